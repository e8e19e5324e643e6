// src/kernels/phase_a/phase_a.cu — CUDA twin of phase A (docs/design.md §3) with the k prep
// (docs/design.md §2: RMSNorm apply, relu, k_scale, RoPE) fused into the load of qkv in
// its native (B, N, 3, H, D) layout.
//
// Forward, per (b, h, frame f), the frame's S tokens as rows:
//   k̂ = k·r·w,  k⁺ = relu(k̂)·k_scale,  kʳ = rope(k⁺)
//   P_f = kʳᵀ diag(β) kʳ,  A_f = kʳᵀ diag(β) v,  Pz_f = k⁺ᵀ diag(β) k⁺,  b_f = k⁺ᵀ β
// Backward, per token s (Ps = dP + dPᵀ, Pzs = dPz + dPzᵀ):
//   dkʳ = β (kʳ Ps + v dAᵀ),  dv = β kʳ dA,  dk⁺ = β (k⁺ Pzs + db) + unrope(dkʳ),
//   dβ = kʳ·(½ kʳ Ps + v dAᵀ) + k⁺·(½ k⁺ Pzs + db),  dk̂ = dk⁺·k_scale·[k̂ > 0]
// (row-vector form of phase_a_ref.cpp; kʳ dA vᵀ = kʳ·(v dAᵀ)).
// Gradient rule: dk_hat, the v channel of dqkv and dbeta are overwritten.
//
// Two codings, one file each: phase_a_f32.cu (f32 tiles, every matrix-unit mode) and
// phase_a_bf16.cu (bf16 mode, bf16 qkv, D % 8 == 0, D > 32: a prep pass and cuBLAS
// forward, a staged ldmatrix backward). The launchers below check the arguments and pick
// the coding.
#include "kernels/common/cuda_common.cuh"
#include "kernels/phase_a/phase_a_cuda.cuh"

namespace gdncp {
namespace cuda {

using namespace detail;

void phase_a_fwd(Tensor& P, Tensor& A, Tensor& Pz, Tensor& bz, const Tensor& qkv, const Tensor& rstd,
                 const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta,
                 const Dims& d, double k_scale, MathMode mode) {
  phase_a::FwdArgs a;
  a.z = frame_sizes(d, "cuda phase A");
  a.qkv = in_of(qkv, "qkv"), a.beta = in_of(beta, "beta");
  a.P = f32_out(P, "P"), a.A = f32_out(A, "A"), a.Pz = f32_out(Pz, "Pz"), a.bz = f32_out(bz, "bz");
  a.rstd = f32_or_null(rstd, "rstd"), a.kw = f32_or_null(k_norm_w, "k_norm_w");
  a.cos = f32_or_null(rope_cos, "rope_cos"), a.sin = f32_or_null(rope_sin, "rope_sin");
  a.k_scale = static_cast<float>(k_scale);
  if (phase_a::bf16_coding(mode, d.D, qkv.dtype()))
    phase_a::fwd_bf16(a);
  else
    phase_a::fwd_f32(a, mode);
}

void phase_a_bwd(Tensor& dk_hat, Tensor& dqkv, Tensor& dbeta, const Tensor& dP, const Tensor& dA, const Tensor& dPz,
                 const Tensor& dbz, const Tensor& qkv, const Tensor& rstd, const Tensor& k_norm_w,
                 const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta, const Dims& d, double k_scale,
                 MathMode mode) {
  phase_a::BwdArgs a;
  a.z = frame_sizes(d, "cuda phase A");
  a.qkv = in_of(qkv, "qkv"), a.beta = in_of(beta, "beta");
  a.dqkv = out_of(dqkv, "dqkv"), a.dbeta = out_of(dbeta, "dbeta");
  a.dk_hat = out_of(dk_hat, "dk_hat");
  a.dP = f32_or_null(dP, "dP"), a.dA = f32_or_null(dA, "dA"), a.dPz = f32_or_null(dPz, "dPz");
  a.dbz = f32_or_null(dbz, "dbz");
  a.rstd = f32_or_null(rstd, "rstd"), a.kw = f32_or_null(k_norm_w, "k_norm_w");
  a.cos = f32_or_null(rope_cos, "rope_cos"), a.sin = f32_or_null(rope_sin, "rope_sin");
  a.k_scale = static_cast<float>(k_scale);
  if (phase_a::bf16_coding(mode, d.D, qkv.dtype()))
    phase_a::bwd_bf16(a);
  else
    phase_a::bwd_f32(a, mode);
}

}  // namespace cuda
}  // namespace gdncp
