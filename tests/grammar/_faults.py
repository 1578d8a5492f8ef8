"""Fault drivers for tests/grammar/test_no_wedge.py (issue 21): real processes, real signals, real
uids, real mounts. Nothing here replaces a part of the system under test; each helper creates the
condition a fault produces on a real host (a paused helper, a stopped lock holder, a second uid, a
full or read-only file system, a library that prints)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable, Optional

from dspark_harden.core import procfs
from dspark_harden.grammar.persist import CompileSlots, PersistSettings

SECOND_UID = 65534  # "nobody": any uid other than ours will do; it needs no passwd entry


class PausingSlots(CompileSlots):
    """Compile slots whose request compiles fill every slot the moment the next ``pause`` helper
    jobs start: the helper is paused at once, as when every worker serves requests. ``release()``
    frees the slots again."""

    def __init__(self, limit: int, pause: int = 1):
        super().__init__(limit)
        self.to_pause = pause
        self.held = 0

    def helper_started(self, pid: int) -> None:
        super().helper_started(pid)
        if self.to_pause > 0:
            self.to_pause -= 1
            for _ in range(self.limit - self.active):
                self.__enter__()
                self.held += 1

    def release(self) -> None:
        while self.held:
            self.held -= 1
            self.__exit__(None, None, None)


def persist_settings(**kw: Any) -> PersistSettings:
    """PersistSettings with the fields this code base knows (a field the code under test lacks is
    dropped, so the same test runs against older code and fails on its behaviour, not on a name)."""
    known = {f.name for f in dataclasses.fields(PersistSettings)}
    return PersistSettings(**{k: v for k, v in kw.items() if k in known})


def proc_state(pid: int) -> Optional[str]:
    """The process state letter (R, S, T, Z, ...) or None when no such process exists."""
    p = procfs.stat(pid)
    return None if p is None else p.state


def proc_ppid(pid: int) -> Optional[int]:
    p = procfs.stat(pid)
    return None if p is None else p.ppid


def alive(pid: int) -> bool:
    """A process that still exists and is not a zombie (a zombie holds no lock and runs nothing)."""
    return proc_state(pid) not in (None, "Z", "X")


def wait_for(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.01) -> Any:
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)


_HOLDER = textwrap.dedent("""
    import fcntl, os, signal, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    sys.stdout.write("locked\\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGSTOP)
""")


def stopped_lock_holder(path: str) -> subprocess.Popen:
    """A process that takes an exclusive flock on ``path`` and then stops itself (state T), as a
    process SIGSTOPped or frozen while it held the lock."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, path], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    wait_for(lambda: proc_state(p.pid) == "T", 30, "the lock holder to stop")
    return p


def end_process(p: subprocess.Popen) -> None:
    try:
        p.kill()
    except ProcessLookupError:
        pass
    p.wait(timeout=30)


# -- forked children with another uid or their own mounts ----------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x00020000
MS_RDONLY = 1
MS_REC = 16384
MS_PRIVATE = 1 << 18


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def private_mount_namespace() -> None:
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")


def mount_tmpfs(path: str, options: str, readonly: bool = False) -> None:
    _check(
        _libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_RDONLY if readonly else 0, options.encode()),
        f"mount tmpfs {path}",
    )


def in_child(fn: Callable[[], Any], *, uid: Optional[int] = None, timeout: float = 120) -> Any:
    """Run ``fn`` in a forked child (optionally as ``uid``) and return what it returned (JSON); an
    exception in the child is re-raised here as AssertionError with its text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            payload = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001
            payload = {"exc": f"{type(exc).__name__}: {exc}"}
        try:
            os.write(w, json.dumps(payload, default=str).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    end = time.monotonic() + timeout
    try:
        while True:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            if time.monotonic() > end:
                raise AssertionError("child timed out")
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"exc": "child died without a report"}')
    if "exc" in out:
        raise AssertionError(f"child failed: {out['exc']}")
    return out["ok"]


# -- a chatty or crashing library inside the helper ----------------------------------------------

SITECUSTOMIZE = textwrap.dedent('''
    """Test fault injection for the grammar persistence helper (DSPARK_TEST_HELPER_FAULT)."""
    import os
    import sys

    _fault = os.environ.get("DSPARK_TEST_HELPER_FAULT", "")
    if _fault:
        import xgrammar

        _orig = xgrammar.GrammarCompiler.compile_regex

        def compile_regex(self, regex, *args, **kwargs):
            if _fault == "print":  # a library that prints, from Python and from C, while compiling
                print('{"level": "info", "msg": "a chatty library"}', flush=True)
                os.write(1, b'{"status": "published", "stored": "serialized", "total": 0}\\n')
            elif _fault == "abort" and "crash" in regex:
                os.abort()
            elif _fault == "badalloc" and "crash" in regex:
                sys.stderr.write("terminate called after throwing an instance of 'std::bad_alloc'\\n")
                sys.stderr.flush()
                os.abort()
            return _orig(self, regex, *args, **kwargs)

        xgrammar.GrammarCompiler.compile_regex = compile_regex
''')


def fault_env(monkeypatch, tmp_path, fault: str) -> None:
    """Make every helper started from now on load SITECUSTOMIZE with ``fault``."""
    d = tmp_path / "sitecustomize-dir"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(d), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DSPARK_TEST_HELPER_FAULT", fault)


def sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
