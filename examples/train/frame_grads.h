// examples/train/frame_grads.h — the trainer's sums over tokens in global frame
// order, for --deterministic (Note [layout] in trainer.cpp).
//
// The layer's deterministic mode (docs/design.md §12) makes its output and
// gradients the same bits for every CP degree. What the trainer adds on top
// are sums over the tokens of a CP group: the projections' weight gradients
// (Σ_rows xᵀ·dy) and the loss. Summed per rank and then over ranks, their
// rounding depends on the split; here each is summed per frame (in f64, a
// fixed order inside the frame), the frames' terms are gathered over the CP
// group and added in global frame order. CP rank 0 holds the sum (the others
// zero), so the gradient all-reduce adds exact zeros to it.
#pragma once

#include <gdncp/tensor.h>

#include <cstdint>
#include <map>
#include <vector>

#include "dist.h"

namespace train {

// Per-frame weight-gradient terms of the projections, by parameter (the f32 leaf).
class FrameGrads {
 public:
  // y = x (B, F·S, K) · w (K, M) in x's dtype (w cast to it), differentiable in x;
  // w's gradient is kept here per frame instead of flowing to w.
  gdncp::Tensor matmul(const gdncp::Tensor& x, const gdncp::Tensor& w, int64_t F, int64_t S);
  // Sets the gradient of every parameter in `weights` (those given to matmul, in
  // the model's order; one call on every rank of the CP group, an empty rank
  // included) to its sum over the global frames, on CP rank 0; zero elsewhere.
  void reduce(const std::vector<gdncp::Tensor>& weights, const Dist& dist);
  void clear() { terms_.clear(); }

 private:
  friend class FrameMatmulNode;
  std::map<const void*, std::vector<double>> terms_;  // weight's storage -> (F, K, M) f64
};

// Σ (pred − target)² / count over the CP group's tokens in global frame order,
// on CP rank 0 (0 elsewhere). pred, target (B, F·S, C).
double frame_ordered_loss(const gdncp::Tensor& pred, const gdncp::Tensor& target, int64_t F, int64_t S, int64_t count,
                          const Dist& dist);

}  // namespace train
