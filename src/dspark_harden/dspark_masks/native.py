"""Python side of the native draft-chain traversal (``dspark_harden._traverse_native``, cffi API mode).

The C module (native/draft_traverse.c) calls xgrammar's own ``GrammarMatcher.traverse_draft_tree``
through the TVM FFI C ABI — the entry point xgrammar's Python binding calls — from a persistent pool
of native threads, with the GIL released (cffi releases it around the call), and applies the
stock-equivalence repair (rejected / terminating nodes, terminated roots) in C. One call per
verify step; see :class:`~.traversal.ChainTraverser` (engine ``native``).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Optional, Sequence

import torch

from .jobs import Job, TraversalError, per_matcher

try:
    from .._traverse_native import ffi, lib
except ImportError as exc:  # pragma: no cover - only without the built extension
    ffi = lib = None
    IMPORT_ERROR: Optional[str] = f"dspark_harden._traverse_native is not built: {exc}"
else:
    IMPORT_ERROR = None

ABI_VERSION = 3
# How long woken workers spin for the step they were woken for. Adaptive: 1.5x the recent gap
# between prewake() and run() (the barrier, job resolution and draft-copy wait between them) plus
# 50 us, within [PREWAKE_SPIN_MIN_US, PREWAKE_SPIN_MAX_US]; the first step uses the maximum.
# (A fixed 3 ms spin took cores from the scheduler and tokenizer on every step.)
PREWAKE_SPIN_MIN_US = 50
PREWAKE_SPIN_MAX_US = 1000


def unavailable_reason() -> Optional[str]:
    if IMPORT_ERROR:
        return IMPORT_ERROR
    if lib.DSH_TRAV_ABI_VERSION != ABI_VERSION:
        return (
            f"dspark_harden._traverse_native ABI {lib.DSH_TRAV_ABI_VERSION} does not match the Python wrapper "
            f"(expects {ABI_VERSION}); rebuild the package"
        )
    return None


def tvm_ffi_library() -> str:
    """Path of the TVM FFI shared library loaded in this process (the instance xgrammar's objects
    and types live in)."""
    import xgrammar  # noqa: F401 - loads libtvm_ffi

    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                fields = line.split()  # address perms offset dev inode [path]
                if len(fields) >= 6 and os.path.basename(fields[5]).startswith("libtvm_ffi.so"):
                    return fields[5]
    except OSError:
        pass
    from tvm_ffi import libinfo

    return libinfo.find_libtvm_ffi()


def _probe_matcher() -> Any:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(["a", "b"], vocab_size=2, stop_token_ids=[1])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar('root ::= "a"'))


def _handle(matcher: Any) -> int:
    return matcher._handle.__chandle__()


class NativeTraversal:
    """A bound native traversal with ``threads`` native threads (the calling thread included)."""

    def __init__(self, threads: int) -> None:
        reason = unavailable_reason()
        if reason:
            raise TraversalError(reason)
        probe = _probe_matcher()
        out = ffi.new("dsh_trav **")
        err = ffi.new("char[]", lib.DSH_TRAV_ERRBUF_MIN)
        rc = lib.dsh_trav_open(
            tvm_ffi_library().encode(), ffi.cast("void *", _handle(probe)), threads, out, err, len(err)
        )
        if rc:
            raise TraversalError(
                f"native traversal could not bind to xgrammar: {ffi.string(err).decode(errors='replace')}"
            )
        self._t = out[0]
        self.threads = threads
        self._pid = os.getpid()
        self._err = err
        self._failed = ffi.new("int32_t *")
        self._cache: dict = {}  # per_matcher cache of _describe
        self._cj = ffi.new("dsh_trav_job[]", 64)  # the job array, reused while large enough
        self._run_lock = threading.Lock()  # guards _cj, _err and _failed through one step
        self._finalizer = weakref.finalize(self, NativeTraversal._close_handle, self._t, self._pid)
        self._gap_ewma_us: Optional[float] = None  # recent prewake -> run gap
        self._prewoke_at: Optional[float] = None
        self._last_jobs = threads  # workers a step needs: from the previous step's job count
        self.last_spin_us = 0

    @staticmethod
    def _close_handle(handle, pid) -> None:
        # worker threads exist only in the opening process; a forked child just drops the handle
        if os.getpid() == pid:
            lib.dsh_trav_close(handle)

    def close(self) -> None:
        self._finalizer()

    def prewake(self, spin_us: Optional[int] = None) -> None:
        """Wake the workers the next step is expected to need (as many as the previous step had jobs,
        minus the calling thread) ahead of :meth:`run`; they spin up to ``spin_us`` for it (default:
        adaptive, see PREWAKE_SPIN_*)."""
        if self.stale():
            return
        if spin_us is None:
            if self._gap_ewma_us is None:
                spin_us = PREWAKE_SPIN_MAX_US
            else:
                spin_us = int(min(PREWAKE_SPIN_MAX_US, max(PREWAKE_SPIN_MIN_US, 1.5 * self._gap_ewma_us + 50)))
        self.last_spin_us = spin_us
        workers = max(0, min(self.threads - 1, self._last_jobs - 1))
        self._prewoke_at = time.perf_counter()
        lib.dsh_trav_prewake(self._t, spin_us, workers)

    def participations(self) -> int:
        """Worker-thread entries into steps so far (see dsh_trav_participations)."""
        return int(lib.dsh_trav_participations(self._t))

    def stale(self) -> bool:
        """True in a forked child of the process that opened this traversal."""
        return os.getpid() != self._pid

    @staticmethod
    def _describe(matcher: Any):
        """(handle as void *, stop ids as int32[] or NULL, their count) of a matcher."""
        stops = list(matcher.stop_token_ids)
        return (ffi.cast("void *", _handle(matcher)), ffi.new("int32_t[]", stops) if stops else ffi.NULL, len(stops))

    def _pack(self, jobs: Sequence[Job]):
        """The step's jobs in the reused C array (every field of entries [0, n) rewritten: the C side
        clips ``end`` in place); per-matcher fields from :func:`~.jobs.per_matcher`'s cache."""
        n = len(jobs)
        if len(self._cj) < n:
            self._cj = ffi.new("dsh_trav_job[]", max(n, 2 * len(self._cj)))
        cj, cache = self._cj, self._cache
        for i, j in enumerate(jobs):
            d = per_matcher(cache, j.matcher, self._describe)
            c = cj[i]
            c.matcher, c.stop, c.n_stop = d
            c.row, c.root, c.end = j.row, j.root, j.end
        return cj

    def run(
        self, jobs: Sequence[Job], draft: torch.Tensor, out: torch.Tensor, bs: int, chain: int, vocab_size: int
    ) -> None:
        """Fill ``out[:bs*chain]``; a job's ``end`` is clipped in C at its first draft token
        ``>= vocab_size`` (so :func:`~.resolve.resolve_jobs` may leave it at ``chain``)."""
        if self.stale():
            raise TraversalError("native traversal used after fork; create a new ChainTraverser in this process")
        if self._prewoke_at is not None:
            gap_us = (time.perf_counter() - self._prewoke_at) * 1e6
            self._gap_ewma_us = gap_us if self._gap_ewma_us is None else 0.8 * self._gap_ewma_us + 0.2 * gap_us
            self._prewoke_at = None
        n = len(jobs)
        self._last_jobs = max(1, n)
        with self._run_lock:
            rc = lib.dsh_trav_run(
                self._t,
                self._pack(jobs) if n else ffi.NULL,
                n,
                ffi.cast("const int64_t *", draft.data_ptr()),
                bs,
                chain,
                vocab_size,
                ffi.cast("int32_t *", out.data_ptr()),
                out.shape[1],
                self._failed,
                self._err,
                len(self._err),
            )
            if rc:
                msg, k = ffi.string(self._err).decode(errors="replace"), self._failed[0]
        if rc:
            who = f"request {jobs[k].rid}" if 0 <= k < n else "native traversal"
            raise TraversalError(f"{who}: {msg}")
