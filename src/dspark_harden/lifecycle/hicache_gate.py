"""The one-shot, idle-only, write-back-preserving HiCache eviction gate (seed §9).

``POST /set_internal_state {"server_args": {"hicache_gate_evict_device_tokens": N}}`` reaches
every scheduler's ``SchedulerInternalStateController.set_internal_state`` (wrapped; stock
rejects unknown keys). With ``SGLANG_HICACHE_GATE_CONTROL=armed`` each scheduler accepts it
**once**, only when

* N is a positive integer (not a bool, not a float),
* hierarchical cache is on with a cache controller (``--enable-hierarchical-cache``),
* the scheduler is fully idle (no running/waiting request) and no HiCache transfer is in flight.

Startup refuses the armed gate unless each DP group is one scheduler (attention-TP 1, attention-CP
1, PP 1: :func:`group_problem` says why).

Execution, in this order: the arm is consumed (no retry, even on failure); pending write-through
acknowledgements are settled (``writing_check(write_back=True)``); the evictable size is
recorded; the write policy is forced to ``write_back`` (the controller's ``write_policy`` and the
tree's ``is_write_back``, which is what stock ``_evict_device_leaf`` reads) so every evicted
device-only leaf is backed up to host first; ``evict(EvictParams(N))``
runs through stock code; the policy is restored; zero evicted tokens is a failure. Refusals and
failures answer ``updated=false`` (the HTTP answer is stock's list of booleans) and log the reason
at WARNING; ``/get_internal_state`` shows ``hicache_gate`` = {armed, last_requested_tokens,
last_evictable_tokens, last_evicted_tokens, last_outcome, last_reason}.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..core import metrics, roles

logger = logging.getLogger("dspark_harden.lifecycle")

GATE_KEY = "hicache_gate_evict_device_tokens"


def group_widths(server_args: Any) -> dict:
    """Attention-TP, attention-CP and PP widths of one DP group, from the ``server_args`` this
    process was launched with (resolved by the main process: ``attn_dp_size``; unresolved:
    ``--dp-size`` with ``--enable-dp-attention``)."""
    g = lambda name, default=1: getattr(server_args, name, default)  # noqa: E731
    attn_dp = int(g("attn_dp_size") or 1)
    if attn_dp <= 1 and g("enable_dp_attention", False):
        attn_dp = int(g("dp_size") or 1)
    attn_cp = int(g("attn_cp_size") or 1)
    tp = int(g("tp_size") or 1)
    return {"attn_tp": max(1, tp // max(1, attn_dp) // attn_cp), "attn_cp": attn_cp, "pp": int(g("pp_size") or 1)}


def group_problem(server_args: Any) -> Optional[str]:
    """Why the gate cannot run with this geometry (None: one scheduler per DP group).

    The gate decides per scheduler (idle? transfers in flight? how much is evictable?). With
    attention-TP > 1 (or attention-CP / PP > 1) several schedulers mirror one DP group's radix tree;
    they can disagree (one has a write-through ack in flight and refuses, the others evict) and their
    trees diverge. Agreeing through a collective would put a blocking all-reduce on a control
    request that a rank can miss (a rank that fails validation or raises before it) -- a wedged DP
    group -- and even an agreed eviction can differ per rank (host pool space). The gate is opt-in
    and the supported deployment is attention-TP 1, so it refuses to start instead (fail closed)."""
    if server_args is None:
        return None
    w = group_widths(server_args)
    if w["attn_tp"] == 1 and w["attn_cp"] == 1 and w["pp"] == 1:
        return None
    return (
        f"the HiCache gate decides per scheduler, and each DP group here has {w['attn_tp'] * w['attn_cp'] * w['pp']} "
        f"schedulers (attention-TP {w['attn_tp']}, attention-CP {w['attn_cp']}, PP {w['pp']}) whose radix trees "
        "would diverge if some evicted and others refused; it needs attention-TP 1, attention-CP 1 and PP 1 "
        "(e.g. --dp-size 2 --tp-size 2 --enable-dp-attention), or SGLANG_HICACHE_GATE_CONTROL=disabled"
    )


def available(_settings) -> Optional[str]:
    """Feature ``hicache-gate``'s availability in this process (None: it can run)."""
    ctx = roles.CONTEXT
    return group_problem(getattr(ctx, "server_args", None)) if ctx is not None else None


class Gate:
    def __init__(self, armed: bool = False) -> None:
        self.armed = armed
        self.last_requested_tokens: Optional[int] = None
        self.last_evictable_tokens: Optional[int] = None
        self.last_evicted_tokens: Optional[int] = None
        self.last_outcome: Optional[str] = None
        self.last_reason: Optional[str] = None
        self.used = False

    def state(self) -> dict:
        return {
            "armed": self.armed,
            "last_requested_tokens": self.last_requested_tokens,
            "last_evictable_tokens": self.last_evictable_tokens,
            "last_evicted_tokens": self.last_evicted_tokens,
            "last_outcome": self.last_outcome,
            "last_reason": self.last_reason,
        }

    def _finish(self, outcome: str, reason: str) -> bool:
        self.last_outcome, self.last_reason = outcome, reason
        try:
            ctx = roles.CONTEXT
            dp = ctx.dp_label if ctx is not None else "none"
            metrics.child("dspark_harden_hicache_gate_requests_total", dp, outcome).inc()
            if outcome == "evicted" and self.last_evicted_tokens:
                metrics.child("dspark_harden_hicache_gate_evicted_tokens_total", dp).inc(self.last_evicted_tokens)
        except Exception:  # noqa: BLE001
            logger.debug("metric unavailable", exc_info=True)
        if outcome == "evicted":
            logger.info("dspark-harden hicache-gate: %s", reason)
            return True
        logger.warning("dspark-harden hicache-gate: refused (%s): %s", outcome, reason)
        return False

    def run(self, scheduler: Any, value: Any) -> bool:
        """Validate, consume the arm, evict. True when tokens were evicted."""
        if not self.armed:
            why = (
                "the gate was already used once in this scheduler (one shot; restart to re-arm)"
                if self.used
                else "the gate is not armed (SGLANG_HICACHE_GATE_CONTROL=armed)"
            )
            return self._finish("already_used" if self.used else "not_armed", why)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return self._finish("bad_value", f"{GATE_KEY} must be a positive integer number of tokens, got {value!r}")
        tree = getattr(scheduler, "tree_cache", None)
        cc = getattr(tree, "cache_controller", None)
        if cc is None:
            return self._finish(
                "hicache_off",
                "hierarchical cache is not active in this scheduler "
                "(--enable-hierarchical-cache with a cache controller)",
            )
        busy = []
        if not scheduler.is_fully_idle():
            busy.append("requests are running or waiting")
        inflight = getattr(cc, "has_inflight_device_transfers", None)
        if callable(inflight) and inflight():
            busy.append("HiCache transfers are in flight")
        if busy:
            return self._finish("busy", "the scheduler is not idle: " + " and ".join(busy))
        # one attempt only: consume the arm before anything can fail
        self.armed, self.used = False, True
        self.last_requested_tokens = value
        self.last_evicted_tokens = None
        try:
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            tree.writing_check(write_back=True)
            self.last_evictable_tokens = int(tree.evictable_size())
            old_policy = cc.write_policy
            has_flag = hasattr(type(tree), "is_write_back") or hasattr(tree, "is_write_back")
            old_flag = tree.is_write_back if has_flag else None
            cc.write_policy = "write_back"
            if has_flag:
                tree.is_write_back = True
            try:
                result = tree.evict(EvictParams(num_tokens=value))
            finally:
                cc.write_policy = old_policy
                if has_flag:
                    tree.is_write_back = old_flag
            evicted = int(getattr(result, "num_tokens_evicted", 0) or 0)
        except Exception as exc:  # noqa: BLE001 - a failed gate answers false; the scheduler keeps serving
            return self._finish("failed", f"eviction raised {type(exc).__name__}: {exc}")
        self.last_evicted_tokens = evicted
        if evicted <= 0:
            return self._finish(
                "nothing_evicted", f"requested {value} token(s), {self.last_evictable_tokens} evictable, 0 evicted"
            )
        return self._finish(
            "evicted",
            f"evicted {evicted} of {value} requested device token(s) "
            f"({self.last_evictable_tokens} evictable) with write-back to host",
        )


GATE = Gate()


def build_set_internal_state(stock):
    def set_internal_state(self, recv_req):
        requested = getattr(recv_req, "server_args", None) or {}
        if GATE_KEY not in requested:
            return stock(self, recv_req)
        from sglang.srt.managers.io_struct import SetInternalStateReqOutput

        if len(requested) != 1:
            GATE._finish("bad_value", f"{GATE_KEY} must be sent alone, got keys {sorted(requested)}")
            return SetInternalStateReqOutput(updated=False)
        return SetInternalStateReqOutput(updated=GATE.run(self.scheduler, requested[GATE_KEY]))

    return set_internal_state


def build_get_internal_state(stock):
    def get_internal_state(self, recv_req):
        out = stock(self, recv_req)
        try:
            out.internal_state["hicache_gate"] = GATE.state()
        except Exception:  # noqa: BLE001
            logger.debug("could not add the gate state", exc_info=True)
        return out

    return get_internal_state
