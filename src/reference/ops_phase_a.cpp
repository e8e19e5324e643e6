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
#include "reference/ops_common.h"

namespace gdncp {
namespace ops {
namespace {

using namespace cpu::detail;
using namespace ops::detail;

TokenGeometry geometry(const Tensor& kr, const Tensor& kp, const Tensor& qkv_hat, const Tensor& beta, int64_t F,
                       int64_t S) {
  const char* op = "ops::phase_a";
  require_cpu_inputs(op, {{kr, "kr"}, {kp, "kp"}, {qkv_hat, "qkv_hat"}, {beta, "beta"}});
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

// One token s of frame bhf = (b·H + h)·F + f: its rows r of kr/kp and vr of
// the v channel, and its beta.
template <typename T>
struct Token {
  int64_t bhf, s;
  size_t r, vr;
  T be;
  const T *kr, *kp, *v;
};

// Calls fn(token) for every token, frame by frame (b, h, f outer), s inner.
template <typename T, typename Fn>
void for_each_token(const TokenGeometry& g, const Loaded<T>& in, Fn&& fn) {
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < g.H; ++h)
      for (int64_t f = 0; f < g.F; ++f) {
        const int64_t bhf = (b * g.H + h) * g.F + f;
        for (int64_t s = 0; s < g.S; ++s) {
          const int64_t n = f * g.S + s;
          const size_t r = g.row(b, n, h), vr = v_row(g, b, n, h);
          fn(Token<T>{bhf, s, r, vr, in.beta[static_cast<size_t>(bhf * g.S + s)], &in.kr[r], &in.kp[r], &in.x[vr]});
        }
      }
}

template <typename T>
std::vector<Tensor> phase_a_forward(const Tensor& kr_t, const Tensor& kp_t, const Tensor& qkv_hat, const Tensor& beta_t,
                                    int64_t F, int64_t S) {
  const TokenGeometry g = geometry(kr_t, kp_t, qkv_hat, beta_t, F, S);
  const Loaded<T> in = load<T>(g, kr_t, kp_t, qkv_hat, beta_t);
  const int64_t D = g.D, BH = g.B * g.H;
  std::vector<T> P(static_cast<size_t>(BH * F * D * D), T(0)), A(P), Pz(P), bv(static_cast<size_t>(BH * F * D), T(0));
  for_each_token(g, in, [&](const Token<T>& t) {
    for (int64_t i = 0; i < D; ++i) {
      for (int64_t j = 0; j < D; ++j) {
        const size_t e = static_cast<size_t>((t.bhf * D + i) * D + j);
        P[e] += t.be * t.kr[i] * t.kr[j];
        A[e] += t.be * t.kr[i] * t.v[j];
        Pz[e] += t.be * t.kp[i] * t.kp[j];
      }
      bv[static_cast<size_t>(t.bhf * D + i)] += t.be * t.kp[i];
    }
  });
  const DType ct = dtype_of<T>::value;
  return {tensor_from(P, {BH, F, D, D}, ct), tensor_from(A, {BH, F, D, D}, ct), tensor_from(Pz, {BH, F, D, D}, ct),
          tensor_from(bv, {BH, F, D}, ct)};
}

class PhaseANode : public FramesNode<PhaseANode> {
 public:
  PhaseANode(int64_t F, int64_t S) : FramesNode("ops::phase_a", F, S) {}

  template <typename T>
  std::vector<Tensor> run(const std::vector<Tensor>& grads) {
    const Tensor &kr_t = saved(0), &kp_t = saved(1), &qkv_hat = saved(2), &beta_t = saved(3);
    const TokenGeometry g = geometry(kr_t, kp_t, qkv_hat, beta_t, F_, S_);
    const Loaded<T> in = load<T>(g, kr_t, kp_t, qkv_hat, beta_t);
    const int64_t D = g.D, BH = g.B * g.H, F = g.F, S = g.S;
    const std::vector<T> dP = values<T>(grads[0], BH * F * D * D), dA = values<T>(grads[1], BH * F * D * D),
                         dPz = values<T>(grads[2], BH * F * D * D), db = values<T>(grads[3], BH * F * D);
    std::vector<T> dkr(in.kr.size(), T(0)), dkp(in.kp.size(), T(0)), dx(in.x.size(), T(0)), dbeta(in.beta.size(), T(0));
    for_each_token(g, in, [&](const Token<T>& t) {
      const auto m = [&](const std::vector<T>& M, int64_t i, int64_t j) {
        return M[static_cast<size_t>((t.bhf * D + i) * D + j)];
      };
      const T be = t.be, *kr = t.kr, *kp = t.kp, *v = t.v;
      T* gkr = &dkr[t.r];
      T* gkp = &dkp[t.r];
      T* gv = &dx[t.vr];
      T gb = T(0);
      for (int64_t i = 0; i < D; ++i) {
        for (int64_t j = 0; j < D; ++j) {
          gkr[i] += be * (m(dP, i, j) + m(dP, j, i)) * kr[j] + be * m(dA, i, j) * v[j];
          gkp[i] += be * (m(dPz, i, j) + m(dPz, j, i)) * kp[j];
          gv[j] += be * m(dA, i, j) * kr[i];
          gb += m(dP, i, j) * kr[i] * kr[j] + m(dA, i, j) * kr[i] * v[j] + m(dPz, i, j) * kp[i] * kp[j];
        }
        const T dbi = db[static_cast<size_t>(t.bhf * D + i)];
        gkp[i] += be * dbi;
        gb += dbi * kp[i];
      }
      dbeta[static_cast<size_t>(t.bhf * S + t.s)] = gb;
    });
    return grads_like_saved<T>({&dkr, &dkp, &dx, &dbeta});
  }
};

}  // namespace

std::vector<Tensor> phase_a(const Tensor& kr, const Tensor& kp, const Tensor& qkv_hat, const Tensor& beta, int64_t F,
                            int64_t S) {
  const auto fwd = [&](auto t) { return phase_a_forward<decltype(t)>(kr, kp, qkv_hat, beta, F, S); };
  return run_and_record<PhaseANode>({kr, kp, qkv_hat, beta}, fwd, F, S);
}

}  // namespace ops
}  // namespace gdncp
