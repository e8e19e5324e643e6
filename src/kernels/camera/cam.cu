// src/kernels/camera/cam.cu — CUDA twins of the camera-branch kernels (cam_ref.cpp), f32
// arithmetic, bf16 or f32 storage of q, k, v, beta and of their gradients.
//
//   pa_fwd_kernel    one block per (b·h, frame): Pc, Ac = Σ_s (β k) kᵀ, (β k) vᵀ (Note [outer tiles])
//   tok_kernel       one block per (16 tokens, frame, b·h), one thread per row (Note [row threads]):
//                    out = Mᵀ q | dq = M dout | the phase-A backward of dk, dv, dβ
//   beta_frame_kernel  per-frame β: dβ_f = Σ_s dβ_s in token order.
//   dm_kernel        dM = Σ_s q_s dout_sᵀ per (b·h, frame) (Note [outer tiles]).
// Gradient rule: every output overwritten. No atomics.
#include "kernels/common/cp_cuda.cuh"
#include "kernels/common/cuda_common.cuh"
#include "kernels/cp_kernels.h"

namespace gdncp {
namespace cp {
namespace cuda {
namespace {

using namespace dev;

constexpr int kTok = 16;           // tokens per block of tok_kernel
constexpr int kBetaThreads = 128;  // frames per block of beta_frame_kernel (one thread a frame)

struct Geo {
  int D = 0, F = 0, S = 0;
  int64_t N = 0;
  bool beta_per_frame = false;
};

__device__ __forceinline__ float beta_at(const InPlain& beta, const Geo& g, int64_t bh, int f, int s) {
  return g.beta_per_frame ? beta[bh * g.F + f] : beta[(bh * g.F + f) * g.S + s];
}

// Pc (which = 0) or Ac (which = 1) of frame (bh, f).
__global__ void __launch_bounds__(kOuterThreads)
    pa_fwd_kernel(float* out, InPlain k, InPlain v, InPlain beta, Geo g, int which) {
  __shared__ float Ls[kChunk * kOuterPitch];
  __shared__ float Rs[kChunk * kOuterPitch];
  const int64_t bt = blockIdx.x, bh = bt / g.F;
  const int f = static_cast<int>(bt % g.F);
  const int64_t xb = bh * g.D * g.N + static_cast<int64_t>(f) * g.S;
  const InPlain r = which ? v : k;
  float acc[8][8];
  outer_tile(
      acc, [&](int i, int s) { return beta_at(beta, g, bh, f, s) * k[xb + static_cast<int64_t>(i) * g.N + s]; },
      [&](int j, int s) { return r[xb + static_cast<int64_t>(j) * g.N + s]; }, g.D, g.S, Ls, Rs);
  store_outer_tile(out + bt * g.D * g.D, acc, g.D);
}

// dM = Σ_s q_s dout_sᵀ of frame (bh, f).
__global__ void __launch_bounds__(kOuterThreads) dm_kernel(float* dM, InPlain q, InPlain dout, Geo g) {
  __shared__ float Ls[kChunk * kOuterPitch];
  __shared__ float Rs[kChunk * kOuterPitch];
  const int64_t bt = blockIdx.x, bh = bt / g.F;
  const int f = static_cast<int>(bt % g.F);
  const int64_t xb = bh * g.D * g.N + static_cast<int64_t>(f) * g.S;
  float acc[8][8];
  outer_tile(
      acc, [&](int i, int s) { return q[xb + static_cast<int64_t>(i) * g.N + s]; },
      [&](int j, int s) { return dout[xb + static_cast<int64_t>(j) * g.N + s]; }, g.D, g.S, Ls, Rs);
  store_outer_tile(dM + bt * g.D * g.D, acc, g.D);
}

enum class TokMode { out, dq, pa_bwd };

struct TokArgs {
  Geo g;
  const float* M = nullptr;   // out / dq: the state (BH, F, D, D); pa_bwd: dPc
  const float* M2 = nullptr;  // pa_bwd: dAc
  InPlain x;                  // out: q; dq: dout; pa_bwd: k
  InPlain x2;                 // pa_bwd: v
  InPlain beta;
  Out o;                      // out: out; dq: dq; pa_bwd: dk
  Out o2;                     // pa_bwd: dv
  Out ob;                     // pa_bwd, per-token β: dbeta
  float* beta_tok = nullptr;  // pa_bwd, per-frame β: dβ_s per token (BH, N)
};

// Loads the token block [s0, s0 + kTok) of frame f of x (B·H, D, N) into Ys[D][kTok].
__device__ __forceinline__ void load_tokens(float* Ys, const InPlain& x, const Geo& g, int64_t bh, int f, int s0) {
  for (int idx = threadIdx.x; idx < g.D * kTok; idx += blockDim.x) {
    const int j = idx / kTok, c = idx % kTok;
    const int s = s0 + c;
    Ys[j * kTok + c] = s < g.S ? x[(bh * g.D + j) * g.N + static_cast<int64_t>(f) * g.S + s] : 0.f;
  }
}

template <TokMode MODE>
__global__ void __launch_bounds__(kRowThreads) tok_kernel(TokArgs a) {
  __shared__ float Ps[kRowThreads * kPitch];
  __shared__ __align__(16) float Yk[kRowThreads * kTok];
  __shared__ __align__(16) float Yv[kRowThreads * kTok];
  const Geo& g = a.g;
  const int s0 = blockIdx.x * kTok, f = blockIdx.y, i = threadIdx.x;
  const int64_t bh = blockIdx.z, bt = bh * g.F + f, DD = static_cast<int64_t>(g.D) * g.D;
  const bool row = i < g.D;
  const int64_t at = (bh * g.D + i) * g.N + static_cast<int64_t>(f) * g.S + s0;  // (bh, i, f·S + s0)
  const int nc = min(kTok, g.S - s0);
  load_tokens(Yk, a.x, g, bh, f, s0);
  float acc[kTok];
  if constexpr (MODE == TokMode::out || MODE == TokMode::dq) {
    apply_mat<kTok>(acc, a.M + bt * DD, MODE == TokMode::out, Yk, Ps, g.D, i);
    if (row)
      for (int c = 0; c < nc; ++c) a.o.set(at + c, acc[c]);
  } else {
    load_tokens(Yv, a.x2, g, bh, f, s0);
    float a1[kTok], a2[kTok], b1[kTok], b2[kTok];
    apply_mat<kTok>(a1, a.M + bt * DD, false, Yk, Ps, g.D, i);   // dPc k
    apply_mat<kTok>(a2, a.M + bt * DD, true, Yk, Ps, g.D, i);    // dPcᵀ k
    apply_mat<kTok>(b1, a.M2 + bt * DD, false, Yv, Ps, g.D, i);  // dAc v
    apply_mat<kTok>(b2, a.M2 + bt * DD, true, Yk, Ps, g.D, i);   // dAcᵀ k
    // dβ_s = Σ_i k_i (dPc k + dAc v)_i: per-row parts, summed over rows in order.
    __shared__ float part[kRowThreads * kTok];
#pragma unroll
    for (int c = 0; c < kTok; ++c) part[i * kTok + c] = row ? Yk[i * kTok + c] * (a1[c] + b1[c]) : 0.f;
    if (row)
      for (int c = 0; c < nc; ++c) {
        const float be = beta_at(a.beta, g, bh, f, s0 + c);
        a.o.set(at + c, be * (a1[c] + a2[c] + b1[c]));
        a.o2.set(at + c, be * b2[c]);
      }
    __syncthreads();
    if (i < nc) {
      float sum = 0.f;
      for (int r = 0; r < g.D; ++r) sum += part[r * kTok + i];
      const int64_t n = static_cast<int64_t>(f) * g.S + s0 + i;
      if (g.beta_per_frame)
        a.beta_tok[bh * g.N + n] = sum;
      else
        a.ob.set(bt * g.S + s0 + i, sum);
    }
  }
}

// dβ_f = Σ_s dβ_s in token order (per-frame β).
__global__ void beta_frame_kernel(Out dbeta, const float* beta_tok, Geo g, int64_t BHF) {
  const int64_t bt = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bt >= BHF) return;
  const int64_t bh = bt / g.F;
  const int f = static_cast<int>(bt % g.F);
  float sum = 0.f;
  for (int s = 0; s < g.S; ++s) sum += beta_tok[bh * g.N + static_cast<int64_t>(f) * g.S + s];
  dbeta.set(bt, sum);
}

Geo geo_of(const CamDims& d) {
  GDNCP_CHECK(d.D >= 1 && d.D <= kRowThreads, "cp cuda camera: D = ", d.D, " must be in [1, ", kRowThreads, "]");
  Geo g;
  g.D = static_cast<int>(d.D);
  g.F = static_cast<int>(d.F);
  g.S = static_cast<int>(d.S);
  g.N = d.N();
  g.beta_per_frame = d.beta_per_frame;
  return g;
}

dim3 tok_grid(const CamDims& d) {
  return dim3(static_cast<unsigned>((d.S + kTok - 1) / kTok), static_cast<unsigned>(d.F),
              static_cast<unsigned>(d.BH()));
}

}  // namespace

void cam_phase_a_fwd(Tensor& Pc, Tensor& Ac, const Tensor& k, const Tensor& v, const Tensor& beta, const CamDims& d) {
  if (d.BH() * d.F == 0) return;  // a rank with no frame: nothing to launch
  const Geo g = geo_of(d);
  float* pc = f32_out_or_null(Pc, "Pc");
  float* ac = f32_out_or_null(Ac, "Ac");
  const InPlain ki = in_of<InPlain>(k, "k"), vi = in_of<InPlain>(v, "v"), bi = in_of<InPlain>(beta, "beta");
  const unsigned blocks = static_cast<unsigned>(d.BH() * d.F);
  pa_fwd_kernel<<<blocks, kOuterThreads, 0, stream()>>>(pc, ki, vi, bi, g, 0);
  GDNCP_CUDA_CHECK_LAUNCH("pa_fwd_kernel(Pc)");
  pa_fwd_kernel<<<blocks, kOuterThreads, 0, stream()>>>(ac, ki, vi, bi, g, 1);
  GDNCP_CUDA_CHECK_LAUNCH("pa_fwd_kernel(Ac)");
}

void cam_phase_a_bwd(Tensor& dk, Tensor& dv, Tensor& dbeta, const Tensor& dPc, const Tensor& dAc, const Tensor& k,
                     const Tensor& v, const Tensor& beta, const CamDims& d) {
  if (d.BH() * d.F == 0) return;  // a rank with no frame: nothing to launch
  TokArgs a;
  a.g = geo_of(d);
  a.M = f32_or_null(dPc, "dPc");
  a.M2 = f32_or_null(dAc, "dAc");
  a.x = in_of<InPlain>(k, "k");
  a.x2 = in_of<InPlain>(v, "v");
  a.beta = in_of<InPlain>(beta, "beta");
  a.o = out_of(dk, "dk");
  a.o2 = out_of(dv, "dv");
  a.ob = out_of(dbeta, "dbeta");
  Tensor tok;
  if (d.beta_per_frame) {
    tok = Tensor::empty({d.BH(), d.N()}, DType::f32, Device::cuda);
    a.beta_tok = static_cast<float*>(tok.data());
  }
  tok_kernel<TokMode::pa_bwd><<<tok_grid(d), kRowThreads, 0, stream()>>>(a);
  GDNCP_CUDA_CHECK_LAUNCH("tok_kernel(pa_bwd)");
  if (d.beta_per_frame) {
    const int64_t n = d.BH() * d.F;
    beta_frame_kernel<<<static_cast<unsigned>(cdiv(n, kBetaThreads)), kBetaThreads, 0, stream()>>>(a.ob, a.beta_tok,
                                                                                                   a.g, n);
    GDNCP_CUDA_CHECK_LAUNCH("beta_frame_kernel");
  }
}

void cam_out_fwd(Tensor& out, const Tensor& q, const Tensor& M, const CamDims& d) {
  if (d.BH() * d.F == 0) return;  // a rank with no frame: nothing to launch
  TokArgs a;
  a.g = geo_of(d);
  a.M = f32_or_null(M, "M");
  a.x = in_of<InPlain>(q, "q");
  a.o = out_of(out, "out");
  tok_kernel<TokMode::out><<<tok_grid(d), kRowThreads, 0, stream()>>>(a);
  GDNCP_CUDA_CHECK_LAUNCH("tok_kernel(out)");
}

void cam_out_bwd(Tensor& dq, Tensor& dM, const Tensor& dout, const Tensor& q, const Tensor& M, const CamDims& d) {
  if (d.BH() * d.F == 0) return;  // a rank with no frame: nothing to launch
  TokArgs a;
  a.g = geo_of(d);
  a.M = f32_or_null(M, "M");
  a.x = in_of<InPlain>(dout, "dout");
  a.o = out_of(dq, "dq");
  tok_kernel<TokMode::dq><<<tok_grid(d), kRowThreads, 0, stream()>>>(a);
  GDNCP_CUDA_CHECK_LAUNCH("tok_kernel(dq)");
  dm_kernel<<<static_cast<unsigned>(d.BH() * d.F), kOuterThreads, 0, stream()>>>(
      f32_out_or_null(dM, "dM"), in_of<InPlain>(q, "q"), in_of<InPlain>(dout, "dout"), a.g);
  GDNCP_CUDA_CHECK_LAUNCH("dm_kernel");
}

}  // namespace cuda
}  // namespace cp
}  // namespace gdncp
