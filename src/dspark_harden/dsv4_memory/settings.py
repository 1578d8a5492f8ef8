"""Names and settings of the DSV4 eager-prefill memory features: the one place the feature module,
its parts and its tests read them (no torch / sglang import)."""

from __future__ import annotations

from ..core.settings import Setting, flag01, int_range, positive_int

POOL_FEATURE = "dsv4-sparse-prefill-pool"
QNORM_FEATURE = "dsv4-inplace-q-norm-rope"
GUARDS_FEATURE = "dsv4-planner-guards"

POOL = "DSPARK_HARDEN_DSV4_SPARSE_PREFILL_POOL"
POOL_TOKENS = "DSPARK_HARDEN_DSV4_SPARSE_PREFILL_TOKENS"
POOL_SLOTS = "DSPARK_HARDEN_DSV4_SPARSE_PREFILL_SLOTS"
QNORM = "DSPARK_HARDEN_DSV4_INPLACE_Q_NORM_ROPE"
GUARDS = "DSPARK_HARDEN_DSV4_PLANNER_GUARDS"
GUARDS_SYNC = "DSPARK_HARDEN_DSV4_PLANNER_GUARDS_SYNC"

FLASH_MLA_TARGET = "sglang.kernels.ops.attention.flash_mla_interface:flash_mla_sparse_fwd"
FLASH_MLA_FINGERPRINT = "dfc3f8b1a22d1ba0"  # checked against the installed source by tests/dsv4_memory
Q8KV8_TARGET = "sglang.kernels.ops.attention.sparse_mla_q8kv8_prefill_sm90:sparse_mla_q8kv8_prefill_fwd"
Q8KV8_FINGERPRINT = "7bea049b190ecddc"
BACKEND_INIT_TARGET = "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.__init__"
BACKEND_INIT_FINGERPRINT = "ca0f301c0b0998d8"
Q_B_TARGET = "sglang.srt.models.deepseek_v4:MQALayer._compute_q_b"
Q_B_FINGERPRINT = "591b8227c137651a"
PREFILL_PLAN_TARGET = "sglang.kernels.ops.attention.dsv4.compress:CompressorPrefillPlan.generate"
PREFILL_PLAN_FINGERPRINT = "dfcc3c08631d7af8"
DECODE_PLAN_TARGET = "sglang.kernels.ops.attention.dsv4.compress:CompressorDecodePlan.generate"
DECODE_PLAN_FINGERPRINT = "7f38a6579d3d76dc"
# the planner guards' per-step report: every forward-metadata build, eager and graph replay
METADATA_TARGET = "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.init_forward_metadata"
METADATA_FINGERPRINT = "86a69e718d9ff3da"
METADATA_OUT_GRAPH_TARGET = (
    "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.init_forward_metadata_out_graph"
)
METADATA_OUT_GRAPH_FINGERPRINT = "524e43e8dc2c557c"
# the planner guards' check at the step's result sync: the result processors stock calls after the
# forward, which wait for the step's result copy before they append and stream its tokens
_BRP = "sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor."
RESULT_SYNC_TARGETS = {
    _BRP + "process_batch_result_prefill": "1aea9fd7d974f1bb",
    _BRP + "process_batch_result_decode": "038c21b9d5a79038",
    # PD prefill server (--disaggregation-mode prefill): its own result processor on the Scheduler mixin
    "sglang.srt.disaggregation.prefill:SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill": (
        "25c3f6d4f0bfc1f6"
    ),
}
# the kernel sources the guarded planner copies (c_plan.cuh) or documents as reading no req_to_token /
# full_to_state (c128_online_v2.cuh, generate_online): sha256 (first 16 hex) of the installed file under
# sglang/kernels/jit/csrc, and of the two Python generate_online methods
KERNEL_SOURCES = {
    "deepseek_v4/c_plan.cuh": "ece03178ec400098",
    "deepseek_v4/c128_online_v2.cuh": "0efcc8b09519d2dd",
}
ONLINE_PLAN_SOURCES = {
    "sglang.kernels.ops.attention.dsv4.compress:CompressorPrefillPlan.generate_online": "5e652f8bee4ccc4b",
    "sglang.kernels.ops.attention.dsv4.compress:CompressorDecodePlan.generate_online": "51573ed900c53730",
}

#: The compute capabilities each DSV4 GPU suite has run on, and the cards (tests/gpu/RUN.md records every run):
#: what the start-up self-test's refusal and ``dspark-harden check`` compare the local device with. H100 and
#: H200 are both sm_90; nothing has run on Blackwell (sm_100 / sm_103) yet. An empty entry: not yet run.
GPU_RUNS = {
    "tests/gpu/test_dsv4_memory_gpu.py": {"sm_90": ("NVIDIA H200",)},
    "tests/gpu/test_dsv4_selftest_gpu.py": {"sm_90": ("NVIDIA H100 80GB HBM3",)},
    "tests/gpu/test_dsv4_result_sync_gpu.py": {"sm_90": ("NVIDIA H100 80GB HBM3",)},
}


def proven_ccs() -> dict:
    """``{"sm_90": ("NVIDIA H200", ...)}``: every compute capability some DSV4 GPU suite ran on, with its cards."""
    out: dict = {}
    for runs in GPU_RUNS.values():
        for cc, cards in runs.items():
            out[cc] = tuple(sorted(set(out.get(cc, ())) | set(cards)))
    return dict(sorted(out.items()))


SETTINGS = [
    Setting(
        POOL,
        flag01,
        False,
        "1: every DSV4 sparse-prefill FlashMLA call (flash_mla_sparse_fwd: output, max_logits, lse) "
        "allocates from a private CUDA memory pool reserved once, after the weights load and before "
        "graph capture, for the largest sparse-prefill shape; a call larger than the reservation "
        "fails naming both sizes. Needs CUDA. 0: stock (fresh allocations per layer call).",
        feature=POOL_FEATURE,
    ),
    Setting(
        POOL_TOKENS,
        positive_int,
        None,
        "Token capacity of the sparse-prefill reservation. Unset: the server's --chunked-prefill-size "
        "(or --max-prefill-tokens when chunking is off), raised to the largest prefill CUDA-graph bucket "
        "when prefill graphs are on; a value below that bucket stops start-up.",
        feature=POOL_FEATURE,
        accepts="positive integer (tokens)",
    ),
    Setting(
        POOL_SLOTS,
        int_range(1, 4),
        1,
        "Sparse-prefill outputs that may be alive at once (1: one layer's output is consumed before "
        "the next layer's call, as in eager prefill; 2 with two-batch overlap).",
        feature=POOL_FEATURE,
    ),
    Setting(
        QNORM,
        flag01,
        False,
        "1: DSV4's q_head_norm path runs fused_q_norm_rope in place (input aliased to output; "
        "alias safety established from the kernel source and tested on the GPU), removing one "
        "tokens x heads x head_dim allocation per layer call. 0: stock (out of place). Needs CUDA.",
        feature=QNORM_FEATURE,
    ),
    Setting(
        GUARDS,
        flag01,
        False,
        "1: every DSV4 compress plan (CompressorPrefillPlan.generate / CompressorDecodePlan.generate), eager, "
        "captured or replayed, runs a device-side guarded planner (bit-identical to stock for in-bounds "
        "inputs, no device sync): an index past an allocation is clamped and counted on the GPU, and the "
        "host raises a named error at the step's result sync, before any token of that step is appended or "
        "streamed (or earlier, at the next plan or forward-metadata build; shape and host-length "
        "problems are refused before the launch). generate_online reads no req_to_token / full_to_state "
        "entry and is left to stock. Needs CUDA and nvcc (SGLang's JIT). 0: stock.",
        feature=GUARDS_FEATURE,
    ),
    Setting(
        GUARDS_SYNC,
        flag01,
        False,
        "1 (with the planner guards): also check the planner's device inputs on the host before every eager "
        "plan, refusing the launch -- one device sync per plan (decode b=256: ~45 -> ~630 us per plan on an "
        "H200), for debugging. 0: device-side guard only.",
        feature=GUARDS_FEATURE,
    ),
]
