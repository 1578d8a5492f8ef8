"""Prefill CUDA graphs with two-batch overlap (``DSPARK_HARDEN_PREFILL_GRAPH_TBO=1``): the hooks.

Stock 0.5.23 cannot capture them (tbo.py says why). With the switch on, the full prefill backend
captures and replays TBO buckets under the fixed flat split of :mod:`.tbo_split`:

* capture -- ``TboCudaGraphRunnerPlugin.capture_one_batch_size`` (wrapped): an EXTEND / MIXED
  capture batch gets its two children from :func:`tbo_split.capture_children` (stock ``filter_batch``
  over the whole request axis, per-slot fields in address-stable :class:`tbo_split.ChildBuffers`);
  any other mode (decode graphs: Bugbot #2) goes to stock unchanged;
* replay metadata -- ``TboAttnBackend.init_forward_metadata_out_graph`` (wrapped): for an EXTEND
  replay view the primary is planned from the padded view as stock does, then *both* children from
  :func:`tbo_split.child_view` of the same split (a child without live tokens is planned as all
  zero-length sentinels, so no stale plan of an earlier, larger replay survives);
* replay buffers -- ``PrefillCudaGraphRunner.load_batch`` (wrapped): after stock's load, the
  children's per-slot buffers and the two ``num_token_non_padded`` counts the graph reads are
  refreshed from the same split;
* gate -- the DP decision admits a graph only when the gathered TBO columns say every rank runs TBO
  this step (:func:`tbo_synchronized`: min-reduced ``local_can_run_tbo`` and agreeing forward modes,
  the values stock's ``TboDPAttentionPreparer.compute_output`` reads); the forward-time guard raises
  should an admitted batch carry no TBO split.
"""

from __future__ import annotations

from typing import Any, Callable

#: set by the feature when DSPARK_HARDEN_PREFILL_GRAPH_TBO=1 is bound (tests build with explicit flags)
ACTIVE = False


def _is_extend(mode: Any) -> bool:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return mode in (ForwardMode.EXTEND, ForwardMode.MIXED)


def tbo_synchronized(tp0_info_cpu: Any) -> bool:
    """Every rank runs TBO this step, from the gathered table alone (columns 4 and 5 of
    ``MLPSyncBatchInfo.tp0_info_cpu``: ``local_can_run_tbo``, ``local_forward_mode``)."""
    from sglang.srt.batch_overlap.two_batch_overlap import TboDPAttentionPreparer

    if tp0_info_cpu is None:
        return False
    can_run = min(int(x) for x in tp0_info_cpu[:, 4].tolist())
    _mode, agree = TboDPAttentionPreparer._compute_global_forward_mode(tp0_info_cpu[:, 5].tolist())
    return bool(can_run and agree)


def bucket_problem(server_args: Any) -> str:
    """Startup: the configured prefill buckets against ``full_prefill_max_req`` when both are set
    (otherwise the capture hook checks each bucket when it captures it); ``""`` when fine."""
    from .tbo_split import TboSplitError, check_buckets

    cfg = getattr(server_args, "cuda_graph_config", None)
    prefill = getattr(cfg, "prefill", None)
    bs, slots = getattr(prefill, "bs", None), getattr(prefill, "full_prefill_max_req", None)
    if not bs or not slots:
        return ""
    try:
        check_buckets(list(bs), int(slots))
    except TboSplitError as exc:
        return str(exc)
    return ""


def _buffers(plugin: Any, slots: int, device: Any):
    from .tbo_split import ChildBuffers

    bufs = getattr(plugin, "_dspark_child_buffers", None)
    if bufs is None:
        bufs = plugin._dspark_child_buffers = ChildBuffers(slots, device)
    elif bufs.slots < slots:
        raise RuntimeError(
            f"TBO prefill capture needs {slots} request slots but the children's buffers hold {bufs.slots} "
            "(the largest bucket is captured first and fixes them)"
        )
    return bufs


def build_capture_one_batch_size(stock: Callable, active: Callable[[], bool] = lambda: ACTIVE) -> Callable:
    def capture_one_batch_size(self, batch, num_tokens):
        from sglang.srt.batch_overlap import two_batch_overlap as T

        if not active() or not _is_extend(batch.forward_mode) or not T.is_tbo_enabled():
            return stock(self, batch, num_tokens)  # decode / verify graphs: stock (Bugbot #2)
        from . import tbo_split

        if len(batch.input_ids) != num_tokens:
            raise tbo_split.TboSplitError(f"capture batch has {len(batch.input_ids)} rows for bucket {num_tokens}")
        override = getattr(batch, "max_seq_len_override", None)
        batch.max_seq_len_override = None  # filter_batch refuses fields it does not know; restored below
        try:
            bufs = _buffers(self, len(batch.seq_lens), batch.seq_lens.device)
            tbo_split.capture_children(batch, self._tbo_children_num_token_non_padded, bufs)
        finally:
            batch.max_seq_len_override = override
        for child in batch.tbo_children:
            child.max_seq_len_override = override

    capture_one_batch_size.__doc__ = stock.__doc__
    return capture_one_batch_size


def build_out_graph(stock: Callable, active: Callable[[], bool] = lambda: ACTIVE) -> Callable:
    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        if in_capture or not active() or not _is_extend(forward_batch.forward_mode):
            return stock(self, forward_batch, in_capture=in_capture)
        if not self._children_use_cuda_graph():
            return stock(self, forward_batch, in_capture=in_capture)
        from . import tbo_split

        self.primary.init_forward_metadata_out_graph(forward_batch=forward_batch, in_capture=False)
        children = tbo_split.split_of_view(forward_batch, slots=forward_batch.batch_size)
        for backend, child in zip(self.children, children, strict=True):
            backend.init_forward_metadata_out_graph(
                forward_batch=tbo_split.child_view(forward_batch, child), in_capture=False
            )

    init_forward_metadata_out_graph.__doc__ = stock.__doc__
    return init_forward_metadata_out_graph


def build_load_batch(stock: Callable, active: Callable[[], bool] = lambda: ACTIVE) -> Callable:
    def load_batch(self, forward_batch, **kwargs):
        out = stock(self, forward_batch, **kwargs)
        plugin = getattr(self, "tbo_plugin", None)
        bufs = getattr(plugin, "_dspark_child_buffers", None)
        if not active() or bufs is None or not _is_extend(forward_batch.forward_mode):
            return out
        from . import tbo_split

        children = tbo_split.split_of_view(forward_batch, slots=bufs.slots, bucket=len(out[0].input_ids))
        tbo_split.refresh(bufs, plugin._tbo_children_num_token_non_padded, children)
        return out

    load_batch.__doc__ = stock.__doc__
    return load_batch
