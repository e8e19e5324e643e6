// src/cp/comm/call_header.cu — writes a call header into device memory on a
// stream (Note [NCCL call headers] in comm_nccl.cpp): the header travels as
// the kernel's argument, so the host keeps no buffer alive for it and a
// captured graph holds it as it was.
#include <cuda_runtime.h>

#include "cp/comm/collective_header.h"

namespace gdncp {
namespace cp {
namespace detail {
namespace {

constexpr int kWords = sizeof(CollectiveHeader) / sizeof(int64_t);

__global__ void write_header_kernel(CollectiveHeader h, int64_t* dst) {
  const int i = threadIdx.x;
  if (i < kWords) dst[i] = reinterpret_cast<const int64_t*>(&h)[i];
}

}  // namespace

cudaError_t write_header(void* dst, const CollectiveHeader& h, cudaStream_t stream) {
  write_header_kernel<<<1, kWords, 0, stream>>>(h, static_cast<int64_t*>(dst));
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
