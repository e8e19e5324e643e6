// src/kernels/rms_norm.cu — CUDA twin of the full-channel RMSNorm of q and k
// (docs/design.md §2.1): the statistics pass (rms_stats, the only pass of its own; the
// apply is fused into the loads of phase A and phase C) and its backward.
//
//   r = 1/sqrt(mean_c x_c² + norm_eps),  x̂ = x·r·w
//   dx = r·w·dx̂ − (r³/C)·x·Σ_c w_c dx̂_c x_c,   dw_c = Σ_tokens dx̂_c·x_c·r
//
// Gradient rule: dqkv channels 0 and 1, dq_norm_w and dk_norm_w are
// overwritten. A stream whose weight is undefined is not normalised (r = 1,
// dx = dx̂). dq_hat / dk_hat are read through In: f32 or bf16 (kernels.h,
// hat-grad dtype; bf16 halves this pass's largest reads).
// Note [fixed-order dw]: a block's warps own fixed tokens and keep their dw in
// shared memory; blocks write partial sums that a second kernel adds in block
// order — no atomics, so results are bitwise reproducible.
#include <algorithm>

#include "kernels/cuda_common.cuh"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

constexpr int kStatThreads = 256;
// rms_bwd_kernel: at most 8 warps a block, 3 blocks an SM — what the shared-memory dw
// accumulators allow at the production C = 2240 (3 × 70 KB). Without the bound the
// run-time f32/bf16 choice of In takes the kernel to 96 registers, i.e. 2 blocks an SM.
constexpr int kBwdMaxWarps = 8, kBwdMinBlocks = 3;

// One warp per token; both streams.
__global__ void __launch_bounds__(kStatThreads)
    rms_stats_kernel(float* __restrict__ rstd, In qkv, int64_t tokens, int C, bool norm_q, bool norm_k, float eps) {
  const int64_t tok = static_cast<int64_t>(blockIdx.x) * (kStatThreads / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (tok >= tokens) return;
  for (int c = 0; c < 2; ++c) {
    const bool norm = c == 0 ? norm_q : norm_k;
    float ss = 0.f;
    if (norm) {
      const int64_t row = (tok * 3 + c) * C;
#pragma unroll 8
      for (int e = 2 * lane; e < C; e += 64) {
        const float2 v = qkv.pair(row + e);
        ss = fmaf(v.x, v.x, ss);
        ss = fmaf(v.y, v.y, ss);
      }
      ss = warp_sum(ss);
    }
    if (lane == 0) rstd[tok * 2 + c] = norm ? 1.f / sqrtf(ss / static_cast<float>(C) + eps) : 1.f;
  }
}

// blockIdx.y = stream (0 q, 1 k); warp w of block blk owns tokens blk·tpb + w + k·warps.
// Shared memory: [warps][C] dw accumulators (weighted streams only).
__global__ void __launch_bounds__(32 * kBwdMaxWarps, kBwdMinBlocks)
    rms_bwd_kernel(Out dqkv, float* __restrict__ dw_part, In dq_hat, In dk_hat, In qkv, const float* __restrict__ rstd,
                   const float* __restrict__ qw, const float* __restrict__ kw, int64_t tokens, int C,
                   int64_t tokens_per_block) {
  extern __shared__ __align__(16) float acc[];
  const int c = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const float* w = c == 0 ? qw : kw;
  const In dxh = c == 0 ? dq_hat : dk_hat;
  if (!dxh.p) return;  // stream not asked for: its channel stays untouched (the whole block leaves)
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tokens_per_block;
  const int64_t t1 = min(tokens, t0 + tokens_per_block);
  float* mine = acc + static_cast<int64_t>(warp) * C;
  if (w)
    for (int e = lane; e < C; e += 32) mine[e] = 0.f;
  __syncwarp();

  const float invC = 1.f / static_cast<float>(C);
  for (int64_t t = t0 + warp; t < t1; t += warps) {
    const int64_t xrow = (t * 3 + c) * C, grow = t * C;
    if (!w) {  // unnormalised stream: x̂ = x
      for (int e = 2 * lane; e < C; e += 64) {
        const float2 gv = dxh.pair(grow + e);
        dqkv.set_pair(xrow + e, gv.x, gv.y);
      }
      continue;
    }
    const float r = rstd[t * 2 + c];
    float corr = 0.f;  // Σ_c w_c dx̂_c x_c
#pragma unroll 8
    for (int e = 2 * lane; e < C; e += 64) {
      const float2 gv = dxh.pair(grow + e), xv = qkv.pair(xrow + e), wv = ldg2(w + e);
      corr = fmaf(wv.x * gv.x, xv.x, corr);
      corr = fmaf(wv.y * gv.y, xv.y, corr);
    }
    corr = warp_sum(corr);
    const float k = r * r * r * invC * corr;
#pragma unroll 8
    for (int e = 2 * lane; e < C; e += 64) {
      const float2 gv = dxh.pair(grow + e), xv = qkv.pair(xrow + e), wv = ldg2(w + e);
      dqkv.set_pair(xrow + e, r * wv.x * gv.x - k * xv.x, r * wv.y * gv.y - k * xv.y);
      mine[e] += gv.x * xv.x * r;
      mine[e + 1] += gv.y * xv.y * r;
    }
  }
  if (!w) return;
  __syncthreads();
  // This block's partial: the warps' accumulators summed in warp order.
  float* out = dw_part + (static_cast<int64_t>(c) * gridDim.x + blockIdx.x) * C;
  for (int e = threadIdx.x; e < C; e += blockDim.x) {
    float s = 0.f;
    for (int v = 0; v < warps; ++v) s += acc[static_cast<int64_t>(v) * C + e];
    out[e] = s;
  }
}

// dw[c][e] = Σ_blk dw_part[c][blk][e], in block order.
__global__ void rms_dw_sum_kernel(float* __restrict__ dqw, float* __restrict__ dkw, const float* __restrict__ dw_part,
                                  int blocks, int C) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x, c = blockIdx.y;
  float* dst = c == 0 ? dqw : dkw;
  if (e >= C || !dst) return;
  const float* p = dw_part + static_cast<int64_t>(c) * blocks * C + e;
  float s = 0.f;
  for (int b = 0; b < blocks; ++b) s += p[static_cast<int64_t>(b) * C];
  dst[e] = s;
}

}  // namespace

// ---------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------
void rms_stats(Tensor& rstd, const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, const Dims& d,
               double norm_eps) {
  GDNCP_CHECK(d.B > 0 && d.N() > 0 && d.C() > 0 && d.C() % 2 == 0, "cuda rms_stats: bad sizes");
  const int64_t tokens = d.B * d.N();
  const unsigned blocks = static_cast<unsigned>((tokens + kStatThreads / 32 - 1) / (kStatThreads / 32));
  rms_stats_kernel<<<blocks, kStatThreads, 0, stream()>>>(f32_out(rstd, "rstd"), in_of(qkv, "qkv"), tokens,
                                                          static_cast<int>(d.C()), q_norm_w.defined(),
                                                          k_norm_w.defined(), static_cast<float>(norm_eps));
  GDNCP_CUDA_CHECK_LAUNCH("rms_stats_kernel");
}

void rms_norm_bwd(Tensor& dqkv, Tensor& dq_norm_w, Tensor& dk_norm_w, const Tensor& dq_hat, const Tensor& dk_hat,
                  const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w, const Tensor& k_norm_w,
                  const Dims& d) {
  GDNCP_CHECK(d.B > 0 && d.N() > 0 && d.C() > 0 && d.C() % 2 == 0, "cuda rms_norm_bwd: bad sizes");
  GDNCP_CHECK(dq_hat.defined() || dk_hat.defined(), "cuda rms_norm_bwd: dq_hat and dk_hat are both undefined");
  const int C = static_cast<int>(d.C());
  const int64_t tokens = d.B * d.N();
  // Warps per block so that their dw accumulators fit in shared memory.
  const int warps = static_cast<int>(std::min<int64_t>(kBwdMaxWarps, (160 * 1024) / (static_cast<int64_t>(C) * 4)));
  GDNCP_CHECK(warps >= 1, "cuda rms_norm_bwd: C = H·D = ", C, " is too large for the shared-memory accumulators");
  // A fixed number of blocks (independent of the device) keeps the summation order fixed.
  const int64_t blocks = std::min<int64_t>(512, (tokens + warps - 1) / warps);
  const int64_t per_block = (tokens + blocks - 1) / blocks;
  const int64_t used = (tokens + per_block - 1) / per_block;
  const bool need_dw = q_norm_w.defined() || k_norm_w.defined();
  Tensor part;
  if (need_dw) part = Tensor::empty({2, used, C}, DType::f32, Device::cuda);
  const size_t smem = need_dw ? static_cast<size_t>(warps) * C * sizeof(float) : 0;
  allow_smem(rms_bwd_kernel, smem);
  rms_bwd_kernel<<<dim3(static_cast<unsigned>(used), 2), 32 * warps, smem, stream()>>>(
      out_of(dqkv, "dqkv"), need_dw ? static_cast<float*>(part.data()) : nullptr, in_of(dq_hat, "dq_hat"),
      in_of(dk_hat, "dk_hat"), in_of(qkv, "qkv"), f32_or_null(rstd, "rstd"), f32_or_null(q_norm_w, "q_norm_w"),
      f32_or_null(k_norm_w, "k_norm_w"), tokens, C, per_block);
  GDNCP_CUDA_CHECK_LAUNCH("rms_bwd_kernel");
  const bool q = dq_hat.defined(), k = dk_hat.defined();
  float* dqw = (q && q_norm_w.defined() && dq_norm_w.defined()) ? f32_out(dq_norm_w, "dq_norm_w") : nullptr;
  float* dkw = (k && k_norm_w.defined() && dk_norm_w.defined()) ? f32_out(dk_norm_w, "dk_norm_w") : nullptr;
  if (dqw || dkw) {
    rms_dw_sum_kernel<<<dim3(static_cast<unsigned>((C + 255) / 256), 2), 256, 0, stream()>>>(
        dqw, dkw, static_cast<const float*>(part.data()), static_cast<int>(used), C);
    GDNCP_CUDA_CHECK_LAUNCH("rms_dw_sum_kernel");
  }
}

}  // namespace cuda
}  // namespace gdncp
