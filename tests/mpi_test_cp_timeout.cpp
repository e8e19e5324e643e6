// tests/mpi_test_cp_timeout.cpp — a collective that cannot finish in time
// aborts the communicator and throws on the waiting ranks instead of hanging.
// Rank 0 joins the all-gather late (after the others' deadline): the others
// throw, their communicator refuses every later call; rank 0's late call still
// completes (the others' requests stay alive, parked), so the job ends cleanly.
// The first test aborts the binary's shared communicator; the second makes its own.
// gdncp-mpi-np: 2 3
#include <chrono>
#include <string>
#include <thread>

#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {
namespace {

TEST(MpiCommTimeout, MissingRankAbortsAndThrows) {
  const double timeout = 1.0;
  world()->set_timeout_seconds(timeout);
  const Tensor in = Tensor::full({4}, rank(), DType::f32);
  Tensor out = Tensor::empty({nranks(), 4}, DType::f32);
  if (rank() == 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(2.5 * timeout));
    world()->set_timeout_seconds(30);
    EXPECT_NO_THROW(world()->all_gather(out, in));
    EXPECT_FALSE(world()->aborted());
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      world()->all_gather(out, in);
      ADD_FAILURE() << "rank " << rank() << ": expected a timeout";
    } catch (const Error& e) {
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_NE(std::string(e.what()).find("did not complete within"), std::string::npos) << e.what();
      EXPECT_GE(waited, timeout);
      EXPECT_LT(waited, timeout + 5.0);
    }
    EXPECT_TRUE(world()->aborted());
    Tensor t = Tensor::zeros({1}, DType::f32);
    try {
      world()->all_reduce_sum(t);
      ADD_FAILURE() << "an aborted communicator must refuse calls";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
    }
  }
  // Everyone meets here on the raw world communicator; MPI progress completes
  // the parked all-gather of ranks > 0.
  MPI_Barrier(MPI_COMM_WORLD);
}

// The watchdog's contract on a fresh communicator: the error names the
// collective and the deadline, every later call throws at once naming the
// same cause, and the destructor of the aborted communicator does not wait
// (its abandoned request is matched afterwards by rank 0's late call).
TEST(MpiCommWatchdog, AbortedCommunicatorThrowsAtOnceAndDestroysWithoutWaiting) {
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_timeout_seconds(1);
  const Tensor in = Tensor::full({4}, rank(), DType::f32);
  Tensor out = Tensor::empty({nranks(), 4}, DType::f32);
  if (rank() == 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(2.0));
    c->set_timeout_seconds(30);
    EXPECT_NO_THROW(c->all_gather(out, in));
  } else {
    EXPECT_THROW(c->all_gather(out, in), Error);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c->barrier();
      ADD_FAILURE() << "an aborted communicator must refuse calls";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("barrier"), std::string::npos) << msg;
      EXPECT_NE(msg.find("all_gather did not complete within the deadline of 1 s"), std::string::npos) << msg;
    }
    c.reset();
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(took, 0.5) << "refusing and destroying an aborted communicator must not wait";
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
