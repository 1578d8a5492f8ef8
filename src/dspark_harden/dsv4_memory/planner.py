"""Bounds guards for DSV4's compress planner (``sglang/kernels/jit/csrc/deepseek_v4/c_plan.cuh``).

The planner turns (request pool indices, sequence and extend lengths, ``req_to_token``,
``full_to_state``) into compress and write plans. What its kernels trust without checking
(read from the 0.5.23 source):

* GPU-input prefill path (``plan_compress_prefill_kernel0``): plan buffers are sized
  ``num_q_tokens`` but entries are appended per *extend token*; ``sum(extend_lens) > num_q_tokens``
  writes past both buffers. ``0 < extend_len <= seq_len`` is checked only on the CPU-input path;
  a violation makes ``prefix_len`` negative and kernel 1 index ``req_to_token`` below the row.
* both paths (kernel 1, decode kernel): ``req_to_token[rid, position]`` with ``rid`` from
  ``req_pool_indices`` and ``position < seq_len`` unchecked against ``req_to_token``'s shape, and
  ``full_to_state[raw_loc]`` unchecked against its length.

Every plan -- eager, captured, replayed -- runs the device-side guarded planner (:mod:`.planner_device`):
those reads are checked on the GPU, no device sync, errors reported through a pinned mirror the host
reads before every plan, at every forward-metadata build, and at each step's result sync before any of
its tokens is appended or streamed (:func:`build_result_check`). On the host, before the launch and for
free, the wrappers refuse what needs no device read (:func:`prefill_problems` / :func:`decode_problems`
with ``device_data=False``: shapes, ratios, nesting, and the lengths when they are host tensors).
``DSPARK_HARDEN_DSV4_PLANNER_GUARDS_SYNC=1`` adds the device-data checks before every eager launch
(``device_data=True``: refuse before launch, one device sync per plan; checks that read device tensors
touch only the positions the plan reads, O(num_q_tokens + batch) int64 temporaries, never batch x
columns; skipped while a graph is being captured).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .common import PlannerBoundsError
from .common import capturing as _capturing

MAX_TOKENS = 65536  # ragged ids are uint16 (c_plan.cuh kMaxTokens)
MAX_GPU_PREFILL_BATCH = 1024  # c_plan.cuh kMaxPrefillBatchSize
CALLS = {"checked": 0, "rejected": 0, "data_checks_skipped_in_capture": 0}


def _r2t_flags(rid, seq, lo, r2t, f2s, *, need_f2s: bool, bound: int) -> list:
    """Device flags (no sync): rid in [0, rows), every read position ``< columns``, and -- with
    ``need_f2s`` -- the full location of every position the plan reads inside ``full_to_state``.

    The positions read are the window ``[lo[i], seq[i])`` of each request (c_plan.cuh: decode reads
    ``seq-1`` and ``max(seq-1-ratio, 0)``; prefill reads the extend positions and up to ``ratio``
    before them). The windows are flattened into ``bound`` slots (``bound`` >= their total length
    whenever the lengths are valid; an invalid batch is flagged by its length checks), so the
    temporaries are O(bound + batch) int64, never batch x columns."""
    import torch

    dev = r2t.device
    rows, cols = int(r2t.shape[0]), int(r2t.shape[1])
    rid = rid.to(dev, torch.int64)
    seq = seq.to(dev, torch.int64)
    lo = lo.to(dev, torch.int64)
    bad_rid = ((rid < 0) | (rid >= rows)).any()
    bad_pos = ((seq - 1 < 0) | (seq - 1 >= cols) | (lo < 0)).any()
    if not need_f2s or rid.numel() == 0 or bound <= 0:
        return [bad_rid, bad_pos, torch.zeros((), dtype=torch.bool, device=dev)]
    width = (seq - lo).clamp(min=0)
    ends = torch.cumsum(width, 0)
    starts = ends - width
    slot = torch.arange(bound, device=dev, dtype=torch.int64)
    req = torch.searchsorted(ends, slot, right=True).clamp(max=rid.numel() - 1)
    live = slot < ends[-1]
    pos = (lo.index_select(0, req) + slot - starts.index_select(0, req)).clamp(0, max(cols - 1, 0))
    row = rid.clamp(0, max(rows - 1, 0)).index_select(0, req)
    loc = r2t[row, pos].to(torch.int64)
    n = int(f2s.numel())
    bad_loc = (live & ((loc < 0) | (loc >= n))).any()
    return [bad_rid, bad_pos, bad_loc]


def _r2t_messages(got: list, r2t, f2s) -> list[str]:
    out = []
    if got[0]:
        out.append(f"req_pool_indices outside req_to_token's {int(r2t.shape[0])} rows")
    if got[1]:
        out.append(f"a sequence reads position >= req_to_token's {int(r2t.shape[1])} columns (or < 0)")
    if got[2]:
        out.append(
            f"req_to_token maps a read position to a full location outside full_to_state's {int(f2s.numel())} entries"
        )
    return out


def prefill_problems(
    compress_ratio,
    req_pool_indices,
    seq_lens,
    extend_lens,
    req_to_token,
    full_to_state,
    swa_page_size,
    ring_size,
    num_q_tokens,
    use_cuda_graph=False,
    use_req_ring=False,
    device_data=True,
) -> list[str]:
    """What would make the prefill plan index past an allocation. ``device_data=False``: only what needs
    no device read (shapes, settings, and the lengths when they are host tensors)."""
    import torch

    out = []
    b = int(seq_lens.shape[0]) if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or extend_lens.shape != seq_lens.shape or req_pool_indices.shape != seq_lens.shape:
        return [
            f"seq_lens {tuple(seq_lens.shape)}, extend_lens {tuple(extend_lens.shape)} and req_pool_indices "
            f"{tuple(req_pool_indices.shape)} must be the same 1-D batch"
        ]
    n = int(num_q_tokens)
    if compress_ratio not in (4, 128):
        out.append(f"compress_ratio {compress_ratio} (must be 4 or 128)")
    if not (b <= n <= MAX_TOKENS):
        out.append(f"batch {b} / num_q_tokens {n} (need batch <= num_q_tokens <= {MAX_TOKENS})")
    gpu_input = seq_lens.device.type != "cpu"
    if gpu_input and b > MAX_GPU_PREFILL_BATCH:
        out.append(f"batch {b} above the GPU plan's {MAX_GPU_PREFILL_BATCH}")
    if ring_size <= 0 or swa_page_size % ring_size or ring_size % max(compress_ratio, 1):
        out.append(f"swa_page_size {swa_page_size} / ring_size {ring_size} / ratio {compress_ratio} not nested")
    if out or b == 0:
        return out
    if not device_data:
        return out if gpu_input else _host_length_problems(seq_lens, extend_lens, n)
    if (gpu_input or req_to_token.device.type != "cpu") and _capturing():
        CALLS["data_checks_skipped_in_capture"] += 1
        return out
    seq = seq_lens.to(torch.int64)
    ext = extend_lens.to(torch.int64)
    # host lengths: stock's CPU path requires 0 < extend; GPU lengths may carry 0 (padding, sentinels)
    bad_len = (((ext <= 0) if not gpu_input else (ext < 0)) | (ext > seq)).any()
    total = ext.sum()
    need_f2s = not (compress_ratio == 128 or use_req_ring)
    lo = (seq - ext - compress_ratio).clamp(min=0)
    r2t_flags = _r2t_flags(
        req_pool_indices, seq, lo, req_to_token, full_to_state, need_f2s=need_f2s, bound=n + b * int(compress_ratio)
    )
    dev = req_to_token.device
    flags = torch.stack(
        [bad_len.to(dev), (total > n).to(dev), (total != n).to(dev)] + [f.to(torch.bool) for f in r2t_flags]
    ).tolist()  # the one device sync
    if flags[0]:
        out.append(_BAD_LEN_GPU if gpu_input else _BAD_LEN)
    if flags[1] or (flags[2] and not gpu_input):
        out += _sum_problems(int(total), n)
    if out:  # the window check assumed valid lengths: report the lengths alone
        return out
    return _r2t_messages(flags[3:], req_to_token, full_to_state)


_BAD_LEN = "an extend length is <= 0 or larger than its sequence length"
# GPU-resident lengths may carry 0 (padding entries, zero-length sentinels): only < 0 is bad there
_BAD_LEN_GPU = "an extend length is < 0 or larger than its sequence length (GPU-input lengths may be 0)"


def _host_length_problems(seq_lens, extend_lens, n: int) -> list[str]:
    """The length checks of host-resident lengths (no device read; stock's CPU path raises on the same
    conditions, later and less specifically)."""
    import torch

    seq = seq_lens.to(torch.int64)
    ext = extend_lens.to(torch.int64)
    out = [_BAD_LEN] if bool(((ext <= 0) | (ext > seq)).any()) else []
    return out + _sum_problems(int(ext.sum()), n)


def _sum_problems(total: int, n: int) -> list[str]:
    if total > n:
        return [
            f"the extend lengths add up to {total} tokens, more than num_q_tokens {n} (the plan buffers hold {n} entries)"
        ]
    if total != n:
        return [f"the extend lengths add up to {total} tokens, not num_q_tokens {n}"]
    return []


def decode_problems(
    compress_ratio,
    req_pool_indices,
    req_to_token,
    full_to_state,
    seq_lens,
    swa_page_size,
    ring_size,
    use_req_ring=False,
    device_data=True,
) -> list[str]:
    """As :func:`prefill_problems` for the decode plan (``device_data=False``: shapes and ratio only)."""
    import torch

    if seq_lens.dim() != 1 or req_pool_indices.shape != seq_lens.shape:
        return [
            f"seq_lens {tuple(seq_lens.shape)} and req_pool_indices {tuple(req_pool_indices.shape)} must be the "
            f"same 1-D batch"
        ]
    out = []
    if compress_ratio not in (4, 128):
        out.append(f"compress_ratio {compress_ratio} (must be 4 or 128)")
    if out or seq_lens.numel() == 0 or not device_data:
        return out
    if _capturing():
        CALLS["data_checks_skipped_in_capture"] += 1
        return out
    seq = seq_lens.to(torch.int64)
    need_f2s = not (compress_ratio == 128 or use_req_ring)
    lo = (seq - 1 - compress_ratio).clamp(min=0)
    # decode reads only seq-1 and max(seq-1-ratio, 0): check those two, not the window between
    dev = req_to_token.device
    ends = torch.stack([lo, seq - 1], 1).reshape(-1)
    flags = _r2t_flags(
        req_pool_indices.repeat_interleave(2),
        ends + 1,
        ends,
        req_to_token,
        full_to_state,
        need_f2s=need_f2s,
        bound=2 * int(seq.numel()),
    )
    got = torch.stack([(seq <= 0).any().to(dev)] + [f.to(torch.bool) for f in flags]).tolist()  # one sync
    if got[0]:
        return ["a decode sequence length is <= 0"]
    return _r2t_messages(got[1:], req_to_token, full_to_state)


def _raise(kind: str, problems: list[str]) -> None:
    CALLS["rejected"] += 1
    raise PlannerBoundsError(
        f"DSV4 compress {kind} plan refused before launch (it would index past an allocation): "
        + "; ".join(problems)
        + " (DSPARK_HARDEN_DSV4_PLANNER_GUARDS)"
    )


def _device_defaults(kind: str, device_generate: Optional[Callable], check_pending: Optional[Callable]):
    """The device-side guard's plan function and pending-report reader (:mod:`.planner_device`, CUDA),
    or the ones a test passes in."""
    if device_generate is None or check_pending is None:
        from . import planner_device

        device_generate = device_generate or getattr(planner_device, f"generate_{kind}")
        check_pending = check_pending or planner_device.check_pending
    return device_generate, check_pending


def build_prefill_generate(
    stock: Callable,
    on_call: Callable[[bool], None],
    device_generate: Optional[Callable] = None,
    check_pending: Optional[Callable] = None,
    sync_checks: bool = False,
) -> Callable:
    """Every prefill plan, eager or captured, runs the device-side guarded planner
    (:func:`.planner_device.generate_prefill`, default): no device sync. Before it, shape checks and the
    checks of host-resident lengths (free) refuse the launch; a violation an earlier plan published is
    raised. ``sync_checks`` (``DSPARK_HARDEN_DSV4_PLANNER_GUARDS_SYNC=1``) adds the device-data checks
    before every eager launch (one sync per plan: refuse before launch, for debugging). ``stock`` is
    kept for the signature only: the guarded plan replaces it."""
    del stock

    def generate(
        compress_ratio,
        req_pool_indices,
        seq_lens,
        extend_lens,
        req_to_token,
        full_to_state,
        swa_page_size,
        ring_size,
        num_q_tokens,
        use_cuda_graph=False,
        use_req_ring=False,
    ):
        nonlocal device_generate, check_pending
        device_generate, check_pending = _device_defaults("prefill", device_generate, check_pending)
        CALLS["checked"] += 1
        problems = prefill_problems(
            compress_ratio,
            req_pool_indices,
            seq_lens,
            extend_lens,
            req_to_token,
            full_to_state,
            swa_page_size,
            ring_size,
            num_q_tokens,
            use_cuda_graph,
            use_req_ring,
            device_data=sync_checks,
        )
        on_call(not problems)
        if problems:
            _raise("prefill", problems)
        if not _capturing():
            check_pending(req_to_token.device)
        return device_generate(
            compress_ratio,
            req_pool_indices,
            seq_lens,
            extend_lens,
            req_to_token,
            full_to_state,
            swa_page_size,
            ring_size,
            num_q_tokens,
            use_cuda_graph,
            use_req_ring,
        )

    return staticmethod(generate)


def build_decode_generate(
    stock: Callable,
    on_call: Callable[[bool], None],
    device_generate: Optional[Callable] = None,
    check_pending: Optional[Callable] = None,
    sync_checks: bool = False,
) -> Callable:
    """Every decode plan, eager or captured (the decode graph replays it), runs the device-side guarded
    planner (:func:`.planner_device.generate_decode`, default): no device sync, the same plan as stock
    for in-bounds inputs. Before it, shape checks refuse the launch and a violation an earlier plan (or a
    replay) published is raised; ``sync_checks`` adds the device-data checks before every eager launch."""
    del stock

    def generate(
        compress_ratio,
        req_pool_indices,
        req_to_token,
        full_to_state,
        seq_lens,
        swa_page_size,
        ring_size,
        use_req_ring=False,
    ):
        nonlocal device_generate, check_pending
        device_generate, check_pending = _device_defaults("decode", device_generate, check_pending)
        CALLS["checked"] += 1
        problems = decode_problems(
            compress_ratio,
            req_pool_indices,
            req_to_token,
            full_to_state,
            seq_lens,
            swa_page_size,
            ring_size,
            use_req_ring,
            device_data=sync_checks,
        )
        on_call(not problems)
        if problems:
            _raise("decode", problems)
        if not _capturing():
            check_pending(req_to_token.device)
        return device_generate(
            compress_ratio,
            req_pool_indices,
            req_to_token,
            full_to_state,
            seq_lens,
            swa_page_size,
            ring_size,
            use_req_ring,
        )

    return staticmethod(generate)


def unwrap(stock: Any) -> Optional[Callable]:
    return stock.__func__ if isinstance(stock, staticmethod) else stock


def build_metadata_report(stock: Callable) -> Callable:
    """Wrap a ``DeepseekV4AttnBackend`` forward-metadata builder (``init_forward_metadata``, every eager
    forward; ``init_forward_metadata_out_graph``, every graph replay and, with ``in_capture=True``, eagerly
    before each capture): create the device guard's counters outside any capture, then read its report
    (no sync) so a violation a replayed plan published fails the next step, not the next eager plan."""
    import functools

    @functools.wraps(stock)
    def wrapper(self, forward_batch, *args, **kwargs):
        if not _capturing():
            from . import planner_device

            planner_device.report(planner_device.ensure_state())
        return stock(self, forward_batch, *args, **kwargs)

    return wrapper


AT_RESULT_SYNC = "read at this step's result sync: none of its tokens was appended or streamed"


def build_result_check(stock: Callable) -> Callable:
    """Wrap a result processor stock calls once per step after the forward
    (``SchedulerBatchResultProcessor.process_batch_result_prefill`` / ``_decode``, the PD prefill server's
    ``process_batch_result_disagg_prefill``): wait for the step's result first -- ``result.copy_done``
    when set (overlap scheduling: the event recorded behind the step's result copy; stock's own
    ``synchronize()`` a few lines later then returns at once), else the current stream (non-overlap:
    the forward ran on it; stock's ``.tolist()`` of the device tokens waits for the same) -- then read the
    device guard's mirror (:mod:`.planner_device`), exact for every plan queued before the step's result,
    and raise before stock appends or streams a token of the step. Before the first guard state exists no
    guarded plan has run: stock alone, no wait added."""
    import functools

    from . import planner_device as guard  # no CUDA call at import

    @functools.wraps(stock)
    def wrapper(self, batch, result, *args, **kwargs):
        if guard.guarding():
            done = getattr(result, "copy_done", None)
            if done is not None:
                done.synchronize()
            else:
                guard.sync_current_streams()
            guard.report_all(AT_RESULT_SYNC)
        return stock(self, batch, result, *args, **kwargs)

    return wrapper
