// src/kernels/scan/fold.cu — CUDA twins of the CP kernels around the scan core, f32, same signatures and
// semantics as scan_sweep_ref.cpp. The sweeps and transition gradients themselves (Note [scan step] in
// cp_kernels.h) are the scan core's: src/kernels/scan/scan_sweep.cu.
//
//   fold_kernel     the fold over the gathered composites of the ranks: one warp per (fold,
//                   b·h, slice of kTileCols = 8 state columns), Note [fold slices]; the
//                   ranks' composites stream through a cp.async ring that the warps of a
//                   block share.
//   scan_correct    X_t += C_t·v for every (b·h, t) at once: one cuBLAS
//                   strided-batched f32 GEMM per KV correction (Note [corrections
//                   through cuBLAS]), correct_z_kernel per Z correction.
// Gradient rule as the CPU twin: every output overwritten except the corrected X.
// No atomics: every result is bitwise reproducible.
//
// Note [fold slices]. Each step of a fold multiplies a D×D
// matrix op(A) into the state, a D×E matrix whose columns evolve on their own.
// One warp owns a slice of 8 columns: lane (r, h) = (lane % 16, lane / 16)
// accumulates rows r + 16a (a < RA, 16·RA ≥ D) × columns 4h … 4h+3 in 4·RA
// registers; the slice itself lives in shared memory (pitch kYP) and is read
// as broadcasts. The steps are sequential, so a fold is latency-bound: 8
// columns a warp (not 16) give twice the warps, each with half the products
// of a step and half the registers (measured on the sweeps this coding once
// ran: Note [eight columns]).
// A streams through a ring of kStages shared buffers in chunks of kKC values
// of k, issued kStages − 1 chunks ahead with cp.async and across step
// boundaries (A does not depend on the state, so the next step's A is in
// flight while this step's product runs). A chunk is op(A)[:, k0 … k0+kKC)
// stored [i][k] (pitch kKCP, 5 float4: read along k as float4 without bank
// conflicts) for op(A) = A and Aᵀ alike: the transposed folds transpose on
// the way into shared memory, so their products load as few operands as the
// plain ones. The warps of a block are slices of the same (fold, b·h) and
// share the ring; a step costs one barrier per chunk. Sums over k run in
// index order, like the CPU twin.
#include <algorithm>

#include "autograd/device.h"
#include "kernels/common/cp_cuda.cuh"
#include "kernels/common/cublas_handle.h"
#include "kernels/common/cuda_common.cuh"
#include "kernels/cp_kernels.h"

namespace gdncp {
namespace cp {
namespace cuda {
namespace {

using namespace dev;
namespace cc = ::gdncp::cuda::detail;  // device helpers shared with the layer kernels

constexpr int kMaxRanks = 64;
constexpr int kTileCols = 8;  // state columns per warp (Note [fold slices])
constexpr int kKC = 16;       // values of k per staged chunk
constexpr int kKCP = 20;      // pitch of a chunk of op(A) = A: 5 float4 (odd: conflict-free along k)
constexpr int kYP = 12;       // pitch of the state slice: 3 float4 (odd: a lane's float4 rows conflict-free)
constexpr int kStages = 4;    // depth of the cp.async ring
constexpr int kMaxWarps = 4;  // slices per block

// Row slots of a lane (Note [fold slices]): lane r covers rows r + 16a, a < RA, so 16·RA ≥ D.
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
// kKCP (Note [fold slices]): the product reads it the same way for op(A) = A and op(A) = Aᵀ.
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
      __syncthreads();               // everyone's copies visible; everyone done with chunk q − 1
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
// Note [eight columns]. At D = 112 on an H200, 16-column slices need 221
// registers and keep too few warps resident to hide the ring's latency;
// 8-column slices need 128 and made the SIMT sweeps (since replaced by the
// scan core, src/kernels/scan/scan_sweep.cu) about a fifth faster.
//
// Slices per block (Note [fold slices]): one warp per block while the launch
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

void copy_region(Tensor& dst, int64_t dst_off, const Tensor& src, int64_t src_off, int64_t n, int64_t rows,
                 int64_t dst_pitch, int64_t src_pitch) {
  GDNCP_CHECK(dst.dtype() == src.dtype(), "copy_region: dtype mismatch");
  check_region("dst", dst.numel(), dst_off, n, rows, dst_pitch);
  check_region("src", src.numel(), src_off, n, rows, src_pitch);
  if (n == 0 || rows == 0) return;
  const size_t es = dtype_size(dst.dtype());
  char* d = static_cast<char*>(dst.data()) + dst_off * es;
  const char* s = static_cast<const char*>(src.data()) + src_off * es;
  if (rows == 1)
    GDNCP_CUDA_CHECK(cudaMemcpyAsync(d, s, static_cast<size_t>(n) * es, cudaMemcpyDeviceToDevice, stream()));
  else
    GDNCP_CUDA_CHECK(cudaMemcpy2DAsync(d, static_cast<size_t>(dst_pitch) * es, s, static_cast<size_t>(src_pitch) * es,
                                       static_cast<size_t>(n) * es, static_cast<size_t>(rows), cudaMemcpyDeviceToDevice,
                                       stream()));
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
