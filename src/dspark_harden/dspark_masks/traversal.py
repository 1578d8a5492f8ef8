"""Batched native traversal of DSpark's linear draft chains (CPU side, pure torch + xgrammar).

DSpark verifies one linear chain per request: node 0 is the already committed token and node
``i``'s only child is ``i + 1``. Stock SGLang 0.5.23 (``spec_utils.generate_token_bitmask`` ->
``traverse_tree``) walks every chain with a Python DFS that calls ``fill_vocab_mask`` /
``accept_token`` / ``rollback`` one node at a time. Here one call per verify step walks every
active chain natively and yields **exactly** the stock bitmask:

* rows of requests without an active matcher, rows before a matcher's root, the row of a rejected
  node (token outside the parent's mask or ``>= vocab_size``) and every row after it, and the row of
  a node whose token terminated the grammar (and every row after it) are all-ones (``-1``), because
  stock allocates the mask with ``-1`` and never fills those rows;
* every other row is the matcher's ``fill_next_token_bitmask`` after accepting the chain up to
  that node.

xgrammar's native ``traverse_draft_tree`` writes **zero** rows for rejected and terminated nodes
(measured on 0.2.7); the scalar/threads/batch-API engines repair exactly those rows (at most one per
chain) so the result equals stock bit for bit. Matchers are left exactly as found (native traversal
rolls back; the level engine rolls back what it accepted).

Engines (``DSPARK_HARDEN_GRAMMAR_TRAVERSAL``):

``native``   ``GrammarMatcher.traverse_draft_tree`` per chain, called through the TVM FFI C ABI from a
             persistent pool of native threads without the GIL, repair in C (:mod:`.native`).
``scalar``   ``GrammarMatcher.traverse_draft_tree`` per chain, in a plain Python loop.
``threads``  the same, chains split over a persistent Python thread pool (xgrammar 0.2.7's binding
             holds the GIL here, so this is slower than ``scalar``; kept for comparison).
``level``    level-synchronous: per depth one ``BatchGrammarMatcher.batch_fill_next_token_bitmask``
             (native thread pool), a bit test of the next draft token, one ``batch_accept_token``;
             one ``batch_rollback`` at the end.
``batch``    ``BatchGrammarMatcher.batch_traverse_draft_tree`` (not in xgrammar 0.2.7; used only when
             the installed xgrammar has it, after a start-up equivalence probe against ``scalar``).
``auto``     ``batch`` when available, else ``native`` when the native module binds; neither: a
             start-up error naming why (``scalar`` runs only when named; measured, see
             docs/dspark_masks.md).

Nothing here imports SGLang; :mod:`.resolve` turns SGLang grammar objects into :class:`Job` s.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import numpy as np
import torch
import xgrammar as xgr

from .jobs import Job, TraversalError, per_matcher  # noqa: F401 - re-exported
from .settings import ENGINES

logger = logging.getLogger("dspark_harden.dspark_masks")


def batch_traverse_available() -> bool:
    return callable(getattr(xgr.BatchGrammarMatcher, "batch_traverse_draft_tree", None))


def chain_end(tokens: Sequence[int], start: int, vocab_size: int, rid: str) -> int:
    """First index ``>= start`` whose draft token stock rejects unconditionally (``>= vocab_size``),
    else ``len(tokens)``. A negative draft token has no stock meaning (stock would index the mask
    from the end): fail closed."""
    for i in range(start, len(tokens)):
        tok = tokens[i]
        if tok < 0:
            raise TraversalError(f"request {rid}: negative draft token {tok} at chain position {i}")
        if tok >= vocab_size:
            return i
    return len(tokens)


class _ChainLinks:
    """Cached ``retrieve_next_token`` / ``retrieve_next_sibling`` of a linear chain of length n."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        links = self._cache.get(n)
        if links is None:
            nxt = torch.full((n,), -1, dtype=torch.int64)
            if n > 1:
                nxt[:-1] = torch.arange(1, n, dtype=torch.int64)
            sib = torch.full((n,), -1, dtype=torch.int64)
            links = self._cache[n] = (nxt, sib)
        return links


class ChainTraverser:
    """Fills the stock-equivalent DSpark grammar bitmask for a batch of linear chains.

    ``traverse(jobs, draft, out, vocab_size)``: ``draft`` is the (bs, L) int64 CPU draft-token
    tensor (column 0 = committed token), ``out`` a contiguous (>= bs*L, words) int32 CPU tensor;
    rows ``[0, bs*L)`` are overwritten (all-ones where stock leaves them untouched).
    """

    def __init__(self, engine: str = "auto", threads: int = 2) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown traversal engine {engine!r}; expected one of {ENGINES}")
        if threads <= 0:
            raise ValueError(f"traversal threads must be positive, got {threads}")
        if engine == "batch" and not batch_traverse_available():
            raise TraversalError(
                "traversal engine 'batch' needs xgrammar.BatchGrammarMatcher.batch_traverse_draft_tree, "
                "which the installed xgrammar does not have"
            )
        requested = engine
        if engine == "auto":
            reason = auto_unavailable_reason()
            if reason:
                raise TraversalError(reason)
            engine = "batch" if batch_traverse_available() else DEFAULT_ENGINE
        self.requested = requested
        self.engine = engine
        self.threads = threads
        self._links = _ChainLinks()
        self._views: dict = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self._batch: Optional[Any] = None
        self._lock = threading.Lock()
        self._closed = False
        self._native: Optional[Any] = None
        if engine == "native":
            try:
                self._native = self._open_native()
            except TraversalError as exc:
                if requested != "auto":
                    raise
                raise TraversalError(f"{AUTO_REFUSAL}: {exc}. {SCALAR_HINT}") from None
        if engine in ("level", "batch"):
            self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        if engine == "threads" and threads > 1:
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dspark-grammar")
        if engine == "batch":
            probe_batch_engine(self)

    def _open_native(self):
        from .native import NativeTraversal

        return NativeTraversal(self.threads)

    @property
    def clips_end(self) -> bool:
        """True when the engine finds each chain's first out-of-vocab draft token itself (native):
        :func:`~.resolve.resolve_jobs` may then skip that scan."""
        return self.engine == "native"

    def prewake(self) -> None:
        """Called at the start of a verify step's mask build: native workers wake up while the
        caller runs the barrier and resolves jobs (no-op for the other engines)."""
        if self._native is not None:
            self._native.prewake()  # a no-op in a forked child (see NativeTraversal.prewake)

    def close(self) -> None:
        """Idempotent. Takes the traversal lock, so a close racing a running step waits for it to end
        instead of freeing the native pool under it (the C side also serialises close with run)."""
        with self._lock:
            self._closed = True
            if self._native is not None:
                self._native.close()
                self._native = None
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # ------------------------------------------------------------------------------------------
    def traverse(self, jobs: Sequence[Job], draft: torch.Tensor, out: torch.Tensor, vocab_size: int) -> None:
        bs, chain = draft.shape
        _check_buffers(draft, out, bs, chain, vocab_size)
        with self._lock:  # one step at a time per traverser (buffers and native pools are shared)
            if self._closed:
                raise TraversalError("the grammar traversal was closed (scheduler shutting down); no masks are built")
            live = [j for j in jobs if j.end > j.root]
            if self.engine == "native":
                # validation (rows, ranges, shared matchers), all-ones prefill and repair run in C
                if self._native.stale():
                    self._native = self._open_native()  # forked: worker threads stay in the parent
                self._native.run(live, draft, out, bs, chain, vocab_size)
                return
            bits = out[: bs * chain].numpy()
            seen, matchers = set(), set()
            for j in live:
                if j.row in seen:
                    raise TraversalError(f"request {j.rid}: batch row {j.row} assigned to two matchers")
                if id(j.matcher) in matchers:
                    raise TraversalError(f"request {j.rid}: its GrammarMatcher is shared with another batch row")
                seen.add(j.row)
                matchers.add(id(j.matcher))
                if not (0 <= j.row < bs and 0 <= j.root < j.end <= chain):
                    raise TraversalError(
                        f"request {j.rid}: job row={j.row} root={j.root} end={j.end} outside batch {bs}x{chain}"
                    )
            # Every row the traversal does not write must read all-ones, as in stock's fresh -1 mask.
            # numpy, not torch: a torch fill of this size is an OpenMP parallel region, which stalls
            # for milliseconds whenever one of its threads is descheduled on a busy host. The level
            # engine writes only visited rows, so it needs the whole buffer; the native engines
            # write [root, end) up to the first rejected node and the repair fills the rest.
            if self.engine == "level" or not live:
                bits.fill(-1)
            else:
                covered = np.zeros(bs * chain, dtype=bool)
                for j in live:
                    covered[j.row * chain + j.root : j.row * chain + j.end] = True
                bits[~covered] = -1
            if not live:
                return
            if self.engine == "level":
                # stock fills nothing for a matcher terminated at its root; rows of chains the level
                # walk stops early stay -1 from the fill above
                live = [j for j in live if not j.matcher.is_terminated()]
                if live:
                    self._level(live, draft, out, chain)
                return
            if self.engine == "batch":
                self._batch_api(live, draft, out, chain)
            else:
                rows_d, rows_o = self._row_views(draft, out, bs, chain)
                if self.engine == "threads" and self._pool is not None and len(live) > 1:
                    n = min(self.threads, len(live))
                    futures = [self._pool.submit(self._scalar, live[k::n], rows_d, rows_o) for k in range(n)]
                    for f in futures:
                        f.result()
                else:
                    self._scalar(live, rows_d, rows_o)
            _repair_native_rows(live, draft, out, chain)

    def _row_views(self, draft: torch.Tensor, out: torch.Tensor, bs: int, chain: int):
        """Per-row views of the draft and mask buffers, cached per buffer: the pipeline reuses two
        pinned slots, so the views are made once per slot (a cached view keeps its storage alive,
        so a data pointer in the key can never belong to another, newer buffer)."""
        key = (draft.data_ptr(), bs, chain, out.data_ptr(), out.shape[1])
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 8:
                self._views.pop(next(iter(self._views)))
            views = self._views[key] = (draft.unbind(0), out[: bs * chain].view(bs, chain, -1).unbind(0))
        return views

    # ------------------------------------------------------------------------------------------
    def _scalar(self, jobs: Sequence[Job], rows_d: Sequence[torch.Tensor], rows_o: Sequence[torch.Tensor]) -> None:
        """``rows_d[r]`` / ``rows_o[r]``: batch row r's draft tokens and (chain, words) mask rows
        (views made by one ``unbind`` each, cheaper than slicing per job)."""
        for j in jobs:
            nxt, sib = self._links.get(j.end - j.root)
            d, o = rows_d[j.row], rows_o[j.row]
            if j.root or j.end < len(d):
                d, o = d[j.root : j.end], o[j.root : j.end]
            if not j.matcher.traverse_draft_tree(nxt, sib, d, o):
                raise TraversalError(f"request {j.rid}: native draft-tree traversal did not complete")

    def _batch_api(self, jobs: Sequence[Job], draft: torch.Tensor, out: torch.Tensor, chain: int) -> None:
        # Companion-xgrammar API (seed-contracts.md §4.5): 1-D shared chain links, 2-D draft tokens,
        # bitmask rows = batch * nodes, ``indices`` = batch row per matcher, root positions per
        # matcher; rows of unlisted batch entries are set to all-ones. Tokens at or after a job's
        # ``end`` must not be seen by the matcher, so such tokens are replaced by an out-of-vocab id
        # in a scratch copy (the node is then rejected, and repaired like any rejected node).
        nxt, sib = self._links.get(chain)
        tokens = draft
        if any(j.end < chain for j in jobs):
            tokens = draft.clone()
            for j in jobs:
                if j.end < chain:
                    tokens[j.row, j.end :] = np.iinfo(np.int32).max
        results = self._batch.batch_traverse_draft_tree(
            [j.matcher for j in jobs],
            nxt,
            sib,
            tokens,
            out[: draft.shape[0] * chain],
            indices=[j.row for j in jobs],
            root_positions=[j.root for j in jobs],
        )
        for j, ok in zip(jobs, results):
            if not ok:
                raise TraversalError(f"request {j.rid}: native batch draft-tree traversal did not complete")
        # Stock never fills rows before a root or from a stock-rejected token on: whatever the
        # batch API wrote there (contract: nothing before the root, a zero row at the rejected
        # placeholder), reset them to all-ones.
        for j in jobs:
            base = j.row * chain
            if j.root:
                out[base : base + j.root].numpy().fill(-1)
            if j.end < chain:
                out[base + j.end : base + chain].numpy().fill(-1)

    def _level(self, jobs: Sequence[Job], draft: torch.Tensor, out: torch.Tensor, chain: int) -> None:
        """Level-synchronous walk: stock semantics by construction (no repair needed)."""
        bits = out.numpy()
        toks = draft.numpy()
        pos = [j.root for j in jobs]
        accepted = [0] * len(jobs)
        active = list(range(len(jobs)))
        batch = self._batch
        try:
            while active:
                batch.batch_fill_next_token_bitmask(
                    [jobs[k].matcher for k in active], out, [jobs[k].row * chain + pos[k] for k in active]
                )
                step_k, step_tok = [], []
                for k in active:
                    j = jobs[k]
                    node = pos[k] + 1
                    if node >= j.end:
                        continue
                    tok = int(toks[j.row, node])
                    if (int(bits[j.row * chain + pos[k], tok >> 5]) >> (tok & 31)) & 1:
                        step_k.append(k)
                        step_tok.append(tok)
                if not step_k:
                    break
                ok = batch.batch_accept_token([jobs[k].matcher for k in step_k], step_tok)
                active = []
                refused = None
                for k, tok, good in zip(step_k, step_tok, ok):
                    if not good:
                        refused = refused or (jobs[k], tok)
                        continue
                    accepted[k] += 1
                    pos[k] += 1
                    if not jobs[k].matcher.is_terminated():
                        active.append(k)
                if refused is not None:
                    raise TraversalError(
                        f"request {refused[0].rid}: matcher refused draft token {refused[1]} that its own "
                        f"mask allows (incomplete traversal)"
                    )
        finally:
            rolled = [(jobs[k].matcher, accepted[k]) for k in range(len(jobs)) if accepted[k]]
            if rolled:
                xgr.BatchGrammarMatcher.batch_rollback([m for m, _ in rolled], [n for _, n in rolled])


def _check_buffers(draft: torch.Tensor, out: torch.Tensor, bs: int, chain: int, vocab_size: int) -> None:
    if draft.device.type != "cpu" or draft.dtype != torch.int64 or not draft.is_contiguous() or draft.dim() != 2:
        raise TraversalError(
            f"draft tokens must be a contiguous 2-D int64 CPU tensor, got {tuple(draft.shape)} {draft.dtype} {draft.device}"
        )
    words = (vocab_size + 31) // 32
    if (
        out.device.type != "cpu"
        or out.dtype != torch.int32
        or not out.is_contiguous()
        or out.dim() != 2
        or out.shape[1] != words
        or out.shape[0] < bs * chain
    ):
        raise TraversalError(
            f"bitmask must be a contiguous int32 CPU tensor of at least ({bs * chain}, {words}) rows for "
            f"vocab {vocab_size}, got {tuple(out.shape)} {out.dtype} {out.device}"
        )


def _repair_native_rows(jobs: Sequence[Job], draft: torch.Tensor, out: torch.Tensor, chain: int) -> None:
    """Native traversal zeroes the row of a rejected or terminating node, and the root row of a
    matcher that was already terminated, and leaves the rows after it untouched (stale: the buffer
    is reused); stock leaves all of them all-ones. This resets rows [first such node, end).

    Node i (root < i < end) is accepted iff its token's bit is set in row i-1 (as filled by the
    native call) and every earlier node was accepted; the first rejected node, or the first accepted
    node whose token is one of the matcher's stop tokens (xgrammar terminates exactly on accepting
    a stop token), is the cut. A matcher terminated before the step leaves an all-zero root row and
    rejects its first child: then the cut is the root (a non-terminated all-zero root row is a
    genuine fill and stays).
    """
    bits = out.numpy()
    toks = draft.tolist()
    for j in jobs:
        base = j.row * chain
        row = toks[j.row]
        root, end = j.root, j.end
        cut = None
        stop = None
        for i in range(root + 1, end):
            tok = row[i]
            if not (int(bits[base + i - 1, tok >> 5]) >> (tok & 31)) & 1:
                cut = i
                break
            if stop is None:
                stop = stop_tokens(j.matcher)
            if tok in stop:
                cut = i
                break
        if (cut == root + 1 or end == root + 1) and not bits[base + root].any() and j.matcher.is_terminated():
            cut = root
        if cut is not None:
            bits[base + cut : base + end] = -1


_STOPS: dict = {}  # see per_matcher


def stop_tokens(matcher: Any) -> frozenset:
    """A matcher's stop token ids (fixed at construction)."""
    return per_matcher(_STOPS, matcher, lambda m: frozenset(m.stop_token_ids))


def probe_batch_engine(traverser: ChainTraverser) -> None:
    """Before trusting ``batch_traverse_draft_tree`` (absent from stock xgrammar), check that it
    matches the scalar engine bit for bit on a small grammar with accepted, rejected and
    terminating chains. Raises :class:`TraversalError` on any difference."""
    vocab = ["a", "b", "{", "}", '"', ":", " ", "1", "2", "<eos>"]
    info = xgr.TokenizerInfo(vocab, vocab_size=len(vocab), stop_token_ids=[9])
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "{" ("a" | "b")* "}"')
    chains = [[0, 2, 0, 1, 3, 9, 0, 0], [0, 2, 7, 0, 0, 0, 0, 0], [0, 2, 3, 9, 1, 0, 0, 0], [0, 0, 0, 2, 0, 3, 9, 9]]
    draft = torch.tensor(chains, dtype=torch.int64)
    bs, chain = draft.shape
    mk = lambda: [xgr.GrammarMatcher(compiled) for _ in range(bs)]  # noqa: E731
    jobs_a = [Job(r, m, 0 if r < 3 else 2, chain, f"probe{r}") for r, m in enumerate(mk())]
    jobs_b = [Job(r, m, 0 if r < 3 else 2, chain, f"probe{r}") for r, m in enumerate(mk())]
    want = torch.empty((bs * chain, 1), dtype=torch.int32)
    got = torch.empty_like(want)
    ref = ChainTraverser("scalar")
    ref.traverse(jobs_a, draft, want, len(vocab))
    traverser._batch_api([j for j in jobs_b], draft, got.fill_(-1), chain)
    _repair_native_rows(jobs_b, draft, got, chain)
    if not torch.equal(want, got):
        raise TraversalError(
            "xgrammar.BatchGrammarMatcher.batch_traverse_draft_tree does not reproduce the scalar traversal "
            "on the start-up probe; refusing to use it (set DSPARK_HARDEN_GRAMMAR_TRAVERSAL=scalar)"
        )


def native_unavailable_reason():
    from .native import unavailable_reason

    return unavailable_reason()


AUTO_REFUSAL = (
    "DSPARK_HARDEN_GRAMMAR_TRAVERSAL=auto: neither xgrammar's batched "
    "BatchGrammarMatcher.batch_traverse_draft_tree nor the native engine is available"
)
SCALAR_HINT = (
    "The Python 'scalar' engine (several times slower per verify step) runs only when named: set "
    "DSPARK_HARDEN_GRAMMAR_TRAVERSAL=scalar to accept it, or unset DSPARK_HARDEN_DSPARK_MASKS for stock"
)


def auto_unavailable_reason():
    """Why engine ``auto`` cannot pick a fast engine here (``None`` when it can). ``auto`` never
    falls back to ``scalar``: a silent slower path is what the fail-closed rule forbids."""
    if batch_traverse_available():
        return None
    reason = native_unavailable_reason()
    if reason is None:
        return None
    return (
        f"{AUTO_REFUSAL} (the batch API is not in xgrammar {getattr(xgr, '__version__', '?')}; native: "
        f"{reason}). {SCALAR_HINT}"
    )


# The engine `auto` picks when the batch API is absent: chosen by measurement (docs/dspark_masks.md).
DEFAULT_ENGINE = "native"
