"""Startup-time guarantees of the prefill-graph decision (issue 22 items 5-7).

* draft runners: a speculative worker whose draft runner captures prefill graphs (or whose
  capture_hidden_mode override is not modelled) is refused at scheduler startup; a draft runner that
  reaches the guard under a DP table runs eager (on every rank alike);
* every stock source the views mirror is fingerprinted (drift refuses startup);
* the hybrid-SSM IDLE -> TARGET_VERIFY relabel keeps idle ranks out of the graph;
* both ranks configured alike: the runner configuration row is exchanged once over a real gloo group
  and over the real native DP2 channel between two processes; a mismatch refuses on both ranks naming
  both values.

What could make these fail: the refusal accepting an unmodelled algorithm, a mirrored source whose
fingerprint no longer matches (or a probe that does not notice), the exchange not carrying the row
or the comparison missing a field.
"""

from __future__ import annotations

import types

import pytest

from dspark_harden.prefill_graph import config_digest as C
from dspark_harden.prefill_graph import decision as D
from dspark_harden.prefill_graph import feature
from dspark_harden.prefill_graph import runner as R
from tests.harness import warm

# --- item 5: speculative workers and draft runners -------------------------------------------------


@pytest.mark.parametrize(
    "algo,refused",
    [
        (None, False),
        ("DSPARK", False),
        ("EAGLE", True),
        ("EAGLE3", True),
        ("STANDALONE", True),
        ("NGRAM", True),
        ("DFLASH", True),
    ],
)
def test_unmodelled_speculative_workers_are_refused(algo, refused):
    msg = feature.speculative_refusal(types.SimpleNamespace(speculative_algorithm=algo))
    assert (msg is not None) is refused
    if refused:
        assert algo in msg and "EagleDraftWorker.init_cuda_graphs" in msg and "DSPARK_HARDEN_PREFILL_GRAPH=0" in msg


@pytest.mark.forked
@pytest.mark.parametrize("explicit", [False, True])
def test_eagle_with_prefill_graphs_under_dp_attention_is_unavailable_by_default_and_refused_when_explicit(explicit):
    """Issue 39: by default an EAGLE server keeps stock behaviour (the feature is ``unavailable``, nothing
    raises); ``DSPARK_HARDEN_PREFILL_GRAPH=1`` refuses at bind time. Real parsed ServerArgs:
    tests/plugin/test_applicability.py."""
    from dspark_harden.core import binder, roles
    from dspark_harden.core.patch import Role

    sa = types.SimpleNamespace(
        enable_dp_attention=True,
        dp_size=2,
        tp_size=2,
        enable_two_batch_overlap=False,
        speculative_algorithm="EAGLE",
        cuda_graph_config=types.SimpleNamespace(prefill=types.SimpleNamespace(backend="breakable")),
    )
    roles.CONTEXT = roles.ProcessContext(role=Role.SCHEDULER, server_args=sa, tp_rank=0, dp_rank=0)
    report = binder.bind(Role.SCHEDULER, environ={"DSPARK_HARDEN_PREFILL_GRAPH": "1"} if explicit else {})
    st = next(f for f in report.features if f.name == feature.FEATURE)
    assert st.status == ("failed" if explicit else "unavailable"), st
    assert "speculative algorithm EAGLE" in st.detail and not st.targets
    feature.dspark_process_bound(role=Role.SCHEDULER, settings=binder.STATE.settings, report=report)  # no raise


def test_the_worker_capture_modes_are_the_modelled_ones():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    assert D.worker_capture_mode(SpeculativeAlgorithm.NONE) is None
    assert D.worker_capture_mode(SpeculativeAlgorithm.DSPARK) == CaptureHiddenMode.FULL
    with pytest.raises(D.UnmodelledWorker):
        D.worker_capture_mode(SpeculativeAlgorithm.EAGLE)


def test_a_draft_runner_under_a_dp_table_runs_eager():
    from dspark_harden.prefill_graph import admission as A
    from tests.prefill_graph.test_guard_and_patches import _fb, _stock_can_run

    runner = R.build_runner(R.capture_config())
    runner.model_runner = types.SimpleNamespace(is_draft_worker=True, lora_manager=None)
    rt = A.Runtime()
    guard = A.build_guard(_stock_can_run(), rt)
    assert guard(runner, _fb()) is False and rt.last_guard == "draft"  # even where every check passes


# --- item 6: fingerprints of every mirrored stock source ------------------------------------------


def test_every_mirrored_source_matches_its_fingerprint():
    ok, detail = feature.probe_mirrored_sources()
    assert ok, detail
    assert f"{len(feature.MIRRORED) + len(feature.MIRRORED_TEXT)} mirrored" in detail
    names = set(feature.MIRRORED) | set(feature.MIRRORED_TEXT)
    for needed in (
        "ForwardBatch.init_new",
        "ForwardBatch._maybe_init_non_generation_fields",
        "DSparkWorkerV2.forward_batch_generation",
        "DSparkWorkerV2._forward_prefill",
        "ForwardBatch.prepare_mlp_sync_batch",
        "ScheduleBatch.convert_decode_to_extend",
        "EagleDraftWorker.init_cuda_graphs",
        "capture_prefill_graph",
    ):
        assert any(n.endswith(needed) for n in names), needed


@pytest.mark.parametrize("table", ["MIRRORED", "MIRRORED_TEXT"])
def test_the_probe_notices_drift(monkeypatch, table):
    entries = dict(getattr(feature, table))
    target = next(iter(entries))
    monkeypatch.setattr(feature, table, {**entries, target: "0000000000000000"})
    ok, detail = feature.probe_mirrored_sources()
    assert not ok and target in detail and "expected 0000000000000000" in detail


def test_hybrid_ssm_speculative_idle_ranks_stay_out_of_the_graph():
    """Stock relabels such an idle batch IDLE -> TARGET_VERIFY (prepare_mlp_sync_batch, fingerprinted),
    which no prefill graph replays: finalize sends both ranks eager instead of admitting the idle rank."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    runner = R.build_runner(R.capture_config())
    kw = dict(
        vote=True, runner=runner, bs=list(R.capture_config().buckets), factor=4.0, server_mode=CaptureHiddenMode.NULL
    )
    assert D.finalize([900, 0], **kw).graph
    dec = D.finalize([900, 0], idle_relabel=True, **kw)
    assert not dec.graph and dec.reason == "idle_participant" and "TARGET_VERIFY" in dec.detail
    assert D.finalize([900, 5], idle_relabel=True, **kw).graph  # no idle rank: nothing is relabelled
    assert D.idle_relabels_to_target_verify(None, None) is False


# --- item 7: both ranks configured alike -----------------------------------------------------------


def test_payload_and_comparison_name_both_values():
    a = R.build_runner(R.capture_config())
    b = R.build_runner(R.capture_config(slots=16))
    assert C.compare([C.payload(a, 4.0), C.payload(a, 4.0)]) is None
    msg = C.compare([C.payload(a, 4.0), C.payload(b, 2.5)])
    assert "request_slots: dp_rank 0 = 32, dp_rank 1 = 16" in msg
    assert "padding_factor_millionths: dp_rank 0 = 4, dp_rank 1 = 2.5" in msg
    c = R.build_runner(R.capture_config([64, 4096]))
    msg = C.compare([C.payload(a, 4.0), C.payload(c, 4.0)])
    assert "buckets_digest: dp_rank 0 = 74 buckets 4..16384" in msg and "dp_rank 1 = 2 buckets 64..4096" in msg
    brk = R.build_runner(R.capture_config(), backend="breakable")
    msg = C.compare([C.payload(a, 4.0), C.payload(brk, 4.0)])
    assert "backend: dp_rank 0 = full, dp_rank 1 = breakable" in msg
    assert "none" in C.compare([C.payload(None, 4.0), C.payload(a, 4.0)])  # a rank without a prefill graph


def _config_worker(rank, port, session, slots_by_rank, transport):
    from dspark_harden.dp2 import harness
    from dspark_harden.dp2.channels import RUNTIME

    w = harness.init_worker(rank, port, session)
    runner = R.build_runner(R.capture_config(slots=slots_by_rank[rank]))
    try:
        if transport == "native":
            RUNTIME.configure(
                session_id=session, timeout_ms=10000, spin_us=50, export=False, rank=rank, dp_label=str(rank)
            )
            C.check(runner, 4.0)  # picks the native channel: dp2's RUNTIME is configured
        else:
            C.check(runner, 4.0, group=w.group)  # gloo: the TP CPU group
        return {"ok": True}
    except C.PrefillGraphConfigMismatch as exc:
        return {"ok": False, "message": str(exc)}
    finally:
        w.sync.channel.close()


def test_no_native_pair_exchange_is_offered_before_dp2_is_configured():
    """The check asks the dp2 feature for its channel through the ``dspark_pair_exchange`` hook
    (prefill-graph never imports dp2): unconfigured, dp2 answers None and the check uses gloo. The
    configured answer is what the native case below runs (mutation: dp2 answering None there makes
    that case fall back to gloo without a group and fail)."""
    from dspark_harden.core.manager import make_manager

    pm = make_manager(load_extensions=False)
    assert pm.hook.dspark_pair_exchange(channel=C.CHANNEL, width=C.WIDTH, fields=C.FIELDS) is None


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["gloo", "native"])
def test_both_ranks_compare_their_configuration_once_at_startup(transport):
    from dspark_harden.dp2 import harness

    r0, r1 = harness.run_pair(_config_worker, ({0: 32, 1: 32}, transport), ctx=warm.mp_context())
    assert r0 == r1 == {"ok": True}
    r0, r1 = harness.run_pair(_config_worker, ({0: 32, 1: 16}, transport), ctx=warm.mp_context())
    for r in (r0, r1):
        assert not r["ok"] and "request_slots: dp_rank 0 = 32, dp_rank 1 = 16" in r["message"], r
