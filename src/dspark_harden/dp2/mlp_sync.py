"""Hardened ``MLPSyncBatchInfo.all_gather`` over the native DP2 channel.

The stock call builds torch tensors, ``repeat``s a fallback row, exchanges over gloo, masks
inactive ranks, copies to host and ``tolist()``s every column (~1.3 ms on 2 cores, ~0.3 ms of it
Python/torch work). Here the row is packed from the dataclass fields with one ``struct.pack_into``
into the native request buffer, both rows land in a preallocated int64 tensor slot, and the
gathered fields are derived from the plain Python ints one ``struct.unpack_from`` returns. The objects downstream code reads are produced exactly: ``tp0_info_cpu``
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
from bisect import bisect_left as _bucket
from typing import Any, Optional

from .channels import RUNTIME, config_digest
from .metrics import DP2_HIST_EDGES_S as _EDGES
from .native import Channel, Dp2Error

# the gathered reductions stock all_gather derives, keyed by field name (checked against the live
# schema at startup); everything else in the row is only carried (tp0_info_cpu).
_KNOWN_FIELDS = (
    "num_tokens",
    "num_tokens_for_logprob",
    "can_run_decode_cuda_graph",
    "is_extend_in_batch",
    "local_can_run_tbo",
    "local_forward_mode",
    "can_run_prefill_cuda_graph",
    "prefill_cuda_graph_max_prefix_len",
    "can_run_draft_cuda_graph",
    "is_health_check",
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
    """A compiled ``info -> [int, ...]`` in column order with stock's ``int()`` conversions (the slow path
    for values ``struct`` does not take as int64: floats, numpy scalars...)."""
    items = ", ".join(f"int(info.{name})" for name in schema.columns)
    ns: dict = {}
    exec(compile(f"def pack(info):\n    return [{items}]\n", "<dp2-pack>", "exec"), ns)  # noqa: S102 - names come from the live schema
    return ns["pack"]


def _make_request_packer(schema: Schema):
    """A compiled ``(pack_into, buf, row, info) -> None`` writing ``[row, field, ...]`` (columns in live-schema
    order, attributes read like stock's ``_get_local_tensor`` does) with one ``struct.pack_into``. Raises
    ``struct.error`` for anything that is not an int (or bool) in int64 range."""
    items = ", ".join(f"info.{name}" for name in schema.columns)
    ns: dict = {}
    src = f"def pack_request(pack_into, buf, row, info):\n    pack_into(buf, 0, row, {items})\n"
    exec(compile(src, "<dp2-pack-request>", "exec"), ns)  # noqa: S102 - names come from the live schema
    return ns["pack_request"]


POOL = 512  # result tensors allocated per batch (each handed out once, never reused)


class MlpSync:
    """Replacement body of ``MLPSyncBatchInfo.all_gather`` for one process.

    Hot path per call: one ``struct.pack_into`` writes ``[row, fields...]`` into the request buffer bound
    to the native handle; the one-argument native call ``dspark_dp2_exchange_bound`` writes both rows
    straight into row ``row`` of a preallocated ``[POOL, 2, width]`` int64 tensor (never reused: that
    slot becomes ``tp0_info_cpu``); one ``struct.unpack_from`` yields the Python ints the gathered fields
    are derived from (min / max of two ints as conditional expressions: ``bool(min(a, b))`` costs
    ~10x more and is the same value for ints).
    """

    def __init__(self, dp_attn_module: Any, schema: Schema):
        import struct

        import torch

        from .native import ERRBUF, _check, ffi, lib

        self._dp_attn = dp_attn_module
        self._torch = torch
        self._ffi, self._lib, self._check, self._errbuf = ffi, lib, _check, ERRBUF
        self._struct_error = struct.error
        self.schema = schema
        self.width = w = schema.width
        self.pack = _make_packer(schema)
        self._pack_request = _make_request_packer(schema)
        self._req_pack_into = struct.Struct(f"<{1 + w}q").pack_into
        self._unpack_from = struct.Struct(f"<{2 * w}q").unpack_from
        self._row_bytes = 2 * w * 8
        c = {name: i for i, name in enumerate(schema.columns)}
        self._i = (
            c["num_tokens"],
            c["num_tokens_for_logprob"],
            c["can_run_decode_cuda_graph"],
            c["is_extend_in_batch"],
            c["can_run_prefill_cuda_graph"],
            c["prefill_cuda_graph_max_prefix_len"],
            c["can_run_draft_cuda_graph"],
            c["is_health_check"],
            c["attention_pairs"],
            c["local_forward_mode"],
        )
        self._fallback_t = torch.tensor(schema.fallback, dtype=torch.int64)
        self.channel: Optional[Channel] = None
        self._group: Any = None
        self._act: Any = None
        self._act_p: Any = None
        self._acc = None
        self._pool: list = []
        self._pool_i = POOL
        self._pool_buf: Any = None
        self._pool_ptr: Any = None
        from sglang.srt.observability.metrics_collector import DPCooperationInfo

        self._coop = DPCooperationInfo

    # -- setup --------------------------------------------------------------------------------
    def open(self, runtime=RUNTIME) -> Channel:
        geometry = (2, 1, 1)
        digest = config_digest("mlp", self.width, self.schema.columns + self.schema.fallback, geometry)
        self.channel = runtime.open("mlp", width=self.width, digest=digest)
        self._acc = runtime.accs["mlp"]
        self._refill()
        return self.channel

    def _refill(self) -> None:
        """A fresh ``[POOL, 2, width]`` result tensor, bound as the output rows of the native call."""
        base = self._torch.empty((POOL, 2, self.width), dtype=self._torch.int64)
        ptr = self._ffi.cast("int64_t *", base.data_ptr())
        self.channel.bind(self.channel._req, ptr, POOL)
        self._pool_ptr = ptr
        self._pool = list(base.unbind(0))
        self._pool_buf = self._ffi.buffer(ptr, POOL * self._row_bytes)
        self._pool_base = base  # keeps the pointer valid even after every view is dropped
        self._pool_i = 0

    def _fail(self, message: str) -> Dp2Error:
        ch = self.channel
        exc = ch.poison(message) if ch is not None else Dp2Error(-1, message)
        if not isinstance(exc, Dp2Error) or exc.code <= 0:
            exc = Dp2Error(-1, message)
        RUNTIME.record_error("mlp", exc)
        return exc

    def _check_call(self, info: Any, group: Any, use_all_reduce: bool) -> None:
        if self.channel is None or self.channel.closed:
            raise Dp2Error(-1, "dp2: MLPSyncBatchInfo.all_gather called without an open native channel")
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
        """Stock masks rows whose ``tp_group.active_ranks_cpu`` entry is 0 (a shorter mask means all active)."""
        act = self._dp_attn.get_parallel().tp_group.active_ranks_cpu
        if act is not self._act:
            self._act = act
            self._act_p = (
                self._ffi.cast("int32_t *", act.data_ptr())
                if act.dtype == self._torch.int32
                and act.is_contiguous()
                and act.numel() >= 2
                and act.device.type == "cpu"
                else None
            )
        p = self._act_p
        if p is not None:
            return p[0], p[1]
        vals = act.tolist()
        return (1, 1) if len(vals) < 2 else (vals[0], vals[1])

    def _pack_slow(self, ch: Channel, row: int, info: Any) -> None:
        """Values ``struct`` refused: convert each field with ``int()`` like stock's ``_get_local_tensor``."""
        try:
            vals = self.pack(info)
        except (TypeError, ValueError, OverflowError) as exc:
            raise self._fail(f"MLPSyncBatchInfo row cannot be packed as int64: {exc}") from None
        try:
            self._req_pack_into(ch._req_buf, 0, row, *vals)
        except self._struct_error as exc:
            raise self._fail(f"MLPSyncBatchInfo row value out of int64 range: {exc}") from None

    # -- hot path -----------------------------------------------------------------------------
    def __call__(self, info: Any, device: Any, group: Any, use_all_reduce: bool = False) -> None:
        t0 = time.perf_counter()
        ch = self.channel
        if group is not self._group or use_all_reduce or ch is None:
            self._check_call(info, group, use_all_reduce)
            ch = self.channel
        if info.num_dp_ranks != 2 or info.tp_size != 1 or info.cp_size != 1:
            raise self._fail(
                f"MLPSyncBatchInfo geometry dp={info.num_dp_ranks} attn_tp={info.tp_size} cp={info.cp_size}; "
                f"the native DP2 exchange needs 2/1/1"
            )
        i = self._pool_i
        if i >= POOL:
            self._refill()
            i = 0
        elif ch._bound_out is not self._pool_ptr:  # Channel.exchange rebound the handle to its own buffer
            ch.bind(ch._req, self._pool_ptr, POOL)
        self._pool_i = i + 1
        try:
            self._pack_request(self._req_pack_into, ch._req_buf, i, info)
        except self._struct_error:  # a field holds a non-int (e.g. a numpy scalar) or is out of range
            self._pack_slow(ch, i, info)
        rc = self._lib.dspark_dp2_exchange_bound(ch._h)
        if rc:
            if rc == self._lib.DSPARK_DP2_STALLED:  # the peer is alive but late: warn, count, keep waiting
                try:
                    rc = ch._keep_waiting(ch._h)
                except Dp2Error as exc:
                    RUNTIME.record_error("mlp", exc)
                    raise
            if rc:
                try:
                    self._check(rc, ch._err, "dspark_dp2_exchange")
                except Dp2Error as exc:
                    RUNTIME.record_error("mlp", exc)
                    raise
        w = self.width
        v = self._unpack_from(self._pool_buf, i * self._row_bytes)
        pool = self._pool
        tp0 = pool[i]
        pool[i] = None  # handed out: never reused
        act = self._dp_attn.get_parallel().tp_group.active_ranks_cpu
        if act is self._act and self._act_p is not None:
            ap = self._act_p
            a0, a1 = ap[0], ap[1]
        else:
            a0, a1 = self._active()
        if not (a0 and a1):
            v = list(v)
            fb = list(self.schema.fallback)
            if not a0:
                v[0:w] = fb
                tp0[0] = self._fallback_t
            if not a1:
                v[w : 2 * w] = fb
                tp0[1] = self._fallback_t
        i_nt, i_nl, i_dcg, i_ext, i_pcg, i_pfx, i_dr, i_hc, i_ap, i_fm = self._i
        info.tp0_info_cpu = tp0
        info.global_num_tokens = [v[i_nt], v[w + i_nt]]
        info.global_num_tokens_for_logprob = [v[i_nl], v[w + i_nl]]
        # stock: bool(column.min()) / bool(column.max()) / int(column.max()) over the two rows
        a, b = v[i_dcg], v[w + i_dcg]
        info.can_run_decode_cuda_graph = (a if a <= b else b) != 0
        a, b = v[i_ext], v[w + i_ext]
        info.is_extend_in_batch = (a if a >= b else b) != 0
        a, b = v[i_pcg], v[w + i_pcg]
        info.can_run_prefill_cuda_graph = (a if a <= b else b) != 0
        a, b = v[i_pfx], v[w + i_pfx]
        info.prefill_cuda_graph_max_prefix_len = a if a >= b else b
        a, b = v[i_dr], v[w + i_dr]
        info.can_run_draft_cuda_graph = (a if a <= b else b) != 0
        a, b = v[i_hc], v[w + i_hc]
        info.any_health_check = (a if a >= b else b) != 0
        info.global_attention_pairs = [v[i_ap], v[w + i_ap]]
        if self._dp_attn._ENABLE_METRICS_DP_ATTENTION:
            info.dp_cooperation_info = self._coop.create([v[i_fm], v[w + i_fm]])
        now = time.perf_counter()
        d = info.sync_wait_seconds = now - t0
        acc = self._acc
        acc.call_sum += d
        if d > acc.call_max:
            acc.call_max = d
        acc.call_hist[_bucket(_EDGES, d)] += 1
        if now >= acc.deadline:
            acc.flush(now)


MLP: Optional[MlpSync] = None


def build_all_gather(stock: Any):
    """Patch builder for ``MLPSyncBatchInfo.all_gather`` (REPLACE: stock is never called)."""

    def all_gather(self, device, group, use_all_reduce: bool = False):
        sync = MLP
        if sync is None:
            raise Dp2Error(
                -1, "dp2: native exchange enabled but not started in this process (dspark_process_bound did not run)"
            )
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
