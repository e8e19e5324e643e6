// src/nn/adamw.cu — CUDA twin of one AdamW update (f32, in place on p, m, v).
// Gradient rule: the parameter and both moments are updated in place; g is read.
#include "kernels/common/cuda_common.cuh"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

__global__ void adamw_kernel(float* p, float* m, float* v, const float* g, float lr, float decay, float b1, float b2,
                             float eps, float bc1, float bc2, float gs, int64_t n) {
  GDNCP_GRID_STRIDE(i, n) {
    const float gi = gs * g[i];
    float pi = p[i] - decay * p[i];
    const float mi = b1 * m[i] + (1.0f - b1) * gi;
    const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    pi -= lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
    p[i] = pi;
  }
}

}  // namespace

void adamw_step(Tensor& p, Tensor& m, Tensor& v, const Tensor& g, const AdamWStep& s) {
  GDNCP_CHECK(p.dtype() == DType::f32, "AdamW: CUDA parameters must be f32, got ", p.str());
  const int64_t n = p.numel();
  if (n == 0) return;
  adamw_kernel<<<blocks_for(n), kGridThreads, 0, stream()>>>(
      ptr<float>(p), ptr<float>(m), ptr<float>(v), ptr<float>(g), static_cast<float>(s.lr),
      static_cast<float>(s.lr * s.weight_decay), static_cast<float>(s.beta1), static_cast<float>(s.beta2),
      static_cast<float>(s.eps), static_cast<float>(s.bias_corr1), static_cast<float>(s.bias_corr2),
      static_cast<float>(s.grad_scale), n);
  GDNCP_CUDA_CHECK_LAUNCH("adamw_kernel");
}

}  // namespace cuda
}  // namespace gdncp
