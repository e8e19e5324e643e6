// src/autograd/checkpoint.cpp — activation checkpointing (docs/design.md §7).
//
// Forward runs fn with grad mode off, so none of its intermediates is saved;
// one CheckpointNode keeps only the inputs. Its backward re-runs fn with grad
// mode on, on a tape of its own, over detached copies of the inputs, and
// back-propagates the output gradients through that sub-tape. The recomputed
// forward is the same code on the same inputs, so the gradients are bitwise
// those of the un-checkpointed graph (for inputs used only inside fn).
//
// Memory in backward: the node lets go of fn (and whatever its closure keeps
// for the recompute) as soon as the recompute has run, so the sub-backward's
// peak carries only the rebuilt graph; a layer's recompute may return its
// outputs shape-only (Note [checkpoint recompute]).
#include "autograd/tape.h"
#include "autograd/tensor_internals.h"
#include "gdncp/autograd.h"
#include "gdncp/error.h"

namespace gdncp {
namespace autograd {

const char* checkpoint_name(Checkpoint mode) {
  switch (mode) {
    case Checkpoint::off: return "off";
    case Checkpoint::on: return "on";
    case Checkpoint::automatic: return "auto";
  }
  return "?";
}

bool resolve_checkpoint(Checkpoint mode, const std::vector<Tensor>& inputs) {
  if (mode == Checkpoint::automatic) return should_record(inputs);
  return mode == Checkpoint::on;
}

namespace {

class CheckpointNode : public Node {
 public:
  CheckpointNode(Function fn, const std::vector<Tensor>& inputs) : fn_(std::move(fn)) {
    for (const Tensor& t : inputs) {
      save(t);
      requires_grad_.push_back(t.defined() && t.requires_grad());
    }
  }
  const char* name() const override { return "checkpoint"; }

  std::vector<Tensor> backward(const std::vector<Tensor>& grad_outputs) override {
    GDNCP_CHECK(fn_, "checkpoint: this checkpoint's backward already ran (or failed part-way)");
    std::vector<Tensor> inputs;
    for (size_t i = 0; i < requires_grad_.size(); ++i) {
      Tensor x = saved(i);
      if (x.defined()) x = x.detach().requires_grad_(requires_grad_[i]);
      inputs.push_back(x);
    }
    Tape sub;
    TapeScope scope(sub);
    EnableGradGuard grad_on;
    std::vector<Tensor> outputs;
    {
      const Function fn = std::move(fn_);  // freed after this one re-run, with what its closure kept
      fn_ = nullptr;
      outputs = fn(inputs);
    }
    GDNCP_CHECK(outputs.size() == grad_outputs.size(), "checkpoint: the recomputed function returned ", outputs.size(),
                " outputs, the first run ", grad_outputs.size());
    std::vector<Tensor> roots, grads;
    for (size_t k = 0; k < outputs.size(); ++k) {
      if (!outputs[k].requires_grad()) continue;  // depends on no input that requires grad
      roots.push_back(outputs[k]);
      grads.push_back(grad_outputs[k]);
    }
    if (!roots.empty()) autograd::backward(roots, grads);
    std::vector<Tensor> grad_inputs;
    for (size_t i = 0; i < inputs.size(); ++i) grad_inputs.push_back(requires_grad_[i] ? inputs[i].grad() : Tensor());
    return grad_inputs;
  }

 private:
  Function fn_;
  std::vector<bool> requires_grad_;
};

}  // namespace

std::vector<Tensor> checkpoint(const Function& fn, const std::vector<Tensor>& inputs, Checkpoint mode) {
  if (!resolve_checkpoint(mode, inputs) || !should_record(inputs)) return fn(inputs);
  std::vector<Tensor> outputs;
  {
    NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  // fn may hand back an input unchanged; the node needs outputs of its own.
  for (Tensor& out : outputs)
    for (const Tensor& in : inputs)
      if (in.defined() && out.same_as(in)) out = out.detach();
  record(std::make_shared<CheckpointNode>(fn, inputs), inputs, outputs);
  return outputs;
}

// Note [checkpoint recompute]: the checkpoint node re-runs fn in backward only
// to rebuild the sub-graph it back-propagates through; the outputs of that run
// are roots of the sub-backward, whose values backward never reads. A layer
// that records one fused node can therefore skip the kernels that only write
// its outputs (phase C of the BiGDN layer, about a fifth of its forward) and
// return those outputs shape-only (Note [shape-only tensors] in
// src/autograd/tensor_internals.h): no memory for them at the backward's peak,
// and any read of them throws. Only the re-run may do so: the first run's
// outputs reach the caller.
std::vector<Tensor> checkpoint_layer(const RecomputeFunction& fn, const std::vector<Tensor>& inputs, Checkpoint mode) {
  auto ran = std::make_shared<bool>(false);
  const Function once_then_recompute = [fn, ran](const std::vector<Tensor>& x) {
    const bool recompute = *ran;
    *ran = true;
    std::vector<Tensor> outputs = fn(x, recompute);
    if (!recompute)
      for (size_t k = 0; k < outputs.size(); ++k)
        GDNCP_CHECK(!detail::is_shape_only(outputs[k]), "checkpoint_layer: output ", k, " (", outputs[k].str(),
                    ") of the first run is shape-only; only the recompute may skip writing its outputs");
    return outputs;
  };
  return checkpoint(once_then_recompute, inputs, mode);
}

}  // namespace autograd
}  // namespace gdncp
