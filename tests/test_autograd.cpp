// Tests of the tape engine and checkpointing with small ops defined here
// (elementwise product, sum, tanh) so that the engine is tested on its own.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>

#include "autograd/tensor_internals.h"
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

// --- shape-only recompute outputs (Note [checkpoint recompute], Note [shape-only tensors]) ---

// A "fused layer" for checkpoint_layer: out = tanh(x·w) in one node that saves
// x and w (not its output). Its recompute returns out shape-only.
class FusedNode : public Node {
 public:
  explicit FusedNode(std::shared_ptr<int> backward_calls) : calls_(std::move(backward_calls)) {}
  const char* name() const override { return "test_fused"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    ++*calls_;
    const Tensor y = map2(saved(0), saved(1), [](double u, double v) { return std::tanh(u * v); });
    const Tensor gz = map2(g[0], y, [](double gy, double t) { return gy * (1 - t * t); });
    return {map2(gz, saved(1), [](double u, double v) { return u * v; }),
            map2(gz, saved(0), [](double u, double v) { return u * v; })};
  }

 private:
  std::shared_ptr<int> calls_;
};

Tensor fused(const std::vector<Tensor>& in, bool recompute, const std::shared_ptr<int>& calls) {
  const Tensor &x = in[0], &w = in[1];
  const Tensor out = recompute ? detail::shape_only(x.shape(), DType::f64, Device::cpu)
                               : map2(x, w, [](double u, double v) { return std::tanh(u * v); });
  auto node = std::make_shared<FusedNode>(calls);
  if (autograd::should_record({x, w})) {
    node->save(x);
    node->save(w);
  }
  autograd::record(node, {x, w}, {out});
  return out;
}

template <typename Fn>
std::string error_of(const Fn& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no gdncp::Error thrown)";
}

TEST(ShapeOnly, HasNoStorageAndEveryReadThrows) {
  // 8 TiB of f64: making it must not allocate.
  const int64_t n = int64_t(1) << 40;
  const size_t made = detail::TensorInternals::shape_only_made();
  Tensor t = detail::shape_only({n}, DType::f64, Device::cpu);
  EXPECT_EQ(detail::TensorInternals::shape_only_made(), made + 1);
  EXPECT_TRUE(detail::is_shape_only(t));
  EXPECT_EQ(t.numel(), n);
  EXPECT_EQ(t.dtype(), DType::f64);
  EXPECT_EQ(t.device(), Device::cpu);
  EXPECT_NE(t.str().find("shape-only"), std::string::npos) << t.str();
  EXPECT_NE(error_of([&] { t.data(); }).find("no storage"), std::string::npos) << error_of([&] { t.data(); });
  EXPECT_THROW(t.data_ptr<double>(), Error);
  EXPECT_THROW(t.fill_(1.0), Error);
  // Small ones for the copies (a large copy would fail allocating its destination first).
  Tensor s = detail::shape_only({2, 3}, DType::f32, Device::cpu);
  const Tensor c = s;
  EXPECT_THROW(c.data(), Error);
  EXPECT_THROW(s.to_vector(), Error);
  EXPECT_THROW(s.clone(), Error);
  EXPECT_THROW(s.to(DType::f64), Error);
  Tensor dst = Tensor::zeros({2, 3}, DType::f32);
  EXPECT_THROW(dst.copy_from(s), Error);
  EXPECT_THROW(s.copy_from(dst), Error);
  // Views stay shape-only; ordinary and empty tensors are not.
  EXPECT_TRUE(detail::is_shape_only(s.reshape({6})));
  EXPECT_TRUE(detail::is_shape_only(s.detach()));
  EXPECT_FALSE(detail::is_shape_only(dst));
  EXPECT_FALSE(detail::is_shape_only(Tensor::empty({0, 3}, DType::f32)));
  EXPECT_FALSE(detail::is_shape_only(Tensor()));
}

TEST(ShapeOnly, CannotBeSavedForBackward) {
  auto node = std::make_shared<MulNode>();
  EXPECT_NE(error_of([&] { node->save(detail::shape_only({4}, DType::f64, Device::cpu)); }).find("test_mul: save()"),
            std::string::npos);
}

TEST(Autograd, CheckpointLayerRecomputeReturnsShapeOnlyOutputs) {
  autograd::clear_tape();
  const size_t base = autograd::saved_bytes();
  auto calls = std::make_shared<int>(0);
  Tensor recomputed;  // what the recompute returned, kept to try reading it afterwards
  const autograd::RecomputeFunction fn = [&](const std::vector<Tensor>& in, bool recompute) {
    Tensor out = fused(in, recompute, calls);
    if (recompute) recomputed = out;
    return std::vector<Tensor>{out};
  };
  Tensor grads[2][2], outs[2];
  for (int ck = 0; ck < 2; ++ck) {
    Tensor x = rnd({64}, 30).requires_grad_();
    Tensor w = rnd({64}, 31).requires_grad_();
    const size_t made = detail::TensorInternals::shape_only_made();
    outs[ck] = autograd::checkpoint_layer(fn, {x, w}, ck ? Checkpoint::on : Checkpoint::off).at(0);
    backward(sum(mul(outs[ck], outs[ck])));
    EXPECT_EQ(detail::TensorInternals::shape_only_made(), made + static_cast<size_t>(ck));
    grads[ck][0] = x.grad();
    grads[ck][1] = w.grad();
  }
  EXPECT_EQ(*calls, 2);  // the fused node's backward ran once per run
  EXPECT_TRUE(test::bitwise_equal(outs[0], outs[1]));
  EXPECT_TRUE(test::bitwise_equal(grads[0][0], grads[1][0]));
  EXPECT_TRUE(test::bitwise_equal(grads[0][1], grads[1][1]));
  ASSERT_TRUE(recomputed.defined());
  EXPECT_TRUE(detail::is_shape_only(recomputed));
  EXPECT_THROW(recomputed.to_vector(), Error);
  EXPECT_EQ(autograd::saved_bytes(), base);
}

TEST(Autograd, CheckpointLayerMisuseOfShapeOnlyOutputsThrows) {
  autograd::clear_tape();
  auto calls = std::make_shared<int>(0);
  Tensor x = rnd({8}, 32).requires_grad_();
  Tensor w = rnd({8}, 33).requires_grad_();
  // The first run may not return a shape-only output, checkpointed or not.
  const autograd::RecomputeFunction always = [&](const std::vector<Tensor>& in, bool) {
    return std::vector<Tensor>{fused(in, /*recompute=*/true, calls)};
  };
  for (const Checkpoint ck : {Checkpoint::on, Checkpoint::off})
    EXPECT_NE(error_of([&] {
                autograd::checkpoint_layer(always, {x, w}, ck);
              }).find("of the first run is shape-only"),
              std::string::npos);
  autograd::clear_tape();
  // A recompute that reads its shape-only output (here: an op on top of it) throws in backward.
  const autograd::RecomputeFunction reads = [&](const std::vector<Tensor>& in, bool recompute) {
    return std::vector<Tensor>{tanh_op(fused(in, recompute, calls))};
  };
  Tensor out = autograd::checkpoint_layer(reads, {x, w}, Checkpoint::on).at(0);
  EXPECT_NE(error_of([&] { backward(sum(out)); }).find("no storage"), std::string::npos);
  autograd::clear_tape();
}

TEST(Autograd, CheckpointLetsGoOfItsFunctionBeforeTheSubBackward) {
  autograd::clear_tape();
  auto kept = std::make_shared<int>(7);  // stands for what a layer's closure keeps for its recompute
  std::weak_ptr<int> watch = kept;
  auto calls = std::make_shared<int>(0);
  bool alive_in_sub_backward = true;
  class Probe : public Node {  // records whether the closure's state was still alive when its backward ran
   public:
    Probe(std::weak_ptr<int> w, bool* alive) : w_(std::move(w)), alive_(alive) {}
    const char* name() const override { return "test_probe"; }
    std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
      *alive_ = !w_.expired();
      return {g[0].clone()};
    }

   private:
    std::weak_ptr<int> w_;
    bool* alive_;
  };
  Tensor x = rnd({8}, 34).requires_grad_();
  Tensor w = rnd({8}, 35).requires_grad_();
  Tensor out;
  {
    const autograd::RecomputeFunction fn = [kept, calls, watch, &alive_in_sub_backward](const std::vector<Tensor>& in,
                                                                                        bool) {
      Tensor y = fused(in, false, calls);
      Tensor o = y.detach().clone();
      autograd::record(std::make_shared<Probe>(watch, &alive_in_sub_backward), {y}, {o});
      return std::vector<Tensor>{o};
    };
    out = autograd::checkpoint_layer(fn, {x, w}, Checkpoint::on).at(0);
  }
  kept.reset();
  EXPECT_FALSE(watch.expired());  // the checkpoint node holds fn until its backward
  backward(sum(out));
  EXPECT_FALSE(alive_in_sub_backward);
  EXPECT_TRUE(watch.expired());
  EXPECT_TRUE(x.grad().defined());
  autograd::clear_tape();
}

TEST(AutogradGradcheck, TestOpsAgainstCentralDifferences) {
  auto fn = [](const std::vector<Tensor>& in) { return block(in); };
  Tensor x = rnd({6}, 17).requires_grad_();
  Tensor w = rnd({6}, 18).requires_grad_();
  auto r = test::gradcheck(fn, {x, w});
  EXPECT_LE(r.max_rel_error, test::tol::gradcheck) << r.report;
  auto fn_ck = [](const std::vector<Tensor>& in) { return autograd::checkpoint(block, in, Checkpoint::on); };
  auto r2 = test::gradcheck(fn_ck, {x, w});
  EXPECT_LE(r2.max_rel_error, test::tol::gradcheck) << r2.report;
}

}  // namespace
}  // namespace gdncp
