// src/layer/layer_prep.cpp — the Prep stage of the layer (layer_prep.h).
#include "layer/layer_prep.h"

#include "kernels/prep/norm_w_frames.h"

namespace gdncp {

Prep prep_forward(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& rope_cos,
                  const Tensor& rope_sin, const Tensor& beta, const Dims& d, const BigdnOptions& opt, MathMode mode) {
  const Device dev = qkv.device();
  const DType ct = compute_dtype(qkv.dtype());
  const int64_t BH = d.BH(), F = d.F, D = d.D;
  Prep p;
  p.rstd = Tensor::empty({d.B, d.N(), 2}, ct, dev);
  kernels::rms_stats(p.rstd, qkv, q_norm_w, k_norm_w, d, opt.norm_eps);
  p.P = Tensor::empty({BH, F, D, D}, ct, dev);
  p.A = Tensor::empty({BH, F, D, D}, ct, dev);
  p.Pz = Tensor::empty({BH, F, D, D}, ct, dev);
  p.bz = Tensor::empty({BH, F, D}, ct, dev);
  kernels::phase_a_fwd(p.P, p.A, p.Pz, p.bz, qkv, p.rstd, k_norm_w, rope_cos, rope_sin, beta, d, opt.k_scale, mode);
  return p;
}

PrepGrads prep_backward_q(const Tensor& dq_hat, const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w,
                          const Tensor& k_norm_w, const Tensor& beta, const Dims& d, bool want_dq_norm_w,
                          bool want_dk_norm_w, bool per_frame) {
  const Device dev = qkv.device();
  PrepGrads g;
  g.dqkv = Tensor::empty(qkv.shape(), qkv.dtype(), dev);
  g.dbeta = Tensor::empty(beta.shape(), beta.dtype(), dev);
  g.per_frame = per_frame;
  const DType ct = compute_dtype(qkv.dtype());
  Tensor& dq_w = per_frame ? g.dq_norm_w_frames : g.dq_norm_w;
  Tensor& dk_w = per_frame ? g.dk_norm_w_frames : g.dk_norm_w;
  if (q_norm_w.defined() && want_dq_norm_w)
    dq_w = per_frame ? Tensor::empty({d.F, d.C()}, ct, dev) : Tensor::empty(q_norm_w.shape(), q_norm_w.dtype(), dev);
  if (k_norm_w.defined() && want_dk_norm_w)
    dk_w = per_frame ? Tensor::empty({d.F, d.C()}, ct, dev) : Tensor::empty(k_norm_w.shape(), k_norm_w.dtype(), dev);
  Tensor none;
  kernels::rms_norm_bwd(g.dqkv, g.dq_norm_w, none, dq_hat, Tensor(), qkv, rstd, q_norm_w, k_norm_w, d);
  if (g.dq_norm_w_frames.defined()) kernels::norm_w_frame_partials(g.dq_norm_w_frames, dq_hat, qkv, rstd, 0, d);
  return g;
}

void prep_backward_k(PrepGrads& g, const Tensor& dP, const Tensor& dA, const Tensor& dPz, const Tensor& dbz,
                     const Tensor& qkv, const Tensor& rstd, const Tensor& k_norm_w, const Tensor& rope_cos,
                     const Tensor& rope_sin, const Tensor& beta, const Dims& d, double k_scale, MathMode mode) {
  Tensor dk_hat = Tensor::empty({d.B, d.N(), d.H, d.D}, grad_hat_dtype(mode, qkv.dtype()), qkv.device());
  kernels::phase_a_bwd(dk_hat, g.dqkv, g.dbeta, dP, dA, dPz, dbz, qkv, rstd, k_norm_w, rope_cos, rope_sin, beta, d,
                       k_scale, mode);
  Tensor none;
  kernels::rms_norm_bwd(g.dqkv, none, g.dk_norm_w, Tensor(), dk_hat, qkv, rstd, Tensor(), k_norm_w, d);
  if (g.dk_norm_w_frames.defined()) kernels::norm_w_frame_partials(g.dk_norm_w_frames, dk_hat, qkv, rstd, 1, d);
}

}  // namespace gdncp
