// src/capi/dlpack.h — zero-copy exchange of tensors through DLPack
// (the legacy DLManagedTensor of DLPack 0.6-1.x, as torch.utils.dlpack hands out).
#pragma once

#include <dlpack/dlpack.h>

#include "gdncp/tensor.h"

namespace gdncp {
namespace detail {

// A Tensor over the memory of m, without a copy. Takes ownership of m whatever
// happens: m->deleter runs when the tensor's storage dies, or at once when m
// is rejected (then a gdncp::Error names `what`: a dtype other than f32, f64,
// bf16; a device other than CPU or CUDA; strides that are not dense row-major).
// A CUDA tensor must live on the current device.
Tensor from_dlpack(DLManagedTensor* m, const char* what);

// A DLManagedTensor over t's storage, without a copy: it keeps the storage
// alive until its deleter runs. t must be defined and have storage.
DLManagedTensor* to_dlpack(const Tensor& t);

}  // namespace detail
}  // namespace gdncp
