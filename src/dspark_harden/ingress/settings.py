"""Names and settings of the ingress features (``atomic-routed-batch``,
``dp-controller-blocking-loop``): the one place the feature, its patches, CLI and bench read them."""

from __future__ import annotations

from ..core.settings import Setting, flag01, nonneg_int, positive_int

ATOMIC = "atomic-routed-batch"
LOOP = "dp-controller-blocking-loop"
ATOMIC_SWITCH = "DSPARK_HARDEN_ATOMIC_ROUTED_BATCH"
LOOP_SWITCH = "DSPARK_HARDEN_DP_CONTROLLER_LOOP"
POLL_MS = "DSPARK_HARDEN_DP_CONTROLLER_POLL_MS"
DEFAULT_POLL_MS = 100
SPIN_US = "DSPARK_HARDEN_DP_CONTROLLER_SPIN_US"
DEFAULT_SPIN_US = 2000

HEALTH_SWITCH = "DSPARK_HARDEN_HEALTH_SCHEDULER"  # declared by dspark_harden.health
APP_PATH_VAR = "SGLANG_HTTP_SERVER_APP_PATH"  # SGLang's own variable (read, and set when unset)
STOCK_APP_PATH = "sglang.srt.entrypoints.http_server:app"
OUR_APP_PATH = "dspark_harden.ingress.app:app"

SETTINGS = [
    Setting(
        ATOMIC_SWITCH,
        flag01,
        True,
        "1: under DP attention, a batch routed to one DP rank is tokenized and sent as one "
        "message and the DP controller forwards it whole; invalid ranks get HTTP 400. 0: stock.",
        feature=ATOMIC,
    ),
    Setting(
        LOOP_SWITCH,
        flag01,
        True,
        "1: the DP controller waits for requests in a bounded socket poll instead of a busy "
        "loop. 0: stock busy loop (one core at 100 % even when idle).",
        feature=LOOP,
    ),
    Setting(
        POLL_MS,
        positive_int,
        DEFAULT_POLL_MS,
        "Upper bound in milliseconds on one idle wait of the DP controller loop. A request "
        "wakes the loop at once; the bound only sets how often an idle controller wakes to "
        "feed its soft watchdog (it is shortened to a quarter of the watchdog timeout).",
        feature=LOOP,
        accepts="positive integer (ms)",
    ),
    Setting(
        SPIN_US,
        nonneg_int,
        DEFAULT_SPIN_US,
        "Microseconds the DP controller keeps polling its socket without sleeping after each message "
        "before it blocks again: a follow-up message is dispatched as fast as by stock's busy loop. "
        "Costs at most this much CPU per message burst; an idle controller still uses none. 0: block "
        "right after draining.",
        feature=LOOP,
        accepts="non-negative integer (us)",
    ),
]
