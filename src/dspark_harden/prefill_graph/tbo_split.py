"""The fixed flat-token TBO split of a captured prefill bucket (``DSPARK_HARDEN_PREFILL_GRAPH_TBO=1``).

A prefill graph is captured for one token bucket with a fixed request axis (the full backend's
request slots, unused slots zero-length sentinels). Two-batch overlap runs the body as two child
batches. Eager TBO picks a split per batch (``compute_split_seq_index``: a sequence boundary, or the
two-chunk cut at ``sum // 2`` inside one sequence); a graph cannot follow that, so the split here is
a *flat token index* fixed per bucket (``bucket // 2``), the same at capture and at every replay:

* child A owns bucket rows ``[0, T)``, child B rows ``[T, bucket)``;
* every child keeps the captured request axis: slot ``i`` of a child is slot ``i`` of the parent,
  with the part of request ``i``'s tokens that fall in the child's rows; a request cut by ``T`` is
  split like stock's two-chunk split (A: ``prefix``, ``a`` tokens; B: ``prefix + a``, the rest);
* a slot with no tokens in a child is a true zero-length sentinel (seq, extend and prefix lengths
  0, request-pool index 0), like the full backend's slot tail; start locations are the exclusive
  cumulative sum of the child's lengths (a trailing sentinel sits at the child's live-token count);
* a child with no live tokens at all (``N <= T``: B is all padding) is all sentinels with
  ``num_token_non_padded = 0``.

:func:`split` is the geometry (pure); :func:`child_view` builds the out-of-graph metadata view a
child attention backend is planned from at replay; :func:`capture_children` builds the two real
``ForwardBatch`` children of a capture batch through stock's ``TboForwardBatchPreparer.filter_batch``
with the per-slot fields in address-stable buffers (:class:`ChildBuffers`) that every replay
refreshes (:func:`refresh`). See docs/prefill_graph.md ("Prefill graphs with two-batch overlap").
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional, Sequence

#: per-slot fields every child keeps on the captured request axis (stock ``_PREFILL_STATIC_FIELDS`` subset)
SLOT_FIELDS = ("seq_lens", "extend_seq_lens", "extend_prefix_lens", "extend_start_loc", "req_pool_indices")


class TboSplitError(ValueError):
    """A batch that cannot take the fixed flat split (names the geometry)."""


@dataclass(frozen=True)
class Child:
    index: int  # 0: child A, 1: child B
    token_start: int  # the child's rows of the bucket: [token_start, token_end)
    token_end: int
    seq_lens: tuple
    extend_seq_lens: tuple
    extend_prefix_lens: tuple
    extend_start_loc: tuple
    req_pool_indices: tuple
    live_tokens: int  # num_token_non_padded of this child

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def live_slots(self) -> tuple:
        return tuple(i for i, n in enumerate(self.extend_seq_lens) if n > 0)

    def field(self, name: str) -> tuple:
        return getattr(self, name)


def split_token_index(bucket: int) -> int:
    """The fixed split of a bucket: ``bucket // 2`` (capture and replay use this one function)."""
    if bucket < 2:
        raise TboSplitError(f"a TBO prefill graph needs a bucket of at least 2 tokens, got {bucket}")
    return bucket // 2


def _holds(bucket: int, slots: int) -> bool:
    """Each child's query rows hold the whole request axis: DSV4's compressor planner requires
    ``batch_size <= num_q_tokens`` (c_plan.cuh ``RuntimeCheck``), and both children keep all slots."""
    t = split_token_index(bucket)
    return slots <= min(t, bucket - t)


def check_bucket(bucket: int, slots: int) -> None:
    """A bucket can be captured with TBO only if :func:`_holds`."""
    if not _holds(bucket, slots):
        t = split_token_index(bucket)
        raise TboSplitError(
            f"a TBO prefill graph of bucket {bucket} cannot hold {slots} request slots: each child keeps every "
            f"slot but has only {t} / {bucket - t} query rows, and DSV4's compressor planner requires "
            f"batch_size <= num_q_tokens (c_plan.cuh). Capture only buckets >= {2 * slots} "
            f"(cuda_graph_config prefill bs) or lower full_prefill_max_req"
        )


def check_buckets(buckets: Sequence[int], slots: int) -> None:
    """:func:`check_bucket` over a capture list, naming every bucket that fails."""
    bad = [int(b) for b in buckets if not _holds(int(b), slots)]
    if bad:
        raise TboSplitError(
            f"TBO prefill graphs keep all {slots} request slots (full_prefill_max_req) in each child, and DSV4's "
            f"compressor planner requires batch_size <= num_q_tokens (c_plan.cuh): buckets {bad} give children "
            f"with fewer query rows than slots. Capture only buckets >= {2 * slots} (cuda_graph_config prefill "
            f"bs) or lower full_prefill_max_req"
        )


def _exclusive_cumsum(xs: Sequence[int]) -> tuple:
    out, acc = [], 0
    for x in xs:
        out.append(acc)
        acc += x
    return tuple(out)


def split(
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    req_pool_indices: Sequence[int],
    *,
    bucket: int,
    slots: Optional[int] = None,
    split_token: Optional[int] = None,
) -> tuple:
    """``(child_a, child_b)`` of a batch whose requests occupy the bucket's first ``sum(extend_lens)``
    rows in slot order. ``slots`` (default ``len(extend_lens)``) is the request axis; the slots past
    the live requests are zero-length sentinels. ``split_token`` defaults to :func:`split_token_index`."""
    lens = [int(x) for x in extend_lens]
    pre = [int(x) for x in prefix_lens]
    rpi = [int(x) for x in req_pool_indices]
    k = len(lens)
    r = k if slots is None else int(slots)
    geometry = f"extend_lens={lens[:8]}{'...' if len(lens) > 8 else ''} bucket={bucket} slots={r}"
    if len(pre) != len(lens) or len(rpi) < len(lens):
        raise TboSplitError(
            f"prefix lens ({len(pre)}) / request-pool indices ({len(rpi)}) do not cover {len(lens)} requests"
        )
    if r < len(lens):
        raise TboSplitError(f"{len(lens)} requests do not fit {r} request slots ({geometry})")
    if any(x < 0 for x in lens) or any(x < 0 for x in pre):
        raise TboSplitError(f"negative extend or prefix length ({geometry})")
    n = sum(lens)
    if n > bucket:
        raise TboSplitError(f"{n} live tokens exceed the bucket ({geometry})")
    t = split_token_index(bucket) if split_token is None else int(split_token)
    if not 0 <= t <= bucket:
        raise TboSplitError(f"split token {t} outside the bucket ({geometry})")
    lens += [0] * (r - k)
    pre += [0] * (r - k)
    rpi = rpi[:k] + [0] * (r - k)
    starts = _exclusive_cumsum(lens)
    a_f: dict = {k: [] for k in SLOT_FIELDS}
    b_f: dict = {k: [] for k in SLOT_FIELDS}
    for i in range(r):
        a = max(0, min(t - starts[i], lens[i]))
        b = lens[i] - a
        for f, n_i, p_i, s_i in ((a_f, a, pre[i], pre[i] + a), (b_f, b, pre[i] + a, pre[i] + lens[i])):
            live = n_i > 0
            f["extend_seq_lens"].append(n_i)
            f["extend_prefix_lens"].append(p_i if live else 0)
            f["seq_lens"].append(s_i if live else 0)
            f["req_pool_indices"].append(rpi[i] if live else 0)
    children = []
    for idx, (f, lo, hi, live) in enumerate(((a_f, 0, t, min(t, n)), (b_f, t, bucket, max(0, n - t)))):
        f["extend_start_loc"] = list(_exclusive_cumsum(f["extend_seq_lens"]))
        children.append(Child(idx, lo, hi, live_tokens=live, **{k: tuple(v) for k, v in f.items()}))
    return tuple(children)


def split_of_view(fb: Any, *, slots: Optional[int] = None, bucket: Optional[int] = None) -> tuple:
    """The split of a parent batch or replay view: live lengths from its CPU lists, request-pool
    indices from :func:`request_pool_indices`, the bucket from its ``input_ids`` rows unless given
    (a live batch's rows are not padded to the bucket)."""
    lens = list(fb.extend_seq_lens_cpu)
    pre = list(fb.extend_prefix_lens_cpu or [0] * len(lens))
    return split(
        lens,
        pre,
        request_pool_indices(fb, len(lens)),
        bucket=len(fb.input_ids) if bucket is None else bucket,
        slots=slots or max(len(lens), 1),
    )


def request_pool_indices(fb: Any, n: int) -> list:
    """The first ``n`` request-pool indices, from the CPU copy when the batch carries one (no device
    sync on the replay path)."""
    src = getattr(fb, "req_pool_indices_cpu", None)
    if src is None:
        src = fb.req_pool_indices
    return [int(x) for x in src[:n].tolist()]


def child_view(fb_view: Any, child: Child) -> SimpleNamespace:
    """The out-of-graph metadata view of one child (the request axis kept), in the shape of stock's
    ``tbo_backend._build_tbo_child_replay_fb_view`` for an EXTEND parent."""
    import torch

    dev = fb_view.seq_lens.device

    def t(name):
        return torch.tensor(child.field(name), dtype=torch.int64, device=dev)

    def rows(name, clip=False):
        x = getattr(fb_view, name, None)
        if x is None:
            return None
        return x[_clipped(child, len(x))] if clip else x[child.token_start : child.token_end]

    plan = getattr(fb_view, "kv_loc_plan", None)
    return SimpleNamespace(
        batch_size=len(child.seq_lens),
        forward_mode=fb_view.forward_mode,
        actual_forward_mode=getattr(fb_view, "actual_forward_mode", fb_view.forward_mode),
        input_ids=rows("input_ids"),
        positions=rows("positions", clip=True),
        req_pool_indices=t("req_pool_indices"),
        seq_lens=t("seq_lens"),
        seq_lens_cpu=torch.tensor(child.seq_lens, dtype=torch.int64),
        seq_lens_sum=int(sum(child.seq_lens)),
        extend_seq_lens=t("extend_seq_lens"),
        extend_prefix_lens=t("extend_prefix_lens"),
        extend_start_loc=t("extend_start_loc"),
        extend_seq_lens_cpu=list(child.extend_seq_lens),
        extend_prefix_lens_cpu=list(child.extend_prefix_lens),
        extend_num_tokens=child.num_tokens,
        num_token_non_padded_cpu=child.live_tokens,
        encoder_lens=None,
        out_cache_loc=rows("out_cache_loc", clip=True),
        kv_loc_plan=plan,
        kv_loc_cols=(
            None if plan is None else plan.cols_slice(getattr(fb_view, "kv_loc_cols", None), _loc_rows(child, fb_view))
        ),
        spec_info=None,
        max_seq_len_override=getattr(fb_view, "max_seq_len_override", None),
    )


def _clipped(child: Child, n: int) -> slice:
    """The child's rows of a per-token tensor that holds only ``n`` (live) rows."""
    return slice(child.token_start, max(child.token_start, min(child.token_end, n)))


def _loc_rows(child: Child, fb_view: Any) -> slice:
    loc = getattr(fb_view, "out_cache_loc", None)
    return _clipped(child, child.token_end if loc is None else len(loc))


class ChildBuffers:
    """Address-stable per-slot tensors of the two children (``SLOT_FIELDS`` x 2, int64, ``slots``
    long): the captured body reads the children's per-slot fields from here, every replay refreshes
    them (:func:`refresh`)."""

    def __init__(self, slots: int, device: Any) -> None:
        import torch

        self.slots = slots
        self.device = device
        self.tensors = [
            {k: torch.zeros((slots,), dtype=torch.int64, device=device) for k in SLOT_FIELDS} for _ in range(2)
        ]

    def fill(self, children: Sequence[Child]) -> None:
        import torch

        for bufs, child in zip(self.tensors, children, strict=True):
            if len(child.seq_lens) > self.slots:
                raise TboSplitError(f"{len(child.seq_lens)} request slots exceed the captured {self.slots}")
            r = len(child.seq_lens)
            host = torch.tensor([child.field(k) for k in SLOT_FIELDS], dtype=torch.int64)
            for j, k in enumerate(SLOT_FIELDS):
                bufs[k][:r].copy_(host[j], non_blocking=True)
                bufs[k][r:].zero_()


def refresh(buffers: ChildBuffers, counts: Any, children: Sequence[Child]) -> None:
    """Replay: the children's per-slot buffers and the two ``num_token_non_padded`` counts the
    captured graph reads (``TboCudaGraphRunnerPlugin._tbo_children_num_token_non_padded``)."""
    import torch

    buffers.fill(children)
    counts.copy_(torch.tensor([c.live_tokens for c in children], dtype=counts.dtype), non_blocking=True)


def capture_children(batch: Any, counts: Any, buffers: ChildBuffers, *, preparer: Any = None) -> tuple:
    """The two real ``ForwardBatch`` children of a capture (or eager-equivalent) batch under the fixed
    split: stock ``TboForwardBatchPreparer.filter_batch`` over the whole request axis and each child's
    rows, then the per-slot fields pointed at :class:`ChildBuffers` and the CPU lists set from the
    geometry. Sets ``batch.tbo_split_seq_index`` (the slot holding token ``T``) and ``tbo_children``.
    Returns the geometry."""
    import torch

    if preparer is None:
        from sglang.srt.batch_overlap.two_batch_overlap import TboForwardBatchPreparer as preparer

    slots = len(batch.seq_lens)
    check_bucket(len(batch.input_ids), slots)
    children = split_of_view(batch, slots=slots)
    refresh(buffers, counts, children)
    a = children[0]
    built = []
    for child, bufs, out_count in zip(children, buffers.tensors, counts, strict=True):
        fb = preparer.filter_batch(
            batch,
            start_token_index=child.token_start,
            end_token_index=child.token_end,
            start_seq_index=0,
            end_seq_index=slots,
            out_num_token_non_padded=out_count,
        )
        for k in SLOT_FIELDS:
            setattr(fb, k, bufs[k][:slots])
        fb.seq_lens_cpu = torch.tensor(child.seq_lens, dtype=torch.int64)
        fb.seq_lens_sum = int(sum(child.seq_lens))
        fb.extend_seq_lens_cpu = list(child.extend_seq_lens)
        fb.extend_prefix_lens_cpu = list(child.extend_prefix_lens)
        fb.extend_logprob_start_lens_cpu = list(child.extend_seq_lens)
        built.append(fb)
    batch.tbo_split_seq_index = next(
        (i for i, s in enumerate(a.extend_seq_lens) if s and a.extend_start_loc[i] + s >= a.token_end),
        len(a.live_slots),
    )
    batch.tbo_children = built
    return children
