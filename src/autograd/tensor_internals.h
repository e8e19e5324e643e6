// src/autograd/tensor_internals.h — tensors with a shape but no storage.
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

#include <cstddef>

#include "gdncp/tensor.h"

namespace gdncp {
namespace detail {

struct TensorInternals {
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

}  // namespace detail
}  // namespace gdncp
