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
#include <string>

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
  double k_scale = 0, norm_eps = 0, eps = 0;
};

// Where this rank's frames sit in the global sequence (from every rank's F).
struct FrameLayout {
  int64_t offset = 0;  // this rank's first global frame o_r = Σ_{j<r} F_j
  int64_t total = 0;   // F_total = Σ_j F_j
};

// Runs local (which throws gdncp::Error on a bad argument of this rank; it
// also fills rec), exchanges the outcome and rec with all ranks of comm, and
// throws on every rank if any rank failed, the records differ in a field that
// must agree, or every rank holds 0 frames. Also checks the communicator:
// usable, and its device the tensors' device. Returns this rank's place in
// the global sequence.
FrameLayout validate_collective(Communicator& comm, const char* entry, CallRecord& rec,
                                const std::function<void(CallRecord&)>& local);

// The clip mask of an entry: undefined, or (B, F) f32 on `device`.
void check_clip_starts(const char* entry, const Tensor& clip_starts, int64_t B, int64_t F, Device device);

// truncate_to_active / reverse_rank_order checks shared by the entries: the
// local part (before the exchange) ...
void check_cp_options(const char* entry, const CpOptions& o);
// ... and the part that needs F_total (after it; the same verdict on every rank).
void check_cp_options_global(const char* entry, const CpOptions& o, const FrameLayout& f);

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
