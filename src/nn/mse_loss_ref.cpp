// src/nn/mse_loss_ref.cpp — CPU twin of mse_loss (forward and backward).
// The sum of squares runs left to right in f64 whatever the data dtype
// (reproducible, and no f32 drift over long tensors).
#include "nn/nn_kernels.h"

namespace gdncp {
namespace cpu {
namespace {

template <typename T>
double sum_sq_diff(const T* p, const T* t, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(p[i]) - static_cast<double>(t[i]);
    s += d * d;
  }
  return s;
}

template <typename T>
void scaled_diff(T* dp, const T* p, const T* t, T factor, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dp[i] = factor * (p[i] - t[i]);
}

}  // namespace

void mse_fwd(Tensor& loss, const Tensor& pred, const Tensor& target, double scale) {
  if (pred.dtype() == DType::f64) {
    loss.data_ptr<double>()[0] = scale * sum_sq_diff(pred.data_ptr<double>(), target.data_ptr<double>(), pred.numel());
    return;
  }
  const Tensor p32 = as_f32(pred), t32 = as_f32(target);
  loss.data_ptr<float>()[0] =
      static_cast<float>(scale * sum_sq_diff(p32.data_ptr<float>(), t32.data_ptr<float>(), pred.numel()));
}

void mse_bwd(Tensor& dpred, const Tensor& dloss, const Tensor& pred, const Tensor& target, double scale) {
  if (pred.dtype() == DType::f64) {
    const double factor = 2.0 * scale * dloss.data_ptr<double>()[0];
    return scaled_diff(dpred.data_ptr<double>(), pred.data_ptr<double>(), target.data_ptr<double>(), factor,
                       pred.numel());
  }
  const float factor = static_cast<float>(2.0 * scale) * dloss.data_ptr<float>()[0];
  const Tensor p32 = as_f32(pred), t32 = as_f32(target);
  Tensor dp32 = f32_out(dpred);
  scaled_diff(dp32.data_ptr<float>(), p32.data_ptr<float>(), t32.data_ptr<float>(), factor, pred.numel());
  store_out(dpred, dp32);
}

}  // namespace cpu
}  // namespace gdncp
