// tests/util/test_util.h — shared helpers of the test suite.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gdncp/gdncp.h"
#include "util/tolerance.h"

namespace gdncp {
namespace test {

// ‖a − b‖₂ / max(‖b‖₂, tiny). Both converted to double on the host.
double rel_l2(const Tensor& a, const Tensor& b);
double max_abs_diff(const Tensor& a, const Tensor& b);
bool bitwise_equal(const Tensor& a, const Tensor& b);
// gtest assertion: rel_l2(actual, expected) <= tol; on failure prints the
// errors and the first mismatching elements with their indices.
::testing::AssertionResult close_rel(const Tensor& actual, const Tensor& expected, double tol,
                                     const std::string& what = "");
// Fills t with NaN (floats) so a kernel that leaves an element unwritten is caught.
void poison(Tensor& t);
// True if any element is NaN or inf.
bool has_nonfinite(const Tensor& t);
// GDNCP_TEST_SMALL=1: the tests keep their smaller shapes only (scripts/gpu.sh sanitize, where
// compute-sanitizer runs every kernel many times slower).
bool small_only();
// A test of CUDA code skips itself where no GPU is visible (or gdncp has no CUDA).
#define REQUIRE_GPU() \
  if (!::gdncp::cuda_available()) GTEST_SKIP() << "no CUDA device visible"

// Central-difference gradient check in f64 (CPU).
//   fn maps the inputs to one or more outputs; the scalar loss is
//   L = Σ_k Σ_i w_k[i]·out_k[i] with fixed random weights w_k.
// Every input that requires grad is perturbed element by element
// (all elements when numel ≤ max_elems, else max_elems of them chosen at random).
// Returns the max over inputs of ‖analytic − numeric‖ / ‖numeric‖ over the
// checked elements, and prints per-input errors on failure. When it compared
// no element at all, max_rel_error is +inf: an empty check fails.
struct GradcheckResult {
  double max_rel_error = 0;
  int64_t elements_checked = 0;
  std::string report;  // one line per input
};
GradcheckResult gradcheck(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, double step = 1e-6, int64_t max_elems = 64,
                          uint64_t seed = 1234);

}  // namespace test
}  // namespace gdncp
