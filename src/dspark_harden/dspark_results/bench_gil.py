"""``dspark-harden bench switch-interval``: what the materializer's GIL switch interval costs the
scheduler thread when the scheduler process has other Python threads busy (issue 39).

``DSPARK_HARDEN_DSPARK_RESULTS_SWITCH_INTERVAL_US`` (default 200 µs) is process-wide: once set, every
thread of the scheduler process that wants the GIL gets it within 200 µs instead of 5 ms. The scheduler's
own loop then competes with the grammar service's compile threads (real xgrammar compiles of new schemas,
32k-token tokenizer, as many as ``DSPARK_HARDEN_GRAMMAR_WORKERS``) and the persister/metric threads
(pure Python: here a thread re-serializing a JSON document). This bench runs a scheduler-shaped loop
(``--work-us`` of Python per iteration, then a ``--wait-us`` blocking wait that releases the GIL, as the
scheduler's wait for a step's results does) with those threads busy, at the interpreter's interval and at
the feature's, in alternating blocks, and reports the loop iteration's p50/p99 for each. The JSON object:
``{"default": {...}, "feature": {...}, "ratio_p99": feature/default}``.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from typing import Any

from .settings import SWITCH_INTERVAL_DEFAULT_US


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "switch-interval",
        help="scheduler-loop latency with grammar compiles in flight: interpreter GIL switch interval vs the "
        "DSpark results feature's",
    )
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks per interval (default 6)")
    p.add_argument("--iterations", type=int, default=400, help="loop iterations per block (default 400)")
    p.add_argument("--work-us", type=float, default=300.0, help="Python work per iteration (default 300)")
    p.add_argument("--wait-us", type=float, default=1000.0, help="GIL-free wait per iteration (default 1000)")
    p.add_argument("--compilers", type=int, default=4, help="grammar compile threads (default 4)")
    p.add_argument("--python-threads", type=int, default=1, help="pure-Python busy threads (default 1)")
    p.add_argument("--vocab", type=int, default=32000, help="tokenizer vocabulary (default 32000)")
    p.add_argument("--interval-us", type=int, default=SWITCH_INTERVAL_DEFAULT_US, help="the feature's interval")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def _spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    x = 0
    while time.perf_counter() < end:
        x += 1


def _pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args: Any) -> dict:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from ..devtools.tiny_models import ensure_tokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(ensure_tokenizer(args.vocab)))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    stop = threading.Event()
    compiled = [0]

    def compile_loop(k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            props = {f"f{k}_{n}_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(12)}
            compiler.compile_json_schema(json.dumps({"type": "object", "properties": props, "required": list(props)}))
            compiled[0] += 1

    doc = {"entries": [{"key": f"k{i}", "bytes": i * 17, "ok": True} for i in range(200)]}

    def python_loop() -> None:
        while not stop.is_set():
            json.loads(json.dumps(doc))

    threads = [threading.Thread(target=compile_loop, args=(k,), daemon=True) for k in range(args.compilers)]
    threads += [threading.Thread(target=python_loop, daemon=True) for _ in range(args.python_threads)]
    default_interval = sys.getswitchinterval()
    lat = {"default": [], "feature": []}
    wait = threading.Event()
    for t in threads:
        t.start()
    try:
        for b in range(2 * args.blocks):
            side = ("default", "feature")[b % 2]
            sys.setswitchinterval(default_interval if side == "default" else args.interval_us / 1e6)
            for i in range(args.iterations):
                t0 = time.perf_counter()
                _spin(args.work_us)
                wait.wait(args.wait_us / 1e6)  # releases the GIL, like the scheduler's wait for results
                if i >= 20:  # the first iterations after a switch settle the other threads
                    lat[side].append((time.perf_counter() - t0) * 1e6)
    finally:
        sys.setswitchinterval(default_interval)
        stop.set()
        for t in threads:
            t.join(30)
    floor = args.work_us + args.wait_us
    out = {}
    for side, xs in lat.items():
        out[side] = {
            "interval_us": round((default_interval if side == "default" else args.interval_us / 1e6) * 1e6),
            "iterations": len(xs),
            "p50_us": round(statistics.median(xs), 1),
            "p99_us": round(_pct(xs, 0.99), 1),
            "max_us": round(max(xs), 1),
            "floor_us": floor,
        }
    out["ratio_p99"] = round(out["feature"]["p99_us"] / out["default"]["p99_us"], 3)
    out["compiles"] = compiled[0]
    out["threads"] = {"compilers": args.compilers, "python": args.python_threads}
    return out


def main(args: Any) -> int:
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return 0
    for side in ("default", "feature"):
        r = out[side]
        print(
            f"{side:8s} switch interval {r['interval_us']:>5d} µs: loop p50 {r['p50_us']:.0f} µs, p99 {r['p99_us']:.0f} µs,"
            f" max {r['max_us']:.0f} µs (floor {r['floor_us']:.0f} µs, {r['iterations']} iterations)"
        )
    print(f"p99 ratio feature/default: {out['ratio_p99']}; {out['compiles']} grammars compiled meanwhile")
    return 0
