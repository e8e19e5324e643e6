// src/kernels/phase_a.cu — CUDA twin of phase A (SPEC §3) with the k prep
// (SPEC §2: RMSNorm apply, relu, k_scale, RoPE) fused into the load of qkv in
// its native (B, N, 3, H, D) layout.
//
// Forward, per (b, h, frame f), the frame's S tokens as rows:
//   k̂ = k·r·w,  k⁺ = relu(k̂)·k_scale,  kʳ = rope(k⁺)
//   P_f = kʳᵀ diag(β) kʳ,  A_f = kʳᵀ diag(β) v,  Pz_f = k⁺ᵀ diag(β) k⁺,  b_f = k⁺ᵀ β
// Backward, per token s (Ps = dP + dPᵀ, Pzs = dPz + dPzᵀ):
//   dkʳ = β (kʳ Ps + v dAᵀ),  dv = β kʳ dA,  dk⁺ = β (k⁺ Pzs + db) + unrope(dkʳ),
//   dβ = kʳ·(½ kʳ Ps + v dAᵀ) + k⁺·(½ k⁺ Pzs + db),  dk̂ = dk⁺·k_scale·[k̂ > 0]
// (row-vector form of phase_a_ref.cpp; kʳ dA vᵀ = kʳ·(v dAᵀ)).
// Gradient rule: dk_hat, the v channel of dqkv and dbeta are overwritten.
//
// Forward grid: (3 products, B·H·F) — one block owns one D×D product of one
// frame and loops over the frame's tokens in chunks of 32 (Note [warp tiles]).
// Backward grid: (token splits, B·H·F) — the three D×D gradients stay in
// shared memory while the block walks its tokens; every output is per token,
// so no reduction crosses blocks.
#include <algorithm>
#include <type_traits>

#include "kernels/cuda_common.cuh"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

template <int DP>
struct FwdTile {  // 2 × 4 warps over the DP×DP product
  static constexpr int WM = 2, WN = 4, TM = DP / (16 * WM), TN = DP / (8 * WN), KS = 32;
};

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------
template <int DP, MathMode MODE>
__global__ void __launch_bounds__(kThreads, 2) phase_a_fwd_kernel(float* __restrict__ P, float* __restrict__ A,
                                                               float* __restrict__ Pz, float* __restrict__ bz, In qkv,
                                                               const float* __restrict__ rstd,
                                                               const float* __restrict__ kw,
                                                               const float* __restrict__ rope_cos,
                                                               const float* __restrict__ rope_sin, In beta, int H,
                                                               int D, int F, int S, float k_scale) {
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
      for (int i = 0; i < BATCH; ++i) {
        const int s = s0 + warp + 8 * (i0 + i);
        const bool valid = s < S;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        rk[i] = valid ? __ldg(rstd + (b * N + n) * 2 + 1) : 0.f;
        bt[i] = valid ? beta[static_cast<int64_t>(bhf) * S + s] : 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          const bool ok = valid && d < D;
          const float2 zero = make_float2(0.f, 0.f);
          xk[i][j] = ok ? qkv.pair(qkv_index(b, n, 1, h, d, N, H, D)) : zero;
          xv[i][j] = (ok && prod == 1) ? qkv.pair(qkv_index(b, n, 2, h, d, N, H, D)) : zero;
          xc[i][j] = (ok && prod != 2) ? ldg2(rope_cos + n * D + d) : zero;
          xs[i][j] = (ok && prod != 2) ? ldg2(rope_sin + n * D + d) : zero;
        }
      }
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

  float* out = (prod == 0 ? P : prod == 1 ? A : Pz) + static_cast<int64_t>(bhf) * D * D;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < Tl::TM; ++i)
#pragma unroll
    for (int j = 0; j < Tl::TN; ++j) {
      const int row = m0 + 16 * i + g, col = n0 + 8 * j + 2 * t;
      if (col >= D) continue;
      if (row < D) st2(out + row * D + col, acc[i][j][0], acc[i][j][1]);
      if (row + 8 < D) st2(out + (row + 8) * D + col, acc[i][j][2], acc[i][j][3]);
    }
  if (prod == 2 && threadIdx.x < D) bz[static_cast<int64_t>(bhf) * D + threadIdx.x] = bsum;
}

// bf16 mode (Note [ldmatrix tiles]): the same block layout with bf16 operand tiles of 64 tokens,
// both read as [k][mn] through ldmatrix.trans. b_f is summed in f32 from the values before
// rounding: per thread over its rows, then over the warps in a fixed order.
template <int DP>
struct FwdHTile {
  static constexpr int WM = 2, WN = 4, TM = DP / (16 * WM), TN = DP / (8 * WN), KS = 64;
};

template <int DP>
__global__ void __launch_bounds__(kThreads, 2)
    phase_a_fwd_h_kernel(float* __restrict__ P, float* __restrict__ A, float* __restrict__ Pz, float* __restrict__ bz,
                         In qkv, const float* __restrict__ rstd, const float* __restrict__ kw,
                         const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, In beta, int H, int D,
                         int F, int S, float k_scale) {
  using Tl = FwdHTile<DP>;
  constexpr int KS = Tl::KS, LD = pitch_ld(DP);
  constexpr int RPW = KS / 8, PPL = DP >= 64 ? DP / 64 : 1, BATCH = 2;
  __shared__ __align__(16) __nv_bfloat16 Xh[KS * LD];  // β·(kʳ or k⁺), [s][d]
  __shared__ __align__(16) __nv_bfloat16 Yh[KS * LD];  // kʳ, v or k⁺,  [s][d]
  __shared__ float bpart[8][DP];                       // Pz block: per-warp Σ_s β k⁺

  const int prod = blockIdx.x;  // 0: P, 1: A, 2: Pz and b
  const int bhf = blockIdx.y, bh = bhf / F, f = bhf % F, b = bh / H, h = bh % H;
  const int64_t N = static_cast<int64_t>(F) * S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp / Tl::WN, wn = warp % Tl::WN;
  const int m0 = wm * Tl::TM * 16, n0 = wn * Tl::TN * 8;

  float2 wk[PPL], bacc[PPL];
#pragma unroll
  for (int j = 0; j < PPL; ++j) {
    const int d = 2 * lane + 64 * j;
    wk[j] = d < D ? weight_pair(kw, h * D + d) : make_float2(0.f, 0.f);
    bacc[j] = make_float2(0.f, 0.f);
  }

  float acc[Tl::TM][Tl::TN][4] = {};
  for (int s0 = 0; s0 < S; s0 += KS) {
    __syncthreads();  // the previous chunk is consumed
#pragma unroll
    for (int i0 = 0; i0 < RPW; i0 += BATCH) {
      float2 xk[BATCH][PPL], xv[BATCH][PPL], xc[BATCH][PPL], xs[BATCH][PPL];
      float rk[BATCH], bt[BATCH];
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int s = s0 + warp + 8 * (i0 + i);
        const bool valid = s < S;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        rk[i] = valid ? __ldg(rstd + (b * N + n) * 2 + 1) : 0.f;
        bt[i] = valid ? beta[static_cast<int64_t>(bhf) * S + s] : 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          const bool ok = valid && d < D;
          const float2 zero = make_float2(0.f, 0.f);
          xk[i][j] = ok ? qkv.pair(qkv_index(b, n, 1, h, d, N, H, D)) : zero;
          xv[i][j] = (ok && prod == 1) ? qkv.pair(qkv_index(b, n, 2, h, d, N, H, D)) : zero;
          xc[i][j] = (ok && prod != 2) ? ldg2(rope_cos + n * D + d) : zero;
          xs[i][j] = (ok && prod != 2) ? ldg2(rope_sin + n * D + d) : zero;
        }
      }
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int r = warp + 8 * (i0 + i);
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          if (d >= DP) continue;
          float2 kp, kr, x, y;
          prep_pair(xk[i][j], rk[i], wk[j], k_scale, xc[i][j], xs[i][j], kp, kr);
          if (prod == 2) {
            x = make_float2(bt[i] * kp.x, bt[i] * kp.y);
            y = kp;
            bacc[j].x += x.x;
            bacc[j].y += x.y;
          } else {
            x = make_float2(bt[i] * kr.x, bt[i] * kr.y);
            y = prod == 0 ? kr : xv[i][j];
          }
          st2h(Xh + r * LD + d, x.x, x.y);
          st2h(Yh + r * LD + d, y.x, y.y);
        }
      }
    }
    __syncthreads();
    // P(i, j) = Σ_s X[s][i] Y[s][j]: both operands are [k][mn] tiles.
    warp_mma_ld<Tl::TM, Tl::TN>(acc, LdCol{Xh, LD}, m0, LdCol{Yh, LD}, n0, KS, D, D);
  }

  float* out = (prod == 0 ? P : prod == 1 ? A : Pz) + static_cast<int64_t>(bhf) * D * D;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < Tl::TM; ++i)
#pragma unroll
    for (int j = 0; j < Tl::TN; ++j) {
      const int row = m0 + 16 * i + g, col = n0 + 8 * j + 2 * t;
      if (col >= D) continue;
      if (row < D) st2(out + row * D + col, acc[i][j][0], acc[i][j][1]);
      if (row + 8 < D) st2(out + (row + 8) * D + col, acc[i][j][2], acc[i][j][3]);
    }
  if (prod == 2) {
#pragma unroll
    for (int j = 0; j < PPL; ++j) {
      const int d = 2 * lane + 64 * j;
      if (d < DP) st2(&bpart[warp][d], bacc[j].x, bacc[j].y);
    }
    __syncthreads();
    if (threadIdx.x < D) {
      float v = 0.f;
      for (int w = 0; w < 8; ++w) v += bpart[w][threadIdx.x];
      bz[static_cast<int64_t>(bhf) * D + threadIdx.x] = v;
    }
  }
}

// ---------------------------------------------------------------------------
// backward
// ---------------------------------------------------------------------------
template <int DP>
struct BwdTile {  // each warp owns a column slice of all four products of a KS-token tile
  static constexpr int WN = DP >= 64 ? 8 : 4, WM = 8 / WN, TN = DP / (8 * WN), KS = 16 * WM;
};

// Pitches of the three gradients in shared memory: Ps and Pzs are read as [k][n] in bf16 mode
// (DP + 2 is conflict-free there), dA both ways. The total stays under the 227 KB limit at DP = 128.
template <int DP, MathMode MODE>
constexpr int sym_pitch() { return MODE == MathMode::bf16 ? DP + 2 : DP + 4; }

template <int DP, MathMode MODE>
constexpr size_t bwd_smem_floats() {
  using Tl = BwdTile<DP>;
  return static_cast<size_t>(DP) * (2 * sym_pitch<DP, MODE>() + DP + 4) +
         3 * static_cast<size_t>(Tl::KS) * pitch_mk(DP, MODE) + Tl::KS + DP + Tl::KS * Tl::WN;
}

template <int DP, MathMode MODE>
__global__ void __launch_bounds__(kThreads, 1)
    phase_a_bwd_kernel(Out dk_hat, Out dqkv, Out dbeta, const float* __restrict__ dP,
                       const float* __restrict__ dA, const float* __restrict__ dPz, const float* __restrict__ dbz,
                       In qkv, const float* __restrict__ rstd, const float* __restrict__ kw,
                       const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, In beta, int H, int D,
                       int F, int S, int tiles_per_block, float k_scale) {
  using Tl = BwdTile<DP>;
  constexpr int KS = Tl::KS, LDS = sym_pitch<DP, MODE>(), LDA = DP + 4, LDT = pitch_mk(DP, MODE);
  extern __shared__ __align__(16) float smem[];
  float* SA = smem;             // dA            [DP][LDA]  (first: 16-byte aligned rows)
  float* SP = SA + DP * LDA;    // dP + dPᵀ      [DP][LDS]
  float* SPz = SP + DP * LDS;   // dPz + dPzᵀ    [DP][LDS]
  float* Kr = SPz + DP * LDS;   // kʳ            [KS][LDT]
  float* Vt = Kr + KS * LDT;    // v
  float* Kp = Vt + KS * LDT;    // k⁺
  float* bs = Kp + KS * LDT;    // β             [KS]
  float* db = bs + KS;          // dbz           [DP]
  float* part = db + DP;        // dβ partials   [KS][WN]

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
      for (int i = 0; i < RPW; ++i) {
        const int s = s0 + warp + 8 * i;
        const bool valid = s < S;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        rk[i] = valid ? __ldg(rstd + (b * N + n) * 2 + 1) : 0.f;
        bt[i] = valid ? beta[static_cast<int64_t>(bhf) * S + s] : 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          const bool ok = valid && d < D;
          const float2 zero = make_float2(0.f, 0.f);
          xk[i][j] = ok ? qkv.pair(qkv_index(b, n, 1, h, d, N, H, D)) : zero;
          xv[i][j] = ok ? qkv.pair(qkv_index(b, n, 2, h, d, N, H, D)) : zero;
          xc[i][j] = ok ? ldg2(rope_cos + n * D + d) : zero;
          xs[i][j] = ok ? ldg2(rope_sin + n * D + d) : zero;
        }
      }
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
        const float a1 = x1[0][j][2 * half], b1 = x1[0][j][2 * half + 1];
        const float a2 = x2[0][j][2 * half], b2 = x2[0][j][2 * half + 1];
        const float a3 = x3[0][j][2 * half], b3 = x3[0][j][2 * half + 1];
        const float a4 = x4[0][j][2 * half], b4 = x4[0][j][2 * half + 1];
        const float bt = bs[r];
        const float2 kr = ld2(Kr + r * LDT + col), kp = ld2(Kp + r * LDT + col), dbv = ld2(db + col);
        dbeta_part[half] += kr.x * (0.5f * a1 + a2) + kr.y * (0.5f * b1 + b2) + kp.x * (0.5f * a4 + dbv.x) +
                            kp.y * (0.5f * b4 + dbv.y);
        if (s >= S || col >= D) continue;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        const float dkr0 = bt * (a1 + a2), dkr1 = bt * (b1 + b2);
        const float2 c = ec[half][j], sn = es[half][j];
        const float dkp0 = bt * (a4 + dbv.x) + dkr0 * c.x + dkr1 * sn.y;
        const float dkp1 = bt * (b4 + dbv.y) + dkr1 * c.y + dkr0 * sn.x;
        dk_hat.set_pair(((b * N + n) * H + h) * D + col, kp.x != 0.f ? dkp0 * k_scale : 0.f,
                        kp.y != 0.f ? dkp1 * k_scale : 0.f);
        dqkv.set_pair(qkv_index(b, n, 2, h, col, N, H, D), bt * a3, bt * b3);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float v = dbeta_part[half];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
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

// bf16 mode (Note [ldmatrix tiles]): the gradients live in shared memory as bf16 in [n][k]
// layout, the token tiles kʳ, v, k⁺ as bf16 [s][d]; every fragment is one ldmatrix, and the
// kʳ fragments feed both kʳ Ps and kʳ dA. Ps = dP + dPᵀ is formed in f32 in a scratch area
// (the later token tiles) and rounded once, as the f32 path rounds it. The epilogue reads kʳ
// and k⁺ from f32 copies, so dβ and the relu mask see the unrounded values.
template <int DP>
struct HTile {
  static constexpr int WN = DP / 16 < 8 ? DP / 16 : 8, WM = 8 / WN, TM = DP == 128 ? 2 : 1, TN = 2,
                       KS = 16 * WM * TM;
};

template <int DP>
constexpr int h_f32_pitch() { return DP + 8; }  // float2 epilogue reads at r·ld + 2t: conflict-free per half warp

template <int DP>
constexpr size_t h_smem_bytes() {
  using Tl = HTile<DP>;
  constexpr size_t mats = 4 * static_cast<size_t>(DP) * pitch_ld(DP) * 2;
  constexpr size_t tiles = (2 * static_cast<size_t>(Tl::KS) * h_f32_pitch<DP>() + Tl::KS + DP + Tl::KS * Tl::WN) * 4 +
                           3 * static_cast<size_t>(Tl::KS) * pitch_ld(DP) * 2;
  constexpr size_t scratch = static_cast<size_t>(DP) * DP * 4;
  return mats + (tiles > scratch ? tiles : scratch);
}

template <int DP>
__global__ void __launch_bounds__(kThreads, 1)
    phase_a_bwd_h_kernel(Out dk_hat, Out dqkv, Out dbeta, const float* __restrict__ dP, const float* __restrict__ dA,
                         const float* __restrict__ dPz, const float* __restrict__ dbz, In qkv,
                         const float* __restrict__ rstd, const float* __restrict__ kw,
                         const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, In beta, int H,
                         int D, int F, int S, int tiles_per_block, float k_scale) {
  using Tl = HTile<DP>;
  constexpr int KS = Tl::KS, TM = Tl::TM, TN = Tl::TN, LH = pitch_ld(DP), LDF = h_f32_pitch<DP>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* HP = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // Ps   [j][i]  (B of kʳ Ps; symmetric)
  __nv_bfloat16* HA = HP + DP * LH;                                 // dA   [i][j]  (B of v dAᵀ)
  __nv_bfloat16* HAT = HA + DP * LH;                                // dAᵀ  [j][i]  (B of kʳ dA)
  __nv_bfloat16* HPz = HAT + DP * LH;                               // Pzs  [j][i]
  float* f32 = reinterpret_cast<float*>(HPz + DP * LH);
  float* T = f32;                 // scratch [DP][DP] while the gradients are loaded
  float* Kr = f32;                // kʳ  [KS][LDF]  (epilogue)
  float* Kp = Kr + KS * LDF;      // k⁺
  float* bs = Kp + KS * LDF;      // β   [KS]
  float* db = bs + KS;            // dbz [DP]
  float* part = db + DP;          // dβ partials [KS][WN]
  __nv_bfloat16* Krh = reinterpret_cast<__nv_bfloat16*>(part + KS * Tl::WN);  // kʳ [KS][LH]  (A operands)
  __nv_bfloat16* Vh = Krh + KS * LH;                                           // v
  __nv_bfloat16* Kph = Vh + KS * LH;                                           // k⁺

  const int bhf = blockIdx.y, bh = bhf / F, f = bhf % F, b = bh / H, h = bh % H;
  const int64_t N = static_cast<int64_t>(F) * S, DD = static_cast<int64_t>(D) * D, mat0 = bhf * DD;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // dA and dAᵀ straight from global; Ps and Pzs through the f32 scratch.
  for (int e = tid; e < DP * DP; e += kThreads) {
    const int i = e / DP, j = e % DP;
    const float a = (i < D && j < D) ? dA[mat0 + i * D + j] : 0.f;
    HA[i * LH + j] = __float2bfloat16_rn(a);
    HAT[j * LH + i] = __float2bfloat16_rn(a);
  }
  for (int which = 0; which < 2; ++which) {
    const float* src = which == 0 ? dP : dPz;
    __nv_bfloat16* dst = which == 0 ? HP : HPz;
    __syncthreads();  // scratch free
    for (int e = tid; e < DP * DP; e += kThreads) {
      const int i = e / DP, j = e % DP;
      T[e] = (i < D && j < D) ? src[mat0 + i * D + j] : 0.f;
    }
    __syncthreads();
    for (int e = tid; e < DP * DP; e += kThreads) {
      const int i = e / DP, j = e % DP;
      dst[i * LH + j] = __float2bfloat16_rn(T[i * DP + j] + T[j * DP + i]);
    }
  }
  __syncthreads();  // scratch no longer needed
  if (tid < DP) db[tid] = tid < D ? dbz[static_cast<int64_t>(bhf) * D + tid] : 0.f;

  const int wm = warp / Tl::WN, wn = warp % Tl::WN;
  const int m0 = wm * TM * 16, n0 = wn * TN * 8, Kd = round16(D);
  constexpr int RPW = KS / 8, PPL = DP >= 64 ? DP / 64 : 1;
  float2 wk[PPL];
#pragma unroll
  for (int j = 0; j < PPL; ++j) {
    const int d = 2 * lane + 64 * j;
    wk[j] = d < D ? weight_pair(kw, h * D + d) : make_float2(0.f, 0.f);
  }
  const LdRow aKr{Krh, LH}, aV{Vh, LH}, aKp{Kph, LH}, bP{HP, LH}, bA{HA, LH}, bAT{HAT, LH}, bPz{HPz, LH};
  const int ntiles = (S + KS - 1) / KS;
  const int tile_end = min(ntiles, (static_cast<int>(blockIdx.x) + 1) * tiles_per_block);
  for (int tile = blockIdx.x * tiles_per_block; tile < tile_end; ++tile) {
    const int s0 = tile * KS;
    __syncthreads();  // previous tile consumed
    {
      float2 xk[RPW][PPL], xv[RPW][PPL], xc[RPW][PPL], xs[RPW][PPL];
      float rk[RPW], bt[RPW];
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        const int s = s0 + warp + 8 * i;
        const bool valid = s < S;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        rk[i] = valid ? __ldg(rstd + (b * N + n) * 2 + 1) : 0.f;
        bt[i] = valid ? beta[static_cast<int64_t>(bhf) * S + s] : 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int d = 2 * lane + 64 * j;
          const bool ok = valid && d < D;
          const float2 zero = make_float2(0.f, 0.f);
          xk[i][j] = ok ? qkv.pair(qkv_index(b, n, 1, h, d, N, H, D)) : zero;
          xv[i][j] = ok ? qkv.pair(qkv_index(b, n, 2, h, d, N, H, D)) : zero;
          xc[i][j] = ok ? ldg2(rope_cos + n * D + d) : zero;
          xs[i][j] = ok ? ldg2(rope_sin + n * D + d) : zero;
        }
      }
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
          st2(Kr + r * LDF + d, kr.x, kr.y);
          st2(Kp + r * LDF + d, kp.x, kp.y);
          st2h(Krh + r * LH + d, kr.x, kr.y);
          st2h(Kph + r * LH + d, kp.x, kp.y);
          st2h(Vh + r * LH + d, xv[i][j].x, xv[i][j].y);
        }
      }
    }
    __syncthreads();
    // The rope of this thread's epilogue elements, fetched now so that the loads overlap the products.
    float2 ec[TM][2][TN], es[TM][2][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int s = s0 + m0 + 16 * i + g + 8 * half;
        const int64_t n = static_cast<int64_t>(f) * S + s;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const int col = n0 + 8 * j + 2 * t;
          const bool ok = s < S && col < D;
          ec[i][half][j] = ok ? ldg2(rope_cos + n * D + col) : make_float2(0.f, 0.f);
          es[i][half][j] = ok ? ldg2(rope_sin + n * D + col) : make_float2(0.f, 0.f);
        }
      }

    // The four products of the tile: x1 = kʳ Ps, x2 = v dAᵀ, x3 = kʳ dA, x4 = k⁺ Pzs.
    const int rows = min(KS, S - s0);
    float x1[TM][TN][4] = {}, x2[TM][TN][4] = {}, x3[TM][TN][4] = {}, x4[TM][TN][4] = {};
    if (n0 < D) {
      for (int k = 0; k < Kd; k += 16) {
        uint32_t fk[TM][4] = {}, fv[TM][4] = {}, fp[TM][4] = {}, gP[TN][2], gA[TN][2], gAT[TN][2], gPz[TN][2];
#pragma unroll
        for (int i = 0; i < TM; ++i)
          if (m0 + 16 * i < rows) {
            aKr.a(fk[i], m0 + 16 * i, k, lane);
            aV.a(fv[i], m0 + 16 * i, k, lane);
            aKp.a(fp[i], m0 + 16 * i, k, lane);
          }
        bP.b2(gP[0], gP[1], n0, k, lane);
        bA.b2(gA[0], gA[1], n0, k, lane);
        bAT.b2(gAT[0], gAT[1], n0, k, lane);
        bPz.b2(gPz[0], gPz[1], n0, k, lane);
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j)
            if (m0 + 16 * i < rows && n0 + 8 * j < D) {
              mma_bf16(x1[i][j], fk[i], gP[j]);
              mma_bf16(x2[i][j], fv[i], gA[j]);
              mma_bf16(x3[i][j], fk[i], gAT[j]);
              mma_bf16(x4[i][j], fp[i], gPz[j]);
            }
      }
    }

    float dbeta_part[TM][2] = {};
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        const int col = n0 + 8 * j + 2 * t;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m0 + 16 * i + g + 8 * half, s = s0 + r;
          const float a1 = x1[i][j][2 * half], b1 = x1[i][j][2 * half + 1];
          const float a2 = x2[i][j][2 * half], b2 = x2[i][j][2 * half + 1];
          const float a3 = x3[i][j][2 * half], b3 = x3[i][j][2 * half + 1];
          const float a4 = x4[i][j][2 * half], b4 = x4[i][j][2 * half + 1];
          const float btr = bs[r];
          const float2 kr = ld2(Kr + r * LDF + col), kp = ld2(Kp + r * LDF + col), dbv = ld2(db + col);
          dbeta_part[i][half] += kr.x * (0.5f * a1 + a2) + kr.y * (0.5f * b1 + b2) + kp.x * (0.5f * a4 + dbv.x) +
                                 kp.y * (0.5f * b4 + dbv.y);
          if (s >= S || col >= D) continue;
          const int64_t n = static_cast<int64_t>(f) * S + s;
          const float dkr0 = btr * (a1 + a2), dkr1 = btr * (b1 + b2);
          const float2 c = ec[i][half][j], sn = es[i][half][j];
          const float dkp0 = btr * (a4 + dbv.x) + dkr0 * c.x + dkr1 * sn.y;
          const float dkp1 = btr * (b4 + dbv.y) + dkr1 * c.y + dkr0 * sn.x;
          dk_hat.set_pair(((b * N + n) * H + h) * D + col, kp.x != 0.f ? dkp0 * k_scale : 0.f,
                          kp.y != 0.f ? dkp1 * k_scale : 0.f);
          dqkv.set_pair(qkv_index(b, n, 2, h, col, N, H, D), btr * a3, btr * b3);
        }
      }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float v = dbeta_part[i][half];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (t == 0) part[(m0 + 16 * i + g + 8 * half) * Tl::WN + wn] = v;
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

// ---------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------
void phase_a_fwd(Tensor& P, Tensor& A, Tensor& Pz, Tensor& bz, const Tensor& qkv, const Tensor& rstd,
                 const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta,
                 const Dims& d, double k_scale, MathMode mode) {
  const FrameSizes z = frame_sizes(d, "cuda phase A");
  const In x = in_of(qkv, "qkv"), bt = in_of(beta, "beta");
  float *p = f32_out(P, "P"), *a = f32_out(A, "A"), *pz = f32_out(Pz, "Pz"), *b = f32_out(bz, "bz");
  const float *r = f32_or_null(rstd, "rstd"), *kw = f32_or_null(k_norm_w, "k_norm_w");
  const float *cs = f32_or_null(rope_cos, "rope_cos"), *sn = f32_or_null(rope_sin, "rope_sin");
  with_dp_mode(d.D, mode, [&](auto dp, auto md) {
    constexpr int DP = decltype(dp)::value;
    constexpr MathMode MODE = decltype(md)::value;
    const dim3 grid(3, static_cast<unsigned>(z.BHF));
    if constexpr (MODE == MathMode::bf16)
      phase_a_fwd_h_kernel<DP><<<grid, kThreads, 0, stream()>>>(p, a, pz, b, x, r, kw, cs, sn, bt, z.H, z.D, z.F, z.S,
                                                                static_cast<float>(k_scale));
    else
      phase_a_fwd_kernel<DP, MODE><<<grid, kThreads, 0, stream()>>>(p, a, pz, b, x, r, kw, cs, sn, bt, z.H, z.D, z.F,
                                                                     z.S, static_cast<float>(k_scale));
    GDNCP_CUDA_CHECK(cudaGetLastError());
  });
}

void phase_a_bwd(Tensor& dk_hat, Tensor& dqkv, Tensor& dbeta, const Tensor& dP, const Tensor& dA, const Tensor& dPz,
                 const Tensor& dbz, const Tensor& qkv, const Tensor& rstd, const Tensor& k_norm_w,
                 const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& beta, const Dims& d, double k_scale,
                 MathMode mode) {
  const FrameSizes z = frame_sizes(d, "cuda phase A");
  const In x = in_of(qkv, "qkv"), bt = in_of(beta, "beta");
  const Out dx = out_of(dqkv, "dqkv"), dbt = out_of(dbeta, "dbeta");
  const Out dk = out_of(dk_hat, "dk_hat");
  const float *gp = f32_or_null(dP, "dP"), *ga = f32_or_null(dA, "dA"), *gpz = f32_or_null(dPz, "dPz"),
              *gb = f32_or_null(dbz, "dbz");
  const float *r = f32_or_null(rstd, "rstd"), *kw = f32_or_null(k_norm_w, "k_norm_w");
  const float *cs = f32_or_null(rope_cos, "rope_cos"), *sn = f32_or_null(rope_sin, "rope_sin");
  const int sms = sm_count();
  with_dp_mode(d.D, mode, [&](auto dp, auto md) {
    constexpr int DP = decltype(dp)::value;
    constexpr MathMode MODE = decltype(md)::value;
    constexpr bool half = MODE == MathMode::bf16;
    constexpr int KS = half ? HTile<DP>::KS : BwdTile<DP>::KS;
    const int ntiles = (z.S + KS - 1) / KS;
    // One block per SM (shared memory): split a frame's tokens so that the grid fills whole waves.
    const int splits = wave_splits(z.BHF, sms, std::min(4, ntiles));
    const int per_block = (ntiles + splits - 1) / splits;
    const dim3 grid(static_cast<unsigned>((ntiles + per_block - 1) / per_block), static_cast<unsigned>(z.BHF));
    if constexpr (half) {
      const size_t smem = h_smem_bytes<DP>();
      allow_smem(phase_a_bwd_h_kernel<DP>, smem);
      phase_a_bwd_h_kernel<DP><<<grid, kThreads, smem, stream()>>>(dk, dx, dbt, gp, ga, gpz, gb, x, r, kw, cs, sn,
                                                                    bt, z.H, z.D, z.F, z.S, per_block,
                                                                    static_cast<float>(k_scale));
    } else {
      const size_t smem = bwd_smem_floats<DP, MODE>() * sizeof(float);
      allow_smem(phase_a_bwd_kernel<DP, MODE>, smem);
      phase_a_bwd_kernel<DP, MODE><<<grid, kThreads, smem, stream()>>>(dk, dx, dbt, gp, ga, gpz, gb, x, r, kw, cs,
                                                                        sn, bt, z.H, z.D, z.F, z.S, per_block,
                                                                        static_cast<float>(k_scale));
    }
    GDNCP_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace cuda
}  // namespace gdncp
