"""``dspark-harden bench gc``: gen-2 GC pauses before and after ``gc.freeze()``, in process.

Not a server: a scheduler-shaped heap built here, because a tiny CPU server's heap (~0.3M objects)
is far from the 1.1M objects measured on a production scheduler (#30693), and the pause scales with
the heap. The heap is what a warmed scheduler keeps alive: a radix tree (node objects with
children dicts and token-id lists), request objects with their sampling/params dicts and output
lists, and pool bookkeeping — ``--objects`` GC-tracked containers in total. The load is a serving
loop: every step admits requests that live for a few hundred steps (a running batch), builds
per-step batch structures that die at once, and retires finished requests, so survivors reach the
old generation and CPython runs gen-2 collections on its own schedule (no explicit
``gc.collect``). Pauses are timed with ``gc.callbacks`` (:class:`.gc_freeze.PauseRecorder`), the
same way the servers export them. The same load runs before and after ``gc.collect(); gc.freeze()``.

Output (``--json``): ``{"before": {"gen2_pauses", "p50_ms", "p99_ms", "max_ms", "gen2_objects"},
"after": {...}, "frozen_objects", "heap_objects", "seconds_per_phase", "source"}``. ``gen2_objects``
is what a gen-2 collection traverses when the phase starts (``gc.get_objects(generation=2)``;
frozen objects are not in it): the deterministic part of the effect, the pauses the timed part.
"""

from __future__ import annotations

import gc
import json
import sys
import time

from .gc_freeze import PauseRecorder, summarize


class _Node:
    __slots__ = ("children", "key", "value", "parent", "meta")

    def __init__(self, parent, key):
        self.parent = parent
        self.key = key
        self.children = {}
        self.value = [0] * 4
        self.meta = {"lock_ref": 0, "last_access": 0.0}


class _Req:
    def __init__(self, rid: int):
        self.rid = rid
        self.origin_input_ids = list(range(rid % 50, rid % 50 + 32))
        self.output_ids = []
        self.sampling_params = {"temperature": 0.0, "max_new_tokens": 64, "stop": []}
        self.meta_info = {"rid": rid, "spans": [[0, 1]]}
        # per-token bookkeeping a running request accumulates (logprob entries, time stats)
        self.token_info = [{"t": i, "lp": [0.0]} for i in range(10)]


def build_heap(objects: int) -> list:
    """A radix tree plus pools: about ``objects`` GC-tracked containers (4 per node)."""
    root = _Node(None, ())
    keep = [root]
    frontier = [root]
    made = 0
    i = 0
    while made < objects:
        parent = frontier[i % len(frontier)]
        node = _Node(parent, (i,))
        parent.children[i] = node
        frontier.append(node)
        made += 4  # node (slots), children dict, value list, meta dict
        i += 1
    keep.append(frontier)
    return keep


def serve(seconds: float, min_gen2: int, recorder: PauseRecorder, cap_factor: float = 4.0) -> list:
    """Run the serving loop for ``seconds`` (longer, up to ``cap_factor``x, until ``min_gen2``
    gen-2 collections were seen); returns the recorded pauses."""
    recorder.drain()
    running: list = []
    rid = 0
    t_end = time.monotonic() + seconds
    t_cap = time.monotonic() + seconds * cap_factor
    pauses: list = []
    while True:
        now = time.monotonic()
        if now >= t_cap or (now >= t_end and sum(1 for p in pauses if p[0] == 2) >= min_gen2):
            break
        for _ in range(32):  # admit
            running.append(_Req(rid))
            rid += 1
        batch = [{"rid": r.rid, "ids": r.origin_input_ids[-4:], "pos": [len(r.output_ids)]} for r in running[-64:]]
        for r in running[-64:]:
            r.output_ids.append(rid & 1023)
        del batch
        if len(running) > 4800:  # retire the oldest: they lived ~150 steps
            del running[:32]
        pauses.extend(recorder.drain())
    pauses.extend(recorder.drain())
    return pauses


def run(objects: int, seconds: float) -> dict:
    recorder = PauseRecorder()
    gc.collect()
    heap = build_heap(objects)
    gc.collect()
    recorder.install()
    try:
        tracked_before = len(gc.get_objects(generation=2))
        before = serve(seconds, 3, recorder)
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
        tracked_after = len(gc.get_objects(generation=2))
        recorder.frozen = True
        after = serve(seconds, 3, recorder)
    finally:
        recorder.uninstall()
        gc.unfreeze()
    del heap
    return {"before": {**summarize(before), "gen2_objects": tracked_before},
            "after": {**summarize(after), "gen2_objects": tracked_after}, "frozen_objects": int(frozen),
            "heap_objects": objects, "seconds_per_phase": seconds,
            "source": "in-process scheduler-shaped heap (not a server)"}


def main(args) -> int:
    if args.objects <= 0 or args.seconds <= 0:
        sys.stderr.write("dspark-harden bench gc: --objects and --seconds must be positive\n")
        return 2
    out = run(args.objects, args.seconds)
    if args.json:
        print(json.dumps(out))
    else:
        b, a = out["before"], out["after"]
        print(f"heap: {out['heap_objects']} tracked objects ({out['source']}), {out['frozen_objects']} frozen")
        for name, s in (("before freeze", b), ("after freeze", a)):
            print(f"{name:>14}: {s['gen2_objects']} objects in gen 2, {s['gen2_pauses']} gen-2 pauses, "
                  f"p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, max {s['max_ms']:.2f} ms")
    return 0
