"""Lifecycle drills against real SGLang servers: load, signals, and what is left afterwards.

Everything here is real: ``/generate`` requests over HTTP from threads, ``os.kill`` of the
server's real processes (found by their SGLang process titles), ``/dev/shm`` and the server's own
``TMPDIR`` inspected after the tree is gone. Both the stock and the plugin server log through
the same ``logging.json`` (SGLang's ``SGLANG_LOGGING_CONFIG_PATH``), which adds the level name to
every line so WARNING+ lines can be counted (SGLang's default format has no level).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import requests

from dspark_harden.core import procfs
from dspark_harden.devtools import shmwatch
from tests.harness.server import DP2_CONFIG, SGLangServer

LOGGING_JSON = str(Path(__file__).with_name("logging.json"))
LEVEL_RE = re.compile(r"^\[[^\]]* (WARNING|ERROR|CRITICAL) ", re.M)
SHM = Path("/dev/shm")


def config(plugin: bool, name: str, **env: str):
    cfg = DP2_CONFIG.with_env(SGLANG_LOGGING_CONFIG_PATH=LOGGING_JSON, **env)
    return type(cfg)(**{**cfg.__dict__, "plugins": "dspark_harden" if plugin else None, "name": name})


@dataclass
class Result:
    index: int
    max_new_tokens: int
    status: Optional[int] = None
    body: str = ""
    error: Optional[str] = None  # transport error: connection dropped, timeout
    seconds: float = 0.0


class Load:
    """Concurrent /generate requests from threads; each records its HTTP answer or transport error."""

    def __init__(self, server: SGLangServer, lengths: list, rid_prefix: str = "drill-"):
        self.server, self.lengths, self.rid_prefix = server, lengths, rid_prefix
        self.results = [Result(i, n) for i, n in enumerate(lengths)]
        self.threads = [threading.Thread(target=self._one, args=(r,), daemon=True) for r in self.results]

    def _one(self, r: Result) -> None:
        t0 = time.monotonic()
        try:
            resp = requests.post(
                self.server.url + "/generate",
                json={
                    "text": f"def drill_{r.index}():",
                    "rid": f"{self.rid_prefix}{r.index}-{os.getpid()}-{time.time_ns()}",
                    "sampling_params": {"max_new_tokens": r.max_new_tokens, "temperature": 0.0, "ignore_eos": True},
                },
                timeout=180,
            )
            r.status, r.body = resp.status_code, resp.text[:2000]
        except requests.RequestException as exc:
            r.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        r.seconds = time.monotonic() - t0

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout: float = 200.0) -> list:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return self.results


def wait_in_flight(server: SGLangServer, n: int, timeout: float = 60.0) -> int:
    """Wait until the schedulers hold ``n`` requests (running + waiting, from /v1/loads)."""
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        try:
            loads = server.get("/v1/loads", timeout=5).json()
            items = loads.get("loads", loads) if isinstance(loads, dict) else loads
            seen = sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in items)
            if seen >= n:
                return seen
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.2)
    return seen


@dataclass
class Drill:
    """What happened after the event (SIGTERM / SIGKILL) on one server."""

    name: str
    returncode: Optional[int] = None
    exit_seconds: Optional[float] = None
    results: list = field(default_factory=list)
    warning_lines: list = field(default_factory=list)
    tracebacks: int = 0
    leftover_shm: list = field(default_factory=list)
    leftover_sockets: list = field(default_factory=list)
    leftover_pids: list = field(default_factory=list)
    log_after: str = ""
    probes: list = field(default_factory=list)  # (what, status, body) observed after the event

    @property
    def lost(self) -> list:
        return [r for r in self.results if r.error is not None]

    @property
    def ok(self) -> list:
        return [r for r in self.results if r.status == 200]

    @property
    def errors(self) -> list:
        return [r for r in self.results if r.status is not None and r.status != 200]

    def summary(self) -> str:
        return (
            f"[drill {self.name}] exit code {self.returncode} after {self.exit_seconds:.1f} s; requests: "
            f"{len(self.ok)} ok, {len(self.errors)} error responses, {len(self.lost)} lost (no answer); "
            f"WARNING+ lines after the event: {len(self.warning_lines)}, tracebacks: {self.tracebacks}; "
            f"left behind: {len(self.leftover_shm)} /dev/shm {sorted(self.leftover_shm)}, "
            f"{len(self.leftover_sockets)} ipc sockets, {len(self.leftover_pids)} processes"
        )


def sockets_in(path: Path) -> list:
    out = []
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            try:
                if stat.S_ISSOCK(os.lstat(p).st_mode):
                    out.append(p)
            except OSError:
                pass
    return out


def finish(
    drill: Drill,
    server: SGLangServer,
    *,
    log_offset: int,
    t_event: float,
    load: Optional[Load],
    exit_timeout: float = 90.0,
) -> Drill:
    """Wait for the server to exit on its own, then collect everything the drill judges."""
    rc = server.wait_exit(exit_timeout)
    drill.exit_seconds = time.monotonic() - t_event
    drill.returncode = rc
    if load is not None:
        drill.results = load.join(60)
    time.sleep(1.0)  # children exit right after the main process
    drill.leftover_pids = procfs.group_pids(server.pid) if rc is not None else ["still running"]
    if rc is None:
        server.stop()
    # new since the server's launch, mapped by no live process, mapped by the server's processes
    drill.leftover_shm = shmwatch.leftovers(server.shm_watch, server.shm_before)
    drill.leftover_sockets = sockets_in(server.workdir / "tmp")
    text = server.log_text()
    drill.log_after = text[log_offset:]
    drill.warning_lines = [line for line in drill.log_after.splitlines() if LEVEL_RE.match(line)]
    drill.tracebacks = drill.log_after.count("Traceback (most recent call last)")
    server.stop()  # reap and release the server lock (no-op when it exited)
    server.remove_workdir()  # its log is in drill.log_after; its tmp/ holds a torchinductor cache (~150 MB)
    # recorded; now removed: what a drilled server left (stock's queues and load snapshots: stock 0.5.23 unlinks
    # them only in its CI-only sweep) must not outlive the drill in the host's /dev/shm (24 MiB a run)
    for name in drill.leftover_shm:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shmwatch.resources.SHM_DIR, name))
    return drill


def signal_drill(
    server: SGLangServer,
    name: str,
    *,
    target: str,
    sig: int,
    lengths: Optional[list],
    wait_for: int = 0,
    probes=None,
    exit_timeout: float = 90.0,
) -> Drill:
    """Start ``lengths`` requests (None: none), wait until ``wait_for`` are in the schedulers, send
    ``sig`` to ``target`` ("main" or a process title prefix), run ``probes(server, drill)`` right after,
    then :func:`finish`."""
    load = None
    if lengths is not None:
        load = Load(server, lengths).start()
        wait_in_flight(server, wait_for)
    log_offset = len(server.log_text())
    pid = server.pid if target == "main" else server.process_titled(target)
    drill = Drill(name)
    server.shm_watch.scan()  # what the server holds right before the event
    t_event = time.monotonic()
    os.kill(pid, sig)
    if probes is not None:
        probes(server, drill)
    return finish(
        drill,
        server,
        log_offset=log_offset,
        t_event=t_event,
        load=load,
        exit_timeout=exit_timeout,
    )


def probe(server: SGLangServer, drill: Drill, what: str, method: str, path: str, **kw) -> None:
    try:
        r = server.request(method, path, timeout=10, **kw)
        drill.probes.append((what, r.status_code, r.text[:500]))
    except requests.RequestException as exc:
        drill.probes.append((what, None, f"{type(exc).__name__}: {exc}"))


def poll_health(server: SGLangServer, drill: Drill, seconds: float) -> None:
    """GET /health_scheduler every 0.1 s until the server stops answering (or ``seconds``)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            r = server.get("/health_scheduler", timeout=2)
            drill.probes.append(("health", r.status_code, r.text[:500]))
        except requests.RequestException:
            if any(p[0] == "health" for p in drill.probes):
                return
        time.sleep(0.1)


__all__ = ["config", "signal_drill", "probe", "poll_health", "Drill", "Load", "SIGNALS"]
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}
