"""The materializer: one bounded background thread per scheduler that waits on a DSpark decode
result's copy event and converts its host tensors to the lists the result processor reads.

Torch is the only dependency (no SGLang import): the GPU test and the bench use this module on a
machine without SGLang. The scheduler-side glue (which results, which stock methods read the
record) is :mod:`dspark_harden.dspark_results.integration`.

Protocol, per DSpark decode step (``submit`` runs on the scheduler thread, right after stock
``Scheduler._copy_result_to_cpu`` enqueued the D2H copies behind the forward and recorded
``copy_done`` on the copy stream):

1. ``submit`` numbers the step (``seq``), stores the number on the result (:data:`SEQ_ATTR`),
   replaces ``result.copy_done`` with a done object of stock's ``HostCopyDone`` interface (the
   recorded CUDA event goes to the thread), and enqueues the step (bounded queue);
2. the thread waits on the event (phase ``copy_wait``), converts the lists (phase ``convert``),
   attaches a :class:`ResultRecord` carrying ``seq`` (:data:`RECORD_ATTR`) and only then sets done;
   an exception sets done *with* the error;
3. a consumer calls :func:`record_of`: ``copy_done.synchronize()`` (phase ``consumer_wait``: bounded
   by the timeout, raises at once when the thread is dead, re-raises the materializer's exception),
   then checks that the record exists and belongs to this step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

logger = logging.getLogger("dspark_harden.dspark_results")

SEQ_ATTR = "_dspark_harden_result_seq"
RECORD_ATTR = "_dspark_harden_result_record"
PHASES = ("queue", "copy_wait", "convert", "consumer_wait")
OUTCOMES = (
    "materialized",
    "converted_by_consumer",
    "failed",
    "timed_out",
    "thread_dead",
    "missing_record",
    "wrong_step",
)
_POLL_S = 0.05


class MaterializerError(RuntimeError):
    """A DSpark result could not be materialized or its record is not this step's; names the step."""


@dataclass
class ResultRecord:
    """Host lists of one DSpark decode result (what stock's consumers ``.tolist()``)."""

    seq: int
    next_token_ids: list
    accept_lens: list
    block_accept_lens: Optional[list]
    cap_lens: Optional[list]
    # under return_logprob: next_token_logprobs and the three converted top/token-ids lists
    # (None where stock converts nothing)
    logprobs: Optional[dict] = None
    timings: dict = field(default_factory=dict)


def convert_result(result: Any, seq: int, return_logprob: bool) -> ResultRecord:
    """The conversions stock runs on the scheduler thread (``_resolve_spec_v2_tokens``,
    ``advance_grammar_fsm``, ``_normalize_decode_outputs``), with the same conditions."""
    if result.accept_lens is None:
        raise MaterializerError(f"DSpark decode result of step {seq} has no accept_lens")
    logprobs = None
    if return_logprob:
        lo = result.logits_output
        logprobs = {
            "next_token_logprobs": lo.next_token_logprobs.tolist(),
            "next_token_top_logprobs_val": None,
            "next_token_top_logprobs_idx": None,
            "next_token_token_ids_logprobs_val": None,
        }
        if lo.next_token_top_logprobs_val:
            logprobs["next_token_top_logprobs_val"] = [v.tolist() for v in lo.next_token_top_logprobs_val]
            logprobs["next_token_top_logprobs_idx"] = [x.tolist() for x in lo.next_token_top_logprobs_idx]
        if lo.next_token_token_ids_logprobs_val:
            logprobs["next_token_token_ids_logprobs_val"] = [v.tolist() for v in lo.next_token_token_ids_logprobs_val]
    return ResultRecord(
        seq=seq,
        next_token_ids=result.next_token_ids.tolist(),
        accept_lens=result.accept_lens.tolist(),
        block_accept_lens=result.block_accept_lens.tolist() if result.block_accept_lens is not None else None,
        cap_lens=result.cap_lens.tolist() if result.cap_lens is not None else None,
        logprobs=logprobs,
    )


class PlainDone:
    """Stock ``HostCopyDone``'s interface without SGLang (bench / GPU test); the feature uses a
    subclass of stock's class itself (:func:`done_class`)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_done(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()


def done_class(base: type) -> type:
    """A ``copy_done`` class derived from ``base`` (stock ``HostCopyDone``) whose ``synchronize`` is
    bounded and thread-aware and names the step."""

    class MaterializedCopyDone(base):
        def __init__(self, materializer: "Materializer", seq: int) -> None:
            base.__init__(self)
            self.materializer = materializer
            self.seq = seq
            self.waited = False
            # whoever takes it converts this step: the thread, or the consumer when the copy is
            # complete and the thread has not started (the thread needs the GIL the scheduler holds)
            self.claim = threading.Lock()
            self.item: Any = None  # (result, event, return_logprob) until converted

        def synchronize(self) -> None:
            self.materializer.wait(self)

    MaterializedCopyDone.__qualname__ = f"MaterializedCopyDone[{base.__name__}]"
    return MaterializedCopyDone


_PlainMaterializedDone = done_class(PlainDone)


def _noop(*_: Any) -> None:
    pass


class Materializer:
    """One background thread and one bounded queue per scheduler.

    ``observe(phase, seconds)`` and ``count(outcome)`` report metrics (no-ops by default);
    ``convert`` is :func:`convert_result` (tests inject faults through it)."""

    def __init__(
        self,
        *,
        queue_size: int = 4,
        timeout_s: float = 60.0,
        done_cls: Optional[type] = None,
        observe: Callable[[str, float], None] = _noop,
        count: Callable[[str], None] = _noop,
        convert: Callable[[Any, int, bool], ResultRecord] = convert_result,
        name: str = "dspark-harden-result-materializer",
    ) -> None:
        if queue_size < 1 or not timeout_s > 0:
            raise ValueError("queue_size must be >= 1 and timeout_s > 0")
        self.timeout_s = float(timeout_s)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._done_cls = done_cls or _PlainMaterializedDone
        self._observe, self._count, self._convert = observe, count, convert
        self.seq = 0  # last step submitted (scheduler thread only)
        self.completed = 0  # last step the thread finished (for messages)
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- scheduler thread -------------------------------------------------------------------
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, result: Any, event: Any, return_logprob: bool) -> Any:
        """Hand one result whose copy ``event`` is already recorded to the thread; returns the
        ``copy_done`` now on the result."""
        seq = self.seq + 1
        if self.closed or not self._thread.is_alive():
            self._count("thread_dead")
            raise MaterializerError(
                f"DSpark result of step {seq}: the materializer thread is not running "
                f"({'shut down' if self.closed else 'it died'}; last step completed: {self.completed})"
            )
        self.seq = seq
        done = self._done_cls(self, seq)
        setattr(result, SEQ_ATTR, seq)
        result.copy_done = done
        done.item = (result, event, return_logprob)
        try:
            self._queue.put((result, event, done, time.perf_counter(), return_logprob), timeout=self.timeout_s)
        except queue.Full:
            self._count("timed_out")
            raise MaterializerError(
                f"DSpark result of step {seq}: the materializer queue stayed full for {self.timeout_s:g} s "
                f"(last step completed: {self.completed})"
            ) from None
        return done

    def _fail(self, done: Any, exc: BaseException, what: str) -> None:
        """A claimed step failed: count it, log it, and set done with the error (synchronize re-raises)."""
        self._count("failed")
        logger.error("dspark-harden: DSpark result of step %d: %s: %s: %s", done.seq, what, type(exc).__name__, exc)
        done.item = None
        done.set_done(error=exc)
        self.completed = max(self.completed, done.seq)

    def _convert_claimed(self, done: Any, by_consumer: bool) -> None:
        """Convert one claimed step (the caller holds ``done.claim``); sets done, with the error on failure."""
        result, event, return_logprob = done.item
        t1 = time.perf_counter()
        try:
            record = self._convert(result, done.seq, return_logprob)
            t2 = time.perf_counter()
            record.timings = {"convert": t2 - t1}
            setattr(result, RECORD_ATTR, record)
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the consumer
            self._fail(done, exc, "materializer failed")
            if not isinstance(exc, Exception):
                raise
            return
        self._observe("convert", t2 - t1)
        self._count("converted_by_consumer" if by_consumer else "materialized")
        done.item = None
        self.completed = max(self.completed, done.seq)
        done.set_done()

    def wait(self, done: Any) -> None:
        """``copy_done.synchronize()`` of a materialized result: bounded, thread-aware, re-raises.
        When the copy is complete but the thread has not started converting (it waits for the GIL
        this thread holds), the consumer converts the step itself instead of handing the GIL over."""
        start = time.perf_counter()
        deadline = start + self.timeout_s
        if not done._done.is_set():
            item = done.item
            query = getattr(item[1], "query", None) if item is not None else None
            if query is not None and query() and done.claim.acquire(blocking=False):
                if done.item is not None:
                    self._convert_claimed(done, by_consumer=True)
                else:
                    done.claim.release()
        while not done._done.wait(_POLL_S):
            if done._done.is_set():
                break
            if not self._thread.is_alive():
                self._count("thread_dead")
                raise MaterializerError(
                    f"DSpark result of step {done.seq}: the materializer thread died before materializing it "
                    f"(last step completed: {self.completed})"
                )
            if time.perf_counter() > deadline:
                self._count("timed_out")
                raise MaterializerError(
                    f"DSpark result of step {done.seq}: no record after {self.timeout_s:g} s (the copy event "
                    f"or the conversion never completed; last step completed: {self.completed})"
                )
        if not done.waited:
            done.waited = True
            self._observe("consumer_wait", time.perf_counter() - start)
        if done.error is not None:
            raise MaterializerError(
                f"DSpark result of step {done.seq}: the materializer failed: {type(done.error).__name__}: {done.error}"
            ) from done.error

    def shutdown(self, timeout_s: Optional[float] = None) -> bool:
        """Stop the thread (bounded join); True when it stopped."""
        self.closed = True
        if not self._thread.is_alive():
            return True
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.perf_counter() + bound
        try:
            self._queue.put(None, timeout=bound)
        except queue.Full:
            pass  # the thread is stuck on the queue's head: the join below is bounded anyway
        self._thread.join(max(0.0, deadline - time.perf_counter()))
        stopped = not self._thread.is_alive()
        if not stopped:
            logger.error(
                "dspark-harden: the DSpark result materializer thread did not stop within %.3g s "
                "(step %d pending); leaving it (daemon)",
                bound,
                self.seq,
            )
        return stopped

    # -- background thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            result, event, done, submitted, return_logprob = item
            t0 = time.perf_counter()
            self._observe("queue", t0 - submitted)
            try:
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - every failure reaches the consumer
                if done.claim.acquire(blocking=False):
                    self._fail(done, exc, "copy wait failed")
                if not isinstance(exc, Exception):
                    raise
                continue
            self._observe("copy_wait", time.perf_counter() - t0)
            if not done.claim.acquire(blocking=False):
                continue  # the consumer took this step
            self._convert_claimed(done, by_consumer=False)


def record_of(result: Any, where: str) -> ResultRecord:
    """The record of a materialized DSpark decode result (waits for it); raises a
    :class:`MaterializerError` naming the step when it is missing or belongs to another step."""
    seq = getattr(result, SEQ_ATTR, None)
    done = getattr(result, "copy_done", None)
    mat = getattr(done, "materializer", None)
    if seq is None or mat is None:
        last = f"; last step submitted: {mat.seq}" if mat is not None else ""
        raise MaterializerError(
            f"{where}: a DSpark decode result reached the consumer without a materializer step (it did not pass "
            f"through the wrapped Scheduler._copy_result_to_cpu{last})"
        )
    done.synchronize()
    record = getattr(result, RECORD_ATTR, None)
    if record is None:
        mat._count("missing_record")
        raise MaterializerError(f"{where}: DSpark result of step {seq} has no materializer record")
    if record.seq != seq or done.seq != seq:
        mat._count("wrong_step")
        raise MaterializerError(
            f"{where}: DSpark result of step {seq} carries the record of step {record.seq} "
            f"(copy_done of step {done.seq})"
        )
    return record
