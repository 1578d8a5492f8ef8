"""Lifecycle drills on real DP2 CPU servers (DeepseekV3 tiny, --dp-size 2 --tp-size 2
--enable-dp-attention), plugin vs stock side by side.

Server budget (each start ~1.5 min on 2 cores): one server of its own by default and three of the run's
shared ones as their last user —
stock SIGTERM (``dp2_stock_server``, after the bench-serve gates used it), plugin SIGTERM
(``dp2_serve_server``, launched through ``sglang serve``, after the launch-path test; it first runs the
non-destructive drills: GC freeze in every process, /health_scheduler), plugin SIGKILL of scheduler DP1 (its
own), plugin SIGKILL of the detokenizer (``dspark_dp2_server``, the DSpark DP2 server, after its users).
``DSPARK_LIFECYCLE_FULL_DRILLS=1`` adds stock SIGKILL of DP1 and the plugin's injected exception in
DP1 (the exception path is also covered without a server in test_processes.py). Every drill prints
its summary line (``[drill ...]``): the numbers docs/lifecycle.md reports.

Servers: one of its own and three shared ones (the server budget above). Every drill ends its server
(SIGTERM, SIGKILL of a scheduler or the detokenizer), so each can only be a shared server's last user, and two
drills cannot share a start. The stock SIGTERM drill is the stock server's last user; the plugin drills' settings
(drain window, native exchange, the killed process) and their /dev/shm checks (host-wide, below) keep them
on servers of their own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import pytest

from tests.harness import shared
from tests.harness.server import SGLangServer
from tests.lifecycle import drills as D

# not host_exclusive: a drill's /dev/shm leftovers are the new entries its own server's processes mapped
# (dspark_harden.devtools.shmwatch), so tests of the other pytest-xdist worker may create theirs meanwhile
pytestmark = [pytest.mark.server]

DRAIN_S = shared.DP2_SERVE_DRAIN_S
#: 12 short requests finish inside the drain window; the 4 long ones may not (then: a clear 503).
#: Stock drains without a bound, so its exit time is the time the long ones take.
LENGTHS = [4] * 12 + [96] * 4
DEATH_LENGTHS = [1500] * 16
FULL = os.environ.get("DSPARK_LIFECYCLE_FULL_DRILLS") == "1"


def _report(drill: D.Drill) -> None:
    sys.stderr.write(drill.summary() + "\n")
    for line in drill.warning_lines[:20]:
        sys.stderr.write(f"    {line[:300]}\n")


def _start(plugin: bool, name: str, **env) -> SGLangServer:
    return SGLangServer(D.config(plugin, name, **env), watch_shm=True).start()


def _warm(server: SGLangServer, n: int = 4) -> None:
    for i in range(n):
        server.generate(f"def warm_{i}():", max_new_tokens=8)


def _gauges(text: str, name: str) -> dict:
    out = {}
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[(labels.get("role"), labels.get("dp_rank"))] = float(m.group(2))
    return out


def _sigterm_probes(server: SGLangServer, drill: D.Drill) -> None:
    time.sleep(0.3)
    D.probe(
        server,
        drill,
        "new_request",
        "POST",
        "/generate",
        json={"text": "late", "sampling_params": {"max_new_tokens": 4}},
    )
    D.probe(server, drill, "health_scheduler", "GET", "/health_scheduler")


def test_sigterm_stock(dp2_stock_server):
    """Stock 0.5.23 under the same load: recorded for comparison (its counts are printed). On the run's
    shared stock server (its last user; paused since the bench-serve gates used it): the leftovers it
    reports are the /dev/shm entries new since that server's launch that its processes mapped and no live
    process maps any more."""
    server = shared.resume(dp2_stock_server)
    assert not server.plugin_roles()
    _warm(server)
    drill = D.signal_drill(
        server,
        "stock SIGTERM",
        target="main",
        sig=signal.SIGTERM,
        lengths=LENGTHS,
        wait_for=8,
        probes=_sigterm_probes,
        exit_timeout=600,
    )
    _report(drill)
    assert drill.returncode is not None, "stock server did not exit after SIGTERM"
    # what stock does that the plugin must not (documented in docs/lifecycle.md): new work is still
    # accepted during the drain, and the tree's shared memory stays behind
    late = [p for p in drill.probes if p[0] == "new_request"]
    sys.stderr.write(f"    stock: request sent during the drain answered {late[0][1] if late else None}\n")
    # stock 0.5.23 leaves its scheduler message queue and its load-snapshot segment in /dev/shm after a clean
    # SIGTERM: also the positive control of the leftover check (the plugin drills assert it empty), which must
    # see them among the entries the server's own processes mapped
    for prefix in ("sgl_shm_mq_", "sglang_loads_"):
        assert any(n.startswith(prefix) for n in drill.leftover_shm), (prefix, drill.leftover_shm)
    # recorded, then removed by the drill (24 MiB of the host's /dev/shm per run otherwise, kept by every run)
    assert not [n for n in drill.leftover_shm if os.path.exists(os.path.join("/dev/shm", n))], drill.leftover_shm


@pytest.mark.shared_order(1)  # the shared ``sglang serve`` server's last user: the drill ends it
def test_sigterm_plugin_drains_orders_and_cleans(dp2_serve_server):
    """On the run's shared plugin server launched through ``sglang serve`` with SGLANG_PLUGINS empty (the
    launch-path test ran on it first), with the native DP2 exchange: its segments are part of what the clean
    exit must leave behind (nothing)."""
    server = dp2_serve_server
    assert server.command()[1] == "serve" and "lifecycle-shutdown" in server.log_text()
    enabled = [
        line
        for line in server.metrics_text().splitlines()
        if line.startswith("dspark_harden_dp2_exchange_enabled{") and 'channel="mlp"' in line and line.endswith(" 1.0")
    ]
    assert len(enabled) == 2, enabled  # both DP ranks exchange natively
    # -- non-destructive drills first --------------------------------------------------------
    r = server.get("/health_scheduler", timeout=10)
    assert r.status_code == 200, r.text
    _warm(server, 6)
    deadline = time.monotonic() + 60
    frozen = {}
    while time.monotonic() < deadline:
        frozen = _gauges(server.metrics_text(), "dspark_harden_gc_frozen_objects")
        if all(
            frozen.get(k, 0) > 0
            for k in (("scheduler", "0"), ("scheduler", "1"), ("detokenizer", "none"), ("main", "none"))
        ):
            break
        _warm(server, 2)
        time.sleep(1.0)
    sys.stderr.write(f"    gc frozen objects per process: {frozen}\n")
    for key in (("scheduler", "0"), ("scheduler", "1"), ("detokenizer", "none"), ("main", "none")):
        assert frozen.get(key, 0) > 0, f"{key} did not freeze its heap after warm-up: {frozen}"
    assert "froze" in server.log_text()

    # -- SIGTERM under load --------------------------------------------------------------------
    drill = D.signal_drill(
        server,
        "plugin SIGTERM",
        target="main",
        sig=signal.SIGTERM,
        lengths=LENGTHS,
        wait_for=8,
        probes=_sigterm_probes,
        exit_timeout=120,
    )
    _report(drill)
    assert drill.returncode == 0, drill.log_after[-5000:]
    assert not drill.lost, f"requests lost (no HTTP answer): {drill.lost}"
    short = [r for r in drill.results if r.max_new_tokens == 4]
    assert all(r.status == 200 for r in short), [(r.status, r.body) for r in short]
    for r in drill.errors:  # aborted at the end of the drain window: a clear 503
        assert r.status == 503 and "drain window" in r.body, (r.status, r.body)
    late = dict((p[0], p) for p in drill.probes)
    assert late["new_request"][1] == 503 and "shutting down" in late["new_request"][2], late["new_request"]
    assert late["health_scheduler"][1] == 503 and "shutting_down" in late["health_scheduler"][2]
    assert drill.warning_lines == [], drill.warning_lines
    assert drill.tracebacks == 0, drill.log_after[-5000:]
    assert drill.exit_seconds < DRAIN_S + 20
    assert drill.leftover_shm == [], drill.leftover_shm
    assert drill.leftover_sockets == [], drill.leftover_sockets
    assert drill.leftover_pids == [], drill.leftover_pids
    assert "every child exited 0" in drill.log_after
    assert "DP controller exits 0" in drill.log_after
    assert "detokenizer received shutdown from 2 of 2 DP rank(s)" in drill.log_after
    assert drill.log_after.count("shutdown barrier passed (2 ranks") == 2, drill.log_after[-5000:]


def _death_probes(server: SGLangServer, drill: D.Drill) -> None:
    D.poll_health(server, drill, 30.0)


def _assert_death(drill: D.Drill, *, code: int, who: str, how: str) -> None:
    assert drill.returncode == code, (drill.returncode, drill.log_after[-6000:])
    assert drill.exit_seconds < 30, drill.exit_seconds
    assert not drill.lost, f"requests lost (connection dropped, no answer): {[(r.error) for r in drill.lost]}"
    assert drill.results and all(r.status == 503 for r in drill.results if r.status != 200), [
        (r.status, r.body) for r in drill.results
    ]
    failed = [r for r in drill.results if r.status == 503]
    assert failed, "no in-flight request was answered with the cause"
    for r in failed:
        body = json.loads(r.body)
        text = json.dumps(body)
        assert who in text and how in text, text
    health = [p for p in drill.probes if p[0] == "health" and p[1] == 503 and "child_died" in p[2]]
    assert health and who in health[-1][2], drill.probes[-5:]
    assert f"{who}" in drill.log_after and how in drill.log_after
    assert drill.leftover_shm == [], drill.leftover_shm
    assert drill.leftover_sockets == [], drill.leftover_sockets
    assert drill.leftover_pids == [], drill.leftover_pids


_VICTIMS = {
    "scheduler_DP1": ("sglang::scheduler_DP1", 3, "DP rank 1 scheduler"),
    "detokenizer": ("sglang::detokenizer", 4, "detokenizer"),
}


def _death_drill(server: SGLangServer, victim: str) -> None:
    title, code, who = _VICTIMS[victim]
    _warm(server, 2)
    drill = D.signal_drill(
        server,
        f"plugin SIGKILL {victim}",
        target=title,
        sig=signal.SIGKILL,
        lengths=DEATH_LENGTHS,
        wait_for=12,
        probes=_death_probes,
    )
    _report(drill)
    _assert_death(drill, code=code, who=who, how="was killed by SIGKILL")


@pytest.mark.parametrize("victim", ["scheduler_DP1"])
def test_death_plugin_is_loud_and_complete(victim):
    _death_drill(_start(True, f"lifecycle-kill-{victim}"), victim)


@pytest.mark.shared_order(1)  # the shared DSpark server's last user: the drill ends it
def test_death_of_the_detokenizer_on_the_dspark_server_is_loud_and_complete(dspark_dp2_server):
    """The detokenizer drill on the run's shared DSpark DP2 server (the target deployment's shape: DSpark
    speculative decoding, DP attention, grammar-aware drafting) after its other users: in-flight requests
    answered 503 naming the detokenizer, /health 503 ``child_died``, exit code 4, nothing left behind (its
    /dev/shm mappings are watched from its start, tests/harness/shared.py)."""
    _death_drill(dspark_dp2_server, "detokenizer")


@pytest.mark.skipif(not FULL, reason="DSPARK_LIFECYCLE_FULL_DRILLS=1: extra server starts for the report")
def test_death_plugin_exception_in_dp1():
    server = _start(True, "lifecycle-exc-dp1", DSPARK_TESTFAULT_SCHEDULER_DP_RANK="1")
    _warm(server, 2)
    load = D.Load(server, DEATH_LENGTHS).start()
    D.wait_in_flight(server, 12)
    log_offset = len(server.log_text())
    drill = D.Drill("plugin exception in DP1")
    t_event = time.monotonic()
    # the marked request reaches DP1 (routed) and raises inside its event loop
    fault = D.Load(server, [4], rid_prefix="dspark-testfault-")
    fault.results[0].index = 0

    def routed(r):
        import requests

        try:
            resp = requests.post(
                server.url + "/generate",
                json={
                    "text": "x",
                    "rid": f"dspark-testfault-{time.time_ns()}",
                    "routed_dp_rank": 1,
                    "sampling_params": {"max_new_tokens": 4},
                },
                timeout=60,
            )
            r.status, r.body = resp.status_code, resp.text
        except requests.RequestException as exc:
            r.error = str(exc)

    import threading

    th = threading.Thread(target=routed, args=(fault.results[0],), daemon=True)
    th.start()
    _death_probes(server, drill)
    D.finish(drill, server, log_offset=log_offset, t_event=t_event, load=load)
    th.join(10)
    drill.results.append(fault.results[0])
    _report(drill)
    _assert_death(drill, code=3, who="DP rank 1 scheduler", how="RuntimeError: dspark-testsupport injected fault")


@pytest.mark.skipif(not FULL, reason="DSPARK_LIFECYCLE_FULL_DRILLS=1: extra server starts for the report")
def test_death_stock_sigkill_dp1_recorded():
    server = _start(False, "lifecycle-stock-kill")
    _warm(server, 2)
    drill = D.signal_drill(
        server,
        "stock SIGKILL scheduler_DP1",
        target="sglang::scheduler_DP1",
        sig=signal.SIGKILL,
        lengths=DEATH_LENGTHS,
        wait_for=12,
        probes=_death_probes,
    )
    _report(drill)
    assert drill.returncode is not None
