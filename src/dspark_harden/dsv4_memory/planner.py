"""Host-side bounds guards for DSV4's compress planner (``sglang/kernels/jit/csrc/deepseek_v4/c_plan.cuh``).

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

:func:`prefill_problems` / :func:`decode_problems` check all of that before the launch and the
patched ``generate`` raises :class:`PlannerBoundsError` naming each violation. Shape checks are
free; checks that read device tensors cost one reduction and one device sync per plan (measured
in tests/gpu), and are skipped while a CUDA graph is being captured (no sync is allowed there;
the captured plan's static buffers are sized for the bucket by the capture code itself).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

MAX_TOKENS = 65536  # ragged ids are uint16 (c_plan.cuh kMaxTokens)
MAX_GPU_PREFILL_BATCH = 1024  # c_plan.cuh kMaxPrefillBatchSize
CALLS = {"checked": 0, "rejected": 0, "data_checks_skipped_in_capture": 0}


class PlannerBoundsError(RuntimeError):
    pass


def _capturing() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001
        return False


def _r2t_problems(rid, last_pos, r2t, f2s, *, need_f2s: bool) -> list[str]:
    """rid in [0, rows), last position < columns, and the mapped full locations < len(full_to_state)."""
    import torch

    out = []
    rows, cols = int(r2t.shape[0]), int(r2t.shape[1])
    rid = rid.to(r2t.device, torch.int64)
    last_pos = last_pos.to(r2t.device, torch.int64)
    bad_rid = (rid < 0) | (rid >= rows)
    bad_pos = (last_pos < 0) | (last_pos >= cols)
    flags = [bad_rid.any(), bad_pos.any()]
    if need_f2s and rid.numel():
        safe_rid = rid.clamp(0, max(rows - 1, 0))
        safe_pos = last_pos.clamp(0, max(cols - 1, 0))
        # the largest position each request reads is its last one; locations grow with position in a
        # request's row only by convention, so check every position up to it (masked gather)
        span = torch.arange(cols, device=r2t.device).unsqueeze(0) <= safe_pos.unsqueeze(1)
        locs = r2t.index_select(0, safe_rid)
        used = torch.where(span, locs.to(torch.int64), torch.zeros((), dtype=torch.int64, device=r2t.device))
        n = int(f2s.numel())
        flags.append(((used < 0) | (used >= n)).any())
    else:
        flags.append(torch.zeros((), dtype=torch.bool, device=r2t.device))
    got = torch.stack([f.to(torch.bool) for f in flags]).tolist()  # the one device sync
    if got[0]:
        out.append(f"req_pool_indices outside req_to_token's {rows} rows")
    if got[1]:
        out.append(f"a sequence reads position >= req_to_token's {cols} columns (or < 0)")
    if got[2]:
        out.append(f"req_to_token maps a read position to a full location outside full_to_state's {int(f2s.numel())} entries")
    return out


def prefill_problems(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state,
                     swa_page_size, ring_size, num_q_tokens, use_cuda_graph=False, use_req_ring=False) -> list[str]:
    import torch

    out = []
    b = int(seq_lens.shape[0]) if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or extend_lens.shape != seq_lens.shape or req_pool_indices.shape != seq_lens.shape:
        return [f"seq_lens {tuple(seq_lens.shape)}, extend_lens {tuple(extend_lens.shape)} and req_pool_indices "
                f"{tuple(req_pool_indices.shape)} must be the same 1-D batch"]
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
    if (gpu_input or req_to_token.device.type != "cpu") and _capturing():
        CALLS["data_checks_skipped_in_capture"] += 1
        return out
    seq = seq_lens.to(torch.int64)
    ext = extend_lens.to(torch.int64)
    bad_len = ((ext <= 0) | (ext > seq)).any()
    total = ext.sum()
    flags = torch.stack([bad_len, total > n, total != n]).tolist()
    if flags[0]:
        out.append("an extend length is <= 0 or larger than its sequence length")
    if flags[1]:
        out.append(f"the extend lengths add up to {int(total)} tokens, more than num_q_tokens {n} "
                   f"(the plan buffers hold {n} entries)")
    elif flags[2] and not gpu_input:
        out.append(f"the extend lengths add up to {int(total)} tokens, not num_q_tokens {n}")
    if out:
        return out
    need_f2s = not (compress_ratio == 128 or use_req_ring)
    return _r2t_problems(req_pool_indices, seq - 1, req_to_token, full_to_state, need_f2s=need_f2s)


def decode_problems(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens, swa_page_size,
                    ring_size, use_req_ring=False) -> list[str]:
    import torch

    if seq_lens.dim() != 1 or req_pool_indices.shape != seq_lens.shape:
        return [f"seq_lens {tuple(seq_lens.shape)} and req_pool_indices {tuple(req_pool_indices.shape)} must be the "
                f"same 1-D batch"]
    out = []
    if compress_ratio not in (4, 128):
        out.append(f"compress_ratio {compress_ratio} (must be 4 or 128)")
    if out or seq_lens.numel() == 0:
        return out
    if _capturing():
        CALLS["data_checks_skipped_in_capture"] += 1
        return out
    seq = seq_lens.to(torch.int64)
    if bool((seq <= 0).any()):
        return ["a decode sequence length is <= 0"]
    need_f2s = not (compress_ratio == 128 or use_req_ring)
    return _r2t_problems(req_pool_indices, seq - 1, req_to_token, full_to_state, need_f2s=need_f2s)


def _raise(kind: str, problems: list[str]) -> None:
    CALLS["rejected"] += 1
    raise PlannerBoundsError(
        f"DSV4 compress {kind} plan refused before launch (it would index past an allocation): "
        + "; ".join(problems) + " (DSPARK_HARDEN_DSV4_PLANNER_GUARDS)"
    )


def build_prefill_generate(stock: Callable, on_call: Callable[[bool], None]) -> Callable:
    def generate(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state,
                 swa_page_size, ring_size, num_q_tokens, use_cuda_graph=False, use_req_ring=False):
        CALLS["checked"] += 1
        problems = prefill_problems(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token,
                                    full_to_state, swa_page_size, ring_size, num_q_tokens, use_cuda_graph,
                                    use_req_ring)
        on_call(not problems)
        if problems:
            _raise("prefill", problems)
        return stock(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state,
                     swa_page_size, ring_size, num_q_tokens, use_cuda_graph, use_req_ring)

    return staticmethod(generate)


def build_decode_generate(stock: Callable, on_call: Callable[[bool], None]) -> Callable:
    def generate(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens, swa_page_size, ring_size,
                 use_req_ring=False):
        CALLS["checked"] += 1
        problems = decode_problems(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens,
                                   swa_page_size, ring_size, use_req_ring)
        on_call(not problems)
        if problems:
            _raise("decode", problems)
        return stock(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens, swa_page_size,
                     ring_size, use_req_ring)

    return staticmethod(generate)


def unwrap(stock: Any) -> Optional[Callable]:
    return stock.__func__ if isinstance(stock, staticmethod) else stock
