// src/cp/all_reduce_grads.cpp — sums parameter gradients over the CP group
// (docs/design.md §7: the norm-weight gradients of the CP layers are partial per rank).
//
// The defined gradients are packed per dtype into one buffer each and summed
// with one all-reduce per dtype (usually one: f32). Which gradients are
// defined, their sizes and dtypes are checked across ranks first (under the
// communicator's Validation policy), so a rank with a different parameter set
// gets an error on every rank, not a hang.
#include <cstring>
#include <vector>

#include "autograd/tensor_internals.h"
#include "cp/validate_cp.h"
#include "gdncp/cp.h"
#include "gdncp/error.h"
#include "kernels/cp_kernels.h"

namespace gdncp {
namespace cp {

namespace {
constexpr int64_t kTag = 0x6772616473;  // "grads"
}

void all_reduce_grads(Communicator& comm, const std::vector<Tensor>& params) {
  std::vector<Tensor> grads(params.size());
  uint64_t sig = 1469598103934665603ull;  // FNV over (index, numel, dtype) of the defined grads
  int64_t local_ok = 1;
  std::string why;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) continue;
    const Tensor g = params[i].grad();
    if (!g.defined()) continue;
    if (g.device() != comm.device()) {
      local_ok = 0;
      why = "params[" + std::to_string(i) + "]: gradient on " + device_name(g.device()) + ", the " + comm.backend() +
            " communicator takes " + device_name(comm.device()) + " tensors";
    }
    grads[i] = g;
    for (const uint64_t x :
         {static_cast<uint64_t>(i), static_cast<uint64_t>(g.numel()), static_cast<uint64_t>(g.dtype())})
      sig = (sig ^ x) * 1099511628211ull;
  }
  // The record starts with the entry's tag, so a rank in another CP entry is
  // named as out of step (validate_cp.cpp's records start with another one).
  struct Wire {
    int64_t tag;
    int64_t ok;
    uint64_t sig;
    char why[200];
  } mine{kTag, local_ok, sig, {0}};
  std::strncpy(mine.why, why.c_str(), sizeof(mine.why) - 1);
  const char* entry = "all_reduce_grads";
  comm.check_usable(entry);
  const std::string local_error = "all_reduce_grads: " + why;
  if (detail::exchange_needed(comm, entry, &mine, sizeof(Wire), local_ok, local_error.c_str())) {
    std::vector<Wire> all(static_cast<size_t>(comm.size()));
    detail::forget_validated(comm, entry);
    detail::exchange_or_explain(comm, entry, all.data(), &mine, sizeof(Wire), local_ok, local_error.c_str());
    for (int r = 0; r < comm.size(); ++r)
      GDNCP_CHECK(all[static_cast<size_t>(r)].tag == kTag, "all_reduce_grads: rank ", r,
                  " is in a different gdncp call (the ranks are out of step)");
    for (int r = 0; r < comm.size(); ++r) {
      const Wire& w = all[static_cast<size_t>(r)];
      GDNCP_CHECK(w.ok, "all_reduce_grads: rank ", r, ": ", std::string(w.why, strnlen(w.why, sizeof(w.why))));
      GDNCP_CHECK(w.sig == all[0].sig, "all_reduce_grads: params: rank ", r,
                  " has a different set of gradients (which are defined, their sizes or dtypes) than rank 0");
    }
    detail::remember_validated(comm, entry, &mine, sizeof(Wire));
  } else {
    GDNCP_CHECK(local_ok, "all_reduce_grads: ", why);
  }

  for (const DType dt : {DType::f32, DType::f64, DType::bf16}) {
    int64_t total = 0;
    for (const Tensor& g : grads)
      if (g.defined() && g.dtype() == dt) total += g.numel();
    if (total == 0) continue;
    Tensor pack = Tensor::empty({total}, dt, comm.device());
    int64_t off = 0;
    for (const Tensor& g : grads)
      if (g.defined() && g.dtype() == dt) {
        kern::copy_region(pack, off, g, 0, g.numel());
        off += g.numel();
      }
    comm.all_reduce_sum(pack);
    off = 0;
    for (Tensor g : grads)
      if (g.defined() && g.dtype() == dt) {
        kern::copy_region(g, 0, pack, off, g.numel());
        gdncp::detail::bump_version(g);
        off += g.numel();
      }
  }
}

}  // namespace cp
}  // namespace gdncp
