"""Names and settings of the DSpark result materializer (no torch / sglang import)."""

from __future__ import annotations

from ..core.settings import Setting, flag01, int_range, positive_float

FEATURE = "dspark-result-materializer"
SWITCH = "DSPARK_HARDEN_DSPARK_RESULTS"
#: bound of the materializer's queue (results waiting for their copy): overlap scheduling keeps at most two
#: results in flight, so it never fills; a full queue would block the scheduler thread at enqueue
#: (back-pressure, timed as phase ``queue``, bounded by the timeout). A setting once, removed: one value made sense
QUEUE_SIZE = 4
TIMEOUT = "DSPARK_HARDEN_DSPARK_RESULTS_TIMEOUT_S"
SWITCH_INTERVAL = "DSPARK_HARDEN_DSPARK_RESULTS_SWITCH_INTERVAL_US"
SWITCH_INTERVAL_DEFAULT_US = 200

SETTINGS = [
    Setting(
        SWITCH,
        flag01,
        False,
        "1: DSpark decode results under overlap scheduling are converted to host lists (tolist, event "
        "wait) on one background thread per scheduler; the consumers read the record. 0: stock (the "
        "scheduler thread synchronizes and converts).",
        feature=FEATURE,
    ),
    Setting(
        TIMEOUT,
        positive_float,
        60.0,
        "Seconds a consumer (the result processor or the grammar barrier) waits for one record before "
        "the step fails with a named error; also the bound of a full-queue enqueue and of the "
        "shutdown join. A dead materializer thread is detected at once, not after this timeout.",
        feature=FEATURE,
        accepts="a positive number of seconds",
    ),
    Setting(
        SWITCH_INTERVAL,
        int_range(0, 100000),
        SWITCH_INTERVAL_DEFAULT_US,
        "The scheduler process's GIL switch interval (sys.setswitchinterval, µs) while the materializer "
        "runs: how long the materializer thread, its copy done, waits for the GIL before the scheduler "
        "thread must hand it over. At the interpreter's 5,000 µs the thread converts only once the scheduler "
        "thread blocks -- usually in the consumer itself, which then waits for the conversion. 0: leave the "
        "interpreter's value. Process-wide: every thread of the scheduler process switches this often when "
        "two want the GIL.",
        feature=FEATURE,
    ),
]
