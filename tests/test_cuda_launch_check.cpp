// tests/test_cuda_launch_check.cpp — GDNCP_CUDA_CHECK_LAUNCH names the kernel, also when the
// name is chosen at run time, and says where the launch was. A failed runtime call leaves the
// same pending error a failed launch leaves. Skips without a device (without a driver every
// runtime call fails, so no error can be consumed).
#include <gtest/gtest.h>

#include <string>

#include "gdncp/error.h"

#ifdef GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace gdncp {
namespace test {
namespace {

TEST(CudaLaunchCheck, NamesTheKernelAndTheSite) {
#ifndef GDNCP_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "no CUDA device visible";
  }
  for (const std::string name : {"probe_kernel<128>", "probe_kernel(Ac)"}) {
    (void)cudaGetLastError();
    ASSERT_NE(cudaSetDevice(-1), cudaSuccess);  // leaves an error pending, like a bad launch
    try {
      GDNCP_CUDA_CHECK_LAUNCH(name);
      FAIL() << "no gdncp::Error for a pending CUDA error";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("CUDA kernel " + name + " failed to launch"), std::string::npos) << what;
      EXPECT_NE(what.find("test_cuda_launch_check.cpp:"), std::string::npos) << what;
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the check consumed the error
  }
  EXPECT_NO_THROW(GDNCP_CUDA_CHECK_LAUNCH("probe_kernel"));  // nothing pending: no error
#endif
}

}  // namespace
}  // namespace test
}  // namespace gdncp
