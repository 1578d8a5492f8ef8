"""Servers shared by many tests: started on first use, stopped as soon as no later test needs them.

Each entry of :data:`SHARED_CONFIGS` becomes a pytest fixture of the same name (tests/conftest.py).
Collection puts the tests that use one shared server next to each other (and after the tests that
use none: heaviest last), so each shared configuration starts once per run; a teardown hook stops
it right after the last test that needs it (the DP controller's idle loop burns a core, and the
machine-wide server lock should be released early). A start failure is remembered so later tests
fail at once with the same log instead of waiting for another start.

A shared server must not be requested from ``@pytest.mark.forked`` tests (the fork would own it).
"""

from __future__ import annotations

import time
from typing import Optional

from dspark_harden.devtools.tiny_models import dspark_draft_dir

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

#: fixture name -> configuration. Later issues may add entries (e.g. a stock server to compare).
SHARED_CONFIGS: dict[str, ServerConfig] = {
    # DeepseekV3 tiny (MLA + MoE), --dp-size 2 --tp-size 2 --enable-dp-attention, plugin active (above)
    "dp2_server": DP2_SHARED_CONFIG,
    # Qwen3 tiny + tiny DSpark draft, --speculative-algorithm DSPARK, the same DP2 geometry (stock
    # requires --enable-dp-lm-head for DSpark under DP attention), plugin active with
    # DSPARK_HARDEN_DSPARK_MASKS=1 and DSPARK_HARDEN_DSPARK_RESULTS=1. The draft is built by ensure_dspark_draft() (tests using this
    # server request it first: tests/dspark_masks/test_dspark_server.py).
    "dspark_dp2_server": DSPARK_DP2_CONFIG,
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
        server = _start_watching(SGLangServer(SHARED_CONFIGS[name]), WATCH_WHILE_STARTING.get(name))
    except ServerError as exc:
        _failed[name] = str(exc)
        raise
    _running[name] = server
    return server


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


def running(name: str) -> Optional[SGLangServer]:
    return _running.get(name)


def stop(name: str) -> None:
    server = _running.pop(name, None)
    if server is not None:
        server.stop()
        server.remove_workdir()


def stop_all() -> None:
    for name in list(_running):
        stop(name)
