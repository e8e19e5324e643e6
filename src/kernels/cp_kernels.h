// src/kernels/cp_kernels.h — the kernel twins of the CP scan and the camera branch.
//
// Like src/kernels/kernels.h: each function exists in gdncp::cp::cpu
// (src/cp/*_ref.cpp, templated on float and double) and gdncp::cp::cuda
// (src/cp/*.cu, f32), same signature; gdncp::cp::kern dispatches on the device
// of the first tensor argument that is defined. Outputs are preallocated by the
// caller and overwritten (or accumulated where an argument says so).
// Argument order: outputs, inputs, sizes/flags. CUDA twins run on
// gdncp::current_stream().
//
// Note [scan step]. The frame scans of docs/design.md §4/§6 are all sweeps of one step
// over frames, on a state Y of D×E (E = D for KV, 1 for Z), with the per-frame
// transition G_t = g_t (I − P_t) applied on the left:
//     1. Y += Vb_t                       (add_before, optional)
//     2. out_before_t = Y                (optional; 0 on a frozen step)
//     3. Y = g_t (Y − op(P_t) Y)         (op = identity, or transpose for adjoints; skipped when frozen)
//     4. Y += Ua_t                       (add_after, optional; skipped when frozen)
//     5. out_after_t = Y                 (optional)
// over t = 0..F−1 (or F−1..0 when descending), starting from Y = init (zero,
// identity, or a given (BH, D, E) tensor); final_state = Y after the sweep.
// Frozen steps are frames t ≥ active (truncate_to_active: W = I, U = 0).
// Forward scan:        ascending,  steps 3, 4, 5 (out_after = inclusive states M_t).
// Anti-causal scan:    descending, steps 2, 3, 4 (out_before = strictly-later states M̃_t).
// Their adjoints:      the reverse order with op = transpose and the state
//                      gradient added before (forward) or after (anti) the step.
//
// Note [clip cuts]. A clip mask c (B, F) (docs/design.md §4a; c_t ≠ 0: frame t of row
// bh / H begins a clip) cuts the sweep at its active frames: Y = 0 at the
// start of step t (Cut::before, before step 1) or at its end (Cut::after,
// after step 4, before step 5). Every sweep reads c_t of its own frame t:
//   forward scan   (M_t = A_t at a start):         before;
//   anti-causal    (M̃_{t−1} = 0: Y after step t):  after;
//   their adjoints (the same cut, transposed):     after (forward), before (anti);
// the sweeps from I (cumulative products) take the cut of the sweep they
// accompany. A cut frame's transition is unused, so scan_grad_outer gives it no
// gradient. Frozen frames ignore the mask.
#pragma once

#include <cstdint>
#include <vector>

#include "gdncp/error.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace cp {

enum class Init : uint8_t { zero, identity, given };
// Where a sweep zeroes its state at a clip start, Note [clip cuts].
enum class Cut : uint8_t { none, before, after };

struct SweepSpec {
  int64_t BH = 0, F = 0, D = 0, E = 0;
  bool descending = false;  // frames F−1 → 0
  bool transpose = false;   // op(P) = Pᵀ
  Init init = Init::zero;   // identity needs E == D
  int64_t active = 0;       // frames t ≥ active are frozen (pass F for none)
  Cut cut = Cut::none;      // with a mask: where it cuts
  int64_t H = 1;            // heads: row b = bh / H of the clip mask
};

// One sweep of Note [scan step] and its tensors (P required; the rest may be undefined).
struct Sweep {
  Tensor out_before, out_after, final_state;
  Tensor P, add_before, add_after, init;
  SweepSpec spec;
  int64_t final_offset = 0;  // elements into final_state where the (BH, D, E) final states go (a pack buffer)
  Tensor cuts;               // clip mask (B, F) f32, or undefined (no cut), Note [clip cuts]
  // A pair (optional): partner ≥ 0 names another sweep of the same scan_sweeps call (same F and E,
  // itself unpaired), and sum (BH, F, D, E) = this sweep's summed output + the partner's, where a
  // sweep's summed output is its out_after, or its out_before when it has no out_after (the
  // forward and anti-causal scans: M = Mf + Mr). CUDA runs a pair of one transpose and one mask
  // presence as one cluster of 2 per column block.
  Tensor sum;
  int partner = -1;
};

// One source of a transition gradient: an adjoint sweep's L (its out_before) and the states R of the
// forward sweep it belongs to (R0 its initial state; shifted: the anti-causal layout). active: its frozen frames.
struct OuterSource {
  Tensor L, R, R0;
  bool shifted = false;
  int64_t active = 0;
};
// The transition gradient of one P from one or two sources (Gr = Σ_sources Gr_src), see scan_grad_outer.
// Frames cut by the clip mask (B, F) f32 (row bh / H) get no transition gradient. Groups of one
// scan_grad_outers call may share dg (their terms are added in group order; the first may
// overwrite it, accumulate_dg = false).
struct OuterGroup {
  Tensor dP, dg, P;
  std::vector<OuterSource> sources;
  int64_t E = 0;
  bool accumulate_dP = false;
  Tensor cuts;
  int64_t H = 1;
  bool accumulate_dg = true;  // false: dg = this group's terms (0 where none), for the first of groups sharing dg
};

// One correction, see scan_correct(): X_t += C_t · v for every frame.
struct Correction {
  Tensor X, C, v;
  int64_t E = 0;
};

// One fold over ranks: X = init (undefined = 0); for j in order: X = op(M_j) X + H_j, op = transpose or
// identity. M_j = Mbuf[m_off + j·m_stride + ...] (BH, D, D), the identity when Mbuf is undefined; H_j
// likewise from Hbuf (BH, D, E). Without init the first step is X = H_j: that M_j is never read. X, init
// (BH, D, E), all of the compute dtype; X is overwritten.
struct Fold {
  Tensor X, init, Mbuf, Hbuf;
  int64_t m_off = 0, m_stride = 0, h_off = 0, h_stride = 0, E = 0;
  bool transpose = false;
  std::vector<int> order;
};

// Camera-branch sizes: q, k, v (B, H, D, N), N = F·S; beta (B,H,F,S) or per frame (B,H,F).
struct CamDims {
  int64_t B = 0, H = 0, D = 0, F = 0, S = 0;
  bool beta_per_frame = false;
  int64_t BH() const { return B * H; }
  int64_t N() const { return F * S; }
};

// The bounds of copy_region's rows in a tensor of numel elements: every row
// [off + r·pitch, off + r·pitch + n) inside it, products checked for overflow.
inline void check_region(const char* which, int64_t numel, int64_t off, int64_t n, int64_t rows, int64_t pitch) {
  GDNCP_CHECK(off >= 0 && n >= 0 && rows >= 0 && (rows <= 1 || pitch >= n), "copy_region: bad ", which,
              " region (offset ", off, ", ", rows, " rows of ", n, ", pitch ", pitch, ")");
  if (n == 0 || rows == 0) return;
  GDNCP_CHECK(off <= numel - n && checked_mul(rows - 1, pitch, "copy_region: rows × pitch") <= numel - n - off,
              "copy_region: ", which, " region (offset ", off, ", ", rows, " rows of ", n, ", pitch ", pitch,
              ") is not inside its ", numel, " elements");
}

#define GDNCP_CP_TWINS(NS)                                                                                              \
  namespace NS {                                                                                                        \
  /* The sweep of Note [scan step]. P (BH, F, D, D) and the states compute dtype; decay (BH·F) any float dtype;        \
     add_before / add_after / out_before / out_after (BH, F, D, E); init / final_state (BH, D, E). Every tensor         \
     argument except P and decay may be undefined (= absent). cuts: the clip mask (B, F) f32 (s.cut says where it       \
     cuts, Note [clip cuts]) or undefined. */                                                                           \
  void scan_sweep(Tensor& out_before, Tensor& out_after, Tensor& final_state, const Tensor& P, const Tensor& decay,     \
                  const Tensor& add_before, const Tensor& add_after, const Tensor& init, const SweepSpec& s,            \
                  const Tensor& cuts = Tensor());                                                                       \
                                                                                                                        \
  /* Gradient of the per-frame transitions from an adjoint sweep. For each (bh, t): Gr = L_t R'_tᵀ with R'_t the      \
     state before step t: R_t when shifted (anti-causal layout), else R_{t−1} (R0 for t = 0; R0 undefined = 0).       \
     dP_t = −g_t Gr (overwritten, or += when accumulate_dP), dg_t += ⟨Gr, I − P_t⟩ (always accumulated: every   \
     sweep of a layer shares the decay); frozen frames (t ≥ s.active) and frames cut by the mask cuts (B, F) f32      \
     (row bh / s.H; undefined = none) contribute 0. dP (BH, F, D, D), dg (BH, F), L, R (BH, F, D, E), R0 (BH, D, E),    \
     all compute dtype. */                                                                                              \
  void scan_grad_outer(Tensor& dP, Tensor& dg, const Tensor& L, const Tensor& R, const Tensor& R0, const Tensor& P,     \
                       const Tensor& decay, const SweepSpec& s, bool shifted, bool accumulate_dP,                       \
                       const Tensor& cuts = Tensor());                                                                  \
                                                                                                                        \
  /* Independent sweeps (none reads another's outputs) sharing decay, BH, F and D, and the sums of their pairs          \
     (Sweep::partner): one launch per transpose, mask presence and pairing on CUDA. */                                  \
  void scan_sweeps(std::vector<Sweep>& sweeps, const Tensor& decay);                                                    \
  /* Independent groups of scan_grad_outer (each group its own dP; dg shared or not): one launch on CUDA (after the     \
     KV groups' GEMMs). Per (bh, t): Gr = Σ over the group's sources; dP (=, +=) −g Gr, dg += ⟨Gr, I − P⟩. */  \
  void scan_grad_outers(std::vector<OuterGroup>& groups, const Tensor& decay, int64_t BH, int64_t F, int64_t D);        \
  /* Corrections X_t += C_t · v for all (bh, t) at once (docs/design.md §6 step 5): X (BH, F, D, E), C (BH, F, D, D)  \
     (cumulative transition products), v (BH, D, E). Independent corrections: one launch on CUDA. */                    \
  void scan_correct(std::vector<Correction>& cs, int64_t BH, int64_t F, int64_t D);                                     \
  /* Independent folds (Fold; none reads another's X): one launch on CUDA. */                                           \
  void folds(std::vector<Fold>& folds, int64_t BH, int64_t D);                                                          \
                                                                                                                        \
  /* dst[dst_off + r·dst_pitch + i] = src[src_off + r·src_pitch + i], i < n, r < rows (same dtype; pitches >= n       \
     when rows > 1): one strided copy on CUDA. */                                                                       \
  void copy_region(Tensor& dst, int64_t dst_off, const Tensor& src, int64_t src_off, int64_t n, int64_t rows = 1,       \
                   int64_t dst_pitch = 0, int64_t src_pitch = 0);                                                       \
  /* out = a + b elementwise (same shape and dtype; out may alias a). */                                                \
  void add(Tensor& out, const Tensor& a, const Tensor& b);                                                              \
                                                                                                                        \
  /* Camera phase A: per (bh, f), Pc = Σ_s β_s k_s k_sᵀ, Ac = Σ_s β_s k_s v_sᵀ (BH, F, D, D) compute dtype. */  \
  void cam_phase_a_fwd(Tensor& Pc, Tensor& Ac, const Tensor& k, const Tensor& v, const Tensor& beta,                    \
                       const CamDims& d);                                                                               \
  /* Its backward: overwrites dk, dv (B, H, D, N) and dbeta (beta's shape), in the inputs' dtype:                       \
     dk_s = β_s (dPc + dPcᵀ) k_s + β_s dAc v_s, dv_s = β_s dAcᵀ k_s, dβ_s = k_sᵀ dPc k_s + k_sᵀ dAc v_s. */ \
  void cam_phase_a_bwd(Tensor& dk, Tensor& dv, Tensor& dbeta, const Tensor& dPc, const Tensor& dAc, const Tensor& k,    \
                       const Tensor& v, const Tensor& beta, const CamDims& d);                                          \
  /* Camera output: out[bh, :, n] = M_fᵀ q[bh, :, n] (B, H, D, N) in out's dtype; M (BH, F, D, D) [key][value]. */    \
  void cam_out_fwd(Tensor& out, const Tensor& q, const Tensor& M, const CamDims& d);                                    \
  /* Its backward: dq = M_f dout (q's dtype, overwritten), dM_f = Σ_s q_s dout_sᵀ (compute dtype, overwritten). */   \
  void cam_out_bwd(Tensor& dq, Tensor& dM, const Tensor& dout, const Tensor& q, const Tensor& M, const CamDims& d);     \
  }

GDNCP_CP_TWINS(cpu)
GDNCP_CP_TWINS(cuda)
GDNCP_CP_TWINS(kern)

#undef GDNCP_CP_TWINS

}  // namespace cp
}  // namespace gdncp
