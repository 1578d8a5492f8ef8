"""DP controller: the parent of the schedulers, so the only process that learns how one exited.

Stock 0.5.23's controller never looks: its event loop does not return on node 0, so the exit-code
check after it is unreachable, and a scheduler that died is noticed only when the whole tree
crashes. A monitor thread (started by the wrapped ``DataParallelController.__init__``, once the
schedulers are up) waits on every scheduler's process sentinel:

* every scheduler exited 0 after ``ShutdownReq`` (its ``shutdown-<pid>`` record exists): the
  controller exits 0 too (ordered shutdown; stock's was SIGKILLed by the main process);
* otherwise the first death is recorded (``death-<pid>``: ranks + exit code/signal), logged naming
  the DP rank and how it died, the surviving schedulers are stopped (they cannot continue without
  their peer, and would only add collective-timeout tracebacks), and the controller exits with
  code 3, which the main process's watchdog turns into the server-wide death path
  (:mod:`.main`).
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import wait

from . import records

logger = logging.getLogger("dspark_harden.lifecycle")

SCHEDULER_DIED_EXIT = 3


def monitor(procs: list, run_dir, exit_fn=os._exit) -> None:
    live = {p.sentinel: p for p in procs if p is not None}
    total = len(live)
    while live:
        for sentinel in wait(list(live)):
            p = live.pop(sentinel)
            p.join(0)
            code = p.exitcode
            if code == 0 and p.pid in records.read(run_dir, "shutdown"):
                continue
            rank = records.read(run_dir, "rank").get(p.pid, {})
            records.write(run_dir, "death", p.pid, {"exitcode": code, "dp_rank": rank.get("dp_rank"),
                                                   "tp_rank": rank.get("tp_rank")})
            fault = records.read(run_dir, "fault").get(p.pid)
            how = records.describe_exit(code) + (
                " before shutdown was requested" if code == 0 else "")
            if fault:
                how += f" after its event loop raised {fault.get('type')}: {fault.get('message')}"
            logger.error("dspark-harden lifecycle: %s (pid %d) %s; stopping %d peer scheduler(s) and the DP "
                         "controller (exit code %d)", records.who(rank, "scheduler"), p.pid, how, len(live),
                         SCHEDULER_DIED_EXIT)
            for q in live.values():
                try:
                    q.kill()
                except Exception:  # noqa: BLE001
                    pass
            for q in live.values():
                q.join(5)
            _flush()
            exit_fn(SCHEDULER_DIED_EXIT)
            return
    logger.info("dspark-harden lifecycle: all %d scheduler(s) exited 0 after ShutdownReq; DP controller exits 0",
                total)
    _flush()
    exit_fn(0)


def _flush() -> None:
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass


def build_controller_init(stock):
    def __init__(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        procs = [p for p in getattr(self, "scheduler_procs", []) if p is not None]
        if procs:
            run_dir = os.environ.get(records.RUN_DIR_ENV)
            threading.Thread(target=monitor, args=(procs, run_dir), name="dspark-lifecycle-schedulers",
                             daemon=True).start()

    return __init__
