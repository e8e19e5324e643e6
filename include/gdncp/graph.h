// gdncp/graph.h — capturing a step (forward + backward, optimizer, CP
// collectives) on a stream into a CUDA graph and replaying it
// (docs/design.md §10).
//
//   CudaGraph graph;
//   step();                      // eager warm-up: fills the allocator's cache,
//                                // creates the cuBLAS handle, connects NCCL and
//                                // validates the CP calls (Validation::on_change)
//   { CaptureGuard capture(graph);  out = step(); }   // captured, not run
//   graph.replay();              // runs the step; `out` holds its result
//
// Between begin_capture() and end_capture() the calling thread's current
// stream is the graph's stream and every gdncp call on it is recorded, not
// run. Allocations then come from a private pool of the caching allocator
// that the graph keeps for its replays: tensors made during the capture (the
// step's outputs and gradients) live at the addresses every replay writes,
// and blocks freed during it are not handed to anyone else while the graph
// lives. Inputs and parameters made before the capture are read at their
// addresses: keep them alive and overwrite them in place between replays.
// Each replay equals the eager step bitwise (the same kernels on the same
// addresses). Nothing in a captured step may wait for the device (a copy to
// the host, a validation exchange): it throws gdncp::Error. Collectives
// captured on an NCCL communicator are replayed with the graph; call
// Communicator::watch() after replay() to put them under the deadline.
// CUDA builds only (the calls throw otherwise).
#pragma once

#include <cstdint>

namespace gdncp {

class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Starts capturing the calling thread's work on stream (a cudaStream_t;
  // nullptr: a non-blocking stream of the graph's own — the legacy default
  // stream cannot be captured). The stream is made current until end_capture().
  void begin_capture(void* stream = nullptr);
  // Ends the capture and instantiates the graph; restores the current stream.
  void end_capture();
  // Ends a capture that an error interrupted, keeping no graph (the graph
  // can be captured again).
  void cancel_capture();
  // Enqueues one replay on the graph's stream (asynchronous, like a kernel),
  // ordered after the current stream's work and before its later work.
  void replay();
  bool captured() const { return exec_ != nullptr; }
  void* stream() const { return stream_; }
  // cudaMallocs the capture needed because the cache had no fitting block
  // (0 after an eager warm-up of the same step).
  int64_t capture_mallocs() const;

 private:
  void* stream_ = nullptr;
  bool own_stream_ = false;
  void* prev_stream_ = nullptr;
  void* graph_ = nullptr;  // cudaGraph_t
  void* exec_ = nullptr;   // cudaGraphExec_t
  void* order_ = nullptr;  // cudaEvent_t
  int64_t pool_ = 0;
  bool capturing_ = false;
};

// begin_capture() in the constructor, end_capture() in the destructor
// (cancel_capture() when an exception is unwinding through it).
class CaptureGuard {
 public:
  explicit CaptureGuard(CudaGraph& graph, void* stream = nullptr) : graph_(graph) { graph_.begin_capture(stream); }
  ~CaptureGuard() noexcept(false);
  CaptureGuard(const CaptureGuard&) = delete;
  CaptureGuard& operator=(const CaptureGuard&) = delete;

 private:
  CudaGraph& graph_;
};

}  // namespace gdncp
