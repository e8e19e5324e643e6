// src/kernels/prep/norm_w_frames_ref.cpp — CPU twins of norm_w_frames.h and the dispatchers.
#include "gdncp/error.h"
#include "kernels/common/cpu_common.h"
#include "kernels/prep/norm_w_frames.h"

namespace gdncp {
namespace cpu {

void norm_w_frame_partials(Tensor& partials, const Tensor& dx_hat, const Tensor& qkv, const Tensor& rstd, int stream,
                           const Dims& d) {
  const int64_t C = d.C(), N = d.N();
  GDNCP_CHECK(partials.numel() == d.F * C && dx_hat.numel() == d.B * N * C && rstd.numel() == d.B * N * 2,
              "cpu::norm_w_frame_partials: sizes do not match (B, F, S, C) = (", d.B, ", ", d.F, ", ", d.S, ", ", C,
              ")");
  const std::vector<double> g = dx_hat.to_vector(), x = qkv.to_vector(), r = rstd.to_vector();
  std::vector<double> p(static_cast<size_t>(d.F * C), 0.0);
  for (int64_t f = 0; f < d.F; ++f)
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t s = 0; s < d.S; ++s) {
        const int64_t t = b * N + f * d.S + s;
        const double rt = r[static_cast<size_t>(t * 2 + stream)];
        for (int64_t i = 0; i < C; ++i)
          p[static_cast<size_t>(f * C + i)] +=
              g[static_cast<size_t>(t * C + i)] * x[static_cast<size_t>((t * 3 + stream) * C + i)] * rt;
      }
  partials.copy_from(Tensor::from_vector(p, partials.shape(), partials.dtype()));
}

void frame_sum(Tensor& out, const Tensor& partials) {
  const int64_t C = out.numel(), F = C > 0 ? partials.numel() / C : 0;
  GDNCP_CHECK(partials.numel() == F * C, "cpu::frame_sum: partials ", partials.str(), " are not (F, ", C, ")");
  const std::vector<double> p = partials.to_vector();
  std::vector<double> s(static_cast<size_t>(C), 0.0);
  for (int64_t f = 0; f < F; ++f)
    for (int64_t i = 0; i < C; ++i) s[static_cast<size_t>(i)] += p[static_cast<size_t>(f * C + i)];
  out.copy_from(Tensor::from_vector(s, out.shape(), out.dtype()));
}

}  // namespace cpu

namespace kernels {

void norm_w_frame_partials(Tensor& partials, const Tensor& dx_hat, const Tensor& qkv, const Tensor& rstd, int stream,
                           const Dims& d) {
#if GDNCP_WITH_CUDA
  if (qkv.is_cuda()) return cuda::norm_w_frame_partials(partials, dx_hat, qkv, rstd, stream, d);
#endif
  GDNCP_CHECK(!qkv.is_cuda(), "kernels::norm_w_frame_partials: got a CUDA tensor, but gdncp was built without CUDA");
  cpu::norm_w_frame_partials(partials, dx_hat, qkv, rstd, stream, d);
}

void frame_sum(Tensor& out, const Tensor& partials) {
#if GDNCP_WITH_CUDA
  if (partials.is_cuda()) return cuda::frame_sum(out, partials);
#endif
  GDNCP_CHECK(!partials.is_cuda(), "kernels::frame_sum: got a CUDA tensor, but gdncp was built without CUDA");
  cpu::frame_sum(out, partials);
}

}  // namespace kernels
}  // namespace gdncp
