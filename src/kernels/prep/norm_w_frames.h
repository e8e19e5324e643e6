// src/kernels/prep/norm_w_frames.h — the norm weights' gradient per frame, and a sum
// over frames in their order: the deterministic mode's cross-rank sum
// (docs/design.md §12, Note [deterministic scan] in src/cp/scan/deterministic.h).
// Twins as in kernels.h: cpu:: (norm_w_frames_ref.cpp), cuda::
// (norm_w_frames.cu), kernels:: dispatches on the device of the first tensor.
#pragma once

#include "gdncp/tensor.h"
#include "kernels/kernels.h"

namespace gdncp {

#define GDNCP_NORM_W_FRAMES_TWINS(NS)                                                                                  \
  namespace NS {                                                                                                       \
  /* partials (F, C) compute dtype: per frame f, Σ_b Σ_{s<S} dx̂_c·x_c·r of stream `stream` (0 q, 1 k) over the   \
     frame's tokens n = f·S + s (rms_norm_bwd's dw, per frame), in f64, in an order set by the frame alone (CPU:      \
     token order; CUDA: 8 interleaved lanes, then the lanes in order). dx_hat (B, N, H, D) hat-grad dtype, qkv         \
     (B, N, 3, H, D), rstd (B, N, 2) compute dtype. */                                                                 \
  void norm_w_frame_partials(Tensor& partials, const Tensor& dx_hat, const Tensor& qkv, const Tensor& rstd,            \
                             int stream, const Dims& d);                                                               \
  /* out (C), any float dtype = Σ_f partials[f] accumulated in f64 over f = 0 … F−1 in order; partials (F, C). */ \
  void frame_sum(Tensor& out, const Tensor& partials);                                                                 \
  }

GDNCP_NORM_W_FRAMES_TWINS(cpu)
GDNCP_NORM_W_FRAMES_TWINS(cuda)
GDNCP_NORM_W_FRAMES_TWINS(kernels)

#undef GDNCP_NORM_W_FRAMES_TWINS

}  // namespace gdncp
