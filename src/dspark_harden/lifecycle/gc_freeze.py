"""GC freeze after warm-up, and gen-2 pause measurement through ``gc.callbacks``.

Stock 0.5.23 freezes once after the HTTP server's warm-up request (``http_server._wait_and_warmup`` ->
``_freeze_gc_after_server_warmup`` -> ``POST /freeze_gc`` -> ``gc.freeze()`` in the tokenizer manager, every
scheduler and the detokenizer; PR #34999, probed by ``upstream.py``'s ``stock-gc-freeze-after-warmup``), with
no ``gc.collect()`` first; the offline ``Engine`` path never freezes on its own; graph capture freezes and
then *unfreezes* everything (``base_cuda_graph_runner.freeze_gc``), stock's warm-up freeze included. A
scheduler holds a large, long-lived object graph (model wrappers, radix tree, request pools): unfrozen,
every gen-2 collection walks all of it (400-430 ms measured upstream with 1.1M objects, #30693), and a pause
on one DP rank stalls every rank. What this module adds to stock's freeze: the Engine path, a collection
before the freeze, the re-freeze after a capture, the gen-2 pacer and the pause metrics (docs/lifecycle.md;
``bench gc`` measures it against stock's own freeze).

When warm-up is over — the process is serving (scheduler: its event loop runs, i.e. after model
load and any graph capture; detokenizer: its loop runs; main: the server answered SGLang's
warm-up request) and it processed ``DSPARK_HARDEN_GC_FREEZE_AFTER_BATCHES`` batches — :func:`freeze_now`
runs ``gc.collect()`` then
``gc.freeze()`` once. Never during capture, and re-freezes if a later capture unfroze the heap
(stock's capture context ``freeze_gc`` calls ``gc.unfreeze()`` at its end).

In a scheduler the freeze runs **on the scheduler's own thread**, at the top of an event-loop
iteration (``Scheduler.ingest_requests``, wrapped): graph capture runs only on that thread (inside
model forward or before the loop), so no capture can start between the capture check and the
``gc.collect(); gc.freeze()`` -- checking on one thread and collecting on another would leave that
window open. The watcher thread only decides *when* (warm-up batches, delay, re-freeze) and marks
the freeze due; the loop runs it. In the main process and the detokenizer nothing captures.

After the freeze, :class:`Gen2Pacer` keeps full (gen-2) collections at the pace CPython would keep
without it. CPython 3.11 runs a full collection only when the objects promoted into gen 2 since
the last one exceed a quarter of the objects that survived it; frozen objects do not count as
survivors, so after freezing a 1 M-object heap that rule compares new survivors with the small
unfrozen rest and full collections came ~3x as often (``bench gc``: 42 vs 13 over the same time; with
stock's own freeze, 2.4x as many per serving step),
each walking the live per-request objects. The pacer counts the promotions itself (young objects
minus collected, at each gen-1 collection) and holds ``threshold2`` high until gen 2 really grew by
a quarter of (frozen + surviving) objects: the pre-freeze bound on uncollected garbage.

:class:`PauseRecorder` measures every collection (a ``gc.callbacks`` pair) into a lock-free
buffer (a collection can start while any lock is held, so the callback never takes one); a
daemon thread moves them into the Prometheus families once a second.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

from ..core import metrics

logger = logging.getLogger("dspark_harden.lifecycle")

#: pause buckets (seconds): sub-millisecond young collections to ~1 s gen-2 walks
PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


#: how often the frozen watcher looks for a full collection (then whether the heap was unfrozen)
REFREEZE_CHECK_S = 5.0


def _capturing() -> bool:
    try:
        from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

        return bool(get_is_capture_mode())
    except Exception:  # noqa: BLE001 - no capture machinery loaded: nothing is capturing
        return False


class _GcCallback:
    """Registration in ``gc.callbacks``, at most once (``installed``)."""

    installed = False

    def _register(self) -> None:
        if not self.installed:
            gc.callbacks.append(self)
            self.installed = True

    def _unregister(self) -> bool:
        """False when it was not registered."""
        if not self.installed:
            return False
        try:
            gc.callbacks.remove(self)
        except ValueError:
            pass
        self.installed = False
        return True


class PauseRecorder(_GcCallback):
    """``gc.callbacks`` timing of every collection: (generation, seconds, frozen-at-the-time)."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self._t0 = 0.0
        self.frozen = False
        self.pending: deque = deque(maxlen=maxlen)
        self.installed = False
        self.full_collections = 0  # generation-2 collections seen (the re-freeze check waits for one)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            if info.get("generation") == 2:
                self.full_collections += 1
            self.pending.append(
                (info.get("generation", -1), time.perf_counter() - self._t0, self.frozen, info.get("collected", 0))
            )

    def install(self) -> None:
        self._register()

    def uninstall(self) -> None:
        self._unregister()

    def drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self.pending.popleft())
            except IndexError:
                return out


def summarize(pauses: list, generation: int = 2) -> dict:
    """{"gen2_pauses", "p50_ms", "p99_ms", "max_ms"} over ``pauses`` of ``generation``."""
    ms = sorted(p[1] * 1000.0 for p in pauses if p[0] == generation)
    if not ms:
        return {"gen2_pauses": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}

    def q(f: float) -> float:
        idx = min(len(ms) - 1, max(0, int(round(f * (len(ms) - 1)))))
        return round(ms[idx], 3)

    return {"gen2_pauses": len(ms), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": round(ms[-1], 3)}


class Gen2Pacer(_GcCallback):
    """``gc.callbacks`` entry that keeps CPython's pre-freeze full-collection rule after ``gc.freeze()``.

    CPython 3.11 (``gc_collect_generations``) runs a full collection only when more than ``threshold2``
    gen-1 collections happened since the last one **and** ``long_lived_pending > long_lived_total / 4``:
    the objects promoted into gen 2 (survivors of gen-1 collections) since the last full collection
    against the objects that survived it. Frozen objects are in neither count, so with ``F`` frozen and
    ``L`` unfrozen survivors the rule fires at ``L / 4`` promotions instead of ``(F + L) / 4``: after
    freezing a 1 M-object heap full collections came ~3x as often (``bench gc``: 42 vs 13 over the same
    time). Neither count is readable from Python, so the pacer keeps its own, exactly as CPython does:

    * gen-1 collection: ``pending += young - collected``, where ``young`` is
      ``len(gc.get_objects(0)) + len(gc.get_objects(1))`` when it starts (what it collects; the survivors
      move into gen 2);
    * full collection: ``L = len(gc.get_objects(2))`` at its start ``- collected``; ``pending = 0``.

    Between full collections ``threshold2`` is raised (to ``MAX_FACTOR`` x stock's: a backstop should a
    measurement be lost) so CPython's rule never fires on its own. Once ``pending > (F + L) / 4`` (where
    CPython would have run a full collection before the freeze) the pacer checks what gen 2 really
    gained, ``len(gc.get_objects(2)) - L``: promoted objects that reference counting freed since (the
    requests that finished) are gone from it, so the gain is live growth plus cyclic garbage. Only when
    the gain exceeds ``(F + L) / 4`` is ``threshold2`` set back to stock's, and the next collection
    CPython runs is a full one (its own gate ``pending > L / 4`` holds as well); otherwise ``pending``
    restarts from the gain. So cyclic garbage stays bounded by a quarter of the heap, as before the
    freeze, while a steady working set (requests arriving and finishing) triggers no full collection
    at all, and each full collection walks only the unfrozen objects. The ``get_objects`` calls run
    inside the collections' timed windows (install after :class:`PauseRecorder`), so their cost is in
    the reported pauses: one walk of the young generations per gen-1 collection, one of gen 2 per check
    and per full collection.
    """

    MAX_FACTOR = 1000

    def __init__(self) -> None:
        self.installed = False
        self.frozen = 0
        self.stock = gc.get_threshold()
        self.long_lived = 0
        self.pending = 0
        self.due = False
        self.checks = 0
        self.full_collections = 0
        self._young: Optional[int] = None
        self._walk: Optional[int] = None
        self.last: dict = {}

    def _hold(self) -> None:
        t0, t1, t2 = self.stock
        self.due = False
        gc.set_threshold(t0, t1, t2 * self.MAX_FACTOR)

    def install(self, frozen: int) -> None:
        """Start pacing for ``frozen`` objects in the permanent generation (right after ``gc.freeze()``,
        when gen 2 is empty: nothing unfrozen survived yet)."""
        if not self.installed:
            self.stock = gc.get_threshold()
        self.frozen = int(frozen)
        self.long_lived, self.pending, self._young, self._walk, self.last = 0, 0, None, None, {}
        self.checks = self.full_collections = 0
        self._hold()
        self._register()

    def uninstall(self) -> None:
        """Stop pacing and restore the thresholds found at install."""
        if self._unregister():
            self.due = False
            gc.set_threshold(*self.stock)

    def __call__(self, phase: str, info: dict) -> None:
        gen = info.get("generation", -1)
        if gen == 1:
            if phase == "start":
                self._young = len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))
                return
            young, self._young = self._young, None
            if young is None:  # installed during this collection
                return
            self.pending += max(0, young - int(info.get("collected", 0) or 0))
            quarter = (self.frozen + self.long_lived) / 4.0
            if not self.due and self.pending > quarter:
                # confirm with what gen 2 really gained: promoted objects freed by reference counting since
                # (finished requests) left nothing to collect; only live growth and cyclic garbage remain
                self.checks += 1
                growth = len(gc.get_objects(generation=2)) - self.long_lived
                if growth > quarter:
                    self.due = True
                    gc.set_threshold(*self.stock)  # CPython's next collection is a full one
                else:
                    self.pending = max(0, growth)
            return
        if gen != 2:
            return
        if phase == "start":
            self._walk = len(gc.get_objects(generation=2))
            return
        walk, self._walk = self._walk, None
        if walk is None:
            return
        self.last = {
            "walked": walk,
            "pending": self.pending,
            "due": self.due,
            "survivors": max(0, walk - int(info.get("collected", 0) or 0)),
        }
        self.long_lived = self.last["survivors"]
        self.full_collections += 1
        self.pending = 0
        self._hold()


class GcFreezer:
    """One per process: measure, then freeze once after warm-up."""

    def __init__(self) -> None:
        self.recorder = PauseRecorder()
        self.pacer = Gen2Pacer()
        self.role = "none"
        self.dp_label = "none"
        self.after_batches = 8
        self.enabled = True
        self.frozen_objects = 0
        self.frozen_at: Optional[float] = None
        self._lock = threading.Lock()
        self._flusher: Optional[threading.Thread] = None
        self._watcher: Optional[threading.Thread] = None
        self._precreated = False  # this process's gauge series exist (flush, once metrics are ready)
        self._gauges_dirty = False  # a gauge update waited for metrics to be ready
        self.on_loop_thread = False  # scheduler: the freeze runs on the event-loop thread (run_due)
        self._due: Optional[str] = None  # the reason of a freeze the loop thread has to run

    def configure(self, *, role: str, dp_label: str, after_batches: int) -> None:
        self.role, self.dp_label = role, dp_label
        self.after_batches = after_batches
        self.recorder.install()
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="dspark-gc-metrics", daemon=True)
            self._flusher.start()

    # -- freezing ----------------------------------------------------------------------------
    def freeze_now(self, reason: str) -> int:
        with self._lock:
            if self.frozen_at is not None and gc.get_freeze_count() > 0:
                return self.frozen_objects
            while _capturing():
                time.sleep(0.05)
            t0 = time.perf_counter()
            gc.collect()
            gc.freeze()
            self.frozen_objects = gc.get_freeze_count()
            self.pacer.install(self.frozen_objects)
            self.frozen_at = time.time()
            self.recorder.frozen = True
            dt = time.perf_counter() - t0
        self._set_gauges()
        logger.info(
            "dspark-harden gc-freeze: %s (dp_rank %s) froze %d objects after warm-up (%s) in %.0f ms",
            self.role,
            self.dp_label,
            self.frozen_objects,
            reason,
            dt * 1000,
        )
        return self.frozen_objects

    def watch(
        self,
        progress: Callable[[], int],
        ready: Callable[[], bool] = lambda: True,
        what: str = "batches",
        threshold: Optional[int] = None,
    ) -> None:
        """Freeze from a daemon thread once ``ready()`` and ``progress()`` reached the threshold."""
        if self._watcher is not None:
            return

        need = self.after_batches if threshold is None else threshold

        def run():
            start = None
            while True:
                try:
                    if ready():
                        if start is None:
                            start = progress()
                        if progress() - start >= need:
                            break
                except Exception:  # noqa: BLE001
                    logger.debug("gc-freeze progress probe failed", exc_info=True)
                time.sleep(0.25)
            self._freeze_or_mark_due(f"{need} {what}")
            # a later graph capture unfreezes (stock freeze_gc context): freeze again after it.
            # gc.get_freeze_count() walks every frozen object with the GIL held (CPython 3.11/3.12: a list
            # walk; ~90 ms at 1.1M objects on the 2-core CI host, i.e. ~1.1 CPU-s a minute per process at
            # idle when read every 5 s), so it is read only after a full collection: stock's freeze_gc
            # collects right after its unfreeze, and any other unfreeze leaves a heap CPython collects
            # in full on its own schedule (counted by the installed recorder; without it, every period)
            seen = -1
            while True:
                time.sleep(REFREEZE_CHECK_S)
                full = self.recorder.full_collections if self.recorder.installed else -1
                if full == seen and full >= 0:
                    continue
                seen = full
                if self._due is None and gc.get_freeze_count() == 0 and not _capturing():
                    self.frozen_at = None
                    self.pacer.uninstall()  # CPython's own pace for the unfrozen heap until the re-freeze
                    self._freeze_or_mark_due("re-freeze: the heap was unfrozen (graph capture?)")

        self._watcher = threading.Thread(target=run, name="dspark-gc-freeze", daemon=True)
        self._watcher.start()

    def _freeze_or_mark_due(self, reason: str) -> None:
        if self.on_loop_thread:
            self._due = reason  # the scheduler's next loop iteration runs it (run_due)
        else:
            self.freeze_now(reason)

    def run_due(self) -> None:
        """Scheduler loop thread, between iterations: run a freeze the watcher marked due. Capture
        runs only on this thread, so none can start before the freeze is done; should capture mode
        be on here all the same, the freeze waits for a later iteration (never sleeps here)."""
        reason = self._due
        if reason is None or _capturing():
            return
        self._due = None
        self.freeze_now(reason)

    def count_batch(self) -> None:
        """Inline variant for single-threaded loops (detokenizer): call once per batch."""
        if self.frozen_at is not None:
            return
        self._inline = getattr(self, "_inline", 0) + 1
        if self._inline >= self.after_batches:
            self.freeze_now(f"{self.after_batches} batches served")

    # -- metrics ------------------------------------------------------------------------------
    def _set_gauges(self) -> None:
        if not metrics.ready():  # main process before SGLang chose its Prometheus mode: later
            self._gauges_dirty = True
            return
        self._gauges_dirty = False
        try:
            metrics.child("dspark_harden_gc_frozen_objects", self.role, self.dp_label).set(self.frozen_objects)
            metrics.child("dspark_harden_gc_frozen", self.role, self.dp_label).set(1 if self.frozen_at else 0)
        except Exception:  # noqa: BLE001
            logger.debug("gc metric update failed", exc_info=True)

    def flush(self) -> None:
        # metrics are created only once the process's Prometheus mode is decided (main: after
        # SGLang set PROMETHEUS_MULTIPROC_DIR); until then pauses wait in the recorder
        if not metrics.ready():
            return
        if not self._precreated:
            self._precreated = True
            try:  # this process's series exist (0) before the freeze
                for name in ("dspark_harden_gc_frozen_objects", "dspark_harden_gc_frozen"):
                    metrics.precreate(name, [(self.role, self.dp_label)])
            except Exception:  # noqa: BLE001
                logger.debug("gc metric pre-creation failed", exc_info=True)
        if self._gauges_dirty:  # a freeze before metrics were ready: its gauges are set now
            self._set_gauges()
        pauses = self.recorder.drain()
        if not pauses:
            return
        try:
            for gen, seconds, frozen, _collected in pauses:
                metrics.child(
                    "dspark_harden_gc_pause_seconds", self.role, self.dp_label, str(gen), "1" if frozen else "0"
                ).observe(seconds)
        except Exception:  # noqa: BLE001
            logger.debug("gc metric flush failed", exc_info=True)

    def _flush_loop(self) -> None:
        while True:
            time.sleep(1.0)
            self.flush()


FREEZER = GcFreezer()


def build_scheduler_get_init_info(stock):
    """``Scheduler.get_init_info`` runs once, after model load and graph capture, right before the
    event loop starts: from here on, batches count towards warm-up."""

    def get_init_info(self):
        out = stock(self)
        if FREEZER.enabled:
            FREEZER.on_loop_thread = True  # the freeze itself runs in ingest_requests (this thread)
            FREEZER.watch(lambda: int(getattr(self, "forward_ct", 0)), what="forward batches served")
        return out

    return get_init_info


def build_scheduler_ingest_requests(stock):
    """``Scheduler.ingest_requests`` opens every iteration of every stock event loop (normal,
    overlap, PP, disaggregation, PD-multiplexing): a freeze marked due runs here, on the scheduler
    thread, where no graph capture is in progress. Costs one attribute read per iteration."""

    def ingest_requests(self, *args, **kwargs):
        if FREEZER._due is not None:
            FREEZER.run_due()
        return stock(self, *args, **kwargs)

    return ingest_requests


def build_detokenizer_batch(stock):
    def handle_batch_token_id_out(self, recv_obj):
        out = stock(self, recv_obj)
        FREEZER.count_batch()
        return out

    return handle_batch_token_id_out


def start_main_watch() -> None:
    """Main process: warm-up is over when the server answered its warm-up request (status Up)."""

    def tm():
        from sglang.srt.entrypoints import http_server

        state = getattr(http_server, "_global_state", None)
        return getattr(state, "tokenizer_manager", None) if state is not None else None

    def ready() -> bool:
        t = tm()
        status = getattr(t, "server_status", None)
        return getattr(status, "value", status) == "Up"

    FREEZER.watch(lambda: 0, ready, what="batches after the server answered its warm-up request", threshold=0)
