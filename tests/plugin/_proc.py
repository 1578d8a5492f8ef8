"""Run Python snippets in a fresh interpreter (the way SGLang's spawned processes start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

MARK = "@@RESULT@@"


def run_py(code: str, env: dict | None = None, timeout: float = 240.0) -> tuple[int, dict | None, str]:
    """Run ``code`` in a new interpreter; it may call ``emit(obj)`` to return a JSON result."""
    prelude = (
        "import json as _json, sys as _sys\n"
        f"def emit(obj):\n    _sys.stdout.write({MARK!r} + _json.dumps(obj) + '\\n'); _sys.stdout.flush()\n"
    )
    full_env = dict(os.environ)
    full_env.pop("DSPARK_HARDEN_ROLE", None)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            result = json.loads(line[len(MARK) :])
    return proc.returncode, result, proc.stdout + proc.stderr


def run_concurrently(commands: list, timeout: float = 300.0) -> list:
    """Run independent ``(argv, env)`` commands at once and return their ``CompletedProcess``es in
    order. Each is a fresh interpreter that spends most of its time importing SGLang on one core:
    started together they use both cores of a 2-core CI host instead of one after another. Nothing
    timed is asserted, so a loaded host only makes them slower."""
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv, env in commands
    ]
    out = []
    try:
        for (argv, _), p in zip(commands, procs):
            stdout, stderr = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(argv, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
