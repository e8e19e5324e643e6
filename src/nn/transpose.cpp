// src/nn/transpose.cpp — swap of the last two axes, differentiable:
// x (A, M, N) -> y (A, N, M), y[a, n, m] = x[a, m, n]; a 2-D x is (1, M, N).
//
// Backward: dx = the inverse swap of dy (fresh tensor).
#include "gdncp/autograd.h"
#include "gdncp/nn.h"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace nn {
namespace {

class TransposeNode : public autograd::Node {
 public:
  TransposeNode(Shape x_shape, DType dtype, int64_t A, int64_t M, int64_t N)
      : x_shape_(std::move(x_shape)), dtype_(dtype), A_(A), M_(M), N_(N) {}
  const char* name() const override { return "transpose_last2"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor dy = grads[0].dtype() == dtype_ ? grads[0] : grads[0].to(dtype_);
    Tensor dx = Tensor::empty(x_shape_, dtype_, dy.device());
    GDNCP_NN_TWIN(dy.device(), transpose_last2, dx, dy, A_, N_, M_);
    return {dx};
  }

 private:
  Shape x_shape_;
  DType dtype_;
  int64_t A_, M_, N_;
};

}  // namespace

Tensor transpose_last2(const Tensor& x) {
  detail::check_nn_input("transpose_last2", "x", x);
  GDNCP_CHECK(x.dim() == 2 || x.dim() == 3, "transpose_last2: x must be (M, N) or (A, M, N), got ", x.str());
  const int64_t A = x.dim() == 3 ? x.size(0) : 1, M = x.size(-2), N = x.size(-1);
  Shape y_shape = x.shape();
  y_shape[y_shape.size() - 2] = N;
  y_shape[y_shape.size() - 1] = M;
  Tensor y = Tensor::empty(y_shape, x.dtype(), x.device());
  if (x.numel() > 0) GDNCP_NN_TWIN(x.device(), transpose_last2, y, x, A, M, N);
  if (autograd::should_record({x}))
    autograd::record(std::make_shared<TransposeNode>(x.shape(), x.dtype(), A, M, N), {x}, {y});
  return y;
}

}  // namespace nn
}  // namespace gdncp
