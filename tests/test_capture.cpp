// tests/test_capture.cpp — CUDA-graph capture of a step (docs/design.md §10):
// a forward + backward of bigdn captured on a stream and replayed equals the
// eager step bitwise, replay after replay, and the capture draws its memory
// from the cache the eager warm-up left (no cudaMalloc while capturing).
// Skips without a GPU.
#include <gtest/gtest.h>

#include <vector>

#include "bigdn_fixtures.h"
#include "gdncp/gdncp.h"
#include "util/test_util.h"

namespace gdncp {
namespace test {
namespace {

std::vector<double> host(const Tensor& t) { return t.to(Device::cpu).to_vector(); }

TEST(Capture, BigdnForwardBackwardReplaysBitwise) {
  if (!cuda_available()) GTEST_SKIP() << "needs a CUDA device";
  const LayerInputs g = convert(make_layer_inputs(dims(2, 2, 16, 4, 8), DType::f32, 510), DType::f32);
  std::vector<Tensor> x;
  for (const Tensor& t : g.list()) x.push_back(t.defined() ? t.to(Device::cuda) : Tensor());
  for (size_t i = 0; i < 5; ++i)
    if (x[i].defined()) x[i].requires_grad_(true);
  const Tensor w = Tensor::randn({2, g.d.N(), 2, 16}, DType::f32, Device::cpu, 511).to(Device::cuda);

  // One step: forward, backward; returns the output (the grads are on x).
  auto step = [&] {
    for (size_t i = 0; i < 5; ++i)
      if (x[i].defined()) x[i].zero_grad();
    Tensor out = g.run(x);
    backward(out, w);
    return out;
  };
  auto snapshot = [&](const Tensor& out) {
    std::vector<std::vector<double>> s = {host(out)};
    for (size_t i = 0; i < 5; ++i)
      if (x[i].defined()) s.push_back(host(x[i].grad()));
    return s;
  };

  const auto eager = snapshot(step());  // also the warm-up
  step();
  synchronize();

  CudaGraph graph;
  Tensor out;
  {
    CaptureGuard capture(graph);
    out = step();
  }
  EXPECT_EQ(graph.capture_mallocs(), 0) << "the capture allocated beyond the warm-up's cache";
  for (int replay = 0; replay < 3; ++replay) {
    poison(out);
    graph.replay();
    synchronize();
    EXPECT_EQ(snapshot(out), eager) << "replay " << replay << " differs from the eager step";
  }
}

// The eager steady state, counted: after a warm-up, forward + backward of bigdn in bf16 at the
// production head dim (the bf16 codings, cuBLAS included) makes the host wait for the device
// zero times and calls cudaMalloc zero times; the same step captured replays bitwise.
TEST(Capture, SteadyStateStepCountsNoHostWaitAndNoMalloc) {
  if (!cuda_available()) GTEST_SKIP() << "needs a CUDA device";
  const LayerInputs g = convert(make_layer_inputs(dims(1, 3, 112, 3, 70), DType::f32, 520), DType::bf16);
  std::vector<Tensor> x;
  for (const Tensor& t : g.list()) x.push_back(t.defined() ? t.to(Device::cuda) : Tensor());
  for (size_t i = 0; i < 5; ++i) x[i].requires_grad_(true);
  const Tensor w = Tensor::randn({1, g.d.N(), 3, 112}, DType::bf16, Device::cpu, 521).to(Device::cuda);
  auto step = [&] {
    for (size_t i = 0; i < 5; ++i) x[i].zero_grad();
    Tensor out = g.run(x);
    backward(out, w);
    return out;
  };
  // Warm-up in the steady state's pattern: a step runs while the previous step's output is
  // held, so the allocator's cache has seen that set of live blocks before the count starts.
  Tensor eager = step();
  eager = step();
  synchronize();
  const int64_t waits0 = cuda_host_waits(), mallocs0 = cuda_memory_stats().mallocs;
  for (int i = 0; i < 3; ++i) eager = step();
  EXPECT_EQ(cuda_host_waits() - waits0, 0) << "3 steady-state steps made the host wait";
  EXPECT_EQ(cuda_memory_stats().mallocs - mallocs0, 0) << "3 steady-state steps called cudaMalloc";
  synchronize();
  const std::vector<double> want = host(eager);

  CudaGraph graph;
  Tensor out;
  {
    CaptureGuard capture(graph);
    out = step();
  }
  EXPECT_EQ(graph.capture_mallocs(), 0);
  poison(out);
  graph.replay();
  synchronize();
  EXPECT_EQ(host(out), want) << "the captured bf16 step differs from the eager one";
}

TEST(Capture, HostWaitInsideCaptureIsAnError) {
  if (!cuda_available()) GTEST_SKIP() << "needs a CUDA device";
  Tensor t = Tensor::zeros({4}, DType::f32, Device::cuda);
  CudaGraph graph;
  try {
    CaptureGuard capture(graph);
    (void)t.to(Device::cpu);
    ADD_FAILURE() << "a device-to-host copy was captured";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("captured"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(graph.captured());
}

TEST(Capture, WithoutCudaThrows) {
  if (cuda_available()) GTEST_SKIP() << "a CUDA device is visible";
  CudaGraph graph;
  EXPECT_THROW(graph.begin_capture(), Error);
}

}  // namespace
}  // namespace test
}  // namespace gdncp
