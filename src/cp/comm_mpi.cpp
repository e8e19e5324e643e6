// src/cp/comm_mpi.cpp — the MPI communicator (CPU tensors) and the local-rank
// bootstrap shared with the NCCL communicator.
//
// Note [MPI collectives]: every collective is nonblocking (MPI_I*) on a
// duplicate of the caller's communicator whose error handler returns errors.
// CPU data is read by the host right after the call, so the call completes
// its request there (its point of use), polling MPI_Test against a deadline of
// timeout_seconds(). A miss marks the communicator aborted and throws naming
// the collective and the deadline; the request cannot be cancelled in MPI, so
// it is abandoned with its buffers (kept alive, never freed: MPI may still
// write them) and the duplicate is never freed. Every later call throws at
// once, and the destructor of an aborted communicator returns without
// waiting. MPI_Finalize synchronises with every rank and can hang after a
// rank was lost: such a process ends with MPI_Abort or _exit.
//
// Note [collective trailer]: each collective sends its payload followed by a
// trailer (kind, payload size, sequence number on this communicator), and the
// receivers check every rank's trailer. Ranks in different collectives — one
// in a layer's all-gather, another in all_reduce_grads, or one in a validation
// exchange the others skipped — then fail at once with a message naming both
// collectives, instead of a truncated message killing the job or a
// same-sized message being read as data. (A message too long for its slot is
// MPI_ERR_TRUNCATE; one too short leaves the trailer slot poisoned.)
#include <mpi.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
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

// Ranks per node of comm when its nodes hold equal blocks of consecutive ranks, else 0
// (Communicator::node_size). Collective over comm: run where the communicator is made.
int detect_node_size(MPI_Comm comm) {
  MPI_Comm shared;
  GDNCP_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &shared));
  int mine[2] = {0, 0};
  int rc = MPI_Comm_rank(shared, &mine[0]);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(shared, &mine[1]);
  MPI_Comm_free(&shared);
  GDNCP_MPI_CHECK(rc);
  int P = 0;
  GDNCP_MPI_CHECK(MPI_Comm_size(comm, &P));
  std::vector<int> all(static_cast<size_t>(2 * P));
  GDNCP_MPI_CHECK(MPI_Allgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, comm));
  const int n = all[1];
  for (int r = 0; r < P; ++r)
    if (all[2 * r + 1] != n || all[2 * r] != r % n) return 0;
  return n;
}

using Clock = std::chrono::steady_clock;

bool mpi_usable() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

std::string mpi_error_string(int code) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, msg, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(msg, static_cast<size_t>(len));
}

// Open MPI 4 reports an error of a nonblocking collective's request through
// MPI_COMM_WORLD's handler (fatal by default), not through the handler of the
// request's communicator: while a request is tested, world returns errors too.
// (The handler is swapped on the calling thread's behalf: gdncp's MPI use is
// single-threaded, MPI_THREAD_SINGLE or FUNNELED.)
class WorldReturnsErrors {
 public:
  WorldReturnsErrors() {
    ok_ = MPI_Comm_get_errhandler(MPI_COMM_WORLD, &old_) == MPI_SUCCESS &&
          MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN) == MPI_SUCCESS;
  }
  ~WorldReturnsErrors() {
    if (!ok_) return;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, old_);
    MPI_Errhandler_free(&old_);
  }
  WorldReturnsErrors(const WorldReturnsErrors&) = delete;
  WorldReturnsErrors& operator=(const WorldReturnsErrors&) = delete;

 private:
  MPI_Errhandler old_ = MPI_ERRHANDLER_NULL;
  bool ok_ = false;
};

enum class Kind : int64_t { all_gather = 1, all_reduce_sum, broadcast, barrier, host_gather, record, send_recv };

const char* kind_name(int64_t k) {
  switch (static_cast<Kind>(k)) {
    case Kind::all_gather:
      return "all_gather";
    case Kind::all_reduce_sum:
      return "all_reduce_sum";
    case Kind::broadcast:
      return "broadcast";
    case Kind::barrier:
      return "barrier";
    case Kind::host_gather:
      return "all_gather_host";
    case Kind::record:
      return "the validation exchange of a CP entry";
    case Kind::send_recv:
      return "send_recv";
  }
  return "an unknown collective";
}

// Note [collective trailer].
struct Trailer {
  int64_t magic = 0;
  int64_t kind = 0;
  int64_t bytes = 0;
  int64_t seq = 0;
};
constexpr int64_t kMagic = 0x67646e6370747231;  // "gdncptr1"

// Payload + trailer of one rank, 8-byte aligned.
size_t slot_bytes(size_t payload) { return (payload + 7) / 8 * 8 + sizeof(Trailer); }

std::string seconds_str(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

using Buffer = std::shared_ptr<std::vector<unsigned char>>;
Buffer buffer(size_t n) { return std::make_shared<std::vector<unsigned char>>(n, 0); }

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) {
    GDNCP_CHECK(mpi_usable(), "make_mpi_communicator: MPI is not initialised (call MPI_Init first)");
    GDNCP_CHECK(comm != MPI_COMM_NULL, "make_mpi_communicator: comm is MPI_COMM_NULL");
    GDNCP_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
    GDNCP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    GDNCP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    GDNCP_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    node_size_ = detect_node_size(comm_);  // collective like the duplicate: no collective later
  }

  // Never waits: an aborted communicator keeps its duplicate and the buffers
  // of its abandoned request (Note [MPI collectives]).
  ~MpiCommunicator() override {
    if (aborted_) {
      new std::vector<Buffer>(std::move(abandoned_));  // MPI may still write them: never freed
      return;
    }
    if (mpi_usable()) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu; }
  bool aborted() const override { return aborted_; }
  std::string abort_reason() const override { return reason_; }
  const char* backend() const override { return "mpi"; }
  int node_size() const override { return node_size_; }

  void all_gather(Tensor& out, const Tensor& in) override {
    check("all_gather");
    check_cpu(in, "all_gather: in");
    check_cpu(out, "all_gather: out");
    GDNCP_CHECK(out.dtype() == in.dtype(), "all_gather: out dtype ", dtype_name(out.dtype()), " != in dtype ",
                dtype_name(in.dtype()));
    GDNCP_CHECK(out.numel() == in.numel() * size_, "all_gather: out has ", out.numel(), " elements, expected size()·",
                in.numel(), " = ", in.numel() * size_);
    gather(out.data(), in.data(), in.nbytes(), Kind::all_gather, false);
  }

  void all_reduce_sum(Tensor& t) override {
    check("all_reduce_sum");
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
    gather(all.data(), t.data(), t.nbytes(), Kind::all_reduce_sum, false);
    if (t.dtype() == DType::f64)
      sum_ranks<double>(t, all);
    else
      sum_ranks<float>(t, all);
  }

  void broadcast(Tensor& t, int root) override {
    check("broadcast");
    check_cpu(t, "broadcast: t");
    GDNCP_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of a group of ", size_);
    const size_t n = t.nbytes(), slot = slot_bytes(n);
    Buffer buf = buffer(slot);
    const Trailer want = trailer(Kind::broadcast, n);
    if (rank_ == root) {
      std::memcpy(buf->data(), t.data(), n);
      std::memcpy(buf->data() + slot - sizeof(Trailer), &want, sizeof want);
    }
    MPI_Request req;
    start(MPI_Ibcast(buf->data(), count(slot, "broadcast"), MPI_BYTE, root, comm_, &req), "MPI_Ibcast");
    wait(req, "MPI_Ibcast", {buf}, n, false);
    check_trailer(buf->data() + slot - sizeof(Trailer), root, want, "MPI_Ibcast");
    if (rank_ != root) std::memcpy(t.data(), buf->data(), n);
  }

  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    check("send_recv");
    GDNCP_CHECK(dst >= -1 && dst < size_, "send_recv: dst ", dst, " is not a rank (or -1)");
    GDNCP_CHECK(src >= -1 && src < size_, "send_recv: src ", src, " is not a rank (or -1)");
    if (src >= 0) check_cpu(recv, "send_recv: recv");
    if (dst >= 0) check_cpu(send, "send_recv: send");
    const Trailer mine = trailer(Kind::send_recv, dst >= 0 ? send.nbytes() : 0);
    std::vector<MPI_Request> reqs;
    Buffer in, out;
    if (src >= 0) {
      in = buffer(slot_bytes(recv.nbytes()));
      MPI_Request r;
      start(MPI_Irecv(in->data(), count(in->size(), "send_recv"), MPI_BYTE, src, kHaloTag, comm_, &r), "MPI_Irecv");
      reqs.push_back(r);
    }
    if (dst >= 0) {
      out = buffer(slot_bytes(send.nbytes()));
      std::memcpy(out->data(), send.data(), send.nbytes());
      std::memcpy(out->data() + out->size() - sizeof(Trailer), &mine, sizeof mine);
      MPI_Request r;
      start(MPI_Isend(out->data(), count(out->size(), "send_recv"), MPI_BYTE, dst, kHaloTag, comm_, &r), "MPI_Isend");
      reqs.push_back(r);
    }
    for (auto& r : reqs) wait(r, "MPI_Isend/MPI_Irecv", {in, out}, 0, false);
    if (src >= 0) {
      Trailer want = mine;
      want.bytes = static_cast<int64_t>(recv.nbytes());
      check_trailer(in->data() + in->size() - sizeof(Trailer), src, want, "MPI_Irecv");
      std::memcpy(recv.data(), in->data(), recv.nbytes());
    }
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.bytes += static_cast<int64_t>(dst >= 0 ? send.nbytes() : 0);
  }

  void barrier() override {
    check("barrier");
    gather(nullptr, nullptr, 0, Kind::barrier, true);
  }

  void all_gather_host(void* out, const void* in, size_t bytes) override {
    check("all_gather_host");
    gather(out, in, bytes, Kind::host_gather, true);
  }

  void exchange_record(void* out, const void* in, size_t bytes) override {
    check("the validation exchange");
    GDNCP_CHECK(bytes <= kRecordBytes, "exchange_record: ", bytes, " bytes exceed kRecordBytes = ", kRecordBytes);
    gather(out, in, bytes, Kind::record, true);
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.validations += 1;
  }

 private:
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

  void check(const char* what) const {
    check_usable(what);
    GDNCP_CHECK(mpi_usable(), what, ": MPI is finalised");
  }
  static void check_cpu(const Tensor& t, const char* what) {
    GDNCP_CHECK(t.defined(), what, " is undefined");
    GDNCP_CHECK(t.device() == Device::cpu, what, " is on ", device_name(t.device()),
                "; the MPI communicator takes CPU tensors (use the NCCL communicator for CUDA tensors)");
  }
  static int count(size_t n, const char* what) {
    GDNCP_CHECK(n <= static_cast<size_t>(INT32_MAX), what, ": ", n, " bytes exceed MPI's int count");
    return static_cast<int>(n);
  }

  Trailer trailer(Kind kind, size_t bytes) {
    Trailer t;
    t.magic = kMagic;
    t.kind = static_cast<int64_t>(kind);
    t.bytes = static_cast<int64_t>(bytes);
    t.seq = seq_++;
    return t;
  }

  [[noreturn]] void abort_with(const std::string& why) {
    aborted_ = true;
    reason_ = why;
    GDNCP_FAIL(why, "; the MPI communicator is aborted");
  }

  void start(int rc, const char* call) {
    if (rc != MPI_SUCCESS)
      abort_with(std::string(call) + " failed on rank " + std::to_string(rank_) + ": " + mpi_error_string(rc));
  }

  // The all-gather of `bytes` per rank behind all_gather, all_reduce_sum,
  // barrier, all_gather_host and exchange_record (Note [collective trailer]).
  void gather(void* out, const void* in, size_t bytes, Kind kind, bool host_wait) {
    const size_t slot = slot_bytes(bytes);
    Buffer send = buffer(slot), recv = buffer(slot * static_cast<size_t>(size_));
    const Trailer want = trailer(kind, bytes);
    if (bytes) std::memcpy(send->data(), in, bytes);
    std::memcpy(send->data() + slot - sizeof(Trailer), &want, sizeof want);
    const int n = count(slot, kind_name(static_cast<int64_t>(kind)));
    MPI_Request req;
    start(MPI_Iallgather(send->data(), n, MPI_BYTE, recv->data(), n, MPI_BYTE, comm_, &req), "MPI_Iallgather");
    wait(req, "MPI_Iallgather", {send, recv}, bytes, host_wait);
    for (int r = 0; r < size_; ++r)
      check_trailer(recv->data() + static_cast<size_t>(r + 1) * slot - sizeof(Trailer), r, want, "MPI_Iallgather");
    for (int r = 0; r < size_ && bytes; ++r)
      std::memcpy(static_cast<unsigned char*>(out) + static_cast<size_t>(r) * bytes,
                  recv->data() + static_cast<size_t>(r) * slot, bytes);
  }

  void check_trailer(const unsigned char* at, int from, const Trailer& want, const char* call) {
    Trailer got;
    std::memcpy(&got, at, sizeof got);
    if (got.magic == want.magic && got.kind == want.kind && got.bytes == want.bytes && got.seq == want.seq) return;
    const std::string here = std::string(kind_name(want.kind)) + " (" + std::to_string(want.bytes) +
                             " bytes, collective #" + std::to_string(want.seq) + ")";
    if (got.magic != kMagic)
      abort_with(std::string(call) + ": the ranks are out of step: rank " + std::to_string(from) +
                 " sent a message of another size than " + here + " on rank " + std::to_string(rank_) +
                 " expects (it is in a different collective or call)");
    abort_with(std::string(call) + ": the ranks are out of step: rank " + std::to_string(from) + " is in " +
               kind_name(got.kind) + " (" + std::to_string(got.bytes) + " bytes, collective #" +
               std::to_string(got.seq) + ") while rank " + std::to_string(rank_) + " is in " + here);
  }

  // Completes req at its point of use, polling until the deadline (Note [MPI
  // collectives]). Yields the core between polls: test runs put several ranks
  // on one core.
  void wait(MPI_Request& req, const char* call, std::vector<Buffer> keep, size_t bytes, bool host_wait) {
    const auto start = Clock::now();
    const auto deadline =
        start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds_));
    int done = 0;
    {
      WorldReturnsErrors world_returns;
      for (int spins = 0;; ++spins) {
        const int rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
          std::string why = std::string(call) + " failed on rank " + std::to_string(rank_) + " of " +
                            std::to_string(size_) + ": " + mpi_error_string(rc);
          int cls = 0;
          MPI_Error_class(rc, &cls);
          if (cls == MPI_ERR_TRUNCATE)
            why +=
                " (a message of another rank did not fit: the ranks are out of step, in different collectives "
                "or calls)";
          if (!done) abandoned_.insert(abandoned_.end(), keep.begin(), keep.end());
          abort_with(why);
        }
        if (done) break;
        if (Clock::now() > deadline) {
          abandoned_.insert(abandoned_.end(), keep.begin(), keep.end());
          abort_with(std::string(call) + " did not complete within the deadline of " + seconds_str(timeout_seconds_) +
                     " s on rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                     " (a rank lost, stopped or out of step)");
        }
        if (spins < 64)
          std::this_thread::yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(spins < 4096 ? 20 : 200));
      }
    }
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.calls += 1;
    stats_.bytes += static_cast<int64_t>(bytes);
    stats_.seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (host_wait) stats_.host_waits += 1;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  int64_t seq_ = 0;
  int node_size_ = 0;  // node_size(), detected at construction
  bool aborted_ = false;
  std::string reason_;
  std::vector<Buffer> abandoned_;
};

}  // namespace

std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) { return std::make_shared<MpiCommunicator>(comm); }

}  // namespace cp
}  // namespace gdncp
