"""Child side of tests/lifecycle/test_scheduler_exit.py (spawned: multiprocessing needs an importable target).

``scheduler_child`` runs stock's real ``run_scheduler_process`` (plugin loading, ``publish``, process
configuration, its ``except Exception`` handler and ``finally``) in a multiprocessing child, as the
engine does. Substituted in this child only: ``Scheduler`` is a stand-in whose ``__init__`` builds
nothing (a real one loads a model) and whose ``run_event_loop`` is the lifecycle wrap around a loop
body that raises. The child leads its own process group so that stock's
``SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION`` SIGKILL stays inside it.
"""

from __future__ import annotations

import os


def scheduler_child(pipe_writer) -> None:
    os.setpgid(0, 0)
    import sglang.srt.managers.scheduler as stock
    from sglang.srt.server_args import ServerArgs

    from dspark_harden.core import roles
    from dspark_harden.core.patch import Role
    from dspark_harden.lifecycle.scheduler import build_run_event_loop

    def loop_body(self):
        raise RuntimeError("injected loop fault")

    class MetricsReporter:
        def _shutdown_fpm(self):
            pass

    class StandInScheduler:
        def __init__(self, server_args, port_args):
            self.gracefully_exit = False
            self.async_d2h_worker = None
            self.metrics_reporter = MetricsReporter()

        def get_init_info(self):
            return {"status": "ready"}

        run_event_loop = build_run_event_loop(loop_body)

    stock.Scheduler = StandInScheduler
    roles.CONTEXT = roles.ProcessContext(role=Role.SCHEDULER, tp_rank=1, dp_rank=1)
    server_args = ServerArgs(
        model_path=os.environ["DSPARK_TEST_SCHEDULER_MODEL"],
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        device="cpu",
    )
    stock.run_scheduler_process(server_args, None, 0, 1, 0, 1, pipe_writer)
