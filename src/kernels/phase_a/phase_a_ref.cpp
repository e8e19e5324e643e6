// src/kernels/phase_a/phase_a_ref.cpp — CPU twin of phase A (docs/design.md §3) with the k prep
// (docs/design.md §2) fused into the load.
//
// Forward, per (b, h, frame f), the frame's S tokens as rows:
//   k̂ = k·r·w,  k⁺ = relu(k̂)·k_scale,  kʳ = rope(k⁺)
//   P_f = Σ_s β_s kʳ_s kʳ_sᵀ,  A_f = Σ_s β_s kʳ_s v_sᵀ,  Pz_f = Σ_s β_s k⁺_s k⁺_sᵀ,  b_f = Σ_s β_s k⁺_s
// Backward, per token s (Ps = dP + dPᵀ, Pzs = dPz + dPzᵀ):
//   dkʳ = β (Ps kʳ + dA v),   dv = β dAᵀ kʳ,   dk⁺ = β (Pzs k⁺ + db) + unrope(dkʳ)
//   dβ = ½ kʳᵀ Ps kʳ + kʳᵀ dA v + ½ k⁺ᵀ Pzs k⁺ + k⁺ᵀ db,   dk̂ = dk⁺·k_scale·[k̂ > 0]
// Gradient rule: dk_hat, the v channel of dqkv and dbeta are overwritten
// (channels 0 and 1 of dqkv are left untouched for rms_norm_bwd). dk_hat is the
// compute dtype or bf16: computed in T, rounded on commit when bf16.
#include "kernels/common/cpu_common.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace cpu {
namespace {

using namespace detail;

// The inputs of one (b, h) pair that every frame reads.
template <typename T>
struct KPrep {
  const T* x;  // qkv
  const T* r;  // rstd
  const T* w;  // k_norm_w or null
  const T* cos;
  const T* sin;
  int64_t N, C, D;
  T k_scale;

  // Token n of batch b, head h: k̂, k⁺, kʳ (any may be null) and v.
  void load(int64_t b, int64_t n, int64_t h, T* khat, T* kplus, T* krot, T* v, T* scratch) const {
    const T* k = x + qkv_offset(b, n, 1, N, C) + h * D;
    const T rk = r[(b * N + n) * 2 + 1];
    prep_row(khat, kplus, krot, k, rk, w ? w + h * D : nullptr, k_scale, cos + n * D, sin + n * D, D, scratch);
    const T* vsrc = x + qkv_offset(b, n, 2, N, C) + h * D;
    for (int64_t i = 0; i < D; ++i) v[i] = vsrc[i];
  }
};

template <typename T>
void phase_a_fwd_impl(Tensor& P, Tensor& A, Tensor& Pz, Tensor& bz, const Tensor& qkv, const Tensor& rstd,
                      const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta,
                      const Dims& d, double k_scale) {
  const int64_t D = d.D, S = d.S, F = d.F, DD = D * D;
  In<T> x(qkv), r(rstd), w(k_norm_w), cs(rope_cos), sn(rope_sin), bt(beta);
  Out<T> oP(P), oA(A), oPz(Pz), ob(bz);
  const KPrep<T> prep{x.data(), r.data(), w.data(), cs.data(), sn.data(), d.N(), d.C(), D, static_cast<T>(k_scale)};
  // The frame's S rows of k⁺, kʳ, v, loaded once; each output row i then
  // accumulates Σ_s over rows that stay in cache.
  const size_t SD = static_cast<size_t>(S * D);
  std::vector<T> Kp(SD), Kr(SD), V(SD), bs(static_cast<size_t>(S)), scratch(static_cast<size_t>(D));

  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h) {
      const int64_t bh = b * d.H + h;
      for (int64_t f = 0; f < F; ++f) {
        for (int64_t s = 0; s < S; ++s) {
          prep.load(b, f * S + s, h, nullptr, &Kp[s * D], &Kr[s * D], &V[s * D], scratch.data());
          bs[s] = bt[(bh * F + f) * S + s];
        }
        T* Pf = oP.data() + (bh * F + f) * DD;
        T* Af = oA.data() + (bh * F + f) * DD;
        T* Pzf = oPz.data() + (bh * F + f) * DD;
        T* bf = ob.data() + (bh * F + f) * D;
        for (int64_t i = 0; i < DD; ++i) Pf[i] = Af[i] = Pzf[i] = T(0);
        for (int64_t i = 0; i < D; ++i) {
          T bsum = T(0);
          for (int64_t s = 0; s < S; ++s) {
            const T bkr = bs[s] * Kr[s * D + i], bkp = bs[s] * Kp[s * D + i];
            axpy(Pf + i * D, bkr, &Kr[s * D], D);
            axpy(Af + i * D, bkr, &V[s * D], D);
            axpy(Pzf + i * D, bkp, &Kp[s * D], D);
            bsum += bkp;
          }
          bf[i] = bsum;
        }
      }
    }
  oP.commit();
  oA.commit();
  oPz.commit();
  ob.commit();
}

template <typename T>
void phase_a_bwd_impl(Tensor& dk_hat, Tensor& dqkv, Tensor& dbeta, const Tensor& dP, const Tensor& dA,
                      const Tensor& dPz, const Tensor& dbz, const Tensor& qkv, const Tensor& rstd,
                      const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta,
                      const Dims& d, double k_scale) {
  const int64_t D = d.D, S = d.S, F = d.F, N = d.N(), C = d.C(), H = d.H, DD = D * D;
  In<T> x(qkv), r(rstd), w(k_norm_w), cs(rope_cos), sn(rope_sin), bt(beta);
  In<T> gP(dP), gA(dA), gPz(dPz), gb(dbz);
  Out<T> odk(dk_hat), odbeta(dbeta);
  std::vector<T> dv(static_cast<size_t>(d.B * N * C));
  const KPrep<T> prep{x.data(), r.data(), w.data(), cs.data(), sn.data(), N, C, D, static_cast<T>(k_scale)};
  const auto vec = [D] { return std::vector<T>(static_cast<size_t>(D)); };
  std::vector<T> kh = vec(), kp = vec(), kr = vec(), v = vec(), scratch = vec();
  std::vector<T> u = vec(), av = vec(), uz = vec(), dkr = vec(), dkp = vec();
  std::vector<T> Ps(static_cast<size_t>(DD)), Pzs(static_cast<size_t>(DD)), dAt(static_cast<size_t>(DD));

  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t bh = b * H + h;
      for (int64_t f = 0; f < F; ++f) {
        const T* dPf = gP.data() + (bh * F + f) * DD;
        const T* dAf = gA.data() + (bh * F + f) * DD;
        const T* dPzf = gPz.data() + (bh * F + f) * DD;
        const T* dbf = gb.data() + (bh * F + f) * D;
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) {
            Ps[i * D + j] = dPf[i * D + j] + dPf[j * D + i];
            Pzs[i * D + j] = dPzf[i * D + j] + dPzf[j * D + i];
          }
        transpose(dAt.data(), dAf, D);
        for (int64_t s = 0; s < S; ++s) {
          const int64_t n = f * S + s;
          prep.load(b, n, h, kh.data(), kp.data(), kr.data(), v.data(), scratch.data());
          const T beta_s = bt[(bh * F + f) * S + s];
          matvec_t(u.data(), Ps.data(), kr.data(), D);        // Ps kʳ (Ps is symmetric)
          matvec_from_t(av.data(), dAt.data(), v.data(), D);  // dA v
          matvec_t(uz.data(), Pzs.data(), kp.data(), D);      // Pzs k⁺
          T* dvs = dv.data() + (b * N + n) * C + h * D;
          matvec_t(dvs, dAf, kr.data(), D);  // dAᵀ kʳ
          for (int64_t i = 0; i < D; ++i) {
            dvs[i] *= beta_s;
            dkr[i] = beta_s * (u[i] + av[i]);
            dkp[i] = beta_s * (uz[i] + dbf[i]);
          }
          odbeta[(bh * F + f) * S + s] = T(0.5) * dot(kr.data(), u.data(), D) + dot(kr.data(), av.data(), D) +
                                         T(0.5) * dot(kp.data(), uz.data(), D) + dot(kp.data(), dbf, D);
          unrope_add(dkp.data(), dkr.data(), cs.data() + n * D, sn.data() + n * D, D);
          relu_scale_bwd(odk.data() + (b * N + n) * C + h * D, dkp.data(), kh.data(), static_cast<T>(k_scale), D);
        }
      }
    }
  odk.commit();
  odbeta.commit();
  store_qkv_channel(dqkv, 2, dv, d.B, N, C);
}

}  // namespace

void phase_a_fwd(Tensor& P, Tensor& A, Tensor& Pz, Tensor& bz, const Tensor& qkv, const Tensor& rstd,
                 const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta,
                 const Dims& d, double k_scale, MathMode mode) {
  const char* op = "cpu::phase_a_fwd";
  const Shape mat_s = {d.BH(), d.F, d.D, d.D}, vec_s = {d.BH(), d.F, d.D};
  for (const Tensor* t : std::initializer_list<const Tensor*>{&P, &A, &Pz}) check_shape(*t, mat_s, op, "P/A/Pz");
  check_shape(bz, vec_s, op, "bz");
  check_prep_inputs(qkv, rstd, k_norm_w, "k_norm_w", rope_cos, rope_sin, d, op);
  check_shape(beta, {d.B, d.H, d.F, d.S}, op, "beta");
  (void)mode;  // the CPU computes exactly in the compute dtype
  if (qkv.dtype() == DType::f64)
    phase_a_fwd_impl<double>(P, A, Pz, bz, qkv, rstd, k_norm_w, rope_cos, rope_sin, beta, d, k_scale);
  else
    phase_a_fwd_impl<float>(P, A, Pz, bz, qkv, rstd, k_norm_w, rope_cos, rope_sin, beta, d, k_scale);
}

void phase_a_bwd(Tensor& dk_hat, Tensor& dqkv, Tensor& dbeta, const Tensor& dP, const Tensor& dA, const Tensor& dPz,
                 const Tensor& dbz, const Tensor& qkv, const Tensor& rstd, const Tensor& k_norm_w,
                 const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta, const Dims& d, double k_scale,
                 MathMode mode) {
  const char* op = "cpu::phase_a_bwd";
  const Shape qkv_s = {d.B, d.N(), 3, d.H, d.D}, row_s = {d.B, d.N(), d.H, d.D};
  const Shape mat_s = {d.BH(), d.F, d.D, d.D}, vec_s = {d.BH(), d.F, d.D};
  check_shape(dk_hat, row_s, op, "dk_hat");
  check_grad_hat(dk_hat, qkv.dtype(), op, "dk_hat");
  check_shape(dqkv, qkv_s, op, "dqkv");
  check_shape(dbeta, {d.B, d.H, d.F, d.S}, op, "dbeta");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dP, &dA, &dPz}) check_shape(*t, mat_s, op, "dP/dA/dPz");
  check_shape(dbz, vec_s, op, "dbz");
  check_prep_inputs(qkv, rstd, k_norm_w, "k_norm_w", rope_cos, rope_sin, d, op);
  check_shape(beta, {d.B, d.H, d.F, d.S}, op, "beta");
  (void)mode;
  if (qkv.dtype() == DType::f64)
    phase_a_bwd_impl<double>(dk_hat, dqkv, dbeta, dP, dA, dPz, dbz, qkv, rstd, k_norm_w, rope_cos, rope_sin, beta, d,
                             k_scale);
  else
    phase_a_bwd_impl<float>(dk_hat, dqkv, dbeta, dP, dA, dPz, dbz, qkv, rstd, k_norm_w, rope_cos, rope_sin, beta, d,
                            k_scale);
}

}  // namespace cpu
}  // namespace gdncp
