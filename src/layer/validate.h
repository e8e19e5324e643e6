// src/layer/validate.h — argument checks of the BiGDN layer entries (docs/design.md §9).
//
// Every public entry calls this before any work. Each failure throws
// gdncp::Error "<entry>: <argument>: <why>", naming the argument as the user
// knows it ("qkv", "beta", "decay", "q_norm_w", "k_norm_w", "rope_cos",
// "rope_sin", "F", "S", "k_scale", "norm_eps", "eps").
#pragma once

#include <cstdint>

#include "gdncp/bigdn.h"
#include "gdncp/tensor.h"
#include "kernels/kernels.h"

namespace gdncp {

// Checks an optional clip-start mask (docs/design.md §4a): undefined, or (B, F) f32 on
// `device`, holding 0 or 1 (validate_clip_values); first raises a clip fault
// of an earlier call (Note [clip mask values] in src/kernels/common/clip_guard.h).
void validate_clip_starts(const char* entry, const Tensor& clip_starts, int64_t B, int64_t F, Device device);
// Every value of a host (CPU) mask is 0 or 1, else gdncp::Error naming
// clip_starts and the first bad value. A device mask is checked on the device
// after the kernels that read it (that here would make the host wait).
void validate_clip_values(const char* entry, const Tensor& clip_starts);

// Checks one rank's inputs of the bidirectional layer and returns their dims:
//  - F > 0 (F ≥ 0 with allow_empty: a CP rank may hold no frame), S > 0; qkv (B, N, 3, H, D) with B, H > 0, N = F·S, D
//  even in 2..kMaxHeadDim;
//  - beta (B, H, F, S), decay (B, H, F), rope_cos/rope_sin (N, D), norm weights (C) or undefined;
//  - dtypes: either every floating input is f64 or none is; norm weights and rope
//    are f32 (f64 with f64 inputs); qkv, beta, decay any of f32/bf16 (f64 with f64);
//  - every tensor on qkv's device, f64 only on the CPU;
//  - k_scale finite, norm_eps and eps finite and >= 0.
// Checks the optional tables of q's RoPE (docs/design.md §5): both undefined (q is
// rotated with rope_cos/rope_sin) or both (N, D) with the k tables' dtype, on
// `device`; names them "rope_cos_q", "rope_sin_q".
void validate_rope_q(const char* entry, const Tensor& rope_cos_q, const Tensor& rope_sin_q, const Dims& d,
                     const Tensor& rope_cos, Device device);

// The tables q is rotated with: the q tables when given, else the k tables.
inline const Tensor& q_table(const Tensor& q_table, const Tensor& k_table) {
  return q_table.defined() ? q_table : k_table;
}

Dims validate_bigdn_inputs(const char* entry, const Tensor& qkv, const Tensor& beta, const Tensor& decay,
                           const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& rope_cos,
                           const Tensor& rope_sin, int64_t F, int64_t S, const BigdnOptions& options,
                           bool allow_empty = false);

}  // namespace gdncp
