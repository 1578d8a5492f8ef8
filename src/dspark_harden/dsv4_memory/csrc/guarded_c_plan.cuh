// dspark-harden: device-side bounds-guarded variants of SGLang 0.5.23's DSV4 compress planners
// (sglang/kernels/jit/csrc/deepseek_v4/c_plan.cuh: plan_compress_decode, plan_compress_prefill), loaded
// through SGLang's own JIT (sglang.kernels.jit load_jit) next to the stock header they include.
//
// Why: a host-side check of the planner's inputs needs a device sync per plan (the inputs live on the
// GPU), and a plan recorded inside a CUDA graph (decode graphs; prefill graphs) never passes a host check
// at all. These planners compute exactly what stock computes whenever every address they read or write
// lies inside its allocation, and otherwise read and write nothing out of bounds: they clamp an offending
// read index into its allocation (the plan entry is then garbage but every location it names is in
// bounds), drop an entry that would be appended past the plan buffers, count the violation per reason in
// a device counter, and publish the counters to a pinned host mirror with one tiny kernel queued behind
// the plan (stream order makes the mirror monotonic). The host reads the mirror without a sync on every
// plan and every forward-metadata build (dsv4_memory.planner_device) and fails the server naming the
// reason. DecodePlan has no invalid sentinel, and a -1 write location would itself be an out-of-bounds
// write downstream, hence the clamp.
//
// "Inside the allocation" is the memory-safety criterion, not a semantic one, so that the plans stay
// bit-identical to stock for every input stock reads in bounds (zero-length decode sentinels included:
// seq_len 0 makes stock read req_to_token[rid, -1], i.e. the previous row's last entry):
//   * the flat req_to_token index rid * stride + position must be in [0, rows * stride);
//   * every full location read must be in [0, len(full_to_state));
//   * GPU-input prefill: 0 <= extend_len <= seq_len for every request and sum(extend_len) <= num_q_tokens
//     (the plan buffers hold num_q_tokens entries and every ragged id indexes a q token). A batch that
//     breaks either is planned as if every extend length were 0 (stock kernel0 then emits only invalid
//     entries): nothing is appended past the buffers, the batch computes nothing, and it is reported.
//     The CPU-input path keeps stock's host RuntimeChecks for the same conditions (they raise before
//     any launch) and runs the guarded stage-1 kernel.
#include "deepseek_v4/c_plan.cuh"

namespace sglang {
namespace host::compress {

// counter index per reason (dsv4_memory.planner_device.REASONS)
inline constexpr int32_t kGuardR2T = 0;     // a req_to_token read outside the allocation
inline constexpr int32_t kGuardF2S = 1;     // a full_to_state read outside the allocation
inline constexpr int32_t kGuardLens = 2;    // a GPU-input prefill extend length <= 0 or > its sequence
inline constexpr int32_t kGuardNumQ = 3;    // GPU-input prefill extend lengths add up past num_q_tokens
inline constexpr int32_t kGuardReasons = 4; // counters [kGuardReasons] int32 on the device, mirror pinned

struct GuardParams {
    int32_t *counts; // device
    int64_t r2t_numel;
    int64_t f2s_numel;
};

SGL_DEVICE int64_t guard_r2t(const GuardParams &g, int64_t flat) {
    if (flat < 0 || flat >= g.r2t_numel) {
        atomicAdd(g.counts + kGuardR2T, 1);
        flat = min(max(flat, int64_t{0}), g.r2t_numel - 1);
    }
    return flat;
}

SGL_DEVICE int64_t guard_f2s(const GuardParams &g, int64_t loc) {
    if (loc < 0 || loc >= g.f2s_numel) {
        atomicAdd(g.counts + kGuardF2S, 1);
        loc = min(max(loc, int64_t{0}), g.f2s_numel - 1);
    }
    return loc;
}

__global__ void guard_publish_kernel(const int32_t *counts, volatile int32_t *mirror) {
    if (threadIdx.x < kGuardReasons) mirror[threadIdx.x] = counts[threadIdx.x];
}

__global__ void plan_compress_decode_guarded_kernel(const DecodeParams params, const GuardParams guard) {
    const auto idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= params.batch_size) return;
    const auto rid = params.rid_ptr[idx];
    const auto compute_loc = [&](int32_t swa_loc) {
        const auto swa_page = swa_loc / params.swa_page_size;
        const auto ring_offset = swa_loc % params.ring_size;
        return swa_page * params.ring_size + ring_offset;
    };
    const auto compute_req_ring_loc = [&](int64_t rid, int32_t position) {
        return static_cast<int32_t>(rid * params.ring_size + position % params.ring_size);
    };
    const auto seq_len = static_cast<int32_t>(params.seq_ptr[idx]);
    const auto position_1 = static_cast<int32_t>(seq_len - 1);
    const auto position_0 = max(position_1 - params.compress_ratio, 0);
    int32_t write_loc;
    int32_t read_page_0;
    int32_t read_page_1;
    if (params.compress_ratio == 128 || params.use_req_ring) {
        write_loc = compute_req_ring_loc(rid, position_1);
        read_page_0 = compute_req_ring_loc(rid, position_0) / params.compress_ratio;
        read_page_1 = compute_req_ring_loc(rid, position_1) / params.compress_ratio;
    } else {
        const auto raw_loc_0 = params.r2t_ptr[guard_r2t(guard, rid * params.stride_r2t + position_0)];
        const auto raw_loc_1 = params.r2t_ptr[guard_r2t(guard, rid * params.stride_r2t + position_1)];
        const auto state_loc_0 = params.f2s_ptr[guard_f2s(guard, raw_loc_0)];
        const auto state_loc_1 = params.f2s_ptr[guard_f2s(guard, raw_loc_1)];
        write_loc = static_cast<int32_t>(compute_loc(state_loc_1));
        read_page_0 = static_cast<int32_t>(compute_loc(state_loc_0) / params.compress_ratio);
        read_page_1 = static_cast<int32_t>(write_loc / params.compress_ratio);
    }
    params.plan_d[idx] = {
        .seq_len = static_cast<uint32_t>(seq_len),
        .write_loc = write_loc,
        .read_page_0 = read_page_0,
        .read_page_1 = read_page_1,
    };
}

// stock plan_compress_prefill_kernel_1 (stage 1: SWA-translated read / write locations) with the
// req_to_token and full_to_state reads guarded
__global__ void plan_compress_prefill_guarded_kernel_1(const Prefill1Params params, const GuardParams guard) {
    const auto idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= params.num_work) return;
    auto plan_c = idx < params.num_c ? params.plan_c[idx] : PlanC::invalid();
    auto plan_w = idx < params.num_w ? params.plan_w[idx] : PlanW::invalid();

    const auto compute_loc = [&](int32_t swa_loc) {
        const auto swa_page = swa_loc / params.swa_page_size;
        const auto ring_offset = swa_loc % params.ring_size;
        return swa_page * params.ring_size + ring_offset;
    };
    const auto compute_req_ring_loc = [&](int64_t rid, int32_t position) {
        return static_cast<int32_t>(rid * params.ring_size + position % params.ring_size);
    };

    if (!plan_c.is_invalid()) {
        if (plan_c.buffer_len > 0) {
            const auto batch_id = plan_c.read_page_1;
            const auto rid = params.rid_ptr[batch_id];
            const auto position_1 = static_cast<int32_t>(plan_c.seq_len - 1);
            const auto position_0 = max(position_1 - params.compress_ratio, 0);
            if (params.compress_ratio == 128 || params.use_req_ring) {
                plan_c.read_page_0 = compute_req_ring_loc(rid, position_0) / params.compress_ratio;
                plan_c.read_page_1 = compute_req_ring_loc(rid, position_1) / params.compress_ratio;
            } else {
                const auto raw_loc_0 = params.r2t_ptr[guard_r2t(guard, rid * params.stride_r2t + position_0)];
                const auto raw_loc_1 = params.r2t_ptr[guard_r2t(guard, rid * params.stride_r2t + position_1)];
                const auto state_loc_0 = params.f2s_ptr[guard_f2s(guard, raw_loc_0)];
                const auto state_loc_1 = params.f2s_ptr[guard_f2s(guard, raw_loc_1)];
                plan_c.read_page_0 = compute_loc(state_loc_0) / params.compress_ratio;
                plan_c.read_page_1 = compute_loc(state_loc_1) / params.compress_ratio;
            }
            params.plan_c[idx] = plan_c;
        }
    } else if (idx < params.num_c_padded) {
        params.plan_c[idx] = PlanC::invalid();
    }

    if (!plan_w.is_invalid()) {
        const auto [ragged_id, batch_id] = unpack_w(plan_w);
        const auto rid = params.rid_ptr[batch_id];
        const auto position = static_cast<int32_t>(plan_w.write_loc - 1);
        plan_w.ragged_id = ragged_id;
        if (params.compress_ratio == 128 || params.use_req_ring) {
            plan_w.write_loc = compute_req_ring_loc(rid, position);
        } else {
            const auto raw_loc = params.r2t_ptr[guard_r2t(guard, rid * params.stride_r2t + position)];
            plan_w.write_loc = compute_loc(params.f2s_ptr[guard_f2s(guard, raw_loc)]);
        }
        params.plan_w[idx] = plan_w;
    } else if (idx < params.num_w_padded) {
        params.plan_w[idx] = PlanW::invalid();
    }
}

// GPU-input prefill, before stock kernel0: copy the lengths into scratch, as they are when
// 0 <= extend_len <= seq_len for every request (0: padding / sentinel entries, legal here) and sum(extend_len) <= num_q_tokens, else with every
// extend length 0 (stock kernel0 then appends nothing and pads both buffers with invalid entries)
__global__ __launch_bounds__(kMaxPrefillBatchSize, 1) //
    void guard_prefill_lengths_kernel(const IDX_T *seq_lens, const IDX_T *extend_lens, IDX_T *seq_out, IDX_T *ext_out,
                                      const uint32_t batch_size, const uint32_t num_q_tokens, int32_t *counts) {
    __shared__ unsigned long long s_total;
    __shared__ int s_bad;
    const auto tx = threadIdx.x;
    if (tx == 0) {
        s_total = 0;
        s_bad = 0;
    }
    __syncthreads();
    IDX_T seq = 0, ext = 0;
    if (tx < batch_size) {
        seq = seq_lens[tx];
        ext = extend_lens[tx];
        if (ext < 0 || ext > seq) atomicOr(&s_bad, 1);
        if (ext > 0) atomicAdd(&s_total, static_cast<unsigned long long>(ext));
    }
    __syncthreads();
    const bool over = s_total > num_q_tokens;
    if (tx == 0) {
        if (s_bad) atomicAdd(counts + kGuardLens, 1);
        if (over) atomicAdd(counts + kGuardNumQ, 1);
    }
    if (tx < batch_size) {
        seq_out[tx] = seq;
        ext_out[tx] = (s_bad || over) ? 0 : ext;
    }
}

inline GuardParams make_guard(const tvm::ffi::TensorView counts, const tvm::ffi::TensorView req_to_token,
                              const tvm::ffi::TensorView full_to_state, SymbolicDevice &device_) {
    TensorMatcher({kGuardReasons}).with_dtype<int32_t>().with_device(device_).verify(counts);
    // the extent of req_to_token's allocation as the planner addresses it (row stride x rows; for the
    // contiguous tensor SGLang passes, rows x columns)
    const int64_t rows = req_to_token.size(0);
    const int64_t r2t_extent = rows > 0 ? (rows - 1) * req_to_token.stride(0) + req_to_token.size(1) : 0;
    return GuardParams{
        .counts = static_cast<int32_t *>(counts.data_ptr()),
        .r2t_numel = r2t_extent,
        .f2s_numel = full_to_state.size(0),
    };
}

// the device address of the pinned mirror ([kGuardReasons] int32, host memory), queried once outside
// any graph capture (dsv4_memory.planner_device.ensure_state) and passed to every plan as an integer
inline int64_t guard_mirror_device_pointer(const tvm::ffi::TensorView mirror) {
    TensorMatcher({kGuardReasons}).with_dtype<int32_t>().with_device<kDLCPU>().verify(mirror);
    void *dev_mirror = nullptr;
    RuntimeDeviceCheck(cudaHostGetDevicePointer(&dev_mirror, mirror.data_ptr(), 0));
    return reinterpret_cast<int64_t>(dev_mirror);
}

// queue the counters' copy into the pinned mirror behind the plan (a graph records it too)
inline void publish_guard(const GuardParams &guard, const int64_t mirror_device_ptr, DLDevice device) {
    RuntimeCheck(mirror_device_ptr != 0, "the planner guard's mirror has no device address");
    LaunchKernel(1, 32, device)(guard_publish_kernel, guard.counts,
                                reinterpret_cast<volatile int32_t *>(mirror_device_ptr));
}

// stock plan_compress_decode's host side with the guard (same checks, same launch geometry)
inline tvm::ffi::Tensor plan_compress_decode_guarded(const tvm::ffi::TensorView req_pool_indices,
                                                     const tvm::ffi::TensorView req_to_token,
                                                     const tvm::ffi::TensorView full_to_state,
                                                     const tvm::ffi::TensorView seq_lens,
                                                     const tvm::ffi::TensorView counts, const int64_t mirror_device_ptr,
                                                     const int32_t compress_ratio, const int32_t swa_page_size,
                                                     const int32_t ring_size, const bool use_req_ring) {
    auto B = SymbolicSize{"batch_size"};
    auto device_ = SymbolicDevice{};
    device_.set_options<kDLGPU>();
    TensorMatcher({B}).with_dtype<RID_T>().with_device(device_).verify(req_pool_indices);
    TensorMatcher({-1, -1}).with_dtype<R2T_T>().with_device(device_).verify(req_to_token);
    TensorMatcher({-1}).with_dtype<F2S_T>().with_device(device_).verify(full_to_state);
    TensorMatcher({B}).with_dtype<IDX_T>().with_device(device_).verify(seq_lens);
    const auto guard = make_guard(counts, req_to_token, full_to_state, device_);
    RuntimeCheck(!use_req_ring || compress_ratio == 4);
    const auto batch_size = static_cast<uint32_t>(B.unwrap());
    const auto device = device_.unwrap();
    auto D = ffi::empty({batch_size, sizeof(PlanD)}, kDLUInt8, device);
    const auto params = DecodeParams{
        .plan_d = static_cast<PlanD *>(D.data_ptr()),
        .rid_ptr = static_cast<const RID_T *>(req_pool_indices.data_ptr()),
        .r2t_ptr = static_cast<const R2T_T *>(req_to_token.data_ptr()),
        .f2s_ptr = static_cast<const F2S_T *>(full_to_state.data_ptr()),
        .seq_ptr = static_cast<const IDX_T *>(seq_lens.data_ptr()),
        .stride_r2t = req_to_token.size(1),
        .batch_size = batch_size,
        .swa_page_size = swa_page_size,
        .ring_size = ring_size,
        .compress_ratio = compress_ratio,
        .use_req_ring = use_req_ring,
    };
    const auto block_size = 256;
    const auto num_blocks = div_ceil(batch_size, block_size);
    if (num_blocks > 0) {
        LaunchKernel(num_blocks, block_size, device)(plan_compress_decode_guarded_kernel, params, guard);
    }
    publish_guard(guard, mirror_device_ptr, device);
    return D;
}

// stock plan_compress_prefill's host side with the guard: same host checks, the GPU-input path's
// lengths sanitised before stock kernel0, the guarded stage-1 kernel on both paths
inline PrefillPlan
plan_compress_prefill_guarded(const tvm::ffi::TensorView req_pool_indices, const tvm::ffi::TensorView req_to_token,
                              const tvm::ffi::TensorView full_to_state, const tvm::ffi::TensorView seq_lens,
                              const tvm::ffi::TensorView extend_lens, const tvm::ffi::TensorView pin_buffer,
                              const tvm::ffi::TensorView counts, const int64_t mirror_device_ptr,
                              const uint32_t num_q_tokens, const int32_t compress_ratio, const int32_t swa_page_size,
                              const int32_t ring_size, const bool use_req_ring, const bool use_cuda_graph) {
    auto B = SymbolicSize{"batch_size"};
    auto cpu_or_gpu = SymbolicDevice{};
    auto device_ = SymbolicDevice{};
    cpu_or_gpu.set_options<kDLCPU, kDLGPU>();
    device_.set_options<kDLGPU>();
    TensorMatcher({B}).with_dtype<RID_T>().with_device(device_).verify(req_pool_indices);
    TensorMatcher({-1, -1}).with_dtype<R2T_T>().with_device(device_).verify(req_to_token);
    TensorMatcher({-1}).with_dtype<F2S_T>().with_device(device_).verify(full_to_state);
    TensorMatcher({B}).with_dtype<IDX_T>().with_device(cpu_or_gpu).verify(seq_lens).verify(extend_lens);
    TensorMatcher({-1}).with_dtype<uint8_t>().with_device<kDLCPU>().verify(pin_buffer);
    const auto guard = make_guard(counts, req_to_token, full_to_state, device_);

    const bool is_overlap = (compress_ratio == 4);
    const int32_t window_size = compress_ratio * (is_overlap ? 2 : 1);
    const auto seq_ptr = static_cast<const IDX_T *>(seq_lens.data_ptr());
    const auto ext_ptr = static_cast<const IDX_T *>(extend_lens.data_ptr());
    const auto rid_ptr = static_cast<const RID_T *>(req_pool_indices.data_ptr());
    const auto r2t_ptr = static_cast<const R2T_T *>(req_to_token.data_ptr());
    const auto f2s_ptr = static_cast<const F2S_T *>(full_to_state.data_ptr());
    const auto batch_size = static_cast<uint32_t>(B.unwrap());
    constexpr auto kMaxTokens = static_cast<uint32_t>(std::numeric_limits<uint16_t>::max()) + 1;
    RuntimeCheck(compress_ratio == 4 || compress_ratio == 128);
    RuntimeCheck(!use_req_ring || compress_ratio == 4);
    RuntimeCheck(batch_size < kMaxTokens && batch_size <= num_q_tokens && num_q_tokens <= kMaxTokens);
    RuntimeCheck(swa_page_size % ring_size == 0 && ring_size % compress_ratio == 0);
    const auto mtp_pad = ring_size > window_size ? ring_size - window_size + 2 : 0;
    const auto device = device_.unwrap();
    const auto stream = LaunchKernel::resolve_device(device);

    // stage 1 (stock plan_compress_prefill_kernel_1, guarded) and the counters' publication, both paths
    const auto stage1 = [&](tvm::ffi::Tensor C, tvm::ffi::Tensor W, int64_t stride_r2t, uint32_t num_c, uint32_t num_w,
                            uint32_t num_c_padded, uint32_t num_w_padded) {
        const auto params = Prefill1Params{
            .plan_c = static_cast<PlanC *>(C.data_ptr()),
            .plan_w = static_cast<PlanW *>(W.data_ptr()),
            .rid_ptr = rid_ptr,
            .r2t_ptr = r2t_ptr,
            .f2s_ptr = f2s_ptr,
            .stride_r2t = stride_r2t,
            .num_c = num_c,
            .num_w = num_w,
            .num_c_padded = num_c_padded,
            .num_w_padded = num_w_padded,
            .num_work = std::max(num_c_padded, num_w_padded),
            .swa_page_size = swa_page_size,
            .ring_size = ring_size,
            .compress_ratio = compress_ratio,
            .use_req_ring = use_req_ring,
        };
        const auto block_size = 256;
        const auto num_blocks = div_ceil(params.num_work, block_size);
        if (num_blocks > 0) {
            LaunchKernel(num_blocks, block_size, device)(plan_compress_prefill_guarded_kernel_1, params, guard);
        }
        publish_guard(guard, mirror_device_ptr, device);
        return PrefillPlan{std::move(C), std::move(W)};
    };

    if (cpu_or_gpu.unwrap().device_type == kDLGPU) {
        RuntimeCheck(batch_size <= kMaxPrefillBatchSize, "GPU plan only support batch size up to ",
                     kMaxPrefillBatchSize);
        auto C = ffi::empty({num_q_tokens, sizeof(PlanC)}, kDLUInt8, device);
        auto W = ffi::empty({num_q_tokens, sizeof(PlanW)}, kDLUInt8, device);
        auto L = ffi::empty({2, std::max(batch_size, 1u)}, DLDataType{.code = kDLInt, .bits = 64, .lanes = 1}, device);
        const auto seq_safe = static_cast<IDX_T *>(L.data_ptr());
        const auto ext_safe = seq_safe + std::max(batch_size, 1u);
        LaunchKernel(1, kMaxPrefillBatchSize, device)(guard_prefill_lengths_kernel, seq_ptr, ext_ptr, seq_safe,
                                                      ext_safe, batch_size, num_q_tokens, guard.counts);
        const auto params0 = Prefill0Params{
            .plan_c = static_cast<PlanC *>(C.data_ptr()),
            .plan_w = static_cast<PlanW *>(W.data_ptr()),
            .seq_lens_ptr = seq_safe,
            .extend_lens_ptr = ext_safe,
            .batch_size = batch_size,
            .num_q_tokens = num_q_tokens,
            .compress_ratio = compress_ratio,
            .swa_page_size = swa_page_size,
            .mtp_pad = mtp_pad,
            .use_req_ring = use_req_ring,
        };
        LaunchKernel(1, kMaxPrefillBatchSize, device)(plan_compress_prefill_kernel0, params0);
        // kernel_1 sees the already-padded buffers, so num_c == num_w == num_padded == num_q_tokens
        return stage1(std::move(C), std::move(W), req_to_token.stride(0), num_q_tokens, num_q_tokens, num_q_tokens,
                      num_q_tokens);
    }

    // CPU input path: stock's host stage, checks included (they raise before any launch)
    const auto pin_buffer_bytes = static_cast<size_t>(pin_buffer.numel()) * sizeof(uint8_t);
    RuntimeCheck(pin_buffer_bytes >= num_q_tokens * (sizeof(PlanC) + sizeof(PlanW)));
    const auto plan_c_ptr = reinterpret_cast<PlanC *>(pin_buffer.data_ptr());
    const auto plan_w_ptr = reinterpret_cast<PlanW *>(plan_c_ptr + num_q_tokens);
    uint32_t counter = 0;
    uint32_t counter_c = 0;
    uint32_t counter_w = 0;
    const auto should_compress = [=](int32_t position) { return (position + 1) % compress_ratio == 0; };
    for (const auto i : irange(batch_size)) {
        const int32_t seq_len = seq_ptr[i];
        const int32_t extend_len = ext_ptr[i];
        const int32_t prefix_len = seq_len - extend_len;
        const int32_t last_c_pos = seq_len / compress_ratio * compress_ratio;
        const int32_t first_w_pos = std::min(last_c_pos - (is_overlap ? compress_ratio : 0), seq_len - mtp_pad);
        RuntimeCheck(0 < extend_len && extend_len <= seq_len);
        const auto should_write = [=](int32_t position) {
            if (position >= first_w_pos) return true;
            return is_overlap && !use_req_ring && position % swa_page_size >= (swa_page_size - compress_ratio);
        };
        for (const auto j : irange(extend_len)) {
            const int32_t position = prefix_len + j;
            const int32_t ragged_id = counter + j;
            if (should_compress(position)) {
                const auto buffer_len = window_size - std::min(j + 1, window_size);
                plan_c_ptr[counter_c++] = {
                    .seq_len = static_cast<uint32_t>(position + 1),
                    .ragged_id = static_cast<uint16_t>(ragged_id),
                    .buffer_len = static_cast<uint16_t>(buffer_len),
                    .read_page_0 = -1,
                    .read_page_1 = static_cast<int32_t>(i),
                };
            }
            if (should_write(position)) {
                plan_w_ptr[counter_w++] = pack_w(ragged_id, i, position + 1);
            }
        }
        counter += extend_len;
    }
    RuntimeCheck(counter == num_q_tokens);
    const auto copy_to_device = [stream](void *cuda_ptr, auto *host_ptr, size_t count) {
        const auto size_bytes = count * sizeof(*host_ptr);
        RuntimeDeviceCheck(cudaMemcpyAsync(cuda_ptr, host_ptr, size_bytes, cudaMemcpyHostToDevice, stream));
    };
    const auto num_c_padded = use_cuda_graph ? num_q_tokens : counter_c;
    const auto num_w_padded = use_cuda_graph ? num_q_tokens : counter_w;
    auto C = ffi::empty({num_c_padded, sizeof(PlanC)}, kDLUInt8, device);
    auto W = ffi::empty({num_w_padded, sizeof(PlanW)}, kDLUInt8, device);
    copy_to_device(C.data_ptr(), plan_c_ptr, counter_c);
    copy_to_device(W.data_ptr(), plan_w_ptr, counter_w);
    return stage1(std::move(C), std::move(W), req_to_token.size(1), counter_c, counter_w, num_c_padded, num_w_padded);
}

} // namespace host::compress
} // namespace sglang
