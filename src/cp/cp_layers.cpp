// src/cp/cp_layers.cpp — the CP layers of gdncp/cp.h: bigdn_cp (both
// directions, out = num/(den+eps)) and cp_gdn_raw (one direction, num and den).
//
// One autograd node per call over the fused kernel twins (kernels.h) and the
// scan engine (Note [CP scan]):
//   forward:  rms_stats → phase_a_fwd (Prep, once) → CP scans (one all-gather)
//             → phase_c_fwd (Output, once; divide for the layer, raw otherwise)
//   backward: phase_c_bwd → rms_norm_bwd(q) → CP scan backward (one all-gather)
//             → phase_a_bwd → rms_norm_bwd(k)
// The bidirectional layer runs the forward scan and the anti-causal scan over
// the same per-frame transitions: the anti-causal one is the rank-reversed scan
// of the flipped frames, shifted by one frame. The shift needs no halo
// exchange: the strictly-later state at a rank's last frame is exactly the
// state arriving from rank r+1, i.e. the rank's incoming state of the reversed
// scan, which the merge computes from the gathered composites anyway.
//
// Phase C rotates q with the q tables when given, else with the k tables.
//
// Gradients: qkv, beta, decay in their dtypes; the present norm weights in
// theirs, partial per rank (all_reduce_grads sums them). All fresh tensors.
//
// A rank with no frame (F = 0) runs no Prep and no Output, only the scans'
// collectives (its composites are the identity); its gradients are empty and
// its norm weights' gradients zero. Clip starts go to the scans only: Prep and
// Output are per frame.
#include <memory>
#include <utility>

#include "autograd/tensor_internals.h"
#include "cp/cp_node.h"
#include "cp/scan/deterministic.h"
#include "cp/scan/exchange.h"
#include "cp/scan/kv_z_scan.h"
#include "cp/scan/scan_engine.h"
#include "cp/validate_cp.h"
#include "gdncp/cp.h"
#include "gdncp/error.h"
#include "kernels/kernels.h"
#include "layer/layer_prep.h"
#include "layer/validate.h"

namespace gdncp {
namespace cp {
namespace {

using detail::ScanContext;
using detail::ScanJob;

// The q tables are undefined when q is rotated with the k tables.
enum Input { kQkv, kBeta, kDecay, kQNormW, kKNormW, kRopeCos, kRopeSin, kRopeCosQ, kRopeSinQ, kNumInputs };

class CpLayerNode : public detail::CpNode {
 public:
  CpLayerNode(std::shared_ptr<Communicator> comm, const Dims& d, const BigdnOptions& opt, const CpOptions& cpo,
              MathMode mode, bool bidi, int64_t offset, const Tensor& cuts, std::vector<int64_t> frames)
      : CpNode(std::move(comm), offset, std::move(frames)),
        d_(d),
        opt_(opt),
        cpo_(cpo),
        mode_(mode),
        bidi_(bidi),
        cuts_(cuts) {}
  const char* name() const override { return bidi_ ? "bigdn_cp" : "cp_gdn_raw"; }

  // Saved after the inputs: rstd, P, Pz, gathered, M, z (what phase C read), then Y, X0 per job.
  void save_state(const std::vector<Tensor>& in, const Tensor& rstd, const Tensor& P, const Tensor& Pz,
                  const ScanContext& ctx, const Tensor& M, const Tensor& z, const std::vector<ScanJob>& jobs) {
    for (const Tensor& t : in) save(t);
    for (const Tensor* t : {&rstd, &P, &Pz, &ctx.gathered, &M, &z}) save(*t);
    for (const ScanJob& j : jobs) {
      save(j.Y);
      save(j.X0);
    }
  }

  // Note [early release]: the saved forward state (P, Pz, the composites, M,
  // z, the scan states) is consumed once the scan backward is done, and the
  // peak of the backward comes after it (Prep's backward holds dk̂ and dqkv; q's
  // RMSNorm backward already ran, so dq̂ is gone). So the node keeps handles to what Prep's backward still reads
  // (the inputs, rstd) and releases its saved tensors there, with dM, dz and
  // the scan's adjoints.
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    // Handles, not references into the saved list: they outlive release().
    const Tensor qkv = saved(kQkv), beta = saved(kBeta), decay = saved(kDecay), qw = saved(kQNormW),
                 kw = saved(kKNormW), cs = saved(kRopeCos), sn = saved(kRopeSin), rstd = saved(kRstd),
                 csq = q_table(saved(kRopeCosQ), cs), snq = q_table(saved(kRopeSinQ), sn);
    const Dims& d = d_;
    const Device dev = qkv.device();
    const DType ct = compute_dtype(qkv.dtype());
    const int64_t B = d.B, N = d.N(), H = d.H, D = d.D, F = d.F, BH = d.BH();

    // Output (phase C) backward, then q's RMSNorm backward, so that dq̂ is gone before dk̂ exists.
    Tensor dq_hat = Tensor::empty({B, N, H, D}, grad_hat_dtype(mode_, qkv.dtype()), dev);
    Tensor dM = Tensor::empty({BH, F, D, D}, ct, dev), dz = Tensor::empty({BH, F, D}, ct, dev);
    const Tensor &M = saved(kM), &z = saved(kZ);  // not used after release()
    PrepGrads g;
    if (F == 0) {
      g = empty_rank_grads(qkv, beta, qw, kw);
    } else {
      if (bidi_)
        kernels::phase_c_bwd(dq_hat, dM, dz, grads[0], Tensor(), qkv, rstd, qw, csq, snq, M, z, d, opt_.eps, true,
                             mode_);
      else
        kernels::phase_c_bwd(dq_hat, dM, dz, grads[0], grads[1], qkv, rstd, qw, csq, snq, M, z, d, opt_.eps, false,
                             mode_);
      g = prep_backward_q(dq_hat, qkv, rstd, qw, kw, beta, d, needs_input_grad(kQNormW), needs_input_grad(kKNormW),
                          /*per_frame=*/!frames_.empty());
    }
    dq_hat = Tensor();

    // CP scan backward (one all-gather); then the saved state goes (Note [early release]).
    const detail::KvZGrads s = scan_backward(grads, dM, dz);
    dM = Tensor();
    dz = Tensor();
    release();

    // Prep (phase A + k's RMSNorm) backward.
    if (F > 0) prep_backward_k(g, s.dP, s.dA, s.dPz, s.dbz, qkv, rstd, kw, cs, sn, beta, d, opt_.k_scale, mode_);
    if (!frames_.empty()) {  // the deterministic mode: the norm weights' sums in global frame order, on rank 0
      g.dq_norm_w = ordered_norm_w_grad(g.dq_norm_w_frames, qw, needs_input_grad(kQNormW), ct);
      g.dk_norm_w = ordered_norm_w_grad(g.dk_norm_w_frames, kw, needs_input_grad(kKNormW), ct);
    }

    std::vector<Tensor> out(kNumInputs);
    if (needs_input_grad(kQkv)) out[kQkv] = g.dqkv;
    if (needs_input_grad(kBeta)) out[kBeta] = g.dbeta;
    if (needs_input_grad(kDecay)) out[kDecay] = s.dg.to(decay.dtype()).reshape(decay.shape());
    out[kQNormW] = g.dq_norm_w;
    out[kKNormW] = g.dk_norm_w;
    return out;
  }

 private:
  // Slots of the saved list after the inputs (save_state's order).
  enum Saved : size_t { kRstd = kNumInputs, kP, kPz, kGathered, kM, kZ, kJobs };

  // The gradients of a rank with no frame: empty, and zero for the norm weights
  // asked for (every rank must hold the same set of gradients for all_reduce_grads).
  PrepGrads empty_rank_grads(const Tensor& qkv, const Tensor& beta, const Tensor& qw, const Tensor& kw) const {
    PrepGrads g;
    g.dqkv = Tensor::zeros(qkv.shape(), qkv.dtype(), qkv.device());
    g.dbeta = Tensor::zeros(beta.shape(), beta.dtype(), beta.device());
    if (qw.defined() && needs_input_grad(kQNormW)) g.dq_norm_w = Tensor::zeros(qw.shape(), qw.dtype(), qw.device());
    if (kw.defined() && needs_input_grad(kKNormW)) g.dk_norm_w = Tensor::zeros(kw.shape(), kw.dtype(), kw.device());
    return g;
  }

  // The gradient of norm weight w from its per-frame terms (deterministic.h);
  // a rank with no frame has none. Collective where w gets a gradient.
  Tensor ordered_norm_w_grad(const Tensor& partials, const Tensor& w, bool wanted, DType ct) const {
    if (!w.defined() || !wanted) return Tensor();
    const Tensor p = partials.defined() ? partials : Tensor::empty({0, w.numel()}, ct, w.device());
    Tensor out = Tensor::empty(w.shape(), w.dtype(), w.device());
    detail::frame_ordered_sum(comm_, out, p, frames_, cpo_.reverse_rank_order);
    return out;
  }

  // The CP scans' backward (one all-gather) over the saved state; its jobs,
  // with their adjoints and handles, go on return.
  detail::KvZGrads scan_backward(const std::vector<Tensor>& grads, const Tensor& dM, const Tensor& dz) const {
    const Dims& d = d_;
    ScanContext ctx =
        detail::scan_context(comm_, d.BH(), d.F, d.D, saved(kDecay), saved(kGathered), cuts_, d.H, frames_, cpo_);
    std::vector<ScanJob> jobs =
        detail::kv_z_jobs(saved(kP), Tensor(), saved(kPz), Tensor(), d.D, d.F, bidi_, cpo_, offset_);
    for (size_t i = 0; i < jobs.size(); ++i) {
      jobs[i].Y = saved(kJobs + 2 * i);
      jobs[i].X0 = saved(kJobs + 2 * i + 1);
    }
    const bool terminal = !bidi_ && cpo_.truncate_to_active > 0;  // outputs 2, 3: the terminal M, z
    return detail::kv_z_backward(ctx, jobs, bidi_, dM, dz, terminal ? grads[2] : Tensor(),
                                 terminal ? grads[3] : Tensor());
  }

  Dims d_;
  BigdnOptions opt_;
  CpOptions cpo_;
  MathMode mode_;
  bool bidi_;
  Tensor cuts_;  // the clip mask (B, F) or undefined (not differentiable)
};

// The fused forward on validated inputs; records one CpLayerNode when needed.
// keep: the gathered composites, reused when set (checkpoint recompute: no
// collective) and filled otherwise. recompute: the checkpoint's re-run in
// backward, which skips phase C and returns num/den/out shape-only, as their
// values are never read (Note [checkpoint recompute] in src/autograd/checkpoint.cpp);
// terminal states are by-products of the scan and stay written.
std::vector<Tensor> layer_forward(Communicator& comm, const std::vector<Tensor>& in, const Dims& d,
                                  const BigdnOptions& opt, const CpOptions& cpo, bool bidi, int64_t offset,
                                  const Tensor& cuts, const std::vector<int64_t>& frames, Tensor* keep,
                                  bool recompute) {
  const Tensor &qkv = in[kQkv], &beta = in[kBeta], &decay = in[kDecay], &qw = in[kQNormW], &kw = in[kKNormW],
               &cs = in[kRopeCos], &sn = in[kRopeSin], &csq = q_table(in[kRopeCosQ], cs),
               &snq = q_table(in[kRopeSinQ], sn);
  const Device dev = qkv.device();
  const DType ct = compute_dtype(qkv.dtype());
  const MathMode mode = resolve_math_mode(opt.precision, qkv.dtype());
  const int64_t B = d.B, N = d.N(), H = d.H, D = d.D, F = d.F, BH = d.BH();

  // Prep: RMSNorm statistics and phase A, once for both directions (a rank with no frame: empty).
  Prep prep;
  if (F > 0) {
    prep = prep_forward(qkv, qw, kw, cs, sn, beta, d, opt, mode);
  } else {
    prep.rstd = Tensor::empty({B, 0, 2}, ct, dev);
    prep.P = Tensor::empty({BH, 0, D, D}, ct, dev);
    prep.A = Tensor::empty({BH, 0, D, D}, ct, dev);
    prep.Pz = Tensor::empty({BH, 0, D, D}, ct, dev);
    prep.bz = Tensor::empty({BH, 0, D}, ct, dev);
  }
  const Tensor &rstd = prep.rstd, &P = prep.P, &A = prep.A, &Pz = prep.Pz, &bz = prep.bz;

  // The CP scans: every direction's composites in one all-gather.
  ScanContext ctx = detail::scan_context(comm, BH, F, D, decay, keep ? *keep : Tensor(), cuts, H, frames, cpo);
  std::vector<ScanJob> jobs = detail::kv_z_jobs(P, A, Pz, bz, D, F, bidi, cpo, offset);
  detail::scan_forward(ctx, jobs);
  if (keep) *keep = ctx.gathered;
  const auto [M, z] = detail::kv_z_states(jobs, bidi);

  // Output: phase C once for both directions; the recompute's outputs are shape-only.
  const auto output = [&](const Shape& shape, DType dtype) {
    return recompute ? gdncp::detail::shape_only(shape, dtype, dev) : Tensor::empty(shape, dtype, dev);
  };
  const bool run_c = !recompute && F > 0;
  std::vector<Tensor> outputs;
  Tensor den = output({B, H, N}, ct);
  if (bidi) {
    Tensor out = output({B, N, H, D}, qkv.dtype());
    if (run_c) kernels::phase_c_fwd(out, den, qkv, rstd, qw, csq, snq, M, z, d, opt.eps, /*divide=*/true, mode);
    outputs = {out};
  } else {
    Tensor num = output({B, N, H, D}, ct);
    if (run_c) kernels::phase_c_fwd(num, den, qkv, rstd, qw, csq, snq, M, z, d, opt.eps, /*divide=*/false, mode);
    outputs = {num, den};
    if (cpo.truncate_to_active > 0) {
      outputs.push_back(jobs[0].T);
      outputs.push_back(jobs[1].T);
    }
  }

  if (autograd::should_record(in)) {
    auto node = std::make_shared<CpLayerNode>(detail::shared_comm(comm, bidi ? "bigdn_cp" : "cp_gdn_raw"), d, opt, cpo,
                                              mode, bidi, offset, cuts, frames);
    node->save_state(in, rstd, P, Pz, ctx, M, z, jobs);
    autograd::record(node, in, outputs);
  }
  return outputs;
}

// Local and cross-rank validation of a layer call; returns this rank's dims
// and its place in the global sequence.
std::pair<Dims, detail::FrameLayout> validate_layer(Communicator& comm, const char* entry,
                                                    const std::vector<Tensor>& in, int64_t F, int64_t S,
                                                    const BigdnOptions& opt, const CpOptions& cpo,
                                                    const Tensor& clip_starts) {
  Dims d;
  detail::CallRecord rec;
  const detail::FrameLayout frames = detail::validate_collective(comm, entry, rec, [&](detail::CallRecord& r) {
    d = validate_bigdn_inputs(entry, in[kQkv], in[kBeta], in[kDecay], in[kQNormW], in[kKNormW], in[kRopeCos],
                              in[kRopeSin], F, S, opt, /*allow_empty=*/true);
    validate_rope_q(entry, in[kRopeCosQ], in[kRopeSinQ], d, in[kRopeCos], in[kQkv].device());
    validate_clip_starts(entry, clip_starts, d.B, d.F, in[kQkv].device());
    detail::check_cp_options(entry, cpo);
    r.B = d.B;
    r.H = d.H;
    r.D = d.D;
    r.F = d.F;
    r.S = d.S;
    r.dtype = static_cast<int64_t>(in[kQkv].dtype());
    r.device = static_cast<int64_t>(in[kQkv].device());
    r.has_q_norm = in[kQNormW].defined();
    r.has_k_norm = in[kKNormW].defined();
    r.reverse = cpo.reverse_rank_order;
    r.truncate = cpo.truncate_to_active;
    r.k_scale = opt.k_scale;
    r.norm_eps = opt.norm_eps;
    r.eps = opt.eps;
    r.deterministic = cpo.deterministic;
  });
  detail::check_cp_options_global(entry, cpo, frames);
  return {d, frames};
}

// Runs the layer forward directly or under a checkpoint whose recompute
// reuses the gathered composites of the first run. The deterministic mode's
// frame counts are exchanged here, once: a recompute issues no collective.
std::vector<Tensor> run_layer(Communicator& comm, const std::vector<Tensor>& in, const Dims& d, const BigdnOptions& opt,
                              const CpOptions& cpo, bool bidi, int64_t offset, const Tensor& cuts) {
  const std::vector<int64_t> frames = cpo.deterministic ? detail::rank_frames(comm, d.F) : std::vector<int64_t>();
  if (!autograd::resolve_checkpoint(opt.checkpoint, in))
    return layer_forward(comm, in, d, opt, cpo, bidi, offset, cuts, frames, nullptr, /*recompute=*/false);
  auto keep = std::make_shared<Tensor>();
  const std::shared_ptr<Communicator> c = detail::graph_comm(comm, in, bidi ? "bigdn_cp" : "cp_gdn_raw");
  const autograd::RecomputeFunction fn = [c, d, opt, cpo, bidi, offset, cuts, frames, keep](
                                             const std::vector<Tensor>& x, bool recompute) {
    return layer_forward(*c, x, d, opt, cpo, bidi, offset, cuts, frames, keep.get(), recompute);
  };
  return autograd::checkpoint_layer(fn, in, Checkpoint::on);
}

}  // namespace

Tensor bigdn_cp(Communicator& comm, const Tensor& qkv, const Tensor& beta, const Tensor& decay, const Tensor& q_norm_w,
                const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, int64_t F, int64_t S,
                const BigdnOptions& options, const Tensor& clip_starts, const Tensor& rope_cos_q,
                const Tensor& rope_sin_q, const CpOptions& cp_options) {
  detail::check_exchange_only("bigdn_cp", cp_options);
  const std::vector<Tensor> in = {qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q};
  CpOptions cpo = cp_options;
  cpo.deterministic = cp_options.deterministic || options.deterministic;
  const auto [d, frames] = validate_layer(comm, "bigdn_cp", in, F, S, options, cpo, clip_starts);
  return run_layer(comm, in, d, options, cpo, true, frames.offset, clip_starts).at(0);
}

RawResult cp_gdn_raw(Communicator& comm, const Tensor& qkv, const Tensor& beta, const Tensor& decay,
                     const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin,
                     int64_t F, int64_t S, const BigdnOptions& options, const CpOptions& cp_options,
                     const Tensor& clip_starts, const Tensor& rope_cos_q, const Tensor& rope_sin_q) {
  const std::vector<Tensor> in = {qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q};
  CpOptions cpo = cp_options;
  cpo.deterministic = cp_options.deterministic || options.deterministic;
  const auto [d, frames] = validate_layer(comm, "cp_gdn_raw", in, F, S, options, cpo, clip_starts);
  const std::vector<Tensor> out = run_layer(comm, in, d, options, cpo, false, frames.offset, clip_starts);
  RawResult r;
  r.num = out[0];
  r.den = out[1];
  detail::take_terminal_states(out, r.terminal_M, r.terminal_z);
  return r;
}

}  // namespace cp
}  // namespace gdncp
