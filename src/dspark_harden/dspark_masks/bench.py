"""``dspark-harden bench traversal``: stock DSpark grammar-mask path vs ours, same run, same inputs.

Stock: SGLang 0.5.23's own ``spec_utils.build_grammar_vocab_mask`` over ``GrammarTree.from_host``
(Python DFS per request). Ours: the DSpark-only replacement as the patched worker calls it
(``DSparkGrammarTree.from_linear_chain`` + ``build_grammar_vocab_mask``), on the CPU device here
(the GPU upload is measured by tests/gpu on the H200). Both run on the same requests (real
tokenizer, real xgrammar grammars, see :mod:`.workload`), interleaved, after a warm-up; the
reported times are medians per verify step, measured in alternating blocks per path (see
``measure``: the stock DFS's allocator debris is charged to the stock path). ``identical`` compares every bit of every mask of
every measured step (ours ``None`` = stock's all-ones mask) and that no grammar state changed.
"""

from __future__ import annotations

import json
import statistics
import time
import types
from typing import Any

import torch

BLOCK = 5  # timed steps per path per block (see measure)


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "traversal", help="DSpark grammar masks: stock Python DFS vs native batched traversal"
    )
    p.add_argument("--requests", type=int, default=64, help="requests per verify step (default 64)")
    p.add_argument("--chain", type=int, default=8, help="draft chain length incl. the committed token (default 8)")
    p.add_argument("--vocab", type=int, default=32000, help="tokenizer vocabulary (default 32000)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per path (default 30)")
    p.add_argument(
        "--mix",
        choices=("json", "all"),
        default="json",
        help="grammar mix: json (JSON schemas + a regex, default) or all (adds an EBNF grammar with "
        "free-text identifiers, where xgrammar's own fills dominate)",
    )
    p.add_argument("--engine", default=None, help="traversal engine (default: DSPARK_HARDEN_GRAMMAR_TRAVERSAL or auto)")
    p.add_argument("--threads", type=int, default=None, help="threads for threads/level engines")
    p.add_argument("--all-engines", action="store_true", help="also time every available engine (extra JSON key)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def _settings():
    from ..core.manager import make_manager, settings_for

    return settings_for(make_manager())


def run(
    requests: int = 64,
    chain: int = 8,
    vocab: int = 32000,
    steps: int = 30,
    engine=None,
    threads=None,
    all_engines: bool = False,
    mix: str = "json",
) -> dict:
    if requests <= 0 or chain <= 1 or steps <= 0:
        raise SystemExit("--requests and --steps must be positive and --chain at least 2")
    from sglang.srt.speculative import spec_utils

    from . import integration as I
    from . import settings as feat
    from .traversal import ENGINES, batch_traverse_available
    from .workload import GrammarFactory, matcher_state

    if engine is None or threads is None:
        s = _settings()
        engine = engine or s[feat.ENGINE]
        threads = threads or s[feat.THREADS]
    factory = GrammarFactory(vocab=vocab, pad=64, mix=mix)
    # Speculative decoding under a grammar: most draft chains follow it (the draft model is usually
    # right); 10% carry an invalid token at a random depth, 20% may run into the end of the
    # instance (terminating mid-chain), 20% are reasoning requests (think-end anywhere in the chain
    # or not at all), 10% have no grammar. tests/dspark_masks use far more adversarial mixes.
    wl = factory.workload(requests, chain, seed=1234, no_grammar=0.1, reasoning=0.2, corrupt=0.1, tail=0.2)
    before = [matcher_state(r.grammar) for r in wl.reqs]
    bs = requests
    nxt = torch.full((bs, chain), -1, dtype=torch.int64)
    nxt[:, :-1] = torch.arange(1, chain, dtype=torch.int64)
    sib = torch.full((bs, chain), -1, dtype=torch.int64)
    words = (wl.vocab_size + 31) // 32
    all_ones = torch.full((bs * chain, words), -1, dtype=torch.int32)

    def stock_step():
        info = types.SimpleNamespace(vocab_size=wl.vocab_size, grammar_mask=object())
        tree = spec_utils.GrammarTree.from_host(nxt, sib, wl.draft)
        gm = spec_utils.build_grammar_vocab_mask(
            reqs=wl.reqs, tree=tree, sampling_info=info, device="cpu", barrier=None
        )
        return None if gm is None else gm.vocab_mask

    tree_cls = I.build_tree_class(spec_utils.GrammarTree)
    ours_build = I.build_vocab_mask_function(spec_utils.build_grammar_vocab_mask, {})

    def make_ours(eng):
        I.reset_runtime()
        I.configure(eng, threads)

        def ours_step():
            info = types.SimpleNamespace(vocab_size=wl.vocab_size, grammar_mask=object())
            tree = tree_cls.from_linear_chain(wl.draft)
            return ours_build(reqs=wl.reqs, tree=tree, sampling_info=info, device="cpu", barrier=None)

        return ours_step

    def settle(result):
        """Outside the timed region: keep a copy of the mask and release the slot as the worker's
        ``apply`` would after masking the logits (neither path applies masks here: the logits live
        on the GPU in a server, see tests/gpu)."""
        if result is None or isinstance(result, torch.Tensor):
            return result
        mask = result.vocab_mask.clone()
        result._pipe.consumed(result._ticket)
        return mask

    def measure(fns, n):
        """``n`` timed steps per path, in blocks: each path runs BLOCK consecutive steps, the paths
        alternate block by block (so machine-load drift hits both), and the first step of every
        block is run but not timed. Rationale: the stock DFS leaves thousands of freed small
        allocations (per-node torch tensors) in the C allocator, and whichever code allocates next
        pays their consolidation (~1-3 ms measured here); a block charges that to the path that
        made the debris instead of to the path that happens to follow it."""
        times = [[] for _ in fns]
        masks = [[] for _ in fns]
        cpu[:] = [[] for _ in fns]
        while len(times[0]) < n:
            for i, fn in enumerate(fns):
                settle(fn())  # untimed: absorbs the previous block's allocator debris
                for _ in range(min(BLOCK, n - len(times[i]))):
                    c0 = time.process_time()  # every thread of this process: workers and their spins
                    t0 = time.perf_counter()
                    m = fn()
                    times[i].append(time.perf_counter() - t0)
                    cpu[i].append(time.process_time() - c0)
                    masks[i].append(settle(m))
        return times, masks

    cpu: list = []

    ours = make_ours(engine)
    chosen = I.runtime().traverser.engine
    measure([stock_step, ours], 2)  # warm-up (xgrammar caches, allocator, thread pools)
    times, masks = measure([stock_step, ours], steps)
    step_cpu = [list(c) for c in cpu]

    def same(a, b):
        a = all_ones if a is None else a
        b = all_ones if b is None else b
        return a.shape == b.shape and torch.equal(a, b)

    identical = all(same(s, o) for s, o in zip(masks[0], masks[1]))
    identical = identical and [matcher_state(r.grammar) for r in wl.reqs] == before
    stock_ms = statistics.median(times[0]) * 1e3
    harden_ms = statistics.median(times[1]) * 1e3
    result = {
        "requests": requests,
        "chain": chain,
        "stock_ms": round(stock_ms, 3),
        "harden_ms": round(harden_ms, 3),
        "speedup": round(stock_ms / harden_ms, 2) if harden_ms > 0 else float("inf"),
        "identical": bool(identical),
        # CPU seconds per step (process-wide: includes native workers' spinning), medians
        "stock_cpu_s_per_step": round(statistics.median(step_cpu[0]), 6),
        "harden_cpu_s_per_step": round(statistics.median(step_cpu[1]), 6),
    }
    if all_engines:
        extra = {
            "engine": chosen,
            "vocab_size": wl.vocab_size,
            "mix": mix,
            # fastest step of each path: closest to an unloaded host on a shared machine
            "stock_min_ms": round(min(times[0]) * 1e3, 3),
            "harden_min_ms": round(min(times[1]) * 1e3, 3),
            "engines_ms": {},
        }
        for eng in ENGINES:
            if eng == "auto" or (eng == "batch" and not batch_traverse_available()):
                continue
            fn = make_ours(eng)
            measure([fn], 2)
            t, m = measure([stock_step, fn], max(3, steps // 2))
            extra["engines_ms"][eng] = {
                "stock_ms": round(statistics.median(t[0]) * 1e3, 3),
                "ms": round(statistics.median(t[1]) * 1e3, 3),
                "identical": all(same(s, o) for s, o in zip(m[0], m[1])),
            }
        result["detail"] = extra
    I.reset_runtime()
    return result


def main(args) -> int:
    result = run(
        args.requests, args.chain, args.vocab, args.steps, args.engine, args.threads, args.all_engines, args.mix
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(f"DSpark grammar masks, {result['requests']} requests x {result['chain']}-node chains")
        print(f"  stock build_grammar_vocab_mask : {result['stock_ms']:.3f} ms/step")
        print(f"  dspark-harden                  : {result['harden_ms']:.3f} ms/step")
        print(f"  speedup {result['speedup']}x, identical masks: {result['identical']}")
        print(
            f"  CPU s/step: stock {result['stock_cpu_s_per_step']:.6f}, dspark-harden {result['harden_cpu_s_per_step']:.6f}"
        )
        for eng, v in result.get("detail", {}).get("engines_ms", {}).items():
            print(f"  engine {eng:8s}: {v['ms']:.3f} ms (stock {v['stock_ms']:.3f}), identical {v['identical']}")
    return 0 if result["identical"] else 1


def native_engine_times(
    requests: int = 64, chain: int = 8, vocab: int = 32000, steps: int = 30, threads=(2, 4, 8)
) -> dict:
    """Our engines only, no SGLang (for the GPU host, which has none): median ms per step of each
    engine on the same :class:`~.workload.NativeFactory` batch, each engine's masks compared bit for
    bit with one independent reference (:func:`~.workload.reference_masks`: plain xgrammar calls in
    stock's order, no engine of ours); ``all_identical`` is False when any engine differs."""
    from .traversal import ChainTraverser
    from .workload import NativeFactory, native_jobs, reference_masks

    factory = NativeFactory(vocab=vocab, pad=64)
    matchers, roots, draft = factory.batch(requests, chain, seed=7)
    V = factory.vocab_size
    ref = reference_masks(matchers, roots, draft, V)
    out = {
        "requests": requests,
        "chain": chain,
        "vocab_size": V,
        "reference": "workload.reference_masks",
        "engines_ms": {},
    }
    configs = [("scalar", 1), ("native", 1)] + [(e, n) for e in ("native", "threads", "level") for n in threads]
    for eng, n in configs:
        t = ChainTraverser(eng, threads=n)
        buf = torch.empty_like(ref)
        times = []
        for i in range(steps + 3):
            t0 = time.perf_counter()
            t.traverse(native_jobs(matchers, roots, draft, V), draft, buf, V)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        out["engines_ms"][f"{eng}x{n}"] = {
            "ms": round(statistics.median(times) * 1e3, 3),
            "identical": bool(torch.equal(buf, ref)),
        }
        t.close()
    out["all_identical"] = all(e["identical"] for e in out["engines_ms"].values())
    return out
