// src/autograd/tensor_math.h — the non-differentiable tensor math the engine
// itself needs (summing gradients). Ops that users call live in gdncp/nn.h.
#pragma once

#include "gdncp/tensor.h"

namespace gdncp {
namespace detail {

// a + b elementwise into a new tensor (same shape, dtype, device).
Tensor add(const Tensor& a, const Tensor& b);

}  // namespace detail
}  // namespace gdncp
