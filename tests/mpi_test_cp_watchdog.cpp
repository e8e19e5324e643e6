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

#include "mpi_async_fixtures.h"

namespace gdncp {
namespace test {
namespace {

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
// its deadline (5 s), within 10 s. Rank 0 then continues it, once every other
// rank has raised (continued earlier, it would complete the all-gather a slower
// rank still waits in, and that rank would wait out a second deadline in the
// next one); it issues the forward whose all-gather the others abandoned, so no
// request stays open.
TEST(MpiCommWatchdog, StoppedRankRaisesOnEveryOtherRankInTime) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_timeout_seconds(5);
  const int last = nranks() - 1;
  int pid = static_cast<int>(getpid());
  std::vector<int> pids(static_cast<size_t>(nranks()));
  MPI_Allgather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  MPI_Comm others = MPI_COMM_NULL;  // every rank but the stopped one
  MPI_Comm_split(MPI_COMM_WORLD, rank() == last ? MPI_UNDEFINED : 0, rank(), &others);
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
    MPI_Barrier(others);
    if (rank() == 0) kill(pids[static_cast<size_t>(last)], SIGCONT);
    MPI_Comm_free(&others);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
