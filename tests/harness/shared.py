"""Servers shared by many tests: started on first use, stopped as soon as no later test needs them.

Each entry of :data:`SHARED_CONFIGS` becomes a pytest fixture of the same name (tests/conftest.py).
Collection puts the tests that use one shared server next to each other (and after the tests that
use none: heaviest last), so each shared configuration starts once per run; a teardown hook stops
it right after the last test of the run that needs it (the DP controller's idle loop burns a core, and the
machine-wide server lock should be released early). A start failure is remembered so later tests
fail at once with the same log instead of waiting for another start.

A shared server must not be requested from ``@pytest.mark.forked`` tests (the fork would own it).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

from dspark_harden.devtools.tiny_models import dspark_draft_dir, ensure_dspark_draft

from .server import DP2_CONFIG, ServerConfig, ServerError, SGLangServer

DSPARK_DP2_CONFIG = ServerConfig(
    arch="qwen3",
    dp_size=2,
    tp_size=2,
    dp_attention=True,
    name="dspark_dp2",
    extra_args=(
        "--speculative-algorithm",
        "DSPARK",
        "--speculative-draft-model-path",
        dspark_draft_dir(),
        "--enable-dp-lm-head",
    ),
    # with the DSpark result materializer (DSpark + overlap scheduling, which stock keeps on for DSpark on
    # CPU): its consumers read every decode step's record on this server (tests/dspark_masks/test_dspark_server.py)
    # and grammar-aware drafting (issue 43: tests/dspark_masks/test_dspark_server.py reads its counters)
    env=(
        ("DSPARK_HARDEN_DSPARK_MASKS", "1"),
        ("DSPARK_HARDEN_DSPARK_RESULTS", "1"),
        ("DSPARK_HARDEN_DSPARK_DRAFT_MASKS", "1"),
    ),
)

#: /health_scheduler staleness of the shared DP2 server: short enough that the SIGSTOP test
#: (tests/ingress/test_e2e_dp2.py) waits little, long enough that a scheduler starved on a loaded 2-core
#: host never reads stale to the soak's health polls (tests/e2e/test_bench_serve.py asserts none)
DP2_SHARED_STALENESS_S = 15.0

# The one plugin DP2 server of the run, shared by every module that only observes it (issue 42: one
# start instead of one per module). Its environment is the union of what those modules need, each
# setting harmless to the others:
# - the opt-in native DP2 exchange (runs on CPU; its panels and counters are proven on this server), no
#   session id: the main process derives one;
# - the third-party test feature (tests/support): its metric family must be exported like a built-in's;
# - an empty grammar disk cache in the server's workdir, with host-wide claims: rank 1's lookup of the
#   observability traffic's schema waits on rank 0's claim until the entry is published. The bounds cover
#   the helper's first start-up on a loaded host: the claim wait, our compile timeout (the wait may use
#   half of it) and stock's poll-count timeout (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS x 5 ms, 50 s by
#   default) are raised to 300 s and more; the disk policy is pinned to serialized entries
#   (DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO=1e9, as the claims tests do): with per-key claims a claimant
#   whose handoff is predicted dearer than its compile gives the claim up (outcome `local`), and on a
#   loaded host that prediction decided whether rank 1 loaded from disk at all (CI of stop 45);
# - stock /health in its liveness-only mode (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0), the
#   configuration in which stock cannot see a stopped scheduler (the ingress tests compare), and a
#   shorter /health_scheduler staleness.
# Module order inside the group (``shared_order`` marks): the observability module first (its counters
# must come from its own traffic, its grammar cache must start empty), the ingress module's shutdown
# test last (it SIGTERMs the server).
DP2_SHARED_CONFIG = DP2_CONFIG.with_env(
    SGLANG_DSPARK_DP2_SHM_MLP_SYNC="1",
    DSPARK_TESTFEATURE="1",
    DSPARK_HARDEN_GRAMMAR_DISK_DIR="{workdir}/grammar-disk",
    DSPARK_HARDEN_GRAMMAR_DISK_CLAIMS="1",
    DSPARK_HARDEN_GRAMMAR_DISK_CLAIM_WAIT="300",
    DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="1e9",
    DSPARK_HARDEN_GRAMMAR_COMPILE_TIMEOUT="900",
    SGLANG_GRAMMAR_MAX_POLL_ITERATIONS="200000",
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="0",
    DSPARK_HARDEN_HEALTH_MAX_STALENESS_S=str(DP2_SHARED_STALENESS_S),
)

#: the stall period and stop limit of the DP2 native server (the stopped-peer drill waits on them)
DP2_NATIVE_PERIOD_MS = 3000
DP2_NATIVE_STOP_MS = 40000

# The plugin DP2 server with the native exchange and nothing else opted in: no session id (its main process
# derives one), a short stall period and stop limit. Its users, in order: the session test runs it beside
# ``dp2_server`` (two servers, neither given an id: different ids, own segments; tests/dp2/test_session.py),
# the end-to-end test serves on it (tests/dp2/test_e2e.py), and the stopped-peer drill ends it
# (tests/dp2/test_e2e_stopped_peer.py, last: rank 1 stopped, exit code 3, no segment left). One start
# instead of four (issue 42). A stall period of 3 s only adds WARNINGs and a stall counter while a rank
# waits on a late peer (the two first users assert no error, not no stall).
DP2_NATIVE_CONFIG = DP2_CONFIG.with_env(
    SGLANG_DSPARK_DP2_SHM_MLP_SYNC="1",
    SGLANG_DSPARK_DP2_SHM_TIMEOUT_MS=str(DP2_NATIVE_PERIOD_MS),
    SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS=str(DP2_NATIVE_STOP_MS),
)
DP2_NATIVE_CONFIG = type(DP2_NATIVE_CONFIG)(**{**DP2_NATIVE_CONFIG.__dict__, "name": "dp2-native"})

# The stock DP2 server of the run (SGLANG_PLUGINS naming no installed plugin), with the lifecycle drills'
# logging configuration (timestamps and levels in its log): the bench-serve gates compare against it
# (tests/e2e/test_bench_serve.py), then the stock SIGTERM drill ends it (tests/lifecycle/test_server_drills.py).
# One start instead of two (issue 42). Stock 0.5.23's DP controller polls without blocking (a core from
# ready to exit), so the server is kept SIGSTOPped between its users (``resume`` below).
DRILL_LOGGING = str(Path(__file__).parents[1] / "lifecycle" / "logging.json")
DP2_STOCK_CONFIG = DP2_CONFIG.with_env(SGLANG_LOGGING_CONFIG_PATH=DRILL_LOGGING)
DP2_STOCK_CONFIG = type(DP2_STOCK_CONFIG)(**{**DP2_STOCK_CONFIG.__dict__, "plugins": None, "name": "dp2-stock"})

#: the drain window of the plugin DP2 server launched through ``sglang serve`` (its SIGTERM drill's)
DP2_SERVE_DRAIN_S = 10

# The plugin DP2 server launched through stock's other launch path, the ``sglang serve`` console script, with
# SGLANG_PLUGINS empty (installed, not named: stock loads every installed plugin), the drills' logging
# configuration, a 10 s drain window and the native DP2 exchange. Users: the launch-path test (every role
# bound, presence lines, answers; tests/integration/test_launch_paths.py), then the plugin SIGTERM drill ends
# it (tests/lifecycle/test_server_drills.py: exit 0 under load, nothing left). One start instead of two.
DP2_SERVE_CONFIG = DP2_CONFIG.with_env(
    SGLANG_LOGGING_CONFIG_PATH=DRILL_LOGGING,
    DSPARK_HARDEN_SHUTDOWN_DRAIN_S=str(DP2_SERVE_DRAIN_S),
    SGLANG_DSPARK_DP2_SHM_MLP_SYNC="1",
)
DP2_SERVE_CONFIG = type(DP2_SERVE_CONFIG)(
    **{**DP2_SERVE_CONFIG.__dict__, "launcher": "serve", "plugins": "", "name": "dp2-serve"}
)

#: fixture name -> configuration, in group order (tests/conftest.py: the tests that use a server run after
#: those of the servers before it; a test that uses two runs in the first one's group)
SHARED_CONFIGS: dict[str, ServerConfig] = {
    # DeepseekV3 tiny (MLA + MoE), --dp-size 2 --tp-size 2 --enable-dp-attention, plugin active (above)
    "dp2_server": DP2_SHARED_CONFIG,
    # the same geometry, native exchange only, short stall settings (above); ended by the stopped-peer drill
    "dp2_native_server": DP2_NATIVE_CONFIG,
    # Qwen3 tiny + tiny DSpark draft, --speculative-algorithm DSPARK, the same DP2 geometry (stock
    # requires --enable-dp-lm-head for DSpark under DP attention), plugin active with
    # DSPARK_HARDEN_DSPARK_MASKS=1 and DSPARK_HARDEN_DSPARK_RESULTS=1. The draft is built first (``PREPARE``).
    # Its last user, the detokenizer SIGKILL drill (tests/lifecycle/test_server_drills.py), ends it.
    "dspark_dp2_server": DSPARK_DP2_CONFIG,
    # stock, paused between its users (above); ended by the stock SIGTERM drill
    "dp2_stock_server": DP2_STOCK_CONFIG,
    # ``sglang serve``, plugin installed but not named, drain 10 s, native exchange (above); ended by the
    # plugin SIGTERM drill
    "dp2_serve_server": DP2_SERVE_CONFIG,
}

_running: dict[str, SGLangServer] = {}
_failed: dict[str, str] = {}


def get(name: str) -> SGLangServer:
    if name in _failed:
        raise ServerError(f"shared server {name!r} failed to start earlier in this run:\n{_failed[name]}")
    server = _running.get(name)
    if server is not None and server.proc is not None and server.proc.poll() is None:
        return server
    if server is not None:  # died since: report, do not silently restart
        _running.pop(name, None)
        msg = server._failure(f"died while shared (exit code {server.proc.poll()})")
        _failed[name] = msg
        raise ServerError(msg)
    try:
        if name in PREPARE:
            PREPARE[name]()
        server = SGLangServer(SHARED_CONFIGS[name], watch_shm=name in WATCH_SHM)
        server = _start_watching(server, WATCH_WHILE_STARTING.get(name))
    except ServerError as exc:
        _failed[name] = str(exc)
        raise
    _running[name] = server
    return server


#: shared servers whose /dev/shm mappings are watched (a drill that ends one checks its leftovers)
WATCH_SHM = {"dp2_stock_server", "dspark_dp2_server", "dp2_serve_server"}

#: fixture name -> what must exist before the server starts (the DSpark draft its arguments name)
PREPARE = {"dspark_dp2_server": ensure_dspark_draft}

#: fixture name -> path polled while the server starts; its (status, reason) answers until the first 200
#: are kept as ``server.startup_answers`` (the ingress tests read /health_scheduler's)
WATCH_WHILE_STARTING = {"dp2_server": "/health_scheduler"}


def _start_watching(server: SGLangServer, path: Optional[str]) -> SGLangServer:
    if path is None:
        return server.start()
    import requests

    def watch(srv: SGLangServer) -> None:
        seen = srv.startup_answers = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and srv.proc.poll() is None and not srv.lost_port_race():
            try:
                r = requests.get(srv.url + path, timeout=5)
                seen.append((r.status_code, r.json().get("reason")))
                if r.status_code == 200:
                    return
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.1)

    return server.start(while_starting=watch)


def resume(server: SGLangServer, timeout: float = 60.0) -> SGLangServer:
    """SIGCONT the server's process group (harmless when it runs) and wait until it answers again."""
    os.killpg(server.pid, signal.SIGCONT)
    deadline = time.monotonic() + timeout
    while not server._http_ok("/model_info", timeout=5):
        if time.monotonic() > deadline or server.proc.poll() is not None:
            raise ServerError(server._failure("did not answer /model_info after SIGCONT"))
        time.sleep(0.5)
    return server


def running(name: str) -> Optional[SGLangServer]:
    return _running.get(name)


def stop(name: str) -> None:
    server = _running.pop(name, None)
    if server is not None:
        if server.proc.poll() is None:
            os.killpg(server.pid, signal.SIGCONT)  # a paused server would take SIGTERM only after its stop timeout
        server.stop()
        server.remove_workdir()


def stop_all() -> None:
    for name in list(_running):
        stop(name)
