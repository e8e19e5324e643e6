// src/kernels/phase_a/phase_a_cuda.cuh — what the two CUDA codings of phase A share: the
// block size, the f32 forward's product map, the launch arguments and the typed launchers of
// phase_a_f32.cu (f32 tiles, per-pair loads, every matrix-unit mode) and phase_a_bf16.cu
// (bf16 mode only: a prep kernel and cuBLAS products forward; bf16 tiles read with ldmatrix
// and staged loads backward). phase_a.cu picks.
#pragma once

#include "kernels/common/cuda_common.cuh"

namespace gdncp {
namespace cuda {
namespace phase_a {

constexpr int kThreads = 256;

// The product a forward block of phase_a_f32.cu owns: 0 → P, 1 → A, 2 → Pz.
__device__ __forceinline__ float* P_or(int prod, float* P, float* A, float* Pz) {
  return prod == 0 ? P : prod == 1 ? A : Pz;
}

// The arguments of phase_a_fwd (kernels.h) as the kernels see them.
struct FwdArgs {
  detail::FrameSizes z;
  float *P, *A, *Pz, *bz;
  detail::In qkv, beta;
  const float *rstd, *kw, *cos, *sin;
  float k_scale;
};
// Phase A's backward at one token and one channel pair (phase_a.cu has the formulas), from
// that pair of x1 = kʳ Ps, x2 = v dAᵀ, x3 = kʳ dA, x4 = k⁺ Pzs and of db: the pair's part of dβ,
__device__ __forceinline__ float dbeta_pair(float2 kr, float2 kp, float2 x1, float2 x2, float2 x4, float2 db) {
  return kr.x * (0.5f * x1.x + x2.x) + kr.y * (0.5f * x1.y + x2.y) + kp.x * (0.5f * x4.x + db.x) +
         kp.y * (0.5f * x4.y + db.y);
}
// and its dk̂ (unrope, relu mask, k_scale) and dv = β x3, stored at k_at of dk_hat and v_at of dqkv.
__device__ __forceinline__ void store_k_grads(const detail::Out& dk_hat, const detail::Out& dqkv, int64_t k_at,
                                              int64_t v_at, float bt, float2 x1, float2 x2, float2 x3, float2 x4,
                                              float2 db, float2 kp, float2 c, float2 sn, float k_scale) {
  const float dkr0 = bt * (x1.x + x2.x), dkr1 = bt * (x1.y + x2.y);
  const float dkp0 = bt * (x4.x + db.x) + dkr0 * c.x + dkr1 * sn.y;
  const float dkp1 = bt * (x4.y + db.y) + dkr1 * c.y + dkr0 * sn.x;
  dk_hat.set_pair(k_at, kp.x != 0.f ? dkp0 * k_scale : 0.f, kp.y != 0.f ? dkp1 * k_scale : 0.f);
  dqkv.set_pair(v_at, bt * x3.x, bt * x3.y);
}

// The arguments of phase_a_bwd (kernels.h) as the kernels see them.
struct BwdArgs {
  detail::FrameSizes z;
  detail::Out dk_hat, dqkv, dbeta;
  const float *dP, *dA, *dPz, *dbz;
  detail::In qkv, beta;
  const float *rstd, *kw, *cos, *sin;
  float k_scale;
};

// The bf16 coding runs bf16 mode at a padded head dim of 64 or 128 with bf16 qkv and
// D % 8 == 0 (Note [staged loads]); the f32 coding runs everything else.
inline bool bf16_coding(MathMode mode, int64_t D, DType qkv) {
  return mode == MathMode::bf16 && padded_dim(D) >= 64 && qkv == DType::bf16 && D % 8 == 0;
}

void fwd_f32(const FwdArgs& a, MathMode mode);  // phase_a_f32.cu
void bwd_f32(const BwdArgs& a, MathMode mode);
void fwd_bf16(const FwdArgs& a);  // phase_a_bf16.cu
void bwd_bf16(const BwdArgs& a);

}  // namespace phase_a
}  // namespace cuda
}  // namespace gdncp
