// src/cp/scan/region.h — a run of a tensor's elements as a tensor of its own: how the CP scan
// hands out the pieces of its packed buffers (composites, gathered packs, kept results) to
// kernels and collectives without copying them.
#pragma once
#include <cstdint>

#include "gdncp/error.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace cp {
namespace detail {

// Elements [off, off + n) of t, flat, sharing t's storage (which the view keeps alive).
inline Tensor region(const Tensor& t, int64_t off, int64_t n) {
  GDNCP_CHECK(off >= 0 && n >= 0 && off <= t.numel() - n, "cp scan: elements [", off, ", ", off + n,
              ") are outside a buffer of ", t.numel());
  if (off == 0 && n == t.numel()) return t;
  char* p = static_cast<char*>(const_cast<void*>(t.data())) + static_cast<size_t>(off) * dtype_size(t.dtype());
  return Tensor::from_blob(p, {n}, t.dtype(), t.device(), [keep = t] {});
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
