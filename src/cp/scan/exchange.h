// src/cp/scan/exchange.h — the exchanges of the CP scan's composites other than the
// one all-gather (Note [CP scan], scan_engine.h): log-depth and hierarchical.
//
// Note [exchange]. Every rank r holds the affine map of its frames,
// f_r(X) = M_r X + h_r, and needs the exclusive prefix X0_r = f_{r−1}∘…∘f_0 (0)
// in its job's logical rank order (and, with truncation, the total on every
// rank); backward, the exclusive suffix of the adjoint maps g_j(a) = M_jᵀ a + dX0_j
// applied to Σ dT. Maps compose associatively, so:
//   log          — recursive doubling (Hillis–Steele) over the ranks: in round
//                  k = 0 … ⌈log₂P⌉−1 the rank at position p sends its inclusive
//                  composite of [p−2ᵏ+1, p] to p+2ᵏ and receives that of p−2ᵏ;
//                  one composite (M, h) per job per round, the two rank orders of
//                  a bidirectional call in opposite directions of the same round
//                  (one Communicator::send_recv_group: NCCL groups them);
//   hierarchical — ranks in nodes of n consecutive ranks (n divides P): a ring
//                  all-gather of the composites inside the node, the node's
//                  composite folded from it, the log scan over nodes between the
//                  ranks of one lane (rank mod n), then the fold over the
//                  node-mates before this rank from the node's incoming state.
//                  log is hierarchical with n = 1, where the node's composite
//                  is the rank's own (h, M), read where the ring put it.
// Each step's folds (the nodes' composites, X0, the seeds) run as one batch of
// every job, and a round's compositions as another (one launch each on CUDA).
// What travels is only what a receiver reads: a composite that starts at
// position 0 is applied to the zero state, so its M never travels (nor in the
// last round, where the receiver only applies what it gets); the M of the
// terminal fold is never needed. Both sides derive every count from (P, n,
// round, position, the jobs), so they agree by construction. A composite with
// an initial adjoint (backward with a terminal state) keeps its M throughout.
// Results differ from the all-gather's only by the association of the same
// products (rounding). The terminal state is broadcast from the last rank (the
// same bits everywhere); Σ dT is an all-reduce (bitwise the same everywhere).
//
// Kept for the backward and a checkpoint recompute (ScanContext::gathered):
// [the n node packs of the forward | X0 of every job | T of every terminal job], each written in
// place (the sweeps write the rank's own pack into its slot, the ring receives into the others,
// the folds write X0); a recompute reads X0 and T where they are and issues no collective.
#pragma once

#include <cstdint>
#include <vector>

#include "gdncp/cp.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace cp {
namespace detail {

// The exchange an entry runs and its node size (1 for log, P for all_gather).
struct ExchangePlan {
  Exchange algo = Exchange::all_gather;
  int node = 1;
};
// Resolves Exchange::automatic (docs/design.md §6) and the node size: node_size > 0, else the
// environment variable GDNCP_CP_NODE_SIZE, else Communicator::node_size() (0: one node). The
// same on every rank whose options agree; an error (naming exchange or node_size) otherwise.
ExchangePlan plan_exchange(Communicator& comm, Exchange requested, int node_size);

// The entries of both directions at once take only the exchange options: reverse_rank_order and
// truncate_to_active there raise gdncp::Error naming them.
void check_exchange_only(const char* entry, const CpOptions& o);

// One scan job as the exchange sees it (offsets in elements into the packs of scan_engine.cpp).
struct ExchangeJob {
  int64_t E = 0;
  bool reverse = false;  // logical order P−1 → 0
  bool terminal = false;
  int64_t h_off = 0, M_off = -1;     // forward pack: composite state, transition (-1: not packed)
  int64_t dX0_off = 0, dT_off = -1;  // backward pack: adjoint of X0, of the terminal state (-1: none)
};

// The elements of the buffer exchange_forward keeps: the node's packs, then X0 and T.
int64_t kept_elements(const ExchangePlan& plan, const std::vector<ExchangeJob>& jobs, int64_t fwd_total, int64_t BH,
                      int64_t D);
// Where this rank's pack lies in that buffer (elements): its lane's slot.
inline int64_t kept_pack_offset(const ExchangePlan& plan, int rank, int64_t fwd_total) {
  return (rank % plan.node) * fwd_total;
}

// Forward: X0[i] of every job and T[i] of every terminal job ((BH, D) for E = 1, else (BH, D, E);
// views into kept, the vectors resized to the jobs) from this rank's packed composites `pack`
// (fwd_total elements). pack undefined (a checkpoint recompute): the views of what kept holds, no
// collective. Otherwise it exchanges and sets kept, a new buffer where kept was undefined; where it
// is defined, it is the buffer of kept_elements() and pack is its slot at kept_pack_offset() (the
// sweeps wrote it in place: no copy).
void exchange_forward(Communicator& comm, const ExchangePlan& plan, const std::vector<ExchangeJob>& jobs,
                      const Tensor& pack, int64_t fwd_total, int64_t BH, int64_t D, Tensor& kept,
                      std::vector<Tensor>& X0, std::vector<Tensor>& T);

// Backward: seed[i] = the adjoint arriving from the logically later ranks (with Σ dT for terminal
// jobs), undefined where none arrives (the logically last rank of a job without a terminal state).
void exchange_backward(Communicator& comm, const ExchangePlan& plan, const std::vector<ExchangeJob>& jobs,
                       const Tensor& kept, int64_t fwd_total, const Tensor& pack, int64_t BH, int64_t D,
                       std::vector<Tensor>& seed);

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
