// src/nn/matmul_ref.cpp — CPU twin of the row-major GEMM behind nn::matmul.
//
// c (M, N) = op(a) (M, K) · op(b) (K, N), overwritten. Loops in a fixed order
// (bitwise reproducible), accumulating in the storage type (f32 for f32 and
// bf16 data, f64 for f64). bf16 operands are widened to f32 first and the
// result rounded once.
#include <vector>

#include "nn/nn_kernels.h"

namespace gdncp {
namespace cpu {
namespace {

template <typename T>
void gemm_loops(T* c, const T* a, const T* b, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K) {
  auto A = [&](int64_t i, int64_t k) { return trans_a ? a[k * M + i] : a[i * K + k]; };
  if (trans_b) {
    // Row j of b is column j of op(b): a dot product per output.
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        T s = 0;
        const T* bj = b + j * K;
        for (int64_t k = 0; k < K; ++k) s += A(i, k) * bj[k];
        c[i * N + j] = s;
      }
    return;
  }
  // i-k-j order: the inner loop streams a row of b into a row of c.
  for (int64_t i = 0; i < M; ++i) {
    T* ci = c + i * N;
    for (int64_t j = 0; j < N; ++j) ci[j] = 0;
    for (int64_t k = 0; k < K; ++k) {
      const T aik = A(i, k);
      const T* bk = b + k * N;
      for (int64_t j = 0; j < N; ++j) ci[j] += aik * bk[j];
    }
  }
}

}  // namespace

void gemm(Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K) {
  switch (c.dtype()) {
    case DType::f64:
      gemm_loops(c.data_ptr<double>(), a.data_ptr<double>(), b.data_ptr<double>(), trans_a, trans_b, M, N, K);
      break;
    case DType::f32:
      gemm_loops(c.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), trans_a, trans_b, M, N, K);
      break;
    case DType::bf16: {
      const Tensor a32 = a.to(DType::f32), b32 = b.to(DType::f32);
      Tensor c32 = Tensor::empty(c.shape(), DType::f32);
      gemm_loops(c32.data_ptr<float>(), a32.data_ptr<float>(), b32.data_ptr<float>(), trans_a, trans_b, M, N, K);
      c.copy_from(c32.to(DType::bf16));
      break;
    }
  }
}

}  // namespace cpu
}  // namespace gdncp
