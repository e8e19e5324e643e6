// src/nn/sigmoid.cu — CUDA twin of sigmoid (forward and backward), f32 math
// for f32 and bf16 storage. Kernels first, launchers after.
#include "kernels/common/cuda_common.cuh"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

template <typename T>
__global__ void sigmoid_fwd_kernel(T* y, const T* x, int64_t n) {
  GDNCP_GRID_STRIDE(i, n) store_f(y, i, 1.0f / (1.0f + expf(-load_f(x, i))));
}

template <typename T>
__global__ void sigmoid_bwd_kernel(T* dx, const T* dy, const T* y, int64_t n) {
  GDNCP_GRID_STRIDE(i, n) {
    const float yi = load_f(y, i);
    store_f(dx, i, load_f(dy, i) * yi * (1.0f - yi));
  }
}

}  // namespace

void sigmoid_fwd(Tensor& y, const Tensor& x) {
  const int64_t n = x.numel();
  GDNCP_CUDA_FLOAT_SWITCH(x.dtype(), "sigmoid", [&] {
    sigmoid_fwd_kernel<<<blocks_for(n), kGridThreads, 0, stream()>>>(ptr<scalar_t>(y), ptr<scalar_t>(x), n);
  });
  GDNCP_CUDA_CHECK_LAUNCH("sigmoid_fwd_kernel");
}

void sigmoid_bwd(Tensor& dx, const Tensor& dy, const Tensor& y) {
  const int64_t n = y.numel();
  GDNCP_CUDA_FLOAT_SWITCH(y.dtype(), "sigmoid", [&] {
    sigmoid_bwd_kernel<<<blocks_for(n), kGridThreads, 0, stream()>>>(ptr<scalar_t>(dx), ptr<scalar_t>(dy),
                                                                     ptr<scalar_t>(y), n);
  });
  GDNCP_CUDA_CHECK_LAUNCH("sigmoid_bwd_kernel");
}

}  // namespace cuda
}  // namespace gdncp
