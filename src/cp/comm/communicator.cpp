// src/cp/comm/communicator.cpp — what every Communicator shares: the deadline, the
// abort check, the padded record exchange of the validation policy, and the
// shared ownership taken by the nodes that use it in backward.
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "cp/validate_cp.h"
#include "gdncp/autograd.h"
#include "gdncp/cp.h"
#include "gdncp/error.h"

namespace gdncp {
namespace cp {

namespace {
std::atomic<bool> g_any_aborted{false};
}  // namespace

bool any_communicator_aborted() { return g_any_aborted; }

const char* validation_name(Validation v) {
  switch (v) {
    case Validation::every_call: return "every_call";
    case Validation::on_change: return "on_change";
    case Validation::off: return "off";
  }
  return "?";
}

void Communicator::check_usable(const char* what) const {
  if (!aborted()) return;
  GDNCP_FAIL(what, ": the ", backend(), " communicator (rank ", rank(), " of ", size(),
             ") was aborted: ", abort_reason());
}

namespace detail {

void check_all_gather_args(const Tensor& out, const Tensor& in, int size) {
  GDNCP_CHECK(out.dtype() == in.dtype(), "all_gather: out dtype ", dtype_name(out.dtype()), " != in dtype ",
              dtype_name(in.dtype()));
  GDNCP_CHECK(out.numel() == in.numel() * size, "all_gather: out has ", out.numel(), " elements, expected size()·",
              in.numel(), " = ", in.numel() * size);
}

void count_collective(std::mutex& mu, Communicator::Stats& stats, size_t bytes,
                      std::chrono::steady_clock::time_point start, bool host_wait) {
  std::lock_guard<std::mutex> lock(mu);
  stats.calls += 1;
  stats.bytes += static_cast<int64_t>(bytes);
  stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (host_wait) stats.host_waits += 1;
}

}  // namespace detail

// Padded to kRecordBytes: the exchanges of different entries have one size,
// so ranks in different entries see each other's records instead of a
// truncated message.
void Communicator::exchange_record(void* out, const void* in, size_t bytes) {
  GDNCP_CHECK(bytes <= kRecordBytes, "exchange_record: ", bytes, " bytes exceed kRecordBytes = ", kRecordBytes);
  std::vector<unsigned char> mine(kRecordBytes, 0), all(kRecordBytes * static_cast<size_t>(size()));
  std::memcpy(mine.data(), in, bytes);
  all_gather_host(all.data(), mine.data(), kRecordBytes);
  for (int r = 0; r < size(); ++r)
    std::memcpy(static_cast<unsigned char*>(out) + r * bytes, all.data() + r * kRecordBytes, bytes);
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.validations += 1;
}

void Communicator::set_timeout_seconds(double s) {
  GDNCP_CHECK(std::isfinite(s) && s > 0,
              "Communicator::set_timeout_seconds: timeout_seconds: must be finite and > 0, got ", s);
  timeout_seconds_ = s;
}

namespace detail {

void note_abort() { g_any_aborted = true; }

std::shared_ptr<Communicator> shared_comm(Communicator& comm, const char* entry) {
  std::shared_ptr<Communicator> owner = comm.weak_from_this().lock();
  GDNCP_CHECK(owner != nullptr, entry,
              ": comm: is not owned by a std::shared_ptr, but the backward of this call needs it after the call "
              "returns; make it with make_mpi_communicator / make_nccl_communicator (or std::make_shared)");
  return owner;
}

std::shared_ptr<Communicator> graph_comm(Communicator& comm, const std::vector<Tensor>& in, const char* entry) {
  if (autograd::should_record(in)) return shared_comm(comm, entry);
  return std::shared_ptr<Communicator>(std::shared_ptr<Communicator>(), &comm);
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
