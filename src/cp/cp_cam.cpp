// src/cp/cp_cam.cpp — the camera branch, numerator only (gdncp/cp.h
// cp_cam_gdn_num; the Python reference's cp_fused_cam_gdn_num_autograd).
//
// One autograd node: camera phase A (Pc = Σ β k kᵀ, Ac = Σ β k vᵀ per frame)
// → the CP KV scan (Note [CP scan]; no Z stream) → out_s = M_fᵀ q_s. The Python reference
// scans S = Mᵀ right-multiplied (S_t = S_{t−1} W + U, W = g (I − Σ β k kᵀ),
// U = Σ β v kᵀ, out = S q); Pc is symmetric, so that is this scan transposed.
//
// Gradients: q, k, v, beta, decay in their dtypes, fresh tensors.
#include <memory>

#include "cp/cp_node.h"
#include "cp/scan/deterministic.h"
#include "cp/scan/scan_engine.h"
#include "cp/validate_cp.h"
#include "gdncp/cp.h"
#include "gdncp/error.h"
#include "kernels/cp_kernels.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace cp {
namespace {

using detail::ScanContext;
using detail::ScanJob;

enum Input { kQ, kK, kV, kBeta, kDecay, kNumInputs };

ScanJob cam_job(const Tensor& Pc, const Tensor& Ac, const CamDims& d, const CpOptions& o, int64_t offset) {
  ScanJob j;
  j.P = Pc;
  j.U = Ac;
  j.E = d.D;
  j.rank_reverse = o.reverse_rank_order;
  j.terminal = o.truncate_to_active > 0;
  j.active = detail::active_frames(o.truncate_to_active, offset, d.F);
  return j;
}

class CamNode : public detail::CpNode {
 public:
  CamNode(std::shared_ptr<Communicator> comm, const CamDims& d, const CpOptions& o, int64_t offset,
          std::vector<int64_t> frames)
      : CpNode(std::move(comm), offset, std::move(frames)), d_(d), opt_(o) {}
  const char* name() const override { return "cp_cam_gdn_num"; }

  // Saved after the inputs: Pc, gathered, Y, X0.
  void save_state(const std::vector<Tensor>& in, const Tensor& Pc, const ScanContext& ctx, const ScanJob& j) {
    for (const Tensor& t : in) save(t);
    for (const Tensor* t : {&Pc, &ctx.gathered, &j.Y, &j.X0}) save(*t);
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor &q = saved(kQ), &k = saved(kK), &v = saved(kV), &beta = saved(kBeta), &decay = saved(kDecay);
    const Tensor &Pc = saved(kNumInputs), &gathered = saved(kNumInputs + 1), &Y = saved(kNumInputs + 2),
                 &X0 = saved(kNumInputs + 3);
    const CamDims& d = d_;
    const Device dev = q.device();
    const DType ct = Pc.dtype();
    const int64_t BH = d.BH(), F = d.F, D = d.D;

    Tensor dq = Tensor::empty(q.shape(), q.dtype(), dev);
    Tensor dM = Tensor::empty({BH, F, D, D}, ct, dev);
    kern::cam_out_bwd(dq, dM, grads[0], q, Y, d);

    ScanContext ctx = detail::scan_context(comm_, BH, F, D, decay, gathered, Tensor(), d.H, frames_, opt_);
    std::vector<ScanJob> jobs = {cam_job(Pc, Tensor(), d, opt_, offset_)};
    jobs[0].Y = Y;
    jobs[0].X0 = X0;
    jobs[0].dY = dM;
    if (opt_.truncate_to_active > 0) jobs[0].dT = grads[1];
    Tensor dPc = Tensor::empty({BH, F, D, D}, ct, dev);
    jobs[0].dP = dPc;
    Tensor dg = Tensor::zeros({BH, F}, ct, dev);
    detail::scan_backward(ctx, jobs, dg);

    Tensor dk = Tensor::empty(k.shape(), k.dtype(), dev), dv = Tensor::empty(v.shape(), v.dtype(), dev);
    Tensor dbeta = Tensor::empty(beta.shape(), beta.dtype(), dev);
    kern::cam_phase_a_bwd(dk, dv, dbeta, dPc, jobs[0].dU, k, v, beta, d);

    std::vector<Tensor> out(kNumInputs);
    if (needs_input_grad(kQ)) out[kQ] = dq;
    if (needs_input_grad(kK)) out[kK] = dk;
    if (needs_input_grad(kV)) out[kV] = dv;
    if (needs_input_grad(kBeta)) out[kBeta] = dbeta;
    if (needs_input_grad(kDecay)) out[kDecay] = dg.to(decay.dtype()).reshape(decay.shape());
    return out;
  }

 private:
  CamDims d_;
  CpOptions opt_;
};

std::vector<Tensor> cam_forward(Communicator& comm, const std::vector<Tensor>& in, const CamDims& d, const CpOptions& o,
                                int64_t offset, const std::vector<int64_t>& frames, Tensor* keep) {
  const Tensor &q = in[kQ], &k = in[kK], &v = in[kV], &beta = in[kBeta], &decay = in[kDecay];
  const Device dev = q.device();
  const DType ct = compute_dtype(q.dtype());
  const int64_t BH = d.BH(), F = d.F, D = d.D;
  Tensor Pc = Tensor::empty({BH, F, D, D}, ct, dev), Ac = Tensor::empty({BH, F, D, D}, ct, dev);
  kern::cam_phase_a_fwd(Pc, Ac, k, v, beta, d);
  ScanContext ctx = detail::scan_context(comm, BH, F, D, decay, keep ? *keep : Tensor(), Tensor(), d.H, frames, o);
  std::vector<ScanJob> jobs = {cam_job(Pc, Ac, d, o, offset)};
  detail::scan_forward(ctx, jobs);
  if (keep) *keep = ctx.gathered;
  Tensor out = Tensor::empty(q.shape(), q.dtype(), dev);
  kern::cam_out_fwd(out, q, jobs[0].Y, d);
  std::vector<Tensor> outputs = {out};
  if (o.truncate_to_active > 0) outputs.push_back(jobs[0].T);
  if (autograd::should_record(in)) {
    auto node = std::make_shared<CamNode>(detail::shared_comm(comm, "cp_cam_gdn_num"), d, o, offset, frames);
    node->save_state(in, Pc, ctx, jobs[0]);
    autograd::record(node, in, outputs);
  }
  return outputs;
}

void check_cam_inputs(const char* entry, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                      const Tensor& decay, int64_t F, int64_t S, CamDims& d, detail::CallRecord& rec) {
  GDNCP_CHECK(F >= 0, entry, ": F: must be >= 0 (frames of this rank), got ", F);
  GDNCP_CHECK(S > 0, entry, ": S: must be > 0, got ", S);
  GDNCP_CHECK(q.defined() && q.dim() == 4, entry, ": q: must be (B, H, D, N), got ",
              q.defined() ? q.str() : "undefined");
  d.B = q.size(0);
  d.H = q.size(1);
  d.D = q.size(2);
  d.F = F;
  d.S = S;
  GDNCP_CHECK(d.B > 0 && d.H > 0 && d.D > 0, entry, ": q: sizes must be > 0, got ", q.str());
  GDNCP_CHECK(d.D <= kMaxHeadDim, entry, ": q: D = ", d.D, " exceeds the supported maximum ", kMaxHeadDim);
  GDNCP_CHECK(q.size(3) == F * S, entry, ": q: N = ", q.size(3), " must equal F·S = ", F * S);
  GDNCP_CHECK(q.dtype() != DType::f64 || q.device() == Device::cpu, entry, ": q: f64 is CPU-only");
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{k, "k"}, {v, "v"}}) {
    GDNCP_CHECK(t.defined() && t.shape() == q.shape(), entry, ": ", name, ": must be ", shape_str(q.shape()),
                " like q, got ", t.defined() ? t.str() : "undefined");
  }
  GDNCP_CHECK(beta.defined() && (beta.shape() == Shape({d.B, d.H, F, S}) || beta.shape() == Shape({d.B, d.H, F})),
              entry, ": beta: must be (B, H, F, S) or (B, H, F) = (", d.B, ", ", d.H, ", ", F, "[, ", S, "]), got ",
              beta.defined() ? beta.str() : "undefined");
  d.beta_per_frame = beta.dim() == 3;
  GDNCP_CHECK(decay.defined() && decay.shape() == Shape({d.B, d.H, F}), entry, ": decay: must be (", d.B, ", ", d.H,
              ", ", F, "), got ", decay.defined() ? decay.str() : "undefined");
  for (const auto& [t, name] :
       {std::pair<const Tensor&, const char*>{k, "k"}, {v, "v"}, {beta, "beta"}, {decay, "decay"}}) {
    GDNCP_CHECK(t.dtype() == q.dtype(), entry, ": ", name, ": dtype ", dtype_name(t.dtype()), " != q's ",
                dtype_name(q.dtype()));
    GDNCP_CHECK(t.device() == q.device(), entry, ": ", name, ": on ", device_name(t.device()), ", q on ",
                device_name(q.device()));
  }
  rec.B = d.B;
  rec.H = d.H;
  rec.D = d.D;
  rec.F = F;
  rec.S = S;
  rec.dtype = static_cast<int64_t>(q.dtype());
  rec.device = static_cast<int64_t>(q.device());
  rec.beta_per_frame = d.beta_per_frame;
}

}  // namespace

CamResult cp_cam_gdn_num(Communicator& comm, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                         const Tensor& decay, int64_t F, int64_t S, const CpOptions& cp_options,
                         Checkpoint checkpoint) {
  const char* entry = "cp_cam_gdn_num";
  CamDims d;
  detail::CallRecord rec;
  const detail::FrameLayout frames = detail::validate_collective(comm, entry, rec, [&](detail::CallRecord& r) {
    check_cam_inputs(entry, q, k, v, beta, decay, F, S, d, r);
    detail::check_cp_options(entry, cp_options);
    r.reverse = cp_options.reverse_rank_order;
    r.truncate = cp_options.truncate_to_active;
    r.deterministic = cp_options.deterministic;
  });
  detail::check_cp_options_global(entry, cp_options, frames);
  const int64_t offset = frames.offset;
  // The deterministic mode's frame counts, exchanged here: a checkpoint recompute issues no collective.
  const std::vector<int64_t> counts =
      cp_options.deterministic ? detail::rank_frames(comm, d.F) : std::vector<int64_t>();
  const std::vector<Tensor> in = {q, k, v, beta, decay};
  std::vector<Tensor> out;
  if (autograd::resolve_checkpoint(checkpoint, in)) {
    auto keep = std::make_shared<Tensor>();
    const std::shared_ptr<Communicator> c = detail::graph_comm(comm, in, "cp_cam_gdn_num");
    const autograd::Function fn = [c, d, cp_options, offset, counts, keep](const std::vector<Tensor>& x) {
      return cam_forward(*c, x, d, cp_options, offset, counts, keep.get());
    };
    out = autograd::checkpoint(fn, in, Checkpoint::on);
  } else {
    out = cam_forward(comm, in, d, cp_options, offset, counts, nullptr);
  }
  CamResult r;
  r.out = out[0];
  if (out.size() > 1) r.terminal_M = out[1];
  return r;
}

}  // namespace cp
}  // namespace gdncp
