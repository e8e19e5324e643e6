// src/reference/ops_relu_rope.cpp — ops::relu_rope: relu, k_scale and RoPE on the q
// and k channels of qkv_hat (docs/design.md §2.2-3), one autograd node, plain loops.
//
//   q⁺ = relu(q̂),  k⁺ = relu(k̂)·k_scale,  xʳ[d] = x⁺[d]·cos[d] + x⁺[d^1]·sin[d]
// Backward (g⁺, gʳ the gradients of x⁺, xʳ):
//   dx⁺[d] = g⁺[d] + gʳ[d]·cos[d] + gʳ[d^1]·sin[d^1]
//   dq̂ = dq⁺·[q̂ > 0],  dk̂ = dk⁺·k_scale·[k̂ > 0],  the v channel gets 0
//   dcos[n][d] = Σ_{b,h} gʳ[d]·x⁺[d],  dsin[n][d] = Σ_{b,h} gʳ[d]·x⁺[d^1]   (q and k summed)
// Gradient rule: fresh gradients for qkv_hat and (when asked) the rope tables.
#include "reference/ops_common.h"

namespace gdncp {
namespace ops {
namespace {

using namespace cpu::detail;
using namespace ops::detail;

TokenRows geometry(const Tensor& qkv_hat, const Tensor& cos, const Tensor& sin) {
  const char* op = "ops::relu_rope";
  require_cpu_inputs(op, {{qkv_hat, "qkv_hat"}, {cos, "rope_cos"}, {sin, "rope_sin"}});
  GDNCP_CHECK(qkv_hat.dim() == 5 && qkv_hat.size(2) == 3, op, ": qkv_hat must be (B, N, 3, H, D), got ", qkv_hat.str());
  const TokenRows g{qkv_hat.size(0), qkv_hat.size(1), qkv_hat.size(3), qkv_hat.size(4)};
  GDNCP_CHECK(g.D % 2 == 0, op, ": qkv_hat: D must be even, got ", g.D);
  GDNCP_CHECK(cos.shape() == Shape({g.N, g.D}), op, ": rope_cos must be (N, D), got ", cos.str());
  GDNCP_CHECK(sin.shape() == Shape({g.N, g.D}), op, ": rope_sin must be (N, D), got ", sin.str());
  return g;
}

// Row (b, n, h) of channel c in qkv_hat.
inline size_t hat_at(const TokenRows& g, int64_t b, int64_t n, int64_t c, int64_t h) {
  return static_cast<size_t>((((b * g.N + n) * 3 + c) * g.H + h) * g.D);
}

template <typename T>
std::vector<Tensor> relu_rope_forward(const Tensor& qkv_hat, const Tensor& cos_t, const Tensor& sin_t, double k_scale) {
  const TokenRows g = geometry(qkv_hat, cos_t, sin_t);
  const std::vector<T> x = values<T>(qkv_hat, qkv_hat.numel());
  const std::vector<T> cs = values<T>(cos_t, g.N * g.D), sn = values<T>(sin_t, g.N * g.D);
  const size_t n_out = static_cast<size_t>(g.rows() * g.D);
  std::vector<T> plus[2] = {std::vector<T>(n_out), std::vector<T>(n_out)};
  std::vector<T> rot[2] = {std::vector<T>(n_out), std::vector<T>(n_out)};
  const T scale[2] = {T(1), static_cast<T>(k_scale)};
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t n = 0; n < g.N; ++n)
      for (int64_t h = 0; h < g.H; ++h)
        for (int c = 0; c < 2; ++c) {
          const size_t in = hat_at(g, b, n, c, h), o = g.row(b, n, h);
          for (int64_t d = 0; d < g.D; ++d) {
            const T v = x[in + static_cast<size_t>(d)];
            plus[c][o + static_cast<size_t>(d)] = v > T(0) ? v * scale[c] : T(0);
          }
          for (int64_t d = 0; d < g.D; ++d) {
            const size_t t = static_cast<size_t>(n * g.D + d);
            rot[c][o + static_cast<size_t>(d)] =
                plus[c][o + static_cast<size_t>(d)] * cs[t] + plus[c][o + static_cast<size_t>(d ^ 1)] * sn[t];
          }
        }
  const Shape shape = {g.B, g.N, g.H, g.D};
  const DType ct = dtype_of<T>::value;
  return {tensor_from(plus[0], shape, ct), tensor_from(plus[1], shape, ct), tensor_from(rot[0], shape, ct),
          tensor_from(rot[1], shape, ct)};
}

class ReluRopeNode : public RefNode<ReluRopeNode> {
 public:
  explicit ReluRopeNode(double k_scale) : RefNode("ops::relu_rope"), k_scale_(k_scale) {}

  template <typename T>
  std::vector<Tensor> run(const std::vector<Tensor>& grads) {
    const Tensor &qkv_hat = saved(0), &cos_t = saved(1), &sin_t = saved(2);
    const TokenRows g = geometry(qkv_hat, cos_t, sin_t);
    const int64_t n_out = g.rows() * g.D;
    const std::vector<T> x = values<T>(qkv_hat, qkv_hat.numel());
    const std::vector<T> cs = values<T>(cos_t, g.N * g.D), sn = values<T>(sin_t, g.N * g.D);
    const std::vector<T> gplus[2] = {values<T>(grads[0], n_out), values<T>(grads[1], n_out)};
    const std::vector<T> grot[2] = {values<T>(grads[2], n_out), values<T>(grads[3], n_out)};
    const T scale[2] = {T(1), static_cast<T>(k_scale_)};
    std::vector<T> dx(x.size(), T(0)), dcos(cs.size(), T(0)), dsin(sn.size(), T(0));
    for (int64_t b = 0; b < g.B; ++b)
      for (int64_t n = 0; n < g.N; ++n)
        for (int64_t h = 0; h < g.H; ++h)
          for (int c = 0; c < 2; ++c) {
            const size_t in = hat_at(g, b, n, c, h), o = g.row(b, n, h);
            const auto plus = [&](int64_t d) {
              const T v = x[in + static_cast<size_t>(d)];
              return v > T(0) ? v * scale[c] : T(0);
            };
            for (int64_t d = 0; d < g.D; ++d) {
              const size_t t = static_cast<size_t>(n * g.D + d), tp = static_cast<size_t>(n * g.D + (d ^ 1));
              const T gr = grot[c][o + static_cast<size_t>(d)];
              const T dplus =
                  gplus[c][o + static_cast<size_t>(d)] + gr * cs[t] + grot[c][o + static_cast<size_t>(d ^ 1)] * sn[tp];
              dx[in + static_cast<size_t>(d)] = x[in + static_cast<size_t>(d)] > T(0) ? dplus * scale[c] : T(0);
              dcos[t] += gr * plus(d);
              dsin[t] += gr * plus(d ^ 1);
            }
          }
    return grads_like_saved<T>({&dx, &dcos, &dsin});
  }

 private:
  double k_scale_;
};

}  // namespace

std::vector<Tensor> relu_rope(const Tensor& qkv_hat, const Tensor& rope_cos, const Tensor& rope_sin, double k_scale) {
  const auto fwd = [&](auto t) { return relu_rope_forward<decltype(t)>(qkv_hat, rope_cos, rope_sin, k_scale); };
  return run_and_record<ReluRopeNode>({qkv_hat, rope_cos, rope_sin}, fwd, k_scale);
}

}  // namespace ops
}  // namespace gdncp
