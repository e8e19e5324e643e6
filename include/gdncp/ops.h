// gdncp/ops.h — the fine-grained differentiable ops of the BiGDN layer
// (docs/design.md §2-5), one node each. bigdn_unfused() composes them; bigdn() runs the
// same math as fused kernels. Shapes and dtypes as in gdncp/bigdn.h; every op
// computes in f32 for bf16/f32 input and in f64 for f64 input, and returns its
// intermediates in that compute dtype. The ops run on the CPU only: an
// undefined or CUDA input, or a shape other than the one documented, throws
// gdncp::Error naming the op and the argument.
#pragma once

#include <cstdint>
#include <vector>

#include "gdncp/tensor.h"

namespace gdncp {
namespace ops {

// Full-channel RMSNorm of the q and k channels of qkv (docs/design.md §2.1):
//   r = 1/sqrt(mean_c x_c² + norm_eps),  x̂ = x·r·w.
// v is copied. An undefined weight leaves that stream unnormalised.
// qkv (B, N, 3, H, D) -> qkv_hat (B, N, 3, H, D), compute dtype.
Tensor rms_norm(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, double norm_eps);

// relu + k_scale + RoPE (docs/design.md §2.2-3) on the q and k channels of qkv_hat:
// returns {q⁺, k⁺, qʳ, kʳ}, each (B, N, H, D) compute dtype.
std::vector<Tensor> relu_rope(const Tensor& qkv_hat, const Tensor& rope_cos, const Tensor& rope_sin, double k_scale);

// Phase A (docs/design.md §3), per frame f of S tokens (N = F·S):
//   P = Σ_s β_s kʳ_s kʳ_sᵀ,  A = Σ_s β_s kʳ_s v_sᵀ,  Pz = Σ_s β_s k⁺_s k⁺_sᵀ,  b = Σ_s β_s k⁺_s.
// kr, kp (B, N, H, D); v is channel 2 of qkv_hat; beta (B, H, F, S).
// Returns {P, A, Pz, b}: (B·H, F, D, D) ×3 and (B·H, F, D).
std::vector<Tensor> phase_a(const Tensor& kr, const Tensor& kp, const Tensor& qkv_hat, const Tensor& beta, int64_t F,
                            int64_t S);

// Bidirectional frame scan (docs/design.md §4) with T_f = g_f (I − P_f):
//   M_f = T_f M_{f−1} + A_f (causal),  M̃_f = T_{f+1} M̃_{f+1} + A_{f+1} (strictly later; z likewise with Pz, b).
// P, A, Pz (B·H, F, D, D), b (B·H, F, D), decay g (B, H, F).
// clip_starts (B, F) f32, or undefined (one clip per row): at a frame f > 0 with a nonzero entry
// T_f is cut in both directions, M_f = A_f and M̃_{f−1} = 0 (docs/design.md §4a); it gets no gradient.
// Returns {M + M̃ (B·H, F, D, D), z + z̃ (B·H, F, D)}.
std::vector<Tensor> bidi_scan(const Tensor& P, const Tensor& A, const Tensor& Pz, const Tensor& b, const Tensor& decay,
                              const Tensor& clip_starts = Tensor());

// Phase C (docs/design.md §5): num (B, N, H, D) = qʳ M per token, den (B, H, N) = q⁺·z.
std::vector<Tensor> phase_c(const Tensor& qr, const Tensor& qp, const Tensor& M, const Tensor& z, int64_t F, int64_t S);

// out = num / (den + eps), den (B, H, N) broadcast over D; out in out_dtype.
Tensor output_divide(const Tensor& num, const Tensor& den, double eps, DType out_dtype);

}  // namespace ops
}  // namespace gdncp
