// fp64 central-difference gradient checks (max relative error <= tol::gradcheck_scan) of
//  - every fine-grained op of gdncp/ops.h,
//  - every pair of CPU kernel twins (forward + backward twin wrapped here as one
//    autograd node): prep + phase A, the bidirectional scan, prep + phase C in
//    divide and raw mode (the RMSNorm twins rms_stats/rms_norm_bwd ride along
//    in the prep chains),
//  - the whole layer bigdn (with, without and with one norm weight, checkpoint on).
// Shapes cover D ∈ {12, 24, 112}, S = 1, F = 1 and B·H > 1. fp64 central
// differences with step 1e-6 are accurate to ~1e-9 relative on these smooth,
// well-conditioned inputs.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <memory>

#include "bigdn_fixtures.h"
#include "kernels/kernels.h"
#include "util/test_util.h"
#include "util/tolerance.h"

namespace gdncp {
namespace test {
namespace {

constexpr double kTol = tol::gradcheck_scan;
const DType f64 = DType::f64;
const Device cpu_dev = Device::cpu;

using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

void expect_gradcheck(const std::string& what, const Fn& fn, const std::vector<Tensor>& inputs,
                      int64_t max_elems = 64) {
  const GradcheckResult r = gradcheck(fn, inputs, 1e-6, max_elems);
  std::printf("[gradcheck] %-48s max rel error %.3e\n", what.c_str(), r.max_rel_error);
  EXPECT_LE(r.max_rel_error, kTol) << what << "\n" << r.report;
}

// An op of four inputs and the frames F and tokens per frame S (ops::phase_a, ops::phase_c).
using FrameOp = std::vector<Tensor> (*)(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t);

// The shapes every op is checked on: D ∈ {12, 24, 112}, S = 1, F = 1, B·H > 1.
std::vector<Dims> op_shapes() {
  return {dims(2, 1, 12, 2, 3), dims(1, 2, 24, 1, 2), dims(1, 1, 112, 2, 1), dims(2, 2, 12, 3, 1)};
}

Tensor randn(const Shape& s, uint64_t seed, double stddev = 1.0) {
  return Tensor::randn(s, f64, cpu_dev, seed, stddev).requires_grad_();
}
Tensor uniform(const Shape& s, uint64_t seed, double lo, double hi) {
  return Tensor::uniform(s, f64, cpu_dev, seed, lo, hi).requires_grad_();
}

// --- fine-grained ops -------------------------------------------------------------------

TEST(OpsGradcheck, RmsNorm) {
  uint64_t seed = 100;
  for (const Dims& d : op_shapes())
    for (int weights = 0; weights < 3; ++weights) {  // both, q only, none
      const Tensor qkv = randn({d.B, d.N(), 3, d.H, d.D}, ++seed);
      const Tensor qw = uniform({d.C()}, ++seed, 0.5, 1.5);
      const Tensor kw = weights == 0 ? uniform({d.C()}, ++seed, 0.5, 1.5) : Tensor();
      const Tensor q = weights < 2 ? qw : Tensor();
      expect_gradcheck(
          "ops::rms_norm w" + std::to_string(weights) + " " + dims_str(d),
          [](const std::vector<Tensor>& x) { return std::vector<Tensor>{ops::rms_norm(x[0], x[1], x[2], 1e-5)}; },
          {qkv, q, kw});
    }
}

TEST(OpsGradcheck, ReluRope) {
  uint64_t seed = 200;
  for (const Dims& d : op_shapes()) {
    const Tensor qkv_hat = randn({d.B, d.N(), 3, d.H, d.D}, ++seed);
    auto rope = rope_tables(d.N(), d.D, f64, cpu_dev, 5);
    rope.first.requires_grad_();
    rope.second.requires_grad_();
    const double k_scale = 0.37;
    expect_gradcheck("ops::relu_rope " + dims_str(d),
                     [k_scale](const std::vector<Tensor>& x) { return ops::relu_rope(x[0], x[1], x[2], k_scale); },
                     {qkv_hat, rope.first, rope.second});
  }
}

// Gradcheck of op at the F and S of the shape d.
void expect_frame_op_gradcheck(const std::string& name, FrameOp op, const Dims& d, const std::vector<Tensor>& inputs) {
  const int64_t F = d.F, S = d.S;
  expect_gradcheck(
      name + " " + dims_str(d), [op, F, S](const std::vector<Tensor>& x) { return op(x[0], x[1], x[2], x[3], F, S); },
      inputs);
}

TEST(OpsGradcheck, PhaseA) {
  uint64_t seed = 300;
  for (const Dims& d : op_shapes()) {
    const Tensor kr = randn({d.B, d.N(), d.H, d.D}, ++seed, 0.3);
    const Tensor kp = randn({d.B, d.N(), d.H, d.D}, ++seed, 0.3);
    const Tensor qkv_hat = randn({d.B, d.N(), 3, d.H, d.D}, ++seed);
    const Tensor beta = uniform({d.B, d.H, d.F, d.S}, ++seed, 0.1, 0.9);
    expect_frame_op_gradcheck("ops::phase_a", ops::phase_a, d, {kr, kp, qkv_hat, beta});
  }
}

TEST(OpsGradcheck, BidiScan) {
  uint64_t seed = 400;
  for (const Dims& d : op_shapes()) {
    const int64_t BH = d.BH(), F = d.F, D = d.D;
    const double s = 1.0 / D;  // keeps ‖P‖ around 1/√D
    const Tensor P = randn({BH, F, D, D}, ++seed, s), A = randn({BH, F, D, D}, ++seed);
    const Tensor Pz = randn({BH, F, D, D}, ++seed, s), b = randn({BH, F, D}, ++seed);
    const Tensor decay = uniform({d.B, d.H, F}, ++seed, 0.5, 0.99);
    expect_gradcheck("ops::bidi_scan " + dims_str(d),
                     [](const std::vector<Tensor>& x) { return ops::bidi_scan(x[0], x[1], x[2], x[3], x[4]); },
                     {P, A, Pz, b, decay});
  }
}

TEST(OpsGradcheck, PhaseC) {
  uint64_t seed = 500;
  for (const Dims& d : op_shapes()) {
    const Tensor qr = randn({d.B, d.N(), d.H, d.D}, ++seed), qp = randn({d.B, d.N(), d.H, d.D}, ++seed);
    const Tensor M = randn({d.BH(), d.F, d.D, d.D}, ++seed), z = randn({d.BH(), d.F, d.D}, ++seed);
    expect_frame_op_gradcheck("ops::phase_c", ops::phase_c, d, {qr, qp, M, z});
  }
}

TEST(OpsGradcheck, OutputDivide) {
  uint64_t seed = 600;
  for (const Dims& d : op_shapes()) {
    const Tensor num = randn({d.B, d.N(), d.H, d.D}, ++seed);
    const Tensor den = uniform({d.B, d.H, d.N()}, ++seed, 0.5, 2.0);
    expect_gradcheck("ops::output_divide " + dims_str(d),
                     [](const std::vector<Tensor>& x) {
                       return std::vector<Tensor>{ops::output_divide(x[0], x[1], 1e-6, DType::f64)};
                     },
                     {num, den});
  }
}

// --- kernel twin pairs, wrapped as one node each ------------------------------------------

class FnNode : public autograd::Node {
 public:
  FnNode(const char* name, Fn bwd) : name_(name), bwd_(std::move(bwd)) {}
  const char* name() const override { return name_; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override { return bwd_(g); }

 private:
  const char* name_;
  Fn bwd_;
};

std::vector<Tensor> with_backward(const char* name, const std::vector<Tensor>& inputs,
                                  const std::vector<Tensor>& outputs, Fn bwd) {
  if (autograd::should_record(inputs))
    autograd::record(std::make_shared<FnNode>(name, std::move(bwd)), inputs, outputs);
  return outputs;
}

Tensor empty(const Shape& s) { return Tensor::empty(s, f64, cpu_dev); }
Tensor zeros(const Shape& s) { return Tensor::zeros(s, f64, cpu_dev); }

// prep of k + phase A: (qkv, beta, k_norm_w) -> (P, A, Pz, bz), rope tables fixed.
// Backward: phase_a_bwd, then rms_norm_bwd for the k stream (dq̂ = 0).
std::vector<Tensor> twin_phase_a(const std::vector<Tensor>& x, const Dims& d, const Tensor& cs, const Tensor& sn,
                                 double k_scale) {
  const Tensor qkv = x[0].detach(), beta = x[1].detach(), kw = x[2].defined() ? x[2].detach() : Tensor();
  const int64_t BH = d.BH(), F = d.F, D = d.D;
  Tensor none;
  Tensor rstd = empty({d.B, d.N(), 2});
  cpu::rms_stats(rstd, qkv, none, kw, d, 1e-5);
  Tensor P = empty({BH, F, D, D}), A = empty({BH, F, D, D}), Pz = empty({BH, F, D, D}), bz = empty({BH, F, D});
  cpu::phase_a_fwd(P, A, Pz, bz, qkv, rstd, kw, cs, sn, beta, d, k_scale, MathMode::ieee);
  return with_backward("twin_phase_a", x, {P, A, Pz, bz}, [=](const std::vector<Tensor>& g) {
    Tensor dk_hat = empty({d.B, d.N(), d.H, D}), dqkv = empty(qkv.shape()), dbeta = empty(beta.shape());
    cpu::phase_a_bwd(dk_hat, dqkv, dbeta, g[0], g[1], g[2], g[3], qkv, rstd, kw, cs, sn, beta, d, k_scale,
                     MathMode::ieee);
    Tensor dq_hat = zeros({d.B, d.N(), d.H, D}), dqw, dkw = kw.defined() ? empty(kw.shape()) : Tensor();
    Tensor no_w;
    cpu::rms_norm_bwd(dqkv, dqw, dkw, dq_hat, dk_hat, qkv, rstd, no_w, kw, d);
    return std::vector<Tensor>{dqkv, dbeta, dkw};
  });
}

std::vector<Tensor> twin_scan(const std::vector<Tensor>& x, const Dims& d, const Tensor& clip_starts = Tensor()) {
  const Tensor P = x[0].detach(), A = x[1].detach(), Pz = x[2].detach(), bz = x[3].detach(), decay = x[4].detach();
  const int64_t BH = d.BH(), F = d.F, D = d.D;
  Tensor Mf = empty({BH, F, D, D}), Mr = empty({BH, F, D, D}), Ms = empty({BH, F, D, D});
  Tensor zf = empty({BH, F, D}), zr = empty({BH, F, D}), zs = empty({BH, F, D});
  cpu::scan_bidi_fwd(Mf, Mr, Ms, zf, zr, zs, P, A, Pz, bz, decay, clip_starts, d);
  return with_backward("twin_scan", x, {Ms, zs}, [=](const std::vector<Tensor>& g) {
    Tensor dP = empty({BH, F, D, D}), dA = empty({BH, F, D, D}), dPz = empty({BH, F, D, D}), dbz = empty({BH, F, D});
    Tensor ddecay = empty(decay.shape());
    cpu::scan_bidi_bwd(dP, dA, dPz, dbz, ddecay, g[0], g[1], P, Pz, decay, Mf, Mr, zf, zr, clip_starts, d);
    return std::vector<Tensor>{dP, dA, dPz, dbz, ddecay};
  });
}

// prep of q + phase C: (qkv, M, z, q_norm_w) -> out (divide) or (num, den) (raw).
std::vector<Tensor> twin_phase_c(const std::vector<Tensor>& x, const Dims& d, const Tensor& cs, const Tensor& sn,
                                 bool divide) {
  const Tensor qkv = x[0].detach(), M = x[1].detach(), z = x[2].detach(),
               qw = x[3].defined() ? x[3].detach() : Tensor();
  const double eps = 1e-6;
  Tensor none;
  Tensor rstd = empty({d.B, d.N(), 2});
  cpu::rms_stats(rstd, qkv, qw, none, d, 1e-5);
  Tensor out = empty({d.B, d.N(), d.H, d.D}), den = empty({d.B, d.H, d.N()});
  cpu::phase_c_fwd(out, den, qkv, rstd, qw, cs, sn, M, z, d, eps, divide, MathMode::ieee);
  const std::vector<Tensor> outs = divide ? std::vector<Tensor>{out} : std::vector<Tensor>{out, den};
  return with_backward("twin_phase_c", x, outs, [=](const std::vector<Tensor>& g) {
    Tensor dq_hat = empty({d.B, d.N(), d.H, d.D}), dM = empty(M.shape()), dz = empty(z.shape());
    const Tensor dden = divide ? Tensor() : g[1];
    cpu::phase_c_bwd(dq_hat, dM, dz, g[0], dden, qkv, rstd, qw, cs, sn, M, z, d, eps, divide, MathMode::ieee);
    Tensor dqkv = zeros(qkv.shape()), dk_hat = zeros({d.B, d.N(), d.H, d.D});
    Tensor dqw = qw.defined() ? empty(qw.shape()) : Tensor(), dkw, no_w;
    cpu::rms_norm_bwd(dqkv, dqw, dkw, dq_hat, dk_hat, qkv, rstd, qw, no_w, d);
    return std::vector<Tensor>{dqkv, dM, dz, dqw};
  });
}

TEST(TwinGradcheck, PrepPhaseA) {
  uint64_t seed = 700;
  for (const Dims& d : op_shapes())
    for (bool norm : {true, false}) {
      const LayerInputs in = make_layer_inputs(d, f64, ++seed, false, norm);
      const Tensor qkv = in.qkv.clone().requires_grad_(), beta = in.beta.clone().requires_grad_();
      const Tensor kw = norm ? in.k_norm_w.clone().requires_grad_() : Tensor();
      const Tensor cs = in.rope_cos, sn = in.rope_sin;
      const double k_scale = in.opt.k_scale;
      expect_gradcheck(std::string("twin prep+phase_a ") + (norm ? "norm " : "") + dims_str(d),
                       [=](const std::vector<Tensor>& x) { return twin_phase_a(x, d, cs, sn, k_scale); },
                       {qkv, beta, kw});
    }
}

TEST(TwinGradcheck, ScanBidi) {
  uint64_t seed = 800;
  for (const Dims& d : op_shapes()) {
    const int64_t BH = d.BH(), F = d.F, D = d.D;
    const double s = 1.0 / D;
    const Tensor P = randn({BH, F, D, D}, ++seed, s), A = randn({BH, F, D, D}, ++seed);
    const Tensor Pz = randn({BH, F, D, D}, ++seed, s), bz = randn({BH, F, D}, ++seed);
    const Tensor decay = uniform({d.B, d.H, F}, ++seed, 0.5, 0.99);
    expect_gradcheck("twin scan_bidi " + dims_str(d), [d](const std::vector<Tensor>& x) { return twin_scan(x, d); },
                     {P, A, Pz, bz, decay});
  }
}

// Packed clips (docs/design.md §4a): rows with clip starts at different frames, 1-frame clips among them.
// Small D keeps the loss, and with it the central differences' rounding (~1e-16·|L|/step), low
// enough for tol::gradcheck.
struct ClipCase {
  Dims d;
  std::vector<double> mask;  // (B, F)
};
std::vector<ClipCase> clip_cases() {
  return {{dims(2, 1, 8, 6, 1), {1, 0, 0, 1, 1, 0, /*row 1*/ 1, 1, 0, 0, 0, 1}},
          {dims(1, 2, 8, 5, 1), {1, 1, 1, 1, 1}},
          {dims(2, 2, 4, 4, 1), {0, 0, 1, 0, /*row 1*/ 1, 0, 0, 1}}};
}

template <typename Scan>
void check_scan_clips(const char* name, uint64_t seed, Scan scan) {
  for (const ClipCase& c : clip_cases()) {
    const Dims& d = c.d;
    const int64_t BH = d.BH(), F = d.F, D = d.D;
    const double s = 1.0 / D;
    const Tensor P = randn({BH, F, D, D}, ++seed, s), A = randn({BH, F, D, D}, ++seed);
    const Tensor Pz = randn({BH, F, D, D}, ++seed, s), bz = randn({BH, F, D}, ++seed);
    const Tensor decay = uniform({d.B, d.H, F}, ++seed, 0.5, 0.99);
    const Tensor mask = Tensor::from_vector(c.mask, {d.B, F}, DType::f32);
    const GradcheckResult r =
        gradcheck([&](const std::vector<Tensor>& x) { return scan(x, d, mask); }, {P, A, Pz, bz, decay}, 1e-6, 64);
    std::printf("[gradcheck] %-48s max rel error %.3e\n", (std::string(name) + " " + dims_str(d)).c_str(),
                r.max_rel_error);
    EXPECT_LE(r.max_rel_error, tol::gradcheck) << name << " " << dims_str(d) << "\n" << r.report;
  }
}

TEST(OpsGradcheck, BidiScanClips) {
  check_scan_clips("ops::bidi_scan clips", 450, [](const std::vector<Tensor>& x, const Dims&, const Tensor& mask) {
    return ops::bidi_scan(x[0], x[1], x[2], x[3], x[4], mask);
  });
}

TEST(TwinGradcheck, ScanBidiClips) {
  check_scan_clips("twin scan_bidi clips", 850, [](const std::vector<Tensor>& x, const Dims& d, const Tensor& mask) {
    return twin_scan(x, d, mask);
  });
}

TEST(TwinGradcheck, PrepPhaseC) {
  uint64_t seed = 900;
  for (const Dims& d : op_shapes())
    for (bool divide : {true, false})
      for (bool norm : {true, false}) {
        const LayerInputs in = make_layer_inputs(d, f64, ++seed, norm, false);
        const Tensor qkv = in.qkv.clone().requires_grad_();
        const Tensor M = randn({d.BH(), d.F, d.D, d.D}, ++seed);
        const Tensor z = uniform({d.BH(), d.F, d.D}, ++seed, 0.2, 1.0);  // den > 0: away from the pole
        const Tensor qw = norm ? in.q_norm_w.clone().requires_grad_() : Tensor();
        const Tensor cs = in.rope_cos, sn = in.rope_sin;
        expect_gradcheck(
            std::string("twin prep+phase_c ") + (divide ? "divide " : "raw ") + (norm ? "norm " : "") + dims_str(d),
            [=](const std::vector<Tensor>& x) { return twin_phase_c(x, d, cs, sn, divide); }, {qkv, M, z, qw});
      }
}

// --- the whole layer -------------------------------------------------------------------------

void check_layer(const std::string& what, LayerInputs in) {
  require_grads(in);
  expect_gradcheck(
      what + " " + dims_str(in.d), [in](const std::vector<Tensor>& x) { return std::vector<Tensor>{in.run(x)}; },
      in.list());
}

std::vector<Dims> layer_shapes() {
  return {dims(2, 1, 12, 3, 2), dims(1, 2, 24, 2, 3), dims(1, 1, 112, 2, 2), dims(1, 2, 12, 1, 4),
          dims(2, 2, 12, 3, 1)};
}

TEST(BigdnGradcheck, WithNormWeights) {
  uint64_t seed = 1000;
  for (const Dims& d : layer_shapes()) check_layer("bigdn norm", make_layer_inputs(d, f64, ++seed));
}

TEST(BigdnGradcheck, WithoutNormWeights) {
  uint64_t seed = 1100;
  for (const Dims& d : layer_shapes()) check_layer("bigdn no norm", make_layer_inputs(d, f64, ++seed, false, false));
}

TEST(BigdnGradcheck, OneNormWeight) {
  check_layer("bigdn q norm only", make_layer_inputs(dims(2, 1, 12, 3, 2), f64, 1201, true, false));
  check_layer("bigdn k norm only", make_layer_inputs(dims(1, 2, 24, 2, 3), f64, 1202, false, true));
}

TEST(BigdnGradcheck, CheckpointOn) {
  uint64_t seed = 1300;
  for (const Dims& d : {dims(2, 1, 12, 3, 2), dims(1, 2, 24, 1, 3)}) {
    LayerInputs in = make_layer_inputs(d, f64, ++seed);
    in.opt.checkpoint = Checkpoint::on;
    check_layer("bigdn checkpoint", in);
  }
}

TEST(BigdnGradcheck, Unfused) {
  uint64_t seed = 1400;
  for (const Dims& d : {dims(2, 1, 12, 3, 2), dims(1, 2, 24, 1, 3)}) {
    LayerInputs in = make_layer_inputs(d, f64, ++seed);
    require_grads(in);
    expect_gradcheck(
        "bigdn_unfused " + dims_str(d),
        [in](const std::vector<Tensor>& x) { return std::vector<Tensor>{in.run(x, false)}; }, in.list());
  }
}

}  // namespace
}  // namespace test
}  // namespace gdncp
