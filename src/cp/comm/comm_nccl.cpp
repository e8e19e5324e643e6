// src/cp/comm/comm_nccl.cpp — the NCCL communicator (CUDA tensors).
//
// Note [watchdog]: a collective is enqueued on the stream and the call
// returns; the host never waits for the device. The communicator is blocking
// (NCCL's default: an enqueue returns without polling; a nonblocking
// ncclComm_t of the caller answers ncclInProgress, and is then settled by
// polling against the deadline — counted as a host wait). A call that blocks
// (connection set-up on the first collectives, with a rank lost) is ended by
// the watchdog with ncclCommAbort at its deadline, as NCCL allows from
// another thread. Around each collective two events from a pool (no event is
// created on the hot path) are recorded and handed to the communicator's
// watchdog thread, which polls them in order together with
// ncclCommGetAsyncError: a completed collective returns its events to the
// pool and is counted (Stats, device time from the events); one past its
// deadline (timeout_seconds() after the call) or an asynchronous error calls
// ncclCommAbort, and the next call on the communicator throws gdncp::Error
// naming the collective and the deadline. The watchdog runs in relaxed
// stream-capture mode, so it keeps polling while another thread captures a
// CUDA graph. Collectives enqueued on a capturing stream are not watched
// (their events would become graph nodes); Communicator::watch puts a
// replay's work under the deadline. An aborted communicator's destructor
// returns at once; a live one finalizes within the deadline.
//
// Note [NCCL call headers]: NCCL's collectives carry no header of their own,
// and reading one on the host would make every collective wait. Instead each
// CP entry call (validate_cp.cpp's exchange_needed) first sends a call header
// (Note [collective header]: the entry, the hash of what every rank must
// agree on, this rank's argument error, whether it waits) in an all-gather of
// its own on the data channel: one kernel writes this rank's header (held in
// its arguments), ncclAllGather, and a copy of every rank's header into a
// pinned host block. A rank that exchanges its record anyway (a bad argument,
// a changed record, every_call) waits for the headers and throws their
// verdict; when some rank did not wait it has enqueued data collectives this
// rank will never join, so the communicator is aborted too. The other ranks
// do not wait: their watchdog checks the headers once the copy completes and
// aborts the communicator with the verdict, so the next call on every rank
// raises it at once instead of at the deadline (a rank with a bad argument
// costs the communicator; when every rank waited, nobody went on and it
// stays usable). Captured calls send the header without the check.
//
// The validation exchange (host memory) goes over MPI when the communicator
// was bootstrapped from an MPI communicator, and over a second NCCL
// communicator split from the caller's one otherwise, so that a rank
// validating alone never meets the others' data collectives on one channel
// (both wait to the deadline and raise instead).
#include <mpi.h>

#include "cp/validate_cp.h"
#include "gdncp/cp.h"
#include "gdncp/error.h"

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cp/comm/collective_header.h"
#include "gdncp/cp_nccl.h"
#endif

namespace gdncp {
namespace cp {

#if GDNCP_WITH_CUDA
namespace detail {
cudaError_t write_header(void* dst, const CollectiveHeader& h, cudaStream_t stream);  // call_header.cu
}

namespace {

using Clock = std::chrono::steady_clock;
using detail::CollectiveHeader;
// What a call header's `bytes` holds (Note [NCCL call headers]).
constexpr const char* kRecordWord = "hash of the sizes and options";

Clock::duration as_duration(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Polling back-off of the settling loops (host waits, rare): yield first, then sleep.
void pause(int spins) {
  if (spins < 50000)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 60000 ? 10 : 200));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
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

// settle() that never throws (destructors).
ncclResult_t settle_quietly(ncclComm_t comm, Clock::time_point deadline) {
  ncclResult_t state = ncclInProgress;
  for (int spins = 0;; ++spins) {
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return ncclInternalError;
    if (state != ncclInProgress || Clock::now() > deadline) return state;
    pause(spins);
  }
}

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  GDNCP_CUDA_CHECK(cudaStreamIsCapturing(s, &st));
  return st != cudaStreamCaptureStatusNone;
}

std::string seconds_str(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

class NcclCommunicator final : public Communicator {
 public:
  // host: an MPI communicator over the same ranks for host-memory exchanges
  // (null: a second NCCL communicator is split from comm for them).
  NcclCommunicator(ncclComm_t comm, bool owned, cudaStream_t stream, double timeout,
                   std::shared_ptr<Communicator> host = nullptr)
      : comm_(comm), owned_(owned), stream_(stream), host_(std::move(host)) {
    set_timeout_seconds(timeout);
    GDNCP_NCCL_CHECK(ncclCommCount(comm_, &size_));
    GDNCP_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    GDNCP_NCCL_CHECK(ncclCommCuDevice(comm_, &device_));
    int cur = -1;
    GDNCP_CUDA_CHECK(cudaGetDevice(&cur));
    GDNCP_CHECK(cur == device_, "make_nccl_communicator: the NCCL communicator is on device ", device_,
                " but the current device is ", cur);
    GDNCP_CUDA_CHECK(cudaEventCreateWithFlags(&order_, cudaEventDisableTiming));
    if (!host_) {  // the validation channel (collective over the ranks, like the caller's creation of comm)
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      const ncclResult_t r = ncclCommSplit(comm_, 0, rank_, &record_comm_, &config);
      GDNCP_CHECK(r == ncclSuccess || r == ncclInProgress,
                  "make_nccl_communicator: ncclCommSplit failed: ", ncclGetErrorString(r));
      const ncclResult_t st = settle(record_comm_, Clock::now() + as_duration(timeout_seconds_));
      GDNCP_CHECK(st == ncclSuccess, "make_nccl_communicator: ncclCommSplit of the validation channel: ",
                  st == ncclInProgress ? std::string("timed out") : std::string(ncclGetErrorString(st)));
      GDNCP_CUDA_CHECK(cudaStreamCreateWithFlags(&record_stream_, cudaStreamNonBlocking));
    }
    GDNCP_CUDA_CHECK(cudaMalloc(&headers_, sizeof(CollectiveHeader) * (1 + static_cast<size_t>(size_))));
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~NcclCommunicator() override {
    if (owned_ && !aborted_) {  // finalize under the watchdog: a lost rank cannot hang it
      std::lock_guard<std::mutex> guard(call_mu_);
      in_call_name_ = "ncclCommFinalize";
      in_call_deadline_ = Clock::now() + as_duration(timeout_seconds_);
      in_call_ = true;
      ncclResult_t fin = ncclCommFinalize(comm_);
      if (fin == ncclInProgress) fin = settle_quietly(comm_, in_call_deadline_.load());
      in_call_ = false;
      std::lock_guard<std::mutex> lock(reason_mu_);
      std::lock_guard<std::mutex> watchdog_out(mu_);  // the watchdog polls comm_ under mu_
      if (!aborted_) {
        if (fin == ncclSuccess)
          ncclCommDestroy(comm_);
        else
          ncclCommAbort(comm_);
        gone_ = true;
        finalized_ = fin == ncclSuccess;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    for (Watch& w : queue_) release(w);
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
    if (finalized_) {  // else kept to the process's end: a collective may still write them
      for (void* b : header_blocks_) cudaFreeHost(b);
      cudaFree(headers_);
    }
    cudaEventDestroy(order_);
    if (record_stream_) cudaStreamDestroy(record_stream_);
    if (aborted_) return;  // never waits again (Note [watchdog])
    if (record_comm_) finalize(record_comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda; }
  ncclComm_t comm() const { return comm_; }
  bool aborted() const override { return aborted_ || (host_ && host_->aborted()); }
  std::string abort_reason() const override {
    std::lock_guard<std::mutex> lock(reason_mu_);
    if (!reason_.empty()) return reason_;
    return host_ ? host_->abort_reason() : std::string();
  }
  const char* backend() const override { return "nccl"; }

  void all_gather(Tensor& out, const Tensor& in) override {
    check("all_gather");
    check_cuda(in, "all_gather: in");
    check_cuda(out, "all_gather: out");
    detail::check_all_gather_args(out, in, size_);
    run("ncclAllGather", in.nbytes(),
        [&](cudaStream_t s) { return ncclAllGather(in.data(), out.data(), in.nbytes(), ncclUint8, comm_, s); });
  }

  void all_reduce_sum(Tensor& t) override {
    check("all_reduce_sum");
    check_cuda(t, "all_reduce_sum: t");
    run("ncclAllReduce", t.nbytes(), [&](cudaStream_t s) {
      return ncclAllReduce(t.data(), t.data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), ncclSum, comm_, s);
    });
  }

  void broadcast(Tensor& t, int root) override {
    check("broadcast");
    check_cuda(t, "broadcast: t");
    GDNCP_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of a group of ", size_);
    run("ncclBroadcast", t.nbytes(),
        [&](cudaStream_t s) { return ncclBroadcast(t.data(), t.data(), t.nbytes(), ncclUint8, root, comm_, s); });
  }

  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    check("send_recv");
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

  void send_recv_group(std::vector<Transfer>& ts) override {
    check("send_recv_group");
    size_t bytes = 0;
    bool any = false;
    for (const Transfer& t : ts) {
      GDNCP_CHECK(t.dst >= -1 && t.dst < size_, "send_recv_group: dst ", t.dst, " is not a rank (or -1)");
      GDNCP_CHECK(t.src >= -1 && t.src < size_, "send_recv_group: src ", t.src, " is not a rank (or -1)");
      if (t.dst >= 0) check_cuda(t.send, "send_recv_group: send");
      if (t.src >= 0) check_cuda(t.recv, "send_recv_group: recv");
      bytes += t.dst >= 0 ? t.send.nbytes() : 0;
      any = any || t.dst >= 0 || t.src >= 0;
    }
    if (!any) return;
    run("ncclSend/ncclRecv group", bytes, [&](cudaStream_t s) {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      for (Transfer& t : ts) {
        if (t.dst >= 0) {
          r = ncclSend(t.send.data(), t.send.nbytes(), ncclUint8, t.dst, comm_, s);
          if (r != ncclSuccess && r != ncclInProgress) return r;
        }
        if (t.src >= 0) {
          r = ncclRecv(t.recv.data(), t.recv.nbytes(), ncclUint8, t.src, comm_, s);
          if (r != ncclSuccess && r != ncclInProgress) return r;
        }
      }
      return ncclGroupEnd();
    });
  }

  // Enqueued like any collective: the host does not wait for the others.
  void barrier() override {
    Tensor one = Tensor::zeros({1}, DType::f32, Device::cuda);
    all_reduce_sum(one);
  }

  void watch(const char* what) override {
    check("watch");
    const cudaStream_t cur = static_cast<cudaStream_t>(current_stream());
    if (capturing(cur)) return;
    Watch w;
    w.call = what;
    w.deadline = Clock::now() + as_duration(timeout_seconds_);
    w.start = take_event();
    w.stop = take_event();
    GDNCP_CUDA_CHECK(cudaEventRecord(w.start, cur));
    GDNCP_CUDA_CHECK(cudaEventRecord(w.stop, cur));
    w.counted = false;
    enqueue(w);
  }

  // Note [NCCL call headers]. Returns whether this rank still exchanges its record.
  bool announce(int64_t kind, const char* entry, int64_t key, const std::string& bad, bool wait) {
    check(entry);
    if (size_ == 1) return wait;  // nobody to agree with
    CollectiveHeader h = detail::make_header(kind, entry, key, call_seq_++, bad);
    h.flags = wait ? 1 : 0;
    const size_t H = sizeof(CollectiveHeader), all = H * static_cast<size_t>(size_);
    unsigned char* send = static_cast<unsigned char*>(headers_);
    unsigned char* recv = send + H;
    const cudaStream_t s = stream_ ? stream_ : static_cast<cudaStream_t>(current_stream());
    const bool captured = capturing(s);
    void* block = captured ? nullptr : take_header_block();
    run(
        "ncclAllGather (call header)", H,
        [&](cudaStream_t st) {
          if (detail::write_header(send, h, st) != cudaSuccess) return ncclUnhandledCudaError;
          return ncclAllGather(send, recv, H, ncclUint8, comm_, st);
        },
        /*counted=*/false,
        [&](cudaStream_t st) {
          return block ? cudaMemcpyAsync(block, recv, all, cudaMemcpyDeviceToHost, st) : cudaSuccess;
        },
        wait ? nullptr : block, &h);
    if (!wait || !block) return wait;
    // This rank exchanges its record next (a host wait anyway): the verdict now.
    count_host_wait();
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) GDNCP_CUDA_CHECK(q);
      check_usable(entry);  // the watchdog aborts at the deadline
      pause(spins);
    }
    const std::vector<CollectiveHeader> got = headers_in(block);
    release_header_block(block);
    const bool all_wait = std::all_of(got.begin(), got.end(), [](const CollectiveHeader& g) { return g.flags == 1; });
    const std::string why = verdict_on(got, h);
    // Agreed: the others, who did not wait, validated this record before; no exchange.
    if (why.empty()) return all_wait;
    if (all_wait) throw Error(why);  // nobody went on: the communicator stays usable
    abort_and_throw(why +
                    " (the ranks that did not wait for the call header have enqueued collectives this rank "
                    "will not join)");
  }

  void all_gather_host(void* out, const void* in, size_t bytes) override {
    check("all_gather_host");
    if (host_) {  // over MPI: no device round trip, no wait for the stream
      host_->set_timeout_seconds(timeout_seconds_);
      host_->all_gather_host(out, in, bytes);
    } else {
      device_exchange(out, in, bytes, "all_gather_host");
    }
    count_host_wait();
  }

  void exchange_record(void* out, const void* in, size_t bytes) override {
    check("the validation exchange");
    GDNCP_CHECK(bytes <= kRecordBytes, "exchange_record: ", bytes, " bytes exceed kRecordBytes = ", kRecordBytes);
    if (host_) {
      host_->set_timeout_seconds(timeout_seconds_);
      host_->exchange_record(out, in, bytes);
    } else {
      std::vector<unsigned char> mine(kRecordBytes, 0), all(kRecordBytes * static_cast<size_t>(size_));
      std::memcpy(mine.data(), in, bytes);
      device_exchange(all.data(), mine.data(), kRecordBytes, "the validation exchange");
      for (int r = 0; r < size_; ++r)
        std::memcpy(static_cast<unsigned char*>(out) + r * bytes, all.data() + r * kRecordBytes, bytes);
    }
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.validations += 1;
    stats_.host_waits += 1;
  }

 private:
  struct Watch {
    const char* call = "";
    int64_t seq = 0;
    size_t bytes = 0;
    Clock::time_point deadline;
    cudaEvent_t start = nullptr, stop = nullptr;
    bool counted = true;      // a collective (false: a watch() of other work, a call header)
    void* headers = nullptr;  // a call header's pinned block, checked once complete
    CollectiveHeader want;    // ... against this rank's header
  };

  void check(const char* what) const {
    check_usable(what);
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

  void count_host_wait() {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.host_waits += 1;
  }

  // Marks the communicator aborted and aborts its NCCL communicator (once).
  // The caller is the thread in the NCCL call, or holds call_mu_ (no call in
  // progress), or found that call stuck past its deadline: ncclCommAbort is
  // how NCCL ends a call blocked in another thread. The validation channel is
  // used by the calling thread alone: only that thread aborts it
  // (abort_and_throw); after a watchdog abort it is left as it is (never
  // destroyed: the destructor of an aborted communicator returns at once).
  void abort_comm(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(reason_mu_);
      if (aborted_ || gone_) return;
      reason_ = why + " (rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ")";
      aborted_ = true;
    }
    detail::note_abort();
    ncclCommAbort(comm_);
  }

  [[noreturn]] void abort_and_throw(const std::string& why) {
    abort_comm(why);
    if (record_comm_) {
      ncclCommAbort(record_comm_);
      record_comm_ = nullptr;
    }
    GDNCP_FAIL(abort_reason(), "; the NCCL communicator is aborted");
  }

  // From the watchdog: waits for an enqueue in progress to return, unless it
  // is itself stuck past its deadline (connection set-up with a lost rank).
  // why empty: only a stuck call is to be aborted (nothing if it returned).
  void abort_from_watchdog(const std::string& why) {
    for (;;) {
      if (call_mu_.try_lock()) {
        if (!why.empty()) abort_comm(why);
        call_mu_.unlock();
        return;
      }
      if (in_call_.load() && Clock::now() > in_call_deadline_.load()) {
        abort_comm(std::string(in_call_name_.load()) + " did not return within the deadline of " +
                   seconds_str(timeout_seconds_) + " s (a rank lost while NCCL connected)");
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!pool_.empty()) {
        cudaEvent_t e = pool_.back();
        pool_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;  // warm-up only: the pool refills as collectives complete
    GDNCP_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
  void release(Watch& w) {  // caller holds mu_ or the watchdog is gone
    if (w.start) pool_.push_back(w.start);
    if (w.stop) pool_.push_back(w.stop);
    if (w.headers) free_blocks_.push_back(w.headers);
    w.start = w.stop = nullptr;
    w.headers = nullptr;
  }
  // Pinned blocks of size_ headers, pooled like the events (allocated in the warm-up only).
  void* take_header_block() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_blocks_.empty()) {
        void* b = free_blocks_.back();
        free_blocks_.pop_back();
        return b;
      }
    }
    void* b = nullptr;
    GDNCP_CUDA_CHECK(cudaHostAlloc(&b, sizeof(CollectiveHeader) * static_cast<size_t>(size_), cudaHostAllocDefault));
    std::lock_guard<std::mutex> lock(mu_);
    header_blocks_.push_back(b);
    return b;
  }
  void release_header_block(void* b) {
    std::lock_guard<std::mutex> lock(mu_);
    free_blocks_.push_back(b);
  }
  // Every rank's call header in a completed pinned block.
  std::vector<CollectiveHeader> headers_in(const void* block) const {
    std::vector<CollectiveHeader> got(static_cast<size_t>(size_));
    std::memcpy(got.data(), block, sizeof(CollectiveHeader) * got.size());
    return got;
  }
  // The verdict on the call headers against this rank's ("" when the ranks agree).
  std::string verdict_on(const std::vector<CollectiveHeader>& got, const CollectiveHeader& want) const {
    const std::string entry(want.name, strnlen(want.name, sizeof(want.name)));
    return detail::header_verdict(got, {}, want, rank_, size_, entry.c_str(), -1, "", kRecordWord);
  }
  void enqueue(const Watch& w) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(w);
    }
    cv_.notify_one();
  }

  // Enqueues op on the collective stream (ordered after the current stream's
  // work and before its later work) and hands it to the watchdog. Holds
  // call_mu_ while NCCL runs, so the watchdog never aborts comm_ under a call
  // that returns (Note [watchdog]).
  // counted: in Stats; after: enqueued right after op once it is settled; headers/want: a call header's check.
  template <typename Op>
  void run(const char* call, size_t bytes, Op op, bool counted = true,
           const std::function<cudaError_t(cudaStream_t)>& after = nullptr, void* headers = nullptr,
           const CollectiveHeader* want = nullptr) {
    const cudaStream_t cur = static_cast<cudaStream_t>(current_stream());
    const cudaStream_t s = stream_ ? stream_ : cur;
    const bool captured = capturing(s);
    Watch w;
    w.call = call;
    w.bytes = bytes;
    w.counted = counted;
    w.headers = headers;
    if (want) w.want = *want;
    w.deadline = Clock::now() + as_duration(timeout_seconds_);
    if (!captured) {
      w.start = take_event();
      w.stop = take_event();
    }
    std::string failure;
    {
      std::lock_guard<std::mutex> guard(call_mu_);
      if (!aborted_) {
        w.seq = seq_++;
        if (s != cur) {  // the collective reads what the current stream wrote
          GDNCP_CUDA_CHECK(cudaEventRecord(order_, cur));
          GDNCP_CUDA_CHECK(cudaStreamWaitEvent(s, order_, 0));
        }
        if (!captured) GDNCP_CUDA_CHECK(cudaEventRecord(w.start, s));
        in_call_name_ = call;
        in_call_deadline_ = w.deadline;
        in_call_ = true;
        ncclResult_t r = op(s);
        in_call_ = false;
        if (r == ncclInProgress) {  // a nonblocking ncclComm_t of the caller: settle (a host wait)
          count_host_wait();
          r = settle(comm_, w.deadline);
          if (r == ncclInProgress)
            failure = std::string(call) + " could not be enqueued within the deadline of " +
                      seconds_str(timeout_seconds_) + " s";
        }
        if (failure.empty() && r != ncclSuccess)
          failure = std::string("NCCL call ") + call + " failed: " + ncclGetErrorString(r);
        if (failure.empty() && after) {
          const cudaError_t e = after(s);
          if (e != cudaSuccess) failure = std::string(call) + ": " + cudaGetErrorString(e);
        }
        if (!failure.empty()) abort_comm(failure);
        if (failure.empty() && !aborted_) {
          if (!captured) GDNCP_CUDA_CHECK(cudaEventRecord(w.stop, s));
          if (s != cur) {
            GDNCP_CUDA_CHECK(cudaEventRecord(order_, s));
            GDNCP_CUDA_CHECK(cudaStreamWaitEvent(cur, order_, 0));
          }
        }
      }
    }
    if (aborted_) {
      std::lock_guard<std::mutex> lock(mu_);
      release(w);
    }
    check_usable(call);  // throws when this call or the watchdog aborted the communicator
    if (!captured) enqueue(w);
  }

  // Note [watchdog].
  void watchdog_loop() {
    cudaSetDevice(device_);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(queue_.empty() && !in_call_ ? 20 : 1));
      if (stop_ || aborted_ || gone_) continue;
      std::string failure;
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
        failure = std::string(queue_.empty() ? "a collective" : queue_.front().call) +
                  " failed asynchronously: " + ncclGetErrorString(async);
      while (failure.empty() && !queue_.empty()) {
        Watch& w = queue_.front();
        const cudaError_t q = cudaEventQuery(w.stop);
        if (q == cudaSuccess) {
          float ms = 0;
          if (cudaEventElapsedTime(&ms, w.start, w.stop) != cudaSuccess) ms = 0;
          if (w.counted) {
            std::lock_guard<std::mutex> st(stats_mu_);
            stats_.calls += 1;
            stats_.bytes += static_cast<int64_t>(w.bytes);
            stats_.seconds += ms * 1e-3;
          }
          if (w.headers) {  // Note [NCCL call headers]
            const std::string why = verdict_on(headers_in(w.headers), w.want);
            if (!why.empty())
              failure = why +
                        " (found by the call header's check; the other ranks do not join this rank's "
                        "collectives)";
          }
          release(w);
          queue_.pop_front();
          if (!failure.empty()) break;
          continue;
        }
        if (q != cudaErrorNotReady)
          failure = std::string(w.call) + " (collective #" + std::to_string(w.seq) +
                    ") failed on the device: " + cudaGetErrorString(q);
        else if (Clock::now() > w.deadline)
          failure = std::string(w.call) + " (collective #" + std::to_string(w.seq) +
                    ") did not complete within the deadline of " + seconds_str(timeout_seconds_) +
                    " s (a rank lost, stopped or out of step)";
        break;
      }
      const bool stuck = failure.empty() && in_call_ && Clock::now() > in_call_deadline_.load();
      if (failure.empty() && !stuck) continue;
      lock.unlock();  // the calling thread may need mu_ to finish its enqueue
      abort_from_watchdog(failure);
      lock.lock();
    }
  }

  // Best effort, never throws: finalize (nonblocking) within the deadline, then destroy (or abort).
  void finalize(ncclComm_t c) {
    const ncclResult_t fin = ncclCommFinalize(c);
    ncclResult_t st = (fin == ncclSuccess || fin == ncclInProgress) ? ncclInProgress : fin;
    const auto deadline = Clock::now() + as_duration(timeout_seconds_);
    for (int spins = 0; st == ncclInProgress && Clock::now() < deadline; ++spins) {
      if (ncclCommGetAsyncError(c, &st) != ncclSuccess) break;
      if (st == ncclInProgress) pause(spins);
    }
    if (st == ncclSuccess)
      ncclCommDestroy(c);
    else
      ncclCommAbort(c);
  }

  // Host bytes through the device over the validation channel (no MPI): a
  // host wait on a stream of its own, bounded by the deadline.
  void device_exchange(void* out, const void* in, size_t bytes, const char* what) {
    GDNCP_CHECK(!capturing(static_cast<cudaStream_t>(current_stream())), what,
                ": a host exchange cannot run while the stream is captured (run the step once before capturing, "
                "so that Validation::on_change has nothing new to validate)");
    const size_t n = (bytes + 7) / 8 * 8;
    std::vector<unsigned char> host(n, 0), all(n * static_cast<size_t>(size_));
    std::memcpy(host.data(), in, bytes);
    void* dev = nullptr;
    GDNCP_CUDA_CHECK(cudaMallocAsync(&dev, n * (1 + static_cast<size_t>(size_)), record_stream_));
    unsigned char* send = static_cast<unsigned char*>(dev);
    unsigned char* recv = send + n;
    const auto deadline = Clock::now() + as_duration(timeout_seconds_);
    GDNCP_CUDA_CHECK(cudaMemcpyAsync(send, host.data(), n, cudaMemcpyHostToDevice, record_stream_));
    ncclResult_t r = ncclAllGather(send, recv, n, ncclUint8, record_comm_, record_stream_);
    if (r == ncclInProgress) r = settle(record_comm_, deadline);
    if (r != ncclSuccess)
      abort_and_throw(std::string(what) + ": ncclAllGather " +
                      (r == ncclInProgress ? std::string("could not be enqueued in time") : ncclGetErrorString(r)));
    GDNCP_CUDA_CHECK(cudaMemcpyAsync(all.data(), recv, all.size(), cudaMemcpyDeviceToHost, record_stream_));
    GDNCP_CUDA_CHECK(cudaFreeAsync(dev, record_stream_));
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaStreamQuery(record_stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) GDNCP_CUDA_CHECK(q);
      if (Clock::now() > deadline)
        abort_and_throw(std::string(what) + " did not complete within the deadline of " +
                        seconds_str(timeout_seconds_) +
                        " s (a rank lost or out of step: under Validation::on_change a rank whose call record "
                        "changed alone waits here while the others are in their data collectives)");
      pause(spins);
    }
    for (int k = 0; k < size_; ++k)
      std::memcpy(static_cast<unsigned char*>(out) + static_cast<size_t>(k) * bytes, all.data() + k * n, bytes);
  }

  ncclComm_t comm_ = nullptr;
  bool owned_ = false;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<Communicator> host_;
  ncclComm_t record_comm_ = nullptr;  // the validation channel without MPI
  cudaStream_t record_stream_ = nullptr;
  int rank_ = 0, size_ = 1, device_ = 0;
  int64_t seq_ = 0;
  cudaEvent_t order_ = nullptr;
  void* headers_ = nullptr;           // device: this rank's call header, then every rank's
  int64_t call_seq_ = 0;              // call headers sent (Note [NCCL call headers])
  std::vector<void*> header_blocks_;  // pinned blocks of size_ headers (all of them)
  std::vector<void*> free_blocks_;    // ... not in use (under mu_)
  bool finalized_ = false;            // comm_ finalized and destroyed: its buffers can go

  mutable std::mutex mu_;          // guards what the watchdog shares: queue_, pool_
  std::mutex call_mu_;             // held by the calling thread while NCCL enqueues
  mutable std::mutex reason_mu_;   // guards reason_ (and the first abort)
  std::atomic<bool> gone_{false};  // comm_ destroyed (set under reason_mu_ and mu_)
  std::atomic<bool> in_call_{false};
  std::atomic<const char*> in_call_name_{""};
  std::atomic<Clock::time_point> in_call_deadline_{Clock::time_point()};
  std::condition_variable cv_;
  std::deque<Watch> queue_;
  std::vector<cudaEvent_t> pool_;
  std::string reason_;
  std::atomic<bool> aborted_{false};
  bool stop_ = false;
  std::thread watchdog_;
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
  // Blocking (NCCL's default): a collective returns once enqueued, with no
  // polling; a call stuck in connection set-up is ended by the watchdog.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
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
  // Blocking init: a non-blocking communicator answers ncclInProgress on
  // every later call, which would make each collective poll on the host.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t nc = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&nc, size, nid, rank, &config);
  GDNCP_CHECK(r == ncclSuccess, "make_nccl_communicator: ncclCommInitRankConfig on rank ", rank, " (device ", device,
              ") failed: ", ncclGetErrorString(r));
  const double timeout = 300.0;
  return std::make_shared<NcclCommunicator>(nc, true, nullptr, timeout);
}

namespace detail {
bool announce_call(Communicator& comm, int64_t entry_hash, const char* entry, int64_t key, const std::string& bad,
                   bool wait) {
  if (auto* n = dynamic_cast<NcclCommunicator*>(&comm)) return n->announce(entry_hash, entry, key, bad, wait);
  return wait;
}
}  // namespace detail

#else  // !GDNCP_WITH_CUDA

namespace detail {
bool announce_call(Communicator&, int64_t, const char*, int64_t, const std::string&, bool wait) { return wait; }
}  // namespace detail

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
