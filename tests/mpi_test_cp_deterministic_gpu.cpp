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

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#endif

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

#if GDNCP_WITH_CUDA
namespace gdncp {
namespace test {
namespace {

// "" or what failed: the callbacks' error strings.
std::string staged(cudaError_t e, const char* what) {
  return e == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(e);
}
std::string staged(int e, const char* what) { return e == MPI_SUCCESS ? std::string() : std::string(what) + " failed"; }

// MPI_COMM_WORLD for CUDA tensors through host buffers: the ranks may share a GPU.
std::shared_ptr<cp::Communicator> make_staged_cuda_world() {
  cp::CollectiveCallbacks cb;
  cb.all_gather = [](void* out, const void* in, size_t bytes, void* stream) -> std::string {
    if (bytes > static_cast<size_t>(INT32_MAX)) return "all_gather: more than 2^31 bytes";
    const int P = nranks();
    std::vector<char> mine(bytes), all(bytes * static_cast<size_t>(P));
    const auto s = static_cast<cudaStream_t>(stream);
    std::string e = staged(cudaMemcpyAsync(mine.data(), in, bytes, cudaMemcpyDeviceToHost, s), "all_gather: copy in");
    if (e.empty()) e = staged(cudaStreamSynchronize(s), "all_gather: wait");
    if (e.empty())
      e = staged(MPI_Allgather(mine.data(), static_cast<int>(bytes), MPI_BYTE, all.data(), static_cast<int>(bytes),
                               MPI_BYTE, MPI_COMM_WORLD),
                 "MPI_Allgather");
    if (e.empty()) e = staged(cudaMemcpyAsync(out, all.data(), all.size(), cudaMemcpyHostToDevice, s), "copy out");
    if (e.empty()) e = staged(cudaStreamSynchronize(s), "all_gather: wait");
    return e;
  };
  cb.broadcast = [](void* data, size_t bytes, int root, void* stream) -> std::string {
    if (bytes > static_cast<size_t>(INT32_MAX)) return "broadcast: more than 2^31 bytes";
    std::vector<char> h(bytes);
    const auto s = static_cast<cudaStream_t>(stream);
    std::string e = staged(cudaMemcpyAsync(h.data(), data, bytes, cudaMemcpyDeviceToHost, s), "broadcast: copy in");
    if (e.empty()) e = staged(cudaStreamSynchronize(s), "broadcast: wait");
    if (e.empty())
      e = staged(MPI_Bcast(h.data(), static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
    if (e.empty()) e = staged(cudaMemcpyAsync(data, h.data(), bytes, cudaMemcpyHostToDevice, s), "broadcast: copy out");
    if (e.empty()) e = staged(cudaStreamSynchronize(s), "broadcast: wait");
    return e;
  };
  cb.send_recv = [](const void* send, size_t sb, int dst, void* recv, size_t rb, int src, void* stream) -> std::string {
    if (sb > static_cast<size_t>(INT32_MAX) || rb > static_cast<size_t>(INT32_MAX)) return "send_recv: too large";
    std::vector<char> hs(sb), hr(rb);
    const auto s = static_cast<cudaStream_t>(stream);
    std::string e = sb ? staged(cudaMemcpyAsync(hs.data(), send, sb, cudaMemcpyDeviceToHost, s), "send_recv: copy in")
                       : std::string();
    if (e.empty()) e = staged(cudaStreamSynchronize(s), "send_recv: wait");
    if (e.empty())
      e = staged(MPI_Sendrecv(hs.data(), static_cast<int>(sb), MPI_BYTE, dst < 0 ? MPI_PROC_NULL : dst, 0, hr.data(),
                              static_cast<int>(rb), MPI_BYTE, src < 0 ? MPI_PROC_NULL : src, 0, MPI_COMM_WORLD,
                              MPI_STATUS_IGNORE),
                 "MPI_Sendrecv");
    if (e.empty() && rb) e = staged(cudaMemcpyAsync(recv, hr.data(), rb, cudaMemcpyHostToDevice, s), "copy out");
    if (e.empty()) e = staged(cudaStreamSynchronize(s), "send_recv: wait");
    return e;
  };
  return cp::make_callback_communicator(std::move(cb), rank(), nranks(), Device::cuda);
}

}  // namespace
}  // namespace test
}  // namespace gdncp
#endif

int main(int argc, char** argv) {
  using namespace gdncp;
  auto setup = [] {
#if GDNCP_WITH_CUDA
    int ok = cuda_device_count() >= test::nranks() ? 1 : 0, all = 0, gpu = cuda_available() ? 1 : 0, any = 0;
    GDNCP_MPI_CHECK(MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    GDNCP_MPI_CHECK(MPI_Allreduce(&gpu, &any, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    if (all)
      test::nccl_world() = cp::make_nccl_communicator(MPI_COMM_WORLD);  // sets this rank's device
    else if (any)
      test::nccl_world() = test::make_staged_cuda_world();  // ranks sharing GPUs
    else
      return;
    test::nccl_world()->set_timeout_seconds(120);
#endif
  };
  return test::run_mpi_tests(argc, argv, setup, [] { test::nccl_world().reset(); });
}
