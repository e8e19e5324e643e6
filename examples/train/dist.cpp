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

#include <algorithm>
#include <cstring>
#include <string>

namespace train {

using gdncp::Device;
using gdncp::Tensor;

Dist::Dist(MPI_Comm world, int cp, Device device, double timeout_seconds) : world_(world), device_(device) {
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
  host_ = gdncp::cp::make_mpi_communicator(world);
  for (auto* c : {&cp_comm_, &grad_comm_, &host_})
    if (*c) (*c)->set_timeout_seconds(timeout_seconds);
}

Dist::~Dist() {
  cp_comm_.reset();
  grad_comm_.reset();
  host_.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && cp_mpi_ != MPI_COMM_NULL) MPI_Comm_free(&cp_mpi_);
}

Tensor Dist::layer(const Tensor& qkv, const Tensor& beta, const Tensor& decay, const Tensor& q_norm_w,
                   const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, int64_t F, int64_t S,
                   const gdncp::BigdnOptions& options, const Tensor& clip_starts,
                   const gdncp::cp::CpOptions& cp_options) {
  if (!cp_comm_)
    return gdncp::bigdn(qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, options, clip_starts);
  return gdncp::cp::bigdn_cp(*cp_comm_, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, options,
                             clip_starts, Tensor(), Tensor(), cp_options);
}

void Dist::reduce_grads(const std::vector<Tensor>& params) {
  if (grad_comm_) gdncp::cp::all_reduce_grads(*grad_comm_, params);
}

double Dist::sum(double v) const {
  Tensor t = Tensor::full({1}, v, gdncp::DType::f64);
  host_->all_reduce_sum(t);  // summed in rank order: the same bits on every rank
  return t.to_vector()[0];
}

std::vector<double> Dist::cp_gather(const std::vector<double>& mine) const {
  if (cp_size_ == 1) return mine;
  GDNCP_CHECK(mine.size() <= static_cast<size_t>(INT32_MAX), "cp_gather: ", mine.size(), " values exceed MPI's count");
  const int n = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<size_t>(cp_size_)), offsets(static_cast<size_t>(cp_size_), 0);
  GDNCP_MPI_CHECK(MPI_Allgather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, cp_mpi_));
  int64_t total = 0;
  for (int r = 0; r < cp_size_; ++r) {
    GDNCP_CHECK(total <= INT32_MAX, "cp_gather: the gathered values exceed MPI's count");
    offsets[static_cast<size_t>(r)] = static_cast<int>(total);
    total += counts[static_cast<size_t>(r)];
  }
  GDNCP_CHECK(total <= INT32_MAX, "cp_gather: the gathered values exceed MPI's count");
  std::vector<double> all(static_cast<size_t>(total));
  GDNCP_MPI_CHECK(
      MPI_Allgatherv(mine.data(), n, MPI_DOUBLE, all.data(), counts.data(), offsets.data(), MPI_DOUBLE, cp_mpi_));
  return all;
}

void Dist::check_identical(uint64_t hash, const char* what) const {
  std::vector<uint64_t> all(static_cast<size_t>(size_));
  host_->all_gather_host(all.data(), &hash, sizeof hash);
  std::string differing;
  for (int r = 1; r < size_; ++r)
    if (all[static_cast<size_t>(r)] != all[0]) differing += (differing.empty() ? "" : ", ") + std::to_string(r);
  GDNCP_CHECK(differing.empty(), what, ": ranks ", differing, " differ from rank 0 (hash ", all[0], ")");
}

void Dist::broadcast_bytes(std::vector<char>& bytes) const {
  Tensor n = Tensor::full({1}, static_cast<double>(bytes.size()), gdncp::DType::f64);
  host_->broadcast(n, 0);
  const double count = n.to_vector()[0];
  GDNCP_CHECK(count >= 0 && count < 9007199254740992.0, "broadcast_bytes: bad size ", count);
  bytes.resize(static_cast<size_t>(count));
  const int64_t chunk = int64_t(1) << 27;  // f64 words per broadcast: 1 GiB, within MPI's int count
  const int64_t words = (static_cast<int64_t>(bytes.size()) + 7) / 8;
  for (int64_t off = 0; off < words; off += chunk) {
    const int64_t w = std::min(chunk, words - off);
    const size_t lo = static_cast<size_t>(off) * 8, len = std::min(bytes.size() - lo, static_cast<size_t>(w) * 8);
    Tensor t = Tensor::zeros({w}, gdncp::DType::f64);
    if (rank_ == 0) std::memcpy(t.data(), bytes.data() + lo, len);
    host_->broadcast(t, 0);
    std::memcpy(bytes.data() + lo, t.data(), len);
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
