"""``dspark-harden bench prefill-admission``: stock's DP2 prefill-graph admission vs ours on a trace.

Each rank's forward-time batch is a REAL ``ForwardBatch``: the trace step becomes, per rank, a real
``ScheduleBatch`` of real ``Req``s over real pools and a real ``RadixCache`` (stock
``prepare_for_extend`` / ``prepare_for_decode`` / ``mix_with_running`` / ``prepare_for_idle``), both
ranks run stock ``dp_attn.prepare_mlp_sync_batch_raw`` (the vote, the ``MLPSyncBatchInfo`` row,
stock ``all_gather``, ``_update_gather_batch``), stock ``maybe_convert_decode_to_extend``, stock
``ForwardBatch.init_new`` with the capture mode the rank's worker passes, stock
``ModelRunner._prepare_eager_forward_batch`` -> ``ForwardBatch.prepare_mlp_sync_batch``, and
whether the rank replays is stock ``ModelRunner._forward_raw``'s prefill-graph condition compiled
from its source, evaluated on that batch. The stock side runs exactly that (stock's own code path:
its splits are counted there); the harden side runs the same with the feature's three wrappers
(:mod:`.admission`) in place of the stock vote, finalisation and ``can_run_graph``.

Stand-ins (what needs a GPU, a model or a running engine; see :mod:`.world`): the model runner's
attributes, the transport between the two ranks (in-process, both ranks in this process), a decode
row's next token, and the prefill-graph runner's capture state (an object of the real
``PrefillCudaGraphRunner`` class whose state is what ``__init__`` derives from the capture
configuration; with the full backend, the real DeepSeek-V4 backend hooks bound to a stand-in
backend). The result is a count, not a timing: deterministic for a given trace and configuration.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from . import decision as D
from . import trace as T
from .runner import capture_config

EAGER_VOTE = "dp_verdict"  # stock side: the shared min-reduced vote said eager


def _eager_reason(r, results, side: str, runner) -> str:
    """Why rank result ``r`` ran eager (``eager_tokens_by_reason``)."""
    if r.raised is not None:
        return f"divergence:{r.raised.check}"
    if side == "harden":
        if r.guard_outcome == "eager_uniform":
            return "eager_uniform"
        dec = r.decision
        if dec is not None and not dec.graph:
            own = r.local_reason
            peers = [p.local_reason for p in results if p is not r and p.local_reason]
            if dec.reason == "peer_vote":
                return own or (peers[0] if peers else "peer_vote")
            return dec.reason
        if dec is None:
            return r.local_reason or "stock_vote"
        return "forward_raw"  # admitted and the guard passed, yet _forward_raw ran eager (would be a split)
    if not r.verdict:
        return EAGER_VOTE
    if r.fb is None or not r.fb.forward_mode.is_extend():
        return "no_extend_forward"
    fails = D.local_failures(runner, r.fb, num_tokens=len(r.fb.input_ids), schedule_time=False)
    if runner._has_inactive_dp_rank(r.fb):
        fails = ["inactive_dp_rank"] + fails
    return fails[0] if fails else "can_run_graph"


def run(world, steps, *, progress=None) -> dict:
    """Replay ``steps`` through ``world`` (a :class:`.world.World`) on both sides."""
    report: dict = {"batches": sum(1 for s in steps if any(r.mode in ("extend", "mixed") for r in s.ranks))}
    raised_total = 0
    for side in ("stock", "harden"):
        tot = cov = splits = executed = useful = 0
        eager: dict = {}
        for i, step in enumerate(steps):
            results = world.step(step, side)
            tokens = [rs.extend_tokens for rs in step.ranks]
            tot += sum(tokens)
            for r, t in zip(results, tokens):
                if r.replays:
                    cov += t
                    useful += t
                    executed += len(r.fb.input_ids)
                elif t:
                    why = _eager_reason(r, results, side, world.runners[side, r.rank])
                    eager[why] = eager.get(why, 0) + t
                raised_total += side == "harden" and r.raised is not None
            splits += results[0].replays != results[1].replays
            if progress is not None:
                progress(side, i)
        report[side] = {
            "graph_token_coverage": round(cov / tot, 6) if tot else 0.0,
            "splits": int(splits),
            "padding_overhead": round((executed - useful) / useful, 6) if useful else 0.0,
            "eager_tokens_by_reason": dict(sorted(eager.items(), key=lambda kv: (-kv[1], kv[0]))),
        }
    report["harden"]["guard_raised"] = int(raised_total)
    return report


def main(args) -> int:
    from . import world as W

    try:
        steps = (
            T.read_jsonl(args.trace)
            if args.trace
            else T.generate(T.TraceShape(**({"steps": args.steps} if args.steps else {})))
        )
        cfg = capture_config(args.buckets)
    except (T.TraceError, ValueError, OSError) as exc:
        print(f"bench prefill-admission: {exc}", file=sys.stderr)
        return 2
    steps = list(steps)
    world = W.World(cfg, backend=args.backend, spec=args.spec, factor=args.factor, sizes=W.Sizes.for_trace(steps))
    try:
        full = run(world, steps)
    finally:
        world.close()
    raised = full["harden"].pop("guard_raised")
    if args.json:
        print(json.dumps(full))
    else:
        source = (
            args.trace or f"built-in generator {asdict(T.TraceShape(**({'steps': args.steps} if args.steps else {})))}"
        )
        print(f"prefill-admission: {full['batches']} DP2 steps with prefill; trace: {source}")
        print(
            f"  capture: {args.backend} backend, {len(cfg.buckets)} buckets {cfg.buckets[0]}..{cfg.buckets[-1]}"
            f"{'' if args.buckets else ' (stock default for a 16384-token per-rank chunk)'}, "
            f"{cfg.slots if args.backend == 'full' else 'no fixed'} request slots; speculative: {args.spec}; "
            f"padding factor {args.factor:g} (stock {D.STOCK_PADDING_FACTOR})"
        )
        for side in ("stock", "harden"):
            r = full[side]
            print(
                f"  {side:6s}: graph-token coverage {r['graph_token_coverage']:.4f}  splits {r['splits']}  "
                f"padding overhead {r['padding_overhead']:.4f}"
            )
            total = sum(r["eager_tokens_by_reason"].values())
            for why, n in r["eager_tokens_by_reason"].items():
                print(f"          eager {why:28s} {n:>10d} tokens ({n / total:.1%} of eager)")
    if raised:
        print(
            f"bench prefill-admission: the harden guard raised {raised} time(s): a forward-time check was not "
            f"folded into the vote (a bug; report it with the trace)",
            file=sys.stderr,
        )
        return 1
    return 0
