// src/nn/adamw.cpp — the AdamW optimizer of gdncp/optim.h: state, checks,
// and one elementwise twin call per parameter (adamw_ref.cpp / adamw.cu).
#include <cmath>

#include "autograd/tensor_internals.h"
#include "gdncp/optim.h"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace optim {

AdamW::AdamW(std::vector<Tensor> params, const AdamWOptions& options) : params_(std::move(params)), options_(options) {
  GDNCP_CHECK(options.lr >= 0, "AdamW: lr must be >= 0, got ", options.lr);
  GDNCP_CHECK(options.beta1 >= 0 && options.beta1 < 1, "AdamW: beta1 must be in [0, 1), got ", options.beta1);
  GDNCP_CHECK(options.beta2 >= 0 && options.beta2 < 1, "AdamW: beta2 must be in [0, 1), got ", options.beta2);
  GDNCP_CHECK(options.eps > 0, "AdamW: eps must be > 0, got ", options.eps);
  GDNCP_CHECK(options.weight_decay >= 0, "AdamW: weight_decay must be >= 0, got ", options.weight_decay);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    GDNCP_CHECK(p.defined(), "AdamW: parameter ", i, " is undefined");
    GDNCP_CHECK(p.requires_grad() && !p.grad_fn(), "AdamW: parameter ", i, " ", p.str(),
                " must be a leaf that requires grad");
    GDNCP_CHECK(p.dtype() == DType::f32 || (p.dtype() == DType::f64 && !p.is_cuda()), "AdamW: parameter ", i, " is ",
                p.str(), "; parameters must be f32 (or f64 on the CPU)");
    m_.push_back(Tensor::zeros(p.shape(), p.dtype(), p.device()));
    v_.push_back(Tensor::zeros(p.shape(), p.dtype(), p.device()));
  }
}

void AdamW::set_steps(int64_t t) {
  GDNCP_CHECK(t >= 0, "AdamW::set_steps: t must be >= 0, got ", t);
  t_ = t;
}

void AdamW::zero_grad() {
  for (Tensor& p : params_) p.zero_grad();
}

void AdamW::step(double grad_scale) {
  ++t_;
  AdamWStep s;
  s.lr = options_.lr;
  s.beta1 = options_.beta1;
  s.beta2 = options_.beta2;
  s.eps = options_.eps;
  s.weight_decay = options_.weight_decay;
  s.bias_corr1 = 1.0 - std::pow(options_.beta1, static_cast<double>(t_));
  s.bias_corr2 = 1.0 - std::pow(options_.beta2, static_cast<double>(t_));
  s.grad_scale = grad_scale;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    Tensor g = p.grad();
    if (!g.defined()) continue;
    GDNCP_CHECK(g.shape() == p.shape() && g.device() == p.device(), "AdamW: gradient ", g.str(), " of parameter ", i,
                " does not match ", p.str());
    if (g.dtype() != p.dtype()) g = g.to(p.dtype());
    GDNCP_NN_TWIN(p.device(), adamw_step, p, m_[i], v_[i], g, s);
    for (const Tensor* t : {&p, &m_[i], &v_[i]}) detail::bump_version(*t);
  }
}

}  // namespace optim
}  // namespace gdncp
