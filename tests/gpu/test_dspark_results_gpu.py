"""The DSpark result materializer on a real GPU (H200; torch + CUDA only, see RUN.md).

Stand-in (no SGLang server or DSpark model can run on the GPU machine): the graph-output buffers of
one DSpark verify step (``dspark_harden.dspark_results.gpu_loop``): fixed device tensors
``next_token_ids [64*8] int64`` and ``accept_lens / block_accept_lens / cap_lens [64] int32``,
rewritten in place at the end of every step's forward (several kernels, after ~0.3 ms of bf16 GEMMs
on the forward stream), exactly the way a replayed CUDA graph rewrites its outputs. Every host list
read is compared with the closed form of its own step.

* enqueue behind the forward (stock ``_copy_result_to_cpu`` on the scheduler thread) + conversion on
  the materializer thread, 10,000 steps, the consumer one step behind (overlap), launch-bound
  (GEMM) and GPU-bound (one ``_sleep`` kernel, like a graph replay) steps: 0 torn or other-step
  values;
* negative control 1, the copy *issued* from the materializer thread (stock ``AsyncD2HCopyWorker``'s
  shape, which stock keeps DSpark off): values of another step or torn ones appear;
* negative control 2, the copy enqueued on the scheduler thread but without
  ``copy_stream.wait_stream(forward_stream)``: the previous step's values appear (the checker sees a
  copy that is not behind the forward).
"""

from __future__ import annotations

import collections
import json
import os
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine: RUN.md)")

BUSY_MS = 0.3
CPU_MS = 0.2


def _report(name: str, obj) -> None:
    line = json.dumps({name: obj})
    print(line)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "dspark_results_figures.jsonl"), "a") as fh:
            fh.write(line + "\n")


def _drive(
    steps: int, *, kind: str = "gemm", thread_issues_copy: bool = False, skip_wait_stream: bool = False
) -> collections.Counter:
    from dspark_harden.dspark_results import gpu_loop
    from dspark_harden.dspark_results.materializer import Materializer, convert_result, record_of

    loop = gpu_loop.StandInDecode(64, 8, BUSY_MS, kind=kind)

    def convert_issuing_the_copy(result, seq, return_logprob):
        gpu_loop.issue_copy(loop, result)  # on the materializer thread, after the scheduler moved on
        result.copy_event.synchronize()
        return convert_result(result, seq, return_logprob)

    mat = Materializer(
        queue_size=4, timeout_s=30.0, convert=convert_issuing_the_copy if thread_issues_copy else convert_result
    )
    seen: collections.Counter = collections.Counter()
    prev = None
    try:
        for k in range(1, steps + 2):
            loop.forward(k)
            if skip_wait_stream:
                event = torch.cuda.Event()
                result = SimpleNamespace(
                    step=k,
                    logits_output=None,
                    copy_done=event,
                    copy_event=event,
                    **{f: getattr(loop, f) for f in gpu_loop.FIELDS},
                )
                gpu_loop.issue_copy(loop, result)
            else:
                result = loop.enqueue_copy(k, issue_later=thread_issues_copy)
            mat.submit(result, result.copy_done, False)
            if prev is not None:
                record = record_of(prev, "test")
                seen[gpu_loop.classify(gpu_loop.record_lists(record), loop, prev.step)] += 1
            gpu_loop.spin_cpu(CPU_MS / 1000.0)
            prev = result
        record_of(prev, "drain")
        loop.drain()
    finally:
        assert mat.shutdown(10.0)
    return seen


@pytest.mark.parametrize("kind", ["gemm", "sleep"])
def test_enqueue_behind_the_forward_and_thread_conversion_never_read_a_torn_value_10k_steps(kind):
    """``gemm``: many launches per step (host and GPU keep pace); ``sleep``: one long kernel per step
    (a graph replay: the host runs ahead of the GPU)."""
    seen = _drive(10_000, kind=kind)
    _report(f"enqueue_behind_forward_{kind}", dict(seen))
    assert sum(seen.values()) == 10_000
    assert seen["ok"] == 10_000, dict(seen)


def test_negative_control_copy_issued_from_the_background_thread_reads_other_steps():
    """Launch-bound steps (``gemm``): the next step's rewrite is done soon after its launch, so a copy
    the thread issues late (it waits for the GIL the scheduler thread holds) reads it."""
    seen = _drive(2_000, kind="gemm", thread_issues_copy=True)
    _report("copy_issued_from_thread", dict(seen))
    assert sum(seen.values()) == 2_000
    assert seen["ok"] < 2_000, f"the thread-issued copy read every step in time: {dict(seen)}"


def test_negative_control_copy_not_behind_the_forward_reads_the_previous_step():
    """GPU-bound steps (``sleep``): the copy enqueued without the stream wait runs while the forward
    is still sleeping, before the rewrite."""
    seen = _drive(2_000, kind="sleep", skip_wait_stream=True)
    _report("copy_without_wait_stream", dict(seen))
    assert seen["ok"] < 2_000, f"a copy not ordered behind the forward read every step in time: {dict(seen)}"


def test_bench_dspark_results_runs_and_is_identical():
    """``bench dspark-results`` itself on the GPU (short): identical lists on both paths."""
    from dspark_harden.dspark_results.bench import run

    res = run(steps=400, blocks=4, busy_ms=1.0, cpu_ms=0.3)  # sleep-kind steps
    _report("bench_short", res)
    assert res["identical"], res
    assert res["steps_per_path"] == 400
