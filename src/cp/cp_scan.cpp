// src/cp/cp_scan.cpp — the differentiable CP scans of gdncp/cp.h: cp_scan
// (one direction, KV + Z, with reverse_rank_order and truncate_to_active) and
// cp_bidi_scan (both directions, docs/design.md §4 on the global sequence). Each is one
// autograd node over the scan engine (Note [CP scan], scan_engine.h).
//
// Gradients: P, A, Pz, bz in the compute dtype, decay in its dtype; all
// fresh tensors (activation gradients), summed into the leaves by the engine.
#include <memory>

#include "cp/cp_node.h"
#include "cp/scan/deterministic.h"
#include "cp/scan/exchange.h"
#include "cp/scan/kv_z_scan.h"
#include "cp/scan/scan_engine.h"
#include "cp/validate_cp.h"
#include "gdncp/cp.h"
#include "gdncp/error.h"
#include "layer/validate.h"

namespace gdncp {
namespace cp {
namespace {

using detail::ScanContext;
using detail::ScanJob;

enum Input { kP, kA, kPz, kBz, kDecay, kNumInputs };

void check_scan_inputs(const char* entry, const Tensor& P, const Tensor& A, const Tensor& Pz, const Tensor& bz,
                       const Tensor& decay, const Tensor& clip_starts, detail::CallRecord& rec) {
  GDNCP_CHECK(P.defined() && P.dim() == 4 && P.size(2) == P.size(3), entry, ": P: must be (B·H, F, D, D), got ",
              P.defined() ? P.str() : "undefined");
  const int64_t BH = P.size(0), F = P.size(1), D = P.size(2);
  GDNCP_CHECK(BH > 0 && F >= 0 && D > 0, entry, ": P: B·H and D must be > 0 (F ≥ 0), got ", P.str());
  GDNCP_CHECK(D <= kMaxHeadDim, entry, ": P: D = ", D, " exceeds the supported maximum ", kMaxHeadDim);
  GDNCP_CHECK(P.dtype() == DType::f32 || P.dtype() == DType::f64, entry,
              ": P: must be f32 or f64 (compute dtype), got ", dtype_name(P.dtype()));
  GDNCP_CHECK(P.dtype() == DType::f32 || P.device() == Device::cpu, entry, ": P: f64 is CPU-only");
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{A, "A"}, {Pz, "Pz"}}) {
    GDNCP_CHECK(t.defined() && t.shape() == P.shape(), entry, ": ", name, ": must be ", shape_str(P.shape()),
                " like P, got ", t.defined() ? t.str() : "undefined");
  }
  GDNCP_CHECK(bz.defined() && bz.shape() == Shape({BH, F, D}), entry, ": bz: must be (", BH, ", ", F, ", ", D,
              "), got ", bz.defined() ? bz.str() : "undefined");
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{A, "A"}, {Pz, "Pz"}, {bz, "bz"}}) {
    GDNCP_CHECK(t.dtype() == P.dtype(), entry, ": ", name, ": dtype ", dtype_name(t.dtype()), " != P's ",
                dtype_name(P.dtype()));
    GDNCP_CHECK(t.device() == P.device(), entry, ": ", name, ": on ", device_name(t.device()), ", P on ",
                device_name(P.device()));
  }
  GDNCP_CHECK(decay.defined() && decay.dim() == 3 && decay.size(0) * decay.size(1) == BH && decay.size(2) == F, entry,
              ": decay: must be (B, H, F) with B·H = ", BH, " and F = ", F, ", got ",
              decay.defined() ? decay.str() : "undefined");
  GDNCP_CHECK(decay.device() == P.device(), entry, ": decay: on ", device_name(decay.device()), ", P on ",
              device_name(P.device()));
  GDNCP_CHECK(decay.dtype() != DType::f64 || P.dtype() == DType::f64, entry, ": decay: f64 needs f64 P");
  validate_clip_starts(entry, clip_starts, decay.size(0), F, P.device());
  rec.B = decay.size(0);
  rec.H = decay.size(1);
  rec.D = D;
  rec.F = F;
  rec.S = 0;
  rec.dtype = static_cast<int64_t>(P.dtype());
  rec.device = static_cast<int64_t>(P.device());
}

class CpScanNode : public detail::CpNode {
 public:
  CpScanNode(std::shared_ptr<Communicator> comm, bool bidi, const CpOptions& o, int64_t offset, const Tensor& cuts,
             std::vector<int64_t> frames)
      : CpNode(std::move(comm), offset, std::move(frames)), bidi_(bidi), opt_(o), cuts_(cuts) {}
  const char* name() const override { return bidi_ ? "cp_bidi_scan" : "cp_scan"; }

  void save_state(const std::vector<Tensor>& in, const std::vector<ScanJob>& jobs, const ScanContext& ctx) {
    for (const Tensor& t : in) save(t);
    save(ctx.gathered);
    for (const ScanJob& j : jobs) {
      save(j.Y);
      save(j.X0);
    }
    n_jobs_ = jobs.size();
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor &P = saved(kP), &A = saved(kA), &Pz = saved(kPz), &bz = saved(kBz), &decay = saved(kDecay);
    const int64_t BH = P.size(0), F = P.size(1), D = P.size(2);
    ScanContext ctx =
        detail::scan_context(comm_, BH, F, D, decay, saved(kNumInputs), cuts_, decay.size(1), frames_, opt_);
    std::vector<ScanJob> jobs = detail::kv_z_jobs(P, A, Pz, bz, D, F, bidi_, opt_, offset_);
    for (size_t i = 0; i < n_jobs_; ++i) {
      jobs[i].Y = saved(kNumInputs + 1 + 2 * i);
      jobs[i].X0 = saved(kNumInputs + 2 + 2 * i);
    }
    const bool terminal = !bidi_ && opt_.truncate_to_active > 0;  // outputs 2, 3: the terminal M, z
    const detail::KvZGrads g = detail::kv_z_backward(ctx, jobs, bidi_, grads[0], grads[1],
                                                     terminal ? grads[2] : Tensor(), terminal ? grads[3] : Tensor());
    std::vector<Tensor> out(kNumInputs);
    out[kP] = g.dP;
    out[kA] = g.dA;
    out[kPz] = g.dPz;
    out[kBz] = g.dbz;
    if (needs_input_grad(kDecay)) out[kDecay] = g.dg.to(decay.dtype()).reshape(decay.shape());
    return out;
  }

 private:
  bool bidi_;
  CpOptions opt_;
  Tensor cuts_;  // the clip mask (not differentiable)
  size_t n_jobs_ = 0;
};

std::vector<Tensor> run_scan(Communicator& comm, const char* entry, const Tensor& P, const Tensor& A, const Tensor& Pz,
                             const Tensor& bz, const Tensor& decay, bool bidi, const CpOptions& o,
                             const Tensor& clip_starts) {
  detail::CallRecord rec;
  const detail::FrameLayout frames = detail::validate_collective(comm, entry, rec, [&](detail::CallRecord& r) {
    check_scan_inputs(entry, P, A, Pz, bz, decay, clip_starts, r);
    detail::check_cp_options(entry, o);
    r.reverse = o.reverse_rank_order;
    r.truncate = o.truncate_to_active;
    r.deterministic = o.deterministic;
  });
  detail::check_cp_options_global(entry, o, frames);
  const int64_t BH = P.size(0), F = P.size(1), D = P.size(2);
  std::vector<int64_t> counts = o.deterministic ? detail::rank_frames(comm, F) : std::vector<int64_t>();
  ScanContext ctx = detail::scan_context(comm, BH, F, D, decay, Tensor(), clip_starts, decay.size(1), counts, o);
  std::vector<ScanJob> jobs = detail::kv_z_jobs(P, A, Pz, bz, D, F, bidi, o, frames.offset);
  detail::scan_forward(ctx, jobs);

  const auto [M, z] = detail::kv_z_states(jobs, bidi);
  std::vector<Tensor> outputs = {M, z};
  if (!bidi && o.truncate_to_active > 0) {
    outputs.push_back(jobs[0].T);
    outputs.push_back(jobs[1].T);
  }
  const std::vector<Tensor> in = {P, A, Pz, bz, decay};
  if (autograd::should_record(in)) {
    auto node =
        std::make_shared<CpScanNode>(detail::shared_comm(comm, entry), bidi, o, frames.offset, clip_starts, ctx.frames);
    node->save_state(in, jobs, ctx);
    autograd::record(node, in, outputs);
  }
  return outputs;
}

}  // namespace

ScanResult cp_scan(Communicator& comm, const Tensor& P, const Tensor& A, const Tensor& Pz, const Tensor& bz,
                   const Tensor& decay, const CpOptions& options, const Tensor& clip_starts) {
  const std::vector<Tensor> out = run_scan(comm, "cp_scan", P, A, Pz, bz, decay, false, options, clip_starts);
  ScanResult r;
  r.M = out[0];
  r.z = out[1];
  detail::take_terminal_states(out, r.terminal_M, r.terminal_z);
  return r;
}

std::vector<Tensor> cp_bidi_scan(Communicator& comm, const Tensor& P, const Tensor& A, const Tensor& Pz,
                                 const Tensor& bz, const Tensor& decay, const Tensor& clip_starts,
                                 const CpOptions& cp_options) {
  detail::check_exchange_only("cp_bidi_scan", cp_options);
  return run_scan(comm, "cp_bidi_scan", P, A, Pz, bz, decay, true, cp_options, clip_starts);
}

}  // namespace cp
}  // namespace gdncp
