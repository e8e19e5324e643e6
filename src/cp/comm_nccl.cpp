// src/cp/comm_nccl.cpp — the NCCL communicator (CUDA tensors).
//
// The communicator is created nonblocking (ncclConfig_t::blocking = 0), so no
// NCCL call can block the host forever. Each collective is enqueued on the
// stream, bracketed by two events, and completed by polling the end event and
// ncclCommGetAsyncError against a deadline of timeout_seconds(); a miss or an
// asynchronous error calls ncclCommAbort and throws on this rank. The events
// also give the device time spent in collectives (Stats::seconds).
//
// Waiting for each collective costs one host round trip; the CP layers issue
// one collective per forward and one per backward, in deferred mode
// (Communicator::begin_deferred): the wait moves to complete(), after the
// layer has enqueued the kernels that follow the collective, so the device
// never idles on the round trip. The deadline applies unchanged. The small validation
// exchange (host memory) goes over MPI when the communicator was bootstrapped
// from an MPI communicator, so it does not wait for the stream.
#include <mpi.h>

#include "gdncp/cp.h"
#include "gdncp/error.h"

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "gdncp/cp_nccl.h"
#endif

namespace gdncp {
namespace cp {

#if GDNCP_WITH_CUDA
namespace {

using Clock = std::chrono::steady_clock;

Clock::duration as_duration(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Polling back-off: yield for the first ~50k polls (a few tens of ms: a
// collective in a training step completes well within that, and a sleep's
// granularity of ~60 µs would be a bubble on the device), then sleep.
void pause(int spins) {
  if (spins < 50000)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 60000 ? 10 : 200));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::bf16:
      return ncclBfloat16;
  }
  GDNCP_FAIL("nccl: unknown dtype");
}

// Waits (with a deadline) until a nonblocking NCCL call has settled.
ncclResult_t settle(ncclComm_t comm, Clock::time_point deadline) {
  ncclResult_t state = ncclInProgress;
  for (int spins = 0;; ++spins) {
    GDNCP_NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
    if (state != ncclInProgress) return state;
    if (Clock::now() > deadline) return ncclInProgress;
    pause(spins);
  }
}

class NcclCommunicator final : public Communicator {
 public:
  // host: an MPI communicator over the same ranks for host-memory exchanges (may be null).
  NcclCommunicator(ncclComm_t comm, bool owned, cudaStream_t stream, double timeout,
                   std::shared_ptr<Communicator> host = nullptr)
      : comm_(comm), owned_(owned), stream_(stream), host_(std::move(host)) {
    timeout_seconds_ = timeout;
    GDNCP_NCCL_CHECK(ncclCommCount(comm_, &size_));
    GDNCP_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    GDNCP_NCCL_CHECK(ncclCommCuDevice(comm_, &device_));
    int cur = -1;
    GDNCP_CUDA_CHECK(cudaGetDevice(&cur));
    GDNCP_CHECK(cur == device_, "make_nccl_communicator: the NCCL communicator is on device ", device_,
                " but the current device is ", cur);
    GDNCP_CUDA_CHECK(cudaEventCreate(&start_));
    GDNCP_CUDA_CHECK(cudaEventCreate(&stop_));
    GDNCP_CUDA_CHECK(cudaEventCreateWithFlags(&order_, cudaEventDisableTiming));
  }

  ~NcclCommunicator() override {
    for (Pending& p : pending_) {  // a deferral left open by an exception: events only
      cudaEventDestroy(p.start);
      cudaEventDestroy(p.stop);
    }
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaEventDestroy(order_);
    if (!owned_ || aborted_) return;
    // Best effort, never throws: finalize (nonblocking), then destroy.
    const ncclResult_t fin = ncclCommFinalize(comm_);
    ncclResult_t st = (fin == ncclSuccess || fin == ncclInProgress) ? ncclInProgress : fin;
    const auto deadline = Clock::now() + as_duration(timeout_seconds_);
    for (int spins = 0; st == ncclInProgress && Clock::now() < deadline; ++spins) {
      if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess) break;
      if (st == ncclInProgress) pause(spins);
    }
    if (st == ncclSuccess)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda; }
  ncclComm_t comm() const { return comm_; }
  bool aborted() const override { return aborted_ || (host_ && host_->aborted()); }
  const char* backend() const override { return "nccl"; }

  void all_gather(Tensor& out, const Tensor& in) override {
    check_usable("all_gather");
    check_cuda(in, "all_gather: in");
    check_cuda(out, "all_gather: out");
    GDNCP_CHECK(out.dtype() == in.dtype(), "all_gather: out dtype ", dtype_name(out.dtype()), " != in dtype ",
                dtype_name(in.dtype()));
    GDNCP_CHECK(out.numel() == in.numel() * size_, "all_gather: out has ", out.numel(), " elements, expected size()·",
                in.numel(), " = ", in.numel() * size_);
    run("ncclAllGather", in.nbytes(),
        [&](cudaStream_t s) { return ncclAllGather(in.data(), out.data(), in.nbytes(), ncclUint8, comm_, s); });
  }

  void all_reduce_sum(Tensor& t) override {
    check_usable("all_reduce_sum");
    check_cuda(t, "all_reduce_sum: t");
    run("ncclAllReduce", t.nbytes(), [&](cudaStream_t s) {
      return ncclAllReduce(t.data(), t.data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), ncclSum, comm_, s);
    });
  }

  void broadcast(Tensor& t, int root) override {
    check_usable("broadcast");
    check_cuda(t, "broadcast: t");
    GDNCP_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of a group of ", size_);
    run("ncclBroadcast", t.nbytes(),
        [&](cudaStream_t s) { return ncclBroadcast(t.data(), t.data(), t.nbytes(), ncclUint8, root, comm_, s); });
  }

  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    check_usable("send_recv");
    GDNCP_CHECK(dst >= -1 && dst < size_, "send_recv: dst ", dst, " is not a rank (or -1)");
    GDNCP_CHECK(src >= -1 && src < size_, "send_recv: src ", src, " is not a rank (or -1)");
    if (dst >= 0) check_cuda(send, "send_recv: send");
    if (src >= 0) check_cuda(recv, "send_recv: recv");
    if (dst < 0 && src < 0) return;
    run("ncclSend/ncclRecv", dst >= 0 ? send.nbytes() : 0, [&](cudaStream_t s) {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      if (dst >= 0) {
        r = ncclSend(send.data(), send.nbytes(), ncclUint8, dst, comm_, s);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      if (src >= 0) {
        r = ncclRecv(recv.data(), recv.nbytes(), ncclUint8, src, comm_, s);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      return ncclGroupEnd();
    });
  }

  void barrier() override {
    Tensor one = Tensor::zeros({1}, DType::f32, Device::cuda);
    all_reduce_sum(one);
  }

  void begin_deferred() override { deferred_ = true; }

  void complete() override {
    deferred_ = false;
    std::vector<Pending> todo;
    todo.swap(pending_);
    std::string failure;
    for (Pending& p : todo) {
      if (failure.empty() && !aborted_) failure = wait(p.call, p.start, p.stop, p.bytes, p.deadline);
      cudaEventDestroy(p.start);
      cudaEventDestroy(p.stop);
    }
    if (!failure.empty()) abort_and_throw(failure);
  }

  void all_gather_host(void* out, const void* in, size_t bytes) override {
    check_usable("all_gather_host");
    if (host_) {  // over MPI: no device round trip, no wait for the stream
      host_->set_timeout_seconds(timeout_seconds_);
      host_->all_gather_host(out, in, bytes);
      return;
    }
    const int64_t n = static_cast<int64_t>((bytes + 7) / 8);
    std::vector<double> host(static_cast<size_t>(n), 0.0);
    std::memcpy(host.data(), in, bytes);
    Tensor send = Tensor::empty({n}, DType::f64, Device::cuda);
    Tensor recv = Tensor::empty({n * size_}, DType::f64, Device::cuda);
    const cudaStream_t cur = static_cast<cudaStream_t>(current_stream());
    GDNCP_CUDA_CHECK(
        cudaMemcpyAsync(send.data(), host.data(), static_cast<size_t>(n) * 8, cudaMemcpyHostToDevice, cur));
    const bool deferred = deferred_;
    deferred_ = false;
    all_gather(recv, send);  // waits: the copy back below cannot block on NCCL
    deferred_ = deferred;
    std::vector<double> all(static_cast<size_t>(n * size_));
    GDNCP_CUDA_CHECK(cudaMemcpyAsync(all.data(), recv.data(), all.size() * 8, cudaMemcpyDeviceToHost, cur));
    GDNCP_CUDA_CHECK(cudaStreamSynchronize(cur));
    for (int r = 0; r < size_; ++r)
      std::memcpy(static_cast<char*>(out) + static_cast<size_t>(r) * bytes, all.data() + r * n, bytes);
  }

 private:
  void check_usable(const char* what) const {
    GDNCP_CHECK(!aborted(), what, ": the NCCL communicator was aborted by an earlier timeout or error (rank ", rank_,
                ")");
    int cur = -1;
    GDNCP_CUDA_CHECK(cudaGetDevice(&cur));
    GDNCP_CHECK(cur == device_, what, ": the current device is ", cur, " but the NCCL communicator of rank ", rank_,
                " is on device ", device_);
  }
  static void check_cuda(const Tensor& t, const char* what) {
    GDNCP_CHECK(t.defined(), what, " is undefined");
    GDNCP_CHECK(t.device() == Device::cuda, what, " is on ", device_name(t.device()),
                "; the NCCL communicator takes CUDA tensors (use the MPI communicator for CPU tensors)");
  }

  [[noreturn]] void abort_and_throw(const std::string& why) {
    aborted_ = true;
    ncclCommAbort(comm_);
    GDNCP_FAIL(why, " (rank ", rank_, " of ", size_, "); the NCCL communicator is aborted");
  }

  // Enqueues op on the collective stream and waits for it with the deadline,
  // or, deferred, leaves the wait to complete().
  template <typename Op>
  void run(const char* call, size_t bytes, Op op) {
    const cudaStream_t cur = static_cast<cudaStream_t>(current_stream());
    const cudaStream_t s = stream_ ? stream_ : cur;
    if (s != cur) {  // the collective reads what the current stream wrote
      GDNCP_CUDA_CHECK(cudaEventRecord(order_, cur));
      GDNCP_CUDA_CHECK(cudaStreamWaitEvent(s, order_, 0));
    }
    const auto deadline = Clock::now() + as_duration(timeout_seconds_);
    cudaEvent_t start = start_, stop = stop_;
    if (deferred_) {  // events of its own: the wait comes later
      GDNCP_CUDA_CHECK(cudaEventCreate(&start));
      GDNCP_CUDA_CHECK(cudaEventCreate(&stop));
      pending_.push_back(Pending{call, bytes, deadline, start, stop});
    }
    GDNCP_CUDA_CHECK(cudaEventRecord(start, s));
    const ncclResult_t r = op(s);
    if (r != ncclSuccess && r != ncclInProgress)
      abort_and_throw(std::string("NCCL call ") + call + " failed: " + ncclGetErrorString(r));
    const ncclResult_t st = settle(comm_, deadline);
    if (st == ncclInProgress) abort_and_throw(std::string(call) + " could not be enqueued within the timeout");
    if (st != ncclSuccess) abort_and_throw(std::string(call) + " failed: " + ncclGetErrorString(st));
    GDNCP_CUDA_CHECK(cudaEventRecord(stop, s));
    if (!deferred_) {
      const std::string failure = wait(call, start, stop, bytes, deadline);
      if (!failure.empty()) abort_and_throw(failure);
    }
    if (s != cur) {
      GDNCP_CUDA_CHECK(cudaEventRecord(order_, s));
      GDNCP_CUDA_CHECK(cudaStreamWaitEvent(cur, order_, 0));
    }
  }

  // Polls the end event of one collective until it completes, an asynchronous
  // error shows or the deadline passes; returns the failure ("" on success) and
  // counts the collective in the statistics.
  std::string wait(const char* call, cudaEvent_t start, cudaEvent_t stop, size_t bytes, Clock::time_point deadline) {
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaEventQuery(stop);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        GDNCP_CUDA_CHECK(q);
      }
      ncclResult_t async = ncclSuccess;
      GDNCP_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess && async != ncclInProgress)
        return std::string(call) + " failed asynchronously: " + ncclGetErrorString(async);
      if (Clock::now() > deadline)
        return std::string(call) + " did not complete within " + std::to_string(timeout_seconds_) +
               " s (a rank missing or out of step)";
      pause(spins);
    }
    float ms = 0;
    GDNCP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    stats_.calls += 1;
    stats_.bytes += static_cast<int64_t>(bytes);
    stats_.seconds += ms * 1e-3;
    return "";
  }

  struct Pending {
    const char* call;
    size_t bytes;
    Clock::time_point deadline;
    cudaEvent_t start, stop;
  };

  ncclComm_t comm_ = nullptr;
  bool owned_ = false;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<Communicator> host_;
  int rank_ = 0, size_ = 1, device_ = 0;
  bool aborted_ = false;
  cudaEvent_t start_ = nullptr, stop_ = nullptr, order_ = nullptr;
  bool deferred_ = false;
  std::vector<Pending> pending_;  // deferred collectives, in enqueue order
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream) {
  GDNCP_CHECK(comm != nullptr, "make_nccl_communicator: comm is null");
  return std::make_shared<NcclCommunicator>(comm, false, stream, 300.0);
}

ncclComm_t nccl_comm(const Communicator& c) {
  const auto* n = dynamic_cast<const NcclCommunicator*>(&c);
  GDNCP_CHECK(n != nullptr, "nccl_comm: a ", c.backend(), " communicator has no ncclComm_t");
  return n->comm();
}

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm) { return make_nccl_communicator(comm, -1); }

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int device_arg) {
  int init = 0;
  MPI_Initialized(&init);
  GDNCP_CHECK(init, "make_nccl_communicator: MPI is not initialised (call MPI_Init first)");
  GDNCP_CHECK(comm != MPI_COMM_NULL, "make_nccl_communicator: comm is MPI_COMM_NULL");
  int rank = 0, size = 1;
  GDNCP_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  GDNCP_MPI_CHECK(MPI_Comm_size(comm, &size));
  // Agree on the outcome of the local checks before any rank waits on the others.
  int ndev = 0;
  const cudaError_t dev_err = cudaGetDeviceCount(&ndev);
  int ok = (dev_err == cudaSuccess && ndev > 0) ? 1 : 0, all_ok = 0;
  GDNCP_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm));
  GDNCP_CHECK(all_ok, "make_nccl_communicator: rank ", rank, " sees ", ndev,
              " CUDA devices; some rank of the group has none (", cudaGetErrorString(dev_err), ")");
  GDNCP_CHECK(device_arg < ndev, "make_nccl_communicator: device ", device_arg, " but rank ", rank, " sees ", ndev,
              " devices");
  // The node-local rank over the world, not over comm: two CP groups of a
  // DP×CP layout on one node would otherwise both start at device 0.
  const int device = device_arg >= 0 ? device_arg : local_rank(MPI_COMM_WORLD) % ndev;
  GDNCP_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  if (rank == 0) GDNCP_NCCL_CHECK(ncclGetUniqueId(&id));
  GDNCP_MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t nc = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&nc, size, id, rank, &config);
  GDNCP_CHECK(r == ncclSuccess || r == ncclInProgress,
              "make_nccl_communicator: ncclCommInitRankConfig failed: ", ncclGetErrorString(r));
  const double timeout = 300.0;
  const ncclResult_t st = settle(nc, Clock::now() + as_duration(timeout));
  if (st != ncclSuccess) {
    ncclCommAbort(nc);
    GDNCP_FAIL("make_nccl_communicator: ncclCommInitRankConfig on rank ", rank, " (device ", device, ") ",
               st == ncclInProgress ? std::string("timed out") : std::string(ncclGetErrorString(st)));
  }
  return std::make_shared<NcclCommunicator>(nc, true, nullptr, timeout, make_mpi_communicator(comm));
}

// --- bootstrap without MPI ---------------------------------------------------

static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId), "UniqueId holds exactly an ncclUniqueId");

UniqueId make_unique_id() {
  ncclUniqueId nid;
  GDNCP_NCCL_CHECK(ncclGetUniqueId(&nid));
  UniqueId id;
  std::memcpy(id.bytes, &nid, sizeof id.bytes);
  return id;
}

std::shared_ptr<Communicator> make_nccl_communicator(const UniqueId& id, int rank, int size, int device) {
  GDNCP_CHECK(size >= 1, "make_nccl_communicator: size must be >= 1, got ", size);
  GDNCP_CHECK(rank >= 0 && rank < size, "make_nccl_communicator: rank ", rank, " is not in [0, ", size, ")");
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess) {  // no driver or no device
    (void)cudaGetLastError();
    ndev = 0;
  }
  GDNCP_CHECK(device >= 0 && device < ndev, "make_nccl_communicator: device ", device, " but rank ", rank, " sees ",
              ndev, " CUDA devices");
  GDNCP_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes, sizeof nid);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t nc = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&nc, size, nid, rank, &config);
  GDNCP_CHECK(r == ncclSuccess || r == ncclInProgress,
              "make_nccl_communicator: ncclCommInitRankConfig failed: ", ncclGetErrorString(r));
  const double timeout = 300.0;
  const ncclResult_t st = settle(nc, Clock::now() + as_duration(timeout));
  if (st != ncclSuccess) {
    ncclCommAbort(nc);
    GDNCP_FAIL("make_nccl_communicator: ncclCommInitRankConfig on rank ", rank, " (device ", device, ") ",
               st == ncclInProgress ? std::string("timed out") : std::string(ncclGetErrorString(st)));
  }
  return std::make_shared<NcclCommunicator>(nc, true, nullptr, timeout);
}

#else  // !GDNCP_WITH_CUDA

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm) { return make_nccl_communicator(comm, -1); }

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm, int) {
  GDNCP_FAIL("make_nccl_communicator: gdncp was built without CUDA (configure with GDNCP_CUDA=ON)");
}

UniqueId make_unique_id() { GDNCP_FAIL("make_unique_id: gdncp was built without CUDA (configure with GDNCP_CUDA=ON)"); }

std::shared_ptr<Communicator> make_nccl_communicator(const UniqueId&, int, int, int) {
  GDNCP_FAIL("make_nccl_communicator: gdncp was built without CUDA (configure with GDNCP_CUDA=ON)");
}

#endif

}  // namespace cp
}  // namespace gdncp
