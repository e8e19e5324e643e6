// tests/test_cuda_kernels.cpp — the CUDA kernel twins against the CPU twins, and the
// whole layer on CUDA against the f64 CPU layer. Skips without a GPU.
//
// Every CUDA output is poisoned (NaN) before the launch and must come back finite
// (fully written) and within the tolerance of its precision:
//   twins, CUDA vs the f32 CPU twin:  ieee tol::f32 (two f32 codings, different summation
//   orders), tf32 tol::tf32 (10-bit operands), bf16 tol::bf16 (8-bit operands; single kernels
//   see the raw operand rounding of up to 2^-9 per factor);
//   layer, CUDA vs the f64 CPU layer on the same (rounded) inputs: ieee tol::f32,
//   bf16 tol::bf16_vs_f64 (util/tolerance.h).
// dq_hat / dk_hat are in the dtype the layer gives them (grad_hat_dtype: bf16 in bf16 mode), on
// both sides, so a bf16 one is compared rounded against rounded; rms_norm_bwd is fed both dtypes.
// GDNCP_TEST_SMALL=1 keeps only the small shapes (used under compute-sanitizer).
// The CUDA twins are reached through the kernels:: dispatchers (CUDA tensors pick gdncp::cuda::),
// so this file also builds and skips where gdncp is built without CUDA.
//
// Note [no F=1 with S=1]: with a single token RoPE rotates q and k of that token alike, so
// qʳ·kʳ = q⁺·k⁺ and out = v·den/(den + eps): the gradients of q, k, beta and the norm weights
// are O(eps) cancellations (~1e-6 against terms of ~1), and a relative error against them
// measures nothing. S = 1 is covered with F = 11 and F = 1 with S = 33.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "bigdn_fixtures.h"
#include "gdncp/gdncp.h"
#include "kernels/cp_kernels.h"
#include "kernels/kernels.h"
#include "kernels/prep/norm_w_frames.h"
#include "kernels/scan/scan_bidi.h"
#include "util/test_util.h"
#include "util/tolerance.h"

namespace gdncp {
namespace test {
namespace {

const char* mode_name(MathMode m) { return m == MathMode::bf16 ? "bf16" : m == MathMode::tf32 ? "tf32" : "ieee"; }

double twin_tol(MathMode m) { return m == MathMode::ieee ? tol::f32 : m == MathMode::tf32 ? tol::tf32 : tol::bf16; }

Tensor gpu(const Tensor& t) { return t.defined() ? t.to(Device::cuda) : Tensor(); }

Tensor poisoned(const Shape& s, DType dt) {
  Tensor t = Tensor::empty(s, dt, Device::cuda);
  poison(t);
  return t;
}

// Channel c of a (B, N, 3, H, D) tensor as a (B, N, H, D) f64 CPU tensor.
Tensor channel(const Tensor& x, int c) {
  const Shape& s = x.shape();
  const int64_t B = s[0], N = s[1], HD = s[3] * s[4];
  const std::vector<double> v = x.to_vector();
  std::vector<double> out(static_cast<size_t>(B * N * HD));
  for (int64_t t = 0; t < B * N; ++t)
    for (int64_t e = 0; e < HD; ++e)
      out[static_cast<size_t>(t * HD + e)] = v[static_cast<size_t>((t * 3 + c) * HD + e)];
  return Tensor::from_vector(out, {B, N, s[3], s[4]}, DType::f64);
}

// actual (CUDA, fully written) vs expected (CPU).
void expect_close(const Tensor& actual, const Tensor& expected, double tol, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what;
  EXPECT_FALSE(has_nonfinite(actual)) << what << ": not every element was written (or non-finite)";
  EXPECT_TRUE(close_rel(actual.to(Device::cpu), expected, tol, what));
}

std::vector<Dims> twin_shapes() {
  std::vector<Dims> v = {dims(1, 2, 16, 11, 1),  dims(1, 2, 2, 2, 3),    dims(2, 1, 12, 3, 5), dims(1, 2, 16, 11, 33),
                         dims(2, 2, 112, 2, 33), dims(1, 2, 128, 3, 70), dims(1, 1, 64, 2, 17)};
  if (!small_only()) v.push_back(dims(1, 1, 112, 11, 920));
  return v;
}

const MathMode kModes[] = {MathMode::ieee, MathMode::tf32, MathMode::bf16};

// CPU inputs plus the CPU rstd of them.
struct Prepared {
  LayerInputs in;
  Tensor rstd;
};
Prepared prepare(const Dims& d, DType dtype, uint64_t seed, bool norm_q = true, bool norm_k = true) {
  Prepared p;
  p.in = make_layer_inputs(d, dtype, seed, norm_q, norm_k);
  p.rstd = Tensor::empty({d.B, d.N(), 2}, DType::f32);
  cpu::rms_stats(p.rstd, p.in.qkv, p.in.q_norm_w, p.in.k_norm_w, d, p.in.opt.norm_eps);
  return p;
}

// Phase A and the bidirectional scan of the CPU pipeline on p's inputs (IEEE), with a
// clip-start mask or without one (undefined): the scan twins' inputs and oracle, and the summed
// states M_f, z_f with which phase C's tests see the den the layer sees.
struct CpuStates {
  Tensor P, A, Pz, bz;          // phase A
  Tensor Mf, Mr, M, zf, zr, z;  // the scan: M = Mf + Mr, z = zf + zr
};
CpuStates cpu_states(const Prepared& p, const Dims& d, const Tensor& mask = Tensor()) {
  const LayerInputs& in = p.in;
  const Shape mat = {d.BH(), d.F, d.D, d.D}, vec = {d.BH(), d.F, d.D};
  CpuStates c;
  c.P = Tensor::empty(mat, DType::f32), c.A = c.P.clone(), c.Pz = c.P.clone(), c.bz = Tensor::empty(vec, DType::f32);
  cpu::phase_a_fwd(c.P, c.A, c.Pz, c.bz, in.qkv, p.rstd, in.k_norm_w, in.rope_cos, in.rope_sin, in.beta, d,
                   in.opt.k_scale, MathMode::ieee);
  c.Mf = Tensor::empty(mat, DType::f32), c.Mr = c.Mf.clone(), c.M = c.Mf.clone();
  c.zf = Tensor::empty(vec, DType::f32), c.zr = c.zf.clone(), c.z = c.zf.clone();
  cpu::scan_bidi_fwd(c.Mf, c.Mr, c.M, c.zf, c.zr, c.z, c.P, c.A, c.Pz, c.bz, in.decay, mask, d);
  return c;
}

// ----------------------------------------------------------------------------------------
// kernel twins
// ----------------------------------------------------------------------------------------
// The RMSNorm twins' shapes: the twin shapes plus the row widths of the bf16 fast paths, where
// a lane holds its octets of a row: C = 2240 (production, 9 octets a lane), 520 (a partial last
// octet round), 2560 (the widest, 10 octets); C = 2600 is past the widest and takes the generic
// loop in bf16 too. 2100 tokens: the backward's 132 blocks of about 16 (two a warp), so a warp
// loads its next token's rows while it stores and keeps dw over two tokens, and the dw sum adds
// 132 partials.
std::vector<Dims> rms_shapes() {
  std::vector<Dims> v = twin_shapes();
  for (const Dims& d : {dims(1, 20, 112, 2, 3), dims(2, 4, 130, 3, 5), dims(1, 20, 128, 1, 5), dims(1, 26, 100, 1, 3)})
    v.push_back(d);
  if (!small_only()) v.push_back(dims(1, 20, 112, 1, 2100));
  return v;
}

TEST(CudaTwins, RmsStats) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (const Dims& d : rms_shapes())
    for (DType dt : {DType::f32, DType::bf16})
      for (int norm = 0; norm < 3; ++norm) {
        const Prepared p = prepare(d, dt, ++seed, norm != 1, norm != 2);
        Tensor r = poisoned({d.B, d.N(), 2}, DType::f32);
        kernels::rms_stats(r, gpu(p.in.qkv), gpu(p.in.q_norm_w), gpu(p.in.k_norm_w), d, p.in.opt.norm_eps);
        expect_close(r, p.rstd, tol::f32_short,
                     "rms_stats " + dims_str(d) + " " + dtype_name(dt) + " norm " + std::to_string(norm));
      }
}

TEST(CudaTwins, PhaseA) {
  REQUIRE_GPU();
  uint64_t seed = 200;
  std::vector<Dims> shapes = twin_shapes();
  // The bf16 forward's prep in several token chunks per frame with B > 1 and F = 1, and at a
  // head dim whose row of octets leaves threads of a block idle (D = 72: 9 octets); with
  // four heads a row group (more b sums than threads), and two heads a row group over three
  // chunks.
  shapes.push_back(dims(2, 3, 64, 1, 150));
  shapes.push_back(dims(3, 1, 72, 2, 57));
  shapes.push_back(dims(1, 4, 128, 2, 150));
  shapes.push_back(dims(2, 2, 112, 1, 300));
  for (const Dims& d : shapes)
    for (MathMode m : kModes) {
      const DType dt = m == MathMode::bf16 ? DType::bf16 : DType::f32;
      ++seed;
      const Prepared p = prepare(d, dt, seed, true, seed % 2 == 0);
      const LayerInputs& in = p.in;
      const std::string tag = std::string(" ") + dims_str(d) + " " + mode_name(m);
      const Shape mat = {d.BH(), d.F, d.D, d.D}, vec = {d.BH(), d.F, d.D};
      // forward
      Tensor P = Tensor::empty(mat, DType::f32), A = P.clone(), Pz = P.clone(), bz = Tensor::empty(vec, DType::f32);
      cpu::phase_a_fwd(P, A, Pz, bz, in.qkv, p.rstd, in.k_norm_w, in.rope_cos, in.rope_sin, in.beta, d, in.opt.k_scale,
                       m);
      Tensor gP = poisoned(mat, DType::f32), gA = poisoned(mat, DType::f32), gPz = poisoned(mat, DType::f32),
             gbz = poisoned(vec, DType::f32);
      kernels::phase_a_fwd(gP, gA, gPz, gbz, gpu(in.qkv), gpu(p.rstd), gpu(in.k_norm_w), gpu(in.rope_cos),
                           gpu(in.rope_sin), gpu(in.beta), d, in.opt.k_scale, m);
      expect_close(gP, P, twin_tol(m), "phase_a_fwd P" + tag);
      expect_close(gA, A, twin_tol(m), "phase_a_fwd A" + tag);
      expect_close(gPz, Pz, twin_tol(m), "phase_a_fwd Pz" + tag);
      expect_close(gbz, bz, tol::f32, "phase_a_fwd bz" + tag);  // f32 sums in every mode
      // backward, fresh random upstream gradients
      const Tensor dP = Tensor::randn(mat, DType::f32, Device::cpu, ++seed),
                   dA = Tensor::randn(mat, DType::f32, Device::cpu, ++seed);
      const Tensor dPz = Tensor::randn(mat, DType::f32, Device::cpu, ++seed),
                   dbz = Tensor::randn(vec, DType::f32, Device::cpu, ++seed);
      const DType hat = grad_hat_dtype(m, dt);
      Tensor dk = Tensor::empty({d.B, d.N(), d.H, d.D}, hat), dqkv = Tensor::zeros(in.qkv.shape(), dt),
             dbeta = Tensor::empty(in.beta.shape(), in.beta.dtype());
      cpu::phase_a_bwd(dk, dqkv, dbeta, dP, dA, dPz, dbz, in.qkv, p.rstd, in.k_norm_w, in.rope_cos, in.rope_sin,
                       in.beta, d, in.opt.k_scale, m);
      Tensor gdk = poisoned(dk.shape(), hat), gdqkv = poisoned(in.qkv.shape(), dt),
             gdbeta = poisoned(in.beta.shape(), in.beta.dtype());
      kernels::phase_a_bwd(gdk, gdqkv, gdbeta, gpu(dP), gpu(dA), gpu(dPz), gpu(dbz), gpu(in.qkv), gpu(p.rstd),
                           gpu(in.k_norm_w), gpu(in.rope_cos), gpu(in.rope_sin), gpu(in.beta), d, in.opt.k_scale, m);
      expect_close(gdk, dk, twin_tol(m), "phase_a_bwd dk_hat" + tag);
      expect_close(channel(gdqkv, 2), channel(dqkv, 2), twin_tol(m), "phase_a_bwd dv" + tag);
      EXPECT_TRUE(has_nonfinite(channel(gdqkv, 0))) << "phase_a_bwd must leave channel 0 of dqkv untouched" << tag;
      expect_close(gdbeta, dbeta, twin_tol(m), "phase_a_bwd dbeta" + tag);
    }
}

// The CUDA bidirectional scan, forward and backward, against its CPU twin on
// realistic transitions (phase A of the inputs), with a clip-start mask or
// without one (mask undefined). sweeps: the GPU runs the scan core's composition
// (kernels/scan_bidi_sweeps.h) directly instead of through the layer's entry, which runs
// the same composition after its shape checks.
void expect_scan_bidi_twins(const Dims& d, uint64_t& seed, const Tensor& mask, const std::string& tag,
                            bool sweeps = false) {
  const auto fwd = sweeps ? scan_core::scan_bidi_fwd : kernels::scan_bidi_fwd;
  const auto bwd = sweeps ? scan_core::scan_bidi_bwd : kernels::scan_bidi_bwd;
  const Prepared p = prepare(d, DType::f32, ++seed);
  const LayerInputs& in = p.in;
  const Shape mat = {d.BH(), d.F, d.D, d.D}, vec = {d.BH(), d.F, d.D};
  const CpuStates c = cpu_states(p, d, mask);
  const Tensor &P = c.P, &A = c.A, &Pz = c.Pz, &bz = c.bz, &Mf = c.Mf, &Mr = c.Mr, &Ms = c.M, &zf = c.zf, &zr = c.zr,
               &zs = c.z;
  Tensor gMf = poisoned(mat, DType::f32), gMr = poisoned(mat, DType::f32), gMs = poisoned(mat, DType::f32);
  Tensor gzf = poisoned(vec, DType::f32), gzr = poisoned(vec, DType::f32), gzs = poisoned(vec, DType::f32);
  fwd(gMf, gMr, gMs, gzf, gzr, gzs, gpu(P), gpu(A), gpu(Pz), gpu(bz), gpu(in.decay), gpu(mask), d);
  expect_close(gMf, Mf, tol::f32, "scan_bidi_fwd Mf" + tag);
  expect_close(gMr, Mr, tol::f32, "scan_bidi_fwd Mr" + tag);
  expect_close(gMs, Ms, tol::f32, "scan_bidi_fwd Msum" + tag);
  expect_close(gzf, zf, tol::f32, "scan_bidi_fwd zf" + tag);
  expect_close(gzr, zr, tol::f32, "scan_bidi_fwd zr" + tag);
  expect_close(gzs, zs, tol::f32, "scan_bidi_fwd zsum" + tag);

  const Tensor dMs = Tensor::randn(mat, DType::f32, Device::cpu, ++seed);
  const Tensor dzs = Tensor::randn(vec, DType::f32, Device::cpu, ++seed);
  Tensor dP = Tensor::empty(mat, DType::f32), dA = dP.clone(), dPz = dP.clone(), dbz = Tensor::empty(vec, DType::f32),
         ddecay = Tensor::empty(in.decay.shape(), in.decay.dtype());
  cpu::scan_bidi_bwd(dP, dA, dPz, dbz, ddecay, dMs, dzs, P, Pz, in.decay, Mf, Mr, zf, zr, mask, d);
  Tensor gdP = poisoned(mat, DType::f32), gdA = poisoned(mat, DType::f32), gdPz = poisoned(mat, DType::f32),
         gdbz = poisoned(vec, DType::f32), gddecay = poisoned(in.decay.shape(), in.decay.dtype());
  bwd(gdP, gdA, gdPz, gdbz, gddecay, gpu(dMs), gpu(dzs), gpu(P), gpu(Pz), gpu(in.decay), gpu(Mf), gpu(Mr), gpu(zf),
      gpu(zr), gpu(mask), d);
  expect_close(gdP, dP, tol::f32, "scan_bidi_bwd dP" + tag);
  expect_close(gdA, dA, tol::f32, "scan_bidi_bwd dA" + tag);
  expect_close(gdPz, dPz, tol::f32, "scan_bidi_bwd dPz" + tag);
  expect_close(gdbz, dbz, tol::f32, "scan_bidi_bwd dbz" + tag);
  expect_close(gddecay, ddecay, tol::f32, "scan_bidi_bwd ddecay" + tag);
}

TEST(CudaTwins, ScanBidi) {
  REQUIRE_GPU();
  uint64_t seed = 300;
  for (const Dims& d : twin_shapes()) expect_scan_bidi_twins(d, seed, Tensor(), " " + dims_str(d));
}

// A clip-start mask (B, F) f32 with clips of several lengths, 1-frame ones among them, each row
// packed differently (docs/design.md §4a).
Tensor clip_mask(const Dims& d) {
  std::vector<double> m(static_cast<size_t>(d.B * d.F), 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t f = 0; f < d.F; ++f)
      m[static_cast<size_t>(b * d.F + f)] = (f == 0 || (f + b) % 3 == 0 || (b % 2 == 1 && f == 1)) ? 1.0 : 0.0;
  return Tensor::from_vector(m, {d.B, d.F}, DType::f32);
}

TEST(CudaTwins, ScanBidiClips) {
  REQUIRE_GPU();
  uint64_t seed = 350;
  std::vector<Dims> shapes = {dims(1, 2, 16, 11, 1), dims(2, 1, 12, 3, 5), dims(2, 2, 112, 6, 33),
                              dims(3, 2, 128, 5, 70), dims(2, 1, 64, 7, 17)};
  for (const Dims& d : shapes) expect_scan_bidi_twins(d, seed, clip_mask(d), " clips " + dims_str(d));
}

// The single-rank scan as the composition of the scan core's sweeps, called directly, on the
// CUDA sweeps: the same composition as the CPU twin, on the layer's variants of the sweeps.
TEST(CudaTwins, ScanBidiSweeps) {
  REQUIRE_GPU();
  uint64_t seed = 370;
  for (const Dims& d : twin_shapes()) expect_scan_bidi_twins(d, seed, Tensor(), " sweeps " + dims_str(d), true);
  for (const Dims& d : {dims(1, 2, 16, 11, 1), dims(2, 2, 112, 6, 33)})
    expect_scan_bidi_twins(d, seed, clip_mask(d), " sweeps clips " + dims_str(d), true);
}

// --- the scan core (src/kernels/cp_kernels.h) on every variant of a sweep and a transition gradient ---
Tensor rnd(const Shape& s, uint64_t seed, double sd = 1.0) {
  return Tensor::randn(s, DType::f32, Device::cpu, seed, sd);
}

// The clip mask (B = 2, F): row 0 starts a clip at frame 2, row 1 at frames 0 and 3 (a 1-frame clip).
Tensor sweep_cuts(int64_t F) {
  std::vector<double> c(static_cast<size_t>(2 * F), 0.0);
  for (int64_t f = 0; f < F; ++f) {
    c[static_cast<size_t>(f)] = f == 2 ? 1.0 : 0.0;
    c[static_cast<size_t>(F + f)] = f == 0 || f == 3 ? 1.0 : 0.0;
  }
  return Tensor::from_vector(c, {2, F}, DType::f32);
}

// One sweep's variant: its spec's flags and which tensors it has.
struct SweepVariant {
  bool descending, transpose;
  cp::Cut cut;
  cp::Init init;
  bool frozen, vb, ua, ob, oa, fin;
};

// The flat elements [off, off + n) of t as a (n) f32 CPU tensor.
Tensor region(const Tensor& t, int64_t off, int64_t n) {
  const std::vector<double> v = t.to(Device::cpu).to_vector();
  return Tensor::from_vector(std::vector<double>(v.begin() + off, v.begin() + off + n), {n}, DType::f32);
}

// Every variant of Note [scan step] and Note [clip cuts] in one scan_sweeps call on the CPU and on
// CUDA (outputs poisoned), with two pairs (Sweep::partner): one that CUDA runs as a cluster, one
// whose members differ in transpose (two sweeps and an add). Odd D, D < 8, partial column
// blocks, E = 1, F = 0 and 1, a final state at an unaligned pack offset (scalar state accesses).
TEST(CudaTwins, ScanCoreSweepVariants) {
  REQUIRE_GPU();
  using cp::Cut;
  using cp::Init;
  const std::vector<SweepVariant> variants = {
      {false, false, Cut::before, Init::given, true, false, true, false, true, true},     // forward scan from X0
      {true, false, Cut::after, Init::zero, false, false, true, true, false, true},       // anti-causal scan
      {true, true, Cut::after, Init::given, true, true, false, true, false, true},        // forward adjoint
      {false, true, Cut::before, Init::zero, false, false, true, true, false, false},     // anti adjoint (last unseen)
      {false, false, Cut::none, Init::identity, false, false, false, false, true, true},  // products from I
      {true, true, Cut::before, Init::identity, true, true, true, true, true, true},      // everything at once
      {false, false, Cut::after, Init::given, false, true, false, false, true, false},    // add_before, out_after
      {true, false, Cut::none, Init::zero, false, true, false, true, false, false},       // add_before, out_before
  };
  uint64_t seed = 3800;
  const int64_t B = 2, H = 2, BH = B * H;
  for (const int64_t D : {int64_t(1), int64_t(5), int64_t(16), int64_t(33), int64_t(112), int64_t(128)})
    for (const int64_t E : {D, int64_t(1)})
      for (const int64_t F : {int64_t(0), int64_t(1), int64_t(5)}) {
        const int64_t Fa = std::max<int64_t>(F, 1);  // inputs of F = 0 stay allocatable
        const Shape st = {BH, F, D, E};
        auto frames = [&](const Tensor& t) { return F == 0 ? Tensor::empty({BH, 0, D, t.size(3)}, DType::f32) : t; };
        const Tensor P = frames(rnd({BH, Fa, D, D}, ++seed, 0.5 / static_cast<double>(D)));
        const Tensor decay = Tensor::uniform({B, H, F}, DType::f32, Device::cpu, ++seed, 0.5, 0.99);
        const Tensor cuts = sweep_cuts(F);
        std::vector<cp::Sweep> cpu_sw;
        for (const SweepVariant& v : variants) {
          cp::Sweep w;
          w.spec.BH = BH, w.spec.F = F, w.spec.D = D, w.spec.E = E, w.spec.H = H;
          w.spec.descending = v.descending;
          w.spec.transpose = v.transpose;
          w.spec.cut = v.cut;
          w.spec.init = v.init == Init::identity && E != D ? Init::zero : v.init;
          w.spec.active = v.frozen ? std::max<int64_t>(F - 2, 0) : F;
          w.P = P;
          if (v.cut != Cut::none) w.cuts = cuts;
          if (w.spec.init == Init::given) w.init = rnd({BH, D, E}, ++seed);
          if (v.vb) w.add_before = frames(rnd({BH, Fa, D, E}, ++seed));
          if (v.ua) w.add_after = frames(rnd({BH, Fa, D, E}, ++seed));
          if (v.ob) w.out_before = Tensor::empty(st, DType::f32);
          if (v.oa) w.out_after = Tensor::empty(st, DType::f32);
          if (v.fin) w.final_state = Tensor::empty({BH, D, E}, DType::f32);
          cpu_sw.push_back(w);
        }
        cpu_sw[5].final_state = Tensor::empty({1 + BH * D * E + 1}, DType::f32);  // a pack, offset 1
        cpu_sw[5].final_offset = 1;
        cpu_sw[0].partner = 1;  // forward + anti-causal: one cluster
        cpu_sw[0].sum = Tensor::empty(st, DType::f32);
        cpu_sw[6].partner = 2;  // members of different transpose: two sweeps and an add
        cpu_sw[6].sum = Tensor::empty(st, DType::f32);
        std::vector<cp::Sweep> gpu_sw = cpu_sw;
        for (cp::Sweep& w : gpu_sw) {
          for (Tensor* t : {&w.P, &w.add_before, &w.add_after, &w.init, &w.cuts}) *t = gpu(*t);
          for (Tensor* t : {&w.out_before, &w.out_after, &w.final_state, &w.sum})
            if (t->defined()) *t = poisoned(t->shape(), DType::f32);
        }
        cp::kern::scan_sweeps(cpu_sw, decay);
        cp::kern::scan_sweeps(gpu_sw, gpu(decay));
        for (size_t k = 0; k < cpu_sw.size(); ++k) {
          const std::string tag = " D=" + std::to_string(D) + " E=" + std::to_string(E) + " F=" + std::to_string(F) +
                                  " variant " + std::to_string(k);
          const cp::Sweep &c = cpu_sw[k], &g = gpu_sw[k];
          if (F > 0) {
            if (c.out_before.defined()) expect_close(g.out_before, c.out_before, tol::f32, "out_before" + tag);
            if (c.out_after.defined()) expect_close(g.out_after, c.out_after, tol::f32, "out_after" + tag);
            if (c.sum.defined()) expect_close(g.sum, c.sum, tol::f32, "pair sum" + tag);
          }
          if (!c.final_state.defined()) continue;
          const int64_t n = BH * D * E, off = c.final_offset;
          expect_close(region(g.final_state, off, n), region(c.final_state, off, n), tol::f32, "final_state" + tag);
          if (off > 0) {  // the pack around the final states is untouched
            const std::vector<double> v = g.final_state.to(Device::cpu).to_vector();
            EXPECT_TRUE(std::isnan(v.front()) && std::isnan(v.back())) << "final_state pack written outside" << tag;
          }
        }
      }
}

// scan_grad_outers against the CPU on every kind of group: KV (E = D, the Z GEMMs) with an
// unshifted source from R0 and a shifted one of a different active (two Z buffers), with two
// unshifted sources (one from R0, one from 0) accumulating into dP, a shifted one alone that
// overwrites its dg, and the z vector (E = 1) sharing the first group's dg; with and without a
// clip mask, F = 1 and 4.
TEST(CudaTwins, ScanCoreGradOuterVariants) {
  REQUIRE_GPU();
  uint64_t seed = 3900;
  const int64_t B = 2, H = 2, BH = B * H;
  for (const int64_t D : {int64_t(1), int64_t(5), int64_t(16), int64_t(112)})
    for (const int64_t F : {int64_t(1), int64_t(4)})
      for (const bool with_cuts : {false, true}) {
        const Tensor decay = Tensor::uniform({B, H, F}, DType::f32, Device::cpu, ++seed, 0.5, 0.99);
        const Tensor cuts = with_cuts ? sweep_cuts(F) : Tensor();
        const Tensor dg0 = rnd({BH, F}, ++seed), dg1 = rnd({BH, F}, ++seed);
        auto source = [&](int64_t E, bool shifted, bool r0, int64_t active) {
          return cp::OuterSource{rnd({BH, F, D, E}, ++seed), rnd({BH, F, D, E}, ++seed),
                                 r0 ? rnd({BH, D, E}, ++seed) : Tensor(), shifted, active};
        };
        std::vector<cp::OuterGroup> cpu_g(4);
        const bool kv_acc[4] = {false, true, true, false};
        for (int k = 0; k < 4; ++k) {
          cp::OuterGroup& g = cpu_g[static_cast<size_t>(k)];
          g.E = k == 3 ? 1 : D;
          g.P = rnd({BH, F, D, D}, ++seed, 0.3);
          g.dP = rnd({BH, F, D, D}, ++seed);
          g.accumulate_dP = kv_acc[k];
          g.cuts = cuts;
          g.H = H;
          g.dg = k == 3 ? dg0.clone() : k == 0 ? dg0.clone() : dg1.clone();
        }
        cpu_g[0].sources = {source(D, false, true, F), source(D, true, false, std::max<int64_t>(F - 1, 0))};
        cpu_g[1].sources = {source(D, false, false, F), source(D, false, true, F)};
        cpu_g[2].sources = {source(D, true, false, F)};
        cpu_g[3].sources = {source(1, false, false, F), source(1, true, false, std::max<int64_t>(F - 1, 0))};
        cpu_g[3].dg = cpu_g[0].dg;       // shared: both add into one dg
        cpu_g[2].accumulate_dg = false;  // overwrites its dg
        std::vector<cp::OuterGroup> gpu_g = cpu_g;
        for (size_t k = 0; k < gpu_g.size(); ++k) {
          cp::OuterGroup& g = gpu_g[k];
          g.P = gpu(g.P);
          g.cuts = gpu(g.cuts);
          g.dP = gpu(cpu_g[k].dP);
          if (!g.accumulate_dP) poison(g.dP);
          if (k != 3) g.dg = gpu(cpu_g[k].dg);
          if (!g.accumulate_dg) poison(g.dg);
          for (cp::OuterSource& s : g.sources) s.L = gpu(s.L), s.R = gpu(s.R), s.R0 = gpu(s.R0);
        }
        gpu_g[3].dg = gpu_g[0].dg;
        cp::kern::scan_grad_outers(cpu_g, decay, BH, F, D);
        cp::kern::scan_grad_outers(gpu_g, gpu(decay), BH, F, D);
        for (size_t k = 0; k < cpu_g.size(); ++k) {
          const std::string tag = " D=" + std::to_string(D) + " F=" + std::to_string(F) + (with_cuts ? " cuts" : "") +
                                  " group " + std::to_string(k);
          expect_close(gpu_g[k].dP, cpu_g[k].dP, tol::f32, "dP" + tag);
          expect_close(gpu_g[k].dg, cpu_g[k].dg, tol::f32, "dg" + tag);
        }
      }
}

TEST(CudaTwins, PhaseC) {
  REQUIRE_GPU();
  uint64_t seed = 400;
  std::vector<Dims> shapes = twin_shapes();
  // More frames than a wave of backward blocks on an H200 (132): whole frames plus split ones.
  shapes.push_back(dims(1, 14, 16, 10, 300));
  for (const Dims& d : shapes)
    for (MathMode m : kModes)
      for (bool divide : {true, false}) {
        const DType dt = m == MathMode::bf16 ? DType::bf16 : DType::f32;
        ++seed;
        const Prepared p = prepare(d, dt, seed, seed % 2 == 0, true);
        const LayerInputs& in = p.in;
        const std::string tag = std::string(" ") + (divide ? "divide " : "raw ") + dims_str(d) + " " + mode_name(m);
        const Shape mat = {d.BH(), d.F, d.D, d.D}, vec = {d.BH(), d.F, d.D}, tok = {d.B, d.N(), d.H, d.D};
        const CpuStates states = cpu_states(p, d);
        const Tensor &M = states.M, &z = states.z;

        const DType out_dt = divide ? dt : DType::f32;
        Tensor out = Tensor::empty(tok, out_dt), den = Tensor::empty({d.B, d.H, d.N()}, DType::f32);
        cpu::phase_c_fwd(out, den, in.qkv, p.rstd, in.q_norm_w, in.rope_cos, in.rope_sin, M, z, d, in.opt.eps, divide,
                         m);
        Tensor gout = poisoned(tok, out_dt), gden = poisoned({d.B, d.H, d.N()}, DType::f32);
        kernels::phase_c_fwd(gout, gden, gpu(in.qkv), gpu(p.rstd), gpu(in.q_norm_w), gpu(in.rope_cos), gpu(in.rope_sin),
                             gpu(M), gpu(z), d, in.opt.eps, divide, m);
        expect_close(gout, out, twin_tol(m), "phase_c_fwd out" + tag);
        expect_close(gden, den, tol::f32, "phase_c_fwd den" + tag);  // f32 dot in every mode

        const Tensor dout = Tensor::randn(tok, divide ? dt : DType::f32, Device::cpu, ++seed);
        Tensor dden;  // raw mode: given on odd seeds, absent (zeros) on even ones
        if (!divide && seed % 2 == 1) dden = Tensor::randn({d.B, d.H, d.N()}, DType::f32, Device::cpu, ++seed);
        const DType hat = grad_hat_dtype(m, dt);
        Tensor dq = Tensor::empty(tok, hat), dM = Tensor::empty(mat, DType::f32), dz = Tensor::empty(vec, DType::f32);
        cpu::phase_c_bwd(dq, dM, dz, dout, dden, in.qkv, p.rstd, in.q_norm_w, in.rope_cos, in.rope_sin, M, z, d,
                         in.opt.eps, divide, m);
        Tensor gdq = poisoned(tok, hat), gdM = poisoned(mat, DType::f32), gdz = poisoned(vec, DType::f32);
        kernels::phase_c_bwd(gdq, gdM, gdz, gpu(dout), gpu(dden), gpu(in.qkv), gpu(p.rstd), gpu(in.q_norm_w),
                             gpu(in.rope_cos), gpu(in.rope_sin), gpu(M), gpu(z), d, in.opt.eps, divide, m);
        expect_close(gdq, dq, twin_tol(m), "phase_c_bwd dq_hat" + tag);
        expect_close(gdM, dM, twin_tol(m), "phase_c_bwd dM" + tag);
        expect_close(gdz, dz, twin_tol(m), "phase_c_bwd dz" + tag);
        if (m == MathMode::bf16) {  // the layers' bf16 dq_hat above; the kernel also stores f32
          Tensor fdq = poisoned(tok, DType::f32), fdM = poisoned(mat, DType::f32), fdz = poisoned(vec, DType::f32);
          kernels::phase_c_bwd(fdq, fdM, fdz, gpu(dout), gpu(dden), gpu(in.qkv), gpu(p.rstd), gpu(in.q_norm_w),
                               gpu(in.rope_cos), gpu(in.rope_sin), gpu(M), gpu(z), d, in.opt.eps, divide, m);
          expect_close(fdq, dq, twin_tol(m), "phase_c_bwd f32 dq_hat" + tag);
          EXPECT_TRUE(bitwise_equal(fdM, gdM) && bitwise_equal(fdz, gdz))
              << "phase_c_bwd dM, dz vs dq_hat dtype" << tag;
        }
      }
}

// A GPU copy of t whose data starts 8 bytes past a 16-byte boundary: the kernels take their
// unaligned (register, channel-pair) paths for it.
Tensor gpu_misaligned(const Tensor& t) {
  Tensor buf = Tensor::empty({static_cast<int64_t>(t.nbytes()) / 2 + 8}, DType::bf16, Device::cuda);
  Tensor v = Tensor::from_blob(static_cast<char*>(buf.data()) + 8, t.shape(), t.dtype(), Device::cuda, [buf] {});
  v.copy_from(t);
  return v;
}

// The bf16 backward's staged rows (bf16 qkv and dout, D % 8 == 0, aligned) against its register
// path on the same values (qkv moved off 16-byte alignment): every output bitwise equal, in divide
// mode and in raw mode with and without dout.
TEST(CudaTwins, PhaseCBwdStagedMatchesRegisterPath) {
  REQUIRE_GPU();
  uint64_t seed = 450;
  for (const Dims& d : {dims(1, 2, 16, 11, 33), dims(2, 2, 112, 2, 33), dims(1, 2, 128, 3, 70), dims(1, 1, 64, 2, 17),
                        dims(1, 14, 16, 10, 300)})
    for (int variant = 0; variant < 3; ++variant) {  // divide; raw with dout and dden; raw with dden only
      const bool divide = variant == 0;
      const Prepared p = prepare(d, DType::bf16, ++seed);
      const LayerInputs& in = p.in;
      const std::string tag = " variant " + std::to_string(variant) + " " + dims_str(d);
      const Shape mat = {d.BH(), d.F, d.D, d.D}, vec = {d.BH(), d.F, d.D}, tok = {d.B, d.N(), d.H, d.D};
      const CpuStates states = cpu_states(p, d);
      const Tensor &M = states.M, &z = states.z;
      Tensor dout, dden;
      if (variant < 2) dout = Tensor::randn(tok, DType::bf16, Device::cpu, ++seed);
      if (variant > 0) dden = Tensor::randn({d.B, d.H, d.N()}, DType::f32, Device::cpu, ++seed);
      const Tensor gqkv = gpu(in.qkv), gdout = gpu(dout), gdden = gpu(dden), grstd = gpu(p.rstd), gw = gpu(in.q_norm_w),
                   gcos = gpu(in.rope_cos), gsin = gpu(in.rope_sin), gM = gpu(M), gz = gpu(z);
      Tensor sdq = poisoned(tok, DType::bf16), sdM = poisoned(mat, DType::f32), sdz = poisoned(vec, DType::f32);
      kernels::phase_c_bwd(sdq, sdM, sdz, gdout, gdden, gqkv, grstd, gw, gcos, gsin, gM, gz, d, in.opt.eps, divide,
                           MathMode::bf16);
      Tensor rdq = poisoned(tok, DType::bf16), rdM = poisoned(mat, DType::f32), rdz = poisoned(vec, DType::f32);
      kernels::phase_c_bwd(rdq, rdM, rdz, gdout, gdden, gpu_misaligned(in.qkv), grstd, gw, gcos, gsin, gM, gz, d,
                           in.opt.eps, divide, MathMode::bf16);
      EXPECT_FALSE(has_nonfinite(sdq) || has_nonfinite(sdM) || has_nonfinite(sdz)) << "staged outputs" << tag;
      EXPECT_TRUE(bitwise_equal(sdq, rdq)) << "phase_c_bwd dq_hat staged vs register path" << tag;
      EXPECT_TRUE(bitwise_equal(sdM, rdM)) << "phase_c_bwd dM staged vs register path" << tag;
      EXPECT_TRUE(bitwise_equal(sdz, rdz)) << "phase_c_bwd dz staged vs register path" << tag;
    }
}

TEST(CudaTwins, RmsNormBwd) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  for (const Dims& d : rms_shapes())
    for (DType dt : {DType::f32, DType::bf16})
      for (int norm = 0; norm < 3; ++norm)
        for (DType hat : {DType::f32, DType::bf16}) {  // dq̂, dk̂: either hat-grad dtype
          const Prepared p = prepare(d, dt, ++seed, norm != 1, norm != 2);
          const LayerInputs& in = p.in;
          const std::string tag =
              " " + dims_str(d) + " " + dtype_name(dt) + " norm " + std::to_string(norm) + " hat " + dtype_name(hat);
          const Shape tok = {d.B, d.N(), d.H, d.D};
          const Tensor dqh = Tensor::randn(tok, hat, Device::cpu, ++seed);
          const Tensor dkh = Tensor::randn(tok, hat, Device::cpu, ++seed);
          Tensor dqkv = Tensor::zeros(in.qkv.shape(), dt), dqw, dkw, gdqw, gdkw;
          if (in.q_norm_w.defined()) {
            dqw = Tensor::empty({d.C()}, DType::f32);
            gdqw = poisoned({d.C()}, DType::f32);
          }
          if (in.k_norm_w.defined()) {
            dkw = Tensor::empty({d.C()}, DType::f32);
            gdkw = poisoned({d.C()}, DType::f32);
          }
          cpu::rms_norm_bwd(dqkv, dqw, dkw, dqh, dkh, in.qkv, p.rstd, in.q_norm_w, in.k_norm_w, d);
          Tensor gdqkv = poisoned(in.qkv.shape(), dt);
          kernels::rms_norm_bwd(gdqkv, gdqw, gdkw, gpu(dqh), gpu(dkh), gpu(in.qkv), gpu(p.rstd), gpu(in.q_norm_w),
                                gpu(in.k_norm_w), d);
          // bf16 storage of dqkv rounds each element once (2^-9).
          const double t = dt == DType::bf16 ? tol::bf16_store : tol::f32;
          expect_close(channel(gdqkv, 0), channel(dqkv, 0), t, "rms_norm_bwd dq" + tag);
          expect_close(channel(gdqkv, 1), channel(dqkv, 1), t, "rms_norm_bwd dk" + tag);
          EXPECT_TRUE(has_nonfinite(channel(gdqkv, 2))) << "rms_norm_bwd must leave channel 2 of dqkv untouched" << tag;
          if (dqw.defined()) expect_close(gdqw, dqw, tol::f32, "rms_norm_bwd dq_norm_w" + tag);
          if (dkw.defined()) expect_close(gdkw, dkw, tol::f32, "rms_norm_bwd dk_norm_w" + tag);
          // One stream per call (as the layer runs them): bitwise the two-stream call, channel 2 untouched.
          Tensor sdqkv = poisoned(in.qkv.shape(), dt), sdqw, sdkw;
          if (gdqw.defined()) sdqw = poisoned({d.C()}, DType::f32);
          if (gdkw.defined()) sdkw = poisoned({d.C()}, DType::f32);
          kernels::rms_norm_bwd(sdqkv, sdqw, sdkw, gpu(dqh), Tensor(), gpu(in.qkv), gpu(p.rstd), gpu(in.q_norm_w),
                                gpu(in.k_norm_w), d);
          EXPECT_TRUE(has_nonfinite(channel(sdqkv, 1))) << "q's call must leave channel 1 untouched" << tag;
          kernels::rms_norm_bwd(sdqkv, sdqw, sdkw, Tensor(), gpu(dkh), gpu(in.qkv), gpu(p.rstd), gpu(in.q_norm_w),
                                gpu(in.k_norm_w), d);
          EXPECT_TRUE(bitwise_equal(sdqkv, gdqkv)) << "rms_norm_bwd one stream at a time" << tag;
          if (sdqw.defined()) {
            EXPECT_TRUE(bitwise_equal(sdqw, gdqw)) << tag;
          }
          if (sdkw.defined()) {
            EXPECT_TRUE(bitwise_equal(sdkw, gdkw)) << tag;
          }
        }
}

// The deterministic mode's per-frame norm-weight partials: the CUDA twin (its own fixed order)
// against the CPU twin, and the same bits on a second run.
TEST(CudaTwins, NormWFramePartialsDeterministic) {
  REQUIRE_GPU();
  uint64_t seed = 700;
  for (const Dims& d : rms_shapes())
    for (DType dt : {DType::f32, DType::bf16})
      for (DType hat : {DType::f32, DType::bf16})
        for (int stream = 0; stream < 2; ++stream) {
          const Prepared p = prepare(d, dt, ++seed);
          const std::string tag = " " + dims_str(d) + " " + dtype_name(dt) + " hat " + dtype_name(hat) + " stream " +
                                  std::to_string(stream);
          const Tensor dxh = Tensor::randn({d.B, d.N(), d.H, d.D}, hat, Device::cpu, ++seed);
          Tensor want = Tensor::empty({d.F, d.C()}, DType::f32);
          cpu::norm_w_frame_partials(want, dxh, p.in.qkv, p.rstd, stream, d);
          Tensor got = poisoned({d.F, d.C()}, DType::f32), again = poisoned({d.F, d.C()}, DType::f32);
          kernels::norm_w_frame_partials(got, gpu(dxh), gpu(p.in.qkv), gpu(p.rstd), stream, d);
          kernels::norm_w_frame_partials(again, gpu(dxh), gpu(p.in.qkv), gpu(p.rstd), stream, d);
          expect_close(got, want, tol::f32, "norm_w_frame_partials" + tag);
          EXPECT_TRUE(bitwise_equal(got, again)) << "norm_w_frame_partials run to run" << tag;
        }
}

// ----------------------------------------------------------------------------------------
// the layer: CUDA forward + backward against the f64 CPU layer
// ----------------------------------------------------------------------------------------
struct LayerResult {
  Tensor out;
  std::vector<Tensor> grads;  // qkv, beta, decay, q_norm_w, k_norm_w (undefined when absent)
};

// Fresh leaves every call (detach), so repeated runs do not accumulate into one grad.
// mask: the clip starts (B, F), or undefined for one clip a row.
LayerResult run_layer(LayerInputs in, const Tensor& dout, const Tensor& mask = Tensor()) {
  for (Tensor* t : {&in.qkv, &in.beta, &in.decay, &in.q_norm_w, &in.k_norm_w})
    if (t->defined()) *t = t->detach();
  require_grads(in);
  const Tensor out = bigdn(in.qkv, in.beta, in.decay, in.q_norm_w, in.k_norm_w, in.rope_cos, in.rope_sin, in.d.F,
                           in.d.S, in.opt, mask);
  backward(out, dout);
  LayerResult r;
  r.out = out.detach();
  for (const Tensor* t : {&in.qkv, &in.beta, &in.decay, &in.q_norm_w, &in.k_norm_w})
    r.grads.push_back(t->defined() ? t->grad() : Tensor());
  return r;
}

LayerInputs to_gpu(const LayerInputs& in) {
  LayerInputs g = in;
  for (Tensor* t : {&g.qkv, &g.beta, &g.decay, &g.q_norm_w, &g.k_norm_w, &g.rope_cos, &g.rope_sin}) *t = gpu(*t);
  return g;
}

struct LayerCase {
  Dims d;
  bool norm_q, norm_k;
};

std::vector<LayerCase> layer_cases() {
  std::vector<LayerCase> v = {{dims(1, 2, 16, 11, 1), true, true},
                              {dims(1, 2, 16, 11, 33), true, true},
                              {dims(2, 2, 112, 1, 33), true, true},
                              {dims(1, 3, 128, 2, 33), false, true},
                              {dims(1, 2, 112, 3, 70), true, false}};
  if (!small_only()) {
    v.push_back({dims(1, 2, 112, 11, 920), true, true});
    v.push_back({dims(1, 1, 128, 11, 920), true, true});
  }
  return v;
}

void check_layer(Precision precision, DType dtype, double tol, uint64_t seed) {
  const char* names[] = {"dqkv", "dbeta", "ddecay", "dq_norm_w", "dk_norm_w"};
  for (const LayerCase& c : layer_cases()) {
    LayerInputs in = make_layer_inputs(c.d, dtype, ++seed, c.norm_q, c.norm_k);
    in.opt.precision = precision;
    const Tensor dout = Tensor::randn({c.d.B, c.d.N(), c.d.H, c.d.D}, dtype, Device::cpu, ++seed);
    const LayerResult ref = run_layer(convert(in, DType::f64), dout.to(DType::f64));
    const LayerResult got = run_layer(to_gpu(in), gpu(dout));
    const std::string tag =
        std::string(" ") + dims_str(c.d) + " " + precision_name(precision) + " " + dtype_name(dtype);
    expect_close(got.out, ref.out, tol, "layer out" + tag);
    for (size_t i = 0; i < ref.grads.size(); ++i) {
      ASSERT_EQ(got.grads[i].defined(), ref.grads[i].defined()) << names[i] << tag;
      if (ref.grads[i].defined()) expect_close(got.grads[i], ref.grads[i], tol, std::string("layer ") + names[i] + tag);
    }
  }
}

TEST(CudaLayer, IeeeF32MatchesF64Layer) {
  REQUIRE_GPU();
  check_layer(Precision::ieee, DType::f32, tol::f32, 1000);
}

TEST(CudaLayer, Bf16MatchesF64Layer) {
  REQUIRE_GPU();
  check_layer(Precision::automatic, DType::bf16, tol::bf16_vs_f64, 2000);
}

TEST(CudaLayer, Tf32MatchesF64Layer) {
  REQUIRE_GPU();
  check_layer(Precision::tf32, DType::f32, tol::tf32, 3000);
}

// The layer with a clip-start mask: f32 IEEE on CUDA against the f64 CPU layer with the same mask,
// and checkpointing on bitwise equal to off.
TEST(CudaLayer, ClipsIeeeMatchesF64Layer) {
  REQUIRE_GPU();
  const char* names[] = {"dqkv", "dbeta", "ddecay", "dq_norm_w", "dk_norm_w"};
  uint64_t seed = 5000;
  for (const Dims& d : {dims(2, 2, 16, 11, 9), dims(3, 2, 112, 5, 33)}) {
    LayerInputs in = make_layer_inputs(d, DType::f32, ++seed);
    in.opt.precision = Precision::ieee;
    const Tensor mask = clip_mask(d);
    const Tensor dout = Tensor::randn({d.B, d.N(), d.H, d.D}, DType::f32, Device::cpu, ++seed);
    const LayerResult ref = run_layer(convert(in, DType::f64), dout.to(DType::f64), mask);
    const LayerResult got = run_layer(to_gpu(in), gpu(dout), gpu(mask));
    const std::string tag = " clips " + dims_str(d);
    expect_close(got.out, ref.out, tol::f32, "layer out" + tag);
    for (size_t i = 0; i < ref.grads.size(); ++i)
      expect_close(got.grads[i], ref.grads[i], tol::f32, std::string("layer ") + names[i] + tag);
  }
}

TEST(CudaLayer, ClipsCheckpointBitwiseEqual) {
  REQUIRE_GPU();
  const Dims d = dims(2, 2, 112, 6, 33);
  LayerInputs in = to_gpu(make_layer_inputs(d, DType::bf16, 5100));
  const Tensor mask = gpu(clip_mask(d));
  const Tensor dout = Tensor::randn({d.B, d.N(), d.H, d.D}, DType::bf16, Device::cuda, 5101);
  in.opt.checkpoint = Checkpoint::off;
  const LayerResult off = run_layer(in, dout, mask);
  in.opt.checkpoint = Checkpoint::on;
  const LayerResult on = run_layer(in, dout, mask);
  EXPECT_TRUE(bitwise_equal(on.out, off.out)) << "out";
  const char* names[] = {"dqkv", "dbeta", "ddecay", "dq_norm_w", "dk_norm_w"};
  for (size_t i = 0; i < on.grads.size(); ++i) EXPECT_TRUE(bitwise_equal(on.grads[i], off.grads[i])) << names[i];
}

TEST(CudaLayer, TwoRunsBitwiseIdentical) {
  REQUIRE_GPU();
  const Dims d = small_only() ? dims(1, 2, 112, 3, 70) : dims(2, 4, 112, 11, 200);
  const LayerInputs in = to_gpu(make_layer_inputs(d, DType::bf16, 4242));
  const Tensor dout = Tensor::randn({d.B, d.N(), d.H, d.D}, DType::bf16, Device::cuda, 4343);
  const LayerResult a = run_layer(in, dout), b = run_layer(in, dout);
  EXPECT_TRUE(bitwise_equal(a.out, b.out)) << "out";
  const char* names[] = {"dqkv", "dbeta", "ddecay", "dq_norm_w", "dk_norm_w"};
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(bitwise_equal(a.grads[i], b.grads[i])) << names[i];
}

}  // namespace
}  // namespace test
}  // namespace gdncp
