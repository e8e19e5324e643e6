// src/kernels/common/cublas_handle.h — the cuBLAS handle of the CUDA twins (matmul.cu
// defines it): one per (thread, device), bound to gdncp::current_stream() on
// every call, default math mode (no TF32: callers pick CUBLAS_COMPUTE_32F for
// f32 work).
#pragma once

#include <cublas_v2.h>

namespace gdncp {
namespace cuda {

cublasHandle_t cublas_handle();

}  // namespace cuda
}  // namespace gdncp
