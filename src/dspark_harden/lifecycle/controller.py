"""DP controller: leave on purpose once the schedulers did, and surface its own children's deaths.

Under DP attention (the DSV4 geometry) SGLang 0.5.23 prelaunches the schedulers from the main
process and hands their pids to the controller; otherwise the controller spawns them itself. In
both cases the controller's event loop never returns on node 0, so the exit-code check after it is
unreachable and, on SIGTERM, stock SIGKILLs the controller. A monitor thread (started by the
wrapped ``DataParallelController.__init__``, once the schedulers are up):

* every scheduler exited after ``ShutdownReq`` (its ``shutdown-<pid>`` record exists): the
  controller exits 0 (ordered shutdown);
* a scheduler the controller spawned itself died otherwise: the death is recorded
  (``death-<pid>``: ranks + exit code/signal, only the parent can know it), logged naming the DP
  rank and how it died, the surviving schedulers are stopped, and the controller exits with code 3,
  which the main process's watchdog turns into the server-wide death path (:mod:`.main`);
* a prelaunched scheduler died otherwise: the main process is its parent and sees it directly;
  the controller does nothing.

Peers are stopped with everything they started (:func:`.proctree.kill_tree` through pidfds), so a
scheduler's helper processes are never orphaned. The run directory inherited from the main process
is checked before stock's ``__init__`` spawns anything: one that is not this uid's private directory
stops the controller (:class:`.records.RunDirError`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import wait

from ..core import procfs
from . import proctree, records

logger = logging.getLogger("dspark_harden.lifecycle")

SCHEDULER_DIED_EXIT = 3
PEER_KILL_WAIT_S = 10.0


def _flush() -> None:
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass


def monitor(procs: list, run_dir, exit_fn=os._exit) -> None:
    """Own children (mp.Process): wait on their sentinels."""
    live = {p.sentinel: p for p in procs if p is not None}
    total = len(live)
    while live:
        for sentinel in wait(list(live)):
            p = live.pop(sentinel)
            p.join(5)  # the sentinel fires on exit; the exit status may lag it by a moment
            code = p.exitcode
            if code == 0 and p.pid in records.read(run_dir, "shutdown"):
                continue
            rank = records.read(run_dir, "rank").get(p.pid, {})
            try:
                records.write(
                    run_dir,
                    "death",
                    p.pid,
                    {"exitcode": code, "dp_rank": rank.get("dp_rank"), "tp_rank": rank.get("tp_rank")},
                )
            except Exception as exc:  # noqa: BLE001 - the peers must still be stopped and the exit code given
                logger.error("dspark-harden lifecycle: recording the death of pid %d failed: %s", p.pid, exc)
            fault = records.read(run_dir, "fault").get(p.pid)
            how = records.describe_exit(code) + (" before shutdown was requested" if code == 0 else "")
            if fault:
                how += f" after its event loop raised {fault.get('type')}: {fault.get('message')}"
            logger.error(
                "dspark-harden lifecycle: %s (pid %d) %s; stopping %d peer scheduler(s) and the DP "
                "controller (exit code %d)",
                records.who(rank, "scheduler"),
                p.pid,
                how,
                len(live),
                SCHEDULER_DIED_EXIT,
            )
            reports = [proctree.kill_tree(q.pid, include_root=True, wait_s=0) for q in live.values()]
            for report in reports:
                proctree.await_exit(report, PEER_KILL_WAIT_S)
                if report.survivors:
                    logger.error(
                        "dspark-harden lifecycle: peer process(es) did not exit within %g s of SIGKILL: %s",
                        PEER_KILL_WAIT_S,
                        report.describe_survivors(),
                    )
                report.close()
            for q in live.values():
                q.join(5)
            _flush()
            exit_fn(SCHEDULER_DIED_EXIT)
            return
    logger.info("dspark-harden lifecycle: all %d scheduler(s) exited 0 after ShutdownReq; DP controller exits 0", total)
    _flush()
    exit_fn(0)


def monitor_pids(pids: list, run_dir, exit_fn=os._exit, interval_s: float = 0.25) -> None:
    """Prelaunched schedulers (children of the main process): exit 0 once all left after
    ShutdownReq; a death is the main process's to handle."""
    pids = list(pids)
    while True:
        if all(procfs.gone(p) for p in pids):
            shut = records.read(run_dir, "shutdown")
            if all(p in shut for p in pids):
                logger.info(
                    "dspark-harden lifecycle: all %d scheduler(s) left after ShutdownReq; DP controller exits 0",
                    len(pids),
                )
                _flush()
                exit_fn(0)
            return  # died: the main process (their parent) reports it and stops the server
        time.sleep(interval_s)


def build_controller_init(stock):
    def __init__(self, *args, **kwargs):
        run_dir = records.require_run_dir(os.environ.get(records.RUN_DIR_ENV))  # before anything is spawned
        stock(self, *args, **kwargs)
        prelaunched = getattr(self, "prelaunched_schedulers", None)
        procs = [p for p in getattr(self, "scheduler_procs", []) if p is not None]
        if prelaunched:
            pids = [pid for pid, _pipe in prelaunched.values()]
            target, args = monitor_pids, (pids, run_dir)
        elif procs:
            target, args = monitor, (procs, run_dir)
        else:
            return
        threading.Thread(target=target, args=args, name="dspark-lifecycle-schedulers", daemon=True).start()

    return __init__
