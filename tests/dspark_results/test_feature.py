"""The feature's binding: opt-in, bound only for DSpark + overlap scheduling (an explicit switch on
another server fails start-up naming why), the four fingerprinted patches apply / revert / re-apply,
and the bound wrapper materializes a DSpark decode result through the live stock classes with the
metric families counting it."""

from __future__ import annotations

import sys
import types

import pluggy
import pytest

from dspark_harden.core import binder, hookspecs, roles
from dspark_harden.core.patch import Role
from dspark_harden.core.roles import ProcessContext
from dspark_harden.dspark_results import feature as F
from dspark_harden.dspark_results import integration as I
from dspark_harden.dspark_results.settings import SWITCH, SWITCH_INTERVAL, SWITCH_INTERVAL_DEFAULT_US
from tests.harness import warm

ON = {SWITCH: "1"}
TARGETS = {I.COPY_TARGET, I.RESOLVE_TARGET, I.ADVANCE_TARGET, I.NORMALIZE_TARGET}


def manager():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(F, name="dspark_harden.dspark_results.feature")
    return pm


def bind(environ):
    return binder.bind(Role.SCHEDULER, pm=manager(), environ=dict(environ))


def status(report):
    return {st.name: st for st in report.features}[F.FEATURE]


def test_preconditions():
    ok = types.SimpleNamespace(speculative_algorithm="DSPARK", disable_overlap_schedule=False)
    assert F.preconditions(ok) == []
    eagle = types.SimpleNamespace(speculative_algorithm="EAGLE", disable_overlap_schedule=False)
    assert "not DSPARK" in " ".join(F.preconditions(eagle))
    sync = types.SimpleNamespace(speculative_algorithm="DSPARK", disable_overlap_schedule=True)
    assert "overlap scheduling is disabled" in " ".join(F.preconditions(sync))
    assert "not DSPARK" in " ".join(F.preconditions(types.SimpleNamespace(speculative_algorithm=None)))


def test_fingerprints_match_the_installed_stock_sources():
    from dspark_harden.core.patch import fingerprint_source, raw_attr, resolve_owner

    for target, fp in (
        (I.COPY_TARGET, I.COPY_FINGERPRINT),
        (I.RESOLVE_TARGET, I.RESOLVE_FINGERPRINT),
        (I.ADVANCE_TARGET, I.ADVANCE_FINGERPRINT),
        (I.NORMALIZE_TARGET, I.NORMALIZE_FINGERPRINT),
    ):
        owner, attr = resolve_owner(target)
        assert fingerprint_source(raw_attr(owner, attr)) == fp, target
    assert I.probe_mirrored_sources() is None


@pytest.mark.forked
def test_off_by_default_binds_nothing():
    report = bind({})
    assert report.ok and status(report).status == "disabled"
    from sglang.srt.managers.scheduler import Scheduler

    assert not hasattr(Scheduler._copy_result_to_cpu, "__wrapped__")
    binder.revert_all()


@pytest.mark.forked
def test_explicit_switch_on_a_server_without_dspark_overlap_fails(monkeypatch):
    monkeypatch.setattr(
        roles,
        "CONTEXT",
        ProcessContext(
            Role.SCHEDULER, types.SimpleNamespace(speculative_algorithm="DSPARK", disable_overlap_schedule=True), 0, 0
        ),
    )
    report = bind(ON)
    assert not report.ok
    assert any(
        "dspark-result-materializer" in line and "overlap scheduling is disabled" in line for line in report.failures()
    ), report.failures()
    binder.revert_all()


@pytest.mark.forked
def test_bound_patches_round_trip_and_materialize_through_the_live_classes(monkeypatch):
    import torch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor as P
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from tests.dspark_results.test_differential import processor, scheduler

    monkeypatch.setattr(
        roles,
        "CONTEXT",
        ProcessContext(
            Role.SCHEDULER, types.SimpleNamespace(speculative_algorithm="DSPARK", disable_overlap_schedule=False), 0, 1
        ),
    )
    stock = (Scheduler._copy_result_to_cpu, P._resolve_spec_v2_tokens, P.advance_grammar_fsm)
    report = bind(ON)
    assert report.ok, report.failures()
    assert status(report).status == "bound"
    assert Scheduler._copy_result_to_cpu is not stock[0] and P._resolve_spec_v2_tokens is not stock[1]

    reqs = [Req(f"r{i}", "", [1, 2, 3], SamplingParams(max_new_tokens=50)) for i in range(2)]
    batch = ScheduleBatch(
        reqs=reqs,
        forward_mode=ForwardMode.DECODE,
        spec_algorithm=SpeculativeAlgorithm.DSPARK,
        has_grammar=False,
        return_logprob=False,
    )
    res = GenerationBatchResult(
        next_token_ids=torch.tensor([5, 6, 7, 8, 9, 10]),
        accept_lens=torch.tensor([2, 3]),
        speculative_num_draft_tokens=3,
    )
    res.copy_done = torch.cpu.Event()
    sched = scheduler()
    assert sys.getswitchinterval() == pytest.approx(0.005)  # the interpreter's, until a materializer exists
    Scheduler._copy_result_to_cpu(sched, res, batch)
    assert sched.__dict__[I.ATTR].seq == 1
    # the first materializer set this (scheduler) process's GIL switch interval to the setting's default
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_DEFAULT_US / 1e6)
    res.copy_done.synchronize()
    assert P._resolve_spec_v2_tokens(processor(P), res, batch) == [[5, 6], [8, 9, 10]]
    assert [r.kv.kv_committed_len for r in reqs] == [2, 3]
    text = __import__("prometheus_client").generate_latest().decode()
    # one step, converted by the thread or (the CPU copy event is complete at once) by the consumer
    done = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('dspark_harden_dspark_results_total{dp_rank="1",outcome="')
        and ('"materialized"' in line or '"converted_by_consumer"' in line)
    ]
    assert done and sum(done) == 1.0, text[-2000:]
    assert 'dspark_harden_dspark_result_phase_seconds_count{dp_rank="1",phase="consumer_wait"} 1.0' in text
    assert sched.__dict__[I.ATTR].shutdown(2.0)

    binder.revert_all()
    assert (Scheduler._copy_result_to_cpu, P._resolve_spec_v2_tokens, P.advance_grammar_fsm) == stock
    report = bind(ON)
    assert report.ok and Scheduler._copy_result_to_cpu is not stock[0]
    binder.revert_all()
    assert Scheduler._copy_result_to_cpu is stock[0]


@pytest.mark.forked
def test_switch_interval_zero_leaves_the_interpreters_and_a_bad_value_fails_naming_it(monkeypatch):
    monkeypatch.setattr(
        roles,
        "CONTEXT",
        ProcessContext(
            Role.SCHEDULER, types.SimpleNamespace(speculative_algorithm="DSPARK", disable_overlap_schedule=False), 0, 1
        ),
    )
    report = bind({**ON, SWITCH_INTERVAL: "nope"})
    assert not report.ok and any(SWITCH_INTERVAL in f for f in report.failures()), report.failures()
    binder.revert_all()
    report = bind({**ON, SWITCH_INTERVAL: "0"})
    assert report.ok, report.failures()
    mat = I.new_materializer(dp_label="0")
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert mat.shutdown(2.0)
    binder.revert_all()


def test_apply_switch_interval_sets_and_reports_the_previous_value():
    before = sys.getswitchinterval()
    try:
        assert I.apply_switch_interval(0) is None and sys.getswitchinterval() == before
        assert I.apply_switch_interval(150) == before
        assert sys.getswitchinterval() == pytest.approx(150e-6)
    finally:
        sys.setswitchinterval(before)


def test_bench_needs_cuda_and_exits_2_without_it():

    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    r = warm.run([sys.executable, "-m", "dspark_harden", "bench", "dspark-results", "--json"], timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "needs CUDA" in r.stderr


def test_switch_interval_bench_reports_both_intervals_and_restores_the_interpreters():
    """``bench switch-interval`` (issue 39): the scheduler-shaped loop's latency with real xgrammar
    compiles and a Python thread busy, at the interpreter's interval and the feature's, in alternating
    blocks; the process's interval is restored afterwards. Shape only: the figures are in
    docs/dspark_results.md (a timed assertion would need a quiet machine)."""
    from dspark_harden.dspark_results import bench_gil

    before = sys.getswitchinterval()
    args = types.SimpleNamespace(
        blocks=1,
        iterations=60,
        work_us=100.0,
        wait_us=200.0,
        compilers=1,
        python_threads=1,
        vocab=2048,
        interval_us=SWITCH_INTERVAL_DEFAULT_US,
        json=True,
    )
    out = bench_gil.run(args)
    assert sys.getswitchinterval() == before
    assert out["default"]["interval_us"] == round(before * 1e6) and out["feature"]["interval_us"] == 200
    for side in ("default", "feature"):
        r = out[side]
        assert r["iterations"] == 40 and r["floor_us"] <= r["p50_us"] <= r["p99_us"] <= r["max_us"], r
    assert out["compiles"] > 0 and out["ratio_p99"] > 0
