// src/layer/validate.cpp — argument checks of the BiGDN layer (docs/design.md §9).
#include "layer/validate.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "gdncp/error.h"
#include "kernels/common/clip_guard.h"
#include "kernels/common/head_dims.h"

namespace gdncp {
namespace {

// "entry: arg: " prefix of every message.
struct Arg {
  const char* entry;
  const char* name;
};

void require_defined(const Arg& a, const Tensor& t) {
  GDNCP_CHECK(t.defined(), a.entry, ": ", a.name, ": required tensor is undefined");
}

void require_shape(const Arg& a, const Tensor& t, const Shape& expected, const char* layout) {
  GDNCP_CHECK(t.dim() == static_cast<int64_t>(expected.size()), a.entry, ": ", a.name, ": expected ", expected.size(),
              " dims ", layout, " = ", shape_str(expected), ", got ", t.dim(), " dims ", shape_str(t.shape()));
  GDNCP_CHECK(t.shape() == expected, a.entry, ": ", a.name, ": expected shape ", layout, " = ", shape_str(expected),
              ", got ", shape_str(t.shape()));
}

void require_device(const Arg& a, const Tensor& t, Device device) {
  GDNCP_CHECK(t.device() == device, a.entry, ": ", a.name, ": is on ", device_name(t.device()), " but qkv is on ",
              device_name(device), " (all tensors must be on one device)");
}

// qkv, beta, decay: f32/bf16, or f64 when qkv is f64 (all or none).
void require_data_dtype(const Arg& a, const Tensor& t, DType qkv_dtype) {
  if (qkv_dtype == DType::f64)
    GDNCP_CHECK(t.dtype() == DType::f64, a.entry, ": ", a.name, ": is ", dtype_name(t.dtype()),
                " but qkv is f64 (either every floating input is f64 or none is)");
  else
    GDNCP_CHECK(t.dtype() != DType::f64, a.entry, ": ", a.name, ": is f64 but qkv is ", dtype_name(qkv_dtype),
                " (either every floating input is f64 or none is)");
}

// Norm weights and rope tables: f32, or f64 with f64 inputs.
void require_table_dtype(const Arg& a, const Tensor& t, bool f64) {
  const DType want = f64 ? DType::f64 : DType::f32;
  GDNCP_CHECK(t.dtype() == want, a.entry, ": ", a.name, ": must be ", dtype_name(want), " (qkv is ",
              f64 ? "f64" : "f32/bf16", "), got ", dtype_name(t.dtype()));
}

}  // namespace

Dims validate_bigdn_inputs(const char* entry, const Tensor& qkv, const Tensor& beta, const Tensor& decay,
                           const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& rope_cos,
                           const Tensor& rope_sin, int64_t F, int64_t S, const BigdnOptions& options,
                           bool allow_empty) {
  GDNCP_CHECK(F > 0 || (allow_empty && F == 0), entry, ": F: frames per rank must be > 0", allow_empty ? " or 0" : "",
              ", got ", F);
  GDNCP_CHECK(S > 0, entry, ": S: tokens per frame must be > 0, got ", S);

  // qkv fixes B, N, H, D.
  const Arg aq{entry, "qkv"};
  require_defined(aq, qkv);
  GDNCP_CHECK(qkv.dim() == 5, entry, ": qkv: expected 5 dims (B, N, 3, H, D), got ", shape_str(qkv.shape()));
  Dims d;
  d.B = qkv.size(0);
  d.H = qkv.size(3);
  d.D = qkv.size(4);
  d.F = F;
  d.S = S;
  GDNCP_CHECK(qkv.size(2) == 3, entry, ": qkv: dim 2 must be 3 (q, k, v), got ", shape_str(qkv.shape()));
  GDNCP_CHECK(d.B > 0, entry, ": qkv: batch B (dim 0) must be > 0, got ", shape_str(qkv.shape()));
  GDNCP_CHECK(d.H > 0, entry, ": qkv: heads H (dim 3) must be > 0, got ", shape_str(qkv.shape()));
  const int64_t N = checked_mul(F, S, (std::string(entry) + ": F·S").c_str());
  GDNCP_CHECK(qkv.size(1) == N, entry, ": qkv: dim 1 (N = ", qkv.size(1), ") must equal F·S = ", F, "·", S, " = ", N);
  GDNCP_CHECK(supported_head_dim(d.D), entry, ": qkv: head dim D (dim 4) must be even and in ", kMinHeadDim, "..",
              kMaxHeadDim, ", got ", d.D);

  // Shapes.
  const Arg ab{entry, "beta"}, ag{entry, "decay"}, aqw{entry, "q_norm_w"}, akw{entry, "k_norm_w"},
      ac{entry, "rope_cos"}, as{entry, "rope_sin"};
  require_defined(ab, beta);
  require_shape(ab, beta, {d.B, d.H, F, S}, "(B, H, F, S)");
  require_defined(ag, decay);
  require_shape(ag, decay, {d.B, d.H, F}, "(B, H, F)");
  if (q_norm_w.defined()) require_shape(aqw, q_norm_w, {d.C()}, "(C = H·D)");
  if (k_norm_w.defined()) require_shape(akw, k_norm_w, {d.C()}, "(C = H·D)");
  require_defined(ac, rope_cos);
  require_shape(ac, rope_cos, {d.N(), d.D}, "(N, D)");
  require_defined(as, rope_sin);
  require_shape(as, rope_sin, {d.N(), d.D}, "(N, D)");

  // Devices.
  const Device dev = qkv.device();
  require_device(ab, beta, dev);
  require_device(ag, decay, dev);
  if (q_norm_w.defined()) require_device(aqw, q_norm_w, dev);
  if (k_norm_w.defined()) require_device(akw, k_norm_w, dev);
  require_device(ac, rope_cos, dev);
  require_device(as, rope_sin, dev);

  // Dtypes.
  const bool f64 = qkv.dtype() == DType::f64;
  GDNCP_CHECK(!(f64 && dev == Device::cuda), entry, ": qkv: f64 is supported on the CPU only (got a CUDA f64 tensor)");
  require_data_dtype(ab, beta, qkv.dtype());
  require_data_dtype(ag, decay, qkv.dtype());
  if (q_norm_w.defined()) require_table_dtype(aqw, q_norm_w, f64);
  if (k_norm_w.defined()) require_table_dtype(akw, k_norm_w, f64);
  require_table_dtype(ac, rope_cos, f64);
  require_table_dtype(as, rope_sin, f64);

  // Scalars.
  GDNCP_CHECK(std::isfinite(options.k_scale), entry, ": k_scale: must be finite, got ", options.k_scale);
  // > 0: with 0, a zero row (norm_eps) or a zero denominator (eps) turns finite input into NaN.
  GDNCP_CHECK(std::isfinite(options.norm_eps) && options.norm_eps > 0, entry,
              ": norm_eps: must be finite and > 0, got ", options.norm_eps);
  GDNCP_CHECK(std::isfinite(options.eps) && options.eps > 0, entry, ": eps: must be finite and > 0, got ", options.eps);
  const int p = static_cast<int>(options.precision);
  GDNCP_CHECK(p >= 0 && p <= static_cast<int>(Precision::ieee), entry, ": precision: unknown value ", p);
  const int c = static_cast<int>(options.checkpoint);
  GDNCP_CHECK(c >= 0 && c <= static_cast<int>(Checkpoint::automatic), entry, ": checkpoint: unknown value ", c);
  return d;
}

void validate_rope_q(const char* entry, const Tensor& rope_cos_q, const Tensor& rope_sin_q, const Dims& d,
                     const Tensor& rope_cos, Device device) {
  GDNCP_CHECK(rope_cos_q.defined() == rope_sin_q.defined(), entry, ": ",
              rope_cos_q.defined() ? "rope_sin_q" : "rope_cos_q", ": is undefined but ",
              rope_cos_q.defined() ? "rope_cos_q" : "rope_sin_q",
              " is given (give both q tables, or neither to rotate q with rope_cos/rope_sin)");
  if (!rope_cos_q.defined()) return;
  const bool f64 = rope_cos.dtype() == DType::f64;
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{rope_cos_q, "rope_cos_q"},
                                std::pair<const Tensor&, const char*>{rope_sin_q, "rope_sin_q"}}) {
    const Arg a{entry, name};
    require_shape(a, t, {d.N(), d.D}, "(N, D)");
    require_device(a, t, device);
    require_table_dtype(a, t, f64);
  }
}

void validate_clip_starts(const char* entry, const Tensor& clip_starts, int64_t B, int64_t F, Device device) {
  kernels::report_clip_fault(entry);  // in the local checks: in CP entries every rank raises it at once
  if (!clip_starts.defined()) return;
  const Tensor& c = clip_starts;
  GDNCP_CHECK(c.shape() == Shape({B, F}), entry, ": clip_starts: must be (B, F) = (", B, ", ", F,
              ") (1 where a frame begins a clip), got ", c.str());
  GDNCP_CHECK(c.dtype() == DType::f32, entry, ": clip_starts: must be f32, got ", dtype_name(c.dtype()));
  GDNCP_CHECK(c.device() == device, entry, ": clip_starts: is on ", device_name(c.device()), " but the inputs are on ",
              device_name(device), " (all tensors must be on one device)");
  validate_clip_values(entry, c);
}

void validate_clip_values(const char* entry, const Tensor& clip_starts) {
  // A host mask is read here; a device mask on the device, after the kernels
  // that read it (Note [clip mask values] in src/kernels/common/clip_guard.h).
  if (!clip_starts.defined() || clip_starts.device() != Device::cpu || clip_starts.dtype() != DType::f32) return;
  const float* v = clip_starts.data_ptr<float>();
  const int64_t F = std::max<int64_t>(clip_starts.dim() == 2 ? clip_starts.size(1) : 1, 1);
  for (int64_t i = 0; i < clip_starts.numel(); ++i)
    if (v[i] != 0.0f && v[i] != 1.0f) GDNCP_FAIL(kernels::clip_value_message(entry, v[i], i / F, i % F, ""));
}

}  // namespace gdncp
