// gdncp/optim.h — AdamW with decoupled weight decay (Loshchilov & Hutter).
//
// For each parameter θ with gradient g = grad_scale · θ.grad(), at step t ≥ 1:
//   θ ← θ − lr·wd·θ                          (decoupled decay, before the Adam move)
//   m ← β1·m + (1 − β1)·g
//   v ← β2·v + (1 − β2)·g²
//   θ ← θ − lr · (m / (1 − β1ᵗ)) / (√(v / (1 − β2ᵗ)) + eps)
// Updates run in place on the parameters' storage (CPU loops or one CUDA kernel
// per parameter on the current stream); m and v live beside the parameter, in
// its dtype and on its device. Parameters: f32 (CPU or CUDA) or f64 (CPU).
// Deterministic: elementwise, no reductions.
#pragma once

#include <cstdint>
#include <vector>

#include "gdncp/tensor.h"

namespace gdncp {
namespace optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

class AdamW {
 public:
  // params: leaves that require grad, f32 or (CPU) f64; their handles are kept.
  // Throws gdncp::Error for a parameter that is undefined, not a leaf requiring
  // grad or of another dtype, and for options out of range (lr, weight_decay
  // >= 0; beta1, beta2 in [0, 1); eps > 0).
  explicit AdamW(std::vector<Tensor> params, const AdamWOptions& options = {});

  // One update of every parameter that has a gradient (others are skipped and
  // keep their moments). grad_scale multiplies the gradients (e.g. 1/DP to turn
  // a sum over data-parallel groups into a mean). Throws gdncp::Error when a
  // gradient's shape or device differs from its parameter's.
  void step(double grad_scale = 1.0);
  // Drops every parameter's accumulated gradient.
  void zero_grad();

  AdamWOptions& options() { return options_; }
  const AdamWOptions& options() const { return options_; }
  const std::vector<Tensor>& params() const { return params_; }
  // First and second moments, one per parameter (same shape, dtype, device).
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }
  // Steps taken so far (t of the bias correction); restored from checkpoints
  // (set_steps throws gdncp::Error for t < 0).
  int64_t steps() const { return t_; }
  void set_steps(int64_t t);

 private:
  std::vector<Tensor> params_, m_, v_;
  AdamWOptions options_;
  int64_t t_ = 0;
};

}  // namespace optim
}  // namespace gdncp
