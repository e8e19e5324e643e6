// src/nn/nn_kernels.h — kernel twins of the generic ops of gdncp/nn.h and
// gdncp/optim.h.
//
// Each function exists in namespace gdncp::cpu (src/kernels/<op>_ref.cpp,
// templated on float and double, bf16 read and written through f32) and in
// gdncp::cuda (src/kernels/<op>.cu: float and bf16; f64 is CPU-only). The
// public ops validate and pick a twin with GDNCP_NN_TWIN. Conventions as in
// kernels.h: outputs first, preallocated, OVERWRITTEN entirely; CUDA twins run
// on current_stream() and never synchronise.
#pragma once

#include <cstdint>

#include "gdncp/error.h"
#include "gdncp/tensor.h"
#include "kernels/kernels.h"  // compute_dtype

namespace gdncp {

// Scalars of one AdamW update (bias corrections precomputed on the host).
struct AdamWStep {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  double bias_corr1 = 1, bias_corr2 = 1;  // 1 − β1ᵗ, 1 − β2ᵗ
  double grad_scale = 1;
};

#define GDNCP_NN_TWINS(NS)                                                                                             \
  namespace NS {                                                                                                       \
  /* c (M, N) = op(a) · op(b), row-major; op(a) (M, K) is a (M, K) or, with trans_a, aᵀ of a (K, M);                \
     op(b) (K, N) is b (K, N) or, with trans_b, bᵀ of b (N, K). One dtype for all three. */                          \
  void gemm(Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K); \
  /* y = sigmoid(x); dx = dy·y·(1 − y). Same shape and dtype. */                                                   \
  void sigmoid_fwd(Tensor& y, const Tensor& x);                                                                        \
  void sigmoid_bwd(Tensor& dx, const Tensor& dy, const Tensor& y);                                                     \
  /* y (R) = mean of each row of x (R, S); dx (R, S) = dy (R) / S broadcast over the row. */                           \
  void frame_mean_fwd(Tensor& y, const Tensor& x, int64_t R, int64_t S);                                               \
  void frame_mean_bwd(Tensor& dx, const Tensor& dy, int64_t R, int64_t S);                                             \
  /* y (A, N, M) = x (A, M, N) with the last two axes swapped. */                                                      \
  void transpose_last2(Tensor& y, const Tensor& x, int64_t A, int64_t M, int64_t N);                                   \
  /* loss (1), compute dtype = scale · Σ (pred − target)², summed in a fixed order. */                            \
  void mse_fwd(Tensor& loss, const Tensor& pred, const Tensor& target, double scale);                                  \
  /* dpred = 2·scale·(pred − target)·dloss[0] in pred's dtype; dloss (1) compute dtype, read on the device. */    \
  void mse_bwd(Tensor& dpred, const Tensor& dloss, const Tensor& pred, const Tensor& target, double scale);            \
  /* One AdamW update in place of p, m, v (same shape and dtype) from the gradient g. */                               \
  void adamw_step(Tensor& p, Tensor& m, Tensor& v, const Tensor& g, const AdamWStep& s);                               \
  }

GDNCP_NN_TWINS(cpu)
GDNCP_NN_TWINS(cuda)

#undef GDNCP_NN_TWINS

namespace detail {
[[noreturn]] inline void no_cuda_build(const char* op) {
  GDNCP_FAIL(op, ": the tensors are on CUDA but gdncp was built without CUDA");
}

// The argument checks every nn op starts with: defined, a float dtype the
// device supports (f64 is CPU-only).
inline void check_nn_input(const char* op, const char* arg, const Tensor& t) {
  GDNCP_CHECK(t.defined(), op, ": ", arg, " is undefined");
  GDNCP_CHECK(!(t.dtype() == DType::f64 && t.is_cuda()), op, ": ", arg, " is f64 on CUDA; f64 is CPU-only");
}
}  // namespace detail

namespace cpu {
// bf16 data is computed in f32: as_f32 widens an input (no copy for f32),
// f32_out gives the f32 buffer an output is computed into, store_out rounds
// it into the real output (nothing to do for f32).
inline Tensor as_f32(const Tensor& t) { return t.dtype() == DType::f32 ? t : t.to(DType::f32); }
inline Tensor f32_out(Tensor& out) { return out.dtype() == DType::f32 ? out : Tensor::empty(out.shape(), DType::f32); }
inline void store_out(Tensor& out, const Tensor& out32) {
  if (!out.same_as(out32)) out.copy_from(out32.to(out.dtype()));
}
}  // namespace cpu

// GDNCP_NN_TWIN(device, fn, args...) calls cpu::fn or cuda::fn by device.
#if GDNCP_WITH_CUDA
#define GDNCP_NN_TWIN(device, fn, ...) \
  ((device) == ::gdncp::Device::cuda ? ::gdncp::cuda::fn(__VA_ARGS__) : ::gdncp::cpu::fn(__VA_ARGS__))
#else
#define GDNCP_NN_TWIN(device, fn, ...) \
  ((device) == ::gdncp::Device::cuda ? ::gdncp::detail::no_cuda_build(#fn) : ::gdncp::cpu::fn(__VA_ARGS__))
#endif

}  // namespace gdncp
