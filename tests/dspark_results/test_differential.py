"""Differential tests: stock SGLang 0.5.23's ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens``
/ ``advance_grammar_fsm`` / ``_normalize_decode_outputs`` vs the materializer's replacements, on DSpark
``GenerationBatchResult``s copied by the real stock ``Scheduler._copy_result_to_cpu`` (on CPU:
``torch.cpu`` streams and events), real ``Req`` / ``ScheduleBatch`` objects and real grammar objects
built by the stock XGrammar backend (dspark_masks' ``GrammarFactory``: real tokenizer, real xgrammar).

Two identical worlds per run (same seed): world A runs stock, world B the materializer (one background
thread, record per step). Randomized accept lengths, block-accept and cap lengths, drafts that follow
the grammar instance, stop at its end (termination mid-run) or carry an invalid token (abort),
retracted and finished requests, the grammar barrier called before the result processor on some steps.
After every step: predicted tokens, ``output_ids``, ``kv_committed_len``, spec counters and histograms,
FSM state (xgrammar matcher internals), retained tokens and the processor's calls are identical.

No SGLang object is patched: the hardened processor is a subclass carrying the built replacements, and
the hardened copy is the real stock method wrapped by the feature's builder (no bind, no fork).
"""

from __future__ import annotations

import random
import types

import pytest
import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components import batch_result_processor as brp
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from dspark_harden.dspark_masks.workload import GrammarFactory, matcher_state
from dspark_harden.dspark_results import integration as I
from dspark_harden.dspark_results.materializer import RECORD_ATTR, Materializer, MaterializerError

CLS = brp.SchedulerBatchResultProcessor
STOCK_COPY = Scheduler._copy_result_to_cpu
HARDENED_COPY = I.build_copy(STOCK_COPY)


class Hardened(CLS):
    _resolve_spec_v2_tokens = I.build_resolve(CLS._resolve_spec_v2_tokens)
    advance_grammar_fsm = I.build_advance(CLS.advance_grammar_fsm)
    _normalize_decode_outputs = I.build_normalize(CLS._normalize_decode_outputs)


class Recorder:
    """metrics_reporter / model_worker stand-ins: record what the processor hands them."""

    def __init__(self):
        self.calls = []

    def snapshot_spec_decode_metrics(self, batch, result):
        self.calls.append(("snapshot", len(batch.reqs)))

    def on_verify_complete_cpu(self, per_req, batch_size):
        self.calls.append(("verify", list(per_req), batch_size))


def processor(cls):
    proc = object.__new__(cls)  # a frozen dataclass: only the two collaborators the methods call
    rec = Recorder()
    object.__setattr__(proc, "metrics_reporter", rec)
    object.__setattr__(proc, "model_worker", rec)
    return proc


def scheduler(materializer=None):
    """The attributes stock ``_copy_result_to_cpu`` reads (CPU device module)."""
    s = types.SimpleNamespace(
        device_module=torch.cpu,
        copy_stream=torch.cpu.Stream(),
        forward_stream=torch.cpu.Stream(),
        enable_async_d2h_copy=False,
    )
    s.copy_stream_ctx = torch.cpu.stream(s.copy_stream)
    if materializer is not None:
        s.__dict__[I.ATTR] = materializer
    return s


@pytest.fixture(scope="module")
def factory():
    return GrammarFactory(vocab=2048, pad=64, mix="all")


def _finish(reason):
    return None if reason is None else (type(reason).__name__, reason.to_json())


class World:
    def __init__(self, factory, seed, bs):
        rng = random.Random(seed)
        self.reqs, self.instances = [], []
        for r in range(bs):
            req = Req(f"req-{r}", "", [1, 2, 3], SamplingParams(max_new_tokens=rng.randint(6, 40)))
            base, ids = factory.compiled[rng.randrange(len(factory.compiled))]
            roll = rng.random()
            if roll < 0.15:
                ids = None
            else:
                g = base.copy()
                k = rng.randint(0, len(ids) - 1)
                for t in ids[:k]:
                    g.accept_token(t)
                req.grammar = factory.reasoner(g, reasoning=False) if roll > 0.8 else g
                ids = ids[k:]
            req.kv.kv_committed_len = 3
            self.reqs.append(req)
            self.instances.append(ids)
        self.batch = ScheduleBatch(
            reqs=list(self.reqs),
            forward_mode=ForwardMode.DECODE,
            spec_algorithm=SpeculativeAlgorithm.DSPARK,
            has_grammar=any(r.grammar is not None for r in self.reqs),
            return_logprob=False,
        )

    def state(self):
        return [
            (
                r.rid,
                list(r.output_ids),
                r.kv.kv_committed_len,
                r.spec_verify_ct,
                r.spec_num_correct_drafts,
                list(r.spec_correct_drafts_histogram),
                r.spec_num_block_accept_tokens,
                r.spec_num_cap_tokens,
                list(r.spec_cap_lens_histogram),
                r.is_retracted,
                _finish(r.finished_reason),
                _finish(r.to_finish),
                matcher_state(r.grammar),
            )
            for r in self.reqs
        ]

    def settle(self, predicted):
        """What process_batch_result_decode does with the result afterwards (finish state, output)."""
        for req, tokens in zip(self.reqs, predicted):
            if req.finished() or req.is_retracted:
                continue
            req.output_ids.extend(tokens)
            if req.to_finish is not None:
                req.finished_reason, req.to_finish = req.to_finish, None
            elif req.grammar is not None and req.grammar.is_terminated():
                req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            elif len(req.output_ids) >= req.sampling_params.max_new_tokens:
                req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            if req.grammar is not None:
                req.grammar.finished = req.finished()


def step_inputs(rng, world, factory, stride, cursors):
    V = factory.vocab_size
    tokens, accept = [], []
    for i in range(len(world.reqs)):
        ids = world.instances[i]
        if ids is None:
            row = [rng.randrange(V) for _ in range(stride)]
        else:
            row = ids[cursors[i] : cursors[i] + stride]
            row += [rng.randrange(V) for _ in range(stride - len(row))]
            if rng.random() < 0.12:
                row[rng.randrange(stride)] = rng.randrange(V)  # an invalid token: the request aborts
        tokens += row
        accept.append(rng.randint(1, stride))
    block = [rng.randint(0, a) for a in accept]
    cap = [rng.randint(0, stride) for _ in accept]
    retract = [rng.random() < 0.05 for _ in world.reqs]
    barrier = rng.random() < 0.5
    return tokens, accept, block, cap, retract, barrier


def make_result(tokens, accept, block, cap, stride):
    res = GenerationBatchResult(
        next_token_ids=torch.tensor(tokens),
        accept_lens=torch.tensor(accept, dtype=torch.int32),
        block_accept_lens=torch.tensor(block, dtype=torch.int32),
        cap_lens=torch.tensor(cap, dtype=torch.int32),
        speculative_num_draft_tokens=stride,
    )
    res.copy_done = torch.cpu.Event()  # the overlap loop sets it right before _copy_result_to_cpu
    return res


def copy_in_forward(copy, sched, res, batch):
    """``copy`` (stock's or the wrapped ``Scheduler._copy_result_to_cpu``) called as stock's overlap loop
    calls it: inside ``Scheduler._forward_isolation``, where DSpark's verify has set the batch's forward mode
    to TARGET_VERIFY; the isolation restores DECODE afterwards, which is what the result processor sees
    (found on the real DSpark CPU server: a wrapper deciding by the batch's mode at copy time never
    submitted, and the first consumer failed)."""
    mode = batch.forward_mode
    batch.forward_mode = ForwardMode.TARGET_VERIFY if mode == ForwardMode.DECODE else mode
    try:
        copy(sched, res, batch)
    finally:
        batch.forward_mode = mode


def result_view(res):
    return (
        res.num_correct_drafts_per_req_cpu,
        res.num_correct_drafts,
        res.num_block_accept_tokens,
        res.num_cap_tokens,
        res.grammar_advanced,
        res.grammar_retained_tokens,
    )


@pytest.mark.parametrize("seed", range(8))
def test_resolve_and_advance_identical_to_stock(factory, seed):
    bs, stride = [(12, 4), (5, 8), (20, 3), (1, 6)][seed % 4]
    a, b = World(factory, seed, bs), World(factory, seed, bs)
    stock_proc, hard_proc = processor(CLS), processor(Hardened)
    mat = Materializer(queue_size=2, timeout_s=10.0, done_cls=I._done_cls())
    sched_a, sched_b = scheduler(), scheduler(mat)
    rng = random.Random(1000 + seed)
    cursors = [0] * bs
    saw = {"terminated": 0, "aborted": 0, "retracted": 0}
    try:
        for _ in range(12):
            tokens, accept, block, cap, retract, barrier = step_inputs(rng, a, factory, stride, cursors)
            for w in (a, b):
                for req, r in zip(w.reqs, retract):
                    if r and not req.finished():
                        req.is_retracted = True
            ra, rb = make_result(tokens, accept, block, cap, stride), make_result(tokens, accept, block, cap, stride)
            copy_in_forward(STOCK_COPY, sched_a, ra, a.batch)
            copy_in_forward(HARDENED_COPY, sched_b, rb, b.batch)
            assert getattr(rb, "_dspark_harden_result_seq", None) == mat.seq
            if barrier:  # the grammar barrier inside the next verify advances first
                CLS.advance_grammar_fsm(stock_proc, ra, a.batch)
                Hardened.advance_grammar_fsm(hard_proc, rb, b.batch)
            pa = CLS._resolve_spec_v2_tokens(stock_proc, ra, a.batch)
            pb = Hardened._resolve_spec_v2_tokens(hard_proc, rb, b.batch)
            assert getattr(rb, RECORD_ATTR).seq == mat.seq
            assert pb == pa
            assert result_view(rb) == result_view(ra)
            for i, ret in enumerate(ra.grammar_retained_tokens or []):
                if ret is not None:
                    cursors[i] += len(ret)
            a.settle(pa)
            b.settle(pb)
            assert b.state() == a.state()
            assert hard_proc.metrics_reporter.calls == stock_proc.metrics_reporter.calls
        for req in a.reqs:
            saw["retracted"] += req.is_retracted
            saw["aborted"] += "Grammar accept_token failed" in str(_finish(req.finished_reason))
            saw["terminated"] += req.grammar is not None and req.grammar.is_terminated()
    finally:
        assert mat.shutdown(2.0)
    if seed == 0:  # the randomized runs exercise what the docstring claims (checked on one seed's bs=12)
        assert saw["terminated"] and saw["aborted"], saw


def test_runs_cover_termination_abort_and_retraction(factory):
    """Across the seeds above: grammar termination mid-run, aborts and retractions all happen."""
    totals = {"terminated": 0, "aborted": 0, "retracted": 0, "finished": 0}
    for seed in range(8):
        bs, stride = [(12, 4), (5, 8), (20, 3), (1, 6)][seed % 4]
        a = World(factory, seed, bs)
        proc, sched = processor(CLS), scheduler()
        rng, cursors = random.Random(1000 + seed), [0] * bs
        for _ in range(12):
            tokens, accept, block, cap, retract, barrier = step_inputs(rng, a, factory, stride, cursors)
            for req, r in zip(a.reqs, retract):
                if r and not req.finished():
                    req.is_retracted = True
            ra = make_result(tokens, accept, block, cap, stride)
            copy_in_forward(STOCK_COPY, sched, ra, a.batch)
            pa = CLS._resolve_spec_v2_tokens(proc, ra, a.batch)
            for i, ret in enumerate(ra.grammar_retained_tokens or []):
                if ret is not None:
                    cursors[i] += len(ret)
            a.settle(pa)
        for req in a.reqs:
            totals["retracted"] += req.is_retracted
            totals["finished"] += req.finished()
            totals["aborted"] += "Grammar accept_token failed" in str(_finish(req.finished_reason))
            totals["terminated"] += bool(req.grammar is not None and req.grammar.is_terminated())
    assert all(totals.values()), totals


def test_logprob_lists_identical_to_stock(factory):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    bs, stride = 4, 3
    for world_seed in range(2):
        outs = []
        for cls, copy in ((CLS, STOCK_COPY), (Hardened, HARDENED_COPY)):
            w = World(factory, world_seed, bs)
            w.batch.return_logprob = True
            mat = Materializer(queue_size=2, timeout_s=10.0, done_cls=I._done_cls())
            g = torch.Generator().manual_seed(world_seed)
            res = make_result([5] * (bs * stride), [stride] * bs, [0] * bs, [0] * bs, stride)
            res.logits_output = LogitsProcessorOutput(
                next_token_logits=None,
                next_token_logprobs=torch.rand(bs, stride, generator=g),
                next_token_top_logprobs_val=[torch.rand(2, generator=g) for _ in range(bs * stride)],
                next_token_top_logprobs_idx=[torch.arange(2) for _ in range(bs * stride)],
                next_token_token_ids_logprobs_val=[torch.rand(1, generator=g) for _ in range(bs * stride)],
            )
            copy_in_forward(copy, scheduler(mat), res, w.batch)
            proc = processor(cls)
            ids, lps = cls._normalize_decode_outputs(
                proc, batch=w.batch, result=res, logits_output=res.logits_output, next_token_ids=res.next_token_ids
            )
            lo = res.logits_output
            outs.append(
                (
                    ids,
                    lps,
                    lo.next_token_top_logprobs_val,
                    lo.next_token_top_logprobs_idx,
                    lo.next_token_token_ids_logprobs_val,
                    w.state(),
                )
            )
            assert mat.shutdown(2.0)
        assert outs[1] == outs[0]


def test_non_dspark_and_extend_results_run_stock(factory):
    """Only DSpark decode results are materialized: an EAGLE decode result and a DSpark extend result (no
    accept lengths, as DSparkWorkerV2's prefill returns it) go through the stock methods untouched (no
    record, no step number, copy_done stays the event)."""
    for spec, mode in (
        (SpeculativeAlgorithm.EAGLE, ForwardMode.DECODE),
        (SpeculativeAlgorithm.DSPARK, ForwardMode.EXTEND),
    ):
        w = World(factory, 3, 2)
        w.batch.spec_algorithm, w.batch.forward_mode = spec, mode
        mat = Materializer(queue_size=2, timeout_s=10.0, done_cls=I._done_cls())
        res = make_result([7] * 4, [1, 2], [0, 0], [0, 0], 2)
        if mode == ForwardMode.EXTEND:
            res.accept_lens = res.block_accept_lens = res.cap_lens = None
        event = res.copy_done
        copy_in_forward(HARDENED_COPY, scheduler(mat), res, w.batch)
        assert res.copy_done is event and mat.seq == 0 and not hasattr(res, RECORD_ATTR)
        assert mat.shutdown(2.0)


def test_missing_record_raises_naming_the_consumer(factory):
    w = World(factory, 5, 3)
    res = make_result([7] * 6, [1, 2, 1], [0] * 3, [0] * 3, 2)
    STOCK_COPY(scheduler(), res, w.batch)  # a DSpark decode result that bypassed the wrapper
    with pytest.raises(
        MaterializerError,
        match="_resolve_spec_v2_tokens: a DSpark decode result reached the consumer without a materializer step",
    ):
        Hardened._resolve_spec_v2_tokens(processor(Hardened), res, w.batch)
    with pytest.raises(MaterializerError, match="advance_grammar_fsm"):
        Hardened.advance_grammar_fsm(processor(Hardened), res, w.batch)


def test_record_of_another_step_raises_naming_both_steps(factory):
    w = World(factory, 6, 3)
    mat = Materializer(queue_size=4, timeout_s=10.0, done_cls=I._done_cls())
    sched = scheduler(mat)
    r1 = make_result([7] * 6, [1, 2, 1], [0] * 3, [0] * 3, 2)
    r2 = make_result([8] * 6, [2, 2, 1], [0] * 3, [0] * 3, 2)
    copy_in_forward(HARDENED_COPY, sched, r1, w.batch)
    copy_in_forward(HARDENED_COPY, sched, r2, w.batch)
    r1.copy_done.synchronize()
    r2.copy_done.synchronize()
    setattr(r2, RECORD_ATTR, getattr(r1, RECORD_ATTR))  # step 1's record on step 2's result
    with pytest.raises(MaterializerError, match="DSpark result of step 2 carries the record of step 1"):
        Hardened._resolve_spec_v2_tokens(processor(Hardened), r2, w.batch)
    assert mat.shutdown(2.0)
