"""Per-server records that let the main process say *which* process died and *how*.

A scheduler's exit status is only known to its parent (the DP controller under DP), and a
scheduler's Python exception only to itself, so every process of one server writes small JSON
records into one run directory that the main process names before it spawns anything
(``DSPARK_HARDEN_LIFECYCLE_RUN_DIR``, inherited by every child):

* ``rank-<pid>.json``: a scheduler's ranks (written when the plugin binds in it);
* ``shutdown-<pid>.json``: a scheduler received ShutdownReq (its exit 0 is then expected);
* ``fault-<pid>.json``: a scheduler's event loop raised (type, message, traceback tail);
* ``death-<pid>.json``: the parent saw the process exit (exit code / signal), with its ranks.

Records are written atomically (temp file + rename) and removed with the directory by the main
process at exit.

The directory is private: the main process creates it with ``mkdtemp`` (unpredictable name, mode
0700, owned by its effective uid; a predictable ``/tmp/...-<pid>`` could be pre-created by another
user with forged fault records). Every reader and writer checks the inherited directory first
(:func:`check_run_dir`: a real directory, not a symlink, owned by this process's effective uid, no
group/other permission bits): a writer refuses with :class:`RunDirError` (a scheduler whose
directory is not private refuses to start), a reader ignores it (logs it at ERROR once). Records
are opened with ``O_NOFOLLOW`` and must be regular files owned by the same uid.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import tempfile
import time
from typing import Optional

logger = logging.getLogger("dspark_harden.lifecycle")

RUN_DIR_ENV = "DSPARK_HARDEN_LIFECYCLE_RUN_DIR"
RUN_DIR_PREFIX = "dspark-harden-lifecycle-"


class RunDirError(RuntimeError):
    """The inherited run directory is not this server's private directory."""


def make_run_dir() -> str:
    """A new private run directory (``mkdtemp``: unpredictable name, mode 0700, this euid)."""
    return tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")


def check_run_dir(run_dir: str) -> Optional[str]:
    """None when ``run_dir`` is a private directory of this process's effective uid, else why not."""
    try:
        st = os.lstat(run_dir)
    except FileNotFoundError:
        return "it does not exist"
    except OSError as exc:
        return f"it cannot be inspected ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this process's effective uid {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not private (0700)"
    return None


def refusal(run_dir: str, why: str) -> str:
    return (
        f"dspark-harden lifecycle: refusing the run directory {RUN_DIR_ENV}={run_dir}: {why}; the main process "
        "creates a private one (mkdtemp, 0700) and every SGLang child inherits it: do not set this variable "
        "yourself"
    )


def require_run_dir(run_dir: Optional[str]) -> Optional[str]:
    """``run_dir`` if it is private (None when unset); raises :class:`RunDirError` otherwise."""
    if not run_dir:
        return None
    why = check_run_dir(run_dir)
    if why is not None:
        raise RunDirError(refusal(run_dir, why))
    return run_dir


_REFUSED_READS: set = set()


def write(run_dir: Optional[str], kind: str, pid: int, data: dict) -> Optional[str]:
    if not run_dir:
        return None
    try:
        os.mkdir(run_dir, 0o700)  # gone (removed at exit) or never made: then it is ours and private
    except (FileExistsError, FileNotFoundError):
        pass
    require_run_dir(run_dir)
    path = os.path.join(run_dir, f"{kind}-{pid}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": pid, "time": time.time(), **data}, f)
    os.replace(tmp, path)
    return path


def _load(path: str) -> Optional[dict]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        try:
            rec = json.loads(f.read(1 << 20))
        except ValueError:
            return None
    return rec if isinstance(rec, dict) else None


def read(run_dir: Optional[str], kind: str) -> dict:
    """pid -> record for every ``kind-<pid>.json`` in ``run_dir`` (nothing from a directory that is
    not private: those records could be anyone's)."""
    out: dict = {}
    if not run_dir or not os.path.isdir(run_dir):
        return out
    why = check_run_dir(run_dir)
    if why is not None:
        if run_dir not in _REFUSED_READS:
            _REFUSED_READS.add(run_dir)
            logger.error("%s; its records are ignored", refusal(run_dir, why))
        return out
    prefix = f"{kind}-"
    for name in os.listdir(run_dir):
        if not (name.startswith(prefix) and name.endswith(".json")):
            continue
        rec = _load(os.path.join(run_dir, name))
        try:
            out[int(rec["pid"])] = rec
        except (TypeError, KeyError, ValueError):
            continue
    return out


def describe_exit(exitcode: Optional[int]) -> str:
    """'killed by SIGKILL' / 'exited with code 1' / 'is still running'."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def who(rank: Optional[dict], fallback: str) -> str:
    """'DP rank 1 scheduler (TP rank 1)' from a rank record, else ``fallback``."""
    if not rank:
        return fallback
    dp, tp = rank.get("dp_rank"), rank.get("tp_rank")
    if dp is not None:
        return f"DP rank {dp} scheduler" + (f" (TP rank {tp})" if tp is not None and tp != dp else "")
    return f"scheduler TP rank {tp}" if tp is not None else fallback
