"""Which /dev/shm entries one process tree left behind, on a host where other processes create their own.

A /dev/shm name says nothing of its creator (multiprocessing's ``sem.mp-*``, SGLang's ``sgl_shm_mq_*``), so a
before/after diff of the directory also lists what other processes of the host created meanwhile (the other
pytest-xdist workers' tests). :func:`watch` is the lifecycle's own
:class:`~dspark_harden.lifecycle.resources.ResourceTracker` on the tree, scanning every few seconds (and at
each ``scan()``): it records every /dev/shm file the tree maps or holds open by identity (device, inode) --
a POSIX semaphore is mapped under ``sem_open()``'s temporary name, then renamed. :func:`created` is what is new
since a baseline and was the tree's, :func:`leftovers` the part of it no live process holds
(:func:`~dspark_harden.lifecycle.resources.holders`). What the tree creates and drops between two scans
without removing it is not seen: the checks built on it are about what a server holds while it serves
(queues, semaphores, exchange segments), which it holds for its whole life.
"""

from __future__ import annotations

import os

from ..lifecycle import resources


def entries() -> set:
    """The names in /dev/shm now."""
    try:
        return set(os.listdir(resources.SHM_DIR))
    except OSError:
        return set()


def watch(root: int, every_s: float = 2.0) -> resources.ResourceTracker:
    """Track the /dev/shm files of the process tree rooted at ``root``, scanning every ``every_s``."""
    tracker = resources.ResourceTracker(root, settle_s=every_s, rescan_s=every_s)
    tracker.notify_ready()
    tracker.start()
    return tracker


def created(tracker: resources.ResourceTracker, before: set) -> dict:
    """path -> identity of the /dev/shm entries new since ``before`` that the tree mapped or held (in use or not)."""
    return {
        path: key
        for path, key in tracker.candidates().items()
        if path.startswith(resources.SHM_DIR) and os.path.basename(path) not in before
    }


def leftovers(tracker: resources.ResourceTracker, before: set) -> list:
    """Names of the entries new since ``before`` that the tree had and no live process (this one included) holds."""
    mine = created(tracker, before)
    found = resources.holders(mine, exclude=set())
    return sorted(os.path.basename(p) for p, k in mine.items() if p not in found.in_use and k not in found.ours)
