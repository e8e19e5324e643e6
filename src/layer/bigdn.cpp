// src/layer/bigdn.cpp — the public single-rank BiGDN layer (gdncp/bigdn.h).
//
// bigdn() is one autograd node over the fused kernel twins (kernels.h):
//   forward:  rms_stats → phase_a_fwd → scan_bidi_fwd → phase_c_fwd(divide)
//   backward: phase_c_bwd → rms_norm_bwd(q) → scan_bidi_bwd → phase_a_bwd → rms_norm_bwd(k)
// With checkpointing on, autograd::checkpoint keeps only the inputs and
// re-runs the forward in backward. bigdn_unfused() composes the fine ops of
// gdncp/ops.h instead (one node per op), an independent check of the math.
// An optional clip-start mask (docs/design.md §4a) only changes the scan; it is not
// differentiable and rides along in the node and the checkpoint's closure.
//
// Gradients: qkv, beta, decay in their own dtypes, present norm weights in
// theirs; the rope tables (k's and q's) and absent weights get none. Phase C
// rotates q with the q tables when given, else with the k tables. The node returns fresh
// gradients; the engine sums them into the leaves.
#include "gdncp/bigdn.h"

#include <cmath>
#include <memory>
#include <utility>

#include "autograd/tensor_internals.h"
#include "cp/scan/deterministic.h"
#include "gdncp/error.h"
#include "gdncp/ops.h"
#include "kernels/kernels.h"
#include "layer/layer_prep.h"
#include "layer/validate.h"

namespace gdncp {

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::automatic: return "automatic";
    case Precision::bf16: return "bf16";
    case Precision::tf32: return "tf32";
    case Precision::ieee: return "ieee";
  }
  return "unknown";
}

namespace {

// Inputs of the layer, in the order given to autograd::record.
// The q tables are undefined when q is rotated with the k tables.
enum Input { kQkv, kBeta, kDecay, kQNormW, kKNormW, kRopeCos, kRopeSin, kRopeCosQ, kRopeSinQ, kNumInputs };

// Forward intermediates that backward needs (besides the inputs).
struct Intermediates {
  Tensor rstd, P, Pz, Mf, Mr, zf, zr, Msum, zsum;
};

class BigdnNode : public autograd::Node {
 public:
  BigdnNode(const Dims& d, const BigdnOptions& opt, MathMode mode, Tensor clip_starts)
      : d_(d), opt_(opt), mode_(mode), clip_starts_(std::move(clip_starts)) {}
  const char* name() const override { return "bigdn"; }

  // Saves the inputs (an absent weight is saved as undefined) and the intermediates.
  void save_all(const std::vector<Tensor>& in, const Intermediates& m) {
    for (const Tensor& t : in) save(t);
    for (const Tensor* t : {&m.rstd, &m.P, &m.Pz, &m.Mf, &m.Mr, &m.zf, &m.zr, &m.Msum, &m.zsum}) save(*t);
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const auto input = [&](int i) -> const Tensor& { return saved(static_cast<size_t>(i)); };
    const auto mid = [&](size_t k) -> const Tensor& { return saved(kNumInputs + k); };
    const Tensor &qkv = input(kQkv), &beta = input(kBeta), &decay = input(kDecay), &qw = input(kQNormW),
                 &kw = input(kKNormW), &cs = input(kRopeCos), &sn = input(kRopeSin),
                 &csq = q_table(input(kRopeCosQ), cs), &snq = q_table(input(kRopeSinQ), sn);
    const Tensor &rstd = mid(0), &P = mid(1), &Pz = mid(2), &Mf = mid(3), &Mr = mid(4), &zf = mid(5), &zr = mid(6),
                 &Msum = mid(7), &zsum = mid(8);
    const Dims& d = d_;
    const Device dev = qkv.device();
    const DType ct = compute_dtype(qkv.dtype());
    const int64_t B = d.B, N = d.N(), H = d.H, D = d.D, F = d.F, BH = d.BH();

    Tensor dq_hat = Tensor::empty({B, N, H, D}, grad_hat_dtype(mode_, qkv.dtype()), dev);
    Tensor dMsum = Tensor::empty({BH, F, D, D}, ct, dev), dzsum = Tensor::empty({BH, F, D}, ct, dev);
    kernels::phase_c_bwd(dq_hat, dMsum, dzsum, grads[0], Tensor(), qkv, rstd, qw, csq, snq, Msum, zsum, d, opt_.eps,
                         /*divide=*/true, mode_);
    PrepGrads g =
        prep_backward_q(dq_hat, qkv, rstd, qw, kw, beta, d, needs_input_grad(kQNormW), needs_input_grad(kKNormW));
    dq_hat = Tensor();

    Tensor dP = Tensor::empty({BH, F, D, D}, ct, dev), dA = Tensor::empty({BH, F, D, D}, ct, dev);
    Tensor dPz = Tensor::empty({BH, F, D, D}, ct, dev), dbz = Tensor::empty({BH, F, D}, ct, dev);
    Tensor ddecay = Tensor::empty(decay.shape(), decay.dtype(), dev);
    kernels::scan_bidi_bwd(dP, dA, dPz, dbz, ddecay, dMsum, dzsum, P, Pz, decay, Mf, Mr, zf, zr, clip_starts_, d);

    prep_backward_k(g, dP, dA, dPz, dbz, qkv, rstd, kw, cs, sn, beta, d, opt_.k_scale, mode_);

    std::vector<Tensor> out(kNumInputs);
    if (needs_input_grad(kQkv)) out[kQkv] = g.dqkv;
    if (needs_input_grad(kBeta)) out[kBeta] = g.dbeta;
    if (needs_input_grad(kDecay)) out[kDecay] = ddecay;
    out[kQNormW] = g.dq_norm_w;
    out[kKNormW] = g.dk_norm_w;
    return out;
  }

 private:
  Dims d_;
  BigdnOptions opt_;
  MathMode mode_;
  Tensor clip_starts_;
};

// The fused forward on validated inputs; records one BigdnNode when needed.
// write_out false: the checkpoint's re-run in backward, which skips phase C
// and returns out shape-only (Note [checkpoint recompute] in src/autograd/checkpoint.cpp).
Tensor bigdn_fused(const std::vector<Tensor>& in, const Dims& d, const BigdnOptions& opt, const Tensor& clip_starts,
                   bool write_out) {
  const Tensor &qkv = in[kQkv], &beta = in[kBeta], &decay = in[kDecay], &qw = in[kQNormW], &kw = in[kKNormW],
               &cs = in[kRopeCos], &sn = in[kRopeSin], &csq = q_table(in[kRopeCosQ], cs),
               &snq = q_table(in[kRopeSinQ], sn);
  const Device dev = qkv.device();
  const DType ct = compute_dtype(qkv.dtype());
  const MathMode mode = resolve_math_mode(opt.precision, qkv.dtype());
  const int64_t B = d.B, N = d.N(), H = d.H, D = d.D, F = d.F, BH = d.BH();

  const Prep prep = prep_forward(qkv, qw, kw, cs, sn, beta, d, opt, mode);
  Intermediates m;
  m.rstd = prep.rstd;
  m.P = prep.P;
  m.Pz = prep.Pz;
  const Tensor &A = prep.A, &bz = prep.bz;

  m.Mf = Tensor::empty({BH, F, D, D}, ct, dev);
  m.Mr = Tensor::empty({BH, F, D, D}, ct, dev);
  m.Msum = Tensor::empty({BH, F, D, D}, ct, dev);
  m.zf = Tensor::empty({BH, F, D}, ct, dev);
  m.zr = Tensor::empty({BH, F, D}, ct, dev);
  m.zsum = Tensor::empty({BH, F, D}, ct, dev);
  kernels::scan_bidi_fwd(m.Mf, m.Mr, m.Msum, m.zf, m.zr, m.zsum, m.P, A, m.Pz, bz, decay, clip_starts, d);

  // The checkpoint's re-run returns out shape-only (Note [checkpoint recompute]).
  Tensor out =
      write_out ? Tensor::empty({B, N, H, D}, qkv.dtype(), dev) : detail::shape_only({B, N, H, D}, qkv.dtype(), dev);
  if (write_out) {
    Tensor den = Tensor::empty({B, H, N}, ct, dev);
    kernels::phase_c_fwd(out, den, qkv, m.rstd, qw, csq, snq, m.Msum, m.zsum, d, opt.eps, /*divide=*/true, mode);
  }

  if (autograd::should_record(in)) {
    auto node = std::make_shared<BigdnNode>(d, opt, mode, clip_starts);
    node->save_all(in, m);
    autograd::record(node, in, {out});
  }
  return out;
}

Tensor unfused_forward(const std::vector<Tensor>& in, int64_t F, int64_t S, const BigdnOptions& opt,
                       const Tensor& clip_starts) {
  const Tensor qkv_hat = ops::rms_norm(in[kQkv], in[kQNormW], in[kKNormW], opt.norm_eps);
  const std::vector<Tensor> prep = ops::relu_rope(qkv_hat, in[kRopeCos], in[kRopeSin], opt.k_scale);
  // With q tables of its own, q's half of a second relu_rope over them (its k half is unused).
  const std::vector<Tensor> prep_q =
      in[kRopeCosQ].defined() ? ops::relu_rope(qkv_hat, in[kRopeCosQ], in[kRopeSinQ], opt.k_scale) : prep;
  const Tensor &qp = prep_q[0], &kp = prep[1], &qr = prep_q[2], &kr = prep[3];
  const std::vector<Tensor> a = ops::phase_a(kr, kp, qkv_hat, in[kBeta], F, S);
  const std::vector<Tensor> scan = ops::bidi_scan(a[0], a[1], a[2], a[3], in[kDecay], clip_starts);
  const std::vector<Tensor> c = ops::phase_c(qr, qp, scan[0], scan[1], F, S);
  return ops::output_divide(c[0], c[1], opt.eps, in[kQkv].dtype());
}

}  // namespace

Tensor bigdn(const Tensor& qkv, const Tensor& beta, const Tensor& decay, const Tensor& q_norm_w, const Tensor& k_norm_w,
             const Tensor& rope_cos, const Tensor& rope_sin, int64_t F, int64_t S, const BigdnOptions& options,
             const Tensor& clip_starts, const Tensor& rope_cos_q, const Tensor& rope_sin_q) {
  const Dims d =
      validate_bigdn_inputs("bigdn", qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, options);
  validate_rope_q("bigdn", rope_cos_q, rope_sin_q, d, rope_cos, qkv.device());
  validate_clip_starts("bigdn", clip_starts, d.B, F, qkv.device());
  if (options.deterministic) {  // the CP layer's one-rank path, which the CP layers match bitwise (§12)
    const std::shared_ptr<cp::Communicator> self = cp::detail::make_self_communicator(qkv.device());
    return cp::bigdn_cp(*self, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, options, clip_starts);
  }
  // Per stream, as docs/design.md §1 says ("absent ⇒ no RMSNorm"): the Python reference normalises both when either
  // weight is given.
  const std::vector<Tensor> in = {qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q};
  const autograd::RecomputeFunction fn = [d, options, clip_starts](const std::vector<Tensor>& x, bool recompute) {
    return std::vector<Tensor>{bigdn_fused(x, d, options, clip_starts, /*write_out=*/!recompute)};
  };
  return autograd::checkpoint_layer(fn, in, options.checkpoint).at(0);
}

Tensor bigdn_unfused(const Tensor& qkv, const Tensor& beta, const Tensor& decay, const Tensor& q_norm_w,
                     const Tensor& k_norm_w, const Tensor& rope_cos, const Tensor& rope_sin, int64_t F, int64_t S,
                     const BigdnOptions& options, const Tensor& clip_starts, const Tensor& rope_cos_q,
                     const Tensor& rope_sin_q) {
  const Dims d =
      validate_bigdn_inputs("bigdn_unfused", qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, options);
  validate_rope_q("bigdn_unfused", rope_cos_q, rope_sin_q, d, rope_cos, qkv.device());
  validate_clip_starts("bigdn_unfused", clip_starts, d.B, F, qkv.device());
  GDNCP_CHECK(!qkv.is_cuda(), "bigdn_unfused: qkv: the unfused ops run on the CPU only (use bigdn on CUDA)");
  const std::vector<Tensor> in = {qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q};
  const autograd::Function fn = [F, S, options, clip_starts](const std::vector<Tensor>& x) {
    return std::vector<Tensor>{unfused_forward(x, F, S, options, clip_starts)};
  };
  return autograd::checkpoint(fn, in, options.checkpoint).at(0);
}

std::pair<Tensor, Tensor> rope_tables(int64_t N, int64_t D, DType dtype, Device device, int64_t offset, double base) {
  GDNCP_CHECK(N > 0, "rope_tables: N: must be > 0, got ", N);
  GDNCP_CHECK(D >= 2 && D % 2 == 0, "rope_tables: D: must be even and >= 2, got ", D);
  GDNCP_CHECK(dtype == DType::f32 || dtype == DType::f64, "rope_tables: dtype: must be f32 or f64, got ",
              dtype_name(dtype));
  GDNCP_CHECK(std::isfinite(base) && base > 0, "rope_tables: base: must be finite and > 0, got ", base);
  int64_t last = 0;
  GDNCP_CHECK(!__builtin_add_overflow(offset, N - 1, &last), "rope_tables: offset: ", offset, " + N - 1 (N = ", N,
              ") overflows int64");
  std::vector<double> c(static_cast<size_t>(checked_mul(N, D, "rope_tables: N·D (table size)"))), s(c.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < D / 2; ++i) {
      const double theta = static_cast<double>(n + offset) * std::pow(base, -2.0 * static_cast<double>(i) / D);
      const size_t e = static_cast<size_t>(n * D + 2 * i);
      c[e] = c[e + 1] = std::cos(theta);
      s[e] = -std::sin(theta);     // rope(x)[2i]   = x[2i]·cos − x[2i+1]·sin
      s[e + 1] = std::sin(theta);  // rope(x)[2i+1] = x[2i+1]·cos + x[2i]·sin
    }
  return {Tensor::from_vector(c, {N, D}, dtype, device), Tensor::from_vector(s, {N, D}, dtype, device)};
}

}  // namespace gdncp
