// Tests of the tape engine and checkpointing with small ops defined here
// (elementwise product, sum, tanh) so that the engine is tested on its own.
#include <gtest/gtest.h>

#include <cmath>

#include "util/test_util.h"

namespace gdncp {
namespace {

using autograd::Node;

// --- tiny f64 CPU ops ---------------------------------------------------------------

Tensor map2(const Tensor& a, const Tensor& b, double (*f)(double, double)) {
  Tensor out = Tensor::empty(a.shape(), DType::f64);
  const double *x = a.data_ptr<double>(), *y = b.data_ptr<double>();
  double* o = out.data_ptr<double>();
  for (int64_t i = 0; i < a.numel(); ++i) o[i] = f(x[i], y[i]);
  return out;
}

class MulNode : public Node {
 public:
  const char* name() const override { return "test_mul"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    auto prod = [](double u, double v) { return u * v; };
    return {map2(g[0], saved(1), prod), map2(g[0], saved(0), prod)};
  }
};

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = map2(a, b, [](double u, double v) { return u * v; });
  auto node = std::make_shared<MulNode>();
  if (autograd::should_record({a, b})) {
    node->save(a);
    node->save(b);
  }
  autograd::record(node, {a, b}, {out});
  return out;
}

class TanhNode : public Node {
 public:
  const char* name() const override { return "test_tanh"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    return {map2(g[0], saved(0), [](double gy, double y) { return gy * (1 - y * y); })};
  }
};

Tensor tanh_op(const Tensor& a) {
  Tensor out = map2(a, a, [](double u, double) { return std::tanh(u); });
  auto node = std::make_shared<TanhNode>();
  if (autograd::should_record({a})) node->save(out);
  autograd::record(node, {a}, {out});
  return out;
}

class SumNode : public Node {
 public:
  explicit SumNode(Shape s) : shape_(std::move(s)) {}
  const char* name() const override { return "test_sum"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    return {Tensor::full(shape_, g[0].item(), DType::f64)};
  }
  Shape shape_;
};

Tensor sum(const Tensor& a) {
  double s = 0;
  for (double v : a.to_vector()) s += v;
  Tensor out = Tensor::full({1}, s, DType::f64);
  autograd::record(std::make_shared<SumNode>(a.shape()), {a}, {out});
  return out;
}

// Both inputs get the very same gradient tensor back.
class ForkNode : public Node {
 public:
  const char* name() const override { return "test_fork_sum"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override { return {g[0], g[0]}; }
};

Tensor add_same_grad(const Tensor& a, const Tensor& b) {
  Tensor out = map2(a, b, [](double u, double v) { return u + v; });
  autograd::record(std::make_shared<ForkNode>(), {a, b}, {out});
  return out;
}

Tensor rnd(const Shape& s, uint64_t seed) { return Tensor::randn(s, DType::f64, Device::cpu, seed); }

// --- tests -------------------------------------------------------------------------------

TEST(Autograd, ProductRuleAndSharedInputSummed) {
  Tensor x = rnd({5}, 1).requires_grad_();
  Tensor y = rnd({5}, 2).requires_grad_();
  // L = Σ x·y + Σ x·x: x reaches L along three edges.
  Tensor L = add_same_grad(sum(mul(x, y)), sum(mul(x, x)));
  backward(L);
  const auto gx = x.grad().to_vector(), gy = y.grad().to_vector();
  const auto xv = x.to_vector(), yv = y.to_vector();
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_DOUBLE_EQ(gx[i], yv[i] + 2 * xv[i]);
    EXPECT_DOUBLE_EQ(gy[i], xv[i]);
  }
}

TEST(Autograd, LeafGradsAccumulateAcrossBackwards) {
  Tensor x = rnd({3}, 3).requires_grad_();
  backward(sum(mul(x, x)));
  backward(sum(mul(x, x)));
  const auto g = x.grad().to_vector(), xv = x.to_vector();
  for (size_t i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(g[i], 4 * xv[i]);
  x.zero_grad();
  EXPECT_FALSE(x.grad().defined());
}

TEST(Autograd, NoGradRecordsNothing) {
  autograd::clear_tape();
  Tensor x = rnd({4}, 4).requires_grad_();
  {
    NoGradGuard no_grad;
    Tensor y = tanh_op(mul(x, x));
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(autograd::tape_size(), 0u);
  }
  Tensor y = tanh_op(x);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_EQ(autograd::tape_size(), 1u);
  autograd::clear_tape();
  // Inputs that do not require grad record nothing either.
  Tensor z = tanh_op(rnd({4}, 5));
  EXPECT_FALSE(z.requires_grad());
  EXPECT_EQ(autograd::tape_size(), 0u);
}

TEST(Autograd, BackwardTwiceThrowsAndSavedTensorsAreFreed) {
  autograd::clear_tape();
  const size_t before = autograd::saved_bytes();
  Tensor x = rnd({64}, 6).requires_grad_();
  Tensor L = sum(tanh_op(mul(x, x)));
  EXPECT_GT(autograd::saved_bytes(), before);
  backward(L);
  EXPECT_EQ(autograd::saved_bytes(), before);
  EXPECT_THROW(backward(L), Error);
}

TEST(Autograd, RootWithoutGradThrows) {
  Tensor x = rnd({2}, 7);
  EXPECT_THROW(backward(sum(x)), Error);
  Tensor y = rnd({2}, 8).requires_grad_();
  Tensor v = mul(y, y);
  EXPECT_THROW(backward(v), Error);  // not a scalar and no gradient given
  autograd::clear_tape();
}

TEST(Autograd, LeafGradientsNeverAlias) {
  Tensor a = rnd({3}, 9).requires_grad_();
  Tensor b = rnd({3}, 10).requires_grad_();
  backward(sum(add_same_grad(a, b)));
  ASSERT_TRUE(a.grad().defined() && b.grad().defined());
  EXPECT_NE(a.grad().data(), b.grad().data());
  Tensor ga = a.grad();
  ga.fill_(5.0);  // an in-place all-reduce of one must not touch the other
  EXPECT_EQ(b.grad().to_vector()[0], 1.0);
}

TEST(Autograd, ReshapeIsDifferentiableAndSharesStorage) {
  Tensor x = rnd({2, 3}, 11).requires_grad_();
  Tensor y = x.reshape({6});
  EXPECT_EQ(y.data(), x.data());
  backward(sum(mul(y, y)));
  EXPECT_EQ(x.grad().shape(), (Shape{2, 3}));
  const auto g = x.grad().to_vector(), xv = x.to_vector();
  for (size_t i = 0; i < 6; ++i) EXPECT_DOUBLE_EQ(g[i], 2 * xv[i]);
  EXPECT_THROW(x.reshape({4}), Error);
}

TEST(Autograd, LongChainIsIterative) {
  Tensor x = Tensor::full({1}, 0.5, DType::f64).requires_grad_();
  Tensor y = x;
  for (int i = 0; i < 20000; ++i) y = tanh_op(y);
  backward(y);
  EXPECT_TRUE(std::isfinite(x.grad().item()));
  EXPECT_GT(x.grad().item(), 0.0);
}

std::vector<Tensor> block(const std::vector<Tensor>& in) {
  Tensor h = tanh_op(mul(in[0], in[1]));
  h = tanh_op(mul(h, in[0]));
  return {mul(h, h), tanh_op(h)};
}

TEST(Autograd, CheckpointGivesBitwiseIdenticalGradsWithFewerSavedBytes) {
  autograd::clear_tape();
  const size_t base = autograd::saved_bytes();
  Tensor grads[2][2];
  size_t saved[2];
  for (int ck = 0; ck < 2; ++ck) {
    Tensor x = rnd({256}, 12).requires_grad_();
    Tensor w = rnd({256}, 13).requires_grad_();
    auto outs = autograd::checkpoint(block, {x, w}, ck ? Checkpoint::on : Checkpoint::off);
    saved[ck] = autograd::saved_bytes() - base;
    Tensor L = add_same_grad(sum(mul(outs[0], outs[1])), sum(outs[1]));
    backward(L);
    grads[ck][0] = x.grad();
    grads[ck][1] = w.grad();
  }
  EXPECT_TRUE(test::bitwise_equal(grads[0][0], grads[1][0]));
  EXPECT_TRUE(test::bitwise_equal(grads[0][1], grads[1][1]));
  EXPECT_LT(saved[1], saved[0]);
  EXPECT_EQ(saved[1], 2u * 256 * sizeof(double));  // only the two inputs
  EXPECT_EQ(autograd::saved_bytes(), base);
}

TEST(Autograd, CheckpointAutoFollowsGradMode) {
  Tensor x = rnd({4}, 14).requires_grad_();
  EXPECT_TRUE(autograd::resolve_checkpoint(Checkpoint::automatic, {x}));
  EXPECT_FALSE(autograd::resolve_checkpoint(Checkpoint::automatic, {x.detach()}));
  {
    NoGradGuard no_grad;
    EXPECT_FALSE(autograd::resolve_checkpoint(Checkpoint::automatic, {x}));
  }
  EXPECT_TRUE(autograd::resolve_checkpoint(Checkpoint::on, {x.detach()}));
  EXPECT_FALSE(autograd::resolve_checkpoint(Checkpoint::off, {x}));
}

TEST(Autograd, CheckpointOnlyGradsForInputsThatRequireIt) {
  Tensor x = rnd({8}, 15).requires_grad_();
  Tensor w = rnd({8}, 16);  // constant
  auto outs = autograd::checkpoint(block, {x, w}, Checkpoint::on);
  backward(sum(outs[0]));
  EXPECT_TRUE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());
}

TEST(Autograd, CheckpointLayerTellsTheRecompute) {
  std::vector<bool> calls;
  const autograd::RecomputeFunction fn = [&calls](const std::vector<Tensor>& in, bool recompute) {
    calls.push_back(recompute);
    return block(in);
  };
  Tensor x = rnd({8}, 19).requires_grad_();
  Tensor w = rnd({8}, 20).requires_grad_();
  auto outs = autograd::checkpoint_layer(fn, {x, w}, Checkpoint::on);
  backward(sum(mul(outs[0], outs[1])));
  EXPECT_EQ(calls, (std::vector<bool>{false, true}));
  // Off: one run, not a recompute.
  calls.clear();
  autograd::checkpoint_layer(fn, {x, w}, Checkpoint::off);
  EXPECT_EQ(calls, (std::vector<bool>{false}));
  autograd::clear_tape();
}

TEST(AutogradGradcheck, TestOpsAgainstCentralDifferences) {
  auto fn = [](const std::vector<Tensor>& in) { return block(in); };
  Tensor x = rnd({6}, 17).requires_grad_();
  Tensor w = rnd({6}, 18).requires_grad_();
  auto r = test::gradcheck(fn, {x, w});
  EXPECT_LE(r.max_rel_error, 1e-8) << r.report;
  auto fn_ck = [](const std::vector<Tensor>& in) { return autograd::checkpoint(block, in, Checkpoint::on); };
  auto r2 = test::gradcheck(fn_ck, {x, w});
  EXPECT_LE(r2.max_rel_error, 1e-8) << r2.report;
}

}  // namespace
}  // namespace gdncp
