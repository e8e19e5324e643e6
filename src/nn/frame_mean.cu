// src/nn/frame_mean.cu — CUDA twin of frame_mean (forward and backward).
// One thread per row sums its S tokens in order (bitwise reproducible; the
// rows are few — B·H·F — so the serial sum is not the bottleneck).
#include "kernels/common/cuda_common.cuh"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

template <typename T>
__global__ void frame_mean_fwd_kernel(T* y, const T* x, int64_t R, int64_t S) {
  GDNCP_GRID_STRIDE(r, R) {
    float s = 0.0f;
    for (int64_t j = 0; j < S; ++j) s += load_f(x, r * S + j);
    store_f(y, r, s / static_cast<float>(S));
  }
}

template <typename T>
__global__ void frame_mean_bwd_kernel(T* dx, const T* dy, int64_t R, int64_t S) {
  GDNCP_GRID_STRIDE(i, R * S) store_f(dx, i, load_f(dy, i / S) / static_cast<float>(S));
}

}  // namespace

void frame_mean_fwd(Tensor& y, const Tensor& x, int64_t R, int64_t S) {
  GDNCP_CUDA_FLOAT_SWITCH(x.dtype(), "frame_mean", [&] {
    frame_mean_fwd_kernel<<<blocks_for(R), kGridThreads, 0, stream()>>>(ptr<scalar_t>(y), ptr<scalar_t>(x), R, S);
  });
  GDNCP_CUDA_CHECK_LAUNCH("frame_mean_fwd_kernel");
}

void frame_mean_bwd(Tensor& dx, const Tensor& dy, int64_t R, int64_t S) {
  GDNCP_CUDA_FLOAT_SWITCH(dx.dtype(), "frame_mean", [&] {
    frame_mean_bwd_kernel<<<blocks_for(R * S), kGridThreads, 0, stream()>>>(ptr<scalar_t>(dx), ptr<scalar_t>(dy), R, S);
  });
  GDNCP_CUDA_CHECK_LAUNCH("frame_mean_bwd_kernel");
}

}  // namespace cuda
}  // namespace gdncp
