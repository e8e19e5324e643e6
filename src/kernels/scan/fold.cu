// src/kernels/scan/fold.cu — CUDA twins of the CP kernels around the scan core, f32, same signatures and
// semantics as scan_sweep_ref.cpp. The sweeps and transition gradients themselves (Note [scan step] in
// cp_kernels.h) are the scan core's: src/kernels/scan/scan_sweep.cu.
//
//   fold_kernel     the fold over the gathered composites of the ranks: one block per (fold,
//                   b·h, slice of kTileCols = 8 state columns), its warps over the slice's
//                   rows, Note [fold slices].
//   scan_correct    X_t += C_t·v for every (b·h, t) at once: one cuBLAS
//                   strided-batched f32 GEMM per KV correction (Note [corrections
//                   through cuBLAS]), correct_z_kernel per Z correction.
// Gradient rule as the CPU twin: every output overwritten except the corrected X.
// No atomics: every result is bitwise reproducible.
//
// Note [fold slices]. Each step of a fold multiplies a D×D matrix op(A) into the state, a D×E
// matrix whose columns evolve on their own. A block owns a slice of 8 columns of one (fold, b·h);
// the slice lives in shared memory (pitch kYP) and is read as broadcasts. Its rows are split
// over the block's ⌈D/16⌉ warps: warp w's lane (r, h) = (lane % 16, lane / 16) accumulates row
// 16w + r × columns 4h … 4h+3 over k in index order, like the CPU twin. The steps are
// sequential, so a fold is latency-bound, and a step's chain is one warp's 16 rows, not the
// whole D: with one warp for all D rows of a slice, a product step took ~13 µs at D = 112
// (a few hundred warps on the whole device, each waiting on its own loads and FMAs), and a log
// round's fold launch twice as long as now (docs/scaling.md, per kernel).
// Each warp streams its 16 rows of op(A) through a ring of its own (kStages chunks of kKC
// values of k, cp.async, kStages − 1 chunks ahead and across step boundaries: A does not depend
// on the state), stored [i][k] (pitch kKCP, read along k as float4 without bank conflicts) for
// op(A) = A and Aᵀ alike: the transposed folds transpose on the way into shared memory. A step
// costs two block barriers: every warp done reading the slice before it is rewritten, and the
// new slice visible before the next product.
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
constexpr int kTileCols = 8;  // state columns per block (Note [fold slices])
constexpr int kRows = 16;     // rows per warp
constexpr int kKC = 16;       // values of k per staged chunk
constexpr int kKCP = 20;      // pitch of a staged row: 5 float4 (odd: conflict-free along k)
constexpr int kYP = 12;       // pitch of the state slice: 3 float4 (odd: a lane's float4 rows conflict-free)
constexpr int kStages = 6;    // depth of a warp's cp.async ring
constexpr int kMaxWarps = kMaxHeadDim / kRows;
static_assert(kMaxWarps * kRows == kMaxHeadDim, "the largest head dim is a whole number of warps' rows");
static_assert(kMaxHeadDim <= kRowThreads, "the CP kernels take D ≤ kRowThreads");
static_assert(kKC == kRows, "a warp's chunks and the slice's row blocks have one size (nch = warps)");

// Floats of one warp's ring stage and of the slice (rows [0, 16·warps)).
constexpr int kStageFloats = kRows * kKCP;
__host__ __device__ constexpr int slice_floats(int warps) { return kRows * warps * kYP; }
constexpr int smem_bytes(int warps) {
  return (warps * kStages * kStageFloats + slice_floats(warps)) * static_cast<int>(sizeof(float));
}
int warps_of(int64_t D) { return static_cast<int>((D + kRows - 1) / kRows); }

// Stages chunk j of the rows [row0, row0 + 16) of op(A), A a row-major D×D matrix, into buf as
// [i − row0][k0 … k0+kKC) with pitch kKCP (Note [fold slices]); called by the 32 lanes of one warp.
// op(A) = A: 16-byte copies along k (vec: D % 4 == 0, A 16-byte aligned), else 4-byte ones.
// op(A) = Aᵀ: buf[ii][kk] = A[k0 + kk][row0 + ii], 4-byte copies, 16 lanes along ii (reads of A's
// rows coalesced). Entries with k ≥ D are zero-filled; rows ≥ D too (their sums are never stored).
__device__ __forceinline__ void stage_rows(float* buf, const float* A, int D, int row0, int j, bool transpose,
                                           bool vec) {
  const int k0 = j * kKC, lane = threadIdx.x % 32;
  if (transpose) {
#pragma unroll
    for (int t = 0; t < kRows * kKC / 32; ++t) {
      const int idx = lane + 32 * t, ii = idx % kRows, kk = idx / kRows, i = row0 + ii, k = k0 + kk;
      const bool ok = i < D && k < D;
      cp_async4(buf + ii * kKCP + kk, ok ? A + static_cast<int64_t>(k) * D + i : A, ok);
    }
  } else if (vec) {
#pragma unroll
    for (int t = 0; t < kRows * kKC / 4 / 32; ++t) {
      const int idx = lane + 32 * t, ii = idx / (kKC / 4), kk = 4 * (idx % (kKC / 4)), i = row0 + ii;
      const bool ok = i < D && k0 + kk < D;
      cp_async16(buf + ii * kKCP + kk, ok ? A + static_cast<int64_t>(i) * D + k0 + kk : A, ok);
    }
  } else {
#pragma unroll
    for (int t = 0; t < kRows * kKC / 32; ++t) {
      const int idx = lane + 32 * t, ii = idx / kKC, kk = idx % kKC, i = row0 + ii;
      const bool ok = i < D && k0 + kk < D;
      cp_async4(buf + ii * kKCP + kk, ok ? A + static_cast<int64_t>(i) * D + k0 + kk : A, ok);
    }
  }
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float comp(const float4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// acc += op(A)[this lane's row][k0 … k0+kKC) · slice[k0 … k0+kKC)[this lane's columns], k in order.
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const float* buf, const float* ys, int k0) {
  const int lane = threadIdx.x % 32, r = lane % 16, h = lane / 16;
  const float* y = ys + k0 * kYP + 4 * h;
#pragma unroll
  for (int k4 = 0; k4 < kKC; k4 += 4) {
    const float4 p = ld4(buf + r * kKCP + k4);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 y0 = ld4(y + (k4 + j) * kYP);
      const float pj = comp(p, j);
      acc[0] = fmaf(pj, y0.x, acc[0]);
      acc[1] = fmaf(pj, y0.y, acc[1]);
      acc[2] = fmaf(pj, y0.z, acc[2]);
      acc[3] = fmaf(pj, y0.w, acc[3]);
    }
  }
}

// The lane's elements of the slice: row i = 16w + r, columns c0 + 4h + c (c < 4) of a D×E matrix.
// vec: E % 4 == 0 and the job's state pointers 16-byte aligned: the 4 columns are one float4.
struct Slice {
  int D, E, c0, i, h;
  bool vec;
  __device__ bool ok(int c) const { return i < D && c0 + 4 * h + c < E; }
  __device__ int64_t at(int c) const { return static_cast<int64_t>(i) * E + c0 + 4 * h + c; }
  __device__ int sh() const { return i * kYP + 4 * h; }  // offset of column 0 in the slice
};
// The lane's 4 values of the D×E matrix src (zeros outside it or where not live).
__device__ __forceinline__ float4 load_own(const float* src, const Slice& s, bool live) {
  if (s.vec) return live && s.ok(0) ? ld4(src + s.at(0)) : make_float4(0.f, 0.f, 0.f, 0.f);
  float x[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) x[c] = live && s.ok(c) ? src[s.at(c)] : 0.f;
  return make_float4(x[0], x[1], x[2], x[3]);
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
  int tiles = 0, block0 = 0;
  int order[kMaxRanks];
};
// Folds per launch: a log round's compositions (up to four a job, four jobs in a bidirectional
// call) in one launch.
constexpr int kMaxFolds = 16;
struct FoldBatch {
  FoldArgs f[kMaxFolds];
  int n = 0;
};
static_assert(sizeof(FoldBatch) <= 32764, "a fold batch is one kernel's parameters (32764 bytes at most)");

// Which (fold, b·h, slice) a block works on: the folds' blocks laid out one after another, BH × tiles each.
__device__ __forceinline__ void place_of(const FoldBatch& batch, int& k, int& unit, int& tile) {
  k = 0;
  while (k + 1 < batch.n && static_cast<int>(blockIdx.x) >= batch.f[k + 1].block0) ++k;
  const int rel = static_cast<int>(blockIdx.x) - batch.f[k].block0;
  unit = rel / batch.f[k].tiles;
  tile = rel % batch.f[k].tiles;
}

// X = init; for j in order: X = op(M_j) X + H_j (X += H_j without M). One block per (fold, b·h,
// slice), ⌈D/16⌉ warps (Note [fold slices]).
__global__ void __launch_bounds__(32 * kMaxWarps) fold_kernel(const __grid_constant__ FoldBatch batch) {
  extern __shared__ __align__(16) float smem[];
  int k, bh, tile;
  place_of(batch, k, bh, tile);
  const FoldArgs& a = batch.f[k];
  const int D = a.D, E = a.E, w = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const Slice sl{D, E, tile * kTileCols, kRows * w + lane % 16, lane / 16, a.vec_states};
  float* ring = smem + w * kStages * kStageFloats;
  float* ys = smem + warps * kStages * kStageFloats;
  const int64_t DE = static_cast<int64_t>(D) * E, DD = static_cast<int64_t>(D) * D;
  // From a zero state the first step is X = h (no product): the ring streams the other ranks' M.
  const int q0 = a.init ? 0 : 1, nch = warps, total = max(a.n - q0, 0) * nch;
  auto issue = [&](int c) {
    if (a.M && c < total)
      stage_rows(ring + (c % kStages) * kStageFloats, a.M + a.m_off + a.order[c / nch + q0] * a.m_stride + bh * DD, D,
                 kRows * w, c % nch, a.transpose, a.vec);
    cp_async_commit();  // possibly empty: keeps the group count uniform
  };
  for (int c = 0; c < kStages - 1; ++c) issue(c);
  // The initial state (zeros without init), the lane's loads issued at once.
  *reinterpret_cast<float4*>(ys + sl.sh()) = load_own(a.init ? a.init + bh * DE : nullptr, sl, a.init != nullptr);
  __syncthreads();
  int q = 0;  // next chunk of the ring
  for (int step = 0; step < a.n; ++step) {
    const float4 hv = load_own(a.H + a.h_off + a.order[step] * a.h_stride + bh * DE, sl, true);
    float acc[4];
    if (a.M && step >= q0) {
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
      for (int j = 0; j < nch; ++j, ++q) {
        cp_async_wait<kStages - 2>();  // chunk q has landed (this lane's copies)
        __syncwarp();                  // the warp's copies visible; the warp done with chunk q − 1
        issue(q + kStages - 1);
        mma_chunk(acc, ring + (q % kStages) * kStageFloats, ys, j * kKC);
      }
    } else {
      const float4 x = ld4(ys + sl.sh());
      acc[0] = x.x, acc[1] = x.y, acc[2] = x.z, acc[3] = x.w;
    }
    __syncthreads();  // every warp done reading the slice
    // CPU: tmp + h, or x + h. Outside D×E both are 0 (zero-filled rows and k of op(A), zero
    // columns of the state and of h), so the slice stays zero there.
    *reinterpret_cast<float4*>(ys + sl.sh()) = make_float4(acc[0] + hv.x, acc[1] + hv.y, acc[2] + hv.z, acc[3] + hv.w);
    __syncthreads();  // the new slice visible
  }
  const float4 y = ld4(ys + sl.sh());
  float* X = a.X + bh * DE;
  if (sl.vec) {
    if (sl.ok(0)) *reinterpret_cast<float4*>(X + sl.at(0)) = y;
  } else {
    for (int c = 0; c < 4; ++c)
      if (sl.ok(c)) X[sl.at(c)] = comp(y, c);
  }
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
  GDNCP_CHECK(D >= 1 && D <= kMaxHeadDim, "cp cuda fold: D = ", D, " must be in [1, ", kMaxHeadDim, "]");
  const int warps = warps_of(D);
  for (size_t first = 0; first < fs.size(); first += kMaxFolds) {
    const size_t n = std::min<size_t>(kMaxFolds, fs.size() - first);
    FoldBatch batch;
    batch.n = static_cast<int>(n);
    int64_t blocks = 0;
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
      a.block0 = static_cast<int>(blocks);
      blocks += BH * a.tiles;
      GDNCP_CHECK(blocks < (int64_t{1} << 31), "fold_kernel: too many blocks (", blocks, ")");
    }
    if (blocks == 0) continue;
    cc::allow_smem(fold_kernel, static_cast<size_t>(smem_bytes(warps)));
    fold_kernel<<<static_cast<unsigned>(blocks), 32 * warps, smem_bytes(warps), stream()>>>(batch);
    GDNCP_CUDA_CHECK_LAUNCH("fold_kernel");
  }
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
