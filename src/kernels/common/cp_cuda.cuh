// src/kernels/common/cp_cuda.cuh — the tile building blocks of the CUDA twins of the CP
// kernels (fold.cu, cam.cu); the device helpers (stream, tensor views, cp.async,
// reductions) are those of kernels/cuda_common.cuh. All arithmetic is f32 (docs/design.md §8:
// the scan state, its products and the merge run in f32); inputs may be bf16 or f32.
//
// Note [row threads]. The state-like products here are A (D×D) times a block
// of NC columns (state columns or tokens): one thread per row i (128 threads,
// D ≤ 128) keeps its NC outputs in registers; the column block is staged in
// shared memory (read as broadcasts) and A streams through shared memory in
// chunks of 32 columns with an odd pitch, so that reading A[i][k] and A[k][i]
// (the transpose) are both free of bank conflicts. The sum over k runs in
// index order, like the CPU twin.
#pragma once

#include <cstdint>

#include "kernels/common/cuda_common.cuh"

namespace gdncp {
namespace cp {
namespace cuda {
namespace dev {

using namespace ::gdncp::cuda::detail;  // the device helpers, seen by `using namespace dev`

constexpr int kRowThreads = 128;  // Note [row threads]
static_assert(kRowThreads >= kMaxHeadDim, "one thread per row of a D×D state (Note [head dims])");
constexpr int kChunk = 32;  // columns of A per shared-memory chunk
constexpr int kPitch = kChunk + 1;

// acc[c] = Σ_k op(A)[i][k] · Ys[k][c] for this thread's row i (Note [row threads]).
// A: D×D row-major in global memory; op(A)[i][k] = A[i][k], or A[k][i] when
// transpose. Ys: [D][NC] in shared memory, written before the call. Ps: a
// kRowThreads × kPitch shared buffer. Called by all threads of the block;
// ends with a barrier, so the caller may overwrite Ys afterwards.
template <int NC>
__device__ __forceinline__ void apply_mat(float (&acc)[NC], const float* __restrict__ A, bool transpose,
                                          const float* Ys, float* Ps, int D, int i) {
#pragma unroll
  for (int c = 0; c < NC; ++c) acc[c] = 0.f;
  for (int k0 = 0; k0 < D; k0 += kChunk) {
    const int kc = min(kChunk, D - k0);
    __syncthreads();  // Ys written / the previous chunk consumed
    for (int idx = threadIdx.x; idx < D * kChunk; idx += blockDim.x) {
      int r, kk;
      if (transpose) {  // rows k0.. of A, contiguous in r
        r = idx % D;
        kk = idx / D;
      } else {  // columns k0.. of A, contiguous in kk
        kk = idx % kChunk;
        r = idx / kChunk;
      }
      float v = 0.f;
      if (kk < kc) v = transpose ? A[static_cast<int64_t>(k0 + kk) * D + r] : A[static_cast<int64_t>(r) * D + k0 + kk];
      Ps[r * kPitch + kk] = v;
    }
    __syncthreads();
    if (i < D) {
      for (int kk = 0; kk < kc; ++kk) {
        const float p = Ps[i * kPitch + kk];
        const float* y = Ys + (k0 + kk) * NC;
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] = fmaf(p, y[c], acc[c]);
      }
    }
  }
  __syncthreads();
}

// Note [outer tiles]. C (D×D) = Σ_e L(i, e) R(k, e) for one block of 256
// threads: thread (ty, tx) of 16×16 owns rows ty + 16a and columns tx + 16b
// (a, b < 8). L and R stream through shared memory in chunks of 32 along e.
// Launch with kOuterThreads threads.
constexpr int kOuterThreads = 256;
constexpr int kOuterPitch = 129;

template <typename LoadL, typename LoadR>
__device__ __forceinline__ void outer_tile(float (&acc)[8][8], LoadL ldl, LoadR ldr, int D, int E, float* Ls,
                                           float* Rs) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int a = 0; a < 8; ++a)
#pragma unroll
    for (int b = 0; b < 8; ++b) acc[a][b] = 0.f;
  for (int e0 = 0; e0 < E; e0 += kChunk) {
    const int ec = min(kChunk, E - e0);
    // All loads of the chunk first, then the stores: the loads are in flight
    // together instead of one round trip each (blockDim.x == kOuterThreads).
    constexpr int kPer = 128 * kChunk / kOuterThreads;
    float lin[kPer], rin[kPer];
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int idx = threadIdx.x + m * kOuterThreads, ee = idx % kChunk, r = idx / kChunk;
      const bool ok = r < D && ee < ec;
      lin[m] = ok ? ldl(r, e0 + ee) : 0.f;
      rin[m] = ok ? ldr(r, e0 + ee) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int idx = threadIdx.x + m * kOuterThreads, ee = idx % kChunk, r = idx / kChunk;
      Ls[ee * kOuterPitch + r] = lin[m];
      Rs[ee * kOuterPitch + r] = rin[m];
    }
    __syncthreads();
    for (int ee = 0; ee < ec; ++ee) {
      float lv[8], rv[8];
#pragma unroll
      for (int a = 0; a < 8; ++a) lv[a] = Ls[ee * kOuterPitch + ty + 16 * a];
#pragma unroll
      for (int b = 0; b < 8; ++b) rv[b] = Rs[ee * kOuterPitch + tx + 16 * b];
#pragma unroll
      for (int a = 0; a < 8; ++a)
#pragma unroll
        for (int b = 0; b < 8; ++b) acc[a][b] = fmaf(lv[a], rv[b], acc[a][b]);
    }
  }
  __syncthreads();
}

// outer_tile's C into o, row-major D×D: each thread its own rows and columns.
__device__ __forceinline__ void store_outer_tile(float* o, const float (&acc)[8][8], int D) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int a = 0; a < 8; ++a)
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const int i = ty + 16 * a, j = tx + 16 * b;
      if (i < D && j < D) o[i * D + j] = acc[a][b];
    }
}

}  // namespace dev
}  // namespace cuda
}  // namespace cp
}  // namespace gdncp
