// src/kernels/phase_c/phase_c_ref.cpp — CPU twin of phase C (docs/design.md §5) with the q prep
// (docs/design.md §2) fused into the load and, in divide mode, the output divide fused
// into the store.
//
// Forward, token s of frame f:  q̂ = q·r·w,  q⁺ = relu(q̂),  qʳ = rope(q⁺)
//   num_s = qʳ_s M_f,  den_s = q⁺_s·z_f,  out_s = num_s / (den_s + eps)  (divide) or num_s (raw)
// Backward:  divide: dnum = dout/(den+eps), dden = −(dout·num)/(den+eps)²;  raw: given.
//   dqʳ = M_f dnum,  dM_f = Σ_s qʳ_s dnum_sᵀ,  dz_f = Σ_s dden_s q⁺_s,
//   dq⁺ = dden·z_f + unrope(dqʳ),  dq̂ = dq⁺·[q̂ > 0]
// Gradient rule: dq_hat, dM, dz are overwritten. dq_hat is the compute dtype or
// bf16: computed in T, rounded on commit when bf16.
#include "kernels/common/cpu_common.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace cpu {
namespace {

using namespace detail;

template <typename T>
struct QPrep {
  const T* x;
  const T* r;
  const T* w;
  const T* cos;
  const T* sin;
  int64_t N, C, D;

  void load(int64_t b, int64_t n, int64_t h, T* qhat, T* qplus, T* qrot) const {
    const T* q = x + qkv_offset(b, n, 0, N, C) + h * D;
    prep_row(qhat, qplus, qrot, q, r[(b * N + n) * 2], w ? w + h * D : nullptr, T(1), cos + n * D, sin + n * D, D,
             static_cast<T*>(nullptr));
  }
};

// num = qʳ M (row vector times D×D).
template <typename T>
void vecmat(T* num, const T* qr, const T* M, int64_t D) {
  for (int64_t j = 0; j < D; ++j) num[j] = T(0);
  for (int64_t i = 0; i < D; ++i) {
    const T qi = qr[i];
    const T* Mi = M + i * D;
    for (int64_t j = 0; j < D; ++j) num[j] += qi * Mi[j];
  }
}

template <typename T>
void phase_c_fwd_impl(Tensor& out, Tensor& den, const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w,
                      const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& M, const Tensor& z, const Dims& d,
                      double eps, bool divide) {
  const int64_t D = d.D, S = d.S, F = d.F, N = d.N(), C = d.C(), H = d.H, DD = D * D;
  In<T> x(qkv), r(rstd), w(q_norm_w), cs(rope_cos), sn(rope_sin), iM(M), iz(z);
  Out<T> oo(out), oden(den);
  const QPrep<T> prep{x.data(), r.data(), w.data(), cs.data(), sn.data(), N, C, D};
  std::vector<T> qp(static_cast<size_t>(D)), qr(qp), num(qp);

  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t bh = b * H + h;
      for (int64_t f = 0; f < F; ++f) {
        const T* Mf = iM.data() + (bh * F + f) * DD;
        const T* zf = iz.data() + (bh * F + f) * D;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t n = f * S + s;
          prep.load(b, n, h, nullptr, qp.data(), qr.data());
          vecmat(num.data(), qr.data(), Mf, D);
          const T dn = dot(qp.data(), zf, D);
          oden[bh * N + n] = dn;
          T* o = oo.data() + (b * N + n) * C + h * D;
          const T scale = divide ? T(1) / (dn + static_cast<T>(eps)) : T(1);
          for (int64_t j = 0; j < D; ++j) o[j] = num[j] * scale;
        }
      }
    }
  oo.commit();
  oden.commit();
}

template <typename T>
void phase_c_bwd_impl(Tensor& dq_hat, Tensor& dM, Tensor& dz, const Tensor& dout, const Tensor& dden, const Tensor& qkv,
                      const Tensor& rstd, const Tensor& q_norm_w, const Tensor& rope_cos, const Tensor& rope_sin,
                      const Tensor& M, const Tensor& z, const Dims& d, double eps, bool divide) {
  const int64_t D = d.D, S = d.S, F = d.F, N = d.N(), C = d.C(), H = d.H, DD = D * D;
  In<T> x(qkv), r(rstd), w(q_norm_w), cs(rope_cos), sn(rope_sin), iM(M), iz(z), go(dout), gden(dden);
  GDNCP_CHECK(!divide || go.defined(), "phase_c_bwd: divide mode needs dout");
  Out<T> odq(dq_hat), odM(dM), odz(dz);
  const QPrep<T> prep{x.data(), r.data(), w.data(), cs.data(), sn.data(), N, C, D};
  const auto vec = [D] { return std::vector<T>(static_cast<size_t>(D)); };
  std::vector<T> qh = vec(), qp = vec(), qr = vec(), num = vec(), dnum = vec(), dqr = vec(), dqp = vec();
  std::vector<T> Mt(static_cast<size_t>(DD));

  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t bh = b * H + h;
      for (int64_t f = 0; f < F; ++f) {
        const T* Mf = iM.data() + (bh * F + f) * DD;
        const T* zf = iz.data() + (bh * F + f) * D;
        T* dMf = odM.data() + (bh * F + f) * DD;
        T* dzf = odz.data() + (bh * F + f) * D;
        std::fill(dMf, dMf + DD, T(0));
        std::fill(dzf, dzf + D, T(0));
        transpose(Mt.data(), Mf, D);
        for (int64_t s = 0; s < S; ++s) {
          const int64_t n = f * S + s;
          const int64_t row = (b * N + n) * C + h * D;
          prep.load(b, n, h, qh.data(), qp.data(), qr.data());
          T dden_s = T(0);
          if (divide) {
            vecmat(num.data(), qr.data(), Mf, D);
            const T inv = T(1) / (dot(qp.data(), zf, D) + static_cast<T>(eps));
            const T* g = go.data() + row;
            for (int64_t j = 0; j < D; ++j) dnum[j] = g[j] * inv;
            dden_s = -dot(g, num.data(), D) * inv * inv;
          } else {
            for (int64_t j = 0; j < D; ++j) dnum[j] = go.defined() ? go[row + j] : T(0);
            if (gden.defined()) dden_s = gden[bh * N + n];
          }
          matvec_from_t(dqr.data(), Mt.data(), dnum.data(), D);  // M dnum
          for (int64_t i = 0; i < D; ++i) {
            axpy(dMf + i * D, qr[i], dnum.data(), D);
            dzf[i] += dden_s * qp[i];
            dqp[i] = dden_s * zf[i];
          }
          unrope_add(dqp.data(), dqr.data(), cs.data() + n * D, sn.data() + n * D, D);
          relu_scale_bwd(odq.data() + row, dqp.data(), qh.data(), T(1), D);
        }
      }
    }
  odq.commit();
  odM.commit();
  odz.commit();
}

}  // namespace

void phase_c_fwd(Tensor& out, Tensor& den, const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w,
                 const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& M, const Tensor& z, const Dims& d,
                 double eps, bool divide, MathMode mode) {
  const char* op = "cpu::phase_c_fwd";
  const Shape row_s = {d.B, d.N(), d.H, d.D}, mat_s = {d.BH(), d.F, d.D, d.D}, vec_s = {d.BH(), d.F, d.D};
  check_shape(out, row_s, op, "out");
  check_shape(den, {d.B, d.H, d.N()}, op, "den");
  check_prep_inputs(qkv, rstd, q_norm_w, "q_norm_w", rope_cos, rope_sin, d, op);
  check_shape(M, mat_s, op, "M");
  check_shape(z, vec_s, op, "z");
  (void)mode;  // the CPU computes exactly in the compute dtype
  if (qkv.dtype() == DType::f64)
    phase_c_fwd_impl<double>(out, den, qkv, rstd, q_norm_w, rope_cos, rope_sin, M, z, d, eps, divide);
  else
    phase_c_fwd_impl<float>(out, den, qkv, rstd, q_norm_w, rope_cos, rope_sin, M, z, d, eps, divide);
}

void phase_c_bwd(Tensor& dq_hat, Tensor& dM, Tensor& dz, const Tensor& dout, const Tensor& dden, const Tensor& qkv,
                 const Tensor& rstd, const Tensor& q_norm_w, const Tensor& rope_cos, const Tensor& rope_sin,
                 const Tensor& M, const Tensor& z, const Dims& d, double eps, bool divide, MathMode mode) {
  const char* op = "cpu::phase_c_bwd";
  const Shape row_s = {d.B, d.N(), d.H, d.D}, mat_s = {d.BH(), d.F, d.D, d.D}, vec_s = {d.BH(), d.F, d.D};
  check_shape(dq_hat, row_s, op, "dq_hat");
  check_grad_hat(dq_hat, qkv.dtype(), op, "dq_hat");
  check_shape(dM, mat_s, op, "dM");
  check_shape(dz, vec_s, op, "dz");
  check_shape_if_defined(dout, row_s, op, "dout");
  check_shape_if_defined(dden, {d.B, d.H, d.N()}, op, "dden");
  check_prep_inputs(qkv, rstd, q_norm_w, "q_norm_w", rope_cos, rope_sin, d, op);
  check_shape(M, mat_s, op, "M");
  check_shape(z, vec_s, op, "z");
  (void)mode;
  if (qkv.dtype() == DType::f64)
    phase_c_bwd_impl<double>(dq_hat, dM, dz, dout, dden, qkv, rstd, q_norm_w, rope_cos, rope_sin, M, z, d, eps, divide);
  else
    phase_c_bwd_impl<float>(dq_hat, dM, dz, dout, dden, qkv, rstd, q_norm_w, rope_cos, rope_sin, M, z, d, eps, divide);
}

}  // namespace cpu
}  // namespace gdncp
