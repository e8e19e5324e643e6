// src/kernels/cp_dispatch.cpp — gdncp::cp::kern: picks the CPU or CUDA twin of
// each CP kernel (cp_kernels.h) by the device of its tensors.
#include <algorithm>

#include "gdncp/error.h"
#include "kernels/common/clip_guard.h"
#include "kernels/cp_kernels.h"

namespace gdncp {
namespace cp {
namespace kern {
namespace {

bool on_cuda(const Tensor& t) {
  if (t.device() != Device::cuda) return false;
#if GDNCP_WITH_CUDA
  return true;
#else
  GDNCP_FAIL("CUDA tensor given to a gdncp built without CUDA");
#endif
}

// What a kernel that reads a clip mask writes.
std::vector<Tensor> outputs_of(const Sweep& w) { return {w.out_before, w.out_after, w.final_state, w.sum}; }
std::vector<Tensor> outputs_of(const OuterGroup& g) { return {g.dP, g.dg}; }

// The masks a batch of kernels read, each checked once after the batch, with
// the outputs of its readers (Note [clip mask values] in clip_guard.h).
template <typename Item>
void guard_masks(const std::vector<Item>& items) {
  std::vector<std::pair<Tensor, std::vector<Tensor>>> by_mask;
  for (const Item& it : items) {
    if (!it.cuts.defined()) continue;
    auto g =
        std::find_if(by_mask.begin(), by_mask.end(), [&](const auto& m) { return m.first.data() == it.cuts.data(); });
    if (g == by_mask.end()) g = by_mask.insert(by_mask.end(), {it.cuts, {}});
    for (const Tensor& t : outputs_of(it)) {
      if (!t.defined()) continue;
      const bool seen =
          std::any_of(g->second.begin(), g->second.end(), [&](const Tensor& o) { return o.data() == t.data(); });
      if (!seen) g->second.push_back(t);
    }
  }
  for (const auto& [mask, outputs] : by_mask) kernels::guard_clip_mask(mask, outputs);
}

}  // namespace

#if GDNCP_WITH_CUDA
#define GDNCP_CP_DISPATCH(lead, call) \
  do {                                \
    if (on_cuda(lead))                \
      cuda::call;                     \
    else                              \
      cpu::call;                      \
  } while (0)
#else
#define GDNCP_CP_DISPATCH(lead, call) \
  do {                                \
    (void)on_cuda(lead);              \
    cpu::call;                        \
  } while (0)
#endif

void scan_sweep(Tensor& out_before, Tensor& out_after, Tensor& final_state, const Tensor& P, const Tensor& decay,
                const Tensor& add_before, const Tensor& add_after, const Tensor& init, const SweepSpec& s,
                const Tensor& cuts) {
  GDNCP_CP_DISPATCH(P, scan_sweep(out_before, out_after, final_state, P, decay, add_before, add_after, init, s, cuts));
  kernels::guard_clip_mask(cuts, {out_before, out_after, final_state});
}

void scan_grad_outer(Tensor& dP, Tensor& dg, const Tensor& L, const Tensor& R, const Tensor& R0, const Tensor& P,
                     const Tensor& decay, const SweepSpec& s, bool shifted, bool accumulate, const Tensor& cuts) {
  GDNCP_CP_DISPATCH(P, scan_grad_outer(dP, dg, L, R, R0, P, decay, s, shifted, accumulate, cuts));
  kernels::guard_clip_mask(cuts, {dP, dg});
}

void scan_sweeps(std::vector<Sweep>& sweeps, const Tensor& decay) {
  if (sweeps.empty()) return;
  GDNCP_CP_DISPATCH(sweeps.front().P, scan_sweeps(sweeps, decay));
  guard_masks(sweeps);
}

void scan_grad_outers(std::vector<OuterGroup>& groups, const Tensor& decay, int64_t BH, int64_t F, int64_t D) {
  if (groups.empty()) return;
  GDNCP_CP_DISPATCH(groups.front().P, scan_grad_outers(groups, decay, BH, F, D));
  guard_masks(groups);
}

void scan_correct(std::vector<Correction>& cs, int64_t BH, int64_t F, int64_t D) {
  if (cs.empty()) return;
  GDNCP_CP_DISPATCH(cs.front().X, scan_correct(cs, BH, F, D));
}

void folds(std::vector<Fold>& fs, int64_t BH, int64_t D) {
  if (fs.empty()) return;
  GDNCP_CP_DISPATCH(fs.front().X, folds(fs, BH, D));
}

void copy_region(Tensor& dst, int64_t dst_off, const Tensor& src, int64_t src_off, int64_t n, int64_t rows,
                 int64_t dst_pitch, int64_t src_pitch) {
  GDNCP_CHECK(dst.device() == src.device(), "copy_region: device mismatch");
  GDNCP_CP_DISPATCH(dst, copy_region(dst, dst_off, src, src_off, n, rows, dst_pitch, src_pitch));
}

void add(Tensor& out, const Tensor& a, const Tensor& b) { GDNCP_CP_DISPATCH(out, add(out, a, b)); }

void cam_phase_a_fwd(Tensor& Pc, Tensor& Ac, const Tensor& k, const Tensor& v, const Tensor& beta, const CamDims& d) {
  GDNCP_CP_DISPATCH(k, cam_phase_a_fwd(Pc, Ac, k, v, beta, d));
}

void cam_phase_a_bwd(Tensor& dk, Tensor& dv, Tensor& dbeta, const Tensor& dPc, const Tensor& dAc, const Tensor& k,
                     const Tensor& v, const Tensor& beta, const CamDims& d) {
  GDNCP_CP_DISPATCH(k, cam_phase_a_bwd(dk, dv, dbeta, dPc, dAc, k, v, beta, d));
}

void cam_out_fwd(Tensor& out, const Tensor& q, const Tensor& M, const CamDims& d) {
  GDNCP_CP_DISPATCH(q, cam_out_fwd(out, q, M, d));
}

void cam_out_bwd(Tensor& dq, Tensor& dM, const Tensor& dout, const Tensor& q, const Tensor& M, const CamDims& d) {
  GDNCP_CP_DISPATCH(q, cam_out_bwd(dq, dM, dout, q, M, d));
}

#undef GDNCP_CP_DISPATCH

}  // namespace kern
}  // namespace cp
}  // namespace gdncp
