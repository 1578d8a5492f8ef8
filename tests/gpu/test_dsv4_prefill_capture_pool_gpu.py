"""What choosing prefill CUDA graphs for DeepSeek V4 costs (issue 41 item 1; RUN.md, "DSV4 prefill capture pool").

Stock 0.5.23 turns the breakable prefill graph off for DSV4 by default because "the c4 indexer scratch is
pinned in the capture pool and OOMs" (arg_groups/cuda_graph_hook.py, disable_breakable_cudagraph_if_incompatible).
This script captures, with ``torch.cuda.graph`` into a private pool, one forward of the c4 indexer's per-forward
scratch at each prefill bucket of the deployment recipe, and prints one JSON line per bucket: the capture pool's
reserved bytes, the sparse-prefill pool's reservation at the same chunk / bucket (this repo's
``dsv4_memory.pool.reservation_bytes``, tokens = ``feature.pool_capacity``'s rule max(chunk, largest bucket)), and
the KV-cache tokens each equals.

What is allocated: the real stock JIT op ``fused_q_indexer_rope_hadamard_quant`` (sglang.kernels.ops.attention.dsv4,
norm_rope.py: it allocates q fp8 [T, 64, 128] and weights fp32 [T, 64, 1]) when it loads (else those two by shape,
and the JSON says so). The rest by shape, because DeepGEMM's ``fp8_paged_mqa_logits`` is not on the GPU machine:

- per forward (the capture's indexer metadata, refreshed in place at replay): ``page_table`` int32 [T, P] with
  P = ceil(C / 256) (BuildPageTablePositions via DeepseekV4AttnBackend.make_core_attn_metadata; page_size 256,
  metadata.py asserts it) and ``c4_sparse_page_indices`` int32 [T, index_topk=512];
- per c4 layer (freed before the next): ``wq_b`` output bf16 [T, 64 * 128] and ``weights_proj`` output bf16
  [T, 64] (indexer.py C4Indexer.compute_q / compute_weights), the q quant above, and the logits fp32
  [T, P * 64] (indexer.py forward_c4_indexer -> run_paged_indexer: ``fn(..., indexer_metadata.max_compressed_seq_len)``;
  metadata.py ``max_compressed_seq_len = page_table.shape[1] * compressed_page_size``, compressed_page_size =
  page_size // 4 = 64; one call per forward under a prefill graph: ``_mqa_logits_budget`` returns None when
  ``use_prefill_cuda_graph``, so no row chunking).

T = the bucket's tokens; C = the captured context width: deepseek_v4_backend.py ``_prefill_graph_context_width``
returns ``forward_batch.max_seq_len_override or self.MAX_SEQ_LEN_FOR_CAPTURE`` for a model with c4/c128 layers,
``MAX_SEQ_LEN_FOR_CAPTURE = req_to_token.shape[1]`` (the context length) and the breakable runner passes
``max_seq_len_override = cuda_graph_config[prefill].max_context_size`` (None unless
``--cuda-graph-prefill-max-context`` is set). Shapes: configs/deepseek_v4.py DeepSeekV4Config (index_n_heads 64,
index_head_dim 128, index_topk 512, q_lora_rank 1024, hidden_size 4096), unless ``DSV4_CONFIG`` names a real
checkpoint's config.json. Not measured: the rest of the model's activations in the same pool.

Buckets: the recipe launches with the default ``--chunked-prefill-size`` (8,192 on H100 / H200,
arg_groups/memory_hook.py), which DP attention divides per rank (parallel_hook.py: 8,192 // 2 = 4,096) and
re-clamps the prefill graph's max_bs to; buckets = generate_prefill_cuda_graph_batch_sizes(4096)
(cuda_graph_hook.py: 50 buckets, 4 .. 4,096). ``CHUNK`` overrides the per-rank chunk.

KV per token (pool_configurator.py DSV4PoolConfigurator, SM90 defaults: V4 layout, fp8 indexer, cap-mode SWA moved
to fixed bytes by ``_get_bytes_per_full_token``): per c4 layer KVLayout.V4.page_bytes(64) / 64 / 4 + 132 / 4
(``_compressed_bytes_per_full_token``, get_dsv4_indexer_bytes_per_token = 128 + 128 // 128 * 4), per c128 layer
KVLayout.V4.page_bytes(2) / 2 / 128, times (L + 1) / L for the DSpark draft (``_spec_infl``). The layer mix is the
checkpoint's ``compress_ratios`` (``DSV4_CONFIG``, or ``DSV4_COMPRESS_RATIOS`` as "4,128,..."); without either the
script ASSUMES 43 layers alternating 4 / 128 and says so in every line.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine: RUN.md)")

DEV = "cuda"
PAGE_SIZE = 256
C4_PAGE = PAGE_SIZE // 4
REPORT = os.environ.get("OUT")


def _config() -> dict:
    cfg = {
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "q_lora_rank": 1024,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "v_head_dim": 512,
        "num_hidden_layers": 43,
        "max_position_embeddings": 65536,
    }
    path = os.environ.get("DSV4_CONFIG")
    if path:
        with open(path) as fh:
            cfg.update({k: v for k, v in json.load(fh).items() if k in cfg or k == "compress_ratios"})
    ratios = os.environ.get("DSV4_COMPRESS_RATIOS")
    if ratios:
        cfg["compress_ratios"] = [int(r) for r in ratios.split(",")]
    cfg["layer_mix_assumed"] = "compress_ratios" not in cfg
    if cfg["layer_mix_assumed"]:
        cfg["compress_ratios"] = [4 if i % 2 == 0 else 128 for i in range(cfg["num_hidden_layers"])]
    return cfg


CFG = _config()


def _buckets(max_bs: int) -> tuple:
    """The recipe's prefill buckets: stock's own generator when importable here, else its 0.5.23 formula."""
    try:
        from sglang.srt.arg_groups.cuda_graph_hook import generate_prefill_cuda_graph_batch_sizes

        return list(generate_prefill_cuda_graph_batch_sizes(max_bs)), "stock generate_prefill_cuda_graph_batch_sizes"
    except Exception as exc:  # noqa: BLE001 - the srt import closure needs packages the GPU machine lacks
        sizes = (
            list(range(4, 33, 4))
            + list(range(48, 257, 16))
            + list(range(288, 513, 32))
            + list(range(576, 1025, 64))
            + list(range(1280, 4097, 256))
            + list(range(4608, max_bs + 1, 512))
        )
        return [s for s in sizes if s <= max_bs], f"0.5.23 formula (stock import failed: {type(exc).__name__})"


def _kv_bytes_per_token() -> tuple:
    try:
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

        c4_kv, c128_kv, src = KVLayout.V4.page_bytes(64) / 64, KVLayout.V4.page_bytes(2) / 2, "stock KVLayout.V4"
    except Exception as exc:  # noqa: BLE001
        c4_kv, c128_kv, src = 585.0, 864.0, f"0.5.23 values (KVLayout import failed: {type(exc).__name__})"
    indexer = CFG["index_head_dim"] + CFG["index_head_dim"] // 128 * 4
    ratios = CFG["compress_ratios"]
    per = sum(c4_kv / 4 + indexer / 4 for r in ratios if r == 4) + sum(c128_kv / 128 for r in ratios if r == 128)
    return per * (len(ratios) + 1) / len(ratios), src


def _reservation(tokens: int) -> int:
    from dspark_harden.dsv4_memory.pool import reservation_bytes

    return reservation_bytes(tokens, CFG["num_attention_heads"], CFG["v_head_dim"])


def _q_quant():
    try:
        from sglang.kernels.ops.attention.dsv4 import fused_q_indexer_rope_hadamard_quant

        freqs = torch.polar(torch.ones(65536, 32), torch.rand(65536, 32) * 6.283).to(DEV)
        probe = torch.randn(4, CFG["index_n_heads"], CFG["index_head_dim"], dtype=torch.bfloat16, device=DEV)
        w = torch.randn(4, CFG["index_n_heads"], dtype=torch.bfloat16, device=DEV)
        fused_q_indexer_rope_hadamard_quant(probe, w, 0.1, freqs, torch.arange(4, device=DEV))  # JIT build now
        torch.cuda.synchronize()

        def real(q, w, pos):
            return fused_q_indexer_rope_hadamard_quant(q, w, 0.1, freqs, pos)

        return real, "stock JIT fused_q_indexer_rope_hadamard_quant"
    except Exception as exc:  # noqa: BLE001

        def by_shape(q, w, pos):
            t, h = q.shape[0], q.shape[1]
            qq = torch.empty((t, h, CFG["index_head_dim"]), dtype=torch.float8_e4m3fn, device=DEV)
            return qq, torch.empty((t, h, 1), dtype=torch.float32, device=DEV)

        return by_shape, f"by shape (stock op unavailable: {type(exc).__name__}: {str(exc)[:120]})"


def _forward(t: int, context: int, layers: int, q_quant, static: dict) -> None:
    """One captured forward's indexer scratch at bucket ``t`` (the allocations in the module docstring)."""
    h, d, topk = CFG["index_n_heads"], CFG["index_head_dim"], CFG["index_topk"]
    pages = math.ceil(context / PAGE_SIZE)
    page_table = torch.zeros((t, pages), dtype=torch.int32, device=DEV)
    sparse = torch.full((t, topk), -1, dtype=torch.int32, device=DEV)
    x, q_lora, pos = static["x"][:t], static["q_lora"][:t], static["pos"][:t]
    for _ in range(layers):
        q = (q_lora @ static["wq_b"]).view(t, h, d)  # wq_b output bf16 [T, 64 * 128]
        w = x @ static["w_proj"]  # weights_proj output bf16 [T, 64]
        q_fp8, weights = q_quant(q, w, pos)
        logits = torch.empty((t, pages * C4_PAGE), dtype=torch.float32, device=DEV)
        logits.fill_(1.0)  # stands in for fp8_paged_mqa_logits writing every row
        sparse.copy_(logits[:, :topk].to(torch.int32))  # the top-k transform's read and its in-place write
        del q, w, q_fp8, weights, logits
    static["sink"].add_(page_table[:1, :1].sum() + sparse[:1, :1].sum())


def _capture(buckets, context: int, layers: int, q_quant, static: dict, pool=None) -> tuple:
    """Capture ``buckets`` largest first into one private pool (stock's order and sharing; one bucket: its own
    pool). Returns the graphs and the bytes the pool holds (reserved-memory delta, cross-checked against the
    pool's own segments in the allocator snapshot)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    pool = pool or torch.cuda.graph_pool_handle()
    graphs = []
    for t in sorted(buckets, reverse=True):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            _forward(t, context, layers, q_quant, static)
        graphs.append(g)
    torch.cuda.synchronize()
    delta = torch.cuda.memory_reserved() - before
    pool_bytes = sum(
        s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool)
    )
    assert pool_bytes > 0, f"no allocator segment carries the capture pool's id {pool} (delta {delta} bytes)"
    return graphs, delta, pool_bytes


def _live_bytes(t: int, context: int) -> int:
    """One c4 layer's live indexer scratch at bucket ``t`` plus the forward's metadata (the lower bound of a
    pool that reuses each layer's blocks for the next)."""
    h, d, topk = CFG["index_n_heads"], CFG["index_head_dim"], CFG["index_topk"]
    pages = math.ceil(context / PAGE_SIZE)
    meta = t * pages * 4 + t * topk * 4
    layer = t * h * d * 2 + t * h * 2 + t * h * d + t * h * 4 + t * pages * C4_PAGE * 4
    return meta + layer


def _emit(obj: dict) -> None:
    line = json.dumps(obj)
    print(line)
    if REPORT:
        with open(os.path.join(REPORT, "dsv4_prefill_capture_pool.jsonl"), "a") as fh:
            fh.write(line + "\n")


@pytest.mark.parametrize("context", [int(c) for c in os.environ.get("CONTEXTS", "65536,1048576").split(",")])
def test_prefill_capture_pool_of_the_c4_indexer_scratch_per_bucket(context):
    chunk = int(os.environ.get("CHUNK", "4096"))
    layers = int(os.environ.get("LAYERS", "2"))
    buckets, bucket_src = _buckets(chunk)
    assert buckets and max(buckets) == chunk, (buckets, chunk)
    kv_per_token, kv_src = _kv_bytes_per_token()
    q_quant, quant_src = _q_quant()
    tmax = max(buckets)
    slack = 64 * 2**20  # the caching allocator's segment rounding (2 MiB small, 20 MiB for 1-10 MiB blocks)
    g = torch.Generator(device="cpu").manual_seed(0)
    static = {
        "x": torch.randn(tmax, CFG["hidden_size"], generator=g).to(DEV, torch.bfloat16),
        "q_lora": torch.randn(tmax, CFG["q_lora_rank"], generator=g).to(DEV, torch.bfloat16),
        "pos": torch.arange(tmax, device=DEV) % 65536,
        "wq_b": (torch.randn(CFG["q_lora_rank"], CFG["index_n_heads"] * CFG["index_head_dim"], generator=g) / 32).to(
            DEV, torch.bfloat16
        ),
        "w_proj": (torch.randn(CFG["hidden_size"], CFG["index_n_heads"], generator=g) / 64).to(DEV, torch.bfloat16),
        "sink": torch.zeros((), dtype=torch.int64, device=DEV),
    }
    common = {
        "context": context,
        "chunk_per_rank": chunk,
        "c4_layers_captured": layers,
        "buckets_from": bucket_src,
        "q_quant": quant_src,
        "kv_bytes_per_token": round(kv_per_token, 3),
        "kv_bytes_from": kv_src,
        "layer_mix_assumed": CFG["layer_mix_assumed"],
        "device": torch.cuda.get_device_name(),
    }
    rows = []
    _forward(min(buckets), context, layers, q_quant, static)  # eager warm-up (cuBLAS handles, JIT) before capture
    torch.cuda.synchronize()
    for t in buckets:
        graphs, delta, pool_bytes = _capture([t], context, layers, q_quant, static)
        graphs[0].replay()
        torch.cuda.synchronize()
        logits_bytes = t * math.ceil(context / PAGE_SIZE) * C4_PAGE * 4
        with_graphs = _reservation(max(chunk, t))  # feature.pool_capacity: max(chunk, largest bucket)
        rows.append(
            {
                **common,
                "bucket": t,
                "capture_pool_bytes": pool_bytes,
                "reserved_delta_bytes": delta,
                "logits_bytes_one_layer": logits_bytes,
                "live_bytes_one_layer_and_metadata": _live_bytes(t, context),
                "capture_pool_kv_tokens": int(pool_bytes / kv_per_token),
                "sparse_prefill_reservation_bytes_with_graphs": with_graphs,
                "sparse_prefill_reservation_bytes_without": _reservation(chunk),
                "sparse_prefill_extra_kv_tokens": int((with_graphs - _reservation(chunk)) / kv_per_token),
            }
        )
        _emit(rows[-1])
        del graphs
    # every bucket captured into one pool, largest first (what a server holds for the graphs' lifetime)
    graphs, delta, pool_bytes = _capture(buckets, context, layers, q_quant, static)
    shared = {
        **common,
        "all_buckets_one_pool": len(buckets),
        "capture_pool_bytes": pool_bytes,
        "reserved_delta_bytes": delta,
        "capture_pool_kv_tokens": int(pool_bytes / kv_per_token),
        "capture_pool_gib": round(pool_bytes / 2**30, 3),
    }
    _emit(shared)
    del graphs

    # sanity: a pool that holds nothing, one below the scratch one forward must hold, one above what no reuse
    # at all would need, or one that does not grow with the bucket, is nonsense
    pools = [r["capture_pool_bytes"] for r in rows]
    assert all(p > 0 for p in pools), rows
    assert all(r["capture_pool_bytes"] >= r["live_bytes_one_layer_and_metadata"] for r in rows), rows
    assert all(r["capture_pool_bytes"] <= layers * r["live_bytes_one_layer_and_metadata"] + slack for r in rows), rows
    assert all(b >= a - slack for a, b in zip(pools, pools[1:])), pools
    assert pools[-1] > pools[0] and pools[-1] >= rows[-1]["logits_bytes_one_layer"], pools
    # the shared pool holds at least the largest bucket's and at most the sum of all
    assert pools[-1] - slack <= shared["capture_pool_bytes"] <= sum(pools), (shared, pools)
    assert all(
        r["sparse_prefill_reservation_bytes_with_graphs"] >= r["sparse_prefill_reservation_bytes_without"] > 0
        for r in rows
    )
