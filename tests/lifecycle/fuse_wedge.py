"""A real kernel wait that does not end: a minimal FUSE filesystem whose daemon reads some requests
and never answers them (test support; needs root and /dev/fuse).

A process whose request the daemon has read is waiting inside the kernel (``request_wait_answer``).
SIGKILL cannot end that wait (the kernel waits uninterruptibly for the answer of a request already in
userspace): the process stays in state ``D`` until the daemon answers or goes away — the same as a
process wedged in a GPU driver call. With ``interruptible=True`` the daemon answers a held request
with EINTR once the kernel sends the request's INTERRUPT (a signal arrived), so a blocked call
ends with its process (a plain call that never returns, like a hung NFS ``stat``); Python retries
EINTR, so a normal signal does not end it.

Entries: ``f`` (regular file, 4096 bytes: its pages are never delivered, so touching a mapping of it
blocks), ``sock`` (a socket-type entry); any other name's LOOKUP is held. SIGUSR1 to the daemon holds
every later LOOKUP/GETATTR too (a filesystem that hangs after a while). Attributes are never cached
(each ``stat`` asks the daemon).

Run as a module: ``python -m tests.lifecycle.fuse_wedge MOUNTPOINT [interruptible]``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import stat
import struct
import subprocess
import sys
import time

FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR, FUSE_OPEN, FUSE_READ = 1, 2, 3, 14, 15
FUSE_RELEASE, FUSE_FLUSH, FUSE_INIT, FUSE_INTERRUPT, FUSE_BATCH_FORGET = 18, 25, 26, 36, 42
MNT_DETACH = 2
ENTRIES = {b"f": (2, stat.S_IFREG | 0o666, 4096), b"sock": (3, stat.S_IFSOCK | 0o777, 0)}


def _attr(ino: int, mode: int, size: int) -> bytes:
    # fuse_attr: ino size blocks atime mtime ctime (u64) atimensec mtimensec ctimensec mode nlink uid gid
    # rdev blksize flags (u32)
    return struct.pack("<QQQQQQIIIIIIIIII", ino, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


def serve(mountpoint: str, interruptible: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: never outlive the test that mounted it
    fd = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"dspark-wedge", mountpoint.encode(), b"fuse", 0, opts) != 0:
        err = ctypes.get_errno()
        print(f"mount failed: {os.strerror(err)}", flush=True)
        sys.exit(2)
    hold_all = [False]
    signal.signal(signal.SIGUSR1, lambda *_: hold_all.__setitem__(0, True))
    held: set[int] = set()

    def reply(unique: int, payload: bytes = b"", err: int = 0) -> None:
        try:
            os.write(fd, struct.pack("<IiQ", 16 + len(payload), err, unique) + payload)
        except OSError:
            pass  # the request was aborted meanwhile

    print("mounted", flush=True)
    while True:
        try:
            buf = os.read(fd, 1 << 20)
        except OSError:
            return  # unmounted
        _len, op, unique, nodeid = struct.unpack_from("<IIQQ", buf)
        body = buf[40:]
        if op == FUSE_INIT:
            # fuse_init_out, protocol 7.31, no optional features
            reply(unique, struct.pack("<IIIIHHIIHHII6I", 7, 31, 0, 0, 0, 0, 4096, 0, 0, 0, 0, 0, *([0] * 6)))
        elif op in (FUSE_FORGET, FUSE_BATCH_FORGET):
            continue
        elif op == FUSE_INTERRUPT:
            (target,) = struct.unpack_from("<Q", body)
            if interruptible and target in held:
                held.discard(target)
                reply(target, err=-4)  # EINTR
        elif hold_all[0] and op in (FUSE_LOOKUP, FUSE_GETATTR):
            held.add(unique)
        elif op == FUSE_LOOKUP:
            name = body.split(b"\0")[0]
            if name in ENTRIES:
                ino, mode, size = ENTRIES[name]
                # fuse_entry_out: nodeid generation entry_valid attr_valid (u64) + nsecs (u32 x2); no caching
                reply(unique, struct.pack("<QQQQII", ino, 0, 0, 0, 0, 0) + _attr(ino, mode, size))
            else:
                held.add(unique)
        elif op == FUSE_GETATTR:
            if nodeid == 1:
                attr = _attr(1, stat.S_IFDIR | 0o755, 0)
            else:
                entry = next((e for e in ENTRIES.values() if e[0] == nodeid), (nodeid, stat.S_IFREG | 0o666, 4096))
                attr = _attr(*entry)
            reply(unique, struct.pack("<QII", 0, 0, 0) + attr)
        elif op == FUSE_OPEN:
            reply(unique, struct.pack("<QII", 1, 0, 0))
        elif op in (FUSE_RELEASE, FUSE_FLUSH):
            reply(unique)
        elif op == FUSE_READ:
            held.add(unique)
        else:
            reply(unique, err=-38)  # ENOSYS


class Wedge:
    """Mount the filesystem at ``mountpoint`` (a daemon subprocess); :meth:`release` ends every wait
    (the daemon dies: the kernel aborts its pending requests) and unmounts."""

    def __init__(self, mountpoint: str, interruptible: bool = False):
        import pytest

        if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
            pytest.skip("needs root and /dev/fuse")
        os.makedirs(mountpoint, exist_ok=True)
        self.mountpoint = mountpoint
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.lifecycle.fuse_wedge",
                mountpoint,
                "interruptible" if interruptible else "wedge",
            ],
            cwd=here,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline().strip()
        if line != "mounted":
            self.proc.kill()
            self.proc.wait(10)
            pytest.skip(f"FUSE mount not available here: {line or 'no output'}")

    def path(self, name: str) -> str:
        return os.path.join(self.mountpoint, name)

    def hold_everything(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(self.mountpoint.encode(), MNT_DETACH)

    def __enter__(self) -> "Wedge":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


if __name__ == "__main__":
    serve(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "interruptible")
