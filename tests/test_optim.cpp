// tests/test_optim.cpp — AdamW on the CPU against an independent scalar coding
// of the update, decoupled weight decay, skipped parameters, and a small fit.
#include <cmath>

#include "gdncp/nn.h"
#include "gdncp/optim.h"
#include "util/test_util.h"

namespace gdncp {
namespace {

// One AdamW step on plain doubles (the formula of optim.h, written out again).
struct RefAdam {
  std::vector<double> p, m, v;
  int t = 0;
  void step(const std::vector<double>& g, const optim::AdamWOptions& o, double gs) {
    ++t;
    for (size_t i = 0; i < p.size(); ++i) {
      const double gi = gs * g[i];
      p[i] -= o.lr * o.weight_decay * p[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * gi;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * gi * gi;
      const double mh = m[i] / (1 - std::pow(o.beta1, t)), vh = v[i] / (1 - std::pow(o.beta2, t));
      p[i] -= o.lr * mh / (std::sqrt(vh) + o.eps);
    }
  }
};

TEST(AdamW, MatchesScalarReferenceF64) {
  optim::AdamWOptions o;
  o.lr = 0.05;
  o.weight_decay = 0.1;
  Tensor p = Tensor::randn({3, 5}, DType::f64, Device::cpu, 1).requires_grad_();
  RefAdam ref{p.to_vector(), std::vector<double>(15, 0.0), std::vector<double>(15, 0.0)};
  optim::AdamW opt({p}, o);
  for (int step = 0; step < 4; ++step) {
    const Tensor target = Tensor::randn({3, 5}, DType::f64, Device::cpu, 100 + step);
    opt.zero_grad();
    backward(nn::mse_loss(p, target));
    const std::vector<double> g = p.grad().to_vector();
    opt.step(0.5);
    ref.step(g, o, 0.5);
  }
  EXPECT_EQ(opt.steps(), 4);
  EXPECT_TRUE(test::close_rel(p.detach(), Tensor::from_vector(ref.p, {3, 5}, DType::f64), test::tol::f64_sum, "param"));
  EXPECT_TRUE(
      test::close_rel(opt.exp_avg()[0], Tensor::from_vector(ref.m, {3, 5}, DType::f64), test::tol::f64_sum, "m"));
  EXPECT_TRUE(
      test::close_rel(opt.exp_avg_sq()[0], Tensor::from_vector(ref.v, {3, 5}, DType::f64), test::tol::f64_sum, "v"));
}

TEST(AdamW, F32MatchesF64WithinF32Rounding) {
  optim::AdamWOptions o;
  o.lr = 0.01;
  Tensor p64 = Tensor::randn({64}, DType::f64, Device::cpu, 2).requires_grad_();
  Tensor p32 = p64.to(DType::f32).requires_grad_();
  optim::AdamW a64({p64}, o), a32({p32}, o);
  for (int step = 0; step < 3; ++step) {
    const Tensor t = Tensor::randn({64}, DType::f64, Device::cpu, 200 + step);
    a64.zero_grad();
    a32.zero_grad();
    backward(nn::mse_loss(p64, t));
    backward(nn::mse_loss(p32, t.to(DType::f32)));
    a64.step();
    a32.step();
  }
  EXPECT_TRUE(test::close_rel(p32.detach().to(DType::f64), p64.detach(), test::tol::f32_short, "f32 vs f64"));
}

TEST(AdamW, WeightDecayIsDecoupledFromTheGradient) {
  // A zero gradient leaves m = v = 0, so the Adam move is 0 and only the decay acts: p·(1 − lr·wd).
  optim::AdamWOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.5;
  Tensor p = Tensor::randn({8}, DType::f64, Device::cpu, 3).requires_grad_();
  const std::vector<double> before = p.to_vector();
  optim::AdamW opt({p}, o);
  backward(nn::mse_loss(p, p.detach()));  // gradient 2(p − p) = 0
  opt.step();
  const std::vector<double> after = p.to_vector();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_DOUBLE_EQ(after[i], before[i] * (1 - 0.05));
}

TEST(AdamW, ParametersWithoutGradientAreSkipped) {
  Tensor a = Tensor::randn({4}, DType::f32, Device::cpu, 4).requires_grad_();
  Tensor b = Tensor::randn({4}, DType::f32, Device::cpu, 5).requires_grad_();
  const Tensor b0 = b.detach().clone();
  optim::AdamW opt({a, b});
  backward(nn::mse_loss(a, Tensor::zeros({4}, DType::f32)));
  opt.step();
  EXPECT_TRUE(test::bitwise_equal(b.detach(), b0));
  EXPECT_FALSE(test::bitwise_equal(opt.exp_avg()[0], Tensor::zeros({4}, DType::f32)));
}

TEST(AdamW, FitsALinearMap) {
  // y = x·W*: AdamW on mse must recover W* (loss down by orders of magnitude).
  const Tensor x = Tensor::randn({64, 6}, DType::f32, Device::cpu, 6);
  const Tensor w_star = Tensor::randn({6, 3}, DType::f32, Device::cpu, 7);
  const Tensor y = nn::matmul(x, w_star);
  Tensor w = Tensor::zeros({6, 3}, DType::f32).requires_grad_();
  optim::AdamWOptions o;
  o.lr = 0.05;
  o.weight_decay = 0.0;
  optim::AdamW opt({w}, o);
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    opt.zero_grad();
    Tensor loss = nn::mse_loss(nn::matmul(x, w), y);
    if (step == 0) first = loss.item();
    last = loss.item();
    backward(loss);
    opt.step();
  }
  EXPECT_LT(last, 1e-3 * first) << "first " << first << " last " << last;
}

TEST(AdamW, BadOptionsAndParametersThrow) {
  Tensor p = Tensor::randn({4}, DType::f32, Device::cpu, 8).requires_grad_();
  optim::AdamWOptions o;
  o.beta1 = 1.0;
  EXPECT_THROW(optim::AdamW({p}, o), Error);
  o = {};
  o.eps = 0;
  EXPECT_THROW(optim::AdamW({p}, o), Error);
  EXPECT_THROW(optim::AdamW({Tensor::randn({4}, DType::f32, Device::cpu, 9)}), Error);  // not requiring grad
  EXPECT_THROW(optim::AdamW({Tensor::randn({4}, DType::bf16, Device::cpu, 9).requires_grad_()}), Error);
  optim::AdamW opt({p});
  EXPECT_THROW(opt.set_steps(-1), Error);
}

}  // namespace
}  // namespace gdncp
