// src/autograd/autograd.cpp — the tape, record() and the reverse pass.
//
// Note [tape order]: ops append their node after computing their outputs, so
// a node's inputs were produced by nodes earlier on the tape. Walking the tape
// backwards therefore visits a node only after every consumer of its outputs
// has delivered its gradient: no topological sort, no recursion.
#include "gdncp/autograd.h"

#include <atomic>
#include <unordered_map>

#include "autograd/tape.h"
#include "autograd/tensor_internals.h"
#include "autograd/tensor_math.h"
#include "gdncp/error.h"

namespace gdncp {
namespace autograd {

namespace {

std::atomic<size_t> g_saved_bytes{0};
thread_local bool t_grad_enabled = true;
thread_local Tape t_default_tape;
thread_local Tape* t_tape = nullptr;

// Adds g into the gradient slot `slot` (which may be undefined). Gradients are
// summed out of place: a node may hand the same tensor to several inputs.
void accumulate(Tensor& slot, Tensor g) {
  if (!slot.defined())
    slot = std::move(g);
  else
    slot = detail::add(slot, g);
}

}  // namespace

Tape& current_tape() { return t_tape ? *t_tape : t_default_tape; }

TapeScope::TapeScope(Tape& tape) : prev_(t_tape) { t_tape = &tape; }
TapeScope::~TapeScope() { t_tape = prev_; }

// --- Node -------------------------------------------------------------------------

Node::~Node() {
  if (!released_) g_saved_bytes -= saved_nbytes_;
}

void Node::save(const Tensor& t) {
  GDNCP_CHECK(!released_, name(), ": save() after release");
  if (!t.defined()) {
    saved_.emplace_back();
    saved_versions_.push_back(0);
    return;
  }
  GDNCP_CHECK(!detail::is_shape_only(t), name(), ": save(): ", t.str(),
              " has no values to keep for backward (Note [shape-only tensors])");
  saved_.push_back(t.detach());  // detached: an output saved by its own node would form a cycle
  saved_versions_.push_back(t.version());
  saved_nbytes_ += t.nbytes();
  g_saved_bytes += t.nbytes();
}

const Tensor& Node::saved(size_t i) const {
  GDNCP_CHECK(!released_, name(), ": saved tensors were already freed (backward called twice on this graph?)");
  GDNCP_CHECK(i < saved_.size(), name(), ": saved tensor ", i, " of ", saved_.size());
  const Tensor& t = saved_[i];
  // Note [saved versions]: values read in backward must be those of the
  // forward; an in-place change in between would give a silently wrong gradient.
  GDNCP_CHECK(!t.defined() || t.version() == saved_versions_[i], name(), ": saved tensor ", i, " (", t.str(),
              ") was modified in place after the forward saved it (version ", saved_versions_[i], " at save, ",
              t.version(), " now): clone it before changing it, or run the change after backward");
  return t;
}

void Node::release() {
  if (released_) return;
  g_saved_bytes -= saved_nbytes_;
  saved_nbytes_ = 0;
  saved_.clear();
  saved_.shrink_to_fit();
  saved_versions_.clear();
  saved_versions_.shrink_to_fit();
  released_ = true;
}

// --- grad mode and recording -------------------------------------------------------

bool grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool enabled) { t_grad_enabled = enabled; }

bool should_record(const std::vector<Tensor>& inputs) {
  if (!t_grad_enabled) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

bool record(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs) {
  if (!should_record(inputs)) return false;
  node->edges.clear();
  for (const Tensor& t : inputs) {
    Edge e;
    if (t.defined()) {
      e.id = t.id();
      e.requires_grad = t.requires_grad();
      e.shape = t.shape();
      if (e.requires_grad && !t.grad_fn()) e.leaf = detail::meta_ptr(t);
    }
    node->edges.push_back(std::move(e));
  }
  node->outputs.clear();
  for (const Tensor& t : outputs) {
    GDNCP_CHECK(t.defined(), node->name(), ": an op output is undefined");
    for (const Tensor& in : inputs)
      GDNCP_CHECK(!in.defined() || !t.same_as(in), node->name(), ": an op must return new tensors, not its inputs");
    AutogradMeta& m = detail::meta(t);
    m.requires_grad = true;
    m.grad_fn = node;
    node->outputs.push_back(OutputInfo{m.id, t.shape(), t.dtype(), t.device()});
  }
  current_tape().nodes.push_back(node);
  return true;
}

// --- the reverse pass ------------------------------------------------------------------

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads) {
  GDNCP_CHECK(roots.size() == grads.size(), "backward: ", roots.size(), " roots but ", grads.size(), " gradients");
  std::unordered_map<uint64_t, Tensor> pending;  // tensor id -> gradient summed so far
  for (size_t r = 0; r < roots.size(); ++r) {
    const Tensor& root = roots[r];
    GDNCP_CHECK(root.defined() && root.requires_grad(), "backward: root ", r,
                " does not require grad (no input of its ops requires grad, or grad mode was off)");
    Tensor g = grads[r];
    if (!g.defined()) {
      GDNCP_CHECK(root.numel() == 1, "backward: root ", r, " ", root.str(),
                  " is not a scalar, so its gradient must be given");
      g = Tensor::full(root.shape(), 1.0, root.dtype(), root.device());
    }
    GDNCP_CHECK(g.shape() == root.shape() && g.dtype() == root.dtype() && g.device() == root.device(),
                "backward: gradient ", g.str(), " does not match root ", r, " ", root.str());
    const std::shared_ptr<Node> fn = root.grad_fn();
    if (!fn) {
      accumulate(detail::meta(root).grad, g.clone());
      continue;
    }
    GDNCP_CHECK(!fn->released(), "backward: the graph of root ", r,
                " was already consumed (backward called twice, or the tape was cleared)");
    accumulate(pending[root.id()], g);
  }

  Tape& tape = current_tape();
  for (size_t i = tape.nodes.size(); i-- > 0;) {
    Node& node = *tape.nodes[i];
    std::vector<Tensor> grad_out(node.outputs.size());
    bool any = false;
    for (size_t k = 0; k < node.outputs.size(); ++k) {
      auto it = pending.find(node.outputs[k].id);
      if (it == pending.end()) continue;
      grad_out[k] = std::move(it->second);
      pending.erase(it);
      any = true;
    }
    if (!any) continue;
    GDNCP_CHECK(!node.released(), "backward: node ", node.name(), " was already consumed (backward called twice?)");
    for (size_t k = 0; k < grad_out.size(); ++k)
      if (!grad_out[k].defined()) {
        const OutputInfo& o = node.outputs[k];
        grad_out[k] = Tensor::zeros(o.shape, o.dtype, o.device);
      }
    std::vector<Tensor> grad_in = node.backward(grad_out);
    GDNCP_CHECK(grad_in.size() == node.edges.size(), "backward: node ", node.name(), " returned ", grad_in.size(),
                " gradients for ", node.edges.size(), " inputs");
    for (size_t j = 0; j < grad_in.size(); ++j) {
      const Edge& e = node.edges[j];
      if (!e.requires_grad || !grad_in[j].defined()) continue;
      GDNCP_CHECK(grad_in[j].shape() == e.shape, "backward: node ", node.name(), " gave gradient ", grad_in[j].str(),
                  " for input ", j, " of shape ", shape_str(e.shape));
      if (e.leaf) {
        // A leaf's grad outlives the pass and may be modified in place (an
        // all-reduce, an optimizer): it must not share storage with anything.
        Tensor g = std::move(grad_in[j]);
        if (!g.storage_unique()) g = g.clone();
        accumulate(e.leaf->grad, std::move(g));
      } else {
        accumulate(pending[e.id], std::move(grad_in[j]));
      }
    }
    node.release();
  }
  clear_tape();
}

void backward(const Tensor& root, const Tensor& grad) {
  backward(std::vector<Tensor>{root}, std::vector<Tensor>{grad});
}

size_t saved_bytes() { return g_saved_bytes.load(); }
size_t tape_size() { return current_tape().nodes.size(); }

void clear_tape() {
  Tape& tape = current_tape();
  for (auto& n : tape.nodes) n->release();
  tape.nodes.clear();
}

}  // namespace autograd
}  // namespace gdncp
