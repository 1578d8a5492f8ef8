"""``dspark-harden port-report``: which patch targets' stock source differs, in an installed or unpacked
SGLang, from the fingerprints recorded for the supported release, with a unified diff of each.

Porting to a new release starts from this list. The diffs need the supported release's source: the
installed SGLang when it is that release (the usual case: run it from the plugin's own environment and
point ``--sglang`` at the unpacked new release), else ``--baseline PATH`` to an unpacked copy of it.
Exit status: 0 when no target changed, 1 when some did, 2 on bad input.
"""

from __future__ import annotations

import json
import sys

from ..core import porting as P
from ..core.patch import SUPPORTED_SGLANG


def register(sub) -> None:
    p = sub.add_parser(
        "port-report",
        help="patch targets whose stock source differs in another SGLang, with diffs",
        description=__doc__,
    )
    p.add_argument(
        "--sglang",
        metavar="PATH",
        help="the SGLang to examine: its package directory or a directory holding it (a site-packages, "
        "an unpacked wheel); default: the installed one",
    )
    p.add_argument(
        "--baseline",
        metavar="PATH",
        help="an SGLang of the supported release to diff against; default: the installed one",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-diff", action="store_true", help="list the targets only")
    p.set_defaults(func=main)


def report(sglang: str | None = None, baseline: str | None = None, pm=None) -> dict:
    """The report as a dict; raises :class:`~dspark_harden.core.porting.PortError` on bad input."""
    tree = P.SglangTree.at(sglang) if sglang else P.SglangTree.installed()
    notes = []
    base = None
    if baseline:
        base = P.SglangTree.at(baseline)
        if not P.in_supported_range(base.version):
            raise P.PortError(
                f"--baseline {baseline}: sglang {base.version} there is not the supported release "
                f"({SUPPORTED_SGLANG}); the diffs need that release's source"
            )
    else:
        try:
            inst = P.SglangTree.installed()
        except P.PortError:
            inst = None
        if inst is not None and P.in_supported_range(inst.version):
            base = inst
        else:
            notes.append(
                f"no sglang {SUPPORTED_SGLANG} source for the diffs (installed: "
                f"{inst.version if inst else 'none'}): pass --baseline PATH to an unpacked copy "
                f"(pip download --no-deps 'sglang{SUPPORTED_SGLANG}'; python -m zipfile -e WHEEL DIR)"
            )
    rows = P.compare(tree, P.fingerprinted_targets(pm), baseline=base)
    changed = [r for r in rows if r.status != P.SAME]
    return {
        "sglang": tree.package,
        "sglang_version": tree.version,
        "supported": SUPPORTED_SGLANG,
        "in_supported_range": P.in_supported_range(tree.version),
        "baseline": base.package if base else None,
        "baseline_version": base.version if base else None,
        "targets": len(rows),
        "changed": len([r for r in changed if r.status == P.CHANGED]),
        "missing": len([r for r in changed if r.status == P.MISSING]),
        "rows": [r.to_dict() for r in changed],
        "notes": notes,
    }


def render(rep: dict, diffs: bool = True) -> str:
    n = rep["changed"] + rep["missing"]
    out = [
        f"port-report: sglang {rep['sglang_version']} at {rep['sglang']} (supported: {rep['supported']}): "
        f"{n} of {rep['targets']} patch targets differ from the recorded fingerprints "
        f"({rep['changed']} changed, {rep['missing']} missing)"
    ]
    if rep["baseline"]:
        out.append(f"diffs against sglang {rep['baseline_version']} at {rep['baseline']}")
    out.extend(f"NOTE: {note}" for note in rep["notes"])
    for r in rep["rows"]:
        found = r["found"] if r["status"] == P.CHANGED else r["detail"]
        out.append(
            f"{r['status'].upper():8} {r['target']}  [{r['feature']}; {r['kind']}] expected {r['expected']}, "
            f"found {found}"
        )
    if diffs:
        for r in rep["rows"]:
            if r["diff"]:
                out += ["", f"==== {r['target']} [{r['feature']}]", r["diff"].rstrip("\n")]
            elif r["diff"] is None and rep["baseline"]:
                out += [
                    "",
                    f"==== {r['target']} [{r['feature']}]: no diff (the baseline's source does not match "
                    f"the recorded fingerprint either)",
                ]
    return "\n".join(out)


def main(args) -> int:
    try:
        rep = report(args.sglang, args.baseline)
    except P.PortError as exc:
        print(f"dspark-harden port-report: {exc}", file=sys.stderr)
        return 2
    if args.no_diff:
        for r in rep["rows"]:
            r["diff"] = None
    print(json.dumps(rep) if args.json else render(rep, diffs=not args.no_diff))
    return 1 if rep["rows"] else 0
