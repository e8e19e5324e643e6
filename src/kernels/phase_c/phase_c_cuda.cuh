// src/kernels/phase_c/phase_c_cuda.cuh — what the two CUDA codings of phase C share: the block
// size, the launch arguments and the typed launchers of phase_c_f32.cu (f32 tiles: tf32 and
// ieee modes) and phase_c_bf16.cu (bf16 tiles read with ldmatrix: bf16 mode). phase_c.cu
// picks.
#pragma once

#include "kernels/common/cuda_common.cuh"

namespace gdncp {
namespace cuda {
namespace phase_c {

constexpr int kThreads = 256;

// The arguments of phase_c_fwd (kernels.h) as the kernels see them.
struct FwdArgs {
  detail::FrameSizes z;
  detail::Out out;
  float* den;
  detail::In qkv;
  const float *rstd, *qw, *cos, *sin, *M, *z_f;
  float eps;
  bool divide;
};
// The arguments of phase_c_bwd (kernels.h) as the kernels see them.
struct BwdArgs {
  detail::FrameSizes z;
  detail::Out dq_hat;
  float *dM, *dz;
  detail::In dout, dden, qkv;
  const float *rstd, *qw, *cos, *sin, *M, *z_f;
  float eps;
  bool divide;
};

void fwd_f32(const FwdArgs& a, MathMode mode);  // phase_c_f32.cu: tf32, ieee
void bwd_f32(const BwdArgs& a, MathMode mode);
void fwd_bf16(const FwdArgs& a);  // phase_c_bf16.cu: bf16
void bwd_bf16(const BwdArgs& a);

}  // namespace phase_c
}  // namespace cuda
}  // namespace gdncp
