// Tests of Tensor: factories, seeded fills, conversions, copies, devices.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "util/test_util.h"

namespace gdncp {
namespace {

TEST(Tensor, ShapeAndMetadata) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::bf16);
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.str(), "bf16[2, 3, 4] cpu");
  EXPECT_THROW(t.size(3), Error);
  EXPECT_THROW(Tensor::empty({2, -1}, DType::f32), Error);
  Tensor u;
  EXPECT_FALSE(u.defined());
  EXPECT_THROW(u.shape(), Error);
}

TEST(Tensor, SeededFillsAreReproducibleAndDistinct) {
  Tensor a = Tensor::randn({1000}, DType::f64, Device::cpu, 42);
  Tensor b = Tensor::randn({1000}, DType::f64, Device::cpu, 42);
  Tensor c = Tensor::randn({1000}, DType::f64, Device::cpu, 43);
  EXPECT_TRUE(test::bitwise_equal(a, b));
  EXPECT_FALSE(test::bitwise_equal(a, c));
  double mean = 0, var = 0;
  for (double v : a.to_vector()) mean += v / 1000;
  for (double v : a.to_vector()) var += (v - mean) * (v - mean) / 1000;
  EXPECT_NEAR(mean, 0.0, 0.15);
  EXPECT_NEAR(var, 1.0, 0.15);
  // Element i depends only on (seed, i): a prefix of a longer fill is the shorter fill.
  Tensor d = Tensor::randn({10}, DType::f64, Device::cpu, 42);
  auto av = a.to_vector(), dv = d.to_vector();
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(av[i], dv[i]);
  // Large fills run on several threads; the values are those of the serial fill.
  Tensor big = Tensor::randn({3, 400000}, DType::f32, Device::cpu, 42);
  auto bv = big.to_vector();
  Tensor a32 = a.to(DType::f32);
  auto a32v = a32.to_vector();
  for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(bv[i], a32v[i]);
  Tensor tail = Tensor::randn({3, 400000}, DType::f32, Device::cpu, 42);
  EXPECT_TRUE(test::bitwise_equal(big, tail));
  Tensor u = Tensor::uniform({500}, DType::f32, Device::cpu, 7, 0.25, 0.75);
  for (double v : u.to_vector()) {
    EXPECT_GE(v, 0.25);
    EXPECT_LT(v, 0.75);
  }
}

TEST(Tensor, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256)), 1.0f);  // tie: rounds to even
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  Tensor x = Tensor::from_vector({1.0, -2.5, 3.14159}, {3}, DType::bf16);
  auto v = x.to_vector();
  EXPECT_EQ(v[0], 1.0);
  EXPECT_EQ(v[1], -2.5);
  EXPECT_NEAR(v[2], 3.14159, 3.14159 / 128);
}

TEST(Tensor, ConversionsAndCopies) {
  Tensor a = Tensor::randn({4, 5}, DType::f64, Device::cpu, 1);
  Tensor f = a.to(DType::f32);
  EXPECT_EQ(f.dtype(), DType::f32);
  EXPECT_LE(test::rel_l2(f, a), test::tol::f32_rounding);
  Tensor c = a.clone();
  EXPECT_NE(c.data(), a.data());
  EXPECT_TRUE(test::bitwise_equal(a, c));
  Tensor z = Tensor::zeros({4, 5}, DType::f64);
  z.copy_from(a);
  EXPECT_TRUE(test::bitwise_equal(a, z));
  EXPECT_THROW(z.copy_from(f), Error);
  EXPECT_THROW(Tensor::from_vector({1, 2}, {3}, DType::f32), Error);
  EXPECT_EQ(Tensor::full({1}, 2.5, DType::f32).item(), 2.5);
}

TEST(Tensor, DetachSharesStorageNotHistory) {
  Tensor x = Tensor::randn({3}, DType::f64, Device::cpu, 2).requires_grad_();
  Tensor d = x.detach();
  EXPECT_EQ(d.data(), x.data());
  EXPECT_FALSE(d.requires_grad());
  EXPECT_NE(d.id(), x.id());
}

TEST(TensorCuda, RoundTripAndSeededFillMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    Tensor h = Tensor::randn({3, 1000}, dt, Device::cpu, 99);
    Tensor g = Tensor::randn({3, 1000}, dt, Device::cuda, 99);
    EXPECT_TRUE(test::bitwise_equal(h, g.to(Device::cpu))) << dtype_name(dt);
    Tensor back = h.to(Device::cuda).to(Device::cpu);
    EXPECT_TRUE(test::bitwise_equal(h, back));
  }
  // Device cast agrees with the host cast bit for bit.
  Tensor x = Tensor::randn({4096}, DType::f32, Device::cpu, 5);
  EXPECT_TRUE(test::bitwise_equal(x.to(DType::bf16), x.to(Device::cuda).to(DType::bf16).to(Device::cpu)));
  Tensor p = Tensor::empty({777}, DType::f32, Device::cuda);
  test::poison(p);
  EXPECT_TRUE(test::has_nonfinite(p));
  p.fill_(1.5);
  EXPECT_FALSE(test::has_nonfinite(p));
  EXPECT_EQ(p.to_vector()[776], 1.5);
}

TEST(Tensor, FromBlobAliasesForeignMemoryAndRunsItsDeleterOnce) {
  std::vector<float> buf = {1, 2, 3, 4, 5, 6};
  int deleted = 0;
  {
    Tensor t = Tensor::from_blob(buf.data(), {2, 3}, DType::f32, Device::cpu, [&] { ++deleted; });
    EXPECT_EQ(t.str(), "f32[2, 3] cpu");
    EXPECT_EQ(t.data(), static_cast<void*>(buf.data()));  // no copy
    EXPECT_EQ(t.to_vector(), std::vector<double>({1, 2, 3, 4, 5, 6}));
    Tensor view = t.reshape({6});
    t = Tensor();
    EXPECT_EQ(deleted, 0) << "the storage is still viewed";
    view.fill_(0.5);  // writes land in the foreign buffer
    EXPECT_EQ(buf[4], 0.5f);
  }
  EXPECT_EQ(deleted, 1);
  // An empty deleter is allowed: the caller owns the memory.
  Tensor t = Tensor::from_blob(buf.data(), {3}, DType::f32, Device::cpu, nullptr);
  EXPECT_EQ(t.to_vector(), std::vector<double>({0.5, 0.5, 0.5}));
}

TEST(Tensor, VersionCountsInPlaceChangesOfTheStorage) {
  Tensor t = Tensor::randn({4}, DType::f32, Device::cpu, 3);
  const uint64_t v0 = t.version();
  Tensor view = t.reshape({2, 2});
  view.fill_(1.0);
  EXPECT_EQ(t.version(), v0 + 1);
  t.copy_from(Tensor::randn({4}, DType::f32, Device::cpu, 4));
  EXPECT_EQ(view.version(), v0 + 2);
  const Tensor other = t.clone();  // new storage, its own count
  EXPECT_EQ(t.version(), v0 + 2);
  (void)other;
}

TEST(TensorCuda, CachingAllocatorReusesBlocks) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  void* first = nullptr;
  {
    Tensor t = Tensor::empty({1 << 20}, DType::f32, Device::cuda);
    first = t.data();
  }
  const MemoryStats s = cuda_memory_stats();
  EXPECT_GE(s.cached, size_t(4) << 20);
  Tensor again = Tensor::empty({1 << 20}, DType::f32, Device::cuda);
  EXPECT_EQ(again.data(), first);
}

}  // namespace
}  // namespace gdncp
