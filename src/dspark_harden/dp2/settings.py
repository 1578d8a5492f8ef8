"""Environment variables of the native DP2 exchange (names follow the seed's contract)."""

from __future__ import annotations

from ..core.settings import Setting, flag01, nonempty_str, nonneg_int, positive_int

FEATURE = "dp2-native-exchange"

SWITCH = "SGLANG_DSPARK_DP2_SHM_MLP_SYNC"
SESSION_ID = "SGLANG_DSPARK_DP2_SHM_SESSION_ID"
TIMEOUT_MS = "SGLANG_DSPARK_DP2_SHM_TIMEOUT_MS"
HARD_TIMEOUT_MS = "SGLANG_DSPARK_DP2_SHM_HARD_TIMEOUT_MS"
PEER_STOP_MS = "SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS"
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
        SWITCH,
        flag01,
        False,
        "1: replace the per-step gloo all-gather of MLPSyncBatchInfo (and DSpark's verify-tier gather) "
        "with the native shared-memory exchange. Only for DP2 / attention-TP1 / CP1 on one node; "
        "any other geometry or a conflicting sync switch stops startup. "
        "Once enabled there is no gloo fallback.",
        feature=FEATURE,
    ),
    Setting(
        SESSION_ID,
        nonempty_str,
        None,
        "Session id naming the shared-memory segments. Unset (recommended): the main process derives a "
        "fresh id for every launch (pid + 64 random bits) before it spawns the schedulers, which inherit "
        "it, so two servers on one host never collide. Set: used as is by both DP ranks (then give every "
        "concurrently running server its own value).",
        feature=FEATURE,
        accepts="non-empty string",
    ),
    Setting(
        TIMEOUT_MS,
        positive_int,
        30000,
        "Milliseconds one rank waits for a peer that never attached (or closed) before both ranks fail; "
        "while the peer is attached and provably alive (pid + process start time), the interval of "
        "stall warnings (log WARNING + dspark_harden_dp2_exchange_stalls_total) while it keeps waiting. "
        "Peer death is detected within ~20 ms regardless.",
        feature=FEATURE,
    ),
    Setting(
        HARD_TIMEOUT_MS,
        nonneg_int,
        1_800_000,
        "Milliseconds after which an exchange with a peer that is alive but stalled fails and stops both "
        "ranks (default 30 min, torch's default process-group timeout, which bounds stock's gloo wait); "
        "0 = wait as long as the peer is alive.",
        feature=FEATURE,
        accepts="integer >= 0 (milliseconds)",
    ),
    Setting(
        PEER_STOP_MS,
        nonneg_int,
        60_000,
        "Milliseconds a peer scheduler may stay stopped or traced (process state T, e.g. SIGSTOP, a "
        "debugger) or in uninterruptible sleep (state D, e.g. wedged in a driver call) without a break "
        "while this rank waits for it; then it is treated as dead: code peer_died, published so both "
        "ranks stop and the server exits. 0 = off (a stopped peer is then a stall until the hard timeout).",
        feature=FEATURE,
        accepts="integer >= 0 (milliseconds)",
    ),
    Setting(
        SPIN_US,
        nonneg_int,
        50,
        "Busy-poll budget (microseconds) before a waiting rank sleeps in a futex; 0 = futex only.",
        feature=FEATURE,
    ),
    Setting(
        METRICS,
        flag01,
        True,
        "1: export the dspark_harden_dp2_* Prometheus metrics (flushed at most once per second); "
        "0: do not export them.",
        feature=FEATURE,
    ),
    Setting(
        LIBRARY,
        _no_library_override,
        None,
        "Accepted by the seed to point at an external library; not supported here (the exchange is "
        "built into the package), so any value is a startup error. It is declared only for that: a "
        "configuration carried over from the seed that sets it stops at startup instead of silently "
        "running another exchange than the one it names.",
        feature=FEATURE,
        accepts="must be unset",
    ),
]
