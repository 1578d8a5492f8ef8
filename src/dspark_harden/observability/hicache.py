"""HiCache transfers in flight per ``dp_rank``: ``dspark_harden_hicache_ongoing_{operations,tokens}{kind}``.

Stock SGLang 0.5.23 counts HiCache transfers once they finish (``sglang:hicache_backup_tokens_total`` and
``_duration_seconds`` for device->host write-through, ``sglang:load_back_tokens_total`` for host->device,
``sglang:backuped_tokens_total`` / ``sglang:prefetched_tokens_total`` for the storage tier) but exports
nothing of what is still in flight. The in-flight state lives in ``UnifiedRadixCache``'s maps
(mem_cache/unified_radix_cache.py, ``_reset_full``), one entry per operation:

==============  =============================  ==========================================================
kind            operations                     tokens
==============  =============================  ==========================================================
write_through   ``ongoing_write_through``      ``cache_controller.write_queue`` (``CacheOperation``
                (buffer mode: the pipeline's)  device rows not yet submitted) + ``ack_write_queue``
                                               (``HiCacheAck.num_tokens`` submitted, not yet acknowledged)
load_back       ``ongoing_load_back``          ``load_queue`` + ``ack_load_queue``, the same way
backup          ``ongoing_backup``             not exported: the map keeps (node id, host lock) and the
                                               ``StorageOperation`` lives in the storage thread's queues
prefetch        ``ongoing_prefetch``           ``len(host_indices)`` of each ``_OngoingPrefetch``
==============  =============================  ==========================================================

The stock tree keeps node ids only (its Rust tree core exposes no per-node length), so the write-through
and load-back tokens come from the cache controller's own queues, which hold exactly the rows of those
operations. :class:`HiCacheSampler` is driven by the scheduler-phase recorder: the wrapped
``check_hicache_events`` (phase ``check_hicache_events``) tells it which tree this scheduler polls, and every
recorder flush (scheduler thread, at most once per flush interval) samples that tree and sets the gauges.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from ..core import metrics
from .metrics import HICACHE_KINDS
from .metrics import HICACHE_TOKEN_KINDS as TOKEN_KINDS

OPERATIONS = "dspark_harden_hicache_ongoing_operations"
TOKENS = "dspark_harden_hicache_ongoing_tokens"


def _queue_tokens(ops: Any, acks: Any) -> int:
    """Rows of the controller's not-yet-submitted operations plus its submitted, unacknowledged ones."""
    n = 0
    for op in ops or ():
        n += len(op.device_indices)
    for ack in acks or ():
        n += int(ack.num_tokens)
    return n


def sample(tree: Any) -> dict:
    """``kind -> (operations, tokens)`` in flight in ``tree`` (a stock ``UnifiedRadixCache``); tokens is
    None where stock keeps no count (backup)."""
    cc = getattr(tree, "cache_controller", None)
    pipeline = getattr(tree, "buffer_pipeline", None)
    write = pipeline.ongoing_write_through if pipeline is not None else tree.ongoing_write_through
    backup = tree.ongoing_backup
    prefetch = tree.ongoing_prefetch
    out = {
        "write_through": (
            len(write),
            _queue_tokens(cc.write_queue, cc.ack_write_queue) if cc is not None else 0,
        ),
        "load_back": (
            len(tree.ongoing_load_back),
            _queue_tokens(cc.load_queue, cc.ack_load_queue) if cc is not None else 0,
        ),
        "backup": (len(backup), None),
        "prefetch": (len(prefetch), sum(len(info.host_indices) for info in prefetch.values())),
    }
    return out


class HiCacheSampler:
    """Sets the gauges of the tree this scheduler polls; called by :meth:`PhaseRecorder.flush`."""

    def __init__(self) -> None:
        self._tree: Optional[weakref.ref] = None
        self._children: Optional[dict] = None
        self.dp_label = "none"
        self.samples = 0

    def watch(self, tree: Any) -> None:
        ref = self._tree
        if ref is None or ref() is not tree:
            self._tree = weakref.ref(tree)

    def tree(self) -> Any:
        return self._tree() if self._tree is not None else None

    def configure(self, dp_label: str) -> None:
        self.dp_label, self._children = dp_label, None

    def __call__(self) -> None:
        tree = self.tree()
        if tree is None:
            return
        values = sample(tree)
        if self._children is None:
            ops, toks = metrics.get(OPERATIONS), metrics.get(TOKENS)
            self._children = {
                k: (ops.labels(self.dp_label, k), toks.labels(self.dp_label, k) if k in TOKEN_KINDS else None)
                for k in HICACHE_KINDS
            }
        for kind, (n_ops, n_tokens) in values.items():
            ops, toks = self._children[kind]
            ops.set(n_ops)
            if toks is not None:
                toks.set(n_tokens)
        self.samples += 1


SAMPLER = HiCacheSampler()
