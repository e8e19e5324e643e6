// src/kernels/dispatch.cpp — gdncp::kernels::X picks the CPU twin or the CUDA
// twin of X by the device of qkv (or of the first input for the scan).
#include "gdncp/error.h"
#include "kernels/kernels.h"

namespace gdncp {

MathMode resolve_math_mode(Precision p, DType qkv_dtype) {
  if (qkv_dtype == DType::f64) return MathMode::ieee;  // the f64 oracle is exact whatever was asked
  switch (p) {
    case Precision::automatic: return qkv_dtype == DType::bf16 ? MathMode::bf16 : MathMode::ieee;
    case Precision::bf16: return MathMode::bf16;
    case Precision::tf32: return MathMode::tf32;
    case Precision::ieee: return MathMode::ieee;
  }
  GDNCP_FAIL("precision: unknown value ", static_cast<int>(p));
}

namespace kernels {
namespace {

bool on_cuda(const Tensor& t, const char* op) {
  GDNCP_CHECK(t.defined(), "kernels::", op, ": input tensor is undefined");
#if !GDNCP_WITH_CUDA
  GDNCP_CHECK(!t.is_cuda(), "kernels::", op, ": got a CUDA tensor, but gdncp was built without CUDA");
#endif
  return t.is_cuda();
}

}  // namespace

#if GDNCP_WITH_CUDA
#define GDNCP_DISPATCH(op, first, ...) \
  do {                                 \
    if (on_cuda(first, #op))           \
      cuda::op(__VA_ARGS__);           \
    else                               \
      cpu::op(__VA_ARGS__);            \
  } while (0)
#else
#define GDNCP_DISPATCH(op, first, ...) \
  do {                                 \
    on_cuda(first, #op);               \
    cpu::op(__VA_ARGS__);              \
  } while (0)
#endif

void rms_stats(Tensor& rstd, const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, const Dims& d,
               double norm_eps) {
  GDNCP_DISPATCH(rms_stats, qkv, rstd, qkv, q_norm_w, k_norm_w, d, norm_eps);
}

void phase_a_fwd(Tensor& P, Tensor& A, Tensor& Pz, Tensor& bz, const Tensor& qkv, const Tensor& rstd,
                 const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta,
                 const Dims& d, double k_scale, MathMode mode) {
  GDNCP_DISPATCH(phase_a_fwd, qkv, P, A, Pz, bz, qkv, rstd, k_norm_w, rope_cos, rope_sin, beta, d, k_scale, mode);
}

void phase_a_bwd(Tensor& dk_hat, Tensor& dqkv, Tensor& dbeta, const Tensor& dP, const Tensor& dA, const Tensor& dPz,
                 const Tensor& dbz, const Tensor& qkv, const Tensor& rstd, const Tensor& k_norm_w,
                 const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta, const Dims& d, double k_scale,
                 MathMode mode) {
  GDNCP_DISPATCH(phase_a_bwd, qkv, dk_hat, dqkv, dbeta, dP, dA, dPz, dbz, qkv, rstd, k_norm_w, rope_cos, rope_sin, beta,
                 d, k_scale, mode);
}

void scan_bidi_fwd(Tensor& Mf, Tensor& Mr, Tensor& Msum, Tensor& zf, Tensor& zr, Tensor& zsum, const Tensor& P,
                   const Tensor& A, const Tensor& Pz, const Tensor& bz, const Tensor& decay, const Tensor& clip_starts,
                   const Dims& d) {
  GDNCP_DISPATCH(scan_bidi_fwd, P, Mf, Mr, Msum, zf, zr, zsum, P, A, Pz, bz, decay, clip_starts, d);
}

void scan_bidi_bwd(Tensor& dP, Tensor& dA, Tensor& dPz, Tensor& dbz, Tensor& ddecay, const Tensor& dMsum,
                   const Tensor& dzsum, const Tensor& P, const Tensor& Pz, const Tensor& decay, const Tensor& Mf,
                   const Tensor& Mr, const Tensor& zf, const Tensor& zr, const Tensor& clip_starts, const Dims& d) {
  GDNCP_DISPATCH(scan_bidi_bwd, P, dP, dA, dPz, dbz, ddecay, dMsum, dzsum, P, Pz, decay, Mf, Mr, zf, zr, clip_starts,
                 d);
}

void phase_c_fwd(Tensor& out, Tensor& den, const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w,
                 const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& M, const Tensor& z, const Dims& d,
                 double eps, bool divide, MathMode mode) {
  GDNCP_DISPATCH(phase_c_fwd, qkv, out, den, qkv, rstd, q_norm_w, rope_cos, rope_sin, M, z, d, eps, divide, mode);
}

void phase_c_bwd(Tensor& dq_hat, Tensor& dM, Tensor& dz, const Tensor& dout, const Tensor& dden, const Tensor& qkv,
                 const Tensor& rstd, const Tensor& q_norm_w, const Tensor& rope_cos, const Tensor& rope_sin,
                 const Tensor& M, const Tensor& z, const Dims& d, double eps, bool divide, MathMode mode) {
  GDNCP_DISPATCH(phase_c_bwd, qkv, dq_hat, dM, dz, dout, dden, qkv, rstd, q_norm_w, rope_cos, rope_sin, M, z, d, eps,
                 divide, mode);
}

void rms_norm_bwd(Tensor& dqkv, Tensor& dq_norm_w, Tensor& dk_norm_w, const Tensor& dq_hat, const Tensor& dk_hat,
                  const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w, const Tensor& k_norm_w,
                  const Dims& d) {
  GDNCP_DISPATCH(rms_norm_bwd, qkv, dqkv, dq_norm_w, dk_norm_w, dq_hat, dk_hat, qkv, rstd, q_norm_w, k_norm_w, d);
}

#undef GDNCP_DISPATCH

}  // namespace kernels
}  // namespace gdncp
