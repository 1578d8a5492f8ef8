"""The native DP2 exchange with no GPU work, two processes, many iterations per configuration, and for
every large call what explains it (issue 25 §5: idle maxima of 1.09 / 4.48 / 12.75 ms on the H200).

Run: ``python3 tests/gpu/dp2_idle.py [--iters N] [--only NAME,...] [--json PATH]`` with
``dspark_harden._dp2_native`` built (tests/gpu/run_dp2_idle_on_device.sh does both). Needs no GPU except
for the ``cuda-*`` configurations (each rank imports torch and makes a CUDA context on GPU 0, as the
two-rank test does).

What one iteration measures, per rank: one ``Channel.exchange`` (the product's hot call: one bound native
call), timed by the native stats (``total_ns``: publish + wait for the peer + copy; ``post_latest_arrival_ns``:
from the later of the two arrivals to this rank's finish, i.e. the exchange's own latency with the peer's
lateness taken out; ``arrival_skew_ns``; ``futex_waits``: 0 when the spin window sufficed, >= 1 when the
waiter fell from the spin into a futex sleep). Around the call, outside the timed region: getrusage
(RUSAGE_THREAD: voluntary / involuntary context switches, minor / major page faults), the thread's CPU
time (CLOCK_THREAD_CPUTIME_ID), the /proc schedstat run delay (time runnable but waiting on a run
queue), the CPU (sched_getcpu) before and after, and the number of garbage collections so far
(gc.callbacks). The same quantities from just before the peer's previous call to just before this one
(what the peer did before it arrived) explain a peer's late arrival.

Each rank's row is a function of the iteration and the rank; every value a rank receives is compared with
it. Exit code 1 if any value was wrong or a rank failed; the timing goal (max <= 1 ms) is reported, never
enforced (it depends on the host).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid
from array import array

W = 11
FIELDS = (
    "wa",
    "wb",
    "t0",
    "t1",
    "total",
    "post",
    "skew",
    "futex",
    "nv_a",
    "nv_b",
    "niv_a",
    "niv_b",
    "flt_a",
    "flt_b",
    "ex_a",
    "ex_b",
    "rd_a",
    "rd_b",
    "cpu_a",
    "cpu_b",
    "gc_a",
    "gc_b",
)

# name, pin ("none" | "own": one core per rank | "stock": SGLANG_SET_CPU_AFFINITY's halves), spin (us),
# cuda (torch + a CUDA context in each rank), hogs (busy processes), hogs_where ("all" | "others": every CPU
# but the ranks'), lean (no per-call instrumentation besides the native stats)
CONFIGS = [
    dict(name="plain-unpinned", pin="none", spin_us=50, cuda=False, hogs=0),
    dict(name="plain-own-core", pin="own", spin_us=50, cuda=False, hogs=0),
    dict(name="cuda-unpinned", pin="none", spin_us=50, cuda=True, hogs=0),
    dict(name="cuda-unpinned-lean", pin="none", spin_us=50, cuda=True, hogs=0, lean=True),
    dict(name="cuda-own-core", pin="own", spin_us=50, cuda=True, hogs=0),
    dict(name="cuda-stock-affinity", pin="stock", spin_us=50, cuda=True, hogs=0),
    dict(name="cuda-unpinned-spin1000", pin="none", spin_us=1000, cuda=True, hogs=0),
    dict(name="cuda-unpinned-spin0", pin="none", spin_us=0, cuda=True, hogs=0),
    dict(name="load16-unpinned", pin="none", spin_us=50, cuda=False, hogs=16, hogs_where="all"),
    dict(name="load16-own-core", pin="own", spin_us=50, cuda=False, hogs=16, hogs_where="all"),
    dict(name="load14-own-core-isolated", pin="own", spin_us=50, cuda=False, hogs=14, hogs_where="others"),
]


def _cpus() -> list:
    return sorted(os.sched_getaffinity(0))


def rank_cpus(pin: str, rank: int) -> list | None:
    cpus = _cpus()
    if pin == "none" or len(cpus) < 2:
        return None
    if pin == "own":
        # two cores apart from CPU 0 (where the host's housekeeping tends to land), in different halves
        return [cpus[(1 + rank * (len(cpus) // 2)) % len(cpus)]]
    if pin == "stock":
        # sglang.srt.utils.common.set_gpu_proc_affinity with tp_size_per_node = 2 (DP2, attention TP1)
        try:
            import psutil

            pcores = psutil.cpu_count(logical=False) or len(cpus)
            logical = psutil.cpu_count() or len(cpus)
        except ImportError:
            pcores = logical = len(cpus)
        n = pcores // 2
        ids = list(range(rank * n % pcores, rank * n % pcores + n))
        if logical != pcores:
            ids += [i + pcores for i in ids]
        return ids
    raise ValueError(pin)


def _rank_main(rank: int, cfg: dict, session: str, iters: int, deadline_s: float, q) -> None:
    try:
        q.put(_rank(rank, cfg, session, iters, deadline_s))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        q.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"})


def _row(rank: int, i: int, stop: int) -> list:
    return [i, stop if rank == 0 else 0, rank] + [i * 131 + rank * 7 + j for j in range(W - 3)]


def _rank(rank: int, cfg: dict, session: str, iters: int, deadline_s: float) -> dict:
    import resource

    cpus = rank_cpus(cfg["pin"], rank)
    if cpus is not None:
        os.sched_setaffinity(0, set(cpus))
    if cfg.get("cuda"):
        import torch

        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    from dspark_harden.dp2.native import Channel

    libc = ctypes.CDLL(None, use_errno=True)
    getcpu = libc.sched_getcpu
    getrusage, RT = resource.getrusage, resource.RUSAGE_THREAD
    fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    pread = os.pread
    tcpu = time.thread_time_ns  # CLOCK_THREAD_CPUTIME_ID: exact (schedstat's own run time lags until a tick)
    gcn = [0]

    def on_gc(phase, info):
        if phase == "start":
            gcn[0] += 1

    gc.callbacks.append(on_gc)
    ch = Channel(
        session,
        cfg["name"][:40],
        rank=rank,
        width=W,
        timeout_ms=60_000,
        spin_ns=cfg["spin_us"] * 1000,
        config_digest=25,
    )
    st = ch.stats
    lean = bool(cfg.get("lean"))
    corrupt_at = cfg.get("corrupt_at", -1)
    warm = 5_000
    n = iters
    rec = {f: array("q", bytes(8 * n)) for f in FIELDS}
    t0a, t1a, tot, post, skew, fut = (rec[k] for k in ("t0", "t1", "total", "post", "skew", "futex"))
    waa, wba = rec["wa"], rec["wb"]
    nva, nvb, niva, nivb, flta, fltb = (rec[k] for k in ("nv_a", "nv_b", "niv_a", "niv_b", "flt_a", "flt_b"))
    exa, exb, rda, rdb, cpa, cpb, gca, gcb = (
        rec[k] for k in ("ex_a", "ex_b", "rd_a", "rd_b", "cpu_a", "cpu_b", "gc_a", "gc_b")
    )
    pc = time.perf_counter_ns
    bad = []
    ex = ch.exchange
    for i in range(warm):
        ex(_row(rank, -1 - i, 0))
    start = time.monotonic()
    done = 0
    stop = 0
    for i in range(n):
        if rank == 0 and not stop and (i == n - 1 or (i & 1023) == 0 and time.monotonic() - start > deadline_s):
            stop = 1
        row = _row(rank, i, stop)
        if rank == 1 and i == corrupt_at:
            row[3] += 1  # negative control (--corrupt-at): one wrong value the peer must catch
        if lean:
            t0 = pc()
            out = ex(row)
            t1 = pc()
        else:
            wa = pc()
            ra = getrusage(RT)
            sa = pread(fd, 128, 0).split()
            xa = tcpu()
            ca = getcpu()
            ga = gcn[0]
            t0 = pc()
            out = ex(row)
            t1 = pc()
            gb = gcn[0]
            cb = getcpu()
            xb = tcpu()
            sb = pread(fd, 128, 0).split()
            rb = getrusage(RT)
            waa[i], wba[i] = wa, pc()
            nva[i], nvb[i], niva[i], nivb[i] = ra.ru_nvcsw, rb.ru_nvcsw, ra.ru_nivcsw, rb.ru_nivcsw
            flta[i], fltb[i] = ra.ru_minflt + ra.ru_majflt, rb.ru_minflt + rb.ru_majflt
            exa[i], exb[i], rda[i], rdb[i] = xa, xb, int(sa[1]), int(sb[1])
            cpa[i], cpb[i], gca[i], gcb[i] = ca, cb, ga, gb
        t0a[i], t1a[i] = t0, t1
        tot[i], post[i], skew[i], fut[i] = st.total_ns, st.post_latest_arrival_ns, st.arrival_skew_ns, st.futex_waits
        if out[:W] != _row(0, i, out[1]) or out[W:] != _row(1, i, 0) or out[1] not in (0, 1):
            if len(bad) < 20:
                bad.append({"i": i, "got": out})
            else:
                bad.append(i)
        done = i + 1
        if out[1] == 1:
            break
    ch.close()
    os.close(fd)
    return {
        "rank": rank,
        "cpus": cpus,
        "allowed": sorted(os.sched_getaffinity(0)),
        "n": done,
        "wall_s": time.monotonic() - start,
        "bad": bad[:20],
        "n_bad": len(bad),
        "rec": {k: v[:done].tobytes() for k, v in rec.items()},
        "lean": lean,
        "pid": os.getpid(),
    }


def _proc_stat() -> dict:
    """Per-CPU jiffies from /proc/stat: irq, softirq, steal (steal: time the hypervisor ran something else)."""
    out = {}
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith("cpu"):
                p = line.split()
                out[p[0]] = {"irq": int(p[6]), "softirq": int(p[7]), "steal": int(p[8]) if len(p) > 8 else 0}
    return out


def _start_hogs(k: int, where: str, exclude: list) -> list:
    if k <= 0:
        return []
    allowed = _cpus()
    cpus = [c for c in allowed if c not in exclude] if where == "others" else allowed
    if not cpus:
        print(f"  (no CPU outside {exclude} for the {k} busy processes: none started)")
        return []
    code = (
        "import os,sys; os.sched_setaffinity(0, set(int(c) for c in sys.argv[1].split(',')))\nx = 0\nwhile True: x += 1"
    )
    procs = []
    for j in range(k):
        mine = [cpus[j % len(cpus)]] if where == "others" else cpus
        procs.append(subprocess.Popen([sys.executable, "-c", code, ",".join(map(str, mine))]))
    time.sleep(0.5)
    return procs


def _pct(xs, q):
    """Nearest-rank percentile of a sorted list."""
    import math

    return xs[max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))]


def _summary(v: list) -> dict:
    xs = sorted(v)
    us = lambda x: round(x / 1e3, 2)  # noqa: E731
    return {
        "p50": us(_pct(xs, 0.5)),
        "p99": us(_pct(xs, 0.99)),
        "p99.9": us(_pct(xs, 0.999)),
        "p99.99": us(_pct(xs, 0.9999)),
        "max": us(xs[-1]),
        "n_over_100us": sum(1 for x in xs if x > 100_000),
        "n_over_1ms": sum(1 for x in xs if x > 1_000_000),
    }


def _explain(i: int, me: dict, peer: dict, lean: bool) -> dict:
    """Why call i of this rank took long: its own wait (spin / futex sleep, preempted, page faults, GC), or the
    peer's late arrival, explained by what the peer's thread did from just before its call i-1 to just before
    its call i (a preemption in the tail of its call i-1 delays its arrival at i as much as one between calls).
    A span's time splits into: on a CPU (CLOCK_THREAD_CPUTIME_ID), runnable but waiting for a CPU (schedstat run
    delay), asleep (only if it switched voluntarily) and the rest, which this guest's kernel does not see at all
    (the vCPU not running: host preemption / steal, or time in interrupts)."""
    us = lambda x: round(x / 1e3, 1)  # noqa: E731
    d = {
        "i": i,
        "total_us": us(me["total"][i]),
        "post_latest_us": us(me["post"][i]),
        "skew_us": us(me["skew"][i]),
        "futex_waits": me["futex"][i],
    }
    if lean:
        return d

    def span(r, a, b, ka, kb):  # from rank r's read set ka (suffix "a" or "b") at iteration a to kb at b
        wall = r["w" + kb][b] - r["w" + ka][a]
        ex_, rd_ = r["ex_" + kb][b] - r["ex_" + ka][a], r["rd_" + kb][b] - r["rd_" + ka][a]
        return {
            "wall_us": us(wall),
            "on_cpu_us": us(ex_),
            "runnable_waiting_us": us(rd_),
            "rest_us": us(wall - ex_ - rd_),
            "nvcsw": r["nv_" + kb][b] - r["nv_" + ka][a],
            "nivcsw": r["niv_" + kb][b] - r["niv_" + ka][a],
            "faults": r["flt_" + kb][b] - r["flt_" + ka][a],
            "gc": r["gc_" + kb][b] - r["gc_" + ka][a],
            "cpu": [r["cpu_" + ka][a], r["cpu_" + kb][b]],
        }

    def cause(sp, lost_ns, futex):
        if sp["runnable_waiting_us"] * 1e3 > lost_ns / 2:
            return (
                f"runnable but waiting for a CPU {sp['runnable_waiting_us']} us (nivcsw {sp['nivcsw']}, "
                f"CPU {sp['cpu']}): preempted by another task"
            )
        if sp["gc"]:
            return f"{sp['gc']} garbage collection(s), {sp['on_cpu_us']} us on CPU"
        if sp["faults"] and sp["on_cpu_us"] * 1e3 > lost_ns / 2:
            return f"{sp['faults']} page faults, {sp['on_cpu_us']} us on CPU"
        if sp["on_cpu_us"] * 1e3 > lost_ns / 2:
            return f"on its CPU {sp['on_cpu_us']} us (spinning or its own work)"
        if sp["nvcsw"] or futex:
            return (
                f"asleep (futex: {futex} waits, nvcsw {sp['nvcsw']}) and woken late: {sp['on_cpu_us']} us "
                f"on CPU, {sp['runnable_waiting_us']} us runnable, {sp['rest_us']} us neither (sleep, or host)"
            )
        return (
            f"{sp['rest_us']} us neither on a CPU nor runnable nor asleep as this kernel sees it: the vCPU "
            f"was not running (host preemption / steal) or in interrupts"
        )

    d["own_call"] = own = span(me, i, i, "a", "b")
    pspan = span(peer, i - 1, i, "a", "a") if i > 0 else None
    d["peer_since_call_before"] = pspan
    total, skew = me["total"][i], me["skew"][i]
    why = []
    late_peer = skew > total / 2 and peer["t0"][i] > me["t0"][i]
    if late_peer and pspan is not None:
        why.append(f"peer arrived {us(skew)} us late: {cause(pspan, skew, peer['futex'][i - 1])}")
    own_ns = total - (skew if late_peer else 0)
    if own_ns > total / 2 or not why:
        why.append(f"own {us(own_ns)} us: {cause(own, own_ns, me['futex'][i])}")
    d["why"] = "; ".join(why)
    return d


def run_config(cfg: dict, iters: int, deadline_s: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    session = f"idle-{uuid.uuid4().hex[:12]}"
    excl = sum((rank_cpus(cfg["pin"], r) or [] for r in (0, 1)), [])
    hogs = _start_hogs(cfg.get("hogs", 0), cfg.get("hogs_where", "all"), excl)
    try:
        stat0 = _proc_stat()
        procs = [ctx.Process(target=_rank_main, args=(r, cfg, session, iters, deadline_s, q)) for r in (0, 1)]
        for p in procs:
            p.start()
        res = {}
        for _ in procs:
            r = q.get(timeout=300)
            res[r["rank"]] = r
        for p in procs:
            p.join(30)
        stat1 = _proc_stat()
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
    out = {"config": cfg}
    errors = [res[r]["error"] for r in res if "error" in res[r]]
    if errors:
        out["errors"] = errors
        return out
    recs = {}
    for r in (0, 1):
        rec = {}
        for k, b in res[r]["rec"].items():
            a = array("q")
            a.frombytes(b)
            rec[k] = a
        recs[r] = rec
    out["steal_jiffies"] = {
        c: stat1[c]["steal"] - stat0[c]["steal"] for c in stat1 if c in stat0 and stat1[c]["steal"] != stat0[c]["steal"]
    }
    out["irq_softirq_jiffies_all"] = (
        stat1["cpu"]["irq"] + stat1["cpu"]["softirq"] - stat0["cpu"]["irq"] - stat0["cpu"]["softirq"]
    )
    out["ranks"] = {}
    for r in (0, 1):
        me, peer, lean = recs[r], recs[1 - r], res[r]["lean"]
        n = res[r]["n"]
        order = sorted(range(n), key=lambda k: me["total"][k], reverse=True)[:10]
        info = {
            "n": n,
            "wall_s": round(res[r]["wall_s"], 2),
            "cpus_pinned": res[r]["cpus"],
            "n_bad": res[r]["n_bad"],
            "bad": res[r]["bad"],
            "total_us": _summary(me["total"]),
            "post_latest_arrival_us": _summary(me["post"]),
            "futex_calls": sum(1 for x in me["futex"] if x),
            "outliers": [_explain(k, me, peer, lean) for k in order],
        }
        if not lean:
            info["cpus_seen"] = sorted(set(me["cpu_a"]) | set(me["cpu_b"]))
            info["migrations_between_calls"] = sum(1 for k in range(1, n) if me["cpu_a"][k] != me["cpu_b"][k - 1])
            info["calls_with_nivcsw"] = sum(1 for k in range(n) if me["niv_b"][k] != me["niv_a"][k])
            info["calls_with_nvcsw"] = sum(1 for k in range(n) if me["nv_b"][k] != me["nv_a"][k])
            info["gc_runs"] = me["gc_b"][n - 1] if n else 0
        out["ranks"][r] = info
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=200_000)
    ap.add_argument("--deadline-s", type=float, default=60.0, help="stop a configuration early after this long")
    ap.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    ap.add_argument("--json", default="", help="write the full report here")
    ap.add_argument(
        "--corrupt-at",
        type=int,
        default=-1,
        help="negative control: rank 1 sends one wrong value at this iteration (the run must exit 1)",
    )
    a = ap.parse_args(argv)
    want = [s for s in a.only.split(",") if s]
    cfgs = [dict(c, corrupt_at=a.corrupt_at) for c in CONFIGS if not want or c["name"] in want]
    unknown = set(want) - {c["name"] for c in CONFIGS}
    if unknown:
        ap.error(f"unknown configuration(s) {sorted(unknown)}; known: {[c['name'] for c in CONFIGS]}")
    print(f"cpus allowed {_cpus()} nproc {os.cpu_count()} kernel {os.uname().release}", flush=True)
    reports, rc = [], 0
    for cfg in cfgs:
        t = time.monotonic()
        rep = run_config(cfg, a.iters, a.deadline_s)
        reports.append(rep)
        if "errors" in rep:
            print(f"== {cfg['name']}: ERROR\n" + "\n".join(rep["errors"]), flush=True)
            rc = 1
            continue
        print(
            f"== {cfg['name']} ({time.monotonic() - t:.1f} s; steal jiffies {rep['steal_jiffies']}, "
            f"irq+softirq {rep['irq_softirq_jiffies_all']})",
            flush=True,
        )
        for r, info in rep["ranks"].items():
            if info["n_bad"]:
                rc = 1
            extra = (
                ""
                if cfg.get("lean")
                else (
                    f" cpus {info['cpus_seen']} migrations {info['migrations_between_calls']} calls with nivcsw "
                    f"{info['calls_with_nivcsw']} nvcsw {info['calls_with_nvcsw']} gc {info['gc_runs']}"
                )
            )
            print(
                f"  rank {r}: n {info['n']} bad {info['n_bad']} total_us {info['total_us']} "
                f"post_latest_us {info['post_latest_arrival_us']} futex_calls {info['futex_calls']}{extra}"
            )
            for o in info["outliers"][:10]:
                print(
                    f"    i {o['i']} total {o['total_us']} post {o['post_latest_us']} skew {o['skew_us']} "
                    f"futex {o['futex_waits']}: {o.get('why', '')}"
                )
            if info["n"] < a.iters:
                print(f"  rank {r}: stopped at the deadline after {info['n']} iterations (< {a.iters})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(reports, fh, indent=1)
    print("RESULT", "FAIL (wrong values or a rank error)" if rc else "all exchanged values correct")
    return rc


if __name__ == "__main__":
    sys.exit(main())
