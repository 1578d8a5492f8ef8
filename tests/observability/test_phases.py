"""Scheduler phase metrics: the recorder's arithmetic, and the declared patches bound by the real
binder against the real sglang 0.5.23 Scheduler / SchedulerRequestReceiver classes (in a fresh
interpreter, since binding patches SGLang). The timing on a live scheduler loop, in SGLang's
multiprocess mode, is proven end to end in test_e2e_observability.py."""

from __future__ import annotations

import pytest

from dspark_harden.observability import phases
from dspark_harden.observability.metrics import SCHEDULER_PHASES

from ..plugin._proc import run_py


class FakeClock:
    """A settable clock: the recorder's flush decisions are tested without timing assertions."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Sink:
    def __init__(self):
        self.value = 0.0
        self.sets = []

    def inc(self, v):
        self.value += v

    def set(self, v):
        self.value = v
        self.sets.append(v)


def _recorder(interval=1.0):
    clock = FakeClock()
    rec = phases.PhaseRecorder(dp_label="1", interval_s=interval, clock=clock)
    rec._children = [(Sink(), Sink(), Sink()) for _ in rec.phases]
    return rec, clock


def test_recorder_accumulates_and_flushes_once_per_interval():
    rec, clock = _recorder()
    rb = rec.index("run_batch")
    sec, calls, mx = rec._children[rb]
    rec.observe(rb, 0.25, clock.t + 0.1)
    rec.observe(rb, 0.5, clock.t + 0.2)
    assert (sec.value, calls.value, rec.flushes) == (0.0, 0.0, 0)  # not yet: inside the window
    rec.observe(rb, 0.125, clock.t + 1.0)  # window over: flush
    assert (sec.value, calls.value, mx.value, rec.flushes) == (0.875, 3, 0.5, 1)
    assert rec.seconds[rb] == 0.0 and rec.calls[rb] == 0 and rec.max[rb] == 0.0


def test_rolling_max_is_per_window_and_drops_to_zero_when_idle():
    rec, clock = _recorder()
    rb, idle = rec.index("run_batch"), rec.index("idle")
    rec.observe(rb, 0.9, 101.0)  # window 1 (flushes)
    assert rec._children[rb][2].value == 0.9
    rec.observe(idle, 0.01, 102.5)  # window 2: run_batch did not run
    assert rec._children[rb][2].value == 0.0
    assert rec._children[idle][2].value == 0.01
    assert rec._children[rb][1].value == 1  # counters keep accumulating


def test_disabled_recorder_records_nothing():
    rec, clock = _recorder()
    rec.enabled = False
    rec.observe(0, 1.0, 1e9)
    rec.flush()
    assert rec.calls == [0] * len(rec.phases) and rec.flushes == 0


def test_bad_interval_is_rejected():
    with pytest.raises(ValueError, match="positive"):
        phases.PhaseRecorder(interval_s=0)


def test_timed_wrapper_records_calls_and_reraises():
    rec, clock = _recorder(interval=1e9)
    saved = phases.RECORDER
    phases.RECORDER = rec
    try:

        def stock(self, x):
            if x < 0:
                raise ValueError("negative")
            return x * 2

        wrapped = phases.timed(stock, "get_next_batch_to_run")
        assert wrapped.__wrapped__ is stock and wrapped.__name__ == "stock"
        assert wrapped(None, 21) == 42
        with pytest.raises(ValueError, match="negative"):
            wrapped(None, -1)
        i = rec.index("get_next_batch_to_run")
        assert rec.calls[i] == 2 and rec.seconds[i] >= 0.0
    finally:
        phases.RECORDER = saved


@pytest.mark.parametrize(
    "tp,dp,dpa,rank,expected",
    [
        (2, 2, True, 0, True),
        (2, 2, True, 1, True),  # DP2 attention over TP2: attn-TP1, every rank
        (4, 2, True, 1, False),
        (4, 2, True, 2, True),  # attn-TP2: first rank of each DP group
        (2, 1, False, 1, False),
        (2, 1, False, 0, True),  # plain TP2: rank 0 only
    ],
)
def test_records_only_on_first_attention_tp_rank(tp, dp, dpa, rank, expected):
    from types import SimpleNamespace

    args = SimpleNamespace(tp_size=tp, dp_size=dp, enable_dp_attention=dpa)
    assert phases.records_here(args, rank) is expected
    if dpa:  # the form sglang 0.5.23 resolves "--dp-size N --enable-dp-attention" into
        resolved = SimpleNamespace(tp_size=tp, dp_size=1, attn_dp_size=dp, enable_dp_attention=True)
        assert phases.records_here(resolved, rank) is expected


def test_phase_targets_match_the_declared_phases():
    assert tuple(t[0] for t in phases.TARGETS) == SCHEDULER_PHASES
    assert len({t[1] for t in phases.TARGETS}) == len(phases.TARGETS)


_BIND = """
import os, time
from types import SimpleNamespace
import pluggy
from dspark_harden.core import binder, hookspecs, roles
from dspark_harden.core.patch import Role
from dspark_harden.core.roles import ProcessContext
from dspark_harden.observability import feature as obs, phases
from dspark_harden import entry

args = SimpleNamespace(enable_metrics=METRICS, tp_size=2, dp_size=2, enable_dp_attention=True)
roles.CONTEXT = ProcessContext(role=Role.SCHEDULER, server_args=args, tp_rank=1, dp_rank=1)
pm = pluggy.PluginManager(hookspecs.PROJECT)
pm.add_hookspecs(hookspecs)
pm.register(obs)
report = binder.bind(Role.SCHEDULER, pm=pm, environ=ENVIRON)
feats = {f.name: (f.status, f.detail, [(t.target, t.bound, t.detail) for t in f.targets]) for f in report.features}
out = {"ok": report.ok, "features": feats}
if report.ok and feats["scheduler-phase-metrics"][0] == "bound":
    binder.STATE.pm = pm
    entry._notify_bound(Role.SCHEDULER, report)
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.request_receiver import SchedulerRequestReceiver
    from sglang.srt.observability.scheduler_stage_metrics import SchedulerStageMetricsRecorder
    live = {p.target: p.replacement for p in binder.STATE.patches}
    out["wrapped_stock"] = all(
        getattr(live[t], "__wrapped__", None) is not None for _, t, _ in phases.TARGETS)
    # call the real (wrapped) SchedulerRequestReceiver.recv_requests on a real receiver with
    # SGLang's real stage recorder; its recv skipper (a stand-in: no batch is running) makes the
    # stock method return early, before it would need the process groups of a live scheduler
    skipped = []
    stage = SchedulerStageMetricsRecorder(enabled=True)
    stage.start(time.monotonic_ns())
    receiver = SchedulerRequestReceiver(
        recv_from_tokenizer=None, recv_from_rpc=None,
        recv_skipper=SimpleNamespace(handle=lambda last: skipped.append(last) and False),
        input_blocker=None, mm_receiver=None, server_args=None, model_config=None,
        max_recv_per_poll=-1, stream_output=None, get_last_batch=lambda: None,
        scheduler_stage_metrics=stage,
    )
    results = [receiver.recv_requests(), receiver.recv_requests()]
    rec = phases.recorder()
    i = rec.index("recv_requests")
    out["calls"] = rec.calls[i]
    out["results"] = results
    out["skipped"] = len(skipped)
    out["stage_recorded"] = any(k[0] == "recv_requests" for k in stage.drain(time.monotonic_ns()))
    out["dp_label"] = rec.dp_label
    binder.revert_all()
    out["reverted"] = all(
        getattr(Scheduler.__dict__[t.split(".")[-1]], "__dspark_patch__", None) is None
        for _, t, _ in phases.TARGETS if ":Scheduler." in t
    ) and getattr(SchedulerRequestReceiver.__dict__["recv_requests"], "__dspark_patch__", None) is None
emit(out)
"""


def _bind(metrics_on: bool, environ: dict):
    code = _BIND.replace("METRICS", repr(metrics_on)).replace("ENVIRON", repr(environ))
    rc, res, out = run_py(code)
    assert rc == 0 and res is not None, out
    return res


def test_patches_bind_on_the_real_scheduler_classes_record_and_revert():
    res = _bind(True, {})
    assert res["ok"], res
    status, _, targets = res["features"]["scheduler-phase-metrics"]
    assert status == "bound"
    assert sorted(t[0] for t in targets) == sorted(t[1] for t in phases.TARGETS)
    assert all(bound for _, bound, _ in targets), targets
    assert res["wrapped_stock"]
    assert res["calls"] == 2 and res["skipped"] == 2 and res["results"] == [[], []]
    assert res["stage_recorded"], "SGLang's own stage metrics must keep working under our wrapper"
    assert res["dp_label"] == "1"
    assert res["reverted"]


def test_without_enable_metrics_the_feature_is_unavailable_or_fails_when_explicit():
    res = _bind(False, {})
    assert res["ok"]
    assert res["features"]["scheduler-phase-metrics"][0] == "unavailable"
    assert "--enable-metrics" in res["features"]["scheduler-phase-metrics"][1]
    res = _bind(False, {"DSPARK_HARDEN_SCHEDULER_PHASE_METRICS": "1"})
    assert not res["ok"]
    assert res["features"]["scheduler-phase-metrics"][0] == "failed"


def test_switch_off_binds_nothing():
    res = _bind(True, {"DSPARK_HARDEN_SCHEDULER_PHASE_METRICS": "0"})
    assert res["ok"] and res["features"]["scheduler-phase-metrics"][0] == "disabled"
    assert res["features"]["scheduler-phase-metrics"][2] == []


def test_bad_flush_interval_is_a_startup_error_naming_the_variable():
    res = _bind(True, {"DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S": "0"})
    assert not res["ok"]
    rc, r2, out = run_py("""
        from dspark_harden.core import binder
        from dspark_harden.core.patch import Role
        rep = binder.bind(Role.DETOKENIZER, environ={"DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S": "-1"})
        emit(rep.errors)
    """)
    assert rc == 0, out
    assert any("DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S" in e for e in r2), r2
