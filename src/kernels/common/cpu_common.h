// src/kernels/common/cpu_common.h — small helpers shared by the CPU kernels and ops.
//
// Storage dtypes (f32, bf16, f64) are read and written through the compute
// type T (float or double). The dtype is dispatched once per tensor, outside
// the loops: In<T> aliases a tensor that already is T and converts it once
// otherwise; results are built in T buffers and written back with store().
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "gdncp/error.h"
#include "gdncp/tensor.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace cpu {
namespace detail {

// --- element conversion ---------------------------------------------------
template <typename T>
inline T to_compute(float x) {
  return static_cast<T>(x);
}
template <typename T>
inline T to_compute(double x) {
  return static_cast<T>(x);
}
template <typename T>
inline T to_compute(bf16 x) {
  return static_cast<T>(bf16_to_float(x));
}

template <typename T>
inline void from_compute(float* p, int64_t i, T v) {
  p[i] = static_cast<float>(v);
}
template <typename T>
inline void from_compute(double* p, int64_t i, T v) {
  p[i] = static_cast<double>(v);
}
template <typename T>
inline void from_compute(bf16* p, int64_t i, T v) {
  p[i] = float_to_bf16(static_cast<float>(v));
}

// Calls fn(ptr) with t's data as float*, double* or bf16*.
template <typename Fn>
void visit(const Tensor& t, Fn&& fn) {
  switch (t.dtype()) {
    case DType::f32: fn(static_cast<const float*>(t.data())); return;
    case DType::f64: fn(static_cast<const double*>(t.data())); return;
    case DType::bf16: fn(static_cast<const bf16*>(t.data())); return;
  }
  GDNCP_FAIL("unknown dtype");
}
template <typename Fn>
void visit_mut(Tensor& t, Fn&& fn) {
  switch (t.dtype()) {
    case DType::f32: fn(static_cast<float*>(t.data())); return;
    case DType::f64: fn(static_cast<double*>(t.data())); return;
    case DType::bf16: fn(static_cast<bf16*>(t.data())); return;
  }
  GDNCP_FAIL("unknown dtype");
}

template <typename T>
constexpr DType compute_dtype_of() {
  return dtype_of<T>::value;
}

// Read-only view of a CPU tensor in T. An undefined tensor gives data() == nullptr.
template <typename T>
class In {
 public:
  explicit In(const Tensor& t) {
    if (!t.defined()) return;
    GDNCP_CHECK(!t.is_cuda(), "CPU kernel got a CUDA tensor ", t.str());
    if (t.dtype() == compute_dtype_of<T>()) {
      p_ = static_cast<const T*>(t.data());
      return;
    }
    buf_.resize(static_cast<size_t>(t.numel()));
    visit(t, [&](const auto* src) {
      for (size_t i = 0; i < buf_.size(); ++i) buf_[i] = to_compute<T>(src[i]);
    });
    p_ = buf_.data();
  }
  In(const In&) = delete;
  In& operator=(const In&) = delete;
  const T* data() const { return p_; }
  T operator[](int64_t i) const { return p_[i]; }
  bool defined() const { return p_ != nullptr; }

 private:
  const T* p_ = nullptr;
  std::vector<T> buf_;
};

// Writable view of a CPU output tensor in T: aliases t when it already is T,
// else a scratch buffer that commit() rounds into t. Every element must be
// written before commit().
template <typename T>
class Out {
 public:
  explicit Out(Tensor& t) : t_(t) {
    GDNCP_CHECK(t.defined(), "CPU kernel: output tensor is undefined");
    GDNCP_CHECK(!t.is_cuda(), "CPU kernel got a CUDA tensor ", t.str());
    if (t.dtype() == compute_dtype_of<T>()) {
      p_ = static_cast<T*>(t.data());
    } else {
      buf_.resize(static_cast<size_t>(t.numel()));
      p_ = buf_.data();
    }
  }
  Out(const Out&) = delete;
  Out& operator=(const Out&) = delete;
  T* data() { return p_; }
  T& operator[](int64_t i) { return p_[i]; }
  void commit() {
    if (buf_.empty()) return;
    visit_mut(t_, [&](auto* dst) {
      for (size_t i = 0; i < buf_.size(); ++i) from_compute<T>(dst, static_cast<int64_t>(i), buf_[i]);
    });
  }

 private:
  Tensor& t_;
  T* p_ = nullptr;
  std::vector<T> buf_;
};

// A new CPU tensor of dtype holding the values of buf (rounded).
template <typename T>
Tensor tensor_from(const std::vector<T>& buf, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cpu);
  GDNCP_CHECK(static_cast<size_t>(t.numel()) == buf.size(), "tensor_from: ", buf.size(), " values for shape ",
              shape_str(shape));
  visit_mut(t, [&](auto* dst) {
    for (size_t i = 0; i < buf.size(); ++i) from_compute<T>(dst, static_cast<int64_t>(i), buf[i]);
  });
  return t;
}

// Values of a CPU tensor in T, as a fresh vector; n zeros when t is undefined
// (an output that got no gradient).
template <typename T>
std::vector<T> values(const Tensor& t, int64_t n) {
  if (!t.defined()) return std::vector<T>(static_cast<size_t>(n), T(0));
  GDNCP_CHECK(t.numel() == n, "expected ", n, " elements, got ", t.str());
  In<T> in(t);
  return std::vector<T>(in.data(), in.data() + n);
}

// The fine-grained ops run on the CPU only.
inline void require_cpu(const Tensor& t, const char* op, const char* arg) {
  GDNCP_CHECK(t.defined(), op, ": ", arg, " is undefined");
  GDNCP_CHECK(!t.is_cuda(), op, ": ", arg, " is a CUDA tensor; this op runs on the CPU only (use gdncp::bigdn)");
}

// --- the fine ops' token tensors (B, N, H, D), N = F·S -----------------------
struct TokenGeometry {
  int64_t B, N, H, D, F, S;
  // Offset of row (b, n, h).
  size_t row(int64_t b, int64_t n, int64_t h) const { return static_cast<size_t>(((b * N + n) * H + h) * D); }
};

// Sizes of the pair x, y of (B, N, H, D) tensors over F frames of S tokens:
// checks F, S > 0, x 4-d with N = F·S and y of x's shape.
inline TokenGeometry token_pair_geometry(const char* op, const Tensor& x, const char* x_name, const Tensor& y,
                                         const char* y_name, int64_t F, int64_t S) {
  GDNCP_CHECK(F > 0 && S > 0, op, ": F and S must be > 0, got F = ", F, ", S = ", S);
  GDNCP_CHECK(x.dim() == 4, op, ": ", x_name, " must be (B, N, H, D), got ", x.str());
  const TokenGeometry g{x.size(0), x.size(1), x.size(2), x.size(3), F, S};
  GDNCP_CHECK(g.N == F * S, op, ": ", x_name, ": N = ", g.N, " must equal F·S = ", F * S);
  GDNCP_CHECK(y.shape() == x.shape(), op, ": ", y_name, " must have ", x_name, "'s shape, got ", y.str());
  return g;
}

// Cheap guard at the twin entries: a shape that does not match the Dims would
// make the loops read or write out of bounds.
inline void check_shape(const Tensor& t, const Shape& shape, const char* op, const char* name) {
  GDNCP_CHECK(t.defined(), op, ": ", name, " is undefined");
  GDNCP_CHECK(t.shape() == shape, op, ": ", name, " must be ", shape_str(shape), ", got ", t.str());
}
inline void check_shape_if_defined(const Tensor& t, const Shape& shape, const char* op, const char* name) {
  if (t.defined()) check_shape(t, shape, op, name);
}

// dq_hat / dk_hat: the compute dtype of qkv or bf16 (kernels.h, "hat-grad dtype").
// In<T> reads either; Out<T> rounds into bf16 (to nearest even) on commit().
inline void check_grad_hat(const Tensor& t, DType qkv_dtype, const char* op, const char* name) {
  const DType ct = compute_dtype(qkv_dtype);
  GDNCP_CHECK(t.dtype() == ct || t.dtype() == DType::bf16, op, ": ", name, " must be ", dtype_name(ct),
              " or bf16, got ", t.str());
}

// What the token prep of phase A (k) and phase C (q) reads: qkv (B, N, 3, H, D),
// rstd (B, N, 2), the stream's norm weight (C) when defined, the rope tables (N, D).
inline void check_prep_inputs(const Tensor& qkv, const Tensor& rstd, const Tensor& norm_w, const char* norm_w_name,
                              const Tensor& rope_cos, const Tensor& rope_sin, const Dims& d, const char* op) {
  check_shape(qkv, {d.B, d.N(), 3, d.H, d.D}, op, "qkv");
  check_shape(rstd, {d.B, d.N(), 2}, op, "rstd");
  check_shape_if_defined(norm_w, {d.C()}, op, norm_w_name);
  check_shape(rope_cos, {d.N(), d.D}, op, "rope_cos");
  check_shape(rope_sin, {d.N(), d.D}, op, "rope_sin");
}

// --- the qkv layout (B, N, 3, H, D) -----------------------------------------
// Offset of channel c, head 0, dim 0 of token n of batch b.
inline int64_t qkv_offset(int64_t b, int64_t n, int64_t c, int64_t N, int64_t C) { return ((b * N + n) * 3 + c) * C; }

// Writes channel c of a (B, N, 3, H, D) tensor from src (B, N, H, D) in T;
// the other channels are left untouched.
template <typename T>
void store_qkv_channel(Tensor& qkv_like, int64_t c, const std::vector<T>& src, int64_t B, int64_t N, int64_t C) {
  visit_mut(qkv_like, [&](auto* dst) {
    for (int64_t t = 0; t < B * N; ++t) {
      const int64_t o = (t * 3 + c) * C;
      const T* s = src.data() + t * C;
      for (int64_t i = 0; i < C; ++i) from_compute<T>(dst, o + i, s[i]);
    }
  });
}

// --- token prep (docs/design.md §2) --------------------------------------------------
// One head's row of q or k: x̂ = x·r·w (w may be null = 1), x⁺ = relu(x̂)·scale,
// xʳ[d] = x⁺[d]·cos[d] + x⁺[d^1]·sin[d]. Any output pointer may be null.
template <typename T>
inline void prep_row(T* xhat, T* xplus, T* xrot, const T* x, T r, const T* w, T scale, const T* cos, const T* sin,
                     int64_t D, T* scratch_plus) {
  T* plus = xplus ? xplus : scratch_plus;
  for (int64_t d = 0; d < D; ++d) {
    const T h = x[d] * r * (w ? w[d] : T(1));
    if (xhat) xhat[d] = h;
    plus[d] = (h > T(0) ? h : T(0)) * scale;
  }
  if (xrot)
    for (int64_t d = 0; d < D; ++d) xrot[d] = plus[d] * cos[d] + plus[d ^ 1] * sin[d];
}

// Backward of the rotation, accumulated: dx⁺[d] += dxʳ[d]·cos[d] + dxʳ[d^1]·sin[d^1].
template <typename T>
inline void unrope_add(T* dxplus, const T* dxrot, const T* cos, const T* sin, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dxplus[d] += dxrot[d] * cos[d] + dxrot[d ^ 1] * sin[d ^ 1];
}

// Backward of relu·scale: dx̂ = dx⁺·scale where x̂ > 0, else 0.
template <typename T>
inline void relu_scale_bwd(T* dxhat, const T* dxplus, const T* xhat, T scale, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dxhat[d] = xhat[d] > T(0) ? dxplus[d] * scale : T(0);
}

// --- small dense matrices (row-major D×D) ----------------------------------
// Inner loops are written as y[j] += a·x[j] (axpy) over contiguous rows, the
// form the compiler vectorises without reassociating sums (so results stay
// bitwise reproducible).

// y[0..n) += a·x[0..n)
template <typename T>
inline void axpy(T* __restrict y, T a, const T* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// out = aᵀ (out must not alias a).
template <typename T>
inline void transpose(T* __restrict out, const T* __restrict a, int64_t D) {
  for (int64_t i = 0; i < D; ++i)
    for (int64_t j = 0; j < D; ++j) out[j * D + i] = a[i * D + j];
}

// out = a·b (out must not alias a or b).
template <typename T>
inline void matmul(T* out, const T* a, const T* b, int64_t D) {
  for (int64_t i = 0; i < D * D; ++i) out[i] = T(0);
  for (int64_t i = 0; i < D; ++i)
    for (int64_t k = 0; k < D; ++k) axpy(out + i * D, a[i * D + k], b + k * D, D);
}

// out = aᵀ·b (out must not alias a or b).
template <typename T>
inline void matmul_tn(T* out, const T* a, const T* b, int64_t D) {
  for (int64_t i = 0; i < D * D; ++i) out[i] = T(0);
  for (int64_t k = 0; k < D; ++k)
    for (int64_t i = 0; i < D; ++i) axpy(out + i * D, a[k * D + i], b + k * D, D);
}

// out = a·bᵀ (out must not alias a or b; bt: D×D scratch).
template <typename T>
inline void matmul_nt(T* out, const T* a, const T* b, int64_t D, T* bt) {
  transpose(bt, b, D);
  matmul(out, a, bt, D);
}

// out = aᵀ·x (out must not alias a or x).
template <typename T>
inline void matvec_t(T* out, const T* a, const T* x, int64_t D) {
  for (int64_t i = 0; i < D; ++i) out[i] = T(0);
  for (int64_t k = 0; k < D; ++k) axpy(out, x[k], a + k * D, D);
}

// out = a·x in dot form (for the cheap D² paths).
template <typename T>
inline void matvec(T* out, const T* a, const T* x, int64_t D) {
  for (int64_t i = 0; i < D; ++i) {
    T s = T(0);
    for (int64_t k = 0; k < D; ++k) s += a[i * D + k] * x[k];
    out[i] = s;
  }
}

// out = a·x given at = aᵀ (out must not alias at or x).
template <typename T>
inline void matvec_from_t(T* out, const T* at, const T* x, int64_t D) {
  matvec_t(out, at, x, D);
}

// Accumulator of long reductions with cancellation (the decay gradient sums D²
// terms of both signs): double for float, long double for double.
template <typename T>
struct Wider;
template <>
struct Wider<float> {
  using type = double;
};
template <>
struct Wider<double> {
  using type = long double;
};

template <typename T>
inline T dot_wide(const T* a, const T* b, int64_t n) {
  typename Wider<T>::type s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<typename Wider<T>::type>(a[i]) * b[i];
  return static_cast<T>(s);
}

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = T(0);
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace detail
}  // namespace cpu
}  // namespace gdncp
