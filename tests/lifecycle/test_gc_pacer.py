"""The freezer's full-collection pacer (:class:`dspark_harden.lifecycle.gc_freeze.Gen2Pacer`): after
``gc.freeze()`` it counts the objects promoted into gen 2 itself and holds CPython's own full-collection
trigger back until they exceed a quarter of (frozen + surviving) objects, CPython's pre-freeze rule.
Counts only, no timings (docs/lifecycle.md).

Each test runs in a fresh interpreter (``--noconftest``): its counts are about the heap the test built
and froze, and in the suite's long-lived process the heap other modules left behind (over a million
objects once SGLang is imported) moves CPython's automatic collections into the middle of the test's
promotion loop (a full collection ran between two of its steps, so it never saw the pacer due)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from dspark_harden.lifecycle.gc_freeze import GcFreezer, Gen2Pacer

_CHILD = "DSPARK_HARDEN_TEST_GC_PACER_CHILD"


def _in_fresh_interpreter(name: str) -> bool:
    """In the suite's process: run test ``name`` alone in a fresh interpreter, fail with its output if it
    fails, and return True (the caller returns). In that interpreter: False (the caller runs the test)."""
    if os.environ.get(_CHILD) == "1":
        return False
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", f"{__file__}::{name}"],
        env={**os.environ, _CHILD: "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-2000:]
    return True


@pytest.fixture
def clean_gc():
    stock = gc.get_threshold()
    gc.collect()
    yield stock
    gc.unfreeze()
    gc.set_threshold(*stock)


def test_pacer_holds_full_collections_until_a_quarter_of_the_whole_heap_was_promoted(clean_gc):
    if _in_fresh_interpreter("test_pacer_holds_full_collections_until_a_quarter_of_the_whole_heap_was_promoted"):
        return
    stock = clean_gc
    heap = [[i] for i in range(200_000)]
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    pacer = Gen2Pacer()
    pacer.install(frozen)
    try:
        held = stock[2] * Gen2Pacer.MAX_FACTOR
        assert gc.get_threshold() == (stock[0], stock[1], held)
        live = []
        # promote ~20 k objects per gen-1 collection; CPython alone would run a full collection once
        # 20 k > (unfrozen survivors = 0) / 4 -- the pacer waits for (frozen + survivors) / 4
        steps = 0
        while not pacer.due:
            live.append([[i] for i in range(20_000)])
            gc.collect(1)
            steps += 1
            assert steps < 100, pacer.pending
        # due at the first gen-1 collection past the quarter (one batch, plus automatic collections, of slack)
        assert pacer.pending > frozen / 4 >= pacer.pending - 45_000, (pacer.pending, frozen)
        assert steps >= 2  # a quarter of the frozen heap is more than one batch of promotions
        assert gc.get_threshold() == stock  # due: CPython's next collection is the full one
        gc.collect()  # the full collection: survivors measured, promotions reset, trigger held again
        last = pacer.last
        assert last["due"] and last["walked"] >= 20_000 * steps and last["survivors"] >= 20_000 * steps, last
        assert pacer.pending == 0 and pacer.long_lived == last["survivors"] and not pacer.due
        assert gc.get_threshold() == (stock[0], stock[1], held)
    finally:
        pacer.uninstall()
    assert gc.get_threshold() == stock and pacer not in gc.callbacks
    pacer.uninstall()  # idempotent
    del heap, live


def test_promoted_objects_freed_since_trigger_no_full_collection(clean_gc):
    if _in_fresh_interpreter("test_promoted_objects_freed_since_trigger_no_full_collection"):
        return
    """Requests that arrive, survive into gen 2 and finish (freed by reference counting) leave nothing to
    collect: when the promotions pass the quarter, the check finds gen 2 did not grow and holds on."""
    stock = clean_gc
    heap = [[i] for i in range(200_000)]
    gc.collect()
    gc.freeze()
    pacer = Gen2Pacer()
    pacer.install(gc.get_freeze_count())
    try:
        for _ in range(40):
            batch = [[i] for i in range(20_000)]
            gc.collect(1)  # promoted into gen 2 ...
            del batch  # ... and finished
        # mutation check: without the growth check (due on promotions alone) a full collection runs and this fails
        assert pacer.checks >= 1 and pacer.full_collections == 0 and not pacer.due, (pacer.checks, pacer.pending)
        assert gc.get_threshold()[2] == stock[2] * Gen2Pacer.MAX_FACTOR
        assert pacer.pending <= (pacer.frozen + pacer.long_lived) / 4
    finally:
        pacer.uninstall()
    del heap


def test_freezer_installs_the_pacer_at_the_freeze(clean_gc):
    if _in_fresh_interpreter("test_freezer_installs_the_pacer_at_the_freeze"):
        return
    stock = clean_gc
    f = GcFreezer()
    f.configure(role="test", dp_label="0", after_batches=0)
    try:
        heap = [{"k": [i]} for i in range(100_000)]
        f.freeze_now("test")
        # mutation check: freeze_now without pacer.install leaves stock's threshold2 and this fails
        assert f.pacer.installed and f.pacer.frozen == f.frozen_objects > 100_000
        assert gc.get_threshold()[2] == stock[2] * Gen2Pacer.MAX_FACTOR
        live = [[i] for i in range(20_000)]
        gc.collect(1)
        assert f.pacer.pending >= 20_000
    finally:
        f.pacer.uninstall()
        f.recorder.uninstall()
    assert gc.get_threshold() == stock
    del heap, live
