"""What the DSV4 memory modules share without importing each other: the capture test and the
planner's error (:mod:`.planner` and :mod:`.planner_device` both raise it)."""

from __future__ import annotations


class PlannerBoundsError(RuntimeError):
    pass


def capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (False on a host without CUDA)."""
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001
        return False
