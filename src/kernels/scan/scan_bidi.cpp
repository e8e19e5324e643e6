// src/kernels/scan/scan_bidi.cpp — CPU twin of the single-rank bidirectional
// frame scan (docs/design.md §4, §4a), forward and backward, and the
// composition both twins run (scan_core, scan_bidi.h): the sweeps of the
// scan core (Note [scan step] and Note [clip cuts] in src/kernels/cp_kernels.h) through
// the cp::kern dispatchers, so the recurrence itself is coded once per device
// (cp::cpu; on CUDA src/kernels/scan/scan_sweep.cu).
//
// Per (b, h), with G_t = g_t (I − P_t):
//   Mf_t = G_t Mf_{t−1} + A_t (Mf_{−1} = 0):        ascending sweep, add_after A, out_after;  cut before.
//   Mr_{t−1} = G_t Mr_t + A_t (Mr_{F−1} = 0):        descending sweep, add_after A, out_before; cut after.
//   Msum = Mf + Mr (the pair's sum, Sweep::partner);  z the same with (Pz, bz) and E = 1.
// Backward, with Λ = dL/dMf and Λ̃ = dL/dMr (both get dMsum directly):
//   Λ_t = dMsum_t + G_{t+1}ᵀ Λ_{t+1}:     descending transposed sweep, add_before dMsum, out_before = Λ_t
//                                           (the adjoint of a cut before is a cut after);
//   Λ̃_t = dMsum_t + G_tᵀ Λ̃_{t−1}:         ascending transposed sweep, add_after dMsum, out_before = Λ̃_{t−1}
//                                           (cut before);
//   dA_t = Λ_t + Λ̃_{t−1} (the pair's sum);  dP_t, dg_t from scan_grad_outer(s) with the sources (Λ, Mf, unshifted) and
//   (Λ̃, Mr, shifted): Gr_t = Λ_t Mf_{t−1}ᵀ + Λ̃_{t−1} Mr_tᵀ, dP_t = −g_t Gr_t, dg_t = ⟨Gr_t, I − P_t⟩ over
//   both KV and z. A cut frame's transition is unused: its dP, dPz and ddecay are 0.
// The clip mask of this layer ignores column 0 (frame 0 has no transition from
// an earlier frame); the sweeps read it there too, with the same result: the
// state they would cut is zero or unused.
#include "kernels/scan/scan_bidi.h"

#include <initializer_list>
#include <vector>

#include "kernels/common/cpu_common.h"
#include "kernels/cp_kernels.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace scan_core {
namespace {

using cp::Cut;
using cp::Sweep;

// The spec of one sweep of this layer over (BH, F) frames, none frozen.
cp::SweepSpec spec(const Dims& d, int64_t E, bool descending, bool transpose, Cut cut) {
  cp::SweepSpec s;
  s.BH = d.BH();
  s.F = d.F;
  s.D = d.D;
  s.E = E;
  s.descending = descending;
  s.transpose = transpose;
  s.active = d.F;
  s.cut = cut;
  s.H = d.H;
  return s;
}

Sweep sweep(const Tensor& P, const Tensor& clip_starts, const cp::SweepSpec& s) {
  Sweep w;
  w.P = P;
  w.spec = s;
  w.cuts = clip_starts;
  return w;
}

Tensor like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

}  // namespace

void scan_bidi_fwd(Tensor& Mf, Tensor& Mr, Tensor& Msum, Tensor& zf, Tensor& zr, Tensor& zsum, const Tensor& P,
                   const Tensor& A, const Tensor& Pz, const Tensor& bz, const Tensor& decay, const Tensor& clip_starts,
                   const Dims& d) {
  std::vector<Sweep> sweeps;
  for (const bool anti : {false, true})
    for (const bool kv : {true, false}) {
      Sweep w = sweep(kv ? P : Pz, clip_starts,
                      spec(d, kv ? d.D : 1, /*descending=*/anti, /*transpose=*/false, anti ? Cut::after : Cut::before));
      w.add_after = kv ? A : bz;
      (anti ? w.out_before : w.out_after) = kv ? (anti ? Mr : Mf) : (anti ? zr : zf);
      if (!anti) {  // the pair (Mf, Mr) writes Msum, (zf, zr) zsum: sweeps 0, 1 pair with 2, 3
        w.partner = static_cast<int>(sweeps.size()) + 2;
        w.sum = kv ? Msum : zsum;
      }
      sweeps.push_back(w);
    }
  cp::kern::scan_sweeps(sweeps, decay);
}

void scan_bidi_bwd(Tensor& dP, Tensor& dA, Tensor& dPz, Tensor& dbz, Tensor& ddecay, const Tensor& dMsum,
                   const Tensor& dzsum, const Tensor& P, const Tensor& Pz, const Tensor& decay, const Tensor& Mf,
                   const Tensor& Mr, const Tensor& zf, const Tensor& zr, const Tensor& clip_starts, const Dims& d) {
  // The adjoint sweeps: L[kv][anti] = Λ (forward) or Λ̃ shifted (anti-causal), Note [scan step].
  const Tensor L[2][2] = {{like(dbz), like(dbz)}, {like(dA), like(dA)}};
  std::vector<Sweep> sweeps;
  for (const bool anti : {false, true})
    for (const bool kv : {true, false}) {
      Sweep w = sweep(kv ? P : Pz, clip_starts,
                      spec(d, kv ? d.D : 1, /*descending=*/!anti, /*transpose=*/true, anti ? Cut::before : Cut::after));
      (anti ? w.add_after : w.add_before) = kv ? dMsum : dzsum;
      w.out_before = L[kv][anti];
      if (!anti) {  // the pair (Λ, Λ̃') writes dA, and dbz likewise
        w.partner = static_cast<int>(sweeps.size()) + 2;
        w.sum = kv ? dA : dbz;
      }
      sweeps.push_back(w);
    }
  cp::kern::scan_sweeps(sweeps, decay);

  // The transition gradients: one group per P, into one dg (ddecay itself when it has the compute
  // dtype) that the first overwrites and the second adds to.
  const DType ct = compute_dtype(P.dtype());
  const bool direct = ddecay.dtype() == ct;
  Tensor dg = direct ? ddecay : Tensor::empty({d.B, d.H, d.F}, ct, P.device());
  std::vector<cp::OuterGroup> groups;
  for (const bool kv : {true, false}) {
    cp::OuterGroup g;
    g.dP = kv ? dP : dPz;
    g.dg = dg;
    g.accumulate_dg = !kv;
    g.P = kv ? P : Pz;
    g.E = kv ? d.D : 1;
    g.cuts = clip_starts;
    g.H = d.H;
    const Tensor& Rf = kv ? Mf : zf;
    const Tensor& Rr = kv ? Mr : zr;
    g.sources = {cp::OuterSource{L[kv][0], Rf, Tensor(), /*shifted=*/false, d.F},
                 cp::OuterSource{L[kv][1], Rr, Tensor(), /*shifted=*/true, d.F}};
    groups.push_back(g);
  }
  cp::kern::scan_grad_outers(groups, decay, d.BH(), d.F, d.D);
  if (!direct) ddecay.copy_from(dg.to(ddecay.dtype()));
}

}  // namespace scan_core

namespace cpu {

using namespace detail;

void scan_bidi_fwd(Tensor& Mf, Tensor& Mr, Tensor& Msum, Tensor& zf, Tensor& zr, Tensor& zsum, const Tensor& P,
                   const Tensor& A, const Tensor& Pz, const Tensor& bz, const Tensor& decay, const Tensor& clip_starts,
                   const Dims& d) {
  const char* op = "cpu::scan_bidi_fwd";
  const Shape mat_s = {d.BH(), d.F, d.D, d.D}, vec_s = {d.BH(), d.F, d.D};
  for (const Tensor* t : std::initializer_list<const Tensor*>{&Mf, &Mr, &Msum, &P, &A, &Pz})
    check_shape(*t, mat_s, op, "a (BH, F, D, D) tensor");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&zf, &zr, &zsum, &bz})
    check_shape(*t, vec_s, op, "a (BH, F, D) tensor");
  check_shape(decay, {d.B, d.H, d.F}, op, "decay");
  check_shape_if_defined(clip_starts, {d.B, d.F}, op, "clip_starts");
  scan_core::scan_bidi_fwd(Mf, Mr, Msum, zf, zr, zsum, P, A, Pz, bz, decay, clip_starts, d);
}

void scan_bidi_bwd(Tensor& dP, Tensor& dA, Tensor& dPz, Tensor& dbz, Tensor& ddecay, const Tensor& dMsum,
                   const Tensor& dzsum, const Tensor& P, const Tensor& Pz, const Tensor& decay, const Tensor& Mf,
                   const Tensor& Mr, const Tensor& zf, const Tensor& zr, const Tensor& clip_starts, const Dims& d) {
  const char* op = "cpu::scan_bidi_bwd";
  const Shape mat_s = {d.BH(), d.F, d.D, d.D}, vec_s = {d.BH(), d.F, d.D};
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dP, &dA, &dPz, &dMsum, &P, &Pz, &Mf, &Mr})
    check_shape(*t, mat_s, op, "a (BH, F, D, D) tensor");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dbz, &dzsum, &zf, &zr})
    check_shape(*t, vec_s, op, "a (BH, F, D) tensor");
  check_shape(ddecay, {d.B, d.H, d.F}, op, "ddecay");
  check_shape(decay, {d.B, d.H, d.F}, op, "decay");
  check_shape_if_defined(clip_starts, {d.B, d.F}, op, "clip_starts");
  scan_core::scan_bidi_bwd(dP, dA, dPz, dbz, ddecay, dMsum, dzsum, P, Pz, decay, Mf, Mr, zf, zr, clip_starts, d);
}

}  // namespace cpu
}  // namespace gdncp
