// bench/loopback_comm.h — stand-in peers for timing one rank of a CP group on
// one GPU (gdncp_bench --cp --emulate P). A benchmark tool, not a communicator
// for results: every collective hands this rank's own data back in the other
// ranks' places (an all-gather is P device copies of `in`), so the layer runs
// exactly the kernels that rank r of P runs — with the same sizes, the same
// batches and the same folds and corrections — on finite data that is not the
// other ranks' data. What it leaves out is the collectives' own time and the
// ranks' skew; a real P-GPU run adds those.
//
// With a LinkModel (modeled_link.h) every collective runs on a communication
// stream: it waits for the data on the compute stream, occupies the
// communication stream for the modeled time of its link, copies, and the
// compute stream waits for it — the collectives' modeled time (and any overlap
// the layer allows) then is in the rank's measured time. Stats::seconds sums the
// modeled times. The ranks' skew is still left out. With CpOptions::overlap_exchange the
// current stream of a collective is the scan's own communication stream (Note [hidden exchange]
// in src/cp/scan/comm_stream.h), so the modeled time runs beside the sweeps the exchange does
// not read, as a real link's would.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gdncp/cp.h"
#include "gdncp/error.h"
#include "gdncp/tensor.h"
#include "modeled_link.h"

namespace gdncp {
namespace bench {

class LoopbackPeers final : public cp::Communicator {
 public:
  LoopbackPeers(int rank, int size, const LinkModel& model = LinkModel()) : rank_(rank), size_(size), model_(model) {
    GDNCP_CHECK(size >= 1 && rank >= 0 && rank < size, "LoopbackPeers: rank ", rank, " of ", size);
    GDNCP_CHECK(model.node >= 1, "LoopbackPeers: node size ", model.node);
    if (model_.on()) {
      GDNCP_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
      GDNCP_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      GDNCP_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    }
  }
  ~LoopbackPeers() override {
    if (!model_.on()) return;
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
    cudaStreamDestroy(comm_stream_);
  }
  LoopbackPeers(const LoopbackPeers&) = delete;
  LoopbackPeers& operator=(const LoopbackPeers&) = delete;
  // The modeled nodes (CpOptions::node_size 0 then finds them, as MPI's split would).
  int node_size() const override { return size_ % model_.node == 0 ? model_.node : 0; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda; }
  const char* backend() const override { return "loopback"; }
  bool aborted() const override { return false; }

  void all_gather(Tensor& out, const Tensor& in) override {
    GDNCP_CHECK(out.numel() == in.numel() * size_ && out.dtype() == in.dtype(), "LoopbackPeers::all_gather: sizes");
    const Link& l = size_ <= model_.node ? model_.intra : model_.inter;
    cudaStream_t s = begin(l.alpha_s + (size_ - 1) * seconds(in.nbytes(), l));
    for (int p = 0; p < size_; ++p)
      GDNCP_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out.data()) + p * in.nbytes(), in.data(), in.nbytes(),
                                       cudaMemcpyDeviceToDevice, s));
    end();
    count(in.nbytes());
  }
  // The sum of size() equal copies is not what timing needs: left as it is.
  void all_reduce_sum(Tensor& t) override {
    begin(tree_seconds(t.nbytes()));
    end();
    count(t.nbytes());
  }
  void broadcast(Tensor& t, int) override {
    begin(tree_seconds(t.nbytes()));
    end();
    count(t.nbytes());
  }
  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    std::vector<Transfer> ts(1);
    ts[0] = Transfer{send, dst, recv, src};
    send_recv_group(ts);
  }
  // The transfers at once over full-duplex links: the slowest one's modeled time.
  void send_recv_group(std::vector<Transfer>& ts) override {
    double t = 0;
    size_t total = 0;
    for (const Transfer& x : ts) {
      if (x.src < 0 && x.dst < 0) continue;
      const bool far = (x.dst >= 0 && x.dst / model_.node != rank_ / model_.node) ||
                       (x.src >= 0 && x.src / model_.node != rank_ / model_.node);
      const Link& l = far ? model_.inter : model_.intra;
      const size_t bytes = std::max(x.dst >= 0 ? x.send.nbytes() : 0, x.src >= 0 ? x.recv.nbytes() : 0);
      t = std::max(t, l.alpha_s + seconds(bytes, l));
      total += bytes;
    }
    if (total == 0) return;
    cudaStream_t s = begin(t);
    for (Transfer& x : ts) {
      if (x.src < 0) continue;
      if (x.dst >= 0 && x.send.nbytes() == x.recv.nbytes())
        GDNCP_CUDA_CHECK(cudaMemcpyAsync(x.recv.data(), x.send.data(), x.send.nbytes(), cudaMemcpyDeviceToDevice, s));
      else
        GDNCP_CUDA_CHECK(cudaMemsetAsync(x.recv.data(), 0, x.recv.nbytes(), s));
    }
    end();
    count(total);
  }
  void barrier() override {}
  void all_gather_host(void* out, const void* in, size_t bytes) override {
    for (int p = 0; p < size_; ++p) std::memcpy(static_cast<char*>(out) + p * bytes, in, bytes);
  }

 private:
  static cudaStream_t stream() { return static_cast<cudaStream_t>(current_stream()); }
  static double seconds(size_t bytes, const Link& l) { return l.beta_Bps > 0 ? bytes / l.beta_Bps : 0.0; }
  // ⌈log₂P⌉ latencies and twice the bytes over the slowest link the group spans.
  double tree_seconds(size_t bytes) const {
    const Link& l = size_ <= model_.node ? model_.intra : model_.inter;
    return std::ceil(std::log2(static_cast<double>(size_))) * l.alpha_s + 2 * seconds(bytes, l);
  }
  // The stream a collective's copies go on: with a model, the communication stream after the
  // compute stream's work so far and `t` seconds of modeled link time.
  cudaStream_t begin(double t) {
    if (!model_.on()) return stream();
    GDNCP_CUDA_CHECK(cudaEventRecord(ready_, stream()));
    GDNCP_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ready_, 0));
    link_delay(comm_stream_, t);
    stats_.seconds += t;
    return comm_stream_;
  }
  // The compute stream waits for the collective.
  void end() {
    if (!model_.on()) return;
    GDNCP_CUDA_CHECK(cudaEventRecord(done_, comm_stream_));
    GDNCP_CUDA_CHECK(cudaStreamWaitEvent(stream(), done_, 0));
  }
  void count(size_t bytes) {
    stats_.calls += 1;
    stats_.bytes += static_cast<int64_t>(bytes);
  }
  int rank_, size_;
  LinkModel model_;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
};

}  // namespace bench
}  // namespace gdncp
