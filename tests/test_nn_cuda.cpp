// tests/test_nn_cuda.cpp — CUDA twins of the generic ops and AdamW against
// their CPU twins on the same seeded inputs, outputs poisoned before launch.
// Skips without a device (and in builds without CUDA).
//
// Tolerances (util/tolerance.h): f32 tol::f32 (different summation orders / FMA on the
// device, f32 rounding); bf16 tol::bf16_vs_f64 (outputs rounded to 8 mantissa bits, and
// cuBLAS may order the f32 accumulation differently before that rounding).
#include "gdncp/nn.h"
#include "gdncp/optim.h"
#include "nn/nn_kernels.h"
#include "util/test_util.h"

namespace gdncp {
namespace {

#if GDNCP_WITH_CUDA

double tol_for(DType dt) { return dt == DType::f32 ? test::tol::f32 : test::tol::bf16_vs_f64; }

#define SKIP_WITHOUT_CUDA() \
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device"

Tensor poisoned(const Shape& s, DType dt) {
  Tensor t = Tensor::empty(s, dt, Device::cuda);
  test::poison(t);
  return t;
}

class NnCuda : public ::testing::TestWithParam<DType> {};

TEST_P(NnCuda, GemmAllTransposesMatchCpu) {
  SKIP_WITHOUT_CUDA();
  const DType dt = GetParam();
  const int64_t M = 37, N = 19, K = 53;  // not multiples of any tile
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const Tensor a = Tensor::randn(ta ? Shape{K, M} : Shape{M, K}, dt, Device::cpu, 1);
      const Tensor b = Tensor::randn(tb ? Shape{N, K} : Shape{K, N}, dt, Device::cpu, 2);
      Tensor c_cpu = Tensor::empty({M, N}, dt);
      cpu::gemm(c_cpu, a, b, ta, tb, M, N, K);
      Tensor c = poisoned({M, N}, dt);
      cuda::gemm(c, a.to(Device::cuda), b.to(Device::cuda), ta, tb, M, N, K);
      EXPECT_FALSE(test::has_nonfinite(c));
      EXPECT_TRUE(
          test::close_rel(c, c_cpu, tol_for(dt), "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb)));
    }
}

TEST_P(NnCuda, ElementwiseTwinsMatchCpu) {
  SKIP_WITHOUT_CUDA();
  const DType dt = GetParam();
  const int64_t A = 3, R = 70, S = 33;
  const Tensor x = Tensor::randn({A, R, S}, dt, Device::cpu, 3, 2.0), xd = x.to(Device::cuda);
  const Tensor dy = Tensor::randn({A, R, S}, dt, Device::cpu, 4), dyd = dy.to(Device::cuda);

  Tensor y_cpu = Tensor::empty({A, R, S}, dt), y = poisoned({A, R, S}, dt);
  cpu::sigmoid_fwd(y_cpu, x);
  cuda::sigmoid_fwd(y, xd);
  EXPECT_TRUE(test::close_rel(y, y_cpu, tol_for(dt), "sigmoid_fwd"));
  Tensor dx_cpu = Tensor::empty({A, R, S}, dt), dx = poisoned({A, R, S}, dt);
  cpu::sigmoid_bwd(dx_cpu, dy, y_cpu);
  cuda::sigmoid_bwd(dx, dyd, y_cpu.to(Device::cuda));
  EXPECT_TRUE(test::close_rel(dx, dx_cpu, tol_for(dt), "sigmoid_bwd"));

  Tensor m_cpu = Tensor::empty({A, R}, dt), m = poisoned({A, R}, dt);
  cpu::frame_mean_fwd(m_cpu, x, A * R, S);
  cuda::frame_mean_fwd(m, xd, A * R, S);
  EXPECT_TRUE(test::close_rel(m, m_cpu, tol_for(dt), "frame_mean_fwd"));
  const Tensor dm = Tensor::randn({A, R}, dt, Device::cpu, 5);
  Tensor dmx_cpu = Tensor::empty({A, R, S}, dt), dmx = poisoned({A, R, S}, dt);
  cpu::frame_mean_bwd(dmx_cpu, dm, A * R, S);
  cuda::frame_mean_bwd(dmx, dm.to(Device::cuda), A * R, S);
  EXPECT_TRUE(test::close_rel(dmx, dmx_cpu, tol_for(dt), "frame_mean_bwd"));

  Tensor t_cpu = Tensor::empty({A, S, R}, dt), t = poisoned({A, S, R}, dt);
  cpu::transpose_last2(t_cpu, x, A, R, S);
  cuda::transpose_last2(t, xd, A, R, S);
  EXPECT_TRUE(test::bitwise_equal(t, t_cpu)) << "transpose is a copy: bitwise";

  const Tensor target = Tensor::randn({A, R, S}, dt, Device::cpu, 6);
  Tensor l_cpu = Tensor::empty({1}, DType::f32), l = poisoned({1}, DType::f32);
  cpu::mse_fwd(l_cpu, x, target, 1.0 / 1000);
  cuda::mse_fwd(l, xd, target.to(Device::cuda), 1.0 / 1000);
  EXPECT_TRUE(test::close_rel(l, l_cpu, test::tol::f32_short, "mse_fwd"));  // both sum in f64, one f32 rounding
  const Tensor dl = Tensor::full({1}, 0.7, DType::f32);
  Tensor dp_cpu = Tensor::empty({A, R, S}, dt), dp = poisoned({A, R, S}, dt);
  cpu::mse_bwd(dp_cpu, dl, x, target, 1.0 / 1000);
  cuda::mse_bwd(dp, dl.to(Device::cuda), xd, target.to(Device::cuda), 1.0 / 1000);
  EXPECT_TRUE(test::close_rel(dp, dp_cpu, tol_for(dt), "mse_bwd"));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NnCuda, ::testing::Values(DType::f32, DType::bf16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

TEST(NnCudaOps, ForwardBackwardThroughTheTapeMatchCpuAndRepeatBitwise) {
  SKIP_WITHOUT_CUDA();
  auto run = [](Device dev) {
    Tensor x = Tensor::randn({2, 12, 8}, DType::f32, dev, 7).requires_grad_();
    Tensor w = Tensor::randn({8, 8}, DType::f32, dev, 8, 0.3).requires_grad_();
    Tensor wg = Tensor::randn({8, 2}, DType::f32, dev, 9).requires_grad_();
    const Tensor target = Tensor::randn({2, 12, 8}, DType::f32, dev, 10);
    Tensor g = nn::sigmoid(nn::frame_mean(nn::transpose_last2(nn::matmul(x, wg)).reshape({2, 2, 3, 4})));
    Tensor y = nn::add(x, nn::matmul(x, w));
    Tensor loss = nn::add(nn::mse_loss(y, target), nn::mse_loss(g, Tensor::full(g.shape(), 0.5, DType::f32, dev)));
    backward(loss);
    return std::vector<Tensor>{loss.detach(), x.grad(), w.grad(), wg.grad()};
  };
  const auto ref = run(Device::cpu), a = run(Device::cuda), b = run(Device::cuda);
  const char* names[] = {"loss", "dx", "dw", "dwg"};
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(test::close_rel(a[i], ref[i], test::tol::f32, names[i]));
    EXPECT_TRUE(test::bitwise_equal(a[i], b[i])) << names[i] << " differs between two CUDA runs";
  }
}

TEST(NnCudaOps, AdamWMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  optim::AdamWOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.1;
  Tensor pc = Tensor::randn({1000}, DType::f32, Device::cpu, 11).requires_grad_();
  Tensor pd = pc.to(Device::cuda).requires_grad_();
  optim::AdamW oc({pc}, o), od({pd}, o);
  for (int step = 0; step < 3; ++step) {
    const Tensor t = Tensor::randn({1000}, DType::f32, Device::cpu, 20 + step);
    oc.zero_grad();
    od.zero_grad();
    backward(nn::mse_loss(pc, t));
    backward(nn::mse_loss(pd, t.to(Device::cuda)));
    oc.step(0.5);
    od.step(0.5);
  }
  EXPECT_TRUE(test::close_rel(pd.detach(), pc.detach(), test::tol::f32_short, "param"));
  EXPECT_TRUE(test::close_rel(od.exp_avg_sq()[0], oc.exp_avg_sq()[0], test::tol::f32, "v"));
}

TEST(NnCudaOps, F64OnCudaIsRejected) {
  SKIP_WITHOUT_CUDA();
  const Tensor x = Tensor::randn({2, 2}, DType::f64, Device::cpu, 12).to(Device::cuda);
  EXPECT_THROW(nn::sigmoid(x), Error);
  EXPECT_THROW(nn::matmul(x, x), Error);
}

#else

TEST(NnCuda, SkippedWithoutCudaBuild) { GTEST_SKIP() << "gdncp built without CUDA"; }

#endif

}  // namespace
}  // namespace gdncp
