// tests/mpi_test_cp_exchange_gpu.cpp — the composites' exchanges (gdncp/cp.h Exchange) on GPUs,
// the hidden exchange (CpOptions::overlap_exchange, Note [hidden exchange] in
// src/cp/scan/comm_stream.h) and the f32 decay gradient:
//   - bigdn_cp in IEEE f32 on P = 1 … 4 ranks (one GPU each, or sharing GPUs through host
//     staging: tests/util/gpu_world.h) under every exchange (auto, all-gather, log,
//     hierarchical with nodes of 2), even and uneven splits with an empty rank: every rank's
//     output and gradients within 1e-6 of the f64 one-rank layer on the CPU;
//   - on one rank, each rank of emulated groups of 2 and 3 on stand-in peers with a modeled
//     link (bench/loopback_comm.h: the all-gather occupies a stream of its own for the link's
//     time): a bigdn_cp step with overlap on equals it with overlap off bitwise, makes no host
//     wait, and captured in a CUDA graph replays bitwise equal to the eager step;
//   - on one rank, bigdn_cp in IEEE f32 on the GPU (a group of one) against the f64 oracle at
//     11, 22 and 44 frames: every output and gradient within 1e-6, the decay gradient included.
// Skips without a GPU.
// gdncp-mpi-np: 1 2 3 4
#include <numeric>
#include <string>
#include <vector>

#include "gdncp/graph.h"
#include "mpi_cp_fixtures.h"
#include "util/gpu_world.h"

#if GDNCP_WITH_CUDA
#include "loopback_comm.h"
#endif

namespace gdncp {
namespace test {
namespace {

// The tests of one rank's work (emulated peers, a group of one) run in the one-rank run.
#define REQUIRE_ONE_RANK() \
  if (nranks() != 1) GTEST_SKIP() << "runs at np 1"

Tensor cpu(const Tensor& t) { return t.defined() ? t.to(Device::cpu) : Tensor(); }

// One rank's bigdn_cp step on the GPU (leaves require grad) and its output gradient.
struct Step {
  LayerInputs l;
  std::vector<Tensor> x;
  Tensor w;
  Step(int64_t F, int64_t S, int64_t D, uint64_t seed) {
    l = make_layer_inputs(dims(1, 2, D, F, S), DType::f32, seed);
    l.opt.precision = Precision::ieee;
    for (const Tensor& t : l.list()) x.push_back(t.defined() ? t.to(Device::cuda) : Tensor());
    for (size_t i = 0; i < 5; ++i)
      if (x[i].defined()) x[i].requires_grad_(true);
    w = Tensor::randn({1, F * S, 2, D}, DType::f32, Device::cpu, seed + 1).to(Device::cuda);
  }
  Tensor run(cp::Communicator& c, const cp::CpOptions& o) {
    for (size_t i = 0; i < 5; ++i)
      if (x[i].defined()) x[i].zero_grad();
    Tensor out =
        cp::bigdn_cp(c, x[0], x[1], x[2], x[3], x[4], x[5], x[6], l.d.F, l.d.S, l.opt, Tensor(), Tensor(), Tensor(), o);
    backward(out, w);
    return out;
  }
  std::vector<std::vector<double>> snapshot(const Tensor& out) const {
    std::vector<std::vector<double>> s = {cpu(out).to_vector()};
    for (size_t i = 0; i < 5; ++i)
      if (x[i].defined()) s.push_back(cpu(x[i].grad()).to_vector());
    return s;
  }
};

// The f64 layer on the CPU over every frame of g, backward of ⟨w, out⟩: out, then the gradients
// of qkv, beta, decay, q_norm_w and k_norm_w (kGradNames).
const char* const kGradNames[] = {"dqkv", "dbeta", "ddecay", "dq_norm_w", "dk_norm_w"};
std::vector<Tensor> f64_reference(const LayerInputs& g, const Tensor& w) {
  const LayerInputs o = convert(g, DType::f64);
  std::vector<Tensor> x = {leaf(o.qkv), leaf(o.beta), leaf(o.decay), leaf(o.q_norm_w), leaf(o.k_norm_w)};
  std::vector<Tensor> r = {bigdn(x[0], x[1], x[2], x[3], x[4], o.rope_cos, o.rope_sin, o.d.F, o.d.S, o.opt)};
  backward(r[0], cpu(w).to(DType::f64));
  for (const Tensor& t : x) r.push_back(t.grad());
  return r;
}

#if GDNCP_WITH_CUDA
// Every rank of 2 (the all-gather behind Wcum forward, Rcum backward) and of 3 (the forward
// composites in two all-gathers), over an NVLink model.
TEST(CpExchangeGpu, OverlapEqualsOffAndReplaysBitwise) {
  REQUIRE_GPU();
  REQUIRE_ONE_RANK();
  bench::LinkModel model;
  model.intra = model.inter = bench::link_preset("nvlink");
  for (int P : {2, 3})
    for (int r = 0; r < P; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(P));
      // Owned by a shared_ptr: the backward of a CP call keeps its communicator.
      const auto owner = std::make_shared<bench::LoopbackPeers>(r, P, model);
      bench::LoopbackPeers& peers = *owner;
      Step step(3, 16, 112, 1200 + static_cast<uint64_t>(10 * P + r));
      cp::CpOptions off, on;
      on.overlap_exchange = true;
      const auto plain = step.snapshot(step.run(peers, off));
      step.run(peers, on);  // warm-up: the communication stream, the cache
      synchronize();
      std::vector<std::vector<double>> eager;
      {  // the eager output freed before the capture, so the cache holds what the capture needs
        const int64_t waits = cuda_host_waits();
        Tensor eager_out = step.run(peers, on);
        EXPECT_EQ(cuda_host_waits(), waits) << "a step with the exchange hidden made the host wait";
        eager = step.snapshot(eager_out);
      }
      EXPECT_EQ(eager, plain) << "overlap on differs from overlap off";
      CudaGraph graph;
      Tensor out;
      {
        CaptureGuard capture(graph);
        out = step.run(peers, on);
      }
      EXPECT_EQ(graph.capture_mallocs(), 0);
      for (int replay = 0; replay < 3; ++replay) {
        poison(out);
        graph.replay();
        synchronize();
        EXPECT_EQ(step.snapshot(out), eager) << "replay " << replay << " differs from the eager step";
      }
    }
}
#endif

// Every exchange's CUDA path on P ranks against the f64 one-rank layer (the CPU tests check the
// same algebra in f64 on CPU ranks; here the device folds, packs and collectives run).
TEST(CpExchangeGpu, EveryExchangeMatchesOneRank) {
  REQUIRE_NCCL_WORLD();
  cp::Communicator& c = *nccl_world();
  const int P = nranks(), r = rank();
  std::vector<cp::CpOptions> exchanges(3);
  exchanges[1].exchange = cp::Exchange::all_gather;
  exchanges[2].exchange = cp::Exchange::log;
  if (P % 2 == 0) {
    exchanges.emplace_back();
    exchanges.back().exchange = cp::Exchange::hierarchical;
    exchanges.back().node_size = 2;
  }
  std::vector<std::vector<int64_t>> splits = {std::vector<int64_t>(static_cast<size_t>(P), 3)};
  if (P > 1) {  // uneven, the last rank empty
    std::vector<int64_t> u(static_cast<size_t>(P), 2);
    u[0] = 4;
    u.back() = 0;
    splits.push_back(u);
  }
  uint64_t seed = 1400;
  for (const std::vector<int64_t>& split : splits) {
    const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0}), S = 37, D = 112;
    const int64_t off = std::accumulate(split.begin(), split.begin() + r, int64_t{0}),
                  F = split[static_cast<size_t>(r)];
    LayerInputs g = make_layer_inputs(dims(1, 2, D, Ft, S), DType::f32, seed);
    g.opt.precision = Precision::ieee;
    const Tensor w = Tensor::randn({1, Ft * S, 2, D}, DType::f32, Device::cpu, seed + 9);
    const std::vector<Tensor> ref = f64_reference(g, w);  // over every frame
    const auto mine = [&](const Tensor& t, int axis, int64_t per) {
      return slice(t, axis, off * per, (off + F) * per);
    };
    for (const cp::CpOptions& x : exchanges) {
      SCOPED_TRACE(std::string("exchange ") + cp::exchange_name(x.exchange) + ", split of " + std::to_string(Ft) +
                   " frames, rank " + std::to_string(r) + " of " + std::to_string(P));
      const auto on_gpu = [](const Tensor& t, bool grad) {
        Tensor y = t.to(Device::cuda);
        if (grad) y.requires_grad_(true);
        return y;
      };
      std::vector<Tensor> xs = {on_gpu(mine(g.qkv, 1, S), true), on_gpu(mine(g.beta, 2, 1), true),
                                on_gpu(mine(g.decay, 2, 1), true), on_gpu(g.q_norm_w, true), on_gpu(g.k_norm_w, true)};
      const Tensor out =
          cp::bigdn_cp(c, xs[0], xs[1], xs[2], xs[3], xs[4], mine(g.rope_cos, 0, S).to(Device::cuda),
                       mine(g.rope_sin, 0, S).to(Device::cuda), F, S, g.opt, Tensor(), Tensor(), Tensor(), x);
      backward(out, mine(w, 1, S).to(Device::cuda));
      cp::all_reduce_grads(c, {xs[3], xs[4]});
      if (F > 0) {
        EXPECT_TRUE(close_rel(cpu(out), mine(ref[0], 1, S), tol::f32_layer, "out"));
        EXPECT_TRUE(close_rel(cpu(xs[0].grad()), mine(ref[1], 1, S), tol::f32_layer, kGradNames[0]));
        EXPECT_TRUE(close_rel(cpu(xs[1].grad()), mine(ref[2], 2, 1), tol::f32_layer, kGradNames[1]));
        EXPECT_TRUE(close_rel(cpu(xs[2].grad()), mine(ref[3], 2, 1), tol::f32_layer, kGradNames[2]));
      }
      for (size_t k = 3; k < 5; ++k)  // the norm weights' gradients, summed over the ranks
        EXPECT_TRUE(close_rel(cpu(xs[k].grad()), ref[k + 1], tol::f32_layer, kGradNames[k]));
    }
    seed += 17;
  }
}

// The decay gradient's sums per frame in f64 (Note [dg in f64]): f32 within 1e-6 of f64 at the
// production D, not growing past it with F.
TEST(CpExchangePrecisionGpu, F32LayerWithin1e6OfF64) {
  REQUIRE_GPU();
  REQUIRE_ONE_RANK();
  auto c = cp::make_nccl_communicator(MPI_COMM_SELF);
  for (int64_t F : {11, 22, 44}) {
    SCOPED_TRACE("F = " + std::to_string(F));
    Step step(F, 37, 112, 1300 + static_cast<uint64_t>(F));
    const Tensor out = step.run(*c, cp::CpOptions());
    const std::vector<Tensor> ref = f64_reference(step.l, step.w);
    EXPECT_TRUE(close_rel(cpu(out), ref[0], tol::f32_layer, "out"));
    for (size_t k = 0; k < 5; ++k)
      EXPECT_TRUE(close_rel(cpu(step.x[k].grad()), ref[k + 1], tol::f32_layer, kGradNames[k]));
  }
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_gpu_mpi_tests(argc, argv); }
