// examples/train/frame_grads.cpp — frame_grads.h.
#include "frame_grads.h"

#include <gdncp/autograd.h>
#include <gdncp/error.h>
#include <gdncp/nn.h>

#include <memory>

namespace train {

using gdncp::Tensor;

namespace {

// Σ_b Σ_s a[b, f·S + s, i] · c[b, f·S + s, j] per frame f: (F, I, J) f64.
std::vector<double> frame_outer_sums(const Tensor& a, const Tensor& c, int64_t F, int64_t S) {
  const int64_t B = a.size(0), N = F * S, I = a.size(2), J = c.size(2);
  const std::vector<double> av = a.to(gdncp::Device::cpu).to_vector(), cv = c.to(gdncp::Device::cpu).to_vector();
  std::vector<double> out(static_cast<size_t>(F * I * J), 0.0);
  for (int64_t f = 0; f < F; ++f)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        const int64_t row = b * N + f * S + s;
        for (int64_t i = 0; i < I; ++i) {
          const double x = av[static_cast<size_t>(row * I + i)];
          double* o = out.data() + (f * I + i) * J;
          for (int64_t j = 0; j < J; ++j) o[j] += x * cv[static_cast<size_t>(row * J + j)];
        }
      }
  return out;
}

// The frames' terms of every CP rank, added in global frame order (CP rank order).
std::vector<double> ordered_sum(const std::vector<double>& mine, size_t per_frame, const Dist& dist) {
  const std::vector<double> all = dist.cp_gather(mine);
  std::vector<double> sum(per_frame, 0.0);
  for (size_t at = 0; at + per_frame <= all.size(); at += per_frame)
    for (size_t i = 0; i < per_frame; ++i) sum[i] += all[at + i];
  return sum;
}

}  // namespace

class FrameMatmulNode : public gdncp::autograd::Node {
 public:
  FrameMatmulNode(FrameGrads* owner, Tensor w, int64_t F, int64_t S) : owner_(owner), w_(std::move(w)), F_(F), S_(S) {}
  const char* name() const override { return "frame_matmul"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor &x = saved(0), &wc = saved(1), &dy = grads[0];
    gdncp::NoGradGuard no_grad;
    std::vector<Tensor> out(2);
    if (needs_input_grad(0)) out[0] = gdncp::nn::matmul(dy, gdncp::nn::transpose_last2(wc));
    std::vector<double> t = frame_outer_sums(x, dy, F_, S_);
    std::vector<double>& acc = owner_->terms_[w_.data()];
    if (acc.empty())
      acc = std::move(t);
    else
      for (size_t i = 0; i < acc.size(); ++i) acc[i] += t[i];
    return out;
  }

 private:
  FrameGrads* owner_;
  Tensor w_;  // the leaf whose terms these are
  int64_t F_, S_;
};

Tensor FrameGrads::matmul(const Tensor& x, const Tensor& w, int64_t F, int64_t S) {
  Tensor y, wc;
  {
    gdncp::NoGradGuard no_grad;
    wc = gdncp::nn::cast(w.detach(), x.dtype());
    y = gdncp::nn::matmul(x, wc);
  }
  const std::vector<Tensor> in = {x, w};
  if (gdncp::autograd::should_record(in)) {
    auto node = std::make_shared<FrameMatmulNode>(this, w, F, S);
    node->save(x);
    node->save(wc);
    gdncp::autograd::record(node, in, {y});
  }
  return y;
}

void FrameGrads::reduce(const std::vector<Tensor>& weights, const Dist& dist) {
  for (const Tensor& w : weights) {
    const int64_t K = w.size(0), M = w.size(1);
    auto it = terms_.find(w.data());
    const std::vector<double> mine = it == terms_.end() ? std::vector<double>() : it->second;
    const std::vector<double> sum = ordered_sum(mine, static_cast<size_t>(K * M), dist);
    const Tensor g = dist.cp_rank() == 0 ? Tensor::from_vector(sum, w.shape(), w.dtype(), w.device())
                                         : Tensor::zeros(w.shape(), w.dtype(), w.device());
    Tensor(w).set_grad(g);
  }
  terms_.clear();
}

double frame_ordered_loss(const Tensor& pred, const Tensor& target, int64_t F, int64_t S, int64_t count,
                          const Dist& dist) {
  std::vector<double> mine(static_cast<size_t>(F), 0.0);
  if (F > 0) {
    const std::vector<double> p = pred.to(gdncp::Device::cpu).to_vector(),
                              t = target.to(gdncp::Device::cpu).to_vector();
    const int64_t B = pred.size(0), N = F * S, C = pred.size(2);
    for (int64_t f = 0; f < F; ++f)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = (b * N + f * S) * C; i < (b * N + (f + 1) * S) * C; ++i) {
          const double d = p[static_cast<size_t>(i)] - t[static_cast<size_t>(i)];
          mine[static_cast<size_t>(f)] += d * d;
        }
  }
  const double sum = ordered_sum(mine, 1, dist)[0];
  return dist.cp_rank() == 0 ? sum / static_cast<double>(count) : 0.0;
}

}  // namespace train
