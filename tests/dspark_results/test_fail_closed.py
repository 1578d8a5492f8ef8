"""Fault injection on the materializer (real stock ``HostCopyDone`` subclass): a conversion that
raises, a copy event that never completes, a thread that dies, a full queue, shutdown. Every consumer
call runs on a helper thread joined with a bound, so a regression shows as a failure, never a hang."""

from __future__ import annotations

import threading
import time
import types

import pytest
from sglang.srt.managers.async_d2h_copy_worker import HostCopyDone

from dspark_harden.dspark_results import integration as I
from dspark_harden.dspark_results.materializer import RECORD_ATTR, Materializer, MaterializerError, record_of


class Event:
    """A copy event stand-in: ``synchronize`` blocks until released (never, unless told)."""

    def __init__(self, ready=True):
        self.ready = threading.Event()
        if ready:
            self.ready.set()

    def synchronize(self):
        self.ready.wait()


def result():
    import torch

    return types.SimpleNamespace(
        next_token_ids=torch.tensor([1, 2, 3, 4]),
        accept_lens=torch.tensor([2, 1]),
        block_accept_lens=None,
        cap_lens=torch.tensor([1, 0]),
        logits_output=None,
        copy_done=None,
    )


def within(fn, bound=5.0):
    """Run ``fn`` on a thread; (elapsed seconds, exception or None); fails if it is still running after
    ``bound`` (a hang)."""
    out = {}

    def run():
        try:
            fn()
            out["exc"] = None
        except BaseException as exc:  # noqa: BLE001
            out["exc"] = exc

    t0 = time.perf_counter()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"hung for more than {bound} s"
    return time.perf_counter() - t0, out["exc"]


def materializer(**kw):
    counts = []
    kw.setdefault("timeout_s", 5.0)
    mat = Materializer(queue_size=kw.pop("queue_size", 4), done_cls=I._done_cls(), count=counts.append, **kw)
    return mat, counts


def test_done_is_stock_host_copy_done_and_record_arrives():
    mat, counts = materializer()
    res = result()
    done = mat.submit(res, Event(), return_logprob=False)
    assert isinstance(done, HostCopyDone) and res.copy_done is done
    elapsed, exc = within(lambda: record_of(res, "test"))
    assert exc is None
    rec = getattr(res, RECORD_ATTR)
    assert (rec.seq, rec.next_token_ids, rec.accept_lens, rec.block_accept_lens, rec.cap_lens) == (
        1,
        [1, 2, 3, 4],
        [2, 1],
        None,
        [1, 0],
    )
    assert done.query() and counts == ["materialized"]
    assert mat.shutdown(2.0)


def test_materializer_exception_reraises_from_synchronize_naming_the_step():
    def boom(res, seq, lp):
        raise ValueError("injected conversion failure")

    mat, counts = materializer(convert=boom)
    res = result()
    mat.submit(res, Event(), False)
    elapsed, exc = within(res.copy_done.synchronize)
    assert isinstance(exc, MaterializerError) and isinstance(exc.__cause__, ValueError), exc
    assert "step 1: the materializer failed: ValueError: injected conversion failure" in str(exc)
    _, exc = within(lambda: record_of(res, "consumer"))  # every later consumer fails the same way
    assert isinstance(exc, MaterializerError)
    assert counts == ["failed"]
    # the thread survives an ordinary exception: the next step is materialized
    mat._convert = __import__("dspark_harden.dspark_results.materializer", fromlist=["x"]).convert_result
    res2 = result()
    mat.submit(res2, Event(), False)
    assert within(lambda: record_of(res2, "consumer"))[1] is None
    assert mat.shutdown(2.0)


def test_copy_event_that_never_completes_raises_after_the_timeout():
    mat, counts = materializer(timeout_s=0.3)
    res = result()
    stuck = Event(ready=False)
    mat.submit(res, stuck, False)
    elapsed, exc = within(res.copy_done.synchronize)
    assert isinstance(exc, MaterializerError) and "step 1: no record after 0.3 s" in str(exc), exc
    assert 0.25 < elapsed < 2.0
    assert counts == ["timed_out"]
    stopped = []
    elapsed, exc = within(lambda: stopped.append(mat.shutdown(0.2)), bound=3.0)
    assert exc is None and stopped == [False]  # bounded join: the stuck thread is left (daemon), no hang
    assert elapsed < 1.0
    stuck.ready.set()


def test_dead_thread_is_detected_at_once_not_after_the_timeout():
    def die(res, seq, lp):
        raise SystemExit("injected thread death")

    mat, counts = materializer(timeout_s=30.0, convert=die)
    first, second = result(), result()
    mat.submit(first, Event(), False)
    mat.submit(second, Event(), False)
    _, exc = within(first.copy_done.synchronize)
    assert isinstance(exc, MaterializerError) and "SystemExit" in str(exc), exc
    elapsed, exc = within(second.copy_done.synchronize)
    assert isinstance(exc, MaterializerError), exc
    assert "step 2: the materializer thread died before materializing it" in str(exc)
    assert elapsed < 2.0  # not the 30 s timeout
    with pytest.raises(MaterializerError, match="step 3: the materializer thread is not running"):
        mat.submit(result(), Event(), False)
    assert "thread_dead" in counts


def test_full_queue_blocks_boundedly_then_raises():
    mat, counts = materializer(timeout_s=0.3, queue_size=1)
    stuck = Event(ready=False)
    mat.submit(result(), stuck, False)  # taken by the thread, which blocks on it
    time.sleep(0.1)
    mat.submit(result(), Event(), False)  # fills the queue
    elapsed, exc = within(lambda: mat.submit(result(), Event(), False))
    assert isinstance(exc, MaterializerError) and "step 3: the materializer queue stayed full" in str(exc), exc
    stuck.ready.set()
    assert mat.shutdown(2.0)


def test_shutdown_joins_and_refuses_later_steps():
    mat, _ = materializer()
    res = result()
    mat.submit(res, Event(), False)
    assert within(lambda: record_of(res, "c"))[1] is None
    t0 = time.perf_counter()
    assert mat.shutdown(2.0) is True and not mat.alive()
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(MaterializerError, match="shut down"):
        mat.submit(result(), Event(), False)


def test_in_flight_steps_keep_their_own_records():
    """Overlap: step N+1 is submitted before step N is consumed; each result gets its own record."""
    mat, _ = materializer()
    results = [result() for _ in range(3)]
    for i, r in enumerate(results):
        r.next_token_ids = r.next_token_ids + 10 * i
        mat.submit(r, Event(), False)
    for i, r in enumerate(results):
        rec = record_of(r, "c")
        assert rec.seq == i + 1 and rec.next_token_ids == [1 + 10 * i, 2 + 10 * i, 3 + 10 * i, 4 + 10 * i]
    assert mat.shutdown(2.0)


class QueryEvent(Event):
    """A copy event that also answers ``query()`` (complete once released), like a CUDA event."""

    def query(self):
        return self.ready.is_set()


def test_copy_event_that_raises_reraises_naming_the_step():
    class Broken(Event):
        def synchronize(self):
            raise RuntimeError("CUDA error: injected copy failure")

    mat, counts = materializer()
    res = result()
    mat.submit(res, Broken(), False)
    _, exc = within(res.copy_done.synchronize)
    assert isinstance(
        exc, MaterializerError
    ) and "step 1: the materializer failed: RuntimeError: CUDA error: injected" in str(exc)
    assert counts == ["failed"]
    assert mat.shutdown(2.0)


def test_consumer_converts_a_complete_step_the_thread_has_not_reached_and_nothing_converts_twice():
    """The thread is stuck on step 1's copy; step 2's copy is complete: its consumer converts it on the
    spot (the thread would need the GIL the scheduler holds) instead of waiting. When step 1 completes,
    the thread converts it and skips step 2 (claimed): two steps, two conversions, both records right."""
    from dspark_harden.dspark_results.materializer import convert_result

    conversions = []

    def counting(res, seq, lp):
        conversions.append(seq)
        return convert_result(res, seq, lp)

    mat, counts = materializer(convert=counting)
    first, second = result(), result()
    gate = QueryEvent(ready=False)
    mat.submit(first, gate, False)
    mat.submit(second, QueryEvent(), False)
    _, exc = within(lambda: record_of(second, "consumer"))
    assert exc is None and getattr(second, RECORD_ATTR).seq == 2
    assert conversions == [2] and counts == ["converted_by_consumer"]
    gate.ready.set()
    # no consumer asks for step 1 until the thread is done with it (else the consumer may take it: the
    # thread's conversion is what this step is about)
    deadline = time.monotonic() + 5.0
    while not first.copy_done.query() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert first.copy_done.query(), "the thread did not convert step 1 within 5 s of its copy completing"
    _, exc = within(lambda: record_of(first, "consumer"))
    assert exc is None and getattr(first, RECORD_ATTR).seq == 1
    third = result()  # the thread took step 2 off the queue, skipped it, and still runs
    mat.submit(third, Event(), False)
    assert within(lambda: record_of(third, "consumer"))[1] is None
    assert mat.shutdown(2.0)
    assert sorted(conversions) == [1, 2, 3] and sorted(counts) == [
        "converted_by_consumer",
        "materialized",
        "materialized",
    ]


def test_consumer_waits_while_the_thread_converts_a_step_it_took():
    """The thread has claimed step 1 and is converting it (slowly); the consumer arrives with the copy
    complete: it waits for the thread's record instead of converting a second time."""
    from dspark_harden.dspark_results.materializer import convert_result

    conversions, started, gate = [], threading.Event(), threading.Event()

    def slow(res, seq, lp):
        conversions.append(seq)
        started.set()
        gate.wait(5.0)
        return convert_result(res, seq, lp)

    mat, counts = materializer(convert=slow)
    res = result()
    mat.submit(res, QueryEvent(), False)
    assert started.wait(5.0)
    threading.Timer(0.3, gate.set).start()
    elapsed, exc = within(lambda: record_of(res, "consumer"))
    assert exc is None and conversions == [1] and counts == ["materialized"], (conversions, counts)
    assert mat.shutdown(2.0)
