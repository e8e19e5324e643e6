// tests/test_nn_gradcheck.cpp — the generic ops of gdncp/nn.h on the CPU:
// f64 central-difference gradchecks (≤ tol::gradcheck relative), forwards against
// independent naive loops, and bad input naming the argument.
#include <cmath>
#include <string>

#include "gdncp/nn.h"
#include "util/test_util.h"

namespace gdncp {
namespace {

Tensor rnd(const Shape& s, uint64_t seed, double stddev = 1.0) {
  return Tensor::randn(s, DType::f64, Device::cpu, seed, stddev).requires_grad_();
}

void expect_gradcheck(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                      const std::vector<Tensor>& inputs) {
  const test::GradcheckResult r = test::gradcheck(fn, inputs);
  EXPECT_LE(r.max_rel_error, test::tol::gradcheck) << r.report;
  EXPECT_GT(r.max_rel_error, 0.0) << "gradcheck compared nothing:\n" << r.report;
}

// --- gradchecks ---------------------------------------------------------------------------

// A gradcheck that compared no element fails: an empty selection (max_elems 0)
// and inputs of which none requires grad both give +inf, whatever fn does.
TEST(NnGradcheck, GradcheckOverEmptySelectionFails) {
  const auto fn = [](const std::vector<Tensor>& in) { return std::vector<Tensor>{nn::sigmoid(in[0])}; };
  const test::GradcheckResult none = test::gradcheck(fn, {rnd({3, 4}, 5)}, 1e-6, /*max_elems=*/0);
  EXPECT_EQ(none.elements_checked, 0);
  EXPECT_FALSE(none.max_rel_error <= test::tol::gradcheck) << none.report;
  const Tensor frozen = Tensor::randn({3, 4}, DType::f64, Device::cpu, 6);  // requires no grad
  const test::GradcheckResult frozen_only = test::gradcheck(fn, {frozen});
  EXPECT_EQ(frozen_only.elements_checked, 0);
  EXPECT_FALSE(frozen_only.max_rel_error <= test::tol::gradcheck) << frozen_only.report;
  // The same check over a real selection passes.
  const test::GradcheckResult some = test::gradcheck(fn, {rnd({3, 4}, 5)});
  EXPECT_EQ(some.elements_checked, 12);
  EXPECT_LE(some.max_rel_error, test::tol::gradcheck) << some.report;
}

TEST(NnGradcheck, MatmulGradcheck) {
  for (const Shape& xs : {Shape{7, 5}, Shape{2, 3, 5}, Shape{1, 5}}) {
    Tensor x = rnd(xs, 11), w = rnd({5, 4}, 12);
    expect_gradcheck([](const std::vector<Tensor>& in) { return std::vector<Tensor>{nn::matmul(in[0], in[1])}; },
                     {x, w});
  }
}

TEST(NnGradcheck, MatmulSharedInputGradcheck) {
  // x · W used twice (x·W and (x·W)·W): gradients of W reach it along two edges.
  Tensor x = rnd({3, 4}, 21), w = rnd({4, 4}, 22, 0.5);
  expect_gradcheck(
      [](const std::vector<Tensor>& in) {
        Tensor h = nn::matmul(in[0], in[1]);
        return std::vector<Tensor>{nn::matmul(h, in[1])};
      },
      {x, w});
}

TEST(NnGradcheck, AddGradcheck) {
  Tensor a = rnd({3, 4, 2}, 31), b = rnd({3, 4, 2}, 32);
  expect_gradcheck([](const std::vector<Tensor>& in) { return std::vector<Tensor>{nn::add(in[0], in[1])}; }, {a, b});
  // The same tensor on both sides: its gradient is 2·dy.
  expect_gradcheck([](const std::vector<Tensor>& in) { return std::vector<Tensor>{nn::add(in[0], in[0])}; }, {a});
}

TEST(NnGradcheck, SigmoidGradcheck) {
  Tensor x = rnd({4, 6}, 41, 3.0);  // wide enough to reach both saturated tails
  expect_gradcheck([](const std::vector<Tensor>& in) { return std::vector<Tensor>{nn::sigmoid(in[0])}; }, {x});
}

TEST(NnGradcheck, FrameMeanGradcheck) {
  for (const Shape& s : {Shape{2, 3, 4, 5}, Shape{2, 1, 3, 1}, Shape{7}}) {
    Tensor x = rnd(s, 51);
    expect_gradcheck([](const std::vector<Tensor>& in) { return std::vector<Tensor>{nn::frame_mean(in[0])}; }, {x});
  }
}

TEST(NnGradcheck, TransposeLast2Gradcheck) {
  for (const Shape& s : {Shape{2, 3, 5}, Shape{4, 3}, Shape{3, 1, 4}}) {
    Tensor x = rnd(s, 61);
    expect_gradcheck([](const std::vector<Tensor>& in) { return std::vector<Tensor>{nn::transpose_last2(in[0])}; },
                     {x});
  }
}

TEST(NnGradcheck, MseLossGradcheck) {
  Tensor p = rnd({3, 5, 2}, 71), t = rnd({3, 5, 2}, 72);
  expect_gradcheck([](const std::vector<Tensor>& in) { return std::vector<Tensor>{nn::mse_loss(in[0], in[1])}; },
                   {p, t});
  // A shard with the global count.
  expect_gradcheck([](const std::vector<Tensor>& in) { return std::vector<Tensor>{nn::mse_loss(in[0], in[1], 100)}; },
                   {p, t});
}

// The trainer's gate path: per-token beta and per-frame decay from the latents,
// (B, N, C) -> (B, N, H) -> (B, H, N) -> (B, H, F, S) [-> frame mean] -> sigmoid.
TEST(NnGradcheck, GateCompositionGradcheck) {
  const int64_t B = 2, F = 3, S = 4, N = F * S, C = 6, H = 2;
  Tensor x = rnd({B, N, C}, 81), wb = rnd({C, H}, 82), wg = rnd({C, H}, 83);
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        Tensor beta = nn::sigmoid(nn::transpose_last2(nn::matmul(in[0], in[1])).reshape({B, H, F, S}));
        Tensor decay = nn::sigmoid(nn::frame_mean(nn::transpose_last2(nn::matmul(in[0], in[2])).reshape({B, H, F, S})));
        return std::vector<Tensor>{beta, decay};
      },
      {x, wb, wg});
}

// A residual projection block with the loss at the end: every op on one tape.
TEST(NnGradcheck, ResidualBlockLossGradcheck) {
  Tensor x = rnd({2, 5, 4}, 91), w1 = rnd({4, 4}, 92, 0.5), w2 = rnd({4, 4}, 93, 0.5), target = rnd({2, 5, 4}, 94);
  expect_gradcheck(
      [](const std::vector<Tensor>& in) {
        Tensor h = nn::sigmoid(nn::matmul(in[0], in[1]));
        Tensor y = nn::add(in[0], nn::matmul(h, in[2]));
        return std::vector<Tensor>{nn::mse_loss(y, in[3])};
      },
      {x, w1, w2, target});
}

// --- forwards against naive loops ---------------------------------------------------------------

TEST(NnOps, MatmulMatchesNaiveLoopF32AndBf16) {
  const int64_t M = 6, K = 9, N = 5;
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor x = Tensor::randn({2, 3, K}, dt, Device::cpu, 101), w = Tensor::randn({K, N}, dt, Device::cpu, 102);
    const std::vector<double> xv = x.to_vector(), wv = w.to_vector();
    std::vector<double> ref(M * N, 0.0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        for (int64_t k = 0; k < K; ++k) ref[i * N + j] += xv[i * K + k] * wv[k * N + j];
    const Tensor y = nn::matmul(x, w);
    ASSERT_EQ(y.shape(), (Shape{2, 3, N}));
    ASSERT_EQ(y.dtype(), dt);
    // f32: accumulation rounding ~K·2^-24; bf16: one output rounding 2^-9.
    const double tol = dt == DType::f32 ? test::tol::f32_short : test::tol::bf16_matmul;
    EXPECT_TRUE(
        test::close_rel(y.to(DType::f64), Tensor::from_vector(ref, {2, 3, N}, DType::f64), tol, dtype_name(dt)));
  }
}

TEST(NnOps, ElementwiseForwardsMatchFormulas) {
  const Tensor x = Tensor::randn({3, 4, 5}, DType::f64, Device::cpu, 111);
  const std::vector<double> xv = x.to_vector();
  const std::vector<double> sg = nn::sigmoid(x).to_vector();
  const std::vector<double> fm = nn::frame_mean(x).to_vector();
  const std::vector<double> tr = nn::transpose_last2(x).to_vector();
  for (int64_t a = 0; a < 3; ++a)
    for (int64_t m = 0; m < 4; ++m) {
      double s = 0;
      for (int64_t n = 0; n < 5; ++n) {
        const double v = xv[(a * 4 + m) * 5 + n];
        s += v;
        EXPECT_NEAR(sg[(a * 4 + m) * 5 + n], 1.0 / (1.0 + std::exp(-v)), test::tol::f64_rounding);
        EXPECT_EQ(tr[(a * 5 + n) * 4 + m], v);
      }
      EXPECT_NEAR(fm[a * 4 + m], s / 5, test::tol::f64_rounding);
    }
  const Tensor t = Tensor::randn({3, 4, 5}, DType::f64, Device::cpu, 112);
  const std::vector<double> tv = t.to_vector();
  double sq = 0;
  for (size_t i = 0; i < xv.size(); ++i) sq += (xv[i] - tv[i]) * (xv[i] - tv[i]);
  EXPECT_NEAR(nn::mse_loss(x, t).item(), sq / 60, test::tol::f64_sum);
  EXPECT_NEAR(nn::mse_loss(x, t, 600).item(), sq / 600, test::tol::f64_rounding);
  const std::vector<double> ad = nn::add(x, t).to_vector();
  for (size_t i = 0; i < xv.size(); ++i) EXPECT_EQ(ad[i], xv[i] + tv[i]);
}

TEST(NnOps, CastRoundsAndSendsGradientBack) {
  Tensor x = Tensor::randn({4, 8}, DType::f32, Device::cpu, 121).requires_grad_();
  Tensor y = nn::cast(x, DType::bf16);
  ASSERT_EQ(y.dtype(), DType::bf16);
  EXPECT_TRUE(test::bitwise_equal(y, x.to(DType::bf16)));
  EXPECT_TRUE(nn::cast(x, DType::f32).same_as(x));  // no-op cast is the input itself
  // d/dx Σ w·cast(x) = w rounded to bf16 then widened (the gradient takes the output's dtype on the way).
  const Tensor w = Tensor::randn({4, 8}, DType::bf16, Device::cpu, 122);
  backward(y, w);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().dtype(), DType::f32);
  EXPECT_TRUE(test::bitwise_equal(x.grad(), w.to(DType::f32)));
}

TEST(NnOps, Bf16OpsMatchF32WithinBf16Rounding) {
  const Tensor x = Tensor::randn({2, 6, 7}, DType::f32, Device::cpu, 131);
  const Tensor xb = x.to(DType::bf16);
  // bf16 keeps 8 bits of mantissa: one rounding on input and output, ~2^-8 relative.
  EXPECT_TRUE(test::close_rel(nn::sigmoid(xb), nn::sigmoid(x), test::tol::bf16_vs_f64, "sigmoid"));
  EXPECT_TRUE(test::close_rel(nn::frame_mean(xb), nn::frame_mean(x), test::tol::bf16_vs_f64, "frame_mean"));
  EXPECT_TRUE(test::bitwise_equal(nn::transpose_last2(xb), nn::transpose_last2(x).to(DType::bf16)));
  EXPECT_NEAR(nn::mse_loss(xb, xb).item(), 0.0, 0.0);
}

// --- bad input -------------------------------------------------------------------------------

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no gdncp::Error thrown; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(NnOps, BadInputNamesTheArgument) {
  const Tensor a = Tensor::randn({3, 4}, DType::f32, Device::cpu, 1);
  const Tensor b = Tensor::randn({4, 3}, DType::f32, Device::cpu, 2);
  const Tensor d = Tensor::randn({4, 5}, DType::f64, Device::cpu, 3);
  expect_error([&] { nn::matmul(a, a); }, "x's last axis");
  expect_error([&] { nn::matmul(a, d); }, "w is f64");
  expect_error([&] { nn::matmul(a, Tensor::randn({4}, DType::f32, Device::cpu, 4)); }, "w must be (K, N)");
  expect_error([&] { nn::matmul(Tensor(), b); }, "x is undefined");
  expect_error([&] { nn::add(a, b); }, "differ in shape");
  expect_error([&] { nn::add(a, a.to(DType::bf16)); }, "b is bf16");
  expect_error([&] { nn::transpose_last2(Tensor::randn({2, 2, 2, 2}, DType::f32, Device::cpu, 5)); }, "x must be");
  expect_error([&] { nn::mse_loss(a, b); }, "differ in shape");
  expect_error([&] { nn::mse_loss(a, a, -1); }, "count must be");
  expect_error([&] { nn::frame_mean(Tensor::randn({3, 0}, DType::f32, Device::cpu, 6)); }, "last axis");
  expect_error([&] { nn::sigmoid(Tensor()); }, "x is undefined");
}

}  // namespace
}  // namespace gdncp
