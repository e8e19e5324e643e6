// tests/mpi_test_cp_watchdog.cpp — a lost rank under the MPI communicator's
// deadline (docs/design.md §10): with a 5 s timeout, a rank that skips a call
// or is stopped (SIGSTOP) makes every other rank raise within 10 s, and the
// destructor of the aborted communicator does not wait.
// Tests that break a communicator make a fresh one (an aborted one stays so).
// gdncp-mpi-np: 2 3
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// One layer step (forward + backward) of this rank's block of a seeded global
// input of F frames per rank; returns out and the gradients, flattened.
std::vector<double> layer_step(cp::Communicator& c, int64_t F, uint64_t seed = 77, bool backward_too = true) {
  const int64_t S = 2;
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, 4, F * c.size(), S), DType::f64, seed), F, c.rank());
  std::vector<Tensor> x = {leaf(l.qkv),      leaf(l.beta), leaf(l.decay), leaf(l.q_norm_w),
                           leaf(l.k_norm_w), l.rope_cos,   l.rope_sin};
  Tensor out = cp::bigdn_cp(c, x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, S, l.opt);
  std::vector<double> v = out.to_vector();
  if (!backward_too) return v;
  backward(out, Tensor::randn(out.shape(), out.dtype(), Device::cpu, seed + 9));
  for (size_t i = 0; i < 5; ++i)
    for (double g : x[i].grad().to_vector()) v.push_back(g);
  return v;
}

// Every rank must throw gdncp::Error from fn within `within` seconds, with a
// message containing one of `what`.
void expect_error_in_time(const std::function<void()>& fn, const std::vector<std::string>& what, double within) {
  const auto t0 = Clock::now();
  try {
    fn();
    ADD_FAILURE() << "rank " << rank() << ": no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    bool found = false;
    for (const std::string& w : what) found |= msg.find(w) != std::string::npos;
    EXPECT_TRUE(found) << "rank " << rank() << ": unexpected message: " << msg;
  }
  EXPECT_LT(since(t0), within) << "rank " << rank() << " raised too late";
}

// A rank that skips one layer call runs one call ahead of the others, so they
// wait for a last call it never makes: every other rank raises at the deadline
// (5 s), within 10 s. (The skipper itself may end without an error.)
TEST(MpiCommWatchdog, RankSkippingACallRaisesOnEveryOtherRank) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_timeout_seconds(5);
  const bool skipper = rank() == nranks() - 1;
  auto steps = [&] {
    for (int step = 0; step < 4; ++step)
      if (!(skipper && step == 1)) layer_step(*c, 2, 77 + static_cast<uint64_t>(step));
  };
  if (skipper) {
    try {
      steps();
    } catch (const Error&) {
    }
  } else {
    expect_error_in_time(steps, {"did not complete within the deadline of 5 s", "out of step"}, 10);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A rank stopped by SIGSTOP before a layer call: every other rank raises at
// its deadline (5 s), within 10 s. Rank 0 then continues it; it issues the
// forward whose all-gather the others abandoned, so no request stays open.
TEST(MpiCommWatchdog, StoppedRankRaisesOnEveryOtherRankInTime) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_timeout_seconds(5);
  const int last = nranks() - 1;
  int pid = static_cast<int>(getpid());
  std::vector<int> pids(static_cast<size_t>(nranks()));
  MPI_Allgather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  layer_step(*c, 2);
  if (rank() == last) {
    raise(SIGSTOP);  // continued by rank 0 below
    NoGradGuard no_grad;
    layer_step(*c, 2, 78, /*backward_too=*/false);  // completes the abandoned forward all-gather
  } else {
    expect_error_in_time([&] { layer_step(*c, 2, 78); }, {"did not complete within the deadline of 5 s"}, 10);
    EXPECT_TRUE(c->aborted());
    const auto t0 = Clock::now();
    c.reset();  // the destructor of an aborted communicator does not wait
    EXPECT_LT(since(t0), 0.5);
    if (rank() == 0) kill(pids[static_cast<size_t>(last)], SIGCONT);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
