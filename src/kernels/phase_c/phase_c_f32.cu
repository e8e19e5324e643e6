// src/kernels/phase_c/phase_c_f32.cu — phase C's f32 coding, for the tf32 and ieee modes (phase_c.cu
// has the math and picks the coding): f32 tiles (Note [warp tiles]). Forward grid: (token
// splits, B·H·F), M_f in shared memory while the block walks 64-token tiles. Backward grid:
// B·H·F; a block owns a frame because dM_f and dz_f sum over its tokens (fixed order, no
// atomics).
#include <algorithm>
#include <cstdint>

#include "kernels/common/cuda_common.cuh"
#include "kernels/phase_c/phase_c_cuda.cuh"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;
using namespace phase_c;

// What both kernels load first: M_f as [i][j] at pitch ld and z_f, zeros beyond D.
template <int DP>
__device__ __forceinline__ void load_frame_state(float* Ms, int ld, float* zs, const float* M_f, const float* z_f,
                                                 int D, int tid) {
  for (int e = tid; e < DP * DP; e += kThreads) {
    const int i = e / DP, j = e % DP;
    Ms[i * ld + j] = (i < D && j < D) ? M_f[i * D + j] : 0.f;
  }
  if (tid < DP) zs[tid] = tid < D ? z_f[tid] : 0.f;
}

// The q norm weights of the channel pairs this lane owns (d = 2·lane + 64j), zeros beyond D.
template <int PPL>
__device__ __forceinline__ void q_weight_pairs(float2 (&wq)[PPL], const float* qw, int h, int D, int lane) {
#pragma unroll
  for (int j = 0; j < PPL; ++j) {
    const int d = 2 * lane + 64 * j;
    wq[j] = d < D ? weight_pair(qw, h * D + d) : make_float2(0.f, 0.f);
  }
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------
template <int DP>
struct FwdTile {  // 2 × 4 warps over a KS×DP output tile
  static constexpr int KS = 64, WM = 2, WN = 4, TM = KS / (16 * WM), TN = DP / (8 * WN);
  static_assert(is_padded_dim(DP) && TN * 8 * WN == DP, "FwdTile: the warps cover the DP columns");
};

template <int DP, MathMode MODE>
constexpr size_t fwd_smem_bytes() {  // M_f f32 [k][n], qʳ, z_f, den
  return (static_cast<size_t>(DP) * pitch_km(DP, MODE) + FwdTile<DP>::KS * pitch_mk(DP, MODE) + DP + FwdTile<DP>::KS) *
         4;
}

template <int DP, MathMode MODE>
__global__ void __launch_bounds__(kThreads)
    phase_c_fwd_kernel(Out out, float* __restrict__ den, In qkv, const float* __restrict__ rstd,
                       const float* __restrict__ qw, const float* __restrict__ rope_cos,
                       const float* __restrict__ rope_sin, const float* __restrict__ M, const float* __restrict__ z,
                       int H, int D, int F, int S, int tiles_per_block, float eps, bool divide) {
  static_assert(MODE != MathMode::bf16, "bf16 mode runs phase_c_fwd_ld_kernel");
  using Tl = FwdTile<DP>;
  constexpr int KS = Tl::KS, LDM = pitch_km(DP, MODE), LDQ = pitch_mk(DP, MODE);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* Ms = reinterpret_cast<float*>(smem_raw);  // M_f [i][j]  (OpKM)
  float* Qr = Ms + DP * LDM;                       // qʳ [KS][LDQ] (A: (m = s, k = d))
  float* zs = Qr + KS * LDQ;                       // z_f     [DP]
  float* dens = zs + DP;                           // den     [KS]

  const int bhf = blockIdx.y, bh = bhf / F, f = bhf % F, b = bh / H, h = bh % H;
  const int64_t N = static_cast<int64_t>(F) * S, mat0 = static_cast<int64_t>(bhf) * D * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  load_frame_state<DP>(Ms, LDM, zs, M + mat0, z + static_cast<int64_t>(bhf) * D, D, tid);

  // Loads: warp w owns rows w, w+8, ...; lane l owns channel pairs d = 2l + 64j (j < PPL).
  constexpr int RPW = KS / 8, PPL = DP >= 64 ? DP / 64 : 1, BATCH = 4;
  float2 wq[PPL];
  q_weight_pairs(wq, qw, h, D, lane);

  const int wm = warp / Tl::WN, wn = warp % Tl::WN;
  const int m0 = wm * Tl::TM * 16, n0 = wn * Tl::TN * 8, Kd = round16(D);
  const int ntiles = (S + KS - 1) / KS;
  const int tile_end = min(ntiles, (static_cast<int>(blockIdx.x) + 1) * tiles_per_block);
  for (int tile = blockIdx.x * tiles_per_block; tile < tile_end; ++tile) {
    const int s0 = tile * KS;
    __syncthreads();  // M_f, z_f ready / previous tile consumed
#pragma unroll
    for (int i0 = 0; i0 < RPW; i0 += BATCH) {
      // every global load of BATCH rows first, then the math
      float2 xq[BATCH][PPL], xc[BATCH][PPL], xs[BATCH][PPL];
      float rq[BATCH];
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int s = s0 + warp + 8 * (i0 + i);
        const bool valid = s < S;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        rq[i] = valid ? __ldg(rstd + (b * N + n) * 2) : 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          const bool ok = valid && d < D;
          xq[i][j] = ok ? qkv.pair(qkv_index(b, n, 0, h, d, N, H, D)) : make_float2(0.f, 0.f);
          xc[i][j] = ok ? ldg2(rope_cos + n * D + d) : make_float2(0.f, 0.f);
          xs[i][j] = ok ? ldg2(rope_sin + n * D + d) : make_float2(0.f, 0.f);
        }
      }
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int r = warp + 8 * (i0 + i), s = s0 + r;
        float dpart = 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          if (d >= DP) continue;
          float2 qp, qr;
          prep_pair(xq[i][j], rq[i], wq[j], 1.f, xc[i][j], xs[i][j], qp, qr);
          st2(Qr + r * LDQ + d, qr.x, qr.y);
          dpart += qp.x * zs[d] + qp.y * zs[d + 1];
        }
        const float dn = warp_sum(dpart);
        if (lane == 0) {
          dens[r] = dn;
          if (s < S) den[static_cast<int64_t>(bh) * N + static_cast<int64_t>(f) * S + s] = dn;
        }
      }
    }
    __syncthreads();

    const int rows = min(KS, S - s0);
    float acc[Tl::TM][Tl::TN][4] = {};
    warp_mma<MODE, Tl::TM, Tl::TN>(acc, OpMK{Qr, LDQ}, m0, OpKM{Ms, LDM}, n0, Kd, rows, D);
#pragma unroll
    for (int i = 0; i < Tl::TM; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + 16 * i + g + 8 * half, s = s0 + r;
        if (s >= S) continue;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        const float scale = divide ? 1.f / (dens[r] + eps) : 1.f;
#pragma unroll
        for (int j = 0; j < Tl::TN; ++j) {
          const int col = n0 + 8 * j + 2 * t;
          if (col < D)
            out.set_pair(((b * N + n) * H + h) * D + col, acc[i][j][2 * half] * scale, acc[i][j][2 * half + 1] * scale);
        }
      }
  }
}

// ---------------------------------------------------------------------------
// backward
// ---------------------------------------------------------------------------
template <int DP>
struct BwdTile {
  static constexpr int KS = 32, WM = 2, WN = 4;
  static constexpr int TM1 = KS / (16 * WM), TN1 = DP / (8 * WN);  // dqʳ = dnum Mᵀ   (KS × DP)
  static constexpr int TM2 = DP / (16 * WM), TN2 = DP / (8 * WN);  // dM += qʳᵀ dnum (DP × DP)
  static_assert(is_padded_dim(DP) && TM2 * 16 * WM == DP && TN1 * 8 * WN == DP, "BwdTile: warps tile DP × DP");
};

template <int DP, MathMode MODE>
constexpr size_t bwd_smem_bytes() {  // M_f f32 [i][j], then the token tiles
  constexpr int KS = BwdTile<DP>::KS;
  return (static_cast<size_t>(DP) * pitch_mk(DP, MODE) + KS * pitch_km(DP, MODE) + 3 * KS * (DP + 8) + KS * (DP + 4) +
          DP + 3 * KS + KS * BwdTile<DP>::WN) *
         4;
}

template <int DP, MathMode MODE>
__global__ void __launch_bounds__(kThreads, 1)
    phase_c_bwd_kernel(Out dq_hat, float* __restrict__ dM, float* __restrict__ dz, In dout, In dden, In qkv,
                       const float* __restrict__ rstd, const float* __restrict__ qw, const float* __restrict__ rope_cos,
                       const float* __restrict__ rope_sin, const float* __restrict__ M, const float* __restrict__ z,
                       int H, int D, int F, int S, float eps, bool divide) {
  static_assert(MODE != MathMode::bf16, "bf16 mode runs phase_c_bwd_ld_kernel");
  using Tl = BwdTile<DP>;
  // dnum is read both ways (A of dnum Mᵀ, B of qʳᵀ dnum): DP + 4 keeps both at most 2-way.
  constexpr int KS = Tl::KS, LDM = pitch_mk(DP, MODE), LDR = pitch_km(DP, MODE), LDP = DP + 8, LDD = DP + 4;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* Ms = reinterpret_cast<float*>(smem_raw);  // M_f [i][j]: B of dnum Mᵀ, (n = i, k = j)
  float* Qr = Ms + DP * LDM;                       // qʳ [KS][LDR] (A of qʳᵀ dnum)
  float* Qp = Qr + KS * LDR;                       // q⁺    [KS][LDP]
  float* Cs = Qp + KS * LDP;                       // cos   [KS][LDP]  (for the epilogue's unrope)
  float* Sn = Cs + KS * LDP;                       // sin   [KS][LDP]
  float* Dn = Sn + KS * LDP;                       // dnum  [KS][LDD]  (A of dnum Mᵀ; B of qʳᵀ dnum)
  float* zs = Dn + KS * LDD;                       // z_f   [DP]
  float* dpe = zs + DP;                            // den + eps [KS]
  float* dd = dpe + KS;                            // dden  [KS]
  float* rowdot = dd + KS;                         // [KS]  (spare)
  float* part = rowdot + KS;                       // qʳ·dqʳ partials [KS][WN]

  const int bhf = blockIdx.x, bh = bhf / F, f = bhf % F, b = bh / H, h = bh % H;
  const int64_t N = static_cast<int64_t>(F) * S, mat0 = static_cast<int64_t>(bhf) * D * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  load_frame_state<DP>(Ms, LDM, zs, M + mat0, z + static_cast<int64_t>(bhf) * D, D, tid);

  constexpr int RPW = KS / 8, PPL = DP >= 64 ? DP / 64 : 1;
  float2 wq[PPL];
  q_weight_pairs(wq, qw, h, D, lane);

  const int wm = warp / Tl::WN, wn = warp % Tl::WN, Kd = round16(D);
  const int m1 = wm * Tl::TM1 * 16, n1 = wn * Tl::TN1 * 8;
  const int m2 = wm * Tl::TM2 * 16, n2 = wn * Tl::TN2 * 8;
  float acc2[Tl::TM2][Tl::TN2][4] = {};
  float dz_acc = 0.f;
  for (int s0 = 0; s0 < S; s0 += KS) {
    __syncthreads();  // M_f, z_f ready / previous tile consumed
    {
      // Every global load of this warp's rows (w, w+8, ...) in one batch, then the math.
      float2 xq[RPW][PPL], xc[RPW][PPL], xs[RPW][PPL], xg[RPW][PPL];
      float rq[RPW], ddin[RPW];
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        const int s = s0 + warp + 8 * i;
        const bool valid = s < S;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        rq[i] = valid ? __ldg(rstd + (b * N + n) * 2) : 0.f;
        ddin[i] = (!divide && valid && dden.p) ? dden[static_cast<int64_t>(bh) * N + n] : 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          const bool ok = valid && d < D;
          xq[i][j] = ok ? qkv.pair(qkv_index(b, n, 0, h, d, N, H, D)) : make_float2(0.f, 0.f);
          xc[i][j] = ok ? ldg2(rope_cos + n * D + d) : make_float2(0.f, 0.f);
          xs[i][j] = ok ? ldg2(rope_sin + n * D + d) : make_float2(0.f, 0.f);
          xg[i][j] = (ok && dout.p) ? dout.pair(((b * N + n) * H + h) * D + d) : make_float2(0.f, 0.f);
        }
      }
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        const int r = warp + 8 * i;
        float dpart = 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          if (d >= DP) continue;
          float2 qp, qr;
          prep_pair(xq[i][j], rq[i], wq[j], 1.f, xc[i][j], xs[i][j], qp, qr);
          st2(Qr + r * LDR + d, qr.x, qr.y);
          st2(Qp + r * LDP + d, qp.x, qp.y);
          st2(Cs + r * LDP + d, xc[i][j].x, xc[i][j].y);
          st2(Sn + r * LDP + d, xs[i][j].x, xs[i][j].y);
          dpart += qp.x * zs[d] + qp.y * zs[d + 1];
        }
        const float dn = warp_sum(dpart) + eps;
        const float inv = divide ? 1.f / dn : 1.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          if (d < DP) st2(Dn + r * LDD + d, xg[i][j].x * inv, xg[i][j].y * inv);
        }
        if (lane == 0) {
          dpe[r] = dn;
          dd[r] = ddin[i];
        }
      }
    }
    __syncthreads();

    const int rows = min(KS, S - s0);
    float acc1[Tl::TM1][Tl::TN1][4] = {};
    warp_mma<MODE, Tl::TM1, Tl::TN1>(acc1, OpMK{Dn, LDD}, m1, OpMK{Ms, LDM}, n1, Kd, rows, D);  // dqʳ = dnum Mᵀ
    warp_mma<MODE, Tl::TM2, Tl::TN2>(acc2, OpKM{Qr, LDR}, m2, OpKM{Dn, LDD}, n2, KS, D, D);     // dM += qʳᵀ dnum
    if (divide) {
#pragma unroll
      for (int i = 0; i < Tl::TM1; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m1 + 16 * i + g + 8 * half;
          float v = 0.f;
#pragma unroll
          for (int j = 0; j < Tl::TN1; ++j) {
            const float2 q = ld2(Qr + r * LDR + n1 + 8 * j + 2 * t);
            v += q.x * acc1[i][j][2 * half] + q.y * acc1[i][j][2 * half + 1];
          }
          v = quad_sum(v);
          if (t == 0) part[r * Tl::WN + wn] = v;
        }
      __syncthreads();
      if (tid < KS) {
        float v = 0.f;
        for (int w = 0; w < Tl::WN; ++w) v += part[tid * Tl::WN + w];
        dd[tid] = -v / dpe[tid];
      }
    }
    __syncthreads();  // dden ready
    if (tid < DP)
      for (int r = 0; r < KS; ++r) dz_acc += Qp[r * LDP + tid] * dd[r];
#pragma unroll
    for (int i = 0; i < Tl::TM1; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m1 + 16 * i + g + 8 * half, s = s0 + r;
        if (s >= S) continue;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        const float ddr = dd[r];
#pragma unroll
        for (int j = 0; j < Tl::TN1; ++j) {
          const int col = n1 + 8 * j + 2 * t;
          if (col >= D) continue;
          const float g0 = acc1[i][j][2 * half], g1 = acc1[i][j][2 * half + 1];
          const float2 c = ld2(Cs + r * LDP + col), sn = ld2(Sn + r * LDP + col), qp = ld2(Qp + r * LDP + col);
          const float d0 = ddr * zs[col] + g0 * c.x + g1 * sn.y;
          const float d1 = ddr * zs[col + 1] + g1 * c.y + g0 * sn.x;
          dq_hat.set_pair(((b * N + n) * H + h) * D + col, qp.x > 0.f ? d0 : 0.f, qp.y > 0.f ? d1 : 0.f);
        }
      }
  }

  store_tile(dM + mat0, acc2, m2, n2, D);
  if (tid < D) dz[static_cast<int64_t>(bhf) * D + tid] = dz_acc;
}

}  // namespace

namespace phase_c {

void fwd_f32(const FwdArgs& a, MathMode mode) {
  const FrameSizes& sz = a.z;
  const int sms = sm_count();
  with_dp_mode(sz.D, mode, [&](auto dp, auto md) {
    constexpr int DP = decltype(dp)::value;
    constexpr MathMode MODE = decltype(md)::value;
    if constexpr (MODE == MathMode::bf16) {
      GDNCP_FAIL("cuda phase C: bf16 mode runs the bf16 coding");
    } else {
      const int ntiles = (sz.S + FwdTile<DP>::KS - 1) / FwdTile<DP>::KS;
      // Two blocks per SM: split a frame's tokens so that the grid fills whole waves.
      const int splits = wave_splits(sz.BHF, 2 * sms, std::min(6, ntiles));
      const int per_block = (ntiles + splits - 1) / splits;
      const dim3 grid(static_cast<unsigned>((ntiles + per_block - 1) / per_block), static_cast<unsigned>(sz.BHF));
      const size_t smem = fwd_smem_bytes<DP, MODE>();
      allow_smem(phase_c_fwd_kernel<DP, MODE>, smem);
      phase_c_fwd_kernel<DP, MODE><<<grid, kThreads, smem, stream()>>>(a.out, a.den, a.qkv, a.rstd, a.qw, a.cos, a.sin,
                                                                       a.M, a.z_f, sz.H, sz.D, sz.F, sz.S, per_block,
                                                                       a.eps, a.divide);
      GDNCP_CUDA_CHECK_LAUNCH("phase_c_fwd_kernel");
    }
  });
}

void bwd_f32(const BwdArgs& a, MathMode mode) {
  const FrameSizes& sz = a.z;
  with_dp_mode(sz.D, mode, [&](auto dp, auto md) {
    constexpr int DP = decltype(dp)::value;
    constexpr MathMode MODE = decltype(md)::value;
    if constexpr (MODE == MathMode::bf16) {
      GDNCP_FAIL("cuda phase C: bf16 mode runs the bf16 coding");
    } else {
      const size_t smem = bwd_smem_bytes<DP, MODE>();
      allow_smem(phase_c_bwd_kernel<DP, MODE>, smem);
      phase_c_bwd_kernel<DP, MODE><<<static_cast<unsigned>(sz.BHF), kThreads, smem, stream()>>>(
          a.dq_hat, a.dM, a.dz, a.dout, a.dden, a.qkv, a.rstd, a.qw, a.cos, a.sin, a.M, a.z_f, sz.H, sz.D, sz.F, sz.S,
          a.eps, a.divide);
      GDNCP_CUDA_CHECK_LAUNCH("phase_c_bwd_kernel");
    }
  });
}

}  // namespace phase_c
}  // namespace cuda
}  // namespace gdncp
