// src/nn/cast.cpp — y = x in another dtype, differentiable.
//
// The conversion is Tensor::to (round to nearest even into bf16); backward
// casts dy back to x's dtype (fresh tensor).
#include "gdncp/autograd.h"
#include "gdncp/nn.h"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace nn {
namespace {

class CastNode : public autograd::Node {
 public:
  explicit CastNode(DType from) : from_(from) {}
  const char* name() const override { return "cast"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override { return {grads[0].to(from_)}; }

 private:
  DType from_;
};

}  // namespace

Tensor cast(const Tensor& x, DType dtype) {
  detail::check_nn_input("cast", "x", x);
  GDNCP_CHECK(!(dtype == DType::f64 && x.is_cuda()), "cast: f64 is CPU-only, x is on CUDA");
  if (x.dtype() == dtype) return x;
  Tensor y = x.to(dtype);
  if (autograd::should_record({x})) autograd::record(std::make_shared<CastNode>(x.dtype()), {x}, {y});
  return y;
}

}  // namespace nn
}  // namespace gdncp
