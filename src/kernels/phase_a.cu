// src/kernels/phase_a.cu — CUDA twin of phase A (docs/design.md §3) with the k prep
// (docs/design.md §2: RMSNorm apply, relu, k_scale, RoPE) fused into the load of qkv in
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

// The product a forward block owns: 0 → P, 1 → A, 2 → Pz.
__device__ __forceinline__ float* P_or(int prod, float* P, float* A, float* Pz) {
  return prod == 0 ? P : prod == 1 ? A : Pz;
}

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

  store_tile(P_or(prod, P, A, Pz) + static_cast<int64_t>(bhf) * D * D, acc, m0, n0, D);
  if (prod == 2 && threadIdx.x < D) bz[static_cast<int64_t>(bhf) * D + threadIdx.x] = bsum;
}

// bf16 mode with bf16 qkv and D % 8 == 0: the same block layout, the raw rows of the next
// 32-token chunk staged with cp.async while the current one is multiplied (Note [staged
// loads]), bf16 operand tiles read as [k][mn] through ldmatrix.trans (Note [ldmatrix tiles]).
// b_f is summed in f32 from the values before rounding: per thread over its rows, then over
// the row groups in a fixed order.
template <int DP>
struct FwdHTile {
  static constexpr int WM = 2, WN = 4, TM = DP / (16 * WM), TN = DP / (8 * WN), KS = 32;
  static constexpr int OPR = DP / 8, RSTEP = kThreads / OPR, TPT = KS / RSTEP;  // octets per row, rows per pass
};

template <int DP>
size_t fwd_h_smem_bytes(int D) {
  using Tl = FwdHTile<DP>;
  return 2 * static_cast<size_t>(Tl::KS) * pitch_ld(DP) * 2 +            // X, Y tiles (bf16)
         static_cast<size_t>(Tl::KS) * D * (2 * 4 + 2 * 2) +              // staged cos, sin (f32), k, v (bf16)
         (2 * static_cast<size_t>(Tl::KS) + DP + Tl::RSTEP * DP) * 4;     // r, β, weights, b_f partials
}

template <int DP>
__global__ void __launch_bounds__(kThreads, 2)
    phase_a_fwd_h_kernel(float* __restrict__ P, float* __restrict__ A, float* __restrict__ Pz, float* __restrict__ bz,
                         const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ rstd,
                         const float* __restrict__ kw, const float* __restrict__ rope_cos,
                         const float* __restrict__ rope_sin, In beta, int H, int D, int F, int S, float k_scale) {
  using Tl = FwdHTile<DP>;
  constexpr int KS = Tl::KS, LD = pitch_ld(DP), RSTEP = Tl::RSTEP, TPT = Tl::TPT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* Xh = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // β·(kʳ or k⁺), [s][d]
  __nv_bfloat16* Yh = Xh + KS * LD;                                  // kʳ, v or k⁺,  [s][d]
  float* Cs = reinterpret_cast<float*>(Yh + KS * LD);                // staged cos [KS][D]
  float* Sn = Cs + KS * D;                                           // staged sin
  __nv_bfloat16* Kst = reinterpret_cast<__nv_bfloat16*>(Sn + KS * D);  // staged k [KS][D]
  __nv_bfloat16* Vst = Kst + KS * D;                                   // staged v
  float* rks = reinterpret_cast<float*>(Vst + KS * D);                 // r of k [KS]
  float* bts = rks + KS;                                               // β [KS]
  float* wks = bts + KS;                                               // k norm weight [DP]
  float* bpart = wks + DP;                                             // Σ β k⁺ per row group [RSTEP][DP]

  const int prod = blockIdx.x;  // 0: P, 1: A, 2: Pz and b
  const int bhf = blockIdx.y, bh = bhf / F, f = bhf % F, b = bh / H, h = bh % H;
  const int64_t N = static_cast<int64_t>(F) * S;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int wm = warp / Tl::WN, wn = warp % Tl::WN;
  const int m0 = wm * Tl::TM * 16, n0 = wn * Tl::TN * 8;
  const int d0 = 8 * (tid % Tl::OPR), row0 = tid / Tl::OPR;
  const bool rope = prod != 2, need_v = prod == 1;

  // Issues the copies of chunk s0 (and fetches its r and β into registers: pr, pb).
  float pr = 0.f, pb = 0.f;
  auto stage = [&](int s0) {
    const int valid = min(KS, S - s0);
    const int64_t n0f = static_cast<int64_t>(f) * S + s0;
    const auto krow = [&](int r) { return qkv + qkv_index(b, n0f + r, 1, h, 0, N, H, D); };
    const auto vrow = [&](int r) { return qkv + qkv_index(b, n0f + r, 2, h, 0, N, H, D); };
    const auto crow = [&](int r) { return rope_cos + (n0f + r) * D; };
    const auto srow = [&](int r) { return rope_sin + (n0f + r) * D; };
    stage_rows<kThreads>(Kst, krow, KS, valid, D);
    if (need_v) stage_rows<kThreads>(Vst, vrow, KS, valid, D);
    if (rope) {
      stage_rows<kThreads>(Cs, crow, KS, valid, D);
      stage_rows<kThreads>(Sn, srow, KS, valid, D);
    }
    cp_async_commit();
    if (tid < KS) {
      const bool ok = tid < valid;
      pr = ok ? __ldg(rstd + (b * N + n0f + tid) * 2 + 1) : 0.f;
      pb = ok ? beta[static_cast<int64_t>(bhf) * S + s0 + tid] : 0.f;
    }
  };

  for (int d = tid; d < DP; d += kThreads) wks[d] = d < D ? (kw ? kw[h * D + d] : 1.f) : 0.f;
  for (int e = tid; e < RSTEP * DP; e += kThreads) bpart[e] = 0.f;
  float acc[Tl::TM][Tl::TN][4] = {};
  stage(0);
  for (int s0 = 0; s0 < S; s0 += KS) {
    cp_async_wait_all();
    if (tid < KS) rks[tid] = pr, bts[tid] = pb;
    __syncthreads();  // chunk s0 staged; the tiles of the previous chunk consumed
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
      const int r = row0 + RSTEP * i;
      float k[8], w[8], c[8] = {}, sn[8] = {}, v[8] = {}, kp[8] = {}, kr[8] = {}, x[8], y[8];
      if (d0 < D) {
        ld8h(k, Kst + r * D + d0);
        ld8f(w, wks + d0);
        if (rope) ld8f(c, Cs + r * D + d0), ld8f(sn, Sn + r * D + d0);
        if (need_v) ld8h(v, Vst + r * D + d0);
        prep_octet(k, rks[r], w, k_scale, c, sn, kp, kr);
      }
      const float bt = bts[r];
#pragma unroll
      for (int q = 0; q < 8; ++q) {  // X = β·kʳ, Y = kʳ | X = β·kʳ, Y = v | X = β·k⁺, Y = k⁺
        x[q] = bt * (prod == 2 ? kp[q] : kr[q]);
        y[q] = prod == 0 ? kr[q] : prod == 1 ? v[q] : kp[q];
      }
      if (prod == 2)  // this thread's own slots: no race
#pragma unroll
        for (int q = 0; q < 8; ++q) bpart[row0 * DP + d0 + q] += x[q];
      st8h(Xh + r * LD + d0, x);
      st8h(Yh + r * LD + d0, y);
    }
    __syncthreads();  // tiles ready; the stage is free
    if (s0 + KS < S) stage(s0 + KS);
    // P(i, j) = Σ_s X[s][i] Y[s][j]: both operands are [k][mn] tiles.
    warp_mma_ld<Tl::TM, Tl::TN>(acc, LdCol{Xh, LD}, m0, LdCol{Yh, LD}, n0, KS, D, D);
  }

  store_tile(P_or(prod, P, A, Pz) + static_cast<int64_t>(bhf) * D * D, acc, m0, n0, D);
  if (prod == 2) {
    __syncthreads();
    if (tid < D) {
      float v = 0.f;
      for (int w = 0; w < RSTEP; ++w) v += bpart[w * DP + tid];
      bz[static_cast<int64_t>(bhf) * D + tid] = v;
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

// bf16 mode with bf16 qkv and D % 8 == 0 (Note [staged loads], Note [ldmatrix tiles]): the
// gradients live in shared memory as bf16 (Ps and Pzs symmetric, dA read both ways, so three
// matrices), the token tiles kʳ, v, k⁺ as bf16 [s][d]; the raw rows of the next tile are
// staged with cp.async into the other of two buffers while the current tile is multiplied,
// and the epilogue re-derives kʳ, k⁺ (f32) and the RoPE rows from the staged raw rows, so dβ
// and the relu mask see unrounded values. Ps = dP + dPᵀ is formed in f32 in a scratch area
// and rounded once, as the f32 path rounds it.
template <int DP>
struct HTile {
  static constexpr int WN = DP / 16 < 8 ? DP / 16 : 8, WM = 8 / WN, TM = DP == 128 ? 2 : 1, TN = 2,
                       KS = 16 * WM * TM;
  static constexpr int OPR = DP / 8, RSTEP = kThreads / OPR, TPT = KS / RSTEP;  // octets per row, rows per pass
};

// Shared memory of phase_a_bwd_h_kernel, in bytes from the start (all 16-byte aligned).
struct HLayout {
  size_t mats, tiles, stage0, stage_bytes, small, total;
};
template <int DP>
HLayout h_layout(int D) {
  using Tl = HTile<DP>;
  HLayout l{};
  l.mats = 0;
  l.tiles = 3 * static_cast<size_t>(DP) * pitch_ld(DP) * 2;
  l.stage0 = l.tiles + 3 * static_cast<size_t>(Tl::KS) * pitch_ld(DP) * 2;
  l.stage_bytes = static_cast<size_t>(Tl::KS) * D * (2 * 4 + 2 * 2) + 2 * Tl::KS * 4;  // cos, sin, k, v, r, β
  l.small = l.stage0 + 2 * l.stage_bytes;
  l.total = l.small + (2 * static_cast<size_t>(DP) + Tl::KS * Tl::WN) * 4;
  const size_t scratch_end = l.tiles + static_cast<size_t>(DP) * DP * 4;  // f32 scratch over tiles + stages
  if (scratch_end > l.small) l.total += scratch_end - l.small, l.small = scratch_end;
  return l;
}

// One staged buffer: raw rows of a KS-token tile.
struct KRaw {
  float *cs, *sn;
  __nv_bfloat16 *k, *v;
  float *r, *bt;
};
__device__ __forceinline__ KRaw k_raw(unsigned char* base, int KS, int D) {
  KRaw s;
  s.cs = reinterpret_cast<float*>(base);
  s.sn = s.cs + KS * D;
  s.k = reinterpret_cast<__nv_bfloat16*>(s.sn + KS * D);
  s.v = s.k + KS * D;
  s.r = reinterpret_cast<float*>(s.v + KS * D);
  s.bt = s.r + KS;
  return s;
}

template <int DP>
__global__ void __launch_bounds__(kThreads, 1)
    phase_a_bwd_h_kernel(Out dk_hat, Out dqkv, Out dbeta, const float* __restrict__ dP, const float* __restrict__ dA,
                         const float* __restrict__ dPz, const float* __restrict__ dbz,
                         const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ rstd,
                         const float* __restrict__ kw, const float* __restrict__ rope_cos,
                         const float* __restrict__ rope_sin, In beta, int H, int D, int F, int S, int tiles_per_block,
                         float k_scale, HLayout lay) {
  using Tl = HTile<DP>;
  constexpr int KS = Tl::KS, TM = Tl::TM, TN = Tl::TN, LH = pitch_ld(DP), RSTEP = Tl::RSTEP;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* HP = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // Ps  [j][i] (B of kʳ Ps; symmetric)
  __nv_bfloat16* HA = HP + DP * LH;                                 // dA  [i][j] (B of v dAᵀ by rows, of kʳ dA by columns)
  __nv_bfloat16* HPz = HA + DP * LH;                                // Pzs [j][i]
  __nv_bfloat16* Krh = reinterpret_cast<__nv_bfloat16*>(smem_raw + lay.tiles);  // kʳ [KS][LH] (A operands)
  __nv_bfloat16* Vh = Krh + KS * LH;                                             // v
  __nv_bfloat16* Kph = Vh + KS * LH;                                             // k⁺
  float* T = reinterpret_cast<float*>(smem_raw + lay.tiles);  // scratch [DP][DP] while the gradients are loaded
  float* db = reinterpret_cast<float*>(smem_raw + lay.small);  // dbz [DP]
  float* wks = db + DP;                                         // k norm weight [DP]
  float* part = wks + DP;                                       // dβ partials [KS][WN]

  const int bhf = blockIdx.y, bh = bhf / F, f = bhf % F, b = bh / H, h = bh % H;
  const int64_t N = static_cast<int64_t>(F) * S, DD = static_cast<int64_t>(D) * D, mat0 = bhf * DD;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // dA straight from global; Ps and Pzs through the f32 scratch.
  for (int e = tid; e < DP * DP; e += kThreads) {
    const int i = e / DP, j = e % DP;
    HA[i * LH + j] = __float2bfloat16_rn((i < D && j < D) ? dA[mat0 + i * D + j] : 0.f);
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
  for (int d = tid; d < DP; d += kThreads) {
    db[d] = d < D ? dbz[static_cast<int64_t>(bhf) * D + d] : 0.f;
    wks[d] = d < D ? (kw ? kw[h * D + d] : 1.f) : 0.f;
  }
  __syncthreads();  // scratch no longer needed: the stages may be filled

  // Issues the copies of tile s0 into raw[buf] (and fetches its r and β into registers).
  float pr = 0.f, pb = 0.f;
  auto stage = [&](int s0, int buf) {
    const int valid = min(KS, S - s0);
    const int64_t n0f = static_cast<int64_t>(f) * S + s0;
    const KRaw st = k_raw(smem_raw + lay.stage0 + buf * lay.stage_bytes, KS, D);
    stage_rows<kThreads>(st.k, [&](int r) { return qkv + qkv_index(b, n0f + r, 1, h, 0, N, H, D); }, KS, valid, D);
    stage_rows<kThreads>(st.v, [&](int r) { return qkv + qkv_index(b, n0f + r, 2, h, 0, N, H, D); }, KS, valid, D);
    stage_rows<kThreads>(st.cs, [&](int r) { return rope_cos + (n0f + r) * D; }, KS, valid, D);
    stage_rows<kThreads>(st.sn, [&](int r) { return rope_sin + (n0f + r) * D; }, KS, valid, D);
    cp_async_commit();
    if (tid < KS) {
      const bool ok = tid < valid;
      pr = ok ? __ldg(rstd + (b * N + n0f + tid) * 2 + 1) : 0.f;
      pb = ok ? beta[static_cast<int64_t>(bhf) * S + s0 + tid] : 0.f;
    }
  };

  const int wm = warp / Tl::WN, wn = warp % Tl::WN;
  const int m0 = wm * TM * 16, n0 = wn * TN * 8, Kd = round16(D);
  const int d0 = 8 * (tid % Tl::OPR), row0 = tid / Tl::OPR;
  const LdRow aKr{Krh, LH}, aV{Vh, LH}, aKp{Kph, LH}, bP{HP, LH}, bA{HA, LH}, bPz{HPz, LH};
  const LdCol bAT{HA, LH};
  const int ntiles = (S + KS - 1) / KS;
  const int tile_begin = blockIdx.x * tiles_per_block, tile_end = min(ntiles, tile_begin + tiles_per_block);
  if (tile_begin < tile_end) stage(tile_begin * KS, 0);
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int s0 = tile * KS, buf = (tile - tile_begin) & 1;
    const KRaw st = k_raw(smem_raw + lay.stage0 + buf * lay.stage_bytes, KS, D);
    cp_async_wait_all();
    if (tid < KS) st.r[tid] = pr, st.bt[tid] = pb;
    __syncthreads();  // tile staged; the previous tile's operands consumed
#pragma unroll
    for (int i = 0; i < Tl::TPT; ++i) {
      const int r = row0 + RSTEP * i;
      float k[8], w[8], c[8], sn[8], v[8], kp[8] = {}, kr[8] = {};
      if (d0 < D) {
        ld8h(k, st.k + r * D + d0), ld8h(v, st.v + r * D + d0);
        ld8f(w, wks + d0), ld8f(c, st.cs + r * D + d0), ld8f(sn, st.sn + r * D + d0);
        prep_octet(k, st.r[r], w, k_scale, c, sn, kp, kr);
      } else {
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = 0.f;
      }
      st8h(Krh + r * LH + d0, kr);
      st8h(Kph + r * LH + d0, kp);
      st8h(Vh + r * LH + d0, v);
    }
    __syncthreads();  // operands ready
    if (tile + 1 < tile_end) stage(s0 + KS, buf ^ 1);

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
        if (col >= D) continue;
        const float2 dbv = ld2(db + col), w = ld2(wks + col);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m0 + 16 * i + g + 8 * half, s = s0 + r;
          if (s >= S) continue;
          const float a1 = x1[i][j][2 * half], b1 = x1[i][j][2 * half + 1];
          const float a2 = x2[i][j][2 * half], b2 = x2[i][j][2 * half + 1];
          const float a3 = x3[i][j][2 * half], b3 = x3[i][j][2 * half + 1];
          const float a4 = x4[i][j][2 * half], b4 = x4[i][j][2 * half + 1];
          const float btr = st.bt[r];
          const float2 c = ld2(st.cs + r * D + col), sn = ld2(st.sn + r * D + col);
          float2 kp, kr;
          prep_pair(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(st.k + r * D + col)), st.r[r], w,
                    k_scale, c, sn, kp, kr);
          dbeta_part[i][half] += kr.x * (0.5f * a1 + a2) + kr.y * (0.5f * b1 + b2) + kp.x * (0.5f * a4 + dbv.x) +
                                 kp.y * (0.5f * b4 + dbv.y);
          const int64_t n = static_cast<int64_t>(f) * S + s;
          const float dkr0 = btr * (a1 + a2), dkr1 = btr * (b1 + b2);
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
  const bool staged = qkv.dtype() == DType::bf16 && d.D % 8 == 0;  // Note [staged loads]
  with_dp_mode(d.D, mode, [&](auto dp, auto md) {
    constexpr int DP = decltype(dp)::value;
    constexpr MathMode MODE = decltype(md)::value;
    const dim3 grid(3, static_cast<unsigned>(z.BHF));
    if constexpr (MODE == MathMode::bf16 && DP >= 64) {
      if (staged) {
        const size_t smem = fwd_h_smem_bytes<DP>(z.D);
        allow_smem(phase_a_fwd_h_kernel<DP>, smem);
        phase_a_fwd_h_kernel<DP><<<grid, kThreads, smem, stream()>>>(
            p, a, pz, b, static_cast<const __nv_bfloat16*>(qkv.data()), r, kw, cs, sn, bt, z.H, z.D, z.F, z.S,
            static_cast<float>(k_scale));
        GDNCP_CUDA_CHECK(cudaGetLastError());
        return;
      }
    }
    phase_a_fwd_kernel<DP, MODE><<<grid, kThreads, 0, stream()>>>(p, a, pz, b, x, r, kw, cs, sn, bt, z.H, z.D, z.F, z.S,
                                                                   static_cast<float>(k_scale));
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
  const bool staged_input = qkv.dtype() == DType::bf16 && d.D % 8 == 0;  // Note [staged loads]
  with_dp_mode(d.D, mode, [&](auto dp, auto md) {
    constexpr int DP = decltype(dp)::value;
    constexpr MathMode MODE = decltype(md)::value;
    constexpr bool h_kernel = MODE == MathMode::bf16 && DP >= 64;
    const bool staged = h_kernel && staged_input;
    int KS = BwdTile<DP>::KS;
    if constexpr (h_kernel) KS = staged ? HTile<DP>::KS : KS;
    const int ntiles = (z.S + KS - 1) / KS;
    // One block per SM (shared memory): split a frame's tokens so that the grid fills whole waves.
    const int splits = wave_splits(z.BHF, sms, std::min(4, ntiles));
    const int per_block = (ntiles + splits - 1) / splits;
    const dim3 grid(static_cast<unsigned>((ntiles + per_block - 1) / per_block), static_cast<unsigned>(z.BHF));
    if constexpr (h_kernel) {
      if (staged) {
        const HLayout lay = h_layout<DP>(z.D);
        allow_smem(phase_a_bwd_h_kernel<DP>, lay.total);
        phase_a_bwd_h_kernel<DP><<<grid, kThreads, lay.total, stream()>>>(
            dk, dx, dbt, gp, ga, gpz, gb, static_cast<const __nv_bfloat16*>(qkv.data()), r, kw, cs, sn, bt, z.H, z.D,
            z.F, z.S, per_block, static_cast<float>(k_scale), lay);
        GDNCP_CUDA_CHECK(cudaGetLastError());
        return;
      }
    }
    const size_t smem = bwd_smem_floats<DP, MODE>() * sizeof(float);
    allow_smem(phase_a_bwd_kernel<DP, MODE>, smem);
    phase_a_bwd_kernel<DP, MODE><<<grid, kThreads, smem, stream()>>>(dk, dx, dbt, gp, ga, gpz, gb, x, r, kw, cs, sn, bt,
                                                                      z.H, z.D, z.F, z.S, per_block,
                                                                      static_cast<float>(k_scale));
    GDNCP_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace cuda
}  // namespace gdncp
