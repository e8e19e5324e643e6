// src/kernels/phase_c/phase_c.cu — CUDA twin of phase C (docs/design.md §5) with the q prep
// (docs/design.md §2: RMSNorm apply, relu, RoPE) fused into the load of qkv in its
// native (B, N, 3, H, D) layout and the output divide fused into the store.
//
// Forward, token s of frame f:  q̂ = q·r·w,  q⁺ = relu(q̂),  qʳ = rope(q⁺)
//   num_s = qʳ_s M_f,  den_s = q⁺_s·z_f,  out_s = num_s / (den_s + eps)  (divide) or num_s (raw)
// Backward:  divide: dnum = dout/(den+eps) and, since dout·num = qʳ·(dnum Mᵀ)(den+eps),
//   dden = −qʳ·dqʳ/(den+eps) with dqʳ = dnum Mᵀ (num is never recomputed); raw: given.
//   dM_f = Σ_s qʳ_sᵀ dnum_s,  dz_f = Σ_s dden_s q⁺_s,  dq⁺ = dden·z_f + unrope(dqʳ),  dq̂ = dq⁺·[q̂ > 0]
// Gradient rule: dq_hat, dM, dz are overwritten.
//
//
// Two codings, one file each: phase_c_bf16.cu (bf16 mode: bf16 tiles read with ldmatrix,
// a persistent forward, a backward split into token parts) and phase_c_f32.cu (tf32 and
// ieee: f32 tiles). The launchers below check the arguments and pick the coding.
#include "kernels/common/cuda_common.cuh"
#include "kernels/phase_c/phase_c_cuda.cuh"

namespace gdncp {
namespace cuda {

using namespace detail;

void phase_c_fwd(Tensor& out, Tensor& den, const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w,
                 const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& M, const Tensor& z, const Dims& d,
                 double eps, bool divide, MathMode mode) {
  phase_c::FwdArgs a;
  a.z = frame_sizes(d, "cuda phase C");
  a.qkv = in_of(qkv, "qkv");
  a.out = out_of(out, "out");
  GDNCP_CHECK(divide || out.dtype() == DType::f32, "cuda phase_c_fwd: raw mode writes num in f32, got ", out.str());
  a.den = f32_out(den, "den");
  a.rstd = f32_or_null(rstd, "rstd"), a.qw = f32_or_null(q_norm_w, "q_norm_w");
  a.cos = f32_or_null(rope_cos, "rope_cos"), a.sin = f32_or_null(rope_sin, "rope_sin");
  a.M = f32_or_null(M, "M"), a.z_f = f32_or_null(z, "z");
  a.eps = static_cast<float>(eps), a.divide = divide;
  if (mode == MathMode::bf16)
    phase_c::fwd_bf16(a);
  else
    phase_c::fwd_f32(a, mode);
}

void phase_c_bwd(Tensor& dq_hat, Tensor& dM, Tensor& dz, const Tensor& dout, const Tensor& dden, const Tensor& qkv,
                 const Tensor& rstd, const Tensor& q_norm_w, const Tensor& rope_cos, const Tensor& rope_sin,
                 const Tensor& M, const Tensor& z, const Dims& d, double eps, bool divide, MathMode mode) {
  phase_c::BwdArgs a;
  a.z = frame_sizes(d, "cuda phase C");
  GDNCP_CHECK(!divide || dout.defined(), "cuda phase_c_bwd: divide mode needs dout");
  a.qkv = in_of(qkv, "qkv"), a.dout = in_of(dout, "dout"), a.dden = in_of(dden, "dden");
  a.dq_hat = out_of(dq_hat, "dq_hat");
  a.dM = f32_out(dM, "dM"), a.dz = f32_out(dz, "dz");
  a.rstd = f32_or_null(rstd, "rstd"), a.qw = f32_or_null(q_norm_w, "q_norm_w");
  a.cos = f32_or_null(rope_cos, "rope_cos"), a.sin = f32_or_null(rope_sin, "rope_sin");
  a.M = f32_or_null(M, "M"), a.z_f = f32_or_null(z, "z");
  a.eps = static_cast<float>(eps), a.divide = divide;
  if (mode == MathMode::bf16)
    phase_c::bwd_bf16(a);
  else
    phase_c::bwd_f32(a, mode);
}

}  // namespace cuda
}  // namespace gdncp
