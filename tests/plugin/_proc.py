"""Run Python snippets in a fresh interpreter (the way SGLang's spawned processes start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

MARK = "@@RESULT@@"


def _py_command(code: str, env: dict | None) -> tuple[list, dict]:
    prelude = (
        "import json as _json, sys as _sys\n"
        f"def emit(obj):\n    _sys.stdout.write({MARK!r} + _json.dumps(obj) + '\\n'); _sys.stdout.flush()\n"
    )
    full_env = dict(os.environ)
    full_env.pop("DSPARK_HARDEN_ROLE", None)
    full_env.update(env or {})
    return [sys.executable, "-c", prelude + textwrap.dedent(code)], full_env


def _py_result(proc) -> tuple[int, dict | None, str]:
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            result = json.loads(line[len(MARK) :])
    return proc.returncode, result, proc.stdout + proc.stderr


def run_py(code: str, env: dict | None = None, timeout: float = 240.0) -> tuple[int, dict | None, str]:
    """Run ``code`` in a new interpreter; it may call ``emit(obj)`` to return a JSON result."""
    argv, full_env = _py_command(code, env)
    return _py_result(subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=timeout))


def run_pys(*snippets: tuple, timeout: float = 240.0) -> list:
    """:func:`run_py` for independent ``(code, env)`` snippets, run at once (:func:`run_concurrently`)."""
    return [_py_result(p) for p in run_concurrently([_py_command(c, e) for c, e in snippets], timeout=timeout)]


def run_concurrently(commands: list, timeout: float = 300.0, parallel: int = 4) -> list:
    """Run independent ``(argv, env)`` commands, ``parallel`` at a time, and return their
    ``CompletedProcess``es in order. Each is a fresh interpreter that spends most of its time importing
    SGLang on one core: run together they use both cores of a 2-core CI host instead of one after
    another. Nothing timed is asserted, so a loaded host only makes them slower; ``timeout`` bounds each."""
    from concurrent.futures import ThreadPoolExecutor

    def one(cmd):
        argv, env = cmd
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)

    with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="test-subprocess") as pool:
        return list(pool.map(one, commands))
