"""Run code as another uid (test support): the tests run as root; a forked child drops to an
unused uid with setgroups/setgid/setuid before it runs. Everything the child needs must already be
imported (the interpreter's own files under /root are not readable by that uid)."""

from __future__ import annotations

import json
import os
import select
import signal
import time
import traceback

import pytest

#: the server's uid and an unrelated user's (no passwd entry needed)
SERVER_UID = 23456
OTHER_UID = 23457


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (to act as a second uid)")


def drop_to(uid: int) -> None:
    """Become ``uid`` like a process started as that user: a uid change clears the "dumpable" flag
    (its /proc files would then belong to root); a process exec'd as the user has it set."""
    import ctypes

    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE


def run_as(uid: int, fn, *args, timeout: float = 120.0):
    """``fn(*args)`` in a forked child running as ``uid``; its JSON-able result, or the child's
    exception re-raised here as AssertionError with its traceback."""
    need_root()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            drop_to(uid)
            out = {"ok": fn(*args)}
        except BaseException:  # noqa: BLE001 - handed to the parent
            out = {"error": traceback.format_exc()}
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"the child running as uid {uid} did not finish in {timeout} s")
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = json.loads(data)
    if "error" in out:
        raise AssertionError(f"in the child running as uid {uid}:\n{out['error']}")
    return out["ok"]


class Proc:
    """A forked process (optionally as ``uid``) that runs ``fn(conn)``; ``conn.ready()`` /
    ``conn.wait()`` exchange one-line messages with the test."""

    def __init__(self, fn, *args, uid: int | None = None):
        self._to_child = os.pipe()
        self._to_parent = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._to_child[1])
            os.close(self._to_parent[0])
            try:
                if uid is not None:
                    drop_to(uid)
                fn(self, *args)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                os._exit(0)
        os.close(self._to_child[0])
        os.close(self._to_parent[1])

    # in the child
    def say(self, msg: str = "ready") -> None:
        os.write(self._to_parent[1], (msg + "\n").encode())

    def hear(self) -> str:
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = os.read(self._to_child[0], 1)
            if not chunk:
                os._exit(0)  # the test went away
            buf += chunk
        return buf.decode().strip()

    # in the test
    def tell(self, msg: str) -> None:
        os.write(self._to_child[1], (msg + "\n").encode())

    def expect(self, timeout: float = 60.0) -> str:
        buf = b""
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._to_parent[0]], [], [], left)[0]:
                raise AssertionError(f"forked process {self.pid} did not answer in {timeout} s")
            chunk = os.read(self._to_parent[0], 1024)
            if not chunk:
                raise AssertionError(f"forked process {self.pid} exited")
            buf += chunk
        return buf.decode().strip()

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self) -> None:
        self.kill()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        for fd in (self._to_child[1], self._to_parent[0]):
            try:
                os.close(fd)
            except OSError:
                pass
