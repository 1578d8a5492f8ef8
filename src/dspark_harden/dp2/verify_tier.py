"""Hardened ``DSparkVerifyPlanner._maybe_gather_dp_verify_tier`` over its own native channel.

Stock gathers one int64 (the local verify tier) per step over gloo ``all_gather_single`` on the
TP CPU group and stores ``gathered.tolist()`` in ``batch.global_spec_verify_tier_num_tokens``. The
native version exchanges ``[tier, CHANNEL_MAGIC]`` on the separate ``verify_tier`` segment and
checks the magic of both rows, so a cross-wired channel is detected instead of silently mixing
MLP-sync values into tier decisions. Same early returns as stock (gather disabled, extend in
batch -> ``None``).

The patch is bound only when DSpark speculative decoding is configured (server_args), so the
DSpark planner module is never imported by schedulers that do not need it.
"""

from __future__ import annotations

import operator
import time
from typing import Any, Optional

from .channels import RUNTIME, config_digest
from .native import Channel, Dp2Error

CHANNEL_MAGIC = int.from_bytes(b"DSPKTIER", "little") & 0x7FFFFFFFFFFFFFFF
WIDTH = 2


class VerifyTierSync:
    def __init__(self) -> None:
        self.channel: Optional[Channel] = None
        self._acc = None

    def open(self, runtime=RUNTIME) -> Channel:
        digest = config_digest("verify_tier", WIDTH, ("tier", "magic", CHANNEL_MAGIC), (2, 1, 1))
        self.channel = runtime.open("verify_tier", width=WIDTH, digest=digest)
        self._acc = runtime.accs["verify_tier"]
        return self.channel

    def _fail(self, message: str) -> Dp2Error:
        exc = self.channel.poison(message) if self.channel is not None else Dp2Error(-1, message)
        if exc.code <= 0:
            exc = Dp2Error(-1, message)
        RUNTIME.record_error("verify_tier", exc)
        return exc

    def gather(self, local_tier_num_tokens: Any) -> list:
        t0 = time.perf_counter()
        if self.channel is None:
            raise Dp2Error(-1, "dp2: verify-tier gather called before the native channel was opened")
        try:
            tier = operator.index(local_tier_num_tokens)
        except TypeError:
            raise self._fail(f"verify tier must be an integer, got {type(local_tier_num_tokens).__name__}") from None
        if tier < -1:
            raise self._fail(f"verify tier must be >= -1, got {tier}")
        try:
            v = self.channel.exchange((tier, CHANNEL_MAGIC))
        except Dp2Error as exc:
            RUNTIME.record_error("verify_tier", exc)
            raise
        if v[1] != CHANNEL_MAGIC or v[3] != CHANNEL_MAGIC:
            raise self._fail(f"verify-tier channel magic mismatch: got {v[1]:#x} / {v[3]:#x}, want {CHANNEL_MAGIC:#x}")
        now = time.perf_counter()
        self._acc.record(now - t0, now)
        return [v[0], v[2]]


VERIFY: Optional[VerifyTierSync] = None


def build_verify_tier(stock: Any):
    """Patch builder for ``DSparkVerifyPlanner._maybe_gather_dp_verify_tier`` (REPLACE)."""

    def _maybe_gather_dp_verify_tier(self, *, batch, local_tier_num_tokens: int) -> None:
        if not self._dp_tier_gather_enabled:
            return
        if batch.is_extend_in_batch:
            batch.global_spec_verify_tier_num_tokens = None
            return
        sync = VERIFY
        if sync is None:
            raise Dp2Error(-1, "dp2: native verify-tier exchange enabled but not started in this process")
        batch.global_spec_verify_tier_num_tokens = sync.gather(local_tier_num_tokens)

    _maybe_gather_dp_verify_tier.__qualname__ = getattr(stock, "__qualname__", "_maybe_gather_dp_verify_tier")
    return _maybe_gather_dp_verify_tier


def start(runtime=RUNTIME) -> VerifyTierSync:
    global VERIFY
    sync = VerifyTierSync()
    sync.open(runtime)
    VERIFY = sync
    return sync
