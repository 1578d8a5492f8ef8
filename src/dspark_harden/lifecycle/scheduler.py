"""Scheduler and detokenizer side of the ordered shutdown, and loud scheduler failures.

* ``Scheduler.handle_shutdown`` (wrap): records ``shutdown-<pid>`` (the exit that follows is
  expected) and forwards ``ShutdownReq`` to the detokenizer, which stock never tells;
* ``Scheduler.release_host_resources`` (wrap; stock calls it in ``run_scheduler_process``'s
  ``finally`` on the graceful path, right before the non-collective
  ``abort_distributed_environment()``): after stock released host memory, every rank meets its
  peers at a gloo ``monitored_barrier`` on the world CPU group with a timeout
  (``DSPARK_HARDEN_SHUTDOWN_BARRIER_TIMEOUT_S``), so no rank tears its groups down while a peer
  still uses them (the source of NCCL/TCPStore noise on GPUs), and a dead peer costs at most the
  timeout;
* ``Scheduler.run_event_loop`` (wrap): an exception out of the loop is recorded (best effort:
  ``fault-<pid>``: type, message, traceback), logged naming the DP rank (also when the record could
  not be written), and re-raised into stock's ``run_scheduler_process`` handler, which logs the
  traceback, SIGQUITs its parent and honours ``SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION``; the process
  then exits 1 (stock: 0). A failure caused by a peer's death (collateral) exits 1 quietly, unless
  the kill-the-group opt-in is set;
* ``DetokenizerManager.event_loop`` (replace; same loop as stock): on ``ShutdownReq`` from every
  DP rank (or 2 s after the first) it leaves the loop, so the detokenizer exits 0 instead of
  being SIGKILLed.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
import traceback

from ..core import metrics, procfs, roles
from . import records

logger = logging.getLogger("dspark_harden.lifecycle")

DETOKENIZER_SHUTDOWN_GRACE_S = 2.0


def _labels():
    ctx = roles.CONTEXT
    return ("scheduler", ctx.dp_label if ctx is not None else "none")


def _set_phase(phase: str, seconds: float) -> None:
    try:
        metrics.child("dspark_harden_shutdown_phase_seconds", *_labels(), phase).set(seconds)
    except Exception:  # noqa: BLE001
        logger.debug("metric unavailable", exc_info=True)


def _rank_record() -> dict:
    ctx = roles.CONTEXT
    return {"dp_rank": getattr(ctx, "dp_rank", None), "tp_rank": getattr(ctx, "tp_rank", None)}


def _who() -> str:
    return records.who(_rank_record(), f"scheduler (pid {os.getpid()})")


def write_rank_record() -> None:
    records.write(os.environ.get(records.RUN_DIR_ENV), "rank", os.getpid(), _rank_record())


def build_handle_shutdown(stock):
    def handle_shutdown(self, recv_req):
        out = stock(self, recv_req)
        self._dspark_shutdown_t0 = time.monotonic()
        records.write(os.environ.get(records.RUN_DIR_ENV), "shutdown", os.getpid(), _rank_record())
        try:
            self.ipc_channels.send_to_detokenizer.send_output(recv_req, recv_req)
        except Exception as exc:  # noqa: BLE001 - the main process kills a detokenizer that was not told
            logger.warning(
                "dspark-harden lifecycle: %s could not forward shutdown to the detokenizer: %s: %s",
                _who(),
                type(exc).__name__,
                exc,
            )
        return out

    return handle_shutdown


def shutdown_barrier(timeout_s: float, group=None) -> str:
    """Meet every rank of the world CPU (gloo) group (or ``group``); never hangs longer than
    ``timeout_s``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return "skipped (no process group)"
    if group is None:
        from sglang.srt.distributed import parallel_state as ps

        try:
            group = ps.get_world_group().cpu_group
        except Exception as exc:  # noqa: BLE001
            return f"skipped (no world group: {type(exc).__name__})"
    world = dist.get_world_size(group)
    if world <= 1:
        return "skipped (single rank)"
    t0 = time.monotonic()
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except Exception as exc:  # noqa: BLE001 - a dead or stuck peer: go on without it
        dt = time.monotonic() - t0
        _set_phase("barrier", dt)
        _count_barrier("timeout")
        logger.warning(
            "dspark-harden lifecycle: %s: shutdown barrier of %d ranks not met after %.1f s "
            "(a peer is dead or stuck): %s; tearing down anyway",
            _who(),
            world,
            dt,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return "timeout"
    dt = time.monotonic() - t0
    _set_phase("barrier", dt)
    _count_barrier("passed")
    return f"passed ({world} ranks, {dt * 1000:.0f} ms)"


def _count_barrier(outcome: str) -> None:
    try:
        metrics.child("dspark_harden_shutdown_barriers_total", *_labels(), outcome).inc()
    except Exception:  # noqa: BLE001
        logger.debug("metric unavailable", exc_info=True)


def build_release_host_resources(barrier_timeout_s: float):
    def builder(stock):
        def release_host_resources(self):
            t0 = time.monotonic()
            try:
                return stock(self)
            finally:
                _set_phase("release", time.monotonic() - t0)
                outcome = shutdown_barrier(barrier_timeout_s)
                start = getattr(self, "_dspark_shutdown_t0", None)
                if start is not None:
                    _set_phase("total", time.monotonic() - start)
                logger.info(
                    "dspark-harden lifecycle: %s released host resources in %.0f ms; shutdown barrier %s",
                    _who(),
                    (time.monotonic() - t0) * 1000,
                    outcome,
                )

        return release_host_resources

    return builder


def dead_peers(run_dir) -> list:
    """Rank records of other schedulers of this server whose process is gone."""
    return [rec for pid, rec in records.read(run_dir, "rank").items() if pid != os.getpid() and procfs.gone(pid)]


def _killpg_opt_in() -> bool:
    """Stock's operator opt-in ``SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION`` (read the way stock reads it)."""
    try:
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION.get())
    except Exception:  # noqa: BLE001 - unreadable: stock's handler decides (we then take its path)
        return True


def _exit_code_after_stock_handler(code: int) -> None:
    """Make this scheduler process exit ``code`` after stock's ``run_scheduler_process`` returned.

    Stock's ``except Exception`` logs the traceback, SIGQUITs its parent, SIGKILLs the process group
    when ``SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION`` is set, runs its ``finally`` and *returns*: the
    process would exit 0. The scheduler is a multiprocessing child; after its target returned,
    ``Process._bootstrap`` runs ``util._exit_function``, whose last step runs the registered
    finalizers, lowest priority last. This one runs last and raises ``SystemExit(code)``, which
    ``_bootstrap`` turns into the exit code (nothing is skipped: it is the last finalizer)."""
    from multiprocessing import util

    def exit_nonzero():
        raise SystemExit(code)

    util.Finalize(None, exit_nonzero, exitpriority=-sys.maxsize)


def _record_fault(exc: BaseException, tb: str) -> tuple:
    """Best effort: (dead peers, None) or ([], the reason the record could not be written). A
    failure here must never hide the exception or the rank from the log."""
    run_dir = os.environ.get(records.RUN_DIR_ENV)
    try:
        peers = dead_peers(run_dir)
    except Exception:  # noqa: BLE001
        peers = []
    try:
        records.write(
            run_dir,
            "fault",
            os.getpid(),
            {
                **_rank_record(),
                "type": type(exc).__name__,
                "message": str(exc)[:500],
                "traceback": tb[-4000:],
                "secondary": bool(peers),
            },
        )
    except Exception as werr:  # noqa: BLE001
        return peers, f"{type(werr).__name__}: {werr}"
    return peers, None


def build_run_event_loop(stock):
    def run_event_loop(self):
        try:
            return stock(self)
        except Exception as exc:
            tb = traceback.format_exc()
            who, pid = _who(), os.getpid()
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            peers, write_error = _record_fault(exc, tb)
            if write_error is not None:
                logger.error(
                    "dspark-harden lifecycle: %s (pid %d): could not record its fault in %s (%s); the "
                    "main process names this rank from its exit code only",
                    who,
                    pid,
                    os.environ.get(records.RUN_DIR_ENV),
                    write_error,
                )
            killpg = _killpg_opt_in()
            if peers and not killpg:
                # the cause is the peer's death, which the main process reports at ERROR; stock's
                # handler would only add this collateral failure's traceback and a second SIGQUIT
                logger.warning(
                    "dspark-harden lifecycle: %s (pid %d) stopped: its peer %s is gone (%s: %s); exiting with code 1",
                    who,
                    pid,
                    ", ".join(records.who(r, f"pid {r.get('pid')}") for r in peers),
                    type(exc).__name__,
                    first,
                )
                raise SystemExit(1) from exc
            # stock's handler runs next (traceback at ERROR, SIGQUIT to the parent, and with
            # SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1 SIGKILL of the process group); then exit 1
            logger.error(
                "dspark-harden lifecycle: %s (pid %d): event loop raised %s: %s; exiting with code 1 (the "
                "server stops and answers its in-flight requests)%s",
                who,
                pid,
                type(exc).__name__,
                first,
                "; SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION is set: stock SIGKILLs the process group next"
                if killpg
                else "",
            )
            _exit_code_after_stock_handler(1)
            raise

    return run_event_loop


def _expected_shutdowns(manager) -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return max(1, int(get_parallel().num_dp_ranks))
    except Exception:  # noqa: BLE001
        return 1


def build_detokenizer_event_loop(_stock):
    def event_loop(self):
        """The event loop that handles requests (stock's, plus ShutdownReq)."""
        from sglang.srt.managers.io_struct import ShutdownReq, sock_recv, sock_send

        expected = _expected_shutdowns(self)
        seen = 0
        first_at = None
        while True:
            if first_at is not None:
                remaining = first_at + DETOKENIZER_SHUTDOWN_GRACE_S - time.monotonic()
                if remaining <= 0 or not self.recv_from_scheduler.poll(int(remaining * 1000)):
                    break
            with self.soft_watchdog.disable():
                recv_obj = sock_recv(self.recv_from_scheduler)
            if isinstance(recv_obj, ShutdownReq):
                seen += 1
                if first_at is None:
                    first_at = time.monotonic()
                if seen >= expected:
                    break
                continue
            output = self._request_dispatcher(recv_obj)
            if output is not None:
                sock_send(self.send_to_tokenizer, output)
            self.soft_watchdog.feed()
        logger.info(
            "dspark-harden lifecycle: detokenizer received shutdown from %d of %d DP rank(s); exiting 0", seen, expected
        )

    return event_loop
