"""Persistence that cannot endanger the serving process.

A scheduler compiles a missed grammar in its own compile pool and serves it at once. Publishing
it to the disk cache happens later and elsewhere:

* :class:`Persister` (one thread per cache) keeps a *bounded* queue of publication jobs. A job is
  the grammar's cache key (kind + text), never the compiled grammar, so a queued job pins no
  ``CompiledGrammar`` and no lock file descriptor. A full queue skips the publication (counted).
* :class:`Helper` runs each job in a separate helper process (:mod:`.persist_worker`) that
  compiles the key again itself, serializes, trial-loads and publishes, under an address-space
  limit and a deadline. A grammar whose serialization would exceed the limit, the deadline or
  the entry cap becomes a compile-locally marker with the measured reason; the serving process
  never holds a serialized grammar, so its memory is the LRU's plus the compiles it serves.
* :class:`CompileSlots` makes the helper's compile count against the same bound as the request
  compiles (``DSPARK_HARDEN_GRAMMAR_WORKERS``): a helper job starts only while a slot is free and
  is paused (SIGSTOP) while every slot serves requests, resumed (SIGCONT) when one frees.
  Requests never wait for persistence; the deadline counts only the helper's running time.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from . import disk
from . import metrics as gm

logger = logging.getLogger("dspark_harden.grammar")


@dataclass(frozen=True)
class PersistSettings:
    queue_max: int = 64
    memory_limit_bytes: int = 2 << 30
    deadline_s: float = 120.0
    idle_exit_s: float = 30.0
    start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        for name in ("queue_max", "memory_limit_bytes"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("deadline_s", "idle_exit_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


class CompileSlots:
    """At most ``limit`` compiles run at once: request compiles plus the persistence helper's job."""

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError(f"compile slot limit must be positive, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)
        self.active = 0  # request compiles running now
        self._helper_pid: Optional[int] = None
        self._stopped_at: Optional[float] = None
        self.stopped_s = 0.0  # helper time spent paused during the current job
        self.peak_running = 0  # most compiles ever running at once (requests + an unpaused helper job)
        self.pauses = 0

    # request compiles --------------------------------------------------------------------
    def __enter__(self) -> "CompileSlots":
        with self._lock:
            self.active += 1
            self._police()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self.active -= 1
            self._police()
            self._free.notify_all()

    # the helper job ----------------------------------------------------------------------
    def wait_for_helper_slot(self, stop: threading.Event) -> None:
        with self._lock:
            while self.active >= self.limit and not stop.is_set():
                self._free.wait(0.05)

    def helper_started(self, pid: int) -> None:
        with self._lock:
            self._helper_pid, self._stopped_at, self.stopped_s = pid, None, 0.0
            self._police()

    def helper_finished(self) -> None:
        with self._lock:
            if self._stopped_at is not None and self._helper_pid is not None:
                self._signal(signal.SIGCONT)
                self.stopped_s += time.monotonic() - self._stopped_at
            self._helper_pid, self._stopped_at = None, None

    def helper_paused_seconds(self) -> float:
        with self._lock:
            extra = time.monotonic() - self._stopped_at if self._stopped_at is not None else 0.0
            return self.stopped_s + extra

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self._helper_pid, sig)
        except ProcessLookupError:
            pass

    def _police(self) -> None:  # under self._lock
        if self._helper_pid is not None:
            if self._stopped_at is None and self.active >= self.limit:
                self._signal(signal.SIGSTOP)
                self._stopped_at = time.monotonic()
                self.pauses += 1
            elif self._stopped_at is not None and self.active < self.limit:
                self._signal(signal.SIGCONT)
                self.stopped_s += time.monotonic() - self._stopped_at
                self._stopped_at = None
        running = self.active + (1 if self._helper_pid is not None and self._stopped_at is None else 0)
        self.peak_running = max(self.peak_running, running)


class HelperError(RuntimeError):
    pass


class Helper:
    """One persistence helper process, started on demand and restarted after it exits."""

    def __init__(self, init: dict, settings: PersistSettings, slots: CompileSlots):
        self._init = init
        self.settings = settings
        self.slots = slots
        self.proc: Optional[subprocess.Popen] = None
        self._buf = b""
        self.starts = 0
        self.limit_bytes: Optional[int] = None

    def _start(self) -> None:
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ""  # the helper needs no GPU and must not create a context
        env.pop("SGLANG_PLUGINS", None)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dspark_harden.grammar.persist_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )
        self._buf = b""
        self.starts += 1
        try:
            self.proc.stdin.write((json.dumps(self._init) + "\n").encode())
            self.proc.stdin.flush()
            msg = self._read_line(self.settings.start_timeout_s)
        except (EOFError, BrokenPipeError, OSError):
            rc = self.proc.poll()
            self.kill()
            raise HelperError(f"grammar persistence helper exited during start-up (exit code {rc})") from None
        if msg is None or not msg.get("ready"):
            self.kill()
            raise HelperError(f"grammar persistence helper did not start within {self.settings.start_timeout_s:g} s")
        self.limit_bytes = msg.get("limit")

    def _read_line(self, timeout: float) -> Optional[dict]:
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 0.05))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Idempotent and safe from two threads at once (the persister, and close() from a finalizer)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not time out
            pass
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def run(self, job: dict) -> dict:
        """Run one job; always returns a result dict (``status`` says what happened)."""
        if not self.alive():
            self.kill()
            self._start()
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):  # it exited on idle between our check and the write
            self.kill()
            self._start()
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        phase = "queued"
        t0 = time.monotonic()
        self.slots.helper_started(self.proc.pid)
        try:
            while True:
                running = time.monotonic() - t0 - self.slots.helper_paused_seconds()
                if running > self.settings.deadline_s:
                    self.kill()
                    return {"status": "killed", "reason": "deadline", "phase": phase, "running_s": running}
                try:
                    msg = self._read_line(0.05)
                except EOFError:
                    rc = self.proc.wait(timeout=10) if self.proc else None
                    self.kill()
                    return {"status": "died", "reason": "helper_failed", "phase": phase, "returncode": rc}
                if msg is None:
                    continue
                if "phase" in msg and "status" not in msg:
                    phase = msg["phase"]
                    continue
                return msg
        finally:
            self.slots.helper_finished()


class Persister:
    """Bounded queue of publication jobs, drained by one thread through the helper process."""

    def __init__(self, ns: disk.Namespace, init: dict, settings: PersistSettings, slots: CompileSlots):
        self.ns = ns
        self.settings = settings
        self.slots = slots
        self.helper = Helper(init, settings, slots)
        self._q: "queue.Queue" = queue.Queue(maxsize=settings.queue_max)
        self._queued: set = set()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.outcomes: dict[str, dict] = {}  # key digest -> last result (tests, bench)
        self.skipped: dict[str, int] = {"queue_full": 0, "queued": 0}

    def submit(self, key_hex: str, parts: list, compile_s: float) -> bool:
        with self._lock:
            if key_hex in self._queued:
                self.skipped["queued"] += 1
                gm.inc_publish_skipped("queued")
                return False
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dspark-grammar-persist", daemon=True)
                self._thread.start()
            try:
                self._q.put_nowait({"key_hex": key_hex, "parts": parts, "compile_s": compile_s})
            except queue.Full:
                self.skipped["queue_full"] += 1
                gm.inc_publish_skipped("queue_full")
                return False
            self._queued.add(key_hex)
            gm.set_publish_queue(self._q.qsize())
            return True

    def flush(self) -> None:
        self._q.join()

    def close(self) -> None:
        """Stop the thread (after the job in progress) and the helper process. Idempotent."""
        self._stop.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self.helper.kill()

    def _run(self) -> None:
        while not self._stop.is_set():
            job = self._q.get()
            if job is None:
                self._q.task_done()
                return
            try:
                self.slots.wait_for_helper_slot(self._stop)
                if not self._stop.is_set():
                    self._one(job)
            except BaseException:  # noqa: BLE001 - never let the persister die
                # closing (or interpreter shutdown) kills the helper under a running job: not an error.
                # Python 3.11 parses source while formatting a traceback, which races the main thread's
                # own parsing during shutdown, so nothing is formatted then.
                if not self._stop.is_set() and not sys.is_finalizing():
                    logger.exception("dspark-harden: grammar cache persistence failed")
            finally:
                with self._lock:
                    self._queued.discard(job["key_hex"])
                    gm.set_publish_queue(self._q.qsize())
                self._q.task_done()

    def _one(self, job: dict) -> None:
        key_hex = job["key_hex"]
        if os.path.exists(self.ns.entry_path(key_hex)):
            self.outcomes[key_hex] = {"status": "exists"}
            return
        try:
            res = self.helper.run(job)
        except HelperError as exc:
            gm.inc_disk_error("helper")
            logger.error("dspark-harden: %s; grammar %s not persisted", exc, key_hex)
            self.outcomes[key_hex] = {"status": "helper_unavailable", "error": str(exc)}
            return
        status = res.get("status")
        if status in ("killed", "died"):
            reason = res["reason"]
            if status == "died" and res.get("phase") in ("serialize", "measure_load"):
                reason = "memory_limit"  # an allocation failure the binding could not turn into an exception
            logger.warning("dspark-harden: grammar cache helper %s during %s (%s); storing a compile-locally "
                           "marker for %s", "hit its deadline" if status == "killed" else "died",
                           res.get("phase"), reason, key_hex)
            res = self._publish_marker(key_hex, reason, job["compile_s"], res)
        self.outcomes[key_hex] = res
        status = res.get("status")
        if status == "published":
            gm.inc_stored(res["stored"], res.get("reason") or "")
            gm.set_disk_bytes(res["total"])
            gm.observe_phases(res.get("phases", {}))
            if res.get("pruned"):
                gm.inc_evictions("disk", "prune", res["pruned"])
            if res.get("ratio"):
                gm.observe_serialized_ratio(res["ratio"])
        elif status == "prune_error":
            gm.inc_disk_error("prune")
            logger.error("dspark-harden: %s", res.get("error"))
        elif status in ("publish_error", "error", "compile_failed"):
            gm.inc_disk_error("publish")
            logger.error("dspark-harden: publishing grammar cache entry %s failed: %s", key_hex, res.get("error"))

    def _publish_marker(self, key_hex: str, reason: str, compile_s: float, res: dict) -> dict:
        from filelock import Timeout

        lock = self.ns.entry_lock(key_hex)
        try:
            lock.acquire(blocking=False)
        except Timeout:
            return {"status": "busy", **res}  # another helper is publishing this key
        try:
            if os.path.exists(self.ns.entry_path(key_hex)):
                return {"status": "exists", **res}
            marker = disk.Marker(reason, max(1, int(compile_s * 1e9)), 0, 0)
            total, pruned = self.ns.publish(key_hex, disk.encode_marker(self.ns.scope_hex, key_hex, marker))
        except (disk.PruneError, OSError) as exc:
            return {"status": "publish_error", "error": str(exc)}
        finally:
            lock.release()
        return {"status": "published", "stored": "marker", "reason": reason, "total": total,
                "pruned": pruned.removed if pruned else 0, "helper": res}
