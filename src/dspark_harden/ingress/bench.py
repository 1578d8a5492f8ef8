"""``dspark-harden bench controller``: stock vs blocking DP controller loop, one run.

Each loop runs in its own forked process as a real ``DataParallelController`` (built by
:mod:`.harness`: real class, real ``init_dispatcher``, real ZMQ IPC sockets; no schedulers
launched — their ends are PULL sockets in this process). For each loop we measure:

* idle CPU: the controller process's user+system CPU time over ``idle_seconds`` with no traffic,
  scaled to 10 s (``*_idle_cpu_s_per_10s``);
* dispatch latency: ``n_requests`` real ``TokenizedGenerateReqInput`` messages sent one at a
  time from the tokenizer end; latency = time from send to arrival at the chosen scheduler
  socket (same clock, same process); p50 in microseconds (``*_dispatch_p50_us``).

The stock loop and ours run the same code except ``event_loop`` (ours is bound through the same
:class:`~dspark_harden.core.patch.Patch` object the plugin uses). Numbers depend on the host
(on a shared 2-core CI box the spinning stock loop competes with everything else).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Optional

from .harness import Endpoints, Peer, build_controller, make_request


def _controller_main(endpoints: Endpoints, dp_size: int, variant: str, poll_ms: int) -> None:
    if variant == "harden":
        from ..core.patch import Role
        from ..core.settings import Settings
        from .patches import patches
        from .settings import ATOMIC_SWITCH, LOOP_SWITCH, POLL_MS

        settings = Settings(values={LOOP_SWITCH: True, ATOMIC_SWITCH: False, POLL_MS: poll_ms})
        for patch in patches(Role.CONTROLLER, settings):
            patch.apply()
    ctrl = build_controller(endpoints, dp_size=dp_size)
    ctrl.event_loop()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _measure(variant: str, *, dp_size: int, idle_seconds: float, n_requests: int, poll_ms: int,
             directory: str) -> tuple[float, float]:
    endpoints = Endpoints.new(dp_size, directory)
    # fork before this process opens its own ZMQ context (a context must not cross a fork)
    proc = mp.get_context("fork").Process(
        target=_controller_main, args=(endpoints, dp_size, variant, poll_ms), daemon=True,
    )
    proc.start()
    peer = Peer(endpoints).open()
    try:
        # warm up until the controller is connected and dispatching
        for i in range(20):
            peer.send(make_request(f"warm-{variant}-{i}"))
            if peer.recv_any(30_000) is None:
                raise RuntimeError(f"{variant} controller did not dispatch within 30 s")
        time.sleep(0.5)
        cpu0 = _cpu_seconds(proc.pid)
        t0 = time.monotonic()
        time.sleep(idle_seconds)
        cpu1 = _cpu_seconds(proc.pid)
        elapsed = time.monotonic() - t0
        idle_per_10s = (cpu1 - cpu0) * 10.0 / elapsed

        reqs = [make_request(f"{variant}-{i}", routed_dp_rank=i % dp_size) for i in range(n_requests)]
        lat_us = []
        for i, req in enumerate(reqs):
            t_send = time.perf_counter()
            peer.send(req)
            got = peer.recv_any(10_000)
            t_recv = time.perf_counter()
            if got is None or got[0] != i % dp_size:
                raise RuntimeError(f"{variant} controller misrouted request {i}: {got and got[0]}")
            lat_us.append((t_recv - t_send) * 1e6)
        return idle_per_10s, statistics.median(lat_us)
    finally:
        proc.kill()
        proc.join(10)
        peer.close()


def run_controller_bench(*, idle_seconds: float = 3.0, n_requests: int = 300, dp_size: int = 2,
                         poll_ms: Optional[int] = None) -> dict:
    from sglang.srt.managers import data_parallel_controller  # noqa: F401 - import once, before fork

    from .settings import DEFAULT_POLL_MS

    poll_ms = poll_ms or DEFAULT_POLL_MS
    with tempfile.TemporaryDirectory(prefix="dspark-bench-dpc-") as directory:
        stock_cpu, stock_p50 = _measure("stock", dp_size=dp_size, idle_seconds=idle_seconds,
                                        n_requests=n_requests, poll_ms=poll_ms, directory=directory)
        harden_cpu, harden_p50 = _measure("harden", dp_size=dp_size, idle_seconds=idle_seconds,
                                          n_requests=n_requests, poll_ms=poll_ms, directory=directory)
    return {
        "stock_idle_cpu_s_per_10s": round(stock_cpu, 4),
        "harden_idle_cpu_s_per_10s": round(harden_cpu, 4),
        "stock_dispatch_p50_us": round(stock_p50, 2),
        "harden_dispatch_p50_us": round(harden_p50, 2),
    }
