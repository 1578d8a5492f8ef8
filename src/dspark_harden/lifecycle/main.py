"""Main process (HTTP server + tokenizer manager): draining ordered shutdown and surfaced death.

SIGTERM (stock ``SignalHandler.sigterm_handler`` + ``TokenizerManager.sigterm_watchdog``,
replaced):

1. at once: ``gracefully_exit`` is set (``/health``, ``/health_generate`` and ``/health_scheduler``
   answer 503) and :class:`DrainGate` answers every request that is not on the read-only route
   allow-list (:mod:`.drain_routes`; ``/abort_request`` stays allowed) with 503 naming the shutdown;
2. in-flight requests finish within ``DSPARK_HARDEN_SHUTDOWN_DRAIN_S`` (stock polls every 5 s and
   has no bound); those still running at the deadline are answered with HTTP 503 naming the drain
   window (stock's own abort path, ``_handle_abort_req``) and aborted in the schedulers;
3. ``ShutdownReq`` goes to the schedulers (each forwards it to the detokenizer, leaves its loop,
   releases host resources and meets its peers at a CPU barrier with a timeout before its groups
   go away: :mod:`.scheduler`); the main process waits for every child to exit on its own (the DP
   controller exits 0 once its schedulers did: :mod:`.controller`), kills only stragglers (named),
   removes what the tree left in /dev/shm and its ZMQ ipc sockets (:mod:`.resources`), exits 0
   (6 when a child failed, had to be killed or would not die).

A child's death (stock ``SubprocessWatchdog._check_processes`` and the running-phase SIGQUIT
handler, replaced): the cause is built from the records the children wrote (:mod:`.records`),
``/health_scheduler`` answers 503 naming it (attribute ``dspark_harden_fault`` on the tokenizer
manager, read by the health feature), every in-flight request is answered with HTTP 503 naming it
(instead of a dropped connection), then the tree is killed, leftovers removed, and the process exits
with :data:`EXIT_CODES` (scheduler 3, detokenizer 4, DP controller 5, other 6).

Teardown never wedges the host and never orphans anything (:mod:`.proctree`): the main process is
the child subreaper of its tree under launch_server / ``sglang serve`` (an orphaned grandchild is
reparented to it, not to init; an offline ``sglang.Engine`` runs in the user's process, never made a
subreaper, where an adopted orphan would stay a zombie for the life of that process); the whole
tree is stopped and killed together through pidfds (never by a pid that may have been reused), the
schedulers with everything they started; a process that will not die even from SIGKILL is named and
left behind; every /proc scan is bounded (``D``-state processes are not read, each scan runs on a
daemon thread with a time limit) and a hard deadline exits with the documented code whatever blocks.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import shutil
import sys
import threading
import time
from http import HTTPStatus
from typing import Any, Optional

from ..core import metrics
from . import proctree, records
from .resources import ResourceTracker, remove_leftovers

logger = logging.getLogger("dspark_harden.lifecycle")

EXIT_CODES = {"scheduler": 3, "detokenizer": 4, "controller": 5, "other": 6}
# What a refusing server still serves (DrainGate) is decided by route, not by method (16 stock GET
# routes do work): the read-only allow-list and the work paths still accepted are in .drain_routes.
SCHEDULER_EXIT_TIMEOUT_S = 15.0  # stock _SCHEDULER_EXIT_TIMEOUT_SECS, after the barrier timeout
CHILD_EXIT_TIMEOUT_S = 10.0
ABORT_ANSWER_TIMEOUT_S = 10.0
#: SIGKILL to exit: a GPU process can take seconds to release its context; one that takes longer is
#: blocked in the kernel and is named and left behind (stock: 60 s, then RuntimeError)
KILL_WAIT_S = 30.0
#: the resource scan of the live tree before it is killed
SCAN_LIMIT_S = 5.0
#: finding and removing leftovers (reads /proc of every process of the host)
CLEANUP_LIMIT_S = 15.0
#: the hard deadline: beyond the sum of the bounded steps, this much before os._exit(code) anyway
HARD_EXIT_MARGIN_S = 15.0
#: after a completed ordered shutdown, how long stock's own exit may take before os._exit
EXIT_GRACE_S = 30.0
SCHEDULER_COMM = "sglang::schedul"  # setproctitle("sglang::scheduler...") as /proc/<pid>/comm (15 chars)


def _metric(name: str, *labels: Any):
    try:
        return metrics.child(name, *labels)
    except Exception:  # noqa: BLE001 - metrics must never change the lifecycle
        logger.debug("metric %s unavailable", name, exc_info=True)
        return None


def _set_phase(phase: str, seconds: float) -> None:
    m = _metric("dspark_harden_shutdown_phase_seconds", "main", "none", phase)
    if m is not None:
        m.set(seconds)


def _count(name: str, *labels: Any, n: float = 1) -> None:
    m = _metric(name, *labels)
    if m is not None and n:
        m.inc(n)


RTRACKER_STOP_S = 5.0
ANSWER_WAIT_S = 5.0


class HardExit:
    """``os._exit(code)`` at a deadline, whatever the teardown is blocked in (a /proc read of a
    wedged process, a hung filesystem, a stuck ZMQ send). Armed when a teardown starts; the
    current step's name goes into the CRITICAL line."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._deadline: Optional[float] = None
        self._armed_for = 0.0
        self._code = EXIT_CODES["other"]
        self._what = ""
        self._thread: Optional[threading.Thread] = None

    def arm(self, seconds: float, code: int, what: str) -> None:
        with self._cv:
            self._deadline = time.monotonic() + seconds
            self._armed_for, self._code, self._what = seconds, code, what
            self._cv.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dspark-lifecycle-hard-exit", daemon=True)
                self._thread.start()

    def set(self, *, what: Optional[str] = None, code: Optional[int] = None) -> None:
        with self._cv:
            if what is not None:
                self._what = what
            if code is not None:
                self._code = code

    @property
    def armed(self) -> bool:
        return self._deadline is not None

    def _run(self) -> None:
        with self._cv:
            while True:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            code, what, seconds = self._code, self._what, self._armed_for
        try:
            logger.critical(
                "dspark-harden lifecycle: the teardown did not finish within its hard deadline (%.0f s; "
                "blocked in: %s); exiting with code %d now",
                seconds,
                what,
                code,
            )
            _flush_logs()
        finally:
            os._exit(code)


def _bounded(fn, limit_s: float, what: str):
    """Run ``fn`` on a daemon thread for at most ``limit_s``: ``(True, value)``, or ``(False, None)``
    when it raised or did not finish (logged at ERROR; the thread is left behind, a daemon)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    t = threading.Thread(target=run, name="dspark-lifecycle-bounded", daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        logger.error(
            "dspark-harden lifecycle: %s did not finish within %g s (a /proc read or a file operation "
            "blocked in the kernel); continuing without it",
            what,
            limit_s,
        )
        return False, None
    if "error" in box:
        exc = box["error"]
        logger.error("dspark-harden lifecycle: %s failed: %s: %s", what, type(exc).__name__, exc)
        return False, None
    return True, box.get("value")


async def _to_thread(fn):
    """Await ``fn`` on a daemon thread (never the event loop's executor: its shutdown would join a
    blocked thread); the hard deadline bounds it."""
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="dspark-lifecycle-teardown", daemon=True).start()
    while not done.is_set():
        await asyncio.sleep(0.02)
    if "error" in box:
        raise box["error"]
    return box.get("value")


async def _bounded_async(fn, limit_s: float, what: str) -> bool:
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="dspark-lifecycle-bounded", daemon=True).start()
    deadline = time.monotonic() + limit_s
    while not done.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if not done.is_set():
        logger.error(
            "dspark-harden lifecycle: %s did not finish within %g s (a /proc read or a file operation "
            "blocked in the kernel); continuing without it",
            what,
            limit_s,
        )
        return False
    if "error" in box:
        logger.error("dspark-harden lifecycle: %s failed: %s: %s", what, type(box["error"]).__name__, box["error"])
        return False
    return True


def _kept(left: dict) -> str:
    kept = left.get("kept") or []
    if not kept:
        return ""
    why = left.get("why") or {}
    return ", kept: " + "; ".join(f"{p} ({why[p]})" if p in why else p for p in kept)


def _scheduler_handles() -> list:
    """pidfds of the scheduler processes below this one (named by setproctitle: /proc comm)."""
    out = []
    for p in proctree.descendants(os.getpid()):
        if p.name.startswith(SCHEDULER_COMM) and p.state not in ("Z", "X"):
            h = proctree.open_handle(p)
            if h is not None:
                out.append(h)
    return out


def _rtracker():
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    return tracker, getattr(tracker, "_pid", None)


def _kill_tree_now() -> proctree.KillReport:
    """SIGKILL the whole tree below this process at once (SIGSTOP first, through pidfds: nothing it
    started can escape), except multiprocessing's resource tracker (:func:`_finish_kill`)."""
    _tracker, tracker_pid = _rtracker()
    return proctree.kill_tree(os.getpid(), skip={tracker_pid} if tracker_pid else (), wait_s=0)


def _finish_kill(report: proctree.KillReport, wait_s: float) -> proctree.KillReport:
    """Wait for the killed processes (a bounded time: one that does not die is named and left), then
    stop the resource tracker: with every other process gone it unlinks the semaphores they
    registered and never released (``sem.mp-*``: SIGKILLed processes cannot; stock kills the tracker
    too, so they leak)."""
    proctree.await_exit(report, wait_s)
    if report.survivors:
        logger.error(
            "dspark-harden lifecycle: %d process(es) did not exit within %g s of SIGKILL and are left "
            "behind: %s (a process in state D is blocked in the kernel: a driver call, a hung "
            "filesystem; it exits only when that call returns)",
            len(report.survivors),
            wait_s,
            report.describe_survivors(),
        )
    if report.incomplete:
        logger.error(
            "dspark-harden lifecycle: the process tree kept forking while it was being stopped; some "
            "processes may have escaped"
        )
    tracker, tracker_pid = _rtracker()
    if tracker_pid is not None:

        def stop():
            try:
                tracker._stop()
            except Exception:  # noqa: BLE001 - then the /proc-based cleanup still runs
                logger.debug("stopping the resource tracker failed", exc_info=True)

        t = threading.Thread(target=stop, name="dspark-lifecycle-rtracker", daemon=True)
        t.start()
        t.join(RTRACKER_STOP_S)  # it exits once every holder of its pipe is gone; never wait longer
    report.close()
    return report


def _kill_children(wait_timeout: float) -> proctree.KillReport:
    """Kill the whole tree below this process and wait (bounded); never raises."""
    return _finish_kill(_kill_tree_now(), wait_timeout)


class MainLifecycle:
    """The main process's view of the server's lifecycle (one per process: :data:`MAIN`)."""

    def __init__(self) -> None:
        self.drain_s = 30.0
        self.death_grace_s = 2.0
        self.barrier_timeout_s = 10.0
        self.run_dir: Optional[str] = None
        self.owns_run_dir = False
        self.tm: Any = None
        self.port_args: Any = None
        self.tracker: Optional[ResourceTracker] = None
        self.shutdown_started: Optional[float] = None
        self.fault: Optional[dict] = None
        self._lock = threading.Lock()
        self.refused = 0
        self.subreaper = False
        self.cleanup_incomplete = False
        self.hard_exit = HardExit()

    # -- configuration ---------------------------------------------------------------------
    def configure(
        self, *, drain_s: float, death_grace_s: float, barrier_timeout_s: float, owns_process: bool = True
    ) -> None:
        """In the main process, before any child is spawned. ``owns_process``: the server owns this process
        (launch_server / ``sglang serve``); an offline ``sglang.Engine`` runs in the user's own process,
        which never becomes a child subreaper (orphans it adopted would stay zombies there)."""
        self.drain_s, self.death_grace_s, self.barrier_timeout_s = drain_s, death_grace_s, barrier_timeout_s
        if not self.owns_run_dir:
            inherited = os.environ.get(records.RUN_DIR_ENV)
            # always a fresh private directory: an inherited name (from another server's process, or
            # set by anyone) is never trusted with this server's records
            self.run_dir = records.make_run_dir()
            self.owns_run_dir = True
            os.environ[records.RUN_DIR_ENV] = self.run_dir  # inherited by every child spawned later
            # whatever way this process ends short of a kill, its run directory goes with it: a server
            # refused at start-up, or the fresh directory next_tree() made after an Engine's last
            # shutdown, was otherwise left in /tmp by every such process (one per pid, forever)
            atexit.register(self._remove_run_dir_at_exit, os.getpid())
            if inherited:
                logger.info(
                    "dspark-harden lifecycle: %s=%s was inherited; this server uses its own private run directory %s",
                    records.RUN_DIR_ENV,
                    inherited,
                    self.run_dir,
                )
        self.subreaper = proctree.become_subreaper() if owns_process else False

    def _remove_run_dir_at_exit(self, owner_pid: int) -> None:
        run_dir = self.run_dir
        if os.getpid() != owner_pid or not self.owns_run_dir or not run_dir:
            return  # a forked child that exits through atexit: the directory is its parent's
        if records.check_run_dir(run_dir) is None:  # still this process's private directory
            shutil.rmtree(run_dir, ignore_errors=True)

    def attach(self, tm: Any, port_args: Any) -> None:
        """Called from TokenizerManager.__init__ (the children are starting)."""
        self.tm, self.port_args = tm, port_args
        if self.tracker is None:
            self.tracker = ResourceTracker()
            self.tracker.add_paths(sockets=self.ipc_paths())
            self.tracker.start()  # scans on its own thread: now, when the children are ready, rarely after

    def next_tree(self) -> None:
        """After an in-process tree (an offline Engine) was shut down and cleaned up: drop its tracker
        and give the next tree a fresh private run directory (``cleanup`` removed this one), so a later
        Engine in the same process starts tracked and with a directory its children accept."""
        self.tracker = None
        self.cleanup_incomplete = False
        if self.owns_run_dir:
            self.run_dir = records.make_run_dir()
            os.environ[records.RUN_DIR_ENV] = self.run_dir

    def children_ready(self) -> None:
        if self.tracker is not None:
            self.tracker.notify_ready()

    # -- state -------------------------------------------------------------------------------
    def refusing(self) -> Optional[str]:
        """The 503 message for new work, or None while serving."""
        if self.fault is not None:
            return f"server is stopping: {self.fault['message']}"
        if self.shutdown_started is not None:
            return (
                f"server is shutting down (SIGTERM received {time.time() - self.shutdown_started:.1f} s ago); "
                "retry on another replica"
            )
        return None

    def begin_shutdown(self) -> bool:
        with self._lock:
            if self.shutdown_started is not None:
                return False
            self.shutdown_started = time.time()
            return True

    # -- cleanup -------------------------------------------------------------------------------
    def ipc_paths(self) -> list[str]:
        out = []
        pa = self.port_args
        if pa is None:
            return out
        for value in vars(pa).values():
            if isinstance(value, str) and value.startswith("ipc://"):
                out.append(value[len("ipc://") :])
        try:
            from sglang.srt.managers.load_snapshot import shm_path_for

            if getattr(pa, "instance_id", ""):
                out.append(shm_path_for(pa.instance_id))
        except Exception:  # noqa: BLE001
            pass
        return out

    def scan_now(self, limit_s: float = SCAN_LIMIT_S) -> bool:
        """Record what the live tree holds (before it is killed), within ``limit_s``."""
        tracker = self.tracker
        if tracker is None:
            return True
        deadline = time.monotonic() + limit_s
        done, _value = _bounded(
            lambda: tracker.scan(deadline=deadline), limit_s + 1.0, "the resource scan of the live tree"
        )
        return done

    def cleanup(self, exclude=()) -> dict:
        """Remove what the dead tree left (``exclude``: ``(pid, start)`` of killed processes that did
        not die), within :data:`CLEANUP_LIMIT_S`; sets :attr:`cleanup_incomplete` when cut short."""
        t0 = time.monotonic()
        result = {"removed": [], "kept": [], "why": {}}
        tracker = self.tracker
        run_dir = self.run_dir if self.owns_run_dir else None
        deadline = time.monotonic() + CLEANUP_LIMIT_S

        def work():
            out = result
            if tracker is not None:
                tracker.stop()
                tracker.scan(deadline=deadline)  # whatever this process maps now
                out = remove_leftovers(tracker, exclude=exclude, deadline=deadline)
            if run_dir:
                shutil.rmtree(run_dir, ignore_errors=True)
            return out

        done, value = _bounded(work, CLEANUP_LIMIT_S + 1.0, "removing leftovers")
        if done and value is not None:
            result = value
        else:
            self.cleanup_incomplete = True
        _count("dspark_harden_lifecycle_leftovers_removed_total", n=len(result["removed"]))
        _set_phase("cleanup", time.monotonic() - t0)
        return result

    def _teardown_budget(self) -> float:
        """Upper bound of the bounded steps after the drain: the hard deadline adds a margin to it."""
        return (
            self.barrier_timeout_s
            + SCHEDULER_EXIT_TIMEOUT_S
            + CHILD_EXIT_TIMEOUT_S
            + SCAN_LIMIT_S
            + 1
            + KILL_WAIT_S
            + RTRACKER_STOP_S
            + CLEANUP_LIMIT_S
            + 1
            + HARD_EXIT_MARGIN_S
        )

    def _death_budget(self) -> float:
        return (
            SCAN_LIMIT_S
            + 1
            + ANSWER_WAIT_S
            + self.death_grace_s
            + KILL_WAIT_S
            + RTRACKER_STOP_S
            + CLEANUP_LIMIT_S
            + 1
            + HARD_EXIT_MARGIN_S
        )

    # -- SIGTERM -------------------------------------------------------------------------------
    def _open_rids(self, tm: Any) -> list[str]:
        from sglang.srt.managers.utils import HEALTH_CHECK_RID_PREFIX

        return [rid for rid in list(tm.rid_to_state) if not str(rid).startswith(HEALTH_CHECK_RID_PREFIX)]

    def answer_all(self, tm: Any, message: str, status_code: int = HTTPStatus.SERVICE_UNAVAILABLE) -> int:
        """Finish every open request with an error response (stock ``_handle_abort_req``); event loop thread.

        The status is an ``HTTPStatus``, not the int 503: stock's OpenAI streaming handlers
        (``serving_chat`` / ``serving_completions``) write the in-band ``{"error": ...}`` chunk only
        when ``finish_reason["status_code"]`` is an ``HTTPStatus``; with an int the stream ends with
        ``finish_reason: abort`` and no message."""
        from sglang.srt.managers.io_struct import AbortReq

        n = 0
        for rid in self._open_rids(tm):
            try:
                tm._handle_abort_req(
                    AbortReq(
                        rid=rid,
                        abort_message=message,
                        finished_reason={"type": "abort", "message": message, "status_code": status_code},
                    )
                )
                n += 1
            except Exception:  # noqa: BLE001 - one request must not stop answering the others
                logger.exception("dspark-harden lifecycle: answering request %s failed", rid)
        return n

    async def run_shutdown(self, tm: Any) -> None:
        """Drain, ordered teardown, cleanup. Returns after a clean shutdown (every child exited 0 on
        its own, nothing left that could not be removed); otherwise exits the process with code 6
        (:data:`EXIT_CODES`), also when the shutdown itself raised (the tree is still killed and the
        leftovers removed: never stock's SIGKILL of the main process)."""
        try:
            code = await self._shutdown(tm)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the tree goes and the exit code is ours
            code = EXIT_CODES["other"]
            logger.error(
                "dspark-harden lifecycle: the ordered shutdown failed (%s: %s); killing the process tree, "
                "removing leftovers and exiting with code %d",
                type(exc).__name__,
                exc,
                code,
                exc_info=True,
            )
            self.hard_exit.arm(self._death_budget(), code, "tearing down after the failed shutdown")
            report = _kill_children(KILL_WAIT_S)
            self.cleanup(exclude=report.survivor_idents)
        if code != 0:
            _flush_logs()
            os._exit(code)
        # stock's own exit follows (server stop hook / sys.exit(0)): it must not hang either
        self.hard_exit.arm(EXIT_GRACE_S, 0, "the process's exit after the completed shutdown")

    async def _shutdown(self, tm: Any) -> int:
        self.begin_shutdown()
        t_sig = self.shutdown_started or time.time()
        t0 = time.monotonic() - max(0.0, time.time() - t_sig)
        open_at_start = len(self._open_rids(tm))
        drain_s = self.drain_s
        status = getattr(getattr(tm, "server_status", None), "value", None)
        from sglang.srt.utils import get_bool_env_var

        if status == "UnHealthy" or get_bool_env_var("SGL_FORCE_SHUTDOWN"):
            # stock exits at once in both cases; here: no drain, the ordered teardown still runs
            drain_s = 0.0
            logger.info(
                "dspark-harden lifecycle: %s: in-flight requests are aborted at once",
                "health check failed" if status == "UnHealthy" else "SGL_FORCE_SHUTDOWN is set",
            )
        logger.info(
            "dspark-harden lifecycle: draining %d in-flight request(s) for up to %g s "
            "(DSPARK_HARDEN_SHUTDOWN_DRAIN_S); new requests get HTTP 503",
            open_at_start,
            drain_s,
        )
        # the drain and the abort are bounded too (a ZMQ send to a wedged scheduler is not)
        self.hard_exit.arm(
            drain_s + ABORT_ANSWER_TIMEOUT_S + 1 + self._teardown_budget(),
            EXIT_CODES["other"],
            "draining and aborting the in-flight requests",
        )
        deadline = t0 + drain_s
        while self._open_rids(tm) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        remaining = self._open_rids(tm)
        drained = max(0, open_at_start - len(remaining))
        _set_phase("drain", time.monotonic() - t0)
        _count("dspark_harden_shutdown_requests_total", "drained", n=drained)
        aborted = 0
        if remaining:
            t_abort = time.monotonic()
            msg = (
                f"aborted by server shutdown: the request was still running when the drain window "
                f"(DSPARK_HARDEN_SHUTDOWN_DRAIN_S={drain_s:g} s) ended"
            )
            aborted = len(remaining)
            # the schedulers finish every request with this message and HTTP 503 through their own
            # abort path (running: FINISH_ABORT(message, 503); waiting: the reason given here)
            from sglang.srt.managers.io_struct import AbortReq

            try:
                tm._dispatch_to_scheduler(
                    AbortReq(
                        rid="",
                        abort_all=True,
                        abort_message=msg,
                        finished_reason={
                            "type": "abort",
                            "message": msg,
                            "status_code": HTTPStatus.SERVICE_UNAVAILABLE,
                        },
                    )
                )
            except Exception:  # noqa: BLE001
                logger.debug("abort_all to the schedulers failed", exc_info=True)
            abort_deadline = time.monotonic() + ABORT_ANSWER_TIMEOUT_S
            while self._open_rids(tm) and time.monotonic() < abort_deadline:
                await asyncio.sleep(0.05)
            left = self._open_rids(tm)
            if left:  # schedulers did not answer in time: answer here (their late outputs are dropped)
                logger.warning(
                    "dspark-harden lifecycle: %d request(s) not answered by the schedulers %g s after "
                    "the abort; answering them with HTTP 503 here",
                    len(left),
                    ABORT_ANSWER_TIMEOUT_S,
                )
                self.answer_all(tm, msg)
            _count("dspark_harden_shutdown_requests_total", "aborted", n=aborted)
            await asyncio.sleep(0.2)  # the aborted requests' handlers write their responses on this loop
            _set_phase("abort", time.monotonic() - t_abort)
            logger.info(
                "dspark-harden lifecycle: %d request(s) still running after the drain window were "
                "answered with HTTP 503",
                aborted,
            )

        # children now exit on purpose: the stock watchdog must not call that a crash
        watchdog = getattr(tm, "_subprocess_watchdog", None)
        procs = list(getattr(watchdog, "_processes", []) or [])
        names = list(getattr(watchdog, "_names", []) or [])
        if watchdog is not None:
            watchdog.stop()
        from sglang.srt.managers.io_struct import ShutdownReq

        self.hard_exit.arm(self._teardown_budget(), EXIT_CODES["other"], "the ordered teardown")
        # what the tree holds, while it still holds it
        await _bounded_async(
            lambda: self.tracker.scan(deadline=time.monotonic() + SCAN_LIMIT_S) if self.tracker is not None else None,
            SCAN_LIMIT_S + 1.0,
            "the resource scan of the live tree",
        )
        # the schedulers, pinned by pidfd (stock's collect_scheduler_processes reads every child's
        # cmdline, which blocks without a timeout on a process wedged with its mmap lock contended)
        schedulers = _scheduler_handles()
        t_sched = time.monotonic()
        tm._dispatch_to_scheduler(ShutdownReq())
        sched_deadline = t_sched + self.barrier_timeout_s + SCHEDULER_EXIT_TIMEOUT_S
        while time.monotonic() < sched_deadline and not all(h.exited() for h in schedulers):
            await asyncio.sleep(0.05)
        stragglers = [f"pid {h.pid} ({h.name})" for h in schedulers if not h.exited()]
        for h in schedulers:
            h.close()
        _set_phase("schedulers", time.monotonic() - t_sched)
        t_children = time.monotonic()
        child_deadline = t_children + CHILD_EXIT_TIMEOUT_S
        while time.monotonic() < child_deadline and any(p.is_alive() for p in procs):
            await asyncio.sleep(0.05)
        _set_phase("children", time.monotonic() - t_children)
        failed = []
        for p, name in zip(procs, names):
            if p.is_alive():
                stragglers.append(f"pid {p.pid} ({name})")
            elif p.exitcode != 0:
                failed.append(f"{name} (pid {p.pid}) {records.describe_exit(p.exitcode)}")
        if stragglers:
            logger.warning(
                "dspark-harden lifecycle: processes still alive after ShutdownReq, killing them: %s",
                ", ".join(stragglers),
            )
        self.hard_exit.set(what="killing what is left of the process tree")
        report = await _to_thread(lambda: _kill_children(KILL_WAIT_S))
        self.hard_exit.set(what="removing leftovers")
        left = await _to_thread(lambda: self.cleanup(exclude=report.survivor_idents))
        total = time.monotonic() - t0
        _set_phase("total", total)
        if failed:
            logger.error(
                "dspark-harden lifecycle: shutdown finished in %.1f s but child process(es) failed: %s",
                total,
                "; ".join(failed),
            )
        clean = not failed and not stragglers and not report.survivors and not self.cleanup_incomplete
        logger.info(
            "dspark-harden lifecycle: shutdown complete in %.1f s: %d request(s) drained, %d aborted, "
            "every child exited %s, %d leftover(s) removed%s",
            total,
            drained,
            aborted,
            "0" if not failed and not stragglers else "(see above)",
            len(left["removed"]),
            _kept(left),
        )
        if clean:
            return 0
        return EXIT_CODES["other"]

    # -- death ------------------------------------------------------------------------------
    def cause_of(self, dead: list) -> dict:
        """The root cause among the dead processes ``[(name, pid, exitcode), ...]``, from the records
        the children wrote. A scheduler whose loop failed only because a peer died (``secondary``
        fault) is never the cause; one killed by a signal or failing on its own is."""
        ranks = records.read(self.run_dir, "rank")
        deaths = records.read(self.run_dir, "death")  # written by a controller that owns its schedulers
        faults = records.read(self.run_dir, "fault")
        items = [(name, pid, code) for name, pid, code in dead]
        for pid, rec in deaths.items():  # the controller's children: their exit codes
            if all(pid != p for _n, p, _c in items):
                items.append(("scheduler", pid, rec.get("exitcode")))

        def rank_key(item):
            name, pid, code = item
            fault = faults.get(pid)
            if pid in ranks or pid in deaths:
                if fault and fault.get("secondary"):
                    return (3, fault.get("time", 0))
                if fault:
                    return (1, fault.get("time", 0))
                return (0, 0) if code is not None and code != 0 else (2, 0)
            return (4, 0)  # not a scheduler: the controller exiting 3 after its child, or the detokenizer

        schedulers = [it for it in items if it[1] in ranks or it[1] in deaths]
        if schedulers:
            name, pid, code = min(schedulers, key=rank_key)
            rank = ranks.get(pid) or deaths.get(pid) or {}
            who = records.who(rank, f"scheduler (pid {pid})")
            how = records.describe_exit(code)
            fault = faults.get(pid)
            if fault:
                how += f" after its event loop raised {fault.get('type')}: {fault.get('message')}"
            return {
                "role": "scheduler",
                "who": who,
                "pid": pid,
                "exitcode": code,
                "dp_rank": rank.get("dp_rank"),
                "message": f"{who} (pid {pid}) {how}",
            }
        name, pid, code = items[0] if items else ("a child process", None, None)
        if pid is None:  # SIGQUIT from a child that has not exited (yet)
            return {
                "role": "other",
                "who": "a child process",
                "pid": None,
                "exitcode": None,
                "dp_rank": None,
                "message": "a child process reported a fatal error (SIGQUIT) and none has exited; see the "
                "ERROR lines above",
            }
        # a direct child without a scheduler rank record: the detokenizer, or (named "scheduler_0" by
        # stock's watchdog under DP) the DP controller
        if "detoken" in name:
            role, label = "detokenizer", "detokenizer"
        elif name.startswith("scheduler"):
            role, label = "controller", "DP controller"
        else:
            role, label = "other", name
        return {
            "role": role,
            "who": label,
            "pid": pid,
            "exitcode": code,
            "dp_rank": None,
            "message": f"{label} (pid {pid}) {records.describe_exit(code)}",
        }

    def on_child_death(self, dead: list, via: str) -> None:
        """Children died (or one reported a fatal error): answer everyone, tear down, exit non-zero."""
        with self._lock:
            if self.fault is not None:
                return
            cause = self.cause_of(dead)
            self.fault = cause
        tm = self.tm
        if tm is not None:
            try:
                tm.dspark_harden_fault = dict(cause)
            except Exception:  # noqa: BLE001
                pass
        threading.Thread(target=self._die, args=(cause, via), name="dspark-lifecycle-death", daemon=True).start()

    def _die(self, cause: dict, via: str) -> None:
        code = EXIT_CODES.get(cause["role"], EXIT_CODES["other"])
        self.hard_exit.arm(self._death_budget(), code, "stopping the server after a child's death")
        _count("dspark_harden_lifecycle_child_deaths_total", cause["role"])
        tm = self.tm
        loop = getattr(tm, "event_loop", None) if tm is not None else None
        n_open = len(self._open_rids(tm)) if tm is not None else 0
        logger.error(
            "dspark-harden lifecycle: %s; answering %d in-flight request(s) with HTTP 503 and stopping "
            "the server (exit code %d)",
            cause["message"],
            n_open,
            code,
        )
        watchdog = getattr(tm, "_subprocess_watchdog", None) if tm is not None else None
        if watchdog is not None:
            watchdog._stop_event.set()  # never join: this may run on its thread
        # the last look at what the tree holds; then the surviving processes cannot serve without the
        # dead one: the whole tree goes at once, every scheduler together with what it started (its
        # requests are answered below either way)
        self.hard_exit.set(what="the resource scan of the live tree")
        self.scan_now()
        self.hard_exit.set(what="killing the process tree")
        report = _kill_tree_now()
        answered = 0
        if tm is not None and loop is not None and n_open:
            self.hard_exit.set(what="answering the in-flight requests")
            done = threading.Event()
            box = {}

            def answer():
                try:
                    box["n"] = self.answer_all(tm, f"request failed: {cause['message']}")
                finally:
                    done.set()

            loop.call_soon_threadsafe(answer)
            done.wait(ANSWER_WAIT_S)
            answered = box.get("n", 0)
            _count("dspark_harden_lifecycle_requests_failed_total", n=answered)
            # let the handlers write their 503 responses
            deadline = time.monotonic() + self.death_grace_s
            while time.monotonic() < deadline:
                time.sleep(0.05)
        self.hard_exit.set(what="waiting for the killed processes to exit")
        _finish_kill(report, KILL_WAIT_S)
        self.hard_exit.set(what="removing leftovers")
        left = self.cleanup(exclude=report.survivor_idents)
        logger.error(
            "dspark-harden lifecycle: server stopped because %s (%d request(s) answered with 503, "
            "%d leftover(s) removed%s); exit code %d",
            cause["message"],
            answered,
            len(left["removed"]),
            _kept(left),
            code,
        )
        _flush_logs()
        os._exit(code)


MAIN = MainLifecycle()


def _flush_logs() -> None:
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()


# -- patch builders ----------------------------------------------------------------------------


def build_sigterm_handler(_stock):
    def sigterm_handler(self, signum=None, frame=None):
        first = MAIN.begin_shutdown()
        tm = self.tokenizer_manager
        if first:
            n = len(MAIN._open_rids(tm)) if tm is not None else 0
            logger.info(
                "SIGTERM received: draining %d in-flight request(s) for up to %g s, then an ordered "
                "shutdown; new requests get HTTP 503",
                n,
                MAIN.drain_s,
            )
        tm.gracefully_exit = True

    return sigterm_handler


def build_sigterm_watchdog(_stock):
    async def sigterm_watchdog(self):
        while not self.gracefully_exit:
            await asyncio.sleep(0.25)
        await MAIN.run_shutdown(self)
        if self._server_stop_hook is not None:
            current = asyncio.current_task()
            for task in self.asyncio_tasks:
                if task is not current:
                    task.cancel()
            self._server_stop_hook()
            return
        sys.exit(0)

    return sigterm_watchdog


def build_sigquit_handler(_stock):
    def running_phase_sigquit_handler(self, signum=None, frame=None):
        # A child sent SIGQUIT (stock children do on a fatal error). Find which one died.
        def find():
            watchdog = getattr(self.tokenizer_manager, "_subprocess_watchdog", None)
            procs = list(zip(getattr(watchdog, "_processes", []) or [], getattr(watchdog, "_names", []) or []))
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                dead = _dead(procs)
                if dead:
                    time.sleep(SETTLE_S)
                    MAIN.on_child_death(_dead(procs), via="sigquit")
                    return
                time.sleep(0.05)
            MAIN.on_child_death([("a child process (SIGQUIT)", None, None)], via="sigquit")

        threading.Thread(target=find, name="dspark-lifecycle-sigquit", daemon=True).start()

    return running_phase_sigquit_handler


SETTLE_S = 0.5


def _dead(procs) -> list:
    return [(name, proc.pid, proc.exitcode) for proc, name in procs if not proc.is_alive() and proc.exitcode != 0]


def build_check_processes(_stock):
    def _check_processes(self):
        MAIN.children_ready()  # the watchdog starts once every child is ready
        procs = list(zip(self._processes, self._names))
        if not _dead(procs):
            return False
        time.sleep(SETTLE_S)  # a peer failing because of this death also exits: see both, pick the cause
        MAIN.on_child_death(_dead(procs), via="watchdog")
        return True

    return _check_processes


def build_engine_shutdown(stock):
    """``Engine.shutdown`` (the offline ``sglang.Engine`` API, main process in-process): stock closes its
    sockets and kills the tree (``kill_process_tree``), which leaves the children's /dev/shm segments
    (``sgl_shm_mq_*``, ``sglang_loads_*``) and multiprocessing semaphores (``sem.mp-*``) behind; a
    launch_server main cleans those up on its own way out, an Engine's process goes on living. Here the
    live tree is scanned first, stock runs, then what the dead tree left is removed (bounded, as in the
    server's shutdown) and the tracker is released, so a later Engine in the same process tracks its
    own tree (:meth:`MainLifecycle.next_tree`)."""

    def shutdown(self):
        if getattr(self, "_attached", False) or MAIN.tracker is None:
            return stock(self)
        MAIN.scan_now()
        # pinned before stock kills them: stock's wait counts a process whose leader is a zombie as
        # gone while its other threads still hold its memory (proctree.live_tid)
        handles = [h for h in map(proctree.open_handle, proctree.descendants(os.getpid())) if h is not None]
        try:
            return stock(self)
        finally:
            alive = proctree.wait_exited(handles, KILL_WAIT_S)
            for h in handles:
                h.close()
            result = MAIN.cleanup(exclude={h.ident for h in alive})
            MAIN.next_tree()
            if result["removed"]:
                logger.info(
                    "dspark-harden lifecycle: Engine.shutdown removed %d leftover(s) of its tree: %s",
                    len(result["removed"]),
                    ", ".join(sorted(result["removed"]))[:400],
                )
            if result["kept"] or MAIN.cleanup_incomplete:
                logger.warning(
                    "dspark-harden lifecycle: Engine.shutdown left %d entries of its tree (cleanup %s): %s",
                    len(result["kept"]),
                    "cut short by its time limit" if MAIN.cleanup_incomplete else "complete",
                    "; ".join(f"{path}: {why}" for path, why in sorted(result["why"].items()))[:800],
                )

    return shutdown


def build_tm_init(stock):
    def __init__(self, server_args, port_args, *args, **kwargs):
        stock(self, server_args, port_args, *args, **kwargs)
        MAIN.attach(self, port_args)

    return __init__


class DrainGate:
    """ASGI middleware: 503 for new work while the server drains or after a child died.

    By route, not by method (:mod:`.drain_routes`): read-only routes keep working (those that wait
    for the schedulers only while they live); health/readiness probes and every work route (the 16
    stock GET routes that do work included) get 503 naming the cause; a new WebSocket session is
    refused. Costs one call while serving: routes are looked at only when refusing.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        kind = scope.get("type")
        if kind in ("http", "websocket"):
            msg = MAIN.refusing()
            if msg is not None:
                from .drain_routes import route_path, served_while_refusing

                if not served_while_refusing(
                    kind, scope.get("method", "GET"), route_path(scope), child_died=MAIN.fault is not None
                ):
                    MAIN.refused += 1
                    _count("dspark_harden_shutdown_requests_total", "refused")
                    await self._refuse(scope, msg, receive, send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope, msg: str, receive, send) -> None:
        body = json.dumps({"error": {"message": msg, "type": "ServiceUnavailable", "code": 503}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 503, "headers": headers + [(b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        # WebSocket: answer the handshake with HTTP 503 where the server offers the ASGI denial
        # response extension (uvicorn does), else close before accepting with 1013 (try again later)
        if (await receive()).get("type") != "websocket.connect":
            return
        if "websocket.http.response" in (scope.get("extensions") or {}):
            await send({"type": "websocket.http.response.start", "status": 503, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1013, "reason": msg[:120]})
