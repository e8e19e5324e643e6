// src/kernels/phase_a/phase_a_bf16.cu — phase A's bf16 coding (phase_a.cu has the math and picks
// the coding): bf16 mode with bf16 qkv and D % 8 == 0 at a padded head dim of 64 or 128.
//
// Forward: one kernel preps the k rows and multiplies them on the matrix unit, a frame and a
// product set a block (Note [fused forward]); the operands never leave shared memory.
// Backward: the raw rows of the next token tile are staged with cp.async while the current
// one is multiplied (Note [staged loads]); operand tiles are bf16 in shared memory, read with
// ldmatrix (Note [ldmatrix tiles]).
#include <algorithm>

#include "kernels/common/cuda_common.cuh"
#include "kernels/phase_a/phase_a_cuda.cuh"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;
using namespace phase_a;

// ---------------------------------------------------------------------------
// forward: the k prep and the three products in one kernel
// ---------------------------------------------------------------------------
// Note [fused forward]: a block owns one frame (b, h, f) and one of two product sets, so that
// its accumulators fit in registers:
//   rope = true:  u = kʳ,  P = (β·u)ᵀ u  and  A = (β·u)ᵀ v   (one left operand for both)
//   rope = false: u = k⁺,  Pz = (β·u)ᵀ u  and  b_f = Σ_s β_s k⁺_s  (f32, unrounded values)
// It walks the frame's tokens in tiles of KS: the raw rows of the next tile (k, and for the
// rope set v and the RoPE rows) are staged with cp.async while the current one is prepped
// and multiplied; v lands directly in its padded operand tile (nothing to prep). The prep
// writes the tile's bf16 operands L = bf16(β·u) and U = bf16(u), and the 8 warps multiply
// them with ldmatrix fragments, the tokens being the products' k. Nothing goes through global
// memory between the prep and the products (four bf16 operand copies written and read back
// would be 180 MB each way at the production shape). b_f's per-thread sums are added in a
// fixed order at the end, so every result is bitwise the same run to run.
template <int DP, int KS_>
struct FTile {
  static constexpr int KS = KS_, WM = 2, WN = 4, TM = DP / (16 * WM), TN = DP / (8 * WN), LH = pitch_ld(DP);
  static constexpr int OPR = DP / 8, RSTEP = kThreads / OPR, TPT = KS / RSTEP;  // octets a row, rows a pass
  static_assert(is_padded_dim(DP) && DP >= 64 && DP <= 128, "FTile: the bf16 coding's padded dims");
  static_assert(TM >= 1 && TN % 2 == 0 && KS % 16 == 0 && KS % RSTEP == 0, "FTile: 8 warps cover DP×DP");
};

// Shared memory of phase_a_fwd_kernel, in bytes from the start (all 16-byte aligned).
struct FLayout {
  size_t L, U, V, stage0, stage_bytes, total;
};
template <int DP, int KS>
constexpr FLayout f_layout(int D) {
  const size_t tile = static_cast<size_t>(KS) * pitch_ld(DP) * 2;
  FLayout l{};
  l.L = 0, l.U = tile, l.V = 2 * tile, l.stage0 = 4 * tile;                // L, U, 2 × V (bf16)
  l.stage_bytes = static_cast<size_t>(KS) * D * (2 + 4 + 4) + 2 * KS * 4;  // k (bf16), cos, sin, r, β
  l.total = l.stage0 + 2 * l.stage_bytes;
  return l;
}
// One staged buffer: the raw rows of a tile.
struct FRaw {
  __nv_bfloat16* k;
  float *cs, *sn, *r, *bt;
};
__device__ __forceinline__ FRaw f_raw(unsigned char* base, int KS, int D) {
  FRaw s;
  s.cs = reinterpret_cast<float*>(base);
  s.sn = s.cs + KS * D;
  s.k = reinterpret_cast<__nv_bfloat16*>(s.sn + KS * D);
  s.r = reinterpret_cast<float*>(s.k + KS * D);
  s.bt = s.r + KS;
  return s;
}

template <int DP, int KS>
__global__ void __launch_bounds__(kThreads, 1)
    phase_a_fwd_kernel(float* __restrict__ P, float* __restrict__ A, float* __restrict__ Pz, float* __restrict__ bz,
                       const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ rstd,
                       const float* __restrict__ kw, const float* __restrict__ rope_cos,
                       const float* __restrict__ rope_sin, In beta, int H, int D, int F, int S, float k_scale,
                       FLayout lay) {
  using Tl = FTile<DP, KS>;
  constexpr int TM = Tl::TM, TN = Tl::TN, LH = Tl::LH, RSTEP = Tl::RSTEP;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* Lt = reinterpret_cast<__nv_bfloat16*>(smem_raw + lay.L);  // β·u [s][d]: A as (m = d, k = s)
  __nv_bfloat16* Ut = reinterpret_cast<__nv_bfloat16*>(smem_raw + lay.U);  // u [s][d]: B as (n = d, k = s)
  __nv_bfloat16* Vt = reinterpret_cast<__nv_bfloat16*>(smem_raw + lay.V);  // 2 × v [s][d]: B of Lᵀ v

  const bool rope = blockIdx.y == 0;  // uniform over the block
  const int64_t bhf = blockIdx.x, bh = bhf / F, b = bh / H, N = static_cast<int64_t>(F) * S;
  const int f = static_cast<int>(bhf % F), h = static_cast<int>(bh % H);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  // The copies of a tile: k and v rows lie 3·H·D apart in qkv, the RoPE rows D apart.
  constexpr int kCopiesH = (KS * DP / 8 + kThreads - 1) / kThreads, kCopiesF = (KS * DP / 4 + kThreads - 1) / kThreads;
  const RowStager<kThreads, __nv_bfloat16, kCopiesH> k_rows(KS, D, 3 * H * D);
  const RowStager<kThreads, __nv_bfloat16, kCopiesH, true> v_rows(KS, D, 3 * H * D, LH);
  const RowStager<kThreads, float, kCopiesF> rope_rows(KS, D, D);
  float pr = 0.f, pb = 0.f;
  auto stage = [&](int s0, int buf) {
    const int valid = min(KS, S - s0);
    const int64_t n0f = static_cast<int64_t>(f) * S + s0;
    const FRaw st = f_raw(smem_raw + lay.stage0 + buf * lay.stage_bytes, KS, D);
    const __nv_bfloat16* k0 = qkv + qkv_index(b, n0f, 1, h, 0, N, H, D);
    k_rows.issue(st.k, k0, valid);
    if (rope) {
      v_rows.issue(Vt + buf * KS * LH, k0 + static_cast<int64_t>(H) * D, valid);  // channel group 2: v
      rope_rows.issue(st.cs, rope_cos + n0f * D, valid);
      rope_rows.issue(st.sn, rope_sin + n0f * D, valid);
    }
    cp_async_commit();
    if (tid < KS) {
      const bool ok = tid < valid;
      pr = ok ? __ldg(rstd + (b * N + n0f + tid) * 2 + 1) : 0.f;
      pb = ok ? beta[bhf * S + s0 + tid] : 0.f;
    }
  };

  const int d0 = 8 * (tid % Tl::OPR), row0 = tid / Tl::OPR;
  float w[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) w[q] = d0 < D ? (kw ? __ldg(kw + h * D + d0 + q) : 1.f) : 0.f;
  const int wm = warp / Tl::WN, wn = warp % Tl::WN, m0 = wm * TM * 16, n0 = wn * TN * 8;
  const LdCol aL{Lt, LH}, bU{Ut, LH};
  float acc0[TM][TN][4] = {}, acc1[TM][TN][4] = {}, bsum[8] = {};

  const int ntiles = (S + KS - 1) / KS;
  stage(0, 0);
  for (int tile = 0; tile < ntiles; ++tile) {
    const int s0 = tile * KS, buf = tile & 1;
    const FRaw st = f_raw(smem_raw + lay.stage0 + buf * lay.stage_bytes, KS, D);
    cp_async_wait<0>();
    if (tid < KS) st.r[tid] = pr, st.bt[tid] = pb;
    __syncthreads();  // tile staged; the previous tile's operands and staged rows consumed
    if (tile + 1 < ntiles) stage(s0 + KS, buf ^ 1);
#pragma unroll
    for (int i = 0; i < Tl::TPT; ++i) {
      const int r = row0 + RSTEP * i;
      float u[8] = {}, l[8] = {};
      if (d0 < D) {
        float k[8], c[8] = {}, sn[8] = {}, kp[8], kr[8];
        ld8h(k, st.k + r * D + d0);
        if (rope) ld8f(c, st.cs + r * D + d0), ld8f(sn, st.sn + r * D + d0);
        prep_octet(k, st.r[r], w, k_scale, c, sn, kp, kr);
        const float bt = st.bt[r];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          u[q] = rope ? kr[q] : kp[q];
          l[q] = bt * u[q];
          bsum[q] += l[q];  // b_f's share (kept by the k⁺ set only)
        }
      }
      st8h(Lt + r * LH + d0, l);
      st8h(Ut + r * LH + d0, u);
    }
    __syncthreads();  // operands ready

    const LdCol bV{Vt + buf * KS * LH, LH};
    const int kend = round16(min(KS, S - s0));  // rows past S are zero
    for (int k = 0; k < kend; k += 16) {
      uint32_t af[TM][4] = {}, bu[TN][2] = {};
#pragma unroll
      for (int i = 0; i < TM; ++i)
        if (m0 + 16 * i < D) aL.a(af[i], m0 + 16 * i, k, lane);
#pragma unroll
      for (int j = 0; j < TN; j += 2)
        if (n0 + 8 * j < D) bU.b2(bu[j], bu[j + 1], n0 + 8 * j, k, lane);
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j)
          if (m0 + 16 * i < D && n0 + 8 * j < D) mma_bf16(acc0[i][j], af[i], bu[j]);
      if (rope) {
        uint32_t bv[TN][2] = {};
#pragma unroll
        for (int j = 0; j < TN; j += 2)
          if (n0 + 8 * j < D) bV.b2(bv[j], bv[j + 1], n0 + 8 * j, k, lane);
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j)
            if (m0 + 16 * i < D && n0 + 8 * j < D) mma_bf16(acc1[i][j], af[i], bv[j]);
      }
    }
  }

  const int64_t DD = static_cast<int64_t>(D) * D;
  store_tile((rope ? P : Pz) + bhf * DD, acc0, m0, n0, D);
  if (rope) store_tile(A + bhf * DD, acc1, m0, n0, D);
  // b_f: the threads' sums of a channel (RSTEP of them) added in row order, in the staged
  // buffers, free now.
  __syncthreads();
  float* part = reinterpret_cast<float*>(smem_raw + lay.stage0);  // [RSTEP][DP]
  if (!rope) {
#pragma unroll
    for (int q = 0; q < 8; ++q) part[row0 * DP + d0 + q] = bsum[q];
  }
  __syncthreads();
  if (!rope && tid < D) {
    float v = 0.f;
    for (int r = 0; r < RSTEP; ++r) v += part[r * DP + tid];
    bz[bhf * D + tid] = v;
  }
}

template <int DP, int KS>
void fwd(const FwdArgs& a) {
  const FrameSizes& z = a.z;
  // RowStager's 32-bit offsets within a tile: rows up to KS·3·H·D elements apart.
  const int64_t HD = checked_mul(z.H, z.D, "cuda phase A: H·D");
  GDNCP_CHECK(checked_mul(3 * KS, HD, "cuda phase A: a tile's span of qkv") <= INT32_MAX,
              "cuda phase A: a tile of qkv rows spans more than 2^31 elements (H·D = ", HD, ")");
  GDNCP_CHECK(z.BHF <= INT32_MAX, "cuda phase A: B·H·F = ", z.BHF, " exceeds the grid's limit");
  const FLayout lay = f_layout<DP, KS>(z.D);
  constexpr size_t b_part_bytes = FTile<DP, KS>::RSTEP * DP * sizeof(float);
  GDNCP_CHECK(b_part_bytes <= 2 * lay.stage_bytes, "cuda phase A: b_f's partials exceed the staged buffers");
  allow_smem(phase_a_fwd_kernel<DP, KS>, lay.total);
  phase_a_fwd_kernel<DP, KS><<<dim3(static_cast<unsigned>(z.BHF), 2), kThreads, lay.total, stream()>>>(
      a.P, a.A, a.Pz, a.bz, static_cast<const __nv_bfloat16*>(a.qkv.p), a.rstd, a.kw, a.cos, a.sin, a.beta, z.H, z.D,
      z.F, z.S, a.k_scale, lay);
  GDNCP_CUDA_CHECK_LAUNCH("phase_a_fwd_kernel");
}

// The widest tile of tokens whose buffers fit in a block's shared memory (227 KB on sm_90).
constexpr size_t kMaxBlockSmem = 227 * 1024;

// ---------------------------------------------------------------------------
// backward
// ---------------------------------------------------------------------------
// bf16 mode with bf16 qkv and D % 8 == 0 (Note [staged loads], Note [ldmatrix tiles]): the
// gradients live in shared memory as bf16 (Ps and Pzs symmetric, dA read both ways, so three
// matrices), the token tiles kʳ, v, k⁺ as bf16 [s][d]; the raw rows of the next tile are
// staged with cp.async into the other of two buffers while the current tile is prepped and
// multiplied (RowStager: the copies' offsets are computed once), and the epilogue re-derives
// kʳ, k⁺ (f32) and the RoPE rows from the staged raw rows, so dβ and the relu mask see
// unrounded values. The three matrices are made once per frame by
// phase_a_bwd_mats_kernel (Ps = dP + dPᵀ formed in f32 and rounded once, as the f32 path
// rounds it), already padded and pitched as the blocks keep them: each of a frame's token
// blocks streams them in with cp.async behind its first tile instead of converting them
// itself (a latency-bound prologue that every block of a frame repeated). A tile's dβ row
// sums are finished after the next tile's first barrier (their partials are double-buffered),
// so a tile costs two barriers.
template <int DP>
struct HTile {
  static constexpr int WN = DP / 16 < 8 ? DP / 16 : 8, WM = 8 / WN, TM = DP == 128 ? 2 : 1, TN = 2, KS = 16 * WM * TM;
  static constexpr int OPR = DP / 8, RSTEP = kThreads / OPR, TPT = KS / RSTEP;  // octets per row, rows per pass
  static_assert(is_padded_dim(DP) && DP <= 128, "HTile: a tile shape for each padded dim up to 128 (Note [head dims])");
  static_assert(WM * WN == 8 && TN * 8 * WN == DP && KS % RSTEP == 0, "HTile: 8 warps cover the DP columns");
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
  l.total = l.small + (2 * static_cast<size_t>(DP) + 2 * Tl::KS * Tl::WN) * 4;
  return l;
}

// The gradient matrices of phase_a_bwd_h_kernel, per frame: [Ps, dA, Pzs], each [DP][LH] bf16
// with zeros beyond D (padding rows, columns and the pitch). blockIdx = (b·h·f, which); Ps and
// Pzs symmetrise through a transposing f32 tile in shared memory ([D][D + 1]: conflict-free).
template <int DP>
__global__ void __launch_bounds__(kThreads)
    phase_a_bwd_mats_kernel(__nv_bfloat16* __restrict__ mats, const float* __restrict__ dP,
                            const float* __restrict__ dA, const float* __restrict__ dPz, int D) {
  constexpr int LH = pitch_ld(DP), OPR = LH / 8;  // a padded row: OPR octets of 8 bf16
  extern __shared__ float T[];
  const int bhf = blockIdx.x, which = blockIdx.y, tid = threadIdx.x, quads = D / 4;
  const int64_t DD = static_cast<int64_t>(D) * D;
  const float* src = (which == 0 ? dP : which == 1 ? dA : dPz) + bhf * DD;
  __nv_bfloat16* dst = mats + (static_cast<int64_t>(bhf) * 3 + which) * DP * LH;
  // 16-byte loads (D % 8 == 0), kBatch of them in flight per thread before their stores.
  constexpr int kLoads = (DP * DP / 4 + kThreads - 1) / kThreads, kBatch = 8;
  const int n = D * quads;
  for (int l0 = 0; l0 < kLoads; l0 += kBatch) {
    float4 v[kBatch];
#pragma unroll
    for (int l = 0; l < kBatch; ++l) {
      const int e = tid + (l0 + l) * kThreads;
      if (e < n) {
        const int i = e / quads;
        v[l] = __ldg(reinterpret_cast<const float4*>(src + i * D + 4 * (e - i * quads)));
      }
    }
#pragma unroll
    for (int l = 0; l < kBatch; ++l) {
      const int e = tid + (l0 + l) * kThreads;
      if (e < n) {
        const int i = e / quads, j = 4 * (e - i * quads);
        float* t = T + i * (D + 1) + j;
        t[0] = v[l].x, t[1] = v[l].y, t[2] = v[l].z, t[3] = v[l].w;
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < DP * OPR; e += kThreads) {  // 16-byte stores
    const int i = e / OPR, j0 = 8 * (e - i * OPR);
    float v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int j = j0 + q;
      v[q] = 0.f;
      if (i < D && j < D) v[q] = which == 1 ? T[i * (D + 1) + j] : T[i * (D + 1) + j] + T[j * (D + 1) + i];
    }
    st8h(dst + i * LH + j0, v);
  }
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
    phase_a_bwd_h_kernel(Out dk_hat, Out dqkv, Out dbeta, const __nv_bfloat16* __restrict__ mats,
                         const float* __restrict__ dbz, const __nv_bfloat16* __restrict__ qkv,
                         const float* __restrict__ rstd, const float* __restrict__ kw,
                         const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, In beta, int H, int D,
                         int F, int S, int tiles_per_block, float k_scale, HLayout lay) {
  using Tl = HTile<DP>;
  constexpr int KS = Tl::KS, TM = Tl::TM, TN = Tl::TN, LH = pitch_ld(DP), RSTEP = Tl::RSTEP;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* HP = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // Ps  [j][i] (B of kʳ Ps; symmetric)
  __nv_bfloat16* HA = HP + DP * LH;   // dA  [i][j] (B of v dAᵀ by rows, of kʳ dA by columns)
  __nv_bfloat16* HPz = HA + DP * LH;  // Pzs [j][i]
  __nv_bfloat16* Krh = reinterpret_cast<__nv_bfloat16*>(smem_raw + lay.tiles);  // kʳ [KS][LH] (A operands)
  __nv_bfloat16* Vh = Krh + KS * LH;                                            // v
  __nv_bfloat16* Kph = Vh + KS * LH;                                            // k⁺
  float* db = reinterpret_cast<float*>(smem_raw + lay.small);                   // dbz [DP]
  float* wks = db + DP;                                                         // k norm weight [DP]
  float* part = wks + DP;                                                       // 2 × dβ partials [KS][WN]

  const int bhf = blockIdx.y, bh = bhf / F, f = bhf % F, b = bh / H, h = bh % H;
  const int64_t N = static_cast<int64_t>(F) * S;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // The frame's three matrices, copied as they lie (HP, HA, HPz are contiguous); they land
  // with the first tile's copies, which the loop waits for.
  const __nv_bfloat16* mats_f = mats + static_cast<int64_t>(bhf) * 3 * DP * LH;
  for (int e = tid; e < 3 * DP * LH / 8; e += kThreads) cp_async16(HP + 8 * e, mats_f + 8 * e, true);
  cp_async_commit();
  for (int d = tid; d < DP; d += kThreads) {
    db[d] = d < D ? dbz[static_cast<int64_t>(bhf) * D + d] : 0.f;
    wks[d] = d < D ? (kw ? kw[h * D + d] : 1.f) : 0.f;
  }

  // Issues the copies of tile s0 into raw[buf] (and fetches its r and β into registers). k and
  // v rows lie 3·H·D apart in qkv, the RoPE rows D apart.
  constexpr int kCopiesH = (KS * DP / 8 + kThreads - 1) / kThreads, kCopiesF = (KS * DP / 4 + kThreads - 1) / kThreads;
  const RowStager<kThreads, __nv_bfloat16, kCopiesH> kv_rows(KS, D, 3 * H * D);
  const RowStager<kThreads, float, kCopiesF> rope_rows(KS, D, D);
  float pr = 0.f, pb = 0.f;
  auto stage = [&](int s0, int buf) {
    const int valid = min(KS, S - s0);
    const int64_t n0f = static_cast<int64_t>(f) * S + s0;
    const KRaw st = k_raw(smem_raw + lay.stage0 + buf * lay.stage_bytes, KS, D);
    const __nv_bfloat16* k0 = qkv + qkv_index(b, n0f, 1, h, 0, N, H, D);
    kv_rows.issue(st.k, k0, valid);
    kv_rows.issue(st.v, k0 + static_cast<int64_t>(H) * D, valid);  // channel group 2: v
    rope_rows.issue(st.cs, rope_cos + n0f * D, valid);
    rope_rows.issue(st.sn, rope_sin + n0f * D, valid);
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
  // dβ of tile `tile`: its rows' partials, added in warp order. Run after the next barrier,
  // so a tile's partials (double-buffered) need no barrier of their own.
  auto finish_dbeta = [&](int tile) {
    const int s = tile * KS + tid;
    const float* p = part + (((tile - tile_begin) & 1) * KS + tid) * Tl::WN;
    if (tid < KS && s < S) {
      float v = 0.f;
      for (int w = 0; w < Tl::WN; ++w) v += p[w];
      dbeta.set(static_cast<int64_t>(bhf) * S + s, v);
    }
  };

  if (tile_begin < tile_end) stage(tile_begin * KS, 0);
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int s0 = tile * KS, buf = (tile - tile_begin) & 1;
    const KRaw st = k_raw(smem_raw + lay.stage0 + buf * lay.stage_bytes, KS, D);
    cp_async_wait<0>();
    if (tid < KS) st.r[tid] = pr, st.bt[tid] = pb;
    __syncthreads();  // tile staged; the previous tile's dβ partials in, its operands and staged rows consumed
    if (tile + 1 < tile_end) stage(s0 + KS, buf ^ 1);
    if (tile > tile_begin) finish_dbeta(tile - 1);
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

    // Row s0 of the tile in dk̂ (B, N, H, D) and in dqkv's v channels; rows lie H·D and 3·H·D apart.
    const int64_t n0f = static_cast<int64_t>(f) * S + s0, HD = static_cast<int64_t>(H) * D;
    const int64_t dk0 = ((b * N + n0f) * H + h) * D, dv0 = qkv_index(b, n0f, 2, h, 0, N, H, D);
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
          const float2 a1 = make_float2(x1[i][j][2 * half], x1[i][j][2 * half + 1]);
          const float2 a2 = make_float2(x2[i][j][2 * half], x2[i][j][2 * half + 1]);
          const float2 a3 = make_float2(x3[i][j][2 * half], x3[i][j][2 * half + 1]);
          const float2 a4 = make_float2(x4[i][j][2 * half], x4[i][j][2 * half + 1]);
          const float btr = st.bt[r];
          const float2 c = ld2(st.cs + r * D + col), sn = ld2(st.sn + r * D + col);
          float2 kp, kr;
          prep_pair(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(st.k + r * D + col)), st.r[r], w,
                    k_scale, c, sn, kp, kr);
          dbeta_part[i][half] += dbeta_pair(kr, kp, a1, a2, a4, dbv);
          store_k_grads(dk_hat, dqkv, dk0 + r * HD + col, dv0 + r * (3 * HD) + col, btr, a1, a2, a3, a4, dbv, kp, c, sn,
                        k_scale);
        }
      }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float v = dbeta_part[i][half];
        v = quad_sum(v);
        if (t == 0) part[(buf * KS + m0 + 16 * i + g + 8 * half) * Tl::WN + wn] = v;
      }
  }
  __syncthreads();
  if (tile_begin < tile_end) finish_dbeta(tile_end - 1);
}

template <int DP>
void bwd(const BwdArgs& a) {
  const FrameSizes& z = a.z;
  // RowStager's 32-bit offsets within a tile: rows up to KS·3·H·D elements apart.
  const int64_t HD = checked_mul(z.H, z.D, "cuda phase A: H·D");
  GDNCP_CHECK(checked_mul(3 * HTile<DP>::KS, HD, "cuda phase A: a tile's span of qkv") <= INT32_MAX,
              "cuda phase A: a tile of qkv rows spans more than 2^31 elements (H·D = ", HD, ")");
  const int sms = sm_count();
  const int ntiles = (z.S + HTile<DP>::KS - 1) / HTile<DP>::KS;
  // One block per SM (shared memory): split a frame's tokens so that the grid fills whole waves.
  const int splits = wave_splits(z.BHF, sms, std::min(4, ntiles));
  const int per_block = (ntiles + splits - 1) / splits;
  const dim3 grid(static_cast<unsigned>((ntiles + per_block - 1) / per_block), static_cast<unsigned>(z.BHF));
  Tensor mats = Tensor::empty({z.BHF, 3, DP, pitch_ld(DP)}, DType::bf16, Device::cuda);
  const size_t mats_smem = static_cast<size_t>(z.D) * (z.D + 1) * sizeof(float);
  allow_smem(phase_a_bwd_mats_kernel<DP>, mats_smem);
  phase_a_bwd_mats_kernel<DP><<<dim3(static_cast<unsigned>(z.BHF), 3), kThreads, mats_smem, stream()>>>(
      static_cast<__nv_bfloat16*>(mats.data()), a.dP, a.dA, a.dPz, z.D);
  GDNCP_CUDA_CHECK_LAUNCH("phase_a_bwd_mats_kernel");
  const HLayout lay = h_layout<DP>(z.D);
  allow_smem(phase_a_bwd_h_kernel<DP>, lay.total);
  phase_a_bwd_h_kernel<DP><<<grid, kThreads, lay.total, stream()>>>(
      a.dk_hat, a.dqkv, a.dbeta, static_cast<const __nv_bfloat16*>(mats.data()), a.dbz,
      static_cast<const __nv_bfloat16*>(a.qkv.p), a.rstd, a.kw, a.cos, a.sin, a.beta, z.H, z.D, z.F, z.S, per_block,
      a.k_scale, lay);
  GDNCP_CUDA_CHECK_LAUNCH("phase_a_bwd_h_kernel");
}

}  // namespace

namespace phase_a {

void fwd_bf16(const FwdArgs& a) {
  if (padded_dim(a.z.D) == 64)
    fwd<64, 64>(a);
  else if (f_layout<128, 64>(a.z.D).total <= kMaxBlockSmem)
    fwd<128, 64>(a);
  else
    fwd<128, 32>(a);
}

void bwd_bf16(const BwdArgs& a) {
  if (padded_dim(a.z.D) == 64)
    bwd<64>(a);
  else
    bwd<128>(a);
}

}  // namespace phase_a
}  // namespace cuda
}  // namespace gdncp
