"""Grammar-aware DSpark drafting (feature ``dspark-draft-masks``, opt-in ``DSPARK_HARDEN_DSPARK_DRAFT_MASKS=1``).

Stock SGLang 0.5.23 masks only the target's verification of a DSpark block: the Markov draft
(``dspark_draft.draft_markov_block`` -> ``_draft_step`` per position) proposes freely, and on a
constrained request every draft token the grammar forbids is a certain rejection that ends the
accepted run. Here each draft step of a request with a grammar draws only from the tokens its
grammar allows after the tokens drafted before it in the block:

* the mask of draft step ``k`` is exactly stock's verify mask of chain row ``k`` (what
  ``spec_utils.traverse_tree`` fills for ``[anchor, d_0 .. d_{k-1}]``): the request's own grammar
  object, advanced over the block's earlier draft tokens with the same calls (``accept_token`` of
  a token the previous row allows, ``fill_vocab_mask``, stop at ``is_terminated``), rolled back
  when the block ends (in ``finally``), so the committed state the verify traverses is untouched;
* the mask lands on the step's base logits before the Markov step adds its bias and picks a
  token, so the greedy argmax, the sampled token and the kept step logits (``corrected_logits``,
  the draft distribution the sampling accept test reads) are all the masked distribution;
* columns at or past the grammar's vocab size are masked too (stock's verify rejects such a draft
  token without asking the grammar);
* a draft token that ends the grammar (or that no longer follows it) stops masking the row: the
  target rejects whatever follows (``dspark_harden_dspark_draft_blocks_cut_total``);
* rows without a grammar are not touched (a batch mixes both).

Before the draft the upstream grammar barrier runs (``Scheduler._advance_pending_grammar``,
idempotent): under overlap scheduling the previous step's committed tokens may not have reached
the grammar yet, and the draft's first mask must start from them.

Covered: the eager proposal (``sample_draft_block``). The folded proposal samples inside the draft
CUDA graph where no mask lands: with CUDA graphs on and ``SGLANG_DSPARK_FOLDED_PROPOSAL`` on (stock
default) start-up is refused (:func:`server_args_problems`), never drafted unmasked.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import torch

from ..core.metrics import never_raises as metrics_never_raises

logger = logging.getLogger("dspark_harden.dspark_masks")

DRAFT_MODULE = "sglang.srt.speculative.dspark_components.dspark_draft"
WORKER = "sglang.srt.speculative.dspark_components.dspark_worker_v2:DSparkWorkerV2"
FORWARD_TARGET = f"{WORKER}._forward_decode"
BLOCK_TARGET = f"{DRAFT_MODULE}:draft_markov_block"
STEP_TARGET = f"{DRAFT_MODULE}:_draft_step"
FORWARD_FINGERPRINT = "0c21f5a8eb3d63da"
BLOCK_FINGERPRINT = "d333b1be95c605b4"
STEP_FINGERPRINT = "b65e8bb2fab56f4e"

_LOCAL = threading.local()  # .batch: (reqs, vocab_size) of the decode step; .block: the open _Block
_BITS = {}  # device -> the 32 bit positions of an int32 bitmask word


class _Block:
    """One draft block's grammar rows: each row's grammar object, the draft tokens it accepted
    (rolled back at the end), whether it is still masked, and its previous step's mask."""

    def __init__(self, reqs: list, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.rows = [i for i, req in enumerate(reqs) if req.grammar is not None]
        self.grammars = {i: reqs[i].grammar for i in self.rows}
        self.accepted = dict.fromkeys(self.rows, 0)
        self.alive = [i for i in self.rows if not self.grammars[i].is_terminated()]
        self.bitmask: Optional[torch.Tensor] = None
        self.masked = 0  # draft positions drawn under a grammar mask
        self.cut = False  # a row stopped being masked before the block's last step

    def _allowed(self, row: int, tok: int) -> bool:
        if not 0 <= tok < self.vocab_size:
            return False
        word = int(self.bitmask[row, tok // 32])
        return (word >> (tok % 32)) & 1 == 1

    def step(self, step: int, prev_tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Advance the rows over the token drafted at ``step - 1`` and mask ``logits`` ([bs, V],
        this step's base logits, in place) with each live row's grammar mask."""
        if step > 0 and self.alive:
            toks = prev_tokens.view(-1)[self.alive].tolist()
            alive = []
            for row, tok in zip(self.alive, toks):
                if not self._allowed(row, tok):  # stock's traversal stops the chain there too
                    self.cut = True
                    continue
                g = self.grammars[row]
                g.accept_token(int(tok))
                self.accepted[row] += 1
                if g.is_terminated():
                    self.cut = True
                else:
                    alive.append(row)
            self.alive = alive
        if not self.alive:
            return
        g0 = self.grammars[self.alive[0]]
        if self.bitmask is None:
            self.bitmask = g0.allocate_vocab_mask(vocab_size=self.vocab_size, batch_size=logits.shape[0], device="cpu")
        _fill(self.grammars, self.alive, self.bitmask)
        _apply(logits, self.bitmask, self.alive, self.vocab_size)
        self.masked += len(self.alive)

    def rollback(self) -> None:
        for row, n in self.accepted.items():
            if n:
                self.grammars[row].rollback(n)
                self.accepted[row] = 0


_BATCHABLE: list = []  # grammar classes whose fill_vocab_mask is exactly matcher.fill_next_token_bitmask(mask, row)
_BATCH: list = []  # [xgrammar.BatchGrammarMatcher] of this process
_THREADS = [2]


def configure(threads: int) -> None:
    """Threads of the batched mask fill (DSPARK_HARDEN_GRAMMAR_TRAVERSAL_THREADS)."""
    _THREADS[0] = int(threads)
    _BATCH.clear()


def _fill(grammars: dict, rows: list, bitmask: torch.Tensor) -> None:
    """Each row's grammar mask into its bitmask row: the rows whose grammar object is SGLang's
    ``XGrammarGrammar`` in one ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` over a native thread
    pool (the same matcher call each ``fill_vocab_mask`` makes, per row), any other grammar object through
    its own ``fill_vocab_mask``."""
    if not _BATCHABLE:
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

        _BATCHABLE.append(XGrammarGrammar)
    batch = [r for r in rows if type(grammars[r]) in _BATCHABLE]
    if len(batch) > 1:
        if not _BATCH:
            import xgrammar as xgr

            _BATCH.append(xgr.BatchGrammarMatcher(max_threads=_THREADS[0]))
        _BATCH[0].batch_fill_next_token_bitmask([grammars[r].matcher for r in batch], bitmask, indices=batch)
    else:
        batch = []
    done = set(batch)
    for r in rows:
        if r not in done:
            grammars[r].fill_vocab_mask(bitmask, r)


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list, vocab_size: int) -> None:
    """``logits[rows]`` (any strides, any device) to -inf wherever the packed int32 bitmask has a 0 bit,
    and at every column >= ``vocab_size``."""
    device = logits.device
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    idx = torch.tensor(rows, dtype=torch.long)
    words = bitmask[idx].to(device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).view(len(rows), -1).bool()
    width = logits.shape[-1]
    keep = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
    n = min(width, vocab_size, allowed.shape[1])
    keep[:, :n] = allowed[:, :n]
    idx = idx.to(device)
    logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))


# -- the three wraps ---------------------------------------------------------------------------


def wrap_forward_decode(stock):
    def _forward_decode(self, batch, on_publish, grammar_barrier=None, coordination_plan=None):
        _PENDING.flush()
        if batch.forward_mode.is_idle():
            return stock(self, batch, on_publish, grammar_barrier, coordination_plan)
        constrained = [req.grammar is not None for req in batch.reqs]
        if not any(constrained):
            result = stock(self, batch, on_publish, grammar_barrier, coordination_plan)
        else:
            if grammar_barrier is not None:
                grammar_barrier()  # the committed tokens reach the grammars before the draft reads them
            _LOCAL.batch = (batch.reqs, batch.sampling_info.vocab_size)
            try:
                result = stock(self, batch, on_publish, grammar_barrier, coordination_plan)
            finally:
                _LOCAL.batch = None
        _PENDING.add(getattr(result, "accept_lens", None), constrained)
        return result

    return _forward_decode


class _AcceptLengths:
    """Per verify row, the tokens committed (accepted draft + bonus), by request kind: counted at once off
    CUDA; on CUDA copied to the host without a sync (pinned, an event) and counted at a later step of this
    scheduler (idle steps included) once the copy is done."""

    def __init__(self):
        self.queue: list = []

    def add(self, lens: Optional[torch.Tensor], constrained: list) -> None:
        if lens is None or lens.numel() != len(constrained):
            return
        if lens.device.type != "cuda":  # computed synchronously: counted now
            _observe_accept(lens.tolist(), constrained)
            return
        lens = lens.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.queue.append((lens, constrained, event))
        if len(self.queue) > 64:  # never read back (a stalled device): keep the newest only
            del self.queue[:-64]

    def flush(self) -> None:
        while self.queue and self.queue[0][2].query():
            lens, constrained, _ = self.queue.pop(0)
            _observe_accept(lens.tolist(), constrained)


_PENDING = _AcceptLengths()


@metrics_never_raises
def _observe_accept(lens: list, constrained: list) -> None:
    from ..core import metrics

    dp = metrics.process_dp_label()
    for n, c in zip(lens, constrained):
        metrics.child("dspark_harden_dspark_accept_length", dp, "constrained" if c else "free").observe(n)


def wrap_markov_block(stock):
    def draft_markov_block(**kw):
        batch = getattr(_LOCAL, "batch", None)
        if batch is None or getattr(_LOCAL, "block", None) is not None:
            return stock(**kw)
        block = _LOCAL.block = _Block(*batch)
        try:
            return stock(**kw)
        finally:
            _LOCAL.block = None
            block.rollback()
            _count(block)

    return draft_markov_block


def wrap_draft_step(stock):
    def _draft_step(markov_head, prev_tokens, base_logits, **kw):
        block = getattr(_LOCAL, "block", None)
        if block is not None:
            block.step(kw["step"], prev_tokens, base_logits)
        return stock(markov_head, prev_tokens, base_logits, **kw)

    return _draft_step


@metrics_never_raises
def _count(block: _Block) -> None:
    from ..core import metrics

    dp = metrics.process_dp_label()
    metrics.child("dspark_harden_dspark_draft_masked_tokens_total", dp).inc(block.masked)
    if block.cut:
        metrics.child("dspark_harden_dspark_draft_blocks_cut_total", dp).inc()


# -- start-up ----------------------------------------------------------------------------------


def server_args_problems(args: Any, switch: str) -> list[str]:
    """What makes a server one this feature cannot serve exactly (known from its arguments)."""
    from sglang.srt.environ import envs

    out = []
    spec = str(getattr(args, "speculative_algorithm", None) or "").upper()
    if spec != "DSPARK":
        out.append(
            f"it masks DSpark's draft and this server's --speculative-algorithm is {spec or 'unset'}; unset {switch}"
        )
    if getattr(args, "grammar_backend", None) == "none":
        out.append(f"--grammar-backend none serves no grammar to mask the draft with; unset {switch}")
    folded = envs.SGLANG_DSPARK_FOLDED_PROPOSAL.get()  # stock's own reading (an invalid value: its default, on)
    if spec == "DSPARK" and folded and not getattr(args, "disable_cuda_graph", False):
        device = str(getattr(args, "device", None) or "cuda")
        if device.startswith("cuda"):
            out.append(
                "the folded DSpark proposal (SGLANG_DSPARK_FOLDED_PROPOSAL, on by default) samples the draft inside "
                "the draft CUDA graph, where no grammar mask lands; set SGLANG_DSPARK_FOLDED_PROPOSAL=0 (the eager "
                f"proposal, masked) or --disable-cuda-graph, or unset {switch}"
            )
    return out
