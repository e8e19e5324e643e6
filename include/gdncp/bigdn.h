// gdncp/bigdn.h — the single-rank bidirectional gated-delta-net layer (docs/design.md §1-5).
//
//   q̂, k̂   = full-channel RMSNorm of q, k over C = H·D channels (times the norm weight)
//   q⁺ = relu(q̂), k⁺ = relu(k̂)·k_scale, qʳ = rope(q⁺), kʳ = rope(k⁺)
//   per frame f:  P_f = kʳᵀ diag(β) kʳ,  A_f = kʳᵀ diag(β) v,  Pz_f = k⁺ᵀ diag(β) k⁺,  b_f = k⁺ᵀ β
//   M_f = g_f (I − P_f) M_{f−1} + A_f          z_f likewise with (Pz, b)
//   M̃_f = g_{f+1} (I − P_{f+1}) M̃_{f+1} + A_{f+1},  M̃_{F−1} = 0
//   num_s = qʳ_s (M_f + M̃_f),  den_s = q⁺_s · (z_f + z̃_f),  out_s = num_s / (den_s + eps)
//
// Layouts (all dense, row-major):
//   qkv   (B, N, 3, H, D)  bf16 | f32 | f64   channel 0 = q, 1 = k, 2 = v; N = F·S
//   beta  (B, H, F, S)     bf16 | f32 | f64   per-token update gate
//   decay (B, H, F)        bf16 | f32 | f64   per-frame decay g
//   q_norm_w, k_norm_w (C) f32 (f64 with f64 inputs), or undefined: an absent
//         weight means that stream is not normalised at all and gets no gradient
//   rope_cos, rope_sin (N, D) f32 (f64 with f64 inputs); sin carries the sign:
//         rope(x)[d] = x[d]·cos[d] + x[d^1]·sin[d]
//   rope_cos_q, rope_sin_q (N, D), optional, as rope_cos/rope_sin: q's own tables
//         (qʳ = rope(q⁺) with them, kʳ with rope_cos/rope_sin); both undefined = q
//         uses the k tables (bitwise the same as passing the k tables); one alone throws
//   clip_starts (B, F)     f32 whatever qkv is, optional: 1 where frame f of row b begins a clip, 0 elsewhere
//         (other values: gdncp::Error naming clip_starts; a CUDA mask is checked on the device, its
//         call's out and gradients become NaN and the next call raises: docs/design.md §9).
//         Undefined = one clip per row.
//   out   (B, N, H, D)     qkv's dtype
// Either every floating input is f64 (the CPU oracle) or none is. All tensors
// on one device. D even, 2..128; f64 is CPU-only.
//
// Packed clips (docs/design.md §4a): at a clip start f no state crosses the boundary in
// either direction, M_f = A_f and M̃_{f−1} = 0 (z likewise); frame 0 always
// starts one. Out and every gradient equal running each clip as its own row
// (the decay of a clip's first frame then gets gradient 0, as it does alone).
//
// Gradients flow to qkv, beta, decay and the present norm weights.
// Throws gdncp::Error naming the argument for any bad input (docs/design.md §9).
#pragma once

#include <cstdint>

#include "gdncp/autograd.h"
#include "gdncp/tensor.h"

namespace gdncp {

// Matrix-unit mode of the CUDA kernels (docs/design.md §8). The CPU computes in
// f32 (bf16/f32 inputs) or f64: exactly so in ieee and tf32 modes (it has no
// tensor cores to round operands for); in bf16 mode (automatic with bf16 input)
// it stores dq̂ and dk̂ (dL/dq̂, dL/dk̂) in bf16 as the CUDA path does, so the q, k
// and norm-weight gradients carry that rounding.
enum class Precision {
  automatic,  // bf16 operands for bf16 input, IEEE f32 for f32 input
  bf16,       // bf16 tensor-core operands, f32 accumulation
  tf32,       // tf32 tensor-core operands, f32 accumulation
  ieee,       // plain f32 arithmetic
};
const char* precision_name(Precision p);

struct BigdnOptions {
  double k_scale = 1.0;    // finite; Sana production uses D^-½·S^-½
  double norm_eps = 1e-5;  // finite and > 0 (the RMSNorm of a zero row stays finite)
  double eps = 1e-6;       // finite and > 0 (a zero denominator stays finite)
  Precision precision = Precision::automatic;
  Checkpoint checkpoint = Checkpoint::off;  // on: keep only the inputs, recompute in backward
  // Bitwise the same output and gradients for every CP degree and frame ownership
  // (docs/design.md §12): every floating-point reduction runs in global frame order.
  // Here bigdn runs the CP layer's one-rank path, which the CP layers match bitwise.
  bool deterministic = false;
};

// Largest supported head dimension.
constexpr int64_t kMaxHeadDim = 128;

// The layer, as fused kernels (one node, or a checkpoint node). Returns out.
Tensor bigdn(const Tensor& qkv, const Tensor& beta, const Tensor& decay, const Tensor& q_norm_w, const Tensor& k_norm_w,
             const Tensor& rope_cos, const Tensor& rope_sin, int64_t F, int64_t S, const BigdnOptions& options = {},
             const Tensor& clip_starts = Tensor(), const Tensor& rope_cos_q = Tensor(),
             const Tensor& rope_sin_q = Tensor());

// The same layer composed of the fine-grained ops of gdncp/ops.h, one node per
// op (CPU). An independent implementation of the math, used to check bigdn.
Tensor bigdn_unfused(const Tensor& qkv, const Tensor& beta, const Tensor& decay, const Tensor& q_norm_w,
                     const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, int64_t F, int64_t S,
                     const BigdnOptions& options = {}, const Tensor& clip_starts = Tensor(),
                     const Tensor& rope_cos_q = Tensor(), const Tensor& rope_sin_q = Tensor());

// Standard RoPE tables for the pair layout of docs/design.md §2 (sin carries the sign),
// position of token n = n + offset, frequency base^(-2i/D) for pair i.
// Returns {cos, sin}, each (N, D) in dtype (f32 or f64), on device.
std::pair<Tensor, Tensor> rope_tables(int64_t N, int64_t D, DType dtype, Device device, int64_t offset = 0,
                                      double base = 10000.0);

}  // namespace gdncp
