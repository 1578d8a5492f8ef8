"""Environment variables of the prefill-graph DP admission."""

from __future__ import annotations

import math

from ..core.settings import Setting, choice, flag01, nonneg_int
from .decision import DEFAULT_PADDING_FACTOR, MAX_PADDING_FACTOR

FEATURE = "prefill-graph-dp"

SWITCH = "DSPARK_HARDEN_PREFILL_GRAPH"
PADDING = "DSPARK_HARDEN_PREFILL_GRAPH_PADDING"
TBO = "DSPARK_HARDEN_PREFILL_GRAPH_TBO"
VALIDATE = "DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE"
VALIDATE_FIRST = "DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_FIRST"
VALIDATE_TOLERANCE = "DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_TOLERANCE"
VALIDATE_ACTION = "DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_ACTION"


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


def tolerance(raw: str) -> float:
    """number t with 0 <= t <= 1"""
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"must be a number t with 0 <= t <= 1, got {raw!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"must be a number t with 0 <= t <= 1, got {raw!r}")
    return value


tolerance.bad_examples = ("", "-0.1", "1.5", "nan", "inf", "abc")

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
    Setting(
        TBO,
        flag01,
        False,
        "1: capture and replay full-backend prefill CUDA graphs with two-batch overlap "
        "(--enable-two-batch-overlap): a fixed flat-token split of each bucket at bucket/2, both children "
        "on the captured request axis (zero-length sentinels), child attention metadata planned from the "
        "replay view, replayed only when every DP rank can run TBO this step. Not yet run on two GPUs "
        "(docs/prefill_graph.md); 0: the combination is refused at startup.",
        feature=FEATURE,
    ),
    Setting(
        VALIDATE,
        nonneg_int,
        0,
        "N > 0: validate prefill-graph replays against stock's eager forward of the same batch -- the "
        "first DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_FIRST replays per bucket and every N-th after, on "
        "replays without a cached prefix (the touched KV / request-state rows are saved and restored; "
        "a validated step runs the forward twice and returns the eager result). 0: off.",
        feature=FEATURE,
        accepts="integer >= 0",
    ),
    Setting(
        VALIDATE_FIRST,
        nonneg_int,
        2,
        "Replays per bucket validated before the every-N-th schedule starts (with VALIDATE > 0).",
        feature=FEATURE,
        accepts="integer >= 0",
    ),
    Setting(
        VALIDATE_TOLERANCE,
        tolerance,
        0.02,
        "A validated output or touched-state tensor mismatches when max|graph - eager| > t x "
        "max(1, max|eager|); 0 demands bit-identical results.",
        feature=FEATURE,
        accepts="number t, 0 <= t <= 1",
    ),
    Setting(
        VALIDATE_ACTION,
        choice("raise", "count"),
        "raise",
        "On a validation mismatch: raise PrefillGraphValidationError (naming bucket, differences and "
        "geometry; the scheduler stops) or count it and log an error.",
        feature=FEATURE,
        accepts="raise | count",
    ),
]
