"""Hardened ``MLPSyncBatchInfo.all_gather`` over the native DP2 channel.

The stock call builds torch tensors, ``repeat``s a fallback row, exchanges over gloo, masks
inactive ranks, copies to host and ``tolist()``s every column (~1.3 ms on 2 cores, ~0.3 ms of it
Python/torch work). Here the row is packed from the dataclass fields straight into a native buffer,
the peer's row lands in a preallocated int64 staging tensor, and the gathered fields are derived
from plain Python ints. The objects downstream code reads are produced exactly: ``tp0_info_cpu``
is a fresh ``[2, width]`` int64 CPU tensor (a clone, so later steps never alias it), the lists are
lists of Python ints, the reductions are Python bools/ints, ``sync_wait_seconds`` is the whole
call, ``dp_cooperation_info`` only when stock would set it.

The payload schema (width, which field sits in which column, the fallback row of an inactive
rank) is read from the live stock class at startup (:func:`live_schema`), never hard-coded: a
schema change in SGLang fails startup instead of exchanging the wrong columns.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from .channels import RUNTIME, config_digest
from .native import Channel, Dp2Error

# the gathered reductions stock all_gather derives, keyed by field name (checked against the live
# schema at startup); everything else in the row is only carried (tp0_info_cpu).
_KNOWN_FIELDS = (
    "num_tokens", "num_tokens_for_logprob", "can_run_decode_cuda_graph", "is_extend_in_batch",
    "local_can_run_tbo", "local_forward_mode", "can_run_prefill_cuda_graph",
    "prefill_cuda_graph_max_prefix_len", "can_run_draft_cuda_graph", "is_health_check",
    "attention_pairs",
)
_GEOMETRY_FIELDS = ("num_dp_ranks", "tp_size", "cp_size")


class SchemaError(Dp2Error):
    def __init__(self, message: str):
        super().__init__(-1, message)


@dataclasses.dataclass(frozen=True)
class Schema:
    width: int
    columns: tuple  # field name of each column, in stock order
    fallback: tuple  # stock fallback row (inactive rank)


def _probe_instance(cls: Any, overrides: dict) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            continue
        kwargs[f.name] = {"num_dp_ranks": 2, "tp_size": 1, "cp_size": 1}.get(f.name, 0)
    kwargs.update(overrides)
    return cls(**kwargs)


def live_schema(cls: Any) -> Schema:
    """Read width, column order and fallback row from the stock ``_get_local_tensor`` /
    ``_get_fallback_tensor``: one probe per field (that field set to a distinctive value, every
    other row field zero) locates its column. Raises :class:`SchemaError` if any column cannot be
    attributed to exactly one known field."""
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [n for n in _KNOWN_FIELDS if n not in names]
    if missing:
        raise SchemaError(f"MLPSyncBatchInfo schema changed: fields {missing} no longer exist")
    base = _probe_instance(cls, {n: 0 for n in _KNOWN_FIELDS})
    zero_row = base._get_local_tensor(device="cpu").tolist()
    width = len(zero_row)
    if any(v != 0 for v in zero_row):
        raise SchemaError(f"MLPSyncBatchInfo schema changed: an all-zero instance packs {zero_row}")
    columns: list = [None] * width
    for name in _KNOWN_FIELDS:
        row = _probe_instance(cls, {**{n: 0 for n in _KNOWN_FIELDS}, name: 7})._get_local_tensor(device="cpu").tolist()
        hits = [i for i, v in enumerate(row) if v != 0]
        if len(hits) != 1:
            raise SchemaError(f"MLPSyncBatchInfo schema changed: field {name} lands in columns {hits}")
        col = hits[0]
        if columns[col] is not None:
            raise SchemaError(f"MLPSyncBatchInfo schema changed: fields {columns[col]} and {name} share column {col}")
        columns[col] = name
    unknown = [i for i, c in enumerate(columns) if c is None]
    if unknown:
        raise SchemaError(
            f"MLPSyncBatchInfo schema changed: columns {unknown} of the {width}-wide row come from fields this "
            f"version of dspark-harden does not know"
        )
    fallback = tuple(int(v) for v in base._get_fallback_tensor(device="cpu").tolist())
    if len(fallback) != width:
        raise SchemaError(f"MLPSyncBatchInfo fallback row has width {len(fallback)}, local row {width}")
    return Schema(width=width, columns=tuple(columns), fallback=fallback)


def _make_packer(schema: Schema):
    """A compiled ``info -> [int, ...]`` in column order (no per-call getattr loop)."""
    items = ", ".join(f"int(info.{name})" for name in schema.columns)
    ns: dict = {}
    exec(compile(f"def pack(info):\n    return [{items}]\n", "<dp2-pack>", "exec"), ns)  # noqa: S102 - names come from the live schema
    return ns["pack"]


class MlpSync:
    """Replacement body of ``MLPSyncBatchInfo.all_gather`` for one process."""

    def __init__(self, dp_attn_module: Any, schema: Schema):
        import torch

        self._dp_attn = dp_attn_module
        self._torch = torch
        self.schema = schema
        self.width = w = schema.width
        self.pack = _make_packer(schema)
        c = {name: i for i, name in enumerate(schema.columns)}
        self._i = (
            c["num_tokens"], c["num_tokens_for_logprob"], c["can_run_decode_cuda_graph"],
            c["is_extend_in_batch"], c["can_run_prefill_cuda_graph"], c["prefill_cuda_graph_max_prefix_len"],
            c["can_run_draft_cuda_graph"], c["is_health_check"], c["attention_pairs"], c["local_forward_mode"],
        )
        self.stage = torch.zeros((2, w), dtype=torch.int64)
        self.channel: Optional[Channel] = None
        self._group: Any = None
        self._act: Any = None
        self._act_vals = (1, 1)
        self._acc = None
        from sglang.srt.observability.metrics_collector import DPCooperationInfo

        self._coop = DPCooperationInfo

    # -- setup --------------------------------------------------------------------------------
    def open(self, runtime=RUNTIME) -> Channel:
        geometry = (2, 1, 1)
        digest = config_digest("mlp", self.width, self.schema.columns + self.schema.fallback, geometry)
        self.channel = runtime.open("mlp", width=self.width, digest=digest, out_tensor=self.stage)
        self._acc = runtime.accs["mlp"]
        return self.channel

    def _fail(self, message: str) -> Dp2Error:
        ch = self.channel
        exc = ch.poison(message) if ch is not None else Dp2Error(-1, message)
        if not isinstance(exc, Dp2Error) or exc.code <= 0:
            exc = Dp2Error(-1, message)
        RUNTIME.record_error("mlp", exc)
        return exc

    def _check_call(self, info: Any, group: Any, use_all_reduce: bool) -> None:
        if self.channel is None:
            raise Dp2Error(-1, "dp2: MLPSyncBatchInfo.all_gather called before the native channel was opened")
        if use_all_reduce:
            raise self._fail(
                "MLPSyncBatchInfo.all_gather asked for the WORLD all-reduce path (elastic EP); the native DP2 "
                "exchange only serves the DP2 attention-TP1 all-gather"
            )
        if group is not self._group:
            dist = self._torch.distributed
            ws, rk = dist.get_world_size(group), dist.get_rank(group)
            if ws != 2 or rk != self.channel.rank:
                raise self._fail(
                    f"MLPSyncBatchInfo.all_gather group has world size {ws} and rank {rk}; the native channel is "
                    f"rank {self.channel.rank} of 2"
                )
            self._group = group

    def _active(self) -> tuple:
        act = self._dp_attn.get_parallel().tp_group.active_ranks_cpu
        if act is not self._act:
            self._act = act
        vals = act.tolist()
        if len(vals) < 2:
            return (1, 1)
        return (vals[0], vals[1])

    # -- hot path -----------------------------------------------------------------------------
    def __call__(self, info: Any, device: Any, group: Any, use_all_reduce: bool = False) -> None:
        t0 = time.perf_counter()
        if group is not self._group or use_all_reduce or self.channel is None:
            self._check_call(info, group, use_all_reduce)
        if info.num_dp_ranks != 2 or info.tp_size != 1 or info.cp_size != 1:
            raise self._fail(
                f"MLPSyncBatchInfo geometry dp={info.num_dp_ranks} attn_tp={info.tp_size} cp={info.cp_size}; "
                f"the native DP2 exchange needs 2/1/1"
            )
        row = self.pack(info)
        try:
            v = self.channel.exchange(row)
        except Dp2Error as exc:
            RUNTIME.record_error("mlp", exc)
            raise
        w = self.width
        a0, a1 = self._active()
        if not (a0 and a1):
            fb = list(self.schema.fallback)
            fbt = self._torch.tensor(fb, dtype=self._torch.int64)
            if not a0:
                v[0:w] = fb
                self.stage[0] = fbt
            if not a1:
                v[w : 2 * w] = fb
                self.stage[1] = fbt
        i_nt, i_nl, i_dcg, i_ext, i_pcg, i_pfx, i_dr, i_hc, i_ap, i_fm = self._i
        info.tp0_info_cpu = self.stage.clone()
        info.global_num_tokens = [v[i_nt], v[w + i_nt]]
        info.global_num_tokens_for_logprob = [v[i_nl], v[w + i_nl]]
        info.can_run_decode_cuda_graph = bool(min(v[i_dcg], v[w + i_dcg]))
        info.is_extend_in_batch = bool(max(v[i_ext], v[w + i_ext]))
        info.can_run_prefill_cuda_graph = bool(min(v[i_pcg], v[w + i_pcg]))
        info.prefill_cuda_graph_max_prefix_len = int(max(v[i_pfx], v[w + i_pfx]))
        info.can_run_draft_cuda_graph = bool(min(v[i_dr], v[w + i_dr]))
        info.any_health_check = bool(max(v[i_hc], v[w + i_hc]))
        info.global_attention_pairs = [v[i_ap], v[w + i_ap]]
        now = time.perf_counter()
        info.sync_wait_seconds = now - t0
        if self._dp_attn._ENABLE_METRICS_DP_ATTENTION:
            info.dp_cooperation_info = self._coop.create([v[i_fm], v[w + i_fm]])
        self._acc.record(self.channel.stats, now - t0, now)


MLP: Optional[MlpSync] = None


def build_all_gather(stock: Any):
    """Patch builder for ``MLPSyncBatchInfo.all_gather`` (REPLACE: stock is never called)."""

    def all_gather(self, device, group, use_all_reduce: bool = False):
        sync = MLP
        if sync is None:
            raise Dp2Error(-1, "dp2: native exchange enabled but not started in this process (dspark_process_bound did not run)")
        return sync(self, device, group, use_all_reduce)

    all_gather.__doc__ = stock.__doc__
    all_gather.__qualname__ = getattr(stock, "__qualname__", "MLPSyncBatchInfo.all_gather")
    return all_gather


def start(runtime=RUNTIME) -> MlpSync:
    """Validate the live schema against stock and open the ``mlp`` channel (scheduler startup)."""
    global MLP
    from sglang.srt.managers.scheduler_components import dp_attn

    schema = live_schema(dp_attn.MLPSyncBatchInfo)
    sync = MlpSync(dp_attn, schema)
    sync.open(runtime)
    MLP = sync
    return sync
