"""The scheduler-side glue of the DSpark result materializer: the three patch builders and the
stock sources they were written against.

* ``Scheduler._copy_result_to_cpu`` (wrap): stock enqueues the D2H copies on ``copy_stream`` right
  behind the forward and records ``copy_done`` (the constraint stock states for DSpark: the accept
  lengths are views of CUDA-graph buffers the next replay rewrites); for a DSpark decode result the
  wrapper then hands the recorded event to this scheduler's materializer, which replaces
  ``copy_done`` with a ``HostCopyDone`` (stock's class, subclassed: bounded, thread-aware wait).
* ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens`` / ``.advance_grammar_fsm`` /
  ``._normalize_decode_outputs`` (replace, DSpark decode results only; every other result runs the
  stock method): the stock bodies, line for line, reading the record's lists instead of calling
  ``.tolist()``. A DSpark decode result without a record, or with another step's, raises naming the
  step (:func:`~dspark_harden.dspark_results.materializer.record_of`).
"""

from __future__ import annotations

import atexit
import functools
import threading
import weakref
from typing import Any, Optional

from .materializer import Materializer, done_class, record_of

COPY_TARGET = "sglang.srt.managers.scheduler:Scheduler._copy_result_to_cpu"
COPY_FINGERPRINT = "aa27a06488d6bac9"
RESOLVE_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor:"
    "SchedulerBatchResultProcessor._resolve_spec_v2_tokens"
)
RESOLVE_FINGERPRINT = "dd103aa7dd424080"
ADVANCE_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor.advance_grammar_fsm"
)
ADVANCE_FINGERPRINT = "30b46f5b13c2b1b6"
NORMALIZE_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor:"
    "SchedulerBatchResultProcessor._normalize_decode_outputs"
)
NORMALIZE_FINGERPRINT = "e8fd0e0079a61484"
# read-only: what the record mirrors (the copies it waits for; the done interface it subclasses)
MIRRORED = {
    "sglang.srt.managers.utils:GenerationBatchResult.copy_to_cpu": "232e775930e32884",
    "sglang.srt.managers.async_d2h_copy_worker:HostCopyDone": "39c2c4e6664312f1",
}

ATTR = "_dspark_harden_materializer"
_CONFIG = {"queue_size": 4, "timeout_s": 60.0, "switch_interval_us": 0}
_LOCK = threading.Lock()
_SWITCH_LOCK = threading.Lock()
_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def configure(queue_size: int, timeout_s: float, switch_interval_us: int = 0) -> None:
    _CONFIG.update(queue_size=int(queue_size), timeout_s=float(timeout_s), switch_interval_us=int(switch_interval_us))


def apply_switch_interval(us: int) -> Optional[float]:
    """Set this process's GIL switch interval to ``us`` µs (0: leave it); returns the previous value in
    seconds when it changed it. Process-wide, so the scheduler process does it once, with its first
    materializer (DSPARK_HARDEN_DSPARK_RESULTS_SWITCH_INTERVAL_US)."""
    import logging
    import sys

    if us <= 0:
        return None
    before = sys.getswitchinterval()
    sys.setswitchinterval(us / 1e6)
    logging.getLogger(__name__).info(
        "dspark-harden: GIL switch interval %.0f µs -> %.0f µs for the DSpark result materializer "
        "(DSPARK_HARDEN_DSPARK_RESULTS_SWITCH_INTERVAL_US; 0 leaves it)",
        before * 1e6,
        sys.getswitchinterval() * 1e6,
    )
    return before


def probe_mirrored_sources(allow: tuple = ()) -> Optional[str]:
    """None when the read-only sources still match (or DSPARK_HARDEN_ALLOW_DRIFT names them / says
    'all'), else what drifted."""
    from ..core.patch import source_drift

    drifted = source_drift(MIRRORED, allow=allow)
    return ("stock sources the DSpark result record mirrors changed: " + "; ".join(drifted)) if drifted else None


def materializes(batch: Any) -> bool:
    """Results the consumers read from a record: DSpark decode (verify) steps, as the result processor
    sees the batch (its forward mode restored to DECODE after the forward)."""
    spec = getattr(batch, "spec_algorithm", None)
    mode = getattr(batch, "forward_mode", None)
    return bool(spec is not None and spec.is_dspark() and mode is not None and mode.is_decode())


def submits(batch: Any, batch_result: Any) -> bool:
    """Results the copy wrapper hands to the materializer: every DSpark result with accept lengths (the
    decode/verify step and an idle rank's empty one; a prefill result has none). Decided from the result,
    not the batch's forward mode: stock copies inside ``Scheduler._forward_isolation``, where DSpark's
    verify has left the batch in TARGET_VERIFY (restored to DECODE only after the copy), and the result
    processor later sees another batch object. A record nobody reads (an idle rank's) costs one empty
    conversion; a DSpark decode result without one fails its consumer (:func:`record_of`)."""
    spec = getattr(batch, "spec_algorithm", None)
    return bool(spec is not None and spec.is_dspark() and getattr(batch_result, "accept_lens", None) is not None)


_DONE_CLS: dict = {}


def _done_cls() -> type:
    cls = _DONE_CLS.get("cls")
    if cls is None:
        from sglang.srt.managers.async_d2h_copy_worker import HostCopyDone

        cls = _DONE_CLS["cls"] = done_class(HostCopyDone)
    return cls


def new_materializer(dp_label: Optional[str] = None) -> Materializer:
    from . import metrics

    label = dp_label if dp_label is not None else metrics.dp_label()
    with _SWITCH_LOCK:  # not _LOCK: materializer_of holds it around this call
        if not _CONFIG.get("switch_interval_applied"):
            _CONFIG["switch_interval_applied"] = True
            apply_switch_interval(_CONFIG["switch_interval_us"])
    mat = Materializer(
        queue_size=_CONFIG["queue_size"],
        timeout_s=_CONFIG["timeout_s"],
        done_cls=_done_cls(),
        observe=metrics.observer(label),
        count=metrics.counter(label),
    )
    _LIVE.add(mat)
    return mat


def materializer_of(scheduler: Any) -> Materializer:
    mat = scheduler.__dict__.get(ATTR)
    if mat is None:
        with _LOCK:
            mat = scheduler.__dict__.get(ATTR)
            if mat is None:
                mat = new_materializer()
                setattr(scheduler, ATTR, mat)
    return mat


@atexit.register
def shutdown_all() -> None:
    """Bounded join of every live materializer (interpreter exit)."""
    for mat in list(_LIVE):
        mat.shutdown()


# -- patch builders --------------------------------------------------------------------------------


def build_copy(stock):
    @functools.wraps(stock)
    def _copy_result_to_cpu(self, batch_result, batch):
        stock(self, batch_result, batch)
        if submits(batch, batch_result):
            # stock recorded copy_done on copy_stream right behind this forward's copies
            materializer_of(self).submit(batch_result, batch_result.copy_done, bool(batch.return_logprob))

    return _copy_result_to_cpu


def build_resolve(stock):
    from sglang.srt.managers.scheduler_components.batch_result_processor import _get_speculative_output_stride

    @functools.wraps(stock)
    def _resolve_spec_v2_tokens(self, result, batch):
        if not materializes(batch):
            return stock(self, result, batch)
        record = record_of(result, "SchedulerBatchResultProcessor._resolve_spec_v2_tokens")

        self.metrics_reporter.snapshot_spec_decode_metrics(batch, result)

        next_token_ids = record.next_token_ids
        accept_lens = record.accept_lens
        stride = _get_speculative_output_stride(result)
        num_non_draft = result.num_non_draft_tokens_per_req
        result.num_correct_drafts_per_req_cpu = [length - num_non_draft for length in accept_lens]
        result.num_correct_drafts = sum(result.num_correct_drafts_per_req_cpu)

        block_accept_lens = record.block_accept_lens
        result.num_block_accept_tokens = sum(block_accept_lens) if block_accept_lens else 0
        cap_lens = record.cap_lens
        result.num_cap_tokens = sum(cap_lens) if cap_lens else 0

        self.model_worker.on_verify_complete_cpu(result.num_correct_drafts_per_req_cpu, batch_size=len(batch.reqs))

        self.advance_grammar_fsm(result, batch)

        predict_tokens = []
        for i, req in enumerate(batch.reqs):
            accept_tokens = next_token_ids[i * stride : i * stride + accept_lens[i]]

            if req.is_retracted or req.finished():
                pass
            else:
                if req.grammar is not None:
                    accept_tokens = result.grammar_retained_tokens[i]

                num_accept_tokens = len(accept_tokens)
                req.kv.kv_committed_len += num_accept_tokens
                req.spec_verify_ct += 1

                num_correct_drafts = result.num_correct_drafts_per_req_cpu[i]
                req.spec_num_correct_drafts += num_correct_drafts
                req.update_spec_correct_drafts_histogram(num_correct_drafts)

                if block_accept_lens is not None:
                    req.spec_num_block_accept_tokens += block_accept_lens[i]
                if cap_lens is not None:
                    req.spec_num_cap_tokens += cap_lens[i]
                    req.update_spec_cap_lens_histogram(cap_lens[i])

            predict_tokens.append(accept_tokens)

        return predict_tokens

    return _resolve_spec_v2_tokens


def build_advance(stock):
    from sglang.srt.managers.scheduler_components.batch_result_processor import _get_speculative_output_stride

    @functools.wraps(stock)
    def advance_grammar_fsm(self, result, batch):
        if result.grammar_advanced or not batch.has_grammar:
            return
        if not materializes(batch):
            return stock(self, result, batch)
        record = record_of(result, "SchedulerBatchResultProcessor.advance_grammar_fsm")
        next_token_ids = record.next_token_ids
        accept_lens = record.accept_lens
        stride = _get_speculative_output_stride(result)
        retained = [None] * len(batch.reqs)
        for i, req in enumerate(batch.reqs):
            if req.grammar is None or req.is_retracted or req.finished():
                continue
            accept_tokens = next_token_ids[i * stride : i * stride + accept_lens[i]]
            retained[i] = self._accept_grammar_tokens(req, accept_tokens)
        result.grammar_retained_tokens = retained
        result.grammar_advanced = True

    return advance_grammar_fsm


def build_normalize(stock):
    @functools.wraps(stock)
    def _normalize_decode_outputs(self, *, batch, result, logits_output, next_token_ids):
        if not (materializes(batch) and batch.return_logprob):
            return stock(self, batch=batch, result=result, logits_output=logits_output, next_token_ids=next_token_ids)
        next_token_ids = self._resolve_spec_v2_tokens(result, batch)
        lists = record_of(result, "SchedulerBatchResultProcessor._normalize_decode_outputs").logprobs
        if lists is None:
            from .materializer import MaterializerError

            raise MaterializerError(
                f"SchedulerBatchResultProcessor._normalize_decode_outputs: DSpark result of step "
                f"{result.copy_done.seq} was materialized without its logprob lists (return_logprob)"
            )
        next_token_logprobs = lists["next_token_logprobs"]
        if logits_output.next_token_top_logprobs_val:
            logits_output.next_token_top_logprobs_val = lists["next_token_top_logprobs_val"]
            logits_output.next_token_top_logprobs_idx = lists["next_token_top_logprobs_idx"]
        if logits_output.next_token_token_ids_logprobs_val:
            logits_output.next_token_token_ids_logprobs_val = lists["next_token_token_ids_logprobs_val"]
        return next_token_ids, next_token_logprobs

    return _normalize_decode_outputs
