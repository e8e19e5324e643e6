// src/cp/scan/scan_engine.h — the distributed frame scan of docs/design.md §6, forward and
// backward, for several scans ("jobs") that share one all-gather.
//
// Note [CP scan]. Each job scans Y_t = G_t Y_{t−1} + U_t (G_t = g_t (I − P_t),
// Note [scan step]) over the global sequence, in the logical rank order
// (rank_reverse: P−1 → 0). Forward, per job:
//   1. composites of this rank from a zero state: h = state after the local
//      frames, M = the product of the local transitions (a sweep from I, run
//      only where a correction needs it or another rank reads M: Note [which
//      composites travel] in scan_engine.cpp);
//   2. ONE all-gather of every job's (h, M) packed together (or the log-depth or
//      hierarchical exchange of Note [exchange] in exchange.h, which gives steps 3's X0 and T);
//   3. the incoming state X0 = fold over the logically earlier ranks of
//      X ← M_j X + h_j (and the terminal state, with truncation, the fold over
//      all ranks: identical on every rank, no broadcast needed);
//   4. the correction Y_t = Y_loc,t + Wcum_t X0 of docs/design.md §6 step 5, all frames
//      at once; a job of one state column (z), and one whose composite no rank reads on a
//      rank with other sweeps before the exchange, is instead swept again from X0
//      (Note [rescan] in scan_engine.cpp: the same linear map).
// Backward, per job, with λ the state adjoint:
//   1. dX0 = the adjoint of the rescan's initial state (a transposed sweep);
//   2. ONE all-gather of every job's dX0 (and dT of the terminal states);
//   3. a = the adjoint arriving from the logically later ranks:
//      a ← dX0_j + M_jᵀ a for j = P−1 … r+1, starting from Σ_ranks dT (or 0),
//      with the M_j kept from the forward gather;
//   4. the composite's gradient is folded into the rescan's last state:
//      ⟨dh, h⟩ + ⟨dM, M⟩ = ⟨a, h + M·X0⟩ = ⟨a, Y_last⟩, so one transposed sweep
//      seeded with a gives dU, and the outer products give dP and dg.
// The gathered composites are kept in ScanContext: a checkpoint recompute that
// passes them back in issues no collective.
//
// Uneven ownership: F is this rank's frame count and may differ between ranks
// (the composites are (BH, D, D) whatever F); a rank with F = 0 sweeps
// nothing and contributes h = 0, M = I. Clip starts (ctx.cuts) cut the sweeps
// of Note [clip cuts] (cp_kernels.h): a start inside a rank cuts its
// composite (M = 0 from there), and the anti-causal cut at the first frame of
// a rank (M̃ of the frame before = 0) falls on that rank's own anti-causal
// composite (h = M = 0), so it reaches the nearest non-empty rank before it
// with no halo of mask bits.
#pragma once

#include <cstdint>
#include <vector>

#include "cp/scan/region.h"
#include "gdncp/cp.h"
#include "gdncp/tensor.h"
#include "kernels/cp_kernels.h"

namespace gdncp {
namespace cp {
namespace detail {

// A state of the scan (X0, T, their adjoints): (BH, D) for a job of one column (E = 1: the z of
// the Z stream), else (BH, D, E).
inline Shape state_shape(int64_t BH, int64_t D, int64_t E) { return E == 1 ? Shape{BH, D} : Shape{BH, D, E}; }
// The states of F frames (Y, U and their gradients): (BH, F, D) for E = 1, else (BH, F, D, E).
inline Shape states_shape(int64_t BH, int64_t F, int64_t D, int64_t E) {
  return E == 1 ? Shape{BH, F, D} : Shape{BH, F, D, E};
}
// The state at elements [off, off + BH·D·E) of a packed buffer, as a view of it (no copy).
inline Tensor state_view(const Tensor& buf, int64_t off, int64_t BH, int64_t D, int64_t E) {
  return region(buf, off, BH * D * E).reshape(state_shape(BH, D, E));
}

// Fold f's result, its X computed when batch runs (kern::folds; X a new (BH, D, E) tensor where f has
// none) — or, for an f without X that needs no kernel, at once: over no rank from a zero state X = 0,
// over one rank from a zero state the view of that rank's h where it lies (no copy).
Tensor fold_into(Fold f, std::vector<Fold>& batch, int64_t BH, int64_t D);

struct ScanJob {
  // --- inputs
  Tensor P;                   // (BH, F, D, D) compute dtype
  Tensor U;                   // (BH, F, D, E)
  int64_t E = 0;              // D (KV) or 1 (Z)
  bool anti = false;          // flipped + shifted: out slot t = strictly-later state (bidi M̃); rank order P−1 → 0
  bool rank_reverse = false;  // rank order P−1 → 0 (local frames in their order)
  bool terminal = false;      // produce the terminal state (truncate_to_active)
  int64_t active = 0;         // frames t ≥ active of this rank are frozen (F: none)
  // --- forward results
  Tensor Y;   // (BH, F, D, E) states: inclusive, or strictly-later for anti
  Tensor X0;  // (BH, D, E) incoming state
  Tensor T;   // (BH, D, E) terminal state (terminal jobs)
  // --- backward inputs (undefined = zero) and targets
  Tensor dY, dT;
  Tensor dP;  // where dP goes: (BH, F, D, D), overwritten or accumulated
  bool dP_accumulate = false;
  Tensor dU;  // result (BH, F, D, E), fresh
};

struct ScanContext {
  Communicator* comm = nullptr;
  int64_t BH = 0, F = 0, D = 0;  // F: this rank's frames (≥ 0)
  Tensor decay;                  // (B, H, F), any float dtype
  Tensor gathered;               // (P · per-rank) composites; kept from the forward (set: no all-gather)
  Tensor cuts;                   // clip mask (B, F) f32 or undefined (Note [clip cuts])
  int64_t H = 1;                 // heads: row bh / H of cuts
  // The deterministic mode (Note [deterministic scan], deterministic.h): every
  // rank's F in rank order (empty: the default mode) and truncate_to_active.
  std::vector<int64_t> frames;
  int64_t truncate = 0;
  // How the composites travel (CpOptions); with log or hierarchical, `gathered` keeps what
  // src/cp/scan/exchange.h says instead of every rank's composites.
  Exchange exchange = Exchange::automatic;
  int node_size = 0;
  bool overlap = false;  // CpOptions::overlap_exchange (Note [hidden exchange], comm_stream.h)
};

// The scan context of a CP entry: what its options say of the scan (truncate_to_active, the
// exchange) comes from them here, in one place.
inline ScanContext scan_context(Communicator& comm, int64_t BH, int64_t F, int64_t D, const Tensor& decay,
                                const Tensor& gathered, const Tensor& cuts, int64_t H, std::vector<int64_t> frames,
                                const CpOptions& o) {
  ScanContext ctx{&comm, BH, F, D, decay, gathered, cuts, H, std::move(frames), o.truncate_to_active};
  ctx.exchange = o.exchange;
  ctx.node_size = o.node_size;
  ctx.overlap = o.overlap_exchange;
  return ctx;
}

// Frames of this rank (F of them from global frame `offset`) that stay active
// under truncate_to_active = K (0 = off).
int64_t active_frames(int64_t K, int64_t offset, int64_t F);

void scan_forward(ScanContext& ctx, std::vector<ScanJob>& jobs);
// dg (BH, F) compute dtype: the decay gradient, accumulated.
void scan_backward(ScanContext& ctx, std::vector<ScanJob>& jobs, Tensor& dg);

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
