"""``/proc/<pid>/stat`` read once, the same way everywhere (lifecycle, grammar helper, DP2, benches,
the server harness).

Only ``stat`` and ``cmdline`` of a process are read here. ``stat`` never blocks on the process's memory
(``maps``, ``environ`` and ``mem`` take its mmap lock). The ``comm`` field may contain spaces and
parentheses, so the fields are split after the *last* ``)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    pgrp: int
    start: int  # clock ticks after boot: (pid, start) identifies the process
    state: str  # R, S, D, T, t, Z, X, ...
    name: str  # comm (15 characters; setproctitle sets it: "sglang::schedul")
    utime: int  # clock ticks
    stime: int

    @property
    def cpu_seconds(self) -> float:
        return (self.utime + self.stime) / _CLK_TCK

    @property
    def exited(self) -> bool:
        """A zombie counts as exited: the kernel freed its memory and files."""
        return self.state in ("Z", "X")


def stat(pid: int) -> Optional[ProcStat]:
    """The process's ``/proc/<pid>/stat``, or None when it is gone (or the file is unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    try:
        lp, rp = raw.index("("), raw.rindex(")")
        fields = raw[rp + 2 :].split()
        return ProcStat(
            pid=int(raw[:lp]),
            ppid=int(fields[1]),
            pgrp=int(fields[2]),
            start=int(fields[19]),
            state=fields[0],
            name=raw[lp + 1 : rp],
            utime=int(fields[11]),
            stime=int(fields[12]),
        )
    except (IndexError, ValueError):
        return None


def gone(pid: int) -> bool:
    """Exited or never existed (a zombie waiting for its parent counts as exited)."""
    p = stat(pid)
    return p is None or p.exited


def cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of ``pid`` (None when it is gone)."""
    p = stat(pid)
    return None if p is None else p.cpu_seconds


def thread_states(pid: int) -> Optional[list[str]]:
    """The state letter of every thread of ``pid`` (``/proc/<pid>/task/*/stat``); None when it is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out = []
    for tid in tids:
        t = stat(int(tid)) if tid.isdigit() else None
        if t is not None:  # a thread that ended between the listing and the read is not a state
            out.append(t.state)
    return out or None


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) members of process group ``pgid``, sorted; one pass over the host's /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            p = stat(int(entry))
            if p is not None and p.pgrp == pgid and not p.exited:
                out.append(p.pid)
    return sorted(out)


def cmdline(pid: int) -> Optional[str]:
    """The command line with NULs as spaces (None when gone). Reads the process's memory: not for a
    process that may be wedged in the kernel."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
