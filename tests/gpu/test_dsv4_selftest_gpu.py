"""The DSV4 features' start-up self-tests (``dspark_harden.dsv4_memory.selftest``, issue 41 item 2) on the
device: each passes with SGLang 0.5.23's own kernels (``fused_q_norm_rope`` and the compress planner via its
JIT, ``flash_mla_sparse_fwd`` of sgl-flash-mla 1.0.0, the SM90 Q8KV8 prefill), in well under a second after
the first call, and each refuses -- naming the feature, the device and its ``sm_XY`` -- when one element of
the feature's result is corrupted or a crafted bad plan goes uncaught (negative controls). Run as the DSV4
suite (tests/gpu/RUN.md, "Start-up self-tests"):
``TESTS=tests/gpu/test_dsv4_selftest_gpu.py OUT=$OUT bash tests/gpu/run_dsv4_on_device.sh``.

No SGLang server runs here (the device has only the kernel wheels, not SGLang's dependency tree), so stock
``MQALayer._compute_q_b`` is its q_head_norm branch copied verbatim (as in test_dsv4_memory_gpu.py), and
the wiring test drives :func:`selftest.run_for_backend` with a stand-in backend object carrying the
attributes it reads (device, KV-pool geometry, ``req_to_token``).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine: RUN.md)")

DEV = torch.device("cuda", 0)
HEAD_DIM, ROPE_DIM, MAX_POS = 512, 64, 65536
REPORT = os.environ.get("OUT")
BUDGET_S = 1.0  # each self-test after its first call ("well under a second")


def _report(name: str, obj) -> None:
    line = json.dumps({name: obj})
    print(line)
    if REPORT:
        with open(os.path.join(REPORT, "dsv4_selftest_figures.jsonl"), "a") as fh:
            fh.write(line + "\n")


def _cc() -> str:
    major, minor = torch.cuda.get_device_capability(DEV)
    return f"sm_{major}{minor}"


def _assert_refused(info, feature: str, what: str) -> str:
    msg = str(info.value)
    name = torch.cuda.get_device_name(DEV)
    assert f"start-up self-test of feature {feature} failed on {name} ({_cc()}, cuda:0): " in msg, msg
    assert what in msg, msg
    return msg


def _flip_one(t: torch.Tensor, index: int = 7) -> None:
    """Flip the lowest bit of one element (in place): the smallest corruption there is."""
    flat = t.view(-1).view(torch.uint8)
    flat[index * t.element_size()] ^= 1


def test_device_and_the_capabilities_the_suites_ran_on():
    from dspark_harden.dsv4_memory import selftest as ST
    from dspark_harden.dsv4_memory import settings as S

    name, cc, label = ST.device_info(DEV)
    _report(
        "device",
        {"name": name, "cc": cc, "label": label, "proven": S.proven_ccs(), "check_line": ST.host_device_line()},
    )
    assert cc == _cc() and label.startswith(name)
    assert f"this host: {name} {cc}" in ST.host_device_line()


# --- dsv4-inplace-q-norm-rope ---------------------------------------------------------------------


def _freqs():
    g = torch.Generator(device="cpu").manual_seed(0)
    ang = torch.rand((MAX_POS, ROPE_DIM // 2), generator=g) * 6.283
    return torch.polar(torch.ones_like(ang), ang).to(DEV)


def _stock_q_head_norm(self, q, positions, q_out=None):
    """sglang 0.5.23 ``MQALayer._compute_q_b``, q_head_norm branch (models/deepseek_v4.py), verbatim."""
    from sglang.kernels.ops.attention.dsv4 import fused_q_norm_rope

    q, _ = self.wq_b(q)
    q = q.view(-1, self.n_local_heads, self.head_dim)
    if q_out is None:
        q_out = torch.empty_like(q)
    fused_q_norm_rope(q, q_out, self.eps, self.freqs_cis, positions)
    return q_out


def _qnorm(ours, heads, tokens=None):
    from dspark_harden.dsv4_memory import selftest as ST

    return ST.check_qnorm(
        ours,
        _stock_q_head_norm,
        heads=heads,
        head_dim=HEAD_DIM,
        eps=1e-6,
        freqs_cis=_freqs(),
        device=DEV,
        tokens=tokens or ST.QNORM_TOKENS,
    )


@pytest.mark.parametrize("heads", [64, 128])
def test_qnorm_self_test_passes_and_refuses_a_corrupted_in_place_result(heads):
    from dspark_harden.dsv4_memory import selftest as ST
    from dspark_harden.dsv4_memory import settings as S
    from dspark_harden.dsv4_memory.qnorm import build_compute_q_b

    ours = build_compute_q_b(_stock_q_head_norm, lambda: None)
    res = _qnorm(ours, heads)
    _report(f"qnorm_self_test_{heads}_heads", {"seconds": res.seconds, "load_seconds": res.load_seconds})
    assert res.status == "passed" and res.seconds < BUDGET_S, res

    def corrupted(self, q, positions, q_out=None):
        out = ours(self, q, positions, q_out)
        _flip_one(out)
        return out

    with pytest.raises(ST.SelfTestError) as info:
        _qnorm(corrupted, heads)
    _assert_refused(info, S.QNORM_FEATURE, "fused_q_norm_rope in place differs from out of place")


def test_qnorm_self_test_refuses_an_unsafe_alias_on_the_real_kernel():
    """The real kernel with its output one token ahead of its input (unsafe by construction), at the
    shape of test_dsv4_memory_gpu.py's negative control (8,192 tokens x 128 heads, 3 of 3 runs caught
    there): the self-test's comparison must refuse it."""
    from sglang.kernels.ops.attention.dsv4 import fused_q_norm_rope

    from dspark_harden.dsv4_memory import selftest as ST
    from dspark_harden.dsv4_memory import settings as S

    def offset_alias(self, q, positions, q_out=None):
        q, _ = self.wq_b(q)
        q = q.view(-1, self.n_local_heads, self.head_dim)
        buf = torch.cat([q, q[-1:]])  # rows [0, T-1] the input, rows [1, T] the output: overlapping
        fused_q_norm_rope(buf[:-1], buf[1:], self.eps, self.freqs_cis, positions)
        q.copy_(buf[1:])
        return q

    with pytest.raises(ST.SelfTestError) as info:
        _qnorm(offset_alias, 128, tokens=8192)
    _assert_refused(info, S.QNORM_FEATURE, "in place differs from out of place")


# --- dsv4-sparse-prefill-pool ---------------------------------------------------------------------


def _flash_mla_stock():
    pytest.importorskip("flash_mla", reason="sgl-flash-mla is in .whl_dsv4, not .whl_q8")
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd

    return flash_mla_sparse_fwd


@pytest.mark.parametrize("heads", [64, 128])
def test_pool_self_test_passes_and_refuses_a_corrupted_pooled_output(heads):
    from dspark_harden.dsv4_memory import selftest as ST
    from dspark_harden.dsv4_memory import settings as S
    from dspark_harden.dsv4_memory.pool import SparsePrefillPool

    stock = _flash_mla_stock()
    pool = SparsePrefillPool(tokens=1024, heads=heads, d_v=512, device=DEV).reserve()
    res = ST.check_reservation(pool, stock, device=DEV)
    _report(f"pool_self_test_{heads}_heads", {"seconds": res.seconds, "load_seconds": res.load_seconds, **res.figures})
    assert res.status == "passed" and res.seconds < BUDGET_S, res
    assert res.figures["poisoned_blocks_reused"], "the compared call did not reuse the NaN-filled reserved blocks"
    assert (pool.served, pool.refused) == (0, 0)

    def corrupt_inside(*args, **kwargs):
        out = stock(*args, **kwargs)
        if pool._inside(out[0]):
            _flip_one(out[0])
        return out

    with pytest.raises(ST.SelfTestError) as info:
        ST.check_reservation(pool, corrupt_inside, device=DEV)
    _assert_refused(info, S.POOL_FEATURE, "the pooled sparse-prefill output differs from a fresh allocation's")


def test_q8kv8_pool_self_test_passes_and_refuses_a_corrupted_output():
    """Needs the Q8KV8 JIT's CUTLASS headers (the ``.whl_q8`` wheel directory: RUN.md)."""
    pytest.importorskip("deep_gemm", reason="CUTLASS headers come with .whl_q8 (cutlass-include.tar.gz)")
    from sglang.kernels.ops.attention.sparse_mla_q8kv8_prefill_sm90 import (
        q8kv8_padded_num_heads,
        sparse_mla_q8kv8_prefill_fwd,
    )

    from dspark_harden.dsv4_memory import selftest as ST
    from dspark_harden.dsv4_memory import settings as S
    from dspark_harden.dsv4_memory.pool import Q8KV8Reservation

    res = Q8KV8Reservation(tokens=1024, heads=int(q8kv8_padded_num_heads(64)), d_v=512, device=DEV).reserve()
    out = ST.check_reservation(res, sparse_mla_q8kv8_prefill_fwd, device=DEV)
    _report("q8kv8_self_test", {"seconds": out.seconds, "load_seconds": out.load_seconds, **out.figures})
    assert out.status == "passed" and out.seconds < BUDGET_S, out

    def corrupt(*args, **kwargs):
        result = sparse_mla_q8kv8_prefill_fwd(*args, **kwargs)
        if kwargs.get("out") is not None:
            _flip_one(result[0])
        return result

    with pytest.raises(ST.SelfTestError) as info:
        ST.check_reservation(res, corrupt, device=DEV)
    _assert_refused(info, S.POOL_FEATURE, "the pooled sparse-prefill output differs from a fresh allocation's")


# --- dsv4-planner-guards --------------------------------------------------------------------------


def _planner_paths(sync=False):
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan, CompressorPrefillPlan

    from dspark_harden.dsv4_memory import planner as PL

    stock = {"decode": CompressorDecodePlan.generate, "prefill": CompressorPrefillPlan.generate}
    ours = {
        "decode": PL.unwrap(PL.build_decode_generate(stock["decode"], lambda ok: None, sync_checks=sync)),
        "prefill": PL.unwrap(PL.build_prefill_generate(stock["prefill"], lambda ok: None, sync_checks=sync)),
    }
    return ours, stock


def _check_planner(ours, stock, report=None):
    from dspark_harden.dsv4_memory import planner as PL
    from dspark_harden.dsv4_memory import planner_device as PD
    from dspark_harden.dsv4_memory import selftest as ST

    PD.ensure_state(DEV)
    PD.check(DEV)
    return ST.check_planner(
        ours,
        stock,
        report or (lambda: PD.check(DEV)),
        PL.PlannerBoundsError,
        geometry=ST.PlanGeometry(),
        device=DEV,
    )


@pytest.mark.parametrize("sync", [False, True], ids=["device-guard", "sync-mode"])
def test_planner_self_test_passes(sync):
    from dspark_harden.dsv4_memory import planner_device as PD

    res = _check_planner(*_planner_paths(sync))
    _report(
        f"planner_self_test_{'sync' if sync else 'device'}",
        {"seconds": res.seconds, "load_seconds": res.load_seconds, **res.figures},
    )
    assert res.status == "passed" and res.seconds < BUDGET_S, res
    assert res.figures["caught"] == ["decode past req_to_token", "prefill over num_q_tokens"]
    PD.check(DEV)  # the crafted plans' reports were consumed: nothing left pending


def test_planner_self_test_refuses_a_corrupted_plan_and_a_guard_whose_report_is_never_read():
    from dspark_harden.dsv4_memory import planner as PL
    from dspark_harden.dsv4_memory import planner_device as PD
    from dspark_harden.dsv4_memory import selftest as ST
    from dspark_harden.dsv4_memory import settings as S

    ours, stock = _planner_paths()
    decode = ours["decode"]

    def corrupted(*args, **kwargs):
        plan = decode(*args, **kwargs)
        _flip_one(plan.plan_d, 0)
        return plan

    with pytest.raises(ST.SelfTestError) as info:
        _check_planner({**ours, "decode": corrupted}, stock)
    _assert_refused(info, S.GUARDS_FEATURE, "the guarded c4 decode plan (device lengths, b 8) is not stock's: plan_d")

    with pytest.raises(ST.SelfTestError) as info:  # the guard counts, but nobody reads its report
        _check_planner(ours, stock, report=lambda: torch.cuda.synchronize(DEV))
    _assert_refused(info, S.GUARDS_FEATURE, "a crafted out-of-bounds c4 plan (decode past req_to_token) was not caught")
    with pytest.raises(PL.PlannerBoundsError, match="req_to_token read outside its allocation"):
        PD.check(DEV)  # what the unread report held


# --- wiring: run_for_backend on the device ----------------------------------------------------------


def test_run_for_backend_runs_each_enabled_self_test_once_on_this_device():
    """:func:`selftest.run_for_backend` as the backend-init wrap calls it, with the pool and the planner
    guards on (the in-place Q path needs a live ``MQALayer``, i.e. SGLang's model code, not on this
    machine): a real reservation, the stand-in backend's KV-pool geometry, the real kernels; a second
    backend of the same process runs nothing again."""
    from dspark_harden.core.settings import load_settings
    from dspark_harden.dsv4_memory import pool as P
    from dspark_harden.dsv4_memory import selftest as ST
    from dspark_harden.dsv4_memory import settings as S

    _flash_mla_stock()
    settings = load_settings(S.SETTINGS, {S.POOL: "1", S.GUARDS: "1"})
    kv_pool = SimpleNamespace(
        swa_page_size=256,
        get_ring_size=lambda compress_ratio: 128 if compress_ratio == 4 else 256,
        _unified_kv=False,
        full_to_swa_index_mapping=torch.zeros(8, dtype=torch.int64, device=DEV),
    )
    backend = SimpleNamespace(
        device=torch.device("cuda"),
        token_to_kv_pool=kv_pool,
        req_to_token=torch.zeros((4, 8), dtype=torch.int32, device=DEV),
        present_ratios=(0, 4, 128),
    )
    old = P.POOL
    P.POOL = P.SparsePrefillPool(tokens=1024, heads=64, d_v=512, device=DEV).reserve()
    try:
        ST.RESULTS.clear()
        out = ST.run_for_backend(backend, SimpleNamespace(model=None), settings)
        assert [(r.feature, r.status) for r in out] == [(S.POOL_FEATURE, "passed"), (S.GUARDS_FEATURE, "passed")]
        assert ST.run_for_backend(backend, SimpleNamespace(model=None), settings) == []
        _report("run_for_backend", [{"feature": r.feature, "seconds": r.seconds, "detail": r.detail} for r in out])
        assert all(r.seconds < BUDGET_S for r in out), out
    finally:
        P.POOL = old
