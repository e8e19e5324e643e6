// src/nn/frame_mean_ref.cpp — CPU twin of frame_mean (forward and backward).
// Rows are summed left to right (bitwise reproducible), then divided by S.
#include "nn/nn_kernels.h"

namespace gdncp {
namespace cpu {
namespace {

template <typename T>
void mean_rows(T* y, const T* x, int64_t R, int64_t S) {
  for (int64_t r = 0; r < R; ++r) {
    T s = 0;
    for (int64_t j = 0; j < S; ++j) s += x[r * S + j];
    y[r] = s / static_cast<T>(S);
  }
}

template <typename T>
void spread_rows(T* dx, const T* dy, int64_t R, int64_t S) {
  for (int64_t r = 0; r < R; ++r) {
    const T g = dy[r] / static_cast<T>(S);
    for (int64_t j = 0; j < S; ++j) dx[r * S + j] = g;
  }
}

}  // namespace

void frame_mean_fwd(Tensor& y, const Tensor& x, int64_t R, int64_t S) {
  if (x.dtype() == DType::f64) return mean_rows(y.data_ptr<double>(), x.data_ptr<double>(), R, S);
  const Tensor x32 = as_f32(x);
  Tensor y32 = f32_out(y);
  mean_rows(y32.data_ptr<float>(), x32.data_ptr<float>(), R, S);
  store_out(y, y32);
}

void frame_mean_bwd(Tensor& dx, const Tensor& dy, int64_t R, int64_t S) {
  if (dx.dtype() == DType::f64) return spread_rows(dx.data_ptr<double>(), dy.data_ptr<double>(), R, S);
  const Tensor dy32 = as_f32(dy);
  Tensor dx32 = f32_out(dx);
  spread_rows(dx32.data_ptr<float>(), dy32.data_ptr<float>(), R, S);
  store_out(dx, dx32);
}

}  // namespace cpu
}  // namespace gdncp
