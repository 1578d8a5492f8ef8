"""Installed everywhere, harmful nowhere (issue 39): a server the plugin is not built for, with the plugin
installed but not named (``SGLANG_PLUGINS`` empty), against stock's recorded side.

Stock's greedy outputs (plain and JSON-schema constrained) and its SIGTERM exit code are recorded once per
SGLang version and model recipe in data/matrix_stock.json by
``python -m dspark_harden.devtools.matrix --record tests/integration/data/matrix_stock.json`` (which runs
both arms of every configuration -- single, TP2 without overlap, DP2 on llguidance, --dp 2 --tp 4 and DP4
under DP attention, DSpark DP2, the sglang.Engine path -- and refuses to write on any difference). CI runs
the installed arm of one configuration (one server start, ~100 s on 2 cores): DP2 without DP attention on
the llguidance grammar backend, where two default-on features must step aside (``grammar-service``:
another grammar backend; ``prefill-graph-dp``: no DP attention) and the rest must change nothing. The
``SGLANG_PLUGINS``-empty path of a DP2 attention server is tests/integration/test_launch_paths.py (shared
with the ``sglang serve`` launch test, no extra start). No existing server could take this configuration:
each runs DP attention, xgrammar or a named plugin.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_harden.devtools import matrix

# not host_exclusive: a configuration's /dev/shm leftovers are the new entries its own server's processes
# mapped (dspark_harden.devtools.shmwatch)
pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

FIXTURE = Path(__file__).parent / "data" / "matrix_stock.json"
CI_CONFIG = "dp2-llguidance"


def test_installed_not_named_on_a_foreign_deployment_is_stock():
    recorded = json.loads(FIXTURE.read_text())
    key = matrix.fixture_key()
    assert {k: recorded[k] for k in key} == key, (
        f"{FIXTURE.name} was recorded for {recorded.get('sglang')} / recipe {recorded.get('model_recipe')}, "
        f"this is {key}: regenerate it (python -m dspark_harden.devtools.matrix --record {FIXTURE})"
    )
    got = matrix.run(CI_CONFIG, "installed")
    assert not matrix.problems(CI_CONFIG, got, recorded["configs"][CI_CONFIG]), got["log_tail"]
    schedulers = [ln for ln in got["presence"] if "active in scheduler process" in ln]
    assert len(schedulers) == 2, got["presence"]
    for line in schedulers:
        assert "loaded because SGLANG_PLUGINS is unset" in line, line
        assert "grammar-service (the server's grammar backend is llguidance" in line, line
        assert "prefill-graph-dp (DP attention is off" in line, line
        assert "grammar-service" not in line.split("; unavailable")[0], line  # not bound
