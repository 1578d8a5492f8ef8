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
    env=(("DSPARK_HARDEN_DSPARK_MASKS", "1"), ("DSPARK_HARDEN_DSPARK_RESULTS", "1")),
)

#: fixture name -> configuration. Later issues may add entries (e.g. a stock server to compare).
SHARED_CONFIGS: dict[str, ServerConfig] = {
    # DeepseekV3 tiny (MLA + MoE), --dp-size 2 --tp-size 2 --enable-dp-attention, plugin active
    "dp2_server": DP2_CONFIG,
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
        server = SGLangServer(SHARED_CONFIGS[name]).start()
    except ServerError as exc:
        _failed[name] = str(exc)
        raise
    _running[name] = server
    return server


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
