"""Double-buffered grammar-mask pipeline for DSpark verify steps (pure torch; no SGLang import).

One verify step goes through three calls, in this order, on the scheduler thread:

``begin(verify_ids_2d)``  right after the verify ids exist and *before* the target verify launch:
    rotates to the next slot; on the persistent copy stream (which first waits on the compute
    stream) enqueues the D2H copy of the draft chain into the slot's pinned host buffer and records
    ``draft_copy_done``. Never waits on the host.
``finish(ticket, fill, vocab_size)``  after the verify launch: waits on the host until the slot's
    previous mask upload has left its pinned buffer (``mask_ready`` of two steps ago), waits for
    ``draft_copy_done``, lets ``fill(draft_host, mask_host)`` write the mask on the host, then on the
    copy stream waits on the slot's ``mask_consumed`` (recorded by the previous consumer of this
    slot), enqueues the H2D upload into the slot's device buffer and records ``mask_ready``. The
    compute stream waits on ``mask_ready``; the device mask view is returned.
``consumed(ticket)``  after the kernel that reads the mask has been enqueued on the compute stream:
    records ``mask_consumed`` there. The slot's device buffer is not written again until that event
    has completed on the GPU.

Protocol violations raise :class:`PipelineError` (fail closed): finishing a ticket that is not the
current one, consuming twice or before finishing, beginning a step while the previous one was
begun but never finished, or reusing a slot whose mask was handed out but never marked consumed
(its ``mask_consumed`` event is missing). Geometry (chain length, mask words) is fixed by the first
step; a change raises. Capacity (batch rows) grows when needed, after draining both slots.

On a CPU device the same protocol runs synchronously (no streams, no events).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


class PipelineError(RuntimeError):
    """The mask pipeline's event protocol or geometry was violated (fail closed)."""


class GeometryError(PipelineError):
    """Chain length or mask width changed after the first step."""


# slot states
IDLE = "idle"  # no mask handed out that may still be read
BEGUN = "begun"  # draft copy enqueued, finish() pending
HELD = "held"  # device mask handed to a consumer, consumed() pending


@dataclass
class Ticket:
    seq: int
    slot: int
    bs: int
    chain: int


@dataclass
class _Slot:
    index: int
    draft_host: torch.Tensor
    mask_host: torch.Tensor
    mask_dev: torch.Tensor
    draft_copy_done: Optional[object] = None
    mask_ready: Optional[object] = None
    mask_consumed: Optional[object] = None
    upload_pending: bool = False  # mask_ready recorded and not yet waited on by the host
    consumed_pending: bool = False  # mask_consumed recorded and not yet waited on by the copy stream
    state: str = IDLE
    seq: int = -1
    uses: int = 0


@dataclass
class StepTimings:
    """Host-side seconds of the last finish() (keys are metric ``phase`` label values)."""

    values: dict = field(default_factory=dict)


PHASES = ("buffer_wait", "draft_copy_wait", "traversal", "mask_upload")


class MaskPipeline:
    def __init__(self, device, *, capacity: int = 0, slots: int = 2, pin: Optional[bool] = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if slots < 2:
            raise ValueError("the mask pipeline needs at least two slots")
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda if pin is None else pin
        self.nslots = slots
        self.capacity = max(0, int(capacity))
        self.chain: Optional[int] = None
        self.words: Optional[int] = None
        self._slots: list[_Slot] = []
        self._next = 0
        self._seq = 0
        self._current: Optional[Ticket] = None
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.timings = StepTimings()
        self.steps = 0

    # ------------------------------------------------------------------------------------------
    def _event(self):
        return torch.cuda.Event() if self.cuda else None

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate every slot for ``capacity`` batch rows, after draining all of them."""
        self._drain()
        self._slots = []
        for i in range(self.nslots):
            slot = _Slot(
                i,
                torch.empty((capacity, self.chain), dtype=torch.int64, pin_memory=self.pin),
                None,
                None,
                self._event(),
                self._event(),
                self._event(),
            )
            self._slots.append(slot)
        self.capacity = capacity
        if self.words is not None:
            self._allocate_masks()

    def _allocate_masks(self) -> None:
        rows = self.capacity * self.chain
        for s in self._slots:
            s.mask_host = torch.empty((rows, self.words), dtype=torch.int32, pin_memory=self.pin)
            s.mask_dev = (
                torch.empty((rows, self.words), dtype=torch.int32, device=self.device) if self.cuda else s.mask_host
            )

    def _drain(self) -> None:
        """Wait until nothing may still read or write any slot (before reallocating)."""
        for s in self._slots:
            if s.state != IDLE:
                raise PipelineError(f"cannot resize the mask pipeline while slot {s.index} is {s.state} (step {s.seq})")
        for s in self._slots:
            if self.cuda:
                if s.consumed_pending:
                    s.mask_consumed.synchronize()
                if s.upload_pending:
                    s.mask_ready.synchronize()
                if s.uses:
                    s.draft_copy_done.synchronize()
            s.upload_pending = s.consumed_pending = False

    # ------------------------------------------------------------------------------------------
    def begin(self, verify_ids_2d: torch.Tensor, *, rid_hint: str = "") -> Ticket:
        ids = verify_ids_2d
        if ids.dim() != 2 or ids.dtype != torch.int64:
            raise PipelineError(f"verify ids must be a 2-D int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
        if ids.device != self.device and not (
            ids.device.type == self.device.type == "cuda" and ids.device.index == self.device.index
        ):
            raise PipelineError(f"verify ids are on {ids.device}, the mask pipeline on {self.device}")
        if not ids.is_contiguous():
            raise PipelineError("verify ids must be contiguous")
        bs, chain = ids.shape
        if bs <= 0 or chain <= 0:
            raise PipelineError(f"empty verify batch {tuple(ids.shape)}")
        if self._current is not None:
            raise PipelineError(
                f"begin() of a new step while step {self._current.seq} (slot {self._current.slot}) was begun and "
                f"never finished{rid_hint}"
            )
        if self.chain is None:
            self.chain = chain
        elif chain != self.chain:
            raise GeometryError(
                f"draft chain length changed from {self.chain} to {chain} between verify steps{rid_hint}"
            )
        if not self._slots or bs > self.capacity:
            self._allocate(max(bs, self.capacity, 1) if not self._slots else _grow(self.capacity, bs))
        slot = self._slots[self._next]
        if slot.state == HELD:
            raise PipelineError(
                f"slot {slot.index} is still held by the consumer of step {slot.seq}: its mask_consumed event "
                f"was never recorded (consumed() missing){rid_hint}"
            )
        if slot.state != IDLE:
            raise PipelineError(f"slot {slot.index} is {slot.state}, expected idle{rid_hint}")
        self._next = (self._next + 1) % self.nslots
        seq = self._seq
        self._seq += 1
        draft_view = slot.draft_host[:bs]
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(compute)
            with torch.cuda.stream(self.copy_stream):
                draft_view.copy_(ids, non_blocking=True)
                slot.draft_copy_done.record(self.copy_stream)
            ids.record_stream(self.copy_stream)
        else:
            draft_view.copy_(ids)
        slot.state, slot.seq = BEGUN, seq
        slot.uses += 1
        ticket = Ticket(seq=seq, slot=slot.index, bs=bs, chain=chain)
        self._current = ticket
        return ticket

    def abandon(self, ticket: Ticket) -> None:
        """Forget a begun step that will not be finished (its draft copy is waited for)."""
        self._check_current(ticket, "abandon")
        slot = self._slots[ticket.slot]
        if self.cuda:
            slot.draft_copy_done.synchronize()
        slot.state = IDLE
        self._current = None

    def _check_current(self, ticket: Ticket, what: str) -> None:
        cur = self._current
        if cur is None or cur.seq != ticket.seq:
            raise PipelineError(
                f"{what}() of step {ticket.seq} out of order: current step is {'none' if cur is None else cur.seq}"
            )

    def finish(
        self,
        ticket: Ticket,
        fill: Callable[[torch.Tensor, torch.Tensor], bool],
        vocab_size: int,
    ) -> Optional[torch.Tensor]:
        """Fill and upload the mask of ``ticket``; returns the device mask (bs*chain, words), or
        ``None`` when ``fill`` reports that no row is constrained (nothing is uploaded)."""
        self._check_current(ticket, "finish")
        slot = self._slots[ticket.slot]
        if slot.state != BEGUN or slot.seq != ticket.seq:
            raise PipelineError(f"finish() of step {ticket.seq}: slot {slot.index} is {slot.state} for step {slot.seq}")
        words = (int(vocab_size) + 31) // 32
        if words <= 0:
            raise PipelineError(f"vocab size must be positive, got {vocab_size}")
        t = {}
        t0 = time.perf_counter()
        if self.words is None:
            # first step: no mask buffer existed, so nothing can be in flight on one
            self.words = words
            self._allocate_masks()
        elif words != self.words:
            raise GeometryError(f"mask width changed from {self.words} to {words} words (vocab size {vocab_size})")
        # The host buffer is rewritten below: its previous upload must have left it.
        if self.cuda and slot.upload_pending:
            slot.mask_ready.synchronize()
            slot.upload_pending = False
        t1 = time.perf_counter()
        if self.cuda:
            slot.draft_copy_done.synchronize()
        t2 = time.perf_counter()
        rows = ticket.bs * ticket.chain
        draft = slot.draft_host[: ticket.bs]
        mask_host = slot.mask_host[:rows]
        self._current = None
        slot.state = IDLE  # if fill raises, the slot holds nothing a consumer could read
        needed = fill(draft, mask_host)
        t3 = time.perf_counter()
        t.update(buffer_wait=t1 - t0, draft_copy_wait=t2 - t1, traversal=t3 - t2)
        if not needed:
            t["mask_upload"] = 0.0
            self.timings.values = t
            self.steps += 1
            return None
        mask_dev = slot.mask_dev[:rows]
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if slot.consumed_pending:
                    self.copy_stream.wait_event(slot.mask_consumed)
                    slot.consumed_pending = False
                mask_dev.copy_(mask_host, non_blocking=True)
                slot.mask_ready.record(self.copy_stream)
            slot.upload_pending = True
            torch.cuda.current_stream(self.device).wait_event(slot.mask_ready)
        slot.state = HELD
        t["mask_upload"] = time.perf_counter() - t3
        self.timings.values = t
        self.steps += 1
        return mask_dev

    def consumed(self, ticket: Ticket) -> None:
        """The kernel reading ``ticket``'s mask is enqueued on the current stream."""
        slot = self._slots[ticket.slot] if 0 <= ticket.slot < len(self._slots) else None
        if slot is None or slot.state != HELD or slot.seq != ticket.seq:
            raise PipelineError(
                f"consumed() of step {ticket.seq} out of order: slot {ticket.slot} is "
                f"{'missing' if slot is None else slot.state} for step {'-' if slot is None else slot.seq}"
            )
        if self.cuda:
            slot.mask_consumed.record(torch.cuda.current_stream(self.device))
            slot.consumed_pending = True
        slot.state = IDLE

    def close(self) -> None:
        """Wait for every copy and consumer on the GPU (process shutdown, tests)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _grow(capacity: int, bs: int) -> int:
    cap = max(1, capacity)
    while cap < bs:
        cap *= 2
    return cap
