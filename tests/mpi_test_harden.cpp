// tests/mpi_test_harden.cpp — misuses of the CP entries a trainer can make, on
// every rank: a communicator released between forward and backward (the
// graph keeps it alive), a communicator not owned by a shared_ptr, a bad
// timeout, and sizes whose products overflow int64; ownership that changes
// between steps on any rank under every validation policy (== one rank over
// the whole sequence); sizes that differ between ranks, a bad argument on one
// rank in a steady state and a bad collective argument on one rank (an error
// on every rank at once, the communicator still usable); clip masks with
// values other than 0 and 1.
// gdncp-mpi-np: 1 2 3
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "capi/dlpack.h"
#include "gdncp/gdncp_c.h"
#include "kernels/common/clip_guard.h"
#include "mpi_cp_fixtures.h"
#include "util/tolerance.h"

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
  expect_all_throw(
      [&] { cp::bigdn_cp(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], int64_t(1) << 62, kS, l.opt); },
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

// --- ownership that changes between steps --------------------------------------------------------

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Frames [lo, hi) of global layer inputs.
LayerInputs frames_of(const LayerInputs& g, int64_t lo, int64_t hi) {
  LayerInputs l = g;
  const int64_t S = g.d.S;
  l.d.F = hi - lo;
  l.qkv = slice(g.qkv, 1, lo * S, hi * S);
  l.beta = slice(g.beta, 2, lo, hi);
  l.decay = slice(g.decay, 2, lo, hi);
  l.rope_cos = slice(g.rope_cos, 0, lo * S, hi * S);
  l.rope_sin = slice(g.rope_sin, 0, lo * S, hi * S);
  return l;
}

// Rank r's frames at step k: the balanced split of 21, 22, 21, 30 frames (one
// rank's F changes at a time: 11 + 10, 11 + 11 on two ranks), then rank 0
// empty, then a split that moves most frames to the last rank.
int64_t frames_at(int step, int r, int P, int64_t* total) {
  const int64_t totals[] = {21, 22, 21, 30, 9, 26};
  const int64_t Ft = totals[step];
  *total = Ft;
  if (step == 4 && P > 1) return r == 0 ? 0 : cp::balanced_split(Ft, P - 1, r - 1).frames;
  if (step == 5 && P > 1) return r == P - 1 ? Ft - 2 * (P - 1) : 2;
  return cp::balanced_split(Ft, P, r).frames;
}
constexpr int kSteps = 6;

// bigdn_cp of this rank's frames == bigdn over the whole sequence (forward,
// and the gradients of qkv, beta, decay), step after step with the split
// changing under policy v. Returns the validations counted after step 0.
int64_t run_changing_split(cp::Validation v) {
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_validation(v);
  c->set_timeout_seconds(60);
  const int P = nranks(), r = rank();
  int64_t validations = 0;
  for (int step = 0; step < kSteps; ++step) {
    int64_t Ft = 0;
    const int64_t F = frames_at(step, r, P, &Ft);
    int64_t lo = 0;
    for (int j = 0; j < r; ++j) lo += frames_at(step, j, P, &Ft);
    const LayerInputs g = make_layer_inputs(dims(1, 2, 8, Ft, 2), DType::f64, 1000 + static_cast<uint64_t>(step));
    const Tensor w = Tensor::randn({1, Ft * 2, 2, 8}, DType::f64, Device::cpu, 1100 + static_cast<uint64_t>(step));
    // The reference: one rank over the whole sequence.
    const std::vector<Tensor> xg = {leaf(g.qkv), leaf(g.beta), leaf(g.decay)};
    const Tensor ref = bigdn(xg[0], xg[1], xg[2], g.q_norm_w, g.k_norm_w, g.rope_cos, g.rope_sin, Ft, 2, g.opt);
    backward(ref, w);
    // This rank's frames.
    const LayerInputs l = frames_of(g, lo, lo + F);
    const std::vector<Tensor> x = {leaf(l.qkv), leaf(l.beta), leaf(l.decay)};
    if (step > 0) c->reset_stats();
    const Tensor out = cp::bigdn_cp(*c, x[0], x[1], x[2], l.q_norm_w, l.k_norm_w, l.rope_cos, l.rope_sin, F, 2, l.opt);
    backward(out, slice(w, 1, lo * 2, (lo + F) * 2));
    const std::string at = "rank " + std::to_string(r) + " step " + std::to_string(step) +
                           " (F = " + std::to_string(F) + " of " + std::to_string(Ft) + ", " + cp::validation_name(v) +
                           ")";
    EXPECT_TRUE(close_rel(out, slice(ref, 1, lo * 2, (lo + F) * 2), tol::f64, at + ": out")) << at;
    EXPECT_TRUE(close_rel(x[0].grad(), slice(xg[0].grad(), 1, lo * 2, (lo + F) * 2), tol::f64, at + ": dqkv"));
    EXPECT_TRUE(close_rel(x[1].grad(), slice(xg[1].grad(), 2, lo, lo + F), tol::f64, at + ": dbeta"));
    EXPECT_TRUE(close_rel(x[2].grad(), slice(xg[2].grad(), 2, lo, lo + F), tol::f64, at + ": ddecay"));
    if (step > 0) {
      validations += c->stats().validations;
      if (v != cp::Validation::every_call) {
        EXPECT_EQ(c->stats().host_waits, 0) << at;
      }
    }
  }
  EXPECT_FALSE(c->aborted()) << c->abort_reason();
  return validations;
}

TEST(HardenOwnership, SplitChangesEveryStepUnderEveryCall) {
  EXPECT_EQ(run_changing_split(cp::Validation::every_call), kSteps - 1);
}
TEST(HardenOwnership, SplitChangesEveryStepUnderOnChange) {
  EXPECT_EQ(run_changing_split(cp::Validation::on_change), 0) << "a change of F alone validates nothing";
}
TEST(HardenOwnership, SplitChangesEveryStepUnderOff) { EXPECT_EQ(run_changing_split(cp::Validation::off), 0); }

// truncate_to_active places its frozen frames from every rank's F: the split
// may change too, and the terminal state is the one rank's.
TEST(HardenOwnership, TruncatedScanWithChangingSplit) {
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_validation(cp::Validation::on_change);
  const int P = nranks(), r = rank();
  cp::CpOptions o;
  o.truncate_to_active = 13;
  for (int step = 0; step < 4; ++step) {
    int64_t Ft = 0;
    const int64_t F = frames_at(step, r, P, &Ft);
    int64_t lo = 0;
    for (int j = 0; j < r; ++j) lo += frames_at(step, j, P, &Ft);
    const LayerInputs g = make_layer_inputs(dims(1, 2, 6, Ft, 2), DType::f64, 1200 + static_cast<uint64_t>(step));
    const cp::RawResult ref = cp::cp_gdn_raw(*self(), g.qkv, g.beta, g.decay, g.q_norm_w, g.k_norm_w, g.rope_cos,
                                             g.rope_sin, Ft, 2, g.opt, o);
    const LayerInputs l = frames_of(g, lo, lo + F);
    const cp::RawResult got =
        cp::cp_gdn_raw(*c, l.qkv, l.beta, l.decay, l.q_norm_w, l.k_norm_w, l.rope_cos, l.rope_sin, F, 2, l.opt, o);
    const std::string at = "rank " + std::to_string(r) + " step " + std::to_string(step);
    EXPECT_TRUE(close_rel(got.num, slice(ref.num, 1, lo * 2, (lo + F) * 2), tol::f64, at + ": num"));
    EXPECT_TRUE(close_rel(got.terminal_M, ref.terminal_M, tol::f64, at + ": terminal_M"));
    EXPECT_TRUE(close_rel(got.terminal_z, ref.terminal_z, tol::f64, at + ": terminal_z"));
  }
}

// --- disagreements: an error on every rank at once, the communicator usable ------------------------

// One layer step of this rank's block of a global input of D, S.
Tensor block_step(cp::Communicator& c, int64_t D, int64_t S, bool bad_beta = false) {
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, D, 2 * nranks(), S), DType::f64, 1300), 2, rank());
  const Tensor beta = bad_beta ? Tensor::zeros({3}, DType::f64) : l.beta;
  NoGradGuard no_grad;
  return cp::bigdn_cp(c, l.qkv, beta, l.decay, l.q_norm_w, l.k_norm_w, l.rope_cos, l.rope_sin, 2, S, l.opt);
}

void expect_all_raise_at_once(const std::function<void()>& fn, const std::vector<std::string>& what) {
  const auto t0 = Clock::now();
  try {
    fn();
    ADD_FAILURE() << "rank " << rank() << ": no error";
  } catch (const Error& e) {
    bool found = false;
    for (const std::string& s : what) found |= std::string(e.what()).find(s) != std::string::npos;
    EXPECT_TRUE(found) << "rank " << rank() << ": unexpected message: " << e.what();
  }
  EXPECT_LT(since(t0), 1.0) << "rank " << rank() << " raised too late";
}

// The last rank's D differs (a small and a large difference: the larger
// composites exceed MPI's eager limit) in a steady state, under every policy.
TEST(HardenMismatch, HeadDimDiffersOnOneRankUnderEveryPolicy) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  for (cp::Validation v : {cp::Validation::every_call, cp::Validation::on_change, cp::Validation::off})
    for (int64_t D_bad : {6, 48}) {
      auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
      c->set_validation(v);
      c->set_timeout_seconds(30);
      const Tensor ref = block_step(*c, 4, 2);
      const bool odd = rank() == nranks() - 1;
      expect_all_raise_at_once([&] { block_step(*c, odd ? D_bad : 4, 2); },
                               {"D differs", "out of step", "bad argument on rank"});
      EXPECT_FALSE(c->aborted()) << c->abort_reason();
      EXPECT_TRUE(bitwise_equal(block_step(*c, 4, 2), ref)) << "rank " << rank() << ": the next call";
    }
}

TEST(HardenMismatch, BadArgumentOnOneRankInSteadyStateUnderEveryPolicy) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  for (cp::Validation v : {cp::Validation::every_call, cp::Validation::on_change, cp::Validation::off}) {
    auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
    c->set_validation(v);
    c->set_timeout_seconds(30);
    const Tensor ref = block_step(*c, 4, 2);
    block_step(*c, 4, 2);
    const bool bad = rank() == nranks() - 1;
    expect_all_raise_at_once([&] { block_step(*c, 4, 2, bad); },
                             {bad ? "beta" : "bad argument on rank", "out of step"});
    EXPECT_FALSE(c->aborted()) << c->abort_reason();
    EXPECT_TRUE(bitwise_equal(block_step(*c, 4, 2), ref)) << "rank " << rank() << ": the next call";
  }
}

// The communicator's own collectives: a bad argument on one rank reaches
// every rank at once; sizes or roots that differ are an error on every rank,
// never a truncation or an overflow of a receive buffer.
TEST(HardenComm, CollectiveArgumentErrorOnOneRankReachesEveryRank) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  const int last = nranks() - 1;
  Tensor in = Tensor::full({3}, 1.0, DType::f32);
  Tensor out = Tensor::zeros({nranks() * 3 + (rank() == last ? 1 : 0)}, DType::f32);
  expect_all_raise_at_once([&] { world()->all_gather(out, in); },
                           {rank() == last ? "all_gather: out has" : "bad argument on rank " + std::to_string(last)});
  Tensor undefined;
  Tensor t = Tensor::full({2}, 1.0, DType::f32);
  expect_all_raise_at_once([&] { world()->all_reduce_sum(rank() == last ? undefined : t); },
                           {rank() == last ? "all_reduce_sum: t is undefined" : "bad argument on rank"});
  expect_all_raise_at_once([&] { world()->broadcast(t, rank() == last ? nranks() : 0); },
                           {rank() == last ? "broadcast: root" : "bad argument on rank"});
  EXPECT_FALSE(world()->aborted());
  world()->all_reduce_sum(t);
  for (double x : t.to_vector()) EXPECT_EQ(x, nranks());
}

TEST(HardenComm, SizesThatDifferAreAnErrorOnEveryRank) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  for (int64_t n : {int64_t(16), int64_t(1) << 17}) {  // below and above the eager limit
    const int64_t mine = rank() == 0 ? n : 3;
    Tensor in = Tensor::full({mine}, 1.0, DType::f64);
    Tensor out = Tensor::zeros({nranks() * mine}, DType::f64);
    expect_all_raise_at_once([&] { world()->all_gather(out, in); }, {"out of step", "sizes of a call must agree"});
    Tensor sum = Tensor::full({mine}, 1.0, DType::f64);
    expect_all_raise_at_once([&] { world()->all_reduce_sum(sum); }, {"out of step"});
    expect_all_raise_at_once([&] { world()->broadcast(sum, 0); }, {"out of step"});
  }
  Tensor t = Tensor::full({4}, static_cast<double>(rank()), DType::f64);
  expect_all_raise_at_once([&] { world()->broadcast(t, rank() == 0 ? 1 : 0); }, {"disagree on the root"});
  if (nranks() == 2) {
    Tensor send = Tensor::full({rank() == 0 ? 4096 : 4}, 1.0, DType::f64), recv = Tensor::zeros({4}, DType::f64);
    // Each receives the other's message: rank 1's is too large for its receive.
    try {
      world()->send_recv(send, 1 - rank(), recv, 1 - rank());
      EXPECT_EQ(rank(), 0) << "rank 1 received a message larger than its receive tensor";
    } catch (const Error& e) {
      EXPECT_EQ(rank(), 1) << e.what();
      EXPECT_NE(std::string(e.what()).find("out of step"), std::string::npos) << e.what();
    }
  }
  EXPECT_FALSE(world()->aborted());
  Tensor ok = Tensor::full({5}, 2.0, DType::f64);
  world()->all_reduce_sum(ok);
  for (double x : ok.to_vector()) EXPECT_EQ(x, 2.0 * nranks());
}

// --- clip masks ----------------------------------------------------------------------------------

TEST(HardenClip, MaskValuesOtherThanZeroOrOneAreAnError) {
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, 4, 3 * nranks(), 2), DType::f64, 1400), 3, rank());
  for (float bad : {0.5f, 2.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<double> m(3, 0.0);
    if (rank() == 0) m[1] = bad;
    const Tensor mask = Tensor::from_vector(m, {1, 3}, DType::f32);
    const std::string what = "clip_starts: must hold 0 or 1";
    expect_all_throw(
        [&] {
          cp::bigdn_cp(*world(), l.qkv, l.beta, l.decay, l.q_norm_w, l.k_norm_w, l.rope_cos, l.rope_sin, 3, 2, l.opt,
                       mask);
        },
        rank() == 0 ? what : "bad argument on rank 0");
    const Tensor P = make_P(2, 3, 4, DType::f64, 1401), A = Tensor::randn({2, 3, 4, 4}, DType::f64, Device::cpu, 1402);
    const Tensor bz = Tensor::randn({2, 3, 4}, DType::f64, Device::cpu, 1403);
    const Tensor decay = Tensor::full({1, 2, 3}, 0.9, DType::f64);
    expect_all_throw([&] { cp::cp_bidi_scan(*world(), P, A, P, bz, decay, mask); },
                     rank() == 0 ? what : "bad argument on rank 0");
    if (rank() == 0) {
      EXPECT_THROW(bigdn(l.qkv, l.beta, l.decay, l.q_norm_w, l.k_norm_w, l.rope_cos, l.rope_sin, 3, 2, l.opt, mask),
                   Error);
    }
  }
  autograd::clear_tape();
}

// A fault of a device mask (Note [clip mask values]; here the CPU twin of the
// device check, driven directly on rank 0) is raised by the next CP call with
// a good mask on every rank at once, under the default policy in a steady
// state; the call after that runs.
TEST(HardenClip, DeviceCheckFaultReachesEveryRankAtNextCall) {
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, 4, 3 * nranks(), 2), DType::f64, 1450), 3, rank());
  const Tensor good = Tensor::from_vector({0.0, 1.0, 0.0}, {1, 3}, DType::f32);
  auto call = [&] {
    return cp::bigdn_cp(*world(), l.qkv, l.beta, l.decay, l.q_norm_w, l.k_norm_w, l.rope_cos, l.rope_sin, 3, 2, l.opt,
                        good);
  };
  const Tensor ref = call();  // validated: the next calls skip the exchange under on_change
  if (rank() == 0) {
    Tensor out = Tensor::zeros({4}, DType::f64);
    kernels::guard_clip_mask(Tensor::from_vector({0.0, 2.0, 0.0}, {1, 3}, DType::f32), {out});
    EXPECT_TRUE(std::isnan(out.to_vector()[0]));
  }
  expect_all_throw(call, rank() == 0 ? "clip_starts: must hold 0 or 1" : "bad argument on rank 0");
  EXPECT_FALSE(world()->aborted());
  EXPECT_TRUE(bitwise_equal(call(), ref)) << "rank " << rank();
  autograd::clear_tape();
}

// --- the C ABI: a call refused on one rank before its entry runs --------------------------------

// This rank's layer call through the door; the last rank's qkv misaligned when `bad`.
gdncp_status door_layer_call(gdncp_comm* comm, bool bad, DLManagedTensor** out) {
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, 4, 2 * nranks(), 2), DType::f64, 1500), 2, rank());
  DLManagedTensor* in[7];
  const std::vector<Tensor> x = l.list();
  for (size_t i = 0; i < 7; ++i) in[i] = gdncp::detail::to_dlpack(x[i]);
  if (bad) in[0]->dl_tensor.byte_offset = 4;
  return gdncp_bigdn_cp(comm, in[0], in[1], in[2], in[3], in[4], in[5], in[6], nullptr, nullptr, nullptr, 2, 2, nullptr,
                        nullptr, 0, out, nullptr);
}

TEST(HardenCApi, RefusedOnOneRankReachesEveryRankAtOnce) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  gdncp_comm* comm = nullptr;
  ASSERT_EQ(gdncp_comm_create_mpi_world(&comm), GDNCP_OK) << gdncp_last_error();
  ASSERT_EQ(gdncp_comm_set_timeout(comm, 30), GDNCP_OK);
  const bool bad = rank() == nranks() - 1;
  for (int round = 0; round < 2; ++round) {  // the second in a steady state (on_change skips the exchange)
    DLManagedTensor* out = nullptr;
    ASSERT_EQ(door_layer_call(comm, false, &out), GDNCP_OK) << gdncp_last_error();
    out->deleter(out);
    const auto t0 = Clock::now();
    const gdncp_status st = door_layer_call(comm, bad, &out);
    const std::string msg = gdncp_last_error();
    EXPECT_LT(since(t0), 1.0) << "rank " << rank() << " raised too late";
    if (bad) {
      EXPECT_EQ(st, GDNCP_ERROR_ARGUMENT) << msg;
      EXPECT_NE(msg.find("qkv"), std::string::npos) << msg;
      EXPECT_NE(msg.find("aligned"), std::string::npos) << msg;
    } else {
      EXPECT_EQ(st, GDNCP_ERROR) << msg;
      EXPECT_TRUE(msg.find("bad argument on rank " + std::to_string(nranks() - 1)) != std::string::npos ||
                  msg.find("out of step") != std::string::npos)
          << "rank " << rank() << ": " << msg;
    }
  }
  // The collective of the door: a tensor it refuses on one rank.
  Tensor t = Tensor::full({3}, 1.0, DType::f32);
  DLManagedTensor* m = gdncp::detail::to_dlpack(t);
  if (bad) m->dl_tensor.dtype.code = kDLInt;
  const auto t0 = Clock::now();
  const gdncp_status st = gdncp_comm_all_reduce_sum(comm, m, nullptr);
  EXPECT_LT(since(t0), 1.0) << "rank " << rank() << " raised too late";
  EXPECT_EQ(st, bad ? GDNCP_ERROR_ARGUMENT : GDNCP_ERROR) << gdncp_last_error();
  int aborted = 1;
  ASSERT_EQ(gdncp_comm_aborted(comm, &aborted), GDNCP_OK);
  EXPECT_EQ(aborted, 0) << "an argument error must leave the communicator usable";
  DLManagedTensor* out = nullptr;
  EXPECT_EQ(door_layer_call(comm, false, &out), GDNCP_OK) << gdncp_last_error();
  if (out) out->deleter(out);
  EXPECT_EQ(gdncp_comm_destroy(comm), GDNCP_OK);
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
