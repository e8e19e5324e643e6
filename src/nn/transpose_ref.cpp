// src/nn/transpose_ref.cpp — CPU twin of transpose_last2: a pure copy, so
// bf16 is moved as raw 16-bit words (no rounding).
#include "nn/nn_kernels.h"

namespace gdncp {
namespace cpu {
namespace {

template <typename T>
void swap_last2(T* y, const T* x, int64_t A, int64_t M, int64_t N) {
  for (int64_t a = 0; a < A; ++a) {
    const T* xa = x + a * M * N;
    T* ya = y + a * M * N;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) ya[n * M + m] = xa[m * N + n];
  }
}

}  // namespace

void transpose_last2(Tensor& y, const Tensor& x, int64_t A, int64_t M, int64_t N) {
  switch (x.dtype()) {
    case DType::f64: return swap_last2(y.data_ptr<double>(), x.data_ptr<double>(), A, M, N);
    case DType::f32: return swap_last2(y.data_ptr<float>(), x.data_ptr<float>(), A, M, N);
    case DType::bf16: return swap_last2(y.data_ptr<bf16>(), x.data_ptr<bf16>(), A, M, N);
  }
}

}  // namespace cpu
}  // namespace gdncp
