"""DSpark grammar-mask pipeline on a real GPU (skipped without CUDA).

Runs without SGLang (the GPU machine has none): pure torch + xgrammar, the same traversal and
pipeline modules the DSpark patch uses. Stand-ins: the verify ids are random draft chains written
by the test (no DSpark draft model), and "logits" are random tensors; a ``torch.cuda._sleep`` kernel
plays the target verify that keeps the compute stream busy. Command and output: tests/gpu/RUN.md.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from dspark_harden.dspark_masks.pipeline import GeometryError, MaskPipeline, PipelineError  # noqa: E402
from dspark_harden.dspark_masks.traversal import ChainTraverser  # noqa: E402

DEV = torch.device("cuda", 0)
SLEEP = 200_000  # cycles (~0.1 ms at ~2 GHz)


@pytest.fixture(scope="module")
def native():
    from dspark_harden.dspark_masks.workload import NativeFactory

    return NativeFactory(vocab=32000, pad=64)


@pytest.mark.parametrize("engine", ["native", "scalar", "threads", "level"])
def test_pipeline_masks_equal_cpu_path_while_compute_stream_is_busy(native, engine):
    """Each step: the compute stream sleeps, then writes the step's verify ids (so the D2H must wait
    for it), begin(); the compute stream sleeps again (target verify); finish() traverses and
    uploads; a consumer on the compute stream copies the mask and masks logits; consumed().
    Every mask and every masked logit row equals the synchronous CPU path."""
    import xgrammar as xgr

    from dspark_harden.dspark_masks.workload import native_jobs, reference_masks

    bs, chain, V = 64, 8, native.vocab_size
    traverser = ChainTraverser(engine, threads=4)
    pipe = MaskPipeline(DEV, capacity=16)  # grows to 64 on the first step
    verify = torch.full((bs, chain), -7, dtype=torch.int64, device=DEV)
    seen, want = [], []
    stream = torch.cuda.current_stream(DEV)
    for step in range(30):
        matchers, roots, draft = native.batch(bs, chain, seed=step)
        # the independent reference (plain xgrammar calls in stock's order), not one of the engines
        ref = reference_masks(matchers, roots, draft, V)
        src = draft.to(DEV)
        torch.cuda._sleep(SLEEP)
        verify.copy_(src)  # ordered after the sleep on the compute stream
        ticket = pipe.begin(verify)
        torch.cuda._sleep(SLEEP)  # "target verify"

        def fill(host_draft, host_mask):
            assert torch.equal(host_draft, draft), f"step {step}: draft copy not ordered after its producer"
            jobs = native_jobs(matchers, roots, host_draft, V)
            if not jobs:
                return False
            traverser.traverse(jobs, host_draft, host_mask, V)
            return True

        mask = pipe.finish(ticket, fill, V)
        assert mask is not None and mask.is_cuda and mask.shape == ref.shape
        torch.cuda._sleep(SLEEP)  # the consumer reads late
        seen.append(mask.clone())
        logits = torch.randn((bs * chain, V), generator=torch.Generator().manual_seed(step)).to(DEV)
        xgr.apply_token_bitmask_inplace(logits, mask)
        seen.append(logits)
        pipe.consumed(ticket)
        cpu_logits = torch.randn((bs * chain, V), generator=torch.Generator().manual_seed(step))
        xgr.apply_token_bitmask_inplace(cpu_logits, ref)
        want.append(ref)
        want.append(cpu_logits)
    stream.synchronize()
    for i, (got, exp) in enumerate(zip(seen, want)):
        assert torch.equal(got.cpu(), exp), f"step {i // 2}: {'mask' if i % 2 == 0 else 'masked logits'} differ"
    assert pipe.capacity >= bs
    traverser.close()


def _stress(
    pipe: MaskPipeline, steps: int, *, side_consumer: bool, bs=4, chain=4, vocab=32 * 64, seed=0, sleep_max=40_000
):
    """Step-specific ids and masks; the consumer reads after a random delay, either on the compute
    stream or on a side stream (e.g. a sampling stream: then begin()'s wait on the compute stream
    does not order the next uploads after it, only mask_consumed does). Returns the steps whose
    consumed mask was not that step's (overwritten while held) and those whose draft copy was wrong."""
    rng = random.Random(seed)
    words = (vocab + 31) // 32
    rows = bs * chain
    results = torch.empty((steps, rows, words), dtype=torch.int32, device=DEV)
    verify = torch.empty((bs, chain), dtype=torch.int64, device=DEV)
    base_ids = torch.arange(bs * chain, dtype=torch.int64, device=DEV).view(bs, chain)
    row_ids = torch.arange(rows, dtype=torch.int32).view(rows, 1)
    col_ids = torch.arange(words, dtype=torch.int32).view(1, words)
    compute = torch.cuda.current_stream(DEV)
    side = torch.cuda.Stream(DEV)
    bad_drafts = []
    for step in range(steps):
        if rng.random() < 0.5:
            torch.cuda._sleep(rng.randrange(sleep_max))
        torch.add(base_ids, step * 1000, out=verify)
        ticket = pipe.begin(verify)

        def fill(host_draft, host_mask, step=step):
            if int(host_draft[0, 0]) != step * 1000 or int(host_draft[-1, -1]) != step * 1000 + rows - 1:
                bad_drafts.append(step)
            torch.add(row_ids * 131 + col_ids, step * 7919, out=host_mask)
            return True

        mask = pipe.finish(ticket, fill, vocab)
        consumer = side if side_consumer else compute
        with torch.cuda.stream(consumer):
            consumer.wait_stream(compute)  # compute already waits on mask_ready
            torch.cuda._sleep(rng.randrange(sleep_max))  # consumer still busy: it reads later
            results[step].copy_(mask)
            pipe.consumed(ticket)  # records mask_consumed on the consumer's stream
    torch.cuda.synchronize(DEV)
    expected = (row_ids * 131 + col_ids).to(DEV)
    got = results - torch.arange(steps, dtype=torch.int32, device=DEV).view(steps, 1, 1) * 7919
    wrong = (got != expected).flatten(1).any(1).nonzero().flatten().tolist()
    return wrong, bad_drafts


@pytest.mark.parametrize("side_consumer", [False, True], ids=["compute-stream-consumer", "side-stream-consumer"])
def test_slot_never_overwritten_while_its_consumer_holds_it_10k_steps(side_consumer):
    pipe = MaskPipeline(DEV, capacity=4)
    wrong, bad_drafts = _stress(pipe, 10_000, side_consumer=side_consumer)
    assert pipe.steps == 10_000
    assert not bad_drafts, f"draft copies not ordered after their producer at steps {bad_drafts[:10]}"
    assert not wrong, f"{len(wrong)} consumed masks were overwritten, first steps {wrong[:10]}"


class _NoConsumerWait(MaskPipeline):
    """Negative control: forgets every mask_consumed event (the bug the protocol prevents)."""

    def consumed(self, ticket):
        super().consumed(ticket)
        self._slots[ticket.slot].consumed_pending = False


def test_stress_detects_overwrite_when_the_consumer_wait_is_missing():
    """The stress check is not vacuous: with a side-stream consumer and without the mask_consumed
    wait, masks are overwritten before the consumer reads them."""
    wrong, _ = _stress(_NoConsumerWait(DEV, capacity=4), 300, side_consumer=True, sleep_max=2_000_000)
    assert wrong, "expected overwritten masks without the mask_consumed wait"


def test_missing_or_out_of_order_events_raise():
    pipe = MaskPipeline(DEV, capacity=2)
    ids = torch.zeros((2, 4), dtype=torch.int64, device=DEV)
    fill = lambda d, m: (m.fill_(-1), True)[1]  # noqa: E731

    t0 = pipe.begin(ids)
    with pytest.raises(PipelineError, match="never finished"):
        pipe.begin(ids)  # begin twice
    with pytest.raises(PipelineError, match="out of order"):
        pipe.consumed(t0)  # consumed before finish
    m0 = pipe.finish(t0, fill, 128)
    assert m0 is not None
    with pytest.raises(PipelineError, match="out of order"):
        pipe.finish(t0, fill, 128)  # finish twice
    # consumer of step 0 never records mask_consumed: slot 0 comes round again after one step
    t1 = pipe.begin(ids)
    pipe.finish(t1, fill, 128)
    pipe.consumed(t1)
    with pytest.raises(PipelineError, match="mask_consumed event was never recorded"):
        pipe.begin(ids)
    pipe.consumed(t0)
    with pytest.raises(PipelineError, match="out of order"):
        pipe.consumed(t0)  # twice
    t2 = pipe.begin(ids)
    with pytest.raises(PipelineError, match="out of order"):
        pipe.finish(t0, fill, 128)  # stale ticket
    pipe.finish(t2, fill, 128)
    pipe.consumed(t2)
    with pytest.raises(GeometryError, match="chain length changed"):
        pipe.begin(torch.zeros((2, 5), dtype=torch.int64, device=DEV))
    t3 = pipe.begin(ids)
    with pytest.raises(GeometryError, match="mask width changed"):
        pipe.finish(t3, fill, 4096)
    with pytest.raises(PipelineError, match="int64"):
        pipe.begin(ids.to(torch.int32))
    with pytest.raises(PipelineError, match="contiguous"):
        pipe.begin(torch.zeros((4, 2), dtype=torch.int64, device=DEV).t())
    with pytest.raises(PipelineError, match="are on cpu"):
        pipe.begin(ids.cpu())
    pipe.close()
