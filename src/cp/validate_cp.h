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

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gdncp/cp.h"

namespace gdncp {
namespace cp {
namespace detail {

// The facts of one rank's call. -1 = unknown (local check failed first).
// Every field must agree across ranks except F (this rank's frames, F_r).
struct CallRecord {
  int64_t B = -1, H = -1, D = -1, F = -1, S = -1;
  int64_t dtype = -1;  // DType of the data tensors
  int64_t device = -1;
  int64_t has_q_norm = -1, has_k_norm = -1, beta_per_frame = -1;
  int64_t reverse = -1, truncate = -1;
  int64_t deterministic = -1;
  double k_scale = 0, norm_eps = 0, eps = 0;
};

// Where this rank's frames sit in the global sequence (from every rank's F).
// Known only after an exchange (always made with truncate_to_active, the one
// option that needs it); total = -1 when the exchange was skipped.
struct FrameLayout {
  int64_t offset = 0;  // this rank's first global frame o_r = Σ_{j<r} F_j
  int64_t total = 0;   // F_total = Σ_j F_j
};

// Runs local (which throws gdncp::Error on a bad argument of this rank; it
// also fills rec), exchanges the outcome and rec with all ranks of comm (as
// comm.validation() says: Note [validation policy] in validate_cp.cpp), and
// throws on every rank if any rank failed, the records differ in a field that
// must agree, or every rank holds 0 frames. Also checks the communicator:
// usable, and its device the tensors' device. Returns this rank's place in
// the global sequence when the records were exchanged (with truncation,
// always), else {0, -1}: F may change on any rank without an exchange.
FrameLayout validate_collective(Communicator& comm, const char* entry, CallRecord& rec,
                                const std::function<void(CallRecord&)>& local);

// The validation policy around an entry's own record exchange (Note
// [validation policy] in validate_cp.cpp), for entries with a record of their
// own (all_reduce_grads): whether this rank exchanges `rec` now (always when
// its local check failed, ok false, under every policy); after the
// exchange, forget before checking and remember once every rank agreed.
// exchange_or_explain runs the exchange; when this rank's own local check
// failed (ok false) and the exchange fails, it reports local_error first.
// exchange_needed also sends the call's header where the backend carries
// one (announce_call); `always`: this rank exchanges whatever the policy.
bool exchange_needed(Communicator& comm, const char* entry, const void* rec, size_t bytes, bool ok,
                     const char* local_error, bool always = false);

// Note [NCCL call headers] (comm_nccl.cpp): on a backend that carries a call
// header (NCCL; the others: nothing), sends this rank's header of the call
// `entry`: the hash of what every rank must agree on (key) and its argument
// error (bad, "" when none). wait (this rank means to exchange its record: a
// host wait anyway): waits for every rank's header and throws their verdict;
// otherwise the communicator's watchdog checks the headers, off the calling
// thread, and aborts the communicator on a disagreement. Returns whether the
// record exchange is still needed: false when the headers agree and some
// rank did not wait (it validated this record before); else wait.
bool announce_call(Communicator& comm, int64_t entry_hash, const char* entry, int64_t key, const std::string& bad,
                   bool wait);
void remember_validated(Communicator& comm, const char* entry, const void* rec, size_t bytes);
void forget_validated(Communicator& comm, const char* entry);
void exchange_or_explain(Communicator& comm, const char* entry, void* all, const void* rec, size_t bytes, bool ok,
                         const char* local_error);

// truncate_to_active / reverse_rank_order checks shared by the entries: the
// local part (before the exchange) ...
void check_cp_options(const char* entry, const CpOptions& o);
// ... and the part that needs F_total (after it; the same verdict on every rank).
void check_cp_options_global(const char* entry, const CpOptions& o, const FrameLayout& f);

// Records that a communicator of this process was aborted (any_communicator_aborted()).
void note_abort();

// The backends' shared all_gather argument checks: out holds size copies of in's dtype and numel.
void check_all_gather_args(const Tensor& out, const Tensor& in, int size);

// Counts one data collective of bytes begun at start in stats, under mu.
void count_collective(std::mutex& mu, Communicator::Stats& stats, size_t bytes,
                      std::chrono::steady_clock::time_point start, bool host_wait);

// The shared owner of comm, taken by a node (or a checkpoint's recompute)
// that uses comm after the entry returns, so that the communicator lives as
// long as the graph does. Throws naming `entry` when comm is not owned by a
// std::shared_ptr (make_mpi_communicator and make_nccl_communicator return one).
std::shared_ptr<Communicator> shared_comm(Communicator& comm, const char* entry);
// For a checkpoint's recompute: shared_comm when a graph is recorded on in,
// else a non-owning pointer (no backward will run after the call returns).
std::shared_ptr<Communicator> graph_comm(Communicator& comm, const std::vector<Tensor>& in, const char* entry);

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
