"""Subprocess driver of the real-object prefill-graph tests (test_real_forward_batch.py).

Runs in its own interpreter (``python -m tests.prefill_graph._world_driver``) because
``dspark_harden.prefill_graph.world`` publishes a runtime configuration into SGLang's process-wide
context and stamps ``get_parallel().tp_group``. Prints one JSON report on the last line.

For each configuration it replays randomized DP2 steps through :class:`World` on three sides
(``probe``: every schedule-time view compared with the real ForwardBatch at a forced graph
verdict; ``harden``: the feature's vote / finalisation / guard; ``stock``: stock's own path), and
for each mutation of the view (``MUTATIONS``) it re-runs the probe and harden checks with the
mutated function in place and records which check reported it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

CONFIGS = {
    # name: (World kwargs, trace shape overrides)
    "full": dict(backend="full", spec="none"),
    "breakable": dict(backend="breakable", spec="none"),
    "dspark": dict(backend="full", spec="dspark"),
    "server_hidden_last": dict(backend="full", spec="none", server_hidden="last"),
}


def random_steps(n: int, seed: int) -> list:
    """Randomized DP2 steps: every request flag far more frequent than in production, idle,
    decoding and prefilling peers, mixed ranks, cached prefixes, request-slot bursts."""
    from dspark_harden.prefill_graph import trace as T

    shapes = [
        T.TraceShape(
            steps=n - n // 3,
            seed=seed,
            max_len=6000,
            max_prefix=9000,
            p_cached=0.5,
            p_hidden=0.08,
            p_pool=0.08,
            p_embeds=0.05,
            p_logprob=0.3,
            p_mm=0.05,
            p_replace=0.05,
            p_peer_decode=0.3,
            p_peer_idle=0.3,
            p_peer_prefill=0.4,
            p_small_batch_burst=0.04,
        ),
        T.TraceShape(
            steps=n // 3,
            seed=seed + 1,
            max_len=512,
            max_prefix=16000,
            p_cached=0.8,
            p_hidden=0.05,
            p_pool=0.05,
            p_logprob=0.2,
            p_peer_idle=0.5,
            p_peer_prefill=0.3,
            p_peer_decode=0.2,
        ),
    ]
    out = [s for shape in shapes for s in T.generate(shape)]
    # crafted: pooling readout batches (every request carries token_indices_to_pool), and a pair
    # whose global max sits just above a bucket (the idle rank's dummy extend takes the bucket)
    out += [
        T.Step(
            (
                T.RankStep("extend", (T.TraceReq(extend=300, pool=True), T.TraceReq(extend=40, pool=True))),
                T.RankStep("idle"),
            )
        ),
        T.Step((T.RankStep("decode", seq=(900, 17)), T.RankStep("extend", (T.TraceReq(extend=70, pool=True),)))),
        T.Step((T.RankStep("idle"), T.RankStep("extend", (T.TraceReq(extend=1025, prefix=700),)))),
    ]
    return out


def _features(world, res, feat: collections.Counter) -> None:
    """Counts of what the real ForwardBatches contained (non-vacuity of the checks)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    for r in res:
        pre = r.fb_pre
        if pre is None:
            continue
        feat["forward_batches"] += 1
        feat[f"mode_{pre['forward_mode'].name.lower()}"] += 1
        if pre["capture_hidden_mode"] != CaptureHiddenMode.NULL:
            feat[f"capture_{pre['capture_hidden_mode'].name.lower()}"] += 1
        for k in ("input_embeds", "replace_embeds", "mm_inputs", "return_logprob"):
            feat[k] += bool(pre[k])
        feat["token_indices_to_pool"] += pre["token_indices_to_pool"] is not None
        feat["cached_prefix"] += any(pre["extend_prefix_lens_cpu"] or [])
        if r.batch is not None and r.batch.spec_info is not None:
            feat["spec_info"] += 1
        if r.mode == "decode" and pre["forward_mode"] == ForwardMode.EXTEND:
            feat["decode_converted_to_extend"] += 1
        if r.fb is not None and getattr(r.fb, "_original_forward_mode", None) == ForwardMode.IDLE:
            feat["idle_dummy_extend"] += 1


def run_config(name: str, steps: list, *, sides=("probe", "harden", "stock"), max_examples: int = 5) -> dict:
    from dspark_harden.prefill_graph import runner as R
    from dspark_harden.prefill_graph import world as W

    world = WORLDS.get(name)
    if world is None:
        world = WORLDS[name] = W.World(R.capture_config(), **CONFIGS[name])
    out: dict = {"steps": len(steps)}
    t0 = time.perf_counter()
    if "probe" in sides:
        diffs, feat, n_bad = [], collections.Counter(), 0
        for i, step in enumerate(steps):
            res = world.step(step, "probe")
            _features(world, res, feat)
            d = W.view_differences(world, step, res)
            if d:
                n_bad += 1
                if len(diffs) < max_examples:
                    diffs.append({"step": i, "trace": _json(step), "differences": d[:6]})
        out["probe"] = {"steps_with_differences": n_bad, "examples": diffs, "features": dict(feat)}
    for side in ("harden", "stock"):
        if side not in sides:
            continue
        splits, raised, graph_steps, examples = 0, collections.Counter(), 0, []
        for i, step in enumerate(steps):
            res = world.step(step, side)
            rep = [r.replays for r in res]
            for r in res:
                if r.raised is not None:
                    raised[r.raised.check] += 1
            split = rep[0] != rep[1]
            splits += split
            graph_steps += rep[0] and rep[1]
            if (split or any(r.raised is not None for r in res)) and len(examples) < max_examples:
                examples.append(
                    {
                        "step": i,
                        "trace": _json(step),
                        "replays": rep,
                        "raised": [None if r.raised is None else str(r.raised)[:300] for r in res],
                    }
                )
        out[side] = {"splits": splits, "raised": dict(raised), "graph_steps": graph_steps, "examples": examples}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


WORLDS: dict = {}


def _json(step):
    from dspark_harden.prefill_graph import trace as T

    return T.step_to_json(step)


# -- mutations of the view: each ignores one input the view reads --------------------------------


def _mutate_view(fn):
    """Wrap decision.schedule_view's result with ``fn(view, batch, kwargs)``."""
    from dspark_harden.prefill_graph import decision as D

    orig = D.schedule_view

    def mutated(batch, **kw):
        view = orig(batch, **kw)
        return view if view is None else fn(view, batch, kw)

    return "schedule_view", mutated


def _m_capture(drop: str):
    def fn(view, batch, kw):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, get_required_capture_hidden_mode

        worker = None if drop == "worker" else kw.get("worker_mode")
        request = CaptureHiddenMode.NULL if drop == "request" else batch.return_hidden_states_mode
        server = CaptureHiddenMode.NULL if drop == "server" else kw["server_mode"]
        view.capture_hidden_mode = (
            worker
            if worker is not None
            else get_required_capture_hidden_mode(
                max(request, server), None if drop == "spec_info" else batch.spec_info
            )
        )
        return view

    return _mutate_view(fn)


def _m_set(**values):
    def fn(view, batch, kw):
        for k, v in values.items():
            setattr(view, k, v(view, batch) if callable(v) else v)
        return view

    return _mutate_view(fn)


def _m_pool_ignores_prefill_only():
    def fn(view, batch, kw):
        reqs = list(batch.reqs)
        if reqs and all(r.token_indices_to_pool is not None for r in reqs) and not view.forward_mode.is_decode():
            if view.extend_seq_lens_cpu and len(view.extend_seq_lens_cpu) == len(reqs):
                view.token_indices_to_pool = [list(r.token_indices_to_pool) for r in reqs]
        return view

    return _mutate_view(fn)


def _m_no_decode_view():
    from dspark_harden.prefill_graph import decision as D

    orig = D.schedule_view

    def mutated(batch, **kw):
        return None if batch.forward_mode.is_decode() else orig(batch, **kw)

    return "schedule_view", mutated


def _m_dummy(**values):
    from dspark_harden.prefill_graph import decision as D

    orig = D.dummy_extend_view

    def mutated(bucket, **kw):
        view = orig(bucket, **kw)
        for k, v in values.items():
            setattr(view, k, v(view, kw) if callable(v) else v)
        return view

    return "dummy_extend_view", mutated


def _m_dummy_capture_server_only():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    return _m_dummy(
        capture_hidden_mode=lambda v, kw: (
            kw["server_mode"] if kw.get("server_mode") is not None else CaptureHiddenMode.NULL
        )
    )


def _m_dummy_capture_null():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    return _m_dummy(capture_hidden_mode=CaptureHiddenMode.NULL)


def _m_no_pool_check():
    from dspark_harden.prefill_graph import decision as D

    orig = D.local_failures

    def mutated(runner, fb, **kw):
        return [f for f in orig(runner, fb, **kw) if f != "token_indices_to_pool"]

    return "local_failures", mutated


def _m_no_capture_check():
    from dspark_harden.prefill_graph import decision as D

    orig = D.local_failures

    def mutated(runner, fb, **kw):
        if kw.get("schedule_time"):
            return [f for f in orig(runner, fb, **kw) if f != "capture_hidden_mode"]
        return orig(runner, fb, **kw)

    return "local_failures", mutated


def _seq_from_extend(view, batch):
    import torch

    return torch.tensor(list(view.extend_seq_lens_cpu), dtype=torch.int64)


# name -> (factory, configs it is observable in, what it ignores)
MUTATIONS = {
    "capture_ignores_request_hidden_mode": (
        lambda: _m_capture("request"),
        ("full",),
        "schedule_view: a request's return_hidden_states",
    ),
    "capture_ignores_worker_mode": (
        lambda: _m_capture("worker"),
        ("dspark",),
        "schedule_view: the capture mode the DSpark worker passes (FULL)",
    ),
    "capture_ignores_server_mode": (
        lambda: _m_capture("server"),
        ("server_hidden_last",),
        "schedule_view: the server's --return-hidden-states-mode",
    ),
    "pool_ignores_is_prefill_only": (
        _m_pool_ignores_prefill_only,
        ("dspark",),
        "schedule_view: ScheduleBatch.is_prefill_only (False under speculative decoding)",
    ),
    "pool_ignored": (
        lambda: _m_set(token_indices_to_pool=None),
        ("full",),
        "schedule_view: requests' token_indices_to_pool",
    ),
    "input_embeds_ignored": (lambda: _m_set(input_embeds=None), ("full",), "schedule_view: ScheduleBatch.input_embeds"),
    "replace_embeds_ignored": (
        lambda: _m_set(replace_embeds=None),
        ("full",),
        "schedule_view: ScheduleBatch.replace_embeds (positional embedding overrides)",
    ),
    "mm_inputs_ignored": (lambda: _m_set(mm_inputs=False), ("full",), "schedule_view: ScheduleBatch.multimodal_inputs"),
    "return_logprob_ignored": (
        lambda: _m_set(return_logprob=False),
        ("full",),
        "schedule_view: ScheduleBatch.return_logprob",
    ),
    "logprob_starts_ignored": (
        lambda: _m_set(extend_logprob_start_lens_cpu=lambda v, b: [0] * len(v.extend_seq_lens_cpu)),
        ("full",),
        "schedule_view: ScheduleBatch.extend_logprob_start_lens",
    ),
    "prefix_lens_ignored": (
        lambda: _m_set(extend_prefix_lens_cpu=lambda v, b: [0] * len(v.extend_seq_lens_cpu)),
        ("full",),
        "schedule_view: ScheduleBatch.prefix_lens (cached prefixes)",
    ),
    "seq_lens_ignored": (
        lambda: _m_set(seq_lens_cpu=_seq_from_extend),
        ("full",),
        "schedule_view: ScheduleBatch.seq_lens_cpu (context lengths)",
    ),
    "extend_lens_ignored": (
        lambda: _m_set(extend_seq_lens_cpu=lambda v, b: [1] * len(v.extend_seq_lens_cpu)),
        ("full",),
        "schedule_view: ScheduleBatch.extend_lens",
    ),
    "mixed_labelled_extend": (
        lambda: _m_set(forward_mode=lambda v, b: type(v.forward_mode).EXTEND),
        ("full",),
        "schedule_view: ScheduleBatch.forward_mode (MIXED)",
    ),
    "batch_size_ignored": (lambda: _m_set(batch_size=1), ("full",), "schedule_view: ScheduleBatch.batch_size()"),
    "extend_num_tokens_ignored": (
        lambda: _m_set(extend_num_tokens=None),
        ("full",),
        "schedule_view: ScheduleBatch.extend_num_tokens",
    ),
    "decode_view_missing": (
        _m_no_decode_view,
        ("breakable",),
        "schedule_view: the breakable backend's decode->extend conversion",
    ),
    "decode_view_prefix_off_by_one": (
        lambda: _m_set(
            extend_prefix_lens_cpu=lambda v, b: (
                [int(s) for s in b.seq_lens_cpu.tolist()] if b.forward_mode.is_decode() else v.extend_prefix_lens_cpu
            )
        ),
        ("breakable",),
        "schedule_view: a converted decode row's prefix (seq_len - 1)",
    ),
    "dummy_seq_len_short": (
        lambda: _m_dummy(seq_lens_cpu=lambda v, kw: v.seq_lens_cpu - 1),
        ("full",),
        "dummy_extend_view: the dummy request's sequence length (the bucket)",
    ),
    "dummy_capture_ignores_worker_mode": (
        _m_dummy_capture_server_only,
        ("dspark",),
        "dummy_extend_view: the capture mode the DSpark worker passes to idle ranks",
    ),
    "dummy_capture_ignores_server_mode": (
        _m_dummy_capture_null,
        ("server_hidden_last",),
        "dummy_extend_view: the server's --return-hidden-states-mode",
    ),
    "dummy_not_relabelled": (
        lambda: _m_dummy(_original_forward_mode=None),
        ("full",),
        "dummy_extend_view: stock's IDLE -> EXTEND relabel (_original_forward_mode)",
    ),
    "vote_skips_pool_check": (_m_no_pool_check, ("full",), "local_failures: token_indices_to_pool (_forward_raw)"),
    "vote_skips_capture_check": (
        _m_no_capture_check,
        ("full",),
        "local_failures at schedule time: the capture-mode check",
    ),
}


def run_mutation(name: str, steps: list) -> dict:
    from dspark_harden.prefill_graph import decision as D

    factory, configs, what = MUTATIONS[name]
    attr, mutated = factory()
    orig = getattr(D, attr)
    setattr(D, attr, mutated)
    try:
        out = {"ignores": what, "configs": {}}
        for cfg in configs:
            rep = run_config(cfg, steps, sides=("probe", "harden"), max_examples=1)
            out["configs"][cfg] = {
                "probe_steps_with_differences": rep["probe"]["steps_with_differences"],
                "probe_example": (rep["probe"]["examples"][0]["differences"][:2] if rep["probe"]["examples"] else None),
                "harden_splits": rep["harden"]["splits"],
                "harden_raised": rep["harden"]["raised"],
            }
        return out
    finally:
        setattr(D, attr, orig)


# -- crafted pairs (test_property.py) -------------------------------------------------------------


def crafted_pairs() -> dict:
    """name -> (step, capture-config overrides, world kwargs)."""
    from dspark_harden.prefill_graph import trace as T

    def req(**kw):
        return T.TraceReq(**{"extend": 900, **kw})

    idle = T.RankStep("idle")
    return {
        # stock's vote does not evaluate these: one rank runs eager alone (stock splits)
        "split/capture_hidden_mode": (T.Step((T.RankStep("extend", (req(hidden=True),)), idle)), {}, {}),
        "split/capture_hidden_mode/both_busy": (
            T.Step((T.RankStep("extend", (req(hidden=True),)), T.RankStep("extend", (req(extend=700),)))),
            {},
            {},
        ),
        "split/token_indices_to_pool": (T.Step((T.RankStep("extend", (req(pool=True),)), idle)), {}, {}),
        "split/token_indices_to_pool/both_busy": (
            T.Step((T.RankStep("extend", (req(extend=300),)), T.RankStep("extend", (req(pool=True),)))),
            {},
            {},
        ),
        # the idle rank's dummy extend covers the whole bucket (seq_len 3072 > 3000): it alone fails
        "split/max_context": (T.Step((T.RankStep("extend", (req(extend=2900),)), idle)), {"max_seq_len": 3000}, {}),
        "split/backend_hook": (
            T.Step((idle, T.RankStep("extend", (req(extend=2900),)))),
            {"backend_seq_limit": 3000},
            {},
        ),
        # stock's vote evaluates these already (min-reduced): both ranks eager under stock too
        "consistent/request_slots": (
            T.Step((T.RankStep("extend", tuple(T.TraceReq(extend=2) for _ in range(40))), idle)),
            {},
            {},
        ),
        "consistent/input_embeds": (T.Step((T.RankStep("extend", (req(embeds=True),)), idle)), {}, {}),
        "consistent/replace_embeds": (T.Step((T.RankStep("extend", (req(replace=True),)), idle)), {}, {}),
        "consistent/prefix": (
            T.Step((T.RankStep("extend", (req(prefix=9000),)), T.RankStep("extend", (req(),)))),
            {},
            {},
        ),
        "consistent/num_tokens": (T.Step((T.RankStep("extend", (req(extend=16384), req(extend=1))), idle)), {}, {}),
        "consistent/forward_mode": (
            T.Step((T.RankStep("extend", (req(),)), T.RankStep("decode", seq=(100, 200)))),
            {},
            {},
        ),
        "consistent/backend_hook/late_tail": (
            T.Step((T.RankStep("extend", tuple(req(extend=300, logprob=True) for _ in range(30))), idle)),
            {"max_running_requests": 64},
            {},
        ),
        # padding judged on the shared bucket
        "padding/one_token_each": (
            T.Step((T.RankStep("extend", (T.TraceReq(extend=1),)), T.RankStep("extend", (T.TraceReq(extend=1),)))),
            {},
            {},
        ),
        "padding/tiny_next_to_large": (
            T.Step((T.RankStep("extend", (T.TraceReq(extend=10),)), T.RankStep("extend", (T.TraceReq(extend=5000),)))),
            {},
            {},
        ),
        "padding/sparse_buckets_f2": (
            T.Step((T.RankStep("extend", (T.TraceReq(extend=1000),)), idle)),
            {"buckets": (64, 4096)},
            {"factor": 2.0},
        ),
        # the breakable backend converts a decoding peer to 1-token extends: both replay
        "breakable/decoding_peer": (
            T.Step((T.RankStep("decode", seq=(900, 17, 3000)), T.RankStep("extend", (T.TraceReq(extend=600),)))),
            {},
            {"backend": "breakable"},
        ),
        "breakable/decoding_peer_hidden": (
            T.Step((T.RankStep("decode", seq=(900, 17)), T.RankStep("extend", (T.TraceReq(extend=600, hidden=True),)))),
            {},
            {"backend": "breakable"},
        ),
        # DSpark: its worker passes FULL on the target prefill and the idle rank; the runner captures FULL
        "dspark/hidden_request": (T.Step((T.RankStep("extend", (req(hidden=True),)), idle)), {}, {"spec": "dspark"}),
        "dspark/pool_request": (T.Step((T.RankStep("extend", (req(pool=True),)), idle)), {}, {"spec": "dspark"}),
    }


def run_crafted() -> dict:
    from dspark_harden.prefill_graph import runner as R
    from dspark_harden.prefill_graph import world as W

    out = {}
    worlds: dict = {}
    for name, (step, over, wkw) in crafted_pairs().items():
        over = dict(over)
        limit = over.pop("backend_seq_limit", None)
        buckets = over.pop("buckets", None)
        if limit:
            over["max_seq_len"] = limit
        key = (tuple(sorted(over.items())), limit, buckets, tuple(sorted(wkw.items())))
        world = worlds.get(key)
        if world is None:
            cfg = R.capture_config(buckets, **over)
            world = worlds[key] = W.World(cfg, **wkw)
            if limit:
                for runner in world.runners.values():
                    runner.max_seq_len = None  # only the backend hook knows the limit
        rec = {}
        for side in ("stock", "harden"):
            res = world.step(step, side)
            rec[side] = {
                "replays": [r.replays for r in res],
                "raised": [None if r.raised is None else r.raised.check for r in res],
                "verdict": [r.verdict for r in res],
                "reasons": [r.local_reason or (r.decision.reason if r.decision is not None else None) for r in res],
                "decision": [
                    None if r.decision is None else [r.decision.graph, r.decision.bucket, r.decision.reason]
                    for r in res
                ],
                "executed": [None if r.fb is None or not r.replays else len(r.fb.input_ids) for r in res],
            }
        out[name] = rec
    for world in worlds.values():
        world.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--mutation-steps", type=int, default=120)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--mutations", default="all")
    ap.add_argument("--crafted", action="store_true", help="only the crafted pairs")
    args = ap.parse_args(argv)
    if args.crafted:
        sys.stdout.write("\n" + json.dumps({"crafted": run_crafted()}) + "\n")
        return 0
    steps = random_steps(args.steps, args.seed)
    report: dict = {"configs": {}, "mutations": {}}
    for name in args.configs.split(","):
        if name:
            report["configs"][name] = run_config(name, steps)
    names = list(MUTATIONS) if args.mutations == "all" else [m for m in args.mutations.split(",") if m]
    msteps = random_steps(args.mutation_steps, args.seed + 17)
    for name in names:
        report["mutations"][name] = run_mutation(name, msteps)
    for w in WORLDS.values():
        w.close()
    sys.stdout.write("\n" + json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
