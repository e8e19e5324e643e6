// examples/train/model.cpp — parameters and forward of gdncp_train's model,
// written only with the public ops (gdncp/nn.h) and the layer.
#include "model.h"

#include <gdncp/nn.h>

#include <cmath>

namespace train {

using gdncp::DType;
using gdncp::Tensor;

std::vector<Tensor> Model::params() const {
  std::vector<Tensor> out;
  for (const LayerParams& l : layers)
    for (const Tensor* t : {&l.w_qkv, &l.w_beta, &l.w_gate, &l.q_norm, &l.k_norm, &l.w_out}) out.push_back(*t);
  return out;
}

std::vector<Tensor> Model::projections() const {
  std::vector<Tensor> out;
  for (const LayerParams& l : layers)
    for (const Tensor* t : {&l.w_qkv, &l.w_beta, &l.w_gate, &l.w_out}) out.push_back(*t);
  return out;
}

std::vector<std::string> Model::param_names() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < layers.size(); ++i)
    for (const char* n : {"w_qkv", "w_beta", "w_gate", "q_norm", "k_norm", "w_out"})
      out.push_back("layer" + std::to_string(i) + "." + n);
  return out;
}

Model init_model(const ModelShape& shape, uint64_t seed, gdncp::Device device, bool teacher, bool trainable) {
  Model m;
  m.shape = shape;
  const int64_t C = shape.channels(), H = shape.heads;
  const double std_in = 1.0 / std::sqrt(static_cast<double>(C));
  uint64_t s = seed * 1000;  // one stream per parameter
  for (int64_t l = 0; l < shape.layers; ++l) {
    LayerParams p;
    p.w_qkv = Tensor::randn({C, 3 * C}, DType::f32, device, ++s, std_in);
    p.w_beta = Tensor::randn({C, H}, DType::f32, device, ++s, std_in);
    p.w_gate = Tensor::randn({C, H}, DType::f32, device, ++s, std_in);
    p.q_norm =
        teacher ? Tensor::uniform({C}, DType::f32, device, ++s, 0.5, 1.5) : Tensor::full({C}, 1.0, DType::f32, device);
    p.k_norm =
        teacher ? Tensor::uniform({C}, DType::f32, device, ++s, 0.5, 1.5) : Tensor::full({C}, 1.0, DType::f32, device);
    p.w_out = Tensor::randn({C, C}, DType::f32, device, ++s, std_in);
    m.layers.push_back(p);
  }
  if (trainable)
    for (Tensor& t : m.params()) t.requires_grad_();
  return m;
}

Tensor forward(const Model& model, const Tensor& x_in, const ForwardContext& ctx, std::vector<Tensor>* empty_outs) {
  const int64_t B = x_in.size(0), H = model.shape.heads, D = model.shape.head_dim, C = model.shape.channels();
  const int64_t F = ctx.frames, S = ctx.tokens, N = F * S;
  if (F == 0) {  // no token to project (the projections take no empty input): the layers' collectives only
    const gdncp::Device dev = x_in.device();
    for (const LayerParams& p : model.layers) {
      const auto leaf = [&](const gdncp::Shape& s) {
        Tensor t = Tensor::empty(s, ctx.dtype, dev);
        if (gdncp::autograd::grad_enabled()) t.requires_grad_();
        return t;
      };
      const Tensor out =
          ctx.dist->layer(leaf({B, 0, 3, H, D}), leaf({B, H, 0, S}), leaf({B, H, 0}), p.q_norm, p.k_norm, ctx.rope_cos,
                          ctx.rope_sin, 0, S, ctx.options, ctx.clip_starts, ctx.cp_options);
      if (empty_outs && out.requires_grad()) empty_outs->push_back(out);
    }
    return x_in;
  }
  // x (B, N, K) · w (K, M): per frame with --deterministic (frame_grads.h).
  const auto project = [&](const Tensor& in, const Tensor& w) {
    return ctx.frame_grads ? ctx.frame_grads->matmul(in, w, F, S)
                           : gdncp::nn::matmul(in, gdncp::nn::cast(w, ctx.dtype));
  };
  Tensor x = x_in;
  for (const LayerParams& p : model.layers) {
    // Projections in the activation dtype (bf16 runs cast the f32 master weights;
    // the cast is differentiable, so gradients land in f32).
    const Tensor qkv = project(x, p.w_qkv).reshape({B, N, 3, H, D});
    // (B, N, H) -> (B, H, N) = (B, H, F, S): per head and token.
    const Tensor beta_logit = gdncp::nn::transpose_last2(project(x, p.w_beta)).reshape({B, H, F, S});
    const Tensor gate_logit = gdncp::nn::transpose_last2(project(x, p.w_gate)).reshape({B, H, F, S});
    const Tensor beta = gdncp::nn::sigmoid(beta_logit);
    const Tensor decay = gdncp::nn::sigmoid(gdncp::nn::frame_mean(gate_logit));  // (B, H, F)
    const Tensor out = ctx.dist->layer(qkv, beta, decay, p.q_norm, p.k_norm, ctx.rope_cos, ctx.rope_sin, F, S,
                                       ctx.options, ctx.clip_starts, ctx.cp_options);  // (B, N, H, D)
    x = gdncp::nn::add(x, project(out.reshape({B, N, C}), p.w_out));
  }
  return x;
}

}  // namespace train
