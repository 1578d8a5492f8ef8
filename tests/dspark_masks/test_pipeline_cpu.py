"""The mask pipeline's step protocol on the CPU device (same state machine as on CUDA, where
tests/gpu adds the streams and events), and the traversal bench's JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dspark_harden.dspark_masks.pipeline import GeometryError, MaskPipeline, PipelineError


def fill_with(value):
    def fill(draft, mask):
        mask.fill_(value)
        return True

    return fill


def test_protocol_violations_raise_and_slots_rotate():
    pipe = MaskPipeline("cpu", capacity=2)
    ids = torch.arange(8, dtype=torch.int64).view(2, 4)
    t0 = pipe.begin(ids)
    with pytest.raises(PipelineError, match="never finished"):
        pipe.begin(ids)
    with pytest.raises(PipelineError, match="out of order"):
        pipe.consumed(t0)
    seen = {}

    def fill(draft, mask):
        seen["draft"] = draft.clone()
        mask.fill_(7)
        return True

    m0 = pipe.finish(t0, fill, 100)
    assert torch.equal(seen["draft"], ids) and m0.shape == (8, 4) and int(m0[0, 0]) == 7
    with pytest.raises(PipelineError, match="out of order"):
        pipe.finish(t0, fill, 100)
    t1 = pipe.begin(ids)
    assert t1.slot != t0.slot
    m1 = pipe.finish(t1, fill_with(9), 100)
    assert int(m0[0, 0]) == 7 and int(m1[0, 0]) == 9  # double buffered: step 0's mask intact
    pipe.consumed(t1)
    with pytest.raises(PipelineError, match="mask_consumed event was never recorded"):
        pipe.begin(ids)  # slot of step 0 still held
    pipe.consumed(t0)
    with pytest.raises(PipelineError, match="out of order"):
        pipe.consumed(t0)
    t2 = pipe.begin(ids)
    assert t2.slot == t0.slot
    assert pipe.finish(t2, lambda d, m: False, 100) is None  # nothing constrained: no mask, slot free
    with pytest.raises(GeometryError, match="chain length changed from 4 to 3"):
        pipe.begin(torch.zeros((2, 3), dtype=torch.int64))
    t3 = pipe.begin(ids)
    with pytest.raises(GeometryError, match="mask width changed from 4 to 1 words"):
        pipe.finish(t3, fill_with(1), 10)
    pipe.abandon(t3)
    # growth beyond the initial capacity drains and reallocates
    big = torch.zeros((5, 4), dtype=torch.int64)
    t4 = pipe.begin(big)
    assert pipe.capacity >= 5
    m4 = pipe.finish(t4, fill_with(3), 100)
    assert m4.shape == (20, 4)
    pipe.consumed(t4)
    with pytest.raises(PipelineError, match="2-D int64"):
        pipe.begin(torch.zeros((2, 4), dtype=torch.int32))


def test_fill_error_leaves_the_pipeline_usable():
    pipe = MaskPipeline("cpu")
    ids = torch.zeros((1, 2), dtype=torch.int64)
    t = pipe.begin(ids)

    def boom(d, m):
        raise RuntimeError("traversal failed")

    with pytest.raises(RuntimeError, match="traversal failed"):
        pipe.finish(t, boom, 64)
    t = pipe.begin(ids)
    assert pipe.finish(t, fill_with(1), 64) is not None


def test_bench_traversal_json_contract():
    """The CLI prints exactly the issue's JSON shape (small sizes here: speed is not asserted)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark_harden",
            "bench",
            "traversal",
            "--requests",
            "6",
            "--chain",
            "4",
            "--vocab",
            "2048",
            "--steps",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {
        "requests",
        "chain",
        "stock_ms",
        "harden_ms",
        "speedup",
        "identical",
        "stock_cpu_s_per_step",
        "harden_cpu_s_per_step",
    }
    assert result["stock_cpu_s_per_step"] > 0 and result["harden_cpu_s_per_step"] > 0
    assert result["requests"] == 6 and result["chain"] == 4 and result["identical"] is True
    assert isinstance(result["stock_ms"], float) and isinstance(result["harden_ms"], float)
