// src/autograd/tensor_kernels.cu — the elementwise kernels Tensor itself needs
// (fill, dtype cast, add for gradient accumulation). Grid-stride loops; every
// launch is checked. CPU versions live in tensor.cpp.
#include "autograd/device.h"
#include "kernels/common/cuda_common.cuh"

namespace gdncp {
namespace detail {
namespace {

using ::gdncp::cuda::detail::blocks_for;
using ::gdncp::cuda::detail::kGridThreads;
using ::gdncp::cuda::detail::stream;

__device__ __forceinline__ double load_as_double(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

__device__ __forceinline__ void store_from_double(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    default: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v)); break;
  }
}

__global__ void fill_kernel(void* dst, DType t, int64_t n, double value) {
  GDNCP_GRID_STRIDE(i, n)
  store_from_double(dst, t, i, value);
}

// f32 <-> bf16 goes through float so bf16 rounding is round-to-nearest-even,
// matching the host's float_to_bf16.
__global__ void cast_kernel(void* dst, DType dt, const void* src, DType st, int64_t n) {
  GDNCP_GRID_STRIDE(i, n) {
    const double v = load_as_double(src, st, i);
    if (dt == DType::bf16)
      static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(static_cast<float>(v));
    else
      store_from_double(dst, dt, i, v);
  }
}

// a + b rounded once to the storage type (f32 adds in f32, bf16 through f32).
__global__ void add_kernel(void* out, const void* a, const void* b, DType t, int64_t n) {
  GDNCP_GRID_STRIDE(i, n) {
    if (t == DType::f64) {
      static_cast<double*>(out)[i] = static_cast<const double*>(a)[i] + static_cast<const double*>(b)[i];
    } else {
      const float s = static_cast<float>(load_as_double(a, t, i)) + static_cast<float>(load_as_double(b, t, i));
      store_from_double(out, t, i, s);
    }
  }
}

}  // namespace

void cuda_fill(void* dst, DType dtype, int64_t n, double value) {
  if (n == 0) return;
  fill_kernel<<<blocks_for(n), kGridThreads, 0, stream()>>>(dst, dtype, n, value);
  GDNCP_CUDA_CHECK_LAUNCH("fill_kernel");
}

void cuda_cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n) {
  if (n == 0) return;
  cast_kernel<<<blocks_for(n), kGridThreads, 0, stream()>>>(dst, dst_dtype, src, src_dtype, n);
  GDNCP_CUDA_CHECK_LAUNCH("cast_kernel");
}

void cuda_add(void* out, const void* a, const void* b, DType dtype, int64_t n) {
  if (n == 0) return;
  add_kernel<<<blocks_for(n), kGridThreads, 0, stream()>>>(out, a, b, dtype, n);
  GDNCP_CUDA_CHECK_LAUNCH("add_kernel");
}

}  // namespace detail
}  // namespace gdncp
