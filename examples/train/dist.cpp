// examples/train/dist.cpp — rank layout and collectives of gdncp_train.
//
// Note [one gradient all-reduce]: every parameter gradient is partial twice
// over — per CP rank (its frames' tokens) and per DP group (its videos). Summing
// over the CP group and averaging over DP groups equals summing over the whole
// world and dividing by DP, so the trainer issues ONE all-reduce over the world
// (cp::all_reduce_grads packs all gradients into one buffer) and the optimizer
// applies 1/DP. The result is bitwise identical on every rank, which keeps the
// parameters identical.
#include "dist.h"

#include <gdncp/error.h>

#include <cstring>
#include <string>

namespace train {

using gdncp::Device;
using gdncp::Tensor;

Dist::Dist(MPI_Comm world, int cp, Device device) : world_(world), device_(device) {
  GDNCP_MPI_CHECK(MPI_Comm_rank(world, &rank_));
  GDNCP_MPI_CHECK(MPI_Comm_size(world, &size_));
  GDNCP_CHECK(cp >= 1 && size_ % cp == 0, "--cp ", cp, " must divide the number of ranks ", size_);
  cp_size_ = cp;
  dp_size_ = size_ / cp;
  cp_rank_ = rank_ % cp;
  dp_rank_ = rank_ / cp;
  GDNCP_MPI_CHECK(MPI_Comm_split(world, dp_rank_, cp_rank_, &cp_mpi_));
  auto make = [&](MPI_Comm c) {
    return device == Device::cuda ? gdncp::cp::make_nccl_communicator(c) : gdncp::cp::make_mpi_communicator(c);
  };
  if (cp_size_ > 1) cp_comm_ = make(cp_mpi_);
  if (size_ > 1) grad_comm_ = cp_size_ == size_ ? cp_comm_ : make(world);
}

Dist::~Dist() {
  cp_comm_.reset();
  grad_comm_.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && cp_mpi_ != MPI_COMM_NULL) MPI_Comm_free(&cp_mpi_);
}

Tensor Dist::layer(const Tensor& qkv, const Tensor& beta, const Tensor& decay, const Tensor& q_norm_w,
                   const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, int64_t F, int64_t S,
                   const gdncp::BigdnOptions& options, const Tensor& clip_starts) {
  if (!cp_comm_)
    return gdncp::bigdn(qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, options, clip_starts);
  return gdncp::cp::bigdn_cp(*cp_comm_, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, options,
                             clip_starts);
}

void Dist::reduce_grads(const std::vector<Tensor>& params) {
  if (grad_comm_) gdncp::cp::all_reduce_grads(*grad_comm_, params);
}

double Dist::sum(double v) const {
  double out = 0;
  GDNCP_MPI_CHECK(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, world_));
  return out;
}

void Dist::check_identical(uint64_t hash, const char* what) const {
  std::vector<uint64_t> all(static_cast<size_t>(size_));
  GDNCP_MPI_CHECK(MPI_Allgather(&hash, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, world_));
  std::string differing;
  for (int r = 1; r < size_; ++r)
    if (all[static_cast<size_t>(r)] != all[0]) differing += (differing.empty() ? "" : ", ") + std::to_string(r);
  GDNCP_CHECK(differing.empty(), what, ": ranks ", differing, " differ from rank 0 (hash ", all[0], ")");
}

void Dist::broadcast_bytes(std::vector<char>& bytes) const {
  uint64_t n = bytes.size();
  GDNCP_MPI_CHECK(MPI_Bcast(&n, 1, MPI_UINT64_T, 0, world_));
  bytes.resize(n);
  const uint64_t chunk = uint64_t(1) << 30;  // MPI counts are int
  for (uint64_t off = 0; off < n; off += chunk) {
    const int count = static_cast<int>(std::min(chunk, n - off));
    GDNCP_MPI_CHECK(MPI_Bcast(bytes.data() + off, count, MPI_BYTE, 0, world_));
  }
}

uint64_t hash_tensors(const std::vector<Tensor>& tensors) {
  // FNV-style over 64-bit words: h ← (h ⊕ w)·p is a bijection of h for a fixed
  // w, so two byte strings that differ in any one word always hash apart.
  const uint64_t prime = 1099511628211ull;
  uint64_t h = 1469598103934665603ull;
  for (const Tensor& t : tensors) {
    const Tensor host = t.device() == Device::cpu ? t : t.to(Device::cpu);
    const unsigned char* p = static_cast<const unsigned char*>(host.data());
    const size_t n = host.nbytes(), words = n / 8;
    for (size_t i = 0; i < words; ++i) {
      uint64_t w;
      std::memcpy(&w, p + 8 * i, 8);
      h = (h ^ w) * prime;
    }
    for (size_t i = 8 * words; i < n; ++i) h = (h ^ p[i]) * prime;
    h = (h ^ n) * prime;  // tensor boundaries
  }
  return h;
}

}  // namespace train
