"""Tokenizer side: keep a uniformly routed HTTP batch together under DP attention.

Stock ``TokenizerManager._should_use_batch_tokenization`` answers False under DP attention
(unless ``--enable-tokenizer-batch-encode``), so every item of a batch is tokenized and sent as
its own ZMQ message. Our wrapper keeps the stock answer and additionally answers True when the
batch is routed to one DP rank and is one of the shapes the stock batch path handles
(``_batch_tokenize_and_process`` + ``_send_batch_request`` -> one
``BatchTokenizedGenerateReqInput``):

* every item text (no ``input_ids``/``input_embeds``): tokenized in one tokenizer call;
* no item text (pre-tokenized ``input_ids`` or ``input_embeds``): per-item, sent together.

Multimodal items and text/ids mixes keep the stock per-request path (the batch path raises on
them). ``parallel_sample_num > 1`` never reaches this method in stock.
"""

from __future__ import annotations

from typing import Any


def routed_batch_eligible(tm: Any, batch_size: int, obj: Any) -> bool:
    if batch_size <= 0:
        return False
    rank = getattr(obj, "routed_dp_rank", None)
    if rank is None:
        return False
    items = [obj[i] for i in range(batch_size)]
    if any(getattr(item, "routed_dp_rank", None) != rank for item in items):
        return False
    if getattr(tm, "is_generation", True) and any(item.contains_mm_input() for item in items):
        return False
    has_text = [bool(getattr(item, "text", None)) for item in items]
    if all(has_text):
        return not any(
            getattr(item, "input_ids", None) is not None or getattr(item, "input_embeds", None) is not None
            for item in items
        )
    return not any(has_text)


def _attn_dp_enabled() -> bool:
    from sglang.srt.runtime_context import get_parallel

    return bool(get_parallel().attn_dp_enabled)


def build_should_use_batch_tokenization(stock):
    def _should_use_batch_tokenization(self, batch_size, requests) -> bool:
        if stock(self, batch_size, requests):
            return True
        return _attn_dp_enabled() and routed_batch_eligible(self, batch_size, requests)

    return _should_use_batch_tokenization
