// src/kernels/phase_a/phase_a_bf16.cu — phase A's bf16 coding (phase_a.cu has the math and picks
// the coding): bf16 mode with bf16 qkv and D % 8 == 0 at a padded head dim of 64 or 128.
//
// Forward: the k prep runs once per token (phase_a_prep_kernel), not once per product, and
// writes the bf16 k operands of the three products; the products are batched GEMMs on cuBLAS
// (one matrix per frame, all S tokens at once) rather than blocks that multiply chunks of 32
// tokens between rounds of prep. v is read where it lies in qkv, not copied.
// Backward: the raw rows of the next token tile are staged with cp.async while the current
// one is multiplied (Note [staged loads]); operand tiles are bf16 in shared memory, read with
// ldmatrix (Note [ldmatrix tiles]).
#include <cublas_v2.h>

#include <algorithm>

#include "kernels/common/cublas_handle.h"
#include "kernels/common/cuda_common.cuh"
#include "kernels/phase_a/phase_a_cuda.cuh"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;
using namespace phase_a;

// ---------------------------------------------------------------------------
// forward: prep, then P = Xᵀ kʳ, A = Xᵀ v, Pz = Xpᵀ k⁺ on cuBLAS
// ---------------------------------------------------------------------------
// The prep writes four operands, per (b, h, f) S rows of D bf16 channels each ((B, H, F, S, D)
// layout):
//   X = bf16(β·kʳ),  Kr = bf16(kʳ),  Xp = bf16(β·k⁺),  Kp = bf16(k⁺)
// with kʳ, k⁺ the f32 values of prep_octet; and b_f = Σ_s β_s k⁺_s in f32 from the unrounded
// values. A thread owns one octet of channels (16-byte accesses) of one head; the threads of a
// row group cover hg adjacent heads of one token row, so a warp reads that row's RoPE octets
// once for all hg heads (the f32 cos/sin rows are the largest read and come from L2) and the
// heads' k octets as one contiguous piece of qkv. A block owns a chunk of one frame's tokens,
// prep_chunk_rows of them, and walks it a row per row group at a time, the next row's loads
// issued before the current row's math and stores; its threads add Σ β k⁺ over their rows in
// registers, so a block writes one part of b_f per head, and phase_a_bz_kernel adds the chunks
// in order (no atomics, so b is bitwise the same run to run and under graph capture). A = Xᵀ v
// reads v in place in qkv through a pointer-array batched GEMM (frame_gemms): a copy of v
// would cost a read and a write of it and its memory. P and Pz run as one batch of 2·B·H·F
// products: one launch whose blocks fill the waves that two would leave part empty.
constexpr int kPrepChunk = 144;  // tokens a block walks, about: enough to amortize its start and its sum

// Heads a row group covers: 4 where they fill the block's row groups exactly, else 2, else 1
// (they must divide H).
inline int prep_heads(int H, int D) {
  const int opr = D / 8;
  if (H % 4 == 0 && kThreads % (4 * opr) == 0) return 4;
  return H % 2 == 0 ? 2 : 1;
}
// Tokens of a chunk: S split into ⌈S / kPrepChunk⌉ near-equal chunks (the last one is not a
// short straggler), rounded up to whole steps of the row groups.
inline int prep_chunk_rows(int H, int D, int S) {
  const int rg = kThreads / (prep_heads(H, D) * (D / 8)), chunks = 1 + (S - 1) / kPrepChunk,
            rows = 1 + (S - 1) / chunks;
  return (rows + rg - 1) / rg * rg;
}

// One token row's loads of a thread: its k octet, the row's RoPE octets, rstd and β.
struct PrepRow {
  uint4 k;
  float4 c[2], s[2];
  float rk, bt;
};

// 3 blocks an SM: a thread holds two rows' loads (80 registers); 4 blocks would spill.
__global__ void __launch_bounds__(kThreads, 3)
    phase_a_prep_kernel(__nv_bfloat16* __restrict__ X, __nv_bfloat16* __restrict__ Kr, __nv_bfloat16* __restrict__ Xp,
                        __nv_bfloat16* __restrict__ Kp, float* __restrict__ b_part,
                        const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ rstd,
                        const float* __restrict__ kw, const float* __restrict__ rope_cos,
                        const float* __restrict__ rope_sin, In beta, int H, int D, int F, int S, int hg, int chunk_rows,
                        int chunks, float k_scale) {
  __shared__ __align__(16) float part[8 * kThreads];  // Σ β k⁺ per row group [g][j·D + d]; rg·hg·D ≤ 8·kThreads
  const int opr = D / 8, per_row = hg * opr, rg = kThreads / per_row, tid = threadIdx.x, g = tid / per_row,
            j = tid % per_row / opr, d0 = 8 * (tid % opr);
  // Block → (b, f, chunk, head group), head group fastest: the heads of one token chunk run
  // side by side and share its RoPE rows in L2.
  const int groups = H / hg;
  int64_t blk = blockIdx.x;
  const int h0 = static_cast<int>(blk % groups) * hg;
  blk /= groups;
  const int c = static_cast<int>(blk % chunks);
  blk /= chunks;
  const int f = static_cast<int>(blk % F);
  const int64_t b = blk / F, N = static_cast<int64_t>(F) * S;
  const int h = h0 + j;
  const int64_t bhf = (b * H + h) * F + f;
  const int s_begin = c * chunk_rows, s_last = min(s_begin + chunk_rows, S) - 1;

  const auto load = [&](int s) {
    const int64_t n = static_cast<int64_t>(f) * S + s;
    PrepRow r;
    r.k = __ldg(reinterpret_cast<const uint4*>(qkv + qkv_index(b, n, 1, h, d0, N, H, D)));
    r.c[0] = __ldg(reinterpret_cast<const float4*>(rope_cos + n * D + d0));
    r.c[1] = __ldg(reinterpret_cast<const float4*>(rope_cos + n * D + d0 + 4));
    r.s[0] = __ldg(reinterpret_cast<const float4*>(rope_sin + n * D + d0));
    r.s[1] = __ldg(reinterpret_cast<const float4*>(rope_sin + n * D + d0 + 4));
    r.rk = __ldg(rstd + (b * N + n) * 2 + 1);
    r.bt = beta[bhf * S + s];
    return r;
  };

  float bsum[8] = {};
  if (g < rg) {
    float w[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) w[q] = kw ? __ldg(kw + h * D + d0 + q) : 1.f;
    PrepRow cur = load(min(s_begin + g, s_last));
    for (int s = s_begin + g; s <= s_last; s += rg) {
      // The next row's loads are in flight during this row's math and stores (past the
      // chunk's end: its last row again, stored by nobody).
      const PrepRow nxt = load(min(s + rg, s_last));
      float k[8], c8[8], s8[8], kp[8], kr[8], x[8], xp[8];
      ld8h(k, reinterpret_cast<const __nv_bfloat16*>(&cur.k));
      ld8f(c8, reinterpret_cast<const float*>(cur.c));
      ld8f(s8, reinterpret_cast<const float*>(cur.s));
      prep_octet(k, cur.rk, w, k_scale, c8, s8, kp, kr);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        x[q] = cur.bt * kr[q];
        xp[q] = cur.bt * kp[q];
        bsum[q] += xp[q];
      }
      const int64_t o = (bhf * S + s) * D + d0;
      st8h(X + o, x);
      st8h(Kr + o, kr);
      st8h(Xp + o, xp);
      st8h(Kp + o, kp);
      cur = nxt;
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) part[(g * hg + j) * D + d0 + q] = bsum[q];
  }
  __syncthreads();
  for (int e = tid; e < hg * D; e += kThreads) {  // hg·D can reach 4·128
    const int je = e / D, d = e % D;
    float v = 0.f;
    for (int gg = 0; gg < rg; ++gg) v += part[(gg * hg + je) * D + d];
    b_part[(((b * H + h0 + je) * F + f) * chunks + c) * D + d] = v;
  }
}

// b_f = Σ over the chunks of b_part, in chunk order.
__global__ void phase_a_bz_kernel(float* __restrict__ bz, const float* __restrict__ b_part, int64_t n, int D,
                                  int chunks) {
  GDNCP_GRID_STRIDE(i, n) {
    const int64_t bhf = i / D, d = i % D;
    float v = 0.f;
    for (int c = 0; c < chunks; ++c) v += b_part[(bhf * chunks + c) * D + d];
    bz[i] = v;
  }
}

// The pointer arrays of frame_gemms, 3·B·H·F entries each, per frame bhf = (b·H + h)·F + f:
// xs, ys, cs hold at bhf the operands and result of P (X, Kr), at B·H·F + bhf those of Pz (Xp,
// Kp), at 2·B·H·F + bhf those of A (X and the frame's first v row in qkv, rows 3·H·D apart).
__global__ void phase_a_ptrs_kernel(const void** __restrict__ xs, const void** __restrict__ ys, void** __restrict__ cs,
                                    const __nv_bfloat16* X, const __nv_bfloat16* Kr, const __nv_bfloat16* Xp,
                                    const __nv_bfloat16* Kp, const __nv_bfloat16* qkv, float* P, float* Pz, float* A,
                                    int H, int D, int F, int S, int64_t BHF) {
  const int64_t N = static_cast<int64_t>(F) * S;
  GDNCP_GRID_STRIDE(bhf, BHF) {
    const int64_t bh = bhf / F, b = bh / H, rows = bhf * S * D, mat = bhf * D * D;
    const int f = static_cast<int>(bhf % F), h = static_cast<int>(bh % H);
    xs[bhf] = X + rows, ys[bhf] = Kr + rows, cs[bhf] = P + mat;
    xs[BHF + bhf] = Xp + rows, ys[BHF + bhf] = Kp + rows, cs[BHF + bhf] = Pz + mat;
    xs[2 * BHF + bhf] = X + rows;
    ys[2 * BHF + bhf] = qkv + qkv_index(b, static_cast<int64_t>(f) * S, 2, h, 0, N, H, D);
    cs[2 * BHF + bhf] = A + mat;
  }
}

// C_f = Σ_s Xf[s]ᵀ Yf[s] for `frames` frames f (row-major D×D, f32), Xf and Yf S×D bf16 rows,
// Yf's ldy elements apart (D, or 3·H·D for v in qkv), by pointer arrays (the frames of v are not
// one stride apart, and P and Pz, one batch, are two caller tensors). Note [row-major through
// cuBLAS]: a row-major S×D frame is the column-major D×S matrix, and row-major
// C[i][j] = Σ_s X[s][i] Y[s][j] is column-major Y·Xᵀ. A row starts at a multiple of D
// elements, 16-byte aligned with D % 8 == 0 (cuBLAS's fast path).
void frame_gemms(cublasHandle_t handle, void* const* cs, const void* const* xs, const void* const* ys, int D, int S,
                 int ldy, int frames) {
  const float one = 1.f, zero = 0.f;
  GDNCP_CUBLAS_CHECK(cublasGemmBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, D, D, S, &one, ys, CUDA_R_16BF, ldy, xs,
                                         CUDA_R_16BF, D, &zero, cs, CUDA_R_32F, D, frames, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT));
}

void fwd(const FwdArgs& a) {
  const FrameSizes& z = a.z;
  GDNCP_CHECK(z.BHF <= INT32_MAX / 2, "cuda phase A: 2·B·H·F = 2·", z.BHF, " exceeds cuBLAS's 32-bit batch count");
  const int hg = prep_heads(z.H, z.D), chunk_rows = prep_chunk_rows(z.H, z.D, z.S);
  const int chunks = 1 + (z.S - 1) / chunk_rows;
  const int64_t blocks = checked_mul(z.BHF / hg, chunks, "cuda phase A: prep blocks");
  GDNCP_CHECK(blocks <= INT32_MAX, "cuda phase A: ", blocks, " prep blocks exceed the grid's limit");
  const int64_t ldv = checked_mul(3, checked_mul(z.H, z.D, "cuda phase A: H·D"), "cuda phase A: 3·H·D");
  GDNCP_CHECK(ldv <= INT32_MAX, "cuda phase A: qkv's row stride 3·H·D = ", ldv, " exceeds cuBLAS's 32-bit ld");
  // The four operands live only inside this call (4 · B·H·F·S·D bf16, ≈ 0.17 GiB at the
  // production shape, B = 1, where the layer's peak is still in its backward; at B = 8 they
  // raise the peak: docs/perf.md).
  const Shape rows = {z.BHF, z.S, z.D};
  Tensor X = Tensor::empty(rows, DType::bf16, Device::cuda), Kr = Tensor::empty(rows, DType::bf16, Device::cuda),
         Xp = Tensor::empty(rows, DType::bf16, Device::cuda), Kp = Tensor::empty(rows, DType::bf16, Device::cuda);
  // frame_gemms' pointer arrays [xs | ys | cs], 3·B·H·F pointers each, in a buffer of 8-byte
  // elements (f64: Tensor has no pointer dtype).
  static_assert(sizeof(double) == sizeof(void*), "a pointer array element is 8 bytes");
  Tensor ptrs = Tensor::empty({checked_mul(9, z.BHF, "cuda phase A: 9·B·H·F")}, DType::f64, Device::cuda);
  // One chunk per frame: the block's sum is b_f itself.
  Tensor b_part;
  if (chunks > 1) b_part = Tensor::empty({z.BHF, chunks, z.D}, DType::f32, Device::cuda);
  float* bp = chunks > 1 ? static_cast<float*>(b_part.data()) : a.bz;
  const auto bf = [](Tensor& t) { return static_cast<__nv_bfloat16*>(t.data()); };
  phase_a_prep_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream()>>>(
      bf(X), bf(Kr), bf(Xp), bf(Kp), bp, static_cast<const __nv_bfloat16*>(a.qkv.p), a.rstd, a.kw, a.cos, a.sin, a.beta,
      z.H, z.D, z.F, z.S, hg, chunk_rows, chunks, a.k_scale);
  GDNCP_CUDA_CHECK_LAUNCH("phase_a_prep_kernel");
  if (chunks > 1) {
    const int64_t n = z.BHF * z.D;
    phase_a_bz_kernel<<<blocks_for(n), kGridThreads, 0, stream()>>>(a.bz, bp, n, z.D, chunks);
    GDNCP_CUDA_CHECK_LAUNCH("phase_a_bz_kernel");
  }
  const int64_t n = z.BHF;
  void** const xs = static_cast<void**>(ptrs.data());
  void** const ys = xs + 3 * n;
  void** const cs = ys + 3 * n;
  phase_a_ptrs_kernel<<<blocks_for(n), kGridThreads, 0, stream()>>>(
      const_cast<const void**>(xs), const_cast<const void**>(ys), cs, bf(X), bf(Kr), bf(Xp), bf(Kp),
      static_cast<const __nv_bfloat16*>(a.qkv.p), a.P, a.Pz, a.A, z.H, z.D, z.F, z.S, n);
  GDNCP_CUDA_CHECK_LAUNCH("phase_a_ptrs_kernel");
  cublasHandle_t handle = cublas_handle();
  frame_gemms(handle, cs, xs, ys, z.D, z.S, z.D, static_cast<int>(2 * n));  // P = Xᵀ kʳ, Pz = Xpᵀ k⁺
  frame_gemms(handle, cs + 2 * n, xs + 2 * n, ys + 2 * n, z.D, z.S, static_cast<int>(ldv),
              static_cast<int>(n));  // A = Xᵀ v
}

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
    float x1[TM][TN][4] = {}, x2[TM][TN][4] = {}, x3[TM][TN][4] = {}, x4[TM][TN][4] = {};
    // Every row and column tile of the warp, with no branch in the loop, so that two k-steps
    // unrolled overlap: the rows past S (zero-filled copies, so zero operands) and the columns
    // past D (zero padding of the matrices) multiply zeros that the epilogue does not store.
    if (n0 < D) {
#pragma unroll 2
      for (int k = 0; k < Kd; k += 16) {
        uint32_t fk[TM][4], fv[TM][4], fp[TM][4], gP[TN][2], gA[TN][2], gAT[TN][2], gPz[TN][2];
#pragma unroll
        for (int i = 0; i < TM; ++i) {
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
          for (int j = 0; j < TN; ++j) {
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

void fwd_bf16(const FwdArgs& a) { fwd(a); }

void bwd_bf16(const BwdArgs& a) {
  if (padded_dim(a.z.D) == 64)
    bwd<64>(a);
  else
    bwd<128>(a);
}

}  // namespace phase_a
}  // namespace cuda
}  // namespace gdncp
