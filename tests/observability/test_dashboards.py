"""The shipped dashboard and Prometheus config: structurally valid, generated from the declared
families (so every family — every fast path — has a panel), and every metric a dashboard queries
is a declared family. That the queries return data from a real Prometheus scraping a real server
is tested in test_e2e_observability.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dspark_harden.core import metrics
from dspark_harden.observability import dashboard as D

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DASHBOARDS = sorted((EXAMPLES / "grafana").glob("*.json"))
PANEL_TYPES = {"row", "timeseries", "stat", "table", "text", "gauge", "bargauge", "heatmap"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_examples_ship_the_overview_dashboard():
    assert EXAMPLES / "grafana" / "dspark-harden-overview.json" in DASHBOARDS


def test_committed_overview_is_the_generated_one():
    committed = (EXAMPLES / "grafana" / "dspark-harden-overview.json").read_text()
    assert committed == D.render(), (
        "examples/grafana/dspark-harden-overview.json is stale: regenerate it with "
        "`dspark-harden dashboard --out examples/grafana/dspark-harden-overview.json`"
    )


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_structurally_valid(path):
    dash = _load(path)
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "time"):
        assert key in dash, f"{path.name}: missing {key}"
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    dp = variables["dp_rank"]
    assert dp["type"] == "query" and dp["includeAll"] and dp["multi"] and dp["allValue"] == ".*"
    assert dp["datasource"]["uid"] == "${datasource}"
    assert "dp_rank" in dp["query"]["query"]

    ids, boxes = set(), []
    for panel in D.iter_panels(dash):
        assert panel["type"] in PANEL_TYPES, panel["type"]
        assert panel["id"] not in ids, f"duplicate panel id {panel['id']}"
        ids.add(panel["id"])
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0 and g["y"] >= 0, (panel["title"], g)
        for other in boxes:
            overlap = not (
                g["x"] + g["w"] <= other["x"]
                or other["x"] + other["w"] <= g["x"]
                or g["y"] + g["h"] <= other["y"]
                or other["y"] + other["h"] <= g["y"]
            )
            assert not overlap, f"panel {panel['title']!r} overlaps another at {g}"
        boxes.append(g)
        if panel["type"] in ("row", "text"):
            assert not panel.get("targets")
            continue
        assert panel["title"].strip() and panel.get("description", "").strip(), panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            expr = t["expr"]
            assert expr.strip()
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert expr.count("[") == expr.count("]"), expr
            # queries of per-rank families honour the dp_rank variable
            for name in D.referenced_metrics(expr):
                fam = metrics.FAMILIES.get(D.family_of(name) or "")
                if fam is not None and "dp_rank" in fam.labels:
                    assert "$dp_rank" in expr, f"{panel['title']}: {expr} ignores $dp_rank"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_referenced_metric_is_a_declared_family(path):
    bad = []
    for title, ref, raw, _ in D.panel_queries(_load(path)):
        names = D.referenced_metrics(raw)
        assert names, f"panel {title!r} {ref} references no metric: {raw}"
        bad += [(title, n) for n in names if D.family_of(n) is None]
    assert not bad, f"dashboard queries reference undeclared metrics: {bad}"


def test_every_declared_family_has_a_panel():
    dash = _load(EXAMPLES / "grafana" / "dspark-harden-overview.json")
    used = {D.family_of(n) for _, _, raw, _ in D.panel_queries(dash) for n in D.referenced_metrics(raw)}
    missing = sorted(set(metrics.registry(load_extensions=False)) - used)
    assert not missing, f"families without a dashboard panel: {missing}"


def test_one_row_per_feature_area():
    titles = [
        p["title"] for p in _load(EXAMPLES / "grafana" / "dspark-harden-overview.json")["panels"] if p["type"] == "row"
    ]
    for needle in (
        "Platform",
        "Ingress / routing",
        "DP controller",
        "Health",
        "Grammar cache",
        "DSpark grammar masks",
        "Native DP2 exchange",
        "Scheduler phases",
    ):
        assert any(t.startswith(needle) for t in titles), (needle, titles)


def test_counter_histogram_and_gauge_panels_use_the_right_functions():
    for name, fam in metrics.FAMILIES.items():
        exprs = [t["expr"] for t in D.auto_panel(fam)["targets"]]
        if fam.kind == "counter":
            assert all(f"rate({name}" in e for e in exprs)
        elif fam.kind == "histogram":
            assert all("histogram_quantile(" in e and f"{name}_bucket" in e for e in exprs)
        else:
            assert all("rate(" not in e for e in exprs)


def test_variable_substitution_and_metric_extraction():
    expr = 'sum by (dp_rank) (rate(dspark_harden_scheduler_phase_calls_total{dp_rank=~"$dp_rank"}[$__rate_interval]))'
    assert D.substitute(expr, window="2m") == (
        'sum by (dp_rank) (rate(dspark_harden_scheduler_phase_calls_total{dp_rank=~".*"}[2m]))'
    )
    assert D.referenced_metrics("x(sglang:num_running_reqs) + dspark_harden_a_bucket") == {
        "sglang:num_running_reqs",
        "dspark_harden_a_bucket",
    }
    assert D.family_of("dspark_harden_scheduler_phase_calls_total") == "dspark_harden_scheduler_phase_calls_total"
    assert D.family_of("dspark_harden_scheduler_phase_calls_total_bucket") is None


def test_row_routing_of_feature_areas():
    assert D.row_for("dspark-masks") == "dspark-masks"
    assert D.row_for(None, "grammar-service") == "grammar"
    assert D.row_for("ingress") == "ingress"
    assert D.row_for("dp2-native-exchange") == "dp2"
    assert D.row_for("something-new") == "other"


def _promtool() -> str:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run `make install` (installs the Debian package prometheus)"
    return exe


def test_prometheus_example_config_is_valid():
    proc = subprocess.run(
        [_promtool(), "check", "config", str(EXAMPLES / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_examples_readme_shows_how_to_run_them():
    text = (EXAMPLES / "README.md").read_text()
    for needle in (
        "prometheus --config.file=examples/prometheus/prometheus.yml",
        "dspark-harden-overview.json",
        "metrics-lint",
        "--enable-metrics",
        "SGLANG_PLUGINS=dspark_harden",
    ):
        assert needle in text
    assert re.search(r"apt-get install -y prometheus", text)
