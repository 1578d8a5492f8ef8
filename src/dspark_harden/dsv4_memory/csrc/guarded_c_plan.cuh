// dspark-harden: a device-side bounds-guarded variant of SGLang 0.5.23's DSV4 compress *decode*
// planner (sglang/kernels/jit/csrc/deepseek_v4/c_plan.cuh, plan_compress_decode_kernel), loaded
// through SGLang's own JIT (sglang.kernels.jit load_jit) next to the stock header it includes.
//
// Why: the decode plan is recorded inside the decode CUDA graph, so its replays (the common decode
// path) never pass a host-side check. This kernel computes exactly what the stock kernel computes
// whenever every address it reads lies inside its allocation, and otherwise reads nothing out of
// bounds: it clamps the offending index into its allocation (the plan entry is then garbage but every
// location it names is in bounds) and ORs a reason bit into a device error flag that the host reads
// at its next natural sync, failing the batch (dsv4_memory.planner_device). DecodePlan has no invalid
// sentinel, and a -1 write location would itself be an out-of-bounds write downstream.
//
// "Inside the allocation" is the memory-safety criterion, not a semantic one, so that it stays
// bit-identical to stock for every input stock reads in bounds (zero-length sentinels included:
// seq_len 0 makes stock read req_to_token[rid, -1], i.e. the previous row's last entry):
//   * the flat req_to_token index rid * stride + position must be in [0, rows * stride);
//   * every full location read must be in [0, len(full_to_state)).
#include "deepseek_v4/c_plan.cuh"

namespace sglang {
namespace host::compress {

inline constexpr int32_t kGuardR2T = 1;  // a req_to_token read outside the allocation
inline constexpr int32_t kGuardF2S = 2;  // a full_to_state read outside the allocation

__global__ void plan_compress_decode_guarded_kernel(
    const DecodeParams params, const int64_t r2t_numel, const int64_t f2s_numel, int32_t* error_flag) {
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
    int64_t flat_0 = rid * params.stride_r2t + position_0;
    int64_t flat_1 = rid * params.stride_r2t + position_1;
    if (flat_0 < 0 || flat_0 >= r2t_numel || flat_1 < 0 || flat_1 >= r2t_numel) {
      atomicOr(error_flag, kGuardR2T);
      flat_0 = min(max(flat_0, int64_t{0}), r2t_numel - 1);
      flat_1 = min(max(flat_1, int64_t{0}), r2t_numel - 1);
    }
    int64_t raw_loc_0 = params.r2t_ptr[flat_0];
    int64_t raw_loc_1 = params.r2t_ptr[flat_1];
    if (raw_loc_0 < 0 || raw_loc_0 >= f2s_numel || raw_loc_1 < 0 || raw_loc_1 >= f2s_numel) {
      atomicOr(error_flag, kGuardF2S);
      raw_loc_0 = min(max(raw_loc_0, int64_t{0}), f2s_numel - 1);
      raw_loc_1 = min(max(raw_loc_1, int64_t{0}), f2s_numel - 1);
    }
    const auto state_loc_0 = params.f2s_ptr[raw_loc_0];
    const auto state_loc_1 = params.f2s_ptr[raw_loc_1];
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

// stock plan_compress_decode's host side, plus the error flag ([1] int32 on the device, never reset
// here: the host reads and clears it) -- same checks, same launch geometry
inline tvm::ffi::Tensor plan_compress_decode_guarded(
    const tvm::ffi::TensorView req_pool_indices,
    const tvm::ffi::TensorView req_to_token,
    const tvm::ffi::TensorView full_to_state,
    const tvm::ffi::TensorView seq_lens,
    const tvm::ffi::TensorView error_flag,
    const int32_t compress_ratio,
    const int32_t swa_page_size,
    const int32_t ring_size,
    const bool use_req_ring) {
  auto B = SymbolicSize{"batch_size"};
  auto device_ = SymbolicDevice{};
  device_.set_options<kDLGPU>();
  TensorMatcher({B}).with_dtype<RID_T>().with_device(device_).verify(req_pool_indices);
  TensorMatcher({-1, -1}).with_dtype<R2T_T>().with_device(device_).verify(req_to_token);
  TensorMatcher({-1}).with_dtype<F2S_T>().with_device(device_).verify(full_to_state);
  TensorMatcher({B}).with_dtype<IDX_T>().with_device(device_).verify(seq_lens);
  TensorMatcher({1}).with_dtype<int32_t>().with_device(device_).verify(error_flag);
  RuntimeCheck(!use_req_ring || compress_ratio == 4);
  const auto batch_size = static_cast<uint32_t>(B.unwrap());
  const auto device = device_.unwrap();
  auto D = ffi::empty({batch_size, sizeof(PlanD)}, kDLUInt8, device);
  const auto params = DecodeParams{
      .plan_d = static_cast<PlanD*>(D.data_ptr()),
      .rid_ptr = static_cast<const RID_T*>(req_pool_indices.data_ptr()),
      .r2t_ptr = static_cast<const R2T_T*>(req_to_token.data_ptr()),
      .f2s_ptr = static_cast<const F2S_T*>(full_to_state.data_ptr()),
      .seq_ptr = static_cast<const IDX_T*>(seq_lens.data_ptr()),
      .stride_r2t = req_to_token.size(1),
      .batch_size = batch_size,
      .swa_page_size = swa_page_size,
      .ring_size = ring_size,
      .compress_ratio = compress_ratio,
      .use_req_ring = use_req_ring,
  };
  const int64_t r2t_numel = req_to_token.size(0) * req_to_token.size(1);
  const int64_t f2s_numel = full_to_state.size(0);
  const auto block_size = 256;
  const auto num_blocks = div_ceil(batch_size, block_size);
  LaunchKernel(num_blocks, block_size, device)(
      plan_compress_decode_guarded_kernel, params, r2t_numel, f2s_numel, static_cast<int32_t*>(error_flag.data_ptr()));
  return D;
}

}  // namespace host::compress
}  // namespace sglang
