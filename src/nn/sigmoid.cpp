// src/nn/sigmoid.cpp — y = 1 / (1 + e^(−x)), differentiable.
//
// Backward: dx = dy · y · (1 − y), computed from the saved output (fresh
// tensor; the engine accumulates).
#include "gdncp/autograd.h"
#include "gdncp/nn.h"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace nn {
namespace {

class SigmoidNode : public autograd::Node {
 public:
  const char* name() const override { return "sigmoid"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& y = saved(0);
    const Tensor dy = grads[0].dtype() == y.dtype() ? grads[0] : grads[0].to(y.dtype());
    Tensor dx = Tensor::empty(y.shape(), y.dtype(), y.device());
    GDNCP_NN_TWIN(y.device(), sigmoid_bwd, dx, dy, y);
    return {dx};
  }
};

}  // namespace

Tensor sigmoid(const Tensor& x) {
  detail::check_nn_input("sigmoid", "x", x);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (x.numel() > 0) GDNCP_NN_TWIN(x.device(), sigmoid_fwd, y, x);
  if (autograd::should_record({x})) {
    auto node = std::make_shared<SigmoidNode>();
    node->save(y);
    autograd::record(node, {x}, {y});
  }
  return y;
}

}  // namespace nn
}  // namespace gdncp
