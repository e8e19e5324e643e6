// src/kernels/prep/norm_w_frames.cu — CUDA twins of norm_w_frames.h. One thread per
// (frame, channel) sums its tokens in order, in f64: no atomics, so the result
// is the same run to run (the deterministic mode's contract).
#include "kernels/common/cuda_common.cuh"
#include "kernels/prep/norm_w_frames.h"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

template <typename G, typename X>
__global__ void norm_w_frame_partials_kernel(float* partials, const G* g, const X* x, const float* r, int64_t B,
                                             int64_t F, int64_t S, int64_t C, int stream) {
  const int64_t N = F * S;
  GDNCP_GRID_STRIDE(k, F * C) {
    const int64_t f = k / C, i = k % C;
    double acc = 0.0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        const int64_t t = b * N + f * S + s;
        acc += static_cast<double>(load_f(g, t * C + i)) * static_cast<double>(load_f(x, (t * 3 + stream) * C + i)) *
               static_cast<double>(r[t * 2 + stream]);
      }
    partials[k] = static_cast<float>(acc);
  }
}

template <typename T>
__global__ void frame_sum_kernel(T* out, const float* partials, int64_t F, int64_t C) {
  GDNCP_GRID_STRIDE(i, C) {
    double acc = 0.0;
    for (int64_t f = 0; f < F; ++f) acc += static_cast<double>(partials[f * C + i]);
    store_f(out, i, static_cast<float>(acc));
  }
}

}  // namespace

void norm_w_frame_partials(Tensor& partials, const Tensor& dx_hat, const Tensor& qkv, const Tensor& rstd, int which,
                           const Dims& d) {
  const int64_t C = d.C();
  GDNCP_CHECK(partials.numel() == d.F * C && dx_hat.numel() == d.B * d.N() * C && rstd.numel() == d.B * d.N() * 2,
              "cuda::norm_w_frame_partials: sizes do not match (B, F, S, C) = (", d.B, ", ", d.F, ", ", d.S, ", ", C,
              ")");
  if (d.F * C == 0) return;
  float* p = f32_out(partials, "cuda::norm_w_frame_partials: partials");
  const float* r = f32_in(rstd, "cuda::norm_w_frame_partials: rstd");
  GDNCP_CUDA_FLOAT_SWITCH(dx_hat.dtype(), "norm_w_frame_partials", [&] {
    using G = scalar_t;
    GDNCP_CUDA_FLOAT_SWITCH(qkv.dtype(), "norm_w_frame_partials", [&] {
      norm_w_frame_partials_kernel<<<blocks_for(d.F * C), kGridThreads, 0, stream()>>>(
          p, ptr<G>(dx_hat), ptr<scalar_t>(qkv), r, d.B, d.F, d.S, C, which);
    });
  });
  GDNCP_CUDA_CHECK_LAUNCH("norm_w_frame_partials_kernel");
}

void frame_sum(Tensor& out, const Tensor& partials) {
  const int64_t C = out.numel(), F = C > 0 ? partials.numel() / C : 0;
  GDNCP_CHECK(partials.numel() == F * C, "cuda::frame_sum: partials ", partials.str(), " are not (F, ", C, ")");
  if (C == 0) return;
  const float* p = f32_in(partials, "cuda::frame_sum: partials");
  GDNCP_CUDA_FLOAT_SWITCH(out.dtype(), "frame_sum", [&] {
    frame_sum_kernel<<<blocks_for(C), kGridThreads, 0, stream()>>>(ptr<scalar_t>(out), p, F, C);
  });
  GDNCP_CUDA_CHECK_LAUNCH("frame_sum_kernel");
}

}  // namespace cuda
}  // namespace gdncp
