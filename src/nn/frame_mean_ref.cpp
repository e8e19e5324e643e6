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

// Runs rows(out, in) on out's and in's data: as they are when f64 is true,
// otherwise on f32 copies (as_f32 / f32_out) with the result stored back into out.
template <typename Rows>
void run_rows(bool f64, Tensor& out, const Tensor& in, Rows&& rows) {
  if (f64) return rows(out.data_ptr<double>(), in.data_ptr<double>());
  const Tensor in32 = as_f32(in);
  Tensor out32 = f32_out(out);
  rows(out32.data_ptr<float>(), in32.data_ptr<float>());
  store_out(out, out32);
}

}  // namespace

void frame_mean_fwd(Tensor& y, const Tensor& x, int64_t R, int64_t S) {
  run_rows(x.dtype() == DType::f64, y, x, [&](auto* yp, const auto* xp) { mean_rows(yp, xp, R, S); });
}

void frame_mean_bwd(Tensor& dx, const Tensor& dy, int64_t R, int64_t S) {
  run_rows(dx.dtype() == DType::f64, dx, dy, [&](auto* dxp, const auto* dyp) { spread_rows(dxp, dyp, R, S); });
}

}  // namespace cpu
}  // namespace gdncp
