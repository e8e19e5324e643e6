// tests/mpi_test_cp_comm.cpp — the MPI communicator: every collective against
// values every rank can compute itself, results bitwise identical on all
// ranks, and argument errors.
// gdncp-mpi-np: 1 2 3 4
#include <cstring>
#include <string>
#include <vector>

#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {
namespace {

// Rank r's contribution: a seeded tensor, so every rank knows every other's.
Tensor contribution(int r, DType dt, int64_t n, uint64_t seed) {
  return Tensor::randn({n}, dt, Device::cpu, seed + 1000 * static_cast<uint64_t>(r));
}

TEST(MpiComm, RankAndSize) {
  int r = 0, p = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  EXPECT_EQ(world()->rank(), r);
  EXPECT_EQ(world()->size(), p);
  EXPECT_EQ(world()->device(), Device::cpu);
  EXPECT_STREQ(world()->backend(), "mpi");
  EXPECT_EQ(self()->size(), 1);
  EXPECT_GE(cp::local_rank(MPI_COMM_WORLD), 0);
  EXPECT_LT(cp::local_rank(MPI_COMM_WORLD), p);
}

TEST(MpiComm, AllGather) {
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    const int P = nranks();
    const Tensor in = contribution(rank(), dt, 7, 10);
    Tensor out = Tensor::empty({P, 7}, dt);
    poison(out);
    world()->all_gather(out, in);
    for (int r = 0; r < P; ++r)
      EXPECT_TRUE(bitwise_equal(slice(out, 0, r, r + 1).reshape({7}), contribution(r, dt, 7, 10)))
          << dtype_name(dt) << " block " << r;
  }
}

TEST(MpiComm, AllReduceSumIsTheRankOrderSumOnEveryRank) {
  for (DType dt : {DType::f32, DType::f64}) {
    const int P = nranks();
    Tensor t = contribution(rank(), dt, 33, 20);
    world()->all_reduce_sum(t);
    // Expected: Σ in rank order, in dt arithmetic.
    std::vector<double> acc = contribution(0, dt, 33, 20).to_vector();
    for (int r = 1; r < P; ++r) {
      const std::vector<double> c = contribution(r, dt, 33, 20).to_vector();
      for (size_t i = 0; i < acc.size(); ++i)
        acc[i] = dt == DType::f32 ? static_cast<double>(static_cast<float>(acc[i]) + static_cast<float>(c[i]))
                                  : acc[i] + c[i];
    }
    EXPECT_TRUE(bitwise_equal(t, Tensor::from_vector(acc, {33}, dt))) << dtype_name(dt);
    // And the same bits on every rank.
    Tensor all = Tensor::empty({P, 33}, dt);
    world()->all_gather(all, t);
    for (int r = 0; r < P; ++r) EXPECT_TRUE(bitwise_equal(slice(all, 0, r, r + 1).reshape({33}), t));
  }
  // bf16 sums in f32 and rounds once.
  Tensor b = Tensor::full({4}, 1.0, DType::bf16);
  world()->all_reduce_sum(b);
  for (double v : b.to_vector()) EXPECT_EQ(v, nranks());
}

TEST(MpiComm, Broadcast) {
  for (int root = 0; root < nranks(); ++root) {
    Tensor t = contribution(rank(), DType::f32, 5, 30);
    world()->broadcast(t, root);
    EXPECT_TRUE(bitwise_equal(t, contribution(root, DType::f32, 5, 30))) << "root " << root;
  }
}

TEST(MpiComm, SendRecvRing) {
  const int P = nranks(), r = rank();
  const Tensor send = contribution(r, DType::f64, 6, 40);
  Tensor recv = Tensor::empty({6}, DType::f64);
  poison(recv);
  // Halo to the left: send to r−1, receive from r+1 (the ends send or receive nothing).
  world()->send_recv(send, r > 0 ? r - 1 : -1, recv, r + 1 < P ? r + 1 : -1);
  if (r + 1 < P)
    EXPECT_TRUE(bitwise_equal(recv, contribution(r + 1, DType::f64, 6, 40)));
  else
    EXPECT_TRUE(has_nonfinite(recv)) << "nothing received: recv untouched";
}

TEST(MpiComm, AllGatherHostAndBarrier) {
  struct Rec {
    int64_t a;
    double b;
    char c[5];
  };
  Rec mine{rank() * 3 + 1, rank() * 0.5, "abcd"};
  std::vector<Rec> all(static_cast<size_t>(nranks()));
  world()->all_gather_host(all.data(), &mine, sizeof(Rec));
  for (int r = 0; r < nranks(); ++r) {
    EXPECT_EQ(all[static_cast<size_t>(r)].a, r * 3 + 1);
    EXPECT_EQ(all[static_cast<size_t>(r)].b, r * 0.5);
    EXPECT_STREQ(all[static_cast<size_t>(r)].c, "abcd");
  }
  world()->barrier();
  EXPECT_GE(world()->stats().calls, 2);
}

TEST(MpiComm, ArgumentErrors) {
  Tensor in = Tensor::zeros({3}, DType::f32);
  Tensor wrong = Tensor::zeros({nranks() * 3 + 1}, DType::f32);
  EXPECT_THROW(world()->all_gather(wrong, in), Error);
  Tensor wrong_dt = Tensor::zeros({nranks() * 3}, DType::f64);
  EXPECT_THROW(world()->all_gather(wrong_dt, in), Error);
  EXPECT_THROW(world()->broadcast(in, nranks()), Error);
  EXPECT_THROW(world()->send_recv(in, nranks() + 2, in, -1), Error);
  Tensor undefined;
  EXPECT_THROW(world()->all_reduce_sum(undefined), Error);
  if (cuda_available()) {
    Tensor g = Tensor::zeros({3}, DType::f32, Device::cuda);
    EXPECT_THROW(world()->all_reduce_sum(g), Error);
  }
  // Nothing was sent: the communicator is still in step.
  Tensor t = Tensor::full({2}, 1.0, DType::f32);
  world()->all_reduce_sum(t);
  for (double v : t.to_vector()) EXPECT_EQ(v, nranks());
  EXPECT_FALSE(world()->aborted());
}

TEST(MpiComm, NcclWithoutGpuIsAnError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "GPUs present: the NCCL tests cover it";
  try {
    cp::make_nccl_communicator(MPI_COMM_WORLD);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("without CUDA") != std::string::npos || msg.find("CUDA devices") != std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
