"""The scheduler's GC freeze cannot overlap a graph capture that starts right after the check (issue 21 item 9c).

A scheduler-shaped loop runs on its own thread with the real lifecycle wraps of ``get_init_info``
(starts the freezer) and ``ingest_requests`` (opens each iteration); the stand-in is only the
scheduler object (``forward_ct`` and the loop body). Its "lazy capture" is stock's own capture
sequence: ``base_cuda_graph_runner.freeze_gc`` around ``capture_mode.model_capture_mode``, on the
loop thread, as in a real runner.

The worst case is forced deterministically: the freezer's capture check is wrapped so that each
time it answers "not capturing", a capture is requested from the loop -- and a check made on any
other thread waits until that capture has started. Every ``gc.collect()``/``gc.freeze()`` the
freezer makes is recorded with stock's ``get_is_capture_mode()`` at that moment: none may happen
in capture mode. Collecting on the watcher thread (the old code) fails this; freezing on the loop
thread passes by construction, then re-freezes after the capture unfroze the heap.
"""

from __future__ import annotations

import threading
import time

import pytest


@pytest.mark.forked
def test_freeze_never_collects_inside_a_capture_that_starts_after_the_check(monkeypatch):
    import gc

    from sglang.srt.model_executor.runner.base_cuda_graph_runner import freeze_gc
    from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode, model_capture_mode

    from dspark_harden.lifecycle import gc_freeze as G

    real_capturing = G._capturing
    capture_wanted = threading.Event()
    capturing_now = threading.Event()
    captures = []  # start of each capture
    capture_ends = []
    # (what, thread name, capture mode on, time, frozen objects after it) for every collect/freeze the freezer makes
    calls = []
    loop_name = "scheduler-loop"

    def capturing():
        v = real_capturing()
        if not v and len(captures) < 2:
            capture_wanted.set()  # a capture wants to start right after this check
            if threading.current_thread().name != loop_name:
                capturing_now.wait(3.0)  # ... and, on another thread, it does start before the collect
        return v

    class GcProbe:  # the freezer's view of the gc module: records each call's capture state
        def __getattr__(self, name):
            return getattr(gc, name)

        def collect(self, *a):
            calls.append(("collect", threading.current_thread().name, get_is_capture_mode(), time.monotonic(), None))
            return gc.collect(*a)

        def freeze(self):
            on, t0 = get_is_capture_mode(), time.monotonic()
            out = gc.freeze()
            calls.append(("freeze", threading.current_thread().name, on, t0, gc.get_freeze_count()))
            return out

    monkeypatch.setattr(G, "_capturing", capturing)
    monkeypatch.setattr(G, "gc", GcProbe())
    G.FREEZER.after_batches = 2
    G.FREEZER.recorder.install()
    junk = [[{} for _ in range(5)] for _ in range(50000)]  # a heap worth a measurable collect

    class SchedulerStandIn:
        forward_ct = 0
        get_init_info = G.build_scheduler_get_init_info(lambda self: {"status": "ready"})
        ingest_requests = G.build_scheduler_ingest_requests(lambda self: [])

    sched = SchedulerStandIn()
    stop = threading.Event()

    def refrozen():
        """The freezer's first freeze after the first capture ended (froze, a capture unfroze, froze again)."""
        ends = list(capture_ends)
        return next((c for c in list(calls) if c[0] == "freeze" and ends and c[3] > ends[0]), None)

    def loop():
        sched.get_init_info()
        while not stop.is_set():
            sched.ingest_requests()
            if capture_wanted.is_set():  # a lazy capture, stock's sequence, on this thread
                capture_wanted.clear()
                with freeze_gc(False):
                    with model_capture_mode():
                        captures.append(time.monotonic())
                        capturing_now.set()
                        time.sleep(0.3)
                capture_ends.append(time.monotonic())
                capturing_now.clear()
            sched.forward_ct += 1
            time.sleep(0.02)

    t = threading.Thread(target=loop, name=loop_name, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        # the first freeze, then a capture (which unfreezes: stock freeze_gc), then the re-freeze: waited on
        # as recorded events, not as the heap's state when the loop is stopped (a later capture may have
        # unfrozen it again by then: failed so beside two busy loops)
        while time.monotonic() < deadline and not refrozen():
            time.sleep(0.1)
    finally:
        stop.set()
        t.join(5)
    inside = [c for c in calls if c[2]]
    assert not inside, f"the freezer collected/froze during a graph capture: {inside} (all: {calls})"
    freezes = [c for c in calls if c[0] == "freeze"]
    again = refrozen()
    assert len(freezes) >= 2 and freezes[0][3] < captures[0] and again, (calls, captures, capture_ends)
    assert G.FREEZER.frozen_objects > 200000 and again[4] > 200000, (G.FREEZER.frozen_objects, again)
    assert {c[1] for c in calls} == {loop_name}, calls  # every collect/freeze on the loop thread
    del junk
    gc.unfreeze()


@pytest.mark.forked
def test_the_frozen_watcher_walks_the_frozen_heap_only_after_a_full_collection(monkeypatch):
    """``gc.get_freeze_count()`` is a walk over every frozen object with the GIL held (CPython 3.11: ~90 ms at
    1.1M objects on the 2-core CI host; a DP2 test server's three freezing processes spent ~1.1 CPU-s a minute
    each on it at idle, per-thread CPU with py-spy's thread names). After its freeze the watcher reads it only
    when a full collection happened since its last look -- stock's ``freeze_gc`` collects right after its
    unfreeze --, so an idle frozen process never walks its heap, and an unfreeze in stock's order is still
    re-frozen. Mutation: the full-collection gate removed -> walks while idle -> red."""
    import gc

    from sglang.srt.model_executor.runner.base_cuda_graph_runner import freeze_gc

    from dspark_harden.lifecycle import gc_freeze as G

    walks = []

    class GcProbe:  # the freezer's view of the gc module: counts the walks
        def __getattr__(self, name):
            return getattr(gc, name)

        def get_freeze_count(self):
            walks.append(time.monotonic())
            return gc.get_freeze_count()

    monkeypatch.setattr(G, "gc", GcProbe())
    monkeypatch.setattr(G, "REFREEZE_CHECK_S", 0.02)
    G.FREEZER.recorder.install()
    junk = [[{} for _ in range(5)] for _ in range(50000)]  # a heap worth freezing
    served = [0]

    def wait_for(cond, what):
        deadline = time.monotonic() + 30
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    gc.disable()  # no automatic collection from here: only the explicit ones (the freeze's, stock's below)
    try:
        G.FREEZER.watch(lambda: served[0], threshold=1)  # not on a loop thread: the watcher freezes itself
        served[0] = 1
        wait_for(lambda: G.FREEZER.frozen_at is not None and gc.get_freeze_count() > 0, "the first freeze")
        # walks: the freeze's own read of the count, then the watcher's first look (after the freeze's collection)
        wait_for(lambda: len(walks) >= 2, "the watcher's first look after the freeze")
        idle_from = time.monotonic()
        time.sleep(0.5)  # ~25 periods with no full collection
        idle_walks = [w for w in walks if w > idle_from]
        assert idle_walks == [], f"{len(idle_walks)} walks of the frozen heap while idle"
        first_freeze = G.FREEZER.frozen_at
        with freeze_gc(False):  # stock's capture sequence: collect, freeze, ..., unfreeze, collect
            pass
        wait_for(lambda: G.FREEZER.frozen_at not in (None, first_freeze), "the re-freeze after stock's unfreeze")
        assert gc.get_freeze_count() > 200000
    finally:
        gc.enable()
        del junk
        gc.unfreeze()
