// bench/loopback_comm.h — stand-in peers for timing one rank of a CP group on
// one GPU (gdncp_bench --cp --emulate P). A benchmark tool, not a communicator
// for results: every collective hands this rank's own data back in the other
// ranks' places (an all-gather is P device copies of `in`), so the layer runs
// exactly the kernels that rank r of P runs — with the same sizes, the same
// batches and the same folds and corrections — on finite data that is not the
// other ranks' data. What it leaves out is the collectives' own time and the
// ranks' skew; a real P-GPU run adds those.
#pragma once

#include <cuda_runtime.h>

#include <cstring>

#include "gdncp/cp.h"
#include "gdncp/error.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace bench {

class LoopbackPeers final : public cp::Communicator {
 public:
  LoopbackPeers(int rank, int size) : rank_(rank), size_(size) {
    GDNCP_CHECK(size >= 1 && rank >= 0 && rank < size, "LoopbackPeers: rank ", rank, " of ", size);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda; }
  const char* backend() const override { return "loopback"; }
  bool aborted() const override { return false; }

  void all_gather(Tensor& out, const Tensor& in) override {
    GDNCP_CHECK(out.numel() == in.numel() * size_ && out.dtype() == in.dtype(), "LoopbackPeers::all_gather: sizes");
    for (int p = 0; p < size_; ++p)
      GDNCP_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out.data()) + p * in.nbytes(), in.data(), in.nbytes(),
                                       cudaMemcpyDeviceToDevice, stream()));
    count(in.nbytes());
  }
  // The sum of size() equal copies is not what timing needs: left as it is.
  void all_reduce_sum(Tensor& t) override { count(t.nbytes()); }
  void broadcast(Tensor& t, int) override { count(t.nbytes()); }
  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    if (src < 0) return;
    if (dst >= 0 && send.nbytes() == recv.nbytes())
      GDNCP_CUDA_CHECK(cudaMemcpyAsync(recv.data(), send.data(), send.nbytes(), cudaMemcpyDeviceToDevice, stream()));
    else
      GDNCP_CUDA_CHECK(cudaMemsetAsync(recv.data(), 0, recv.nbytes(), stream()));
    count(recv.nbytes());
  }
  void barrier() override {}
  void all_gather_host(void* out, const void* in, size_t bytes) override {
    for (int p = 0; p < size_; ++p) std::memcpy(static_cast<char*>(out) + p * bytes, in, bytes);
  }

 private:
  static cudaStream_t stream() { return static_cast<cudaStream_t>(current_stream()); }
  void count(size_t bytes) {
    stats_.calls += 1;
    stats_.bytes += static_cast<int64_t>(bytes);
  }
  int rank_, size_;
};

}  // namespace bench
}  // namespace gdncp
