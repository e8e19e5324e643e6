// src/reference/ops_common.h — the autograd plumbing shared by the plain-loop
// reference ops (src/reference/ops_*.cpp): each op is one node that keeps its
// inputs, recomputes from them in backward in the inputs' dtype (f64 or f32),
// and returns fresh gradients shaped like the saved inputs.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

#include "gdncp/autograd.h"
#include "gdncp/ops.h"
#include "kernels/common/cpu_common.h"

namespace gdncp {
namespace ops {
namespace detail {

// (B, N, H, D) sizes of a per-token tensor, with the offset of row (b, n, h).
struct TokenRows {
  int64_t B, N, H, D;
  int64_t rows() const { return B * N * H; }
  size_t row(int64_t b, int64_t n, int64_t h) const { return static_cast<size_t>(((b * N + n) * H + h) * D); }
};

// One input of a reference op and the name its errors give it.
struct NamedInput {
  const Tensor& t;
  const char* name;
};

// cpu::detail::require_cpu on each input, in order.
inline void require_cpu_inputs(const char* op, std::initializer_list<NamedInput> inputs) {
  for (const NamedInput& in : inputs) cpu::detail::require_cpu(in.t, op, in.name);
}

// Base of a reference op's node, named `name`: backward runs the public
// Derived::run<T>(grads) with T the dtype of saved(0) (double for f64, float
// otherwise).
template <typename Derived>
class RefNode : public autograd::Node {
 public:
  explicit RefNode(const char* name) : name_(name) {}
  const char* name() const override { return name_; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    Derived& self = static_cast<Derived&>(*this);
    return saved(0).dtype() == DType::f64 ? self.template run<double>(grads) : self.template run<float>(grads);
  }

 protected:
  // The gradients of inputs 0, 1, ... (in record order, each saved at the same
  // index) as fresh tensors of the saved input's shape and dtype; undefined
  // where the input needs none.
  template <typename T>
  std::vector<Tensor> grads_like_saved(std::initializer_list<const std::vector<T>*> grads) const {
    std::vector<Tensor> out(grads.size());
    size_t i = 0;
    for (const std::vector<T>* g : grads) {
      if (needs_input_grad(i)) out[i] = cpu::detail::tensor_from(*g, saved(i).shape(), saved(i).dtype());
      ++i;
    }
    return out;
  }

 private:
  const char* name_;
};

// Base of the node of an op over F frames of S tokens each.
template <typename Derived>
class FramesNode : public RefNode<Derived> {
 public:
  FramesNode(const char* name, int64_t F, int64_t S) : RefNode<Derived>(name), F_(F), S_(S) {}

 protected:
  const int64_t F_, S_;
};

// Records NodeT(args...) for out = op(inputs) when autograd asks for it,
// saving every input in order (saved(i) is inputs[i]).
template <typename NodeT, typename... Args>
void record_saving_inputs(const std::vector<Tensor>& inputs, const std::vector<Tensor>& out, Args&&... args) {
  if (!autograd::should_record(inputs)) return;
  auto node = std::make_shared<NodeT>(std::forward<Args>(args)...);
  for (const Tensor& t : inputs) node->save(t);
  autograd::record(node, inputs, out);
}

// The body of a reference op with several outputs: out = fwd(T{}) with T the
// compute type of inputs[0] (double for f64, float otherwise), then
// record_saving_inputs<NodeT>(inputs, out, node_args...).
template <typename NodeT, typename Fwd, typename... Args>
std::vector<Tensor> run_and_record(const std::vector<Tensor>& inputs, Fwd&& fwd, Args&&... node_args) {
  std::vector<Tensor> out = inputs[0].dtype() == DType::f64 ? fwd(double{}) : fwd(float{});
  record_saving_inputs<NodeT>(inputs, out, std::forward<Args>(node_args)...);
  return out;
}

}  // namespace detail
}  // namespace ops
}  // namespace gdncp
