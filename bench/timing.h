// bench/timing.h — the one timing loop of the benchmarks: CUDA events around
// each call on the current stream, the median over the calls.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "gdncp/error.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace bench {

// Median over iters of the device time of fn (ms), after warmup untimed calls.
inline double time_ms(const std::function<void()>& fn, int warmup, int iters) {
  const auto stream = static_cast<cudaStream_t>(current_stream());
  for (int i = 0; i < warmup; ++i) fn();
  GDNCP_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  GDNCP_CUDA_CHECK(cudaEventCreate(&a));
  GDNCP_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    GDNCP_CUDA_CHECK(cudaEventRecord(a, stream));
    fn();
    GDNCP_CUDA_CHECK(cudaEventRecord(b, stream));
    GDNCP_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    GDNCP_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  GDNCP_CUDA_CHECK(cudaEventDestroy(a));
  GDNCP_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace bench
}  // namespace gdncp
