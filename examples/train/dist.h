// examples/train/dist.h — the rank layout of gdncp_train and every collective
// the trainer issues: the CP layer call, the gradient reduction, scalar sums,
// the parameter-identity check and byte broadcasts. Every one goes through a
// gdncp communicator with the run's deadline (--timeout): a lost or hung rank
// makes the others raise gdncp::Error instead of waiting for ever.
#pragma once

#include <gdncp/bigdn.h>
#include <gdncp/cp.h>
#include <gdncp/tensor.h>
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace train {

class Dist {
 public:
  // world = dp × cp ranks; consecutive ranks form a CP group. Creates the
  // communicators (MPI for cpu, NCCL for cuda) of the groups larger than one,
  // and an MPI one over the world for the host helpers; every collective of
  // them has a deadline of timeout_seconds.
  Dist(MPI_Comm world, int cp, gdncp::Device device, double timeout_seconds = 300);
  ~Dist();
  Dist(const Dist&) = delete;
  Dist& operator=(const Dist&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int cp_rank() const { return cp_rank_; }
  int cp_size() const { return cp_size_; }
  int dp_rank() const { return dp_rank_; }
  int dp_size() const { return dp_size_; }
  gdncp::Device device() const { return device_; }

  // The bidirectional layer over this rank's F frames (the only CP call of the
  // trainer): bigdn_cp over the CP group, or the single-rank bigdn when CP = 1.
  // clip_starts: the clip-start mask (B, F), or undefined. cp_options: bigdn_cp's (unused when CP = 1).
  gdncp::Tensor layer(const gdncp::Tensor& qkv, const gdncp::Tensor& beta, const gdncp::Tensor& decay,
                      const gdncp::Tensor& q_norm_w, const gdncp::Tensor& k_norm_w, const gdncp::Tensor& rope_cos,
                      const gdncp::Tensor& rope_sin, int64_t F, int64_t S, const gdncp::BigdnOptions& options,
                      const gdncp::Tensor& clip_starts = gdncp::Tensor(), const gdncp::cp::CpOptions& cp_options = {});

  // Sums the parameter gradients over all ranks (CP partial sums and DP
  // replicas in one all-reduce); the optimizer divides by DP.
  void reduce_grads(const std::vector<gdncp::Tensor>& params);

  // Host-side helpers over the world (MPI, with the deadline).
  double sum(double v) const;
  // The values of every rank of this CP group concatenated in CP rank order
  // (each rank may give a different count; CP rank order is global frame order).
  std::vector<double> cp_gather(const std::vector<double>& mine) const;
  // Throws gdncp::Error on every rank unless all ranks hold the same hash.
  void check_identical(uint64_t hash, const char* what) const;
  // Broadcasts rank 0's bytes to every rank (any size).
  void broadcast_bytes(std::vector<char>& bytes) const;

 private:
  MPI_Comm world_;
  MPI_Comm cp_mpi_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, cp_rank_ = 0, cp_size_ = 1, dp_rank_ = 0, dp_size_ = 1;
  gdncp::Device device_;
  std::shared_ptr<gdncp::cp::Communicator> cp_comm_;    // null when cp_size == 1
  std::shared_ptr<gdncp::cp::Communicator> grad_comm_;  // over the world; null when size == 1
  std::shared_ptr<gdncp::cp::Communicator> host_;       // MPI over the world, for the host helpers
};

// A 64-bit hash of the tensors' bytes (host copies), in order; any one differing word changes it.
uint64_t hash_tensors(const std::vector<gdncp::Tensor>& tensors);

}  // namespace train
