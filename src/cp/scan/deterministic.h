// src/cp/scan/deterministic.h — the deterministic mode of the CP entries (docs/design.md §12).
//
// Note [deterministic scan]. The default CP scan (Note [CP scan]) folds per-rank
// composites, so its rounding depends on where the rank boundaries fall. In the
// deterministic mode every rank runs the single-rank scan over the global
// sequence instead: one all-gather of the per-frame transitions, inputs, decay
// and clip mask (padded to the longest rank), the one-rank path of
// scan_forward over all F_total frames (a one-rank communicator), and this
// rank's frames sliced out. Backward gathers every rank's states and state
// gradients, runs the one-rank scan_backward over the global sequence and
// slices dU, dP and dg. Every number is then computed by the same code in the
// same order as on one rank, whatever P and the ownership: bitwise the same.
// Cost: the per-frame exchange (O(F_total·D²) bytes per rank instead of
// O(P·D²)) and each rank scanning all frames (docs/design.md §12).
//
// Cross-rank sums (the norm weights' gradients) are per-frame partials added
// in global frame order on rank 0 (the other ranks hold zeros, so
// all_reduce_grads adds exact zeros to it).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "gdncp/cp.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace cp {
namespace detail {

struct ScanContext;
struct ScanJob;

// A group of one rank on `device`: collectives copy or do nothing. The
// single-rank layer runs the CP layer over it in the deterministic mode.
std::shared_ptr<Communicator> make_self_communicator(Device device);

// Every rank's frame count in rank order (one host exchange), for the
// deterministic mode's frame exchanges.
std::vector<int64_t> rank_frames(Communicator& comm, int64_t F);

// Note [deterministic scan]: scan_forward / the adjoints and transition
// gradients of scan_backward when ctx.frames is set and P > 1.
void deterministic_scan_forward(ScanContext& ctx, std::vector<ScanJob>& jobs);
void deterministic_scan_backward(ScanContext& ctx, std::vector<ScanJob>& jobs, Tensor& dg);

// partials (F, C) compute dtype: this rank's per-frame terms of a sum over frames (F =
// frames[rank]). out (C), any float dtype: on rank 0 the sum over all global
// frames added in global frame order (ranks concatenated in reverse order when
// reversed), zero on the other ranks. One all-gather.
void frame_ordered_sum(Communicator& comm, Tensor& out, const Tensor& partials, const std::vector<int64_t>& frames,
                       bool reversed);

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
