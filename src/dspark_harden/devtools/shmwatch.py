"""Which /dev/shm entries one process group left behind, on a host where other processes create their own.

A /dev/shm name says nothing of its creator (multiprocessing's ``sem.mp-*``, SGLang's ``sgl_shm_mq_*``), so a
before/after diff of the directory also lists what other processes of the host created meanwhile (the second
pytest-xdist worker's tests: the reason the server drills ran alone). :class:`ShmWatch` reads the maps of a
process group's members while it lives (every ``interval`` seconds and at :meth:`ShmWatch.sample`) and keeps
the identity (device, inode) of every /dev/shm file they map, under any name -- the lifecycle's own
:func:`~dspark_harden.lifecycle.resources.mapped_keys`: a POSIX semaphore is mapped under ``sem_open()``'s
temporary name, then renamed. :meth:`ShmWatch.created` is what is new since a baseline and was mapped by the
group, :meth:`ShmWatch.leftovers` the part of it no live process maps. What the group creates and unmaps
between two samples without removing it is not seen: the checks built on it are about what a server holds
while it serves (queues, semaphores, exchange segments), which it maps for its whole life.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable, Optional

from ..core import procfs
from ..lifecycle import resources


def entries() -> set:
    """The names in /dev/shm now."""
    try:
        return set(os.listdir(resources.SHM_DIR))
    except OSError:
        return set()


def _mapped(pids: Iterable[int]) -> set:
    dev = resources.shm_dev()
    out: set = set()
    for pid in pids:
        try:
            out |= resources.mapped_keys(pid, dev)
        except OSError:  # gone, or another user's
            continue
    return out


def mapped_anywhere(names: Iterable[str]) -> set:
    """The names among ``names`` that a live process of the host maps (not leftovers: in use)."""
    names = set(names)
    live = _mapped(int(p) for p in os.listdir("/proc") if p.isdigit())
    return {os.path.basename(p) for k, p in resources.shm_listing().items() if k in live} & names


class ShmWatch:
    """The /dev/shm files the members of process group ``pgid`` mapped while it lived."""

    def __init__(self, pgid: int, interval: float = 2.0):
        self.pgid = pgid
        self.interval = interval
        self.keys: set = set()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> "ShmWatch":
        self.keys |= _mapped(procfs.group_pids(self.pgid))
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
        return sorted(
            name
            for k, p in resources.shm_listing().items()
            if k in self.keys and (name := os.path.basename(p)) not in before
        )

    def leftovers(self, before: set) -> list:
        """Entries new since ``before`` that this group mapped and no live process maps any more."""
        mine = self.created(before)
        return sorted(set(mine) - mapped_anywhere(mine))
