// gdncp/cp.h — context parallelism: communicators, the distributed frame scan
// and the CP layers (SPEC §6-7).
//
// Rank r of a CP group of P ranks holds frames [r·F, (r+1)·F) of a global
// sequence of P·F frames; every entry here is collective over the group and
// returns what one rank holding the whole sequence would compute for this
// rank's frames, forward and every gradient. Communication is O(P·D²),
// independent of S and F: ONE all-gather of the per-rank composites in
// forward and ONE in backward (plus one small all-gather of the sizes that
// validates the call on every rank before anything else is sent).
//
// Errors: every entry validates its arguments locally, then exchanges the
// result with the other ranks, so a bad argument on any rank — or sizes that
// differ between ranks (F, S, B, H, D, dtype, options) — raises gdncp::Error on
// EVERY rank (naming the argument and the rank), never a hang or garbage.
//
// Checkpointing (BigdnOptions::checkpoint, SPEC §7): `on` keeps only the
// inputs and recomputes in backward. The recompute issues no collective: the
// gathered composites (O(P·BH·D²)) are kept from the forward, so it cannot
// deadlock and gives bitwise the same gradients as `off`.
//
// OWNER: the CP helper (branch cp). This file is the contract with the trainer;
// declarations may gain parameters but keep these names.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gdncp/bigdn.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace cp {

// A group of ranks that exchange tensors. CPU tensors go through MPI, CUDA
// tensors through NCCL on the current stream (gdncp::current_stream()). Every
// call is checked; a collective that cannot finish within timeout_seconds()
// aborts the communicator and throws gdncp::Error on that rank instead of
// hanging; every later call on an aborted communicator throws at once.
// All ranks must issue the same collectives in the same order.
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
  virtual void barrier() = 0;
  // Host memory all-gather of `bytes` bytes per rank into out (size()·bytes):
  // the cross-rank validation of sizes and options uses it.
  virtual void all_gather_host(void* out, const void* in, size_t bytes) = 0;
  // True after a timeout or an asynchronous error aborted the communicator.
  virtual bool aborted() const = 0;
  // Deferred completion: after begin_deferred(), a device collective returns
  // once it is enqueued on the stream, and complete() waits for every such
  // collective against the deadline (throwing on a miss, as a plain call does)
  // and ends the deferral. A caller enqueues the work that follows its
  // collective before the host waits, so the device never idles while the
  // host makes its round trip. Host (MPI) collectives complete at once: for
  // them both are no-ops.
  virtual void begin_deferred() {}
  virtual void complete() {}
  // "mpi" or "nccl".
  virtual const char* backend() const = 0;

  double timeout_seconds() const { return timeout_seconds_; }
  // s must be finite and > 0 (else gdncp::Error naming timeout_seconds).
  void set_timeout_seconds(double s);

  // Time spent in collectives by this communicator (seconds measured on the
  // device with events for NCCL, wall time for MPI), calls and bytes sent.
  struct Stats {
    int64_t calls = 0;
    int64_t bytes = 0;
    double seconds = 0;
  };
  const Stats& stats() const { return stats_; }
  void reset_stats() { stats_ = Stats(); }

 protected:
  double timeout_seconds_ = 300.0;
  Stats stats_;
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

// The local rank on this node (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)).
int local_rank(MPI_Comm comm = MPI_COMM_WORLD);

struct CpOptions {
  // State flows from rank P−1 to rank 0: the global sequence is the ranks'
  // frames concatenated in reverse rank order (each rank's own frames stay in
  // their order). Used for anti-causal scans.
  bool reverse_rank_order = false;
  // K > 0: global frames ≥ K get the identity transition (W = I, U = 0), so
  // the state freezes at frame K−1; the terminal state is returned on every
  // rank. K in [1, P·F], forward rank order only; 0 = off.
  int64_t truncate_to_active = 0;
};

// --- the distributed frame scan (SPEC §6) -----------------------------------
// Per frame t (global order): W_t = g_t (I − P_t),
//   M_t = W_t M_{t−1} + A_t   (KV, D×D, M indexed [key][value] as in bigdn.h)
//   z_t = Wz_t z_{t−1} + b_t  (Z, D),  Wz_t = g_t (I − Pz_t),  M_{−1} = z_{−1} = 0.
// Note [state convention]: SPEC §6 writes the KV scan right-multiplied
// (S = Mᵀ); here the KV state is scanned left-multiplied in M, the layout the
// kernels use — the same algorithm transposed, no adapter needed.
//
// P, A, Pz (B·H, F, D, D), bz (B·H, F, D): f32, or f64 (CPU oracle); decay
// (B, H, F) any float dtype. All on comm.device(). Differentiable in P, A, Pz,
// bz, decay (activation gradients; none accumulate).
struct ScanResult {
  Tensor M;           // (B·H, F, D, D) inclusive states of this rank's frames
  Tensor z;           // (B·H, F, D)
  Tensor terminal_M;  // (B·H, D, D) state after global frame K−1 (truncate only; same on every rank)
  Tensor terminal_z;  // (B·H, D)
};
ScanResult cp_scan(Communicator& comm, const Tensor& P, const Tensor& A, const Tensor& Pz, const Tensor& bz,
                   const Tensor& decay, const CpOptions& options = {});

// The bidirectional scan of SPEC §4 over the global sequence: returns
// {M + M̃, z + z̃} for this rank's frames, equal to ops::bidi_scan on the
// gathered sequence. The anti-causal half is the rank-reversed scan of the
// flipped frames shifted by one frame; both halves' composites travel in one
// all-gather (and one in backward).
std::vector<Tensor> cp_bidi_scan(Communicator& comm, const Tensor& P, const Tensor& A, const Tensor& Pz,
                                 const Tensor& bz, const Tensor& decay);

// --- the CP layers -------------------------------------------------------------
// Inputs as bigdn() (gdncp/bigdn.h), CP-local: qkv (B, N, 3, H, D) with N = F·S
// the rank's tokens, beta (B, H, F, S), decay (B, H, F), norm weights (C) or
// undefined, rope_cos/rope_sin this rank's (N, D) rows. options.checkpoint:
// off | on | automatic. Gradients of the norm weights are partial per rank:
// sum them with all_reduce_grads().

// The bidirectional CP layer: out = num/(den+eps) (B, N, H, D) in qkv's dtype,
// equal to bigdn() on the gathered sequence, for this rank's frames.
Tensor bigdn_cp(Communicator& comm, const Tensor& qkv, const Tensor& beta, const Tensor& decay, const Tensor& q_norm_w,
                const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, int64_t F, int64_t S,
                const BigdnOptions& options = {});

// Raw single direction (seed 002 cp_fused_gdn_chunkwise_raw_autograd): Prep
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
                     int64_t F, int64_t S, const BigdnOptions& options = {}, const CpOptions& cp_options = {});

// Camera branch, numerator only (seed 002 cp_fused_cam_gdn_num_autograd).
// q, k, v (B, H, D, N) already rotated; beta (B, H, F, S) or (B, H, F) (one
// gate per frame); decay (B, H, F); all one float dtype (bf16, f32, f64).
// Per frame: W = g (I − Σ_s β_s k_s k_sᵀ), U = Σ_s β_s v_s k_sᵀ (right-multiply
// form S_t = S_{t−1} W + U; here scanned as M = Sᵀ), out_s = S_t q_s.
// Returns out (B, H, D, N) in q's dtype and, with truncate_to_active, the
// terminal state (B·H, D, D) in the [key][value] convention. Gradients to q,
// k, v, beta, decay.
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
