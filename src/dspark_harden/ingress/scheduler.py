"""Scheduler side: observe batch messages where they arrive.

Stock ``Scheduler.handle_batch_generate_request`` already accepts a
``BatchTokenizedGenerateReqInput`` and adds every item in the same receive pass (one scheduling
opportunity). The wrapper only counts the message and its size per DP rank, so operators (and
the end-to-end test) can see that a routed batch arrived as ONE message.
"""

from __future__ import annotations

import logging

from ..core import metrics, roles

logger = logging.getLogger("dspark_harden.ingress")


def dp_label() -> str:
    ctx = roles.CONTEXT
    if ctx is not None and ctx.dp_rank is not None:
        return str(ctx.dp_rank)
    try:
        from sglang.srt.runtime_context import get_parallel

        rank = get_parallel().dp_rank
        return "none" if rank is None else str(rank)
    except Exception:  # noqa: BLE001
        return "none"


def _is_group_leader() -> bool:
    """Only the first attention-TP/CP rank of a DP group counts (its peers get the same requests
    by broadcast; counting them too would multiply every message)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        return (getattr(par, "attn_tp_rank", 0) or 0) == 0 and (getattr(par, "attn_cp_rank", 0) or 0) == 0
    except Exception:  # noqa: BLE001
        return True


def build_handle_batch_generate_request(stock):
    def handle_batch_generate_request(self, recv_req):
        size = len(recv_req)
        label = dp_label()
        logger.debug("dspark-harden: DP rank %s received one batch message with %d request(s)", label, size)
        if not _is_group_leader():
            return stock(self, recv_req)
        try:
            metrics.get("dspark_harden_scheduler_batch_messages_total").labels(label).inc()
            metrics.get("dspark_harden_scheduler_batch_message_requests").labels(label).observe(size)
        except Exception:  # noqa: BLE001 - metrics must never break request intake
            logger.debug("scheduler batch metric failed", exc_info=True)
        return stock(self, recv_req)

    return handle_batch_generate_request
