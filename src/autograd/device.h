// src/autograd/device.h — internal device services of the tensor: the CUDA
// caching allocator, copies, and the few elementwise kernels Tensor itself needs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gdncp/tensor.h"

namespace gdncp {
namespace detail {

// Caching allocator (CUDA builds only; throws otherwise).
void* cuda_alloc(size_t nbytes, int* device_index);
void cuda_free(void* ptr);
// The calling thread's current CUDA device (0 without CUDA).
int current_device();

// Copies nbytes between any two devices; the copy is complete on return when
// the destination is the host (D2H waits for the current stream).
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes);

// Elementwise on device memory, on the current stream (tensor_kernels.cu).
void cuda_fill(void* dst, DType dtype, int64_t n, double value);
void cuda_cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n);
void cuda_add(void* out, const void* a, const void* b, DType dtype, int64_t n);

}  // namespace detail
}  // namespace gdncp
