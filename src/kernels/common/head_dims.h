// src/kernels/common/head_dims.h — the head dims and dtypes the layer supports, in one table.
//
// Note [head dims]. A head dim D is even (RoPE rotates channel pairs) and in
// [kMinHeadDim, kMaxHeadDim]. The tile kernels pad D to the smallest entry of
// kPaddedDims that holds it and are instantiated once per entry (with_dp in
// cuda_common.cuh walks this table); each tile shape static_asserts
// is_padded_dim on its DP, and what is sized by the largest D (one thread per
// state row, shared buffers of D rows) static_asserts against kMaxHeadDim.
// Adding a head dim is one entry here plus the tile shapes of the kernels that
// instantiate it (their static_asserts name them).
//
// Data dtypes (qkv, beta, decay): bf16 and f32 on both devices, f64 on the CPU
// (the oracle of the gradient checks); norm weights, RoPE tables and the scan's
// states are f32 (f64 with f64 data): docs/design.md §1, §8.
#pragma once

#include <cstdint>

#include "gdncp/bigdn.h"

namespace gdncp {

constexpr int kMinHeadDim = 2;
constexpr int kPaddedDims[] = {32, 64, 128};
constexpr int kNumPaddedDims = static_cast<int>(sizeof(kPaddedDims) / sizeof(kPaddedDims[0]));
constexpr int kMaxPaddedDim = kPaddedDims[kNumPaddedDims - 1];

constexpr bool padded_dims_ascend_in_warp_tiles() {
  for (int i = 0; i < kNumPaddedDims; ++i) {
    if (kPaddedDims[i] % 32 != 0) return false;  // whole warps of rows, 16-wide MMA tiles
    if (i > 0 && kPaddedDims[i] <= kPaddedDims[i - 1]) return false;
  }
  return true;
}
static_assert(padded_dims_ascend_in_warp_tiles(), "kPaddedDims: ascending multiples of 32");
static_assert(kMaxHeadDim == kMaxPaddedDim, "the public limit (gdncp/bigdn.h) is the largest padded dim");

constexpr bool is_padded_dim(int dp) {
  for (int p : kPaddedDims)
    if (p == dp) return true;
  return false;
}
constexpr bool supported_head_dim(int64_t D) { return D >= kMinHeadDim && D <= kMaxHeadDim && D % 2 == 0; }
// The padded dim of a supported D: the smallest table entry ≥ D.
constexpr int padded_dim(int64_t D) {
  for (int p : kPaddedDims)
    if (D <= p) return p;
  return kMaxPaddedDim;
}
static_assert(padded_dim(112) == 128 && padded_dim(64) == 64 && padded_dim(2) == 32, "padded_dim follows the table");

}  // namespace gdncp
