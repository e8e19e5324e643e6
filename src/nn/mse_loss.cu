// src/nn/mse_loss.cu — CUDA twin of mse_loss (forward and backward).
//
// Note [deterministic sum]: the forward sums in two passes with a FIXED grid
// (kPartials blocks, whatever the device): each thread accumulates a
// grid-stride slice in f64, each block reduces its threads in a fixed tree,
// one block reduces the partials in a fixed tree. Same inputs, same bits.
#include "kernels/common/cuda_common.cuh"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

constexpr int kPartials = 256;  // blocks of the first pass (fixed: see the Note)

template <typename T>
__global__ void mse_partials_kernel(double* partials, const T* p, const T* t, int64_t n) {
  __shared__ double sh[kGridThreads];
  double s = 0;
  GDNCP_GRID_STRIDE(i, n) {
    const double d = static_cast<double>(load_f(p, i)) - static_cast<double>(load_f(t, i));
    s += d * d;
  }
  const double total = block_sum<kGridThreads>(s, sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void mse_finish_kernel(float* loss, const double* partials, double scale) {
  __shared__ double sh[kGridThreads];
  double s = 0;
  for (int i = threadIdx.x; i < kPartials; i += kGridThreads) s += partials[i];
  const double total = block_sum<kGridThreads>(s, sh);
  if (threadIdx.x == 0) loss[0] = static_cast<float>(scale * total);
}

template <typename T>
__global__ void mse_bwd_kernel(T* dp, const float* dloss, const T* p, const T* t, float two_scale, int64_t n) {
  const float factor = two_scale * dloss[0];
  GDNCP_GRID_STRIDE(i, n) store_f(dp, i, factor * (load_f(p, i) - load_f(t, i)));
}

}  // namespace

void mse_fwd(Tensor& loss, const Tensor& pred, const Tensor& target, double scale) {
  const int64_t n = pred.numel();
  Tensor partials = Tensor::empty({kPartials}, DType::f64, Device::cuda);
  GDNCP_CUDA_FLOAT_SWITCH(pred.dtype(), "mse_loss", [&] {
    mse_partials_kernel<<<kPartials, kGridThreads, 0, stream()>>>(static_cast<double*>(partials.data()),
                                                                  ptr<scalar_t>(pred), ptr<scalar_t>(target), n);
  });
  GDNCP_CUDA_CHECK_LAUNCH("mse_partials_kernel");
  mse_finish_kernel<<<1, kGridThreads, 0, stream()>>>(ptr<float>(loss), static_cast<const double*>(partials.data()),
                                                      scale);
  GDNCP_CUDA_CHECK_LAUNCH("mse_finish_kernel");
}

void mse_bwd(Tensor& dpred, const Tensor& dloss, const Tensor& pred, const Tensor& target, double scale) {
  const int64_t n = pred.numel();
  GDNCP_CUDA_FLOAT_SWITCH(pred.dtype(), "mse_loss", [&] {
    mse_bwd_kernel<<<blocks_for(n), kGridThreads, 0, stream()>>>(ptr<scalar_t>(dpred), ptr<float>(dloss),
                                                                 ptr<scalar_t>(pred), ptr<scalar_t>(target),
                                                                 static_cast<float>(2.0 * scale), n);
  });
  GDNCP_CUDA_CHECK_LAUNCH("mse_bwd_kernel");
}

}  // namespace cuda
}  // namespace gdncp
