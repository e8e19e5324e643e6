// src/cp/comm/comm_mpi.cpp — the MPI communicator (CPU tensors) and the local-rank
// bootstrap shared with the NCCL communicator.
//
// Note [MPI collectives]: a collective is a set of nonblocking messages
// (MPI_Isend, and MPI_Improbe + MPI_Imrecv) on a duplicate of the caller's
// communicator whose error handler returns errors. CPU data is read by the
// host right after the call, so the call completes its messages there (its
// point of use), polling against a deadline of timeout_seconds(). A miss
// marks the communicator aborted and throws naming the collective and the
// deadline; a request cannot be cancelled in MPI, so its buffers are
// abandoned (kept alive, never freed: MPI may still use them) and the
// duplicate is never freed. Every later call throws at once, and the
// destructor of an aborted communicator returns without waiting. After any
// abort, finalize_mpi() skips MPI_Finalize, which synchronises with every
// rank, a lost one included.
//
// Note [collective header] (cp/comm/collective_header.h), the MPI way: each
// rank sends every peer of a collective one message, the header followed by
// its payload, and receives each peer's message at the size that arrives
// (probed first): no count of an MPI call can disagree between ranks, and no
// receive buffer is sized from what this rank expected. Ranks in different
// collectives — one in a layer's all-gather, another in all_reduce_grads, or
// one in a validation exchange the others skipped — with different sizes, or
// with a bad argument on one rank fail at once on every rank. Every rank has
// then taken one message from every peer: the sequence numbers are
// realigned, the validation memory is dropped (the next call validates afresh
// on every rank) and the communicator stays usable. Only an MPI failure or a
// missed deadline aborts it. (A late rank's messages to peers that gave up
// stay unmatched there; their communicator is aborted and never reads again.)
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cp/comm/collective_header.h"
#include "cp/validate_cp.h"
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
    case Kind::all_gather: return "all_gather";
    case Kind::all_reduce_sum: return "all_reduce_sum";
    case Kind::broadcast: return "broadcast";
    case Kind::barrier: return "barrier";
    case Kind::host_gather: return "all_gather_host";
    case Kind::record: return "the validation exchange of a CP entry";
    case Kind::send_recv: return "send_recv";
  }
  return "an unknown collective";
}

using Header = detail::CollectiveHeader;  // Note [collective header]

std::string seconds_str(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

using Buffer = std::shared_ptr<std::vector<unsigned char>>;
Buffer buffer(size_t n) { return std::make_shared<std::vector<unsigned char>>(n, 0); }

// Runs a collective's local argument checks: "" when they pass, else the error
// (sent in the header, so that every rank raises it).
std::string argument_error(const std::function<void()>& checks) {
  try {
    checks();
  } catch (const Error& e) {
    return e.what();
  }
  return std::string();
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
    node_size_ = detect_node_size(comm_);  // collective like the duplicate: no collective later
  }

  // Never waits: an aborted communicator keeps its duplicate and the buffers
  // of its abandoned request (Note [MPI collectives]).
  ~MpiCommunicator() override {
    if (aborted_) {
      new std::vector<Buffer>(std::move(abandoned_));  // MPI may still write them: never freed
      return;
    }
    // After any abort in this process a peer may be lost: the duplicate is left
    // to the process's end rather than risk a wait in MPI_Comm_free.
    if (mpi_usable() && !any_communicator_aborted()) MPI_Comm_free(&comm_);
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
    const std::string bad = argument_error([&] {
      check_cpu(in, "all_gather: in");
      check_cpu(out, "all_gather: out");
      detail::check_all_gather_args(out, in, size_);
    });
    if (!bad.empty()) return gather(nullptr, nullptr, 0, Kind::all_gather, false, bad);
    gather(out.data(), in.data(), in.nbytes(), Kind::all_gather, false);
  }

  void all_reduce_sum(Tensor& t) override {
    check("all_reduce_sum");
    const std::string bad = argument_error([&] { check_cpu(t, "all_reduce_sum: t"); });
    if (!bad.empty()) return gather(nullptr, nullptr, 0, Kind::all_reduce_sum, false, bad);
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
    const std::string bad = argument_error([&] {
      check_cpu(t, "broadcast: t");
      GDNCP_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of a group of ", size_);
    });
    gather(bad.empty() ? t.data() : nullptr, bad.empty() ? t.data() : nullptr, bad.empty() ? t.nbytes() : 0,
           Kind::broadcast, false, bad, root);
  }

  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    check("send_recv");
    GDNCP_CHECK(dst >= -1 && dst < size_, "send_recv: dst ", dst, " is not a rank (or -1)");
    GDNCP_CHECK(src >= -1 && src < size_, "send_recv: src ", src, " is not a rank (or -1)");
    // A bad tensor still sends its header to dst (whose receive raises it) and
    // takes the message of src before raising here.
    const std::string bad = argument_error([&] {
      if (src >= 0) check_cpu(recv, "send_recv: recv");
      if (dst >= 0) check_cpu(send, "send_recv: send");
    });
    const Header mine = header(Kind::send_recv, dst >= 0 && bad.empty() ? send.nbytes() : 0, bad);
    const Buffer msg = message(mine, dst >= 0 && bad.empty() ? send.data() : nullptr);
    std::vector<int> to, from;
    if (dst >= 0) to.push_back(dst);
    if (src >= 0) from.push_back(src);
    const std::vector<Buffer> got = exchange(msg, to, from, "send_recv", static_cast<size_t>(mine.bytes), false);
    if (!bad.empty()) throw Error(bad);
    if (src < 0) return;
    Header want = mine;
    want.bytes = static_cast<int64_t>(recv.nbytes());
    check_headers({header_of(got[0])}, {src}, want, "send_recv");
    check_size(got[0], recv.nbytes(), src);
    if (recv.nbytes()) std::memcpy(recv.data(), got[0]->data() + sizeof(Header), recv.nbytes());
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
  static constexpr int kTag = 4242;  // every message of every collective: ranks out of step meet

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

  Header header(Kind kind, size_t bytes, const std::string& bad, int64_t root = 0) {
    const int64_t k = static_cast<int64_t>(kind);
    return detail::make_header(k, kind_name(k), static_cast<int64_t>(bytes), seq_++, bad, root);
  }

  [[noreturn]] void abort_with(const std::string& why) {
    aborted_ = true;
    detail::note_abort();
    reason_ = why;
    GDNCP_FAIL(why, "; the MPI communicator is aborted");
  }

  void start(int rc, const char* call) {
    if (rc != MPI_SUCCESS)
      abort_with(std::string(call) + " failed on rank " + std::to_string(rank_) + ": " + mpi_error_string(rc));
  }

  // A collective's message: the header, then (payload non-null) header.bytes of payload.
  static Buffer message(const Header& h, const void* payload) {
    Buffer m = buffer(sizeof(Header) + (payload ? static_cast<size_t>(h.bytes) : 0));
    std::memcpy(m->data(), &h, sizeof h);
    if (payload && h.bytes) std::memcpy(m->data() + sizeof(Header), payload, static_cast<size_t>(h.bytes));
    return m;
  }
  // The header of a received message (magic 0 when it is too short to hold one).
  static Header header_of(const Buffer& m) {
    Header h;
    if (m->size() >= sizeof(Header)) std::memcpy(&h, m->data(), sizeof h);
    return h;
  }
  // A message whose header passed check_headers carries its payload whole.
  void check_size(const Buffer& m, size_t payload, int from) {
    if (m->size() == sizeof(Header) + payload) return;
    clear_validated();
    GDNCP_FAIL("the message of rank ", from, " holds ", m->size() - sizeof(Header), " payload bytes, its header ",
               payload);
  }

  // The all-gather of `bytes` per rank behind all_gather, all_reduce_sum,
  // barrier, all_gather_host, exchange_record and (root ≥ 0: only the root's
  // payload travels, into out) broadcast. bad: this rank's argument error
  // ("" = none), sent instead of a payload. Every rank sees every rank's
  // header, so every rank reaches the same verdict (Note [collective header]).
  void gather(void* out, const void* in, size_t bytes, Kind kind, bool host_wait, const std::string& bad = "",
              int root = -1) {
    const Header mine = header(kind, bytes, bad, root);
    const bool carries = bad.empty() && (root < 0 || root == rank_);
    const Buffer msg = message(mine, carries ? in : nullptr);
    std::vector<int> peers;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) peers.push_back(r);
    const char* call = kind_name(static_cast<int64_t>(kind));
    const std::vector<Buffer> got = exchange(msg, peers, peers, call, bytes, host_wait);
    std::vector<Buffer> all(static_cast<size_t>(size_));
    std::vector<Header> hs(static_cast<size_t>(size_));
    for (int r = 0, k = 0; r < size_; ++r) {
      all[static_cast<size_t>(r)] = r == rank_ ? msg : got[static_cast<size_t>(k++)];
      hs[static_cast<size_t>(r)] = header_of(all[static_cast<size_t>(r)]);
    }
    check_headers(hs, {}, mine, call);
    for (int r = 0; r < size_; ++r) check_size(all[static_cast<size_t>(r)], root < 0 || r == root ? bytes : 0, r);
    if (bytes == 0) return;
    if (root >= 0) {
      if (rank_ != root) std::memcpy(out, all[static_cast<size_t>(root)]->data() + sizeof(Header), bytes);
      return;
    }
    for (int r = 0; r < size_; ++r)
      std::memcpy(static_cast<unsigned char*>(out) + static_cast<size_t>(r) * bytes,
                  all[static_cast<size_t>(r)]->data() + sizeof(Header), bytes);
  }
  // Sends msg to every rank of `to` and takes one message from every rank of
  // `from` (in that order), each received at the size that arrives (probed
  // first), so no count can disagree. Polls until all are done or the
  // deadline (Note [MPI collectives]); counts one call.
  std::vector<Buffer> exchange(const Buffer& msg, const std::vector<int>& to, const std::vector<int>& from,
                               const char* call, size_t bytes, bool host_wait) {
    const auto t0 = Clock::now();
    std::vector<Buffer> keep = {msg};  // alive until MPI is done with them (abandoned on a miss)
    std::vector<MPI_Request> sends(to.size(), MPI_REQUEST_NULL), recvs(from.size(), MPI_REQUEST_NULL);
    std::vector<Buffer> got(from.size());
    std::vector<char> matched(from.size(), 0);
    WorldReturnsErrors world_returns;
    for (size_t i = 0; i < to.size(); ++i)
      start(MPI_Isend(msg->data(), count(msg->size(), call), MPI_BYTE, to[i], kTag, comm_, &sends[i]), "MPI_Isend");
    const auto deadline =
        t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds_));
    for (int spins = 0;; ++spins) {
      bool all_matched = true;
      for (size_t i = 0; i < from.size(); ++i) {
        if (matched[i]) continue;
        int flag = 0, n = 0;
        MPI_Message m;
        MPI_Status st;
        progress(MPI_Improbe(from[i], kTag, comm_, &flag, &m, &st), "MPI_Improbe", keep);
        if (!flag) {
          all_matched = false;
          continue;
        }
        progress(MPI_Get_count(&st, MPI_BYTE, &n), "MPI_Get_count", keep);
        got[i] = buffer(static_cast<size_t>(std::max(n, 0)));
        keep.push_back(got[i]);
        progress(MPI_Imrecv(got[i]->data(), n, MPI_BYTE, &m, &recvs[i]), "MPI_Imrecv", keep);
        matched[i] = 1;
      }
      int recvs_done = 0, sends_done = 0;
      progress(MPI_Testall(static_cast<int>(recvs.size()), recvs.data(), &recvs_done, MPI_STATUSES_IGNORE),
               "MPI_Testall (receives)", keep);
      progress(MPI_Testall(static_cast<int>(sends.size()), sends.data(), &sends_done, MPI_STATUSES_IGNORE),
               "MPI_Testall (sends)", keep);
      if (all_matched && recvs_done && sends_done) break;
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
    detail::count_collective(stats_mu_, stats_, bytes, t0, host_wait);
    return got;
  }

  // An MPI failure while requests are in flight aborts (their buffers abandoned).
  void progress(int rc, const char* what, const std::vector<Buffer>& keep) {
    if (rc == MPI_SUCCESS) return;
    abandoned_.insert(abandoned_.end(), keep.begin(), keep.end());
    abort_with(std::string(what) + " failed on rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ": " +
               mpi_error_string(rc));
  }

  void check_headers(const std::vector<Header>& got, const std::vector<int>& from, const Header& want,
                     const char* call) {
    const std::string why = detail::header_verdict(
        got, from, want, rank_, size_, call, static_cast<int64_t>(Kind::record),
        " (a CP entry validates its call on a rank whose arguments changed or are bad while the others go on with "
        "the record they validated last: the sizes and options of a call must agree on every rank; the next call "
        "validates afresh on every rank)");
    if (why.empty()) return;
    int64_t top = want.seq;
    for (const Header& h : got)
      if (h.magic == detail::kHeaderMagic) top = std::max(top, h.seq);
    seq_ = top + 1;
    clear_validated();
    throw Error(why);
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

bool finalize_mpi() {
  int init = 0, fin = 0;
  GDNCP_MPI_CHECK(MPI_Initialized(&init));
  GDNCP_MPI_CHECK(MPI_Finalized(&fin));
  if (!init || fin) return true;
  if (any_communicator_aborted()) return false;  // MPI_Finalize would wait for the lost rank
  GDNCP_MPI_CHECK(MPI_Finalize());
  return true;
}

}  // namespace cp
}  // namespace gdncp
