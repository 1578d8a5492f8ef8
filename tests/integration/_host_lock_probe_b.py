"""Probe for test_harness_parts.py (not collected by the suite): plain tests recording when they ran."""

import json
import os
import time

import pytest


def window(name: str, seconds: float) -> None:
    """Append this test's [start, end] (CLOCK_MONOTONIC: one clock for every process) to the run's file."""
    start = time.monotonic()
    time.sleep(seconds)
    with open(os.environ["DSPARK_HOST_LOCK_PROBE_OUT"], "a") as f:
        f.write(
            json.dumps(
                {"name": name, "worker": os.environ.get("PYTEST_XDIST_WORKER"), "start": start, "end": time.monotonic()}
            )
            + "\n"
        )


@pytest.mark.parametrize("i", range(4))
def test_b(i):
    window(f"b{i}", 1.0)
