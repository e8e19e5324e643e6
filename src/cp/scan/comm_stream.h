// src/cp/scan/comm_stream.h — the communication stream of the hidden exchange (Note [hidden exchange]).
//
// Note [hidden exchange]. With CpOptions::overlap_exchange, a CP scan issues its all-gather on a
// communication stream of the calling thread (one per device, of the highest priority, so that the
// collective's kernels are scheduled ahead of the sweeps that fill the device): an event orders it
// after the current stream's work so far (the composites), the collective is enqueued with that
// stream made current (the NCCL and callback backends and the bench's modeled links run on the
// current stream), and meanwhile the current stream runs the sweeps the collective does not read —
// forward the cumulative products Wcum whose last product M does not travel (Note [which
// composites travel]), backward the cumulative products Rcum of the adjoint (none for a job that
// rescans from X0, Note [rescan] in scan_engine.cpp: a bidirectional call at P = 2 has nothing to
// run beside its exchange). At P > 2 every Wcum
// of the forward feeds a travelling M, so the forward composites travel in two all-gathers
// instead: the first half of the jobs' (a bidirectional call's forward direction) while the
// second half is swept (forward_parts in scan_engine.cpp; the gathered buffer holds the same
// elements in another order, which a checkpoint recompute and the backward read alike). join()
// makes the current stream wait for the collectives before the folds read them. Events and stream waits only:
// no host wait, and a CUDA graph captures the fork and the join. The sweeps are the same sweeps in
// two batches instead of one, so the results are bitwise those without overlap.
// The caching allocator is stream-ordered on one stream (Note [caching allocator]): the
// communication stream touches only the pack and the gathered buffer, which stay alive until the
// current stream has waited for it (the destructor joins, also when an error unwinds); a
// collective issued here must not allocate device memory (none of the backends' does).
// CPU tensors (MPI) run the collective where it is issued: only the order of the batches changes.
#pragma once

#include <functional>

namespace gdncp {
namespace cp {
namespace detail {

class CommStream {
 public:
  // on: the tensors are CUDA tensors and the caller asks for overlap; off: issue() runs in place.
  explicit CommStream(bool on) : on_(on) {}
  ~CommStream();
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;
  // Runs collective (which enqueues on the current stream) on the communication stream, after
  // the current stream's work so far.
  void issue(const std::function<void()>& collective);
  // The current stream waits for everything issued (no-op when nothing is pending).
  void join();

 private:
  bool on_ = false;
  bool pending_ = false;
};

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
