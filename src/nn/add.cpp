// src/nn/add.cpp — y = a + b (same shape), differentiable.
//
// The elementwise sum itself is the tensor core's detail::add (CPU loop or
// CUDA kernel), the one the engine sums gradients with. Backward hands dy to
// both inputs; the engine sums out of place, so sharing it is safe.
#include "autograd/tensor_math.h"
#include "gdncp/autograd.h"
#include "gdncp/nn.h"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace nn {
namespace {

class AddNode : public autograd::Node {
 public:
  const char* name() const override { return "add"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override { return {grads[0], grads[0]}; }
};

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  detail::check_nn_input("add", "a", a);
  detail::check_nn_input("add", "b", b);
  GDNCP_CHECK(a.shape() == b.shape(), "add: a ", a.str(), " and b ", b.str(), " differ in shape");
  GDNCP_CHECK(a.dtype() == b.dtype(), "add: a is ", dtype_name(a.dtype()), " but b is ", dtype_name(b.dtype()));
  GDNCP_CHECK(a.device() == b.device(), "add: a is on ", device_name(a.device()), " but b on ",
              device_name(b.device()));
  Tensor y = detail::add(a, b);
  if (autograd::should_record({a, b})) autograd::record(std::make_shared<AddNode>(), {a, b}, {y});
  return y;
}

}  // namespace nn
}  // namespace gdncp
