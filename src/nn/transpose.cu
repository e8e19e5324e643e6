// src/nn/transpose.cu — CUDA twin of transpose_last2: one thread per
// output element (y is written coalesced; the model's tensors are small,
// (B, N, H) gates, so no shared-memory tiling).
#include "kernels/common/cuda_common.cuh"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

template <typename T>
__global__ void transpose_last2_kernel(T* y, const T* x, int64_t A, int64_t M, int64_t N) {
  GDNCP_GRID_STRIDE(i, A * M * N) {
    const int64_t a = i / (M * N), rem = i % (M * N);
    const int64_t n = rem / M, m = rem % M;  // y[a, n, m]
    y[i] = x[(a * M + m) * N + n];
  }
}

}  // namespace

void transpose_last2(Tensor& y, const Tensor& x, int64_t A, int64_t M, int64_t N) {
  GDNCP_CUDA_FLOAT_SWITCH(x.dtype(), "transpose_last2", [&] {
    transpose_last2_kernel<<<blocks_for(A * M * N), kGridThreads, 0, stream()>>>(ptr<scalar_t>(y), ptr<scalar_t>(x), A,
                                                                                 M, N);
  });
  GDNCP_CUDA_CHECK_LAUNCH("transpose_last2_kernel");
}

}  // namespace cuda
}  // namespace gdncp
