"""The planner guard's check at the step's result sync (issue 41 item 3), on the CPU host, through the
feature's own bound patches on stock SGLang 0.5.23's real ``SchedulerBatchResultProcessor``.

What is real: the processor (the stock frozen dataclass, its collaborators namespaces recording what it
calls), its ``process_batch_result_prefill`` / ``_decode`` under the feature's wrap (the ``Patch`` objects
``feature.patches`` declares, applied with their fingerprints), a real ``Req`` and ``GenerationBatchResult``,
stock's ``HostCopyDone`` as the step's ``copy_done`` (the done object of stock's async D2H copy worker),
the runtime config published from a real ``ServerArgs``, and ``planner_device``'s own registry and
``report``. The stand-in for the GPU: the guard state's mirror is a CPU ``int32[4]`` tensor (on the GPU
machine it is pinned host memory written by the publish kernel queued behind every plan), and a thread
plays the stream -- it writes the mirror (the step's plan publishing a violation), then completes the copy
(``set_done``), as the kernels queued before the step's result copy complete before its event. The batch is
a namespace with the attributes stock reads. Every test is forked: it binds patches on SGLang classes
(SGLang is imported once, here, before the forks).
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.async_d2h_copy_worker import HostCopyDone
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.runtime_context import publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from dspark_harden.core.patch import Role
from dspark_harden.core.settings import load_settings
from dspark_harden.dsv4_memory import feature as F
from dspark_harden.dsv4_memory import planner as PL
from dspark_harden.dsv4_memory import planner_device as PD
from dspark_harden.dsv4_memory import settings as S

PREFILL, DECODE = list(S.RESULT_SYNC_TARGETS)[:2]
GPU_DELAY_S = 0.05


def _bound_result_patches():
    settings = load_settings(S.SETTINGS, {S.GUARDS: "1"})
    ps = [p for p in F.patches(Role.SCHEDULER, settings) if p.target in S.RESULT_SYNC_TARGETS]
    assert sorted(p.target for p in ps) == sorted(S.RESULT_SYNC_TARGETS)
    for p in ps:
        p.apply()
        assert p.live_check() is None, p.target
    return ps


def _publish_runtime():
    import logging

    quiet = logging.getLogger("sglang")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        publish(ServerArgs(model_path="dummy", device="cpu", skip_tokenizer_init=True), role="scheduler")
    finally:
        quiet.setLevel(level)


def _guard_state(monkeypatch):
    """A guard state in planner_device's own registry whose mirror is a real CPU tensor."""
    mirror = torch.zeros(len(PD.REASONS), dtype=torch.int32)
    st = PD.GuardState(counts=None, mirror=mirror, mirror_ptr=0, view=mirror.numpy())
    monkeypatch.setattr(PD, "_STATES", {0: st})
    return st


def _step(kind: str):
    """One real stock processor, one real request (prompt 1 2 3, 8 new tokens) and the step's real result
    (sampled token 7) with a ``HostCopyDone`` not yet done."""
    ns = types.SimpleNamespace
    streamed: list = []
    proc = SchedulerBatchResultProcessor(
        is_generation=True,
        disaggregation_mode=DisaggregationMode.NULL,
        enable_overlap=True,
        enable_overlap_mlx=False,
        model_config=ns(self_opened_think_start_ids=None, think_end_ids=None),
        token_to_kv_pool_allocator=ns(free_group_begin=lambda: None, free_group_end=lambda: None),
        tree_cache=ns(checkpoint=lambda req, up_to: None),
        hisparse_coordinator=None,
        req_to_token_pool=None,
        decode_offload_manager=None,
        metrics_collector=None,
        metrics_reporter=ns(num_generated_tokens=0, forward_ct_decode=0, report_decode_stats=lambda *a, **k: None),
        draft_worker=None,
        model_worker=None,
        logprob_result_processor=None,
        output_streamer=ns(stream_output=lambda reqs, *a: streamed.append([list(r.output_ids) for r in reqs])),
        beam_coordinator=ns(commit_decode=lambda batch: set()),
        abort_request=None,
    )
    sp = SamplingParams(max_new_tokens=8)
    sp.normalize(None)
    req = Req("r0", "", [1, 2, 3], sp)
    common = dict(reqs=[req], spec_algorithm=SpeculativeAlgorithm.NONE, spec_info=None, return_logprob=False)
    if kind == "prefill":
        batch = ns(
            forward_mode=ForwardMode.EXTEND,
            return_hidden_states=False,
            return_hidden_states_mode=CaptureHiddenMode.NULL,
            decoding_reqs=None,
            prefill_stats=None,
            **common,
        )
        run = proc.process_batch_result_prefill
    else:
        batch = ns(forward_mode=ForwardMode.DECODE, batch_size=lambda: 1, mamba_track_mask_cpu=None, **common)
        run = proc.process_batch_result_decode
    done = HostCopyDone()
    result = GenerationBatchResult(next_token_ids=torch.tensor([7]), can_run_cuda_graph=False, copy_done=done)
    return run, batch, result, req, streamed


def _gpu(done, mirror=None, reason: int = 0):
    """The stream, played by a thread: after GPU_DELAY_S the step's plan publishes (``mirror`` given: its
    counter rises), then the step's result copy completes."""

    def body():
        time.sleep(GPU_DELAY_S)
        if mirror is not None:
            mirror[reason] += 1
        done.set_done()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


@pytest.mark.forked
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_step_whose_plan_published_a_violation_fails_at_its_result_sync_before_any_token_is_appended(
    kind, monkeypatch
):
    """The step's plan publishes its violation only while the host already waits at the step's result
    sync (the mirror is still clean when the processor is called): the wrapper waits for the copy, reads
    the mirror, raises naming the reason and the result sync, and stock never runs -- the request's
    output_ids are unchanged and nothing is streamed. The next clean step passes (the report is not
    repeated)."""
    _publish_runtime()
    st = _guard_state(monkeypatch)
    patches = _bound_result_patches()
    try:
        run, batch, result, req, streamed = _step(kind)
        before = list(req.output_ids)
        gpu = _gpu(result.copy_done, st.mirror, reason=1)
        assert not result.copy_done.query() and int(st.mirror.sum()) == 0  # nothing published yet
        with pytest.raises(PL.PlannerBoundsError) as failed:
            run(batch, result)
        gpu.join()
        msg = str(failed.value)
        assert PD.REASONS[1] in msg and "(x1)" in msg and PL.AT_RESULT_SYNC in msg, msg
        assert list(req.output_ids) == before == [] and streamed == []
        # the step after: its copy completes with nothing new published -> stock appends and streams
        run, batch, result, req, streamed = _step(kind)
        _gpu(result.copy_done).join()
        run(batch, result)
        assert list(req.output_ids) == [7] and streamed == [[[7]]]
    finally:
        for p in reversed(patches):
            p.revert()


@pytest.mark.forked
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_clean_step_passes_through_to_stock_unchanged(kind, monkeypatch):
    """With a guard state and a clean mirror the wrapped processor does what stock alone does on the same
    step (the request's output_ids, what is streamed, the return value), after waiting for the copy; with
    no guard state yet (no guarded plan has run) it adds no wait: ``copy_done.synchronize()`` is called
    once, by stock."""
    _publish_runtime()
    run, batch, result, req, streamed = _step(kind)
    _gpu(result.copy_done).join()
    stock_ret = run(batch, result)
    stock_seen = (list(req.output_ids), streamed)
    assert stock_seen == ([7], [[[7]]])

    _guard_state(monkeypatch)
    patches = _bound_result_patches()
    try:
        run, batch, result, req, streamed = _step(kind)
        gpu = _gpu(result.copy_done)
        assert run(batch, result) == stock_ret
        gpu.join()
        assert (list(req.output_ids), streamed) == stock_seen

        monkeypatch.setattr(PD, "_STATES", {})
        run, batch, result, req, streamed = _step(kind)
        calls = []
        sync = result.copy_done.synchronize
        result.copy_done.synchronize = lambda: (calls.append(1), sync())[1]
        result.copy_done.set_done()
        run(batch, result)
        assert calls == [1] and (list(req.output_ids), streamed) == stock_seen
    finally:
        for p in reversed(patches):
            p.revert()


@pytest.mark.forked
def test_without_a_copy_event_the_wrapper_waits_for_the_stream_before_reading(monkeypatch):
    """Non-overlap scheduling: ``copy_done`` is None and stock's ``.tolist()`` of the device tokens is the
    wait. The wrapper waits for the current stream first (``planner_device.sync_current_streams``; here a
    stand-in that plays the stream completing the step's publishing plan, since the real one needs CUDA),
    then reads the mirror: the step fails before a token is appended."""
    _publish_runtime()
    st = _guard_state(monkeypatch)
    order = []

    def stream_completes():
        order.append("sync")
        st.mirror[2] += 3

    monkeypatch.setattr(PD, "sync_current_streams", stream_completes)
    patches = _bound_result_patches()
    try:
        run, batch, result, req, streamed = _step("decode")
        result.copy_done = None
        with pytest.raises(PL.PlannerBoundsError, match=r"GPU-input lengths\) \(x3\)"):
            run(batch, result)
        assert order == ["sync"] and list(req.output_ids) == [] and streamed == []
    finally:
        for p in reversed(patches):
            p.revert()


@pytest.mark.forked
def test_the_pd_prefill_servers_result_processor_is_checked_too(monkeypatch):
    """``process_batch_result_disagg_prefill`` (the PD prefill server's own processor, on the Scheduler
    mixin) under the feature's wrap: a violation published before the step's copy completes fails the step
    before stock's body runs (the scheduler object is a namespace stock would fail on at its first
    attribute; the real class method is the one the Scheduler inherits)."""
    st = _guard_state(monkeypatch)
    patches = _bound_result_patches()
    try:
        _, batch, result, req, _ = _step("prefill")
        gpu = _gpu(result.copy_done, st.mirror, reason=0)
        with pytest.raises(PL.PlannerBoundsError, match="req_to_token read outside its allocation"):
            Scheduler.process_batch_result_disagg_prefill(types.SimpleNamespace(), batch, result)
        gpu.join()
        assert list(req.output_ids) == []
    finally:
        for p in reversed(patches):
            p.revert()
