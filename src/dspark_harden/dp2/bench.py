"""``dspark-harden bench dp2``: native DP2 exchange vs stock gloo, and the whole
``MLPSyncBatchInfo.all_gather`` call stock vs hardened, between two local processes in one run.

(a) raw exchange: gloo ``all_gather_single`` of the live-schema row vs one native exchange;
(b) the call the scheduler makes: stock ``all_gather`` (gloo) vs the hardened one (native) on the
    same random inputs; every hardened result is compared field for field with stock's.
``--rounds`` rounds in one pair of processes; each round runs one block of ``--iters`` calls of
every path, stock's and ours alternating which goes first. Reported: per round p50 / p99, and the
median with min / max over the rounds (never the best round). Timings are rank 0's (both ranks run
in lockstep). For the raw native exchange also the native call's own split of every call (its stats
struct, read outside the timed interval): ``arrival_skew`` (|own arrival - peer arrival|) and
``post_latest_arrival`` (finish - the later arrival), p50 / p99 / mean, as the seed's speed table
(20,000 iterations, the default ``--iters``).
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


def split_mismatches(totals: list, skews: list, posts: list) -> int:
    """Calls whose native split does not add up. A call starts at its own arrival, so when this rank
    arrived last ``post_latest_arrival == total``, and when the peer did ``post_latest_arrival + arrival_skew
    == total`` (ns, exact); any other call is a wrong stat."""
    bad = 0
    for t, k, p in zip(totals, skews, posts):
        if p != t and p + k != t:
            bad += 1
    return bad


def _pin(rank: int) -> list:
    """Pin rank r to the r-th allowed CPU (two schedulers of a DP2 deployment run on their own
    cores); returns the CPU set used. Both the gloo and the native measurement run pinned."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    return sorted(os.sched_getaffinity(0))


def _worker(rank: int, port: int, session: str, iters: int, spin_us: int, pin: bool = True, rounds: int = 1) -> dict:
    if pin:
        _pin(rank)
    w = init_worker(rank, port, session, spin_us=spin_us)
    torch, dist, group = w.torch, w.dist, w.group
    import copy

    from sglang.srt.distributed.utils import all_gather_single

    width = w.sync.width
    pc = time.perf_counter_ns
    warm = max(50, iters // 20)
    local = torch.arange(width, dtype=torch.int64) + rank
    gathered = torch.empty(2 * width, dtype=torch.int64)
    ch = w.sync.channel
    row = list(range(width))
    stock_fn = w.dp_attn.MLPSyncBatchInfo.all_gather
    sync = w.sync

    def raw_gloo(n: int) -> list:
        ts = []
        for _ in range(n):
            t = pc()
            all_gather_single(gathered, local, group=group)
            ts.append(pc() - t)
        return ts

    st = ch.stats
    skews, posts, totals = [], [], []

    def raw_native(n: int, record: bool = False) -> list:
        ts = []
        for i in range(n):
            row[0] = i
            t = pc()
            out = ch.exchange(row)
            ts.append(pc() - t)
            if record:  # the native call's own split of this call (outside the timed interval)
                skews.append(st.arrival_skew_ns)
                posts.append(st.post_latest_arrival_ns)
                totals.append(st.total_ns)
            if out[0] != i or out[width] != i:
                raise AssertionError(f"native exchange returned {out[0]}/{out[width]} at {i}")
        return ts

    def call(fn, objs: list) -> list:
        ts = []
        for obj in objs:
            t = pc()
            fn(obj, "cpu", group)
            ts.append(pc() - t)
        return ts

    # warm-up of all four paths, untimed
    raw_gloo(warm)
    raw_native(warm)
    rng = random.Random(1234 + rank)
    warm_inputs = [random_info(w.dp_attn, rng, rank) for _ in range(warm)]
    call(stock_fn, [copy.copy(x) for x in warm_inputs])
    dist.barrier(group=group)
    call(sync, [copy.copy(x) for x in warm_inputs])
    dist.barrier(group=group)

    out_rounds, bad = [], []
    for r in range(rounds):
        # alternate which side goes first, so a drift of machine load inside a round favours neither
        first_stock = r % 2 == 0
        inputs = [random_info(w.dp_attn, rng, rank) for _ in range(iters)]
        stock_objs, harden_objs = [copy.copy(x) for x in inputs], [copy.copy(x) for x in inputs]
        res: dict = {}
        for side in ("stock", "harden") if first_stock else ("harden", "stock"):
            dist.barrier(group=group)
            if side == "stock":
                res["gloo"] = raw_gloo(iters)
                dist.barrier(group=group)
                res["stock"] = call(stock_fn, stock_objs)
            else:
                skews.clear()
                posts.clear()
                totals.clear()
                res["native"] = raw_native(iters, record=True)
                res["arrival_skew"], res["post_latest_arrival"] = list(skews), list(posts)
                res["split_mismatches"] = split_mismatches(totals, skews, posts)
                dist.barrier(group=group)
                res["harden"] = call(sync, harden_objs)
        dist.barrier(group=group)
        # compare after the timed loops: comparing inside them would make the peer wait for us
        for i in range(iters):
            d = differences(stock_objs[i], harden_objs[i])
            if d and len(bad) < 5:
                bad.append((r, i, d))
        out_rounds.append(res)
    w.runtime.close_all()
    dist.destroy_process_group()
    return {"rounds": out_rounds, "bad": bad, "n": rounds * iters}


def _med_spread(xs: list) -> dict:
    return {"median": float(statistics.median(xs)), "min": float(min(xs)), "max": float(max(xs))}


def run(iters: int = 20000, spin_us: int = 50, pin: bool = True, rounds: int = 5) -> dict:
    r0, r1 = run_pair(_worker, (iters, spin_us, pin, rounds))
    per_round = []
    for res in r0["rounds"]:
        native, gloo = _summary(res["native"]), _summary(res["gloo"])
        stock, harden = _summary(res["stock"]), _summary(res["harden"])
        per_round.append(
            {
                "native": native,
                "arrival_skew": _summary(res["arrival_skew"]),
                "post_latest_arrival": _summary(res["post_latest_arrival"]),
                "gloo": gloo,
                "speedup_p50": float(gloo["p50_us"] / native["p50_us"]),
                "call": {"stock": stock, "harden": harden, "speedup_p50": float(stock["p50_us"] / harden["p50_us"])},
            }
        )

    def med(path) -> dict:
        return _med_spread([path(x) for x in per_round])

    spread = {
        "native_p50_us": med(lambda x: x["native"]["p50_us"]),
        "native_p99_us": med(lambda x: x["native"]["p99_us"]),
        "native_mean_us": med(lambda x: x["native"]["mean_us"]),
        "arrival_skew_p50_us": med(lambda x: x["arrival_skew"]["p50_us"]),
        "arrival_skew_p99_us": med(lambda x: x["arrival_skew"]["p99_us"]),
        "arrival_skew_mean_us": med(lambda x: x["arrival_skew"]["mean_us"]),
        "post_latest_arrival_p50_us": med(lambda x: x["post_latest_arrival"]["p50_us"]),
        "post_latest_arrival_p99_us": med(lambda x: x["post_latest_arrival"]["p99_us"]),
        "post_latest_arrival_mean_us": med(lambda x: x["post_latest_arrival"]["mean_us"]),
        "gloo_p50_us": med(lambda x: x["gloo"]["p50_us"]),
        "gloo_p99_us": med(lambda x: x["gloo"]["p99_us"]),
        "speedup_p50": med(lambda x: x["speedup_p50"]),
        "call_stock_p50_us": med(lambda x: x["call"]["stock"]["p50_us"]),
        "call_stock_p99_us": med(lambda x: x["call"]["stock"]["p99_us"]),
        "call_harden_p50_us": med(lambda x: x["call"]["harden"]["p50_us"]),
        "call_harden_p99_us": med(lambda x: x["call"]["harden"]["p99_us"]),
        "call_speedup_p50": med(lambda x: x["call"]["speedup_p50"]),
    }
    m = {k: v["median"] for k, v in spread.items()}
    identical = not r0["bad"] and not r1["bad"]
    split_bad = sum(res.get("split_mismatches", 0) for r in (r0, r1) for res in r["rounds"])
    return {
        "iters": int(iters),
        "rounds": int(rounds),
        # medians over the rounds (each round: one block of every path, stock and ours alternating first)
        "native": {"p50_us": m["native_p50_us"], "p99_us": m["native_p99_us"], "mean_us": m["native_mean_us"]},
        # the raw native exchange's own split (rank 0's stats): how far apart the ranks arrived, and what
        # the exchange took after the later arrival (the part the channel itself costs)
        "arrival_skew": {
            "p50_us": m["arrival_skew_p50_us"],
            "p99_us": m["arrival_skew_p99_us"],
            "mean_us": m["arrival_skew_mean_us"],
        },
        "post_latest_arrival": {
            "p50_us": m["post_latest_arrival_p50_us"],
            "p99_us": m["post_latest_arrival_p99_us"],
            "mean_us": m["post_latest_arrival_mean_us"],
        },
        "gloo": {"p50_us": m["gloo_p50_us"], "p99_us": m["gloo_p99_us"]},
        "speedup_p50": m["speedup_p50"],
        "call": {
            "stock": {"p50_us": m["call_stock_p50_us"], "p99_us": m["call_stock_p99_us"]},
            "harden": {"p50_us": m["call_harden_p50_us"], "p99_us": m["call_harden_p99_us"]},
            "speedup_p50": m["call_speedup_p50"],
            "identical": identical,
        },
        # every raw native call of both ranks checked: its arrival_skew / post_latest_arrival add up to its total
        "split_checked": int(2 * rounds * iters),
        "split_mismatches": int(split_bad),
        "spread": spread,
        "per_round": per_round,
        "_mismatches": r0["bad"][:3] + r1["bad"][:3],
    }


def main(args) -> int:
    if args.iters <= 0:
        print("dspark-harden bench dp2: --iters must be positive", file=sys.stderr)
        return 2
    rounds = getattr(args, "rounds", 5)
    if rounds <= 0:
        print("dspark-harden bench dp2: --rounds must be positive", file=sys.stderr)
        return 2
    res = run(args.iters, args.spin_us, not args.no_pin, rounds)
    mismatches = res.pop("_mismatches")
    if args.json:
        print(json.dumps(res))
    else:
        sp = res["spread"]

        def line(label: str, key: str, unit: str = "us") -> str:
            v = sp[key]
            return f"  {label:22s} median {v['median']:9.2f} {unit}  (min {v['min']:.2f}, max {v['max']:.2f})"

        print(f"iters {res['iters']} per block, {res['rounds']} rounds (stock and ours alternate; medians over rounds)")
        print(line("raw native p50", "native_p50_us"))
        print(line("raw native p99", "native_p99_us"))
        print(line("raw native mean", "native_mean_us"))
        print(line("arrival skew p50", "arrival_skew_p50_us"))
        print(line("arrival skew p99", "arrival_skew_p99_us"))
        print(line("arrival skew mean", "arrival_skew_mean_us"))
        print(line("post-latest p50", "post_latest_arrival_p50_us"))
        print(line("post-latest p99", "post_latest_arrival_p99_us"))
        print(line("post-latest mean", "post_latest_arrival_mean_us"))
        print(line("raw gloo p50", "gloo_p50_us"))
        print(line("raw gloo p99", "gloo_p99_us"))
        print(line("raw speedup p50", "speedup_p50", "x "))
        print(line("call stock p50", "call_stock_p50_us"))
        print(line("call stock p99", "call_stock_p99_us"))
        print(line("call harden p50", "call_harden_p50_us"))
        print(line("call harden p99", "call_harden_p99_us"))
        print(line("call speedup p50", "call_speedup_p50", "x "))
        print(f"  identical: {res['call']['identical']}")
        print(
            f"  native split adds up: {res['split_checked'] - res['split_mismatches']} of {res['split_checked']} calls"
        )
    if mismatches:
        print(f"MISMATCHES: {mismatches}", file=sys.stderr)
    return 0 if res["call"]["identical"] and not res["split_mismatches"] else 1
