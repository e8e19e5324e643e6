// src/kernels/phase_a/phase_a_f32.cu — phase A's f32 coding (phase_a.cu has the math and picks
// the coding): operand tiles in shared memory as f32 (Note [warp tiles]), every matrix-unit
// mode, qkv in f32 or bf16, rows loaded from global memory in channel pairs.
//
// Forward grid: (3 products, B·H·F) — one block owns one D×D product of one frame and
// loops over the frame's tokens in chunks of 32 (Note [warp tiles]).
// Backward grid: (token splits, B·H·F) — the three D×D gradients stay in shared memory
// while the block walks its tokens; every output is per token, so no reduction crosses
// blocks.
#include <algorithm>
#include <type_traits>

#include "kernels/common/cuda_common.cuh"
#include "kernels/phase_a/phase_a_cuda.cuh"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;
using namespace phase_a;

// The raw inputs of token s of frame (b, h, f) for lane `lane`'s channel pairs d = 2·lane + 64j:
// the k pairs, the v pairs (when want_v), the RoPE pairs (when want_rope), k's rstd and β; zeros
// for s ≥ S, for channels ≥ D and for the loads not wanted.
template <int PPL>
__device__ __forceinline__ void load_k_row(float2 (&xk)[PPL], float2 (&xv)[PPL], float2 (&xc)[PPL], float2 (&xs)[PPL],
                                           float& rk, float& bt, const In& qkv, const float* __restrict__ rstd,
                                           const float* __restrict__ rope_cos, const float* __restrict__ rope_sin,
                                           const In& beta, int b, int h, int f, int s, int bhf, int lane, int H, int D,
                                           int S, int64_t N, bool want_v, bool want_rope) {
  const bool valid = s < S;
  const int64_t n = static_cast<int64_t>(f) * S + s;
  rk = valid ? __ldg(rstd + (b * N + n) * 2 + 1) : 0.f;
  bt = valid ? beta[static_cast<int64_t>(bhf) * S + s] : 0.f;
#pragma unroll
  for (int j = 0; j < PPL; ++j) {
    const int d = 2 * lane + 64 * j;
    const bool ok = valid && d < D;
    const float2 zero = make_float2(0.f, 0.f);
    xk[j] = ok ? qkv.pair(qkv_index(b, n, 1, h, d, N, H, D)) : zero;
    xv[j] = (ok && want_v) ? qkv.pair(qkv_index(b, n, 2, h, d, N, H, D)) : zero;
    xc[j] = (ok && want_rope) ? ldg2(rope_cos + n * D + d) : zero;
    xs[j] = (ok && want_rope) ? ldg2(rope_sin + n * D + d) : zero;
  }
}

template <int DP>
struct FwdTile {  // 2 × 4 warps over the DP×DP product
  static constexpr int WM = 2, WN = 4, TM = DP / (16 * WM), TN = DP / (8 * WN), KS = 32;
  static_assert(is_padded_dim(DP) && TM * 16 * WM == DP && TN * 8 * WN == DP, "FwdTile: warps tile DP × DP exactly");
};

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------
template <int DP, MathMode MODE>
__global__ void __launch_bounds__(kThreads, 2)
    phase_a_fwd_kernel(float* __restrict__ P, float* __restrict__ A, float* __restrict__ Pz, float* __restrict__ bz,
                       In qkv, const float* __restrict__ rstd, const float* __restrict__ kw,
                       const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, In beta, int H, int D,
                       int F, int S, float k_scale) {
  using Tl = FwdTile<DP>;
  constexpr int KS = Tl::KS, LD = pitch_km(DP, MODE);
  __shared__ __align__(16) float Xs[KS * LD];  // β·(kʳ or k⁺), [s][d]
  __shared__ __align__(16) float Ys[KS * LD];  // kʳ, v or k⁺,  [s][d]

  const int prod = blockIdx.x;  // 0: P, 1: A, 2: Pz and b
  const int bhf = blockIdx.y, bh = bhf / F, f = bhf % F, b = bh / H, h = bh % H;
  const int64_t N = static_cast<int64_t>(F) * S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp / Tl::WN, wn = warp % Tl::WN;
  const int m0 = wm * Tl::TM * 16, n0 = wn * Tl::TN * 8;

  // Loads: warp w owns rows w, w+8, ...; lane l owns channel pairs d = 2l + 64j (j < PPL).
  constexpr int RPW = KS / 8, PPL = DP >= 64 ? DP / 64 : 1, BATCH = 2;
  float2 wk[PPL];
#pragma unroll
  for (int j = 0; j < PPL; ++j) {
    const int d = 2 * lane + 64 * j;
    wk[j] = d < D ? weight_pair(kw, h * D + d) : make_float2(0.f, 0.f);
  }

  float acc[Tl::TM][Tl::TN][4] = {};
  float bsum = 0.f;
  for (int s0 = 0; s0 < S; s0 += KS) {
    __syncthreads();  // the previous chunk is consumed
#pragma unroll
    for (int i0 = 0; i0 < RPW; i0 += BATCH) {
      // every global load of BATCH rows first, then the math
      float2 xk[BATCH][PPL], xv[BATCH][PPL], xc[BATCH][PPL], xs[BATCH][PPL];
      float rk[BATCH], bt[BATCH];
#pragma unroll
      for (int i = 0; i < BATCH; ++i)
        load_k_row(xk[i], xv[i], xc[i], xs[i], rk[i], bt[i], qkv, rstd, rope_cos, rope_sin, beta, b, h, f,
                   s0 + warp + 8 * (i0 + i), bhf, lane, H, D, S, N, prod == 1, prod != 2);
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int r = warp + 8 * (i0 + i);
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          if (d >= DP) continue;
          float2 kp, kr, x, y;
          prep_pair(xk[i][j], rk[i], wk[j], k_scale, xc[i][j], xs[i][j], kp, kr);
          if (prod == 0) {
            x = make_float2(bt[i] * kr.x, bt[i] * kr.y);
            y = kr;
          } else if (prod == 1) {
            x = make_float2(bt[i] * kr.x, bt[i] * kr.y);
            y = xv[i][j];
          } else {
            x = make_float2(bt[i] * kp.x, bt[i] * kp.y);
            y = kp;
          }
          st2(Xs + r * LD + d, x.x, x.y);
          st2(Ys + r * LD + d, y.x, y.y);
        }
      }
    }
    __syncthreads();
    if (prod == 2 && threadIdx.x < DP)
      for (int r = 0; r < KS; ++r) bsum += Xs[r * LD + threadIdx.x];
    // P(i, j) = Σ_s X[s][i] Y[s][j]: both operands are [k][mn] tiles.
    warp_mma<MODE, Tl::TM, Tl::TN>(acc, OpKM{Xs, LD}, m0, OpKM{Ys, LD}, n0, KS, D, D);
  }

  store_tile(P_or(prod, P, A, Pz) + static_cast<int64_t>(bhf) * D * D, acc, m0, n0, D);
  if (prod == 2 && threadIdx.x < D) bz[static_cast<int64_t>(bhf) * D + threadIdx.x] = bsum;
}

// ---------------------------------------------------------------------------
// backward
// ---------------------------------------------------------------------------
template <int DP>
struct BwdTile {  // each warp owns a column slice of all four products of a KS-token tile
  static constexpr int WN = DP >= 64 ? 8 : 4, WM = 8 / WN, TN = DP / (8 * WN), KS = 16 * WM;
  static_assert(is_padded_dim(DP) && TN * 8 * WN == DP, "BwdTile: the warps' column slices cover DP");
};

// Pitches of the three gradients in shared memory: Ps and Pzs are read as [k][n] in bf16 mode
// (DP + 2 is conflict-free there), dA both ways. The total stays under the 227 KB limit at DP = 128.
template <int DP, MathMode MODE>
constexpr int sym_pitch() {
  return MODE == MathMode::bf16 ? DP + 2 : DP + 4;
}

template <int DP, MathMode MODE>
constexpr size_t bwd_smem_floats() {
  using Tl = BwdTile<DP>;
  return static_cast<size_t>(DP) * (2 * sym_pitch<DP, MODE>() + DP + 4) +
         3 * static_cast<size_t>(Tl::KS) * pitch_mk(DP, MODE) + Tl::KS + DP + Tl::KS * Tl::WN;
}

template <int DP, MathMode MODE>
__global__ void __launch_bounds__(kThreads, 1)
    phase_a_bwd_kernel(Out dk_hat, Out dqkv, Out dbeta, const float* __restrict__ dP, const float* __restrict__ dA,
                       const float* __restrict__ dPz, const float* __restrict__ dbz, In qkv,
                       const float* __restrict__ rstd, const float* __restrict__ kw, const float* __restrict__ rope_cos,
                       const float* __restrict__ rope_sin, In beta, int H, int D, int F, int S, int tiles_per_block,
                       float k_scale) {
  using Tl = BwdTile<DP>;
  constexpr int KS = Tl::KS, LDS = sym_pitch<DP, MODE>(), LDA = DP + 4, LDT = pitch_mk(DP, MODE);
  extern __shared__ __align__(16) float smem[];
  float* SA = smem;            // dA            [DP][LDA]  (first: 16-byte aligned rows)
  float* SP = SA + DP * LDA;   // dP + dPᵀ      [DP][LDS]
  float* SPz = SP + DP * LDS;  // dPz + dPzᵀ    [DP][LDS]
  float* Kr = SPz + DP * LDS;  // kʳ            [KS][LDT]
  float* Vt = Kr + KS * LDT;   // v
  float* Kp = Vt + KS * LDT;   // k⁺
  float* bs = Kp + KS * LDT;   // β             [KS]
  float* db = bs + KS;         // dbz           [DP]
  float* part = db + DP;       // dβ partials   [KS][WN]

  const int bhf = blockIdx.y, bh = bhf / F, f = bhf % F, b = bh / H, h = bh % H;
  const int64_t N = static_cast<int64_t>(F) * S, DD = static_cast<int64_t>(D) * D, mat0 = bhf * DD;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // The three gradients, zero-padded to DP×DP, then symmetrised in place.
  for (int e = tid; e < DP * DP; e += kThreads) {
    const int i = e / DP, j = e % DP;
    const bool in = i < D && j < D;
    SP[i * LDS + j] = in ? dP[mat0 + i * D + j] : 0.f;
    SA[i * LDA + j] = in ? dA[mat0 + i * D + j] : 0.f;
    SPz[i * LDS + j] = in ? dPz[mat0 + i * D + j] : 0.f;
  }
  if (tid < DP) db[tid] = tid < D ? dbz[static_cast<int64_t>(bhf) * D + tid] : 0.f;
  __syncthreads();
  for (int e = tid; e < DP * DP; e += kThreads) {
    const int i = e / DP, j = e % DP;
    if (i < j) {
      const float s1 = SP[i * LDS + j] + SP[j * LDS + i], s2 = SPz[i * LDS + j] + SPz[j * LDS + i];
      SP[i * LDS + j] = SP[j * LDS + i] = s1;
      SPz[i * LDS + j] = SPz[j * LDS + i] = s2;
    } else if (i == j) {
      SP[i * LDS + i] *= 2.f;
      SPz[i * LDS + i] *= 2.f;
    }
  }

  // Symmetric operands are read in the orientation whose fragment loads are conflict-free.
  using OpSym = std::conditional_t<MODE == MathMode::tf32, OpMK, OpKM>;
  const int wm = warp / Tl::WN, wn = warp % Tl::WN;
  const int m0 = wm * 16, n0 = wn * Tl::TN * 8, Kd = round16(D);
  constexpr int RPW = KS / 8, PPL = DP >= 64 ? DP / 64 : 1;
  float2 wk[PPL];
#pragma unroll
  for (int j = 0; j < PPL; ++j) {
    const int d = 2 * lane + 64 * j;
    wk[j] = d < D ? weight_pair(kw, h * D + d) : make_float2(0.f, 0.f);
  }
  const int ntiles = (S + KS - 1) / KS;
  const int tile_end = min(ntiles, (static_cast<int>(blockIdx.x) + 1) * tiles_per_block);
  for (int tile = blockIdx.x * tiles_per_block; tile < tile_end; ++tile) {
    const int s0 = tile * KS;
    __syncthreads();  // matrices ready / previous tile consumed
    {
      // Every global load of this warp's rows (w, w+8, ...) in one batch, then the math.
      float2 xk[RPW][PPL], xv[RPW][PPL], xc[RPW][PPL], xs[RPW][PPL];
      float rk[RPW], bt[RPW];
#pragma unroll
      for (int i = 0; i < RPW; ++i)
        load_k_row(xk[i], xv[i], xc[i], xs[i], rk[i], bt[i], qkv, rstd, rope_cos, rope_sin, beta, b, h, f,
                   s0 + warp + 8 * i, bhf, lane, H, D, S, N, true, true);
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        const int r = warp + 8 * i;
        if (lane == 0) bs[r] = bt[i];
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          if (d >= DP) continue;
          float2 kp, kr;
          prep_pair(xk[i][j], rk[i], wk[j], k_scale, xc[i][j], xs[i][j], kp, kr);
          st2(Kr + r * LDT + d, kr.x, kr.y);
          st2(Kp + r * LDT + d, kp.x, kp.y);
          st2(Vt + r * LDT + d, xv[i][j].x, xv[i][j].y);
        }
      }
    }
    __syncthreads();
    // The rope of this thread's epilogue elements, fetched now so that the loads overlap the products.
    float2 ec[2][Tl::TN], es[2][Tl::TN];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int s = s0 + m0 + g + 8 * half;
      const int64_t n = static_cast<int64_t>(f) * S + s;
#pragma unroll
      for (int j = 0; j < Tl::TN; ++j) {
        const int col = n0 + 8 * j + 2 * t;
        const bool ok = s < S && col < D;
        ec[half][j] = ok ? ldg2(rope_cos + n * D + col) : make_float2(0.f, 0.f);
        es[half][j] = ok ? ldg2(rope_sin + n * D + col) : make_float2(0.f, 0.f);
      }
    }

    const int rows = min(KS, S - s0);
    float x1[1][Tl::TN][4] = {}, x2[1][Tl::TN][4] = {}, x3[1][Tl::TN][4] = {}, x4[1][Tl::TN][4] = {};
    warp_mma<MODE, 1, Tl::TN>(x1, OpMK{Kr, LDT}, m0, OpSym{SP, LDS}, n0, Kd, rows, D);   // kʳ Ps
    warp_mma<MODE, 1, Tl::TN>(x2, OpMK{Vt, LDT}, m0, OpMK{SA, LDA}, n0, Kd, rows, D);    // v dAᵀ
    warp_mma<MODE, 1, Tl::TN>(x3, OpMK{Kr, LDT}, m0, OpKM{SA, LDA}, n0, Kd, rows, D);    // kʳ dA
    warp_mma<MODE, 1, Tl::TN>(x4, OpMK{Kp, LDT}, m0, OpSym{SPz, LDS}, n0, Kd, rows, D);  // k⁺ Pzs

    float dbeta_part[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < Tl::TN; ++j) {
      const int col = n0 + 8 * j + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + g + 8 * half, s = s0 + r;
        const float2 a1 = make_float2(x1[0][j][2 * half], x1[0][j][2 * half + 1]);
        const float2 a2 = make_float2(x2[0][j][2 * half], x2[0][j][2 * half + 1]);
        const float2 a3 = make_float2(x3[0][j][2 * half], x3[0][j][2 * half + 1]);
        const float2 a4 = make_float2(x4[0][j][2 * half], x4[0][j][2 * half + 1]);
        const float bt = bs[r];
        const float2 kr = ld2(Kr + r * LDT + col), kp = ld2(Kp + r * LDT + col), dbv = ld2(db + col);
        dbeta_part[half] += dbeta_pair(kr, kp, a1, a2, a4, dbv);
        if (s >= S || col >= D) continue;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        store_k_grads(dk_hat, dqkv, ((b * N + n) * H + h) * D + col, qkv_index(b, n, 2, h, col, N, H, D), bt, a1, a2,
                      a3, a4, dbv, kp, ec[half][j], es[half][j], k_scale);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float v = dbeta_part[half];
      v = quad_sum(v);
      if (t == 0) part[(m0 + g + 8 * half) * Tl::WN + wn] = v;
    }
    __syncthreads();
    if (tid < KS && s0 + tid < S) {
      float v = 0.f;
      for (int w = 0; w < Tl::WN; ++w) v += part[tid * Tl::WN + w];
      dbeta.set(static_cast<int64_t>(bhf) * S + s0 + tid, v);
    }
  }
}

}  // namespace

namespace phase_a {

void fwd_f32(const FwdArgs& a, MathMode mode) {
  const FrameSizes& z = a.z;
  with_dp_mode(z.D, mode, [&](auto dp, auto md) {
    constexpr int DP = decltype(dp)::value;
    constexpr MathMode MODE = decltype(md)::value;
    const dim3 grid(3, static_cast<unsigned>(z.BHF));
    phase_a_fwd_kernel<DP, MODE><<<grid, kThreads, 0, stream()>>>(a.P, a.A, a.Pz, a.bz, a.qkv, a.rstd, a.kw, a.cos,
                                                                  a.sin, a.beta, z.H, z.D, z.F, z.S, a.k_scale);
    GDNCP_CUDA_CHECK_LAUNCH("phase_a_fwd_kernel");
  });
}

void bwd_f32(const BwdArgs& a, MathMode mode) {
  const FrameSizes& z = a.z;
  const int sms = sm_count();
  with_dp_mode(z.D, mode, [&](auto dp, auto md) {
    constexpr int DP = decltype(dp)::value;
    constexpr MathMode MODE = decltype(md)::value;
    const int ntiles = (z.S + BwdTile<DP>::KS - 1) / BwdTile<DP>::KS;
    // One block per SM (shared memory): split a frame's tokens so that the grid fills whole waves.
    const int splits = wave_splits(z.BHF, sms, std::min(4, ntiles));
    const int per_block = (ntiles + splits - 1) / splits;
    const dim3 grid(static_cast<unsigned>((ntiles + per_block - 1) / per_block), static_cast<unsigned>(z.BHF));
    const size_t smem = bwd_smem_floats<DP, MODE>() * sizeof(float);
    allow_smem(phase_a_bwd_kernel<DP, MODE>, smem);
    phase_a_bwd_kernel<DP, MODE><<<grid, kThreads, smem, stream()>>>(a.dk_hat, a.dqkv, a.dbeta, a.dP, a.dA, a.dPz,
                                                                     a.dbz, a.qkv, a.rstd, a.kw, a.cos, a.sin, a.beta,
                                                                     z.H, z.D, z.F, z.S, per_block, a.k_scale);
    GDNCP_CUDA_CHECK_LAUNCH("phase_a_bwd_kernel");
  });
}

}  // namespace phase_a
}  // namespace cuda
}  // namespace gdncp
