// src/kernels/common/clip_guard.cu — the CUDA twin of guard_clip_mask (Note
// [clip mask values] in clip_guard.h): one block checks the mask and, on a bad
// value, fills the outputs with NaN and writes the host-mapped fault record.
#include "kernels/common/clip_guard.h"
#include "kernels/common/cuda_common.cuh"

namespace gdncp {
namespace kernels {
namespace cuda {
namespace {

using ::gdncp::cuda::detail::stream;

constexpr int kGuardThreads = 1024;
constexpr int kGuardTargets = 8;  // outputs per launch

struct GuardTargets {
  void* data[kGuardTargets];
  int64_t n[kGuardTargets];
  DType dtype[kGuardTargets];
  int count = 0;
};

__device__ __forceinline__ void store_nan(void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = __int_as_float(0x7fc00000); break;
    case DType::f64: static_cast<double*>(p)[i] = __longlong_as_double(0x7ff8000000000000LL); break;
    default: static_cast<uint16_t*>(p)[i] = 0x7fc0; break;  // bf16
  }
}

// One block: the mask is small ((B, F)); the outputs are written only on a bad value.
__global__ void __launch_bounds__(kGuardThreads)
    guard_clip_mask_kernel(const float* __restrict__ mask, int64_t n, int64_t cols, ClipFault* rec, GuardTargets t) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = ~0ull;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = mask[i];
    if (!(v == 0.0f || v == 1.0f)) atomicMin(&first, static_cast<unsigned long long>(i));
  }
  __syncthreads();
  if (first == ~0ull) return;
  for (int k = 0; k < t.count; ++k)
    for (int64_t i = threadIdx.x; i < t.n[k]; i += blockDim.x) store_nan(t.data[k], t.dtype[k], i);
  if (threadIdx.x == 0) {
    volatile ClipFault* r = rec;
    r->index = static_cast<int64_t>(first);
    r->cols = cols;
    r->value = mask[first];
    __threadfence_system();  // the fields before seq, as the host reads them
    r->seq = r->seq + 1;
    __threadfence_system();
  }
}

}  // namespace

void guard_clip_mask(const Tensor& mask, const std::vector<Tensor>& outputs) {
  const int64_t n = mask.numel();
  if (n == 0) return;
  // Host-mapped: with unified addressing its host address is its device address.
  ClipFault* rec = clip_fault_record();
  size_t k = 0;
  do {  // at least one launch: the mask is checked even with no outputs
    GuardTargets t;
    for (; k < outputs.size() && t.count < kGuardTargets; ++k) {
      Tensor o = outputs[k];
      if (!o.defined() || o.numel() == 0) continue;
      GDNCP_CHECK(o.is_cuda(), "guard_clip_mask: output ", o.str(), " is not on the mask's device");
      t.data[t.count] = o.data();
      t.n[t.count] = o.numel();
      t.dtype[t.count] = o.dtype();
      ++t.count;
    }
    guard_clip_mask_kernel<<<1, kGuardThreads, 0, stream()>>>(mask.data_ptr<float>(), n, mask.size(1), rec, t);
    GDNCP_CUDA_CHECK_LAUNCH("guard_clip_mask_kernel");
  } while (k < outputs.size());
}

}  // namespace cuda
}  // namespace kernels
}  // namespace gdncp
