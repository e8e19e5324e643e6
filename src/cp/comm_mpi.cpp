// src/cp/comm_mpi.cpp — the MPI communicator (CPU tensors) and the local-rank
// bootstrap shared with the NCCL communicator.
//
// Every collective is nonblocking (MPI_I*) and completed by polling MPI_Test
// against a deadline of timeout_seconds(). A collective that misses it marks
// the communicator aborted and throws; its request and buffers are parked (a
// nonblocking collective cannot be cancelled in MPI), so memory that MPI may
// still write stays alive, and the destructor gives parked requests one more
// timeout to complete. MPI has no per-communicator abort: an aborted
// communicator refuses every later call; ending the job is the caller's call.
#include <mpi.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "gdncp/cp.h"
#include "gdncp/error.h"

namespace gdncp {
namespace cp {

int local_rank(MPI_Comm comm) {
  MPI_Comm shared;
  GDNCP_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &shared));
  int local = 0;
  const int rc = MPI_Comm_rank(shared, &local);
  MPI_Comm_free(&shared);
  GDNCP_MPI_CHECK(rc);
  return local;
}

namespace {

bool mpi_usable() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) {
    GDNCP_CHECK(mpi_usable(), "make_mpi_communicator: MPI is not initialised (call MPI_Init first)");
    GDNCP_CHECK(comm != MPI_COMM_NULL, "make_mpi_communicator: comm is MPI_COMM_NULL");
    GDNCP_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
    GDNCP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    GDNCP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    GDNCP_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }

  ~MpiCommunicator() override {
    if (!mpi_usable()) return;
    // Give parked requests (from a timed-out collective) a last chance.
    const auto deadline = Clock::now() + seconds(timeout_seconds_);
    for (auto& p : parked_) {
      int done = 0;
      while (!done && Clock::now() < deadline) {
        if (MPI_Test(&p.request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
        if (!done) std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (!done) p.leaked = true;
    }
    bool any_leaked = false;
    for (auto& p : parked_) any_leaked |= p.leaked;
    // A communicator with a request still in flight must not be freed.
    if (!any_leaked) MPI_Comm_free(&comm_);
    for (auto& p : parked_)
      if (p.leaked) new std::vector<Tensor>(std::move(p.keep));  // MPI may still write: never free
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu; }
  bool aborted() const override { return aborted_; }
  const char* backend() const override { return "mpi"; }

  void all_gather(Tensor& out, const Tensor& in) override {
    check_usable("all_gather");
    check_cpu(in, "all_gather: in");
    check_cpu(out, "all_gather: out");
    GDNCP_CHECK(out.dtype() == in.dtype(), "all_gather: out dtype ", dtype_name(out.dtype()), " != in dtype ",
                dtype_name(in.dtype()));
    GDNCP_CHECK(out.numel() == in.numel() * size_, "all_gather: out has ", out.numel(), " elements, expected size()·",
                in.numel(), " = ", in.numel() * size_);
    const int count = checked_count(in.nbytes(), "all_gather");
    MPI_Request req;
    GDNCP_MPI_CHECK(MPI_Iallgather(in.data(), count, MPI_BYTE, out.data(), count, MPI_BYTE, comm_, &req));
    wait(req, "MPI_Iallgather", {in, out}, in.nbytes());
  }

  void all_reduce_sum(Tensor& t) override {
    check_usable("all_reduce_sum");
    check_cpu(t, "all_reduce_sum: t");
    if (t.dtype() == DType::bf16) {  // no MPI bf16 type: sum in f32, round once
      Tensor f = t.to(DType::f32);
      all_reduce_sum(f);
      t.copy_from(f.to(DType::bf16));
      return;
    }
    // Gather, then sum in rank order: the same bits on every rank and in every
    // run, whatever reduction algorithm MPI would pick.
    Tensor all = Tensor::empty({static_cast<int64_t>(size_) * t.numel()}, t.dtype());
    all_gather(all, t);
    if (t.dtype() == DType::f64)
      sum_ranks<double>(t, all);
    else
      sum_ranks<float>(t, all);
  }

  void broadcast(Tensor& t, int root) override {
    check_usable("broadcast");
    check_cpu(t, "broadcast: t");
    GDNCP_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of a group of ", size_);
    const int count = checked_count(t.nbytes(), "broadcast");
    MPI_Request req;
    GDNCP_MPI_CHECK(MPI_Ibcast(t.data(), count, MPI_BYTE, root, comm_, &req));
    wait(req, "MPI_Ibcast", {t}, t.nbytes());
  }

  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    check_usable("send_recv");
    GDNCP_CHECK(dst >= -1 && dst < size_, "send_recv: dst ", dst, " is not a rank (or -1)");
    GDNCP_CHECK(src >= -1 && src < size_, "send_recv: src ", src, " is not a rank (or -1)");
    std::vector<MPI_Request> reqs;
    std::vector<Tensor> keep;
    size_t bytes = 0;
    if (src >= 0) {
      check_cpu(recv, "send_recv: recv");
      MPI_Request r;
      GDNCP_MPI_CHECK(
          MPI_Irecv(recv.data(), checked_count(recv.nbytes(), "send_recv"), MPI_BYTE, src, kHaloTag, comm_, &r));
      reqs.push_back(r);
      keep.push_back(recv);
    }
    if (dst >= 0) {
      check_cpu(send, "send_recv: send");
      MPI_Request r;
      GDNCP_MPI_CHECK(
          MPI_Isend(send.data(), checked_count(send.nbytes(), "send_recv"), MPI_BYTE, dst, kHaloTag, comm_, &r));
      reqs.push_back(r);
      keep.push_back(send);
      bytes = send.nbytes();
    }
    for (auto& r : reqs) wait(r, "MPI_Isend/MPI_Irecv", keep, 0);
    stats_.bytes += static_cast<int64_t>(bytes);
  }

  void barrier() override {
    check_usable("barrier");
    MPI_Request req;
    GDNCP_MPI_CHECK(MPI_Ibarrier(comm_, &req));
    wait(req, "MPI_Ibarrier", {}, 0);
  }

  void all_gather_host(void* out, const void* in, size_t bytes) override {
    check_usable("all_gather_host");
    // Staged in tensors so a timed-out request keeps its memory alive.
    const int64_t n = static_cast<int64_t>((bytes + 7) / 8);
    Tensor send = Tensor::zeros({n}, DType::f64);
    Tensor recv = Tensor::empty({n * size_}, DType::f64);
    std::memcpy(send.data(), in, bytes);
    const int count = checked_count(static_cast<size_t>(n) * 8, "all_gather_host");
    MPI_Request req;
    GDNCP_MPI_CHECK(MPI_Iallgather(send.data(), count, MPI_BYTE, recv.data(), count, MPI_BYTE, comm_, &req));
    wait(req, "MPI_Iallgather", {send, recv}, bytes);
    for (int r = 0; r < size_; ++r)
      std::memcpy(static_cast<char*>(out) + static_cast<size_t>(r) * bytes, recv.data_ptr<double>() + r * n, bytes);
  }

 private:
  using Clock = std::chrono::steady_clock;
  static Clock::duration seconds(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  }
  static constexpr int kHaloTag = 4242;

  template <typename T>
  void sum_ranks(Tensor& t, const Tensor& all) const {
    const int64_t n = t.numel();
    const T* a = all.data_ptr<T>();
    T* out = t.data_ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      T acc = a[i];
      for (int r = 1; r < size_; ++r) acc += a[r * n + i];
      out[i] = acc;
    }
  }

  struct Parked {
    MPI_Request request;
    std::vector<Tensor> keep;
    bool leaked = false;
  };

  void check_usable(const char* what) const {
    GDNCP_CHECK(!aborted_, what, ": the MPI communicator was aborted by an earlier timeout (rank ", rank_, ")");
    GDNCP_CHECK(mpi_usable(), what, ": MPI is finalised");
  }
  static void check_cpu(const Tensor& t, const char* what) {
    GDNCP_CHECK(t.defined(), what, " is undefined");
    GDNCP_CHECK(t.device() == Device::cpu, what, " is on ", device_name(t.device()),
                "; the MPI communicator takes CPU tensors (use the NCCL communicator for CUDA tensors)");
  }
  static int checked_count(size_t n, const char* what) {
    GDNCP_CHECK(n <= static_cast<size_t>(INT32_MAX), what, ": ", n, " exceeds MPI's int count");
    return static_cast<int>(n);
  }

  // Completes req by polling until the deadline. Yields the core between
  // polls: test runs put several ranks on one core.
  void wait(MPI_Request& req, const char* call, std::vector<Tensor> keep, size_t bytes) {
    const auto start = Clock::now();
    const auto deadline = start + seconds(timeout_seconds_);
    int done = 0;
    for (int spins = 0;; ++spins) {
      GDNCP_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
      if (done) break;
      if (Clock::now() > deadline) {
        aborted_ = true;
        parked_.push_back(Parked{req, std::move(keep), false});
        GDNCP_FAIL(call, " did not complete within ", timeout_seconds_, " s on rank ", rank_, " of ", size_,
                   " (a rank missing or out of step); the communicator is aborted");
      }
      if (spins < 64)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(spins < 4096 ? 20 : 200));
    }
    stats_.calls += 1;
    stats_.bytes += static_cast<int64_t>(bytes);
    stats_.seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  bool aborted_ = false;
  std::vector<Parked> parked_;
};

}  // namespace

std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) { return std::make_shared<MpiCommunicator>(comm); }

}  // namespace cp
}  // namespace gdncp
