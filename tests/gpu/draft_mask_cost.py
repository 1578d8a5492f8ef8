"""Per-step cost of grammar-aware DSpark drafting on the GPU (issue 43): the feature's own draft block
(``dspark_harden.dspark_masks.draft._Block``: accept the previous draft token, fill each live row's mask,
upload it, mask the step's logits) around a greedy draft step over [bs, 129,280] logits on the device,
against the same draft steps unmasked, at 64 and 256 requests x a 7-step block.

Reported per step (median of ``--blocks`` blocks, ms): ``d2h_wait`` (the previous step's tokens to the
host: the one sync per step the feature adds), ``host`` (accept + ``fill_next_token_bitmask`` of every
live row), ``mask_gpu`` (bitmask upload, unpack, ``masked_fill`` on the device, CUDA events), and the
block totals masked vs unmasked. Each draft step is the greedy Markov step of stock's DeepSeek V4 head
(``DSparkV4MarkovHead`` with ``SGLANG_DSPARK_OPT_MARKOV_W2_BF16``, stock's default): the previous token's
``markov_w1`` row, a bf16 ``F.linear`` with ``markov_w2`` [vocab, ``--markov-rank``], added in fp32 to the step's
base logits, argmax. Unmasked, the block runs ahead on the device with no host sync (stock); masked, each step
waits for the previous token.

The budget it is set against, measured on the same device: the draft block unmasked (the base logits of the
block -- the draft's LM head over [bs x gamma, ``--hidden``] -- and the gamma Markov steps). The target's verify
forward of DeepSeek V4 cannot run here (no weights, no SGLang server on the device), so the report also gives, for
accept-length ratios 1.1 / 1.3 / 1.65 (the last one measured by ``bench serve --compare-draft-masks``), the whole
DSpark step time above which the masks pay: ``added_block_ms / (ratio - 1)`` (tokens per second go from
``a / T`` to ``ratio * a / (T + added)``).

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


class Markov:
    """Stand-in weights in the shapes of stock's DSV4 draft head and LM head (random values: the cost does not
    depend on them)."""

    def __init__(self, hidden, rank):
        g = torch.Generator(device=DEV).manual_seed(1)
        dt = torch.bfloat16 if DEV == "cuda" else torch.float32
        self.w1 = torch.randn(V_MODEL, rank, device=DEV, dtype=dt, generator=g) * 0.1
        self.w2 = torch.randn(V_MODEL, rank, device=DEV, dtype=dt, generator=g) * 0.1
        self.lm = torch.randn(V_MODEL, hidden, device=DEV, dtype=dt, generator=g) * 0.02
        self.hidden, self.dt = hidden, dt

    def base_logits(self, bs, gamma, seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        h = torch.randn(bs * gamma, self.hidden, device=DEV, dtype=self.dt, generator=g)
        return torch.nn.functional.linear(h, self.lm).view(bs, gamma, V_MODEL)

    def step(self, prev, base):
        bias = torch.nn.functional.linear(self.w1[prev], self.w2).float()
        return (base.float() + bias).argmax(-1)


def run(factory, bs, gamma, blocks, seed=0, host_only=False, batched=True, threads=2, markov=None):
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
    per = {
        "lm_head_ms": [],
        "masked_ms": [],
        "plain_ms": [],
        "d2h_wait_ms": [],
        "host_ms": [],
        "mask_gpu_ms": [],
    }
    bad = []
    try:
        for blk in range(blocks):
            reqs = requests(factory, bs, seed * 1000 + blk)
            before = [r.grammar.matcher._debug_print_internal_state() if r.grammar else None for r in reqs]
            _sync()
            t0 = time.perf_counter()
            base = markov.base_logits(bs, gamma, blk)
            _sync()
            t_lm = time.perf_counter() - t0
            anchor = torch.randint(
                0, factory.vocab_size, (bs,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(blk)
            )
            # unmasked (stock): gamma Markov steps queued on the device, one sync at the end
            _sync()
            t0 = time.perf_counter()
            prev, plain = anchor, []
            for k in range(gamma):
                prev = markov.step(prev, base[:, k])
                plain.append(prev)
            plain_host = torch.stack(plain, 1).cpu()
            t_plain = time.perf_counter() - t0
            # masked: the feature's block
            work = base.clone()
            events: list = []
            for k in timers:
                timers[k] = 0.0
            _sync()
            t0 = time.perf_counter()
            block = D._Block(reqs, factory.vocab_size)
            prev = anchor
            toks = []
            for k in range(gamma):
                h0 = time.perf_counter()
                if k > 0 and block.alive:
                    prev.view(-1)[block.alive].tolist()  # what block.step's own .tolist() waits for
                timers["d2h_wait"] += time.perf_counter() - h0
                h1 = time.perf_counter()
                block.step(k, prev, work[:, k])
                timers["host"] += time.perf_counter() - h1
                prev = markov.step(prev, work[:, k])
                toks.append(prev)
            drafted = torch.stack(toks, 1).cpu()
            t_masked = time.perf_counter() - t0
            block.rollback()
            gpu = sum(a.elapsed_time(b) for a, b in events)
            per["lm_head_ms"].append(t_lm * 1e3)
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
    added = med["masked_ms"] - med["plain_ms"]
    med["added_per_step_ms"] = round(added / gamma, 4)
    med["added_block_ms"] = round(added, 4)
    med["draft_block_budget_ms"] = round(med["lm_head_ms"] + med["plain_ms"], 4)
    return {
        "pays_if_dspark_step_ms_above": {str(r): round(added / (r - 1), 2) for r in (1.1, 1.3, 1.65)},
        "bs": bs,
        "gamma": gamma,
        "vocab_model": V_MODEL,
        "vocab_grammar": factory.vocab_size,
        "blocks": blocks,
        "median": med,
        "spread": spread,
    }, bad


def kernel_check(factory, markov, bs, gamma, reps=20):
    """The feature's ``_apply`` (unpack + ``masked_fill`` of the live rows of a strided step view, columns >=
    vocab masked) against xgrammar's ``apply_token_bitmask_inplace`` (the kernel family SGLang's
    ``XGrammarGrammar.apply_vocab_mask`` calls; on CUDA SGLang uses its own Triton copy of it) on the same
    rows and bitmask, plus the columns >= vocab stock's verify rejects: equal results, and each one's time
    (median of ``reps``, ms, CUDA events; the bitmask's upload included in both)."""
    import xgrammar as xgr

    from dspark_harden.dspark_masks import draft as D

    reqs = requests(factory, bs, 7)
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    bitmask = xgr.allocate_token_bitmask(bs, factory.vocab_size)
    D._fill({i: reqs[i].grammar for i in rows}, rows, bitmask)
    step = markov.base_logits(bs, gamma, 3)[:, 1]  # a strided view, as _draft_step gets it
    ours, ref = step.clone(), step.contiguous().clone()
    D._apply(ours, bitmask, rows, factory.vocab_size)
    out = {"bs": bs, "rows": len(rows)}
    try:
        xgr.apply_token_bitmask_inplace(ref, bitmask.to(DEV), vocab_size=factory.vocab_size, indices=rows)
        ref[rows, factory.vocab_size :] = float("-inf")
        out["equal"] = bool(torch.equal(ours, ref))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the comparison is informative
        out["xgrammar_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if DEV == "cuda":
        for name, fn in (
            ("ours_ms", lambda t: D._apply(t, bitmask, rows, factory.vocab_size)),
            (
                "xgrammar_ms",
                lambda t: xgr.apply_token_bitmask_inplace(
                    t, bitmask.to(DEV), vocab_size=factory.vocab_size, indices=rows
                ),
            ),
        ):
            if name == "xgrammar_ms" and "xgrammar_error" in out:
                continue
            times = []
            for _ in range(reps):
                t = step.clone() if name == "ours_ms" else step.contiguous().clone()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(t)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            out[name] = round(statistics.median(times), 4)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000, help="tokenizer the grammars are compiled for")
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=4096, help="draft hidden size (stock DeepSeekV4Config default)")
    ap.add_argument("--markov-rank", type=int, default=256, help="markov_rank of the draft config (not in stock)")
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
    markov = Markov(a.hidden, a.markov_rank)
    run(factory, 8, a.gamma, 2, host_only=a.host_only, markov=markov)  # warm-up (kernels, allocator)
    for bs in (64, 256):
        chk = kernel_check(factory, markov, bs, a.gamma)
        print(json.dumps({"kernel_check": chk}))
        if chk.get("equal") is False:
            all_bad.append(f"bs {bs}: _apply differs from xgrammar's apply_token_bitmask_inplace + columns >= vocab")
        for fill in ["per-row"] + [f"batched x{t}" for t in a.threads]:
            t = int(fill.split("x")[1]) if "x" in fill else 1
            res, bad = run(
                factory,
                bs,
                a.gamma,
                a.blocks,
                host_only=a.host_only,
                batched=fill != "per-row",
                threads=t,
                markov=markov,
            )
            res["host_only"], res["fill"] = a.host_only, fill
            print(json.dumps(res))
            all_bad += bad
    if all_bad:
        print("WRONG DRAFT: " + "; ".join(all_bad[:10]), file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
