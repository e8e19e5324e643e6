// gdncp/tensor.h — a small owning, contiguous tensor.
//
// A Tensor is a handle: copies share the same storage and the same autograd
// identity (like torch.Tensor). Storage is always dense and row-major; there
// are no strides and no views other than reshape, which shares the storage.
// Layout changes are explicit ops.
//
// Device memory comes from a stream-ordered caching allocator: freeing a
// tensor returns its block to a cache for the current stream, so the hot path
// does not call cudaMalloc after warm-up. All device work of the library runs
// on the thread's current stream (see StreamGuard); it is the caller's stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace gdncp {

enum class DType : uint8_t { f32, bf16, f64 };
enum class Device : uint8_t { cpu, cuda };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* device_name(Device device);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& shape);

// bfloat16 storage type: the upper 16 bits of an IEEE float.
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest, ties to even; NaN stays NaN.
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

namespace autograd {
class Node;
struct AutogradMeta;
}  // namespace autograd
namespace detail {
struct TensorInternals;  // src/autograd/tensor_internals.h (internal: shape-only tensors)
}  // namespace detail

struct TensorImpl;  // src/autograd/tensor_internals.h

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false

  // --- factories -------------------------------------------------------
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu);
  static Tensor full(const Shape& shape, double value, DType dtype, Device device = Device::cpu);
  // Seeded standard normal (times stddev, plus mean). Element i depends only on
  // (seed, i), so the same seed gives the same values on CPU and GPU.
  static Tensor randn(const Shape& shape, DType dtype, Device device, uint64_t seed, double stddev = 1.0,
                      double mean = 0.0);
  // Seeded uniform on [lo, hi), element i a function of (seed, i).
  static Tensor uniform(const Shape& shape, DType dtype, Device device, uint64_t seed, double lo, double hi);
  // Values given as doubles, rounded to dtype.
  static Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype,
                            Device device = Device::cpu);
  // A contiguous tensor over foreign memory, without a copy: data holds
  // numel·dtype_size bytes on device (for CUDA, the current device's memory),
  // and deleter (may be empty) runs once when the last tensor sharing the
  // storage dies. The caller keeps data valid until then.
  static Tensor from_blob(void* data, Shape shape, DType dtype, Device device, std::function<void()> deleter);

  // --- metadata --------------------------------------------------------
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t size(int64_t i) const;  // negative i counts from the end
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }
  DType dtype() const;
  Device device() const;
  bool is_cuda() const { return device() == Device::cuda; }
  std::string str() const;  // "f32[2, 3] cpu"

  // --- data ------------------------------------------------------------
  // Throws for a tensor without storage (internal: the shape-only outputs of a
  // checkpoint recompute, whose values are never computed).
  void* data();
  const void* data() const;
  template <typename T>
  T* data_ptr();
  template <typename T>
  const T* data_ptr() const;

  // Copies (never aliases): to another device or dtype, or the same.
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;
  Tensor clone() const;
  // Copies src into this tensor (same shape and dtype, any devices).
  void copy_from(const Tensor& src);
  void fill_(double value);
  // Host copy of the values as doubles (for tests and checks).
  std::vector<double> to_vector() const;
  double item() const;  // the value of a one-element tensor

  // Same storage, new shape with the same numel. Differentiable.
  Tensor reshape(const Shape& shape) const;

  // --- autograd --------------------------------------------------------
  bool requires_grad() const;
  // Marks a leaf as requiring grad; its gradient accumulates in grad().
  Tensor& requires_grad_(bool value = true);
  // Accumulated gradient of a leaf (undefined before the first backward).
  Tensor grad() const;
  void zero_grad();  // drops the accumulated gradient
  // Sets a leaf's accumulated gradient to g (this tensor's shape, dtype and
  // device): e.g. zeros on a rank that holds no data but joins a gradient sum.
  void set_grad(const Tensor& g);
  // Same storage, no autograd history, requires_grad false.
  Tensor detach() const;
  std::shared_ptr<autograd::Node> grad_fn() const;
  // Identity of this tensor for autograd (stable across handle copies).
  uint64_t id() const;

  // Counts the in-place changes of the storage (fill_, copy_from,
  // optim::AdamW::step, cp::all_reduce_grads): shared by every tensor viewing
  // it. A tensor saved for backward must have the same version when backward
  // reads it. Writes through data() are not counted.
  uint64_t version() const;

  bool same_as(const Tensor& other) const { return impl_ == other.impl_; }
  // True when no other handle or tensor shares this tensor's storage.
  bool storage_unique() const;

 private:
  friend struct detail::TensorInternals;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<TensorImpl> impl_;
};

template <typename T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct dtype_of<bf16> {
  static constexpr DType value = DType::bf16;
};

// --- devices and streams ------------------------------------------------
// True when gdncp was built with CUDA and at least one device is visible.
bool cuda_available();
int cuda_device_count();
// Thread-local current CUDA stream (a cudaStream_t; nullptr = legacy default).
void* current_stream();
void set_current_stream(void* stream);
// Blocks the host until the current stream has finished its work.
void synchronize();
// Times the library made the calling process's host wait for a CUDA device: synchronize(),
// copies to or from host memory, and the cache's release of its blocks when a cudaMalloc
// fails. A steady-state step on device tensors adds none (docs/design.md §10).
int64_t cuda_host_waits();
class StreamGuard {
 public:
  explicit StreamGuard(void* stream) : prev_(current_stream()) { set_current_stream(stream); }
  ~StreamGuard() { set_current_stream(prev_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  void* prev_;
};

// Caching allocator statistics for the current device (bytes).
struct MemoryStats {
  size_t allocated = 0;       // held by live tensors
  size_t peak_allocated = 0;  // high-water mark since the last reset
  size_t cached = 0;          // held by the cache, free for reuse
  int64_t mallocs = 0;        // cudaMalloc calls: requests the cache could not serve
};
MemoryStats cuda_memory_stats();
void reset_peak_memory();
void empty_cuda_cache();

}  // namespace gdncp
