// src/reference/ops_bidi_scan.cpp — ops::bidi_scan, the single-rank bidirectional
// frame scan (docs/design.md §4), one autograd node, plain loops.
//
// With the transition T_f = g_f (I − P_f) (and Tz_f = g_f (I − Pz_f)):
//   X_f = T_f X_{f−1} + A_f (X_{−1} = 0),   Y_f = T_{f+1} Y_{f+1} + A_{f+1} (Y_{F−1} = 0),   M = X + Y
// Backward: the gradients G of X (walked from the last frame) and R of Y
// (walked from the first) give
//   dA_f += G_f,  dT_f += G_f X_{f−1}ᵀ,  G_{f−1} = dM_{f−1} + T_fᵀ G_f
//   dA_{f+1} += R_f,  dT_{f+1} += R_f Y_{f+1}ᵀ,  R_{f+1} = dM_{f+1} + T_{f+1}ᵀ R_f
// and then dP_f = −g_f dT_f, dg_f = Σ_ij dT_f[i][j] (I − P_f)[i][j] (z likewise).
// A clip start f (docs/design.md §4a) drops T_f from X_f and the whole step Y_{f−1} (= 0),
// so neither T_f nor anything across the boundary gets a gradient.
// Gradient rule: fresh gradients for P, A, Pz, b (their dtype) and decay (its dtype).
#include <utility>

#include "reference/ops_common.h"

namespace gdncp {
namespace ops {
namespace {

using namespace cpu::detail;
using namespace ops::detail;

struct Geometry {
  int64_t BH, F, D;
};

Geometry geometry(const Tensor& P, const Tensor& A, const Tensor& Pz, const Tensor& b, const Tensor& decay) {
  const char* op = "ops::bidi_scan";
  require_cpu_inputs(op, {{P, "P"}, {A, "A"}, {Pz, "Pz"}, {b, "b"}, {decay, "decay"}});
  GDNCP_CHECK(P.dim() == 4 && P.size(2) == P.size(3), op, ": P must be (B·H, F, D, D), got ", P.str());
  const Geometry g{P.size(0), P.size(1), P.size(2)};
  GDNCP_CHECK(A.shape() == P.shape() && Pz.shape() == P.shape(), op, ": A and Pz must have P's shape, got ", A.str(),
              " and ", Pz.str());
  GDNCP_CHECK(b.shape() == Shape({g.BH, g.F, g.D}), op, ": b must be (B·H, F, D), got ", b.str());
  GDNCP_CHECK(decay.dim() == 3 && decay.size(2) == g.F && decay.numel() == g.BH * g.F, op,
              ": decay must be (B, H, F) with B·H = ", g.BH, ", F = ", g.F, ", got ", decay.str());
  return g;
}

// cut[bh·F + f]: frame f > 0 of row bh / H begins a clip.
std::vector<char> clip_cuts(const Tensor& clip_starts, const Tensor& decay, const Geometry& g) {
  const char* op = "ops::bidi_scan";
  std::vector<char> cut(static_cast<size_t>(g.BH * g.F), 0);
  if (!clip_starts.defined()) return cut;
  const int64_t B = decay.size(0), H = decay.size(1);
  require_cpu(clip_starts, op, "clip_starts");
  GDNCP_CHECK(clip_starts.shape() == Shape({B, g.F}), op, ": clip_starts must be (B, F) = (", B, ", ", g.F, "), got ",
              clip_starts.str());
  GDNCP_CHECK(clip_starts.dtype() == DType::f32, op, ": clip_starts must be f32, got ", clip_starts.str());
  const std::vector<double> c = clip_starts.to_vector();
  for (int64_t bh = 0; bh < g.BH; ++bh)
    for (int64_t f = 1; f < g.F; ++f)
      cut[static_cast<size_t>(bh * g.F + f)] = c[static_cast<size_t>(bh / H * g.F + f)] != 0;
  return cut;
}

// Dense helpers on n×m row-major blocks held in vectors (m = 1 for vectors).
// out[i·cols + j] += Σ_k a[i·a_i + k·a_k] · x[k·x_k + j·x_j], i < rows, j < cols, k < K.
template <typename T>
void strided_mul_add(T* out, const T* a, int64_t a_i, int64_t a_k, const T* x, int64_t x_k, int64_t x_j, int64_t rows,
                     int64_t cols, int64_t K) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      T s = T(0);
      for (int64_t k = 0; k < K; ++k) s += a[i * a_i + k * a_k] * x[k * x_k + j * x_j];
      out[i * cols + j] += s;
    }
}
template <typename T>
void mul_add(T* out, const T* a, const T* x, int64_t D, int64_t m) {  // out += a·x, a D×D, x D×m
  strided_mul_add(out, a, D, 1, x, m, 1, D, m, D);
}
template <typename T>
void tmul_add(T* out, const T* a, const T* x, int64_t D, int64_t m) {  // out += aᵀ·x
  strided_mul_add(out, a, 1, D, x, m, 1, D, m, D);
}
template <typename T>
void outer_add(T* out, const T* a, const T* x, int64_t D, int64_t m) {  // out += a·xᵀ, a and x D×m
  strided_mul_add(out, a, m, 1, x, 1, m, D, D, m);
}

// One stream (KV with m = D, Z with m = 1) of one (b, h): the transitions T_f,
// the clip starts and the states X (forward) and Y (reverse).
template <typename T>
struct Chain {
  int64_t F, D, m;
  const char* cut;             // F flags
  std::vector<T> trans, X, Y;  // F·D·D, F·D·m, F·D·m

  Chain(const T* P, const T* U, const T* g, const char* cut_, int64_t F_, int64_t D_, int64_t m_)
      : F(F_),
        D(D_),
        m(m_),
        cut(cut_),
        trans(static_cast<size_t>(F_ * D_ * D_)),
        X(static_cast<size_t>(F_ * D_ * m_), T(0)),
        Y(X) {
    const int64_t DD = D * D, Dm = D * m;
    for (int64_t f = 0; f < F; ++f)
      for (int64_t i = 0; i < D; ++i)
        for (int64_t j = 0; j < D; ++j)
          trans[static_cast<size_t>(f * DD + i * D + j)] = g[f] * ((i == j ? T(1) : T(0)) - P[f * DD + i * D + j]);
    for (int64_t f = 0; f < F; ++f) {
      T* x = &X[static_cast<size_t>(f * Dm)];
      for (int64_t e = 0; e < Dm; ++e) x[e] = U[f * Dm + e];
      if (f > 0 && !cut[f])
        mul_add(x, &trans[static_cast<size_t>(f * DD)], &X[static_cast<size_t>((f - 1) * Dm)], D, m);
    }
    for (int64_t f = F - 2; f >= 0; --f) {
      if (cut[f + 1]) continue;  // Y_f stays 0: frame f ends its clip
      T* y = &Y[static_cast<size_t>(f * Dm)];
      for (int64_t e = 0; e < Dm; ++e) y[e] = U[(f + 1) * Dm + e];
      mul_add(y, &trans[static_cast<size_t>((f + 1) * DD)], &Y[static_cast<size_t>((f + 1) * Dm)], D, m);
    }
  }

  // Given dM (F·D·m) writes dP (F·D·D), dU (F·D·m) and adds to dg (F).
  void backward(const T* dM, const T* P, const T* g, T* dP, T* dU, T* dg) const {
    const int64_t DD = D * D, Dm = D * m;
    std::vector<T> dT(static_cast<size_t>(F * DD), T(0)), G(static_cast<size_t>(Dm)), next(G);
    for (int64_t e = 0; e < F * Dm; ++e) dU[e] = T(0);
    // forward chain
    for (int64_t e = 0; e < Dm; ++e) G[static_cast<size_t>(e)] = dM[(F - 1) * Dm + e];
    for (int64_t f = F - 1; f >= 0; --f) {
      for (int64_t e = 0; e < Dm; ++e) dU[f * Dm + e] += G[static_cast<size_t>(e)];
      if (f == 0) break;
      for (int64_t e = 0; e < Dm; ++e) next[static_cast<size_t>(e)] = dM[(f - 1) * Dm + e];
      if (!cut[f]) {
        outer_add(&dT[static_cast<size_t>(f * DD)], G.data(), &X[static_cast<size_t>((f - 1) * Dm)], D, m);
        tmul_add(next.data(), &trans[static_cast<size_t>(f * DD)], G.data(), D, m);
      }
      G.swap(next);
    }
    // reverse chain: G = dL/dY_f
    for (int64_t e = 0; e < Dm; ++e) G[static_cast<size_t>(e)] = dM[e];
    for (int64_t f = 0; f + 1 < F; ++f) {
      for (int64_t e = 0; e < Dm; ++e) next[static_cast<size_t>(e)] = dM[(f + 1) * Dm + e];
      if (!cut[f + 1]) {
        for (int64_t e = 0; e < Dm; ++e) dU[(f + 1) * Dm + e] += G[static_cast<size_t>(e)];
        outer_add(&dT[static_cast<size_t>((f + 1) * DD)], G.data(), &Y[static_cast<size_t>((f + 1) * Dm)], D, m);
        tmul_add(next.data(), &trans[static_cast<size_t>((f + 1) * DD)], G.data(), D, m);
      }
      G.swap(next);
    }
    // T_f = g_f (I − P_f); dg sums D² terms of both signs, so it accumulates wider.
    for (int64_t f = 0; f < F; ++f) {
      typename Wider<T>::type s = 0;
      for (int64_t i = 0; i < D; ++i)
        for (int64_t j = 0; j < D; ++j) {
          const int64_t e = f * DD + i * D + j;
          dP[e] = -g[f] * dT[static_cast<size_t>(e)];
          s += static_cast<typename Wider<T>::type>(dT[static_cast<size_t>(e)]) * ((i == j ? T(1) : T(0)) - P[e]);
        }
      dg[f] += static_cast<T>(s);
    }
  }
};

template <typename T>
std::vector<Tensor> bidi_scan_forward(const Tensor& P_t, const Tensor& A_t, const Tensor& Pz_t, const Tensor& b_t,
                                      const Tensor& decay, const Tensor& clip_starts) {
  const Geometry g = geometry(P_t, A_t, Pz_t, b_t, decay);
  const std::vector<char> cut = clip_cuts(clip_starts, decay, g);
  const int64_t F = g.F, D = g.D;
  const std::vector<T> P = values<T>(P_t, P_t.numel()), A = values<T>(A_t, A_t.numel()),
                       Pz = values<T>(Pz_t, Pz_t.numel()), b = values<T>(b_t, b_t.numel()),
                       gd = values<T>(decay, decay.numel());
  std::vector<T> M(P.size()), z(b.size());
  for (int64_t bh = 0; bh < g.BH; ++bh) {
    const char* c = &cut[static_cast<size_t>(bh * F)];
    const Chain<T> kv(&P[static_cast<size_t>(bh * F * D * D)], &A[static_cast<size_t>(bh * F * D * D)],
                      &gd[static_cast<size_t>(bh * F)], c, F, D, D);
    const Chain<T> zc(&Pz[static_cast<size_t>(bh * F * D * D)], &b[static_cast<size_t>(bh * F * D)],
                      &gd[static_cast<size_t>(bh * F)], c, F, D, 1);
    for (size_t e = 0; e < kv.X.size(); ++e) M[static_cast<size_t>(bh * F * D * D) + e] = kv.X[e] + kv.Y[e];
    for (size_t e = 0; e < zc.X.size(); ++e) z[static_cast<size_t>(bh * F * D) + e] = zc.X[e] + zc.Y[e];
  }
  const DType ct = dtype_of<T>::value;
  return {tensor_from(M, P_t.shape(), ct), tensor_from(z, b_t.shape(), ct)};
}

class BidiScanNode : public RefNode<BidiScanNode> {
 public:
  explicit BidiScanNode(Tensor clip_starts) : RefNode("ops::bidi_scan"), clip_starts_(std::move(clip_starts)) {}

  template <typename T>
  std::vector<Tensor> run(const std::vector<Tensor>& grads) {
    const Tensor &P_t = saved(0), &A_t = saved(1), &Pz_t = saved(2), &b_t = saved(3), &decay = saved(4);
    const Geometry g = geometry(P_t, A_t, Pz_t, b_t, decay);
    const std::vector<char> cut = clip_cuts(clip_starts_, decay, g);
    const int64_t F = g.F, D = g.D, FDD = F * D * D, FD = F * D;
    const std::vector<T> P = values<T>(P_t, P_t.numel()), A = values<T>(A_t, A_t.numel()),
                         Pz = values<T>(Pz_t, Pz_t.numel()), b = values<T>(b_t, b_t.numel()),
                         gd = values<T>(decay, decay.numel());
    const std::vector<T> dM = values<T>(grads[0], P_t.numel()), dz = values<T>(grads[1], b_t.numel());
    std::vector<T> dP(P.size()), dA(A.size()), dPz(Pz.size()), db(b.size()), dg(gd.size(), T(0));
    for (int64_t bh = 0; bh < g.BH; ++bh) {
      const size_t m0 = static_cast<size_t>(bh * FDD), v0 = static_cast<size_t>(bh * FD),
                   g0 = static_cast<size_t>(bh * F);
      const Chain<T> kv(&P[m0], &A[m0], &gd[g0], &cut[g0], F, D, D);
      const Chain<T> zc(&Pz[m0], &b[v0], &gd[g0], &cut[g0], F, D, 1);
      kv.backward(&dM[m0], &P[m0], &gd[g0], &dP[m0], &dA[m0], &dg[g0]);
      zc.backward(&dz[v0], &Pz[m0], &gd[g0], &dPz[m0], &db[v0], &dg[g0]);
    }
    return grads_like_saved<T>({&dP, &dA, &dPz, &db, &dg});
  }

 private:
  Tensor clip_starts_;
};

}  // namespace

std::vector<Tensor> bidi_scan(const Tensor& P, const Tensor& A, const Tensor& Pz, const Tensor& b, const Tensor& decay,
                              const Tensor& clip_starts) {
  const auto fwd = [&](auto t) { return bidi_scan_forward<decltype(t)>(P, A, Pz, b, decay, clip_starts); };
  return run_and_record<BidiScanNode>({P, A, Pz, b, decay}, fwd, clip_starts);
}

}  // namespace ops
}  // namespace gdncp
