// src/cp/comm/comm_callbacks.cpp — the communicator whose collectives the caller
// runs (make_callback_communicator, gdncp/cp.h): every collective the library
// needs is built from the caller's all_gather and broadcast.
//
// A failed callback aborts the communicator: the ranks may now be out of step
// (one finished the collective, another did not), so no later collective on
// it can be trusted. There is no watchdog: the caller's transport owns the
// deadline (gdncp/cp.h says what that means).
//
// Note [callback headers]: on the CPU each collective is preceded by an
// all-gather of the ranks' headers (Note [collective header],
// cp/comm/collective_header.h). Ranks in different collectives (e.g. one in a
// validation exchange the others skipped) then fail at once on every rank
// with a message naming both, instead of handing the transport mismatched
// sizes (gloo aborts the process on those). On CUDA the header would cost a
// host wait per collective (docs/design.md §10), so there is none.
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "autograd/tensor_math.h"
#include "cp/comm/collective_header.h"
#include "cp/validate_cp.h"
#include "gdncp/cp.h"
#include "gdncp/error.h"

namespace gdncp {
namespace cp {
namespace {

using Clock = std::chrono::steady_clock;

class CallbackCommunicator final : public Communicator {
 public:
  CallbackCommunicator(CollectiveCallbacks cb, int rank, int size, Device device)
      : cb_(std::move(cb)), rank_(rank), size_(size), device_(device) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  const char* backend() const override { return "callbacks"; }
  bool aborted() const override {
    std::lock_guard<std::mutex> lock(abort_mu_);
    return !reason_.empty();
  }
  std::string abort_reason() const override {
    std::lock_guard<std::mutex> lock(abort_mu_);
    return reason_;
  }

  void all_gather(Tensor& out, const Tensor& in) override {
    check_usable("all_gather");
    check_tensor(in, "all_gather: in");
    check_tensor(out, "all_gather: out");
    detail::check_all_gather_args(out, in, size_);
    gather(out.data(), in.data(), in.nbytes(), Kind::all_gather, false);
  }

  // All-gather, then the sum in rank order (as the MPI communicator does): the
  // same bits on every rank and in every run, whatever the caller's transport.
  void all_reduce_sum(Tensor& t) override {
    check_usable("all_reduce_sum");
    check_tensor(t, "all_reduce_sum: t");
    if (t.dtype() == DType::bf16) {  // summed in f32, rounded once
      Tensor f = t.to(DType::f32);
      all_reduce_sum(f);
      t.copy_from(f.to(DType::bf16));
      return;
    }
    const int64_t n = t.numel();
    Tensor all = Tensor::empty({static_cast<int64_t>(size_) * n}, t.dtype(), device_);
    gather(all.data(), t.data(), t.nbytes(), Kind::all_reduce_sum, false);
    Tensor acc = rank_slice(all, 0, t);
    for (int r = 1; r < size_; ++r) acc = gdncp::detail::add(acc, rank_slice(all, r, t));
    t.copy_from(acc);
  }

  void broadcast(Tensor& t, int root) override {
    check_usable("broadcast");
    check_tensor(t, "broadcast: t");
    GDNCP_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of a group of ", size_);
    agree(Kind::broadcast, t.nbytes());
    run("broadcast", t.nbytes(), false, [&] { return cb_.broadcast(t.data(), t.nbytes(), root, current_stream()); });
  }

  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    check_usable("send_recv");
    GDNCP_CHECK(cb_.send_recv, "send_recv: the callback communicator was made without a send_recv callback");
    GDNCP_CHECK(dst >= -1 && dst < size_, "send_recv: dst ", dst, " is not a rank (or -1)");
    GDNCP_CHECK(src >= -1 && src < size_, "send_recv: src ", src, " is not a rank (or -1)");
    if (dst >= 0) check_tensor(send, "send_recv: send");
    if (src >= 0) check_tensor(recv, "send_recv: recv");
    const size_t sb = dst >= 0 ? send.nbytes() : 0, rb = src >= 0 ? recv.nbytes() : 0;
    agree(Kind::send_recv, 0);  // the sizes differ per pair: only the kind is checked
    run("send_recv", sb, false, [&] {
      return cb_.send_recv(dst >= 0 ? send.data() : nullptr, sb, dst, src >= 0 ? recv.data() : nullptr, rb, src,
                           current_stream());
    });
  }

  void barrier() override {
    check_usable("barrier");
    unsigned char mine = 0;
    std::vector<unsigned char> all(static_cast<size_t>(size_));
    host_gather(all.data(), &mine, 1, Kind::barrier);
  }

  void all_gather_host(void* out, const void* in, size_t bytes) override {
    check_usable("all_gather_host");
    host_gather(out, in, bytes, Kind::all_gather_host);
  }

 private:
  void check_tensor(const Tensor& t, const char* what) const {
    GDNCP_CHECK(t.defined(), what, " is undefined");
    GDNCP_CHECK(t.device() == device_, what, " is on ", device_name(t.device()),
                " but the callback communicator takes ", device_name(device_), " tensors");
  }

  // Rank r's part of a gathered (size·n) tensor, as t's shape (a view).
  static Tensor rank_slice(Tensor& all, int r, const Tensor& t) {
    char* p = static_cast<char*>(all.data()) + static_cast<size_t>(r) * t.nbytes();
    Tensor keep = all;
    return Tensor::from_blob(p, t.shape(), t.dtype(), t.device(), [keep] {});
  }

  enum class Kind : int64_t { all_gather = 1, all_reduce_sum, broadcast, send_recv, barrier, all_gather_host };
  static const char* kind_name(int64_t k) {
    static const char* const names[] = {"?",         "all_gather", "all_reduce_sum", "broadcast",
                                        "send_recv", "barrier",    "all_gather_host"};
    return k >= 1 && k <= 6 ? names[k] : "an unknown collective";
  }
  // Note [callback headers]: every rank's header must agree with this rank's.
  void agree(Kind kind, size_t bytes) {
    if (device_ != Device::cpu) return;
    const int64_t k = static_cast<int64_t>(kind);
    const detail::CollectiveHeader mine = detail::make_header(k, kind_name(k), static_cast<int64_t>(bytes), seq_++, "");
    std::vector<detail::CollectiveHeader> all(static_cast<size_t>(size_));
    run(kind_name(k), 0, false, [&] { return cb_.all_gather(all.data(), &mine, sizeof mine, nullptr); });
    const std::string why = detail::header_verdict(all, {}, mine, rank_, size_, kind_name(k));
    if (why.empty()) return;
    abort_with(why);
    GDNCP_FAIL("the callback communicator: ", why);
  }

  // The caller's all_gather of `bytes` bytes per rank on device memory.
  void gather(void* out, const void* in, size_t bytes, Kind kind, bool host_wait) {
    agree(kind, bytes);
    run(kind_name(static_cast<int64_t>(kind)), bytes, host_wait,
        [&] { return cb_.all_gather(out, in, bytes, current_stream()); });
  }

  void abort_with(const std::string& why) {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (reason_.empty()) reason_ = why;
  }

  // An all_gather of host memory: direct on the CPU, staged through device
  // memory on CUDA (the host then waits for the result).
  void host_gather(void* out, const void* in, size_t bytes, Kind kind) {
    if (device_ == Device::cpu) {
      gather(out, in, bytes, kind, true);
      return;
    }
    // f32 words carry the bytes (Tensor has no byte dtype).
    const int64_t words = static_cast<int64_t>((bytes + 3) / 4);
    Tensor mine = Tensor::zeros({words}, DType::f32);
    if (bytes > 0) std::memcpy(mine.data(), in, bytes);
    Tensor dev_in = mine.to(device_), dev_out = Tensor::empty({size_ * words}, DType::f32, device_);
    gather(dev_out.data(), dev_in.data(), static_cast<size_t>(words) * 4, kind, true);
    const Tensor host = dev_out.to(Device::cpu);
    for (int r = 0; r < size_; ++r)
      std::memcpy(static_cast<char*>(out) + static_cast<size_t>(r) * bytes,
                  static_cast<const char*>(host.data()) + static_cast<size_t>(r * words) * 4, bytes);
  }

  // Runs one callback; its error aborts the communicator and throws.
  template <typename Call>
  void run(const char* what, size_t bytes, bool host_wait, Call call) {
    const auto start = Clock::now();
    std::string err;
    try {
      err = call();
    } catch (const std::exception& e) {
      err = std::string("the callback threw: ") + e.what();
    }
    if (!err.empty()) {
      abort_with(std::string(what) + " failed in the caller's callback: " + err);
      GDNCP_FAIL(what, ": the callback communicator's collective failed on rank ", rank_, " of ", size_, ": ", err);
    }
    detail::count_collective(stats_mu_, stats_, bytes, start, host_wait);
  }

  CollectiveCallbacks cb_;
  int rank_, size_;
  Device device_;
  mutable std::mutex abort_mu_;
  std::string reason_;  // "" while usable
  int64_t seq_ = 0;     // collectives issued (Note [callback headers])
};

}  // namespace

std::shared_ptr<Communicator> make_callback_communicator(CollectiveCallbacks callbacks, int rank, int size,
                                                         Device device) {
  const char* fn = "make_callback_communicator";
  GDNCP_CHECK(size >= 1, fn, ": size: must be >= 1, got ", size);
  GDNCP_CHECK(rank >= 0 && rank < size, fn, ": rank: must be in [0, ", size, "), got ", rank);
  GDNCP_CHECK(device == Device::cpu || device == Device::cuda, fn, ": device: must be cpu or cuda");
  GDNCP_CHECK(device == Device::cpu || cuda_available(), fn,
              ": device: cuda, but gdncp was built without CUDA or no device is visible");
  GDNCP_CHECK(static_cast<bool>(callbacks.all_gather), fn, ": callbacks.all_gather: is empty (required)");
  GDNCP_CHECK(static_cast<bool>(callbacks.broadcast), fn, ": callbacks.broadcast: is empty (required)");
  return std::make_shared<CallbackCommunicator>(std::move(callbacks), rank, size, device);
}

}  // namespace cp
}  // namespace gdncp
