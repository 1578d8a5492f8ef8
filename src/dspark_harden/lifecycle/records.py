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
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from typing import Optional

RUN_DIR_ENV = "DSPARK_HARDEN_LIFECYCLE_RUN_DIR"


def default_run_dir(main_pid: Optional[int] = None) -> str:
    return os.path.join(tempfile.gettempdir(), f"dspark-harden-lifecycle-{main_pid or os.getpid()}")


def write(run_dir: Optional[str], kind: str, pid: int, data: dict) -> Optional[str]:
    if not run_dir:
        return None
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, f"{kind}-{pid}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"pid": pid, "time": time.time(), **data}, f)
    os.replace(tmp, path)
    return path


def read(run_dir: Optional[str], kind: str) -> dict:
    """pid -> record for every ``kind-<pid>.json`` in ``run_dir``."""
    out: dict = {}
    if not run_dir or not os.path.isdir(run_dir):
        return out
    prefix = f"{kind}-"
    for name in os.listdir(run_dir):
        if not (name.startswith(prefix) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(run_dir, name)) as f:
                rec = json.load(f)
            out[int(rec["pid"])] = rec
        except (OSError, ValueError, KeyError):
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
