// src/cp/scan.cu — CUDA twins of the CP scan kernels (Note [scan step] in
// cp_kernels.h), f32, same signatures and semantics as scan_ref.cpp.
//
//   sweep_kernel    the sequential sweeps over frames: one warp per (sweep,
//                   b·h, slice of kTileCols = 8 state columns), Note [sweep slices]; the
//                   frames' transitions stream through a cp.async ring that
//                   the warps of a block share.
//   fold_kernel     the same over the gathered composites of the ranks.
//   scan_correct    X_t += C_t·v for every (b·h, t) at once: one cuBLAS
//                   strided-batched f32 GEMM per KV correction (Note [corrections
//                   through cuBLAS]), correct_z_kernel per Z correction.
//   outer_kernel    one block per (b·h, frame): Gr = L Rᵀ (Note [outer tiles]),
//                   then dP (=, +=) −g·Gr and dg += ⟨Gr, I − P⟩ (fixed-order sum).
// Gradient rule as the CPU twin: dg accumulates, dP when asked; the rest overwritten.
// No atomics: every result is bitwise reproducible.
//
// Note [sweep slices]. Each step of a sweep (fold) multiplies a D×D
// matrix op(A) into the state, a D×E matrix whose columns evolve on their own.
// One warp owns a slice of 8 columns: lane (r, h) = (lane % 16, lane / 16)
// accumulates rows r + 16a (a < RA, 16·RA ≥ D) × columns 4h … 4h+3 in 4·RA
// registers; the slice itself lives in shared memory (pitch kYP) and is read
// as broadcasts. The steps are sequential, so a sweep is latency-bound: 8
// columns a warp (not 16) give twice the warps, each with half the products
// of a step and half the registers (measured: Note [eight columns]).
// A streams through a ring of kStages shared buffers in chunks of kKC values
// of k, issued kStages − 1 chunks ahead with cp.async and across frame
// boundaries (A does not depend on the state, so the next frame's A is in
// flight while this frame's product runs). A chunk is op(A)[:, k0 … k0+kKC)
// stored [i][k] (pitch kKCP, 5 float4: read along k as float4 without bank
// conflicts) for op(A) = A and Aᵀ alike: the transposed sweeps transpose on
// the way into shared memory, so their products load as few operands as the
// plain ones. The warps of a block are slices of the same (sweep, b·h) and
// share the ring; a step costs one barrier per chunk. Sums over k run in
// index order, like the CPU twin. The additive terms of a step (U_t, or the
// next frame's add_before) are loaded into registers before the product, so
// their latency hides behind it.
#include <algorithm>

#include "autograd/device.h"
#include "cp/cp_cuda.cuh"
#include "cp/cp_kernels.h"
#include "kernels/cublas_handle.h"
#include "kernels/cuda_common.cuh"

namespace gdncp {
namespace cp {
namespace cuda {
namespace {

using namespace dev;
namespace cc = ::gdncp::cuda::detail;  // device helpers shared with the layer kernels

constexpr int kMaxRanks = 64;
constexpr int kTileCols = 8;  // state columns per warp (Note [sweep slices])
constexpr int kKC = 16;       // values of k per staged chunk
constexpr int kKCP = 20;      // pitch of a chunk of op(A) = A: 5 float4 (odd: conflict-free along k)
constexpr int kYP = 12;       // pitch of the state slice: 3 float4 (odd: a lane's float4 rows conflict-free)
constexpr int kStages = 4;    // depth of the cp.async ring
constexpr int kMaxWarps = 4;  // slices per block

// Row slots of a lane (Note [sweep slices]): lane r covers rows r + 16a, a < RA, so 16·RA ≥ D.
// The kernels are built for RA = 7 (D ≤ 112, the production head dim: one slot fewer than the
// padded 128 saves the registers of a slot) and RA = 8 (up to the largest head dim).
constexpr int kSlotRows = 16;
constexpr int kMaxSlots = kMaxHeadDim / kSlotRows;
static_assert(kMaxSlots * kSlotRows == kMaxHeadDim && padded_dim(kMaxHeadDim) == kMaxHeadDim,
              "the largest head dim is a whole number of row slots and its own padded dim");
static_assert(kMaxHeadDim <= kRowThreads, "the CP kernels take D ≤ kRowThreads");
int row_slots(int64_t D) { return D <= kSlotRows * (kMaxSlots - 1) ? kMaxSlots - 1 : kMaxSlots; }

// Floats of one ring stage and of one warp's state slice, for RA row slots.
__host__ __device__ constexpr int stage_floats(int ra) { return 16 * ra * kKCP; }
__host__ __device__ constexpr int slice_floats(int ra) { return 16 * ra * kYP; }
constexpr int smem_bytes(int ra, int warps) {
  return (kStages * stage_floats(ra) + warps * slice_floats(ra)) * static_cast<int>(sizeof(float));
}
static_assert(kKC <= kKCP, "a staged row of a chunk holds its kKC values of k");

// Stages chunk j of op(A), A a row-major D×D matrix, into buf as [i][k0 … k0+kKC) with pitch
// kKCP (Note [sweep slices]): the product reads it the same way for op(A) = A and op(A) = Aᵀ.
// op(A) = A: 16-byte copies along k (vec: D % 4 == 0, A 16-byte aligned), else 4-byte ones.
// op(A) = Aᵀ: buf[i][kk] = A[k0 + kk][i], 4-byte copies, consecutive threads along i (reads of
// A's rows coalesced; the transpose happens on the way into shared memory), no index division
// (it had cost more instructions than the copies: the one-rank sweeps got slower). Entries with
// k ≥ D are zero-filled; rows i ≥ D stay unwritten: they only reach the sums of rows ≥ D,
// which are never stored. Called by every thread of the block.
__device__ __forceinline__ void stage_chunk(float* buf, const float* A, int D, int j, bool transpose, bool vec) {
  const int k0 = j * kKC, tid = threadIdx.x, nt = blockDim.x;
  if (transpose) {  // thread i (i + nt, …) copies column i of the chunk, one row of A after another
    for (int i = tid; i < D; i += nt) {
      const float* src = A + k0 * D + i;
#pragma unroll 4
      for (int kk = 0; kk < kKC; ++kk) {
        const bool ok = k0 + kk < D;
        cp_async4(buf + i * kKCP + kk, ok ? src + kk * D : A, ok);
      }
    }
  } else if (vec) {  // columns k0 … of every row of A, 4 pieces of 4 per row
    for (int idx = tid; idx < D * (kKC / 4); idx += nt) {
      const int i = idx / (kKC / 4), kk = 4 * (idx % (kKC / 4));
      const bool ok = k0 + kk < D;
      cp_async16(buf + i * kKCP + kk, A + (ok ? i * D + k0 + kk : 0), ok);
    }
  } else {
    for (int idx = tid; idx < D * kKC; idx += nt) {
      const int i = idx / kKC, kk = idx % kKC;
      const bool ok = k0 + kk < D;
      cp_async4(buf + i * kKCP + kk, A + (ok ? i * D + k0 + kk : 0), ok);
    }
  }
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float comp(const float4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}
__device__ __forceinline__ void fma4(float (&acc)[4], float p, const float4& y) {
  acc[0] = fmaf(p, y.x, acc[0]);
  acc[1] = fmaf(p, y.y, acc[1]);
  acc[2] = fmaf(p, y.z, acc[2]);
  acc[3] = fmaf(p, y.w, acc[3]);
}

// acc += op(A)[rows of this lane][k0 … k0+kKC) · slice[k0 … k0+kKC)[columns of this lane], k in order;
// buf is the staged chunk ([i][k], stage_chunk): one float4 of op(A) per row slot and 4 values of k.
template <int RA>
__device__ __forceinline__ void mma_chunk(float (&acc)[RA][4], const float* buf, const float* ys, int k0) {
  const int lane = threadIdx.x % 32, r = lane % 16, h = lane / 16;
  const float* y = ys + k0 * kYP + 4 * h;
#pragma unroll
  for (int k4 = 0; k4 < kKC; k4 += 4) {
    float4 p[RA];
#pragma unroll
    for (int a = 0; a < RA; ++a) p[a] = ld4(buf + (r + 16 * a) * kKCP + k4);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 y0 = ld4(y + (k4 + j) * kYP);
#pragma unroll
      for (int a = 0; a < RA; ++a) fma4(acc[a], comp(p[a], j), y0);
    }
  }
}

// The lane's elements of its warp's slice: rows r + 16a, columns c0 + 4h + c (c < 4).
// vec: E % 4 == 0, so a lane's 4 columns are all in or all out, and the matrices are 16-byte aligned:
// the 4 columns are one float4.
struct Slice {
  int D, E, c0, r, h;
  bool vec;
  __device__ bool row_ok(int a) const { return r + 16 * a < D; }
  __device__ bool ok(int a, int c) const { return row_ok(a) && c0 + 4 * h + c < E; }
  __device__ int64_t at(int a, int c) const {  // offset in a D×E matrix
    return static_cast<int64_t>(r + 16 * a) * E + c0 + 4 * h + c;
  }
  __device__ int sh(int a, int c) const { return (r + 16 * a) * kYP + 4 * h + c; }  // offset in the slice
};
// vec: the launcher checked that E % 4 == 0 and that every state pointer of the job is 16-byte aligned.
__device__ __forceinline__ Slice slice_of(int D, int E, int tile, bool vec) {
  const int lane = threadIdx.x % 32;
  return Slice{D, E, tile * kTileCols, lane % 16, lane / 16, vec};
}

// The whole slice: value(i, col) inside D×E (live warps), 0 elsewhere.
template <int RA, typename Value>
__device__ __forceinline__ void fill_slice(float* ys, const Slice& s, bool live, Value value) {
  for (int idx = threadIdx.x % 32; idx < slice_floats(RA); idx += 32) {
    const int i = idx / kYP, cc = idx % kYP, col = s.c0 + cc;
    ys[idx] = (live && cc < kTileCols && i < s.D && col < s.E) ? value(i, col) : 0.f;
  }
  __syncwarp();
}
// dst = the lane's elements of the D×E matrix src (0 outside); all loads issued before any use.
template <int RA>
__device__ __forceinline__ void load_own(float (&dst)[RA][4], const float* src, const Slice& s, bool live) {
#pragma unroll
  for (int a = 0; a < RA; ++a) {
    if (s.vec) {
      const float4 v = live && s.ok(a, 0) ? ld4(src + s.at(a, 0)) : make_float4(0.f, 0.f, 0.f, 0.f);
      dst[a][0] = v.x;
      dst[a][1] = v.y;
      dst[a][2] = v.z;
      dst[a][3] = v.w;
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) dst[a][c] = (live && s.ok(a, c)) ? src[s.at(a, c)] : 0.f;
    }
  }
}
// dst (D×E) = the lane's elements of the slice (or zeros).
template <int RA>
__device__ __forceinline__ void store_own(float* dst, const float* ys, const Slice& s, bool live, bool zeros = false) {
  if (!live) return;
#pragma unroll
  for (int a = 0; a < RA; ++a) {
    if (s.vec) {
      if (s.ok(a, 0))
        *reinterpret_cast<float4*>(dst + s.at(a, 0)) = zeros ? make_float4(0.f, 0.f, 0.f, 0.f) : ld4(ys + s.sh(a, 0));
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (s.ok(a, c)) dst[s.at(a, c)] = zeros ? 0.f : ys[s.sh(a, c)];
    }
  }
}
template <int RA>
__device__ __forceinline__ void zero(float (&acc)[RA][4]) {
#pragma unroll
  for (int a = 0; a < RA; ++a)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[a][c] = 0.f;
}

// The ring of one block: chunk q = part q % nch of the matrix of step q / nch
// (mat(step) gives it), staged in buffer q % kStages.
template <int RA, typename MatOf>
struct Ring {
  float* buf;
  MatOf mat;
  int D, nch, total;
  bool transpose, vec;
  int q = 0;  // next chunk to consume
  __device__ void issue(int c) const {
    if (c < total) stage_chunk(buf + (c % kStages) * stage_floats(RA), mat(c / nch), D, c % nch, transpose, vec);
    cp_async_commit();  // possibly empty: keeps the group count uniform
  }
  __device__ void start() const {
    for (int c = 0; c < kStages - 1; ++c) issue(c);
  }
  // acc = op(A_step) · slice over the next nch chunks; every thread of the block calls it.
  __device__ void product(float (&acc)[RA][4], const float* ys, bool compute) {
    zero<RA>(acc);
    for (int j = 0; j < nch; ++j, ++q) {
      cp_async_wait<kStages - 2>();  // chunk q has landed (this thread's copies)
      __syncthreads();       // everyone's copies visible; everyone done with chunk q − 1
      issue(q + kStages - 1);
      if (compute) mma_chunk<RA>(acc, buf + (q % kStages) * stage_floats(RA), ys, j * kKC);
    }
  }
};
template <int RA, typename MatOf>
__device__ __forceinline__ Ring<RA, MatOf> make_ring(float* buf, MatOf mat, int D, int steps, bool transpose,
                                                     bool vec) {
  const int nch = (D + kKC - 1) / kKC;
  return Ring<RA, MatOf>{buf, mat, D, nch, steps * nch, transpose, vec};
}

// Which (job, unit, slice) a block works on: jobs laid out one after another,
// units × groups blocks each, `warps` slices per group.
struct Place {
  int job, unit, tile, warp;
};
template <typename Job>
__device__ __forceinline__ Place place_of(const Job* jobs, int n, int warps) {
  int k = 0;
  while (k + 1 < n && static_cast<int>(blockIdx.x) >= jobs[k + 1].block0) ++k;
  const int rel = static_cast<int>(blockIdx.x) - jobs[k].block0, warp = threadIdx.x / 32;
  return Place{k, rel / jobs[k].groups, (rel % jobs[k].groups) * warps + warp, warp};
}

// --- sweeps -----------------------------------------------------------------------------------
struct SweepArgs {
  float* ob = nullptr;
  float* oa = nullptr;
  float* fin = nullptr;
  const float* P = nullptr;
  const float* vb = nullptr;
  const float* ua = nullptr;
  const float* init = nullptr;
  const float* cuts = nullptr;  // clip mask (B, F), row bh / H; null: no cut (Note [clip cuts])
  int D = 0, F = 0, E = 0, active = 0, init_kind = 0, cut = 0, H = 1;
  bool descending = false, transpose = false, vec = false, vec_states = false;
  int tiles = 0, groups = 0, block0 = 0;  // slices per b·h, blocks per b·h, first block
};
constexpr int kMaxSweeps = 8;
struct SweepBatch {
  SweepArgs s[kMaxSweeps];
  InPlain decay;
  int n = 0, warps = 1;
};

// One warp per (sweep, b·h, slice); the steps of Note [scan step] in frame order.
template <int RA>
__global__ void __launch_bounds__(32 * kMaxWarps) sweep_kernel(const __grid_constant__ SweepBatch batch) {
  extern __shared__ __align__(16) float smem[];
  const Place pl = place_of(batch.s, batch.n, batch.warps);
  const SweepArgs& a = batch.s[pl.job];
  const int bh = pl.unit, D = a.D, E = a.E, F = a.F;
  const bool live = pl.tile < a.tiles;  // dead warps only help stage the ring
  const Slice sl = slice_of(D, E, pl.tile, a.vec_states);
  float* ys = smem + kStages * stage_floats(RA) + pl.warp * slice_floats(RA);
  const int64_t DE = static_cast<int64_t>(D) * E, DD = static_cast<int64_t>(D) * D;
  auto frame = [&](int step) { return a.descending ? F - 1 - step : step; };
  auto at = [&](auto* base, int t) { return base + (static_cast<int64_t>(bh) * F + t) * DE; };
  auto mat = [&](int step) { return a.P + (static_cast<int64_t>(bh) * F + frame(step)) * DD; };
  Ring<RA, decltype(mat)> ring = make_ring<RA>(smem, mat, D, F, a.transpose, a.vec);
  ring.start();

  fill_slice<RA>(ys, sl, live, [&](int i, int col) {
    if (a.init_kind == static_cast<int>(Init::identity)) return i == col ? 1.f : 0.f;
    if (a.init_kind == static_cast<int>(Init::given)) return a.init[bh * DE + static_cast<int64_t>(i) * E + col];
    return 0.f;
  });
  // pre: the additive term of the next use — U_t (add_after), else the next frame's add_before.
  const bool pre_u = a.ua != nullptr, pre_v = a.vb != nullptr && !pre_u;
  float pre[RA][4], acc[RA][4];
  zero<RA>(pre);
  if (pre_v && F > 0) load_own<RA>(pre, at(a.vb, frame(0)), sl, live);
  // Zeroes the warp's slice (the lane's own elements), Note [clip cuts].
  auto clear = [&] {
    if (live)
#pragma unroll
      for (int i = 0; i < RA; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (sl.ok(i, c)) ys[sl.sh(i, c)] = 0.f;
    __syncwarp();
  };
  for (int step = 0; step < F; ++step) {
    const int t = frame(step);
    const bool frozen = t >= a.active;  // uniform over the block
    const bool cut = a.cuts && !frozen && a.cuts[static_cast<int64_t>(bh / a.H) * F + t] != 0.f;  // uniform too
    if (cut && a.cut == static_cast<int>(Cut::before)) clear();
    if (a.vb && live) {  // 1. Y += Vb_t
      if (pre_v) {
#pragma unroll
        for (int i = 0; i < RA; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            if (sl.ok(i, c)) ys[sl.sh(i, c)] += pre[i][c];
      } else {  // both add terms given: this one unprefetched
        const float* v = at(a.vb, t);
#pragma unroll
        for (int i = 0; i < RA; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            if (sl.ok(i, c)) ys[sl.sh(i, c)] += v[sl.at(i, c)];
      }
    }
    if (a.ob) store_own<RA>(at(a.ob, t), ys, sl, live, frozen);  // 2. out_before
    if (pre_u) {
      if (!frozen) load_own<RA>(pre, at(a.ua, t), sl, live);
    } else if (pre_v && step + 1 < F) {
      load_own<RA>(pre, at(a.vb, frame(step + 1)), sl, live);
    }
    ring.product(acc, ys, live && !frozen);  // 3. op(P_t) Y
    __syncwarp();                            // the slice has been read
    if (live && !frozen) {
      const float g = batch.decay[static_cast<int64_t>(bh) * F + t];
#pragma unroll
      for (int i = 0; i < RA; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (sl.ok(i, c)) {
            float y = g * (ys[sl.sh(i, c)] - acc[i][c]);
            if (pre_u) y += pre[i][c];  // 4. Y += Ua_t
            ys[sl.sh(i, c)] = y;
          }
    }
    __syncwarp();
    if (cut && a.cut == static_cast<int>(Cut::after)) clear();
    if (a.oa) store_own<RA>(at(a.oa, t), ys, sl, live);  // 5. out_after
  }
  if (a.fin) store_own<RA>(a.fin + bh * DE, ys, sl, live);
  cp_async_wait_all();
}

// --- folds over ranks ---------------------------------------------------------------------------
struct FoldArgs {
  float* X = nullptr;
  const float* init = nullptr;
  const float* M = nullptr;
  const float* H = nullptr;
  int64_t m_off = 0, m_stride = 0, h_off = 0, h_stride = 0;
  int D = 0, E = 0, n = 0;
  bool transpose = false, vec = false, vec_states = false;
  int tiles = 0, groups = 0, block0 = 0;
  int order[kMaxRanks];
};
constexpr int kMaxFolds = 4;
struct FoldBatch {
  FoldArgs f[kMaxFolds];
  int n = 0, warps = 1;
};

// X = init; for j in order: X = op(M_j) X + H_j (X += H_j without M). One warp per (fold, b·h, slice).
template <int RA>
__global__ void __launch_bounds__(32 * kMaxWarps) fold_kernel(const __grid_constant__ FoldBatch batch) {
  extern __shared__ __align__(16) float smem[];
  const Place pl = place_of(batch.f, batch.n, batch.warps);
  const FoldArgs& a = batch.f[pl.job];
  const int bh = pl.unit, D = a.D, E = a.E;
  const bool live = pl.tile < a.tiles;
  const Slice sl = slice_of(D, E, pl.tile, a.vec_states);
  float* ys = smem + kStages * stage_floats(RA) + pl.warp * slice_floats(RA);
  const int64_t DE = static_cast<int64_t>(D) * E, DD = static_cast<int64_t>(D) * D;
  // From a zero state the first step is X = h (no product): the ring streams the other ranks' M.
  const int q0 = a.init ? 0 : 1;
  auto mat = [&](int q) { return a.M + a.m_off + a.order[q + q0] * a.m_stride + bh * DD; };
  Ring<RA, decltype(mat)> ring = make_ring<RA>(smem, mat, D, max(a.n - q0, 0), a.transpose, a.vec);
  if (a.M) ring.start();
  fill_slice<RA>(ys, sl, live,
                 [&](int i, int col) { return a.init ? a.init[bh * DE + static_cast<int64_t>(i) * E + col] : 0.f; });
  float h[RA][4], acc[RA][4];
  for (int q = 0; q < a.n; ++q) {
    load_own<RA>(h, a.H + a.h_off + a.order[q] * a.h_stride + bh * DE, sl, live);
    if (a.M && q >= q0) {
      ring.product(acc, ys, live);
      __syncwarp();
    } else {
#pragma unroll
      for (int i = 0; i < RA; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = live && sl.ok(i, c) ? ys[sl.sh(i, c)] : 0.f;
    }
    if (live) {
#pragma unroll
      for (int i = 0; i < RA; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (sl.ok(i, c)) ys[sl.sh(i, c)] = acc[i][c] + h[i][c];  // CPU: tmp + h, or x + h
    }
    __syncwarp();
  }
  store_own<RA>(a.X + bh * DE, ys, sl, live);
  cp_async_wait_all();
}

// --- transition gradients -----------------------------------------------------------------------
struct OuterSrc {
  const float* L = nullptr;
  const float* R = nullptr;
  const float* R0 = nullptr;
  bool shifted = false;
  int active = 0;
};
struct OuterArgs {
  float* dP = nullptr;
  float* dg = nullptr;
  const float* P = nullptr;
  OuterSrc src[2];
  const float* cuts = nullptr;  // clip mask (B, F), row bh / H: a cut frame gets no gradient
  int nsrc = 0, E = 0, H = 1;
  bool accumulate = false;
};
constexpr int kMaxGroups = 4;
struct OuterBatch {
  OuterArgs g[kMaxGroups];
  InPlain decay;
  int D = 0, F = 0;
};

// blockIdx = (b·h·F + t, group): Gr = Σ_src L_t R'_tᵀ, then dP and dg.
__global__ void __launch_bounds__(kOuterThreads) outer_kernel(const __grid_constant__ OuterBatch batch) {
  __shared__ float Ls[kChunk * kOuterPitch];
  __shared__ float Rs[kChunk * kOuterPitch];
  __shared__ float red[kOuterThreads];
  const OuterArgs& a = batch.g[blockIdx.y];
  const int D = batch.D, F = batch.F, E = a.E;
  const int64_t bt = blockIdx.x;
  const int t = static_cast<int>(bt % F);
  const int64_t bh = bt / F;
  const int64_t DD = static_cast<int64_t>(D) * D, DE = static_cast<int64_t>(D) * E;
  float* dPt = a.dP + bt * DD;
  float sum[8][8];
#pragma unroll
  for (int ia = 0; ia < 8; ++ia)
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) sum[ia][kb] = 0.f;
  bool any = false;
  const bool cut = a.cuts && a.cuts[(bh / a.H) * F + t] != 0.f;  // the transition is unused
  for (int q = 0; q < a.nsrc && !cut; ++q) {
    const OuterSrc& src = a.src[q];
    if (t >= src.active) continue;  // a frozen frame of this source: no gradient
    any = true;
    const float* Lt = src.L + bt * DE;
    const float* Rp =
        src.shifted ? src.R + bt * DE : (t > 0 ? src.R + (bt - 1) * DE : (src.R0 ? src.R0 + bh * DE : nullptr));
    float acc[8][8];
    outer_tile(
        acc, [&](int r, int e) { return Lt[static_cast<int64_t>(r) * E + e]; },
        [&](int r, int e) { return Rp ? Rp[static_cast<int64_t>(r) * E + e] : 0.f; }, D, E, Ls, Rs);
#pragma unroll
    for (int ia = 0; ia < 8; ++ia)
#pragma unroll
      for (int kb = 0; kb < 8; ++kb) sum[ia][kb] += acc[ia][kb];
  }
  if (!any) {  // every source frozen: dP_t = 0, dg unchanged
    if (!a.accumulate)
      for (int64_t k = threadIdx.x; k < DD; k += blockDim.x) dPt[k] = 0.f;
    return;
  }
  const float g = batch.decay[bt];
  const float* Pt = a.P + bt * DD;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float part = 0.f;
#pragma unroll
  for (int ia = 0; ia < 8; ++ia)
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
      const int i = ty + 16 * ia, k = tx + 16 * kb;
      if (i < D && k < D) {
        const float v = sum[ia][kb];
        const int64_t o = static_cast<int64_t>(i) * D + k;
        part += v * ((i == k ? 1.f : 0.f) - Pt[o]);
        dPt[o] = a.accumulate ? dPt[o] - g * v : -g * v;
      }
    }
  const float total = block_sum<kOuterThreads>(part, red);
  if (threadIdx.x == 0) a.dg[bt] += total;
}

// --- the Z corrections (E = 1) -----------------------------------------------------------------
// x_t[i] += Σ_k C_t[i][k] v[k] for one (b·h, t) per block: warp w takes rows w, w + 8, …, lanes
// along k (a float4 each when D % 4 == 0); every row's loads are issued before the first sum,
// then a fixed-order warp sum per row. (cuBLAS's batched gemv took 11 µs for the 11 MB of C at
// B·H = 20, F = 11, D = 112, bound by latency.)
constexpr int kZcWarps = 8;
constexpr int kZcRows = (kRowThreads + kZcWarps - 1) / kZcWarps;  // rows per warp at the largest D
__global__ void __launch_bounds__(32 * kZcWarps)
    correct_z_kernel(float* X, const float* C, const float* v, int D, int F, bool vec) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t bt = blockIdx.x, bh = bt / F;
  const float* Ct = C + bt * D * D;
  const float* vb = v + bh * D;
  float part[kZcRows];
  if (vec) {  // D ≤ 128: one float4 of k per lane
    const int k = 4 * lane;
    const float4 x = k < D ? ld4(vb + k) : make_float4(0.f, 0.f, 0.f, 0.f);
    float4 c[kZcRows];
#pragma unroll
    for (int q = 0; q < kZcRows; ++q) {
      const int i = w + kZcWarps * q;
      c[q] = i < D && k < D ? ld4(Ct + static_cast<int64_t>(i) * D + k) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int q = 0; q < kZcRows; ++q) part[q] = fmaf(c[q].w, x.w, fmaf(c[q].z, x.z, fmaf(c[q].y, x.y, c[q].x * x.x)));
  } else {
#pragma unroll
    for (int q = 0; q < kZcRows; ++q) {
      const int i = w + kZcWarps * q;
      float sum = 0.f;
      if (i < D)
        for (int k = lane; k < D; k += 32) sum = fmaf(Ct[static_cast<int64_t>(i) * D + k], vb[k], sum);
      part[q] = sum;
    }
  }
#pragma unroll
  for (int q = 0; q < kZcRows; ++q) {
    const int i = w + kZcWarps * q;
    const float sum = cc::warp_sum(part[q]);
    if (lane == 0 && i < D) X[bt * D + i] += sum;
  }
}

// --- launchers ----------------------------------------------------------------------------------
InPlain decay_of(const Tensor& decay) { return in_of<InPlain>(decay, "decay"); }

void check_dims(const SweepSpec& s) {
  GDNCP_CHECK(s.D >= 1 && s.D <= kRowThreads, "cp cuda scan: D = ", s.D, " must be in [1, ", kRowThreads, "]");
  GDNCP_CHECK(s.E == 1 || s.E == s.D, "cp cuda scan: E = ", s.E, " must be 1 or D");
}

// Note [eight columns]. At D = 112 on an H200, 16-column slices need 221
// registers and keep too few warps resident to hide the ring's latency;
// 8-column slices need 128 and make the sweeps about a fifth faster. What
// remains is latency: cycles between a warp's instructions, a third of it at
// the ring's barriers in the transposed sweeps.
//
// Slices per block (Note [sweep slices]): one warp per block while the launch
// holds at most one warp per SM sub-partition; beyond that 2, then 4, so the
// warps of a block share the staged transitions (less L2 traffic).
int warps_for(int64_t slices) {
  const int64_t sms = cc::sm_count();
  return slices <= 4 * sms ? 1 : slices <= 8 * sms ? 2 : kMaxWarps;
}

// Lays the jobs' blocks out one after another (units × groups each) and launches
// kernel<RA> for RA = row_slots(D) (7: D ≤ 112, 8: D ≤ 128) with `warps` warps per block.
template <typename Batch, typename Job>
void launch_tiles(void (*k7)(Batch), void (*k8)(Batch), Batch& batch, Job* jobs, const int64_t* units, int D,
                  const char* name) {
  int64_t slices = 0;
  for (int k = 0; k < batch.n; ++k) slices += units[k] * jobs[k].tiles;
  batch.warps = warps_for(slices);
  int64_t blocks = 0;
  for (int k = 0; k < batch.n; ++k) {
    jobs[k].groups = static_cast<int>(cc::cdiv(jobs[k].tiles, batch.warps));
    jobs[k].block0 = static_cast<int>(blocks);
    blocks += units[k] * jobs[k].groups;
    GDNCP_CHECK(blocks < (int64_t{1} << 31), name, ": too many blocks (", blocks, ")");
  }
  if (blocks == 0) return;
  const int ra = row_slots(D);
  void (*fn)(Batch) = ra == kMaxSlots - 1 ? k7 : k8;
  cc::allow_smem(fn, static_cast<size_t>(smem_bytes(ra, batch.warps)));
  fn<<<static_cast<unsigned>(blocks), 32 * batch.warps, smem_bytes(ra, batch.warps), stream()>>>(batch);
  GDNCP_CUDA_CHECK_LAUNCH(name);
}

}  // namespace

// The clip mask of a sweep or outer group (B, F) f32 on the device, or null.
const float* cuts_of(const Tensor& cuts, int64_t BH, int64_t H, int64_t F) {
  if (!cuts.defined()) return nullptr;
  GDNCP_CHECK(H >= 1 && BH % H == 0, "cp cuda scan: H = ", H, " does not divide B·H = ", BH);
  GDNCP_CHECK(cuts.numel() == BH / H * F, "cp cuda scan: cuts: must be (B, F) = (", BH / H, ", ", F, "), got ",
              cuts.str());
  return f32_or_null(cuts, "cuts");
}

void scan_sweeps(std::vector<Sweep>& sweeps, const Tensor& decay) {
  const InPlain dc = decay_of(decay);
  for (size_t first = 0; first < sweeps.size(); first += kMaxSweeps) {
    const size_t n = std::min<size_t>(kMaxSweeps, sweeps.size() - first);
    SweepBatch batch;
    batch.decay = dc;
    batch.n = static_cast<int>(n);
    int64_t units[kMaxSweeps];
    int64_t BH = 0, D = 0;
    for (size_t k = 0; k < n; ++k) {
      Sweep& w = sweeps[first + k];
      const SweepSpec& s = w.spec;
      check_dims(s);
      GDNCP_CHECK(k == 0 || (s.BH == BH && s.D == D), "scan_sweeps: sweeps of one batch must share B·H and D");
      GDNCP_CHECK(s.init != Init::identity || s.E == s.D, "scan_sweep: identity init needs E == D");
      BH = s.BH;
      D = s.D;
      SweepArgs& a = batch.s[k];
      a.ob = f32_out_or_null(w.out_before, "out_before");
      a.oa = f32_out_or_null(w.out_after, "out_after");
      a.fin = f32_out_or_null(w.final_state, "final_state");
      GDNCP_CHECK(!a.fin || (w.final_offset >= 0 && w.final_offset + s.BH * s.D * s.E <= w.final_state.numel()),
                  "scan_sweeps: final_offset ", w.final_offset, " leaves no room for the final states in ",
                  w.final_state.str());
      if (a.fin) a.fin += w.final_offset;
      a.P = f32_or_null(w.P, "P");
      GDNCP_CHECK(w.P.defined(), "scan_sweep: P is undefined");  // (null data: a rank with no frame)
      a.vb = f32_or_null(w.add_before, "add_before");
      a.ua = f32_or_null(w.add_after, "add_after");
      a.init = s.init == Init::given ? f32_or_null(w.init, "init") : nullptr;
      GDNCP_CHECK(s.init != Init::given || a.init, "scan_sweep: init is undefined");
      a.D = static_cast<int>(s.D);
      a.F = static_cast<int>(s.F);
      a.E = static_cast<int>(s.E);
      a.active = static_cast<int>(std::min(s.active, s.F));
      a.init_kind = static_cast<int>(s.init);
      a.cuts = s.cut == Cut::none ? nullptr : cuts_of(w.cuts, s.BH, s.H, s.F);
      a.cut = static_cast<int>(s.cut);
      a.H = static_cast<int>(s.H);
      a.descending = s.descending;
      a.transpose = s.transpose;
      a.vec = s.D % 4 == 0 && cc::aligned16(a.P);
      a.vec_states = s.E % 4 == 0 && cc::aligned16(a.ob) && cc::aligned16(a.oa) && cc::aligned16(a.fin) &&
                     cc::aligned16(a.vb) && cc::aligned16(a.ua) && cc::aligned16(a.init);
      a.tiles = static_cast<int>(cc::cdiv(s.E, kTileCols));
      units[k] = s.BH;
    }
    launch_tiles(sweep_kernel<7>, sweep_kernel<8>, batch, batch.s, units, static_cast<int>(D), "sweep_kernel");
  }
}

void scan_sweep(Tensor& out_before, Tensor& out_after, Tensor& final_state, const Tensor& P, const Tensor& decay,
                const Tensor& add_before, const Tensor& add_after, const Tensor& init, const SweepSpec& s,
                const Tensor& cuts) {
  std::vector<Sweep> one(1);
  one[0] = Sweep{out_before, out_after, final_state, P, add_before, add_after, init, s, 0, cuts};
  scan_sweeps(one, decay);
}

void scan_grad_outers(std::vector<OuterGroup>& groups, const Tensor& decay, int64_t BH, int64_t F, int64_t D) {
  GDNCP_CHECK(D >= 1 && D <= kRowThreads, "cp cuda scan: D = ", D, " must be in [1, ", kRowThreads, "]");
  for (size_t first = 0; first < groups.size(); first += kMaxGroups) {
    const size_t n = std::min<size_t>(kMaxGroups, groups.size() - first);
    OuterBatch batch;
    batch.decay = decay_of(decay);
    batch.D = static_cast<int>(D);
    batch.F = static_cast<int>(F);
    for (size_t k = 0; k < n; ++k) {
      OuterGroup& g = groups[first + k];
      GDNCP_CHECK(g.sources.size() >= 1 && g.sources.size() <= 2, "scan_grad_outers: 1 or 2 sources per group");
      OuterArgs& a = batch.g[k];
      a.dP = f32_out_or_null(g.dP, "dP");
      a.dg = f32_out_or_null(g.dg, "dg");
      a.P = f32_or_null(g.P, "P");
      a.E = static_cast<int>(g.E);
      a.accumulate = g.accumulate_dP;
      a.cuts = cuts_of(g.cuts, BH, g.H, F);
      a.H = static_cast<int>(g.H);
      a.nsrc = static_cast<int>(g.sources.size());
      for (size_t q = 0; q < g.sources.size(); ++q) {
        const OuterSource& src = g.sources[q];
        a.src[q].L = f32_or_null(src.L, "L");
        a.src[q].R = f32_or_null(src.R, "R");
        a.src[q].R0 = f32_or_null(src.R0, "R0");
        a.src[q].shifted = src.shifted;
        a.src[q].active = static_cast<int>(std::min(src.active, F));
      }
    }
    if (BH * F == 0) continue;
    outer_kernel<<<dim3(static_cast<unsigned>(BH * F), static_cast<unsigned>(n)), kOuterThreads, 0, stream()>>>(batch);
    GDNCP_CUDA_CHECK_LAUNCH("outer_kernel");
  }
}

void scan_grad_outer(Tensor& dP, Tensor& dg, const Tensor& L, const Tensor& R, const Tensor& R0, const Tensor& P,
                     const Tensor& decay, const SweepSpec& s, bool shifted, bool accumulate, const Tensor& cuts) {
  check_dims(s);
  std::vector<OuterGroup> one(1);
  one[0].dP = dP;
  one[0].dg = dg;
  one[0].P = P;
  one[0].E = s.E;
  one[0].accumulate_dP = accumulate;
  one[0].cuts = cuts;
  one[0].H = s.H;
  OuterSource src;
  src.L = L;
  src.R = R;
  src.R0 = R0;
  src.shifted = shifted;
  src.active = s.active;
  one[0].sources.push_back(src);
  scan_grad_outers(one, decay, s.BH, s.F, s.D);
}

// Note [corrections through cuBLAS]: X_t += C_t·v for all frames t of one b·h is
// one GEMM — the frames' C_t stacked are an (F·D)×D row-major matrix, their X_t
// an (F·D)×E one — so a KV correction (E = D) is one strided-batched f32 GEMM over
// b·h (CUBLAS_COMPUTE_32F: plain f32, no TF32; cuBLAS is bitwise reproducible run
// to run on one device and stream). Row-major through column-major as in
// matmul.cu: Xᵀ (E, F·D) += vᵀ (E, D) · Cᵀ (D, F·D). A Z correction (E = 1) is a
// matrix-vector product per frame: correct_z_kernel. (A 3×TF32 tensor-core kernel
// for the KV corrections was slower than cuBLAS's f32 GEMM.)
void scan_correct(std::vector<Correction>& cs, int64_t BH, int64_t F, int64_t D) {
  GDNCP_CHECK(D >= 1 && D <= kRowThreads, "cp cuda correct: D = ", D, " must be in [1, ", kRowThreads, "]");
  GDNCP_CHECK(BH <= INT32_MAX && F * D <= INT32_MAX, "cp cuda correct: B·H = ", BH, ", F·D = ", F * D,
              " exceed cuBLAS's 32-bit sizes");
  if (BH * F == 0) return;
  for (Correction& c : cs) {
    GDNCP_CHECK(c.E == 1 || c.E == D, "cp cuda correct: E = ", c.E, " must be 1 or D");
    float* X = f32_out_or_null(c.X, "X");
    const float *C = f32_or_null(c.C, "C"), *v = f32_or_null(c.v, "v");
    GDNCP_CHECK(X && C && v, "scan_correct: X, C and v must be defined");
    if (c.E == 1) {
      const bool vec = D % 4 == 0 && cc::aligned16(C) && cc::aligned16(v);
      correct_z_kernel<<<static_cast<unsigned>(BH * F), 32 * kZcWarps, 0, stream()>>>(X, C, v, static_cast<int>(D),
                                                                                      static_cast<int>(F), vec);
      GDNCP_CUDA_CHECK_LAUNCH("correct_z_kernel");
      continue;
    }
    const int E = static_cast<int>(c.E), FD = static_cast<int>(F * D), Di = static_cast<int>(D);
    const float one = 1.f;
    GDNCP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(gdncp::cuda::cublas_handle(), CUBLAS_OP_N, CUBLAS_OP_N, E, FD, Di,
                                                  &one, v, CUDA_R_32F, E, D * E, C, CUDA_R_32F, Di, F * D * D, &one, X,
                                                  CUDA_R_32F, E, F * D * E, static_cast<int>(BH), CUBLAS_COMPUTE_32F,
                                                  CUBLAS_GEMM_DEFAULT));
  }
}

void folds(std::vector<Fold>& fs, int64_t BH, int64_t D) {
  GDNCP_CHECK(D >= 1 && D <= kRowThreads, "cp cuda fold: D = ", D, " must be in [1, ", kRowThreads, "]");
  for (size_t first = 0; first < fs.size(); first += kMaxFolds) {
    const size_t n = std::min<size_t>(kMaxFolds, fs.size() - first);
    FoldBatch batch;
    batch.n = static_cast<int>(n);
    int64_t units[kMaxFolds];
    for (size_t k = 0; k < n; ++k) {
      Fold& f = fs[first + k];
      GDNCP_CHECK(f.order.size() <= static_cast<size_t>(kMaxRanks), "cp cuda fold: more than ", kMaxRanks, " ranks");
      GDNCP_CHECK(f.E == 1 || f.E == D, "cp cuda fold: E = ", f.E, " must be 1 or D");
      FoldArgs& a = batch.f[k];
      a.X = f32_out_or_null(f.X, "X");
      a.init = f32_or_null(f.init, "init");
      a.M = f32_or_null(f.Mbuf, "Mbuf");
      a.H = f32_or_null(f.Hbuf, "Hbuf");
      GDNCP_CHECK(a.X && a.H, "fold: X and Hbuf must be defined");
      a.m_off = f.m_off;
      a.m_stride = f.m_stride;
      a.h_off = f.h_off;
      a.h_stride = f.h_stride;
      a.D = static_cast<int>(D);
      a.E = static_cast<int>(f.E);
      a.n = static_cast<int>(f.order.size());
      a.transpose = f.transpose;
      a.vec = D % 4 == 0 && a.M && cc::aligned16(a.M) && f.m_off % 4 == 0 && f.m_stride % 4 == 0;
      a.vec_states = f.E % 4 == 0 && cc::aligned16(a.X) && cc::aligned16(a.init) && cc::aligned16(a.H) &&
                     f.h_off % 4 == 0 && f.h_stride % 4 == 0;
      std::copy(f.order.begin(), f.order.end(), a.order);
      a.tiles = static_cast<int>(cc::cdiv(f.E, kTileCols));
      units[k] = BH;
    }
    launch_tiles(fold_kernel<7>, fold_kernel<8>, batch, batch.f, units, static_cast<int>(D), "fold_kernel");
  }
}

void fold(Tensor& X, const Tensor& init, const Tensor& Mbuf, int64_t m_off, int64_t m_stride, bool transpose,
          const Tensor& Hbuf, int64_t h_off, int64_t h_stride, const std::vector<int>& order, int64_t BH, int64_t D,
          int64_t E) {
  std::vector<Fold> one(1);
  Fold& f = one[0];
  f.X = X;
  f.init = init;
  f.Mbuf = Mbuf;
  f.Hbuf = Hbuf;
  f.m_off = m_off;
  f.m_stride = m_stride;
  f.h_off = h_off;
  f.h_stride = h_stride;
  f.E = E;
  f.transpose = transpose;
  f.order = order;
  folds(one, BH, D);
}

void copy_region(Tensor& dst, int64_t dst_off, const Tensor& src, int64_t src_off, int64_t n) {
  GDNCP_CHECK(dst.dtype() == src.dtype(), "copy_region: dtype mismatch");
  GDNCP_CHECK(dst_off + n <= dst.numel() && src_off + n <= src.numel(), "copy_region: out of range");
  if (n == 0) return;
  const size_t es = dtype_size(dst.dtype());
  GDNCP_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst.data()) + dst_off * es,
                                   static_cast<const char*>(src.data()) + src_off * es, static_cast<size_t>(n) * es,
                                   cudaMemcpyDeviceToDevice, stream()));
}

void add(Tensor& out, const Tensor& a, const Tensor& b) {
  GDNCP_CHECK(a.numel() == out.numel() && b.numel() == out.numel(), "add: size mismatch");
  float* o = f32_out_or_null(out, "out");
  const float* x = f32_or_null(a, "a");
  const float* y = f32_or_null(b, "b");
  ::gdncp::detail::cuda_add(o, x, y, DType::f32, out.numel());
}

}  // namespace cuda
}  // namespace cp
}  // namespace gdncp
