// tests/mpi_train_fixtures.h — shared pieces of the in-process trainer tests
// (tests/mpi_test_train*.cpp): the world rank, a scratch directory shared by the
// ranks, a fixture that fails every rank when one failed, a small trainer
// configuration, and their main() (util/mpi_main.h's, removing the scratch
// directories at the end).
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "util/mpi_main.h"

#if __has_include("trainer.h")  // examples/ built (GDNCP_BUILD_EXAMPLES): it links the trainer in
#include "trainer.h"
#define GDNCP_HAVE_TRAINER 1
#endif

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

// scratch_dir, made empty: rank 0 removes and re-creates it, then every rank waits.
inline std::string empty_scratch_dir(const std::string& prefix, const std::string& name) {
  const std::filesystem::path p = scratch_dir(prefix, name);
  if (world_rank() == 0) {
    std::filesystem::remove_all(p);
    std::filesystem::create_directories(p);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return p.string();
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

#if GDNCP_HAVE_TRAINER
// A small trainer configuration: 2 heads, 4 frames a video, no files unless a test
// asks, the bitwise parameter check every step.
inline train::Config small_config(int64_t layers, int64_t head_dim, int64_t tokens, int64_t batch, int64_t pool) {
  train::Config c;
  c.layers = layers;
  c.heads = 2;
  c.head_dim = head_dim;
  c.frames = 4;
  c.tokens = tokens;
  c.batch = batch;
  c.pool = pool;
  c.log_path = "";
  c.print_every = 0;
  c.check_every = 1;
  return c;
}

// One layer of 2 heads of 8, CP = 2 over 4 frames of 4 tokens, 2 videos a step.
inline train::Config small_cp2_config() {
  train::Config c = small_config(1, 8, 4, 2, 4);
  c.cp = 2;
  return c;
}
#endif

// main() of a trainer test binary: util/mpi_main.h's, then the binary's scratch
// directories (scratch_dir(prefix, ·)) removed.
inline int train_test_main(int argc, char** argv, const std::string& prefix) {
  return mpi_main(argc, argv, {}, [prefix] {
#if GDNCP_HAVE_TRAINER
    const std::string root = std::filesystem::path(scratch_dir(prefix, "x")).parent_path().string();
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) std::filesystem::remove_all(root);
#endif
  });
}

}  // namespace test
}  // namespace gdncp
