// gdncp/cp.h — context parallelism: communicators, the distributed frame scan
// and the CP layers (docs/design.md §6-7).
//
// Rank r of a CP group of P ranks holds the F_r ≥ 0 consecutive frames
// [o_r, o_r + F_r) of a global sequence of F_total = Σ F_r frames, o_r =
// Σ_{j<r} F_j (any split: 21 frames on 2 ranks = 11 + 10; balanced_split()
// gives the even one). A rank with F_r = 0 still joins every collective and
// returns empty outputs and gradients. Every entry here is collective over
// the group and returns what one rank holding the whole sequence would
// compute for this rank's frames, forward and every gradient. Communication
// is O(P·D²), independent of S, F_r and the split: ONE all-gather of the
// per-rank composites in forward and ONE in backward (plus one small
// exchange of the sizes, when the Validation policy calls for it, that
// validates the call on every rank before anything else is sent).
//
// Packed clips (docs/design.md §4a): the entries that take `clip_starts` accept a
// per-rank mask (B, F_r), f32, on the inputs' device: 1 where frame f of row
// b begins a clip, 0 elsewhere. Any other value is a gdncp::Error naming
// clip_starts: at once for a CPU mask; a CUDA mask is checked on the device
// (no host wait), the outputs and gradients of that call become NaN, and the
// next call of an entry that takes a mask raises on every rank
// (docs/design.md §9). No state crosses a clip
// start in either direction, so out and every gradient equal running each
// clip as its own row. Clips may cross rank boundaries and rows may pack
// differently. Undefined = one clip per row. Global frame 0 starts a clip
// whatever the mask says (nothing comes before it).
//
// Errors: every entry validates its arguments locally, then exchanges the
// result with the other ranks, so a bad argument on any rank — or sizes that
// must agree and differ between ranks (S, B, H, D, dtype, options), or every
// rank holding 0 frames — raises gdncp::Error on EVERY rank (naming the
// argument and the rank), never a hang or garbage. F_r may differ, and change
// on any rank at any call. The exchange follows the communicator's Validation
// policy: under on_change (the default) a rank whose sizes or options change
// while the others' do not is out of step with them: it names its own bad
// argument, the others raise that the ranks are out of step or name the bad
// argument and its rank — at once (NCCL: at their next call, the
// communicator aborted unless every rank validated that call).
//
// Checkpointing (BigdnOptions::checkpoint, docs/design.md §7): `on` keeps only the
// inputs and recomputes in backward. The recompute issues no collective: the
// gathered composites (O(P·BH·D²)) are kept from the forward, so it cannot
// deadlock and gives bitwise the same gradients as `off`.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gdncp/bigdn.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace cp {

namespace detail {
struct ValidationMemory;
}

// How the CP entries check that the ranks agree on sizes and options before
// their data collectives (docs/design.md §9-10). The check exchanges a small
// host record of the call over the group:
//   every_call — on every call;
//   on_change  — only when this rank's record (its F left out) differs from
//                the last one it validated for the same entry on this
//                communicator (default: a steady-state step exchanges nothing);
//   off        — no check.
// Under every policy: F_r may change on any rank at any call without an
// exchange (the scan needs no other rank's F), except with
// truncate_to_active, which places the frozen frames from every rank's F and
// so exchanges on every call; a rank with a bad argument exchanges, so that
// its error reaches every rank at once. A rank that exchanges while the
// others skip (its arguments changed alone, or are bad) meets their data
// collective: the collectives carry their kind and size and check them
// before any payload moves (MPI), so every rank raises at once, naming the
// out-of-step ranks, and the communicator stays usable (the next call
// validates afresh on every rank). NCCL's collectives carry no header: each
// call sends a call header of its own first (docs/design.md §10), whose
// verdict the ranks that validate raise at once and the others' watchdog
// turns into an abort, raised by their next call (the communicator is then
// lost: the collectives they enqueued cannot be withdrawn). Sizes that
// differ between ranks under off are caught the same way.
enum class Validation { every_call, on_change, off };
const char* validation_name(Validation v);

// A group of ranks that exchange tensors. CPU tensors go through MPI, CUDA
// tensors through NCCL on the current stream (gdncp::current_stream()), or
// either through the caller's own collectives (make_callback_communicator).
// All ranks must issue the same collectives in the same order.
//
// Asynchrony and failure (docs/design.md §10):
// - NCCL: a collective returns once it is enqueued; the host never waits for
//   the device (no stream or event synchronisation, no polling). A watchdog
//   thread of the communicator watches every enqueued collective against its
//   deadline (timeout_seconds() after the call) and NCCL's asynchronous
//   errors; on a miss or an error it calls ncclCommAbort, and the next call on
//   this communicator (and every gdncp CP entry given it) throws gdncp::Error
//   naming the collective and the deadline.
// - MPI: collectives are nonblocking (MPI_I*). CPU data is used by the host
//   right after the call, so the call completes its request at that point of
//   use, polling MPI_Test against the deadline; a miss marks the communicator
//   aborted and throws (MPI cannot abort one communicator: the request is
//   abandoned with its buffers kept alive, every later call throws at once).
//   MPI errors come back as gdncp::Error, never through MPI's fatal handler.
//   Each rank sends every peer of a collective one message: a fixed-size
//   header (kind, size, sequence number, the rank's argument error if any)
//   and its payload, received at the size that arrives (probed first), so no
//   count of an MPI call can disagree; every rank checks every header alike,
//   so ranks in different collectives, with different sizes or with a bad
//   argument on one of them raise at once on every rank, and the
//   communicator stays usable. Exit after an abort: finalize_mpi() below
//   returns without MPI_Finalize (which would wait for a lost rank).
// - A destructor of an aborted communicator never waits.
//
// Communicators are shared: an autograd node that runs collectives in
// backward shares the ownership of the communicator it was made with, so it
// may be released by its caller between forward and backward. A communicator
// used for a recorded (differentiable) call must be owned by a
// std::shared_ptr (as the factories below return it).
class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where the tensors handed to this communicator must live.
  virtual Device device() const = 0;
  // out (size(), *in.shape) = the in of every rank, in rank order.
  virtual void all_gather(Tensor& out, const Tensor& in) = 0;
  // In place sum over ranks (f32, f64; bf16 through f32). The result is
  // bitwise identical on every rank.
  virtual void all_reduce_sum(Tensor& t) = 0;
  virtual void broadcast(Tensor& t, int root) = 0;
  // Sends send to rank dst and receives recv from rank src in one step
  // (either rank may be -1 for none). For a halo exchange.
  virtual void send_recv(const Tensor& send, int dst, Tensor& recv, int src) = 0;
  // One transfer of send_recv_group: send to dst, receive into recv from src (-1: none).
  struct Transfer {
    Tensor send;
    int dst = -1;
    Tensor recv;
    int src = -1;
  };
  // Several transfers as one step (NCCL: one group, so that the two directions of a round of
  // the log exchange share the links' full duplex); every rank lists its transfers in the same
  // order. The default runs send_recv for each in turn.
  virtual void send_recv_group(std::vector<Transfer>& ts) {
    for (Transfer& t : ts) send_recv(t.send, t.dst, t.recv, t.src);
  }
  virtual void barrier() = 0;
  // Host memory all-gather of `bytes` bytes per rank into out (size()·bytes).
  // The host needs the result at once: a blocking wait (Stats::host_waits).
  virtual void all_gather_host(void* out, const void* in, size_t bytes) = 0;
  // The validation exchange of the CP entries: a host all-gather of a record
  // of at most kRecordBytes (padded to that size, so records of different
  // entries never truncate each other). A blocking wait; counted in
  // Stats::validations and Stats::host_waits.
  static constexpr size_t kRecordBytes = 1024;
  virtual void exchange_record(void* out, const void* in, size_t bytes);
  // True after a timeout or an asynchronous error aborted the communicator.
  virtual bool aborted() const = 0;
  // Why it was aborted ("" while usable): the collective, the deadline, the error.
  virtual std::string abort_reason() const { return aborted() ? "aborted" : ""; }
  // Throws gdncp::Error naming `what` and abort_reason() when aborted.
  void check_usable(const char* what) const;
  // Puts the work enqueued so far on the current stream under the watchdog's
  // deadline, labelled `what` — e.g. after replaying a CUDA graph whose
  // collectives were captured (captured collectives are not watched at
  // capture time: a graph replays them later). No-op for MPI.
  virtual void watch(const char* what) { (void)what; }
  // "mpi", "nccl" or "callbacks".
  virtual const char* backend() const = 0;
  // Ranks per node when the group fills its nodes in blocks of that many consecutive ranks,
  // else 0 (unknown or irregular). MPI: from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED), found
  // when the communicator is made (no collective here). NCCL: 0 (declare it:
  // CpOptions::node_size or GDNCP_CP_NODE_SIZE).
  virtual int node_size() const { return 0; }

  // Deadline of every collective, in seconds (finite and > 0; default 300).
  double timeout_seconds() const { return timeout_seconds_; }
  // s must be finite and > 0 (else gdncp::Error naming timeout_seconds).
  void set_timeout_seconds(double s);

  Validation validation() const { return validation_; }
  void set_validation(Validation v) { validation_ = v; }

  // Counters of this communicator. calls/bytes/seconds: collectives completed
  // (seconds measured on the device with events for NCCL, wall time for MPI).
  // host_waits: times the calling thread blocked on other ranks or on the
  // device beyond the point of use of a collective's result — validation and
  // host exchanges, barriers, and for NCCL any host wait at all (an
  // in-progress NCCL call settling, a stream synchronisation). A steady-state
  // CP layer call makes none. (An MPI data collective completes when the host
  // reads its result, right after the call: that wait is its point of use and
  // is not counted; it is bounded by the deadline.)
  // validations: record exchanges made by the validation policy.
  struct Stats {
    int64_t calls = 0;
    int64_t bytes = 0;
    double seconds = 0;
    int64_t host_waits = 0;
    int64_t validations = 0;
  };
  Stats stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
  }
  void reset_stats() {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_ = Stats();
  }

 protected:
  // Drops what the validation policy remembers, so that the next call of
  // every entry validates: after a collective found the ranks out of step.
  void clear_validated() { validated_.clear(); }
  double timeout_seconds_ = 300.0;
  Validation validation_ = Validation::on_change;
  mutable std::mutex stats_mu_;  // the NCCL watchdog counts completed collectives
  Stats stats_;

 private:
  friend struct detail::ValidationMemory;
  // The last record validated per entry (on_change): entry hash -> record bytes.
  std::map<int64_t, std::string> validated_;
};

// MPI communicator over a duplicate of comm (default MPI_COMM_WORLD; the caller
// keeps comm alive and MPI initialised while the communicator lives).
std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm = MPI_COMM_WORLD);

// NCCL communicator bootstrapped over comm: device = this process's local rank
// on its node (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) of MPI_COMM_WORLD, so
// that the CP groups of a DP×CP layout land on distinct GPUs) mod the device
// count (made the calling thread's current device), rank 0 makes the NCCL id
// and broadcasts it over MPI. Collectives run on the current stream.
// Throws when gdncp was built without CUDA or no device is visible.
// (The third bootstrap, from the caller's ncclComm_t + cudaStream_t, is in
// gdncp/cp_nccl.h because it needs nccl.h.)
std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm = MPI_COMM_WORLD);
// The same on an explicit device (device >= 0; -1 = the local-rank rule above),
// e.g. a one-rank group over MPI_COMM_SELF on the current device.
std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int device);

// True once a communicator (MPI or NCCL) of this process was aborted (a
// deadline missed, an MPI or NCCL error): a peer may be lost.
bool any_communicator_aborted();
// MPI_Finalize (when MPI is initialised and not finalised), except after a
// communicator of this process was aborted: MPI_Finalize synchronises
// with every rank, a lost one included, and could wait for it forever, so
// then it returns false without finalising (end the process: exit or _exit
// do not wait for the other ranks). True when MPI is finalised.
bool finalize_mpi();

// The local rank on this node (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)).
int local_rank(MPI_Comm comm = MPI_COMM_WORLD);

// Bootstrap without MPI (docs/design.md §11): one rank calls make_unique_id()
// and hands the bytes to the others by any means (torch.distributed, a file, a
// TCP store); every rank then calls make_nccl_communicator(id, rank, size,
// device), collectively. device >= 0 is made the calling thread's current
// device. The communicator owns its ncclComm_t; its host exchanges go through
// the device. Both throw gdncp::Error when gdncp was built without CUDA.
struct UniqueId {
  unsigned char bytes[128];  // an ncclUniqueId's bytes
};
UniqueId make_unique_id();
std::shared_ptr<Communicator> make_nccl_communicator(const UniqueId& id, int rank, int size, int device);

// A communicator whose collectives the caller runs (docs/design.md §11): e.g.
// a torch.distributed group of any backend (gloo on the CPU, a DeviceMesh's CP
// dimension), a trainer's own transport. The library needs two collectives:
//   all_gather(out, in, bytes, stream): out (size·bytes) = the `bytes` bytes at
//       in of every rank, in rank order;
//   broadcast(data, bytes, root, stream): root's `bytes` bytes at data to
//       every rank;
// and, optionally, send_recv(send, send_bytes, dst, recv, recv_bytes, src,
// stream) (dst/src -1 = none; the layers do not use it, an empty function
// makes Communicator::send_recv throw). The pointers are memory on `device`
// (host memory for Device::cpu); stream is the current stream
// (gdncp::current_stream(), nullptr on the CPU), on which a CUDA collective
// is enqueued. A callback returns "" on success, else a message: the
// communicator is then aborted and the call throws gdncp::Error naming the
// collective and the message (as will every later call on it).
// all_reduce_sum is an all_gather followed by a sum in rank order, so it is
// bitwise identical on every rank and in every run; host exchanges
// (validation records) stage through `device` memory (a host wait on CUDA).
//
// Deadlines: the library cannot interrupt or abandon a collective the
// caller runs, so it has no watchdog here and timeout_seconds() is not
// enforced. A lost or hung rank ends when the caller's transport gives up
// (torch.distributed's process-group timeout) and the callback returns an
// error; without such a timeout it hangs. Ranks out of step (in different
// collectives): on the CPU each collective is preceded by an all-gather of a
// small header (kind, bytes, sequence number), so they fail at once on every
// rank naming both; on CUDA (no header: it would cost a host wait per
// collective) only as far as the transport notices, at worst at its timeout.
struct CollectiveCallbacks {
  std::function<std::string(void* out, const void* in, size_t bytes, void* stream)> all_gather;
  std::function<std::string(void* data, size_t bytes, int root, void* stream)> broadcast;
  std::function<std::string(const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes, int src,
                            void* stream)>
      send_recv;
};
// rank in [0, size), size >= 1, device cpu or cuda (made with CUDA: the
// calling thread's current CUDA device); all_gather and broadcast given.
// backend() is "callbacks".
std::shared_ptr<Communicator> make_callback_communicator(CollectiveCallbacks callbacks, int rank, int size,
                                                         Device device);

// The balanced split of F_total frames over P ranks: the first F_total % P
// ranks hold one frame more; offset = Σ_{j<r} frames_j (the rank's first
// global frame: its RoPE rows and its slice of the data). F_total ≥ 0, P ≥ 1,
// r in [0, P); anything else throws gdncp::Error.
struct FrameSplit {
  int64_t frames;
  int64_t offset;
};
FrameSplit balanced_split(int64_t F_total, int P, int r);

// How the CP scan exchanges the per-rank composites (docs/design.md §6, Note [exchange] in
// src/cp/scan/exchange.h). All give the one-rank result up to rounding; each rank sends and receives:
//   all_gather   — one all-gather of every rank's composites: (P−1) composites in, one collective;
//   log          — recursive doubling over the ranks: ⌈log₂P⌉ rounds of one composite each way;
//   hierarchical — an all-gather inside each node (a ring of n−1 exchanges), then log over the nodes
//                  between the ranks of one lane (rank mod n); nodes are n consecutive ranks, n
//                  dividing P (else gdncp::Error naming node_size);
//   automatic    — all_gather for P ≤ 2 and for one node of at most 8 ranks; hierarchical for
//                  several nodes of n > 1 ranks when n divides P; log otherwise.
// The node size n: CpOptions::node_size > 0, else the environment variable GDNCP_CP_NODE_SIZE
// (e.g. to emulate nodes on one machine), else Communicator::node_size(), else one node.
// Every rank must pass the same exchange and node size. all_gather on CUDA folds at most 64
// composites (groups of up to 65 ranks: the fold kernel's limit); log and hierarchical have none.
enum class Exchange : int { automatic = 0, all_gather = 1, log = 2, hierarchical = 3 };
// "auto", "allgather", "log", "hierarchical".
const char* exchange_name(Exchange e);

struct CpOptions {
  // State flows from rank P−1 to rank 0: the global sequence is the ranks'
  // frames concatenated in reverse rank order (each rank's own frames stay in
  // their order). Used for anti-causal scans. A clip mask then marks clip
  // starts in that global order.
  bool reverse_rank_order = false;
  // K > 0: global frames ≥ K get the identity transition (W = I, U = 0), so
  // the state freezes at frame K−1; the terminal state is returned on every
  // rank. K in [1, F_total], forward rank order only; 0 = off.
  // With a clip mask: clip starts at frames < K cut the state as usual, those
  // at frames ≥ K are ignored (the frozen frames neither update nor reset the
  // state), so the terminal state is the state after frame K−1 of the clip
  // that holds frame K−1, from that clip's start.
  int64_t truncate_to_active = 0;
  // The composites' exchange and the ranks per node it assumes (0: detect), see Exchange.
  Exchange exchange = Exchange::automatic;
  int node_size = 0;
  // CUDA: the all-gather of the composites runs on a communication stream while this rank sweeps
  // what the exchange does not read (the correction's cumulative products; at P > 2 in forward,
  // the other direction), joined by events: no host wait, capturable, bitwise the same results
  // (Note [hidden exchange] in
  // src/cp/scan/comm_stream.h). A rank-local schedule: ranks may differ. CPU: only the order of
  // the sweeps changes. The log and hierarchical exchanges run as without it.
  bool overlap_exchange = false;
  // Deterministic mode (docs/design.md §12): the scan and every cross-rank sum run in
  // global frame order, so results are bitwise the same for every P and frame
  // ownership, equal to one rank. cp_gdn_raw honours it here or in BigdnOptions.
  bool deterministic = false;
};

// --- the distributed frame scan (docs/design.md §6) -----------------------------------
// Per frame t (global order): W_t = g_t (I − P_t),
//   M_t = W_t M_{t−1} + A_t   (KV, D×D, M indexed [key][value] as in bigdn.h)
//   z_t = Wz_t z_{t−1} + b_t  (Z, D),  Wz_t = g_t (I − Pz_t),  M_{−1} = z_{−1} = 0.
// Note [state convention]: docs/design.md §6 writes the KV scan right-multiplied
// (S = Mᵀ); here the KV state is scanned left-multiplied in M, the layout the
// kernels use — the same algorithm transposed, no adapter needed.
//
// P, A, Pz (B·H, F, D, D), bz (B·H, F, D): f32, or f64 (CPU oracle); decay
// (B, H, F) any float dtype; F = F_r, this rank's frames (may be 0);
// clip_starts (B, F) f32 or undefined (header note on packed clips): a start
// at frame f gives M_f = A_f, z_f = bz_f. All on comm.device().
// Differentiable in P, A, Pz, bz, decay (activation gradients; none
// accumulate).
struct ScanResult {
  Tensor M;           // (B·H, F, D, D) inclusive states of this rank's frames
  Tensor z;           // (B·H, F, D)
  Tensor terminal_M;  // (B·H, D, D) state after global frame K−1 (truncate only; same on every rank)
  Tensor terminal_z;  // (B·H, D)
};
ScanResult cp_scan(Communicator& comm, const Tensor& P, const Tensor& A, const Tensor& Pz, const Tensor& bz,
                   const Tensor& decay, const CpOptions& options = {}, const Tensor& clip_starts = Tensor());

// The bidirectional scan of docs/design.md §4 over the global sequence: returns
// {M + M̃, z + z̃} for this rank's frames, equal to ops::bidi_scan on the
// gathered sequence. The anti-causal half is the rank-reversed scan of the
// flipped frames shifted by one frame; both halves' composites travel in one
// all-gather (and one in backward). With clip_starts (B, F) a start at frame
// f also ends the strictly-later state of frame f−1 (M̃_{f−1} = 0), on this
// rank or, for f the first frame of a later rank, on the nearest non-empty
// rank before it.
// cp_options: only the exchange and node size apply (reverse_rank_order, truncate_to_active: error).
std::vector<Tensor> cp_bidi_scan(Communicator& comm, const Tensor& P, const Tensor& A, const Tensor& Pz,
                                 const Tensor& bz, const Tensor& decay, const Tensor& clip_starts = Tensor(),
                                 const CpOptions& cp_options = {});

// --- the CP layers -------------------------------------------------------------
// Inputs as bigdn() (gdncp/bigdn.h), CP-local: qkv (B, N, 3, H, D) with N = F·S
// the rank's tokens (F = F_r ≥ 0, S the same on every rank), beta (B, H, F, S),
// decay (B, H, F), norm weights (C) or undefined, rope_cos/rope_sin this rank's
// (N, D) rows (rows [o_r·S, (o_r + F_r)·S) of the global table: rope_tables
// with offset o_r·S), clip_starts (B, F) f32 or undefined (header note on
// packed clips), rope_cos_q/rope_sin_q q's own (N, D) rows of its tables, or
// both undefined = the k tables (gdncp/bigdn.h). options.checkpoint: off |
// on | automatic. Gradients of the norm weights are partial per rank: sum
// them with all_reduce_grads().

// The bidirectional CP layer: out = num/(den+eps) (B, N, H, D) in qkv's dtype,
// equal to bigdn() on the gathered sequence, for this rank's frames. cp_options: only the
// exchange, node size, overlap_exchange and deterministic apply (reverse_rank_order,
// truncate_to_active: error).
Tensor bigdn_cp(Communicator& comm, const Tensor& qkv, const Tensor& beta, const Tensor& decay, const Tensor& q_norm_w,
                const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, int64_t F, int64_t S,
                const BigdnOptions& options = {}, const Tensor& clip_starts = Tensor(),
                const Tensor& rope_cos_q = Tensor(), const Tensor& rope_sin_q = Tensor(),
                const CpOptions& cp_options = {});

// Raw single direction (the Python reference's cp_fused_gdn_chunkwise_raw_autograd): Prep
// (RMSNorm + relu + k_scale + RoPE + phase A) → CP scan → Output (phase C),
// without the divide. num (B, N, H, D), den (B, H, N) in the compute dtype
// (f32, f64 for f64 input); with truncate_to_active the terminal states
// (B·H, D, D) [key][value] and (B·H, D), identical on every rank, themselves
// differentiable. Gradients to qkv, beta, decay and the present norm weights.
struct RawResult {
  Tensor num, den;
  Tensor terminal_M, terminal_z;
};
RawResult cp_gdn_raw(Communicator& comm, const Tensor& qkv, const Tensor& beta, const Tensor& decay,
                     const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin,
                     int64_t F, int64_t S, const BigdnOptions& options = {}, const CpOptions& cp_options = {},
                     const Tensor& clip_starts = Tensor(), const Tensor& rope_cos_q = Tensor(),
                     const Tensor& rope_sin_q = Tensor());

// Camera branch, numerator only (the Python reference's cp_fused_cam_gdn_num_autograd).
// q, k, v (B, H, D, N) already rotated; beta (B, H, F, S) or (B, H, F) (one
// gate per frame); decay (B, H, F); all one float dtype (bf16, f32, f64).
// Per frame: W = g (I − Σ_s β_s k_s k_sᵀ), U = Σ_s β_s v_s k_sᵀ (right-multiply
// form S_t = S_{t−1} W + U; here scanned as M = Sᵀ), out_s = S_t q_s.
// Returns out (B, H, D, N) in q's dtype and, with truncate_to_active, the
// terminal state (B·H, D, D) in the [key][value] convention. Gradients to q,
// k, v, beta, decay. F = F_r may differ between ranks (and be 0); no clip mask.
struct CamResult {
  Tensor out;
  Tensor terminal_M;
};
CamResult cp_cam_gdn_num(Communicator& comm, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                         const Tensor& decay, int64_t F, int64_t S, const CpOptions& cp_options = {},
                         Checkpoint checkpoint = Checkpoint::off);

// Sums the gradients of params over the group (in place; undefined grads are
// skipped, but the set of defined grads must be the same on every rank — it is
// checked). One all-reduce of all gradients packed together.
void all_reduce_grads(Communicator& comm, const std::vector<Tensor>& params);

}  // namespace cp
}  // namespace gdncp
