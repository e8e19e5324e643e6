// examples/train/model.h — the small video model of gdncp_train (see trainer.h
// for the math): parameters, seeded initialisation, forward.
#pragma once

#include <gdncp/bigdn.h>
#include <gdncp/cp.h>
#include <gdncp/tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dist.h"
#include "frame_grads.h"

namespace train {

struct ModelShape {
  int64_t layers = 2, heads = 2, head_dim = 16;
  int64_t channels() const { return heads * head_dim; }
};

// Parameters of one layer, all f32 (the master copy the optimizer updates).
struct LayerParams {
  gdncp::Tensor w_qkv;   // (C, 3C): columns ordered (3, H, D) = q, k, v
  gdncp::Tensor w_beta;  // (C, H)
  gdncp::Tensor w_gate;  // (C, H)
  gdncp::Tensor q_norm;  // (C)
  gdncp::Tensor k_norm;  // (C)
  gdncp::Tensor w_out;   // (C, C)
};

struct Model {
  ModelShape shape;
  std::vector<LayerParams> layers;
  // Every parameter, in a fixed order, with names ("layer0.w_qkv", ...).
  std::vector<gdncp::Tensor> params() const;
  std::vector<std::string> param_names() const;
  // The projection weights (w_qkv, w_beta, w_gate, w_out of each layer), in params() order.
  std::vector<gdncp::Tensor> projections() const;
};

// Seeded init (same values on every rank and device): projections N(0, 1/C),
// norm weights 1 for a student, U(0.5, 1.5) for a teacher (so they have
// something to learn). trainable: the parameters are leaves requiring grad.
Model init_model(const ModelShape& shape, uint64_t seed, gdncp::Device device, bool teacher, bool trainable);

// What one rank needs besides the parameters: its frames, the rope rows of
// its tokens, and the layer options.
struct ForwardContext {
  Dist* dist = nullptr;
  int64_t frames = 0;                      // F, this rank's frames
  int64_t tokens = 0;                      // S
  gdncp::DType dtype = gdncp::DType::f32;  // activation dtype
  gdncp::Tensor rope_cos, rope_sin;        // (F·S, D) rows of this rank's tokens
  gdncp::Tensor clip_starts;               // (B, F) f32, 1 where a frame begins a clip; undefined = one clip
  gdncp::BigdnOptions options;
  gdncp::cp::CpOptions cp_options;  // --overlap-exchange
  // --deterministic: the projections' weight gradients go here per frame (frame_grads.h).
  FrameGrads* frame_grads = nullptr;
};

// x (B, F·S, C) in ctx.dtype -> y (B, F·S, C). Collective over the CP group.
// A rank with F = 0 (more CP ranks than frames) only joins every layer's
// collectives: y = x, and each layer's (empty) output is appended to
// empty_outs, whose backward joins the layers' backward collectives.
gdncp::Tensor forward(const Model& model, const gdncp::Tensor& x, const ForwardContext& ctx,
                      std::vector<gdncp::Tensor>* empty_outs = nullptr);

}  // namespace train
