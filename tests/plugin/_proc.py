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
