// src/reference/ops_phase_a.cpp — ops::phase_a, the per-frame matrices (docs/design.md §3),
// one autograd node, plain loops.
//
//   P[i][j] = Σ_s β_s kʳ_s[i] kʳ_s[j],  A[i][j] = Σ_s β_s kʳ_s[i] v_s[j]
//   Pz[i][j] = Σ_s β_s k⁺_s[i] k⁺_s[j],  b[i] = Σ_s β_s k⁺_s[i]
// Backward:
//   dkʳ_s[i] = β_s Σ_j (dP[i][j] + dP[j][i]) kʳ_s[j] + β_s Σ_j dA[i][j] v_s[j]
//   dk⁺_s[i] = β_s Σ_j (dPz[i][j] + dPz[j][i]) k⁺_s[j] + β_s db[i]
//   dv_s[j]  = β_s Σ_i dA[i][j] kʳ_s[i]
//   dβ_s     = Σ_ij dP[i][j] kʳ_s[i] kʳ_s[j] + Σ_ij dA[i][j] kʳ_s[i] v_s[j]
//            + Σ_ij dPz[i][j] k⁺_s[i] k⁺_s[j] + Σ_i db[i] k⁺_s[i]
// Gradient rule: fresh gradients for kr, kp, qkv_hat (v channel only; q and k
// channels zero) and beta (its dtype).
#include <memory>

#include "gdncp/autograd.h"
#include "gdncp/ops.h"
#include "kernels/common/cpu_common.h"

namespace gdncp {
namespace ops {
namespace {

using namespace cpu::detail;

TokenGeometry geometry(const Tensor& kr, const Tensor& kp, const Tensor& qkv_hat, const Tensor& beta, int64_t F,
                       int64_t S) {
  const char* op = "ops::phase_a";
  require_cpu(kr, op, "kr");
  require_cpu(kp, op, "kp");
  require_cpu(qkv_hat, op, "qkv_hat");
  require_cpu(beta, op, "beta");
  const TokenGeometry g = token_pair_geometry(op, kr, "kr", kp, "kp", F, S);
  GDNCP_CHECK(qkv_hat.shape() == Shape({g.B, g.N, 3, g.H, g.D}), op, ": qkv_hat must be (B, N, 3, H, D), got ",
              qkv_hat.str());
  GDNCP_CHECK(beta.shape() == Shape({g.B, g.H, F, S}), op, ": beta must be (B, H, F, S), got ", beta.str());
  return g;
}

template <typename T>
struct Loaded {
  std::vector<T> kr, kp, x, beta;
};

template <typename T>
Loaded<T> load(const TokenGeometry& g, const Tensor& kr, const Tensor& kp, const Tensor& qkv_hat, const Tensor& beta) {
  return {values<T>(kr, kr.numel()), values<T>(kp, kp.numel()), values<T>(qkv_hat, qkv_hat.numel()),
          values<T>(beta, g.B * g.H * g.F * g.S)};
}

// Row (b, n, h) of the v channel of qkv_hat.
inline size_t v_row(const TokenGeometry& g, int64_t b, int64_t n, int64_t h) {
  return static_cast<size_t>((((b * g.N + n) * 3 + 2) * g.H + h) * g.D);
}

template <typename T>
std::vector<Tensor> phase_a_forward(const Tensor& kr_t, const Tensor& kp_t, const Tensor& qkv_hat, const Tensor& beta_t,
                                    int64_t F, int64_t S) {
  const TokenGeometry g = geometry(kr_t, kp_t, qkv_hat, beta_t, F, S);
  const Loaded<T> in = load<T>(g, kr_t, kp_t, qkv_hat, beta_t);
  const int64_t D = g.D, BH = g.B * g.H;
  std::vector<T> P(static_cast<size_t>(BH * F * D * D), T(0)), A(P), Pz(P), bv(static_cast<size_t>(BH * F * D), T(0));
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < g.H; ++h)
      for (int64_t f = 0; f < F; ++f) {
        const int64_t bhf = (b * g.H + h) * F + f;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t n = f * S + s;
          const T be = in.beta[static_cast<size_t>(bhf * S + s)];
          const T* kr = &in.kr[g.row(b, n, h)];
          const T* kp = &in.kp[g.row(b, n, h)];
          const T* v = &in.x[v_row(g, b, n, h)];
          for (int64_t i = 0; i < D; ++i) {
            for (int64_t j = 0; j < D; ++j) {
              const size_t e = static_cast<size_t>((bhf * D + i) * D + j);
              P[e] += be * kr[i] * kr[j];
              A[e] += be * kr[i] * v[j];
              Pz[e] += be * kp[i] * kp[j];
            }
            bv[static_cast<size_t>(bhf * D + i)] += be * kp[i];
          }
        }
      }
  const DType ct = dtype_of<T>::value;
  return {tensor_from(P, {BH, F, D, D}, ct), tensor_from(A, {BH, F, D, D}, ct), tensor_from(Pz, {BH, F, D, D}, ct),
          tensor_from(bv, {BH, F, D}, ct)};
}

class PhaseANode : public autograd::Node {
 public:
  PhaseANode(int64_t F, int64_t S) : F_(F), S_(S) {}
  const char* name() const override { return "ops::phase_a"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    return saved(0).dtype() == DType::f64 ? run<double>(grads) : run<float>(grads);
  }

 private:
  template <typename T>
  std::vector<Tensor> run(const std::vector<Tensor>& grads) {
    const Tensor &kr_t = saved(0), &kp_t = saved(1), &qkv_hat = saved(2), &beta_t = saved(3);
    const TokenGeometry g = geometry(kr_t, kp_t, qkv_hat, beta_t, F_, S_);
    const Loaded<T> in = load<T>(g, kr_t, kp_t, qkv_hat, beta_t);
    const int64_t D = g.D, BH = g.B * g.H, F = g.F, S = g.S;
    const std::vector<T> dP = values<T>(grads[0], BH * F * D * D), dA = values<T>(grads[1], BH * F * D * D),
                         dPz = values<T>(grads[2], BH * F * D * D), db = values<T>(grads[3], BH * F * D);
    std::vector<T> dkr(in.kr.size(), T(0)), dkp(in.kp.size(), T(0)), dx(in.x.size(), T(0)), dbeta(in.beta.size(), T(0));
    for (int64_t b = 0; b < g.B; ++b)
      for (int64_t h = 0; h < g.H; ++h)
        for (int64_t f = 0; f < F; ++f) {
          const int64_t bhf = (b * g.H + h) * F + f;
          const auto m = [&](const std::vector<T>& M, int64_t i, int64_t j) {
            return M[static_cast<size_t>((bhf * D + i) * D + j)];
          };
          for (int64_t s = 0; s < S; ++s) {
            const int64_t n = f * S + s;
            const T be = in.beta[static_cast<size_t>(bhf * S + s)];
            const T* kr = &in.kr[g.row(b, n, h)];
            const T* kp = &in.kp[g.row(b, n, h)];
            const T* v = &in.x[v_row(g, b, n, h)];
            T* gkr = &dkr[g.row(b, n, h)];
            T* gkp = &dkp[g.row(b, n, h)];
            T* gv = &dx[v_row(g, b, n, h)];
            T gb = T(0);
            for (int64_t i = 0; i < D; ++i) {
              for (int64_t j = 0; j < D; ++j) {
                gkr[i] += be * (m(dP, i, j) + m(dP, j, i)) * kr[j] + be * m(dA, i, j) * v[j];
                gkp[i] += be * (m(dPz, i, j) + m(dPz, j, i)) * kp[j];
                gv[j] += be * m(dA, i, j) * kr[i];
                gb += m(dP, i, j) * kr[i] * kr[j] + m(dA, i, j) * kr[i] * v[j] + m(dPz, i, j) * kp[i] * kp[j];
              }
              const T dbi = db[static_cast<size_t>(bhf * D + i)];
              gkp[i] += be * dbi;
              gb += dbi * kp[i];
            }
            dbeta[static_cast<size_t>(bhf * S + s)] = gb;
          }
        }
    std::vector<Tensor> out(4);
    if (needs_input_grad(0)) out[0] = tensor_from(dkr, kr_t.shape(), kr_t.dtype());
    if (needs_input_grad(1)) out[1] = tensor_from(dkp, kp_t.shape(), kp_t.dtype());
    if (needs_input_grad(2)) out[2] = tensor_from(dx, qkv_hat.shape(), qkv_hat.dtype());
    if (needs_input_grad(3)) out[3] = tensor_from(dbeta, beta_t.shape(), beta_t.dtype());
    return out;
  }
  int64_t F_, S_;
};

}  // namespace

std::vector<Tensor> phase_a(const Tensor& kr, const Tensor& kp, const Tensor& qkv_hat, const Tensor& beta, int64_t F,
                            int64_t S) {
  std::vector<Tensor> out = kr.dtype() == DType::f64 ? phase_a_forward<double>(kr, kp, qkv_hat, beta, F, S)
                                                     : phase_a_forward<float>(kr, kp, qkv_hat, beta, F, S);
  const std::vector<Tensor> inputs = {kr, kp, qkv_hat, beta};
  if (autograd::should_record(inputs)) {
    auto node = std::make_shared<PhaseANode>(F, S);
    for (const Tensor& t : inputs) node->save(t);
    autograd::record(node, inputs, out);
  }
  return out;
}

}  // namespace ops
}  // namespace gdncp
