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
    captures = []
    calls = []  # (what, thread name, capture mode on) for every collect/freeze the freezer makes
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
            calls.append(("collect", threading.current_thread().name, get_is_capture_mode()))
            return gc.collect(*a)

        def freeze(self):
            calls.append(("freeze", threading.current_thread().name, get_is_capture_mode()))
            return gc.freeze()

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
                capturing_now.clear()
            sched.forward_ct += 1
            time.sleep(0.02)

    t = threading.Thread(target=loop, name=loop_name, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        # the first freeze, then a capture (which unfreezes: stock freeze_gc), then the re-freeze
        while time.monotonic() < deadline and not (
            captures and gc.get_freeze_count() > 0 and len([c for c in calls if c[0] == "freeze"]) >= 2
        ):
            time.sleep(0.1)
    finally:
        stop.set()
        t.join(5)
    inside = [c for c in calls if c[2]]
    assert not inside, f"the freezer collected/froze during a graph capture: {inside} (all: {calls})"
    freezes = [c for c in calls if c[0] == "freeze"]
    assert len(freezes) >= 2 and captures, (calls, captures)  # froze, a capture unfroze, froze again
    assert G.FREEZER.frozen_objects > 200000 and gc.get_freeze_count() > 0
    assert {c[1] for c in calls} == {loop_name}, calls  # every collect/freeze on the loop thread
    del junk
    gc.unfreeze()
