"""The GIL hand-off behind DSPARK_HARDEN_DSPARK_RESULTS_SWITCH_INTERVAL_US, on the CPU (no CUDA): a
background thread is released (as ``event.synchronize()`` releases it when the copy completes) while the
main thread runs 0.5 ms of Python, then the main thread waits for the thread's conversion (the consumer).
Prints, per switch interval, the main thread's median blocked µs at that wait. Not a test (timings);
docs/dspark_results.md "The GIL hand-off" quotes its output.

    python tests/dspark_results/gil_handoff_probe.py [steps]
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time


def probe(switch_interval_us: float, steps: int = 400, spin_s: float = 0.0005) -> dict:
    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_us / 1e6)
    data = list(range(576))  # next_token_ids [512] + accept / block-accept / cap lengths [64]
    go, ready, stop = threading.Event(), threading.Event(), threading.Event()

    def worker() -> None:
        while True:
            go.wait()  # releases the GIL, like the copy event's synchronize()
            go.clear()
            if stop.is_set():
                return
            [x + 0 for x in data]  # the conversion needs the GIL
            ready.set()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    blocked = []
    try:
        for _ in range(steps):
            ready.clear()
            go.set()
            end = time.perf_counter() + spin_s  # the scheduler thread's Python work
            while time.perf_counter() < end:
                pass
            t0 = time.perf_counter()
            ready.wait()  # the consumer
            blocked.append((time.perf_counter() - t0) * 1e6)
            end = time.perf_counter() + spin_s
            while time.perf_counter() < end:
                pass
    finally:
        stop.set()
        go.set()
        t.join(5)
        sys.setswitchinterval(before)
    return {"switch_interval_us": switch_interval_us, "blocked_us_p50": round(statistics.median(blocked), 1)}


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    for si in (5000, 200, 50):
        print(json.dumps(probe(si, n)))
