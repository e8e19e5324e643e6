// src/autograd/tensor_internals.h — what a Tensor handle points at (storage,
// shape, autograd record), and tensors with a shape but no storage.
//
// Note [shape-only tensors]. A checkpoint re-runs a layer in backward only to
// rebuild the graph it back-propagates through (Note [checkpoint recompute]):
// the re-run's outputs are the roots of that sub-backward, so their shape,
// dtype, device and autograd identity matter and their values never do. A
// fused layer returns them shape-only: nothing is allocated for them, so a
// layer's backward does not carry a dead output at its peak. Every access to
// the elements of such a tensor (data(), copies, fill, to_vector, a kernel
// launch, a collective) throws, and so does saving it for backward; a
// checkpoint's first run may not return one (its outputs reach the caller).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "gdncp/tensor.h"

namespace gdncp {

// Raw memory of one tensor (or of several that share it through reshape/detach).
struct Storage {
  void* ptr = nullptr;
  size_t nbytes = 0;
  Device device = Device::cpu;
  int device_index = 0;
  // In-place changes so far (Tensor::version); saved tensors compare it at backward.
  std::atomic<uint64_t> version{0};
  // Memory allocated here (freed by the destructor) ...
  Storage(size_t nbytes, Device device);
  // ... or foreign memory, released by deleter (Tensor::from_blob).
  Storage(void* ptr, size_t nbytes, Device device, int device_index, std::function<void()> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

 private:
  bool foreign_ = false;
  std::function<void()> deleter_;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  DType dtype = DType::f32;
  std::shared_ptr<autograd::AutogradMeta> meta;  // null until autograd touches the tensor
};

namespace detail {

// Elements of shape (product of its extents, overflow-checked); `what` names
// the caller in the error.
int64_t checked_numel(const Shape& shape, const char* what);

struct TensorInternals {
  // The autograd record of t, created on first use.
  static autograd::AutogradMeta& meta(const Tensor& t);
  static const std::shared_ptr<autograd::AutogradMeta>& meta_ptr(const Tensor& t);
  // Marks an in-place change of t's storage (Tensor::version).
  static void bump_version(const Tensor& t);

  static Tensor shape_only(const Shape& shape, DType dtype, Device device);
  static bool is_shape_only(const Tensor& t);
  static size_t shape_only_made();  // how many were made (a counter for tests)
};

// A tensor of this shape, dtype and device without storage (Note [shape-only tensors]).
inline Tensor shape_only(const Shape& shape, DType dtype, Device device) {
  return TensorInternals::shape_only(shape, dtype, device);
}
// Whether t has elements but no storage for them (false for undefined tensors).
inline bool is_shape_only(const Tensor& t) { return TensorInternals::is_shape_only(t); }
inline autograd::AutogradMeta& meta(const Tensor& t) { return TensorInternals::meta(t); }
inline const std::shared_ptr<autograd::AutogradMeta>& meta_ptr(const Tensor& t) { return TensorInternals::meta_ptr(t); }
// Call after writing into t's elements in place (not for a fresh output).
inline void bump_version(const Tensor& t) { TensorInternals::bump_version(t); }

}  // namespace detail
}  // namespace gdncp
