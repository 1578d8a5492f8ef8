"""Per-step cost of grammar-aware DSpark drafting on the GPU (issue 43): the feature's own draft block
(``dspark_harden.dspark_masks.draft._Block``: accept the previous draft token, fill each live row's mask,
upload it, mask the step's logits) around a greedy draft step over [bs, 129,280] logits on the device,
against the same draft steps unmasked, at 64 and 256 requests x a 7-step block.

Reported per step (median of ``--blocks`` blocks, ms): ``d2h_wait`` (the previous step's tokens to the
host: the one sync per step the feature adds), ``host`` (accept + ``fill_next_token_bitmask`` of every
live row), ``mask_gpu`` (bitmask upload, unpack, ``masked_fill`` on the device, CUDA events), and the
block totals masked vs unmasked. The draft step itself is an argmax over the masked logits (the greedy
Markov step is that argmax after a bias GEMV, which the feature does not change).

Stand-ins (no SGLang on the GPU machine): each request's grammar object is a tiny adapter over an
``xgrammar.GrammarMatcher`` with the five calls SGLang's ``XGrammarGrammar`` makes for them
(``accept_token``, ``rollback``, ``is_terminated``, ``fill_vocab_mask``, ``allocate_vocab_mask``).

Fails (exit 3) when a drafted token is not allowed by its row's grammar at that step (checked against
plain xgrammar replaying the block), when a free row's token differs from the unmasked draft, or when a
matcher is not back in its state after the block.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

V_MODEL = 129280
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script, no timings worth reading


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


class Grammar:
    def __init__(self, matcher, vocab_size):
        self.matcher, self.vocab_size = matcher, vocab_size

    def accept_token(self, t):
        if not self.matcher.accept_token(t):
            raise ValueError(f"token {t} not accepted")

    def rollback(self, k):
        self.matcher.rollback(k)

    def is_terminated(self):
        return self.matcher.is_terminated()

    def fill_vocab_mask(self, mask, idx):
        self.matcher.fill_next_token_bitmask(mask, idx)

    def allocate_vocab_mask(self, vocab_size, batch_size, device):
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(batch_size, vocab_size)


class Req:
    def __init__(self, grammar):
        self.grammar = grammar


def requests(factory, bs, seed):
    import xgrammar as xgr

    rng = random.Random(seed)
    reqs = []
    for _ in range(bs):
        cg, ids = factory.compiled[rng.randrange(len(factory.compiled))]
        if rng.random() < 0.1:
            reqs.append(Req(None))
            continue
        m = xgr.GrammarMatcher(cg)
        for t in ids[: rng.randrange(0, len(ids) - 1)]:
            assert m.accept_token(t)
        reqs.append(Req(Grammar(m, factory.vocab_size)))
    return reqs


def run(factory, bs, gamma, blocks, seed=0, host_only=False, batched=True, threads=2):
    from dspark_harden.dspark_masks import draft as D

    if batched:
        D._BATCHABLE[:] = [Grammar]  # the stand-in's fill_vocab_mask is the matcher call XGrammarGrammar makes
        D.configure(threads)
    else:
        D._BATCHABLE[:] = [type(None)]
    timers = {"d2h_wait": 0.0, "host": 0.0, "mask_gpu": 0.0}
    orig_apply = D._apply

    def timed_apply(logits, bitmask, rows, vocab_size):
        if host_only:
            return None
        if DEV == "cpu":
            return orig_apply(logits, bitmask, rows, vocab_size)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        orig_apply(logits, bitmask, rows, vocab_size)
        b.record()
        events.append((a, b))

    D._apply = timed_apply
    per = {"masked_ms": [], "plain_ms": [], "d2h_wait_ms": [], "host_ms": [], "mask_gpu_ms": []}
    bad = []
    try:
        for blk in range(blocks):
            reqs = requests(factory, bs, seed * 1000 + blk)
            before = [r.grammar.matcher._debug_print_internal_state() if r.grammar else None for r in reqs]
            torch.manual_seed(blk)
            base = torch.randn(bs, gamma, V_MODEL, device=DEV)
            # unmasked: gamma argmaxes, one sync at the end
            _sync()
            t0 = time.perf_counter()
            plain = torch.stack([base[:, k].argmax(-1) for k in range(gamma)], 1)
            plain_host = plain.cpu()
            t_plain = time.perf_counter() - t0
            # masked: the feature's block
            work = base.clone()
            events: list = []
            for k in timers:
                timers[k] = 0.0
            _sync()
            t0 = time.perf_counter()
            block = D._Block(reqs, factory.vocab_size)
            prev = torch.zeros(bs, dtype=torch.int64, device=DEV)
            toks = []
            for k in range(gamma):
                h0 = time.perf_counter()
                if k > 0 and block.alive:
                    prev.view(-1)[block.alive].tolist()  # what block.step's own .tolist() waits for
                timers["d2h_wait"] += time.perf_counter() - h0
                h1 = time.perf_counter()
                block.step(k, prev, work[:, k])
                timers["host"] += time.perf_counter() - h1
                prev = work[:, k].argmax(-1)
                toks.append(prev)
            drafted = torch.stack(toks, 1).cpu()
            t_masked = time.perf_counter() - t0
            block.rollback()
            gpu = sum(a.elapsed_time(b) for a, b in events)
            per["masked_ms"].append(t_masked * 1e3)
            per["plain_ms"].append(t_plain * 1e3)
            per["d2h_wait_ms"].append(timers["d2h_wait"] * 1e3 / gamma)
            per["host_ms"].append((timers["host"] * 1e3) / gamma)
            per["mask_gpu_ms"].append(gpu / gamma)
            # correctness: replay with plain xgrammar
            for r, req in enumerate([] if host_only else reqs):
                g = req.grammar
                if g is None:
                    if drafted[r].tolist() != plain_host[r].tolist():
                        bad.append(f"block {blk} row {r}: a free row's draft changed")
                    continue
                state = g.matcher._debug_print_internal_state()
                if state != before[r]:
                    bad.append(f"block {blk} row {r}: matcher not rolled back")
                    continue
                import xgrammar as xgr

                mask = xgr.allocate_token_bitmask(1, factory.vocab_size)
                n = 0
                for k in range(gamma):
                    if g.matcher.is_terminated():
                        break
                    g.matcher.fill_next_token_bitmask(mask, 0)
                    t = int(drafted[r, k])
                    if not (t < factory.vocab_size and (int(mask[0, t // 32]) >> (t % 32)) & 1):
                        bad.append(f"block {blk} row {r} step {k}: token {t} not allowed")
                        break
                    if k < gamma - 1:
                        assert g.matcher.accept_token(t)
                        n += 1
                if n:
                    g.matcher.rollback(n)
    finally:
        D._apply = orig_apply
    med = {k: round(statistics.median(v), 4) for k, v in per.items()}
    spread = {k: [round(min(v), 4), round(max(v), 4)] for k, v in per.items()}
    med["added_per_step_ms"] = round((med["masked_ms"] - med["plain_ms"]) / gamma, 4)
    return {
        "bs": bs,
        "gamma": gamma,
        "vocab_model": V_MODEL,
        "vocab_grammar": factory.vocab_size,
        "blocks": blocks,
        "median": med,
        "spread": spread,
    }, bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000, help="tokenizer the grammars are compiled for")
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 4, 8], help="batched fill threads to compare")
    ap.add_argument(
        "--host-only",
        action="store_true",
        help="the scheduler-thread part alone (accept + fill): no mask applied, drafted tokens not checked",
    )
    a = ap.parse_args()
    from dspark_harden.dspark_masks.workload import NativeFactory

    factory = NativeFactory(vocab=a.vocab, pad=0)
    if DEV == "cuda":
        print(json.dumps({"device": torch.cuda.get_device_name(), "cc": torch.cuda.get_device_capability()}))
    all_bad = []
    run(factory, 8, a.gamma, 2, host_only=a.host_only)  # warm-up (kernels, allocator)
    for bs in (64, 256):
        for fill in ["per-row"] + [f"batched x{t}" for t in a.threads]:
            t = int(fill.split("x")[1]) if "x" in fill else 1
            res, bad = run(factory, bs, a.gamma, a.blocks, host_only=a.host_only, batched=fill != "per-row", threads=t)
            res["host_only"], res["fill"] = a.host_only, fill
            print(json.dumps(res))
            all_bad += bad
    if all_bad:
        print("WRONG DRAFT: " + "; ".join(all_bad[:10]), file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
