// src/kernels/scan_bidi_ref.cpp — CPU twin of the single-rank bidirectional
// frame scan (docs/design.md §4), forward and backward.
//
// Forward (inclusive) and reverse (strictly later frames) states, per (b, h):
//   Mf_f = g_f (I − P_f) Mf_{f−1} + A_f,          Mf_{−1} = 0
//   Mr_f = g_{f+1} (I − P_{f+1}) Mr_{f+1} + A_{f+1},  Mr_{F−1} = 0
//   Msum = Mf + Mr;  z the same with (Pz, b) and vectors.
// Backward of one step X = g (I − P) X_prev + U with G = dL/dX:
//   dU += G,  dP += −g G X_prevᵀ,  dg += ⟨(I − P)ᵀ G, X_prev⟩,  dL/dX_prev += g (I − P)ᵀ G.
// The forward chain is walked from the last frame back, the reverse chain from
// the first frame on; frame f's transition feeds Mf_f and Mr_{f−1}.
// Packed clips (§4a): at a clip start f > 0 the transition of frame f is cut in
// both chains — Mf_f = A_f and Mr_{f−1} = 0 — so f's P and g get no gradient and
// no adjoint crosses the boundary.
// Gradient rule: dP, dA, dPz, dbz, ddecay are overwritten. The decay gradient
// (a sum of D² terms of both signs) accumulates in a wider type.
#include "kernels/cpu_common.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace cpu {
namespace {

using namespace detail;

// X = g (X_prev − P X_prev) + U for D×D states (tmp: D×D scratch).
template <typename T>
void step_mat(T* X, const T* P, const T* X_prev, const T* U, T g, int64_t D, T* tmp) {
  matmul(tmp, P, X_prev, D);
  for (int64_t i = 0; i < D * D; ++i) X[i] = g * (X_prev[i] - tmp[i]) + U[i];
}

template <typename T>
void step_vec(T* x, const T* P, const T* x_prev, const T* u, T g, int64_t D, T* tmp) {
  matvec(tmp, P, x_prev, D);
  for (int64_t i = 0; i < D; ++i) x[i] = g * (x_prev[i] - tmp[i]) + u[i];
}

// cut(bh, f): frame f > 0 of row bh / H begins a clip. An undefined mask cuts nothing.
class ClipCuts {
 public:
  ClipCuts(const Tensor& clip_starts, const Dims& d) : mask_(clip_starts), H_(d.H), F_(d.F) {}
  bool operator()(int64_t bh, int64_t f) const { return f > 0 && mask_.defined() && mask_[(bh / H_) * F_ + f] != 0; }

 private:
  In<float> mask_;
  int64_t H_, F_;
};

template <typename T>
void scan_bidi_fwd_impl(Tensor& Mf, Tensor& Mr, Tensor& Msum, Tensor& zf, Tensor& zr, Tensor& zsum, const Tensor& P,
                        const Tensor& A, const Tensor& Pz, const Tensor& bz, const Tensor& decay,
                        const Tensor& clip_starts, const Dims& d) {
  const int64_t D = d.D, F = d.F, DD = D * D;
  In<T> iP(P), iA(A), iPz(Pz), ib(bz), ig(decay);
  const ClipCuts cut(clip_starts, d);
  Out<T> oMf(Mf), oMr(Mr), oMs(Msum), ozf(zf), ozr(zr), ozs(zsum);
  std::vector<T> tmp(static_cast<size_t>(DD));

  for (int64_t bh = 0; bh < d.BH(); ++bh) {
    const auto mat = [&](auto& t, int64_t f) { return t.data() + (bh * F + f) * DD; };
    const auto vec = [&](auto& t, int64_t f) { return t.data() + (bh * F + f) * D; };
    const auto g = [&](int64_t f) { return ig[bh * F + f]; };
    // forward chain
    std::copy(mat(iA, 0), mat(iA, 0) + DD, mat(oMf, 0));
    std::copy(vec(ib, 0), vec(ib, 0) + D, vec(ozf, 0));
    for (int64_t f = 1; f < F; ++f) {
      if (cut(bh, f)) {  // Mf_f = A_f
        std::copy(mat(iA, f), mat(iA, f) + DD, mat(oMf, f));
        std::copy(vec(ib, f), vec(ib, f) + D, vec(ozf, f));
        continue;
      }
      step_mat(mat(oMf, f), mat(iP, f), mat(oMf, f - 1), mat(iA, f), g(f), D, tmp.data());
      step_vec(vec(ozf, f), mat(iPz, f), vec(ozf, f - 1), vec(ib, f), g(f), D, tmp.data());
    }
    // reverse chain
    std::fill(mat(oMr, F - 1), mat(oMr, F - 1) + DD, T(0));
    std::fill(vec(ozr, F - 1), vec(ozr, F - 1) + D, T(0));
    for (int64_t f = F - 2; f >= 0; --f) {
      if (cut(bh, f + 1)) {  // frame f ends its clip: Mr_f = 0
        std::fill(mat(oMr, f), mat(oMr, f) + DD, T(0));
        std::fill(vec(ozr, f), vec(ozr, f) + D, T(0));
        continue;
      }
      step_mat(mat(oMr, f), mat(iP, f + 1), mat(oMr, f + 1), mat(iA, f + 1), g(f + 1), D, tmp.data());
      step_vec(vec(ozr, f), mat(iPz, f + 1), vec(ozr, f + 1), vec(ib, f + 1), g(f + 1), D, tmp.data());
    }
    for (int64_t f = 0; f < F; ++f) {
      for (int64_t i = 0; i < DD; ++i) mat(oMs, f)[i] = mat(oMf, f)[i] + mat(oMr, f)[i];
      for (int64_t i = 0; i < D; ++i) vec(ozs, f)[i] = vec(ozf, f)[i] + vec(ozr, f)[i];
    }
  }
  oMf.commit();
  oMr.commit();
  oMs.commit();
  ozf.commit();
  ozr.commit();
  ozs.commit();
}

// Backward of X = g (I − P) X_prev + U (D×D): dU += G, dP += −g G X_prevᵀ,
// W = (I − P)ᵀ G; returns ⟨W, X_prev⟩ = dL/dg. tmp, tmp2: D×D scratch.
template <typename T>
T step_mat_bwd(T* dU, T* dP, T* W, const T* G, const T* P, const T* X_prev, T g, int64_t D, T* tmp, T* tmp2) {
  const int64_t DD = D * D;
  for (int64_t i = 0; i < DD; ++i) dU[i] += G[i];
  matmul_nt(tmp, G, X_prev, D, tmp2);
  for (int64_t i = 0; i < DD; ++i) dP[i] -= g * tmp[i];
  matmul_tn(tmp, P, G, D);
  for (int64_t i = 0; i < DD; ++i) W[i] = G[i] - tmp[i];
  return dot_wide(W, X_prev, DD);
}

template <typename T>
T step_vec_bwd(T* du, T* dP, T* w, const T* G, const T* P, const T* x_prev, T g, int64_t D, T* tmp) {
  for (int64_t i = 0; i < D; ++i) du[i] += G[i];
  for (int64_t i = 0; i < D; ++i) {
    const T gi = g * G[i];
    for (int64_t j = 0; j < D; ++j) dP[i * D + j] -= gi * x_prev[j];
  }
  matvec_t(tmp, P, G, D);
  for (int64_t i = 0; i < D; ++i) w[i] = G[i] - tmp[i];
  return dot_wide(w, x_prev, D);
}

template <typename T>
void scan_bidi_bwd_impl(Tensor& dP, Tensor& dA, Tensor& dPz, Tensor& dbz, Tensor& ddecay, const Tensor& dMsum,
                        const Tensor& dzsum, const Tensor& P, const Tensor& Pz, const Tensor& decay, const Tensor& Mf,
                        const Tensor& Mr, const Tensor& zf, const Tensor& zr, const Tensor& clip_starts,
                        const Dims& d) {
  const int64_t D = d.D, F = d.F, DD = D * D;
  const ClipCuts cut(clip_starts, d);
  In<T> gM(dMsum), gz(dzsum), iP(P), iPz(Pz), ig(decay), iMf(Mf), iMr(Mr), izf(zf), izr(zr);
  Out<T> odP(dP), odA(dA), odPz(dPz), odb(dbz), odg(ddecay);
  const auto buf = [](int64_t n) { return std::vector<T>(static_cast<size_t>(n)); };
  std::vector<T> G = buf(DD), W = buf(DD), tmp = buf(DD), tmp2 = buf(DD), Gz = buf(D), Wz = buf(D);

  for (int64_t bh = 0; bh < d.BH(); ++bh) {
    const auto mat = [&](auto& t, int64_t f) { return t.data() + (bh * F + f) * DD; };
    const auto vec = [&](auto& t, int64_t f) { return t.data() + (bh * F + f) * D; };
    const auto g = [&](int64_t f) { return ig[bh * F + f]; };
    for (int64_t f = 0; f < F; ++f) {
      std::fill(mat(odP, f), mat(odP, f) + DD, T(0));
      std::fill(mat(odA, f), mat(odA, f) + DD, T(0));
      std::fill(mat(odPz, f), mat(odPz, f) + DD, T(0));
      std::fill(vec(odb, f), vec(odb, f) + D, T(0));
      odg[bh * F + f] = T(0);
    }
    // forward chain: G = dL/dMf_f, walked from the last frame back
    std::copy(mat(gM, F - 1), mat(gM, F - 1) + DD, G.begin());
    std::copy(vec(gz, F - 1), vec(gz, F - 1) + D, Gz.begin());
    for (int64_t f = F - 1; f >= 1; --f) {
      if (cut(bh, f)) {  // Mf_f = A_f: the adjoint stops here
        for (int64_t i = 0; i < DD; ++i) mat(odA, f)[i] += G[i];
        for (int64_t i = 0; i < D; ++i) vec(odb, f)[i] += Gz[i];
        std::copy(mat(gM, f - 1), mat(gM, f - 1) + DD, G.begin());
        std::copy(vec(gz, f - 1), vec(gz, f - 1) + D, Gz.begin());
        continue;
      }
      odg[bh * F + f] += step_mat_bwd(mat(odA, f), mat(odP, f), W.data(), G.data(), mat(iP, f), mat(iMf, f - 1), g(f),
                                      D, tmp.data(), tmp2.data());
      odg[bh * F + f] += step_vec_bwd(vec(odb, f), mat(odPz, f), Wz.data(), Gz.data(), mat(iPz, f), vec(izf, f - 1),
                                      g(f), D, tmp.data());
      for (int64_t i = 0; i < DD; ++i) G[i] = mat(gM, f - 1)[i] + g(f) * W[i];
      for (int64_t i = 0; i < D; ++i) Gz[i] = vec(gz, f - 1)[i] + g(f) * Wz[i];
    }
    for (int64_t i = 0; i < DD; ++i) mat(odA, 0)[i] += G[i];  // Mf_0 = A_0
    for (int64_t i = 0; i < D; ++i) vec(odb, 0)[i] += Gz[i];
    // reverse chain: G = dL/dMr_{f−1}; Mr_{f−1} = g_f (I − P_f) Mr_f + A_f
    std::copy(mat(gM, 0), mat(gM, 0) + DD, G.begin());
    std::copy(vec(gz, 0), vec(gz, 0) + D, Gz.begin());
    for (int64_t f = 1; f < F; ++f) {
      if (cut(bh, f)) {  // Mr_{f−1} = 0 depends on nothing: restart from dL/dMr_f = dMsum_f
        if (f + 1 < F) {
          std::copy(mat(gM, f), mat(gM, f) + DD, G.begin());
          std::copy(vec(gz, f), vec(gz, f) + D, Gz.begin());
        }
        continue;
      }
      odg[bh * F + f] += step_mat_bwd(mat(odA, f), mat(odP, f), W.data(), G.data(), mat(iP, f), mat(iMr, f), g(f), D,
                                      tmp.data(), tmp2.data());
      odg[bh * F + f] +=
          step_vec_bwd(vec(odb, f), mat(odPz, f), Wz.data(), Gz.data(), mat(iPz, f), vec(izr, f), g(f), D, tmp.data());
      if (f + 1 < F) {
        for (int64_t i = 0; i < DD; ++i) G[i] = mat(gM, f)[i] + g(f) * W[i];
        for (int64_t i = 0; i < D; ++i) Gz[i] = vec(gz, f)[i] + g(f) * Wz[i];
      }
    }
  }
  odP.commit();
  odA.commit();
  odPz.commit();
  odb.commit();
  odg.commit();
}

}  // namespace

void scan_bidi_fwd(Tensor& Mf, Tensor& Mr, Tensor& Msum, Tensor& zf, Tensor& zr, Tensor& zsum, const Tensor& P,
                   const Tensor& A, const Tensor& Pz, const Tensor& bz, const Tensor& decay, const Tensor& clip_starts,
                   const Dims& d) {
  const char* op = "cpu::scan_bidi_fwd";
  const Shape mat_s = {d.BH(), d.F, d.D, d.D}, vec_s = {d.BH(), d.F, d.D};
  for (const Tensor* t : std::initializer_list<const Tensor*>{&Mf, &Mr, &Msum, &P, &A, &Pz})
    check_shape(*t, mat_s, op, "a (BH, F, D, D) tensor");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&zf, &zr, &zsum, &bz})
    check_shape(*t, vec_s, op, "a (BH, F, D) tensor");
  check_shape(decay, {d.B, d.H, d.F}, op, "decay");
  check_shape_if_defined(clip_starts, {d.B, d.F}, op, "clip_starts");
  if (P.dtype() == DType::f64)
    scan_bidi_fwd_impl<double>(Mf, Mr, Msum, zf, zr, zsum, P, A, Pz, bz, decay, clip_starts, d);
  else
    scan_bidi_fwd_impl<float>(Mf, Mr, Msum, zf, zr, zsum, P, A, Pz, bz, decay, clip_starts, d);
}

void scan_bidi_bwd(Tensor& dP, Tensor& dA, Tensor& dPz, Tensor& dbz, Tensor& ddecay, const Tensor& dMsum,
                   const Tensor& dzsum, const Tensor& P, const Tensor& Pz, const Tensor& decay, const Tensor& Mf,
                   const Tensor& Mr, const Tensor& zf, const Tensor& zr, const Tensor& clip_starts, const Dims& d) {
  const char* op = "cpu::scan_bidi_bwd";
  const Shape mat_s = {d.BH(), d.F, d.D, d.D}, vec_s = {d.BH(), d.F, d.D};
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dP, &dA, &dPz, &dMsum, &P, &Pz, &Mf, &Mr})
    check_shape(*t, mat_s, op, "a (BH, F, D, D) tensor");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dbz, &dzsum, &zf, &zr})
    check_shape(*t, vec_s, op, "a (BH, F, D) tensor");
  check_shape(ddecay, {d.B, d.H, d.F}, op, "ddecay");
  check_shape(decay, {d.B, d.H, d.F}, op, "decay");
  check_shape_if_defined(clip_starts, {d.B, d.F}, op, "clip_starts");
  if (P.dtype() == DType::f64)
    scan_bidi_bwd_impl<double>(dP, dA, dPz, dbz, ddecay, dMsum, dzsum, P, Pz, decay, Mf, Mr, zf, zr, clip_starts, d);
  else
    scan_bidi_bwd_impl<float>(dP, dA, dPz, dbz, ddecay, dMsum, dzsum, P, Pz, decay, Mf, Mr, zf, zr, clip_starts, d);
}

}  // namespace cpu
}  // namespace gdncp
