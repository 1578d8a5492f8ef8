"""Wiring into stock SGLang 0.5.23's DSpark worker (DSpark only; EAGLE / NGRAM / DFlash keep stock).

``DSparkWorkerV2._forward_decode`` (sglang-0.5.23-surfaces.md row 3a) does, when the batch has a
grammar::

    grammar_tree = GrammarTree.from_linear_chain(verify_ids_2d)   # before the target verify launch
    ...launch target verify...
    grammar_mask = build_grammar_vocab_mask(reqs=..., tree=grammar_tree, sampling_info=...,
                                            device=logits.device, barrier=grammar_barrier)
    if grammar_mask is not None:
        grammar_mask.apply(logits_output.next_token_logits)

``spec_utils.build_grammar_vocab_mask`` and ``GrammarTree`` are shared with EAGLE, NGRAM and
DFlash, which import them into their own modules. We re-point only the two names **inside the
DSpark worker module** (``propagate=False``), so the other algorithms keep the stock objects:

* ``dspark_worker_v2.GrammarTree`` -> :class:`DSparkGrammarTree` (a ``GrammarTree`` subclass whose
  ``from_linear_chain`` begins a pipeline step: D2H of the chain into a pinned slot on the copy
  stream);
* ``dspark_worker_v2.build_grammar_vocab_mask`` -> :func:`build_grammar_vocab_mask`: calls the
  upstream barrier first (``Scheduler._advance_pending_grammar`` -> ``advance_grammar_fsm``, the
  single FSM-advance authority, which also drops the suffix after a terminating token: we do not
  re-implement either), then one native traversal over every active chain into the slot, uploads
  it on the copy stream and returns a mask whose ``apply`` makes the compute stream wait on
  ``mask_ready`` (done in ``finish``), masks the logits with the stock kernel and records
  ``mask_consumed``.

The result equals stock bit for bit (tests/dspark_masks); the objects whose source that
equivalence depends on are pinned by fingerprint (:data:`SEMANTIC_PINS`) and checked at bind time.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Any, Optional

import torch

from ..core import metrics
from ..core.patch import PatchError, fingerprint_source
from .pipeline import MaskPipeline, PipelineError, Ticket
from .resolve import resolve_jobs
from .traversal import ChainTraverser

logger = logging.getLogger("dspark_harden.dspark_masks")

DSPARK_MODULE = "sglang.srt.speculative.dspark_components.dspark_worker_v2"
TREE_TARGET = f"{DSPARK_MODULE}:GrammarTree"
BUILD_TARGET = f"{DSPARK_MODULE}:build_grammar_vocab_mask"
# fingerprints of the stock objects the two patches replace (inside the DSpark module only)
TREE_FINGERPRINT = "0ec23bc615d0c455"  # spec_utils.GrammarTree
BUILD_FINGERPRINT = "daf0729f28eb1d0e"  # spec_utils.build_grammar_vocab_mask

# Stock sources our stock-equivalence (and call protocol) relies on; a drift fails the bind.
SEMANTIC_PINS = {
    "sglang.srt.speculative.spec_utils:traverse_tree": "ade4b1cee6a7b22b",
    "sglang.srt.speculative.spec_utils:generate_token_bitmask": "1ba2d02e64d5e4be",
    "sglang.srt.constrained.xgrammar_backend:XGrammarGrammar": "bbfb81afa55b294d",
    "sglang.srt.constrained.xgrammar_backend:_allocate_token_bitmask": "13e33bd5819e63c9",
    "sglang.srt.constrained.reasoner_grammar_backend:ReasonerGrammarObject": "1c0088a5ae7b97d4",
    "sglang.srt.utils.token_sequence_matcher:TokenSequenceMatcher": "a1f5ceda51b4fac9",
    "sglang.srt.constrained.base_grammar_backend:GrammarMask": "db3885dcf9029517",
    f"{DSPARK_MODULE}:DSparkWorkerV2._forward_decode": "0c21f5a8eb3d63da",
}


def _resolve(target: str) -> Any:
    module, _, qual = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def check_semantic_pins(allow_drift: tuple = ()) -> list[str]:
    """Targets whose stock source no longer matches; raises PatchError unless drift is allowed."""
    drifted = []
    for target, want in SEMANTIC_PINS.items():
        try:
            found = fingerprint_source(_resolve(target))
        except Exception as exc:  # noqa: BLE001
            raise PatchError(
                f"{target}: cannot check the source our DSpark mask equivalence relies on: {exc}"
            ) from None
        if found != want:
            if "all" in allow_drift or target in allow_drift:
                logger.warning(
                    "dspark-harden: %s drifted (expected %s, found %s); allowed by operator", target, want, found
                )
                drifted.append(target)
                continue
            raise PatchError(
                f"{target}: stock source drifted (expected fingerprint {want}, found {found}); the native DSpark "
                f"grammar traversal was proven equal to this exact source"
            )
    return drifted


# ---------------------------------------------------------------------------------------------
# per-process runtime


class DSparkMaskRuntime:
    """One per scheduler process: the traversal engine and the GPU (or CPU) mask pipeline."""

    def __init__(self, engine: str = "auto", threads: int = 2, device_type: Optional[str] = None) -> None:
        self.traverser = ChainTraverser(engine, threads=threads)
        self.pipeline: Optional[MaskPipeline] = None
        # the server's device type, checked at start-up (pipeline_device_problem); the first step's
        # verify ids must be on it
        self.device_type = device_type
        self._lock = threading.Lock()
        self.last_phases: dict = {}
        self.last_active = 0
        self.outcomes = {"masked": 0, "thinking_only": 0}

    def begin(self, verify_ids_2d: torch.Tensor) -> Ticket:
        pipe = self.pipeline
        if pipe is None:
            if self.device_type is not None and verify_ids_2d.device.type != self.device_type:
                raise PipelineError(
                    f"DSpark verify ids are on {verify_ids_2d.device}, but start-up checked the mask pipeline "
                    f"for the server's device {self.device_type!r}"
                )
            pipe = self.pipeline = MaskPipeline(verify_ids_2d.device, capacity=_pow2(verify_ids_2d.shape[0]))
        return pipe.begin(verify_ids_2d)

    def build(self, *, reqs, ticket: Ticket, sampling_info, device, barrier) -> Optional["PipelinedGrammarMask"]:
        t0 = time.perf_counter()
        self.traverser.prewake()
        if barrier is not None:
            barrier()  # upstream FSM advance of the previous result (single authority)
        t1 = time.perf_counter()
        pipe = self.pipeline
        if pipe is None:
            raise PipelineError("DSpark grammar mask requested without a begun step (GrammarTree patch not used?)")
        if torch.device(device) != pipe.device and not (
            torch.device(device).type == pipe.device.type == "cuda"
            and torch.device(device).index in (None, pipe.device.index)
        ):
            pipe.abandon(ticket)
            raise PipelineError(f"logits are on {device}, the draft chain was on {pipe.device}")
        if len(reqs) != ticket.bs:
            pipe.abandon(ticket)
            raise PipelineError(f"{len(reqs)} requests for a verify batch of {ticket.bs} rows")
        grammar = None
        for req in reqs:
            if req.grammar is not None:
                grammar = req.grammar
        if grammar is None:
            pipe.abandon(ticket)
            raise PipelineError(
                "DSpark batch flagged has_grammar but no request carries a grammar object "
                f"(rids {[getattr(r, 'rid', '?') for r in reqs][:8]})"
            )
        vocab_size = sampling_info.vocab_size
        info = {}

        def fill(draft: torch.Tensor, mask: torch.Tensor) -> bool:
            r0 = time.perf_counter()
            jobs, _ = resolve_jobs(reqs, draft, vocab_size, clip_end=not self.traverser.clips_end)
            r1 = time.perf_counter()
            info["resolution"] = r1 - r0
            info["active"] = len(jobs)
            if not jobs:
                return False
            self.traverser.traverse(jobs, draft, mask, vocab_size)
            return True

        mask = pipe.finish(ticket, fill, vocab_size)
        phases = dict(pipe.timings.values)
        phases["traversal"] = phases.get("traversal", 0.0) - info.get("resolution", 0.0)
        phases["resolution"] = info.get("resolution", 0.0)
        phases["barrier"] = t1 - t0
        # stock clears the extend stage's leftover mask whenever any request has a grammar
        sampling_info.grammar_mask = None
        outcome = "masked" if mask is not None else "thinking_only"
        phases["total"] = time.perf_counter() - t0
        self.last_phases, self.last_active = phases, info.get("active", 0)
        self.outcomes[outcome] += 1
        _observe(phases, self.last_active, outcome)
        if mask is None:
            return None
        return PipelinedGrammarMask(grammar, mask, pipe, ticket)

    def close(self) -> None:
        self.traverser.close()
        if self.pipeline is not None:
            self.pipeline.close()


class PipelinedGrammarMask:
    """What ``build_grammar_vocab_mask`` returns on the DSpark path (the worker only calls
    ``apply``): masks the logits with the grammar backend's stock kernel on the compute stream
    (which already waits on ``mask_ready``), then records ``mask_consumed``."""

    __slots__ = ("grammar", "vocab_mask", "_pipe", "_ticket")

    def __init__(self, grammar, vocab_mask: torch.Tensor, pipe: MaskPipeline, ticket: Ticket) -> None:
        self.grammar = grammar
        self.vocab_mask = vocab_mask
        self._pipe = pipe
        self._ticket = ticket

    def apply(self, logits: torch.Tensor) -> None:
        try:
            self.grammar.apply_vocab_mask(logits=logits, vocab_mask=self.vocab_mask)
        finally:
            self._pipe.consumed(self._ticket)


def _pow2(n: int) -> int:
    cap = 8
    while cap < n:
        cap *= 2
    return cap


_RUNTIME: Optional[DSparkMaskRuntime] = None
_CONFIG = {"engine": "auto", "threads": 2}


def configure(engine: str, threads: int) -> None:
    _CONFIG.update(engine=engine, threads=threads)


def runtime(device_type: Optional[str] = None) -> DSparkMaskRuntime:
    """This process's runtime, created on first use (at scheduler start-up by the feature, with the
    server's device type; raises :class:`~.jobs.TraversalError` when the engine cannot open)."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = DSparkMaskRuntime(_CONFIG["engine"], _CONFIG["threads"], device_type=device_type)
    elif device_type is not None and _RUNTIME.device_type is None:
        _RUNTIME.device_type = device_type
    return _RUNTIME


def pipeline_device_problem(device_type: str) -> Optional[str]:
    """What the mask pipeline cannot do on the server's device (``None`` when it can). On CUDA it
    needs pinned host memory, a copy stream and events: torch must see a CUDA device. On the CPU it
    runs its synchronous protocol. Other devices have no implementation (fail closed)."""
    if device_type == "cpu":
        return None
    if device_type != "cuda":
        return (
            f"the DSpark mask pipeline runs on CUDA (pinned slots, copy stream, events) or on the CPU "
            f"(synchronous); the server's device is {device_type!r}"
        )
    if not torch.cuda.is_available():
        return (
            "the server's device is cuda but torch sees no CUDA device: the DSpark mask pipeline needs "
            "pinned host memory, a CUDA copy stream and CUDA events"
        )
    missing = [name for name in ("Stream", "Event") if not callable(getattr(torch.cuda, name, None))]
    if missing:
        return f"torch.cuda lacks {', '.join(missing)}, which the DSpark mask pipeline needs"
    return None


def pipeline_description(device_type: str) -> str:
    if device_type == "cuda":
        return "cuda (pinned double-buffered slots, copy stream, events)"
    return f"{device_type} (synchronous protocol)"


def reset_runtime() -> None:
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.close()
    _RUNTIME = None


# ---------------------------------------------------------------------------------------------
# patch builders


def build_tree_class(stock_tree: type) -> type:
    class DSparkGrammarTree(stock_tree):
        """``GrammarTree`` as seen by the DSpark worker only: ``from_linear_chain`` begins a mask
        pipeline step (D2H of the chain into a pinned slot on the copy stream)."""

        def __init__(self, ticket: Ticket, rt: DSparkMaskRuntime) -> None:
            super().__init__((), None)
            self.ticket = ticket
            self.runtime = rt

        @classmethod
        def from_linear_chain(cls, verify_ids_2d: torch.Tensor):
            rt = runtime()
            return cls(rt.begin(verify_ids_2d), rt)

        @classmethod
        def from_device(cls, *args, **kwargs):
            raise PipelineError("the DSpark worker builds only linear-chain grammar trees (from_linear_chain)")

        @classmethod
        def from_host(cls, *args, **kwargs):
            raise PipelineError("the DSpark worker builds only linear-chain grammar trees (from_linear_chain)")

        def resolve(self):
            raise PipelineError("DSpark grammar trees are consumed by dspark-harden's build_grammar_vocab_mask only")

    DSparkGrammarTree.__qualname__ = "DSparkGrammarTree"
    DSparkGrammarTree.__module__ = __name__
    return DSparkGrammarTree


def build_vocab_mask_function(stock_build, tree_class_ref: dict):
    def build_grammar_vocab_mask(*, reqs, tree, sampling_info, device, barrier):
        """dspark-harden: DSpark-only replacement of ``spec_utils.build_grammar_vocab_mask``."""
        ticket = getattr(tree, "ticket", None)
        rt = getattr(tree, "runtime", None)
        if not isinstance(ticket, Ticket) or rt is None:
            raise PipelineError(
                f"DSpark grammar mask got a {type(tree).__name__} tree: the GrammarTree patch of "
                f"{DSPARK_MODULE} is not live (fail closed)"
            )
        return rt.build(reqs=reqs, ticket=ticket, sampling_info=sampling_info, device=device, barrier=barrier)

    build_grammar_vocab_mask.stock = stock_build
    return build_grammar_vocab_mask


# ---------------------------------------------------------------------------------------------
# metrics

PHASE_LABELS = ("barrier", "buffer_wait", "draft_copy_wait", "resolution", "traversal", "mask_upload", "total")
OUTCOMES = ("masked", "thinking_only")


def _dp_label() -> str:
    from ..core import roles

    ctx = roles.CONTEXT
    return ctx.dp_label if ctx is not None else "none"


_CHILDREN: dict = {}


def _observe(phases: dict, active: int, outcome: str) -> None:
    try:
        dp = _dp_label()
        kids = _CHILDREN.get(dp)
        if kids is None:
            hist = metrics.get("dspark_harden_dspark_mask_phase_seconds")
            steps = metrics.get("dspark_harden_dspark_mask_steps_total")
            kids = _CHILDREN[dp] = (
                {p: hist.labels(dp, p) for p in PHASE_LABELS},
                metrics.get("dspark_harden_dspark_mask_active_matchers").labels(dp),
                {o: steps.labels(dp, o) for o in OUTCOMES},
            )
        hists, gauge, counters = kids
        for phase, value in phases.items():
            h = hists.get(phase)
            if h is not None:
                h.observe(max(0.0, value))
        gauge.set(active)
        counters[outcome].inc()
    except Exception:  # noqa: BLE001 - metrics must never break a decode step
        logger.debug("dspark mask metrics failed", exc_info=True)
