// src/kernels/phase_c/phase_c_bf16.cu — phase C's bf16 coding, for the bf16 mode (phase_c.cu has
// the math and picks the coding): bf16 token and M tiles read with ldmatrix (Note [ldmatrix
// tiles]), token rows prepared and finished in the row layout (Note [row layout]). The
// forward runs a persistent grid over (frame, 64-token tile) items; the backward splits each
// frame's tokens over `parts` blocks so that the grid fills whole waves, each block summing
// its share of dM_f and dz_f in registers; with parts > 1 the shares go to a workspace and
// are added in the fixed order part 0, 1, … (bitwise reproducible, no atomics).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/common/cuda_common.cuh"
#include "kernels/phase_c/phase_c_cuda.cuh"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;
using namespace phase_c;

// Note [row layout]: the bf16 kernels prepare and finish token rows with LPR = DP/8 lanes per
// row and 8 consecutive channels per lane (c0 = 8·(tid % LPR)), so NT threads cover
// RPB = NT/LPR rows at once. Rows move between global memory and registers in 16-byte
// pieces when D % 8 == 0 and the tensors are 16-byte aligned (`vec`), in channel pairs
// otherwise; a row's dot products are sums over its LPR lanes (warp_sum<LPR>). Channels at or
// beyond D are zero in registers and in the shared tiles (the padded K of the products).
template <int DP, int NT>
struct RowMap {
  static constexpr int LPR = DP / 8, RPB = NT / LPR;
};

__device__ __forceinline__ void unpack8(float (&x)[8], uint4 u) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = __uint_as_float(w[k] << 16);  // the lower channel sits in the low half
    x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}

// Channels c0..c0+7 of a row, element i = row start + c0; `left` = D − c0 (≤ 0: all zero).
__device__ __forceinline__ void ld8(float (&x)[8], const In& src, int64_t i, int left, bool vec) {
  if (vec && left >= 8) {
    if (src.bf) {
      unpack8(x, __ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(src.p) + i)));
    } else {
      const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(src.p) + i);
      const float4 a = __ldg(p), c = __ldg(p + 1);
      x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = c.x, x[5] = c.y, x[6] = c.z, x[7] = c.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      const float2 v = k < left ? src.pair(i + k) : make_float2(0.f, 0.f);
      x[k] = v.x, x[k + 1] = v.y;
    }
  }
}
__device__ __forceinline__ void ld8(float (&x)[8], const float* __restrict__ src, int64_t i, int left, bool vec) {
  if (vec && left >= 8) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(src + i)),
                 c = __ldg(reinterpret_cast<const float4*>(src + i) + 1);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = c.x, x[5] = c.y, x[6] = c.z, x[7] = c.w;
  } else {
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      const float2 v = k < left ? ldg2(src + i + k) : make_float2(0.f, 0.f);
      x[k] = v.x, x[k + 1] = v.y;
    }
  }
}
// 8 f32 channels of a row on the staged paths (D % 8 == 0, 16-byte aligned): a lane's octet
// lies wholly inside the row or wholly past D (zeros), so no channel-pair loop is needed.
__device__ __forceinline__ void ld8_octet(float (&x)[8], const float* __restrict__ src, int64_t i, bool inside) {
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f), c = a;
  if (inside) {
    a = __ldg(reinterpret_cast<const float4*>(src + i));
    c = __ldg(reinterpret_cast<const float4*>(src + i) + 1);
  }
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = c.x, x[5] = c.y, x[6] = c.z, x[7] = c.w;
}
__device__ __forceinline__ void st8(const Out& dst, int64_t i, const float (&x)[8], int left, bool vec) {
  if (vec && left >= 8) {
    if (dst.bf) {
      *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(dst.p) + i) =
          make_uint4(pack_bf16(make_float2(x[0], x[1])), pack_bf16(make_float2(x[2], x[3])),
                     pack_bf16(make_float2(x[4], x[5])), pack_bf16(make_float2(x[6], x[7])));
    } else {
      float4* p = reinterpret_cast<float4*>(static_cast<float*>(dst.p) + i);
      p[0] = make_float4(x[0], x[1], x[2], x[3]);
      p[1] = make_float4(x[4], x[5], x[6], x[7]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 8; k += 2)
      if (k < left) dst.set_pair(i + k, x[k], x[k + 1]);
  }
}
// Shared memory: 8 f32 channels in two 16-byte stores (reads: ld8f; bf16 stores: st8h).
__device__ __forceinline__ void sts8(float* p, const float (&x)[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(x[4], x[5], x[6], x[7]);
}
// Address of element i of a bf16 or f32 tensor (for prefetches).
__device__ __forceinline__ const void* element(const In& x, int64_t i) {
  return static_cast<const char*>(x.p) + i * (x.bf ? 2 : 4);
}
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.L1 [%0];" ::"l"(p)); }
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.L2 [%0];" ::"l"(p)); }

// The raw inputs of 8 channels of one q row (zero for an invalid row or channels ≥ D).
struct QRow {
  float x[8], c[8], s[8];
  float r;
};
__device__ __forceinline__ void load_qrow(QRow& q, const In& qkv, const float* __restrict__ rstd,
                                          const float* __restrict__ cs, const float* __restrict__ sn, int64_t b,
                                          int64_t n, int h, int c0, int H, int D, int64_t N, bool valid, bool vec) {
  const int left = valid ? D - c0 : 0;
  q.r = valid ? __ldg(rstd + (b * N + n) * 2) : 0.f;
  ld8(q.x, qkv, qkv_index(b, n, 0, h, c0, N, H, D), left, vec);
  ld8(q.c, cs, n * D + c0, left, vec);
  ld8(q.s, sn, n * D + c0, left, vec);
}
// Ms[i·ld + j] = bf16(M[i][j]) for i, j < DP, zero outside D×D (vec4: D % 4 == 0, M 16-byte aligned).
template <int DP, int NT>
__device__ __forceinline__ void load_mat_h(__nv_bfloat16* Ms, int ld, const float* __restrict__ M, int D, bool vec4) {
  for (int e = threadIdx.x; e < DP * DP / 4; e += NT) {
    const int i = e / (DP / 4), j = 4 * (e % (DP / 4));
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i < D) {
      const float* p = M + i * D + j;
      if (vec4 && j + 4 <= D) {
        v = __ldg(reinterpret_cast<const float4*>(p));
      } else {
        if (j < D) {
          const float2 a = ldg2(p);
          v.x = a.x, v.y = a.y;
        }
        if (j + 2 < D) {
          const float2 a = ldg2(p + 2);
          v.z = a.x, v.w = a.y;
        }
      }
    }
    *reinterpret_cast<uint2*>(Ms + i * ld + j) =
        make_uint2(pack_bf16(make_float2(v.x, v.y)), pack_bf16(make_float2(v.z, v.w)));
  }
}
// zs = z_f, ws = the q norm weights of head h (1 when absent), both zero at and beyond D.
__device__ __forceinline__ void load_vecs(float* zs, float* ws, const float* __restrict__ z,
                                          const float* __restrict__ qw, int64_t bhf, int h, int D, int DP) {
  const int tid = threadIdx.x;
  if (tid < DP) {
    zs[tid] = tid < D ? __ldg(z + bhf * D + tid) : 0.f;
    ws[tid] = tid < D ? (qw ? __ldg(qw + h * D + tid) : 1.f) : 0.f;
  }
}

// ---------------------------------------------------------------------------
// forward (bf16): a persistent grid walks the items (frame, 64-token tile) in order,
// each block a contiguous run of them; M_f is reloaded when the frame changes. qʳ and den
// are double-buffered (one barrier per item), and the q rows of the next item are
// prefetched to L2 (the RoPE tables, shared by the heads, are in L2 already).
// ---------------------------------------------------------------------------
// (b, h, f, tile) of item it = ((b·H + h)·F + f)·ntiles + tile; next() steps to item it + 1.
struct Item {
  int b, h, f, tile;
  __device__ Item(int64_t it, int H, int F, int ntiles) {
    const int64_t bhf = it / ntiles, bh = bhf / F;
    tile = static_cast<int>(it - bhf * ntiles);
    f = static_cast<int>(bhf - bh * F);
    b = static_cast<int>(bh / H);
    h = static_cast<int>(bh - static_cast<int64_t>(b) * H);
  }
  __device__ void next(int H, int F, int ntiles) {
    if (++tile < ntiles) return;
    tile = 0;
    if (++f < F) return;
    f = 0;
    if (++h < H) return;
    h = 0;
    ++b;
  }
};

template <int DP>
struct FwdLd {  // 2 × 4 warps over a KS×DP output tile
  static constexpr int KS = 64, WM = 2, WN = 4, TM = KS / (16 * WM), TN = DP / (8 * WN);
  static_assert(is_padded_dim(DP) && TN * 8 * WN == DP, "FwdLd: the warps cover the DP columns");
  static constexpr int LDH = pitch_ld(DP), NP = KS / RowMap<DP, kThreads>::RPB;  // NP row passes per tile
  static constexpr int BATCH = DP == 128 ? 2 : 1;                                // rows whose loads go out together
};
template <int DP, bool kStaged>
constexpr size_t fwd_ld_smem_bytes() {  // M_f, 2 × qʳ (bf16); z_f, w, 2 × den (f32); 2 × raw q rows (bf16, kStaged)
  return static_cast<size_t>(DP + 2 * FwdLd<DP>::KS) * FwdLd<DP>::LDH * 2 + (2 * DP + 2 * FwdLd<DP>::KS) * 4 +
         (kStaged ? static_cast<size_t>(2 * FwdLd<DP>::KS) * DP * 2 : 0);
}

template <int DP, bool kStaged>
__global__ void __launch_bounds__(kThreads, 2)
    phase_c_fwd_ld_kernel(Out out, float* __restrict__ den, In qkv, const float* __restrict__ rstd,
                          const float* __restrict__ qw, const float* __restrict__ rope_cos,
                          const float* __restrict__ rope_sin, const float* __restrict__ M, const float* __restrict__ z,
                          int H, int D, int F, int S, int64_t items, float eps, bool divide, bool vec, bool vec4) {
  using Tl = FwdLd<DP>;
  using RM = RowMap<DP, kThreads>;
  constexpr int KS = Tl::KS, LDH = Tl::LDH;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* Mk = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // M_f [i][j]: B of qʳ M as (n = j, k = i), LdCol
  __nv_bfloat16* Qh = Mk + DP * LDH;                               // 2 × qʳ [s][d]: A as (m = s, k = d), LdRow
  float* zs = reinterpret_cast<float*>(Qh + 2 * KS * LDH);         // z_f [DP]
  float* ws = zs + DP;                                             // q norm weights of head h [DP]
  float* dens = ws + DP;                                           // 2 × den [KS]
  __nv_bfloat16* Xs = reinterpret_cast<__nv_bfloat16*>(dens + 2 * KS);  // 2 × raw q rows [KS][DP] (kStaged)

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rs = tid / RM::LPR, c0 = 8 * (tid % RM::LPR);
  const int wm = warp / Tl::WN, wn = warp % Tl::WN, m0 = wm * Tl::TM * 16, n0 = wn * Tl::TN * 8, Kd = round16(D);
  const int ntiles = (S + KS - 1) / KS;
  const int64_t N = static_cast<int64_t>(F) * S;
  const int64_t it0 = blockIdx.x * items / gridDim.x, it1 = (blockIdx.x + 1) * items / gridDim.x;
  int64_t cur = -1;
  Item item(it0, H, F, ntiles), nx = item;
  nx.next(H, F, ntiles);
  // Staged (bf16 qkv, `vec`): the raw q rows of the next item are copied into Xs[buffer] with
  // cp.async while this one is multiplied, and their r into registers. A thread copies exactly
  // the octets it will prep, so its own wait makes them visible to it (no barrier), and the
  // buffer it overwrites is the one it read an item earlier.
  float r_next[Tl::NP];
  auto stage = [&](const Item& x, int buf) {
    const int64_t xn0 = static_cast<int64_t>(x.f) * S + x.tile * KS;
#pragma unroll
    for (int p = 0; p < Tl::NP; ++p) {
      const int r = p * RM::RPB + rs;
      const bool ok = x.tile * KS + r < S, copy = ok && c0 < D;
      const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(qkv.p);
      cp_async16(Xs + (buf * KS + r) * DP + c0, copy ? src + qkv_index(x.b, xn0 + r, 0, x.h, c0, N, H, D) : src, copy);
      r_next[p] = ok ? __ldg(rstd + (x.b * N + xn0 + r) * 2) : 0.f;
    }
    cp_async_commit();
  };
  if (kStaged && it0 < it1) stage(item, it0 & 1);
  for (int64_t it = it0; it < it1; ++it, item = nx, nx.next(H, F, ntiles)) {
    const int64_t b = item.b, bh = b * H + item.h, bhf = bh * F + item.f;
    const int f = item.f, h = item.h, s0 = item.tile * KS;
    if (bhf != cur) {
      cur = bhf;
      __syncthreads();  // no warp still reads M_f, z_f, w
      load_mat_h<DP, kThreads>(Mk, LDH, M + bhf * D * D, D, vec4);
      load_vecs(zs, ws, z, qw, bhf, h, D, DP);
      __syncthreads();
    }
    // Buffer it & 1 was last read by item it − 2, which every warp finished before the barrier of item it − 1.
    __nv_bfloat16* Qb = Qh + (it & 1) * KS * LDH;
    float* db = dens + (it & 1) * KS;
    float r_cur[Tl::NP];
    if constexpr (kStaged) {
#pragma unroll
      for (int p = 0; p < Tl::NP; ++p) r_cur[p] = r_next[p];
      if (it + 1 < it1) {
        stage(nx, (it + 1) & 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
    } else if (it + 1 < it1 && c0 < D) {  // the q rows of the next item, to L2
      const int sx = nx.tile * KS + rs;
#pragma unroll
      for (int p = 0; p < Tl::NP; ++p)
        if (sx + p * RM::RPB < S)
          prefetch_l2(
              element(qkv, qkv_index(nx.b, static_cast<int64_t>(nx.f) * S + sx + p * RM::RPB, 0, nx.h, c0, N, H, D)));
    }
    float w8[8], z8[8];
    ld8f(w8, ws + c0);
    ld8f(z8, zs + c0);
#pragma unroll
    for (int p0 = 0; p0 < Tl::NP; p0 += Tl::BATCH) {  // BATCH rows per thread at a time: loads first, then the math
      QRow q[Tl::BATCH];
#pragma unroll
      for (int u = 0; u < Tl::BATCH; ++u)
        if (p0 + u < Tl::NP) {
          const int r = (p0 + u) * RM::RPB + rs, s = s0 + r;
          if constexpr (kStaged) {
            const int64_t n = static_cast<int64_t>(f) * S + s;
            const bool inside = s < S && c0 < D;
            ld8h(q[u].x, Xs + ((it & 1) * KS + r) * DP + c0);
            q[u].r = r_cur[p0 + u];
            ld8_octet(q[u].c, rope_cos, n * D + c0, inside);
            ld8_octet(q[u].s, rope_sin, n * D + c0, inside);
          } else {
            load_qrow(q[u], qkv, rstd, rope_cos, rope_sin, b, static_cast<int64_t>(f) * S + s, h, c0, H, D, N, s < S,
                      vec);
          }
        }
#pragma unroll
      for (int u = 0; u < Tl::BATCH; ++u)
        if (p0 + u < Tl::NP) {
          const int r = (p0 + u) * RM::RPB + rs, s = s0 + r;
          float qp[8], qr[8];
          prep_octet(q[u].x, q[u].r, w8, 1.f, q[u].c, q[u].s, qp, qr);
          st8h(Qb + r * LDH + c0, qr);
          float dp = 0.f;
#pragma unroll
          for (int k = 0; k < 8; ++k) dp += qp[k] * z8[k];
          const float dn = warp_sum<RM::LPR>(dp);
          if (tid % RM::LPR == 0) {
            db[r] = divide ? 1.f / (dn + eps) : 1.f;
            if (s < S) den[bh * N + static_cast<int64_t>(f) * S + s] = dn;
          }
        }
    }
    __syncthreads();

    const int rows = min(KS, S - s0);
    float acc[Tl::TM][Tl::TN][4] = {};
    warp_mma_ld<Tl::TM, Tl::TN>(acc, LdRow{Qb, LDH}, m0, LdCol{Mk, LDH}, n0, Kd, rows, D);
#pragma unroll
    for (int i = 0; i < Tl::TM; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + 16 * i + g + 8 * half, s = s0 + r;
        if (s >= S) continue;
        const int64_t n = static_cast<int64_t>(f) * S + s;
        const float scale = db[r];
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
// backward (bf16): 512-thread blocks (16 warps: the dM_f sums take 32 registers per thread,
// which leaves room for the row work without spills; one block per SM). The frames that fill
// whole waves get a block each; those of the last, partial wave are split into `parts` runs
// of tokens (bwd_parts), whose dM_f, dz_f shares are added in part order afterwards. A block
// walks its run of KS-token tiles, KS = RPB (one row per thread per tile). Per tile, with qʳ
// and dnum double-buffered:
//   rows:  prep, den, dnum -> bf16 tiles                                    | sync
//   warps: dqʳ = dnum Mᵀ (f32) -> shared                                    | sync
//   rows:  dden = −qʳ·dqʳ/(den+eps), dq̂, the dz share;  warps: dM += qʳᵀ dnum
// With kStaged (Note [staged rows]) the raw rows come from shared memory, copied there while the
// previous tile ran; otherwise each thread loads its row right before the prep.
//
// Note [staged rows]: with bf16 qkv and dout, D % 8 == 0 and 16-byte aligned rows (`vec`), the
// backward copies the raw rows of tile t + 1 with cp.async into the other of two buffers as soon
// as tile t begins (after its barrier, which every thread passes only once done with tile t − 1,
// the buffer's last reader), so the copies run under the whole of tile t (Note [staged loads]).
// Tile t + 1 waits for its own copies, then a barrier makes the others' visible. A buffer:
//   q    [KS][DP] bf16   the q rows as they lie in qkv
//   dout [KS][DP] bf16   (absent dout: not copied, dnum = 0)
//   cos, sin [KS][DP] f32, 16-byte quads at swizzle_quad
//   r    [KS] f32        rstd of the q rows
// Rows at or past S and channels at or beyond D are zero-filled: the prep reads the zeros that the
// register path makes, and every value and operation is the register path's. A thread copies the
// q and dout octets it preps itself (row rs, channels c0..c0+7: one 16-byte copy each, a row's
// lanes contiguous); the f32 rows go as quads tid and tid + NT of the tile (consecutive threads,
// consecutive 16 bytes), r by threads tid < KS. A thread's rows and columns are fixed shifts and
// masks of tid (DP is a power of two), and the global addresses are a few multiply-adds per tile
// from the tile's first token, as the register path computes its own. The RoPE rows stay in the
// buffer to the end of the tile: the dq̂ step reads them again instead of holding 16 registers
// across the products (the kernel is at its 128-register bound).
// ---------------------------------------------------------------------------
constexpr int kBwdThreads = 512;

template <int DP>
struct BwdLd {
  static constexpr int KS = RowMap<DP, kBwdThreads>::RPB;
  static constexpr int WN1 = DP / 16, TN1 = 2;                                // dqʳ (KS × DP): 16 × 16 per warp
  static constexpr int WN2 = 4, TM2 = DP >= 64 ? DP / 64 : 1, TN2 = DP / 32;  // dM (DP × DP): 4 × 4 warps
  static_assert(is_padded_dim(DP) && WN1 * TN1 * 8 == DP && TN2 * 8 * WN2 == DP, "BwdLd: the warps cover DP");
  static constexpr int LDH = pitch_ld(DP), LDG = DP + 8;  // LDG ≡ 8 (mod 32): conflict-free float2 stores
};
// Position of quad e (4 floats, e = row·DP/4 + channel/4) in a staged f32 buffer: quads with bit 3
// of e set swap with their neighbour, so that the two 16-byte reads of a row octet by 8
// consecutive lanes (quads 2l, then 2l + 1) fall in 8 distinct bank groups (Note [staged rows]).
__device__ __forceinline__ int swizzle_quad(int e) { return e ^ ((e >> 3) & 1); }

// One staged buffer of Note [staged rows] (every piece a multiple of 16 bytes).
template <int DP>
struct BwdStage {
  static constexpr int KS = BwdLd<DP>::KS;
  static constexpr size_t kBytes = static_cast<size_t>(KS) * DP * (2 + 2 + 4 + 4) + KS * 4;
  __nv_bfloat16 *q, *go;
  float *cs, *sn, *r;
  __device__ __forceinline__ explicit BwdStage(unsigned char* base) {
    q = reinterpret_cast<__nv_bfloat16*>(base);
    go = q + KS * DP;
    cs = reinterpret_cast<float*>(go + KS * DP);
    sn = cs + KS * DP;
    r = sn + KS * DP;
  }
};
template <int DP, bool kStaged>
constexpr size_t bwd_ld_smem_bytes() {  // M_f, 2 × qʳ, 2 × dnum (bf16); dqʳ, z_f, w (f32); 2 staged buffers
  constexpr int KS = BwdLd<DP>::KS;
  return static_cast<size_t>(DP + 4 * KS) * BwdLd<DP>::LDH * 2 +
         (static_cast<size_t>(KS) * BwdLd<DP>::LDG + 2 * DP) * 4 + (kStaged ? 2 * BwdStage<DP>::kBytes : 0);
}

template <int DP, bool kStaged>
__global__ void __launch_bounds__(kBwdThreads, 1)
    phase_c_bwd_ld_kernel(Out dq_hat, float* __restrict__ dM, float* __restrict__ dz, In dout, In dden, In qkv,
                          const float* __restrict__ rstd, const float* __restrict__ qw,
                          const float* __restrict__ rope_cos, const float* __restrict__ rope_sin,
                          const float* __restrict__ M, const float* __restrict__ z, float* __restrict__ wM,
                          float* __restrict__ wz, int H, int D, int F, int S, int64_t BHF, int64_t whole, int parts,
                          int tiles_per_part, float eps, bool divide, bool vec, bool vec4) {
  using Tl = BwdLd<DP>;
  using RM = RowMap<DP, kBwdThreads>;
  using St = BwdStage<DP>;
  constexpr int KS = Tl::KS, LDH = Tl::LDH, LDG = Tl::LDG;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* Mh = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // M_f [i][j]: B of dnum Mᵀ as (n = i, k = j), LdRow
  __nv_bfloat16* Qh = Mh + DP * LDH;      // 2 × qʳ [s][d]: A of qʳᵀ dnum as (m = d, k = s), LdCol
  __nv_bfloat16* Dh = Qh + 2 * KS * LDH;  // 2 × dnum [s][d]: A of dnum Mᵀ (LdRow), B of qʳᵀ dnum (LdCol)
  float* G = reinterpret_cast<float*>(Dh + 2 * KS * LDH);             // dqʳ [s][d]; at the end the dz shares
  float* zs = G + KS * LDG;                                           // z_f [DP]
  float* ws = zs + DP;                                                // q norm weights of head h [DP]
  unsigned char* staged = reinterpret_cast<unsigned char*>(ws + DP);  // 2 × St (kStaged)
  if constexpr (kStaged) vec = true;                                  // the staged path is taken only for vec rows

  // Blocks [0, whole) own frame blockIdx.x. The others run part p of a frame of the last
  // BHF − whole, with their dM and dz shares going to the workspace as [p][frame − whole].
  const int64_t x = blockIdx.x, nsplit = BHF - whole;
  const bool split = x >= whole;
  const int64_t bhf = split ? whole + (x - whole) / parts : x, bh = bhf / F, b = bh / H;
  const int f = static_cast<int>(bhf % F), h = static_cast<int>(bh % H);
  const int part = split ? static_cast<int>((x - whole) % parts) : 0;
  const int64_t N = static_cast<int64_t>(F) * S;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rs = tid / RM::LPR, c0 = 8 * (tid % RM::LPR);

  // Note [staged rows]: the f32 quads this thread copies (pieces tid and tid + NT of a tile) and
  // where its own rope octet (quads e, e + 1 of the tile, e even) sits.
  constexpr int QPR = DP / 4, RB = kBwdThreads / QPR;  // quads per row; rows from piece tid to tid + NT
  const int r_a = tid / QPR, cq = 4 * (tid % QPR), sw_a = 4 * swizzle_quad(tid);
  const int rope0 = 4 * swizzle_quad(rs * QPR + c0 / 4);  // quad e + 1 at rope0 ^ 4
  auto ld8_rope = [&](float(&v)[8], const float* rows) {
    const float4 a = *reinterpret_cast<const float4*>(rows + rope0),
                 c = *reinterpret_cast<const float4*>(rows + (rope0 ^ 4));
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = c.x, v[5] = c.y, v[6] = c.z, v[7] = c.w;
  };
  // Issues the copies of tile `tile` into buffer buf (invalid pieces read nothing: the base pointer
  // stands in).
  auto stage = [&](int tile, int buf) {
    const St sb(staged + buf * St::kBytes);
    const int s0 = tile * KS;
    const int64_t n0 = static_cast<int64_t>(f) * S + s0;  // the tile's first token
    const __nv_bfloat16 *qs = static_cast<const __nv_bfloat16*>(qkv.p), *gs = static_cast<const __nv_bfloat16*>(dout.p);
    const bool ok = s0 + rs < S && c0 < D;
    cp_async16(sb.q + rs * DP + c0, ok ? qs + qkv_index(b, n0 + rs, 0, h, c0, N, H, D) : qs, ok);
    if (gs) cp_async16(sb.go + rs * DP + c0, ok ? gs + ((b * N + n0 + rs) * H + h) * D + c0 : gs, ok);
    const bool ok_a = s0 + r_a < S && cq < D, ok_b = s0 + r_a + RB < S && cq < D;
    const int64_t ca = (n0 + r_a) * D + cq, cb = ca + RB * D;  // quad tid + NT: swizzle_quad(tid) + NT
    cp_async16(sb.cs + sw_a, ok_a ? rope_cos + ca : rope_cos, ok_a);
    cp_async16(sb.sn + sw_a, ok_a ? rope_sin + ca : rope_sin, ok_a);
    cp_async16(sb.cs + sw_a + 4 * kBwdThreads, ok_b ? rope_cos + cb : rope_cos, ok_b);
    cp_async16(sb.sn + sw_a + 4 * kBwdThreads, ok_b ? rope_sin + cb : rope_sin, ok_b);
    if (tid < KS) {
      const bool ok_r = s0 + tid < S;
      cp_async4(sb.r + tid, ok_r ? rstd + (b * N + n0 + tid) * 2 : rstd, ok_r);
    }
    cp_async_commit();
  };
  if constexpr (kStaged) {                    // the first tile's copies run under the M_f conversion
    const int first = part * tiles_per_part;  // tile0 below (part = 0 when unsplit)
    if (first * KS < S) stage(first, 0);
  }
  load_mat_h<DP, kBwdThreads>(Mh, LDH, M + bhf * D * D, D, vec4);
  load_vecs(zs, ws, z, qw, bhf, h, D, DP);

  const int m1 = 16 * (warp / Tl::WN1), n1 = 16 * (warp % Tl::WN1);
  const int m2 = (warp / Tl::WN2) * Tl::TM2 * 16, n2 = (warp % Tl::WN2) * Tl::TN2 * 8, Kd = round16(D);
  const int ntiles = (S + KS - 1) / KS, per = split ? tiles_per_part : ntiles;
  const int tile0 = part * per, tile1 = min(ntiles, tile0 + per);
  float acc2[Tl::TM2][Tl::TN2][4] = {};
  float dzp[8] = {};
  __syncthreads();  // M_f, z_f, w ready
  for (int tile = tile0; tile < tile1; ++tile) {
    const int buf = (tile - tile0) & 1;
    __nv_bfloat16* Qb = Qh + buf * KS * LDH;
    __nv_bfloat16* Db = Dh + buf * KS * LDH;
    const St sb(staged + buf * St::kBytes);
    const int s = tile * KS + rs;
    const bool valid = s < S;
    const int64_t n = static_cast<int64_t>(f) * S + s, row = ((b * N + n) * H + h) * D + c0;
    // rows: prep, den, dnum
    QRow q;
    float go[8];
    if constexpr (kStaged) {
      cp_async_wait<0>();
      __syncthreads();  // tile staged (the f32 rows and r by other threads); the previous tile done
      if (tile + 1 < tile1) stage(tile + 1, buf ^ 1);  // buffer buf ^ 1 was the previous tile's
      unpack8(q.x, *reinterpret_cast<const uint4*>(sb.q + rs * DP + c0));
      ld8_rope(q.c, sb.cs);
      ld8_rope(q.s, sb.sn);
      q.r = sb.r[rs];
      if (dout.p)
        unpack8(go, *reinterpret_cast<const uint4*>(sb.go + rs * DP + c0));
      else
        for (int k = 0; k < 8; ++k) go[k] = 0.f;
    } else {
      load_qrow(q, qkv, rstd, rope_cos, rope_sin, b, n, h, c0, H, D, N, valid, vec);
      if (dout.p)
        ld8(go, dout, row, valid ? D - c0 : 0, vec);
      else
        for (int k = 0; k < 8; ++k) go[k] = 0.f;
    }
    const float ddin = (!divide && valid && dden.p) ? dden[bh * N + n] : 0.f;
    if (!kStaged && tile + 1 < tile1 && s + KS < S && c0 < D) {  // the next tile's row, read in a few microseconds
      const int64_t nx = n + KS;
      prefetch_l1(element(qkv, qkv_index(b, nx, 0, h, c0, N, H, D)));
      prefetch_l1(rope_cos + nx * D + c0);
      prefetch_l1(rope_sin + nx * D + c0);
      if (dout.p) prefetch_l1(element(dout, row + static_cast<int64_t>(KS) * H * D));
    }
    float w8[8], z8[8], qp[8], qr[8];
    ld8f(w8, ws + c0);
    ld8f(z8, zs + c0);
    prep_octet(q.x, q.r, w8, 1.f, q.c, q.s, qp, qr);
    float dp = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) dp += qp[k] * z8[k];
    const float dn = warp_sum<RM::LPR>(dp) + eps;
    const float inv = divide ? 1.f / dn : 1.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) go[k] *= inv;
    st8h(Qb + rs * LDH + c0, qr);
    st8h(Db + rs * LDH + c0, go);
    __syncthreads();

    // warps: dqʳ = dnum Mᵀ
    {
      float acc1[1][Tl::TN1][4] = {};
      warp_mma_ld<1, Tl::TN1>(acc1, LdRow{Db, LDH}, m1, LdRow{Mh, LDH}, n1, Kd, KS, D);
#pragma unroll
      for (int j = 0; j < Tl::TN1; ++j) {
        const int col = n1 + 8 * j + 2 * t;
        st2(G + (m1 + g) * LDG + col, acc1[0][j][0], acc1[0][j][1]);
        st2(G + (m1 + g + 8) * LDG + col, acc1[0][j][2], acc1[0][j][3]);
      }
    }
    __syncthreads();

    // rows: dden, dq̂, dz share
    {
      float gr[8], dq[8];
      ld8f(gr, G + rs * LDG + c0);
      float dot = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) dot += qr[k] * gr[k];
      dot = warp_sum<RM::LPR>(dot);
      if constexpr (kStaged) {  // the RoPE rows again, from the buffer (registers are short)
        ld8_rope(q.c, sb.cs);
        ld8_rope(q.s, sb.sn);
      }
      const float dd = divide ? -dot / dn : ddin;
#pragma unroll
      for (int k = 0; k < 8; k += 2) {  // dq⁺ = dden·z + unrope(dqʳ), masked by q̂ > 0
        const float d0 = dd * z8[k] + gr[k] * q.c[k] + gr[k + 1] * q.s[k + 1];
        const float d1 = dd * z8[k + 1] + gr[k + 1] * q.c[k + 1] + gr[k] * q.s[k];
        dq[k] = qp[k] > 0.f ? d0 : 0.f;
        dq[k + 1] = qp[k + 1] > 0.f ? d1 : 0.f;
      }
      if (valid) st8(dq_hat, row, dq, D - c0, vec);
#pragma unroll
      for (int k = 0; k < 8; ++k) dzp[k] += dd * qp[k];
    }
    // warps: dM += qʳᵀ dnum
    warp_mma_ld<Tl::TM2, Tl::TN2>(acc2, LdCol{Qb, LDH}, m2, LdCol{Db, LDH}, n2, KS, D, D);
  }

  // dz share: the rows' partial sums added in the fixed row order
  __syncthreads();
  sts8(G + rs * LDG + c0, dzp);
  __syncthreads();
  if (tid < D) {
    float v = 0.f;
    for (int r = 0; r < KS; ++r) v += G[r * LDG + tid];
    (split ? wz + (part * nsplit + bhf - whole) * D : dz + bhf * D)[tid] = v;
  }
  store_tile(split ? wM + (part * nsplit + bhf - whole) * D * D : dM + bhf * D * D, acc2, m2, n2, D);
}

// dst[i] = Σ_p parts[p·n + i], added in the order p = 0, 1, … (n even).
__global__ void sum_parts_kernel(float* __restrict__ dst, const float* __restrict__ parts, int64_t n, int P) {
  const int64_t step = 2 * static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = 2 * (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x); i < n; i += step) {
    float2 v = ldg2(parts + i);
    for (int p = 1; p < P; ++p) {
      const float2 u = ldg2(parts + p * n + i);
      v.x += u.x, v.y += u.y;
    }
    st2(dst + i, v.x, v.y);
  }
}

// ---------------------------------------------------------------------------
// launch helpers
// ---------------------------------------------------------------------------

template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads, size_t smem) {
  int n = 0;
  GDNCP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  return std::max(n, 1);
}

void sum_parts(float* dst, const float* parts, int64_t n, int P) {
  const int64_t blocks = std::min<int64_t>((n / 2 + kThreads - 1) / kThreads, 8 * static_cast<int64_t>(sm_count()));
  sum_parts_kernel<<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), kThreads, 0, stream()>>>(dst, parts, n, P);
  GDNCP_CUDA_CHECK_LAUNCH("sum_parts_kernel");
}

// Token parts per frame for `frames` frames of the bf16 backward (those of the last, partial
// wave): the fewest tile times over their waves of blocks (a block's own cost — M_f in, dM_f
// out — counted as 3 tiles) plus the sum of the parts (about a tile per part per SM).
// Measured on an H200: splitting every frame in 3 parts at B·H·F = 220 (1.67 waves) was no
// faster than whole frames, and 12 % slower at 880 (6.67 waves): split only the last wave.
constexpr int kMaxParts = 8;
int bwd_parts(int64_t frames, int64_t slots, int ntiles) {
  int best = 1;
  double best_cost = 1e300;
  for (int p = 1; p <= std::min(kMaxParts, ntiles); ++p) {
    const int per = (ntiles + p - 1) / p;
    if ((ntiles + per - 1) / per != p) continue;  // the same runs as a smaller p
    const double blocks = static_cast<double>(frames * p), waves = std::ceil(blocks / static_cast<double>(slots));
    const double cost = waves * (per + 3) + (p > 1 ? blocks / static_cast<double>(slots) + 1 : 0.0);
    if (cost < best_cost - 1e-9) {
      best_cost = cost;
      best = p;
    }
  }
  return best;
}

template <int DP, bool kStaged>
void fwd(const FwdArgs& a, bool vec, bool vec4) {
  const FrameSizes& sz = a.z;
  // Persistent: one block per resident slot, each a contiguous run of (frame, tile) items.
  const size_t smem = fwd_ld_smem_bytes<DP, kStaged>();
  const auto kernel = phase_c_fwd_ld_kernel<DP, kStaged>;
  allow_smem(kernel, smem);
  const int64_t items = sz.BHF * ((sz.S + FwdLd<DP>::KS - 1) / FwdLd<DP>::KS);
  const int64_t grid =
      std::min<int64_t>(items, static_cast<int64_t>(blocks_per_sm(kernel, kThreads, smem)) * sm_count());
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream()>>>(a.out, a.den, a.qkv, a.rstd, a.qw, a.cos, a.sin,
                                                                    a.M, a.z_f, sz.H, sz.D, sz.F, sz.S, items, a.eps,
                                                                    a.divide, vec, vec4);
  GDNCP_CUDA_CHECK_LAUNCH("phase_c_fwd_ld_kernel");
}

template <int DP, bool kStaged>
void bwd(const BwdArgs& a, bool vec, bool vec4) {
  const FrameSizes& sz = a.z;
  // Each frame's tokens in `parts` runs (bwd_parts), summed in order when parts > 1.
  const size_t smem = bwd_ld_smem_bytes<DP, kStaged>();
  const auto kernel = phase_c_bwd_ld_kernel<DP, kStaged>;
  allow_smem(kernel, smem);
  const int ntiles = (sz.S + BwdLd<DP>::KS - 1) / BwdLd<DP>::KS;
  const int64_t slots = static_cast<int64_t>(blocks_per_sm(kernel, kBwdThreads, smem)) * sm_count();
  // Whole frames fill the full waves; the frames of the last, partial wave run in `parts` runs each.
  const int64_t rest = sz.BHF % slots, DD = static_cast<int64_t>(sz.D) * sz.D;
  const int parts = rest ? bwd_parts(rest, slots, ntiles) : 1, per_part = (ntiles + parts - 1) / parts;
  const int64_t whole = parts > 1 ? sz.BHF - rest : sz.BHF, nsplit = sz.BHF - whole;
  Tensor work;  // the split frames' dM and dz shares
  float *wm = nullptr, *wz = nullptr;
  if (nsplit > 0) {
    work = Tensor::empty({parts * nsplit * (DD + sz.D)}, DType::f32, Device::cuda);
    wm = work.data_ptr<float>();
    wz = wm + parts * nsplit * DD;
  }
  kernel<<<static_cast<unsigned>(whole + nsplit * parts), kBwdThreads, smem, stream()>>>(
      a.dq_hat, a.dM, a.dz, a.dout, a.dden, a.qkv, a.rstd, a.qw, a.cos, a.sin, a.M, a.z_f, wm, wz, sz.H, sz.D, sz.F,
      sz.S, sz.BHF, whole, parts, per_part, a.eps, a.divide, vec, vec4);
  GDNCP_CUDA_CHECK_LAUNCH("phase_c_bwd_ld_kernel");
  if (nsplit > 0) {
    sum_parts(a.dM + whole * DD, wm, nsplit * DD, parts);
    sum_parts(a.dz + whole * sz.D, wz, nsplit * sz.D, parts);
  }
}

}  // namespace

namespace phase_c {

void fwd_bf16(const FwdArgs& a) {
  const FrameSizes& sz = a.z;
  const bool vec = sz.D % 8 == 0 && aligned16(a.qkv.p) && aligned16(a.cos) && aligned16(a.sin);
  const bool vec4 = sz.D % 4 == 0 && aligned16(a.M);
  const bool staged = vec && a.qkv.bf;  // the raw q rows staged with cp.async (bf16, 16-byte octets)
  with_dp_flag(sz.D, staged, [&](auto dp, auto st) { fwd<decltype(dp)::value, decltype(st)::value>(a, vec, vec4); });
}

void bwd_bf16(const BwdArgs& a) {
  const FrameSizes& sz = a.z;
  const bool vec = sz.D % 8 == 0 && aligned16(a.qkv.p) && aligned16(a.cos) && aligned16(a.sin) &&
                   aligned16(a.dq_hat.p) && (!a.dout.p || aligned16(a.dout.p));
  const bool vec4 = sz.D % 4 == 0 && aligned16(a.M);
  // Note [staged rows]: bf16 q and dout rows in 16-byte pieces.
  const bool staged = vec && a.qkv.bf && (!a.dout.p || a.dout.bf);
  with_dp_flag(sz.D, staged, [&](auto dp, auto st) { bwd<decltype(dp)::value, decltype(st)::value>(a, vec, vec4); });
}

}  // namespace phase_c
}  // namespace cuda
}  // namespace gdncp
