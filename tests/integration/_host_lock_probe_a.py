"""Probe for test_harness_parts.py (not collected by the suite): a ``host_exclusive`` test."""

import pytest

from tests.integration._host_lock_probe_b import window


@pytest.mark.host_exclusive
def test_exclusive():
    window("exclusive", 3.0)
