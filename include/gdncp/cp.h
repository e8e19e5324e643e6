// gdncp/cp.h — context parallelism: communicators, the distributed frame scan
// and the CP layers (SPEC §6-7).
//
// Rank r of a CP group of P ranks holds frames [r·F, (r+1)·F) of a global
// sequence of P·F frames; every entry here is collective over the group and
// returns what one rank holding the whole sequence would compute for this
// rank's frames, forward and every gradient. Communication is O(P·D²),
// independent of S and F.
//
// OWNER: the CP helper (branch cp). This file is the contract with the trainer;
// declarations may gain parameters but keep these names.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "gdncp/bigdn.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace cp {

// A group of ranks that exchange tensors. CPU tensors go through MPI, CUDA
// tensors through NCCL on the current stream. Every call is checked; a
// collective that cannot finish within timeout_seconds() aborts the
// communicator and throws gdncp::Error on that rank instead of hanging.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;
  // out (size(), *in.shape) = the in of every rank, in rank order.
  virtual void all_gather(Tensor& out, const Tensor& in) = 0;
  // In place sum over ranks.
  virtual void all_reduce_sum(Tensor& t) = 0;
  virtual void broadcast(Tensor& t, int root) = 0;
  // Sends send to rank dst and receives recv from rank src in one step
  // (either rank may be -1 for none). For the one-frame halo.
  virtual void send_recv(const Tensor& send, int dst, Tensor& recv, int src) = 0;
  virtual void barrier() = 0;
  double timeout_seconds() const { return timeout_seconds_; }
  void set_timeout_seconds(double s) { timeout_seconds_ = s; }

 protected:
  double timeout_seconds_ = 300.0;
};

// MPI communicator over comm (default: MPI_COMM_WORLD; the caller keeps comm alive).
std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm = MPI_COMM_WORLD);
// NCCL communicator bootstrapped over comm: local rank from
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED), device = local rank mod device count,
// rank 0 makes the NCCL id and broadcasts it over MPI.
std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm = MPI_COMM_WORLD);

struct CpOptions {
  bool reverse_rank_order = false;  // state flows from rank P−1 to rank 0
  int64_t truncate_to_active = 0;   // K > 0: global frames ≥ K freeze the state (forward order only)
};

// The bidirectional CP layer: equals bigdn() on the gathered sequence, for this
// rank's frames. rope_cos/rope_sin are this rank's (N, D) rows. Gradients of the
// norm weights are partial per rank: sum them with all_reduce_grads().
Tensor bigdn_cp(Communicator& comm, const Tensor& qkv, const Tensor& beta, const Tensor& decay,
                const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin,
                int64_t F, int64_t S, const BigdnOptions& options = {});

// Sums the gradients of params over the group (in place; undefined grads are skipped).
void all_reduce_grads(Communicator& comm, const std::vector<Tensor>& params);

}  // namespace cp
}  // namespace gdncp
