// src/nn/sigmoid_ref.cpp — CPU twin of sigmoid (forward and backward).
#include <cmath>

#include "nn/nn_kernels.h"

namespace gdncp {
namespace cpu {
namespace {

template <typename T>
void sigmoid_loop(T* y, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = T(1) / (T(1) + std::exp(-x[i]));
}

template <typename T>
void sigmoid_bwd_loop(T* dx, const T* dy, const T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * y[i] * (T(1) - y[i]);
}

}  // namespace

void sigmoid_fwd(Tensor& y, const Tensor& x) {
  if (x.dtype() == DType::f64) return sigmoid_loop(y.data_ptr<double>(), x.data_ptr<double>(), x.numel());
  const Tensor x32 = as_f32(x);
  Tensor y32 = f32_out(y);
  sigmoid_loop(y32.data_ptr<float>(), x32.data_ptr<float>(), x.numel());
  store_out(y, y32);
}

void sigmoid_bwd(Tensor& dx, const Tensor& dy, const Tensor& y) {
  if (y.dtype() == DType::f64)
    return sigmoid_bwd_loop(dx.data_ptr<double>(), dy.data_ptr<double>(), y.data_ptr<double>(), y.numel());
  const Tensor dy32 = as_f32(dy), y32 = as_f32(y);
  Tensor dx32 = f32_out(dx);
  sigmoid_bwd_loop(dx32.data_ptr<float>(), dy32.data_ptr<float>(), y32.data_ptr<float>(), y.numel());
  store_out(dx, dx32);
}

}  // namespace cpu
}  // namespace gdncp
