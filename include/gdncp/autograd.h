// gdncp/autograd.h — a minimal tape-based reverse-mode engine.
//
// Every differentiable op run while grad mode is on, with at least one input
// that requires grad, appends one Node to the thread's tape. backward() walks
// the tape in reverse (iteratively), hands each node the gradients of its
// outputs and sums the gradients that reach one tensor along several edges.
// Leaves (tensors marked requires_grad_ by the user) accumulate into grad().
//
// The tape is consumed by backward: every node on it releases its saved
// tensors, and a second backward through a released node throws.
//
// Gradient rule of ops: a node's backward returns fresh tensors (it never
// writes into its inputs' gradients); the engine does the summing.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gdncp/tensor.h"

namespace gdncp {
namespace autograd {

class Node;

struct AutogradMeta {
  uint64_t id = 0;
  bool requires_grad = false;
  Tensor grad;                    // leaves only
  std::shared_ptr<Node> grad_fn;  // null for leaves
};

// One incoming edge of a node: the input tensor's identity, and for a leaf
// the record its gradient accumulates into.
struct Edge {
  uint64_t id = 0;
  bool requires_grad = false;
  Shape shape;                         // the input's shape: its gradient must match
  std::shared_ptr<AutogradMeta> leaf;  // non-null iff the input is a leaf requiring grad
};

struct OutputInfo {
  uint64_t id = 0;
  Shape shape;
  DType dtype = DType::f32;
  Device device = Device::cpu;
};

class Node {
 public:
  virtual ~Node();
  virtual const char* name() const = 0;
  // Gradients of the outputs (zeros where an output got none) to gradients of
  // the inputs, one per input in the order given to record(); an undefined
  // tensor for an input that needs none.
  virtual std::vector<Tensor> backward(const std::vector<Tensor>& grad_outputs) = 0;

  // Keeps a tensor for backward (stored detached; counted in saved_bytes()),
  // with its version: saved() throws, naming this node and the tensor, when
  // the storage was changed in place since (Tensor::version).
  void save(const Tensor& t);
  const Tensor& saved(size_t i) const;
  size_t num_saved() const { return saved_.size(); }
  // Whether input i needs a gradient (valid after record()).
  bool needs_input_grad(size_t i) const { return i < edges.size() && edges[i].requires_grad; }

  // Frees the saved tensors; called by the engine once the tape is consumed.
  void release();
  bool released() const { return released_; }

  std::vector<Edge> edges;
  std::vector<OutputInfo> outputs;

 private:
  std::vector<Tensor> saved_;
  std::vector<uint64_t> saved_versions_;
  size_t saved_nbytes_ = 0;
  bool released_ = false;
};

// --- grad mode ------------------------------------------------------------
bool grad_enabled();
void set_grad_enabled(bool enabled);
// Sets grad mode for its lifetime and restores the previous mode on exit.
class GradModeGuard {
 public:
  ~GradModeGuard() { set_grad_enabled(prev_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 protected:
  explicit GradModeGuard(bool enabled) : prev_(grad_enabled()) { set_grad_enabled(enabled); }

 private:
  bool prev_;
};
class NoGradGuard : public GradModeGuard {
 public:
  NoGradGuard() : GradModeGuard(false) {}
};
class EnableGradGuard : public GradModeGuard {
 public:
  EnableGradGuard() : GradModeGuard(true) {}
};

// True when grad mode is on and some defined input requires grad: an op then
// records a node.
bool should_record(const std::vector<Tensor>& inputs);

// Called by an op after it computed its outputs: if should_record(inputs),
// wires the node's edges to the inputs, marks the outputs as requiring grad
// with grad_fn = node, and appends the node to the tape. Returns whether it
// recorded. Undefined inputs (absent optionals) are allowed and get no edge
// gradient.
bool record(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs);

// Reverse pass from roots with the given output gradients (same shapes).
// For a single one-element root the gradient may be omitted (taken as 1).
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads);
void backward(const Tensor& root, const Tensor& grad = Tensor());

// Bytes currently held as saved tensors by live nodes (all threads).
size_t saved_bytes();
// Nodes on this thread's tape.
size_t tape_size();
// Drops this thread's tape (releases every node on it) without a backward.
void clear_tape();

// --- checkpointing (docs/design.md §7) -----------------------------------------------
enum class Checkpoint { off, on, automatic };
const char* checkpoint_name(Checkpoint mode);
// automatic -> on iff grad mode is on and some input requires grad.
bool resolve_checkpoint(Checkpoint mode, const std::vector<Tensor>& inputs);

using Function = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
// Runs fn(inputs). With checkpointing on, fn runs without recording, one node
// is recorded that saves only the inputs, and backward recomputes fn with grad
// mode on and back-propagates through the recomputed sub-tape. fn must be
// deterministic (and, in CP, issue the same collectives on every rank).
std::vector<Tensor> checkpoint(const Function& fn, const std::vector<Tensor>& inputs, Checkpoint mode = Checkpoint::on);

// The same for a function told whether it is the re-run in backward
// (recompute = true): that run only has to rebuild the recorded graph, since
// the values of its outputs are never read, so a fused layer may skip the
// work that only produces them (Note [checkpoint recompute]).
using RecomputeFunction = std::function<std::vector<Tensor>(const std::vector<Tensor>&, bool recompute)>;
std::vector<Tensor> checkpoint_layer(const RecomputeFunction& fn, const std::vector<Tensor>& inputs,
                                     Checkpoint mode = Checkpoint::on);

}  // namespace autograd

using autograd::backward;
using autograd::Checkpoint;
using autograd::NoGradGuard;

}  // namespace gdncp
