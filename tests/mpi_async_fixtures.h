// tests/mpi_async_fixtures.h — shared pieces of the tests of the MPI
// communicator's asynchronous step and deadline (tests/mpi_test_cp_async.cpp,
// tests/mpi_test_cp_watchdog.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {

using Clock = std::chrono::steady_clock;
inline double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// One layer step (forward + backward) of this rank's block of a seeded global
// input of F frames per rank of S tokens; returns out and the gradients, flattened.
inline std::vector<double> layer_step(cp::Communicator& c, int64_t F, uint64_t seed = 77, bool backward_too = true,
                                      int64_t S = 2) {
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
inline void expect_error_in_time(const std::function<void()>& fn, const std::vector<std::string>& what, double within) {
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

}  // namespace test
}  // namespace gdncp
