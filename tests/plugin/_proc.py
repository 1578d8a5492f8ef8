"""Run Python snippets as a fresh interpreter would (the way SGLang's spawned processes start): forked
from the suite's warm interpreter where that is equivalent (tests/harness/warm.py), else fresh."""

from __future__ import annotations

import json
import os
import sys
import textwrap

from tests.harness import warm

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


def run_py(
    code: str, env: dict | None = None, timeout: float = 240.0, fresh: bool = False
) -> tuple[int, dict | None, str]:
    """Run ``code`` in a new interpreter; it may call ``emit(obj)`` to return a JSON result.
    ``fresh=True``: never forked warm (a snippet that inspects ``sys.modules``)."""
    argv, full_env = _py_command(code, env)
    return _py_result(warm.run(argv, env=full_env, timeout=timeout, fresh=fresh))


def run_pys(*snippets: tuple, timeout: float = 240.0) -> list:
    """:func:`run_py` for independent ``(code, env)`` snippets, run at once (:func:`run_concurrently`)."""
    return [_py_result(p) for p in run_concurrently([_py_command(c, e) for c, e in snippets], timeout=timeout)]


def run_concurrently(commands: list, timeout: float = 300.0, parallel: int = 4) -> list:
    """Run independent ``(argv, env)`` commands, ``parallel`` at a time, and return their
    ``CompletedProcess``es in order. Each is a fresh interpreter that spends most of its time importing
    SGLang on one core: run together they use both cores of a 2-core CI host instead of one after
    another (forked warm where equivalent: tests/harness/warm.py). Nothing timed is asserted, so a loaded host only makes them slower; ``timeout`` bounds each."""
    from concurrent.futures import ThreadPoolExecutor

    def one(cmd):
        argv, env = cmd
        return warm.run(argv, env=env, timeout=timeout)

    with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="test-subprocess") as pool:
        return list(pool.map(one, commands))
