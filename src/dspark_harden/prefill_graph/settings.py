"""Environment variables of the prefill-graph DP admission."""

from __future__ import annotations

import math

from ..core.settings import Setting, flag01
from .decision import DEFAULT_PADDING_FACTOR, MAX_PADDING_FACTOR

FEATURE = "prefill-graph-dp"

SWITCH = "DSPARK_HARDEN_PREFILL_GRAPH"
PADDING = "DSPARK_HARDEN_PREFILL_GRAPH_PADDING"


def padding_factor(raw: str) -> float:
    """number f with 1 < f <= 8"""
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"must be a number f with 1 < f <= {MAX_PADDING_FACTOR:g}, got {raw!r}") from None
    if not math.isfinite(value) or not 1.0 < value <= MAX_PADDING_FACTOR:
        raise ValueError(f"must be a number f with 1 < f <= {MAX_PADDING_FACTOR:g}, got {raw!r}")
    return value


padding_factor.bad_examples = ("", "1", "1.0", "0.5", "0", "-4", "8.01", "9", "inf", "nan", "abc", "4x")

SETTINGS = [
    Setting(
        SWITCH,
        flag01,
        True,
        "1: every DP rank takes the same prefill CUDA-graph decision (every forward-time check folded "
        "into the schedule-time vote, padding judged on the shared bucket, idle ranks participate where "
        "valid, a rank-local rejection after a shared 'graph' verdict raises). On wherever DP attention "
        "and a breakable/full prefill graph are both enabled; 0: stock admission.",
        feature=FEATURE,
    ),
    Setting(
        PADDING,
        padding_factor,
        DEFAULT_PADDING_FACTOR,
        "Largest admitted ratio of the shared token bucket to the global maximum token count of the "
        "step (stock: 2, checked per rank on local counts).",
        feature=FEATURE,
        accepts="number f, 1 < f <= 8",
    ),
]
