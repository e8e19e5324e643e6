// gdncp/nn.h — the generic differentiable ops a trainer puts around the layer:
// projections (matmul), residual add, gates (sigmoid), the per-frame mean,
// layout swaps, dtype casts and the loss.
//
// Every op validates its arguments (gdncp::Error naming the argument), runs on
// the inputs' device (CPU loops, or CUDA kernels / cuBLAS on the current
// stream) and records one autograd node when an input requires grad.
//
// Dtypes: f32 and bf16 on both devices, f64 on the CPU only (the gradcheck
// oracle). bf16 data is computed in f32 and rounded once on output; f64 is
// computed in f64. Results are deterministic: the same inputs give bitwise
// the same outputs and gradients on every run (fixed reduction orders).
#pragma once

#include <cstdint>

#include "gdncp/tensor.h"

namespace gdncp {
namespace nn {

// y (..., N) = x (..., K) · w (K, N): every row of x times w.
// x and w share dtype and device; y has x's dtype. On CUDA through cuBLAS
// (f32 in IEEE f32, bf16 operands with f32 accumulation).
// Gradients: dx = dy · wᵀ, dw = Σ_rows xᵀ · dy.
Tensor matmul(const Tensor& x, const Tensor& w);

// a + b, same shape, dtype and device. Gradients: da = db = dy.
Tensor add(const Tensor& a, const Tensor& b);

// y = 1 / (1 + e^(−x)) elementwise. Gradient: dx = dy · y · (1 − y).
Tensor sigmoid(const Tensor& x);

// Mean over the last axis: x (..., S) -> y (...), y = (1/S) Σ_s x[..., s];
// with x = (B, H, F, S) it is the mean over each frame's S tokens.
// A 1-D x gives a one-element y of shape (1). Gradient: dx[..., s] = dy[...] / S.
Tensor frame_mean(const Tensor& x);

// Swaps the last two axes: x (A, M, N) -> y (A, N, M) (a 2-D x is taken as A = 1
// and gives (N, M)). E.g. per-token head values (B, N, H) -> (B, H, N).
// Gradient: the inverse swap.
Tensor transpose_last2(const Tensor& x);

// Copy of x in dtype (round to nearest even for bf16). Gradient: dy cast back to
// x's dtype. Returns x itself when it already has that dtype.
Tensor cast(const Tensor& x, DType dtype);

// Squared error sum divided by count: loss = Σ_i (pred_i − target_i)² / count,
// a one-element tensor of shape (1) in the compute dtype (f32, f64 for f64).
// count = 0 means pred.numel() (the mean); a CP/DP shard passes the global
// element count so that summing the shards' losses gives the global mean.
// pred, target: same shape, dtype and device.
// Gradients: dpred = 2 (pred − target) · dloss / count, dtarget = −dpred.
Tensor mse_loss(const Tensor& pred, const Tensor& target, int64_t count = 0);

}  // namespace nn
}  // namespace gdncp
