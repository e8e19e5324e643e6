// src/kernels/scan_bidi.cu — CUDA twin of the single-rank bidirectional frame
// scan (docs/design.md §4), forward and backward, in plain f32 (docs/design.md §8: scan state,
// products and merge run in f32 whatever the matrix-unit mode).
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

constexpr int kScanThreads = 256;  // thread = (row, half of the columns): D ≤ 128
constexpr int kCols = 16;          // state columns per block
constexpr int kHalf = kCols / 2;   // columns per thread

size_t scan_smem_bytes(int D) {
  const size_t p = (static_cast<size_t>(D) * (D + 1) + 3) / 4 * 4;
  return (p + 2 * static_cast<size_t>(D) * kCols) * sizeof(float);
}

// One direction of one column block (Note [column blocks]).
//   FWD:  X ← g_p (X − P_p X) + U_u          (P_p read as [i][k])
//   !FWD: X ← g_p (X − P_pᵀ X) + U_u         (the adjoint recurrences)
// blockIdx = (direction, column block, b·h); column block ncb is the z vector.
// Each step stages P_p and the block's slice of U_u in shared memory (cp.async); the state
// lives in registers (two rows per thread) and in X for the broadcast reads; states are
// written to global memory from X, coalesced, at the start of the following step.
template <bool FWD, bool CLIPS>
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(float* __restrict__ out0, float* __restrict__ out1, float* __restrict__ zout0,
                float* __restrict__ zout1, float* __restrict__ msum, float* __restrict__ zsum,
                const float* __restrict__ P, const float* __restrict__ U, const float* __restrict__ Pz,
                const float* __restrict__ Uz, In decay, const float* __restrict__ clip, int H, int D, int F, int ncb) {
  extern __shared__ __align__(16) float smem[];
  const int ldp = D + 1;  // odd pitch: both P[i][k] (lanes over i) and P[k][i] are conflict-free
  float* Ps = smem;
  float* X = smem + (D * ldp + 3) / 4 * 4;  // [D][kCols] state slice
  float* Us = X + D * kCols;                // [D][kCols] injected slice of this step

  const int dir = blockIdx.x, cb = blockIdx.y, bh = blockIdx.z, tid = threadIdx.x;
  const bool isz = cb == ncb;
  const int c0 = isz ? 0 : cb * kCols, nc = isz ? 1 : min(kCols, D - c0);
  const int64_t DD = static_cast<int64_t>(D) * D, mstride = isz ? D : DD;
  const float* Pm = (isz ? Pz : P) + bh * F * DD;
  const float* Um = (isz ? Uz : U) + bh * F * mstride;
  float* out = (isz ? (dir ? zout1 : zout0) : (dir ? out1 : out0)) + bh * F * mstride;
  // This thread's row and columns [ch, ch + kHalf) of the slice; rows ≥ D only help with copies.
  const int row = tid & 127, ch = (tid >> 7) * kHalf, rw = min(row, D - 1);
  const bool active = row < D;
  // Element e of the slice, enumerated so that consecutive threads touch consecutive addresses.
  const int slice = isz ? D : D * kCols;
  const auto slice_row = [&](int e) { return isz ? e : e >> 4; };
  const auto slice_col = [&](int e) { return isz ? 0 : e & (kCols - 1); };
  const auto at = [&](int f, int i, int c) -> int64_t {
    return f * mstride + (isz ? i : static_cast<int64_t>(i) * D + c0 + c);
  };

  float x[kHalf];
#pragma unroll
  for (int c = 0; c < kHalf; ++c) x[c] = 0.f;

  const auto publish = [&]() {  // registers -> X (all columns, zeros beyond nc)
    if (active)
#pragma unroll
      for (int c = 0; c < kHalf; ++c) X[row * kCols + ch + c] = x[c];
  };
  const auto copy_out = [&](int f) {  // X -> out[f], coalesced (X must be complete)
    for (int e = tid; e < slice; e += kScanThreads) {
      const int i = slice_row(e), c = slice_col(e);
      if (c < nc) out[at(f, i, c)] = X[i * kCols + c];
    }
  };
  const auto set_u = [&](int u) {
#pragma unroll
    for (int c = 0; c < kHalf; ++c) x[c] = (active && ch + c < nc) ? Um[at(u, row, ch + c)] : 0.f;
  };
  int pending = -1;  // the frame whose state X holds and that is not written yet
  const auto flush = [&]() {
    __syncthreads();
    if (pending >= 0) copy_out(pending);
    pending = -1;
    __syncthreads();
  };
  // x ← g_p (x − op(P_p) x) + U_u; the result is frame `fstore`'s state.
  const auto step = [&](int p, int u, int fstore) {
    const float* Pp = Pm + p * DD;
    for (int i = tid >> 6; i < D; i += kScanThreads / 64)
      for (int k = tid & 63; k < D; k += 64) cp_async4(Ps + i * ldp + k, Pp + static_cast<int64_t>(i) * D + k);
    for (int e = tid; e < slice; e += kScanThreads) {
      const int i = slice_row(e), c = slice_col(e);
      if (c < nc) cp_async4(Us + i * kCols + c, Um + at(u, i, c));
    }
    const bool cut = CLIPS && p > 0 && __ldg(clip + static_cast<int64_t>(bh / H) * F + p) != 0.f;
    const float gp = cut ? 0.f : decay[static_cast<int64_t>(bh) * F + p];
    const bool drop = FWD && cut && dir == 1;  // Mr_{p−1} = 0: frame p − 1 ends its clip
    cp_async_wait_all();
    __syncthreads();  // P_p, U_u and X visible
    if (pending >= 0) copy_out(pending);
    float y[kHalf];
#pragma unroll
    for (int c = 0; c < kHalf; ++c) y[c] = 0.f;
    const float* pr = FWD ? Ps + rw * ldp : Ps + rw;  // P[row][k] at pr[k], or P[k][row] at pr[k·ldp]
    const int pk = FWD ? 1 : ldp;
#pragma unroll 4
    for (int k = 0; k < D; ++k) {
      const float pv = pr[k * pk];
      const float4 v0 = *reinterpret_cast<const float4*>(X + k * kCols + ch);
      const float4 v1 = *reinterpret_cast<const float4*>(X + k * kCols + ch + 4);
      y[0] = fmaf(pv, v0.x, y[0]);
      y[1] = fmaf(pv, v0.y, y[1]);
      y[2] = fmaf(pv, v0.z, y[2]);
      y[3] = fmaf(pv, v0.w, y[3]);
      y[4] = fmaf(pv, v1.x, y[4]);
      y[5] = fmaf(pv, v1.y, y[5]);
      y[6] = fmaf(pv, v1.z, y[6]);
      y[7] = fmaf(pv, v1.w, y[7]);
    }
    const float4 u0 = *reinterpret_cast<const float4*>(Us + rw * kCols + ch);
    const float4 u1 = *reinterpret_cast<const float4*>(Us + rw * kCols + ch + 4);
    const float uu[kHalf] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
    for (int c = 0; c < kHalf; ++c) x[c] = drop ? 0.f : gp * (x[c] - y[c]) + (ch + c < nc ? uu[c] : 0.f);
    __syncthreads();  // everyone is done reading P_p, U_u and X
    publish();
    pending = fstore;
  };

  publish();
  if (FWD) {
    if (dir == 0) {  // Mf: frames 0 .. F−1
      for (int f = 0; f < F; ++f) step(f, f, f);
    } else {  // Mr: frames F−1 .. 0
      pending = F - 1;  // zeros
      for (int f = F - 2; f >= 0; --f) step(f + 1, f + 1, f);
    }
  } else {
    if (dir == 0) {  // G: frames F−1 .. 0
      set_u(F - 1);
      publish();
      pending = F - 1;
      for (int f = F - 2; f >= 0; --f) step(f + 1, f, f);
    } else {  // G̃' (slot f holds G̃_{f−1}): slots 0 .. F−1
      pending = 0;  // zeros
      if (F > 1) {
        flush();
        set_u(0);
        publish();
        pending = 1;
        for (int f = 1; f + 1 < F; ++f) step(f, f, f + 1);
      }
    }
  }
  flush();

  if (FWD) {  // Msum = Mf + Mr: the two directions of the cluster split the frames
    __threadfence();
    cg::this_cluster().sync();
    const float* a = (isz ? zout0 : out0) + bh * F * mstride;
    const float* bb = (isz ? zout1 : out1) + bh * F * mstride;
    float* sum = (isz ? zsum : msum) + bh * F * mstride;
    for (int f = dir; f < F; f += 2)
      for (int e = tid; e < slice; e += kScanThreads) {
        const int i = slice_row(e), c = slice_col(e);
        if (c >= nc) continue;
        const int64_t o = at(f, i, c);
        sum[o] = __ldcg(a + o) + __ldcg(bb + o);
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

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
  const size_t smem = scan_smem_bytes(D);
  // Without a mask the kernels are compiled without the clip tests (Note [clips are a template]).
  const float* clip = f32_or_null(clip_starts, "clip_starts");
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
                                      f32_or_null(P, "P"), f32_or_null(A, "A"), f32_or_null(Pz, "Pz"),
                                      f32_or_null(bz, "bz"), in_of(decay, "decay"),
                                      clip, static_cast<int>(d.H), D, F, ncb));
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
  const int H = static_cast<int>(d.H);
  const size_t smem = scan_smem_bytes(D);
  auto* kernel = clip ? scan_kernel<false, true> : scan_kernel<false, false>;
  allow_smem(kernel, smem);
  const dim3 grid(2, static_cast<unsigned>(ncb + 1), static_cast<unsigned>(BH));
  kernel<<<grid, kScanThreads, smem, stream()>>>(
      f32_out(G, "G"), f32_out(Gt, "Gt"), f32_out(gz, "gz"), f32_out(gzt, "gzt"), nullptr, nullptr, f32_or_null(P, "P"),
      f32_or_null(dMsum, "dMsum"), f32_or_null(Pz, "Pz"), f32_or_null(dzsum, "dzsum"), dec, clip, H, D, F, ncb);
  GDNCP_CUDA_CHECK_LAUNCH("scan_kernel<false>");
  // Z_f into dP's storage: Z_j = G̃'_j Mr_jᵀ over all frames j = bh·F + f, then Z_j += G_j Mf_{j−1}ᵀ
  // for j ≥ 1 (at f = 0 that mixes in the previous (b, h)'s last frame: scan_grads_kernel reads
  // Z as 0 there).
  const int64_t N = checked_mul(BH, d.F, "cuda scan: B·H·F");
  GDNCP_CHECK(N <= INT32_MAX, "cuda scan: B·H·F = ", N, " exceeds cuBLAS's 32-bit batch count");
  const auto f32_in = [](const Tensor& t, const char* what) {
    require_f32(t, what);
    return static_cast<const float*>(t.data());
  };
  float *dp = f32_out(dP, "dP"), *da = f32_out(dA, "dA"), *dpz = f32_out(dPz, "dPz"), *db = f32_out(dbz, "dbz");
  const Out dg = out_of(ddecay, "ddecay");
  const float *mf = f32_in(Mf, "Mf"), *mr = f32_in(Mr, "Mr"), *p = f32_in(P, "P"), *pz = f32_in(Pz, "Pz");
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
