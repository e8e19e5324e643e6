// src/cp/validate_cp.cpp — see validate_cp.h.
#include "cp/validate_cp.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gdncp/error.h"

namespace gdncp {
namespace cp {
namespace detail {
namespace {

// One rank's slot of the exchange: outcome, record and the error text.
struct Wire {
  int64_t magic = 0x67646e6370;  // "gdncp": a rank in a different call is caught too
  int64_t ok = 0;
  int64_t entry_hash = 0;
  CallRecord rec;
  char msg[480] = {0};
};

int64_t hash_of(const char* s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; ++s) h = (h ^ static_cast<unsigned char>(*s)) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

struct Field {
  const char* name;
  int64_t CallRecord::*member;
};
const Field kFields[] = {
    {"B", &CallRecord::B},
    {"H", &CallRecord::H},
    {"D", &CallRecord::D},
    {"S", &CallRecord::S},
    {"dtype", &CallRecord::dtype},
    {"device", &CallRecord::device},
    {"q_norm_w presence", &CallRecord::has_q_norm},
    {"k_norm_w presence", &CallRecord::has_k_norm},
    {"beta layout (per token / per frame)", &CallRecord::beta_per_frame},
    {"reverse_rank_order", &CallRecord::reverse},
    {"truncate_to_active", &CallRecord::truncate},
    {"deterministic", &CallRecord::deterministic},
};

std::string value_str(const Field& f, int64_t v) {
  if (f.member == &CallRecord::dtype && v >= 0) return dtype_name(static_cast<DType>(v));
  if (f.member == &CallRecord::device && v >= 0) return device_name(static_cast<Device>(v));
  return std::to_string(v);
}

}  // namespace

// Note [validation policy]: the record of a call is exchanged under
// comm.validation() (docs/design.md §10). on_change remembers, per entry, the
// bytes this rank last validated successfully, this rank's F left out; an
// equal record skips the exchange. F is free to change on any rank at any
// step without an exchange: the scan needs no other rank's F (a rank's
// composites have one size whatever its F), except to place the frozen frames
// of truncate_to_active, so an entry with truncation exchanges on every call
// under every policy. A rank with a bad argument always exchanges (its error
// then reaches every rank at once), and so does a rank whose record changed
// under on_change. The other ranks, going on to their data collective, meet
// it there: the communicator's collectives check every rank's kind and size
// first (Note [collective header] in cp/comm/collective_header.h), so every rank raises at
// once, the validation memory is dropped on every rank and the next call
// validates afresh everywhere. NCCL's data collectives carry no header; there
// every call sends a header of its own first (Note [NCCL call headers]).
struct ValidationMemory {
  static bool same(Communicator& c, int64_t key, const void* rec, size_t bytes) {
    const auto it = c.validated_.find(key);
    return it != c.validated_.end() && it->second.size() == bytes && std::memcmp(it->second.data(), rec, bytes) == 0;
  }
  static void remember(Communicator& c, int64_t key, const void* rec, size_t bytes) {
    c.validated_[key].assign(static_cast<const char*>(rec), bytes);
  }
  static void forget(Communicator& c, int64_t key) { c.validated_.erase(key); }
};

bool exchange_needed(Communicator& comm, const char* entry, const void* rec, size_t bytes, bool ok,
                     const char* local_error, bool always) {
  bool needed = always || !ok;
  if (!needed) {
    switch (comm.validation()) {
      case Validation::off: needed = false; break;
      case Validation::on_change: needed = !ValidationMemory::same(comm, hash_of(entry), rec, bytes); break;
      case Validation::every_call: needed = true; break;
    }
  }
  uint64_t key = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i) key = (key ^ static_cast<const unsigned char*>(rec)[i]) * 1099511628211ull;
  bool exchange = needed;
  try {
    exchange =
        announce_call(comm, hash_of(entry), entry, static_cast<int64_t>(key >> 1), ok ? "" : local_error, needed);
  } catch (const Error&) {
    ValidationMemory::forget(comm, hash_of(entry));  // the next call validates afresh
    throw;
  }
  if (needed && !exchange) ValidationMemory::remember(comm, hash_of(entry), rec, bytes);  // agreed by the headers
  return exchange;
}

void remember_validated(Communicator& comm, const char* entry, const void* rec, size_t bytes) {
  ValidationMemory::remember(comm, hash_of(entry), rec, bytes);
}

void forget_validated(Communicator& comm, const char* entry) { ValidationMemory::forget(comm, hash_of(entry)); }

void exchange_or_explain(Communicator& comm, const char* entry, void* all, const void* rec, size_t bytes, bool ok,
                         const char* local_error) {
  try {
    comm.exchange_record(all, rec, bytes);
  } catch (const Error& e) {
    if (ok) throw;
    // This rank's own bad argument is the cause; the exchange only failed
    // because the other ranks did not expect it (Note [validation policy]).
    GDNCP_FAIL(local_error, " (", entry,
               ": the other ranks skipped validating this call under Validation::", validation_name(comm.validation()),
               " and the ranks are now out of step: ", e.what(), ")");
  }
}

FrameLayout validate_collective(Communicator& comm, const char* entry, CallRecord& rec,
                                const std::function<void(CallRecord&)>& local) {
  comm.check_usable(entry);
  Wire mine;
  mine.entry_hash = hash_of(entry);
  try {
    local(rec);
    GDNCP_CHECK(rec.device < 0 || rec.device == static_cast<int64_t>(comm.device()), entry, ": comm: a ",
                comm.backend(), " communicator takes ", device_name(comm.device()), " tensors, the inputs are on ",
                device_name(static_cast<Device>(rec.device)));
    mine.ok = 1;
  } catch (const Error& e) {
    std::strncpy(mine.msg, e.what(), sizeof(mine.msg) - 1);
  }
  mine.rec = rec;
  const Validation policy = comm.validation();
  // What on_change compares: the record without this rank's F (Note [validation policy]).
  Wire key = mine;
  key.rec.F = 0;
  const bool layout_needed = mine.ok && rec.truncate > 0;
  if (!exchange_needed(comm, entry, &key, sizeof(Wire), mine.ok, mine.msg, layout_needed)) return FrameLayout{0, -1};
  const int P = comm.size();
  std::vector<Wire> all(static_cast<size_t>(P));
  forget_validated(comm, entry);
  exchange_or_explain(comm, entry, all.data(), &mine, sizeof(Wire), mine.ok, mine.msg);

  for (int r = 0; r < P; ++r) {
    const Wire& w = all[static_cast<size_t>(r)];
    GDNCP_CHECK(w.magic == mine.magic && w.entry_hash == mine.entry_hash, entry, ": rank ", r,
                " is in a different gdncp call (the ranks are out of step)");
  }
  for (int r = 0; r < P; ++r) {
    const Wire& w = all[static_cast<size_t>(r)];
    if (!w.ok) {
      std::string msg(w.msg, strnlen(w.msg, sizeof(w.msg)));
      if (r == comm.rank()) throw Error(msg);
      GDNCP_FAIL(entry, ": bad argument on rank ", r, " of ", P, ": ", msg);
    }
  }
  if (policy != Validation::off) {
    const CallRecord& r0 = all[0].rec;
    for (const Field& f : kFields)
      for (int r = 1; r < P; ++r) {
        const int64_t a = r0.*f.member, b = all[static_cast<size_t>(r)].rec.*f.member;
        GDNCP_CHECK(a == b, entry, ": ", f.name, " differs between ranks: rank 0 has ", value_str(f, a), ", rank ", r,
                    " has ", value_str(f, b), " (every rank of the CP group must agree)");
      }
    for (int r = 1; r < P; ++r) {
      const CallRecord& x = all[static_cast<size_t>(r)].rec;
      GDNCP_CHECK(x.k_scale == r0.k_scale && x.norm_eps == r0.norm_eps && x.eps == r0.eps, entry,
                  ": options (k_scale, norm_eps, eps) differ between rank 0 and rank ", r);
    }
  }
  // F may differ (uneven ownership); the ranks' frames make the global sequence.
  FrameLayout f;
  for (int r = 0; r < P; ++r) {
    const int64_t Fr = all[static_cast<size_t>(r)].rec.F;
    GDNCP_CHECK(Fr <= INT64_MAX - f.total, entry, ": F: the ranks' frames sum past int64 (rank ", r, " holds ", Fr,
                ")");
    if (r < comm.rank()) f.offset += Fr;
    f.total += Fr;
  }
  GDNCP_CHECK(f.total > 0, entry, ": F: every rank of the CP group holds 0 frames (the sequence is empty)");
  checked_mul(f.total, std::max<int64_t>(rec.S, 1), (std::string(entry) + ": F_total·S (global tokens)").c_str());
  ValidationMemory::remember(comm, mine.entry_hash, &key, sizeof(Wire));
  return f;
}

void check_cp_options(const char* entry, const CpOptions& o) {
  const int64_t K = o.truncate_to_active;
  if (K == 0) return;
  GDNCP_CHECK(!o.reverse_rank_order, entry,
              ": truncate_to_active: cannot be combined with reverse_rank_order (the state would freeze before it "
              "starts)");
  GDNCP_CHECK(K >= 1, entry, ": truncate_to_active: must be 0 (off) or in [1, F_total], got ", K);
}

void check_cp_options_global(const char* entry, const CpOptions& o, const FrameLayout& f) {
  const int64_t K = o.truncate_to_active;
  if (K == 0) return;
  GDNCP_CHECK(f.total >= 0, entry, ": truncate_to_active: the frame layout was not exchanged");
  GDNCP_CHECK(K <= f.total, entry, ": truncate_to_active: must be in [1, F_total] = [1, ", f.total, "], got ", K);
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
