"""docs/metrics.md is generated from the built-in declarations (``dspark-harden metrics --markdown``)
and kept current; independently of the generator, every built-in family is documented there and
vice versa (both parsed: the registry and the doc's tables), with the same type and labels."""

from __future__ import annotations

import re
from pathlib import Path

from dspark_harden.cli import metrics_ref
from dspark_harden.core import metrics

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"

_ROW = re.compile(r"^\|\s*`(dspark_harden_[a-z0-9_]+)`\s*\|(.*)\|\s*$")


def parse_doc(text: str) -> dict:
    """{family: (type, labels)} from table rows whose first cell is a backticked family name."""
    out: dict = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if not m:
            continue
        cells = [c.strip() for c in m.group(2).split("|")]
        assert len(cells) >= 4, f"docs/metrics.md row for {m.group(1)} needs Type | Labels | Meaning | Across ranks"
        kind = cells[0].split()[0] if cells[0] else ""
        labels = tuple(re.findall(r"`([a-z_][a-z0-9_]*)`", cells[1]))
        assert m.group(1) not in out, f"{m.group(1)} is documented twice in docs/metrics.md"
        assert cells[2] and cells[3], f"{m.group(1)}: Meaning and Across ranks must not be empty"
        out[m.group(1)] = (kind, labels)
    return out


def test_parser_reads_rows_and_rejects_incomplete_ones():
    doc = parse_doc("| `dspark_harden_x_total` | counter | `dp_rank`, `phase` | m | a |\n| Metric | Type |\n")
    assert doc == {"dspark_harden_x_total": ("counter", ("dp_rank", "phase"))}
    assert parse_doc("| `dspark_harden_y` | gauge (max) | — | m | a |") == {"dspark_harden_y": ("gauge", ())}


BUILTIN = metrics.registry(load_extensions=False)


def test_committed_reference_is_the_generated_one():
    assert DOC.read_text() == metrics_ref.markdown(BUILTIN), (
        "docs/metrics.md is stale: regenerate it with `dspark-harden metrics --markdown > docs/metrics.md`"
    )


def test_every_family_is_documented_and_every_documented_family_exists():
    doc = parse_doc(DOC.read_text())
    declared = set(BUILTIN)
    undocumented = sorted(declared - set(doc))
    unknown = sorted(set(doc) - declared)
    assert not undocumented, f"families missing from docs/metrics.md: {undocumented}"
    assert not unknown, f"docs/metrics.md documents families that are not declared: {unknown}"


def test_documented_type_and_labels_match_the_declaration():
    doc = parse_doc(DOC.read_text())
    wrong = []
    for name, fam in BUILTIN.items():
        if name not in doc:
            continue
        kind, labels = doc[name]
        if kind != fam.kind or set(labels) != set(fam.labels):
            wrong.append(f"{name}: doc says {kind} {labels}, module says {fam.kind} {fam.labels}")
    assert not wrong, "\n".join(wrong)


def test_every_family_says_how_to_aggregate_across_ranks():
    missing = [f.name for f in metrics.FAMILIES.values() if "dp_rank" in f.labels and not f.aggregation.strip()]
    assert not missing, f"families with dp_rank but no aggregation note: {missing}"
