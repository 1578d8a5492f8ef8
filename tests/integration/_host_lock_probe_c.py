"""Probe for test_harness_parts.py (not collected by the suite): plain tests recording when they ran."""

import pytest

from tests.integration._host_lock_probe_b import window


@pytest.mark.parametrize("i", range(4))
def test_c(i):
    window(f"c{i}", 1.0)
