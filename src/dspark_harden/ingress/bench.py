"""``dspark-harden bench controller``: stock vs blocking DP controller loop, in alternating blocks.

Each loop runs in its own forked process as a real ``DataParallelController`` (built by
:mod:`.harness`: real class, real ``init_dispatcher``, real ZMQ IPC sockets; no schedulers
launched — their ends are PULL sockets in this process). For each loop we measure:

* idle CPU: the controller process's user+system CPU time over ``idle_seconds`` with no traffic,
  scaled to 10 s (``*_idle_cpu_s_per_10s``);
* dispatch latency: ``n_requests`` real ``TokenizedGenerateReqInput`` messages sent one at a
  time from the tokenizer end; latency = time from send to arrival at the chosen scheduler
  socket (same clock, same process); p50 in microseconds (``*_dispatch_p50_us``).

``runs`` runs alternate the order of the two loops (stock first, then ours first, ...), so drift in
the host's load does not favour one side; the result lists every run and the median, min and max
of each figure, plus in how many runs our dispatch p50 was at most stock's.

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

from ..core import procfs
from .harness import Endpoints, Peer, build_controller, make_request


def _controller_main(
    endpoints: Endpoints, dp_size: int, variant: str, poll_ms: int, spin_us: int, cpu: Optional[int] = None
) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if variant == "harden":
        from ..core.patch import Role
        from ..core.settings import Settings
        from .patches import patches
        from .settings import ATOMIC_SWITCH, LOOP_SWITCH, POLL_MS, SPIN_US

        settings = Settings(values={LOOP_SWITCH: True, ATOMIC_SWITCH: False, POLL_MS: poll_ms, SPIN_US: spin_us})
        for patch in patches(Role.CONTROLLER, settings):
            patch.apply()
    ctrl = build_controller(endpoints, dp_size=dp_size)
    ctrl.event_loop()


def _cpu_seconds(pid: int) -> float:
    cpu = procfs.cpu_seconds(pid)
    if cpu is None:
        raise RuntimeError(f"controller process {pid} exited during the bench")
    return cpu


def _latencies(peer: "Peer", variant: str, tag: str, n: int, dp_size: int) -> list:
    lat_us = []
    for i in range(n):
        req = make_request(f"{variant}-{tag}-{i}", routed_dp_rank=i % dp_size)
        t_send = time.perf_counter()
        peer.send(req)
        got = peer.recv_any(10_000)
        t_recv = time.perf_counter()
        if got is None or got[0] != i % dp_size:
            raise RuntimeError(f"{variant} controller misrouted request {tag}-{i}: {got and got[0]}")
        lat_us.append((t_recv - t_send) * 1e6)
    return lat_us


def _cpus(pin: bool) -> tuple:
    """(CPU of this process = the tokenizer/scheduler ends, CPU of the controllers), or (None, None).
    Both controllers share one CPU (only one runs at a time), the peer another, so neither variant
    is favoured by where the OS happened to place it."""
    if not pin:
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[-1]) if len(cpus) >= 2 else (None, None)


def _run(
    order: tuple,
    *,
    dp_size: int,
    idle_seconds: float,
    n_requests: int,
    blocks: int,
    poll_ms: int,
    spin_us: int,
    directory: str,
    run: int,
    pin: bool = True,
) -> dict:
    """One run: both controllers alive (forked), only one of them running at any time (the other is
    SIGSTOPped, so a spinning stock loop never steals CPU from ours or the other way round). Idle
    CPU of each over ``idle_seconds``; then ``blocks`` alternating latency blocks per controller,
    ``n_requests`` in total each, in the run's ``order`` (the first request of a block after
    SIGCONT is not counted)."""
    import signal

    endpoints = {v: Endpoints.new(dp_size, directory) for v in order}
    # fork both before this process opens its own ZMQ context (a context must not cross a fork)
    peer_cpu, ctrl_cpu = _cpus(pin)
    procs = {
        v: mp.get_context("fork").Process(
            target=_controller_main, args=(endpoints[v], dp_size, v, poll_ms, spin_us, ctrl_cpu), daemon=True
        )
        for v in order
    }
    for p in procs.values():
        p.start()
    saved_affinity = os.sched_getaffinity(0)
    if peer_cpu is not None:
        os.sched_setaffinity(0, {peer_cpu})
    peers = {v: Peer(endpoints[v]).open() for v in order}

    def only(v):
        for other, p in procs.items():
            if other != v:
                os.kill(p.pid, signal.SIGSTOP)
        os.kill(procs[v].pid, signal.SIGCONT)

    try:
        idle = {}
        for v in order:
            only(v)
            for i in range(20):  # warm up until connected and dispatching
                peers[v].send(make_request(f"warm-{v}-{i}"))
                if peers[v].recv_any(30_000) is None:
                    raise RuntimeError(f"{v} controller did not dispatch within 30 s")
            time.sleep(0.5)
            cpu0, t0 = _cpu_seconds(procs[v].pid), time.monotonic()
            time.sleep(idle_seconds)
            idle[v] = (_cpu_seconds(procs[v].pid) - cpu0) * 10.0 / (time.monotonic() - t0)
        per_block = max(2, n_requests // blocks)
        lat = {v: [] for v in order}
        for b in range(blocks):
            for v in order if b % 2 == 0 else order[::-1]:
                only(v)
                lat[v] += _latencies(peers[v], v, f"b{b}", per_block + 1, dp_size)[1:]
        return {v: (idle[v], statistics.median(lat[v])) for v in order}
    finally:
        for p in procs.values():
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
            p.join(10)
        for peer in peers.values():
            peer.close()
        os.sched_setaffinity(0, saved_affinity)


def run_controller_bench(
    *,
    idle_seconds: float = 3.0,
    n_requests: int = 300,
    dp_size: int = 2,
    poll_ms: Optional[int] = None,
    spin_us: Optional[int] = None,
    runs: int = 5,
    blocks: int = 6,
    pin: bool = True,
) -> dict:
    """``runs`` runs, each measuring both loops (order alternating between runs); every figure per
    run plus median / min / max over the runs."""
    if runs <= 0 or n_requests <= 0 or idle_seconds <= 0 or blocks <= 0:
        raise ValueError("runs, requests, blocks and idle seconds must be positive")
    from sglang.srt.managers import data_parallel_controller  # noqa: F401 - import once, before fork

    from .settings import DEFAULT_POLL_MS, DEFAULT_SPIN_US

    poll_ms = poll_ms or DEFAULT_POLL_MS
    spin_us = DEFAULT_SPIN_US if spin_us is None else spin_us
    per_run = []
    with tempfile.TemporaryDirectory(prefix="dspark-bench-dpc-") as directory:
        for i in range(runs):
            order = ("stock", "harden") if i % 2 == 0 else ("harden", "stock")
            got = _run(
                order,
                dp_size=dp_size,
                idle_seconds=idle_seconds,
                n_requests=n_requests,
                blocks=blocks,
                poll_ms=poll_ms,
                spin_us=spin_us,
                directory=directory,
                run=i,
                pin=pin,
            )
            per_run.append(
                {
                    "order": "/".join(order),
                    "stock_idle_cpu_s_per_10s": round(got["stock"][0], 4),
                    "harden_idle_cpu_s_per_10s": round(got["harden"][0], 4),
                    "stock_dispatch_p50_us": round(got["stock"][1], 2),
                    "harden_dispatch_p50_us": round(got["harden"][1], 2),
                }
            )
    out: dict = {
        "runs": per_run,
        "spin_us": spin_us,
        "poll_ms": poll_ms,
        "requests": n_requests,
        "blocks": blocks,
        "pinned": pin,
        "idle_seconds": idle_seconds,
    }
    for key in (
        "stock_idle_cpu_s_per_10s",
        "harden_idle_cpu_s_per_10s",
        "stock_dispatch_p50_us",
        "harden_dispatch_p50_us",
    ):
        vals = [r[key] for r in per_run]
        out[key] = {"median": round(statistics.median(vals), 4), "min": min(vals), "max": max(vals)}
    out["harden_p50_le_stock_runs"] = sum(r["harden_dispatch_p50_us"] <= r["stock_dispatch_p50_us"] for r in per_run)
    return out
