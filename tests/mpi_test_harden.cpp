// tests/mpi_test_harden.cpp — misuses of the CP entries a trainer can make, on
// every rank: a communicator released between forward and backward (the
// graph keeps it alive), a communicator not owned by a shared_ptr, a bad
// timeout, and sizes whose products overflow int64.
// gdncp-mpi-np: 1 2 3
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {
namespace {

constexpr int64_t kF = 2, kS = 3;

std::vector<Tensor> leaves_of(const LayerInputs& in) {
  return {leaf(in.qkv), leaf(in.beta), leaf(in.decay), leaf(in.q_norm_w), leaf(in.k_norm_w), in.rope_cos, in.rope_sin};
}

// This rank's block of a seeded global layer input.
LayerInputs local_inputs(uint64_t seed, Checkpoint ck) {
  const LayerInputs g = make_layer_inputs(dims(1, 2, 6, kF * nranks(), kS), DType::f64, seed);
  LayerInputs l = local_block(g, kF, rank());
  l.opt.checkpoint = ck;
  return l;
}

struct Run {
  Tensor out;
  std::vector<Tensor> grads;
};

// bigdn_cp forward over comm, then backward with weights w (after comm may be gone).
Run backward_of(const std::vector<Tensor>& x, const Tensor& out, const Tensor& w) {
  backward(out, w);
  Run r{out, {}};
  for (size_t k = 0; k < 5; ++k) r.grads.push_back(x[k].grad());
  return r;
}

void expect_same(const Run& a, const Run& b) {
  EXPECT_TRUE(bitwise_equal(a.out, b.out)) << "rank " << rank() << ": out";
  for (size_t k = 0; k < a.grads.size(); ++k)
    EXPECT_TRUE(bitwise_equal(a.grads[k], b.grads[k])) << "rank " << rank() << ": gradient " << k;
}

// --- lifetime ------------------------------------------------------------------------------------

// The communicator's last owner lets it go between forward and backward: the
// layer's node shares its ownership, so backward runs its collectives on a
// live communicator and gives the gradients of a run whose caller kept it.
void check_released_between_forward_and_backward(Checkpoint ck) {
  const LayerInputs l = local_inputs(700, ck);
  const Tensor w = Tensor::randn({1, kF * kS, 2, 6}, DType::f64, Device::cpu, 750 + rank());

  const std::vector<Tensor> xa = leaves_of(l);
  const Tensor out_a = cp::bigdn_cp(*world(), xa[0], xa[1], xa[2], xa[3], xa[4], xa[5], xa[6], kF, kS, l.opt);
  const Run kept = backward_of(xa, out_a, w);

  const std::vector<Tensor> xb = leaves_of(l);
  Tensor out_b;
  std::weak_ptr<cp::Communicator> watch;
  {
    auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
    watch = c;
    out_b = cp::bigdn_cp(*c, xb[0], xb[1], xb[2], xb[3], xb[4], xb[5], xb[6], kF, kS, l.opt);
  }
  EXPECT_FALSE(watch.expired()) << "the graph does not hold the communicator";
  const Run released = backward_of(xb, out_b, w);
  expect_same(kept, released);
}

TEST(HardenLifetime, LayerCommunicatorReleasedBeforeBackward) {
  check_released_between_forward_and_backward(Checkpoint::off);
}
TEST(HardenLifetime, CheckpointedLayerCommunicatorReleasedBeforeBackward) {
  check_released_between_forward_and_backward(Checkpoint::on);
}

TEST(HardenLifetime, ScanCommunicatorReleasedBeforeBackward) {
  const int64_t BH = 2, F = 2, D = 4;
  const uint64_t s = 800 + static_cast<uint64_t>(rank());
  auto make = [&](const Shape& shape, uint64_t k, double lo, double hi) {
    return leaf(Tensor::uniform(shape, DType::f64, Device::cpu, s + 10 * k, lo, hi));
  };
  const std::vector<Tensor> in0 = {make({BH, F, D, D}, 1, -0.1, 0.1), make({BH, F, D, D}, 2, -1, 1),
                                   make({BH, F, D, D}, 3, -0.1, 0.1), make({BH, F, D}, 4, -1, 1),
                                   make({1, 2, F}, 5, 0.5, 0.95)};
  std::vector<Tensor> grads[2];
  Tensor M[2];
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<Tensor> x;
    for (const Tensor& t : in0) x.push_back(leaf(t.detach()));
    cp::ScanResult r;
    if (pass == 0) {
      r = cp::cp_scan(*world(), x[0], x[1], x[2], x[3], x[4]);
    } else {
      auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
      r = cp::cp_scan(*c, x[0], x[1], x[2], x[3], x[4]);
    }
    backward({r.M, r.z}, {Tensor::full(r.M.shape(), 1.0, DType::f64), Tensor::full(r.z.shape(), 0.5, DType::f64)});
    M[pass] = r.M;
    for (const Tensor& t : x) grads[pass].push_back(t.grad());
  }
  EXPECT_TRUE(bitwise_equal(M[0], M[1])) << "rank " << rank();
  for (size_t k = 0; k < grads[0].size(); ++k)
    EXPECT_TRUE(bitwise_equal(grads[0][k], grads[1][k])) << "rank " << rank() << ": gradient " << k;
}

// A communicator the library cannot share (not owned by a std::shared_ptr):
// forwards every call to the world communicator.
class Unowned final : public cp::Communicator {
 public:
  int rank() const override { return world()->rank(); }
  int size() const override { return world()->size(); }
  Device device() const override { return world()->device(); }
  void all_gather(Tensor& out, const Tensor& in) override { world()->all_gather(out, in); }
  void all_reduce_sum(Tensor& t) override { world()->all_reduce_sum(t); }
  void broadcast(Tensor& t, int root) override { world()->broadcast(t, root); }
  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    world()->send_recv(send, dst, recv, src);
  }
  void barrier() override { world()->barrier(); }
  void all_gather_host(void* out, const void* in, size_t bytes) override { world()->all_gather_host(out, in, bytes); }
  bool aborted() const override { return world()->aborted(); }
  const char* backend() const override { return world()->backend(); }
};

TEST(HardenLifetime, UnownedCommunicatorIsAnErrorWhenBackwardNeedsIt) {
  for (Checkpoint ck : {Checkpoint::off, Checkpoint::on}) {
    const LayerInputs l = local_inputs(900, ck);
    Unowned comm;
    const std::vector<Tensor> x = leaves_of(l);
    expect_all_throw([&] { cp::bigdn_cp(comm, x[0], x[1], x[2], x[3], x[4], x[5], x[6], kF, kS, l.opt); },
                     "bigdn_cp: comm: is not owned by a std::shared_ptr");
    autograd::clear_tape();
    // Without a graph nothing outlives the call: it runs.
    NoGradGuard no_grad;
    const Tensor out = cp::bigdn_cp(comm, x[0], x[1], x[2], x[3], x[4], x[5], x[6], kF, kS, l.opt);
    EXPECT_EQ(out.shape(), (Shape{1, kF * kS, 2, 6}));
  }
}

// --- options -------------------------------------------------------------------------------------

TEST(HardenOptions, TimeoutMustBeFiniteAndPositive) {
  const double before = world()->timeout_seconds();
  for (double t : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    expect_all_throw([&] { world()->set_timeout_seconds(t); }, "timeout_seconds: must be finite and > 0");
    EXPECT_EQ(world()->timeout_seconds(), before) << "a rejected timeout was kept: " << t;
  }
  // The communicator still works.
  Tensor x = Tensor::full({3}, 1.0, DType::f64);
  world()->all_reduce_sum(x);
  EXPECT_EQ(x.to_vector()[0], static_cast<double>(nranks()));
}

void expect_layer_option_rejected(const std::function<void(BigdnOptions&)>& set, const std::string& arg, bool all) {
  LayerInputs l = local_inputs(950, Checkpoint::off);
  if (all || rank() == 0) set(l.opt);
  const std::vector<Tensor> x = leaves_of(l);
  expect_all_throw([&] { cp::bigdn_cp(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], kF, kS, l.opt); },
                   "bigdn_cp: " + arg + ":", "bad argument on rank 0");
  autograd::clear_tape();
}

TEST(HardenOptions, EpsZeroOnEveryRank) {
  expect_layer_option_rejected([](BigdnOptions& o) { o.eps = 0; }, "eps", true);
}
TEST(HardenOptions, NormEpsNegativeOnRankZero) {
  expect_layer_option_rejected([](BigdnOptions& o) { o.norm_eps = -1; }, "norm_eps", false);
}
TEST(HardenOptions, KScaleNaNOnEveryRank) {
  expect_layer_option_rejected([](BigdnOptions& o) { o.k_scale = std::nan(""); }, "k_scale", true);
}
TEST(HardenOptions, NormEpsInfiniteOnRankZero) {
  expect_layer_option_rejected([](BigdnOptions& o) { o.norm_eps = HUGE_VAL; }, "norm_eps", false);
}

// --- sizes ---------------------------------------------------------------------------------------

TEST(HardenSizes, HugeFramesOnEveryRank) {
  const LayerInputs l = local_inputs(960, Checkpoint::off);
  const std::vector<Tensor> x = leaves_of(l);
  expect_all_throw([&] { cp::bigdn_cp(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], int64_t(1) << 62, kS, l.opt); },
                   "bigdn_cp: F·S: ");
  autograd::clear_tape();
}

TEST(HardenSizes, HugeTokensOnRankZeroOnly) {
  const LayerInputs l = local_inputs(970, Checkpoint::off);
  const std::vector<Tensor> x = leaves_of(l);
  const int64_t S = rank() == 0 ? int64_t(1) << 62 : kS;
  expect_all_throw([&] { cp::cp_gdn_raw(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], kF, S, l.opt); },
                   "cp_gdn_raw: F·S: ", "bad argument on rank 0");
  autograd::clear_tape();
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
