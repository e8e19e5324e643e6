// src/cp/validate_cp.h — the collective argument check of every CP entry.
//
// Each entry describes its call in a CallRecord and runs its local checks;
// one all-gather of the records (fixed size, host memory) follows, before any
// other collective, when the communicator's Validation policy asks for it
// (every call, or only when this rank's record changed, or never). Then every
// rank sees every rank's outcome and throws the same gdncp::Error when any
// rank's arguments were bad (naming that rank and argument) or when the ranks
// disagree on a size or an option (naming the field and the values) — so a
// mistake on one rank never leaves the others waiting in a collective.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

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

// The validation policy around an entry's own record exchange (Note
// [validation policy] in validate_cp.cpp), for entries with a record of their
// own (all_reduce_grads): whether this rank exchanges `rec` now; after the
// exchange, forget before checking and remember once every rank agreed.
// exchange_or_explain runs the exchange; when this rank's own local check
// failed (ok false) and the exchange fails, it reports local_error first.
bool exchange_needed(Communicator& comm, const char* entry, const void* rec, size_t bytes, bool ok);
void remember_validated(Communicator& comm, const char* entry, const void* rec, size_t bytes);
void forget_validated(Communicator& comm, const char* entry);
void exchange_or_explain(Communicator& comm, const char* entry, void* all, const void* rec, size_t bytes, bool ok,
                         const char* local_error);

// truncate_to_active / reverse_rank_order checks shared by the entries
// (local part; P·F is known locally since F must agree).
void check_cp_options(const char* entry, const CpOptions& o, int P, int64_t F);

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
