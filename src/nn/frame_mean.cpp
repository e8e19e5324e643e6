// src/nn/frame_mean.cpp — mean over the last axis, differentiable:
// x (..., S) -> y (...), y[r] = (1/S) Σ_s x[r, s] (rows r of the leading axes).
// With x = (B, H, F, S) this is the mean over each frame's S tokens.
//
// Backward: dx[r, s] = dy[r] / S (fresh tensor; the engine accumulates).
#include "gdncp/autograd.h"
#include "gdncp/nn.h"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace nn {
namespace {

class FrameMeanNode : public autograd::Node {
 public:
  FrameMeanNode(Shape x_shape, DType dtype, Device device, int64_t R, int64_t S)
      : x_shape_(std::move(x_shape)), dtype_(dtype), device_(device), R_(R), S_(S) {}
  const char* name() const override { return "frame_mean"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor dy = grads[0].dtype() == dtype_ ? grads[0] : grads[0].to(dtype_);
    Tensor dx = Tensor::empty(x_shape_, dtype_, device_);
    GDNCP_NN_TWIN(device_, frame_mean_bwd, dx, dy, R_, S_);
    return {dx};
  }

 private:
  Shape x_shape_;
  DType dtype_;
  Device device_;
  int64_t R_, S_;
};

}  // namespace

Tensor frame_mean(const Tensor& x) {
  detail::check_nn_input("frame_mean", "x", x);
  GDNCP_CHECK(x.dim() >= 1, "frame_mean: x must have at least one axis, got ", x.str());
  const int64_t S = x.size(-1);
  GDNCP_CHECK(S > 0, "frame_mean: x's last axis (tokens per frame) must be > 0, got ", x.str());
  const int64_t R = x.numel() / S;
  Shape y_shape(x.shape().begin(), x.shape().end() - 1);
  if (y_shape.empty()) y_shape = {1};
  Tensor y = Tensor::empty(y_shape, x.dtype(), x.device());
  if (R > 0) GDNCP_NN_TWIN(x.device(), frame_mean_fwd, y, x, R, S);
  if (autograd::should_record({x}))
    autograd::record(std::make_shared<FrameMeanNode>(x.shape(), x.dtype(), x.device(), R, S), {x}, {y});
  return y;
}

}  // namespace nn
}  // namespace gdncp
