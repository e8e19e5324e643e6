// src/kernels/prep/rms_norm_ref.cpp — CPU twin of the full-channel RMSNorm of q and k
// (docs/design.md §2.1): the statistics pass (rms_stats) and its backward (rms_norm_bwd).
// The normalisation itself is fused into the loads of phase A (k) and phase C (q).
//
//   r = 1/sqrt(mean_c x_c² + norm_eps),  x̂ = x·r·w
//   dx = r·w·dx̂ − (r³/C)·x·Σ_c w_c dx̂_c x_c,   dw_c = Σ_tokens dx̂_c·x_c·r
//
// Gradient rule: every output is overwritten (dqkv channels 0 and 1, dq_norm_w,
// dk_norm_w); the autograd engine does the summing. A stream whose weight is
// undefined is not normalised: r = 1, w = 1, dx = dx̂. dq_hat / dk_hat may be the
// compute dtype or bf16 (read as stored, widened to T).
// Long reductions (over C channels, over all tokens) accumulate in double in a
// fixed order, so results are bitwise reproducible.
#include <utility>

#include "kernels/common/cpu_common.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace cpu {
namespace {

using namespace detail;

template <typename T>
void rms_stats_impl(Tensor& rstd, const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, const Dims& d,
                    double norm_eps) {
  const int64_t N = d.N(), C = d.C();
  In<T> x(qkv);
  Out<T> r(rstd);
  const bool norm[2] = {q_norm_w.defined(), k_norm_w.defined()};
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < 2; ++c) {
        T value = T(1);
        if (norm[c]) {
          const T* row = x.data() + qkv_offset(b, n, c, N, C);
          double ss = 0;
          for (int64_t i = 0; i < C; ++i) ss += static_cast<double>(row[i]) * static_cast<double>(row[i]);
          value = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(C) + norm_eps));
        }
        r[(b * N + n) * 2 + c] = value;
      }
  r.commit();
}

template <typename T>
void rms_norm_bwd_impl(Tensor& dqkv, Tensor& dq_norm_w, Tensor& dk_norm_w, const Tensor& dq_hat, const Tensor& dk_hat,
                       const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w, const Tensor& k_norm_w,
                       const Dims& d) {
  const int64_t N = d.N(), C = d.C(), tokens = d.B * N;
  In<T> x(qkv), r(rstd), qw(q_norm_w), kw(k_norm_w), dqh(dq_hat), dkh(dk_hat);
  const T* w_of[2] = {qw.data(), kw.data()};
  const T* dxhat_of[2] = {dqh.data(), dkh.data()};
  Tensor* dw_out[2] = {&dq_norm_w, &dk_norm_w};

  for (int64_t c = 0; c < 2; ++c) {
    if (!dxhat_of[c]) continue;  // stream not asked for: its channel stays untouched
    const T* w = w_of[c];
    std::vector<T> dx(static_cast<size_t>(tokens * C));
    std::vector<double> dw(w ? static_cast<size_t>(C) : 0, 0.0);
    for (int64_t t = 0; t < tokens; ++t) {
      const T* xr = x.data() + (t * 3 + c) * C;
      const T* g = dxhat_of[c] + t * C;
      T* o = dx.data() + t * C;
      if (!w) {  // unnormalised stream: x̂ = x
        for (int64_t i = 0; i < C; ++i) o[i] = g[i];
        continue;
      }
      const T rt = r[t * 2 + c];
      double corr = 0;  // Σ_c w_c dx̂_c x_c
      for (int64_t i = 0; i < C; ++i) corr += static_cast<double>(w[i] * g[i]) * static_cast<double>(xr[i]);
      const T k = static_cast<T>(static_cast<double>(rt) * rt * rt / static_cast<double>(C) * corr);
      for (int64_t i = 0; i < C; ++i) {
        o[i] = rt * w[i] * g[i] - k * xr[i];
        dw[static_cast<size_t>(i)] += static_cast<double>(g[i] * xr[i] * rt);
      }
    }
    store_qkv_channel(dqkv, c, dx, d.B, N, C);
    Tensor& dwt = *dw_out[c];
    if (w && dwt.defined()) {
      GDNCP_CHECK(dwt.numel() == C, "rms_norm_bwd: norm weight gradient must have ", C, " elements, got ", dwt.str());
      Out<T> o(dwt);
      for (int64_t i = 0; i < C; ++i) o[i] = static_cast<T>(dw[static_cast<size_t>(i)]);
      o.commit();
    }
  }
}

}  // namespace

void rms_stats(Tensor& rstd, const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, const Dims& d,
               double norm_eps) {
  const char* op = "cpu::rms_stats";
  check_shape(rstd, {d.B, d.N(), 2}, op, "rstd");
  check_shape(qkv, {d.B, d.N(), 3, d.H, d.D}, op, "qkv");
  check_shape_if_defined(q_norm_w, {d.C()}, op, "q_norm_w");
  check_shape_if_defined(k_norm_w, {d.C()}, op, "k_norm_w");
  if (qkv.dtype() == DType::f64)
    rms_stats_impl<double>(rstd, qkv, q_norm_w, k_norm_w, d, norm_eps);
  else
    rms_stats_impl<float>(rstd, qkv, q_norm_w, k_norm_w, d, norm_eps);
}

void rms_norm_bwd(Tensor& dqkv, Tensor& dq_norm_w, Tensor& dk_norm_w, const Tensor& dq_hat, const Tensor& dk_hat,
                  const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w, const Tensor& k_norm_w,
                  const Dims& d) {
  const char* op = "cpu::rms_norm_bwd";
  const Shape qkv_s = {d.B, d.N(), 3, d.H, d.D}, row_s = {d.B, d.N(), d.H, d.D};
  check_shape(dqkv, qkv_s, op, "dqkv");
  check_shape(qkv, qkv_s, op, "qkv");
  GDNCP_CHECK(dq_hat.defined() || dk_hat.defined(), op, ": dq_hat and dk_hat are both undefined");
  for (const auto& [hat, name] : {std::pair<const Tensor*, const char*>{&dq_hat, "dq_hat"}, {&dk_hat, "dk_hat"}}) {
    if (!hat->defined()) continue;  // that stream's channel is left untouched
    check_shape(*hat, row_s, op, name);
    check_grad_hat(*hat, qkv.dtype(), op, name);
  }
  check_shape(rstd, {d.B, d.N(), 2}, op, "rstd");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dq_norm_w, &dk_norm_w, &q_norm_w, &k_norm_w})
    check_shape_if_defined(*t, {d.C()}, op, "norm weight");
  if (qkv.dtype() == DType::f64)
    rms_norm_bwd_impl<double>(dqkv, dq_norm_w, dk_norm_w, dq_hat, dk_hat, qkv, rstd, q_norm_w, k_norm_w, d);
  else
    rms_norm_bwd_impl<float>(dqkv, dq_norm_w, dk_norm_w, dq_hat, dk_hat, qkv, rstd, q_norm_w, k_norm_w, d);
}

}  // namespace cpu
}  // namespace gdncp
