"""``dspark-harden bench dp2``: native DP2 exchange vs stock gloo, and the whole
``MLPSyncBatchInfo.all_gather`` call stock vs hardened, between two local processes in one run.

(a) raw exchange: gloo ``all_gather_single`` of the live-schema row vs one native exchange;
(b) the call the scheduler makes: stock ``all_gather`` (gloo) vs the hardened one (native) on the
    same random inputs; every hardened result is compared field for field with stock's.
Timings are rank 0's (both ranks run in lockstep).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

from .harness import differences, init_worker, random_info, run_pair


def _summary(ns: list) -> dict:
    xs = sorted(ns)
    n = len(xs)
    return {
        "p50_us": float(xs[n // 2] / 1e3),
        "p99_us": float(xs[min(n - 1, int(n * 0.99))] / 1e3),
        "mean_us": float(statistics.fmean(xs) / 1e3),
    }


def _pin(rank: int) -> list:
    """Pin rank r to the r-th allowed CPU (two schedulers of a DP2 deployment run on their own
    cores); returns the CPU set used. Both the gloo and the native measurement run pinned."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    return sorted(os.sched_getaffinity(0))


def _worker(rank: int, port: int, session: str, iters: int, spin_us: int, pin: bool = True) -> dict:
    if pin:
        _pin(rank)
    w = init_worker(rank, port, session, spin_us=spin_us)
    torch, dist, group = w.torch, w.dist, w.group
    from sglang.srt.distributed.utils import all_gather_single

    width = w.sync.width
    pc = time.perf_counter_ns
    warm = max(50, iters // 20)

    # (a) raw gloo
    local = torch.arange(width, dtype=torch.int64) + rank
    gathered = torch.empty(2 * width, dtype=torch.int64)
    gloo = []
    for i in range(warm + iters):
        t = pc()
        all_gather_single(gathered, local, group=group)
        if i >= warm:
            gloo.append(pc() - t)
    # (a) raw native
    ch = w.sync.channel
    row = list(range(width))
    native = []
    for i in range(warm + iters):
        row[0] = i
        t = pc()
        out = ch.exchange(row)
        if i >= warm:
            native.append(pc() - t)
        if out[0] != i or out[width] != i:
            raise AssertionError(f"native exchange returned {out[0]}/{out[width]} at {i}")
    dist.barrier(group=group)
    # (b) the whole call: stock over gloo, then hardened over native, same inputs
    stock_fn = w.dp_attn.MLPSyncBatchInfo.all_gather
    rng = random.Random(1234 + rank)
    inputs = [random_info(w.dp_attn, rng, rank) for _ in range(warm + iters)]
    import copy

    stock_out, stock_t = [copy.copy(info) for info in inputs], []
    for i, obj in enumerate(stock_out):
        t = pc()
        stock_fn(obj, "cpu", group)
        if i >= warm:
            stock_t.append(pc() - t)
    dist.barrier(group=group)
    harden_t, harden_out = [], []
    sync = w.sync
    objs = [copy.copy(info) for info in inputs]
    for i, obj in enumerate(objs):
        t = pc()
        sync(obj, "cpu", group)
        if i >= warm:
            harden_t.append(pc() - t)
    dist.barrier(group=group)
    # compare after the timed loop: comparing inside it would make the peer wait for us
    bad = []
    for i, obj in enumerate(objs):
        d = differences(stock_out[i], obj)
        if d and len(bad) < 5:
            bad.append((i, d))
    w.runtime.close_all()
    dist.destroy_process_group()
    return {"gloo": gloo, "native": native, "stock": stock_t, "harden": harden_t, "bad": bad, "n": len(inputs)}


def run(iters: int, spin_us: int = 50, pin: bool = True) -> dict:
    r0, r1 = run_pair(_worker, (iters, spin_us, pin))
    native, gloo = _summary(r0["native"]), _summary(r0["gloo"])
    stock, harden = _summary(r0["stock"]), _summary(r0["harden"])
    return {
        "iters": int(iters),
        "native": native,
        "gloo": gloo,
        "speedup_p50": float(gloo["p50_us"] / native["p50_us"]),
        "call": {
            "stock": {"p50_us": stock["p50_us"], "p99_us": stock["p99_us"]},
            "harden": {"p50_us": harden["p50_us"], "p99_us": harden["p99_us"]},
            "speedup_p50": float(stock["p50_us"] / harden["p50_us"]),
            "identical": not r0["bad"] and not r1["bad"],
        },
        "_mismatches": r0["bad"][:3] + r1["bad"][:3],
    }


def main(args) -> int:
    if args.iters <= 0:
        print("dspark-harden bench dp2: --iters must be positive", file=sys.stderr)
        return 2
    res = run(args.iters, args.spin_us, not args.no_pin)
    mismatches = res.pop("_mismatches")
    if args.json:
        print(json.dumps(res))
    else:
        print(f"iters {res['iters']}")
        for k in ("native", "gloo"):
            print(f"  raw {k:6s}: p50 {res[k]['p50_us']:9.2f} us  p99 {res[k]['p99_us']:9.2f} us  mean {res[k]['mean_us']:9.2f} us")
        print(f"  raw speedup p50: {res['speedup_p50']:.1f}x")
        c = res["call"]
        for k in ("stock", "harden"):
            print(f"  call {k:6s}: p50 {c[k]['p50_us']:9.2f} us  p99 {c[k]['p99_us']:9.2f} us")
        print(f"  call speedup p50: {c['speedup_p50']:.1f}x  identical: {c['identical']}")
    if mismatches:
        print(f"MISMATCHES: {mismatches}", file=sys.stderr)
    return 0 if res["call"]["identical"] else 1
