"""The machine-wide "one real SGLang server at a time" lock.

It is the same lock as ``flock /tmp/dspark-server.lock <command>`` (``flock(2)`` on the same file),
so servers started by tests, by ``make demo`` and by hand all exclude each other. Re-entrant inside
one process (a test that needs two servers at once — e.g. stock vs hardened — takes it once).
In CI every server test runs in one pytest-xdist worker (tests/conftest.py), so the lock is uncontended.

- ``DSPARK_SERVER_LOCK``: lock file (default ``/tmp/dspark-server.lock``)
- ``DSPARK_SERVER_LOCK_TIMEOUT``: seconds to wait for it before failing (default 3600)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time

DEFAULT_LOCK = "/tmp/dspark-server.lock"

_state = threading.RLock()
_fd: int | None = None
_depth = 0


def lock_path() -> str:
    return os.environ.get("DSPARK_SERVER_LOCK") or DEFAULT_LOCK


def env_seconds(name: str, default: str) -> float:
    """A positive number of seconds from the environment (strict, error names the variable)."""
    from dspark_harden.core.settings import positive_float

    try:
        return positive_float(os.environ.get(name, default))
    except ValueError as exc:
        raise ValueError(f"{name} (seconds) {exc}") from None


def _timeout() -> float:
    return env_seconds("DSPARK_SERVER_LOCK_TIMEOUT", "3600")


def acquire() -> None:
    """Take the server lock (blocking up to DSPARK_SERVER_LOCK_TIMEOUT); re-entrant per process."""
    global _fd, _depth
    with _state:
        if _depth > 0:
            _depth += 1
            return
        path = lock_path()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # non-inheritable (PEP 446)
        deadline = time.monotonic() + _timeout()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise TimeoutError(
                        f"waited {_timeout():.0f}s for the server lock {path} (another SGLang server is running; "
                        f"raise DSPARK_SERVER_LOCK_TIMEOUT or wait)"
                    ) from None
                time.sleep(1.0)
        _fd, _depth = fd, 1


def release() -> None:
    global _fd, _depth
    with _state:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0 and _fd is not None:
            try:
                fcntl.flock(_fd, fcntl.LOCK_UN)
            finally:
                os.close(_fd)
                _fd = None


def held() -> bool:
    return _depth > 0


@contextlib.contextmanager
def server_lock():
    acquire()
    try:
        yield
    finally:
        release()
