"""The CUDA path of grammar-aware drafting's accept-length count (skipped without CUDA).

On CUDA ``dspark_masks.draft._AcceptLengths`` copies each verify step's accept lengths to the host
without a sync (non-blocking copy + event) and counts them at a later step once the event has
fired; off CUDA it counts at once (tested on the CPU server). Runs without SGLang (the GPU machine
has none): the accept lengths are a CUDA tensor written behind a ``torch.cuda._sleep`` kernel that
stands in for the verify forward still running; the Prometheus observation is replaced by a list.
Command and output: tests/gpu/RUN.md.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from dspark_harden.dspark_masks import draft as D  # noqa: E402

SLEEP = 200_000_000  # cycles: ~0.1 s of device time before the lengths are written


@pytest.fixture
def seen(monkeypatch):
    got: list = []
    monkeypatch.setattr(D, "_observe_accept", lambda lens, constrained: got.append((lens, constrained)))
    return got


def _lens_behind_a_busy_stream(values):
    """The lengths as a CUDA tensor that the device writes only after ~0.1 s of other work (the host is not
    held: the upload happens before the sleep is queued, the device-to-device copy after it)."""
    src = torch.tensor(values, dtype=torch.int32, device="cuda")
    out = torch.empty_like(src)
    torch.cuda._sleep(SLEEP)
    out.copy_(src)
    return out


def test_counted_once_the_copy_is_done_never_before_and_never_twice(seen):
    acc = D._AcceptLengths()
    torch.cuda.synchronize()
    lens = _lens_behind_a_busy_stream([3, 1, 8])
    acc.add(lens, [True, False, True])
    acc.flush()  # the device is still in the sleep kernel: nothing may be read yet
    assert seen == [], "counted before the device wrote the accept lengths"
    torch.cuda.synchronize()
    acc.flush()
    assert seen == [([3, 1, 8], [True, False, True])]
    acc.flush()
    assert len(seen) == 1 and acc.queue == []


def test_steps_counted_in_order_with_their_own_kinds(seen):
    acc = D._AcceptLengths()
    for i in range(5):
        acc.add(_lens_behind_a_busy_stream([i, i + 1]), [i % 2 == 0, True])
    torch.cuda.synchronize()
    acc.flush()
    assert seen == [([i, i + 1], [i % 2 == 0, True]) for i in range(5)]


def test_a_stalled_device_keeps_the_newest_64_steps_only(seen):
    acc = D._AcceptLengths()
    torch.cuda._sleep(SLEEP)
    for i in range(70):
        acc.add(torch.full((1,), i, dtype=torch.int32, device="cuda"), [True])
    assert len(acc.queue) == 64
    torch.cuda.synchronize()
    acc.flush()
    assert [s[0][0] for s in seen] == list(range(6, 70))


def test_a_mismatched_batch_is_not_counted(seen):
    acc = D._AcceptLengths()
    acc.add(torch.ones(3, dtype=torch.int32, device="cuda"), [True, False])
    acc.add(None, [True])
    torch.cuda.synchronize()
    acc.flush()
    assert seen == [] and acc.queue == []
