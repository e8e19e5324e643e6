// tests/mpi_test_cp_deterministic_gpu.cpp — the deterministic mode (docs/design.md
// §12) on GPUs with NCCL, f32 and bf16: bigdn_cp on P GPUs (P = 1 … 4, even and
// uneven splits) is bitwise the single-GPU layer bigdn in the same mode, forward
// and every gradient (norm weights after all_reduce_grads), with checkpointing
// on and off; and ten runs give the same bits (no order-varying atomics). With
// fewer GPUs than ranks the ranks share the GPUs over MPI with host staging
// (the callback communicator), so one GPU runs P = 1 … 4 too. Skips cleanly
// when gdncp has no CUDA.
// gdncp-mpi-np: 1 2 3 4
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "mpi_cp_fixtures.h"
#include "util/gpu_world.h"

namespace gdncp {
namespace test {
namespace {

struct Outcome {
  std::vector<Tensor> values;  // out, then dqkv, dbeta, ddecay, dq_norm_w, dk_norm_w; on the CPU
};

// The layer on comm (nullptr: bigdn on one GPU) over this rank's frames [off, off + F).
Outcome run_layer(cp::Communicator* comm, const LayerInputs& g, int64_t off, int64_t F, const Tensor& w) {
  const int64_t S = g.d.S;
  const auto rows = [&](const Tensor& t, int axis, int64_t per) { return slice(t, axis, off * per, (off + F) * per); };
  const auto leaf_on_gpu = [](const Tensor& t) {
    Tensor x = t.to(Device::cuda);
    x.requires_grad_(true);
    return x;
  };
  std::vector<Tensor> x = {leaf_on_gpu(rows(g.qkv, 1, S)),
                           leaf_on_gpu(rows(g.beta, 2, 1)),
                           leaf_on_gpu(rows(g.decay, 2, 1)),
                           leaf_on_gpu(g.q_norm_w),
                           leaf_on_gpu(g.k_norm_w),
                           rows(g.rope_cos, 0, S).to(Device::cuda),
                           rows(g.rope_sin, 0, S).to(Device::cuda)};
  BigdnOptions opt = g.opt;
  opt.deterministic = true;
  const Tensor out = comm ? cp::bigdn_cp(*comm, x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, S, opt)
                          : bigdn(x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, S, opt);
  backward_weighted({out}, {rows(w, 1, S).to(Device::cuda).to(out.dtype())});
  if (comm) cp::all_reduce_grads(*comm, {x[3], x[4]});
  Outcome r;
  r.values.push_back(out.to(Device::cpu));
  for (size_t k = 0; k < 5; ++k) r.values.push_back(x[k].grad().to(Device::cpu));
  return r;
}

void expect_bitwise(const Outcome& got, const Outcome& want, const std::string& what) {
  const char* names[] = {"out", "dqkv", "dbeta", "ddecay", "dq_norm_w", "dk_norm_w"};
  ASSERT_EQ(got.values.size(), want.values.size());
  for (size_t k = 0; k < got.values.size(); ++k) {
    ASSERT_EQ(got.values[k].shape(), want.values[k].shape()) << what << " " << names[k];
    const std::vector<double> a = got.values[k].to_vector(), b = want.values[k].to_vector();
    size_t diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff += std::memcmp(&a[i], &b[i], sizeof(double)) != 0;
    EXPECT_EQ(diff, 0u) << what << " " << names[k] << " on rank " << rank() << ": " << diff << " of " << a.size()
                        << " elements differ";
  }
}

// Frames per rank: even, then uneven with an empty rank (for P > 1).
std::vector<std::vector<int64_t>> gpu_splits(int P) {
  std::vector<std::vector<int64_t>> s = {std::vector<int64_t>(static_cast<size_t>(P), 3)};
  if (P > 1) {
    std::vector<int64_t> u(static_cast<size_t>(P), 2);
    u[0] = 5;
    u[static_cast<size_t>(P - 1)] = 0;
    s.push_back(u);
  }
  return s;
}

void check_against_one_gpu(DType dt, Checkpoint ck, uint64_t seed) {
  REQUIRE_NCCL_WORLD();
  const int P = nranks(), r = rank();
  for (const auto& split : gpu_splits(P)) {
    const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0}), S = 37;
    const int64_t off = std::accumulate(split.begin(), split.begin() + r, int64_t{0}),
                  F = split[static_cast<size_t>(r)];
    LayerInputs g = make_layer_inputs(dims(1, 2, 112, Ft, S), dt, seed);
    g.opt.precision = dt == DType::bf16 ? Precision::bf16 : Precision::ieee;
    g.opt.checkpoint = ck;
    const Tensor w = Tensor::randn({1, Ft * S, 2, 112}, dt, Device::cpu, seed + 9);
    const Outcome got = run_layer(nccl_world().get(), g, off, F, w);
    Outcome one = run_layer(nullptr, g, 0, Ft, w);  // the single-GPU layer, same mode
    one.values[0] = slice(one.values[0], 1, off * S, (off + F) * S);
    one.values[1] = slice(one.values[1], 1, off * S, (off + F) * S);
    one.values[2] = slice(one.values[2], 2, off, off + F);
    one.values[3] = slice(one.values[3], 2, off, off + F);
    expect_bitwise(got, one, std::string(dtype_name(dt)) + " split of " + std::to_string(Ft));
  }
}

TEST(CpDeterministicGpu, BigdnCpEqualsOneGpuF32) { check_against_one_gpu(DType::f32, Checkpoint::off, 100); }
TEST(CpDeterministicGpu, BigdnCpEqualsOneGpuBf16) { check_against_one_gpu(DType::bf16, Checkpoint::off, 200); }
TEST(CpDeterministicGpu, BigdnCpEqualsOneGpuCheckpointed) { check_against_one_gpu(DType::bf16, Checkpoint::on, 300); }

TEST(CpDeterministicGpu, TenRunsGiveTheSameBits) {
  REQUIRE_NCCL_WORLD();
  const int P = nranks(), r = rank();
  const int64_t F = 3, S = 37;
  for (DType dt : {DType::f32, DType::bf16}) {
    LayerInputs g = make_layer_inputs(dims(1, 2, 112, F * P, S), dt, 400);
    g.opt.precision = dt == DType::bf16 ? Precision::bf16 : Precision::ieee;
    const Tensor w = Tensor::randn({1, F * P * S, 2, 112}, dt, Device::cpu, 409);
    const Outcome first = run_layer(nccl_world().get(), g, r * F, F, w);
    for (int run = 1; run < 10; ++run)
      expect_bitwise(run_layer(nccl_world().get(), g, r * F, F, w), first,
                     std::string(dtype_name(dt)) + " run " + std::to_string(run));
  }
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_gpu_mpi_tests(argc, argv); }
