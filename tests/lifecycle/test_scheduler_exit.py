"""A scheduler whose event loop raises keeps stock's exit path and names its rank (issue 21 item 9a).

Stock's real ``run_scheduler_process`` runs in a multiprocessing (spawn) child of a parent process
that counts the SIGQUITs it receives (tests/lifecycle/sched_exit_child.py: only the Scheduler object
is a stand-in). Each case checks, from outside: the child's exit code, that stock's ``except
Exception`` handler ran (its ``Scheduler hit an exception`` line and the parent's SIGQUIT), that the
operator opt-in ``SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION`` SIGKILLs the group, that our line names the
DP rank, and the fault record -- also when the record cannot be written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_harden.lifecycle import records

ROOT = Path(__file__).resolve().parents[2]

_PARENT = r"""
import json, multiprocessing as mp, signal, sys, time
got = []
signal.signal(signal.SIGQUIT, lambda *a: got.append("SIGQUIT"))
from tests.lifecycle.sched_exit_child import scheduler_child
ctx = mp.get_context("spawn")
r, w = ctx.Pipe(duplex=False)
p = ctx.Process(target=scheduler_child, args=(w,))
p.start()
p.join(240)
time.sleep(0.3)
print("RESULT " + json.dumps({"exitcode": p.exitcode, "signals": got}), flush=True)
"""


def _run(run_dir: str, **env) -> tuple:
    from dspark_harden.devtools.tiny_models import ensure_model

    e = {
        **os.environ,
        records.RUN_DIR_ENV: run_dir,
        "SGLANG_PLUGINS": "none-in-this-test",
        "DSPARK_TEST_SCHEDULER_MODEL": ensure_model("qwen3"),
        **env,
    }
    if "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION" not in env:
        e.pop("SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION", None)
    proc = subprocess.run(
        [sys.executable, "-c", _PARENT], cwd=str(ROOT), env=e, capture_output=True, text=True, timeout=400
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    return json.loads(line[-1][len("RESULT ") :]), proc.stderr


@pytest.mark.parametrize("case", ["default", "killpg_opt_in", "record_write_fails"])
def test_loop_exception_takes_stocks_path_and_names_the_rank(tmp_path, case):
    run_dir = str(tmp_path / "run")
    env = {}
    if case == "killpg_opt_in":
        env["SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION"] = "1"
    if case == "record_write_fails":
        blocker = tmp_path / "not-a-directory"
        blocker.write_text("x")
        run_dir = str(blocker / "run")  # makedirs raises NotADirectoryError
    result, log = _run(run_dir, **env)
    # stock's except Exception ran: its traceback line and the SIGQUIT to the parent
    assert "Scheduler hit an exception" in log and "RuntimeError: injected loop fault" in log, log[-4000:]
    assert result["signals"] == ["SIGQUIT"], (result, log[-4000:])
    # our line names the rank, in every case
    assert "DP rank 1 scheduler (pid " in log and "event loop raised RuntimeError: injected loop fault" in log, log[
        -4000:
    ]
    if case == "killpg_opt_in":
        assert result["exitcode"] == -9, result  # stock SIGKILLed the (child's own) process group
        assert "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION is set" in log
    else:
        assert result["exitcode"] == 1, (result, log[-4000:])  # not stock's 0: the death is attributable
    if case == "record_write_fails":
        assert "could not record its fault" in log and "NotADirectoryError" in log, log[-4000:]
        # our line comes before stock's traceback line
        assert log.index("DP rank 1 scheduler (pid ") < log.index("Scheduler hit an exception")
    else:
        faults = list(records.read(run_dir, "fault").values())
        assert len(faults) == 1 and faults[0]["type"] == "RuntimeError" and faults[0]["dp_rank"] == 1, faults
        assert faults[0]["message"] == "injected loop fault" and not faults[0]["secondary"]
