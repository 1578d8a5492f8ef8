"""``bench serve`` and ``bench soak`` against real servers, cheaply: the shared stock DP2 server
(``dp2_stock_server``, which the stock SIGTERM drill ends later) and the shared plugin DP2 server (``dp2_server``: every default feature on; the native DP2 exchange is
exercised by the full bench, which launches its own plugin server), a tiny generated trace, one
round each. The gates must hold (sequential outputs identical token for token, no errors, every
constrained output valid) and the JSON has the shape the issue gives; numbers are not asserted."""

from __future__ import annotations

import pytest

from dspark_harden.devtools.e2e import serve, soak, trace

pytestmark = pytest.mark.server


def test_soak_load_helpers_exact():
    answer = {
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2, "timestamp": 10.0},
            {"dp_rank": 1, "num_running_reqs": 1, "timestamp": 11.0},
        ]
    }
    ranks = soak.rank_loads(answer)
    assert ranks == {"0": (3, 2, 10.0), "1": (1, 0, 11.0)}
    later = {"0": (0, 4, 12.0), "1": (2, 0, 12.0)}
    assert soak.max_active([(0.0, ranks), (1.0, later)]) == {"0": 5, "1": 2}
    empty = {"0": (0, 0, 20.0), "1": (0, 0, 20.0)}
    assert soak.drained(empty, 19.0, 2)
    assert not soak.drained(empty, 20.0, 2)  # snapshots not newer than the last answer
    assert not soak.drained({"0": (0, 0, 20.0)}, 19.0, 2)  # a rank missing
    assert not soak.drained({**empty, "1": (0, 1, 20.0)}, 19.0, 2)  # one waiting request left


@pytest.mark.timeout(1500)
def test_serve_gates_hold_on_a_tiny_trace(dp2_server, dp2_stock_server):
    entries = trace.generate(seed=5, requests=14, rate=20.0, batches=1, burst=3, schemas=4)
    for e in entries:  # keep the test short: small outputs, a batch of 64 still routed as one
        e["body"]["sampling_params"]["max_new_tokens"] = min(e["body"]["sampling_params"]["max_new_tokens"], 64)
    seq = trace.sequential_subset(entries, 6)
    assert not dp2_stock_server.plugin_roles(), dp2_stock_server.log_tail()
    stock = serve.Pausable(dp2_stock_server)
    plugin = serve.Pausable(dp2_server)
    try:
        stock.pause()
        report = serve.compare(stock, plugin, entries, seq, 1, {"rounds": 1}, warmup=False)
    finally:
        plugin.resume()  # the shared servers are left: the plugin one running,
        stock.pause()  # the stock one paused (it spins a core while it runs) until the stock SIGTERM drill
    assert set(report) >= {"rounds", "stock", "plugin", "ratio", "identical_sequential", "identical_concurrent"}
    assert set(report["ratio"]) >= {"output_tok_s", "p50_s", "p95_s", "p99_s"}
    assert set(report["identical_concurrent"]) >= {"stock_vs_stock", "plugin_vs_stock"}
    seq_gate = report["identical_sequential"]
    assert seq_gate["checked"] == 6 and seq_gate["identical"] == seq_gate["checked"], seq_gate
    for name in ("stock", "plugin"):
        assert report[name]["errors"] == 0, report[name]["rounds"]
        assert report[name]["constrained_invalid"] == 0, report[name]["rounds"]
        assert report[name]["output_tok_s"] > 0 and {"scheduler", "main"} <= set(report[name]["cpu_s_by_role"])
    assert report["ok"]


@pytest.mark.timeout(900)
def test_soak_checks_run_against_the_plugin_server(dp2_server):
    s = soak.Soak(minutes=0.4, rate=3.0, seed=2, adversarial=False, poll_s=2.0)
    rep = soak.run_on(dp2_server, s)
    assert rep["well_formed"]["all"]["errors"] == 0, rep["well_formed"]
    assert rep["health_scheduler"]["polls"] >= 5 and rep["health_scheduler"]["non_200"] == 0
    assert rep["metrics_scrapes"]["total"] >= 2 and rep["metrics_scrapes"]["failed"] == 0
    assert {"scheduler", "main", "controller", "detokenizer"} <= set(rep["rss"])
    assert rep["grammar"]["memory_bytes_max"] is not None
    # per-rank active requests seen by /v1/loads, and empty queues on both ranks once every answer came back
    assert rep["active_requests"]["polls"] >= 5 and set(rep["active_requests"]["max_per_rank"]) == {"0", "1"}
    drain = rep["queues_drained"]
    assert drain["ok"] and drain["ranks"] == {r: {"running": 0, "waiting": 0} for r in ("0", "1")}, drain
