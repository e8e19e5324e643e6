// src/kernels/scan_bidi.cu — CUDA twin of the single-rank bidirectional frame
// scan (docs/design.md §4), forward and backward, at f32 accuracy whatever the matrix-unit
// mode (docs/design.md §8): f32 state and merge, step products as 3xTF32 (Note [3xTF32 steps]).
//
// Forward, per (b, h):
//   Mf_f = g_f (I − P_f) Mf_{f−1} + A_f,              Mf_{−1} = 0
//   Mr_f = g_{f+1} (I − P_{f+1}) Mr_{f+1} + A_{f+1},   Mr_{F−1} = 0
//   Msum = Mf + Mr;  z the same with (Pz, b) and vectors.
// Backward, given dMsum (which reaches Mf and Mr alike):
//   G_f  = dMsum_f + g_{f+1} (I − P_{f+1})ᵀ G_{f+1},   G_{F−1} = dMsum_{F−1}      (adjoint of Mf)
//   G̃_f  = dMsum_f + g_f (I − P_f)ᵀ G̃_{f−1},           G̃_0 = dMsum_0             (adjoint of Mr)
//   with G̃'_f = G̃_{f−1} (G̃'_0 = 0) and Z_f = G_f Mf_{f−1}ᵀ + G̃'_f Mr_fᵀ:
//   dA_f = G_f + G̃'_f,  dP_f = −g_f Z_f,  dg_f = tr Z_f − ⟨P_f, Z_f⟩  (+ the same terms of z).
//   Z is two strided-batched cuBLAS f32 GEMMs into dP's storage, then one element-wise pass.
// Gradient rule: dP, dA, dPz, dbz, ddecay are overwritten.
//
// Note [clips are a template]: the kernels take CLIPS as a template argument,
// so a call without a mask runs code without the per-step mask load (that load
// sits on the scan's latency-bound critical path: +15 % per scan when read
// at run time).
// Packed clips (§4a): a clip start p > 0 cuts frame p's transition. The steps
// that multiply by it (Mf_p, G_{p−1}, G̃_p) use g = 0, which leaves the injected
// term alone; the reverse step that produces Mr_{p−1} writes 0 instead. The
// gradient kernel drops both Z terms and G̃'_p at a cut frame.
//
// Note [column blocks]: a state step X ← g (X − P X) + U acts on every column
// of X alone, so one block owns 16 columns of one direction of one (b, h) and
// walks the frames with its slice on chip (the z vector is one more block).
// The forward's two directions of a column block form a cluster of 2; after
// both finished, each writes half of the frames of Msum = Mf + Mr.
//
// Note [3xTF32 steps]: the product op(P) X of a step runs on the tensor cores as
// three TF32 products, hi·hi + (hi·lo + lo·hi) with x = hi + lo split at TF32's
// 11 bits, which keeps the f32 accuracy of the scan (the dropped lo·lo term and
// lo's truncation are 2^-21 relative) at a fraction of the instructions of f32 FMAs. Warp
// w owns rows [16w, 16w + 16) of the slice: it stages its own panel of P_p (the
// 16 rows of P, or for the adjoint the 16 columns) with cp.async and starts the
// next frame's panel as soon as its product is done, so the load runs under the
// block's barrier and state update. The state lives in registers in the
// accumulator layout; a copy in shared memory is the B operand of the next step,
// and the thread writes its own elements of each frame to global memory.
#include <cooperative_groups.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cublas_handle.h"
#include "kernels/cuda_common.cuh"

namespace gdncp {
namespace cuda {
namespace {

using namespace detail;
namespace cg = cooperative_groups;

constexpr int kScanThreads = 256;  // 8 warps of 16 rows: D ≤ 128
constexpr int kCols = 16;          // state columns per block: two n-tiles of 8
constexpr int kRows = 16;          // rows per warp: one m-tile
constexpr int kLdX = kCols + 4;    // pitch of [k][16] tiles: words (2t + j)·kLdX + g are conflict-free

// Shared memory of one block, in floats: one panel of P per warp that owns rows, then the
// state slice X as [Kp][kLdX].
struct ScanLayout {
  int Kp;     // D rounded up to a k-slab of 8
  int ldp;    // forward panel [16][Kp] pitch, ≡ 8 (mod 16): 8-byte loads g·ldp + 2t are conflict-free
  int panel;  // floats a panel: forward [16][ldp], adjoint [Kp][kLdX] (16 columns of P)
  int tiles;  // warps that own rows
  __host__ __device__ ScanLayout(int D, bool fwd)
      : Kp((D + 7) / 8 * 8), ldp((Kp + 15) / 16 * 16 + 8), panel(fwd ? kRows * ldp : Kp * kLdX), tiles((D + 15) / 16) {}
  __host__ __device__ size_t floats() const {
    return static_cast<size_t>(tiles) * panel + static_cast<size_t>(Kp) * kLdX;
  }
};

size_t scan_smem_bytes(int D, bool fwd) { return ScanLayout(D, fwd).floats() * sizeof(float); }

// One direction of one column block (Note [column blocks], Note [3xTF32 steps]).
//   FWD:  X ← g_p (X − P_p X) + U_u          (panel: rows of P)
//   !FWD: X ← g_p (X − P_pᵀ X) + U_u         (the adjoint recurrences; panel: columns of P)
// blockIdx = (direction, column block, b·h); column block ncb is the z vector. vec4: D % 4 == 0
// and P, Pz 16-byte aligned, so panels are staged in 16-byte copies.
template <bool FWD, bool CLIPS>
__global__ void __launch_bounds__(kScanThreads, 3)  // 3 blocks an SM: ≤ 85 registers
    scan_kernel(float* __restrict__ out0, float* __restrict__ out1, float* __restrict__ zout0,
                float* __restrict__ zout1, float* __restrict__ msum, float* __restrict__ zsum,
                const float* __restrict__ P, const float* __restrict__ U, const float* __restrict__ Pz,
                const float* __restrict__ Uz, In decay, const float* __restrict__ clip, int H, int D, int F, int ncb,
                bool vec4) {
  extern __shared__ __align__(16) float smem[];
  const ScanLayout L(D, FWD);
  const int dir = blockIdx.x, cb = blockIdx.y, bh = blockIdx.z, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, m0 = warp * kRows;
  const bool owner = warp < L.tiles;
  float* panel = smem + warp * L.panel;  // this warp's P rows (or columns) [m0, m0 + 16)
  float* Xs = smem + L.tiles * L.panel;  // the state slice, [Kp][kLdX]

  const bool isz = cb == ncb;
  const int c0 = isz ? 0 : cb * kCols, nc = isz ? 1 : min(kCols, D - c0), ntiles = nc > 8 ? 2 : 1;
  const int64_t DD = static_cast<int64_t>(D) * D, mstride = isz ? D : DD;
  const float* Pm = (isz ? Pz : P) + bh * F * DD;
  const float* Um = (isz ? Uz : U) + bh * F * mstride;
  float* out = (isz ? (dir ? zout1 : zout0) : (dir ? out1 : out0)) + bh * F * mstride;
  const auto at = [&](int f, int i, int c) -> int64_t {
    return f * mstride + (isz ? i : static_cast<int64_t>(i) * D + c0 + c);
  };
  // This thread's elements of the slice: rows m0 + g + 8h, columns 8j + 2t and + 1, in the
  // accumulator layout (v[j][2h], v[j][2h + 1]); their offsets in a frame (< D·D) and in X,
  // computed once.
  int eoff[2][2], xoff[2][2];
  unsigned in_slice = 0, in_x = 0;  // bit 2j + h
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g + 8 * h, c = 8 * j + 2 * t;
      eoff[j][h] = static_cast<int>(at(0, i, c));
      xoff[j][h] = i * kLdX + c;
      in_slice |= (owner && i < D && c < nc ? 1u : 0u) << (2 * j + h);
      in_x |= (owner && i < L.Kp ? 1u : 0u) << (2 * j + h);
    }
  const auto load_u = [&](int u, float (&v)[2][4]) {
    const float* base = Um + u * mstride;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2 e = make_float2(0.f, 0.f);
        if (in_slice >> (2 * j + h) & 1u)
          e = isz ? make_float2(__ldg(base + eoff[j][h]), 0.f) : ldg2(base + eoff[j][h]);
        v[j][2 * h] = e.x;
        v[j][2 * h + 1] = e.y;
      }
  };
  // The state to X (rows ≥ D as zeros: the padded k of the next product) and, for f ≥ 0, to frame f.
  const auto store_state = [&](const float (&x)[2][4], int f) {
    float* base = out + (f >= 0 ? f : 0) * mstride;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool in = in_slice >> (2 * j + h) & 1u;
        const float a = in ? x[j][2 * h] : 0.f, b = in ? x[j][2 * h + 1] : 0.f;
        if (in_x >> (2 * j + h) & 1u) st2(Xs + xoff[j][h], a, b);
        if (f >= 0 && in) {
          if (isz)
            base[eoff[j][h]] = a;
          else
            st2(base + eoff[j][h], a, b);
        }
      }
  };
  // This warp's panel of P_p (zeros beyond D), one cp.async group. With 16-byte copies a lane
  // owns one 16-byte chunk of each row it visits (Kp ≤ 128), so the addresses step by a row.
  const auto stage_panel = [&](int p) {
    const float* Pp = Pm + p * DD;
    if (FWD && vec4) {  // rows m0 .. m0 + 15, columns 0 .. Kp − 1, as [16][ldp]
      const int k = 4 * lane;
      if (k < L.Kp) {
        const float* src = Pp + static_cast<int64_t>(m0) * D + k;
        float* dst = panel + k;
        for (int r = 0; r < kRows; ++r, src += D, dst += L.ldp) {
          const bool ok = k < D && m0 + r < D;
          cp_async16(dst, ok ? src : Pp, ok);
        }
      }
    } else if (FWD) {
      for (int r = 0; r < kRows; ++r) {
        const int i = m0 + r;
        for (int k = lane; k < L.Kp; k += 32) {
          const bool ok = i < D && k < D;
          cp_async4(panel + r * L.ldp + k, ok ? Pp + static_cast<int64_t>(i) * D + k : Pp, ok);
        }
      }
    } else if (vec4) {  // columns m0 .. m0 + 15 of rows 0 .. Kp − 1, as [Kp][kLdX]
      const int q = 4 * (lane & 3);
      const float* src = Pp + static_cast<int64_t>(lane >> 2) * D + m0 + q;
      float* dst = panel + (lane >> 2) * kLdX + q;
      for (int k = lane >> 2; k < L.Kp; k += 8, src += 8 * D, dst += 8 * kLdX) {
        const bool ok = k < D && m0 + q < D;
        cp_async16(dst, ok ? src : Pp, ok);
      }
    } else {
      for (int k = lane >> 4; k < L.Kp; k += 2) {
        const int q = lane & 15;
        const bool ok = k < D && m0 + q < D;
        cp_async4(panel + k * kLdX + q, ok ? Pp + static_cast<int64_t>(k) * D + m0 + q : Pp, ok);
      }
    }
    cp_async_commit();
  };
  // y = op(P_p) X for this warp's rows, 3xTF32 (Note [3xTF32 steps]). Slot t of a k-slab takes
  // k0 + 2t and slot t + 4 takes k0 + 2t + 1 (Note [warp tiles]), in A and B alike.
  const auto product = [&](float (&y)[2][4]) {
    float ylo[2][4];  // the small terms: a second accumulator chain
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[j][e] = ylo[j][e] = 0.f;
    for (int k0 = 0; k0 < L.Kp; k0 += 8) {
      float a[4];
      if (FWD) {
        const float2 lo = ld2(panel + g * L.ldp + k0 + 2 * t), hi = ld2(panel + (g + 8) * L.ldp + k0 + 2 * t);
        a[0] = lo.x, a[1] = hi.x, a[2] = lo.y, a[3] = hi.y;
      } else {
        const float* r = panel + (k0 + 2 * t) * kLdX + g;
        a[0] = r[0], a[1] = r[8], a[2] = r[kLdX], a[3] = r[kLdX + 8];
      }
      uint32_t ahi[4], alo[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) split_tf32(a[e], ahi[e], alo[e]);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (j < ntiles) {
          const float* xb = Xs + (k0 + 2 * t) * kLdX + 8 * j + g;
          uint32_t bhi[2], blo[2];
          split_tf32(xb[0], bhi[0], blo[0]);
          split_tf32(xb[kLdX], bhi[1], blo[1]);
          mma_tf32(ylo[j], alo, bhi);
          mma_tf32(ylo[j], ahi, blo);
          mma_tf32(y[j], ahi, bhi);
        }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[j][e] += ylo[j][e];
  };
  // Step s of this block's sweep: X ← g_p (X − op(P_p) X) + U_u becomes frame fs.
  const int nsteps = FWD ? (dir == 0 ? F : F - 1) : (dir == 0 ? F - 1 : max(F - 2, 0));
  const auto frames = [&](int s, int& p, int& u, int& fs) {
    if (FWD && dir == 0) p = u = fs = s;                            // Mf: frames 0 .. F−1
    else if (FWD) fs = F - 2 - s, p = u = fs + 1;                   // Mr: frames F−2 .. 0
    else if (dir == 0) fs = u = F - 2 - s, p = fs + 1;              // G: frames F−2 .. 0
    else p = u = 1 + s, fs = p + 1;                                 // G̃' (slot f holds G̃_{f−1})
  };

  float x[2][4] = {};
  if (FWD) {
    store_state(x, dir == 1 ? F - 1 : -1);  // Mr_{F−1} = 0
  } else if (dir == 0) {                    // G_{F−1} = dMsum_{F−1}
    load_u(F - 1, x);
    store_state(x, F - 1);
  } else {  // slot 0 = 0, slot 1 = G̃_0 = dMsum_0
    store_state(x, 0);
    if (F > 1) {
      load_u(0, x);
      store_state(x, 1);
    }
  }
  int p, u, fs;
  if (nsteps > 0 && owner) {
    frames(0, p, u, fs);
    stage_panel(p);
  }
  for (int s = 0; s < nsteps; ++s) {
    frames(s, p, u, fs);
    float un[2][4];
    load_u(u, un);
    const bool cut = CLIPS && p > 0 && __ldg(clip + static_cast<int64_t>(bh / H) * F + p) != 0.f;
    const float gp = cut ? 0.f : decay[static_cast<int64_t>(bh) * F + p];
    const bool drop = FWD && cut && dir == 1;  // Mr_{p−1} = 0: frame p − 1 ends its clip
    cp_async_wait_all();
    __syncthreads();  // this warp's panel of P_p and the whole of X are visible
    if (owner) {
      float y[2][4];
      product(y);
      __syncwarp();  // the panel is free: start the next frame's
      if (s + 1 < nsteps) {
        int pn, un_, fn;
        frames(s + 1, pn, un_, fn);
        stage_panel(pn);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[j][e] = drop ? 0.f : gp * (x[j][e] - y[j][e]) + un[j][e];
    }
    __syncthreads();  // every warp is done reading X
    store_state(x, fs);
  }

  if (FWD) {  // Msum = Mf + Mr: the two directions of the cluster split the frames
    __threadfence();
    cg::this_cluster().sync();
    const float* a = (isz ? zout0 : out0) + bh * F * mstride;
    const float* bb = (isz ? zout1 : out1) + bh * F * mstride;
    float* sum = (isz ? zsum : msum) + bh * F * mstride;
    // Element pairs (f, i, c) of this block's frames f = dir, dir + 2, …, loaded kBatch at a time
    // before any is stored: the loads are independent, and one at a time each waits out L2.
    constexpr int kBatch = 4;
    const int pairs = isz ? 1 : kCols / 2, per_frame = D * pairs, total = (F - dir + 1) / 2 * per_frame;
    for (int e0 = tid; e0 < total; e0 += kBatch * kScanThreads) {
      float2 va[kBatch], vb[kBatch];
      int64_t o[kBatch];
      bool ok[kBatch];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        const int e = e0 + q * kScanThreads, fr = e / per_frame, r = e - fr * per_frame;
        const int i = r / pairs, c = 2 * (r - i * pairs);
        ok[q] = e < total && c < nc;
        o[q] = ok[q] ? at(dir + 2 * fr, i, c) : 0;
        va[q] = vb[q] = make_float2(0.f, 0.f);
        if (ok[q]) {
          if (isz) {
            va[q].x = __ldcg(a + o[q]);
            vb[q].x = __ldcg(bb + o[q]);
          } else {
            va[q] = __ldcg(reinterpret_cast<const float2*>(a + o[q]));
            vb[q] = __ldcg(reinterpret_cast<const float2*>(bb + o[q]));
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kBatch; ++q)
        if (ok[q]) {
          if (isz)
            sum[o[q]] = va[q].x + vb[q].x;
          else
            st2(sum + o[q], va[q].x + vb[q].x, va[q].y + vb[q].y);
        }
    }
  }
}

// Parameter gradients of one frame (bh, f), element-wise (kGradThreads threads a block). Z_f
// is already in dP (scan_bidi_bwd's two GEMMs); at f = 0 and at a cut frame its true value is
// 0 (G̃'_0 = 0 and Mf_{−1} = 0; a cut drops both terms), whatever the GEMMs wrote there.
// vec: every D×D operand is 16-byte aligned, so the frame (D·D a multiple of 4, D even) is
// walked in float4s over its flat index; otherwise one float at a time.
constexpr int kGradThreads = 512;

template <bool CLIPS>
__global__ void __launch_bounds__(kGradThreads)
    scan_grads_kernel(float* __restrict__ dP, float* __restrict__ dA, float* __restrict__ dPz, float* __restrict__ dbz,
                      Out ddecay, const float* __restrict__ G, const float* __restrict__ Gt,
                      const float* __restrict__ gz, const float* __restrict__ gzt, const float* __restrict__ P,
                      const float* __restrict__ Pz, In decay, const float* __restrict__ zf,
                      const float* __restrict__ zr, const float* __restrict__ clip, int H, int D, int F, bool vec) {
  __shared__ float red[kGradThreads / 32];
  __shared__ float zv[4][128];  // gz, g̃z', z_{f−1}, zr_f

  const int bhf = blockIdx.x, f = bhf % F, tid = threadIdx.x;
  const int64_t DD = static_cast<int64_t>(D) * D, m0 = static_cast<int64_t>(bhf) * DD;
  const float gf = decay[bhf];
  // A clip start: Mf_f = A_f and Mr_{f−1} = 0, so f's transition gets nothing and dA_f = G_f.
  const bool cut = CLIPS && f > 0 && __ldg(clip + static_cast<int64_t>(bhf / F / H) * F + f) != 0.f;
  const bool zero = f == 0 || cut;  // Z_f = 0

  // z: Zz = gz z_{f−1}ᵀ + g̃z' zr_fᵀ (rank two)
  const int64_t v0 = static_cast<int64_t>(bhf) * D;
  if (tid < 128) {
    const bool in = tid < D;
    zv[0][tid] = in ? gz[v0 + tid] : 0.f;
    zv[1][tid] = (in && !cut) ? gzt[v0 + tid] : 0.f;
    zv[2][tid] = (in && f > 0 && !cut) ? zf[v0 - D + tid] : 0.f;
    zv[3][tid] = in ? zr[v0 + tid] : 0.f;
  }
  __syncthreads();
  if (tid < D) dbz[v0 + tid] = zv[0][tid] + zv[1][tid];

  // Element (i, j): dP = −g Z, dA = G + G̃', dPz = −g Zz, and this thread's part of
  // dg = tr Z − ⟨P, Z⟩ + tr Zz − ⟨Pz, Zz⟩.
  float dg = 0.f;
  const auto element = [&](int i, int j, float z, float g, float gt, float p, float pz, float& dp, float& da,
                           float& dpz) {
    z = zero ? 0.f : z;
    dp = -gf * z;
    da = cut ? g : g + gt;
    const float zz = zv[0][i] * zv[2][j] + zv[1][i] * zv[3][j];
    dpz = -gf * zz;
    dg += (i == j ? z : 0.f) - p * z;
    dg += (i == j ? zz : 0.f) - pz * zz;
  };
  if (vec) {
    const auto ld4 = [](const float* q) { return __ldg(reinterpret_cast<const float4*>(q)); };
    for (int e = 4 * tid; e < DD; e += 4 * kGradThreads) {
      const int64_t o = m0 + e;
      const float4 z = *reinterpret_cast<const float4*>(dP + o);
      const float4 g = ld4(G + o), gt = ld4(Gt + o), p = ld4(P + o), pz = ld4(Pz + o);
      float4 dp, da, dpz;
      int i = e / D, j = e - i * D;
      const auto next = [&]() {  // D even: the four elements span at most two rows
        if (++j == D) {
          j = 0;
          ++i;
        }
      };
      element(i, j, z.x, g.x, gt.x, p.x, pz.x, dp.x, da.x, dpz.x);
      next();
      element(i, j, z.y, g.y, gt.y, p.y, pz.y, dp.y, da.y, dpz.y);
      next();
      element(i, j, z.z, g.z, gt.z, p.z, pz.z, dp.z, da.z, dpz.z);
      next();
      element(i, j, z.w, g.w, gt.w, p.w, pz.w, dp.w, da.w, dpz.w);
      *reinterpret_cast<float4*>(dP + o) = dp;
      *reinterpret_cast<float4*>(dA + o) = da;
      *reinterpret_cast<float4*>(dPz + o) = dpz;
    }
  } else {
    for (int e = tid; e < DD; e += kGradThreads) {
      const int64_t o = m0 + e;
      const int i = e / D, j = e % D;
      element(i, j, dP[o], G[o], Gt[o], P[o], Pz[o], dP[o], dA[o], dPz[o]);
    }
  }

  dg = warp_sum(dg);
  if ((tid & 31) == 0) red[tid >> 5] = dg;
  __syncthreads();
  if (tid == 0) {
    float s = 0.f;
    for (int w = 0; w < kGradThreads / 32; ++w) s += red[w];
    ddecay.set(bhf, s);
  }
}

// C_j = A_j·B_jᵀ (+ C_j when accumulate) for `batch` row-major D×D frames a frame apart, in
// IEEE f32. Column-major, the buffers hold A_jᵀ, B_jᵀ, C_jᵀ, and C_jᵀ = B_j·A_jᵀ = op_T(B_jᵀ)·op_N(A_jᵀ)
// (Note [row-major through cuBLAS] in matmul.cu).
void frame_gemm_nt(cublasHandle_t handle, float* C, const float* A, const float* B, int D, int batch, bool accumulate) {
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  const int64_t DD = static_cast<int64_t>(D) * D;
  GDNCP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, D, D, D, &one, B, CUDA_R_32F, D, DD,
                                                A, CUDA_R_32F, D, DD, &beta, C, CUDA_R_32F, D, DD, batch,
                                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}


// Panels of P and Pz can be staged in 16-byte copies: rows of D floats keep 16-byte alignment.
bool panels_vec4(const float* P, const float* Pz, int D) { return D % 4 == 0 && aligned16(P) && aligned16(Pz); }

void check_dims(const Dims& d) {
  GDNCP_CHECK(d.D >= 2 && d.D <= kMaxHeadDim && d.D % 2 == 0, "cuda scan: D must be even in [2, ", kMaxHeadDim,
              "], got ", d.D);
  GDNCP_CHECK(d.B > 0 && d.H > 0 && d.F > 0, "cuda scan: sizes must be positive");
}

}  // namespace

// ---------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------
void scan_bidi_fwd(Tensor& Mf, Tensor& Mr, Tensor& Msum, Tensor& zf, Tensor& zr, Tensor& zsum, const Tensor& P,
                   const Tensor& A, const Tensor& Pz, const Tensor& bz, const Tensor& decay, const Tensor& clip_starts,
                   const Dims& d) {
  check_dims(d);
  const int D = static_cast<int>(d.D), F = static_cast<int>(d.F), ncb = (D + kCols - 1) / kCols;
  const size_t smem = scan_smem_bytes(D, true);
  // Without a mask the kernels are compiled without the clip tests (Note [clips are a template]).
  const float* clip = f32_or_null(clip_starts, "clip_starts");
  const float *p = f32_or_null(P, "P"), *pz = f32_or_null(Pz, "Pz");
  const bool vec4 = panels_vec4(p, pz, D);
  auto* kernel = clip ? scan_kernel<true, true> : scan_kernel<true, false>;
  allow_smem(kernel, smem);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(2, static_cast<unsigned>(ncb + 1), static_cast<unsigned>(d.BH()));
  cfg.blockDim = dim3(kScanThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  GDNCP_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, f32_out(Mf, "Mf"), f32_out(Mr, "Mr"), f32_out(zf, "zf"),
                                      f32_out(zr, "zr"), f32_out(Msum, "Msum"), f32_out(zsum, "zsum"),
                                      p, f32_or_null(A, "A"), pz,
                                      f32_or_null(bz, "bz"), in_of(decay, "decay"),
                                      clip, static_cast<int>(d.H), D, F, ncb, vec4));
  GDNCP_CUDA_CHECK_LAUNCH("scan_kernel<true>");
}

void scan_bidi_bwd(Tensor& dP, Tensor& dA, Tensor& dPz, Tensor& dbz, Tensor& ddecay, const Tensor& dMsum,
                   const Tensor& dzsum, const Tensor& P, const Tensor& Pz, const Tensor& decay, const Tensor& Mf,
                   const Tensor& Mr, const Tensor& zf, const Tensor& zr, const Tensor& clip_starts, const Dims& d) {
  check_dims(d);
  const int D = static_cast<int>(d.D), F = static_cast<int>(d.F), ncb = (D + kCols - 1) / kCols;
  const int64_t BH = d.BH();
  // Adjoint states (Note [column blocks]); workspaces from the caching allocator.
  Tensor G = Tensor::empty({BH, d.F, d.D, d.D}, DType::f32, Device::cuda);
  Tensor Gt = Tensor::empty({BH, d.F, d.D, d.D}, DType::f32, Device::cuda);
  Tensor gz = Tensor::empty({BH, d.F, d.D}, DType::f32, Device::cuda);
  Tensor gzt = Tensor::empty({BH, d.F, d.D}, DType::f32, Device::cuda);
  const In dec = in_of(decay, "decay");
  const float* clip = f32_or_null(clip_starts, "clip_starts");
  const float *p = f32_in(P, "P"), *pz = f32_in(Pz, "Pz"), *mf = f32_in(Mf, "Mf"), *mr = f32_in(Mr, "Mr");
  const int H = static_cast<int>(d.H);
  const size_t smem = scan_smem_bytes(D, false);
  auto* kernel = clip ? scan_kernel<false, true> : scan_kernel<false, false>;
  allow_smem(kernel, smem);
  const dim3 grid(2, static_cast<unsigned>(ncb + 1), static_cast<unsigned>(BH));
  kernel<<<grid, kScanThreads, smem, stream()>>>(
      f32_out(G, "G"), f32_out(Gt, "Gt"), f32_out(gz, "gz"), f32_out(gzt, "gzt"), nullptr, nullptr, p,
      f32_or_null(dMsum, "dMsum"), pz, f32_or_null(dzsum, "dzsum"), dec, clip, H, D, F, ncb, panels_vec4(p, pz, D));
  GDNCP_CUDA_CHECK_LAUNCH("scan_kernel<false>");
  // Z_f into dP's storage: Z_j = G̃'_j Mr_jᵀ over all frames j = bh·F + f, then Z_j += G_j Mf_{j−1}ᵀ
  // for j ≥ 1 (at f = 0 that mixes in the previous (b, h)'s last frame: scan_grads_kernel reads
  // Z as 0 there).
  const int64_t N = checked_mul(BH, d.F, "cuda scan: B·H·F");
  GDNCP_CHECK(N <= INT32_MAX, "cuda scan: B·H·F = ", N, " exceeds cuBLAS's 32-bit batch count");
  float *dp = f32_out(dP, "dP"), *da = f32_out(dA, "dA"), *dpz = f32_out(dPz, "dPz"), *db = f32_out(dbz, "dbz");
  const Out dg = out_of(ddecay, "ddecay");
  const float *gp = static_cast<const float*>(G.data()), *gtp = static_cast<const float*>(Gt.data());
  const int64_t DD = d.D * d.D;
  cublasHandle_t handle = cublas_handle();
  frame_gemm_nt(handle, dp, gtp, mr, D, static_cast<int>(N), false);
  if (N > 1) frame_gemm_nt(handle, dp + DD, gp + DD, mf, D, static_cast<int>(N - 1), true);
  const bool vec = aligned16(dp) && aligned16(da) && aligned16(dpz) && aligned16(gp) && aligned16(gtp) &&
                   aligned16(p) && aligned16(pz);
  (clip ? scan_grads_kernel<true> : scan_grads_kernel<false>)<<<static_cast<unsigned>(N), kGradThreads, 0, stream()>>>(
      dp, da, dpz, db, dg, gp, gtp, static_cast<const float*>(gz.data()), static_cast<const float*>(gzt.data()), p, pz,
      dec, f32_or_null(zf, "zf"), f32_or_null(zr, "zr"), clip, H, D, F, vec);
  GDNCP_CUDA_CHECK_LAUNCH("scan_grads_kernel");
}

}  // namespace cuda
}  // namespace gdncp
