"""``dspark-harden bench gc``: gen-2 GC pauses with no freeze, with stock's freeze and with the plugin's.

Not a server: a scheduler-shaped heap built here, because a tiny CPU server's heap (~0.3M objects)
is far from the 1.1M objects measured on a production scheduler (#30693), and the pause scales with
the heap. The heap is what a warmed scheduler keeps alive: a radix tree (node objects with
children dicts and token-id lists), request objects with their sampling/params dicts and output
lists, and pool bookkeeping, topped up to ``--objects`` GC-tracked objects in the process (SGLang's own
modules, imported for stock's freeze, count towards it, as on a real scheduler). The load is a serving
loop: every step admits requests that live for a few hundred steps (a running batch), builds
per-step batch structures that die at once, and retires finished requests, so survivors reach the
old generation and CPython runs gen-2 collections on its own schedule (no explicit
``gc.collect``). Pauses are timed with ``gc.callbacks`` (:class:`.gc_freeze.PauseRecorder`), the
same way the servers export them. The same load runs in three phases per round, the order rotating:

* ``unfrozen``: no freeze (stock's offline ``Engine`` path, which has no freeze after warm-up; or any
  process before its freeze);
* ``stock``: stock 0.5.23's freeze after server warm-up, exactly what its scheduler runs for the
  ``POST /freeze_gc`` the HTTP server sends itself (``http_server._freeze_gc_after_server_warmup``,
  PR #34999): ``Scheduler.handle_freeze_gc`` -> ``sglang.srt.utils.common.freeze_gc("Scheduler",
  gc_threshold)`` with the default ``--gc-threshold`` (none): ``gc.freeze()``, called here as stock's function;
* ``plugin``: what ``gc-freeze`` does, ``gc.collect(); gc.freeze()`` plus the freezer's
  :class:`.gc_freeze.Gen2Pacer`.

A frozen phase ends with ``gc.unfreeze()``; every phase starts after a ``gc.collect()`` (so stock's freeze
without a collection first freezes no garbage here; on a server it freezes what is garbage at that moment).

Output (``--json``): ``{"unfrozen": {"gen2_pauses", "gen2_per_s", "gen2_per_kstep", "p50_ms", "p99_ms",
"max_ms", "walked_median", "gen2_objects", ...}, "stock": {...}, "plugin": {...}, "spread": {phase: {key:
{"median", "min", "max"}}}, "rounds": [...], "frozen_objects", "heap_objects", "tracked_objects",
"seconds_per_phase", "source"}`` (phase values: medians over the rounds; ``walked_median``: objects in gen 2
when a full collection starts). ``gen2_objects`` is what a gen-2 collection traverses when the phase starts
(``gc.get_objects(generation=2)``; frozen objects are not in it): the deterministic part of the effect, the
pauses the timed part.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from typing import Optional

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


def serve(
    seconds: float,
    min_gen2: int,
    recorder: PauseRecorder,
    cap_factor: float = 4.0,
    running_max: int = 4800,
    steps: Optional[list] = None,
) -> list:
    """Run the serving loop for ``seconds`` (longer, up to ``cap_factor``x, until ``min_gen2``
    gen-2 collections were seen) with about ``running_max`` live requests; returns the recorded pauses."""
    recorder.drain()
    steps = steps if steps is not None else [0]
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
        if len(running) > running_max:  # retire the oldest (at 4800 they lived ~150 steps)
            del running[:32]
        pauses.extend(recorder.drain())
        steps[0] += 1
    pauses.extend(recorder.drain())
    return pauses


class _WalkLog:
    """``gc.callbacks`` entry: objects in gen 2 when each full collection starts (what it walks, besides
    the young generations merged in). Installed *before* the recorder, so its own ``get_objects`` call is
    outside the timed pause."""

    def __init__(self) -> None:
        self.walks: list = []

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start" and info.get("generation") == 2:
            self.walks.append(len(gc.get_objects(generation=2)))


PHASES = ("unfrozen", "stock", "plugin")


def _stock_freeze():
    """Stock 0.5.23's scheduler freeze (``Scheduler.handle_freeze_gc``): the real function."""
    from sglang.srt.utils.common import freeze_gc

    return freeze_gc


def _phase(
    phase: str, seconds: float, recorder: PauseRecorder, walks: _WalkLog, pacer, running: int, stock_freeze
) -> dict:
    walks.walks.clear()
    frozen = phase != "unfrozen"
    if phase == "stock":
        stock_freeze("Scheduler", None)  # what the scheduler runs for stock's POST /freeze_gc after warm-up
    elif phase == "plugin":
        gc.collect()
        gc.freeze()
        pacer.install(gc.get_freeze_count())
    n_frozen = gc.get_freeze_count()
    recorder.frozen = frozen
    walks.walks.clear()  # not the freeze's own collection
    tracked = len(gc.get_objects(generation=2))
    t0 = time.monotonic()
    try:
        steps = [0]
        pauses = serve(seconds, 3, recorder, running_max=running, steps=steps)
    finally:
        if phase == "plugin":
            pacer.uninstall()
        gc.unfreeze()
    elapsed = time.monotonic() - t0
    s = summarize(pauses)
    # young (gen-1) pauses too: the pacer's promotion counting and growth checks run inside them
    g1 = summarize(pauses, generation=1)
    ws = sorted(walks.walks)
    return {
        **s,
        "gen1_pauses": g1["gen2_pauses"],
        "gen1_p99_ms": g1["p99_ms"],
        "gen1_max_ms": g1["max_ms"],
        "gen2_objects": tracked,
        "seconds": round(elapsed, 2),
        "gen2_per_s": round(s["gen2_pauses"] / elapsed, 3) if elapsed > 0 else 0.0,
        "steps": steps[0],
        "gen2_per_kstep": round(1000.0 * s["gen2_pauses"] / max(1, steps[0]), 3),
        "walked_median": ws[len(ws) // 2] if ws else 0,
        "frozen_objects": int(n_frozen),
        "pacer_last": dict(pacer.last) if phase == "plugin" else None,
        "pacer_checks": pacer.checks if phase == "plugin" else 0,
    }


def _med(rounds: list, phase: str, key: str) -> dict:
    xs = [r[phase][key] for r in rounds]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(objects: int, seconds: float, rounds: int = 3, running: int = 4800) -> dict:
    """``rounds`` rounds on one heap of ``objects`` tracked objects, each one phase per entry of
    :data:`PHASES` (a freeze applied at the phase's start, undone with ``gc.unfreeze()`` at its end), the
    order rotating from round to round."""
    from .gc_freeze import Gen2Pacer

    stock_freeze = _stock_freeze()  # imported before the heap is sized: its modules are part of it
    recorder, walks, pacer = PauseRecorder(), _WalkLog(), Gen2Pacer()
    gc.collect()
    heap: list = []
    tracked = len(gc.get_objects())
    while tracked < objects:  # top up to ``objects`` tracked (not every container is: empty dicts are not)
        heap.append(build_heap(max(10_000, objects - tracked)))
        gc.collect()
        tracked = len(gc.get_objects())
    gc.callbacks.append(walks)
    recorder.install()
    per_round: list = []
    try:
        for r in range(rounds):
            res = {}
            for i in range(len(PHASES)):
                phase = PHASES[(i + r) % len(PHASES)]
                gc.collect()
                res[phase] = _phase(phase, seconds, recorder, walks, pacer, running, stock_freeze)
            per_round.append(res)
    finally:
        recorder.uninstall()
        pacer.uninstall()
        gc.unfreeze()
        try:
            gc.callbacks.remove(walks)
        except ValueError:
            pass
    del heap
    keys = (
        "gen2_pauses",
        "gen2_per_s",
        "gen2_per_kstep",
        "steps",
        "p50_ms",
        "p99_ms",
        "max_ms",
        "walked_median",
        "gen1_pauses",
        "gen1_p99_ms",
        "gen1_max_ms",
    )
    summary = {ph: {k: _med(per_round, ph, k) for k in keys} for ph in PHASES}
    first = per_round[0]
    return {
        # medians over the rounds (the per-round values and their min / max are in "rounds" / "spread")
        **{
            ph: {**{k: summary[ph][k]["median"] for k in keys}, "gen2_objects": first[ph]["gen2_objects"]}
            for ph in PHASES
        },
        "spread": summary,
        "rounds": per_round,
        "frozen_objects": int(first["plugin"]["frozen_objects"]),
        "stock_frozen_objects": int(first["stock"]["frozen_objects"]),
        "heap_objects": objects,
        "tracked_objects": tracked,
        "seconds_per_phase": seconds,
        "running_requests": running,
        "source": "in-process scheduler-shaped heap (not a server)",
    }


def main(args) -> int:
    rounds, running = getattr(args, "rounds", 3), getattr(args, "running", 4800)
    if args.objects <= 0 or args.seconds <= 0 or rounds <= 0 or running <= 0:
        sys.stderr.write("dspark-harden bench gc: --objects, --seconds, --rounds and --running must be positive\n")
        return 2
    out = run(args.objects, args.seconds, rounds, running)
    if args.json:
        print(json.dumps(out))
    else:
        sp = out["spread"]
        print(
            f"heap: {out['tracked_objects']} tracked objects ({out['source']}), {out['frozen_objects']} frozen, "
            f"{out['running_requests']} live requests; "
            f"{len(out['rounds'])} rounds, each unfrozen + stock freeze + plugin freeze (order rotating); "
            "median (min-max) over rounds"
        )
        for ph, name in (
            ("unfrozen", "no freeze"),
            ("stock", "stock freeze"),
            ("plugin", "plugin freeze"),
        ):

            def f(k, unit="", ph=ph):
                v = sp[ph][k]
                return f"{v['median']:g}{unit} ({v['min']:g}-{v['max']:g})"

            print(
                f"{name:>14}: gen-2 pauses {f('gen2_pauses')}, per s {f('gen2_per_s')}, per 1000 serving steps "
                f"{f('gen2_per_kstep')}, p50 {f('p50_ms', ' ms')}, "
                f"max {f('max_ms', ' ms')}, objects walked {f('walked_median')}; gen-1 pauses {f('gen1_pauses')}, "
                f"p99 {f('gen1_p99_ms', ' ms')}, max {f('gen1_max_ms', ' ms')}"
            )
    return 0
