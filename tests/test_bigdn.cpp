// Tests of the single-rank layer bigdn() (fused CPU twins) beyond the gradchecks:
// hand-checked tiny cases, three independent codings of docs/design.md §2-5 (bigdn,
// bigdn_unfused and a naive loop written here), precision (f32, bf16 against
// f64 on the same values), checkpointing, poisoned twin outputs, determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>

#include "autograd/tensor_internals.h"
#include "bigdn_fixtures.h"
#include "kernels/kernels.h"
#include "util/test_util.h"
#include "util/tolerance.h"

namespace gdncp {
namespace test {
namespace {

const Device kCpu = Device::cpu;

Tensor f64_tensor(const std::vector<double>& v, const Shape& s) { return Tensor::from_vector(v, s, DType::f64); }

// --- hand-checked cases ----------------------------------------------------------------------

// D = 2, H = 1, B = 1, S = 1, F = 2, no norm weights (identity norm), k_scale = 1.
// token 0 (frame 0): q = (1, 2),  k = (1, −3), v = (3, 4),  β = 0.5, g = 0.9, rope angle 0
// token 1 (frame 1): q = (2, −1), k = (0.5, 1), v = (1, −2), β = 0.25, g = 0.8, rope angle 90°
//   (cos = (0, 0), sin = (−1, +1): rope(x) = (−x1, x0))
// k⁺0 = (1, 0) = kʳ0;  k⁺1 = (0.5, 1), kʳ1 = (−1, 0.5)
// P0 = Pz0 = [[.5, 0], [0, 0]], A0 = [[1.5, 2], [0, 0]], b0 = (.5, 0)
// P1 = [[.25, −.125], [−.125, .0625]], A1 = .25·kʳ1 v1ᵀ = [[−.25, .5], [.125, −.25]]
// Pz1 = [[.0625, .125], [.125, .25]], b1 = (.125, .25)
// forward:  M0 = A0, z0 = b0;  M1 = .8·(I − P1)·M0 + A1 = [[.9, 1.2], [.15, .2]] + A1 = [[.65, 1.7], [.275, −.05]]
//           z1 = .8·(I − Pz1)·z0 + b1 = (.375, −.05) + b1 = (.5, .2)
// reverse:  M̃1 = 0, M̃0 = A1, z̃0 = b1  =>  Msum0 = [[1.25, 2.5], [.125, −.25]], zsum0 = (.625, .25)
// token 0: q⁺ = qʳ = (1, 2): num = (1.25 + .25, 2.5 − .5) = (1.5, 2), den = .625 + .5 = 1.125
// token 1: q⁺ = (2, 0), qʳ = (0, 2): num = (2·.275, 2·(−.05)) = (.55, −.1), den = 2·.5 = 1
TEST(BigdnHand, TwoFramesWithRopeAndReverseState) {
  const Tensor qkv = f64_tensor({1, 2, 1, -3, 3, 4, /*token 1*/ 2, -1, 0.5, 1, 1, -2}, {1, 2, 3, 1, 2});
  const Tensor beta = f64_tensor({0.5, 0.25}, {1, 1, 2, 1});
  const Tensor decay = f64_tensor({0.9, 0.8}, {1, 1, 2});
  const Tensor cs = f64_tensor({1, 1, 0, 0}, {2, 2}), sn = f64_tensor({0, 0, -1, 1}, {2, 2});
  BigdnOptions opt;
  opt.k_scale = 1.0;
  const double e = opt.eps;
  const std::vector<double> expected = {1.5 / (1.125 + e), 2.0 / (1.125 + e), 0.55 / (1 + e), -0.1 / (1 + e)};
  for (bool fused : {true, false}) {
    const Tensor out = fused ? bigdn(qkv, beta, decay, Tensor(), Tensor(), cs, sn, 2, 1, opt)
                             : bigdn_unfused(qkv, beta, decay, Tensor(), Tensor(), cs, sn, 2, 1, opt);
    ASSERT_EQ(out.shape(), Shape({1, 2, 1, 2}));
    const std::vector<double> got = out.to_vector();
    for (size_t i = 0; i < expected.size(); ++i)
      EXPECT_NEAR(got[i], expected[i], tol::f64_sum) << "fused " << fused << " i " << i;
  }
}

// D = 2, H = 1, S = 2, F = 1, norm weights w_q = (1.5, .5), w_k = (2, 1), norm_eps = eps = 1e-300 (below
// half an ulp of every sum they join, so the values are those of 0),
// k_scale = .5, identity rope. With F = 1 the state is A (P, g never act).
// q0 = (2, 2): r = 1/2, q̂ = w_q = (1.5, .5) = q⁺      q1 = (−1, 1): r = 1, q̂ = (−1.5, .5), q⁺ = (0, .5)
// k0 = (−3, 3): r = 1/3, k̂ = (−2, 1), k⁺ = (0, .5)    k1 = (4, 4): r = 1/4, k̂ = (2, 1), k⁺ = (1, .5)
// v0 = (1, 0), v1 = (0, 2), β = (.5, 1)
// A = .5·(0, .5)ᵀ(1, 0) + (1, .5)ᵀ(0, 2) = [[0, 2], [.25, 1]],  b = .5·(0, .5) + (1, .5) = (1, .75)
// token 0: num = (1.5·0 + .5·.25, 1.5·2 + .5·1) = (.125, 3.5), den = 1.5 + .375 = 1.875
// token 1: num = (.5·.25, .5·1) = (.125, .5), den = .5·.75 = .375
TEST(BigdnHand, OneFrameWithNormAndKScale) {
  const Tensor qkv = f64_tensor({2, 2, -3, 3, 1, 0, /*token 1*/ -1, 1, 4, 4, 0, 2}, {1, 2, 3, 1, 2});
  const Tensor beta = f64_tensor({0.5, 1}, {1, 1, 1, 2});
  const Tensor decay = f64_tensor({0.7}, {1, 1, 1});
  const Tensor qw = f64_tensor({1.5, 0.5}, {2}), kw = f64_tensor({2, 1}, {2});
  const Tensor cs = f64_tensor({1, 1, 1, 1}, {2, 2}), sn = f64_tensor({0, 0, 0, 0}, {2, 2});
  BigdnOptions opt;
  opt.k_scale = 0.5;
  opt.norm_eps = 1e-300;
  opt.eps = 1e-300;
  const std::vector<double> expected = {0.125 / 1.875, 3.5 / 1.875, 0.125 / 0.375, 0.5 / 0.375};
  for (bool fused : {true, false}) {
    const Tensor out = fused ? bigdn(qkv, beta, decay, qw, kw, cs, sn, 1, 2, opt)
                             : bigdn_unfused(qkv, beta, decay, qw, kw, cs, sn, 1, 2, opt);
    const std::vector<double> got = out.to_vector();
    for (size_t i = 0; i < expected.size(); ++i)
      EXPECT_NEAR(got[i], expected[i], tol::f64_sum) << "fused " << fused << " i " << i;
  }
}

// --- a third, naive coding of docs/design.md §2-5 ------------------------------------------------------

using Mat = std::vector<double>;  // D×D row-major

std::vector<double> naive_bigdn(const LayerInputs& in) {
  const Dims& d = in.d;
  const int64_t B = d.B, H = d.H, D = d.D, F = d.F, S = d.S, N = d.N(), C = d.C();
  const std::vector<double> x = in.qkv.to_vector(), be = in.beta.to_vector(), g = in.decay.to_vector();
  // Tables per stream: q's own when given, else the k tables.
  const std::vector<double> cs_k = in.rope_cos.to_vector(), sn_k = in.rope_sin.to_vector();
  const std::vector<double> cs_q = in.rope_cos_q.defined() ? in.rope_cos_q.to_vector() : cs_k,
                            sn_q = in.rope_sin_q.defined() ? in.rope_sin_q.to_vector() : sn_k;
  const std::vector<double> w[2] = {in.q_norm_w.defined() ? in.q_norm_w.to_vector() : std::vector<double>(),
                                    in.k_norm_w.defined() ? in.k_norm_w.to_vector() : std::vector<double>()};
  const auto X = [&](int64_t b, int64_t n, int64_t c, int64_t h, int64_t i) {
    return x[static_cast<size_t>((((b * N + n) * 3 + c) * H + h) * D + i)];
  };
  // prep: plus[c], rot[c] indexed (b, n, h, i)
  std::vector<double> plus[2], rot[2];
  for (int c = 0; c < 2; ++c) {
    plus[c].assign(static_cast<size_t>(B * N * H * D), 0);
    rot[c] = plus[c];
  }
  const auto at = [&](int64_t b, int64_t n, int64_t h, int64_t i) {
    return static_cast<size_t>(((b * N + n) * H + h) * D + i);
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int c = 0; c < 2; ++c) {
        double r = 1;
        if (!w[c].empty()) {
          double ss = 0;
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < D; ++i) ss += X(b, n, c, h, i) * X(b, n, c, h, i);
          r = 1 / std::sqrt(ss / C + in.opt.norm_eps);
        }
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t i = 0; i < D; ++i) {
            const double xh = X(b, n, c, h, i) * r * (w[c].empty() ? 1.0 : w[c][static_cast<size_t>(h * D + i)]);
            plus[c][at(b, n, h, i)] = std::max(xh, 0.0) * (c == 1 ? in.opt.k_scale : 1.0);
          }
          const std::vector<double>&cs = c == 0 ? cs_q : cs_k, &sn = c == 0 ? sn_q : sn_k;
          for (int64_t i = 0; i < D; i += 2) {  // rotate each pair (2p, 2p+1)
            const size_t t = static_cast<size_t>(n * D + i);
            const double a = plus[c][at(b, n, h, i)], bb = plus[c][at(b, n, h, i + 1)];
            rot[c][at(b, n, h, i)] = a * cs[t] + bb * sn[t];
            rot[c][at(b, n, h, i + 1)] = bb * cs[t + 1] + a * sn[t + 1];
          }
        }
      }
  std::vector<double> out(static_cast<size_t>(B * N * H * D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<Mat> P(F, Mat(D * D, 0)), A(P), Pz(P);
      std::vector<std::vector<double>> bz(F, std::vector<double>(D, 0));
      for (int64_t f = 0; f < F; ++f)
        for (int64_t s = 0; s < S; ++s) {
          const int64_t n = f * S + s;
          const double bs = be[static_cast<size_t>(((b * H + h) * F + f) * S + s)];
          for (int64_t i = 0; i < D; ++i) {
            bz[f][i] += bs * plus[1][at(b, n, h, i)];
            for (int64_t j = 0; j < D; ++j) {
              P[f][i * D + j] += bs * rot[1][at(b, n, h, i)] * rot[1][at(b, n, h, j)];
              A[f][i * D + j] += bs * rot[1][at(b, n, h, i)] * X(b, n, 2, h, j);
              Pz[f][i * D + j] += bs * plus[1][at(b, n, h, i)] * plus[1][at(b, n, h, j)];
            }
          }
        }
      // next = g (I − P) prev + U, for a D×m block
      const auto step = [&](const std::vector<double>& prev, const Mat& Pm, const std::vector<double>& U, double gf,
                            int64_t m) {
        std::vector<double> next(U);
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < m; ++j) {
            double t = prev[i * m + j];
            for (int64_t k = 0; k < D; ++k) t -= Pm[i * D + k] * prev[k * m + j];
            next[i * m + j] += gf * t;
          }
        return next;
      };
      const auto gd = [&](int64_t f) { return g[static_cast<size_t>((b * H + h) * F + f)]; };
      std::vector<Mat> Mf(F), Mr(F, Mat(D * D, 0));
      std::vector<std::vector<double>> zf(F), zr(F, std::vector<double>(D, 0));
      for (int64_t f = 0; f < F; ++f) {
        Mf[f] = step(f ? Mf[f - 1] : Mat(D * D, 0), P[f], A[f], gd(f), D);
        zf[f] = step(f ? zf[f - 1] : std::vector<double>(D, 0), Pz[f], bz[f], gd(f), 1);
      }
      for (int64_t f = F - 2; f >= 0; --f) {
        Mr[f] = step(Mr[f + 1], P[f + 1], A[f + 1], gd(f + 1), D);
        zr[f] = step(zr[f + 1], Pz[f + 1], bz[f + 1], gd(f + 1), 1);
      }
      for (int64_t n = 0; n < N; ++n) {
        const int64_t f = n / S;
        double den = 0;
        for (int64_t i = 0; i < D; ++i) den += plus[0][at(b, n, h, i)] * (zf[f][i] + zr[f][i]);
        for (int64_t j = 0; j < D; ++j) {
          double num = 0;
          for (int64_t i = 0; i < D; ++i) num += rot[0][at(b, n, h, i)] * (Mf[f][i * D + j] + Mr[f][i * D + j]);
          out[at(b, n, h, j)] = num / (den + in.opt.eps);
        }
      }
    }
  return out;
}

struct LayerRun {
  Tensor out;
  std::vector<Tensor> grads;  // qkv, beta, decay, q_norm_w, k_norm_w (undefined where absent)
};

// Forward + backward with L = Σ w·out on fresh leaves.
LayerRun run_layer(const LayerInputs& base, const Tensor& w, bool fused = true) {
  LayerInputs in = base;
  for (Tensor* t : {&in.qkv, &in.beta, &in.decay, &in.q_norm_w, &in.k_norm_w})
    if (t->defined()) *t = t->clone().requires_grad_();
  LayerRun r;
  r.out = in.run(fused);
  backward(r.out, w.to(r.out.dtype()));
  for (const Tensor* t : {&in.qkv, &in.beta, &in.decay, &in.q_norm_w, &in.k_norm_w})
    r.grads.push_back(t->defined() ? t->grad() : Tensor());
  return r;
}

const char* kGradNames[] = {"dqkv", "dbeta", "ddecay", "dq_norm_w", "dk_norm_w"};

std::vector<Dims> agreement_shapes() {
  return {dims(2, 1, 12, 3, 2), dims(1, 2, 24, 2, 3), dims(1, 1, 112, 2, 2), dims(1, 3, 4, 1, 5), dims(2, 2, 4, 4, 3)};
}

double weighted(const std::vector<double>& out, const std::vector<double>& w) {
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += out[i] * w[i];
  return s;
}

struct Worst {
  double out = 0, grad = 0, dir = 0;
};

// Fused, unfused and naive codings on one f64 input: out of all three, every
// gradient fused vs unfused, and the directional derivative of the fused
// gradients against central differences of the naive forward.
void check_agreement(const LayerInputs& in, uint64_t seed, const std::string& what, Worst& worst) {
  const Dims& d = in.d;
  const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, DType::f64, kCpu, seed);
  const LayerRun fused = run_layer(in, w, true), unfused = run_layer(in, w, false);
  const Tensor naive = f64_tensor(naive_bigdn(in), fused.out.shape());
  EXPECT_TRUE(close_rel(fused.out, naive, tol::f64, "out fused vs naive " + what));
  EXPECT_TRUE(close_rel(unfused.out, naive, tol::f64, "out unfused vs naive " + what));
  worst.out = std::max({worst.out, rel_l2(fused.out, naive), rel_l2(unfused.out, naive)});
  for (size_t i = 0; i < fused.grads.size(); ++i) {
    ASSERT_EQ(fused.grads[i].defined(), unfused.grads[i].defined()) << kGradNames[i];
    if (!fused.grads[i].defined()) continue;
    EXPECT_TRUE(close_rel(fused.grads[i], unfused.grads[i], tol::f64, std::string(kGradNames[i]) + " " + what));
    worst.grad = std::max(worst.grad, rel_l2(fused.grads[i], unfused.grads[i]));
  }
  // Gradients against the naive coding: the directional derivative along a random δ,
  // by central differences of the naive forward (h = 1e-6: error ~1e-10 relative).
  const double h = 1e-6;
  LayerInputs plus = in, minus = in;
  double analytic = 0;
  Tensor* p[5] = {&plus.qkv, &plus.beta, &plus.decay, &plus.q_norm_w, &plus.k_norm_w};
  Tensor* m[5] = {&minus.qkv, &minus.beta, &minus.decay, &minus.q_norm_w, &minus.k_norm_w};
  for (size_t i = 0; i < 5; ++i) {
    if (!p[i]->defined()) continue;
    const std::vector<double> dir = Tensor::randn(p[i]->shape(), DType::f64, kCpu, 77 + i).to_vector();
    const std::vector<double> base = p[i]->to_vector(), grad = fused.grads[i].to_vector();
    std::vector<double> vp(base), vm(base);
    for (size_t e = 0; e < base.size(); ++e) {
      vp[e] += h * dir[e];
      vm[e] -= h * dir[e];
      analytic += grad[e] * dir[e];
    }
    *p[i] = f64_tensor(vp, p[i]->shape());
    *m[i] = f64_tensor(vm, m[i]->shape());
  }
  const std::vector<double> wv = w.to_vector();
  const double numeric = (weighted(naive_bigdn(plus), wv) - weighted(naive_bigdn(minus), wv)) / (2 * h);
  EXPECT_NEAR(analytic, numeric, tol::gradcheck_element * std::fabs(numeric)) << what;
  worst.dir = std::max(worst.dir, std::fabs(analytic - numeric) / std::fabs(numeric));
}

TEST(BigdnAgreement, FusedUnfusedNaiveF64) {
  uint64_t seed = 10;
  Worst worst;
  for (const Dims& d : agreement_shapes())
    for (int norms = 0; norms < 3; ++norms) {  // both, q only, none
      const LayerInputs in = make_layer_inputs(d, DType::f64, ++seed, norms < 2, norms == 0);
      check_agreement(in, ++seed, dims_str(d) + " norms " + std::to_string(norms), worst);
    }
  std::printf("[agreement] worst rel L2: out %.2e, fused vs unfused grads %.2e; directional derivative vs naive %.2e\n",
              worst.out, worst.grad, worst.dir);
}

// --- separate q RoPE tables (docs/design.md §5) ------------------------------------------------

// q's own tables: another position offset and frequency base than k's.
void give_q_tables(LayerInputs& in, uint64_t seed) {
  const DType table = in.rope_cos.dtype();
  auto rope = rope_tables(in.d.N(), in.d.D, table, kCpu, /*offset=*/static_cast<int64_t>(seed % 11) + 3, 500.0);
  in.rope_cos_q = rope.first;
  in.rope_sin_q = rope.second;
}

TEST(BigdnRopeQ, SeparateQTablesFusedUnfusedNaiveF64) {
  uint64_t seed = 300;
  Worst worst;
  for (const Dims& d : agreement_shapes())
    for (int norms = 0; norms < 2; ++norms) {
      LayerInputs in = make_layer_inputs(d, DType::f64, ++seed, norms == 0, norms == 0);
      give_q_tables(in, seed);
      // The q tables matter: the output differs from rotating q with the k tables.
      LayerInputs same = in;
      same.rope_cos_q = same.rope_sin_q = Tensor();
      EXPECT_GT(rel_l2(in.run(), same.run()), 1e-3) << dims_str(d);
      check_agreement(in, ++seed, dims_str(d) + " q tables, norms " + std::to_string(norms), worst);
    }
  std::printf("[rope_q] worst rel L2: out %.2e, fused vs unfused grads %.2e; directional derivative vs naive %.2e\n",
              worst.out, worst.grad, worst.dir);
}

TEST(BigdnRopeQ, EqualTablesBitwiseAsOmitted) {
  for (DType dt : {DType::f64, DType::f32, DType::bf16})
    for (Checkpoint ck : {Checkpoint::off, Checkpoint::on}) {
      LayerInputs in = make_layer_inputs(dims(2, 2, 8, 3, 2), dt, 400);
      in.opt.checkpoint = ck;
      const Tensor w = Tensor::randn({2, 6, 2, 8}, DType::f64, kCpu, 401);
      const LayerRun omitted = run_layer(in, w);
      in.rope_cos_q = in.rope_cos.clone();  // equal values, other storage
      in.rope_sin_q = in.rope_sin.clone();
      const LayerRun given = run_layer(in, w);
      const std::string what = std::string(dtype_name(dt)) + (ck == Checkpoint::on ? " checkpoint" : "");
      EXPECT_TRUE(bitwise_equal(omitted.out, given.out)) << "out " << what;
      for (size_t i = 0; i < omitted.grads.size(); ++i)
        EXPECT_TRUE(bitwise_equal(omitted.grads[i], given.grads[i])) << kGradNames[i] << " " << what;
    }
}

TEST(BigdnRopeQ, BadTablesNamed) {
  const LayerInputs base = make_layer_inputs(dims(1, 2, 4, 2, 3), DType::f32, 500);
  const auto fails_naming = [&](const Tensor& cq, const Tensor& sq, const std::string& name, const std::string& why) {
    for (bool fused : {true, false}) {
      LayerInputs in = base;
      in.rope_cos_q = cq;
      in.rope_sin_q = sq;
      try {
        in.run(fused);
        ADD_FAILURE() << "no error for " << name << " (" << why << ")";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(name + ":"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
      }
    }
  };
  const Tensor& c = base.rope_cos;
  fails_naming(c, Tensor(), "rope_sin_q", "undefined");
  fails_naming(Tensor(), c, "rope_cos_q", "undefined");
  fails_naming(Tensor::zeros({5, 4}, DType::f32), c, "rope_cos_q", "shape");
  fails_naming(c, c.to(DType::f64), "rope_sin_q", "must be f32");
}

// --- precision ---------------------------------------------------------------------------------

// Runs the layer in `dtype` and in f64 on the same values (inputs drawn in dtype, converted
// exactly to f64) and compares out and every gradient.
void compare_to_f64(DType dtype, double tol, uint64_t seed, Precision precision = Precision::automatic) {
  for (const Dims& d : {dims(2, 2, 16, 3, 4), dims(1, 2, 112, 2, 8)}) {
    LayerInputs low = make_layer_inputs(d, dtype, seed++);
    low.opt.precision = precision;
    const LayerInputs high = convert(low, DType::f64);
    const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, dtype, kCpu, seed++);
    const LayerRun a = run_layer(low, w), b = run_layer(high, w.to(DType::f64));
    const std::string what = std::string(dtype_name(dtype)) + " vs f64 " + dims_str(d);
    EXPECT_EQ(a.out.dtype(), dtype);
    EXPECT_TRUE(close_rel(a.out, b.out, tol, "out " + what));
    std::printf("[precision] %-36s out rel %.2e", what.c_str(), rel_l2(a.out, b.out));
    for (size_t i = 0; i < a.grads.size(); ++i) {
      ASSERT_TRUE(a.grads[i].defined()) << kGradNames[i];
      const Tensor input = std::vector<Tensor>{low.qkv, low.beta, low.decay, low.q_norm_w, low.k_norm_w}[i];
      EXPECT_EQ(a.grads[i].dtype(), input.dtype()) << kGradNames[i];
      EXPECT_TRUE(close_rel(a.grads[i], b.grads[i], tol, std::string(kGradNames[i]) + " " + what));
      std::printf(" %s %.2e", kGradNames[i], rel_l2(a.grads[i], b.grads[i]));
    }
    std::printf("\n");
  }
}

// f32 arithmetic over sums of ≤ a few hundred terms: ~1e-6 relative; the bar is tol::f32.
TEST(BigdnPrecision, F32MatchesF64) { compare_to_f64(DType::f32, tol::f32, 500); }

// bf16 storage rounds out and the gradients to 8 bits (~4e-3 relative per element).
TEST(BigdnPrecision, Bf16WithinOnePercentOfF64) { compare_to_f64(DType::bf16, tol::bf16_vs_f64, 600); }

// bf16 mode on f32 data: the CPU computes in f32, but dq̂ and dk̂ are stored in bf16 as in the layer's
// bf16 mode (kernels.h, hat-grad dtype), which moves the q, k and weight gradients by ~1e-3.
TEST(BigdnPrecision, Bf16ModeOnF32DataWithinOnePercentOfF64) {
  compare_to_f64(DType::f32, tol::bf16_vs_f64, 650, Precision::bf16);
}

TEST(BigdnPrecision, MixedBf16QkvWithF32Gates) {
  const Dims d = dims(1, 2, 16, 2, 3);
  LayerInputs in = make_layer_inputs(d, DType::bf16, 700);
  in.beta = in.beta.to(DType::f32);
  in.decay = in.decay.to(DType::f32);
  const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, DType::bf16, kCpu, 701);
  const LayerRun a = run_layer(in, w);
  EXPECT_EQ(a.out.dtype(), DType::bf16);
  EXPECT_EQ(a.grads[0].dtype(), DType::bf16);
  EXPECT_EQ(a.grads[1].dtype(), DType::f32);
  EXPECT_EQ(a.grads[2].dtype(), DType::f32);
  const LayerRun b = run_layer(convert(in, DType::f64), w.to(DType::f64));
  EXPECT_TRUE(close_rel(a.out, b.out, tol::bf16_vs_f64, "out"));
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(close_rel(a.grads[i], b.grads[i], tol::bf16_vs_f64, kGradNames[i]));
}

TEST(BigdnPrecision, PrecisionModesAreExactOnCpu) {
  EXPECT_EQ(resolve_math_mode(Precision::automatic, DType::bf16), MathMode::bf16);
  EXPECT_EQ(resolve_math_mode(Precision::automatic, DType::f32), MathMode::ieee);
  EXPECT_EQ(resolve_math_mode(Precision::tf32, DType::f32), MathMode::tf32);
  EXPECT_EQ(resolve_math_mode(Precision::bf16, DType::f64), MathMode::ieee);
  EXPECT_STREQ(precision_name(Precision::tf32), "tf32");
  const LayerInputs in = make_layer_inputs(dims(1, 2, 8, 2, 3), DType::f32, 800);
  LayerInputs tf = in;
  tf.opt.precision = Precision::tf32;
  EXPECT_TRUE(bitwise_equal(in.run(), tf.run()));
}

// --- autograd behaviour ------------------------------------------------------------------------

TEST(BigdnAutograd, CheckpointGivesBitwiseEqualGradsAndSavesLess) {
  for (DType dt : {DType::f32, DType::f64}) {
    const Dims d = dims(2, 2, 16, 3, 4);
    const LayerInputs off = make_layer_inputs(d, dt, 900);
    LayerInputs on = off;
    on.opt.checkpoint = Checkpoint::on;
    const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, dt, kCpu, 901);
    ASSERT_EQ(autograd::saved_bytes(), 0u);
    // saved bytes right after the forward
    size_t saved[2];
    for (int k = 0; k < 2; ++k) {
      LayerInputs in = k ? on : off;
      in.qkv = in.qkv.clone().requires_grad_();
      const Tensor out = in.run();
      saved[k] = autograd::saved_bytes();
      autograd::clear_tape();
    }
    EXPECT_LT(saved[1], saved[0]) << "checkpoint on should keep fewer bytes";
    EXPECT_GT(saved[1], 0u);
    std::printf("[checkpoint] %s saved bytes: off %zu, on %zu\n", dtype_name(dt), saved[0], saved[1]);
    const size_t made = gdncp::detail::TensorInternals::shape_only_made();
    const LayerRun a = run_layer(off, w);
    EXPECT_EQ(gdncp::detail::TensorInternals::shape_only_made(), made) << "no checkpoint, no recompute";
    const LayerRun b = run_layer(on, w);
    EXPECT_EQ(gdncp::detail::TensorInternals::shape_only_made(), made + 1) << "the recompute's out must be shape-only";
    EXPECT_TRUE(bitwise_equal(a.out, b.out));
    for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(bitwise_equal(a.grads[i], b.grads[i])) << kGradNames[i];
    EXPECT_EQ(autograd::saved_bytes(), 0u) << "saved tensors must be freed after backward";
  }
}

TEST(BigdnAutograd, AutomaticCheckpointFollowsGradMode) {
  LayerInputs in = make_layer_inputs(dims(1, 2, 8, 2, 3), DType::f32, 950);
  in.opt.checkpoint = Checkpoint::automatic;
  {
    NoGradGuard no_grad;
    in.qkv.requires_grad_();
    const Tensor out = in.run();
    EXPECT_EQ(autograd::tape_size(), 0u);
    EXPECT_EQ(autograd::saved_bytes(), 0u);
    EXPECT_FALSE(out.requires_grad());
  }
  const Tensor out = in.run();
  EXPECT_TRUE(out.requires_grad());
  EXPECT_EQ(std::string(out.grad_fn()->name()), "checkpoint");
  autograd::clear_tape();
}

TEST(BigdnAutograd, NoGradRecordsNothing) {
  LayerInputs in = make_layer_inputs(dims(1, 2, 8, 2, 3), DType::f64, 960);
  require_grads(in);
  NoGradGuard no_grad;
  in.run(true);
  in.run(false);
  EXPECT_EQ(autograd::tape_size(), 0u);
  EXPECT_EQ(autograd::saved_bytes(), 0u);
}

TEST(BigdnAutograd, AbsentWeightAndRopeGetNoGradient) {
  const Dims d = dims(1, 2, 8, 2, 3);
  LayerInputs in = make_layer_inputs(d, DType::f64, 970, /*norm_q=*/true, /*norm_k=*/false);
  require_grads(in);
  in.rope_cos.requires_grad_();
  const Tensor out = in.run();
  backward(out, Tensor::randn(out.shape(), DType::f64, kCpu, 971));
  EXPECT_TRUE(in.q_norm_w.grad().defined());
  EXPECT_FALSE(in.rope_cos.grad().defined());
  EXPECT_FALSE(in.k_norm_w.defined());
}

TEST(BigdnAutograd, DeterministicTwoRuns) {
  for (DType dt : {DType::f32, DType::bf16}) {
    const Dims d = dims(2, 2, 24, 3, 5);
    const LayerInputs in = make_layer_inputs(d, dt, 980);
    const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, dt, kCpu, 981);
    const LayerRun a = run_layer(in, w), b = run_layer(in, w);
    EXPECT_TRUE(bitwise_equal(a.out, b.out));
    for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(bitwise_equal(a.grads[i], b.grads[i])) << kGradNames[i];
  }
}

// --- the twins overwrite every element of their outputs ----------------------------------------

Tensor poisoned(const Shape& s, DType dt) {
  Tensor t = Tensor::empty(s, dt, kCpu);
  poison(t);
  return t;
}

TEST(BigdnTwins, OverwriteEveryPoisonedOutput) {
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    const Dims d = dims(2, 2, 12, 3, 2);
    const LayerInputs in = make_layer_inputs(d, dt, 990);
    const DType ct = dt == DType::f64 ? DType::f64 : DType::f32;
    const int64_t B = d.B, N = d.N(), H = d.H, D = d.D, F = d.F, BH = d.BH();
    const double ks = in.opt.k_scale;
    const MathMode mode = MathMode::ieee;
    const DType hat = dt == DType::bf16 ? DType::bf16 : ct;  // dq_hat, dk_hat: what the layer gives bf16 data
    const std::string what = dtype_name(dt);

    Tensor rstd = poisoned({B, N, 2}, ct);
    cpu::rms_stats(rstd, in.qkv, in.q_norm_w, in.k_norm_w, d, 1e-5);
    EXPECT_FALSE(has_nonfinite(rstd)) << what;

    Tensor P = poisoned({BH, F, D, D}, ct), A = poisoned({BH, F, D, D}, ct), Pz = poisoned({BH, F, D, D}, ct),
           bz = poisoned({BH, F, D}, ct);
    cpu::phase_a_fwd(P, A, Pz, bz, in.qkv, rstd, in.k_norm_w, in.rope_cos, in.rope_sin, in.beta, d, ks, mode);
    for (const Tensor* t : {&P, &A, &Pz, &bz}) EXPECT_FALSE(has_nonfinite(*t)) << what;

    Tensor Mf = poisoned({BH, F, D, D}, ct), Mr = poisoned({BH, F, D, D}, ct), Ms = poisoned({BH, F, D, D}, ct);
    Tensor zf = poisoned({BH, F, D}, ct), zr = poisoned({BH, F, D}, ct), zs = poisoned({BH, F, D}, ct);
    cpu::scan_bidi_fwd(Mf, Mr, Ms, zf, zr, zs, P, A, Pz, bz, in.decay, Tensor(), d);
    for (const Tensor* t : {&Mf, &Mr, &Ms, &zf, &zr, &zs}) EXPECT_FALSE(has_nonfinite(*t)) << what;

    for (bool divide : {true, false}) {
      Tensor out = poisoned({B, N, H, D}, divide ? dt : ct), den = poisoned({B, H, N}, ct);
      cpu::phase_c_fwd(out, den, in.qkv, rstd, in.q_norm_w, in.rope_cos, in.rope_sin, Ms, zs, d, 1e-6, divide, mode);
      EXPECT_FALSE(has_nonfinite(out)) << what;
      EXPECT_FALSE(has_nonfinite(den)) << what;
    }

    const Tensor dout = Tensor::randn({B, N, H, D}, dt, kCpu, 991);
    const Tensor dden = Tensor::randn({B, H, N}, ct, kCpu, 992);
    Tensor dq_hat = poisoned({B, N, H, D}, hat), dM = poisoned({BH, F, D, D}, ct), dz = poisoned({BH, F, D}, ct);
    cpu::phase_c_bwd(dq_hat, dM, dz, dout, dden, in.qkv, rstd, in.q_norm_w, in.rope_cos, in.rope_sin, Ms, zs, d, 1e-6,
                     /*divide=*/false, mode);
    for (const Tensor* t : {&dq_hat, &dM, &dz}) EXPECT_FALSE(has_nonfinite(*t)) << what;
    poison(dq_hat);
    poison(dM);
    poison(dz);
    cpu::phase_c_bwd(dq_hat, dM, dz, dout, Tensor(), in.qkv, rstd, in.q_norm_w, in.rope_cos, in.rope_sin, Ms, zs, d,
                     1e-6, /*divide=*/true, mode);
    for (const Tensor* t : {&dq_hat, &dM, &dz}) EXPECT_FALSE(has_nonfinite(*t)) << what;

    Tensor dP = poisoned({BH, F, D, D}, ct), dA = poisoned({BH, F, D, D}, ct), dPz = poisoned({BH, F, D, D}, ct),
           dbz = poisoned({BH, F, D}, ct), ddecay = poisoned(in.decay.shape(), dt);
    cpu::scan_bidi_bwd(dP, dA, dPz, dbz, ddecay, dM, dz, P, Pz, in.decay, Mf, Mr, zf, zr, Tensor(), d);
    for (const Tensor* t : {&dP, &dA, &dPz, &dbz, &ddecay}) EXPECT_FALSE(has_nonfinite(*t)) << what;

    // phase_a_bwd writes only the v channel of dqkv; rms_norm_bwd then writes q and k.
    Tensor dk_hat = poisoned({B, N, H, D}, hat), dqkv = poisoned(in.qkv.shape(), dt),
           dbeta = poisoned(in.beta.shape(), dt);
    cpu::phase_a_bwd(dk_hat, dqkv, dbeta, dP, dA, dPz, dbz, in.qkv, rstd, in.k_norm_w, in.rope_cos, in.rope_sin,
                     in.beta, d, ks, mode);
    EXPECT_FALSE(has_nonfinite(dk_hat)) << what;
    EXPECT_FALSE(has_nonfinite(dbeta)) << what;
    const std::vector<double> v = dqkv.to_vector();
    for (size_t e = 0; e < v.size(); ++e) {
      const bool v_channel = (e / static_cast<size_t>(H * D)) % 3 == 2;
      ASSERT_EQ(std::isfinite(v[e]), v_channel) << what << " element " << e;
    }
    Tensor dqw = poisoned({d.C()}, in.q_norm_w.dtype()), dkw = poisoned({d.C()}, in.k_norm_w.dtype());
    cpu::rms_norm_bwd(dqkv, dqw, dkw, dq_hat, dk_hat, in.qkv, rstd, in.q_norm_w, in.k_norm_w, d);
    for (const Tensor* t : {&dqkv, &dqw, &dkw}) EXPECT_FALSE(has_nonfinite(*t)) << what;
  }
}

// --- dq_hat / dk_hat in bf16 (kernels.h, hat-grad dtype) -----------------------------------------

constexpr double kBf16HalfUlp = tol::bf16_half_ulp;

// `rounded` (bf16) is `exact` rounded to nearest even, element by element: bitwise what Tensor::to
// gives, and each element within the bf16 half-ulp of the exact one.
void expect_rounded_from(const Tensor& rounded, const Tensor& exact, const std::string& what) {
  ASSERT_EQ(rounded.dtype(), DType::bf16) << what;
  EXPECT_TRUE(bitwise_equal(rounded, exact.to(DType::bf16))) << what << ": not the rounding of the exact result";
  const std::vector<double> r = rounded.to_vector(), e = exact.to_vector();
  double worst = 0;
  for (size_t i = 0; i < e.size(); ++i) {
    ASSERT_TRUE(std::isfinite(r[i])) << what << ": element " << i << " not written";
    if (e[i] == 0) {
      EXPECT_EQ(r[i], 0.0) << what << ": element " << i;
      continue;
    }
    worst = std::max(worst, std::fabs(r[i] - e[i]) / std::fabs(e[i]));
  }
  EXPECT_LE(worst, kBf16HalfUlp) << what;
}

// The twins compute dq̂ and dk̂ in the compute dtype and round on store, so a bf16 dq_hat / dk_hat is the
// compute-dtype result rounded, and nothing else they write depends on that dtype. rms_norm_bwd fed the
// rounded values matches rms_norm_bwd fed the exact ones to bf16 precision (rel L2 ≤ the half-ulp): it is
// linear in them, and they moved by ≤ 2^-8 per element (~1.1e-3 rel L2 for uniform rounding errors; bf16
// data adds the rounding of dqkv on both sides: measured ≤ 2.4e-3).
TEST(BigdnTwins, Bf16GradHatIsTheComputeResultRounded) {
  uint64_t seed = 1100;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (bool divide : {true, false}) {
      const Dims d = dims(2, 4, 32, 4, 16);  // C = 128 channels, 128 tokens: the errors' L2 norms settle
      const LayerInputs in = make_layer_inputs(d, dt, ++seed, /*norm_q=*/divide, /*norm_k=*/true);
      const DType ct = compute_dtype(dt), bf = DType::bf16;
      const int64_t BH = d.BH(), F = d.F, D = d.D;
      const Shape tok = {d.B, d.N(), d.H, D}, mat = {BH, F, D, D}, vec = {BH, F, D};
      const double ks = in.opt.k_scale, eps = 1e-6;
      const MathMode mode = MathMode::bf16;
      const std::string what = std::string(dtype_name(dt)) + (divide ? " divide" : " raw");

      Tensor rstd = Tensor::empty({d.B, d.N(), 2}, ct);
      cpu::rms_stats(rstd, in.qkv, in.q_norm_w, in.k_norm_w, d, in.opt.norm_eps);
      Tensor P = Tensor::empty(mat, ct), A = P.clone(), Pz = P.clone(), bz = Tensor::empty(vec, ct);
      cpu::phase_a_fwd(P, A, Pz, bz, in.qkv, rstd, in.k_norm_w, in.rope_cos, in.rope_sin, in.beta, d, ks, mode);
      Tensor Mf = Tensor::empty(mat, ct), Mr = Mf.clone(), Ms = Mf.clone();
      Tensor zf = Tensor::empty(vec, ct), zr = zf.clone(), zs = zf.clone();
      cpu::scan_bidi_fwd(Mf, Mr, Ms, zf, zr, zs, P, A, Pz, bz, in.decay, Tensor(), d);

      // phase C backward: dq_hat in the compute dtype, then in bf16.
      const Tensor dout = Tensor::randn(tok, divide ? dt : ct, kCpu, ++seed);
      const Tensor dden = divide ? Tensor() : Tensor::randn({d.B, d.H, d.N()}, ct, kCpu, ++seed);
      Tensor dq = Tensor::empty(tok, ct), dM = Tensor::empty(mat, ct), dz = Tensor::empty(vec, ct);
      cpu::phase_c_bwd(dq, dM, dz, dout, dden, in.qkv, rstd, in.q_norm_w, in.rope_cos, in.rope_sin, Ms, zs, d, eps,
                       divide, mode);
      Tensor dq_b = poisoned(tok, bf), dM_b = poisoned(mat, ct), dz_b = poisoned(vec, ct);
      cpu::phase_c_bwd(dq_b, dM_b, dz_b, dout, dden, in.qkv, rstd, in.q_norm_w, in.rope_cos, in.rope_sin, Ms, zs, d,
                       eps, divide, mode);
      expect_rounded_from(dq_b, dq, "phase_c_bwd dq_hat " + what);
      EXPECT_TRUE(bitwise_equal(dM_b, dM)) << what;
      EXPECT_TRUE(bitwise_equal(dz_b, dz)) << what;

      // phase A backward: dk_hat in the compute dtype, then in bf16.
      const Tensor dP = Tensor::randn(mat, ct, kCpu, ++seed), dA = Tensor::randn(mat, ct, kCpu, ++seed);
      const Tensor dPz = Tensor::randn(mat, ct, kCpu, ++seed), dbz = Tensor::randn(vec, ct, kCpu, ++seed);
      Tensor dk = Tensor::empty(tok, ct), dqkv = poisoned(in.qkv.shape(), dt), dbeta = poisoned(in.beta.shape(), dt);
      cpu::phase_a_bwd(dk, dqkv, dbeta, dP, dA, dPz, dbz, in.qkv, rstd, in.k_norm_w, in.rope_cos, in.rope_sin, in.beta,
                       d, ks, mode);
      Tensor dk_b = poisoned(tok, bf), dqkv_b = poisoned(in.qkv.shape(), dt), dbeta_b = poisoned(in.beta.shape(), dt);
      cpu::phase_a_bwd(dk_b, dqkv_b, dbeta_b, dP, dA, dPz, dbz, in.qkv, rstd, in.k_norm_w, in.rope_cos, in.rope_sin,
                       in.beta, d, ks, mode);
      expect_rounded_from(dk_b, dk, "phase_a_bwd dk_hat " + what);
      EXPECT_TRUE(bitwise_equal(dbeta_b, dbeta)) << what;
      EXPECT_TRUE(bitwise_equal(dqkv_b, dqkv)) << what << ": the v channel (q and k still poisoned alike)";

      // rms_norm_bwd fed the exact and the rounded dq̂, dk̂.
      Tensor dqw = in.q_norm_w.defined() ? poisoned({d.C()}, in.q_norm_w.dtype()) : Tensor();
      Tensor dkw = poisoned({d.C()}, in.k_norm_w.dtype()), dqw_b = dqw.defined() ? dqw.clone() : Tensor(),
             dkw_b = dkw.clone();
      cpu::rms_norm_bwd(dqkv, dqw, dkw, dq, dk, in.qkv, rstd, in.q_norm_w, in.k_norm_w, d);
      cpu::rms_norm_bwd(dqkv_b, dqw_b, dkw_b, dq_b, dk_b, in.qkv, rstd, in.q_norm_w, in.k_norm_w, d);
      EXPECT_FALSE(has_nonfinite(dqkv_b)) << what;
      EXPECT_TRUE(close_rel(dqkv_b, dqkv, kBf16HalfUlp, "rms_norm_bwd dqkv " + what));
      if (dqw.defined()) {
        EXPECT_TRUE(close_rel(dqw_b, dqw, kBf16HalfUlp, "rms_norm_bwd dq_norm_w " + what));
      }
      EXPECT_TRUE(close_rel(dkw_b, dkw, kBf16HalfUlp, "rms_norm_bwd dk_norm_w " + what));
      std::printf("[bf16 hat] %-12s rms_norm_bwd rel L2 vs exact-fed: dqkv %.2e, dk_norm_w %.2e\n", what.c_str(),
                  rel_l2(dqkv_b, dqkv), rel_l2(dkw_b, dkw));
    }
}

// A dq_hat / dk_hat of neither the compute dtype nor bf16 is refused with a message naming it.
void expect_error_naming(const std::function<void()>& call, const std::string& name) {
  try {
    call();
    ADD_FAILURE() << name << ": an f64 hat gradient with f32 data was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
  }
}

TEST(BigdnTwins, RejectGradHatOfAnotherDtype) {
  const Dims d = dims(1, 2, 8, 2, 3);
  const LayerInputs in = make_layer_inputs(d, DType::f32, 1200);
  const DType f32 = DType::f32;
  const Shape tok = {d.B, d.N(), d.H, d.D}, mat = {d.BH(), d.F, d.D, d.D}, vec = {d.BH(), d.F, d.D};
  Tensor rstd = Tensor::empty({d.B, d.N(), 2}, f32);
  cpu::rms_stats(rstd, in.qkv, in.q_norm_w, in.k_norm_w, d, 1e-5);
  const Tensor hat32 = Tensor::randn(tok, f32, kCpu, 1201), hat64 = Tensor::randn(tok, DType::f64, kCpu, 1202);
  const Tensor M = Tensor::randn(mat, f32, kCpu, 1203), z = Tensor::randn(vec, f32, kCpu, 1204);
  Tensor dqkv = Tensor::empty(in.qkv.shape(), f32), dqw = Tensor::empty({d.C()}, f32), dkw = dqw.clone();
  Tensor out64 = Tensor::empty(tok, DType::f64), dM = Tensor::empty(mat, f32), dz = Tensor::empty(vec, f32);
  Tensor dbeta = Tensor::empty(in.beta.shape(), f32);
  expect_error_naming(
      [&] { cpu::rms_norm_bwd(dqkv, dqw, dkw, hat64, hat32, in.qkv, rstd, in.q_norm_w, in.k_norm_w, d); }, "dq_hat");
  expect_error_naming(
      [&] { cpu::rms_norm_bwd(dqkv, dqw, dkw, hat32, hat64, in.qkv, rstd, in.q_norm_w, in.k_norm_w, d); }, "dk_hat");
  expect_error_naming(
      [&] {
        cpu::phase_c_bwd(out64, dM, dz, hat32, Tensor(), in.qkv, rstd, in.q_norm_w, in.rope_cos, in.rope_sin, M, z, d,
                         1e-6, true, MathMode::ieee);
      },
      "dq_hat");
  expect_error_naming(
      [&] {
        cpu::phase_a_bwd(out64, dqkv, dbeta, M, M, M, z, in.qkv, rstd, in.k_norm_w, in.rope_cos, in.rope_sin, in.beta,
                         d, 1.0, MathMode::ieee);
      },
      "dk_hat");
}

// rms_norm_bwd one stream at a time (the layer runs q's right after phase C's backward): each call
// writes only its stream's channel and weight gradient, and the two calls together give bitwise
// what one call with both hats gives. Both hats undefined is an error.
TEST(BigdnTwins, RmsNormBwdOneStreamAtATime) {
  const Dims d = dims(1, 2, 8, 2, 3);
  for (DType dt : {DType::f32, DType::f64}) {
    const LayerInputs in = make_layer_inputs(d, dt, 1300);
    const DType ct = compute_dtype(dt);
    const Shape tok = {d.B, d.N(), d.H, d.D};
    Tensor rstd = Tensor::empty({d.B, d.N(), 2}, ct);
    cpu::rms_stats(rstd, in.qkv, in.q_norm_w, in.k_norm_w, d, 1e-5);
    const Tensor dqh = Tensor::randn(tok, ct, kCpu, 1301), dkh = Tensor::randn(tok, ct, kCpu, 1302);
    Tensor both = poisoned(in.qkv.shape(), dt), bqw = poisoned({d.C()}, ct), bkw = poisoned({d.C()}, ct);
    cpu::rms_norm_bwd(both, bqw, bkw, dqh, dkh, in.qkv, rstd, in.q_norm_w, in.k_norm_w, d);

    Tensor split = poisoned(in.qkv.shape(), dt), sqw = poisoned({d.C()}, ct), skw = poisoned({d.C()}, ct);
    cpu::rms_norm_bwd(split, sqw, skw, dqh, Tensor(), in.qkv, rstd, in.q_norm_w, in.k_norm_w, d);
    const std::vector<double> v = split.to_vector();
    for (size_t e = 0; e < v.size(); ++e)  // only channel 0 written
      ASSERT_EQ(std::isfinite(v[e]), (e / static_cast<size_t>(d.C())) % 3 == 0) << dtype_name(dt) << " element " << e;
    EXPECT_TRUE(has_nonfinite(skw)) << "q's call must leave dk_norm_w untouched";
    cpu::rms_norm_bwd(split, sqw, skw, Tensor(), dkh, in.qkv, rstd, in.q_norm_w, in.k_norm_w, d);
    EXPECT_TRUE(bitwise_equal(split, both)) << dtype_name(dt);  // channel 2 holds the same poison in both
    EXPECT_TRUE(bitwise_equal(sqw, bqw)) << dtype_name(dt);
    EXPECT_TRUE(bitwise_equal(skw, bkw)) << dtype_name(dt);
    expect_error_naming(
        [&] { cpu::rms_norm_bwd(split, sqw, skw, Tensor(), Tensor(), in.qkv, rstd, in.q_norm_w, in.k_norm_w, d); },
        "dq_hat and dk_hat");
  }
}

TEST(BigdnTwins, RejectShapesThatDoNotMatchDims) {
  const Dims d = dims(1, 2, 8, 2, 3);
  const LayerInputs in = make_layer_inputs(d, DType::f32, 995);
  Tensor rstd = Tensor::empty({d.B, d.N(), 2}, DType::f32);
  cpu::rms_stats(rstd, in.qkv, in.q_norm_w, in.k_norm_w, d, 1e-5);
  Tensor P = Tensor::empty({d.BH(), d.F, d.D, d.D + 1}, DType::f32),
         A = Tensor::empty({d.BH(), d.F, d.D, d.D}, DType::f32);
  Tensor Pz = A.clone(), bz = Tensor::empty({d.BH(), d.F, d.D}, DType::f32);
  EXPECT_THROW(cpu::phase_a_fwd(P, A, Pz, bz, in.qkv, rstd, in.k_norm_w, in.rope_cos, in.rope_sin, in.beta, d, 1.0,
                                MathMode::ieee),
               Error);
  Dims wrong = d;
  wrong.F = 3;  // qkv holds F·S = 6 tokens, not 9
  EXPECT_THROW(cpu::rms_stats(rstd, in.qkv, in.q_norm_w, in.k_norm_w, wrong, 1e-5), Error);
}

// --- rope tables ---------------------------------------------------------------------------------

TEST(RopeTables, PairLayoutWithSignedSin) {
  const int64_t N = 5, D = 8, offset = 3;
  const auto t = rope_tables(N, D, DType::f64, kCpu, offset, 100.0);
  const std::vector<double> c = t.first.to_vector(), s = t.second.to_vector();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < D / 2; ++i) {
      const double theta = static_cast<double>(n + offset) * std::pow(100.0, -2.0 * i / D);
      const size_t e = static_cast<size_t>(n * D + 2 * i);
      EXPECT_NEAR(c[e], std::cos(theta), tol::f64_rounding);
      EXPECT_EQ(c[e], c[e + 1]);
      EXPECT_NEAR(s[e + 1], std::sin(theta), tol::f64_rounding);
      EXPECT_EQ(s[e], -s[e + 1]);
    }
  const auto f = rope_tables(N, D, DType::f32, kCpu);
  EXPECT_EQ(f.first.dtype(), DType::f32);
  EXPECT_THROW(rope_tables(N, 7, DType::f32, kCpu), Error);
  EXPECT_THROW(rope_tables(N, D, DType::bf16, kCpu), Error);
}

// --- packed clips (docs/design.md §4a) -------------------------------------------------------------------

using Clips = std::vector<std::vector<int64_t>>;  // clip lengths of each row, summing to F

// The clip-start mask (B, F) f32 of the packing: 1 at the first frame of every clip.
Tensor clip_mask(const Clips& rows, int64_t F) {
  std::vector<double> m(rows.size() * static_cast<size_t>(F), 0.0);
  for (size_t b = 0; b < rows.size(); ++b) {
    int64_t f = 0;
    for (int64_t len : rows[b]) {
      m[b * static_cast<size_t>(F) + static_cast<size_t>(f)] = 1.0;
      f += len;
    }
    EXPECT_EQ(f, F) << "row " << b << ": clip lengths must sum to F";
  }
  return Tensor::from_vector(m, {static_cast<int64_t>(rows.size()), F}, DType::f32);
}

// Flat indices into a tensor of `shape` of its block [lo, hi) along `axis`, in row b
// (dim 0) when axis > 0, in row-major order of the block.
std::vector<size_t> block_index(const Shape& shape, int64_t b, size_t axis, int64_t lo, int64_t hi) {
  int64_t outer = 1, inner = 1;
  for (size_t i = 1; i < axis; ++i) outer *= shape[i];
  for (size_t i = axis + 1; i < shape.size(); ++i) inner *= shape[i];
  const int64_t n = shape[axis], row = axis > 0 ? b : 0;
  std::vector<size_t> idx;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t k = 0; k < inner; ++k) idx.push_back(static_cast<size_t>(((row * outer + o) * n + i) * inner + k));
  return idx;
}

// The block as a tensor of t's dtype (dim 0 of size 1 when axis > 0).
Tensor take_block(const Tensor& t, int64_t b, size_t axis, int64_t lo, int64_t hi) {
  const std::vector<double> v = t.to_vector();
  std::vector<double> out;
  for (size_t e : block_index(t.shape(), b, axis, lo, hi)) out.push_back(v[e]);
  Shape s = t.shape();
  if (axis > 0) s[0] = 1;
  s[axis] = hi - lo;
  return Tensor::from_vector(out, s, t.dtype());
}

// Writes (or adds) src, a block's values, into the flat buffer of a tensor of `shape`.
void put_block(std::vector<double>& dst, const Shape& shape, const Tensor& src, int64_t b, size_t axis, int64_t lo,
               int64_t hi) {
  const std::vector<double> v = src.to_vector();
  const std::vector<size_t> idx = block_index(shape, b, axis, lo, hi);
  ASSERT_EQ(idx.size(), v.size());
  for (size_t k = 0; k < idx.size(); ++k) dst[idx[k]] = v[k];
}

// Forward + backward of the packed layer, L = Σ w·out.
LayerRun run_packed(const LayerInputs& base, const Tensor& w, const Tensor& mask, bool fused = true) {
  LayerInputs in = base;
  for (Tensor* t : {&in.qkv, &in.beta, &in.decay, &in.q_norm_w, &in.k_norm_w})
    if (t->defined()) *t = t->clone().requires_grad_();
  LayerRun r;
  const Dims& d = in.d;
  r.out = fused ? bigdn(in.qkv, in.beta, in.decay, in.q_norm_w, in.k_norm_w, in.rope_cos, in.rope_sin, d.F, d.S, in.opt,
                        mask)
                : bigdn_unfused(in.qkv, in.beta, in.decay, in.q_norm_w, in.k_norm_w, in.rope_cos, in.rope_sin, d.F, d.S,
                                in.opt, mask);
  backward(r.out, w.to(r.out.dtype()));
  for (const Tensor* t : {&in.qkv, &in.beta, &in.decay, &in.q_norm_w, &in.k_norm_w})
    r.grads.push_back(t->defined() ? t->grad() : Tensor());
  return r;
}

// Every clip run as its own row (B = 1, no mask), assembled into the packed layout:
// out, dqkv, dbeta, ddecay in place, the norm weights' gradients summed over the clips.
LayerRun run_separate(const LayerInputs& in, const Tensor& w, const Clips& rows) {
  const Dims& d = in.d;
  const int64_t S = d.S;
  std::vector<double> out(static_cast<size_t>(w.numel()), 0.0);
  std::vector<std::vector<double>> g(5);
  const Tensor* full[5] = {&in.qkv, &in.beta, &in.decay, &in.q_norm_w, &in.k_norm_w};
  for (size_t i = 0; i < 5; ++i)
    if (full[i]->defined()) g[i].assign(static_cast<size_t>(full[i]->numel()), 0.0);
  for (size_t b = 0; b < rows.size(); ++b) {
    int64_t f0 = 0;
    for (int64_t len : rows[b]) {
      const int64_t f1 = f0 + len, bb = static_cast<int64_t>(b);
      LayerInputs c = in;
      c.d.B = 1;
      c.d.F = len;
      c.qkv = take_block(in.qkv, bb, 1, f0 * S, f1 * S);
      c.beta = take_block(in.beta, bb, 2, f0, f1);
      c.decay = take_block(in.decay, bb, 2, f0, f1);
      c.rope_cos = take_block(in.rope_cos, 0, 0, f0 * S, f1 * S);
      c.rope_sin = take_block(in.rope_sin, 0, 0, f0 * S, f1 * S);
      const LayerRun r = run_layer(c, take_block(w, bb, 1, f0 * S, f1 * S));
      put_block(out, w.shape(), r.out, bb, 1, f0 * S, f1 * S);
      put_block(g[0], in.qkv.shape(), r.grads[0], bb, 1, f0 * S, f1 * S);
      put_block(g[1], in.beta.shape(), r.grads[1], bb, 2, f0, f1);
      put_block(g[2], in.decay.shape(), r.grads[2], bb, 2, f0, f1);
      for (size_t i = 3; i < 5; ++i)
        if (r.grads[i].defined()) {
          const std::vector<double> v = r.grads[i].to_vector();
          for (size_t e = 0; e < v.size(); ++e) g[i][e] += v[e];
        }
      f0 = f1;
    }
  }
  LayerRun r;
  r.out = Tensor::from_vector(out, w.shape(), in.qkv.dtype());
  for (size_t i = 0; i < 5; ++i)
    r.grads.push_back(full[i]->defined() ? Tensor::from_vector(g[i], full[i]->shape(), full[i]->dtype()) : Tensor());
  return r;
}

void expect_runs_close(const LayerRun& a, const LayerRun& b, double tol, const std::string& what) {
  EXPECT_TRUE(close_rel(a.out, b.out, tol, "out " + what));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_EQ(a.grads[i].defined(), b.grads[i].defined()) << kGradNames[i] << " " << what;
    if (a.grads[i].defined()) {
      EXPECT_TRUE(close_rel(a.grads[i], b.grads[i], tol, kGradNames[i] + (" " + what)));
    }
  }
}

// Packs `rows` into one call and compares it with every clip run as its own row, fp64.
void check_packed_equals_separate(const Dims& d, const Clips& rows, uint64_t seed, bool norm = true) {
  const LayerInputs in = make_layer_inputs(d, DType::f64, seed, norm, norm);
  const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, DType::f64, kCpu, seed + 100);
  const Tensor mask = clip_mask(rows, d.F);
  const LayerRun packed = run_packed(in, w, mask), separate = run_separate(in, w, rows);
  std::string what = dims_str(d) + " clips";
  for (const auto& row : rows) {
    what += " |";
    for (int64_t len : row) what += " " + std::to_string(len);
  }
  expect_runs_close(packed, separate, tol::f64, what);
  // The clips do change the result: the same inputs as one clip per row differ.
  EXPECT_GT(rel_l2(run_layer(in, w).out, separate.out), 1e-3) << what;
}

TEST(BigdnClip, PackedEqualsSeparateClips) {
  check_packed_equals_separate(dims(1, 2, 8, 8, 3), {{3, 1, 4}}, 2000);
  check_packed_equals_separate(dims(1, 1, 12, 8, 2), {{3, 1, 4}}, 2001, /*norm=*/false);
}

TEST(BigdnClip, OneFrameClips) {
  check_packed_equals_separate(dims(1, 2, 8, 5, 3), {{1, 1, 1, 1, 1}}, 2010);
  check_packed_equals_separate(dims(1, 2, 8, 6, 2), {{2, 1, 1, 2}}, 2011);
}

TEST(BigdnClip, RowsPackedDifferently) {
  check_packed_equals_separate(dims(3, 2, 8, 8, 2), {{3, 1, 4}, {8}, {1, 1, 5, 1}}, 2020);
}

// Frame 0 starts a clip whatever the mask says there.
TEST(BigdnClip, FrameZeroAlwaysStarts) {
  const Dims d = dims(2, 2, 8, 5, 2);
  const LayerInputs in = make_layer_inputs(d, DType::f64, 2030);
  const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, DType::f64, kCpu, 2031);
  const Tensor with = Tensor::from_vector({1, 0, 1, 0, 0, 1, 0, 0, 1, 1}, {2, 5}, DType::f32);
  const Tensor without = Tensor::from_vector({0, 0, 1, 0, 0, 0, 0, 0, 1, 1}, {2, 5}, DType::f32);
  const LayerRun a = run_packed(in, w, with), b = run_packed(in, w, without);
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(bitwise_equal(a.grads[i], b.grads[i])) << kGradNames[i];
  // An all-zero mask is one clip per row.
  const LayerRun none = run_packed(in, w, Tensor::zeros({2, 5}, DType::f32)), plain = run_layer(in, w);
  EXPECT_TRUE(bitwise_equal(none.out, plain.out));
  for (size_t i = 0; i < none.grads.size(); ++i)
    EXPECT_TRUE(bitwise_equal(none.grads[i], plain.grads[i])) << kGradNames[i];
}

// The fused twins and the fine-grained ops, each with the mask, agree (fp64).
TEST(BigdnClip, FusedUnfusedAgree) {
  const Dims d = dims(2, 2, 8, 7, 2);
  const Clips rows = {{2, 1, 4}, {1, 1, 1, 3, 1}};
  const LayerInputs in = make_layer_inputs(d, DType::f64, 2040);
  const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, DType::f64, kCpu, 2041);
  const Tensor mask = clip_mask(rows, d.F);
  expect_runs_close(run_packed(in, w, mask, true), run_packed(in, w, mask, false), tol::f64, "fused vs unfused");
}

// The f32 twin with a mask against the f64 one on the same values.
TEST(BigdnClip, F32AgainstF64) {
  const Dims d = dims(2, 2, 16, 8, 4);
  const Clips rows = {{3, 1, 4}, {1, 7}};
  const LayerInputs hi = make_layer_inputs(d, DType::f64, 2050), lo = convert(hi, DType::f32);
  const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, DType::f64, kCpu, 2051);
  const Tensor mask = clip_mask(rows, d.F);
  const LayerRun a = run_packed(lo, w, mask), b = run_packed(hi, w, mask);
  EXPECT_TRUE(close_rel(a.out, b.out, tol::f32, "out"));
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(close_rel(a.grads[i], b.grads[i], tol::f32, kGradNames[i]));
}

// Checkpointing on gives bitwise the gradients of off, with a mask.
TEST(BigdnClip, CheckpointBitwiseEqual) {
  for (DType dt : {DType::f32, DType::f64}) {
    const Dims d = dims(2, 2, 8, 6, 3);
    LayerInputs in = make_layer_inputs(d, dt, 2060);
    const Tensor w = Tensor::randn({d.B, d.N(), d.H, d.D}, dt, kCpu, 2061);
    const Tensor mask = clip_mask({{2, 3, 1}, {1, 1, 4}}, d.F);
    in.opt.checkpoint = Checkpoint::off;
    const LayerRun off = run_packed(in, w, mask);
    in.opt.checkpoint = Checkpoint::on;
    const LayerRun on = run_packed(in, w, mask);
    EXPECT_TRUE(bitwise_equal(on.out, off.out)) << dtype_name(dt);
    for (size_t i = 0; i < on.grads.size(); ++i)
      EXPECT_TRUE(bitwise_equal(on.grads[i], off.grads[i])) << kGradNames[i] << " " << dtype_name(dt);
  }
}

}  // namespace
}  // namespace test
}  // namespace gdncp
