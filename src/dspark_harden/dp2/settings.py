"""Environment variables of the native DP2 exchange (names follow the seed's contract)."""

from __future__ import annotations

from ..core.settings import Setting, flag01, nonempty_str, nonneg_int, positive_int

FEATURE = "dp2-native-exchange"

SWITCH = "SGLANG_DSPARK_DP2_SHM_MLP_SYNC"
SESSION_ID = "SGLANG_DSPARK_DP2_SHM_SESSION_ID"
TIMEOUT_MS = "SGLANG_DSPARK_DP2_SHM_TIMEOUT_MS"
SPIN_US = "SGLANG_DSPARK_DP2_SHM_SPIN_US"
METRICS = "SGLANG_DSPARK_DP2_SHM_METRICS"
LIBRARY = "SGLANG_DSPARK_DP2_SHM_LIBRARY"


def _no_library_override(raw: str) -> str:
    """not supported (the library is built into dspark_harden._dp2_native)"""
    raise ValueError(
        "is not supported: the native exchange is built into dspark_harden._dp2_native (rebuild the "
        "package instead of pointing at another library); unset it"
    )


_no_library_override.bad_examples = ("", "/tmp/libx.so")

SETTINGS = [
    Setting(
        SWITCH, flag01, False,
        "1: replace the per-step gloo all-gather of MLPSyncBatchInfo (and DSpark's verify-tier gather) "
        "with the native shared-memory exchange. Only for DP2 / attention-TP1 / CP1 on one node; "
        "any other geometry, a missing session id or a conflicting sync switch stops startup. "
        "Once enabled there is no gloo fallback.",
        feature=FEATURE,
    ),
    Setting(
        SESSION_ID, nonempty_str, None,
        "Session id naming the shared-memory segments (required when the exchange is enabled). "
        "Use a new value for every launch (e.g. a UUID): both DP ranks must see the same value.",
        feature=FEATURE, accepts="non-empty string",
    ),
    Setting(
        TIMEOUT_MS, positive_int, 30000,
        "How long one rank waits for its peer in one exchange before both ranks fail (milliseconds). "
        "Peer death is detected within ~20 ms regardless.",
        feature=FEATURE,
    ),
    Setting(
        SPIN_US, nonneg_int, 50,
        "Busy-poll budget (microseconds) before a waiting rank sleeps in a futex; 0 = futex only.",
        feature=FEATURE,
    ),
    Setting(
        METRICS, flag01, True,
        "1: export the dspark_harden_dp2_* Prometheus metrics (flushed at most once per second); "
        "0: do not export them.",
        feature=FEATURE,
    ),
    Setting(
        LIBRARY, _no_library_override, None,
        "Accepted by the seed to point at an external library; not supported here (the exchange is "
        "built into the package), so any value is a startup error.",
        feature=FEATURE, accepts="must be unset",
    ),
]
