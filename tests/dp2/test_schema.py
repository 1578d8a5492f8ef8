"""The payload schema is read from the live stock class, never hard-coded: width, column order and
fallback row come from stock ``_get_local_tensor`` / ``_get_fallback_tensor``, and a stock change
(extra column, swapped fields, renamed field) is refused at startup."""

from __future__ import annotations

import dataclasses

import pytest
import torch

dp_attn = pytest.importorskip("sglang.srt.managers.scheduler_components.dp_attn")

from dspark_harden.dp2.mlp_sync import SchemaError, live_schema  # noqa: E402


def test_live_schema_matches_stock():
    cls = dp_attn.MLPSyncBatchInfo
    schema = live_schema(cls)
    info = cls(
        num_dp_ranks=2,
        tp_size=1,
        cp_size=1,
        num_tokens=3,
        num_tokens_for_logprob=2,
        can_run_decode_cuda_graph=True,
        can_run_draft_cuda_graph=False,
        can_run_prefill_cuda_graph=True,
        is_extend_in_batch=True,
        local_can_run_tbo=False,
        local_forward_mode=2,
        prefill_cuda_graph_max_prefix_len=9,
        is_health_check=True,
        attention_pairs=77,
    )
    assert schema.width == info._get_local_tensor("cpu").numel() == 11
    assert [int(getattr(info, c)) for c in schema.columns] == info._get_local_tensor("cpu").tolist()
    assert list(schema.fallback) == info._get_fallback_tensor("cpu").tolist()


@pytest.mark.parametrize(
    "extra, message",
    [
        (0, r"columns \[11\] of the 12-wide row come from fields this version of dspark-harden does not know"),
        (5, r"an all-zero instance packs \[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5\]"),
    ],
)
def test_extra_stock_column_is_refused(extra, message):
    @dataclasses.dataclass
    class Wider(dp_attn.MLPSyncBatchInfo):
        def _get_local_tensor(self, device, dtype=torch.int64):
            base = super()._get_local_tensor(device, dtype)
            return torch.cat([base, torch.tensor([extra], dtype=dtype)])

    with pytest.raises(SchemaError, match=message):
        live_schema(Wider)


def test_swapped_columns_are_followed_not_assumed():
    @dataclasses.dataclass
    class Swapped(dp_attn.MLPSyncBatchInfo):
        def _get_local_tensor(self, device, dtype=torch.int64):
            t = super()._get_local_tensor(device, dtype)
            return t[[1, 0] + list(range(2, t.numel()))]

    schema = live_schema(Swapped)
    assert schema.columns[:2] == ("num_tokens_for_logprob", "num_tokens")


def test_field_packed_twice_is_refused():
    @dataclasses.dataclass
    class Dup(dp_attn.MLPSyncBatchInfo):
        def _get_local_tensor(self, device, dtype=torch.int64):
            t = super()._get_local_tensor(device, dtype).clone()
            t[10] = t[0]
            return t

    with pytest.raises(SchemaError, match="num_tokens lands in columns"):
        live_schema(Dup)
