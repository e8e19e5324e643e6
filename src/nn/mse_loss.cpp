// src/nn/mse_loss.cpp — loss = Σ_i (pred_i − target_i)² / count, differentiable.
//
// loss is one element (shape (1)) in the compute dtype (f32; f64 for f64).
// Backward: dpred = 2·(pred − target)·dloss / count, dtarget = −dpred (fresh
// tensors; the engine accumulates).
#include "gdncp/autograd.h"
#include "gdncp/nn.h"
#include "nn/nn_kernels.h"

namespace gdncp {
namespace nn {
namespace {

class MseNode : public autograd::Node {
 public:
  explicit MseNode(double scale) : scale_(scale) {}
  const char* name() const override { return "mse_loss"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& pred = saved(0);
    const Tensor& target = saved(1);
    const DType cd = compute_dtype(pred.dtype());
    const Tensor dloss = grads[0].dtype() == cd ? grads[0] : grads[0].to(cd);
    Tensor dpred, dtarget;
    if (needs_input_grad(0)) {
      dpred = Tensor::empty(pred.shape(), pred.dtype(), pred.device());
      GDNCP_NN_TWIN(pred.device(), mse_bwd, dpred, dloss, pred, target, scale_);
    }
    if (needs_input_grad(1)) {  // the same rule with the roles swapped: 2·(target − pred)·dloss/count
      dtarget = Tensor::empty(pred.shape(), pred.dtype(), pred.device());
      GDNCP_NN_TWIN(pred.device(), mse_bwd, dtarget, dloss, target, pred, scale_);
    }
    return {dpred, dtarget};
  }

 private:
  double scale_;
};

}  // namespace

Tensor mse_loss(const Tensor& pred, const Tensor& target, int64_t count) {
  detail::check_nn_input("mse_loss", "pred", pred);
  detail::check_nn_input("mse_loss", "target", target);
  GDNCP_CHECK(pred.shape() == target.shape(), "mse_loss: pred ", pred.str(), " and target ", target.str(),
              " differ in shape");
  GDNCP_CHECK(pred.dtype() == target.dtype(), "mse_loss: pred is ", dtype_name(pred.dtype()), " but target is ",
              dtype_name(target.dtype()));
  GDNCP_CHECK(pred.device() == target.device(), "mse_loss: pred is on ", device_name(pred.device()), " but target on ",
              device_name(target.device()));
  GDNCP_CHECK(count >= 0, "mse_loss: count must be >= 0 (0 = pred.numel()), got ", count);
  const int64_t n = count == 0 ? pred.numel() : count;
  GDNCP_CHECK(n > 0, "mse_loss: pred is empty and no count was given");
  const double scale = 1.0 / static_cast<double>(n);
  Tensor loss = Tensor::empty({1}, compute_dtype(pred.dtype()), pred.device());
  GDNCP_NN_TWIN(pred.device(), mse_fwd, loss, pred, target, scale);
  if (autograd::should_record({pred, target})) {
    auto node = std::make_shared<MseNode>(scale);
    node->save(pred);
    node->save(target);
    autograd::record(node, {pred, target}, {loss});
  }
  return loss;
}

}  // namespace nn
}  // namespace gdncp
