"""``dspark-harden metrics-lint`` on real exposition text: clean on what the plugin exports, and each
convention problem it must report is reported (names, units, _total, colons, cardinality,
undeclared families, dashboard queries without data), through a real HTTP server and the CLI."""

from __future__ import annotations

import http.server
import json
import shutil
import threading

import pytest

from dspark_harden.cli import main as cli_main
from dspark_harden.core import metrics
from dspark_harden.observability import dashboard as D
from dspark_harden.observability import lint

from ..plugin._proc import run_py

_EXPORT = """
import os
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from dspark_harden.core import metrics
from dspark_harden.observability import feature as obs
from dspark_harden.core.binder import BindReport, FeatureStatus
report = BindReport(role="scheduler", sglang_version="0.5.23", features=[
    FeatureStatus(name="observability", area="platform", status="bound"),
    FeatureStatus(name="scheduler-phase-metrics", area="scheduler", status="bound"),
    FeatureStatus(name="grammar-fsm-advance", area="dspark-masks", status="upstream"),
])
for dp in ("0", "1"):
    obs.publish("scheduler", report, dp)
metrics.child("dspark_harden_scheduler_phase_calls_total", "0", "run_batch").inc(3)
reg = CollectorRegistry(); multiprocess.MultiProcessCollector(reg)
emit({"text": generate_latest(reg).decode()})
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> str:
    """What the plugin exports in SGLang's multiprocess mode (a real scheduler-role publish)."""
    d = tmp_path_factory.mktemp("mp")
    rc, res, out = run_py(_EXPORT, env={"PROMETHEUS_MULTIPROC_DIR": str(d)})
    assert rc == 0 and res, out
    return res["text"]


def _problems(findings):
    return [str(f) for f in findings if f.level == lint.PROBLEM]


def test_plugin_export_is_clean(exported):
    scraped = lint.parse_scrape(exported)
    assert "dspark_harden_feature_bound" in scraped and "dspark_harden_scheduler_phase_calls_total" in scraped
    assert _problems(lint.lint_scrape(scraped)) == []
    assert lint.bound_features(scraped) == {
        "observability": True,
        "scheduler-phase-metrics": True,
        "grammar-fsm-advance": False,
    }


def test_promtool_accepts_the_plugin_export(exported):
    if not shutil.which("promtool"):
        pytest.fail("promtool is missing: run `make install` (Debian package prometheus)")
    assert lint.promtool_check(exported) == []


def test_promtool_findings_are_classified():
    if not shutil.which("promtool"):
        pytest.fail("promtool is missing: run `make install` (Debian package prometheus)")
    findings = lint.promtool_check(BAD)
    problems = [f for f in findings if f.level == lint.PROBLEM]
    notes = [f for f in findings if f.level == lint.NOTE]
    assert any("dspark_harden_latency_ms" in f.message for f in problems), findings
    assert notes and all("sglang:" in f.where for f in notes)
    assert all(f.level == lint.PROBLEM for f in lint.promtool_check(BAD, own_only=False))
    broken = lint.promtool_check("dspark_harden_x{ 1\n")
    assert broken and all(f.level == lint.PROBLEM for f in broken), broken
    assert "dspark_harden_latency_ms" in lint.own_subset(BAD) and "sglang:" not in lint.own_subset(BAD)


BAD = """\
# HELP dspark_harden_latency_ms Latency.
# TYPE dspark_harden_latency_ms gauge
dspark_harden_latency_ms 1.0
# HELP dspark_harden_requests Requests.
# TYPE dspark_harden_requests counter
dspark_harden_requests_total 1.0
# HELP dspark_harden_queue_total Queue.
# TYPE dspark_harden_queue_total gauge
dspark_harden_queue_total 1.0
# HELP dspark_harden_scheduler_phase_calls_total Calls.
# TYPE dspark_harden_scheduler_phase_calls_total counter
dspark_harden_scheduler_phase_calls_total{dp_rank="0",phase="idle",schema="0123456789abcdef0123"} 1.0
# HELP sglang:num_requests_total Requests.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total 4.0
"""


def test_each_convention_problem_is_reported():
    scraped = lint.parse_scrape(BAD)
    probs = "\n".join(_problems(lint.lint_scrape(scraped)))
    assert "dspark_harden_latency_ms: unit 'ms' is not a base unit" in probs
    assert "dspark_harden_latency_ms: exported but not declared" in probs
    assert "dspark_harden_queue_total: only counters end with _total" in probs
    assert "labels ['schema'] are not declared" in probs
    assert "unbounded-looking values" in probs
    assert "sglang:" not in probs  # SGLang's own families are out of scope by default
    probs_all = "\n".join(_problems(lint.lint_scrape(scraped, own_only=False)))
    assert "sglang:num_requests_total: must not contain ':'" in probs_all


def test_cardinality_limits():
    lines = ["# HELP dspark_harden_grammar_lookups_total x", "# TYPE dspark_harden_grammar_lookups_total counter"]
    lines += [f'dspark_harden_grammar_lookups_total{{dp_rank="{i}",source="memory"}} 1' for i in range(70)]
    probs = "\n".join(_problems(lint.lint_scrape(lint.parse_scrape("\n".join(lines) + "\n"), max_series=50)))
    assert "label 'dp_rank' has 70 values (limit 64)" in probs
    assert "70 series (limit 50)" in probs


def test_dashboard_queries_without_data(exported):
    scraped = lint.parse_scrape(exported)
    dash = {
        "panels": [
            {"title": "ok", "targets": [{"refId": "A", "expr": "rate(dspark_harden_scheduler_phase_calls_total[5m])"}]},
            {"title": "undeclared", "targets": [{"refId": "A", "expr": "dspark_harden_nope"}]},
            {"title": "absent", "targets": [{"refId": "A", "expr": "dspark_harden_route_rejections_total"}]},
        ]
    }
    findings = lint.lint_dashboard(dash, scraped, source="t")
    text = "\n".join(str(f) for f in findings)
    assert "panel 'ok'" not in text
    assert "problem: t: panel 'undeclared' A: references dspark_harden_nope, which is not a declared family" in text
    fam = metrics.FAMILIES.get("dspark_harden_route_rejections_total")
    if fam is not None:  # feature not reported bound in this scrape -> note, not problem
        assert any(f.level == lint.NOTE and "'absent'" in f.where for f in findings), text


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 - http.server API
        if self.path != "/metrics":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(text: str) -> str:
        handler = type("H", (_Handler,), {"body": text.encode()})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_cli_over_http_clean_and_dirty(serve, exported, capsys, tmp_path):
    url = serve(exported)
    dash = tmp_path / "d.json"
    dash.write_text(
        json.dumps(
            {
                "panels": [
                    {
                        "title": "p",
                        "targets": [
                            {
                                "refId": "A",
                                "expr": 'sum(rate(dspark_harden_scheduler_phase_seconds_total{dp_rank=~"$dp_rank"}[$__rate_interval]))',
                            }
                        ],
                    }
                ]
            }
        )
    )
    rc = cli_main(["metrics-lint", "--url", url, "--no-builtin-dashboard", "--dashboard", str(dash), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert out["ok"] and out["url"] == url + "/metrics" and out["families"] >= 4
    url_bad = serve(BAD)
    rc = cli_main(["metrics-lint", "--url", url_bad + "/metrics", "--no-builtin-dashboard", "--promtool", "off"])
    text = capsys.readouterr().out
    assert rc == 1 and "unit 'ms' is not a base unit" in text


def test_metrics_summary_cli_over_http(serve, exported, capsys):
    """`dspark-harden metrics-summary` over real HTTP: the bound features with their key figure,
    the upstream ones listed; an unreachable server is a usage error."""
    rc = cli_main(["metrics-summary", "--url", serve(exported)])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0, lines
    assert lines[0] == "observability [bound in: scheduler]"
    assert "published by processes: scheduler" in lines[1]
    i = lines.index("scheduler-phase-metrics [bound in: scheduler]")
    assert "rank 0: run_batch 3 calls" in lines[i + 1] and "rank 1: run_batch 0 calls" in lines[i + 1]
    assert "upstream: grammar-fsm-advance" in lines
    assert cli_main(["metrics-summary", "--url", "http://127.0.0.1:9"]) == 2
    assert "cannot scrape" in capsys.readouterr().err


def test_cli_reports_unreachable_server(capsys):
    rc = cli_main(["metrics-lint", "--url", "http://127.0.0.1:9", "--promtool", "off"])
    assert rc == 2 and "cannot scrape http://127.0.0.1:9/metrics" in capsys.readouterr().err


def test_builtin_dashboard_against_a_scrape_reports_only_inactive_features_as_notes(exported):
    result = lint.run("http://unused", text=exported, promtool="off")
    # the export has only platform + scheduler phase families: every other panel belongs to a
    # feature the scrape does not report bound -> notes, never problems
    assert result.problems == [], [str(f) for f in result.problems]
    assert any(f.level == lint.NOTE for f in result.findings)
    strict = lint.run("http://unused", text=exported, promtool="off", strict=True)
    assert strict.problems or len(D.panel_queries(D.build())) == 0


def test_metrics_url_normalisation():
    assert lint.metrics_url("127.0.0.1:30000") == "http://127.0.0.1:30000/metrics"
    assert lint.metrics_url("http://h:1/") == "http://h:1/metrics"
    assert lint.metrics_url("http://h:1/metrics") == "http://h:1/metrics"
