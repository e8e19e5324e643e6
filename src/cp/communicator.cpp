// src/cp/communicator.cpp — what every Communicator shares: its timeout and
// the shared ownership taken by the nodes that use it in backward.
#include <cmath>

#include "cp/validate_cp.h"
#include "gdncp/autograd.h"
#include "gdncp/cp.h"
#include "gdncp/error.h"

namespace gdncp {
namespace cp {

void Communicator::set_timeout_seconds(double s) {
  GDNCP_CHECK(std::isfinite(s) && s > 0, "Communicator::set_timeout_seconds: timeout_seconds: must be finite and > 0, got ",
              s);
  timeout_seconds_ = s;
}

namespace detail {

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
