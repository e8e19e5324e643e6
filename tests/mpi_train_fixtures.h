// tests/mpi_train_fixtures.h — shared pieces of the in-process trainer tests
// (tests/mpi_test_train*.cpp): the world rank, a scratch directory shared by the
// ranks, a fixture that fails every rank when one failed; their main() is
// util/mpi_main.h's.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "util/mpi_main.h"

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

}  // namespace test
}  // namespace gdncp
