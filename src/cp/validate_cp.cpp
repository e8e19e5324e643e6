// src/cp/validate_cp.cpp — see validate_cp.h.
#include "cp/validate_cp.h"

#include <cstring>
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
    {"F (frames per rank)", &CallRecord::F},
    {"S", &CallRecord::S},
    {"dtype", &CallRecord::dtype},
    {"device", &CallRecord::device},
    {"q_norm_w presence", &CallRecord::has_q_norm},
    {"k_norm_w presence", &CallRecord::has_k_norm},
    {"beta layout (per token / per frame)", &CallRecord::beta_per_frame},
    {"reverse_rank_order", &CallRecord::reverse},
    {"truncate_to_active", &CallRecord::truncate},
};

std::string value_str(const Field& f, int64_t v) {
  if (f.member == &CallRecord::dtype && v >= 0) return dtype_name(static_cast<DType>(v));
  if (f.member == &CallRecord::device && v >= 0) return device_name(static_cast<Device>(v));
  return std::to_string(v);
}

}  // namespace

void validate_collective(Communicator& comm, const char* entry, CallRecord& rec,
                         const std::function<void(CallRecord&)>& local) {
  GDNCP_CHECK(!comm.aborted(), entry, ": comm: the communicator was aborted by an earlier error");
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
  const int P = comm.size();
  std::vector<Wire> all(static_cast<size_t>(P));
  comm.all_gather_host(all.data(), &mine, sizeof(Wire));

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

void check_cp_options(const char* entry, const CpOptions& o, int P, int64_t F) {
  const int64_t frames = checked_mul(P, F, (std::string(entry) + ": P·F (global frames)").c_str());
  const int64_t K = o.truncate_to_active;
  if (K == 0) return;
  GDNCP_CHECK(!o.reverse_rank_order, entry,
              ": truncate_to_active: cannot be combined with reverse_rank_order (the state would freeze before it "
              "starts)");
  GDNCP_CHECK(K >= 1 && K <= frames, entry, ": truncate_to_active: must be in [1, P·F] = [1, ", frames, "], got ", K);
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
