// src/reference/ops_rms_norm.cpp — ops::rms_norm, the full-channel RMSNorm of q and k
// (docs/design.md §2.1) as one autograd node. A plain-loop coding, independent of the
// fused kernels, used to cross-check them.
//
//   x̂_c = x_c·r·w_c,  r = (Σ_c x_c²/C + norm_eps)^(−1/2)  over the C = H·D channels of a token
//   ∂x̂_i/∂x_j = w_i (δ_ij r − x_i r³ x_j / C)  ⇒  dx_j = r w_j g_j − (r³/C) x_j Σ_i g_i w_i x_i
//   dw_i = Σ_tokens g_i x_i r
// v is copied (gradient passes through). An undefined weight leaves its stream
// unnormalised (x̂ = x). Gradient rule: the node returns fresh gradients for
// qkv (its dtype) and the present weights (their dtype).
#include <cmath>

#include "reference/ops_common.h"

namespace gdncp {
namespace ops {
namespace {

using namespace cpu::detail;
using namespace ops::detail;

struct QkvDims {
  int64_t tokens, C;
};

QkvDims qkv_dims(const Tensor& qkv, const char* op) {
  require_cpu(qkv, op, "qkv");
  GDNCP_CHECK(qkv.dim() == 5 && qkv.size(2) == 3, op, ": qkv must be (B, N, 3, H, D), got ", qkv.str());
  return {qkv.size(0) * qkv.size(1), qkv.size(3) * qkv.size(4)};
}

// 1/sqrt(mean of squares + eps) of one token's channel.
template <typename T>
T inv_rms(const T* x, int64_t C, double eps) {
  T ss = T(0);
  for (int64_t i = 0; i < C; ++i) ss += x[i] * x[i];
  return T(1) / std::sqrt(ss / static_cast<T>(C) + static_cast<T>(eps));
}

template <typename T>
Tensor rms_norm_forward(const Tensor& qkv, const Tensor& qw, const Tensor& kw, double eps) {
  const QkvDims q = qkv_dims(qkv, "ops::rms_norm");
  const std::vector<T> x = values<T>(qkv, qkv.numel());
  const Tensor* w[2] = {&qw, &kw};
  std::vector<T> wv[2];
  for (int c = 0; c < 2; ++c)
    if (w[c]->defined()) wv[c] = values<T>(*w[c], q.C);
  std::vector<T> y(x);
  for (int64_t t = 0; t < q.tokens; ++t)
    for (int c = 0; c < 2; ++c) {
      if (wv[c].empty()) continue;
      const int64_t o = (t * 3 + c) * q.C;
      const T r = inv_rms(&x[static_cast<size_t>(o)], q.C, eps);
      for (int64_t i = 0; i < q.C; ++i)
        y[static_cast<size_t>(o + i)] = x[static_cast<size_t>(o + i)] * r * wv[c][static_cast<size_t>(i)];
    }
  return tensor_from(y, qkv.shape(), dtype_of<T>::value);
}

class RmsNormNode : public RefNode<RmsNormNode> {
 public:
  explicit RmsNormNode(double eps) : RefNode("ops::rms_norm"), eps_(eps) {}
  bool has_w[2] = {false, false};

  template <typename T>
  std::vector<Tensor> run(const std::vector<Tensor>& grads) {
    const Tensor& gy = grads[0];
    const Tensor& qkv = saved(0);
    const QkvDims q = qkv_dims(qkv, "ops::rms_norm backward");
    const std::vector<T> x = values<T>(qkv, qkv.numel());
    const std::vector<T> g = values<T>(gy, qkv.numel());
    std::vector<T> dx(g);  // v (and unnormalised streams) pass the gradient through
    std::vector<Tensor> out(3);
    size_t next = 1;
    for (int c = 0; c < 2; ++c) {
      if (!has_w[c]) continue;
      const Tensor& wt = saved(next++);
      const std::vector<T> w = values<T>(wt, q.C);
      std::vector<T> dw(static_cast<size_t>(q.C), T(0));
      for (int64_t t = 0; t < q.tokens; ++t) {
        const size_t o = static_cast<size_t>((t * 3 + c) * q.C);
        const T r = inv_rms(&x[o], q.C, eps_);
        T sum = T(0);
        for (int64_t i = 0; i < q.C; ++i) sum += g[o + i] * w[static_cast<size_t>(i)] * x[o + i];
        for (int64_t j = 0; j < q.C; ++j) {
          const size_t e = o + static_cast<size_t>(j);
          dx[e] = r * w[static_cast<size_t>(j)] * g[e] - r * r * r / static_cast<T>(q.C) * x[e] * sum;
          dw[static_cast<size_t>(j)] += g[e] * x[e] * r;
        }
      }
      if (needs_input_grad(static_cast<size_t>(1 + c)))
        out[static_cast<size_t>(1 + c)] = tensor_from(dw, wt.shape(), wt.dtype());
    }
    if (needs_input_grad(0)) out[0] = tensor_from(dx, qkv.shape(), qkv.dtype());
    return out;
  }

 private:
  double eps_;
};

}  // namespace

Tensor rms_norm(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, double norm_eps) {
  qkv_dims(qkv, "ops::rms_norm");
  if (q_norm_w.defined()) require_cpu(q_norm_w, "ops::rms_norm", "q_norm_w");
  if (k_norm_w.defined()) require_cpu(k_norm_w, "ops::rms_norm", "k_norm_w");
  const Tensor y = qkv.dtype() == DType::f64 ? rms_norm_forward<double>(qkv, q_norm_w, k_norm_w, norm_eps)
                                             : rms_norm_forward<float>(qkv, q_norm_w, k_norm_w, norm_eps);
  const std::vector<Tensor> inputs = {qkv, q_norm_w, k_norm_w};
  if (autograd::should_record(inputs)) {
    auto node = std::make_shared<RmsNormNode>(norm_eps);
    node->save(qkv);
    node->has_w[0] = q_norm_w.defined();
    node->has_w[1] = k_norm_w.defined();
    if (q_norm_w.defined()) node->save(q_norm_w);
    if (k_norm_w.defined()) node->save(k_norm_w);
    autograd::record(node, inputs, {y});
  }
  return y;
}

}  // namespace ops
}  // namespace gdncp
