// src/cp/scan/comm_stream.cpp — Note [hidden exchange] (comm_stream.h).
#include "cp/scan/comm_stream.h"

#include <map>

#include "autograd/device.h"
#include "gdncp/error.h"
#include "gdncp/tensor.h"

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace gdncp {
namespace cp {
namespace detail {

#if GDNCP_WITH_CUDA
namespace {

// The thread's communication stream on one device and the two events of a fork and a join. An
// event is reused at once: a wait binds to the record made before it.
struct Lane {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

struct Lanes {
  std::map<int, Lane> by_device;
  ~Lanes() {  // at thread exit; errors are moot there
    for (auto& kv : by_device) {
      cudaEventDestroy(kv.second.fork);
      cudaEventDestroy(kv.second.join);
      cudaStreamDestroy(kv.second.stream);
    }
  }
};

Lane& lane() {
  thread_local Lanes lanes;
  const int dev = gdncp::detail::current_device();
  auto it = lanes.by_device.find(dev);
  if (it != lanes.by_device.end()) return it->second;
  Lane l;
  int least = 0, greatest = 0;
  GDNCP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  GDNCP_CUDA_CHECK(cudaStreamCreateWithPriority(&l.stream, cudaStreamNonBlocking, greatest));
  GDNCP_CUDA_CHECK(cudaEventCreateWithFlags(&l.fork, cudaEventDisableTiming));
  GDNCP_CUDA_CHECK(cudaEventCreateWithFlags(&l.join, cudaEventDisableTiming));
  return lanes.by_device.emplace(dev, l).first->second;
}

cudaStream_t current() { return static_cast<cudaStream_t>(current_stream()); }

}  // namespace

void CommStream::issue(const std::function<void()>& collective) {
  if (!on_) return collective();
  Lane& l = lane();
  GDNCP_CUDA_CHECK(cudaEventRecord(l.fork, current()));
  GDNCP_CUDA_CHECK(cudaStreamWaitEvent(l.stream, l.fork, 0));
  pending_ = true;
  StreamGuard on_lane(l.stream);
  collective();
}

void CommStream::join() {
  if (!pending_) return;
  pending_ = false;
  Lane& l = lane();
  GDNCP_CUDA_CHECK(cudaEventRecord(l.join, l.stream));
  GDNCP_CUDA_CHECK(cudaStreamWaitEvent(current(), l.join, 0));
}

CommStream::~CommStream() {
  if (!pending_) return;
  try {
    join();
  } catch (...) {  // an error is already unwinding: the device reports it again at the next check
  }
}

#else  // no CUDA in this build: CUDA tensors cannot exist, the collective runs in place

void CommStream::issue(const std::function<void()>& collective) { collective(); }
void CommStream::join() {}
CommStream::~CommStream() = default;

#endif

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
