// tests/mpi_gpu_fixtures.h — the NCCL world of the multi-GPU CP tests
// (tests/mpi_test_cp*_gpu.cpp): their main() sets it where every rank sees a
// GPU; null otherwise, and REQUIRE_GPUS() skips the test.
#pragma once

#include <memory>

#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {

// NCCL over all ranks (null without GPUs).
inline std::shared_ptr<cp::Communicator>& nccl_world() {
  static std::shared_ptr<cp::Communicator> c;
  return c;
}

}  // namespace test
}  // namespace gdncp

#define REQUIRE_GPUS()                                                                   \
  do {                                                                                   \
    if (!nccl_world()) GTEST_SKIP() << "needs CUDA and " << nranks() << " visible GPUs"; \
  } while (0)
