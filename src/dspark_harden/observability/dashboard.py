"""The Grafana overview dashboard, generated from the families the features declare (``dspark_metrics`` hook, :mod:`dspark_harden.core.metrics`).

One row per area (platform, ingress/routing, DP controller, health, grammar cache, DSpark masks,
native DP2, prefill graphs, HiCache, scheduler phases), templated by ``$datasource`` and
``$dp_rank``. Families with hand-written panels (platform, scheduler phases) get those; every other
family gets a generated panel chosen by its type (counter: per-second rate; gauge: current value;
histogram: p50/p99), so every declared family — every fast path — has a panel as soon as it is
declared. Panels, targets, variables and the dashboard are built with Grafana's SDK
(``grafana-foundation-sdk``, builders + its JSON encoder); this module decides which panel each
family gets, the PromQL and the grid positions. ``examples/grafana/dspark-harden-overview.json`` is this output (a test checks they are
identical; regenerate with ``dspark-harden dashboard --out examples/grafana/dspark-harden-overview.json``).

Also here: :func:`panel_queries` (every query of a dashboard JSON, with template variables
substituted for evaluation against Prometheus) and :func:`referenced_metrics`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Optional

from ..core import metrics

UID = "dspark-harden-overview"
TITLE = "dspark-harden overview"
DS = {"type": "prometheus", "uid": "${datasource}"}

# (key, title, what the row proves)
ROWS = (
    (
        "platform",
        "Platform: build and bound features",
        "Which dspark-harden build runs and which hardenings are bound in which process role.",
    ),
    (
        "ingress",
        "Ingress / routing",
        "Routed batches kept together from the tokenizer to one scheduler; rejected routes.",
    ),
    ("controller", "DP controller", "How the DP controller dispatched requests to ranks."),
    ("health", "Health and lifecycle", "/health_scheduler verdicts, shutdown ordering, GC freeze, host-pool teardown."),
    (
        "grammar",
        "Grammar cache",
        "How each grammar was resolved (memory, in-flight join, disk, compile) and how long it took.",
    ),
    ("dspark-masks", "DSpark grammar masks", "Batched native draft-tree traversal steps and their phases."),
    (
        "dp2",
        "Native DP2 exchange",
        "Shared-memory DP2 exchange calls and timing per rank (replaces the gloo all-gather).",
    ),
    ("prefill-graphs", "Prefill CUDA graphs", "Shared DP prefill-graph admissions, buckets and padding."),
    ("hicache", "HiCache", "Transfers in flight per rank, eviction gate and host-pool teardown."),
    ("scheduler", "Scheduler phases", "Where each rank's scheduler loop spends its time."),
)
_ROW_KEYS = [r[0] for r in ROWS]

# substring of a Feature.area / Feature.name / Family.feature -> row key (first match wins)
_ROUTING = (
    ("dspark", "dspark-masks"),
    ("mask", "dspark-masks"),
    ("grammar", "grammar"),
    ("xgrammar", "grammar"),
    ("dp2", "dp2"),
    ("native", "dp2"),
    ("exchange", "dp2"),
    ("mlp-sync", "dp2"),
    ("prefill", "prefill-graphs"),
    ("graph", "prefill-graphs"),
    ("hicache", "hicache"),
    ("health", "health"),
    ("lifecycle", "health"),
    ("shutdown", "health"),
    ("gc", "health"),
    ("controller", "controller"),
    ("dispatch", "controller"),
    ("ingress", "ingress"),
    ("rout", "ingress"),
    ("tokenizer", "ingress"),
    ("scheduler", "scheduler"),
    ("phase", "scheduler"),
    ("platform", "platform"),
    ("core", "platform"),
    ("observability", "platform"),
)


# family-name prefix -> row key, before the feature's routing: families a cross-cutting feature emits
# about one area (the HiCache gauges come with the scheduler-phase recorder)
_NAME_ROWS = (("dspark_harden_hicache_ongoing_", "hicache"),)


def row_of(fam: metrics.Family, areas: dict) -> str:
    """Row key of a family: platform for core, then :data:`_NAME_ROWS`, then :func:`row_for`."""
    if fam.feature == "core":
        return "platform"
    for prefix, key in _NAME_ROWS:
        if fam.name.startswith(prefix):
            return key
    return row_for(areas.get(fam.feature), fam.feature)


def row_for(*names: Optional[str]) -> str:
    """Row key for a family, from its feature's area, then its feature name."""
    for name in names:
        if not name:
            continue
        low = name.lower()
        if low in _ROW_KEYS:
            return low
        for needle, key in _ROUTING:
            if needle in low:
                return key
    return "other"


def feature_areas(*, load_extensions: bool = False) -> dict:
    """Feature name -> area, from the built-in feature modules (and extensions if asked)."""
    from ..core.manager import all_features, make_manager

    pm = make_manager(load_extensions=load_extensions)
    return {f.name: f.area for f in all_features(pm)}


# ---------------------------------------------------------------------------------------------
# panel builders


class _Layout:
    """Places panels left to right in rows of 24 columns (a panel that does not fit starts a new
    line) and numbers them; the SDK builders get explicit grid positions from here."""

    def __init__(self) -> None:
        self.panels: list = []  # (kind, builder): kind "row" or "panel"
        self.next_id = 1
        self.y = 0
        self.x = 0
        self.row_h = 0

    def _id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i

    def row(self, title: str) -> None:
        self.newline()
        self.panels.append(
            (
                "row",
                _sdk()
                .db.Row(title)
                .id(self._id())
                .collapsed(False)
                .grid_pos(_sdk().dm.GridPos(h=1, w=24, x=0, y=self.y)),
            )
        )
        self.y += 1

    def newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x, self.row_h = 0, 0

    def add(self, panel: Any, w: int = 12, h: int = 8) -> Any:
        if self.x + w > 24:
            self.newline()
        panel.id(self._id()).grid_pos(_sdk().dm.GridPos(h=h, w=w, x=self.x, y=self.y))
        self.x += w
        self.row_h = max(self.row_h, h)
        self.panels.append(("panel", panel))
        return panel


class _SDK:
    """grafana-foundation-sdk's builders and models, imported on first use (only the dashboard
    generator needs them; the plugin itself never does)."""

    def __init__(self) -> None:
        from grafana_foundation_sdk.builders import common as cb
        from grafana_foundation_sdk.builders import dashboard as db
        from grafana_foundation_sdk.builders import prometheus, stat, table, text, timeseries
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models import common as cm
        from grafana_foundation_sdk.models import dashboard as dm
        from grafana_foundation_sdk.models import prometheus as pm
        from grafana_foundation_sdk.models import text as tm

        self.cb, self.db, self.prometheus, self.stat, self.table, self.text, self.timeseries = (
            cb,
            db,
            prometheus,
            stat,
            table,
            text,
            timeseries,
        )
        self.cm, self.dm, self.pm, self.tm, self.JSONEncoder = cm, dm, pm, tm, JSONEncoder
        self.ds = dm.DataSourceRef(type_val=DS["type"], uid=DS["uid"])


_SDK_CACHE: list = []


def _sdk() -> _SDK:
    if not _SDK_CACHE:
        _SDK_CACHE.append(_SDK())
    return _SDK_CACHE[0]


def to_dict(obj: Any) -> dict:
    """The Grafana JSON of an SDK model or builder (what the SDK's own encoder writes)."""
    if hasattr(obj, "build") and callable(obj.build):
        obj = obj.build()
    return json.loads(json.dumps(obj, cls=_sdk().JSONEncoder))


def _target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> Any:
    g = _sdk()
    q = g.prometheus.Dataquery().expr(expr).ref_id(ref).datasource(g.ds)
    if instant:
        return q.instant().format(g.pm.PromQueryFormat.TABLE)
    return q.range().legend_format(legend or "__auto")


def _timeseries(title: str, desc: str, targets: list, unit: str, stack: bool = False) -> Any:
    g = _sdk()
    cm, cb = g.cm, g.cb
    panel = (
        g.timeseries.Panel()
        .title(title)
        .description(desc)
        .datasource(g.ds)
        .unit(unit)
        .draw_style(cm.GraphDrawStyle.LINE)
        .line_width(1)
        .fill_opacity(10 if stack else 0)
        .stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL if stack else cm.StackingMode.NONE).group("A"))
        .show_points(cm.VisibilityMode.NEVER)
        .span_nulls(False)
        .legend(
            cb.VizLegendOptions()
            .display_mode(cm.LegendDisplayMode.TABLE)
            .placement(cm.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["mean", "max"])
        )
        .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    )
    for t in targets:
        panel.with_target(t)
    return panel


def _table(title: str, desc: str, targets: list) -> Any:
    g = _sdk()
    panel = (
        g.table.Panel()
        .title(title)
        .description(desc)
        .datasource(g.ds)
        .unit("short")
        .show_header(True)
        .cell_height(g.cm.TableCellHeight.SM)
        .with_transformation(g.dm.DataTransformerConfig(id_val="organize", options={"excludeByName": {"Time": True}}))
    )
    for t in targets:
        panel.with_target(t)
    return panel


def _stat(title: str, desc: str, targets: list, unit: str = "short") -> Any:
    g = _sdk()
    panel = (
        g.stat.Panel()
        .title(title)
        .description(desc)
        .datasource(g.ds)
        .unit(unit)
        .reduce_options(g.cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
        .color_mode(g.cm.BigValueColorMode.VALUE)
        .graph_mode(g.cm.BigValueGraphMode.NONE)
        .text_mode(g.cm.BigValueTextMode.AUTO)
    )
    for t in targets:
        panel.with_target(t)
    return panel


def _text(title: str, content: str) -> Any:
    g = _sdk()
    return g.text.Panel().title(title).content(content).mode(g.tm.TextMode.MARKDOWN)


def _selector(fam: metrics.Family) -> str:
    return '{dp_rank=~"$dp_rank"}' if "dp_rank" in fam.labels else ""


def _legend(labels: Iterable[str]) -> str:
    parts = []
    for label in labels:
        parts.append(f"rank {{{{{label}}}}}" if label == "dp_rank" else f"{{{{{label}}}}}")
    return " ".join(parts) or "__auto"


def _by(labels: Iterable[str]) -> str:
    labels = list(labels)
    return f" by ({', '.join(labels)})" if labels else ""


def _rate_unit(name: str) -> str:
    if "_seconds" in name:
        return "percentunit"
    if "_bytes" in name:
        return "Bps"
    return "ops"


def _gauge_unit(name: str) -> str:
    if name.endswith("_seconds"):
        return "s"
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith("_ratio"):
        return "percentunit"
    return "short"


def _gauge_agg(fam: metrics.Family) -> str:
    return {"sum": "sum", "livesum": "sum", "min": "min", "livemin": "min"}.get(fam.multiprocess_mode, "max")


def auto_panel(fam: metrics.Family) -> dict:
    """A generated panel for ``fam`` chosen by its type (its Grafana JSON)."""
    return to_dict(_auto_panel(fam))


def _auto_panel(fam: metrics.Family) -> Any:
    sel, by, legend = _selector(fam), _by(fam.labels), _legend(fam.labels)
    agg = f"Across ranks: {fam.aggregation}." if fam.aggregation else ""
    desc = f"{fam.doc} `{fam.name}` ({fam.kind}). {agg}".strip()
    if fam.kind == "counter":
        unit = _rate_unit(fam.name)
        title = _title(fam.name[len(metrics.PREFIX) : -len("_total")]) + (" (s/s)" if unit == "percentunit" else " /s")
        return _timeseries(title, desc, [_target(f"sum{by} (rate({fam.name}{sel}[$__rate_interval]))", legend)], unit)
    if fam.kind == "gauge":
        title = _title(fam.name[len(metrics.PREFIX) :])
        return _timeseries(
            title, desc, [_target(f"{_gauge_agg(fam)}{by} ({fam.name}{sel})", legend)], _gauge_unit(fam.name)
        )
    by_le = _by(("le",) + tuple(fam.labels))
    unit = "s" if fam.name.endswith("_seconds") else ("bytes" if fam.name.endswith("_bytes") else "short")
    title = _title(fam.name[len(metrics.PREFIX) :]) + " p50 / p99"
    targets = [
        _target(
            f"histogram_quantile({q}, sum{by_le} (rate({fam.name}_bucket{sel}[$__rate_interval])))",
            f"p{int(q * 100)} {legend}".replace(" __auto", ""),
            ref,
        )
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ]
    return _timeseries(title, desc, targets, unit)


def _title(stem: str) -> str:
    return stem.replace("_", " ").capitalize()


def _platform_panels(lay: _Layout) -> set:
    lay.add(
        _table(
            "Build",
            "dspark-harden and SGLang versions reported by the running processes (`dspark_harden_build_info`).",
            [_target("max by (version, sglang_version) (dspark_harden_build_info)", instant=True)],
        ),
        w=8,
        h=5,
    )
    lay.add(
        _stat(
            "Features bound",
            "Number of dspark-harden features whose patches are bound in at least one "
            "process role (`dspark_harden_feature_bound == 1`).",
            [_target("count(max by (feature) (dspark_harden_feature_bound) == 1)", instant=True)],
        ),
        w=4,
        h=5,
    )
    lay.add(
        _table(
            "Features by process role",
            "One row per feature and role: value 1 = bound and verified; "
            "status = the self-check status (bound, upstream, disabled, unavailable).",
            [_target("max by (feature, role, status) (dspark_harden_feature_bound)", instant=True)],
        ),
        w=12,
        h=10,
    )
    return {"dspark_harden_build_info", "dspark_harden_feature_bound"}


def _scheduler_panels(lay: _Layout) -> set:
    sec = "dspark_harden_scheduler_phase_seconds_total"
    calls = "dspark_harden_scheduler_phase_calls_total"
    mx = "dspark_harden_scheduler_phase_max_seconds"
    sel = '{dp_rank=~"$dp_rank"}'
    lay.add(
        _timeseries(
            "Scheduler time by phase (fraction of wall time)",
            f"rate(`{sec}`): seconds per second each rank's scheduler loop spends in each phase "
            "(inclusive). Sum over phases ≈ 1 per rank.",
            [_target(f"sum by (dp_rank, phase) (rate({sec}{sel}[$__rate_interval]))", "rank {{dp_rank}} {{phase}}")],
            "percentunit",
            stack=True,
        )
    )
    lay.add(
        _timeseries(
            "Phase calls /s",
            f"rate(`{calls}`) per rank and phase.",
            [_target(f"sum by (dp_rank, phase) (rate({calls}{sel}[$__rate_interval]))", "rank {{dp_rank}} {{phase}}")],
            "ops",
        )
    )
    lay.add(
        _timeseries(
            "Mean seconds per call",
            f"rate(`{sec}`) / rate(`{calls}`) per rank and phase.",
            [
                _target(
                    f"sum by (dp_rank, phase) (rate({sec}{sel}[$__rate_interval])) / "
                    f"sum by (dp_rank, phase) (rate({calls}{sel}[$__rate_interval]))",
                    "rank {{dp_rank}} {{phase}}",
                )
            ],
            "s",
        )
    )
    lay.add(
        _timeseries(
            "Longest call (rolling max)",
            f"`{mx}`: the longest single call per phase in each flush window, max over the interval.",
            [
                _target(
                    f"max by (dp_rank, phase) (max_over_time({mx}{sel}[$__rate_interval]))",
                    "rank {{dp_rank}} {{phase}}",
                )
            ],
            "s",
        )
    )
    lay.add(
        _timeseries(
            "run_batch share across ranks",
            "Each rank's run_batch seconds per second: under DP attention the ranks run in lock step, so a "
            "rank with much less run_batch time than its peer is waiting on it.",
            [
                _target(
                    f'sum by (dp_rank) (rate({sec}{{dp_rank=~"$dp_rank", phase="run_batch"}}[$__rate_interval]))',
                    "rank {{dp_rank}}",
                )
            ],
            "percentunit",
        ),
        w=24,
    )
    return {sec, calls, mx}


_CURATED = {"platform": _platform_panels, "scheduler": _scheduler_panels}


def build(areas: Optional[dict] = None, *, extensions: bool = False) -> dict:
    """The overview dashboard as a JSON-serialisable dict: panels for the built-in features'
    families (the shipped dashboard), plus installed third-party features' with ``extensions``."""
    if areas is None:
        areas = feature_areas(load_extensions=extensions)
    by_row: dict[str, list] = {}
    for fam in metrics.registry(load_extensions=extensions).values():
        key = row_of(fam, areas)
        by_row.setdefault(key, []).append(fam)
    lay = _Layout()
    rows = list(ROWS) + (
        [("other", "Other", "Families of features without a dedicated row.")] if "other" in by_row else []
    )
    for key, title, what in rows:
        lay.row(title)
        fams = by_row.get(key, [])
        covered = _CURATED[key](lay) if key in _CURATED else set()
        rest = [f for f in fams if f.name not in covered]
        for fam in rest:
            lay.add(_auto_panel(fam))
        if not fams and key not in _CURATED:
            lay.add(
                _text(
                    f"{title}: no metrics",
                    f"{what}\n\nNo `dspark_harden_*` family is declared for this area in this build.",
                ),
                w=24,
                h=3,
            )
    lay.newline()
    g = _sdk()
    dm, db = g.dm, g.db
    query = "label_values(dspark_harden_scheduler_phase_calls_total, dp_rank)"
    dash = (
        db.Dashboard(TITLE)
        .uid(UID)
        .description("Per-rank proof of which dspark-harden paths ran (generated by `dspark-harden dashboard`).")
        .tags(["dspark-harden", "sglang"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("")
        .annotation(
            db.AnnotationQuery()
            .name("Annotations & Alerts")
            .enable(True)
            .hide(True)
            .icon_color("rgba(0, 211, 255, 1)")
            .type("dashboard")
            .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
        )
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            db.QueryVariable("dp_rank")
            .label("DP rank")
            .datasource(g.ds)
            .query({"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1})
            .include_all(True)
            .all_value(".*")
            .multi(True)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.NUMERICAL_ASC)
        )
    )
    for kind, panel in lay.panels:
        (dash.with_row if kind == "row" else dash.with_panel)(panel)
    return to_dict(dash)


def render(areas: Optional[dict] = None, *, extensions: bool = False) -> str:
    return json.dumps(build(areas, extensions=extensions), indent=2, sort_keys=False) + "\n"


# ---------------------------------------------------------------------------------------------
# reading dashboards back


def iter_panels(dashboard: dict) -> Iterable[dict]:
    for panel in dashboard.get("panels", []):
        yield panel
        for inner in panel.get("panels", []) or []:  # collapsed rows keep their panels inside
            yield inner


_VARS = {
    "$__rate_interval": "{window}",
    "${__rate_interval}": "{window}",
    "$__interval": "{window}",
    "${__interval}": "{window}",
    "$__range": "{window}",
    "${__range}": "{window}",
}


def substitute(expr: str, *, window: str = "5m", dp_rank: str = ".*") -> str:
    """Replace Grafana template variables so Prometheus can evaluate the query."""
    out = expr
    for var, val in _VARS.items():
        out = out.replace(var, val.format(window=window))
    return out.replace("${dp_rank}", dp_rank).replace("$dp_rank", dp_rank)


def panel_queries(dashboard: dict, *, window: str = "5m") -> list:
    """[(panel title, refId, raw expr, evaluable expr)] for every query target of every panel."""
    out = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []) or []:
            expr = target.get("expr")
            if expr:
                out.append((panel.get("title", ""), target.get("refId", ""), expr, substitute(expr, window=window)))
    return out


_METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:])(dspark_harden_[a-z0-9_]+|sglang:[A-Za-z0-9_:]+)")


def referenced_metrics(expr: str) -> set:
    """Sample names a PromQL expression reads (ours and SGLang's)."""
    return set(_METRIC_RE.findall(expr))


def family_of(sample_name: str) -> Optional[str]:
    """Declared family a sample name belongs to (histogram suffixes stripped), or None."""
    if sample_name in metrics.FAMILIES:
        return sample_name
    for suffix in ("_bucket", "_sum", "_count"):
        if sample_name.endswith(suffix):
            base = sample_name[: -len(suffix)]
            fam = metrics.FAMILIES.get(base)
            if fam is not None and fam.kind == "histogram":
                return base
    return None
