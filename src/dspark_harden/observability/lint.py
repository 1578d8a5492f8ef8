"""``dspark-harden metrics-lint``: check a live ``/metrics`` scrape and the shipped dashboards.

Problems (exit status 1):

* a ``dspark_harden_*`` family breaking the conventions of :func:`dspark_harden.core.metrics.convention_problems`
  (prefix, no colons, ``_total`` on counters only, base units, label names), or exported but not
  declared by any feature's ``dspark_metrics`` hook, or exported with another type / other labels than declared;
* label cardinality: more distinct values of one label than ``--max-label-values``, more series in
  one family than ``--max-series``, or label values that look unbounded (hashes, UUIDs, long ids);
* a dashboard query referencing an undeclared family, or returning no data: evaluated against
  Prometheus when ``--prometheus URL`` is given, otherwise "no data" means a referenced metric is
  absent from the scrape. A panel whose metrics all belong to features the server reports as not
  bound (``dspark_harden_feature_bound``) is only a note ("expected: feature off"); ``--strict``
  makes notes problems;
* ``promtool check metrics`` output for the scrape, when promtool is installed (``--promtool``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

from ..core import metrics
from . import dashboard as D

PROBLEM = "problem"
NOTE = "note"

_UNBOUNDED_VALUE = (
    re.compile(r"^[0-9a-fA-F]{16,}$"),  # hashes
    re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"),  # uuid
    re.compile(r"^\d{9,}$"),  # long numeric ids / timestamps
)


@dataclass
class Finding:
    level: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.where}: {self.message}"


@dataclass
class ScrapedFamily:
    name: str  # as exposed (counters with _total)
    kind: str
    help: str
    samples: list = field(default_factory=list)  # (sample name, labels dict, value)

    @property
    def label_names(self) -> tuple:
        names: list = []
        for _, labels, _ in self.samples:
            for key in labels:
                if key not in ("le", "quantile") and key not in names:
                    names.append(key)
        return tuple(names)


def parse_scrape(text: str) -> dict:
    """Text exposition -> {exposed family name: ScrapedFamily} (real prometheus_client parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" and not fam.name.endswith("_total") else fam.name
        sf = ScrapedFamily(name=name, kind=fam.type, help=fam.documentation or "")
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            sf.samples.append((s.name, dict(s.labels), s.value))
        out[name] = sf
    return out


def sample_names(scraped: dict) -> set:
    return {s[0] for fam in scraped.values() for s in fam.samples}


def bound_features(scraped: dict) -> Optional[dict]:
    """feature -> True when any process reports it bound; None when the scrape has no bound gauges."""
    fam = scraped.get("dspark_harden_feature_bound")
    if fam is None:
        return None
    out: dict = {}
    for _, labels, value in fam.samples:
        name = labels.get("feature")
        if name:
            out[name] = out.get(name, False) or value >= 1
    return out


def lint_scrape(
    scraped: dict,
    *,
    own_only: bool = True,
    max_label_values: int = 64,
    max_series: int = 512,
) -> list:
    out: list = []
    for name, fam in sorted(scraped.items()):
        own = name.startswith(metrics.PREFIX)
        if own_only and not own:
            continue
        where = name
        labels = fam.label_names
        for msg in metrics.convention_problems(
            name, fam.kind if fam.kind in metrics.KINDS else fam.kind, labels, own=own
        ):
            out.append(Finding(PROBLEM, where, msg.split(": ", 1)[-1]))
        if not fam.help.strip():
            out.append(Finding(PROBLEM, where, "no HELP text"))
        if own:
            declared = metrics.FAMILIES.get(name)
            if declared is None:
                out.append(Finding(PROBLEM, where, "exported but not declared by any feature (dspark_metrics hook)"))
            else:
                if declared.kind != fam.kind:
                    out.append(Finding(PROBLEM, where, f"exported as {fam.kind}, declared as {declared.kind}"))
                extra = set(labels) - set(declared.labels)
                if extra:
                    out.append(Finding(PROBLEM, where, f"labels {sorted(extra)} are not declared ({declared.labels})"))
        series = {tuple(sorted((k, v) for k, v in lbl.items() if k != "le")) for _, lbl, _ in fam.samples}
        if len(series) > max_series:
            out.append(Finding(PROBLEM, where, f"{len(series)} series (limit {max_series}): unbounded labels?"))
        for label in labels:
            values = {lbl[label] for _, lbl, _ in fam.samples if label in lbl}
            if len(values) > max_label_values:
                out.append(
                    Finding(PROBLEM, where, f"label {label!r} has {len(values)} values (limit {max_label_values})")
                )
            odd = sorted(v for v in values if len(v) > 64 or any(p.match(v) for p in _UNBOUNDED_VALUE))
            if odd:
                out.append(Finding(PROBLEM, where, f"label {label!r} has unbounded-looking values, e.g. {odd[0]!r}"))
    return out


def declared_missing(scraped: dict) -> list:
    """Notes: declared families absent from the scrape (their feature may be off in this server)."""
    present = set(scraped)
    bound = bound_features(scraped) or {}
    out = []
    for fam in metrics.FAMILIES.values():
        if fam.name in present:
            continue
        state = "core" if fam.feature == "core" else ("bound" if bound.get(fam.feature) else "not bound")
        out.append(Finding(NOTE, fam.name, f"declared but not exported (feature {fam.feature}: {state})"))
    return out


def prometheus_query(base: str, expr: str, timeout: float = 10.0) -> list:
    """Instant query against a Prometheus server; returns the result vector (raises on errors)."""
    url = base.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - operator-given URL
        body = json.loads(resp.read().decode())
    if body.get("status") != "success":
        raise RuntimeError(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def lint_dashboard(
    dash: dict,
    scraped: Optional[dict],
    *,
    source: str,
    prometheus: Optional[str] = None,
    window: str = "5m",
) -> list:
    out: list = []
    present = sample_names(scraped) if scraped is not None else set()
    bound = bound_features(scraped) if scraped is not None else None
    for title, ref, raw, expr in D.panel_queries(dash, window=window):
        where = f"{source}: panel {title!r} {ref}"
        names = D.referenced_metrics(raw)
        undeclared = sorted(n for n in names if n.startswith(metrics.PREFIX) and D.family_of(n) is None)
        for n in undeclared:
            out.append(Finding(PROBLEM, where, f"references {n}, which is not a declared family"))
        fams = {D.family_of(n) for n in names} - {None}
        off = sorted(
            {
                metrics.FAMILIES[f].feature
                for f in fams
                if metrics.FAMILIES[f].feature != "core"
                and bound is not None
                and not bound.get(metrics.FAMILIES[f].feature)
            }
        )
        all_off = bool(fams) and all(
            metrics.FAMILIES[f].feature != "core" and bound is not None and not bound.get(metrics.FAMILIES[f].feature)
            for f in fams
        )
        if prometheus:
            try:
                result = prometheus_query(prometheus, expr)
            except Exception as exc:  # noqa: BLE001 - report, do not crash the lint
                out.append(Finding(PROBLEM, where, f"query failed: {exc}: {expr}"))
                continue
            if result:
                continue
            missing_msg = "returns no series"
        else:
            absent = sorted(n for n in names if n not in present)
            if not absent:
                continue
            missing_msg = f"references metrics absent from the scrape: {', '.join(absent)}"
        if all_off:
            out.append(
                Finding(NOTE, where, f"{missing_msg} (expected: feature {', '.join(off)} not bound on this server)")
            )
        else:
            out.append(Finding(PROBLEM, where, f"{missing_msg}: {expr}"))
    return out


def own_subset(text: str) -> str:
    """The ``dspark_harden_*`` families of an exposition (HELP/TYPE lines and samples)."""
    keep = []
    for line in text.splitlines():
        body = line[2:].split(" ", 2)[1] if line.startswith(("# HELP ", "# TYPE ")) else line
        if body.startswith(metrics.PREFIX):
            keep.append(line)
    return "\n".join(keep) + "\n"


_PROMTOOL_FINDING = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)$")


def promtool_check(text: str, promtool: Optional[str] = None, *, own_only: bool = True) -> Optional[list]:
    """``promtool check metrics`` on ``text``; None when promtool is not installed.

    promtool lints every family; SGLang's own ``sglang:*`` names break its rules by design (colons,
    ``_histogram`` / ``_gb`` names), so with ``own_only`` findings about other families are notes.
    Anything promtool cannot attribute to a family (a parse error) is a problem.
    """
    exe = promtool or shutil.which("promtool")
    if not exe:
        return None
    proc = subprocess.run([exe, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).decode(errors="replace").splitlines() if ln.strip()]
    out = []
    for ln in lines:
        m = _PROMTOOL_FINDING.match(ln)
        own = m is not None and m.group(1).startswith(metrics.PREFIX)
        if m is not None and not own and own_only and not ln.startswith("error"):
            out.append(Finding(NOTE, f"promtool check metrics: {m.group(1)}", m.group(2)))
        else:
            out.append(Finding(PROBLEM, "promtool check metrics", ln))
    if proc.returncode != 0 and not lines:
        out.append(Finding(PROBLEM, "promtool check metrics", f"exit status {proc.returncode}"))
    return out


def metrics_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def scrape(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(metrics_url(url), timeout=timeout) as resp:  # noqa: S310
        return resp.read().decode()


@dataclass
class LintResult:
    url: str
    findings: list
    families: int
    dashboards: list

    @property
    def problems(self) -> list:
        return [f for f in self.findings if f.level == PROBLEM]

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "ok": not self.problems,
            "families": self.families,
            "dashboards": self.dashboards,
            "problems": [asdict(f) for f in self.problems],
            "notes": [asdict(f) for f in self.findings if f.level == NOTE],
        }


def run(
    url: str,
    *,
    dashboards: Iterable = (),
    use_builtin_dashboard: bool = True,
    prometheus: Optional[str] = None,
    window: str = "5m",
    own_only: bool = True,
    max_label_values: int = 64,
    max_series: int = 512,
    promtool: str = "auto",
    strict: bool = False,
    text: Optional[str] = None,
) -> LintResult:
    if text is None:
        text = scrape(url)
    scraped = parse_scrape(text)
    findings = lint_scrape(scraped, own_only=own_only, max_label_values=max_label_values, max_series=max_series)
    findings += declared_missing(scraped)
    if promtool != "off":
        res = promtool_check(text, own_only=own_only)
        if res is None:
            if promtool == "require":
                findings.append(Finding(PROBLEM, "promtool", "promtool not installed (apt-get install prometheus)"))
        else:
            findings += res
    sources = []
    if use_builtin_dashboard:
        sources.append(("built-in overview dashboard", D.build()))
    for path in dashboards:
        with open(path, encoding="utf-8") as fh:
            sources.append((str(path), json.load(fh)))
    for source, dash in sources:
        findings += lint_dashboard(dash, scraped, source=source, prometheus=prometheus, window=window)
    if strict:
        for f in findings:
            f.level = PROBLEM
    return LintResult(
        url=metrics_url(url),
        findings=findings,
        families=sum(1 for n in scraped if n.startswith(metrics.PREFIX)),
        dashboards=[s for s, _ in sources],
    )
