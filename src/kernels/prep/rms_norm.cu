// src/kernels/prep/rms_norm.cu — CUDA twin of the full-channel RMSNorm of q and k
// (docs/design.md §2.1): the statistics pass (rms_stats, the only pass of its own; the
// apply is fused into the loads of phase A and phase C) and its backward. Both have a
// fast path for bf16 rows in 16-byte octets (one warp a token row, lane l its octets l,
// l+32, …) and a generic one through In/Out.
//
//   r = 1/sqrt(mean_c x_c² + norm_eps),  x̂ = x·r·w
//   dx = r·w·dx̂ − (r³/C)·x·Σ_c w_c dx̂_c x_c,   dw_c = Σ_tokens dx̂_c·x_c·r
//
// Gradient rule: dqkv channels 0 and 1, dq_norm_w and dk_norm_w are
// overwritten. A stream whose weight is undefined is not normalised (r = 1,
// dx = dx̂). dq_hat / dk_hat are read through In: f32 or bf16 (kernels.h,
// hat-grad dtype; bf16 halves this pass's largest reads).
// Note [fixed-order dw]: a block's warps own fixed tokens and keep their dw in
// shared memory, each warp its own; each block writes the warps' sum in warp order
// as its partial, and a second kernel adds the partials in a fixed order (strided
// subsets by warp, then the warps in order) — no atomics, so results are bitwise
// reproducible. The path and the block count depend on the shapes and dtypes only,
// never on the device nor on the streams asked for.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/common/cuda_common.cuh"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

constexpr int kStatThreads = 256;
// rms_bwd_kernel: at most 8 warps a block, 3 blocks an SM — what the shared-memory dw
// accumulators allow at the production C = 2240 (3 × 70 KB). Without the bound the
// run-time f32/bf16 choice of In takes the kernel to 96 registers, i.e. 2 blocks an SM.
constexpr int kBwdMaxWarps = 8, kBwdMinBlocks = 3;
// Fast path (rms_bwd_rows_kernel): 8 warps a block, 2 blocks an SM (16 warps: the rows
// in flight are what keeps DRAM busy); a lane holds at most kRowOctets 16-byte octets of
// each row, i.e. C ≤ 32·8·kRowOctets = 2560. Registers: V octets of dx̂ and of x (8V ≤ 80)
// within the 128 that 2 blocks allow (V = 10 spills 4 bytes); dw lives in shared memory
// (8 warps × C floats, 70 KB at the production C = 2240).
constexpr int kRowWarps = 8, kRowMinBlocks = 2, kRowOctets = 10;
// Blocks of the fast path: one wave of the H200 (132 SMs × 2), each a run of tokens (38 or
// 39 at N = 10120) so that start, tail and dw partial weigh little. A constant, not the
// device's count: the dw summation order depends on the shapes only.
// Short inputs: at least kRowTokens tokens a warp, so that a warp's next rows load during
// its stores (the tests' shapes take that path too).
constexpr int64_t kRowBlocks = 264, kRowTokens = 2;
// Blocks of the generic backward: at most this many partials to add (the count is fixed
// by the token count, so the summation order is too).
constexpr int64_t kBwdMaxBlocks = 512;
// rms_dw_sum_kernel: 32 columns × kSumWarps warps a block.
constexpr int kSumWarps = 32;

// One warp per token; both streams. Generic path: f32 or bf16 through In, pairs of channels.
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

// Stream c0 + blockIdx.y (0 q, 1 k: only the streams asked for are launched); warp w of
// block blk owns tokens blk·tpb + w + k·warps. Shared memory: [warps][C] dw accumulators
// (weighted streams only). dw_part: [blockIdx.y][blk][C].
__global__ void __launch_bounds__(32 * kBwdMaxWarps, kBwdMinBlocks)
    rms_bwd_kernel(Out dqkv, float* __restrict__ dw_part, In dq_hat, In dk_hat, In qkv, const float* __restrict__ rstd,
                   const float* __restrict__ qw, const float* __restrict__ kw, int64_t tokens, int C,
                   int64_t tokens_per_block, int c0) {
  extern __shared__ __align__(16) float acc[];
  const int c = c0 + static_cast<int>(blockIdx.y), warp = threadIdx.x >> 5, lane = threadIdx.x & 31,
            warps = blockDim.x >> 5;
  const float* w = c == 0 ? qw : kw;
  const In dxh = c == 0 ? dq_hat : dk_hat;
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
  float* out = dw_part + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * C;
  for (int e = threadIdx.x; e < C; e += blockDim.x) {
    float s = 0.f;
    for (int v = 0; v < warps; ++v) s += acc[static_cast<int64_t>(v) * C + e];
    out[e] = s;
  }
}

// 8 bf16 channels of a 16-byte octet as f32 (the lower channel sits in the low half).
__device__ __forceinline__ void unpack8(float (&x)[8], uint4 u) {
  const uint32_t h[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    x[2 * q] = __uint_as_float(h[q] << 16);
    x[2 * q + 1] = __uint_as_float(h[q] & 0xffff0000u);
  }
}

// Fast path of the statistics: bf16 qkv, C % 8 == 0, 16-byte aligned rows. One warp per
// token as above; lane l loads octets l, l+32, … (< C/8) of both streams' rows before it
// sums either, so a warp has both rows in flight at once. V = octets a lane holds
// (by_octets).
template <int V>
__global__ void __launch_bounds__(kStatThreads)
    rms_stats_rows_kernel(float* __restrict__ rstd, const __nv_bfloat16* __restrict__ qkv, int64_t tokens, int C,
                          bool norm_q, bool norm_k, float eps) {
  const int64_t tok = static_cast<int64_t>(blockIdx.x) * (kStatThreads / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31, octets = C / 8;
  if (tok >= tokens) return;
  uint4 xv[2][V];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const bool norm = c == 0 ? norm_q : norm_k;
    const uint4* row = reinterpret_cast<const uint4*>(qkv + (tok * 3 + c) * C);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int o = j * 32 + lane;
      if (norm && o < octets) xv[c][j] = __ldg(row + o);
    }
  }
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const bool norm = c == 0 ? norm_q : norm_k;
    float ss = 0.f;
    if (norm) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (j * 32 + lane >= octets) continue;
        float x[8];
        unpack8(x, xv[c][j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = fmaf(x[i], x[i], ss);
      }
      ss = warp_sum(ss);
    }
    if (lane == 0) rstd[tok * 2 + c] = norm ? 1.f / sqrtf(ss / static_cast<float>(C) + eps) : 1.f;
  }
}

// Fast path: bf16 dx̂, x and dx, C % 8 == 0, 16-byte aligned rows. One warp a token as
// above, but lane l holds octets l, l+32, … (< C/8) of the token's dx̂ and x rows in
// registers, so each row is read once for both Σ w dx̂ x and dx. As the dx pass stores an
// octet, the lane loads the same octet of its next token into the freed registers, so a
// warp has rows in flight while it computes and stores too. The lane owns
// those columns for every token, so its dw accumulates in its warp's shared-memory slice
// (no other lane touches it) until the block's warp-order sum. V = octets a lane holds
// (⌈C/256⌉ or a little more). Dynamic shared memory: kRowWarps·C floats.
template <int V>
__global__ void __launch_bounds__(32 * kRowWarps, kRowMinBlocks)
    rms_bwd_rows_kernel(__nv_bfloat16* __restrict__ dqkv, float* __restrict__ dw_part,
                        const __nv_bfloat16* __restrict__ dq_hat, const __nv_bfloat16* __restrict__ dk_hat,
                        const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ rstd,
                        const float* __restrict__ qw, const float* __restrict__ kw, int64_t tokens, int C, int c0) {
  extern __shared__ __align__(16) float acc[];
  const int c = c0 + static_cast<int>(blockIdx.y), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* w = c == 0 ? qw : kw;
  const __nv_bfloat16* dxh = c == 0 ? dq_hat : dk_hat;
  const int octets = C / 8;
  // An even split: blocks differ by one token at most.
  const int64_t t0 = tokens * blockIdx.x / gridDim.x, t1 = tokens * (blockIdx.x + 1) / gridDim.x;
  const float invC = 1.f / static_cast<float>(C);
  // This warp's dw: channels 8o..8o+3 at [o], 8o+4..8o+7 at [octets + o] (16-byte lane stride:
  // no bank conflicts).
  float4* dw = reinterpret_cast<float4*>(acc) + static_cast<int64_t>(warp) * 2 * octets;
  if (w)
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int o = j * 32 + lane;
      if (o < octets) dw[o] = dw[octets + o] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  const auto g_row = [&](int64_t t) { return reinterpret_cast<const uint4*>(dxh + t * C); };
  const auto x_row = [&](int64_t t) { return reinterpret_cast<const uint4*>(qkv + (t * 3 + c) * C); };
  const auto weights = [&](int o, float(&wo)[8]) {
    const float4 wa = __ldg(reinterpret_cast<const float4*>(w) + 2 * o),
                 wb = __ldg(reinterpret_cast<const float4*>(w) + 2 * o + 1);
    wo[0] = wa.x, wo[1] = wa.y, wo[2] = wa.z, wo[3] = wa.w, wo[4] = wb.x, wo[5] = wb.y, wo[6] = wb.z, wo[7] = wb.w;
  };

  uint4 gv[V], xv[V];
  float r = 1.f;
  int64_t t = t0 + warp;
  if (t < t1) {  // the first token's rows; later ones are loaded by the store pass before them
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int o = j * 32 + lane;
      if (o >= octets) continue;
      gv[j] = __ldg(g_row(t) + o);
      if (w) xv[j] = __ldg(x_row(t) + o);
    }
    if (w) r = __ldg(rstd + t * 2 + c);
  }
  for (; t < t1; t += kRowWarps) {
    const int64_t tn = t + kRowWarps;
    const bool next = tn < t1;
    uint4* dx_row = reinterpret_cast<uint4*>(dqkv + (t * 3 + c) * C);
    if (!w) {  // unnormalised stream: dx = dx̂, bit for bit
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int o = j * 32 + lane;
        if (o >= octets) continue;
        dx_row[o] = gv[j];
        if (next) gv[j] = __ldg(g_row(tn) + o);
      }
      continue;
    }
    float corr = 0.f;  // Σ_c w_c dx̂_c x_c
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int o = j * 32 + lane;
      if (o >= octets) continue;
      float g[8], x[8], wo[8], d[8];
      unpack8(g, gv[j]);
      unpack8(x, xv[j]);
      weights(o, wo);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        corr = fmaf(wo[i] * g[i], x[i], corr);
        d[i] = g[i] * x[i] * r;
      }
      const float4 lo = dw[o], hi = dw[octets + o];
      dw[o] = make_float4(lo.x + d[0], lo.y + d[1], lo.z + d[2], lo.w + d[3]);
      dw[octets + o] = make_float4(hi.x + d[4], hi.y + d[5], hi.z + d[6], hi.w + d[7]);
    }
    corr = warp_sum(corr);
    const float k = r * r * r * invC * corr;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int o = j * 32 + lane;
      if (o >= octets) continue;
      float g[8], x[8], wo[8], dx[8];
      unpack8(g, gv[j]);
      unpack8(x, xv[j]);
      weights(o, wo);
#pragma unroll
      for (int i = 0; i < 8; ++i) dx[i] = r * wo[i] * g[i] - k * x[i];
      st8h(reinterpret_cast<__nv_bfloat16*>(dx_row + o), dx);
      if (next) gv[j] = __ldg(g_row(tn) + o), xv[j] = __ldg(x_row(tn) + o);
    }
    if (next) r = __ldg(rstd + tn * 2 + c);  // arrives with the rows loaded just before
  }
  if (!w) return;
  __syncthreads();
  // This block's partial: the warps' dw added in warp order.
  const float4* all = reinterpret_cast<const float4*>(acc);
  float4* out = reinterpret_cast<float4*>(dw_part + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * C);
  for (int o = threadIdx.x; o < octets; o += blockDim.x)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float4 s = all[h * octets + o];
#pragma unroll
      for (int v = 1; v < kRowWarps; ++v) {
        const float4 a = all[(2 * v + h) * octets + o];
        s = make_float4(s.x + a.x, s.y + a.y, s.z + a.z, s.w + a.w);
      }
      out[2 * o + h] = s;
    }
}

// dw of stream c0 + y: dw[e] = Σ_blk dw_part[y][blk][e]. A block sums 32 columns: warp v
// adds partials v, v + kSumWarps, … in order (one 128-byte row each), then lane e of warp 0
// adds the warps' sums in warp order — a fixed order that depends on `blocks` only.
__global__ void __launch_bounds__(32 * kSumWarps)
    rms_dw_sum_kernel(float* __restrict__ dqw, float* __restrict__ dkw, const float* __restrict__ dw_part, int blocks,
                      int C, int c0) {
  __shared__ float warp_sums[kSumWarps][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* dst = c0 + blockIdx.y == 0 ? dqw : dkw;
  if (!dst) return;
  const int e = blockIdx.x * 32 + lane;
  float s = 0.f;
  if (e < C) {
    const float* p = dw_part + static_cast<int64_t>(blockIdx.y) * blocks * C + e;
#pragma unroll 8
    for (int b = warp; b < blocks; b += kSumWarps) s += __ldg(p + static_cast<int64_t>(b) * C);
  }
  warp_sums[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && e < C) {
    float t = 0.f;
#pragma unroll
    for (int v = 0; v < kSumWarps; ++v) t += warp_sums[v][lane];
    dst[e] = t;
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------
namespace {

bool aligned16(const Tensor& t) { return !t.defined() || detail::aligned16(t.data()); }
bool bf16_or_none(const Tensor& t) { return !t.defined() || t.dtype() == DType::bf16; }

// The fast paths' instantiation for C: pick(std::integral_constant<int, V>) for the narrowest
// instantiated V ≥ ⌈C/256⌉ octets a lane; null where none fits (C > 32·8·kRowOctets).
template <typename Pick>
auto by_octets(int C, Pick pick) -> decltype(pick(std::integral_constant<int, 1>())) {
  const int need = (C / 8 + 31) / 32;
  if (need <= 1) return pick(std::integral_constant<int, 1>());
  if (need <= 2) return pick(std::integral_constant<int, 2>());
  if (need <= 4) return pick(std::integral_constant<int, 4>());
  if (need <= 5) return pick(std::integral_constant<int, 5>());
  if (need <= 8) return pick(std::integral_constant<int, 8>());
  if (need <= 9) return pick(std::integral_constant<int, 9>());
  if (need <= kRowOctets) return pick(std::integral_constant<int, kRowOctets>());
  return nullptr;
}

}  // namespace

void rms_stats(Tensor& rstd, const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, const Dims& d,
               double norm_eps) {
  GDNCP_CHECK(d.B > 0 && d.N() > 0 && d.C() > 0 && d.C() % 2 == 0, "cuda rms_stats: bad sizes");
  const int C = static_cast<int>(d.C());
  const int64_t tokens = d.B * d.N();
  const unsigned blocks = static_cast<unsigned>((tokens + kStatThreads / 32 - 1) / (kStatThreads / 32));
  float* const out = f32_out(rstd, "rstd");
  const In x = in_of(qkv, "qkv");
  const bool nq = q_norm_w.defined(), nk = k_norm_w.defined();
  const float eps = static_cast<float>(norm_eps);
  // The fast path needs bf16 rows in 16-byte octets, as the backward's does.
  const bool octets = C % 8 == 0 && qkv.dtype() == DType::bf16 && aligned16(qkv);
  const auto stats = octets ? by_octets(C, [](auto v) { return &rms_stats_rows_kernel<decltype(v)::value>; }) : nullptr;
  if (stats) {
    stats<<<blocks, kStatThreads, 0, stream()>>>(out, static_cast<const __nv_bfloat16*>(qkv.data()), tokens, C, nq, nk,
                                                 eps);
    GDNCP_CUDA_CHECK_LAUNCH("rms_stats_rows_kernel");
  } else {
    rms_stats_kernel<<<blocks, kStatThreads, 0, stream()>>>(out, x, tokens, C, nq, nk, eps);
    GDNCP_CUDA_CHECK_LAUNCH("rms_stats_kernel");
  }
}

void rms_norm_bwd(Tensor& dqkv, Tensor& dq_norm_w, Tensor& dk_norm_w, const Tensor& dq_hat, const Tensor& dk_hat,
                  const Tensor& qkv, const Tensor& rstd, const Tensor& q_norm_w, const Tensor& k_norm_w,
                  const Dims& d) {
  GDNCP_CHECK(d.B > 0 && d.N() > 0 && d.C() > 0 && d.C() % 2 == 0, "cuda rms_norm_bwd: bad sizes");
  GDNCP_CHECK(dq_hat.defined() || dk_hat.defined(), "cuda rms_norm_bwd: dq_hat and dk_hat are both undefined");
  const int C = static_cast<int>(d.C());
  const int64_t tokens = d.B * d.N();
  // Views first: they check dtypes and devices for both paths.
  const Out dx_view = out_of(dqkv, "dqkv");
  const In dq_view = in_of(dq_hat, "dq_hat"), dk_view = in_of(dk_hat, "dk_hat"), x_view = in_of(qkv, "qkv");
  const float* rstd_p = f32_or_null(rstd, "rstd");
  const float* qw = f32_or_null(q_norm_w, "q_norm_w");
  const float* kw = f32_or_null(k_norm_w, "k_norm_w");
  // The fast path needs bf16 rows in 16-byte octets. With dq̂ and dk̂ of one dtype (as the layer
  // gives them) the choice does not depend on which streams are asked for, so a stream's bits
  // do not either.
  const bool octets = C % 8 == 0 && dqkv.dtype() == DType::bf16 && qkv.dtype() == DType::bf16 && bf16_or_none(dq_hat) &&
                      bf16_or_none(dk_hat) && aligned16(dqkv) && aligned16(qkv) && aligned16(dq_hat) &&
                      aligned16(dk_hat) && aligned16(q_norm_w) && aligned16(k_norm_w);
  const auto rows = octets ? by_octets(C, [](auto v) { return &rms_bwd_rows_kernel<decltype(v)::value>; }) : nullptr;
  // Warps per block: kRowWarps on the fast path; on the generic one as many as their dw
  // accumulators fit in shared memory.
  const int warps =
      rows ? kRowWarps
           : static_cast<int>(std::min<int64_t>(kBwdMaxWarps, (160 * 1024) / (static_cast<int64_t>(C) * 4)));
  GDNCP_CHECK(warps >= 1, "cuda rms_norm_bwd: C = H·D = ", C, " is too large for the shared-memory accumulators");
  // A fixed number of blocks (independent of the device and of the streams asked for) keeps
  // the summation order fixed. The fast path splits the tokens evenly over its blocks.
  int64_t used = 0, per_block = 0;
  if (rows) {
    used = std::min<int64_t>(kRowBlocks, (tokens + warps * kRowTokens - 1) / (warps * kRowTokens));
  } else {
    const int64_t blocks = std::min<int64_t>(kBwdMaxBlocks, (tokens + warps - 1) / warps);
    per_block = (tokens + blocks - 1) / blocks;
    used = (tokens + per_block - 1) / per_block;
  }
  // Only the streams asked for are launched: blockIdx.y = stream − c0.
  const bool q = dq_hat.defined(), k = dk_hat.defined();
  const int c0 = q ? 0 : 1, streams = (q ? 1 : 0) + (k ? 1 : 0);
  const bool need_dw = (q && q_norm_w.defined()) || (k && k_norm_w.defined());
  Tensor part;
  if (need_dw) part = Tensor::empty({streams, used, C}, DType::f32, Device::cuda);
  float* part_p = need_dw ? static_cast<float*>(part.data()) : nullptr;
  const dim3 grid(static_cast<unsigned>(used), static_cast<unsigned>(streams));
  if (rows) {
    auto bf = [](const Tensor& t) { return t.defined() ? static_cast<const __nv_bfloat16*>(t.data()) : nullptr; };
    const size_t smem = need_dw ? static_cast<size_t>(kRowWarps) * C * sizeof(float) : 0;  // the warps' dw
    allow_smem(rows, smem);
    rows<<<grid, 32 * kRowWarps, smem, stream()>>>(static_cast<__nv_bfloat16*>(dqkv.data()), part_p, bf(dq_hat),
                                                   bf(dk_hat), bf(qkv), rstd_p, qw, kw, tokens, C, c0);
    GDNCP_CUDA_CHECK_LAUNCH("rms_bwd_rows_kernel");
  } else {
    const size_t smem = need_dw ? static_cast<size_t>(warps) * C * sizeof(float) : 0;
    allow_smem(rms_bwd_kernel, smem);
    rms_bwd_kernel<<<grid, 32 * warps, smem, stream()>>>(dx_view, part_p, dq_view, dk_view, x_view, rstd_p, qw, kw,
                                                         tokens, C, per_block, c0);
    GDNCP_CUDA_CHECK_LAUNCH("rms_bwd_kernel");
  }
  float* dqw = (q && q_norm_w.defined() && dq_norm_w.defined()) ? f32_out(dq_norm_w, "dq_norm_w") : nullptr;
  float* dkw = (k && k_norm_w.defined() && dk_norm_w.defined()) ? f32_out(dk_norm_w, "dk_norm_w") : nullptr;
  if (dqw || dkw) {
    rms_dw_sum_kernel<<<dim3(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(streams)), 32 * kSumWarps, 0,
                        stream()>>>(dqw, dkw, static_cast<const float*>(part.data()), static_cast<int>(used), C, c0);
    GDNCP_CUDA_CHECK_LAUNCH("rms_dw_sum_kernel");
  }
}

}  // namespace cuda
}  // namespace gdncp
