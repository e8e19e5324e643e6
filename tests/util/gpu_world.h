// tests/util/gpu_world.h — the CP group of the multi-rank GPU tests: NCCL over MPI_COMM_WORLD
// where every rank has a GPU of its own, else (ranks sharing GPUs, as on a one-GPU machine)
// MPI_COMM_WORLD for CUDA tensors through host buffers (a callback communicator), so that
// P = 1 … 4 ranks run on one GPU. Null without CUDA or a GPU: the tests skip.
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gdncp/cp.h"
#include "gdncp/gdncp.h"
#include "mpi_cp_fixtures.h"

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>

#include "gdncp/cp_nccl.h"
#endif

namespace gdncp {
namespace test {

#if GDNCP_WITH_CUDA
namespace staged_detail {

// "" or what failed: the callbacks' error strings.
inline std::string staged(cudaError_t e, const char* what) {
  return e == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(e);
}
inline std::string staged(int e, const char* what) {
  return e == MPI_SUCCESS ? std::string() : std::string(what) + " failed";
}

// Collective `call` on CUDA memory through host buffers: hin.size() bytes of `in` to hin, the
// MPI call `mpi_name` on the host buffers, then hout.size() bytes of hout to `out`, each copy
// waited for; hout may be hin (in place).
inline std::string via_host(const char* call, void* stream, const void* in, std::vector<char>& hin, void* out,
                            std::vector<char>& hout, const char* mpi_name, const std::function<int()>& mpi) {
  const auto s = static_cast<cudaStream_t>(stream);
  std::string e;
  if (!hin.empty()) e = staged(cudaMemcpyAsync(hin.data(), in, hin.size(), cudaMemcpyDeviceToHost, s), "copy in");
  if (e.empty()) e = staged(cudaStreamSynchronize(s), "wait");
  if (e.empty()) e = staged(mpi(), mpi_name);
  if (e.empty() && !hout.empty())
    e = staged(cudaMemcpyAsync(out, hout.data(), hout.size(), cudaMemcpyHostToDevice, s), "copy out");
  if (e.empty()) e = staged(cudaStreamSynchronize(s), "wait");
  return e.empty() ? e : std::string(call) + ": " + e;
}

// MPI_COMM_WORLD for CUDA tensors through host buffers: the ranks may share a GPU.
inline std::shared_ptr<cp::Communicator> make_staged_cuda_world() {
  int rank = 0, P = 0;
  GDNCP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  GDNCP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &P));
  cp::CollectiveCallbacks cb;
  cb.all_gather = [P](void* out, const void* in, size_t bytes, void* stream) -> std::string {
    if (bytes > static_cast<size_t>(INT32_MAX)) return "all_gather: more than 2^31 bytes";
    std::vector<char> mine(bytes), all(bytes * static_cast<size_t>(P));
    return via_host("all_gather", stream, in, mine, out, all, "MPI_Allgather", [&] {
      return MPI_Allgather(mine.data(), static_cast<int>(bytes), MPI_BYTE, all.data(), static_cast<int>(bytes),
                           MPI_BYTE, MPI_COMM_WORLD);
    });
  };
  cb.broadcast = [](void* data, size_t bytes, int root, void* stream) -> std::string {
    if (bytes > static_cast<size_t>(INT32_MAX)) return "broadcast: more than 2^31 bytes";
    std::vector<char> h(bytes);
    return via_host("broadcast", stream, data, h, data, h, "MPI_Bcast",
                    [&] { return MPI_Bcast(h.data(), static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD); });
  };
  cb.send_recv = [](const void* send, size_t sb, int dst, void* recv, size_t rb, int src, void* stream) -> std::string {
    if (sb > static_cast<size_t>(INT32_MAX) || rb > static_cast<size_t>(INT32_MAX)) return "send_recv: too large";
    std::vector<char> hs(sb), hr(rb);
    return via_host("send_recv", stream, send, hs, recv, hr, "MPI_Sendrecv", [&] {
      return MPI_Sendrecv(hs.data(), static_cast<int>(sb), MPI_BYTE, dst < 0 ? MPI_PROC_NULL : dst, 0, hr.data(),
                          static_cast<int>(rb), MPI_BYTE, src < 0 ? MPI_PROC_NULL : src, 0, MPI_COMM_WORLD,
                          MPI_STATUS_IGNORE);
    });
  };
  return cp::make_callback_communicator(std::move(cb), rank, P, Device::cuda);
}

}  // namespace staged_detail
#endif

// The group of every rank of MPI_COMM_WORLD for CUDA tensors, or null (no CUDA, or a rank
// without a GPU). Collective over MPI_COMM_WORLD.
inline std::shared_ptr<cp::Communicator> make_gpu_world() {
#if GDNCP_WITH_CUDA
  int size = 0;
  GDNCP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  int ok = cuda_device_count() >= size ? 1 : 0, all = 0, gpu = cuda_available() ? 1 : 0, any = 0;
  GDNCP_MPI_CHECK(MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  GDNCP_MPI_CHECK(MPI_Allreduce(&gpu, &any, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  std::shared_ptr<cp::Communicator> c;
  if (all)
    c = cp::make_nccl_communicator(MPI_COMM_WORLD);  // sets this rank's device
  else if (any)
    c = staged_detail::make_staged_cuda_world();  // ranks sharing GPUs
  if (c) c->set_timeout_seconds(120);
  return c;
#else
  return nullptr;
#endif
}

// The main() of a multi-rank GPU test binary: nccl_world() is the GPU group while its tests run.
inline int run_gpu_mpi_tests(int argc, char** argv) {
  return run_mpi_tests(
      argc, argv, [] { nccl_world() = make_gpu_world(); }, [] { nccl_world().reset(); });
}

}  // namespace test
}  // namespace gdncp
