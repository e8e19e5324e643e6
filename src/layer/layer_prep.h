// src/layer/layer_prep.h — the Prep stage of the layer (docs/design.md §2-3) over the
// kernel twins (kernels.h), shared by the single-rank layer (bigdn.cpp) and
// the CP layers (cp_layers.cpp), which differ only in the scan between Prep
// and Output.
//
//   forward:  rms_stats → phase_a_fwd (k prep fused)
//   backward: rms_norm_bwd of q (its dq̂ comes from phase C's backward), then
//             phase_a_bwd → rms_norm_bwd of k
// Shapes and dtypes as kernels.h says; every result is a fresh tensor on qkv's
// device.
#pragma once

#include "gdncp/bigdn.h"
#include "gdncp/tensor.h"
#include "kernels/kernels.h"

namespace gdncp {

struct Prep {
  Tensor rstd;      // (B, N, 2) compute dtype
  Tensor P, A, Pz;  // (BH, F, D, D) compute dtype
  Tensor bz;        // (BH, F, D) compute dtype
};

Prep prep_forward(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& rope_cos,
                  const Tensor& rope_sin, const Tensor& beta, const Dims& d, const BigdnOptions& opt, MathMode mode);

struct PrepGrads {
  Tensor dqkv;                  // qkv's shape and dtype
  Tensor dbeta;                 // beta's shape and dtype
  Tensor dq_norm_w, dk_norm_w;  // the weight's dtype; undefined unless asked for and the weight is defined
  // per_frame (the deterministic mode): instead of those sums, their terms per
  // frame (F, C) compute dtype (norm_w_frames.h), for a sum in global frame order.
  bool per_frame = false;
  Tensor dq_norm_w_frames, dk_norm_w_frames;
};

// Backward of Prep, in two steps so that dq̂ and dk̂ are never alive together (they
// and dqkv make the peak of the layer's backward):
//  - prep_backward_q, as soon as phase C's backward has made dq_hat = dL/dq̂
//    (B, N, H, D) in grad_hat_dtype(mode): allocates the gradients and runs q's
//    RMSNorm backward (channel 0 of dqkv, dq_norm_w); the caller drops dq_hat then;
//  - prep_backward_k, given the gradients of P, A, Pz, bz: phase A's backward (the v
//    channel, dbeta, dL/dk̂ in the same dtype as dq̂) and k's RMSNorm backward.
// want_dq_norm_w / want_dk_norm_w: whether the caller needs that weight's gradient.
PrepGrads prep_backward_q(const Tensor& dq_hat, const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w,
                          const Tensor& k_norm_w, const Tensor& beta, const Dims& d, bool want_dq_norm_w,
                          bool want_dk_norm_w, bool per_frame = false);
void prep_backward_k(PrepGrads& g, const Tensor& dP, const Tensor& dA, const Tensor& dPz, const Tensor& dbz,
                     const Tensor& qkv, const Tensor& rstd, const Tensor& k_norm_w, const Tensor& rope_cos,
                     const Tensor& rope_sin, const Tensor& beta, const Dims& d, double k_scale, MathMode mode);

}  // namespace gdncp
