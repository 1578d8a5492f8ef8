"""Which /dev/shm entries one process tree left behind, on a host where other processes create their own.

A /dev/shm name says nothing of its creator (multiprocessing's ``sem.mp-*``, SGLang's ``sgl_shm_mq_*``), so a
before/after diff of the directory also lists what other processes of the host created meanwhile (the second
pytest-xdist worker's tests: the reason the server drills ran alone). :class:`ShmWatch` reads the
``/proc/<pid>/maps`` of a process group's members while it lives (every ``interval`` seconds and at
:meth:`ShmWatch.sample`) and keeps the inode of every /dev/shm file they map, under any name: a POSIX semaphore
is mapped under ``sem_open()``'s temporary name, which is then renamed. :meth:`ShmWatch.created` is what is new
since a baseline and was mapped by the group, :meth:`ShmWatch.leftovers` the part of it no live process maps. What the group creates and
unmaps between two samples without removing it is not seen: the checks built on it are about what a server
holds while it serves (queues, semaphores, exchange segments), which it maps for its whole life.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable, Optional

from ..core import procfs

SHM = "/dev/shm"


def entries() -> set:
    """The names in /dev/shm now."""
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def mappings(pids: Iterable[int]) -> dict:
    """{inode: path} of the /dev/shm files the processes ``pids`` map now (the path as the mapping shows it,
    without the `` (deleted)`` of an unlinked file); a process that is gone is skipped."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" not in line:
                        continue
                    parts = line.rstrip("\n").split(None, 5)
                    if len(parts) == 6 and parts[4].isdigit():
                        out[int(parts[4])] = parts[5].removesuffix(" (deleted)")
        except OSError:
            continue
    return out


def _inodes(names: Iterable[str]) -> dict:
    out = {}
    for n in names:
        try:
            out[os.lstat(os.path.join(SHM, n)).st_ino] = n
        except OSError:
            pass
    return out


def mapped_anywhere(names: Iterable[str]) -> set:
    """The names among ``names`` that a live process of the host maps (not leftovers: in use)."""
    by_ino = _inodes(names)
    live = mappings(int(p) for p in os.listdir("/proc") if p.isdigit())
    return {by_ino[i] for i in live.keys() & by_ino.keys()}


class ShmWatch:
    """The /dev/shm inodes the members of process group ``pgid`` mapped while it lived."""

    def __init__(self, pgid: int, interval: float = 2.0):
        self.pgid = pgid
        self.interval = interval
        self.inodes: set = set()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> "ShmWatch":
        self.inodes |= mappings(procfs.group_pids(self.pgid)).keys()
        return self

    def start(self) -> "ShmWatch":
        self.sample()
        self._thread = threading.Thread(target=self._run, name=f"shmwatch-{self.pgid}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> "ShmWatch":
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        return self

    def created(self, before: set) -> list:
        """Entries new since ``before`` that this group mapped (in use or not)."""
        return sorted(n for i, n in _inodes(entries() - before).items() if i in self.inodes)

    def leftovers(self, before: set) -> list:
        """Entries new since ``before`` that this group mapped and no live process maps any more."""
        mine = self.created(before)
        return sorted(set(mine) - mapped_anywhere(mine))
