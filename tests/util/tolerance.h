// tests/util/tolerance.h — the one tolerance table of the test suite.
//
// Relative L2 errors (‖actual − expected‖ / ‖expected‖), one row per dtype,
// each with the reason it is what it is. Tests name the row; they never
// write a number of their own. A row is never loosened to make a test pass.
#pragma once

namespace gdncp {
namespace test {
namespace tol {

// f64 against f64 on the same math by another route (P ranks vs one rank,
// packed vs separate clips, a CPU twin vs an independent coding): exact
// algebra, only the summation order differs; ~1e-16 per op grows to ~1e-13
// over the scans' D×D products, 1e-12 leaves room without hiding a bug.
constexpr double f64 = 1e-12;
// Central-difference gradchecks in f64 (step 1e-6): truncation error
// O(step²)·f''' ≈ 1e-12 relative plus cancellation 1e-16/1e-6 = 1e-10;
// 1e-8 sits two orders above both.
constexpr double gradcheck = 1e-8;
// f32 (IEEE) against f64 or against another f32 order: eps(f32) = 6e-8,
// grown by the scans' F·D accumulation to ~1e-6; 1e-5 for every output and
// gradient.
constexpr double f32 = 1e-5;
// TF32 tensor-core operands (10-bit mantissa, eps 1e-3) accumulated in f32:
// inputs rounded to ~5e-4 relative, averaged over D-long dot products.
constexpr double tf32 = 5e-3;
// bf16 operands (8-bit mantissa, eps 7.8e-3) accumulated in f32, and bf16
// outputs: one rounding of ~4e-3 relative on each operand and result.
constexpr double bf16 = 2e-2;

}  // namespace tol
}  // namespace test
}  // namespace gdncp
