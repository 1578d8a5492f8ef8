"""DSV4 eager-prefill memory on the CPU host: fingerprints against the installed sglang 0.5.23
sources, strict settings, fail-closed start-up without CUDA, the patches binding / verifying /
reverting on the real classes (forked), and the planner guards' geometry checks on real tensors.
The pool and in-place kernels need CUDA: tests/gpu/test_dsv4_memory_gpu.py runs them on the H200."""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import subprocess
import sys

import pytest
import torch

from dspark_harden.core.patch import Role
from dspark_harden.core.patch import source_text_fingerprint as source_fingerprint
from dspark_harden.core.settings import SettingsError, load_settings
from dspark_harden.dsv4_memory import feature as F
from dspark_harden.dsv4_memory import planner as PL
from dspark_harden.dsv4_memory import settings as S
from dspark_harden.dsv4_memory.pool import SparsePrefillPool, SparsePrefillPoolError, reservation_bytes

from ..plugin._proc import run_py


def _settings(**env):
    return load_settings(S.SETTINGS, {k: str(v) for k, v in env.items()})


def test_declared_fingerprints_match_the_installed_sources():
    """Read from the source text: the FlashMLA wrapper module loads the CUDA extension at import."""
    for target, fp in [
        (S.FLASH_MLA_TARGET, S.FLASH_MLA_FINGERPRINT),
        (S.Q8KV8_TARGET, S.Q8KV8_FINGERPRINT),
        (S.BACKEND_INIT_TARGET, S.BACKEND_INIT_FINGERPRINT),
        (S.Q_B_TARGET, S.Q_B_FINGERPRINT),
        (S.PREFILL_PLAN_TARGET, S.PREFILL_PLAN_FINGERPRINT),
        (S.DECODE_PLAN_TARGET, S.DECODE_PLAN_FINGERPRINT),
        (S.METADATA_TARGET, S.METADATA_FINGERPRINT),
        (S.METADATA_OUT_GRAPH_TARGET, S.METADATA_OUT_GRAPH_FINGERPRINT),
        *S.RESULT_SYNC_TARGETS.items(),
    ]:
        assert source_fingerprint(target) == fp, target
    patched = F.patches(Role.SCHEDULER, _settings(**{S.POOL: 1, S.QNORM: 1, S.GUARDS: 1}))
    assert sorted(p.target for p in patched) == sorted(
        [
            S.FLASH_MLA_TARGET,
            S.Q8KV8_TARGET,
            S.BACKEND_INIT_TARGET,
            S.Q_B_TARGET,
            S.PREFILL_PLAN_TARGET,
            S.DECODE_PLAN_TARGET,
            S.METADATA_TARGET,
            S.METADATA_OUT_GRAPH_TARGET,
            *S.RESULT_SYNC_TARGETS,
        ]
    )
    assert F.patches(Role.SCHEDULER, _settings()) == [] and F.patches(Role.MAIN, _settings(**{S.POOL: 1})) == []


@pytest.mark.parametrize(
    "name,bad",
    [
        (S.POOL, "yes"),
        (S.QNORM, "2"),
        (S.GUARDS, "on"),
        (S.POOL_TOKENS, "0"),
        (S.POOL_TOKENS, "-8"),
        (S.POOL_TOKENS, "8k"),
        (S.POOL_SLOTS, "0"),
        (S.POOL_SLOTS, "5"),
        (S.GUARDS_SYNC, "yes"),
    ],
)
def test_bad_values_are_rejected_by_name(name, bad):
    with pytest.raises(SettingsError, match=name):
        _settings(**{name: bad})


def test_explicitly_enabled_without_cuda_stops_startup_naming_why():
    """Real entry point, real binder: on this CPU-only host every switch explicitly on refuses."""
    for switch in (S.POOL, S.QNORM, S.GUARDS):
        rc, res, out = run_py(
            """
            from dspark_harden import entry
            try:
                entry.load()
            except SystemExit as exc:
                emit({"exit": str(exc)})
            """,
            env={"DSPARK_HARDEN_ROLE": "scheduler", switch: "1"},
        )
        assert res and res["exit"], out[-3000:]
        assert f"enabled by {switch}=1 but unavailable" in res["exit"] and "needs CUDA" in res["exit"], res["exit"]


@pytest.mark.forked
def test_importable_patches_bind_verify_and_revert_on_real_sglang():
    """Every target importable on a CPU host (all but FlashMLA's wrapper module, whose fingerprint the
    first test checks from its source) binds with its fingerprint, verifies live, and reverts exactly."""
    from dspark_harden.core.patch import raw_attr, resolve_owner

    ps = [
        p
        for p in F.patches(Role.SCHEDULER, _settings(**{S.POOL: 1, S.QNORM: 1, S.GUARDS: 1}))
        if p.target != S.FLASH_MLA_TARGET
    ]
    before = {p.target: raw_attr(*resolve_owner(p.target)) for p in ps}
    for p in ps:
        p.apply()
        p.apply()  # idempotent
        assert p.live_check() is None, p.target
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    assert CompressorPrefillPlan.__dict__["generate"] is not before[S.PREFILL_PLAN_TARGET]
    for p in reversed(ps):
        p.revert()
        assert raw_attr(*resolve_owner(p.target)) is before[p.target], p.target


def test_reservation_sizes_and_geometry_refusals():
    assert reservation_bytes(8192, 128, 512) == (1 << 30) + 2 * 8192 * 128 * 4  # 1 GiB + 8 MiB
    pool = SparsePrefillPool(tokens=4096, heads=64, d_v=512, device="cpu", slots=2)
    assert pool.reserved_bytes == 2 * reservation_bytes(4096, 64, 512)
    pool.check_geometry(4096, 64, 512)
    for args, frag in [((4097, 64, 512), "4097 tokens"), ((16, 128, 512), "128 heads"), ((16, 64, 448), "d_v 448")]:
        with pytest.raises(SparsePrefillPoolError, match=frag) as info:
            pool.check_geometry(*args)
        assert "reserved 4096 tokens x 64 heads x d_v 512" in str(info.value)
    assert pool.refused == 3


def test_pool_without_a_reservation_is_a_named_error():
    from dspark_harden.dsv4_memory import pool as P

    fn = P.build_sparse_fwd(lambda *a, **k: pytest.fail("stock must not run"), lambda pool: None)
    with pytest.raises(SparsePrefillPoolError, match="no sparse-prefill pool was reserved"):
        fn(torch.zeros(1, 64, 512), None, None, 1.0)


def _valid_prefill(rng: random.Random, device="cpu"):
    b = rng.randint(1, 12)
    rows, cols = b + rng.randint(0, 8), 512
    seq = [rng.randint(1, cols) for _ in range(b)]
    ext = [rng.randint(1, s) for s in seq]
    rid = rng.sample(range(rows), b)
    n_full = 4096
    r2t = torch.randint(0, n_full, (rows, cols), dtype=torch.int32)
    f2s = torch.arange(n_full, dtype=torch.int64)
    return dict(
        compress_ratio=rng.choice([4, 128]),
        req_pool_indices=torch.tensor(rid, dtype=torch.int64),
        seq_lens=torch.tensor(seq, dtype=torch.int64),
        extend_lens=torch.tensor(ext, dtype=torch.int64),
        req_to_token=r2t,
        full_to_state=f2s,
        swa_page_size=256,
        ring_size=128 if rng.random() < 0.5 else 256,
        num_q_tokens=sum(ext),
    )


def test_planner_guard_passes_every_valid_geometry_and_names_each_violation():
    rng = random.Random(7)
    for _ in range(300):
        g = _valid_prefill(rng)
        if g["ring_size"] % g["compress_ratio"]:
            g["ring_size"] = 128 if g["compress_ratio"] == 4 else 256
        assert PL.prefill_problems(**g) == [], g
        d = dict(
            compress_ratio=g["compress_ratio"],
            req_pool_indices=g["req_pool_indices"],
            req_to_token=g["req_to_token"],
            full_to_state=g["full_to_state"],
            seq_lens=g["seq_lens"],
            swa_page_size=256,
            ring_size=g["ring_size"],
        )
        assert PL.decode_problems(**d) == []
    g = _valid_prefill(random.Random(1))
    g["compress_ratio"], g["ring_size"] = 4, 128
    cases = {
        "more than num_q_tokens": dict(num_q_tokens=g["num_q_tokens"] - 1),
        "extend length is <= 0": dict(
            extend_lens=torch.where(
                torch.arange(len(g["seq_lens"])) == 0, torch.zeros_like(g["extend_lens"]), g["extend_lens"]
            )
        ),
        "outside req_to_token's": dict(req_pool_indices=g["req_pool_indices"] + 1000),
        "columns": dict(
            seq_lens=g["seq_lens"] + 1000,
            extend_lens=g["extend_lens"] + 1000,
            num_q_tokens=g["num_q_tokens"] + 1000 * len(g["seq_lens"]),
        ),
        "outside full_to_state": dict(full_to_state=g["full_to_state"][:8]),
        "must be the same 1-D batch": dict(
            extend_lens=g["extend_lens"][:-1] if len(g["seq_lens"]) > 1 else g["extend_lens"].repeat(2)
        ),
        "not nested": dict(ring_size=96),
    }
    for frag, change in cases.items():
        probs = PL.prefill_problems(**{**g, **change})
        assert probs and any(frag in p for p in probs), (frag, probs)


def test_kernel_sources_the_guard_copies_match_and_drift_is_refused(monkeypatch):
    """The installed c_plan.cuh (copied into guarded_c_plan.cuh) and c128_online_v2.cuh / generate_online
    (documented as reading no req_to_token) match their recorded digests; a changed digest is named, and
    DSPARK_HARDEN_ALLOW_DRIFT skips exactly what it names."""
    assert F.kernel_source_drift() == []
    monkeypatch.setitem(S.KERNEL_SOURCES, "deepseek_v4/c_plan.cuh", "0" * 16)
    monkeypatch.setitem(S.ONLINE_PLAN_SOURCES, next(iter(S.ONLINE_PLAN_SOURCES)), "1" * 16)
    drifted = F.kernel_source_drift()
    assert len(drifted) == 2 and "c_plan.cuh (expected 0000000000000000, found ece03178ec400098)" in drifted[0]
    assert "generate_online" in drifted[1]
    assert len(F.kernel_source_drift(("deepseek_v4/c_plan.cuh",))) == 1 and F.kernel_source_drift(("all",)) == []


def _plan_args(g):
    return [
        g[k]
        for k in (
            "compress_ratio",
            "req_pool_indices",
            "seq_lens",
            "extend_lens",
            "req_to_token",
            "full_to_state",
            "swa_page_size",
            "ring_size",
            "num_q_tokens",
        )
    ]


def test_guarded_generate_refuses_before_the_planner_launches():
    """The planner kernels need CUDA; here the device-guarded ``generate`` is a recorder standing in for the
    launch, to show the host checks that need no device read (shapes, host lengths) raise before it, a
    violation an earlier plan published (the pending-report reader, a stand-in) raises before it, and valid
    plans pass straight through to it -- never to stock."""
    launched, pending = [], []

    def check_pending(device=None):
        if pending:
            raise PL.PlannerBoundsError(pending.pop())

    gen = PL.unwrap(
        PL.build_prefill_generate(
            lambda *a: pytest.fail("stock planner called"),
            lambda ok: None,
            device_generate=lambda *a: launched.append(a) or "plan",
            check_pending=check_pending,
        )
    )
    g = _valid_prefill(random.Random(3))
    g["compress_ratio"], g["ring_size"] = 4, 128
    args = _plan_args(g)
    assert gen(*args) == "plan" and len(launched) == 1
    args[8] = g["num_q_tokens"] - 1
    with pytest.raises(PL.PlannerBoundsError, match="refused before launch.*more than num_q_tokens"):
        gen(*args)
    args[8] = g["num_q_tokens"]
    pending.append("device-side guard: a full_to_state read outside its allocation")
    with pytest.raises(PL.PlannerBoundsError, match="device-side guard"):
        gen(*args)
    assert len(launched) == 1
    assert gen(*args) == "plan" and len(launched) == 2


def test_device_data_checks_run_only_in_the_sync_mode(monkeypatch):
    """Without ``sync_checks`` nothing reads the planner's device inputs on the host (a bad row index is
    left to the device guard: the plan is launched); with it the same plan is refused before launch."""
    launched = []
    g = _valid_prefill(random.Random(4))
    g["compress_ratio"], g["ring_size"] = 4, 128
    args = _plan_args({**g, "req_pool_indices": g["req_pool_indices"] + 1000})
    for sync in (False, True):
        gen = PL.unwrap(
            PL.build_prefill_generate(
                None,
                lambda ok: None,
                device_generate=lambda *a: launched.append(a) or "plan",
                check_pending=lambda device=None: None,
                sync_checks=sync,
            )
        )
        if sync:
            with pytest.raises(PL.PlannerBoundsError, match="outside req_to_token's"):
                gen(*args)
        else:
            assert gen(*args) == "plan"
    assert len(launched) == 1


def test_check_lists_the_features_with_their_reservation_sizes():
    """`dspark-harden check` (its real scheduler child): the pool's reservation formula and an
    example size, and the in-place path's saving per layer call, are shown even where the
    features are off (on this CPU host they cannot be on)."""
    import os

    from dspark_harden.cli.check import run_child

    rep = run_child("scheduler", env={**os.environ, "SGLANG_PLUGINS": "dspark_harden"})
    feats = {f["name"]: f for f in rep["features"]}
    pool, qn = feats[S.POOL_FEATURE], feats[S.QNORM_FEATURE]
    assert pool["status"] == "disabled" and "reserves 1 x --chunked-prefill-size tokens" in pool["detail"], pool
    assert str(reservation_bytes(8192, 128, 512)) in pool["detail"]
    assert "8k tokens 1073741824 bytes" in qn["detail"], qn


def test_planner_guard_checks_exactly_the_positions_the_plan_reads():
    """c_plan.cuh reads ``req_to_token[rid, p]`` for decode only at ``p = seq-1`` and
    ``max(seq-1-ratio, 0)``, and for prefill only inside ``[max(prefix-ratio, 0), seq)``. One bad full
    location planted at a position the plan reads must be refused; planted at a position it never
    reads it must not be (a guard that scanned the whole row -- the batch x columns temporaries it
    used to build -- would refuse valid batches whose unused slots hold stale locations)."""
    rng = random.Random(11)
    n_full = 4096
    for it in range(90):
        b = rng.randint(1, 6)
        rows, cols = b + 2, 512
        seq = [rng.randint(16, cols - 1) for _ in range(b)]
        ext = [rng.randint(1, s) for s in seq]
        rid = rng.sample(range(rows), b)
        r2t = torch.randint(0, n_full, (rows, cols), dtype=torch.int32)
        f2s = torch.arange(n_full, dtype=torch.int64)
        base = dict(
            req_pool_indices=torch.tensor(rid, dtype=torch.int64),
            req_to_token=r2t,
            full_to_state=f2s,
            swa_page_size=256,
            ring_size=128,
        )
        i = b - 1 if it % 2 else rng.randrange(b)  # the last request borders the unused flattened slots
        if it % 3 == 0:
            ext[i] = seq[i]  # no prefix: the window is clipped at position 0
        s, e = seq[i], ext[i]

        def planted(pos):
            t = r2t.clone()
            t[rid[i], pos] = n_full + 5
            return t

        pre = dict(
            base, compress_ratio=4, seq_lens=torch.tensor(seq), extend_lens=torch.tensor(ext), num_q_tokens=sum(ext)
        )
        assert PL.prefill_problems(**pre) == []
        lo = max(s - e - 4, 0)
        for pos in (s - 1, lo, rng.randrange(lo, s)):  # read
            assert any(
                "outside full_to_state" in p for p in PL.prefill_problems(**{**pre, "req_to_token": planted(pos)})
            ), pos
        for pos in [p for p in (lo - 1, s, rng.randrange(s, cols)) if 0 <= p < cols]:  # never read
            assert PL.prefill_problems(**{**pre, "req_to_token": planted(pos)}) == [], (pos, lo, s)
        dec = dict(base, compress_ratio=4, seq_lens=torch.tensor(seq))
        assert PL.decode_problems(**dec) == []
        for pos in (s - 1, s - 5):  # read
            assert any(
                "outside full_to_state" in p for p in PL.decode_problems(**{**dec, "req_to_token": planted(pos)})
            ), pos
        for pos in (s - 2, s - 3, s - 4, s - 6, s):  # never read by decode
            if 0 <= pos < cols:
                assert PL.decode_problems(**{**dec, "req_to_token": planted(pos)}) == [], pos
        # ratio 128 (and the request ring) read no full location: nothing planted can be refused
        assert (
            PL.decode_problems(**{**dec, "compress_ratio": 128, "ring_size": 256, "req_to_token": planted(s - 1)}) == []
        )


def test_q8kv8_reservation_hands_out_slices_refuses_held_slots_and_bad_geometry():
    """The Q8KV8 kernel needs SM90 (tests/gpu runs the real one); here ``stock`` is a recorder standing in
    for it, and the reservation's buffers are CPU tensors, to show which outputs each call gets."""
    from dspark_harden.dsv4_memory.pool import Q8KV8Reservation, _storage_uses

    calls = []

    def stock(q, kv, idx, scale, qs, ks, d_v=512, sink=None, lens=None, *, out=None, max_logits=None, lse=None):
        calls.append(
            tuple(t.shape[0] if t is not None else None for t in (out, max_logits, lse))
        )  # shapes only: holding them would hold the slot
        return out, max_logits, lse

    res = Q8KV8Reservation(tokens=64, heads=128, d_v=512, device="cpu", slots=2)
    res.bufs = [
        (torch.empty(64, 128, 512, dtype=torch.bfloat16), torch.empty(64, 128), torch.empty(64, 128)) for _ in range(2)
    ]
    res.baseline = [tuple(_storage_uses(t) for t in slot) for slot in res.bufs]
    q = torch.zeros(48, 128, 576)
    o1 = res.run(stock, q, None, None, 1.0, None, None)[0][:, :100]  # the caller keeps a head slice (a view)
    assert o1.untyped_storage().data_ptr() == res.bufs[0][0].untyped_storage().data_ptr() and calls[-1] == (48, 48, 48)
    o2 = res.run(stock, q, None, None, 1.0, None, None)[0]
    assert o2.data_ptr() == res.bufs[1][0].data_ptr()  # slot 0 is held: slot 1
    with pytest.raises(SparsePrefillPoolError, match="all 2 reserved output slot"):
        res.run(stock, q, None, None, 1.0, None, None)
    del o1
    assert res.run(stock, q, None, None, 1.0, None, None)[0].data_ptr() == res.bufs[0][0].data_ptr()
    with pytest.raises(
        SparsePrefillPoolError, match="65 tokens x 128 heads x d_v 512 does not fit the reserved 64 tokens"
    ):
        res.run(stock, torch.zeros(65, 128, 576), None, None, 1.0, None, None)
    with pytest.raises(SparsePrefillPoolError, match="64 heads"):
        res.run(stock, torch.zeros(8, 64, 576), None, None, 1.0, None, None)
    mine = torch.empty(48, 128, 512)
    assert res.run(stock, q, None, None, 1.0, None, None, out=mine)[0] is mine  # caller-owned: untouched
    assert (res.served, res.refused) == (3, 3)
    del o2


def test_every_decode_plan_runs_the_device_guard_and_reads_its_report_outside_capture(monkeypatch):
    """Routing only (the guarded kernels run in tests/gpu against SGLang's JIT): eager or while a graph is
    being captured, the decode wrapper launches ``device_generate`` and never stock; outside a capture it
    first reads the device guard's report, so a violation a replay published fails the next plan naming
    the reason; during a capture it reads nothing (no raise inside a capture)."""
    recorded, reads = [], []
    pending = ["device-side guard: a req_to_token read outside its allocation"]

    def check_pending(device=None):
        reads.append(device)
        if pending:
            raise PL.PlannerBoundsError(pending.pop())

    gen = PL.unwrap(
        PL.build_decode_generate(
            lambda *a: pytest.fail("stock planner called"),
            lambda ok: None,
            device_generate=lambda *a: recorded.append(a) or "guarded-plan",
            check_pending=check_pending,
        )
    )
    g = _valid_prefill(random.Random(5))
    args = [4, g["req_pool_indices"], g["req_to_token"], g["full_to_state"], g["seq_lens"], 256, 128]
    monkeypatch.setattr(PL, "_capturing", lambda: True)
    assert gen(*args) == "guarded-plan" and len(recorded) == 1 and not reads
    monkeypatch.setattr(PL, "_capturing", lambda: False)
    with pytest.raises(PL.PlannerBoundsError, match="device-side guard"):
        gen(*args)
    assert len(recorded) == 1
    assert gen(*args) == "guarded-plan" and len(recorded) == 2 and len(reads) == 2


@pytest.mark.forked
def test_pool_capacity_covers_the_largest_prefill_graph_bucket_of_the_published_config():
    """A real resolved DP2 ServerArgs published in this (forked) process with prefill CUDA graphs on
    (``prefill_graph.world.publish_runtime``: buckets up to 12,288 tokens, chunk 8,192): the reader finds
    stock's largest capture bucket; the default capacity rises from the chunk to it; an explicit capacity
    below it stops start-up naming both; prefill graphs off leaves the chunk."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import get_prefill_num_tokens_to_capture

    from dspark_harden.dsv4_memory.pool import SparsePrefillPoolError
    from dspark_harden.prefill_graph import runner as R
    from dspark_harden.prefill_graph import world as W

    cfg = R.CaptureConfig(buckets=(512, 1024, 4096, 12288), slots=16, chunked_prefill=8192)
    W.publish_runtime(cfg, backend="full", spec="none")
    want = max(get_prefill_num_tokens_to_capture([512, 1024, 4096, 12288]))
    assert F.prefill_graph_bucket_max() == want >= 12288
    sa = SimpleNamespace(chunked_prefill_size=8192, max_prefill_tokens=16384)
    assert F.pool_capacity(_settings(**{S.POOL: 1}), sa, F.prefill_graph_bucket_max()) == want
    assert F.pool_capacity(_settings(**{S.POOL: 1}), sa, None) == 8192  # prefill graphs off: the chunk
    assert F.pool_capacity(_settings(**{S.POOL: 1, S.POOL_TOKENS: 20000}), sa, want) == 20000
    with pytest.raises(
        SparsePrefillPoolError, match=f"=8192 cannot hold the largest prefill CUDA-graph bucket \\({want} tokens\\)"
    ):
        F.pool_capacity(_settings(**{S.POOL: 1, S.POOL_TOKENS: 8192}), sa, want)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit; no GPU needed)")
def test_guarded_planner_compiles_against_the_installed_stock_header(tmp_path):
    """What SGLang's JIT would build on a GPU host, compiled here without one: the translation unit made by
    SGLang's own ``_wrapper_source`` for ``planner_device._module()``'s two wrappers, against the installed
    ``c_plan.cuh`` and tvm-ffi headers, for sm_90a (the H200). Catches a copy that no longer matches the
    stock structs it includes. Then linked as SGLang's JIT links it (tvm-ffi + cudart) and loaded by tvm-ffi
    in a child: the three exports exist and the mirror's tensor check refuses a wrong shape (mutation: the
    check widened to any length -> red). It does not run the kernels (tests/gpu does, on the H200)."""
    import tvm_ffi
    from sglang.kernels.jit.utils.compile.paths import KERNEL_PATH
    from sglang.kernels.jit.utils.compile.spec import _wrapper_source

    from dspark_harden.dsv4_memory import planner_device as PD

    unit = tmp_path / "cuda.cu"
    unit.write_text(
        _wrapper_source(
            (str(PD.CSRC),),
            (
                ("plan_decode_guarded", "plan_compress_decode_guarded"),
                ("plan_prefill_guarded", "plan_compress_prefill_guarded"),
                ("mirror_device_pointer", "guard_mirror_device_pointer"),
            ),
        )
    )
    cmd = [
        "nvcc",
        "-Xcompiler",
        "-fPIC",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-DSGL_CUDA_ARCH=900",
        "-std=c++20",
        "-O3",
        "--expt-relaxed-constexpr",
        f"-I{pathlib.Path(tvm_ffi.__file__).parent / 'include'}",
        f"-I{KERNEL_PATH / 'include'}",
        f"-I{KERNEL_PATH / 'csrc'}",
        "-c",
        str(unit),
        "-o",
        str(tmp_path / "cuda.o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "cuda.o").stat().st_size > 0
    # linked as SGLang's JIT links (toolchain.base_link_flags: tvm-ffi + cudart) and loaded by tvm-ffi:
    # the three exports are there and the tensor checks run (the CUDA calls need a GPU: tests/gpu)
    from sglang.kernels.jit.utils.compile.toolchain import cuda_home

    libs = [pathlib.Path(cuda_home()) / "lib64", pathlib.Path("/usr/local/cuda/lib64")]
    cuda_lib = next((d for d in libs if (d / "libcudart.so").exists()), None)
    if cuda_lib is None:
        pytest.skip(f"compiled; no libcudart.so to link against in {libs}")
    ffi_lib = pathlib.Path(tvm_ffi.__file__).parent / "lib"
    so = tmp_path / "guarded.so"
    link = ["g++", str(tmp_path / "cuda.o"), "-shared", f"-L{ffi_lib}", "-ltvm_ffi", f"-L{cuda_lib}", "-lcudart"]
    proc = subprocess.run(link + ["-o", str(so)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    probe = (
        "import tvm_ffi, torch\n"
        f"m = tvm_ffi.load_module({str(so)!r})\n"
        "fs = [m.plan_decode_guarded, m.plan_prefill_guarded, m.mirror_device_pointer]\n"
        "try:\n"
        "    m.mirror_device_pointer(torch.zeros(3, dtype=torch.int32))\n"
        "except RuntimeError as exc:\n"
        "    print('REFUSED', 'Tensor match failed' in str(exc) and 'expected 4' in str(exc))\n"
    )
    env = dict(os.environ, LD_LIBRARY_PATH=f"{cuda_lib}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "REFUSED True" in proc.stdout, (proc.stdout, proc.stderr[-4000:])


@pytest.mark.forked
def test_pool_refuses_the_megaattention_backend_at_its_init(monkeypatch):
    """Issue 41: ``DSPARK_HARDEN_DSV4_SPARSE_PREFILL_POOL=1`` with the MegaAttention backend stops start-up
    at the backend's construction. Real classes: ``DeepseekV4MegaAttnBackend`` defines no ``__init__`` of
    its own, so constructing it runs ``DeepseekV4AttnBackend.__init__``, here wrapped by the feature's own
    patch (its ``build``, what binding applies; the stock ``__init__`` under it is a stand-in setting the
    attributes the reservation reads, as the real one needs a CUDA model runner). The standard backend,
    constructed the same way, passes the refusal and reaches the reservation (which needs CUDA here)."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend
    from sglang.srt.layers.attention.deepseek_v4_mega_backend import DeepseekV4MegaAttnBackend

    from dspark_harden.dsv4_memory import pool as P

    assert "__init__" not in DeepseekV4MegaAttnBackend.__dict__ and DeepseekV4MegaAttnBackend.mega_attn is True
    assert DeepseekV4AttnBackend.mega_attn is False

    def stock_init(self, model_runner, *args, **kwargs):  # stand-in for the CUDA-only stock constructor
        self.head_dim_v, self.device, self.dsv4_prefill_backend = 512, "cpu", "auto"

    patch = next(p for p in F.patches(Role.SCHEDULER, _settings(**{S.POOL: 1})) if p.target == S.BACKEND_INIT_TARGET)
    monkeypatch.setattr(DeepseekV4AttnBackend, "__init__", patch.build(stock_init))
    monkeypatch.setattr(F, "_local_heads", lambda model_runner: 64)
    monkeypatch.setattr(F, "_uses_q8kv8", lambda backend: False)
    monkeypatch.setattr(F, "prefill_graph_bucket_max", lambda: None)
    monkeypatch.setattr(P, "POOL", None)
    runner = SimpleNamespace(server_args=SimpleNamespace(chunked_prefill_size=4096, max_prefill_tokens=16384))

    with pytest.raises(SparsePrefillPoolError) as refused:
        DeepseekV4MegaAttnBackend(runner)
    msg = str(refused.value)
    assert "DSPARK_HARDEN_DSV4_SPARSE_PREFILL_POOL=1 with the DeepSeek V4 MegaAttention backend" in msg, msg
    assert "flash_mla_mega_prefill" in msg and "turn the pool off or use the standard DSV4 attention backend" in msg
    assert P.POOL is None  # nothing reserved

    with pytest.raises(SparsePrefillPoolError, match="needs CUDA") as reached:
        DeepseekV4AttnBackend(runner)
    assert "MegaAttention" not in str(reached.value)
