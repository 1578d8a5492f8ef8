"""The DSV4 features' start-up self-tests (issue 41 item 2) on the CPU host: the comparison and refusal
logic of each check on real CPU tensors, through the features' own code (the real ``_compute_q_b`` wrap and
stock ``MQALayer._compute_q_b``, the real Q8KV8 reservation, the real planner wrappers), with the GPU kernel
itself replaced by a named CPU stand-in; the wiring (the backend-init wrap every enabled DSV4 feature binds
runs them, nothing runs without CUDA or for a feature that is off); and what ``check`` reports. The real
kernels: tests/gpu/test_dsv4_selftest_gpu.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from dspark_harden.core.patch import Role
from dspark_harden.core.settings import load_settings
from dspark_harden.dsv4_memory import feature as F
from dspark_harden.dsv4_memory import planner as PL
from dspark_harden.dsv4_memory import selftest as ST
from dspark_harden.dsv4_memory import settings as S

CPU = torch.device("cpu")


def _settings(**env):
    return load_settings(S.SETTINGS, {k: str(v) for k, v in env.items()})


def _refused(info, feature: str, what: str) -> str:
    msg = str(info.value)
    assert f"start-up self-test of feature {feature} failed on cpu (no CUDA compute capability)" in msg, msg
    assert what in msg, msg
    assert f"set {ST.SWITCHES[feature]}=0 to run stock SGLang's path" in msg, msg
    assert "the DSV4 GPU suites have run on sm_90 (NVIDIA H100 80GB HBM3, NVIDIA H200)" in msg, msg
    return msg


# --- dsv4-inplace-q-norm-rope ---------------------------------------------------------------------


def _norm_rope(q, out, eps, freqs, pos):
    """CPU stand-in for ``fused_q_norm_rope`` (main_norm_rope.cuh, CUDA only): RMS norm over the head dim
    (when ``eps``), then RoPE of the last 64 dims (interleaved pairs) by ``freqs[pos]``; reads all of its
    input before it writes (alias-safe, as the real kernel was read to be)."""
    x = q.float()
    if eps is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    rope = torch.view_as_complex(x[..., -64:].reshape(*x.shape[:-1], 32, 2).contiguous())
    rope = rope * freqs[pos].unsqueeze(1)
    x = torch.cat([x[..., :-64], torch.view_as_real(rope).flatten(-2)], -1)
    out.copy_(x.to(out.dtype))


def _unsafe_norm_rope(q, out, eps, freqs, pos):
    """The same math with an aliasing hazard (the bug class the self-test exists for): the first half of
    each row is stored before the second half is computed from a second read of ``q``; in place, that read
    sees the stored half, so the norm and everything after it differ."""
    first, second = torch.empty_like(out), torch.empty_like(out)
    _norm_rope(q, first, eps, freqs, pos)
    out[..., :256] = first[..., :256]
    _norm_rope(q, second, eps, freqs, pos)
    out[..., 256:] = second[..., 256:]


def _freqs(n=4096):
    g = torch.Generator().manual_seed(0)
    ang = torch.rand((n, 32), generator=g) * 6.283
    return torch.polar(torch.ones_like(ang), ang)


def _qnorm_paths(monkeypatch, kernel):
    """(ours, stock): the feature's real in-place ``_compute_q_b`` (:func:`qnorm.build_compute_q_b`) and the
    real stock ``MQALayer._compute_q_b``, both calling ``kernel`` where they call ``fused_q_norm_rope``."""
    import sglang.kernels.ops.attention.dsv4 as dsv4_ops
    import sglang.srt.models.deepseek_v4 as dsv4_model
    from sglang.srt.models.deepseek_v4 import MQALayer

    from dspark_harden.dsv4_memory.qnorm import build_compute_q_b

    monkeypatch.setattr(dsv4_ops, "fused_q_norm_rope", kernel)  # what the in-place wrap imports per call
    monkeypatch.setattr(dsv4_model, "fused_q_norm_rope", kernel)  # what stock's _compute_q_b calls
    stock = ST.stock_of(MQALayer.__dict__["_compute_q_b"])
    return build_compute_q_b(stock, lambda: None), stock


def test_qnorm_self_test_passes_an_alias_safe_kernel_and_refuses_an_unsafe_one(monkeypatch):
    ours, stock = _qnorm_paths(monkeypatch, _norm_rope)
    res = ST.check_qnorm(ours, stock, heads=8, head_dim=512, eps=1e-6, freqs_cis=_freqs(), device=CPU, tokens=16)
    assert res.status == "passed" and res.feature == S.QNORM_FEATURE and res.device.startswith("cpu")
    assert "16 tokens x 8 heads x 512" in res.detail and res.seconds < 5

    ours, stock = _qnorm_paths(monkeypatch, _unsafe_norm_rope)
    with pytest.raises(ST.SelfTestError) as info:
        ST.check_qnorm(ours, stock, heads=8, head_dim=512, eps=1e-6, freqs_cis=_freqs(), device=CPU, tokens=16)
    msg = _refused(info, S.QNORM_FEATURE, "fused_q_norm_rope in place differs from out of place at 16 tokens x 8")
    assert "input aliased to output is not safe here" in msg and "rows (first row 0)" in msg


def test_qnorm_self_test_refuses_a_path_that_did_not_run_in_place_or_a_kernel_that_did_nothing(monkeypatch):
    ours, stock = _qnorm_paths(monkeypatch, _norm_rope)
    with pytest.raises(ST.SelfTestError) as info:  # "ours" silently falling back to stock's allocation
        ST.check_qnorm(stock, stock, heads=4, head_dim=512, eps=1e-6, freqs_cis=_freqs(), device=CPU, tokens=4)
    _refused(info, S.QNORM_FEATURE, "did not write its result over its input")
    ours, stock = _qnorm_paths(monkeypatch, lambda q, out, *a: out.copy_(q))
    with pytest.raises(ST.SelfTestError) as info:
        ST.check_qnorm(ours, stock, heads=4, head_dim=512, eps=1e-6, freqs_cis=_freqs(), device=CPU, tokens=4)
    _refused(info, S.QNORM_FEATURE, "the kernel left its input unchanged")


# --- dsv4-sparse-prefill-pool ---------------------------------------------------------------------


def _q8_stock(skip_last_row: bool = False):
    """CPU stand-in for ``sparse_mla_q8kv8_prefill_fwd`` (SM90 JIT kernel): deterministic outputs from q;
    allocates them, or writes the caller's. ``skip_last_row``: a kernel that leaves one row of a caller-owned
    output unwritten (what a fresh, zeroed allocation could hide and NaN-filled reserved blocks show)."""

    def stock(
        q, kv, idx, scale, qs, ks, d_v=512, attn_sink=None, topk_length=None, *, out=None, max_logits=None, lse=None
    ):
        x = q.float()
        o, m, s = (x[..., :d_v] * scale).to(torch.bfloat16), x.amax(-1), x.sum(-1) + attn_sink
        if out is None:
            return o, m, s
        n = o.shape[0] - 1 if skip_last_row else o.shape[0]
        out[:n].copy_(o[:n])
        max_logits.copy_(m)
        lse.copy_(s)
        return out, max_logits, lse

    return stock


def _q8_reservation(slots=1):
    """The real :class:`pool.Q8KV8Reservation` with its buffers on the CPU (``reserve()`` needs CUDA)."""
    from dspark_harden.dsv4_memory.pool import Q8KV8Reservation, _storage_uses

    res = Q8KV8Reservation(tokens=ST.POOL_TOKENS, heads=64, d_v=512, device="cpu", slots=slots)
    res.bufs = res._output_sets("the self-test's CPU buffers")
    res.baseline = [tuple(_storage_uses(t) for t in slot) for slot in res.bufs]
    return res


def test_pool_self_test_passes_a_reservation_serving_what_stock_allocates_and_restores_its_counters():
    res = _q8_reservation()
    out = ST.check_reservation(res, _q8_stock(), device=CPU)
    assert out.status == "passed" and out.feature == S.POOL_FEATURE
    assert (
        out.detail.startswith("Q8KV8 pooled = fresh allocation bit for bit") and "128 tokens x 64 heads" in out.detail
    )
    assert out.figures["poisoned_blocks_reused"] is True  # the compared call wrote into the NaN-filled slot
    assert (res.served, res.refused, res.high_water_tokens) == (0, 0, 0)  # a self-test call is no request


def test_pool_self_test_refuses_a_kernel_that_leaves_reserved_output_unwritten():
    res = _q8_reservation()
    with pytest.raises(ST.SelfTestError) as info:
        ST.check_reservation(res, _q8_stock(skip_last_row=True), device=CPU)
    msg = _refused(info, S.POOL_FEATURE, "the pooled sparse-prefill output differs from a fresh allocation's")
    assert "in 1 of 128 rows (first row 127)" in msg
    assert res.served == 0


def test_pool_self_test_refuses_a_reservation_that_cannot_serve_the_call():
    res = _q8_reservation()
    held = res.bufs[0][0][:1]  # an output still alive from an earlier call holds the only slot
    with pytest.raises(ST.SelfTestError) as info:
        ST.check_reservation(res, _q8_stock(), device=CPU)
    _refused(info, S.POOL_FEATURE, "the reservation refused a call it must serve: Q8KV8 sparse-prefill call of 128")
    del held


# --- dsv4-planner-guards --------------------------------------------------------------------------


def _flat(rid, r2t, pos):
    return rid.long() * r2t.shape[1] + pos.long()


class _Planner:
    """CPU stand-ins for SGLang's c_plan.cuh planners (``stock``: unchecked reads) and the guarded ones of
    guarded_c_plan.cuh (``guarded``: reads clamped inside the allocation and counted; an over-full batch
    planned empty), with ``report`` standing in for ``planner_device.check``. The plans are the locations
    each read names, so a guard that changes a valid plan shows. ``blind``: a guard that counts nothing
    (the mirror-never-written mutation); ``corrupt``: a guard whose plan has one element off by one."""

    def __init__(self, blind=False, corrupt=False):
        self.count, self.reported, self.blind, self.corrupt = 0, 0, blind, corrupt

    def _loc(self, rid, r2t, f2s, pos, guard):
        flat = _flat(rid, r2t, pos)
        if guard:
            if bool(((flat < 0) | (flat > r2t.numel() - 1)).any()) and not self.blind:
                self.count += 1
            flat = flat.clamp(0, r2t.numel() - 1)
        loc = r2t.reshape(-1)[flat].long()
        if guard and self.corrupt:
            loc[0] += 1
        return torch.stack([loc, f2s[loc.clamp(0, f2s.numel() - 1)].long()], -1).to(torch.int32)

    def decode(self, guard):
        def generate(ratio, rid, r2t, f2s, seq, swa, ring, use_req_ring=False):
            return SimpleNamespace(plan_d=self._loc(rid, r2t, f2s, seq - 1, guard))

        return generate

    def prefill(self, guard):
        def generate(ratio, rid, seq, ext, r2t, f2s, swa, ring, n, use_cuda_graph=False, use_req_ring=False):
            if guard and int(ext.sum()) > n:
                if not self.blind:
                    self.count += 1
                empty = torch.full((n, 2), -1, dtype=torch.int32)
                return SimpleNamespace(plan_c=empty, plan_w=empty)
            rows = torch.repeat_interleave(torch.arange(len(seq)), ext.cpu())
            first = (seq - ext).cpu()
            starts = torch.cumsum(ext.cpu(), 0) - ext.cpu()
            pos = first[rows] + torch.arange(int(ext.sum())) - starts[rows]
            plan = self._loc(rid[rows.to(rid.device)], r2t, f2s, pos.to(r2t.device), guard)
            return SimpleNamespace(plan_c=plan, plan_w=plan + 1)

        return generate

    def report(self):
        if self.count != self.reported:
            self.reported = self.count
            raise PL.PlannerBoundsError("device-side guard: a req_to_token read outside its allocation (stand-in)")

    def paths(self, sync=False):
        """(ours, stock): the real planner wrappers (:func:`planner.build_decode_generate` /
        ``build_prefill_generate``: host checks, report read, launch) around the guarded stand-ins."""
        ours = {
            "decode": PL.unwrap(
                PL.build_decode_generate(
                    None, lambda ok: None, self.decode(True), lambda d=None: self.report(), sync_checks=sync
                )
            ),
            "prefill": PL.unwrap(
                PL.build_prefill_generate(
                    None, lambda ok: None, self.prefill(True), lambda d=None: self.report(), sync_checks=sync
                )
            ),
        }
        return ours, {"decode": self.decode(False), "prefill": self.prefill(False)}


@pytest.mark.parametrize("sync", [False, True], ids=["device-guard", "sync-mode"])
def test_planner_self_test_passes_a_guard_equal_to_stock_that_catches_both_crafted_plans(sync):
    p = _Planner()
    ours, stock = p.paths(sync)
    res = ST.check_planner(ours, stock, p.report, PL.PlannerBoundsError, geometry=ST.PlanGeometry(), device=CPU)
    assert res.status == "passed" and res.figures == {
        "plans": 6,
        "caught": ["decode past req_to_token", "prefill over num_q_tokens"],
    }
    assert "6 guarded plans = stock's (c4/c128" in res.detail


def test_planner_self_test_refuses_a_guard_that_misses_a_crafted_plan_or_changes_a_valid_one():
    p = _Planner(blind=True)
    ours, stock = p.paths()
    with pytest.raises(ST.SelfTestError) as info:
        ST.check_planner(ours, stock, p.report, PL.PlannerBoundsError, geometry=ST.PlanGeometry(), device=CPU)
    _refused(info, S.GUARDS_FEATURE, "a crafted out-of-bounds c4 plan (decode past req_to_token) was not caught")
    p = _Planner(corrupt=True)
    ours, stock = p.paths()
    with pytest.raises(ST.SelfTestError) as info:
        ST.check_planner(ours, stock, p.report, PL.PlannerBoundsError, geometry=ST.PlanGeometry(), device=CPU)
    _refused(info, S.GUARDS_FEATURE, "the guarded c4 decode plan (device lengths, b 8) is not stock's: plan_d")


# --- the refusal names the device and its compute capability ---------------------------------------


def test_refusal_names_feature_device_and_whether_any_gpu_suite_ran_on_its_capability():
    msg = ST.refusal(S.QNORM_FEATURE, "NVIDIA B300 (sm_103, cuda:1)", "sm_103", "in place differs")
    assert msg.startswith(
        "dspark-harden: start-up self-test of feature dsv4-inplace-q-norm-rope failed on NVIDIA B300 (sm_103, cuda:1): "
        "in place differs."
    )
    assert (
        "the DSV4 GPU suites have run on sm_90 (NVIDIA H100 80GB HBM3, NVIDIA H200); sm_103 is never run by any DSV4 GPU suite"
        in msg
    )
    assert "set DSPARK_HARDEN_DSV4_INPLACE_Q_NORM_ROPE=0" in msg
    assert "sm_90 is among them" in ST.refusal(S.GUARDS_FEATURE, "NVIDIA H100 (sm_90, cuda:0)", "sm_90", "x")
    assert S.proven_ccs() == {"sm_90": ("NVIDIA H100 80GB HBM3", "NVIDIA H200")}


# --- wiring ---------------------------------------------------------------------------------------


def test_the_backend_init_wrap_is_bound_for_any_enabled_dsv4_feature_and_for_none_when_all_are_off():
    def owner(**env):
        found = [p for p in F.patches(Role.SCHEDULER, _settings(**env)) if p.target == S.BACKEND_INIT_TARGET]
        assert len(found) <= 1
        return found[0].feature if found else None

    assert owner() is None
    assert owner(**{S.QNORM: 1}) == S.QNORM_FEATURE
    assert owner(**{S.GUARDS: 1}) == S.GUARDS_FEATURE
    assert owner(**{S.QNORM: 1, S.GUARDS: 1}) == S.QNORM_FEATURE
    assert owner(**{S.POOL: 1, S.GUARDS: 1}) == S.POOL_FEATURE
    assert ST.run_for_backend(SimpleNamespace(device="cuda:0"), None, _settings()) == []  # nothing enabled


@pytest.mark.forked
def test_real_bind_arms_the_self_tests_and_construction_runs_them_skipping_without_cuda(monkeypatch):
    """The real binder in this (forked) process with the CUDA precondition answered yes (this host has
    none, so the features would otherwise refuse): ``DeepseekV4AttnBackend.__init__`` is bound for the first
    enabled feature, wrapping stock. Constructing the real class through the feature's wrap (its stock
    ``__init__`` a stand-in: the real one needs a CUDA model runner) runs every enabled feature's self-test,
    which on this host records ``skipped`` (no CUDA) and runs nothing; the pool's reservation is not made
    when the pool is off."""
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    from dspark_harden.core import binder
    from dspark_harden.core.patch import raw_attr, resolve_owner

    stock_init = raw_attr(*resolve_owner(S.BACKEND_INIT_TARGET))
    monkeypatch.setattr(F, "_cuda_reason", lambda: None)
    env = {S.QNORM: "1", S.GUARDS: "1"}
    report = binder.bind(Role.SCHEDULER, environ=env)
    try:
        feats = {f.name: f for f in report.features}
        assert feats[S.QNORM_FEATURE].status == "bound", feats[S.QNORM_FEATURE]
        assert feats[S.GUARDS_FEATURE].status == "bound", feats[S.GUARDS_FEATURE]
        assert S.BACKEND_INIT_TARGET in [t.target for t in feats[S.QNORM_FEATURE].targets if t.bound]
        live = DeepseekV4AttnBackend.__dict__["__init__"]
        assert live is not stock_init and live.__wrapped__ is stock_init
        assert ST.stock_of(live) is stock_init
    finally:
        binder.revert_all()
    assert DeepseekV4AttnBackend.__dict__["__init__"] is stock_init

    patch = next(p for p in F.patches(Role.SCHEDULER, _settings(**env)) if p.target == S.BACKEND_INIT_TARGET)
    monkeypatch.setattr(F, "reserve_for_backend", lambda *a: pytest.fail("the pool is off: nothing to reserve"))
    monkeypatch.setattr(
        DeepseekV4AttnBackend, "__init__", patch.build(lambda self, mr, *a, **kw: setattr(self, "device", CPU))
    )
    ST.RESULTS.clear()
    DeepseekV4AttnBackend(SimpleNamespace())
    assert [(r.feature, r.status) for r in ST.RESULTS] == [
        (S.QNORM_FEATURE, "skipped"),
        (S.GUARDS_FEATURE, "skipped"),
    ]
    assert all("no CUDA device" in r.detail for r in ST.RESULTS)


def test_check_reports_the_self_tests_and_the_compute_capabilities_the_gpu_suites_ran_on():
    """The real ``check`` scheduler child on this CPU host: each DSV4 feature's detail says what its self-test
    proves, the capabilities the GPU suites ran on, and that this host has no NVIDIA GPU; the table shows it."""
    from dspark_harden.cli.check import merge, render_table, run_child

    rep = run_child("scheduler", env={**os.environ, "SGLANG_PLUGINS": "dspark_harden"})
    feats = {f["name"]: f for f in rep["features"]}
    for name in (S.POOL_FEATURE, S.QNORM_FEATURE, S.GUARDS_FEATURE):
        detail = feats[name]["detail"]
        assert f"start-up self-test: {F.SELF_TESTS[name]}" in detail, detail
        assert (
            "DSV4 GPU suites ran on sm_90 (NVIDIA H100 80GB HBM3, NVIDIA H200); this host: no NVIDIA GPU (no nvidia-smi)"
            in detail
        )
    assert feats[S.GUARDS_FEATURE]["detail"].startswith(f"{S.GUARDS}=0; start-up self-test: guarded plans")
    table = render_table(merge([rep]))
    assert "this host: no NVIDIA GPU" in table
    # a bound feature's detail is shown under its targets
    bound = {**feats[S.QNORM_FEATURE], "status": "bound", "detail": "X on sm_90", "default_on": False}
    bound["targets"] = [{"target": S.Q_B_TARGET, "role": "scheduler", "bound": True, "detail": "wrap"}]
    lines = render_table({**merge([rep]), "features": [bound], "problems": []}).splitlines()
    assert lines[-1].strip() == "X on sm_90" and S.Q_B_TARGET in lines[-2]


def test_a_serving_process_never_runs_nvidia_smi_only_check_does(tmp_path, monkeypatch):
    """Guest in every process: the host-GPU line of the DSV4 features' details comes from ``nvidia-smi``,
    which ``check`` runs; a serving process (any SGLang process of an image with the plugin installed, DSV4
    or not) must not spawn it at bind. A planted ``nvidia-smi`` on PATH records each run."""
    from dspark_harden.core import roles

    marker = tmp_path / "ran"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\necho run >> {marker}\necho 'Planted GPU, 10.0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")

    def report():
        names = (S.POOL_FEATURE, S.QNORM_FEATURE, S.GUARDS_FEATURE)
        return SimpleNamespace(
            features=[SimpleNamespace(name=n, status="unavailable", detail="not DSV4") for n in names]
        )

    serving = report()
    ctx = roles.ProcessContext(Role.SCHEDULER, server_args=SimpleNamespace())
    monkeypatch.setattr(roles, "CONTEXT", ctx)
    F.dspark_process_bound(role=Role.SCHEDULER, settings=_settings(), report=serving)
    assert not marker.exists(), "a serving process ran nvidia-smi at bind"
    assert all("this host" not in f.detail and "start-up self-test" in f.detail for f in serving.features)

    checked = report()
    monkeypatch.setattr(roles, "CONTEXT", None)
    F.dspark_process_bound(role=Role.SCHEDULER, settings=_settings(), report=checked)
    assert marker.read_text().count("run") == 1  # check: one run for all three features
    assert all("this host: Planted GPU sm_100 (NOT among them" in f.detail for f in checked.features)
