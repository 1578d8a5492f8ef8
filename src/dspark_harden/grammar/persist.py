"""Persistence that cannot endanger the serving process, nor outlive it, nor wedge the cache.

A scheduler compiles a missed grammar in its own compile pool and serves it at once. Publishing
it to the disk cache happens later and elsewhere:

* :class:`Persister` (one thread per cache) keeps a *bounded* set of publication jobs (queued plus
  waiting to be retried). A job is the grammar's cache key (kind + text), never the compiled
  grammar, so a job pins no ``CompiledGrammar`` and no lock file descriptor. A full set skips the
  publication (counted).
* :class:`Helper` runs each job in a separate helper process (:mod:`.persist_worker`) that
  compiles the key again itself, serializes, trial-loads and publishes, under an address-space
  limit and a deadline. The helper dies with the scheduler (``PR_SET_PDEATHSIG``), and every
  protocol line is tagged with its job's number and key: anything else kills and restarts it.
* :class:`CompileSlots` makes the helper's compile count against the same bound as the request
  compiles (``DSPARK_HARDEN_GRAMMAR_WORKERS``): a helper job starts only while a slot is free and
  is paused (SIGSTOP) while every slot serves requests, resumed (SIGCONT) when one frees — but
  only in the lock-free phases: before the helper takes a lock it announces the publish phase and
  waits for a go, which is sent only once pausing is off for this job. So a paused helper never
  holds a lock, and requests never wait for persistence.

Why SIGSTOP in the lock-free phases rather than cooperative throttling (a token between phases):
a token can only be refused *between* phases, and one phase of a large grammar (its serialize)
runs for seconds to minutes; a request compile arriving meanwhile would either wait for it or run
beyond the compile bound. SIGSTOP takes effect at once (measured in docs/grammar.md). With the
lock phase protected and the helper dying with its parent, what made SIGSTOP dangerous is gone.

Outcome classes (:meth:`Persister._one`): a compile-locally marker is stored only for causes
measured to belong to the grammar (slow or predicted-slow load, too large, serialization raising,
an allocation failing under the helper's own address-space cap, the job's CPU time passing the
deadline, or the same crash on every retry). Everything else — an OOM kill or any SIGKILL from
outside, a job that ran WALL_FACTOR x its deadline without the CPU time to show for it (a starved
or stuck helper), a lock not taken in time, an I/O error, a protocol error — stores nothing and is
retried a bounded number of times after a delay.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import queue
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from ..core.procfs import cpu_seconds, thread_states
from . import claim as claim_mod
from . import disk
from . import metrics as gm

logger = logging.getLogger("dspark_harden.grammar")

# a job that has run this many times its CPU deadline in wall time (pauses and the lock phase
# excluded) without using it is starved by the host or stuck: killed, no marker, retried
WALL_FACTOR = 4.0
# extra seconds the publish phase may take beyond one lock timeout (rename, fsyncs, pruning)
PUBLISH_IO_ALLOWANCE_S = 60.0
STDERR_TAIL_BYTES = 16 << 10
#: the most recent per-grammar outcomes a persister keeps (tests, bench, check): per-key state of a
#: service that sees a new schema per request must not grow with the traffic (issue 40)
OUTCOMES_KEPT = 512
CLAIM_EWMA_WEIGHT = 0.3  # weight of the newest claim-to-release sample in the estimate a claim carries
# a handoff (serialize + load) per byte of compiled-grammar memory before this process measured a publication:
# the median over the 13 bench schemas (xgrammar 0.2.7, 32k vocabulary, 2-core dev box: 99..2,182 ns per byte,
# median 245; the serialized JSON is 1.1..14x the memory size). The helper's optimistic 37 ns (1.1 bytes per
# byte, 60 MB/s each way: right for its "never worth serializing" shortcut) would judge every key worth a wait
HANDOFF_S_PER_MEMORY_BYTE = 250e-9
#: the helper's CPU share is averaged over this window: the token bucket holds at most share x window
#: CPU seconds, so an idle hour banks one minute's worth, not an hour's
CPU_BUDGET_WINDOW_S = 60.0


def _process_exiting(stop: threading.Event) -> bool:
    """This process is on its way out: the persister was closed, the main thread is done
    (``threading._shutdown``), or a multiprocessing child (a scheduler) runs its exit finalizers
    (``multiprocessing.util._exit_function`` sets ``_exiting`` first; the lifecycle's and stock's
    finalizers may take the helper down before the main thread is marked done)."""
    import multiprocessing.util

    return (
        stop.is_set()
        or not threading.main_thread().is_alive()
        or bool(getattr(multiprocessing.util, "_exiting", False))
    )


def _asleep(pid: int) -> bool:
    """Every thread of ``pid`` sleeping (S): none runnable (R), in uninterruptible I/O (D) or stopped (T)."""
    states = thread_states(pid)
    return bool(states) and all(s == "S" for s in states)


class RecentOutcomes(dict):
    """A dict that keeps only its ``limit`` most recently written keys (insertion order, a rewrite moves
    the key to the end)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        self.pop(key, None)
        super().__setitem__(key, value)
        while len(self) > self.limit:
            del self[next(iter(self))]


@dataclass(frozen=True)
class PersistSettings:
    queue_max: int = 64
    memory_limit_bytes: int = 2 << 30
    deadline_s: float = 120.0
    idle_exit_s: float = 30.0
    start_timeout_s: float = 180.0
    lock_timeout_s: float = disk.DEFAULT_LOCK_TIMEOUT_S
    retries: int = 2
    retry_delay_s: float = 5.0
    claim_wait_s: float = claim_mod.MAX_WAIT_S  # DSPARK_HARDEN_GRAMMAR_DISK_CLAIM_WAIT
    helper_cpu_share: float = 0.25  # DSPARK_HARDEN_GRAMMAR_DISK_HELPER_CPU_SHARE
    # a job whose helper used no CPU for this long of running time with every thread asleep is stuck
    stuck_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("queue_max", "memory_limit_bytes"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in (
            "deadline_s",
            "idle_exit_s",
            "start_timeout_s",
            "lock_timeout_s",
            "retry_delay_s",
            "claim_wait_s",
            "helper_cpu_share",
            "stuck_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if int(self.retries) < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries!r}")

    @property
    def wall_limit_s(self) -> float:
        return self.deadline_s * WALL_FACTOR

    @property
    def publish_timeout_s(self) -> float:
        return self.lock_timeout_s + PUBLISH_IO_ALLOWANCE_S


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
        self._locking = False  # the helper is in its publish phase: never paused there
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
            self._helper_pid, self._stopped_at, self.stopped_s, self._locking = pid, None, 0.0, False
            self._police()

    def helper_publishing(self) -> None:
        """The helper asked to enter its lock phase: stop pausing it (and resume it if paused).
        Returns only when it is running, so the go that follows cannot meet a pause."""
        with self._lock:
            self._locking = True
            self._resume()

    def helper_finished(self) -> None:
        with self._lock:
            self._resume()
            self._helper_pid, self._stopped_at, self._locking = None, None, False

    def helper_paused_seconds(self) -> float:
        with self._lock:
            extra = time.monotonic() - self._stopped_at if self._stopped_at is not None else 0.0
            return self.stopped_s + extra

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self._helper_pid, sig)
        except ProcessLookupError:
            pass

    def _resume(self) -> None:  # under self._lock
        if self._stopped_at is not None and self._helper_pid is not None:
            self._signal(signal.SIGCONT)
            self.stopped_s += time.monotonic() - self._stopped_at
        self._stopped_at = None

    def _police(self) -> None:  # under self._lock
        if self._helper_pid is not None and not self._locking:
            if self._stopped_at is None and self.active >= self.limit:
                self._signal(signal.SIGSTOP)
                self._stopped_at = time.monotonic()
                self.pauses += 1
            elif self._stopped_at is not None and self.active < self.limit:
                self._resume()
        helper_compiling = self._helper_pid is not None and self._stopped_at is None and not self._locking
        self.peak_running = max(self.peak_running, self.active + (1 if helper_compiling else 0))


class HelperError(RuntimeError):
    pass


class HelperProtocolError(HelperError):
    pass


class Helper:
    """One persistence helper process, started on demand and restarted after it exits."""

    def __init__(self, init: dict, settings: PersistSettings, slots: CompileSlots, argv: Optional[list] = None):
        self._init = init
        self.settings = settings
        self.slots = slots
        self.argv = list(argv) if argv else [sys.executable, "-m", "dspark_harden.grammar.persist_worker"]
        self.proc: Optional[subprocess.Popen] = None
        self._buf = b""
        self._seq = 0
        self.starts = 0
        self.limit_bytes: Optional[int] = None
        self.phase: Optional[str] = None  # the running job's last announced phase (tests, bench)
        self._err_tail = bytearray()
        self._err_thread: Optional[threading.Thread] = None
        self._to_child: Any = None
        self._from_child: Any = None

    @property
    def pid(self) -> Optional[int]:
        proc = self.proc
        return proc.pid if proc is not None else None

    def _start(self) -> None:
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ""  # the helper needs no GPU and must not create a context
        env.pop("SGLANG_PLUGINS", None)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        # started from the persister thread: the helper's PR_SET_PDEATHSIG follows this thread,
        # which runs every job of the helper and lives until close()
        # the protocol runs over its own pipes, never the helper's stdout: whatever a library prints
        # there (Python or C) lands in the log, and cannot shift a result onto another job
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        try:
            self.proc = subprocess.Popen(
                self.argv + ["--parent-pid", str(os.getpid()), "--proto-fds", f"{child_in},{child_out}"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                close_fds=True,
                pass_fds=(child_in, child_out),
            )
        except BaseException:
            for fd in (to_child, from_child):
                os.close(fd)
            raise
        finally:
            os.close(child_in)
            os.close(child_out)
        self._to_child = os.fdopen(to_child, "wb")
        self._from_child = os.fdopen(from_child, "rb", buffering=0)
        self._buf = b""
        self._err_tail = bytearray()
        self._err_thread = threading.Thread(
            target=self._drain_stderr, args=(self.proc.stdout,), name="dspark-grammar-helper-output", daemon=True
        )
        self._err_thread.start()
        self.starts += 1
        try:
            self._send(self._init)
            msg = self._read_line(self.settings.start_timeout_s)
        except (EOFError, BrokenPipeError, OSError):
            rc = None
            try:
                rc = self.proc.wait(timeout=5) if self.proc else None
            except subprocess.TimeoutExpired:
                pass
            if self._err_thread is not None:
                self._err_thread.join(timeout=2)
            self.kill()
            raise HelperError(
                f"grammar persistence helper exited during start-up (exit code {rc}): {self.stderr_tail()[-500:]}"
            ) from None
        except HelperProtocolError as exc:
            self.kill()
            raise HelperError(f"grammar persistence helper broke the protocol during start-up: {exc}") from None
        if msg is None or not msg.get("ready"):
            self.kill()
            raise HelperError(
                f"grammar persistence helper did not start within {self.settings.start_timeout_s:g} s"
                if msg is None
                else f"grammar persistence helper's first line was not ready: {msg!r}"
            )
        self.limit_bytes = msg.get("limit")

    def _drain_stderr(self, stream) -> None:
        """Forward the helper's stdout and stderr to our stderr and keep their tail (it tells a
        bad_alloc abort from a kill)."""
        try:
            while True:
                chunk = stream.read1(1 << 16)
                if not chunk:
                    stream.close()
                    return
                self._err_tail += chunk
                del self._err_tail[:-STDERR_TAIL_BYTES]
                try:
                    os.write(2, chunk)
                except OSError:
                    pass
        except (OSError, ValueError):
            return

    def stderr_tail(self) -> str:
        return bytes(self._err_tail).decode("utf-8", "replace")

    def _read_line(self, timeout: float) -> Optional[dict]:
        fd = self._from_child.fileno()
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
        try:
            msg = json.loads(line)
        except ValueError:
            raise HelperProtocolError(f"not a protocol line: {line[:200]!r}") from None
        if not isinstance(msg, dict):
            raise HelperProtocolError(f"not a protocol object: {line[:200]!r}")
        return msg

    def _send(self, obj: dict) -> None:
        self._to_child.write((json.dumps(obj) + "\n").encode())
        self._to_child.flush()

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
        for f in (self._to_child, self._from_child):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self._to_child = self._from_child = None

    def _died(self, phase: str) -> dict:
        proc = self.proc
        rc = None
        if proc is not None:
            try:
                rc = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = None
        if self._err_thread is not None:
            self._err_thread.join(timeout=2)
        tail = self.stderr_tail()
        self.kill()
        return {
            "status": "died",
            "reason": "helper_failed",
            "phase": phase,
            "returncode": rc,
            "stderr_tail": tail[-2000:],
        }

    def run(self, job: dict) -> dict:
        """Run one job; always returns a result dict (``status`` says what happened)."""
        if not self.alive():
            self.kill()
            self._start()
        self._seq += 1
        seq = self._seq
        msg_out = {"job": seq, **job}
        try:
            self._send(msg_out)
        except (BrokenPipeError, OSError):  # it exited on idle between our check and the write
            self.kill()
            self._start()
            self._send(msg_out)
        key_hex = job["key_hex"]
        phase = self.phase = "queued"
        t0 = time.monotonic()
        publish_t: Optional[float] = None
        running = 0.0
        cpu0 = cpu_seconds(self.proc.pid) or 0.0  # the helper's start-up and earlier jobs are not this job's
        cpu_seen, cpu_moved = cpu0, 0.0  # the job's CPU at its last change, and the running time then
        self.slots.helper_started(self.proc.pid)
        try:
            while True:
                now = time.monotonic()
                if publish_t is None:
                    # running time: paused time excluded, and the clock stops at the publish phase
                    # (lock waits there are bounded by the lock timeout, never charged to the grammar)
                    running = now - t0 - self.slots.helper_paused_seconds()
                    cpu = cpu_seconds(self.proc.pid)
                    job_cpu = None if cpu is None else cpu - cpu0
                    # the deadline is the job's CPU time: work the grammar needed, whatever the host's
                    # load; a job that runs WALL_FACTOR x as long without using it is starved or stuck
                    if job_cpu is not None and job_cpu > self.settings.deadline_s:
                        self.kill()
                        return {
                            "status": "killed",
                            "reason": "deadline",
                            "phase": phase,
                            "running_s": running,
                            "cpu_s": job_cpu,
                        }
                    if cpu is not None and cpu != cpu_seen:
                        cpu_seen, cpu_moved = cpu, running
                    reason = None
                    if running > self.settings.wall_limit_s:
                        reason = "starved"
                    elif running - cpu_moved > self.settings.stuck_s and _asleep(self.proc.pid):
                        # deadlocked, not starved: a starved helper has a runnable thread and some CPU
                        # (found: xgrammar's thread pool blocks forever when a thread cannot be created
                        # under the address-space cap)
                        reason = "stuck"
                    if reason is not None:
                        self.kill()
                        return {
                            "status": "killed",
                            "reason": reason,
                            "phase": phase,
                            "running_s": running,
                            "cpu_s": job_cpu,
                        }
                elif now - publish_t > self.settings.publish_timeout_s:
                    self.kill()
                    return {
                        "status": "killed",
                        "reason": "publish_timeout",
                        "phase": phase,
                        "running_s": running,
                        "publish_s": now - publish_t,
                    }
                try:
                    msg = self._read_line(0.05)
                except EOFError:
                    return self._died(phase)
                except HelperProtocolError as exc:
                    self.kill()
                    return {"status": "protocol_error", "error": str(exc), "phase": phase}
                if msg is None:
                    continue
                if msg.get("job") != seq or msg.get("key_hex") != key_hex:
                    self.kill()
                    return {
                        "status": "protocol_error",
                        "phase": phase,
                        "error": f"line tagged job {msg.get('job')!r} key {str(msg.get('key_hex'))[:16]!r}, "
                        f"expected job {seq} key {key_hex[:16]}: {json.dumps(msg)[:200]}",
                    }
                if "status" in msg:
                    if msg.get("reason") == "memory_limit":
                        # an allocation failed in it: its address space is not to be trusted for the next job
                        # (found: the next compile's thread pool could not create its threads and hung)
                        self.kill()
                    return msg
                if "phase" not in msg:
                    self.kill()
                    return {
                        "status": "protocol_error",
                        "phase": phase,
                        "error": f"neither phase nor status: {json.dumps(msg)[:200]}",
                    }
                phase = self.phase = str(msg["phase"])
                if msg.get("wait") == "go":
                    publish_t = time.monotonic()
                    self.slots.helper_publishing()  # never paused from here on: it is about to lock
                    try:
                        self._send({"go": seq})
                    except (BrokenPipeError, OSError):
                        return self._died(phase)
        finally:
            self.phase = None
            self.slots.helper_finished()


class Persister:
    """Bounded publication jobs, drained by one thread through the helper process."""

    def __init__(
        self,
        ns: disk.Namespace,
        init: dict,
        settings: PersistSettings,
        slots: CompileSlots,
        helper_argv: Optional[list] = None,
    ):
        self.ns = ns
        self.settings = settings
        self.slots = slots
        self.helper = Helper(init, settings, slots, argv=helper_argv)
        self._q: "queue.Queue" = queue.Queue()
        self._retry: list = []  # heap of (due, n, job): transient failures waiting for their retry
        self._retry_n = itertools.count()
        self._queued: set = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0  # jobs queued, waiting for a retry, or running
        self._busy = 0  # 1 while the thread runs a job
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.outcomes = RecentOutcomes(OUTCOMES_KEPT)  # key digest -> last result (tests, bench)
        self.skipped: dict[str, int] = {"queue_full": 0, "queued": 0, "retries_exhausted": 0, "cpu_budget": 0}
        # the helper's CPU budget (token bucket, CPU seconds): refilled at helper_cpu_share per second up to
        # share x CPU_BUDGET_WINDOW_S, charged with what the helper process really used (start-up included)
        self._cpu_tokens = settings.helper_cpu_share * CPU_BUDGET_WINDOW_S
        self._cpu_refilled = time.monotonic()
        self._cpu_seen: tuple = (None, 0.0)  # (helper pid, its CPU seconds when last charged)
        self.helper_cpu_s = 0.0  # CPU seconds charged so far (bench, tests)
        self.transient: dict[str, int] = {c: 0 for c in gm.TRANSIENT_CAUSES}
        self._claims: dict = {}  # key digest -> this process's claim, until its job's first run ends
        self._claim_ewma: Optional[float] = None
        # measured from this process's serialized publications (EWMA): handoff seconds per byte of the
        # compiled grammar's memory size (serialize + trial load), and seconds of the durable write
        self._handoff_per_byte = HANDOFF_S_PER_MEMORY_BYTE
        self._handoff_write_s = 0.0
        self.handoffs_measured = 0

    def handoff_estimate(self, memory_bytes: int) -> float:
        """Predicted seconds for another process to get a compiled grammar of ``memory_bytes`` from
        the disk instead of compiling it: serialize + durable write + read + deserialize, scaled
        from this process's measured publications (HANDOFF_S_PER_MEMORY_BYTE and no write until one)."""
        with self._lock:
            return max(0, int(memory_bytes)) * self._handoff_per_byte + self._handoff_write_s

    def _measure_handoff(self, res: dict) -> None:
        phases, mem = res.get("phases") or {}, res.get("memory_bytes") or 0
        if res.get("stored") != "serialized" or mem <= 0 or "measure_load" not in phases:
            return
        per_byte = (phases.get("serialize", 0.0) + phases["measure_load"]) / mem
        write_s = phases.get("entry_write_account", 0.0)
        with self._lock:
            w = CLAIM_EWMA_WEIGHT if self.handoffs_measured else 1.0  # the first measurement replaces the prediction
            self.handoffs_measured += 1
            self._handoff_per_byte = w * per_byte + (1 - w) * self._handoff_per_byte
            self._handoff_write_s = w * write_s + (1 - w) * self._handoff_write_s

    def publish_estimate(self) -> float:
        """Seconds from taking a claim until its job ends, as measured for this process's claimed
        jobs (EWMA). The first claim, with nothing measured yet, gets the most a waiter may wait
        (claim_wait_s / WAIT_FACTOR): its publication includes the helper's start-up, unknown yet."""
        with self._lock:
            if self._claim_ewma is not None:
                return self._claim_ewma
        return self.settings.claim_wait_s / claim_mod.WAIT_FACTOR

    def _claim_done(self, c: Any) -> None:
        """Release a job's claim after its first helper run, whatever the outcome (a retry comes
        seconds later: waiters must not wait for it), and measure claim-to-release time."""
        if c is None:
            return
        with self._lock:
            self._claims.pop(c.key_hex, None)
            sample = time.monotonic() - c.taken_at
            self._claim_ewma = (
                sample
                if self._claim_ewma is None
                else (CLAIM_EWMA_WEIGHT * sample + (1 - CLAIM_EWMA_WEIGHT) * self._claim_ewma)
            )
        self._release(c)

    def _release(self, c) -> None:
        try:
            claim_mod.remove_if(self.ns, c)
        except OSError as exc:  # a dead claimant's claim is cleaned by identity; a live one's must go
            logger.warning("dspark-harden: removing grammar cache claim %s failed: %s", c.path, exc)

    def submit(self, key_hex: str, parts: list, compile_s: float, claim: Any = None, cold: bool = True) -> bool:
        """Queue a publication; with ``claim`` (this process's claim on the key) the claim is
        released when the job's first run ends, or at once when nothing is queued. ``cold``: whether
        ``compile_s`` was measured without xgrammar's compiler cache (False: the helper's decision
        ignores it and uses its own cold compile)."""
        ok = self._submit(key_hex, parts, compile_s, claim, cold)
        if not ok and claim is not None:
            self._release(claim)
        return ok

    def _submit(self, key_hex: str, parts: list, compile_s: float, claim: Any, cold: bool = True) -> bool:
        with self._lock:
            if not self._may_queue_locked(key_hex):
                return False
            if self._cpu_budget_locked() <= 0.0:
                self.skipped["cpu_budget"] += 1
                gm.inc_publish_skipped("cpu_budget")
                return False
            job = {
                "key_hex": key_hex,
                "parts": parts,
                "compile_s": compile_s,
                "compile_cold": bool(cold),
                "attempt": 0,
                "causes": [],
            }
            if claim is not None:
                job["claim"] = claim
                self._claims[key_hex] = claim
            self._enqueue_locked(job)
            return True

    def demote(self, key_hex: str, data: bytes, compile_s: float, load_s: float) -> bool:
        """Queue the replacement of the serialized entry ``data`` (as this process read it) by a
        compile-locally marker (reason ``slow_load_served``): this process loaded it in ``load_s``
        (CPU), more than the cold compile recorded in it (``compile_s``), so a restarted process
        compiles it instead. Only those bytes are replaced (their size and checksum are compared under
        the entry lock): an entry a peer replaced or removed meanwhile is left alone. No helper work."""
        with self._lock:
            if not self._may_queue_locked(key_hex):
                return False
            self._enqueue_locked(
                {
                    "key_hex": key_hex,
                    "demote": (len(data), bytes(data[-disk.TRAILER_SIZE :])),
                    "compile_s": compile_s,
                    "load_s": load_s,
                    "attempt": 0,
                    "causes": [],
                }
            )
            return True

    def _may_queue_locked(self, key_hex: str) -> bool:
        if self._stop.is_set():
            return False
        if key_hex in self._queued:
            self.skipped["queued"] += 1
            gm.inc_publish_skipped("queued")
            return False
        if self._pending - self._busy >= self.settings.queue_max:  # waiting or retrying, not running
            self.skipped["queue_full"] += 1
            gm.inc_publish_skipped("queue_full")
            return False
        return True

    def _enqueue_locked(self, job: dict) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="dspark-grammar-persist", daemon=True)
            self._thread.start()
        self._q.put_nowait(job)
        self._queued.add(job["key_hex"])
        self._pending += 1
        gm.set_publish_queue(self._pending - self._busy)

    def _cpu_budget_locked(self) -> float:
        now = time.monotonic()
        share = self.settings.helper_cpu_share
        self._cpu_tokens = min(share * CPU_BUDGET_WINDOW_S, self._cpu_tokens + share * (now - self._cpu_refilled))
        self._cpu_refilled = now
        return self._cpu_tokens

    def _charge_helper_cpu(self) -> None:
        """Charge the budget with the CPU the helper process used since it was last charged (a new
        helper: everything it used, its start-up included)."""
        pid = self.helper.pid
        if pid is None:
            return
        cpu = cpu_seconds(pid)
        if cpu is None:
            return
        last_pid, last_cpu = self._cpu_seen
        used = cpu - last_cpu if pid == last_pid else cpu
        self._cpu_seen = (pid, cpu)
        with self._lock:
            self._cpu_budget_locked()
            self._cpu_tokens -= max(0.0, used)
            self.helper_cpu_s += max(0.0, used)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every job (retries included) reached its final outcome."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending and not self._stop.is_set():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left if left is not None else 0.5)
            return not self._pending

    def close(self, join_s: Optional[float] = None) -> None:
        """Stop the thread (after the job in progress) and the helper process. Idempotent.
        ``join_s``: also wait up to that long for the thread and the helper-output reader to exit
        (a process that forks afterwards must not carry them)."""
        self._stop.set()
        self._q.put_nowait(None)
        self.helper.kill()
        with self._lock:
            claims, self._claims = list(self._claims.values()), {}
            self._idle.notify_all()
        for c in claims:  # nothing will publish them now: their waiters compile at once
            self._release(c)
        if join_s is not None:
            end = time.monotonic() + join_s
            for t in (self._thread, self.helper._err_thread):
                if t is not None and t is not threading.current_thread():
                    t.join(max(0.0, end - time.monotonic()))

    def _next_job(self) -> Optional[dict]:
        """A retry that is due (first: new jobs cannot starve it), else the next queued job."""
        while not self._stop.is_set():
            with self._lock:
                if self._retry and self._retry[0][0] <= time.monotonic():
                    return heapq.heappop(self._retry)[2]
                due = self._retry[0][0] if self._retry else None
            timeout = None if due is None else max(0.0, due - time.monotonic())
            try:
                return self._q.get(timeout=timeout)
            except queue.Empty:
                continue
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            job = self._next_job()
            if job is None:
                return
            final = True
            held = job.pop("claim", None)  # never copied into a retry
            with self._lock:
                self._busy = 1
            try:
                self.slots.wait_for_helper_slot(self._stop)
                if not self._stop.is_set():
                    final = self._one(job)
            except BaseException:  # noqa: BLE001 - never let the persister die
                # closing (or interpreter shutdown) kills the helper under a running job: not an error.
                # Python 3.11 parses source while formatting a traceback, which races the main thread's
                # own parsing during shutdown, so nothing is formatted then.
                if not self._stop.is_set() and not sys.is_finalizing():
                    logger.exception("dspark-harden: grammar cache persistence failed")
            finally:
                self._claim_done(held)
                self._charge_helper_cpu()
                with self._lock:
                    self._busy = 0
                    if final:
                        self._queued.discard(job["key_hex"])
                        self._pending -= 1
                        self._idle.notify_all()
                    gm.set_publish_queue(self._pending - self._busy)

    # -- one job ----------------------------------------------------------------------------
    def _one(self, job: dict) -> bool:
        """Run ``job``; True when its outcome is final, False when it was scheduled for a retry."""
        key_hex = job["key_hex"]
        if "demote" in job:
            res = self._publish_marker(
                key_hex, "slow_load_served", job["compile_s"], {}, replace=job["demote"], load_s=job["load_s"]
            )
            if res.get("status") == "published":
                logger.info(
                    "dspark-harden: grammar cache entry %s loaded in %.1f ms of CPU here, more than the %.1f ms "
                    "cold compile recorded in it: replaced by a compile-locally marker (slow_load_served)",
                    self.ns.entry_path(key_hex),
                    job["load_s"] * 1e3,
                    job["compile_s"] * 1e3,
                )
            self._record(key_hex, res)
            return True
        if os.path.lexists(self.ns.entry_path(key_hex)):
            self.outcomes[key_hex] = {"status": "exists"}
            return True
        try:
            res = self.helper.run({k: job[k] for k in ("key_hex", "parts", "compile_s", "compile_cold")})
        except HelperError as exc:
            if _process_exiting(self._stop):
                # the scheduler is exiting: the helper went with its tree; nothing is wrong with the grammar
                # or the cache, so no ERROR and no retry
                logger.info("dspark-harden: process exiting; grammar %s not persisted (%s)", key_hex, exc)
                self.outcomes[key_hex] = {"status": "helper_unavailable", "error": str(exc), "exiting": True}
                return True
            gm.inc_disk_error("helper")
            logger.error("dspark-harden: %s; grammar %s not persisted", exc, key_hex)
            return self._transient(job, "helper_unavailable", {"status": "helper_unavailable", "error": str(exc)})
        status = res.get("status")
        if status in ("killed", "died", "protocol_error"):
            permanent, cause = self._classify(res)
            if permanent is None:
                return self._transient(job, cause, res)
            logger.warning(
                "dspark-harden: grammar cache helper %s during %s (%s); storing a compile-locally marker for %s",
                "hit its deadline" if status == "killed" else "died",
                res.get("phase"),
                permanent,
                key_hex,
            )
            res = self._publish_marker(key_hex, permanent, job["compile_s"], res)
            status = res.get("status")
        elif status == "lock_timeout":
            gm.inc_disk_error("lock_timeout")
            return self._transient(job, "lock_timeout", res)
        elif status in ("publish_error", "error"):
            gm.inc_disk_error("publish")
            logger.error("dspark-harden: publishing grammar cache entry %s failed: %s", key_hex, res.get("error"))
            if status == "publish_error":
                return self._transient(job, "publish_error", res)
        self._record(key_hex, res)
        return True

    def _classify(self, res: dict) -> tuple[Optional[str], str]:
        """(marker reason, "") when the failure is measured to be the grammar's; (None, transient cause)
        otherwise."""
        status = res.get("status")
        if status == "protocol_error":
            logger.warning(
                "dspark-harden: grammar cache helper protocol error (%s); helper restarted", res.get("error")
            )
            gm.inc_disk_error("protocol")
            return None, "protocol"
        if status == "killed":
            if res.get("reason") == "publish_timeout":
                return None, "publish_timeout"
            if res.get("reason") == "deadline":
                return "deadline", ""  # it used its whole CPU budget: measured work of the grammar
            if res.get("reason") == "stuck":
                return None, "stuck"  # every thread asleep without CPU: a deadlock, retried in a new helper
            return None, "starved"  # the host, not the grammar, kept it from finishing
        rc = res.get("returncode")
        tail = res.get("stderr_tail") or ""
        if res.get("phase") in ("compile", "serialize", "measure_load") and (
            "bad_alloc" in tail or "MemoryError" in tail
        ):
            return "memory_limit", ""  # an allocation failed under the helper's own address-space cap
        if rc == -signal.SIGKILL:
            return None, "killed"  # the OOM killer or an operator: nothing about the grammar
        return None, "crashed"

    def _transient(self, job: dict, cause: str, res: dict) -> bool:
        key_hex = job["key_hex"]
        self.transient[cause] = self.transient.get(cause, 0) + 1
        gm.inc_helper_transient(cause)
        job = {**job, "attempt": job["attempt"] + 1, "causes": job["causes"] + [cause]}
        res = {**res, "transient": cause, "attempt": job["attempt"]}
        self.outcomes[key_hex] = res
        if job["attempt"] <= self.settings.retries and not self._stop.is_set():
            delay = self.settings.retry_delay_s * job["attempt"]
            logger.warning(
                "dspark-harden: persisting grammar %s failed transiently (%s, phase %s); no marker "
                "stored, retry %d of %d in %.3g s",
                key_hex,
                cause,
                res.get("phase"),
                job["attempt"],
                self.settings.retries,
                delay,
            )
            with self._lock:
                heapq.heappush(self._retry, (time.monotonic() + delay, next(self._retry_n), job))
            return False
        if job["causes"] and all(c == "crashed" for c in job["causes"]):
            # the same crash on every attempt: reproduced, so it belongs to the grammar
            logger.warning(
                "dspark-harden: grammar cache helper crashed on all %d attempts for %s; storing a "
                "helper_failed compile-locally marker",
                len(job["causes"]),
                key_hex,
            )
            self._record(key_hex, self._publish_marker(key_hex, "helper_failed", job["compile_s"], res))
            return True
        self.skipped["retries_exhausted"] += 1
        gm.inc_publish_skipped("retries_exhausted")
        logger.warning(
            "dspark-harden: grammar %s not persisted after %d attempts (%s); nothing stored, it is "
            "compiled where it misses and persisted by a later miss",
            key_hex,
            len(job["causes"]),
            ", ".join(job["causes"]),
        )
        return True

    def _record(self, key_hex: str, res: dict) -> None:
        self.outcomes[key_hex] = res
        status = res.get("status")
        if status == "published":
            self._measure_handoff(res)
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
        elif status == "compile_failed":
            gm.inc_disk_error("publish")
            logger.error("dspark-harden: publishing grammar cache entry %s failed: %s", key_hex, res.get("error"))
        elif status == "lock_timeout":
            gm.inc_disk_error("lock_timeout")
            logger.warning("dspark-harden: %s", res.get("error"))
        elif status in ("publish_error", "unsafe"):
            gm.inc_disk_error("publish")
            logger.error("dspark-harden: publishing grammar cache entry %s failed: %s", key_hex, res.get("error"))

    def _publish_marker(
        self,
        key_hex: str,
        reason: str,
        compile_s: float,
        res: dict,
        replace: Optional[tuple] = None,
        load_s: float = 0.0,
    ) -> dict:
        """Publish a compile-locally marker for ``key_hex`` where nothing is published yet, or, with
        ``replace`` = (size, checksum) of an entry, over that entry if the file still holds it."""
        lock = self.ns.entry_lock(key_hex)
        try:
            lock.acquire(blocking=False)
        except disk.GrammarCacheLockTimeout:
            return {"status": "busy", **res}  # another helper is publishing this key
        except (disk.GrammarCacheError, OSError) as exc:
            return {"status": "publish_error", "error": str(exc)}
        try:
            path = self.ns.entry_path(key_hex)
            writable = _holds(path, *replace) if replace else not os.path.lexists(path)
            if not writable:  # published meanwhile, or (replace) replaced or removed meanwhile
                return {"status": "exists", **res}
            payload = replace[0] - disk.HEADER_SIZE - disk.TRAILER_SIZE if replace else 0
            marker = disk.Marker(reason, max(1, int(compile_s * 1e9)), payload, int(load_s * 1e9))
            total, pruned = self.ns.publish(key_hex, disk.encode_marker(self.ns.scope_hex, key_hex, marker))
        except disk.GrammarCacheLockTimeout as exc:
            return {"status": "lock_timeout", "error": str(exc)}
        except (disk.PruneError, OSError) as exc:
            return {"status": "publish_error", "error": str(exc)}
        finally:
            lock.release()
        return {
            "status": "published",
            "stored": "marker",
            "reason": reason,
            "total": total,
            "pruned": pruned.removed if pruned else 0,
            "helper": res,
        }


def _holds(path: str, size: int, checksum: bytes) -> bool:
    """Whether the regular file at ``path`` is ``size`` bytes ending in ``checksum`` (an entry's trailer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return (
            stat.S_ISREG(st.st_mode)
            and st.st_size == size
            and os.pread(fd, len(checksum), size - len(checksum)) == checksum
        )
    finally:
        os.close(fd)
