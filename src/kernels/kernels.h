// src/kernels/kernels.h — the kernel twins of the fused BiGDN layer.
//
// Each function below exists twice with the same signature: in namespace
// gdncp::cpu (src/kernels/<op>_ref.cpp, the reference, templated on float and
// double) and in namespace gdncp::cuda (src/kernels/<op>.cu). The dispatchers
// in namespace gdncp::kernels pick one by the tensors' device. The same tests
// run against both.
//
// Conventions
//  - Argument order: outputs, inputs, sizes/scalars. CUDA twins run on
//    gdncp::current_stream() and never synchronise the device.
//  - Outputs are preallocated by the caller with the documented shape and
//    dtype and are OVERWRITTEN entirely (tests poison them first).
//  - "compute dtype" = f64 when qkv is f64, else f32. State-like tensors
//    (P, A, Pz, bz, M, z, rstd, gradients of intermediates) are in it.
//  - "hat-grad dtype": dq_hat and dk_hat (dL/dq̂, dL/dk̂) may be the compute
//    dtype or bf16; the twins accept either (written rounded to nearest even,
//    read as stored). The layers pick grad_hat_dtype(): bf16 in bf16 math
//    mode, whose bf16 operands leave f32 storage no more accuracy, and whose
//    backward then moves half the bytes.
//  - Dims: B, H, D, F, S; N = F·S; BH = B·H; C = H·D. M is indexed
//    [key dim][value dim]; P, A, M of (bh, f) start at ((bh·F)+f)·D·D.
//  - An undefined norm weight means "this stream is not normalised": the
//    kernel treats r = 1 and w = 1 for it (rstd still holds 1 there).
//  - Validation of user input happens in the public entries, not here; the
//    twins assume consistent shapes (they check only what is cheap).
#pragma once

#include <cstdint>

#include "gdncp/bigdn.h"
#include "gdncp/tensor.h"

namespace gdncp {

struct Dims {
  int64_t B = 0, H = 0, D = 0, F = 0, S = 0;
  int64_t N() const { return F * S; }
  int64_t BH() const { return B * H; }
  int64_t C() const { return H * D; }
};

// The compute dtype of the conventions above: f64 for f64 data, else f32.
inline DType compute_dtype(DType dtype) { return dtype == DType::f64 ? DType::f64 : DType::f32; }

// Resolved matrix-unit mode for one call (Precision::automatic resolved by the caller).
enum class MathMode { bf16, tf32, ieee };
MathMode resolve_math_mode(Precision p, DType qkv_dtype);

// The dtype the layers give dq_hat / dk_hat: bf16 in bf16 math mode, else the compute dtype.
inline DType grad_hat_dtype(MathMode mode, DType qkv_dtype) {
  return mode == MathMode::bf16 ? DType::bf16 : compute_dtype(qkv_dtype);
}

#define GDNCP_KERNEL_TWINS(NS)                                                                                              \
  namespace NS {                                                                                                            \
  /* rstd (B, N, 2) compute dtype: [..,0] = 1/sqrt(mean_c q_c² + eps) over all C channels, [..,1] the same for k;          \
     1 for a stream whose weight is undefined. */                                                                           \
  void rms_stats(Tensor& rstd, const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, const Dims& d,            \
                 double norm_eps);                                                                                          \
                                                                                                                            \
  /* Phase A with the k prep fused into the load: k̂ = k·r·w, k⁺ = relu(k̂)·k_scale, kʳ = rope(k⁺).               \
     P, A, Pz (BH, F, D, D), bz (BH, F, D), compute dtype. beta (B, H, F, S) any float dtype. */                            \
  void phase_a_fwd(Tensor& P, Tensor& A, Tensor& Pz, Tensor& bz, const Tensor& qkv, const Tensor& rstd,                     \
                   const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta,              \
                   const Dims& d, double k_scale, MathMode mode);                                                           \
                                                                                                                            \
  /* Backward of phase_a_fwd. Overwrites dk_hat (B, N, H, D) hat-grad dtype = dL/dk̂ (both streams, through the            \
     rope, the relu mask and k_scale), the v channel (2) of dqkv (B, N, 3, H, D, qkv dtype; channels 0 and 1                \
     untouched) and dbeta (B, H, F, S, beta dtype). dP, dA, dPz (BH, F, D, D), dbz (BH, F, D) compute dtype. */             \
  void phase_a_bwd(Tensor& dk_hat, Tensor& dqkv, Tensor& dbeta, const Tensor& dP, const Tensor& dA, const Tensor& dPz,      \
                   const Tensor& dbz, const Tensor& qkv, const Tensor& rstd, const Tensor& k_norm_w,                        \
                   const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta, const Dims& d, double k_scale,       \
                   MathMode mode);                                                                                          \
                                                                                                                            \
  /* Bidirectional scan (docs/design.md §4). Overwrites Mf (forward inclusive states), Mr (reverse, strictly later),       \
     Msum = Mf + Mr, all (BH, F, D, D); zf, zr, zsum (BH, F, D). decay (B, H, F) any float dtype.                           \
     clip_starts (B, F) f32 on the data's device, or undefined (one clip per row): at a frame f > 0 with                    \
     clip_starts[b, f] != 0 the transition from f − 1 is cut (§4a): Mf_f = A_f, Mr_{f−1} = 0, z likewise. */           \
  void scan_bidi_fwd(Tensor& Mf, Tensor& Mr, Tensor& Msum, Tensor& zf, Tensor& zr, Tensor& zsum, const Tensor& P,           \
                     const Tensor& A, const Tensor& Pz, const Tensor& bz, const Tensor& decay,                              \
                     const Tensor& clip_starts, const Dims& d);                                                             \
                                                                                                                            \
  /* Backward of scan_bidi_fwd given dMsum, dzsum (the same clip_starts). Overwrites dP, dA, dPz (BH, F, D, D),             \
     dbz (BH, F, D) and ddecay (B, H, F, decay dtype); a cut frame's dP, dPz and ddecay are 0. */                           \
  void scan_bidi_bwd(Tensor& dP, Tensor& dA, Tensor& dPz, Tensor& dbz, Tensor& ddecay, const Tensor& dMsum,                 \
                     const Tensor& dzsum, const Tensor& P, const Tensor& Pz, const Tensor& decay, const Tensor& Mf,         \
                     const Tensor& Mr, const Tensor& zf, const Tensor& zr, const Tensor& clip_starts, const Dims& d);       \
                                                                                                                            \
  /* Phase C with the q prep fused into the load (q̂ = q·r·w, q⁺ = relu(q̂), qʳ = rope(q⁺)); rope_cos/rope_sin are \
     the tables q is rotated with (the layer's q tables when given, else its k tables).                                     \
     num_s = qʳ_s M_f, den_s = q⁺_s·z_f. M (BH, F, D, D), z (BH, F, D) compute dtype.                                   \
     divide: out (B, N, H, D) = num/(den+eps) in out's dtype (qkv dtype or compute dtype);                                  \
     raw:    out = num (B, N, H, D) compute dtype.  den (B, H, N) compute dtype is written in both modes. */                \
  void phase_c_fwd(Tensor& out, Tensor& den, const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w,                 \
                   const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& M, const Tensor& z, const Dims& d,         \
                   double eps, bool divide, MathMode mode);                                                                 \
                                                                                                                            \
  /* Backward of phase_c_fwd. divide: dout = dL/dout (B, N, H, D, any float dtype), dden undefined (den is                  \
     recomputed). raw: dout = dL/dnum, dden = dL/dden (B, H, N) (either may be undefined = zeros).                          \
     Overwrites dq_hat (B, N, H, D) hat-grad dtype = dL/dq̂, dM (BH, F, D, D) and dz (BH, F, D). */                        \
  void phase_c_bwd(Tensor& dq_hat, Tensor& dM, Tensor& dz, const Tensor& dout, const Tensor& dden, const Tensor& qkv,       \
                   const Tensor& rstd, const Tensor& q_norm_w, const Tensor& rope_cos, const Tensor& rope_sin,              \
                   const Tensor& M, const Tensor& z, const Dims& d, double eps, bool divide, MathMode mode);                \
                                                                                                                            \
  /* RMSNorm backward for q and k given dq_hat, dk_hat (B, N, H, D) hat-grad dtype: overwrites channels 0 and 1 of          \
     dqkv (qkv dtype; channel 2 untouched) and, when defined, dq_norm_w / dk_norm_w (C) in the weight dtype.                \
     With x the raw channel, r its rstd:                                                                                    \
       dx = r·w·dx̂ − (r³/C)·x·Σ_c w_c dx̂_c x_c,   dw_c = Σ_tokens dx̂_c·x_c·r.                              \
     Reductions run in a fixed order (bitwise reproducible). One of dq_hat, dk_hat may be undefined: that stream's          \
     channel of dqkv and its weight gradient are left untouched (the layer runs q's as soon as phase C's backward           \
     has made dq_hat, so that dq_hat and dk_hat are never alive together). */                                               \
  void rms_norm_bwd(Tensor& dqkv, Tensor& dq_norm_w, Tensor& dk_norm_w, const Tensor& dq_hat, const Tensor& dk_hat,         \
                    const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w, const Tensor& k_norm_w,                  \
                    const Dims& d);                                                                                         \
  }

GDNCP_KERNEL_TWINS(cpu)
GDNCP_KERNEL_TWINS(cuda)
GDNCP_KERNEL_TWINS(kernels)  // dispatchers: pick cpu:: or cuda:: by qkv's device

#undef GDNCP_KERNEL_TWINS

}  // namespace gdncp
