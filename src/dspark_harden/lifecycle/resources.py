"""What a server owns outside its processes, found from the live processes themselves.

Stock SGLang's processes create POSIX shared memory (``sgl_shm_mq_*`` message queues,
``sglang_loads_*.shm`` load snapshots), multiprocessing semaphores (``sem.mp-*``) and ZMQ ``ipc://``
sockets; killed processes never unlink them. Instead of guessing by name, :class:`ResourceTracker`
records what the processes of this server tree actually map or hold open (``/proc/<pid>/maps`` and
``/proc/<pid>/fd`` entries on the ``/dev/shm`` filesystem) and which unix sockets they bound
(``/proc/<pid>/fd`` socket inodes matched against ``/proc/net/unix``), **by file identity**
(device, inode), not by name.

When it scans (:meth:`ResourceTracker.scan`): once when the main process attaches, once when the
children are ready, once :data:`SETTLE_S` later, then every :data:`RESCAN_S`, and at teardown (before
the tree is killed). Only the server's own tree is read (``/proc/<pid>/task/*/children``), never
the whole host; a process with a thread in ``D`` state (blocked in the kernel: its mmap lock may be
held or contended, so reading its maps could block without a timeout on kernels that take that lock
there) is not read, and every scan has a deadline. The state is bounded by what exists: a recorded
identity that is neither present in /dev/shm nor held by the tree any more is forgotten.

After the tree is gone, :func:`remove_leftovers` unlinks a path only when

1. the file now at that path has an identity this tree was seen holding (a name that was unlinked
   and re-created by someone else is not ours, whatever it is called);
2. no live process outside the tree maps it or holds it open (``/proc/*/maps``, ``/proc/*/fd``;
   sockets: bound in ``/proc/net/unix``);
3. every other process could be inspected: a process whose fds or maps cannot be read (another
   user's process when the server is not root, a process in ``D`` state, or the time limit ran out)
   might hold it, so every shared-memory candidate is kept and the reason logged.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import stat as S
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from . import proctree

logger = logging.getLogger("dspark_harden.lifecycle")

SHM_DIR = "/dev/shm/"
#: scans after the children are ready: at once, and this much later (segments made on first use)
SETTLE_S = 60.0
#: then this rarely (reading a process's maps may take its mmap lock on older kernels)
RESCAN_S = 600.0
#: outside the tree, a process in D state is not skipped (its mappings could hold our files): its maps
#: are read on a helper thread for at most this long; if that does not finish it counts as unreadable
D_MAPS_WAIT_S = 0.5
#: a write lease refused while /proc shows no holder is tried again for this long: a SIGKILLed
#: process's last references to a file go away after /proc stops showing them (measured here under
#: load: all 4 leftovers of an Engine refused, a lease on each granted later, nobody in /proc)
LEASE_SETTLE_S = 5.0

Key = tuple  # (st_dev, st_ino)


def shm_dev() -> Optional[int]:
    """The device number of /dev/shm (None when it cannot be read)."""
    try:
        return os.stat(SHM_DIR).st_dev
    except OSError:
        return None


def _key(st: os.stat_result) -> Key:
    return (st.st_dev, st.st_ino)


def shm_listing() -> dict[Key, str]:
    """identity -> path of every file in /dev/shm."""
    out: dict[Key, str] = {}
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return out
    for name in names:
        path = SHM_DIR + name
        try:
            out.setdefault(_key(os.lstat(path)), path)
        except OSError:
            continue
    return out


def proc_dir(p: proctree.ProcStat) -> Optional[str]:
    """Where the address space and the fd table of process ``p`` can be read: ``/proc/<pid>``, or for
    an exited leader whose other threads still run, one of those threads' ``/proc/<pid>/task/<tid>``
    (:func:`proctree.live_tid`: its own ``maps`` and ``fd`` are empty then, the threads' still show
    every mapping); None when nothing of it is alive."""
    tid = proctree.live_tid(p)
    if tid is None:
        return None
    return f"/proc/{p.pid}" if tid == p.pid else f"/proc/{p.pid}/task/{tid}"


def mapped_keys(pid: int, dev: Optional[int], where: Optional[str] = None) -> set[Key]:
    """Identities of the /dev/shm files ``pid`` maps (``dev`` = /dev/shm's device). By identity,
    not name: a POSIX semaphore is mapped under the temporary name sem_open() created and unlinked
    (``/dev/shm/sem.XXXXXX (deleted)``), then linked as ``sem.mp-*``; only the inode is the same.
    ``where``: the /proc directory to read (:func:`proc_dir`), ``/proc/<pid>`` by default.
    Raises OSError (PermissionError: another user's process) when the maps cannot be read."""
    out: set[Key] = set()
    with open(f"{where or f'/proc/{pid}'}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            try:
                major, minor = parts[3].split(":")
                line_dev = os.makedev(int(major, 16), int(minor, 16))
                ino = int(parts[4])
            except ValueError:
                continue
            if ino and (line_dev == dev or (dev is None and SHM_DIR in parts[5])):
                out.add((line_dev, ino))
    return out


def fd_holdings(pid: int, devs: set, where: Optional[str] = None) -> tuple[set[Key], set[int]]:
    """(identities of open files on a device in ``devs``, socket inodes) of ``pid``'s fds; raises
    OSError when its fd table cannot be read. Never touches the process's memory, and stats only
    targets under /dev/shm (a stat through another fd could block on a hung filesystem)."""
    files: set[Key] = set()
    socks: set[int] = set()
    base = f"{where or f'/proc/{pid}'}/fd/"
    for fd in os.listdir(base):
        try:
            target = os.readlink(base + fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            try:
                socks.add(int(target[8:-1]))
            except ValueError:
                pass
        elif target.startswith(SHM_DIR):
            try:
                st = os.stat(base + fd)
            except OSError:
                continue
            if st.st_dev in devs:
                files.add(_key(st))
    return files, socks


def unix_sockets() -> dict[int, str]:
    """socket inode -> bound path (``/proc/net/unix``)."""
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


def _stuck(pid: int) -> bool:
    return "D" in proctree.thread_states(pid)


@dataclass
class ScanReport:
    processes: int = 0
    seconds: float = 0.0
    skipped: dict = field(default_factory=dict)  # pid -> why its maps were not read


class ResourceTracker:
    """Records the shared-memory files and unix sockets of the process tree rooted here."""

    def __init__(self, root: Optional[int] = None, settle_s: float = SETTLE_S, rescan_s: float = RESCAN_S):
        self.root = root or os.getpid()
        self.settle_s, self.rescan_s = settle_s, rescan_s
        self.files: dict[Key, str] = {}  # /dev/shm identity -> last path seen
        self.sockets: dict[str, Key] = {}  # socket path -> identity of the socket file
        self.extra: set[str] = set()  # socket paths named by the server (port_args)
        self.scans = 0
        self.last: Optional[ScanReport] = None
        self.max_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- compatibility views ----------------------------------------------------------------------
    @property
    def shm(self) -> set[str]:
        with self._lock:
            return {path for path in self.files.values() if path}

    def add_paths(self, shm: Iterable[str] = (), sockets: Iterable[str] = ()) -> None:
        """Record these paths as this server's, by the identity they have now."""
        with self._lock:
            for path in shm:
                try:
                    self.files[_key(os.lstat(path))] = path
                except OSError:
                    pass
            self.extra.update(sockets)
        self._record_sockets(set(sockets))

    def _record_sockets(self, paths: set[str]) -> None:
        for path in paths:
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if S.S_ISSOCK(st.st_mode):
                with self._lock:
                    self.sockets.setdefault(path, _key(st))

    # -- scanning ----------------------------------------------------------------------------------
    def scan(self, *, skip: Iterable[int] = (), deadline: Optional[float] = None) -> ScanReport:
        """Record what the tree maps, holds open and binds now; forget what no longer exists."""
        t0 = time.perf_counter()
        report = ScanReport()
        skip = set(skip)
        dev = shm_dev()
        devs = {dev} if dev is not None else set()
        live: set[Key] = set()
        sock_inodes: set[int] = set()
        for p in proctree.tree(self.root):
            where = proc_dir(p) if p.pid not in skip else None
            if where is None:
                continue
            report.processes += 1
            if deadline is not None and time.monotonic() > deadline:
                report.skipped[p.pid] = "time limit"
                continue
            try:
                files, socks = fd_holdings(p.pid, devs, where)
                live |= files
                sock_inodes |= socks
            except OSError:
                pass
            if _stuck(p.pid):
                report.skipped[p.pid] = "a thread is in D state"
                continue
            try:
                live |= mapped_keys(p.pid, dev, where)
            except OSError:
                pass
        listing = shm_listing()
        unix = unix_sockets()
        bound = {unix[i] for i in sock_inodes if i in unix}
        with self._lock:
            known = {k: listing.get(k, path) for k, path in self.files.items() if k in listing or k in live}
            for k in live:
                if k in listing:
                    known[k] = listing[k]
                else:
                    known.setdefault(k, "")  # mapped after unlink: no name (yet); kept while held
            self.files = known
            self.sockets = {path: k for path, k in self.sockets.items() if _exists_as(path, k)}
            extra = set(self.extra)
        self._record_sockets(bound | extra)
        report.seconds = time.perf_counter() - t0
        with self._lock:
            self.scans += 1
            self.last = report
            self.max_s = max(self.max_s, report.seconds)
        logger.debug(
            "dspark-harden lifecycle: resource scan of %d process(es) in %.1f ms (%d file(s), %d socket(s) "
            "recorded; not read: %s)",
            report.processes,
            report.seconds * 1000,
            len(self.files),
            len(self.sockets),
            report.skipped or "none",
        )
        return report

    def notify_ready(self) -> None:
        """The children finished starting: scan now (and once more :attr:`settle_s` later)."""
        self._ready.set()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="dspark-lifecycle-resources", daemon=True)
        self._thread.start()

    def _scan_quietly(self) -> None:
        try:
            self.scan(deadline=time.monotonic() + 30.0)
        except Exception:  # noqa: BLE001 - bookkeeping must never take the server down
            logger.debug("resource scan failed", exc_info=True)

    def _run(self) -> None:
        self._scan_quietly()  # at attach: what exists already (ipc sockets, early segments)
        self._ready.wait(self.rescan_s)
        if self._stop.is_set():
            return
        self._scan_quietly()
        if self._stop.wait(self.settle_s):
            return
        self._scan_quietly()
        while not self._stop.wait(self.rescan_s):
            self._scan_quietly()

    def stop(self) -> None:
        self._stop.set()
        self._ready.set()

    def candidates(self) -> dict[str, Key]:
        """path -> identity of every recorded file or socket that is still where it was (or, for a
        /dev/shm identity, under whatever name it has now)."""
        listing = shm_listing()
        out: dict[str, Key] = {}
        with self._lock:
            for k in self.files:
                if k in listing:
                    out[listing[k]] = k
            for path, k in self.sockets.items():
                if _exists_as(path, k):
                    out[path] = k
        return out


def _exists_as(path: str, key: Key) -> bool:
    try:
        return _key(os.lstat(path)) == key
    except OSError:
        return False


def _maps_bounded(pid: int, dev: Optional[int], timeout_s: float, where: Optional[str] = None) -> Optional[set]:
    """mapped_keys on a helper thread; None when the read did not finish in time (a reader
    blocked on the process's mmap lock waits killably: it goes away with this process)."""
    box: dict = {}

    def run():
        try:
            box["keys"] = mapped_keys(pid, dev, where)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="dspark-lifecycle-maps", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return None
    if "error" in box:
        raise box["error"]
    return box["keys"]


@dataclass
class Holders:
    """What :func:`holders` found about the candidates."""

    in_use: dict = field(default_factory=dict)  # path -> why (a process outside the tree holds it)
    ours: set = field(default_factory=set)  # identities this process or an excluded one holds
    doubt: Optional[str] = None  # why some process could not be inspected (then a lease decides)


def holders(candidates: dict[str, Key], exclude: set, deadline: Optional[float] = None) -> Holders:
    """Who holds the candidates: a live process outside ``exclude`` (``(pid, start)`` identities;
    this process is always excluded) that maps one, holds it open or binds it; what this process
    and the excluded ones hold; and whether some process could not be inspected (its fds or maps
    unreadable: another user's or a more privileged process, or in D state with a maps read that
    did not finish in :data:`D_MAPS_WAIT_S`; or the time limit ran out)."""
    out = Holders()
    if not candidates:
        return out
    me = os.getpid()
    by_key = {k: p for p, k in candidates.items() if not S.S_ISSOCK(_mode(p))}
    socket_paths = set(candidates) - set(by_key.values())
    devs = {k[0] for k in by_key}
    dev = shm_dev()
    unreadable: dict[int, str] = {}
    excluded_socks: set[int] = set()
    unchecked = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        p = proctree.stat(int(entry))
        where = proc_dir(p) if p is not None else None
        if where is None:
            continue  # gone, or a zombie with no thread left: no files, no memory
        if p.pid == me or (p.pid, p.start) in exclude:
            try:
                files, socks = fd_holdings(p.pid, devs, where)
                excluded_socks |= socks
                out.ours |= files & by_key.keys()
                if not _stuck(p.pid):
                    out.ours |= mapped_keys(p.pid, dev, where) & by_key.keys()
            except OSError:
                pass
            continue
        if not by_key:
            continue
        if deadline is not None and time.monotonic() > deadline:
            unchecked += 1
            continue
        try:
            files, _socks = fd_holdings(p.pid, devs, where)  # never blocks on the process
        except PermissionError:
            unreadable[p.pid] = f"the open files of pid {p.pid} ({p.name}) cannot be read"
            files = set()
        except OSError:
            continue  # exited meanwhile
        for k in files & by_key.keys():
            out.in_use.setdefault(by_key[k], f"open in pid {p.pid} ({p.name})")
        try:
            if _stuck(p.pid):
                maps = _maps_bounded(p.pid, dev, D_MAPS_WAIT_S, where)
                if maps is None:
                    unreadable[p.pid] = (
                        f"pid {p.pid} ({p.name}) is in D state (blocked in the kernel) and its "
                        f"mappings could not be read within {D_MAPS_WAIT_S:g} s"
                    )
                    continue
            else:
                maps = mapped_keys(p.pid, dev, where)
        except PermissionError:
            unreadable[p.pid] = f"the mappings of pid {p.pid} ({p.name}) cannot be read"
            continue
        except OSError:
            continue
        for k in maps & by_key.keys():
            out.in_use.setdefault(by_key[k], f"mapped by pid {p.pid} ({p.name})")
    if unchecked:
        out.doubt = f"the time limit ran out with {unchecked} process(es) not inspected"
    elif unreadable:
        first = sorted(unreadable)[0]
        out.doubt = unreadable[first] + (f" (and {len(unreadable) - 1} more)" if len(unreadable) > 1 else "")
    if socket_paths:
        for inode, path in unix_sockets().items():
            if path in socket_paths and inode not in excluded_socks:
                out.in_use.setdefault(path, "bound by a live socket")
    return out


F_SETOWN, F_GETOWN, F_SETSIG, F_GETSIG, F_SETLEASE = 8, 9, 10, 11, 1024
FREE, BUSY, UNSUPPORTED, GONE = "free", "busy", "unsupported", "gone"
_READERS_COUNTED: Optional[bool] = None


def _own_fd_for(key: Key) -> Optional[int]:
    """An fd of this process on the file ``key`` (a lease taken on it does not count this
    process's own open file against itself)."""
    base = "/proc/self/fd/"
    try:
        fds = os.listdir(base)
    except OSError:
        return None
    for fd in fds:
        try:
            if _key(os.stat(base + fd)) == key:
                return int(fd)
        except (OSError, ValueError):
            continue
    return None


def _lease_and_unlink(path: str, key: Key, fd: Optional[int]) -> str:
    """Unlink ``path`` while holding a write lease on it. The kernel grants a write lease only when
    no other open file of the inode exists (an fd or a mapping, in any process and any PID namespace;
    read-only opens are counted since Linux 5.3): :data:`FREE` (unlinked), :data:`BUSY` (someone
    has it open: kept), :data:`UNSUPPORTED` (no leases here, or not this file's owner), :data:`GONE`."""
    own = fd is not None
    if not own:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except BlockingIOError:
            return BUSY  # someone else holds a lease on it
        except FileNotFoundError:
            return GONE
        except OSError:
            return UNSUPPORTED
    saved = None
    try:
        if _key(os.fstat(fd)) != key:
            return GONE
        saved = (fcntl.fcntl(fd, F_GETSIG), fcntl.fcntl(fd, F_GETOWN))
        # a break (someone opening it in the next microseconds) signals SIGURG, ignored by default,
        # instead of SIGIO, which would terminate this process
        fcntl.fcntl(fd, F_SETSIG, signal.SIGURG)
        try:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_WRLCK)
        except (BlockingIOError, PermissionError) as exc:
            return BUSY if isinstance(exc, BlockingIOError) else UNSUPPORTED
        except OSError:
            return UNSUPPORTED
        try:
            if not _exists_as(path, key):
                return GONE
            os.unlink(path)
            return FREE
        finally:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
    finally:
        if saved is not None:
            try:
                fcntl.fcntl(fd, F_SETSIG, saved[0])
                fcntl.fcntl(fd, F_SETOWN, saved[1])
            except OSError:
                pass
        if not own:
            os.close(fd)


def leases_count_readers() -> bool:
    """Whether a write lease is refused while another read-only open exists (Linux >= 5.3)."""
    global _READERS_COUNTED
    if _READERS_COUNTED is None:
        path = f"{SHM_DIR}.dspark-harden-lease-probe-{os.getpid()}-{time.monotonic_ns()}"
        a = b = None
        try:
            a = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDONLY | os.O_CLOEXEC, 0o600)
            b = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.fcntl(a, F_SETSIG, signal.SIGURG)
                fcntl.fcntl(a, F_SETLEASE, fcntl.F_WRLCK)
                fcntl.fcntl(a, F_SETLEASE, fcntl.F_UNLCK)
                _READERS_COUNTED = False
            except BlockingIOError:
                _READERS_COUNTED = True
            except OSError:
                _READERS_COUNTED = False
        except OSError:
            _READERS_COUNTED = False
        finally:
            for fd in (a, b):
                if fd is not None:
                    os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
    return _READERS_COUNTED


def _mode(path: str) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def remove_leftovers(tracker: ResourceTracker, exclude: Iterable = (), deadline: Optional[float] = None) -> dict:
    """Unlink what the (now dead) tree left behind; returns ``{"removed": [...], "kept": [...],
    "why": {path: reason}}``. ``exclude``: ``(pid, start)`` of the tree's processes that are still
    alive (killed but not dead yet): what they hold does not count as in use elsewhere.

    A shared-memory file is removed only while the kernel confirms (write lease) that nobody has it
    open; when that cannot be confirmed because this process or an excluded one holds it, or leases
    are not available, the /proc inspection decides, and it must have been complete. A lease refused
    while /proc shows no holder is tried again for up to :data:`LEASE_SETTLE_S` (the killed tree's last
    references can outlive what /proc shows of it), /proc looked at again each time."""
    exclude = set(exclude)
    exclude |= {(p.pid, p.start) for p in proctree.descendants(tracker.root)}
    candidates = tracker.candidates()
    found = holders(candidates, exclude, deadline)
    decisive = leases_count_readers()
    removed, kept, why = [], [], {}
    unseen: dict[str, Key] = {}  # lease refused, no holder in /proc: tried again below

    def keep(path: str, reason: str) -> None:
        kept.append(path)
        why[path] = reason

    def attempt(path: str, key: Key, found: Holders) -> None:
        if path in found.in_use:
            keep(path, found.in_use[path])
            return
        if not _exists_as(path, key):  # replaced since the check: not ours any more
            return
        try:
            if S.S_ISSOCK(_mode(path)):
                os.unlink(path)
                removed.append(path)
                return
            outcome = _lease_and_unlink(path, key, _own_fd_for(key) if key in found.ours else None)
            if outcome == FREE:
                removed.append(path)
                if not decisive and found.doubt:  # leases ignore read-only opens here: /proc decided
                    logger.warning(
                        "dspark-harden lifecycle: removed %s although %s (this kernel's leases do not "
                        "see read-only opens)",
                        path,
                        found.doubt,
                    )
                return
            if outcome == GONE:
                return
            if outcome == BUSY and key not in found.ours:
                unseen[path] = key
                return
            # BUSY because this process or a killed one holds it, or UNSUPPORTED: /proc decides
            if found.doubt:
                keep(path, f"may be in use: {found.doubt}")
                return
            if _exists_as(path, key):
                os.unlink(path)
                removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            keep(path, exc.strerror or str(exc))

    for path in sorted(candidates):
        attempt(path, candidates[path], found)
    settle_end = time.monotonic() + LEASE_SETTLE_S
    if deadline is not None:
        settle_end = min(settle_end, deadline)
    pause, tries, t_settle = 0.02, 1, time.monotonic()
    refused = len(unseen)
    while unseen and time.monotonic() + pause < settle_end:
        time.sleep(pause)
        pause, tries = min(pause * 2, 0.5), tries + 1
        retry, unseen = unseen, {}
        again = holders(retry, exclude, deadline)
        for path in sorted(retry):
            attempt(path, retry[path], again)
    if refused:
        logger.info(
            "dspark-harden lifecycle: %d leftover(s) refused a write lease with no holder in /proc; after %d "
            "attempt(s) in %.0f ms %d still refused",
            refused,
            tries,
            (time.monotonic() - t_settle) * 1000,
            len(unseen),
        )
    for path in sorted(unseen):
        keep(
            path,
            "open in a process /proc does not show (another PID namespace or an uninspectable "
            f"process): the kernel refused a write lease {tries} time(s) in {LEASE_SETTLE_S:g} s",
        )
    return {"removed": removed, "kept": kept, "why": why}
