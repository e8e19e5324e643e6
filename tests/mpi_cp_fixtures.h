// tests/mpi_cp_fixtures.h — shared pieces of the CP tests (tests/mpi_test_cp_*.cpp).
//
// Every rank regenerates the full global input from a seed, computes the
// one-rank reference itself (over a communicator of MPI_COMM_SELF, or with the
// single-rank layer), and compares its own slice. Pass/fail is reduced over
// the ranks so every rank exits with the same code. One communicator per
// binary: made once in run_mpi_tests(), shared by every test.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bigdn_fixtures.h"
#include "gdncp/cp.h"
#include "gdncp/gdncp.h"
#include "util/mpi_main.h"
#include "util/test_util.h"

namespace gdncp {
namespace test {

// The CP group (MPI_COMM_WORLD) and a one-rank group (MPI_COMM_SELF) for the
// references; the multi-GPU tests' NCCL group over all ranks (null without GPUs).
inline std::shared_ptr<cp::Communicator>& world() {
  static std::shared_ptr<cp::Communicator> c;
  return c;
}
inline std::shared_ptr<cp::Communicator>& self() {
  static std::shared_ptr<cp::Communicator> c;
  return c;
}
inline std::shared_ptr<cp::Communicator>& nccl_world() {
  static std::shared_ptr<cp::Communicator> c;
  return c;
}
// Skips a multi-GPU test where the NCCL group was not made.
#define REQUIRE_NCCL_WORLD()                                                             \
  do {                                                                                   \
    if (!nccl_world()) GTEST_SKIP() << "needs CUDA and " << nranks() << " visible GPUs"; \
  } while (0)
inline int rank() { return world()->rank(); }
inline int nranks() { return world()->size(); }

// Rows [lo, hi) of axis `axis` of t, as a new CPU tensor of t's dtype.
inline Tensor slice(const Tensor& t, int axis, int64_t lo, int64_t hi) {
  const Shape& s = t.shape();
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= s[static_cast<size_t>(i)];
  for (size_t i = static_cast<size_t>(axis) + 1; i < s.size(); ++i) inner *= s[i];
  const int64_t n = s[static_cast<size_t>(axis)];
  const std::vector<double> v = t.to(Device::cpu).to_vector();
  std::vector<double> out;
  out.reserve(static_cast<size_t>(outer * (hi - lo) * inner));
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t k = 0; k < inner; ++k) out.push_back(v[static_cast<size_t>((o * n + i) * inner + k)]);
  Shape shape = s;
  shape[static_cast<size_t>(axis)] = hi - lo;
  return Tensor::from_vector(out, shape, t.dtype());
}

// Frame block of `rank` (F frames each along axis; `per` elements per frame along it).
inline Tensor rank_block(const Tensor& t, int axis, int64_t per_rank, int block) {
  return slice(t, axis, block * per_rank, (block + 1) * per_rank);
}

// This rank's layer inputs: block b of global inputs of P·F frames.
inline LayerInputs local_block(const LayerInputs& g, int64_t F, int b) {
  LayerInputs l = g;
  l.d.F = F;
  const int64_t N = F * g.d.S;
  l.qkv = rank_block(g.qkv, 1, N, b);
  l.beta = rank_block(g.beta, 2, F, b);
  l.decay = rank_block(g.decay, 2, F, b);
  l.rope_cos = rank_block(g.rope_cos, 0, N, b);
  l.rope_sin = rank_block(g.rope_sin, 0, N, b);
  if (g.rope_cos_q.defined()) l.rope_cos_q = rank_block(g.rope_cos_q, 0, N, b);
  if (g.rope_sin_q.defined()) l.rope_sin_q = rank_block(g.rope_sin_q, 0, N, b);
  return l;
}

// A well-conditioned transition: P = X Xᵀ with X ~ N(0, (0.8/D)²), so I − P is
// a contraction, like kʳᵀ diag(β) kʳ of the layer.
inline Tensor make_P(int64_t BH, int64_t F, int64_t D, DType dt, uint64_t seed) {
  const std::vector<double> x = Tensor::randn({BH, F, D, D}, DType::f64, Device::cpu, seed, 0.8 / D).to_vector();
  std::vector<double> p(x.size(), 0.0);
  for (int64_t m = 0; m < BH * F; ++m)
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) {
        double s = 0;
        for (int64_t k = 0; k < D; ++k)
          s += x[static_cast<size_t>((m * D + i) * D + k)] * x[static_cast<size_t>((m * D + j) * D + k)];
        p[static_cast<size_t>((m * D + i) * D + j)] = s;
      }
  return Tensor::from_vector(p, {BH, F, D, D}, dt);
}

// The outputs of a scan or a raw layer call, the terminal state (when returned) last.
inline std::vector<Tensor> with_terminal(std::vector<Tensor> out, const Tensor& terminal_M, const Tensor& terminal_z) {
  if (terminal_M.defined()) {
    out.push_back(terminal_M);
    out.push_back(terminal_z);
  }
  return out;
}
inline std::vector<Tensor> scan_outputs(const cp::ScanResult& r) {
  return with_terminal({r.M, r.z}, r.terminal_M, r.terminal_z);
}
inline std::vector<Tensor> raw_outputs(const cp::RawResult& r) {
  return with_terminal({r.num, r.den}, r.terminal_M, r.terminal_z);
}

// CP options with the state flowing from rank P−1 down to rank 0.
inline cp::CpOptions reversed_ranks() {
  cp::CpOptions o;
  o.reverse_rank_order = true;
  return o;
}

// A leaf copy that requires grad.
inline Tensor leaf(const Tensor& t) {
  if (!t.defined()) return Tensor();
  Tensor x = t.clone();
  x.requires_grad_(true);
  return x;
}

// Backward of Σ_k ⟨w_k, out_k⟩ over the outputs that require grad.
inline void backward_weighted(const std::vector<Tensor>& outs, const std::vector<Tensor>& w) {
  std::vector<Tensor> roots, grads;
  for (size_t k = 0; k < outs.size(); ++k)
    if (outs[k].defined() && outs[k].requires_grad()) {
      roots.push_back(outs[k]);
      grads.push_back(w[k].dtype() == outs[k].dtype() ? w[k] : w[k].to(outs[k].dtype()));
    }
  autograd::backward(roots, grads);
}

// P ranks against one rank (util/tolerance.h): the forward in f32 is a short
// sum per element (f32_short), the gradients go through the scans (f32).
inline double tol_fwd(DType t) { return t == DType::f64 ? tol::f64 : t == DType::f32 ? tol::f32_short : tol::bf16; }
inline double tol_grad(DType t) { return t == DType::f64 ? tol::f64 : t == DType::f32 ? tol::f32 : tol::bf16; }

// Runs fn on every rank; each must throw gdncp::Error containing `what` (on
// the rank that caused it, the local message; on the others `others`).
inline void expect_all_throw(const std::function<void()>& fn, const std::string& what, const std::string& others = "") {
  try {
    fn();
    ADD_FAILURE() << "rank " << rank() << ": no error, expected one mentioning '" << what << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    const bool ok = msg.find(what) != std::string::npos || (!others.empty() && msg.find(others) != std::string::npos);
    EXPECT_TRUE(ok) << "rank " << rank() << ": message '" << msg << "' does not mention '" << what << "'";
  }
}

// main() of a CP test binary: tests/util/mpi_main.h's, with the communicators
// made before the tests and dropped after them. setup runs after the
// communicators exist, teardown before they go.
inline int run_mpi_tests(int argc, char** argv, const std::function<void()>& setup = {},
                         const std::function<void()>& teardown = {}) {
  return mpi_main(
      argc, argv,
      [&] {
        world() = cp::make_mpi_communicator(MPI_COMM_WORLD);
        self() = cp::make_mpi_communicator(MPI_COMM_SELF);
        // A hung collective in a broken test becomes an error, not a stuck job.
        world()->set_timeout_seconds(120);
        // The bad-input tests change one rank's arguments between calls and expect
        // the field named on every rank: that is the every_call policy (under
        // on_change such a rank is out of step; tests/mpi_test_cp_async.cpp).
        world()->set_validation(cp::Validation::every_call);
        if (setup) setup();
      },
      [&] {
        if (teardown && world()) teardown();
        world().reset();
        self().reset();
      });
}

}  // namespace test
}  // namespace gdncp
