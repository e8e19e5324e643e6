// src/nn/matmul.cu — CUDA twin of the row-major GEMM behind nn::matmul,
// through cuBLAS on the current stream.
//
// Note [row-major through cuBLAS]: a row-major (r, c) buffer is the
// column-major (c, r) matrix, its transpose. So c = op(a)·op(b) in row-major is
// cᵀ = op(b)ᵀ·op(a)ᵀ in column-major, which is one cublasGemmEx with the
// operands swapped and m = N, n = M.
//
// f32 runs in IEEE f32 (CUBLAS_COMPUTE_32F, no TF32); bf16 operands accumulate
// in f32 and the result is rounded to bf16. cuBLAS gives bitwise-identical
// results run to run on one device and stream.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <unordered_map>

#include "kernels/common/cublas_handle.h"
#include "kernels/common/cuda_common.cuh"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace cuda {

// One handle per (thread, device): cuBLAS handles are not meant to be shared
// between threads, and a handle belongs to the device current at creation.
cublasHandle_t cublas_handle() {
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  int dev = 0;
  GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
  auto it = handles.find(dev);
  cublasHandle_t h = nullptr;
  if (it != handles.end()) {
    h = it->second;
  } else {
    GDNCP_CUBLAS_CHECK(cublasCreate(&h));
    GDNCP_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
    handles.emplace(dev, h);
  }
  // No workspace of our own: cublasSetStream puts the handle back on cuBLAS's
  // default workspace pool (a workspace set by hand would not outlive this
  // line), so that pool is what every call uses; captured graphs replay with it
  // (tests/test_capture.cpp).
  GDNCP_CUBLAS_CHECK(cublasSetStream(h, detail::stream()));
  return h;
}

void gemm(Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K) {
  GDNCP_CHECK(c.dtype() == DType::f32 || c.dtype() == DType::bf16, "matmul: CUDA supports f32 and bf16, got ",
              dtype_name(c.dtype()));
  GDNCP_CHECK(M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX, "matmul: sizes M=", M, " N=", N, " K=", K,
              " exceed cuBLAS's 32-bit limit");
  cublasHandle_t h = cublas_handle();
  const cudaDataType_t t = c.dtype() == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major: cᵀ (N, M) = op(b)ᵀ (N, K) · op(a)ᵀ (K, M); see Note [row-major through cuBLAS].
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int ldb = static_cast<int>(trans_b ? K : N);
  const int lda = static_cast<int>(trans_a ? M : K);
  GDNCP_CUBLAS_CHECK(cublasGemmEx(h, op_b, op_a, static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &alpha,
                                  b.data(), t, ldb, a.data(), t, lda, &beta, c.data(), t, static_cast<int>(N),
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace cuda
}  // namespace gdncp
