// tests/util/tolerance.h — the one tolerance table of the test suite.
//
// Relative L2 errors (‖actual − expected‖ / ‖expected‖) unless a row says
// otherwise, grouped by dtype, each with the reason it is what it is. Tests
// name the row; they never write a number of their own. A row is never
// loosened to make a test pass.
#pragma once

namespace gdncp {
namespace test {
namespace tol {

// --- f64 -----------------------------------------------------------------------------------
// f64 against f64 on the same math by another route (P ranks vs one rank,
// packed vs separate clips, a CPU twin vs an independent coding): exact
// algebra, only the summation order differs; ~1e-16 per op grows to ~1e-13
// over the scans' D×D products, 1e-12 leaves room without hiding a bug.
constexpr double f64 = 1e-12;
// The CP scan's merged states (M, z) against a naive sequential loop: a few
// D×D products per frame, no division; measured ~1e-15.
constexpr double f64_scan = 1e-13;
// Absolute error of an f64 sum of ≤ a few hundred O(1) terms against a loop in
// another order (n·eps ≈ 1e-14), e.g. a loss, a mean, an optimizer step.
constexpr double f64_sum = 1e-14;
// Absolute error of one or two f64 roundings of an O(1) value against the
// closed form (std::cos, std::exp): eps(f64) = 2.2e-16.
constexpr double f64_rounding = 1e-15;

// --- f64 gradchecks ------------------------------------------------------------------------
// Central-difference gradchecks in f64 (step 1e-6): truncation error
// O(step²)·f''' ≈ 1e-12 relative plus cancellation 1e-16/1e-6 = 1e-10;
// 1e-8 sits two orders above both.
constexpr double gradcheck = 1e-8;
// The same through the D×D frame scans and the whole layer: long chains of
// products and losses summed over many outputs, so small gradient elements
// carry the cancellation error 1e-10/|g| of the differences; measured up to
// 6e-8 at D = 112; 1e-6 still separates a wrong gradient (errors ≥ 1e-3).
constexpr double gradcheck_scan = 1e-6;
// The same, one element at a time against |numeric| (no L2 averaging over the
// elements, so a single element's cancellation 1e-10/|g| shows in full).
constexpr double gradcheck_element = 1e-7;

// --- f32 -----------------------------------------------------------------------------------
// One rounding of f64 values to f32: half an ulp, 2^-24 = 6e-8.
constexpr double f32_rounding = 1e-7;
// f32 results of short sums (tens of terms: a norm, a matmul row, one AdamW
// step, the CP forward) against f64 or another f32 order: a few eps(f32).
constexpr double f32_short = 1e-6;
// The f32 layer (IEEE: the CPU twin, or CUDA's Precision::ieee) against f64, the CP paths
// included, for the decay gradient too, whose per-frame sums of D² terms of both signs run in
// f64 (Note [dg in f64] in src/kernels/scan/scan_sweep.cu): docs/design.md §8's target; the
// CPU twin measured 2e-7 to 4e-7 at D = 112 and 11 to 22 frames a rank (1.3e-6 to 2.3e-6 with
// those sums in f32).
constexpr double f32_layer = 1e-6;
// f32 (IEEE) against f64 or against another f32 order: eps(f32) = 6e-8,
// grown by the scans' F·D accumulation to ~1e-6; 1e-5 for every output and
// gradient.
constexpr double f32 = 1e-5;

// --- tf32 ----------------------------------------------------------------------------------
// TF32 tensor-core operands (10-bit mantissa, eps 1e-3) accumulated in f32:
// inputs rounded to ~5e-4 relative, averaged over D-long dot products.
constexpr double tf32 = 5e-3;

// --- bf16 ----------------------------------------------------------------------------------
// The relative half-ulp of bf16 (8 significant bits): |bf16(x) − x| ≤ 2^-8·|x|,
// per element; the bound of one rounding, and of a linear map of rounded inputs in rel L2.
constexpr double bf16_half_ulp = 0x1p-8;
// One bf16 rounding of a result computed in f32 (half-ulp 2^-9 = 2e-3 per
// element, ~1.1e-3 rel L2 for uniform errors), e.g. an RMSNorm backward stored in bf16.
constexpr double bf16_store = 5e-3;
// A bf16 matmul against an f64 loop on the same bf16 inputs: the f32
// accumulation order plus the output's bf16 rounding.
constexpr double bf16_matmul = 8e-3;
// A whole layer (or op) with bf16 storage of its output and gradients against
// the f64 computation on the same rounded inputs: one rounding of ~4e-3 on
// each stored result, averaged in the L2 norm.
constexpr double bf16_vs_f64 = 1e-2;
// bf16 operands (8-bit mantissa, eps 7.8e-3) accumulated in f32, and bf16
// outputs: one rounding of ~4e-3 relative on each operand and result.
constexpr double bf16 = 2e-2;

}  // namespace tol
}  // namespace test
}  // namespace gdncp
