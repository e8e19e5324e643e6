// src/reference/ops_phase_c.cpp — ops::phase_c, the per-token readout (docs/design.md §5),
// one autograd node, plain loops.
//
//   num_s[j] = Σ_i qʳ_s[i] M_f[i][j],   den_s = Σ_i q⁺_s[i] z_f[i]      (s in frame f)
// Backward:
//   dqʳ_s[i] = Σ_j M_f[i][j] dnum_s[j],  dq⁺_s = dden_s z_f,
//   dM_f[i][j] = Σ_s qʳ_s[i] dnum_s[j],   dz_f = Σ_s dden_s q⁺_s
// Gradient rule: fresh gradients for qr, qp, M, z in their dtypes.
#include "reference/ops_common.h"

namespace gdncp {
namespace ops {
namespace {

using namespace cpu::detail;
using namespace ops::detail;

TokenGeometry geometry(const Tensor& qr, const Tensor& qp, const Tensor& M, const Tensor& z, int64_t F, int64_t S) {
  const char* op = "ops::phase_c";
  require_cpu_inputs(op, {{qr, "qr"}, {qp, "qp"}, {M, "M"}, {z, "z"}});
  const TokenGeometry g = token_pair_geometry(op, qr, "qr", qp, "qp", F, S);
  GDNCP_CHECK(M.shape() == Shape({g.B * g.H, F, g.D, g.D}), op, ": M must be (B·H, F, D, D), got ", M.str());
  GDNCP_CHECK(z.shape() == Shape({g.B * g.H, F, g.D}), op, ": z must be (B·H, F, D), got ", z.str());
  return g;
}

template <typename T>
std::vector<Tensor> phase_c_forward(const Tensor& qr_t, const Tensor& qp_t, const Tensor& M_t, const Tensor& z_t,
                                    int64_t F, int64_t S) {
  const TokenGeometry g = geometry(qr_t, qp_t, M_t, z_t, F, S);
  const int64_t D = g.D;
  const std::vector<T> qr = values<T>(qr_t, qr_t.numel()), qp = values<T>(qp_t, qp_t.numel()),
                       M = values<T>(M_t, M_t.numel()), z = values<T>(z_t, z_t.numel());
  std::vector<T> num(qr.size(), T(0)), den(static_cast<size_t>(g.B * g.H * g.N), T(0));
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t n = 0; n < g.N; ++n)
      for (int64_t h = 0; h < g.H; ++h) {
        const int64_t bhf = (b * g.H + h) * F + n / S;
        const size_t r = g.row(b, n, h);
        for (int64_t j = 0; j < D; ++j)
          for (int64_t i = 0; i < D; ++i)
            num[r + static_cast<size_t>(j)] +=
                qr[r + static_cast<size_t>(i)] * M[static_cast<size_t>((bhf * D + i) * D + j)];
        T dn = T(0);
        for (int64_t i = 0; i < D; ++i) dn += qp[r + static_cast<size_t>(i)] * z[static_cast<size_t>(bhf * D + i)];
        den[static_cast<size_t>((b * g.H + h) * g.N + n)] = dn;
      }
  const DType ct = dtype_of<T>::value;
  return {tensor_from(num, qr_t.shape(), ct), tensor_from(den, {g.B, g.H, g.N}, ct)};
}

class PhaseCNode : public FramesNode<PhaseCNode> {
 public:
  PhaseCNode(int64_t F, int64_t S) : FramesNode("ops::phase_c", F, S) {}

  template <typename T>
  std::vector<Tensor> run(const std::vector<Tensor>& grads) {
    const Tensor &qr_t = saved(0), &qp_t = saved(1), &M_t = saved(2), &z_t = saved(3);
    const TokenGeometry g = geometry(qr_t, qp_t, M_t, z_t, F_, S_);
    const int64_t D = g.D;
    const std::vector<T> qr = values<T>(qr_t, qr_t.numel()), qp = values<T>(qp_t, qp_t.numel()),
                         M = values<T>(M_t, M_t.numel()), z = values<T>(z_t, z_t.numel());
    const std::vector<T> gnum = values<T>(grads[0], qr_t.numel()), gden = values<T>(grads[1], g.B * g.H * g.N);
    std::vector<T> dqr(qr.size(), T(0)), dqp(qp.size(), T(0)), dM(M.size(), T(0)), dz(z.size(), T(0));
    for (int64_t b = 0; b < g.B; ++b)
      for (int64_t n = 0; n < g.N; ++n)
        for (int64_t h = 0; h < g.H; ++h) {
          const int64_t bhf = (b * g.H + h) * F_ + n / S_;
          const size_t r = g.row(b, n, h);
          const T gd = gden[static_cast<size_t>((b * g.H + h) * g.N + n)];
          for (int64_t i = 0; i < D; ++i) {
            for (int64_t j = 0; j < D; ++j) {
              const size_t e = static_cast<size_t>((bhf * D + i) * D + j);
              dqr[r + static_cast<size_t>(i)] += M[e] * gnum[r + static_cast<size_t>(j)];
              dM[e] += qr[r + static_cast<size_t>(i)] * gnum[r + static_cast<size_t>(j)];
            }
            dqp[r + static_cast<size_t>(i)] = gd * z[static_cast<size_t>(bhf * D + i)];
            dz[static_cast<size_t>(bhf * D + i)] += gd * qp[r + static_cast<size_t>(i)];
          }
        }
    return grads_like_saved<T>({&dqr, &dqp, &dM, &dz});
  }
};

}  // namespace

std::vector<Tensor> phase_c(const Tensor& qr, const Tensor& qp, const Tensor& M, const Tensor& z, int64_t F,
                            int64_t S) {
  const auto fwd = [&](auto t) { return phase_c_forward<decltype(t)>(qr, qp, M, z, F, S); };
  return run_and_record<PhaseCNode>({qr, qp, M, z}, fwd, F, S);
}

}  // namespace ops
}  // namespace gdncp
