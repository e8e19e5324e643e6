// src/autograd/graph.cpp — CUDA-graph capture and replay (gdncp/graph.h).
#include "gdncp/graph.h"

#include <exception>

#include "autograd/device.h"
#include "gdncp/error.h"
#include "gdncp/tensor.h"

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace gdncp {

#if GDNCP_WITH_CUDA

void CudaGraph::cancel_capture() {
  if (!capturing_) return;
  capturing_ = false;
  cudaGraph_t g = nullptr;
  cudaStreamEndCapture(static_cast<cudaStream_t>(stream_), &g);
  (void)cudaGetLastError();  // an invalidated capture reports its error here: already thrown
  if (g) cudaGraphDestroy(g);
  detail::end_pool_capture();
  set_current_stream(prev_stream_);
}

CudaGraph::~CudaGraph() {
  cancel_capture();
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  if (order_) cudaEventDestroy(static_cast<cudaEvent_t>(order_));
  // The pool's blocks return to the cache only after the last replay ran.
  if (stream_) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  if (pool_) detail::release_pool(pool_);
  if (own_stream_ && stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void CudaGraph::begin_capture(void* stream) {
  GDNCP_CHECK(!capturing_ && !exec_, "CudaGraph::begin_capture: this graph was already captured");
  if (!stream && !stream_) {
    cudaStream_t s = nullptr;
    GDNCP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = s;
    own_stream_ = true;
  } else if (stream) {
    stream_ = stream;
  }
  if (!order_) {
    cudaEvent_t e = nullptr;
    GDNCP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    order_ = e;
  }
  // The captured work reads what the current stream wrote before.
  prev_stream_ = current_stream();
  auto s = static_cast<cudaStream_t>(stream_);
  GDNCP_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(order_), static_cast<cudaStream_t>(prev_stream_)));
  GDNCP_CUDA_CHECK(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(order_), 0));
  pool_ = detail::begin_pool_capture();
  const cudaError_t err = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  if (err != cudaSuccess) {
    detail::end_pool_capture();
    GDNCP_CUDA_CHECK(err);
  }
  capturing_ = true;
  set_current_stream(stream_);
}

void CudaGraph::end_capture() {
  GDNCP_CHECK(capturing_, "CudaGraph::end_capture: no capture in progress");
  capturing_ = false;
  set_current_stream(prev_stream_);
  detail::end_pool_capture();
  cudaGraph_t g = nullptr;
  GDNCP_CUDA_CHECK(cudaStreamEndCapture(static_cast<cudaStream_t>(stream_), &g));
  graph_ = g;
  cudaGraphExec_t exec = nullptr;
  GDNCP_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  exec_ = exec;
}

void CudaGraph::replay() {
  GDNCP_CHECK(exec_ != nullptr, "CudaGraph::replay: nothing captured");
  auto s = static_cast<cudaStream_t>(stream_);
  auto cur = static_cast<cudaStream_t>(current_stream());
  auto e = static_cast<cudaEvent_t>(order_);
  GDNCP_CUDA_CHECK(cudaEventRecord(e, cur));
  GDNCP_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0));
  GDNCP_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), s));
  GDNCP_CUDA_CHECK(cudaEventRecord(e, s));
  GDNCP_CUDA_CHECK(cudaStreamWaitEvent(cur, e, 0));
}

int64_t CudaGraph::capture_mallocs() const { return pool_ ? detail::pool_capture_mallocs(pool_) : 0; }

#else  // no CUDA in this build

CudaGraph::~CudaGraph() = default;
void CudaGraph::begin_capture(void*) { GDNCP_FAIL("CudaGraph: gdncp was built without CUDA"); }
void CudaGraph::end_capture() { GDNCP_FAIL("CudaGraph: gdncp was built without CUDA"); }
void CudaGraph::replay() { GDNCP_FAIL("CudaGraph: gdncp was built without CUDA"); }
void CudaGraph::cancel_capture() {}
int64_t CudaGraph::capture_mallocs() const { return 0; }

#endif

CaptureGuard::~CaptureGuard() noexcept(false) {
  if (std::uncaught_exceptions() > 0)
    graph_.cancel_capture();
  else
    graph_.end_capture();
}

}  // namespace gdncp
