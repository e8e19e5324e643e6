// tests/util/mpi_main.h — the main() of every test binary that ctest runs under
// mpirun (tests/mpi_test_*.cpp).
//
// mpi_main: every rank runs the binary's tests; the process exit code is the same on
// every rank and says what happened over all of them:
//   1   a test failed (or setup/teardown threw) on some rank;
//   77  no test ran on any rank (all skipped, e.g. GPU tests on a CPU machine):
//       tests/CMakeLists.txt sets SKIP_RETURN_CODE 77, so ctest lists the entry as skipped;
//   0   otherwise.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <exception>
#include <functional>

namespace gdncp {
namespace test {

// The exit code of a multi-rank binary whose tests all skipped (ctest's SKIP_RETURN_CODE).
constexpr int kSkipReturnCode = 77;

// Prints failures of non-zero ranks with a rank prefix (rank 0 prints the usual report).
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed())
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
  }

 private:
  int rank_;
};

// This process's outcome {failed, ran anything}: setup, RUN_ALL_TESTS,
// teardown (also after a failed setup); an exception from any of them is a
// failure reported with the rank, never an abort.
inline void run_tests(int rank, const std::function<void()>& setup, const std::function<void()>& teardown,
                      int outcome[2]) {
  int failed = 1;
  try {
    if (setup) setup();
    failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] uncaught: %s\n", rank, e.what());
    failed = 1;
  }
  try {
    if (teardown) teardown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] teardown: %s\n", rank, e.what());
    failed = 1;
  }
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  outcome[0] = failed;
  outcome[1] = unit.successful_test_count() + unit.failed_test_count() > 0 ? 1 : 0;
}

inline int exit_code(const int outcome[2]) {
  if (outcome[0]) return 1;
  return outcome[1] ? 0 : kSkipReturnCode;
}

// MPI_Init, InitGoogleTest, run_tests, the reduction of the outcome over the
// ranks, MPI_Finalize.
inline int mpi_main(int argc, char** argv, const std::function<void()>& setup = {},
                    const std::function<void()>& teardown = {}) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  if (r != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(r));
  }
  int mine[2] = {1, 0}, all[2] = {1, 0};
  run_tests(r, setup, teardown, mine);
  MPI_Allreduce(mine, all, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (r == 0 && all[0] && !mine[0]) std::fprintf(stderr, "some rank failed (see the [rank k] lines)\n");
  if (r == 0 && !all[0] && !all[1]) std::fprintf(stderr, "no test ran on any rank: reported as skipped\n");
  MPI_Finalize();
  return exit_code(all);
}

// The main of a binary that ctest starts under mpirun but that launches its own
// jobs (a nested mpirun) and does not join MPI: the same exit codes, for this
// process alone.
inline int launcher_main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int outcome[2] = {1, 0};
  run_tests(0, {}, {}, outcome);
  if (!outcome[0] && !outcome[1]) std::fprintf(stderr, "no test ran: reported as skipped\n");
  return exit_code(outcome);
}

}  // namespace test
}  // namespace gdncp
