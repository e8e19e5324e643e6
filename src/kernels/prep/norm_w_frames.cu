// src/kernels/prep/norm_w_frames.cu — CUDA twins of norm_w_frames.h. No atomics: a
// frame's partial adds its tokens in an order fixed by the frame alone, so the
// result is the same run to run and for every frame ownership (the
// deterministic mode's contract).
#include <algorithm>
#include <climits>

#include "kernels/common/cuda_common.cuh"
#include "kernels/prep/norm_w_frames.h"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

// A block sums one frame for 32 channels: lane l of 8 takes tokens s ≡ l (mod 8)
// of each batch row in order, in f64, and lane 0 adds the 8 lanes in order.
// One thread a (frame, channel) walking all B·S tokens left the GPU nearly
// idle (F·C threads, each a chain of B·S dependent loads).
constexpr int kNwChannels = 32, kNwLanes = 8;

template <typename G, typename X>
__global__ void __launch_bounds__(kNwChannels* kNwLanes)
    norm_w_frame_partials_kernel(float* partials, const G* g, const X* x, const float* r, int64_t B, int64_t F,
                                 int64_t S, int64_t C, int stream) {
  __shared__ double lanes[kNwLanes][kNwChannels];
  const int64_t N = F * S, tiles = (C + kNwChannels - 1) / kNwChannels;
  const int c = static_cast<int>(threadIdx.x) % kNwChannels, lane = static_cast<int>(threadIdx.x) / kNwChannels;
  for (int64_t item = blockIdx.x; item < F * tiles; item += gridDim.x) {
    const int64_t f = item / tiles, i = (item % tiles) * kNwChannels + c;
    double acc = 0.0;
    if (i < C)
      for (int64_t b = 0; b < B; ++b)
#pragma unroll 4
        for (int64_t s = lane; s < S; s += kNwLanes) {
          const int64_t t = b * N + f * S + s;
          acc += static_cast<double>(load_f(g, t * C + i)) * static_cast<double>(load_f(x, (t * 3 + stream) * C + i)) *
                 static_cast<double>(r[t * 2 + stream]);
        }
    lanes[lane][c] = acc;
    __syncthreads();
    if (lane == 0 && i < C) {
      double sum = 0.0;
      for (int l = 0; l < kNwLanes; ++l) sum += lanes[l][c];
      partials[f * C + i] = static_cast<float>(sum);
    }
    __syncthreads();  // lanes is reused by the next item
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
      const int64_t items = d.F * ((C + kNwChannels - 1) / kNwChannels);
      norm_w_frame_partials_kernel<<<static_cast<unsigned>(std::min<int64_t>(items, INT_MAX)), kNwChannels * kNwLanes,
                                     0, stream()>>>(p, ptr<G>(dx_hat), ptr<scalar_t>(qkv), r, d.B, d.F, d.S, C, which);
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
