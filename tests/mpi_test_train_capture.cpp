// tests/mpi_test_train_capture.cpp — the trainer's step (examples/train:
// forward of the model through bigdn_cp over NCCL, MSE loss, backward, the
// gradient all-reduce, AdamW) captured in a CUDA graph: each replay equals the
// eager step bitwise. CP = the number of ranks (1 or 2), one GPU each; skips
// without them.
// The captured step leaves out what reads the host (the loss value) and keeps
// the learning rate and AdamW's step count fixed (they are launch arguments,
// captured with the graph): the eager reference does the same.
// gdncp-mpi-np: 1 2
#include <gtest/gtest.h>
#include <mpi.h>

#include <vector>

#include "mpi_train_fixtures.h"

#if __has_include("trainer.h")  // examples/ built: it links the trainer in
#include <gdncp/gdncp.h>
#include <gdncp/nn.h>
#include <gdncp/optim.h>

#include "dist.h"
#include "model.h"
#include "util/test_util.h"
#define GDNCP_HAVE_TRAINER 1
#endif

namespace {

#if GDNCP_HAVE_TRAINER
using gdncp::Device;
using gdncp::DType;
using gdncp::Tensor;

bool gpus_for_every_rank() {
  int n = 0, ok = 0, all = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  ok = gdncp::cuda_device_count() >= n ? 1 : 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all != 0;
}

std::vector<std::vector<double>> host(const std::vector<Tensor>& ts) {
  std::vector<std::vector<double>> out;
  for (const Tensor& t : ts) out.push_back(t.to(Device::cpu).to_vector());
  return out;
}

TEST(TrainCapture, StepReplaysBitwise) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs one GPU per rank";
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  train::Dist dist(MPI_COMM_WORLD, world, Device::cuda, 60);
  const int64_t F = 2, S = 4, D = 8, H = 2, C = H * D;
  train::ForwardContext ctx;
  ctx.dist = &dist;
  ctx.frames = F;
  ctx.tokens = S;
  std::tie(ctx.rope_cos, ctx.rope_sin) = gdncp::rope_tables(F * S, D, DType::f32, Device::cuda, dist.cp_rank() * F * S);
  ctx.options.k_scale = 0.1;
  const Tensor x = Tensor::randn({1, F * S, C}, DType::f32, Device::cpu, 700 + dist.rank()).to(Device::cuda);
  const Tensor y = Tensor::randn({1, F * S, C}, DType::f32, Device::cpu, 800 + dist.rank()).to(Device::cuda);
  const train::ModelShape shape{1, H, D};
  const int64_t fixed_t = 3;

  struct Run {
    train::Model model;
    std::vector<Tensor> params;
    gdncp::optim::AdamW opt;
    explicit Run(const train::ModelShape& s)
        : model(train::init_model(s, 5, Device::cuda, false, true)), params(model.params()), opt(params) {}
  };
  auto step = [&](Run& r) {
    r.opt.set_steps(fixed_t - 1);
    r.opt.zero_grad();
    Tensor loss = gdncp::nn::mse_loss(train::forward(r.model, x, ctx), y, F * S * C);
    gdncp::backward(loss);
    dist.reduce_grads(r.params);
    r.opt.step(1.0);
  };

  Run eager(shape), graphed(shape);
  std::vector<std::vector<std::vector<double>>> want;
  for (int i = 0; i < 5; ++i) {
    step(eager);
    if (i > 1) want.push_back(host(eager.params));
  }
  // The warm-up: the same first two steps, eagerly (the first step's gradients
  // are new; from the second on the cache holds what a step needs).
  step(graphed);
  step(graphed);
  gdncp::synchronize();
  gdncp::CudaGraph graph;
  {
    gdncp::CaptureGuard capture(graph);
    step(graphed);
  }
  EXPECT_EQ(graph.capture_mallocs(), 0);
  for (int i = 0; i < 3; ++i) {
    graph.replay();
    gdncp::synchronize();
    EXPECT_EQ(host(graphed.params), want[static_cast<size_t>(i)]) << "replay " << i << " differs from eager step";
  }
}
#else
TEST(TrainCapture, StepReplaysBitwise) { GTEST_SKIP() << "examples not built"; }
#endif

}  // namespace

int main(int argc, char** argv) { return gdncp::test::mpi_main(argc, argv); }
