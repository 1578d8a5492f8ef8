"""``dspark-harden bench dspark-results``: scheduler-thread blocked time per DSpark decode step, stock
conversion (``copy_done.synchronize()`` + ``.tolist()`` on the scheduler thread, twice: the grammar
barrier's ``advance_grammar_fsm`` inside the next verify, then ``_resolve_spec_v2_tokens``) vs the
materializer (``submit`` behind the copy enqueue, ``record_of`` at both consumers), with the compute
stream busy, in alternating blocks. Needs CUDA (on a host without it: a message and exit status 2).

The step loop is :mod:`~dspark_harden.dspark_results.gpu_loop` (stand-in graph-output buffers; no
SGLang server or DSpark model can run on the GPU machine): per step ``k`` the draft GEMMs, the barrier
on step ``k-1``, the verify GEMMs and the in-place rewrite of the outputs, stock's copy enqueue, the
result processing of step ``k-1``, then ``--cpu-ms`` of scheduler Python work. Every list read on
either path is checked against the closed form of its step: ``identical`` is false (and the exit
status 1) when one differs.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from .settings import SWITCH_INTERVAL_DEFAULT_US

BARRIER_FIELDS = ("next_token_ids", "accept_lens")  # what advance_grammar_fsm converts


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "dspark-results", help="DSpark results: scheduler-thread blocked time, stock vs background materializer (CUDA)"
    )
    p.add_argument("--steps", type=int, default=2000, help="measured steps per path (default 2000)")
    p.add_argument("--blocks", type=int, default=10, help="alternating blocks per path (default 10)")
    p.add_argument("--requests", type=int, default=64, help="requests per step (default 64)")
    p.add_argument("--stride", type=int, default=8, help="draft tokens per request (default 8)")
    p.add_argument("--busy-ms", type=float, default=2.0, help="GPU time of one step's forward (default 2.0)")
    p.add_argument(
        "--busy-kind",
        choices=("sleep", "gemm"),
        default="sleep",
        help="sleep: one long kernel per step, like a graph replay (default); gemm: many GEMM launches",
    )
    p.add_argument(
        "--cpu-ms",
        type=float,
        default=0.5,
        help="scheduler-thread Python work per step after the result processing (default 0.5)",
    )
    p.add_argument(
        "--switch-interval-us",
        type=int,
        default=SWITCH_INTERVAL_DEFAULT_US,
        help="GIL switch interval of the materializer's blocks, in µs, as the feature sets it in the scheduler "
        f"process (DSPARK_HARDEN_DSPARK_RESULTS_SWITCH_INTERVAL_US, default {SWITCH_INTERVAL_DEFAULT_US}; 0: "
        "the interpreter's); stock's blocks always run at the interpreter's",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def _pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _summary(per_step: list) -> dict:
    return {
        "blocked_us_p50": round(statistics.median(per_step), 2),
        "blocked_us_p99": round(_pct(per_step, 0.99), 2),
        "blocked_us_mean": round(statistics.fmean(per_step), 2),
    }


def run(
    steps: int = 2000,
    blocks: int = 10,
    requests: int = 64,
    stride: int = 8,
    busy_ms: float = 2.0,
    cpu_ms: float = 0.5,
    busy_kind: str = "sleep",
    switch_interval_us: int = 0,
) -> dict:
    """The measurement (CUDA); returns the JSON object the command prints."""
    from . import gpu_loop
    from .materializer import Materializer, record_of

    loop = gpu_loop.StandInDecode(requests, stride, busy_ms, kind=busy_kind)
    outcomes: list = []
    mat = Materializer(queue_size=4, timeout_s=30.0, count=outcomes.append)
    draft_frac = 0.25
    state = {"step": 0}
    out: dict = {
        p: {"blocked": [], "barrier": [], "resolve": [], "submit": [], "step": [], "bad": 0}
        for p in ("stock", "harden")
    }

    interpreter_interval = sys.getswitchinterval()

    def block(path: str, n: int, record: bool) -> None:
        harden = path == "harden"
        if harden and switch_interval_us > 0:
            sys.setswitchinterval(switch_interval_us / 1e6)  # as apply_switch_interval in the scheduler
        try:
            run_block(path, n, record)
        finally:
            sys.setswitchinterval(interpreter_interval)

    def run_block(path: str, n: int, record: bool) -> None:
        acc = out[path]
        prev = None
        harden = path == "harden"
        for _ in range(n + 1):  # +1: the first step has no previous result to consume
            k = state["step"] = state["step"] + 1
            t_step = time.perf_counter()
            loop.busy(draft_frac)
            if prev is not None:  # the grammar barrier inside verify(k): advance_grammar_fsm(k-1)
                t = time.perf_counter()
                if harden:
                    got_a = gpu_loop.record_lists(record_of(prev, "advance_grammar_fsm"))
                else:
                    prev.copy_done.synchronize()
                    got_a = {f: getattr(prev, f).tolist() for f in BARRIER_FIELDS}
                barrier = time.perf_counter() - t
            loop.busy(1.0 - draft_frac)
            loop.rewrite(k)
            result = loop.enqueue_copy(k)
            t = time.perf_counter()
            if harden:
                mat.submit(result, result.copy_done, False)
            submit = time.perf_counter() - t
            if prev is not None:  # process_batch_result_decode(k-1) -> _resolve_spec_v2_tokens
                t = time.perf_counter()
                if harden:
                    got_b = gpu_loop.record_lists(record_of(prev, "_resolve_spec_v2_tokens"))
                else:
                    got_b = gpu_loop.stock_lists(prev)
                resolve = time.perf_counter() - t
                want = loop.expected(prev.step)
                if got_b != want or any(got_a[f] != want[f] for f in BARRIER_FIELDS):
                    acc["bad"] += 1
                if record:
                    acc["barrier"].append(barrier * 1e6)
                    acc["resolve"].append(resolve * 1e6)
                    acc["blocked"].append((barrier + resolve) * 1e6)
                    acc["submit"].append(submit * 1e6)
            gpu_loop.spin_cpu(cpu_ms / 1000.0)
            if record and prev is not None:
                acc["step"].append((time.perf_counter() - t_step) * 1e6)
            prev = result
        # the last result: consume it so nothing is left in flight
        if harden:
            record_of(prev, "drain")
        else:
            prev.copy_done.synchronize()
        loop.drain()

    try:
        block("stock", 50, False)
        block("harden", 50, False)  # warm-up: thread start, pinned allocator
        per = max(1, steps // max(1, blocks))
        for i in range(blocks):
            order = ("stock", "harden") if i % 2 == 0 else ("harden", "stock")
            for path in order:
                block(path, per, True)
    finally:
        mat.shutdown(5.0)
    res: dict = {
        "requests": requests,
        "stride": stride,
        "busy_ms": busy_ms,
        "busy_kind": busy_kind,
        "busy_units_per_step": loop.busy_units,
        "cpu_ms": cpu_ms,
        "switch_interval_us": {
            "stock": round(interpreter_interval * 1e6, 1),
            "harden": switch_interval_us if switch_interval_us > 0 else round(interpreter_interval * 1e6, 1),
        },
        "blocks": blocks,
        "steps_per_path": len(out["stock"]["blocked"]),
    }
    for path in ("stock", "harden"):
        acc = out[path]
        res[path] = dict(
            _summary(acc["blocked"]),
            barrier_us_p50=round(statistics.median(acc["barrier"]), 2),
            resolve_us_p50=round(statistics.median(acc["resolve"]), 2),
            submit_us_p50=round(statistics.median(acc["submit"]), 2),
            step_us_p50=round(statistics.median(acc["step"]), 2),
            wrong_lists=acc["bad"],
        )
    res["harden"]["converted_by_consumer"] = outcomes.count("converted_by_consumer")
    res["harden"]["converted_by_thread"] = outcomes.count("materialized")
    res["identical"] = out["stock"]["bad"] == 0 and out["harden"]["bad"] == 0
    h = res["harden"]["blocked_us_p50"]
    res["blocked_p50_ratio_stock_over_harden"] = round(res["stock"]["blocked_us_p50"] / h, 3) if h > 0 else None
    return res


def main(args: Any) -> int:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        print(f"dspark-harden bench dspark-results needs torch with CUDA: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("dspark-harden bench dspark-results needs CUDA (no CUDA device here)", file=sys.stderr)
        return 2
    if args.switch_interval_us < 0:
        print(f"--switch-interval-us must be >= 0, got {args.switch_interval_us}", file=sys.stderr)
        return 2
    res = run(
        args.steps,
        args.blocks,
        args.requests,
        args.stride,
        args.busy_ms,
        args.cpu_ms,
        args.busy_kind,
        switch_interval_us=args.switch_interval_us,
    )
    if args.json:
        print(json.dumps(res))
    else:
        for path in ("stock", "harden"):
            r = res[path]
            print(
                f"{path:7s} blocked p50 {r['blocked_us_p50']:9.1f} us  p99 {r['blocked_us_p99']:9.1f} us  "
                f"(barrier {r['barrier_us_p50']:.1f}, resolve {r['resolve_us_p50']:.1f}, submit {r['submit_us_p50']:.1f}; "
                f"step {r['step_us_p50']:.0f} us; wrong lists {r['wrong_lists']})"
            )
        print(f"identical: {res['identical']}; stock/harden blocked p50: {res['blocked_p50_ratio_stock_over_harden']}")
    if not res["identical"]:
        print(
            "dspark-harden bench dspark-results: a list differed from its step's values (see wrong_lists)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":  # the GPU host runs it without the CLI's plugin manager: python -m ...dspark_results.bench
    import argparse

    _p = argparse.ArgumentParser(prog="dspark-harden bench")
    register(_p.add_subparsers())
    sys.exit(main(_p.parse_args(["dspark-results"] + sys.argv[1:])))
