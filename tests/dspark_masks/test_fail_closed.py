"""Fail-closed start-up of the DSpark grammar-mask feature (issue 23, item 4).

* engine ``auto`` refuses when neither xgrammar's batch API nor the native engine is available,
  naming why; ``scalar`` runs only when named;
* the mask pipeline's device requirements are checked at scheduler start-up against the
  server's device (and the first step's verify ids must be on it);
* DSpark with a grammar backend but without the feature logs one WARNING naming the stock
  Python path and the switch;
* ``check`` (feature detail) and the gauge ``dspark_harden_dspark_mask_engine`` report the engine.

Stand-ins, unavoidable on a CPU-only machine: ``server_args`` is a namespace with the attributes
the feature reads (a real ``ServerArgs`` cannot resolve ``--device cuda`` without a GPU), and "the
native module is not built" is simulated by setting the import error the module records when
its cffi extension is missing (``native.IMPORT_ERROR``): the extension is built here.
"""

from __future__ import annotations

import logging
import types

import pluggy
import pytest
import torch

from dspark_harden.core import binder, hookspecs, metrics, roles
from dspark_harden.core.patch import Role
from dspark_harden.core.roles import ProcessContext
from dspark_harden.dspark_masks import feature as F
from dspark_harden.dspark_masks import integration as I
from dspark_harden.dspark_masks import native
from dspark_harden.dspark_masks.jobs import TraversalError
from dspark_harden.dspark_masks.pipeline import PipelineError
from dspark_harden.dspark_masks.traversal import ChainTraverser

ON = {F.SWITCH: "1"}
NOT_BUILT = "dspark_harden._traverse_native is not built: simulated missing extension"


def manager():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(F, name="dspark_harden.dspark_masks.feature")
    return pm


def bind(environ):
    return binder.bind(Role.SCHEDULER, pm=manager(), environ=dict(environ))


def args(**kw):
    base = dict(device="cpu", grammar_backend="xgrammar", enable_strict_thinking=False, speculative_algorithm="DSPARK")
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(native, "IMPORT_ERROR", NOT_BUILT)


@pytest.fixture
def context(monkeypatch):
    """Scheduler context of DP rank ``dp`` with ``server_args`` (restored afterwards), and a fresh
    runtime."""

    def make(server_args, tp_rank=0, dp_rank=0):
        monkeypatch.setattr(roles, "CONTEXT", ProcessContext(Role.SCHEDULER, server_args, tp_rank, dp_rank))

    I.reset_runtime()
    yield make
    I.reset_runtime()


# --- engine auto -------------------------------------------------------------------------------


def test_auto_refuses_when_neither_fast_engine_is_available_and_scalar_runs_only_when_named(no_native):
    with pytest.raises(TraversalError) as err:
        ChainTraverser("auto")
    text = str(err.value)
    assert "neither" in text and "batch_traverse_draft_tree" in text and NOT_BUILT in text
    assert "DSPARK_HARDEN_GRAMMAR_TRAVERSAL=scalar" in text
    named = ChainTraverser("scalar")
    assert named.engine == "scalar" and named.requested == "scalar"
    named.close()


def test_auto_refuses_when_the_native_engine_does_not_bind(monkeypatch):
    def refuse(self):
        raise TraversalError("native traversal could not bind to xgrammar: simulated ABI 0.2")

    monkeypatch.setattr(ChainTraverser, "_open_native", refuse)
    with pytest.raises(
        TraversalError, match=r"auto: neither .*could not bind to xgrammar: simulated ABI 0\.2.*=scalar"
    ):
        ChainTraverser("auto")
    with pytest.raises(TraversalError, match="^native traversal could not bind"):
        ChainTraverser("native")  # named: its own error, no auto wording


def test_auto_resolves_to_native_here():
    t = ChainTraverser("auto")
    assert (t.engine, t.requested) == ("native", "auto")
    t.close()


@pytest.mark.forked
def test_the_feature_fails_at_bind_when_auto_has_no_fast_engine(no_native):
    report = bind(ON)
    assert not report.ok
    lines = report.failures()
    assert any(
        "[dspark-masks] enabled by DSPARK_HARDEN_DSPARK_MASKS=1 but unavailable" in line and NOT_BUILT in line
        for line in lines
    ), lines
    binder.revert_all()
    report = bind({**ON, F.ENGINE: "scalar"})
    assert report.ok, report.failures()
    binder.revert_all()


# --- process start-up (dspark_process_bound) ------------------------------------------------------


@pytest.mark.forked
def test_startup_opens_the_engine_reports_it_and_sets_the_gauge(context):
    metrics.reset_for_tests()
    context(args(), dp_rank=1)
    report = bind(ON)
    assert report.ok, report.failures()
    F.dspark_process_bound(role=Role.SCHEDULER, settings=binder.STATE.settings, report=report)
    st = next(f for f in report.features if f.name == F.FEATURE)
    assert st.status == "bound"
    assert st.detail.startswith("engine native (DSPARK_HARDEN_GRAMMAR_TRAVERSAL=auto, 2 thread(s))"), st.detail
    assert "cpu (synchronous protocol)" in st.detail
    assert I._RUNTIME is not None and I._RUNTIME.traverser.engine == "native"  # opened at start-up
    samples = {
        s.labels["engine"]: s.value
        for s in metrics.get("dspark_harden_dspark_mask_engine").collect()[0].samples
        if s.labels["dp_rank"] == "1"
    }
    assert samples == {"native": 1.0, "batch": 0.0, "scalar": 0.0, "threads": 0.0, "level": 0.0}
    binder.revert_all()


@pytest.mark.forked
def test_startup_with_scalar_named_reports_scalar(context):
    metrics.reset_for_tests()
    context(args(), dp_rank=0)
    report = bind({**ON, F.ENGINE: "scalar"})
    F.dspark_process_bound(role=Role.SCHEDULER, settings=binder.STATE.settings, report=report)
    st = next(f for f in report.features if f.name == F.FEATURE)
    assert st.detail.startswith("engine scalar (DSPARK_HARDEN_GRAMMAR_TRAVERSAL=scalar"), st.detail
    samples = {
        s.labels["engine"]: s.value for s in metrics.get("dspark_harden_dspark_mask_engine").collect()[0].samples
    }
    assert samples["scalar"] == 1.0 and samples["native"] == 0.0
    binder.revert_all()


@pytest.mark.forked
@pytest.mark.parametrize(
    "device, needle",
    [
        (
            "npu",
            "runs on CUDA (pinned slots, copy stream, events) or on the CPU (synchronous); the server's device is 'npu'",
        ),
        ("cuda", "the server's device is cuda but torch sees no CUDA device"),
    ],
)
def test_startup_refuses_a_device_the_pipeline_cannot_serve(context, device, needle):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    context(args(device=device))
    report = bind(ON)
    assert report.ok, report.failures()
    with pytest.raises(binder.BindError) as err:
        F.dspark_process_bound(role=Role.SCHEDULER, settings=binder.STATE.settings, report=report)
    assert needle in str(err.value) and "[dspark-masks] DSPARK_HARDEN_DSPARK_MASKS=1" in str(err.value)
    st = next(f for f in report.features if f.name == F.FEATURE)
    assert st.status == "failed" and needle in st.detail
    binder.revert_all()


@pytest.mark.forked
def test_startup_refuses_server_args_the_native_path_cannot_reproduce(context):
    context(args(grammar_backend="llguidance"))
    report = bind(ON)
    with pytest.raises(binder.BindError, match="--grammar-backend llguidance is not supported"):
        F.dspark_process_bound(role=Role.SCHEDULER, settings=binder.STATE.settings, report=report)
    binder.revert_all()


def test_the_first_step_must_be_on_the_device_checked_at_startup():
    rt = I.DSparkMaskRuntime("scalar", device_type="cpu")
    with pytest.raises(PipelineError, match="verify ids are on meta, but start-up checked .* device 'cpu'"):
        rt.begin(torch.zeros((2, 4), dtype=torch.int64, device="meta"))
    rt.begin(torch.zeros((2, 4), dtype=torch.int64))  # the checked device works
    rt.close()


# --- the feature off: one WARNING -------------------------------------------------------------------


def _warnings(caplog, context, server_args, **ctx):
    context(server_args, **ctx)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dspark_harden.dspark_masks"):
        F.dspark_process_bound(
            role=Role.SCHEDULER,
            settings={F.SWITCH: False, F.DRAFT_SWITCH: False},
            report=types.SimpleNamespace(features=[]),
        )
    return [r for r in caplog.records if r.levelno == logging.WARNING]


def test_dspark_with_grammar_without_the_feature_warns_once_per_server(caplog, context):
    found = _warnings(caplog, context, args(), tp_rank=0, dp_rank=0)
    assert len(found) == 1, found
    msg = found[0].getMessage()
    assert "spec_utils.build_grammar_vocab_mask -> generate_token_bitmask -> traverse_tree" in msg
    assert "Python DFS" in msg and "DSPARK_HARDEN_DSPARK_MASKS=1" in msg
    # the other schedulers of the same server stay quiet; so do servers the warning does not concern
    assert _warnings(caplog, context, args(), tp_rank=1, dp_rank=1) == []
    assert _warnings(caplog, context, args(grammar_backend="none")) == []
    assert _warnings(caplog, context, args(speculative_algorithm="EAGLE")) == []
    assert _warnings(caplog, context, args(speculative_algorithm=None)) == []
    assert I._RUNTIME is None  # the feature off opens nothing


# --- dspark-harden check --------------------------------------------------------------------------


def test_check_reports_the_engine_in_use():
    import os

    from dspark_harden.cli.check import run_child

    rep = run_child("scheduler", env={**os.environ, **ON})
    assert rep["ok"], rep["errors"]
    feat = {f["name"]: f for f in rep["features"]}[F.FEATURE]
    assert feat["status"] == "bound"
    assert feat["detail"].startswith("engine native (DSPARK_HARDEN_GRAMMAR_TRAVERSAL=auto"), feat["detail"]
