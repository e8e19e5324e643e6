// tests/mpi_test_cp_capture.cpp — the NCCL communicator's asynchronous step
// (docs/design.md §10), on one GPU per rank: a steady-state bigdn_cp step
// makes no host wait at all; a forward + backward of bigdn_cp captured in a
// CUDA graph replays bitwise equal to the eager step; a rank that misses a
// collective gets the others' communicators aborted by their watchdogs within
// the deadline, and their destructors do not wait. Skips without a GPU per rank.
// gdncp-mpi-np: 2
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bool gpus_for_every_rank() {
  int ok = cuda_device_count() >= nranks() ? 1 : 0, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all != 0;
}

#define REQUIRE_GPUS() \
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs CUDA and " << nranks() << " visible GPUs"

// This rank's layer inputs on the GPU (leaves require grad) and the output gradient.
struct GpuStep {
  std::vector<Tensor> x;
  Tensor w;
  LayerInputs l;
  GpuStep(int P, int r) {
    l = local_block(convert(make_layer_inputs(dims(1, 2, 16, 2 * P, 4), DType::f32, 620), DType::f32), 2, r);
    for (const Tensor& t : l.list()) x.push_back(t.defined() ? t.to(Device::cuda) : Tensor());
    for (size_t i = 0; i < 5; ++i)
      if (x[i].defined()) x[i].requires_grad_(true);
    w = Tensor::randn({1, l.d.N(), 2, 16}, DType::f32, Device::cpu, 621 + static_cast<uint64_t>(r)).to(Device::cuda);
  }
  Tensor run(cp::Communicator& c) {
    for (size_t i = 0; i < 5; ++i)
      if (x[i].defined()) x[i].zero_grad();
    Tensor out = cp::bigdn_cp(c, x[0], x[1], x[2], x[3], x[4], x[5], x[6], 2, 4, l.opt);
    backward(out, w);
    return out;
  }
  std::vector<std::vector<double>> snapshot(const Tensor& out) const {
    std::vector<std::vector<double>> s = {out.to(Device::cpu).to_vector()};
    for (size_t i = 0; i < 5; ++i)
      if (x[i].defined()) s.push_back(x[i].grad().to(Device::cpu).to_vector());
    return s;
  }
};

TEST(NcclCommAsync, SteadyStateLayerCallMakesNoHostWait) {
  REQUIRE_GPUS();
  auto c = cp::make_nccl_communicator(MPI_COMM_WORLD);
  GpuStep step(c->size(), c->rank());
  step.run(*c);  // validates, connects NCCL
  synchronize();
  c->reset_stats();
  step.run(*c);
  EXPECT_EQ(c->stats().host_waits, 0) << "a steady-state bigdn_cp step made the host wait";
  EXPECT_EQ(c->stats().validations, 0);
  synchronize();
  EXPECT_FALSE(c->aborted()) << c->abort_reason();
}

TEST(NcclCapture, BigdnCpForwardBackwardReplaysBitwise) {
  REQUIRE_GPUS();
  auto c = cp::make_nccl_communicator(MPI_COMM_WORLD);
  GpuStep step(c->size(), c->rank());
  const auto eager = step.snapshot(step.run(*c));  // warm-up: validation, NCCL connections, the cache
  step.run(*c);
  synchronize();
  CudaGraph graph;
  Tensor out;
  {
    CaptureGuard capture(graph);
    out = step.run(*c);
  }
  EXPECT_EQ(graph.capture_mallocs(), 0);
  for (int replay = 0; replay < 3; ++replay) {
    poison(out);
    graph.replay();
    c->watch("bigdn_cp graph replay");
    synchronize();
    EXPECT_EQ(step.snapshot(out), eager) << "replay " << replay << " differs from the eager step";
  }
  EXPECT_FALSE(c->aborted()) << c->abort_reason();
}

TEST(NcclCommWatchdog, MissingRankAbortsWithinDeadline) {
  REQUIRE_GPUS();
  auto c = cp::make_nccl_communicator(MPI_COMM_WORLD);
  c->set_timeout_seconds(3);
  Tensor in = Tensor::zeros({16}, DType::f32, Device::cuda);
  Tensor out = Tensor::empty({c->size(), 16}, DType::f32, Device::cuda);
  c->all_gather(out, in);
  synchronize();
  if (c->rank() != 0) {  // rank 0 never joins the next all-gather
    const auto t0 = Clock::now();
    c->all_gather(out, in);
    EXPECT_LT(since(t0), 1.0) << "the call must return once enqueued";
    while (!c->aborted() && since(t0) < 3 + 5) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_TRUE(c->aborted());
    EXPECT_LT(since(t0), 3 + 5);
    try {
      c->all_gather(out, in);
      ADD_FAILURE() << "an aborted communicator must refuse calls";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("ncclAllGather"), std::string::npos) << msg;
      EXPECT_NE(msg.find("deadline of 3 s"), std::string::npos) << msg;
    }
    const auto t1 = Clock::now();
    c.reset();
    EXPECT_LT(since(t1), 1.0) << "the destructor of an aborted communicator must not wait";
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
