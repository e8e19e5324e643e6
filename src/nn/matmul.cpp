// src/nn/matmul.cpp — y (..., N) = x (..., K) · w (K, N), differentiable.
//
// Forward and backward are the same row-major GEMM twin with different
// transposes (x viewed as (M, K), M = rows of x):
//   y  = x · w          (M, N)
//   dx = dy · wᵀ        (M, K)   overwritten (a fresh tensor per backward)
//   dw = xᵀ · dy        (K, N)   fresh; the engine accumulates it into w.grad
#include "gdncp/autograd.h"
#include "gdncp/nn.h"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace nn {
namespace {

class MatmulNode : public autograd::Node {
 public:
  MatmulNode(int64_t M, int64_t K, int64_t N) : M_(M), K_(K), N_(N) {}
  const char* name() const override { return "matmul"; }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& x = saved(0);
    const Tensor& w = saved(1);
    const Tensor dy = grads[0].dtype() == x.dtype() ? grads[0] : grads[0].to(x.dtype());
    Tensor dx, dw;
    if (needs_input_grad(0)) {
      dx = Tensor::empty(x.shape(), x.dtype(), x.device());
      GDNCP_NN_TWIN(x.device(), gemm, dx, dy, w, false, true, M_, K_, N_);
    }
    if (needs_input_grad(1)) {
      dw = Tensor::empty(w.shape(), w.dtype(), w.device());
      GDNCP_NN_TWIN(x.device(), gemm, dw, x, dy, true, false, K_, N_, M_);
    }
    return {dx, dw};
  }

 private:
  int64_t M_, K_, N_;
};

}  // namespace

Tensor matmul(const Tensor& x, const Tensor& w) {
  detail::check_nn_input("matmul", "x", x);
  detail::check_nn_input("matmul", "w", w);
  GDNCP_CHECK(x.dim() >= 1, "matmul: x must have at least one axis, got ", x.str());
  GDNCP_CHECK(w.dim() == 2, "matmul: w must be (K, N), got ", w.str());
  GDNCP_CHECK(x.dtype() == w.dtype(), "matmul: x is ", dtype_name(x.dtype()), " but w is ", dtype_name(w.dtype()));
  GDNCP_CHECK(x.device() == w.device(), "matmul: x is on ", device_name(x.device()), " but w on ",
              device_name(w.device()));
  const int64_t K = w.size(0), N = w.size(1);
  GDNCP_CHECK(x.size(-1) == K, "matmul: x's last axis (", x.size(-1), ") must equal w's rows K = ", K, "; x ", x.str(),
              ", w ", w.str());
  GDNCP_CHECK(K > 0 && N > 0, "matmul: w must have non-empty axes, got ", w.str());
  GDNCP_CHECK(x.numel() > 0, "matmul: x has no rows, got ", x.str());
  const int64_t M = x.numel() / K;
  Shape y_shape = x.shape();
  y_shape.back() = N;
  Tensor y = Tensor::empty(y_shape, x.dtype(), x.device());
  GDNCP_NN_TWIN(x.device(), gemm, y, x, w, false, false, M, N, K);

  if (autograd::should_record({x, w})) {
    auto node = std::make_shared<MatmulNode>(M, K, N);
    node->save(x);
    node->save(w);
    autograd::record(node, {x, w}, {y});
  }
  return y;
}

}  // namespace nn
}  // namespace gdncp
