// src/kernels/nn_cuda.cuh — small device helpers shared by the CUDA twins of
// the generic ops: f32/bf16 loads and stores, grid sizing, the dtype switch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/nn_kernels.h"

namespace gdncp {
namespace cuda {

__device__ __forceinline__ float load_f(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store_f(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

// Typed device pointers (Tensor::data_ptr knows only the host bf16 type).
template <typename T>
T* ptr(Tensor& t) {
  return static_cast<T*>(t.data());
}
template <typename T>
const T* ptr(const Tensor& t) {
  return static_cast<const T*>(t.data());
}

inline cudaStream_t stream() { return static_cast<cudaStream_t>(current_stream()); }

constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n elements (capped; the loop covers the rest).
inline unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)));
}

#define GDNCP_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// Calls body with scalar_t = float or __nv_bfloat16 for dtype (f64 is rejected
// before any twin runs).
#define GDNCP_CUDA_FLOAT_SWITCH(dtype, op, ...)                                         \
  do {                                                                                  \
    if ((dtype) == ::gdncp::DType::f32) {                                               \
      using scalar_t = float;                                                           \
      __VA_ARGS__();                                                                    \
    } else if ((dtype) == ::gdncp::DType::bf16) {                                       \
      using scalar_t = __nv_bfloat16;                                                   \
      __VA_ARGS__();                                                                    \
    } else {                                                                            \
      GDNCP_FAIL(op, ": CUDA supports f32 and bf16, got ", ::gdncp::dtype_name(dtype)); \
    }                                                                                   \
  } while (0)

}  // namespace cuda
}  // namespace gdncp
