// src/cp/scan/kv_z_scan.h — the KV and Z scans of one CP call over the scan engine
// (Note [CP scan], scan_engine.h), shared by cp_scan / cp_bidi_scan and the CP
// layers bigdn_cp / cp_gdn_raw.
//
// Jobs, in this order: forward KV (P, A; E = D), forward Z (Pz, bz; E = 1)
// and, when bidirectional, the anti-causal KV and Z over the same transitions.
// Bidirectional results are the sums of both directions (M = Y_fwd + Y_anti);
// one-directional jobs follow reverse_rank_order and truncate_to_active.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "cp/scan/scan_engine.h"
#include "gdncp/cp.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace cp {
namespace detail {

// The jobs over P, A, Pz, bz (BH, F, D, D) / (BH, F, D) of this rank, whose
// frames start at global frame `offset`.
std::vector<ScanJob> kv_z_jobs(const Tensor& P, const Tensor& A, const Tensor& Pz, const Tensor& bz, int64_t D,
                               int64_t F, bool bidi, const CpOptions& o, int64_t offset);

// After scan_forward: M (BH, F, D, D) and z (BH, F, D), the forward states or,
// bidirectional, fresh sums of both directions.
std::pair<Tensor, Tensor> kv_z_states(const std::vector<ScanJob>& jobs, bool bidi);

// Gradients of the scans' inputs, fresh, compute dtype; dg (BH, F).
struct KvZGrads {
  Tensor dP, dA, dPz, dbz, dg;
};

// Backward of the scans (jobs with Y and X0 from the forward) given dM, dz and,
// one-directional with truncate_to_active, dT_M, dT_z of the terminal states
// (each may be undefined = zero; pass undefined for bidirectional calls).
KvZGrads kv_z_backward(ScanContext& ctx, std::vector<ScanJob>& jobs, bool bidi, const Tensor& dM, const Tensor& dz,
                       const Tensor& dT_M, const Tensor& dT_z);

// The terminal states of a one-directional call's outputs (out[2], out[3],
// present with truncate_to_active), into terminal_M and terminal_z.
inline void take_terminal_states(const std::vector<Tensor>& out, Tensor& terminal_M, Tensor& terminal_z) {
  if (out.size() > 2) {
    terminal_M = out[2];
    terminal_z = out[3];
  }
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
