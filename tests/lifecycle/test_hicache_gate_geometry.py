"""The armed HiCache gate refuses to start unless each DP group is one scheduler (issue 21 item 9b).

The gate decides per scheduler; with attention-TP > 1 the TP ranks of one DP group could disagree
(some evict, others refuse) and their radix trees diverge. Real binder, real lifecycle feature module,
real ``ServerArgs`` in a scheduler's process context: attention-TP 2 (resolved ``attn_dp_size`` and
the deprecated ``--enable-dp-attention`` spelling), attention-CP 2 and PP 2 stop startup naming why;
the supported DP2 / attention-TP1 geometry binds.
"""

from __future__ import annotations

import pluggy
import pytest

from dspark_harden.core import binder, hookspecs, roles
from dspark_harden.core.patch import Role
from dspark_harden.core.roles import ProcessContext
from dspark_harden.lifecycle import feature as LF
from dspark_harden.lifecycle import settings as S

ARMED = {S.GATE_CONTROL: "armed", S.SHUTDOWN_SWITCH: "0", S.GC_SWITCH: "0", S.HOSTPOOL_SWITCH: "0"}


def _manager():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(LF, name="dspark_harden.lifecycle.feature")
    return pm


def _args(**kw):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="unused", device="cpu", enable_hierarchical_cache=True, **kw)


def _gate_status(report):
    return next(f for f in report.features if f.name == S.HICACHE_GATE)


@pytest.mark.forked
@pytest.mark.parametrize(
    "kw,widths",
    [
        (dict(tp_size=4, dp_size=2, enable_dp_attention=True), "attention-TP 2, attention-CP 1, PP 1"),
        (dict(tp_size=4, attn_dp_size=2), "attention-TP 2, attention-CP 1, PP 1"),
        (dict(tp_size=2), "attention-TP 2, attention-CP 1, PP 1"),
        (dict(tp_size=4, attn_dp_size=2, attn_cp_size=2), "attention-TP 1, attention-CP 2, PP 1"),
        (dict(tp_size=1, pp_size=2), "attention-TP 1, attention-CP 1, PP 2"),
    ],
)
def test_armed_gate_refuses_to_start_when_a_dp_group_has_several_schedulers(monkeypatch, kw, widths):
    monkeypatch.setattr(roles, "CONTEXT", ProcessContext(Role.SCHEDULER, _args(**kw), 0, 0))
    report = binder.bind(Role.SCHEDULER, pm=_manager(), environ=dict(ARMED))
    try:
        assert not report.ok
        st = _gate_status(report)
        assert st.status == "failed" and "unavailable" in st.detail, st
        assert f"({widths})" in st.detail and "radix trees would diverge" in st.detail, st.detail
        assert not st.targets  # nothing of the gate was bound
        with pytest.raises(binder.BindError) as err:
            binder.raise_if_failed(report)
        assert "[hicache-gate]" in str(err.value) and "attention-TP 1" in str(err.value)
    finally:
        binder.revert_all()


@pytest.mark.forked
@pytest.mark.parametrize(
    "kw", [dict(tp_size=2, dp_size=2, enable_dp_attention=True), dict(tp_size=2, attn_dp_size=2), dict(tp_size=1)]
)
def test_armed_gate_binds_when_every_dp_group_is_one_scheduler(monkeypatch, kw):
    monkeypatch.setattr(roles, "CONTEXT", ProcessContext(Role.SCHEDULER, _args(**kw), 0, 0))
    report = binder.bind(Role.SCHEDULER, pm=_manager(), environ=dict(ARMED))
    try:
        st = _gate_status(report)
        assert report.ok and st.status == "bound" and len(st.targets) == 2, (report.failures(), st)
    finally:
        binder.revert_all()
