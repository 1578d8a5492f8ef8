"""The native engine (native/draft_traverse.c, ``dspark_harden._traverse_native``): xgrammar's own
``traverse_draft_tree`` called through the TVM FFI C ABI from native threads.

Real xgrammar, real TVM FFI library, real threads. Equality with stock is covered for every
engine (``native`` included) by test_traversal_differential.py; this file covers what only the
native engine has: the vendored ABI header against the installed one, thread-count independence
under repeated randomized steps (races would show as differences), fail-closed errors naming the
request, bind failures and fork.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from dspark_harden.dspark_masks import native
from dspark_harden.dspark_masks.resolve import resolve_jobs
from dspark_harden.dspark_masks.traversal import ChainTraverser, Job, TraversalError
from dspark_harden.dspark_masks.workload import GrammarFactory, NativeFactory, Req, matcher_state, native_jobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def factory():
    return GrammarFactory(vocab=2048, pad=64, mix="all")


def _state(m):
    if m is None:
        return None
    return (True, None) if m.is_terminated() else (False, m.find_jump_forward_string())


def _words(v):
    return (v + 31) // 32


def test_vendored_abi_header_matches_installed_tvm_ffi(tmp_path):
    """native/tvm_ffi_abi.h re-declares the TVM FFI structs the C code reads; compile it next to
    the installed apache-tvm-ffi's c_api.h and check every size and offset used."""
    from tvm_ffi import libinfo

    inc = libinfo.find_include_path()
    dl = libinfo.find_dlpack_include_path()
    checks = [
        ("dsh_DLTensor", "DLTensor", ["data", "device", "ndim", "dtype", "shape", "strides", "byte_offset"]),
        ("dsh_DLDataType", "DLDataType", ["code", "bits", "lanes"]),
        ("dsh_DLDevice", "DLDevice", ["device_type", "device_id"]),
        ("dsh_TVMFFIAny", "TVMFFIAny", ["type_index", "v_int64", "v_float64", "v_ptr", "v_obj"]),
        ("dsh_TVMFFIObject", "TVMFFIObject", ["combined_ref_count", "type_index", "deleter"]),
        ("dsh_TVMFFIByteArray", "TVMFFIByteArray", ["data", "size"]),
        ("dsh_TVMFFIMethodInfo", "TVMFFIMethodInfo", ["name", "doc", "metadata", "flags", "method"]),
        (
            "dsh_TVMFFITypeInfo",
            "TVMFFITypeInfo",
            [
                "type_index",
                "type_depth",
                "type_key",
                "type_ancestors",
                "num_fields",
                "num_methods",
                "fields",
                "methods",
            ],
        ),
        ("dsh_TVMFFIVersion", "TVMFFIVersion", ["major", "minor", "patch"]),
    ]
    lines = ["#include <stddef.h>", '#include "tvm/ffi/c_api.h"', '#include "tvm_ffi_abi.h"']
    for ours, theirs, fields in checks:
        lines.append(f'_Static_assert(sizeof({ours}) == sizeof({theirs}), "size {ours}");')
        for f in fields:
            lines.append(f'_Static_assert(offsetof({ours}, {f}) == offsetof({theirs}, {f}), "{ours}.{f}");')
    lines += [
        '_Static_assert(offsetof(dsh_TVMFFIErrorCellPrefix, message) == offsetof(TVMFFIErrorCell, message), "err");',
        *[
            f'_Static_assert((int)dsh_{k} == (int){k}, "{k}");'
            for k in (
                "kTVMFFINone",
                "kTVMFFIInt",
                "kTVMFFIBool",
                "kTVMFFIFloat",
                "kTVMFFIDLTensorPtr",
                "kTVMFFIStaticObjectBegin",
                "kTVMFFIError",
                "kTVMFFIFunction",
            )
        ],
        "_Static_assert(DSH_TVM_FFI_ABI_MAJOR == TVM_FFI_VERSION_MAJOR && DSH_TVM_FFI_ABI_MINOR == TVM_FFI_VERSION_MINOR,"
        ' "ABI version");',
        "int main(void) { return 0; }",
    ]
    src = tmp_path / "abi_check.c"
    src.write_text("\n".join(lines) + "\n")
    res = subprocess.run(
        [
            "gcc",
            "-std=c11",
            "-Wall",
            "-Werror",
            "-I",
            inc,
            "-I",
            dl,
            "-I",
            os.path.join(ROOT, "native"),
            "-o",
            str(tmp_path / "abi_check"),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr


def test_native_c_source_compiles_standalone_strict(tmp_path):
    res = subprocess.run(
        [
            "gcc",
            "-std=c11",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-c",
            os.path.join(ROOT, "native", "draft_traverse.c"),
            "-o",
            str(tmp_path / "t.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("threads", [2, 4, 16])
def test_thread_count_never_changes_a_bit_over_many_random_steps(threads):
    """300 randomized steps (valid, invalid, out-of-vocab, stop tokens, terminated matchers, roots
    inside the chain) through the same native traversal: identical to the single-threaded scalar
    engine every step, and every matcher left as found."""
    f = NativeFactory(vocab=2048, pad=64)
    V = f.vocab_size
    ref_t, nat_t = ChainTraverser("scalar"), ChainTraverser("native", threads=threads)
    for step in range(300):
        matchers, roots, draft = f.batch(48, 8, seed=1000 + step)
        before = [_state(m) for m in matchers]
        want = torch.full((48 * 8, _words(V)), 7, dtype=torch.int32)
        got = torch.full_like(want, 7)
        ref_t.traverse(native_jobs(matchers, roots, draft, V), draft, want, V)
        nat_t.traverse(native_jobs(matchers, roots, draft, V), draft, got, V)
        after = [_state(m) for m in matchers]
        assert after == before, f"step {step}: a matcher changed"
        if not torch.equal(want, got):
            rows = sorted({int(i) // 8 for i in (want != got).any(1).nonzero().flatten()})
            pytest.fail(f"step {step} threads {threads}: rows {rows[:8]} differ")
    nat_t.close()


def test_end_is_clipped_in_c_at_the_first_out_of_vocab_token(factory):
    """resolve_jobs(clip_end=False) leaves end at the chain length; the C side must find the same
    cut stock does (out-of-vocab token at every depth)."""
    from .test_traversal_differential import _valid_chain, stock_mask

    V = factory.vocab_size
    t = ChainTraverser("native")
    for depth in range(1, 8):
        g, row, _ = _valid_chain(factory)
        row[depth] = V + 3
        draft = torch.tensor([row], dtype=torch.int64)
        jobs, _ = resolve_jobs([Req("oov", g)], draft, V, clip_end=False)
        assert jobs[0].end == 8
        out = torch.zeros((8, _words(V)), dtype=torch.int32)
        t.traverse(jobs, draft, out, V)
        assert torch.equal(out, stock_mask([Req("oov", g)], draft, V)), f"depth {depth}"


def test_fail_closed_errors_name_the_request(factory):
    from .test_traversal_differential import _valid_chain

    V = factory.vocab_size
    W = _words(V)
    t = ChainTraverser("native")
    g1, row1, _ = _valid_chain(factory, which=0)
    g2, row2, _ = _valid_chain(factory, which=1)
    draft = torch.tensor([row1, row2], dtype=torch.int64)
    out = torch.empty((16, W), dtype=torch.int32)
    before = [matcher_state(g1), matcher_state(g2)]

    # negative draft token after the root (found in C, resolve skipped the scan)
    neg = draft.clone()
    neg[1, 4] = -3
    with pytest.raises(TraversalError, match="request second: negative draft token -3 at chain position 4"):
        t.traverse([Job(0, g1.matcher, 0, 8, "first"), Job(1, g2.matcher, 0, 8, "second")], neg, out, V)
    # one matcher on two rows would be traversed concurrently
    with pytest.raises(TraversalError, match="request twin: .*shared"):
        t.traverse([Job(0, g1.matcher, 0, 8, "one"), Job(1, g1.matcher, 0, 8, "twin")], draft, out, V)
    # two matchers on one row
    with pytest.raises(TraversalError, match="batch row 0 assigned to two matchers"):
        t.traverse([Job(0, g1.matcher, 0, 8, "a"), Job(0, g2.matcher, 0, 8, "b")], draft, out, V)
    # not a GrammarMatcher: a TVM FFI object of another type (the compiled grammar)
    compiled = factory.backend.grammar_compiler.compile_grammar('root ::= "x"')
    impostor = type("Impostor", (), {})()
    impostor._handle = compiled._handle
    impostor.stop_token_ids = []
    with pytest.raises(TraversalError, match="request imp: matcher object has TVM FFI type index .* not "):
        t.traverse([Job(0, g1.matcher, 0, 8, "ok"), Job(1, impostor, 0, 8, "imp")], draft, out, V)
    # xgrammar itself raises (bitmask narrower than the matcher's vocabulary): its message is kept
    narrow = torch.empty((16, W - 3), dtype=torch.int32)
    with pytest.raises(TraversalError, match="request first: GrammarMatcher.traverse_draft_tree raised"):
        t._native.run([Job(0, g1.matcher, 0, 8, "first")], draft, narrow, 2, 8, (W - 3) * 32)
    assert [matcher_state(g1), matcher_state(g2)] == before


def test_bind_failures_are_specific(monkeypatch):
    monkeypatch.setattr(native, "tvm_ffi_library", lambda: "/nonexistent/libtvm_ffi.so")
    with pytest.raises(
        TraversalError,
        match="could not bind to xgrammar: TVM FFI library /nonexistent/libtvm_ffi.so is not loaded in this process",
    ):
        native.NativeTraversal(2)


def test_bad_thread_counts_rejected():
    with pytest.raises(TraversalError, match=r"threads must be in \[1, 64\], got 0"):
        native.NativeTraversal(0)
    with pytest.raises(TraversalError, match=r"threads must be in \[1, 64\], got 65"):
        native.NativeTraversal(65)


@pytest.mark.forked
def test_fork_reopens_in_the_child_and_the_stale_handle_refuses():
    """Worker threads do not survive fork: a ChainTraverser made before the fork re-opens its native
    traversal in the child (same masks); the stale handle itself refuses to run."""
    f = NativeFactory(vocab=2048, pad=64)
    V = f.vocab_size
    matchers, roots, draft = f.batch(16, 8, seed=5)
    t = ChainTraverser("native", threads=2)
    want = torch.empty((128, _words(V)), dtype=torch.int32)
    t.traverse(native_jobs(matchers, roots, draft, V), draft, want, V)
    stale = t._native
    pid = os.fork()
    if pid == 0:  # child: report through the exit code
        code = 0
        try:
            got = torch.empty_like(want)
            t.traverse(native_jobs(matchers, roots, draft, V), draft, got, V)
            code |= 0 if torch.equal(got, want) else 1
            code |= 0 if t._native is not stale else 2
            try:
                stale.run([], draft, got, 16, 8, V)
                code |= 4
            except TraversalError as exc:
                code |= 0 if "used after fork" in str(exc) else 8
        except BaseException:  # noqa: BLE001
            code |= 16
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, f"child failed with bits {os.WEXITSTATUS(status):05b}"
    # the parent's traversal still works
    again = torch.empty_like(want)
    t.traverse(native_jobs(matchers, roots, draft, V), draft, again, V)
    assert torch.equal(again, want)


def test_auto_picks_native_and_prewake_is_harmless():
    t = ChainTraverser("auto")
    assert t.engine == "native" and t.clips_end
    t.prewake()
    t.prewake()  # twice before a step: the workers spin, then sleep again
    f = NativeFactory(vocab=2048, pad=64)
    matchers, roots, draft = f.batch(8, 8, seed=3)
    V = f.vocab_size
    a = torch.empty((64, _words(V)), dtype=torch.int32)
    b = torch.empty_like(a)
    t.traverse(native_jobs(matchers, roots, draft, V), draft, a, V)
    ChainTraverser("scalar").traverse(native_jobs(matchers, roots, draft, V), draft, b, V)
    assert torch.equal(a, b)
    t.close()
    t.close()  # idempotent


def test_module_exports_and_library_path():
    """Every entry point declared in the header is exported by the built module, and the TVM FFI
    library found is the one loaded in this process."""
    header = open(os.path.join(ROOT, "native", "draft_traverse.h")).read()
    for name in ("dsh_trav_open", "dsh_trav_run", "dsh_trav_prewake", "dsh_trav_threads", "dsh_trav_close"):
        assert name in header
        assert hasattr(native.lib, name)
    assert native.unavailable_reason() is None
    path = native.tvm_ffi_library()
    assert os.path.basename(path).startswith("libtvm_ffi.so")
    assert path in open("/proc/self/maps").read()


def test_a_step_wakes_and_waits_only_for_workers_with_jobs():
    """Item 5 of "Fail closed and bounded everywhere": with 8 threads, a step of n jobs takes
    min(7, n - 1) workers (the caller takes a job too); the others are neither woken nor waited for.
    Before the fix every started worker entered every step (7 per step)."""
    t = native.NativeTraversal(8)
    f = NativeFactory(vocab=2048, pad=64)
    V = f.vocab_size
    try:
        seen = set()
        for n_reqs in (1, 2, 3, 4, 16):
            matchers, roots, draft = f.batch(n_reqs, 8, seed=n_reqs)
            per_step = max(0, min(7, len(native_jobs(matchers, roots, draft, V)) - 1))
            seen.add(per_step)
            out = torch.empty((n_reqs * 8, _words(V)), dtype=torch.int32)
            want = torch.empty_like(out)
            ChainTraverser("scalar").traverse(native_jobs(matchers, roots, draft, V), draft, want, V)
            before = t.participations()
            for _ in range(5):
                t.prewake()
                t.run(native_jobs(matchers, roots, draft, V), draft, out, n_reqs, 8, V)
                assert torch.equal(out, want)
            assert t.participations() - before == 5 * per_step, (n_reqs, t.participations() - before)
        assert {0, 7} <= seen and len(seen) >= 3  # idle, partial and full pools were exercised
        assert native.PREWAKE_SPIN_MIN_US <= t.last_spin_us <= native.PREWAKE_SPIN_MAX_US
    finally:
        t.close()


def test_close_racing_a_running_step_waits_for_it():
    """Item 8: close() from another thread while a step runs waits for the step (the native pool is
    not freed under it); the step's masks are complete and a later step fails clearly. The race is
    made to happen, and shown: close() is called only once the step holds the traversal lock, and an
    iteration counts as a race when the step ended after close() began (close waited for it)."""
    import threading
    import time

    f = NativeFactory(vocab=2048, pad=64)
    matchers, roots, draft = f.batch(256, 8, seed=11)
    V = f.vocab_size
    want = torch.empty((256 * 8, _words(V)), dtype=torch.int32)
    ChainTraverser("scalar").traverse(native_jobs(matchers, roots, draft, V), draft, want, V)
    raced = 0
    for _ in range(20):
        t = ChainTraverser("native", threads=4)
        out = torch.empty_like(want)
        errors, marks = [], {}

        def step():
            try:
                t.traverse(native_jobs(matchers, roots, draft, V), draft, out, V)
                marks["end"] = time.perf_counter()
            except TraversalError as exc:
                errors.append(str(exc))

        th = threading.Thread(target=step)
        th.start()
        deadline = time.perf_counter() + 10
        while not t._lock.locked() and th.is_alive() and time.perf_counter() < deadline:
            pass
        close_start = time.perf_counter()
        t.close()
        close_end = time.perf_counter()
        th.join(30)
        assert not th.is_alive()
        if errors:  # close won the race: the step refused to run, naming why
            assert all("closed" in e for e in errors)
        else:
            assert torch.equal(out, want)
            assert marks["end"] <= close_end  # close returned only after the step ended
            raced += int(marks["end"] > close_start)
        with pytest.raises(TraversalError, match="closed"):
            t.traverse(native_jobs(matchers, roots, draft, V), draft, out, V)
    assert raced >= 10, f"close() overlapped a running step in only {raced} of 20 iterations"
