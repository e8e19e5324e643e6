// src/cp/validate_cp.h — the collective argument check of every CP entry.
//
// Each entry describes its call in a CallRecord and runs its local checks;
// one all-gather of the records (fixed size, host memory) follows, before any
// other collective. Then every rank sees every rank's outcome and throws the
// same gdncp::Error when any rank's arguments were bad (naming that rank and
// argument) or when the ranks disagree on a size or an option (naming the
// field and the values) — so a mistake on one rank never leaves the others
// waiting in a collective.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gdncp/cp.h"

namespace gdncp {
namespace cp {
namespace detail {

// The facts that must agree across ranks. -1 = unknown (local check failed first).
struct CallRecord {
  int64_t B = -1, H = -1, D = -1, F = -1, S = -1;
  int64_t dtype = -1;  // DType of the data tensors
  int64_t device = -1;
  int64_t has_q_norm = -1, has_k_norm = -1, beta_per_frame = -1;
  int64_t reverse = -1, truncate = -1;
  double k_scale = 0, norm_eps = 0, eps = 0;
};

// Runs local (which throws gdncp::Error on a bad argument of this rank; it
// also fills rec), exchanges the outcome and rec with all ranks of comm, and
// throws on every rank if any rank failed or the records differ. Also checks
// the communicator: usable, and its device the tensors' device.
void validate_collective(Communicator& comm, const char* entry, CallRecord& rec,
                         const std::function<void(CallRecord&)>& local);

// The shared owner of comm, taken by a node (or a checkpoint's recompute)
// that uses comm after the entry returns, so that the communicator lives as
// long as the graph does. Throws naming `entry` when comm is not owned by a
// std::shared_ptr (make_mpi_communicator and make_nccl_communicator return one).
std::shared_ptr<Communicator> shared_comm(Communicator& comm, const char* entry);
// For a checkpoint's recompute: shared_comm when a graph is recorded on in,
// else a non-owning pointer (no backward will run after the call returns).
std::shared_ptr<Communicator> graph_comm(Communicator& comm, const std::vector<Tensor>& in, const char* entry);

// truncate_to_active / reverse_rank_order checks shared by the entries
// (local part; P·F is known locally since F must agree).
void check_cp_options(const char* entry, const CpOptions& o, int P, int64_t F);

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
