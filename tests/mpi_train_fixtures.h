// tests/mpi_train_fixtures.h — shared pieces of the in-process trainer tests
// (tests/mpi_test_train*.cpp): the world rank, a scratch directory shared by the
// ranks, a fixture that fails every rank when one failed, and a main() that
// reduces RUN_ALL_TESTS over the ranks.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

namespace gdncp {
namespace test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// <temp>/<prefix>_<pid of rank 0>/<name>: the same path on every rank, and another
// for each run of the binary. Not created.
inline std::string scratch_dir(const std::string& prefix, const std::string& name) {
  long pid = static_cast<long>(getpid());
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  return (std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(pid)) / name).string();
}

// Every rank fails if any rank failed.
class AllRanksTest : public ::testing::Test {
 protected:
  void TearDown() override {
    int mine = HasFailure() ? 1 : 0, any = 0;
    MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any && !mine) ADD_FAILURE() << "another rank failed";
  }
};

// MPI_Init, InitGoogleTest, RUN_ALL_TESTS, after (on every rank), MPI_Finalize;
// returns the largest RUN_ALL_TESTS code over the ranks. With quiet_others,
// only rank 0 prints gtest's report.
inline int run_all_tests_max_over_ranks(int argc, char** argv, bool quiet_others,
                                        const std::function<void()>& after = {}) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (quiet_others && world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  if (after) after();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}

}  // namespace test
}  // namespace gdncp
