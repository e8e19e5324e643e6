// src/autograd/tensor.cpp — Tensor: storage, factories, copies, conversions.
#include "gdncp/tensor.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <sstream>
#include <thread>

#include "autograd/device.h"
#include "autograd/tensor_internals.h"
#include "autograd/tensor_math.h"
#include "gdncp/autograd.h"
#include "gdncp/error.h"

namespace gdncp {

namespace {
// Every dtype's element size and name: the one table dtype_size and dtype_name read.
struct DTypeInfo {
  DType dtype;
  size_t size;
  const char* name;
};
constexpr DTypeInfo kDTypes[] = {{DType::f32, 4, "f32"}, {DType::bf16, 2, "bf16"}, {DType::f64, 8, "f64"}};

const DTypeInfo* dtype_info(DType dtype) {
  for (const DTypeInfo& info : kDTypes)
    if (info.dtype == dtype) return &info;
  return nullptr;
}
}  // namespace

size_t dtype_size(DType dtype) {
  const DTypeInfo* info = dtype_info(dtype);
  return info ? info->size : 0;
}

const char* dtype_name(DType dtype) {
  const DTypeInfo* info = dtype_info(dtype);
  return info ? info->name : "?";
}

const char* device_name(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

// --- storage ----------------------------------------------------------------

namespace {
constexpr size_t kHostAlign = 64;
}

// Host memory through posix_memalign: a request that cannot be served comes
// back as an error code (never std::bad_alloc), reported with its size.
Storage::Storage(size_t n, Device dev) : nbytes(n), device(dev) {
  if (n == 0) return;
  if (dev == Device::cpu) {
    GDNCP_CHECK(posix_memalign(&ptr, kHostAlign, n) == 0, "Tensor: cannot allocate ", n,
                " bytes of host memory (out of memory)");
  } else {
    ptr = detail::cuda_alloc(n, &device_index);
  }
}

Storage::Storage(void* p, size_t n, Device dev, int index, std::function<void()> deleter)
    : ptr(p), nbytes(n), device(dev), device_index(index), foreign_(true), deleter_(std::move(deleter)) {}

Storage::~Storage() {
  if (foreign_) {
    if (deleter_) deleter_();
    return;
  }
  if (!ptr) return;
  if (device == Device::cpu)
    std::free(ptr);
  else
    detail::cuda_free(ptr);
}

// --- host element access --------------------------------------------------------

namespace {

// Shapes are checked when a tensor is made (checked_numel): their product fits.
int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Bytes of a tensor of this shape and dtype, or an error naming `what`.
size_t checked_nbytes(const Shape& shape, DType dtype, const char* what) {
  const int64_t n = detail::checked_numel(shape, what);
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
  int64_t bytes = 0;
  GDNCP_CHECK(!mul_overflows(n, elem, &bytes), what, ": ", dtype_name(dtype), shape_str(shape), " needs ", n, " × ",
              elem, " bytes, more than int64 can count");
  return static_cast<size_t>(bytes);
}

double host_load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::bf16: return bf16_to_float(static_cast<const bf16*>(p)[i]);
  }
  return 0;
}

void host_store(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    // Through float first, like the device cast, so both round identically.
    case DType::bf16: static_cast<bf16*>(p)[i] = float_to_bf16(static_cast<float>(v)); break;
  }
}

// Counter-based generator: element i of a seeded fill depends only on (seed, i).
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform on (0, 1): 53 random bits, offset by half an ulp so log() is finite.
double unit_uniform(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

uint64_t stream_key(uint64_t seed, int64_t i) {
  return splitmix64(seed * 0xD1B54A32D192ED03ull + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull);
}

// Fills a host tensor with gen(i) for every element, on several threads for
// large tensors: element i depends only on i, so the split changes no value.
template <typename Gen>
Tensor host_generated(const Shape& shape, DType dtype, Device device, const Gen& gen) {
  Tensor host = Tensor::empty(shape, dtype, Device::cpu);
  void* p = host.data();
  const int64_t n = host.numel();
  const auto fill = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) host_store(p, dtype, i, gen(i));
  };
  constexpr int64_t kPerThread = int64_t(1) << 18;
  const int64_t threads =
      std::min<int64_t>(std::max<int64_t>(1, std::thread::hardware_concurrency()), (n + kPerThread - 1) / kPerThread);
  if (threads <= 1) {
    fill(0, n);
  } else {
    std::vector<std::thread> pool;
    const int64_t chunk = (n + threads - 1) / threads;
    for (int64_t t = 0; t < threads; ++t) pool.emplace_back(fill, t * chunk, std::min(n, (t + 1) * chunk));
    for (std::thread& th : pool) th.join();
  }
  return device == Device::cpu ? host : host.to(device);
}

std::atomic<uint64_t> g_next_id{1};
std::atomic<size_t> g_shape_only_made{0};

}  // namespace

// --- factories ------------------------------------------------------------------

namespace detail {
int64_t checked_numel(const Shape& shape, const char* what) {
  for (int64_t s : shape) GDNCP_CHECK(s >= 0, what, ": negative size in shape ", shape_str(shape));
  int64_t n = 1;
  for (int64_t s : shape)
    GDNCP_CHECK(!mul_overflows(n, s, &n), what, ": shape ", shape_str(shape),
                " has more elements than int64 can count (2^63 - 1)");
  return n;
}
}  // namespace detail

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  const size_t bytes = checked_nbytes(shape, dtype, "Tensor::empty");
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->dtype = dtype;
  impl->storage = std::make_shared<Storage>(bytes, device);
  return Tensor(std::move(impl));
}

Tensor Tensor::from_blob(void* data, Shape shape, DType dtype, Device device, std::function<void()> deleter) {
  const size_t bytes = checked_nbytes(shape, dtype, "Tensor::from_blob");
  GDNCP_CHECK(data != nullptr || bytes == 0, "Tensor::from_blob: data: null pointer for ", dtype_name(dtype),
              shape_str(shape));
  GDNCP_CHECK(device == Device::cpu || cuda_available(),
              "Tensor::from_blob: device: cuda, but no CUDA device is "
              "visible (or gdncp was built without CUDA)");
  int index = 0;
  if (device == Device::cuda) index = detail::current_device();
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = std::move(shape);
  impl->dtype = dtype;
  impl->storage = std::make_shared<Storage>(data, bytes, device, index, std::move(deleter));
  return Tensor(std::move(impl));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0.0, dtype, device); }

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::randn(const Shape& shape, DType dtype, Device device, uint64_t seed, double stddev, double mean) {
  return host_generated(shape, dtype, device, [&](int64_t i) {
    const uint64_t k = stream_key(seed, i);
    const double u1 = unit_uniform(k), u2 = unit_uniform(splitmix64(k));
    return mean + stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  });
}

Tensor Tensor::uniform(const Shape& shape, DType dtype, Device device, uint64_t seed, double lo, double hi) {
  GDNCP_CHECK(lo <= hi, "Tensor::uniform: lo (", lo, ") > hi (", hi, ")");
  return host_generated(shape, dtype, device,
                        [&](int64_t i) { return lo + (hi - lo) * unit_uniform(stream_key(seed, i)); });
}

Tensor Tensor::from_vector(const std::vector<double>& values, const Shape& shape, DType dtype, Device device) {
  GDNCP_CHECK(static_cast<int64_t>(values.size()) == detail::checked_numel(shape, "Tensor::from_vector"),
              "Tensor::from_vector: ", values.size(), " values for shape ", shape_str(shape));
  return host_generated(shape, dtype, device, [&](int64_t i) { return values[static_cast<size_t>(i)]; });
}

// --- metadata ---------------------------------------------------------------------

namespace {
const TensorImpl& checked(const std::shared_ptr<TensorImpl>& impl) {
  GDNCP_CHECK(impl != nullptr, "Tensor: use of an undefined tensor");
  return *impl;
}

// An empty storage under a shape with elements (Note [shape-only tensors]).
bool lacks_storage(const TensorImpl& t) {
  return t.storage->nbytes < static_cast<size_t>(numel_of(t.shape)) * dtype_size(t.dtype);
}

void* storage_ptr(const std::shared_ptr<TensorImpl>& impl) {
  const TensorImpl& t = checked(impl);
  GDNCP_CHECK(!lacks_storage(t), "Tensor: ", dtype_name(t.dtype), shape_str(t.shape),
              " has no storage: it is the shape-only output of a checkpoint recompute, whose values are never "
              "computed (Note [shape-only tensors])");
  return t.storage->ptr;
}
}  // namespace

// --- shape-only tensors (src/autograd/tensor_internals.h) ---------------------------------

namespace detail {

Tensor TensorInternals::shape_only(const Shape& shape, DType dtype, Device device) {
  checked_nbytes(shape, dtype, "shape_only");
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->dtype = dtype;
  impl->storage = std::make_shared<Storage>(0, device);  // nothing allocated
  ++g_shape_only_made;
  return Tensor(std::move(impl));
}

bool TensorInternals::is_shape_only(const Tensor& t) { return t.defined() && lacks_storage(*t.impl_); }

size_t TensorInternals::shape_only_made() { return g_shape_only_made.load(); }

const std::shared_ptr<autograd::AutogradMeta>& TensorInternals::meta_ptr(const Tensor& t) {
  const std::shared_ptr<TensorImpl>& impl = t.impl_;
  checked(impl);
  if (!impl->meta) {
    impl->meta = std::make_shared<autograd::AutogradMeta>();
    impl->meta->id = g_next_id.fetch_add(1);
  }
  return impl->meta;
}

autograd::AutogradMeta& TensorInternals::meta(const Tensor& t) { return *meta_ptr(t); }

void TensorInternals::bump_version(const Tensor& t) { ++checked(t.impl_).storage->version; }

}  // namespace detail

const Shape& Tensor::shape() const { return checked(impl_).shape; }

int64_t Tensor::size(int64_t i) const {
  const int64_t d = dim();
  const int64_t j = i < 0 ? i + d : i;
  GDNCP_CHECK(j >= 0 && j < d, "Tensor::size: dim ", i, " out of range for ", d, "-d tensor");
  return shape()[static_cast<size_t>(j)];
}

int64_t Tensor::numel() const { return numel_of(shape()); }
DType Tensor::dtype() const { return checked(impl_).dtype; }
Device Tensor::device() const { return checked(impl_).storage->device; }

std::string Tensor::str() const {
  if (!defined()) return "undefined";
  return std::string(dtype_name(dtype())) + shape_str(shape()) + " " + device_name(device()) +
         (lacks_storage(*impl_) ? " (shape-only)" : "");
}

void* Tensor::data() { return storage_ptr(impl_); }
const void* Tensor::data() const { return storage_ptr(impl_); }

template <typename T>
T* Tensor::data_ptr() {
  GDNCP_CHECK(dtype() == dtype_of<T>::value, "Tensor::data_ptr: tensor is ", dtype_name(dtype()), ", asked for ",
              dtype_name(dtype_of<T>::value));
  return static_cast<T*>(data());
}
template <typename T>
const T* Tensor::data_ptr() const {
  GDNCP_CHECK(dtype() == dtype_of<T>::value, "Tensor::data_ptr: tensor is ", dtype_name(dtype()), ", asked for ",
              dtype_name(dtype_of<T>::value));
  return static_cast<const T*>(data());
}
template float* Tensor::data_ptr<float>();
template double* Tensor::data_ptr<double>();
template bf16* Tensor::data_ptr<bf16>();
template const float* Tensor::data_ptr<float>() const;
template const double* Tensor::data_ptr<double>() const;
template const bf16* Tensor::data_ptr<bf16>() const;

// --- copies and conversions ---------------------------------------------------------

Tensor Tensor::to(Device device) const {
  Tensor out = empty(shape(), dtype(), device);
  out.copy_from(*this);
  return out;
}

Tensor Tensor::to(DType dt) const {
  Tensor out = empty(shape(), dt, device());
  const int64_t n = numel();
  if (dt == dtype()) {
    out.copy_from(*this);
  } else if (device() == Device::cuda) {
    detail::cuda_cast(out.data(), dt, data(), dtype(), n);
  } else {
    const void* src = data();
    void* dst = out.data();
    for (int64_t i = 0; i < n; ++i) host_store(dst, dt, i, host_load(src, dtype(), i));
  }
  return out;
}

Tensor Tensor::clone() const { return to(device()); }

void Tensor::copy_from(const Tensor& src) {
  GDNCP_CHECK(src.shape() == shape() && src.dtype() == dtype(), "Tensor::copy_from: source ", src.str(),
              " does not match destination ", str());
  detail::copy_bytes(data(), device(), src.data(), src.device(), nbytes());
  detail::bump_version(*this);
}

void Tensor::fill_(double value) {
  const int64_t n = numel();
  detail::bump_version(*this);
  if (device() == Device::cuda) {
    detail::cuda_fill(data(), dtype(), n, value);
    return;
  }
  void* p = data();
  for (int64_t i = 0; i < n; ++i) host_store(p, dtype(), i, value);
}

std::vector<double> Tensor::to_vector() const {
  const Tensor host = device() == Device::cpu ? *this : to(Device::cpu);
  const int64_t n = numel();
  std::vector<double> v(static_cast<size_t>(n));
  const void* p = host.data();
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = host_load(p, dtype(), i);
  return v;
}

double Tensor::item() const {
  GDNCP_CHECK(numel() == 1, "Tensor::item: tensor has ", numel(), " elements, not 1");
  return to_vector()[0];
}

// --- autograd hooks -----------------------------------------------------------------

uint64_t Tensor::id() const { return detail::meta(*this).id; }

uint64_t Tensor::version() const { return checked(impl_).storage->version.load(); }

bool Tensor::requires_grad() const { return defined() && impl_->meta && impl_->meta->requires_grad; }

Tensor& Tensor::requires_grad_(bool value) {
  autograd::AutogradMeta& m = detail::meta(*this);
  GDNCP_CHECK(!m.grad_fn, "Tensor::requires_grad_: only leaves (tensors not produced by a recorded op) can be marked");
  m.requires_grad = value;
  return *this;
}

Tensor Tensor::grad() const { return impl_ && impl_->meta ? impl_->meta->grad : Tensor(); }

void Tensor::zero_grad() {
  if (impl_ && impl_->meta) impl_->meta->grad = Tensor();
}

void Tensor::set_grad(const Tensor& g) {
  GDNCP_CHECK(!grad_fn(), "Tensor::set_grad: only a leaf has an accumulated gradient");
  GDNCP_CHECK(g.defined() && g.shape() == shape() && g.dtype() == dtype() && g.device() == device(),
              "Tensor::set_grad: g must be ", dtype_name(dtype()), shape_str(shape()), " on ", device_name(device()),
              ", got ", g.defined() ? g.str() : std::string("an undefined tensor"));
  detail::TensorInternals::meta(*this).grad = g;
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = checked(impl_).storage;
  impl->shape = impl_->shape;
  impl->dtype = impl_->dtype;
  return Tensor(std::move(impl));
}

std::shared_ptr<autograd::Node> Tensor::grad_fn() const {
  return impl_ && impl_->meta ? impl_->meta->grad_fn : nullptr;
}

bool Tensor::storage_unique() const { return impl_ && impl_.use_count() == 1 && impl_->storage.use_count() == 1; }

// --- reshape (differentiable) ----------------------------------------------------------

namespace {
class ReshapeNode : public autograd::Node {
 public:
  explicit ReshapeNode(Shape in_shape) : in_shape_(std::move(in_shape)) {}
  const char* name() const override { return "reshape"; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override { return {g[0].reshape(in_shape_)}; }

 private:
  Shape in_shape_;
};
}  // namespace

Tensor Tensor::reshape(const Shape& new_shape) const {
  GDNCP_CHECK(detail::checked_numel(new_shape, "Tensor::reshape") == numel(), "Tensor::reshape: cannot view ", str(),
              " as ", shape_str(new_shape));
  Tensor out = detach();
  out.impl_->shape = new_shape;
  autograd::record(std::make_shared<ReshapeNode>(shape()), {*this}, {out});
  return out;
}

// --- math used by the engine -------------------------------------------------------------

namespace detail {

Tensor add(const Tensor& a, const Tensor& b) {
  GDNCP_CHECK(a.shape() == b.shape() && a.dtype() == b.dtype() && a.device() == b.device(), "add: ", a.str(), " and ",
              b.str(), " differ");
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  const int64_t n = a.numel();
  if (a.device() == Device::cuda) {
    cuda_add(out.data(), a.data(), b.data(), a.dtype(), n);
  } else if (a.dtype() == DType::f64) {
    const double *x = a.data_ptr<double>(), *y = b.data_ptr<double>();
    double* o = out.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
  } else {
    for (int64_t i = 0; i < n; ++i)
      host_store(out.data(), a.dtype(), i,
                 static_cast<float>(host_load(a.data(), a.dtype(), i)) +
                     static_cast<float>(host_load(b.data(), b.dtype(), i)));
  }
  return out;
}

}  // namespace detail
}  // namespace gdncp
