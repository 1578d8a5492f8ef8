"""What a server owns outside its processes, found from the live processes themselves.

Stock SGLang's processes create POSIX shared memory (``sgl_shm_mq_*`` message queues,
``sglang_loads_*.shm`` load snapshots), multiprocessing semaphores (``sem.mp-*``) and ZMQ ``ipc://``
sockets; killed processes never unlink them. Instead of guessing by name, :class:`ResourceTracker`
records what the processes of this server tree actually map (``/proc/<pid>/maps`` entries under
``/dev/shm``) and which unix sockets they bound (``/proc/<pid>/fd`` socket inodes matched against
``/proc/net/unix``), while they run. After the tree is gone, :func:`remove_leftovers` unlinks every
recorded path that still exists and no live process outside the tree maps or binds.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Iterable, Optional

logger = logging.getLogger("dspark_harden.lifecycle")

SHM_DIR = "/dev/shm/"


def tree_pids(root: int) -> list[int]:
    """``root`` and its live descendants (from /proc, no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(rest) >= 2:
            children.setdefault(int(rest[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def mapped_shm_inodes(pid: int) -> set[int]:
    """Inodes of the /dev/shm files ``pid`` maps. By inode, not name: a POSIX semaphore is mapped
    under the temporary name sem_open() created and unlinked (``/dev/shm/sem.XXXXXX (deleted)``),
    then linked as ``sem.mp-*``; only the inode is the same."""
    out = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if SHM_DIR not in line:
                    continue
                parts = line.split()
                if len(parts) >= 6:
                    try:
                        out.add(int(parts[4]))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def shm_files_by_inode() -> dict[int, str]:
    out = {}
    try:
        for name in os.listdir(SHM_DIR):
            path = SHM_DIR + name
            try:
                out.setdefault(os.lstat(path).st_ino, path)
            except OSError:
                continue
    except OSError:
        pass
    return out


def mapped_shm(pid: int) -> set[str]:
    """Current /dev/shm paths of the files ``pid`` maps."""
    inodes = mapped_shm_inodes(pid)
    return {path for ino, path in shm_files_by_inode().items() if ino in inodes}


def _unix_inodes() -> dict[int, str]:
    out = {}
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[7].startswith("/"):
                    out[int(parts[6])] = parts[7]
    except OSError:
        pass
    return out


def bound_sockets(pids: Iterable[int], inodes: Optional[dict] = None) -> set[str]:
    inodes = _unix_inodes() if inodes is None else inodes
    out = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                path = inodes.get(int(target[8:-1]))
                if path:
                    out.add(path)
    return out


class ResourceTracker:
    """Records the shared-memory files and unix sockets of the process tree rooted here."""

    def __init__(self, root: Optional[int] = None, interval_s: float = 3.0):
        self.root = root or os.getpid()
        self.interval_s = interval_s
        self.shm: set[str] = set()
        self.shm_inodes: set[int] = set()
        self.sockets: set[str] = set()
        self.pids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def add_paths(self, shm: Iterable[str] = (), sockets: Iterable[str] = ()) -> None:
        with self._lock:
            self.shm.update(shm)
            self.sockets.update(sockets)

    def scan(self) -> None:
        pids = tree_pids(self.root)
        inodes: set[int] = set()
        for pid in pids:
            inodes |= mapped_shm_inodes(pid)
        files = shm_files_by_inode()
        socks = bound_sockets(pids)
        with self._lock:
            self.pids.update(pids)
            self.shm_inodes |= inodes
            self.shm |= {path for ino, path in files.items() if ino in self.shm_inodes}
            self.sockets |= socks

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="dspark-lifecycle-resources", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - bookkeeping must never take the server down
                logger.debug("resource scan failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()


def _in_use_elsewhere(paths: set[str], exclude: set[int]) -> set[str]:
    """Paths still mapped (shm) or bound (sockets) by a live process not in ``exclude``."""
    if not paths:
        return set()
    used: set[str] = set()
    shm_paths = {p for p in paths if p.startswith(SHM_DIR)}
    inodes = _unix_inodes()
    # sockets still bound by a live process; the main process's own are about to go with it
    bound_now = set(inodes.values()) - bound_sockets([os.getpid()], inodes)
    used |= {p for p in paths if p in bound_now and not p.startswith(SHM_DIR)}
    if shm_paths:
        ino_of = {}
        for p in shm_paths:
            try:
                ino_of[os.lstat(p).st_ino] = p
            except OSError:
                pass
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in exclude:
                continue
            used |= {ino_of[i] for i in mapped_shm_inodes(int(entry)) if i in ino_of}
    return used


def remove_leftovers(tracker: ResourceTracker, extra: Iterable[str] = ()) -> dict:
    """Unlink what the (now dead) tree left behind; returns {"removed": [...], "kept": [...]}."""
    files = shm_files_by_inode()
    with tracker._lock:
        candidates = set(tracker.shm) | set(tracker.sockets) | set(extra)
        candidates |= {path for ino, path in files.items() if ino in tracker.shm_inodes}
    candidates = {p for p in candidates if os.path.lexists(p)}
    alive_tree = {p for p in tree_pids(tracker.root) if p != os.getpid()}
    in_use = _in_use_elsewhere(candidates, exclude={os.getpid()} | alive_tree) if candidates else set()
    removed, kept = [], []
    for path in sorted(candidates):
        if path in in_use:
            kept.append(path)
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            kept.append(f"{path} ({exc.strerror})")
    return {"removed": removed, "kept": kept}
