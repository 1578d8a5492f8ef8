"""The server's process tree, read from /proc and signalled only through pidfds.

* :func:`descendants` walks ``/proc/<pid>/task/<tid>/children`` from a root (only the tree is read,
  not every process of the host); each process is identified by its pid **and** its start time
  (``/proc/<pid>/stat`` field 22), so a pid that was reaped and reused is never taken for the process
  that had it.
* :func:`open_handle` pins a process with ``os.pidfd_open`` and then checks that the pid still has
  the start time it had in the snapshot: from then on every signal goes through the pidfd
  (``signal.pidfd_send_signal``) and can only reach that process, and its exit is seen by polling
  the pidfd (a zombie counts as exited: the kernel freed its memory and files).
* :func:`kill_tree` stops every descendant with SIGSTOP through its pidfd, walking again until a
  walk finds nothing new (a stopped process cannot fork, and its children stay its children instead
  of being reparented away), then SIGKILLs them all together and waits a bounded time. A process
  that does not die (blocked in the kernel: state ``D``, e.g. inside a GPU driver call) is returned
  as a survivor, named with its state and kernel wait channel; it never raises.
* :func:`become_subreaper` (``PR_SET_CHILD_SUBREAPER``): processes orphaned anywhere below the main
  process (a scheduler killed by the OOM killer leaves its helper children) are reparented to the
  main process instead of init, so they are still in its tree when it tears the tree down.

Nothing here reads ``/proc/<pid>/cmdline``, ``environ`` or ``mem`` of another process: those take
its mmap lock and block without a timeout when the process is wedged in the kernel with that lock
contended (psutil's ``cmdline()``, which stock ``collect_scheduler_processes`` uses, does).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from ..core.procfs import ProcStat, stat

logger = logging.getLogger("dspark_harden.lifecycle")

PR_SET_CHILD_SUBREAPER = 36
#: a walk that keeps finding new processes after this many rounds is given up (each round stops
#: what it found, so only a fork storm faster than SIGSTOP could get here)
MAX_STOP_ROUNDS = 50


def task_states(pid: int) -> dict[int, str]:
    """tid -> state of every thread of ``pid`` (``/proc/<pid>/task/<tid>/stat``); empty when gone."""
    out: dict[int, str] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                out[int(tid)] = f.read().rsplit(b")", 1)[1].split()[0].decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def thread_states(pid: int) -> str:
    """The states of every thread of ``pid`` (``/proc/<pid>/stat`` shows only the leader's: a
    worker thread blocked in a driver call is ``D`` while the leader sleeps)."""
    return "".join(task_states(pid).values())


def live_tid(p: ProcStat) -> Optional[int]:
    """A live thread of process ``p``: its pid while the leader runs; while the leader is ``Z`` (it
    exited) another thread of it that still runs; None when nothing of it is alive.

    A SIGKILLed multi-threaded process often looks like that for a while: the leader is ``Z`` in
    ``/proc/<pid>/stat`` while its other threads still tear the address space down, so its memory,
    its files and the kernel's refusal of a write lease on them are all still there (stock
    ``kill_process_tree`` counts such a zombie as gone; a pidfd turns readable only when the whole
    thread group exited)."""
    if p.state not in ("Z", "X"):
        return p.pid
    for tid, state in task_states(p.pid).items():
        if tid != p.pid and state not in ("Z", "X"):
            return tid
    return None


def wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().strip() or "-"
    except OSError:
        return "?"


def _has_children_files() -> bool:
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's ``children`` file: a child belongs to the thread
    that forked it)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def _children_by_ppid() -> dict[int, list[int]]:
    """Fallback without CONFIG_PROC_CHILDREN: one pass over the host's /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            p = stat(int(entry))
            if p is not None:
                out.setdefault(p.ppid, []).append(p.pid)
    return out


def descendants(root: int, skip: Iterable[int] = ()) -> list[ProcStat]:
    """Live descendants of ``root`` (not ``root``); the subtree of a pid in ``skip`` is left out."""
    skip = set(skip)
    by_ppid = None if _has_children_files() else _children_by_ppid()
    out: list[ProcStat] = []
    seen = {root}
    todo = [root]
    while todo:
        pid = todo.pop()
        kids = children(pid) if by_ppid is None else by_ppid.get(pid, [])
        for kid in kids:
            if kid in seen or kid in skip:
                continue
            seen.add(kid)
            p = stat(kid)
            if p is None:
                continue
            out.append(p)
            todo.append(kid)
    return out


def tree(root: int) -> list[ProcStat]:
    """``root`` (if alive) and its live descendants."""
    me = stat(root)
    return ([me] if me is not None else []) + descendants(root)


@dataclass(eq=False)
class Handle:
    """A process pinned by a pidfd."""

    pid: int
    start: int
    name: str
    fd: int

    @property
    def ident(self) -> tuple[int, int]:
        return (self.pid, self.start)

    def send(self, sig: int) -> bool:
        try:
            signal.pidfd_send_signal(self.fd, sig)
            return True
        except ProcessLookupError:  # exited (and reaped): nothing to signal
            return False
        except OSError:
            return False

    def exited(self) -> bool:
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        return bool(p.poll(0))

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


def open_handle(proc: ProcStat) -> Optional[Handle]:
    """Pin ``proc`` with a pidfd, or None when that process is gone. The start time is compared
    *after* pidfd_open: if the pid was reused between the snapshot and the open, the pidfd refers to
    the new process, whose start time differs, and it is closed unused."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # ESRCH: gone
        return None
    now = stat(proc.pid)
    if now is None or now.start != proc.start:
        os.close(fd)
        return None
    return Handle(pid=proc.pid, start=proc.start, name=proc.name, fd=fd)


def wait_exited(handles: Iterable[Handle], timeout_s: float) -> list[Handle]:
    """Wait until every handle's process exited or ``timeout_s`` passed; returns those still alive."""
    live = {h.fd: h for h in handles if h.fd >= 0}
    deadline = time.monotonic() + max(0.0, timeout_s)
    while live:
        poller = select.poll()
        for fd in live:
            poller.register(fd, select.POLLIN)
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ev in poller.poll(min(left, 1.0) * 1000):
            live.pop(fd, None)
    return list(live.values())


@dataclass
class KillReport:
    killed: list[Handle] = field(default_factory=list)
    survivors: list[dict] = field(default_factory=list)  # {pid, name, state, wchan}
    incomplete: bool = False  # the walk never converged (MAX_STOP_ROUNDS)

    @property
    def survivor_idents(self) -> set[tuple[int, int]]:
        return {(s["pid"], s["start"]) for s in self.survivors}

    def describe_survivors(self) -> str:
        return ", ".join(f"pid {s['pid']} ({s['name']}, state {s['state']}, in {s['wchan']})" for s in self.survivors)

    def close(self) -> None:
        for h in self.killed:
            h.close()


def kill_tree(root: int, *, include_root: bool = False, skip: Iterable[int] = (), wait_s: float = 30.0) -> KillReport:
    """SIGSTOP every descendant of ``root`` (and ``root`` itself with ``include_root``) through a
    pidfd until a walk finds no new process, SIGKILL them all, then wait up to ``wait_s`` for them
    to exit (:func:`await_exit`; ``wait_s=0``: do not wait). Processes in ``skip`` (and their
    subtrees) are left alone. Never raises."""
    report = KillReport()
    held: dict[tuple[int, int], Handle] = {}
    skip = set(skip)
    try:
        for _round in range(MAX_STOP_ROUNDS):
            found = []
            procs = descendants(root, skip)
            if include_root:
                me = stat(root)
                if me is not None:
                    procs.insert(0, me)
            for p in procs:
                if (p.pid, p.start) in held or live_tid(p) is None:
                    continue
                h = open_handle(p)
                if h is None:
                    continue
                held[h.ident] = h
                h.send(signal.SIGSTOP)
                found.append(h)
            if not found:
                break
        else:
            report.incomplete = True
    except Exception:  # noqa: BLE001 - a teardown must go on; whatever was pinned gets its SIGKILL
        logger.exception("dspark-harden lifecycle: walking the process tree of pid %d failed", root)
    for h in held.values():
        h.send(signal.SIGKILL)
    report.killed = list(held.values())
    if wait_s > 0:
        await_exit(report, wait_s)
    return report


def await_exit(report: KillReport, wait_s: float) -> KillReport:
    """Wait up to ``wait_s`` for the killed processes; those still alive become ``survivors``."""
    report.survivors = []
    for h in wait_exited(report.killed, wait_s):
        now = stat(h.pid)
        report.survivors.append(
            {
                "pid": h.pid,
                "start": h.start,
                "name": h.name,
                "state": now.state if now is not None else "?",
                "wchan": wchan(h.pid),
            }
        )
    return report


def become_subreaper() -> bool:
    """Adopt the orphans of the tree below this process (``PR_SET_CHILD_SUBREAPER``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return True
    except Exception as exc:  # noqa: BLE001
        logger.warning(
            "dspark-harden lifecycle: cannot become the child subreaper (%s); an orphaned grandchild "
            "would escape the teardown",
            exc,
        )
        return False


def is_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        out = ctypes.c_int(0)
        libc.prctl(37, ctypes.byref(out), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
        return bool(out.value)
    except Exception:  # noqa: BLE001
        return False
