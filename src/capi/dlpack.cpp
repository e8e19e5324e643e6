// src/capi/dlpack.cpp — Tensor <-> DLManagedTensor, both without a copy.
//
// Note [DLPack ownership]: an imported tensor's storage owns the
// DLManagedTensor and calls its deleter when it dies (Tensor::from_blob); an
// exported DLManagedTensor owns a handle on the tensor (manager_ctx) and
// drops it in its deleter. Either side may outlive the other.
#include "capi/dlpack.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "autograd/device.h"
#include "autograd/tensor_internals.h"
#include "gdncp/error.h"

namespace gdncp {
namespace detail {

namespace {

// Calls m's deleter unless released: a rejected import still frees m.
struct Owner {
  DLManagedTensor* m;
  ~Owner() {
    if (m && m->deleter) m->deleter(m);
  }
};

DType dtype_of(const DLDataType& t, const char* what) {
  GDNCP_CHECK(t.lanes == 1, what, ": DLPack tensors with ", t.lanes, " lanes are not supported");
  if (t.code == kDLFloat && t.bits == 32) return DType::f32;
  if (t.code == kDLFloat && t.bits == 64) return DType::f64;
  if (t.code == kDLBfloat && t.bits == 16) return DType::bf16;
  GDNCP_FAIL(what, ": DLPack dtype (code ", static_cast<int>(t.code), ", ", static_cast<int>(t.bits),
             " bits) is not one of float32, float64, bfloat16");
}

DLDataType dl_dtype(DType t) {
  switch (t) {
    case DType::f32: return DLDataType{kDLFloat, 32, 1};
    case DType::f64: return DLDataType{kDLFloat, 64, 1};
    case DType::bf16: return DLDataType{kDLBfloat, 16, 1};
  }
  GDNCP_FAIL("to_dlpack: unknown dtype");
}

// What an exported DLManagedTensor keeps alive.
struct Export {
  Tensor tensor;
  std::vector<int64_t> shape, strides;
  DLManagedTensor managed;
};

}  // namespace

Tensor from_dlpack(DLManagedTensor* m, const char* what) {
  Owner owner{m};
  GDNCP_CHECK(m != nullptr, what, ": the DLPack tensor is null");
  const DLTensor& t = m->dl_tensor;
  GDNCP_CHECK(t.ndim >= 0, what, ": DLPack ndim ", t.ndim, " is negative");
  GDNCP_CHECK(t.ndim == 0 || t.shape != nullptr, what, ": DLPack shape is null");
  const DType dtype = dtype_of(t.dtype, what);
  Device device = Device::cpu;
  if (t.device.device_type == kDLCUDA) {
    device = Device::cuda;
    GDNCP_CHECK(t.device.device_id == current_device(), what, ": the DLPack tensor is on CUDA device ",
                t.device.device_id, " but the current device is ", current_device());
  } else {
    GDNCP_CHECK(t.device.device_type == kDLCPU, what, ": DLPack device type ", static_cast<int>(t.device.device_type),
                " is neither CPU (1) nor CUDA (2)");
  }
  Shape shape(t.shape, t.shape + t.ndim);
  int64_t numel = 1;
  for (int i = 0; i < t.ndim; ++i) {
    GDNCP_CHECK(shape[static_cast<size_t>(i)] >= 0, what, ": DLPack shape ", shape_str(shape), " has a negative size");
    numel =
        checked_mul(numel, shape[static_cast<size_t>(i)], (std::string(what) + ": DLPack shape (elements)").c_str());
  }
  const int64_t esize = static_cast<int64_t>(dtype_size(dtype));
  checked_mul(numel, esize, (std::string(what) + ": DLPack shape (bytes)").c_str());
  // Dense row-major; a dimension of size 1 may carry any stride (as torch's
  // contiguous tensors do), and so may every dimension of an empty tensor
  // (torch's strides of shape (1, 0, 3, H, D) are not the dense ones).
  if (t.strides && numel > 0) {
    int64_t expected = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      if (shape[static_cast<size_t>(i)] != 1)
        GDNCP_CHECK(t.strides[i] == expected, what, ": DLPack tensor ", shape_str(shape), " is not contiguous (stride ",
                    t.strides[i], " of dim ", i, ", expected ", expected, "); pass a contiguous tensor");
      expected *= shape[static_cast<size_t>(i)];
    }
  }
  GDNCP_CHECK(numel == 0 || t.data != nullptr, what, ": DLPack data is null for a tensor of ", numel, " elements");
  void* data = numel ? static_cast<char*>(t.data) + t.byte_offset : nullptr;
  GDNCP_CHECK(reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(esize) == 0, what,
              ": DLPack data + byte_offset (", t.byte_offset, ") is not aligned to the ", esize, "-byte elements of ",
              dtype_name(dtype));
  Tensor out = Tensor::from_blob(data, std::move(shape), dtype, device, [m] {
    if (m->deleter) m->deleter(m);
  });
  owner.m = nullptr;  // the storage owns m now
  return out;
}

DLManagedTensor* to_dlpack(const Tensor& t) {
  GDNCP_CHECK(t.defined(), "to_dlpack: the tensor is undefined");
  GDNCP_CHECK(!is_shape_only(t), "to_dlpack: ", t.str(), " has no storage (Note [shape-only tensors])");
  auto e = std::make_unique<Export>();
  e->tensor = t;
  e->shape = t.shape();
  e->strides.assign(e->shape.size(), 1);
  for (size_t i = e->shape.size(); i-- > 1;) e->strides[i - 1] = e->strides[i] * e->shape[i];
  DLTensor& d = e->managed.dl_tensor;
  d.data = e->tensor.numel() ? e->tensor.data() : nullptr;
  d.device = DLDevice{t.is_cuda() ? kDLCUDA : kDLCPU, t.is_cuda() ? current_device() : 0};
  d.ndim = static_cast<int>(e->shape.size());
  d.dtype = dl_dtype(t.dtype());
  d.shape = e->shape.data();
  d.strides = e->strides.data();  // dense row-major, spelled out (older readers require strides)
  d.byte_offset = 0;
  e->managed.manager_ctx = e.get();
  e->managed.deleter = [](DLManagedTensor* self) { delete static_cast<Export*>(self->manager_ctx); };
  return &e.release()->managed;
}

}  // namespace detail
}  // namespace gdncp
