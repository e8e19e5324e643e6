// tests/bigdn_fixtures.h — seeded inputs of the single-rank BiGDN layer, shared
// by test_ops_gradcheck, test_bigdn and test_bad_input.
//
// Inputs are drawn so that the scan is well conditioned: beta in (0.1, 0.9),
// decay in (0.5, 0.99), norm weights in (0.5, 1.5) (positive, so a relu'd row
// is rarely all zero and den stays away from 0) and k_scale = D^-½·S^-½ as in
// Sana's production blocks.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gdncp/gdncp.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace test {

struct LayerInputs {
  Dims d;
  Tensor qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin;
  Tensor rope_cos_q, rope_sin_q;  // q's own tables, or undefined (q uses rope_cos, rope_sin)
  BigdnOptions opt;

  std::vector<Tensor> list() const { return {qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin}; }
  Tensor run(const std::vector<Tensor>& x, bool fused = true) const {
    return fused ? bigdn(x[0], x[1], x[2], x[3], x[4], x[5], x[6], d.F, d.S, opt, Tensor(), rope_cos_q, rope_sin_q)
                 : bigdn_unfused(x[0], x[1], x[2], x[3], x[4], x[5], x[6], d.F, d.S, opt, Tensor(), rope_cos_q,
                                 rope_sin_q);
  }
  Tensor run(bool fused = true) const { return run(list(), fused); }
};

inline Dims dims(int64_t B, int64_t H, int64_t D, int64_t F, int64_t S) { return Dims{B, H, D, F, S}; }

inline std::string dims_str(const Dims& d) {
  return "B=" + std::to_string(d.B) + " H=" + std::to_string(d.H) + " D=" + std::to_string(d.D) +
         " F=" + std::to_string(d.F) + " S=" + std::to_string(d.S);
}

// Data tensors in `dtype` (f32, bf16 or f64); tables in f64 when dtype is f64, else f32.
inline LayerInputs make_layer_inputs(const Dims& d, DType dtype, uint64_t seed, bool norm_q = true,
                                     bool norm_k = true) {
  LayerInputs in;
  in.d = d;
  const DType table = dtype == DType::f64 ? DType::f64 : DType::f32;
  const Device cpu = Device::cpu;
  in.qkv = Tensor::randn({d.B, d.N(), 3, d.H, d.D}, dtype, cpu, seed + 1);
  in.beta = Tensor::uniform({d.B, d.H, d.F, d.S}, dtype, cpu, seed + 2, 0.1, 0.9);
  in.decay = Tensor::uniform({d.B, d.H, d.F}, dtype, cpu, seed + 3, 0.5, 0.99);
  if (norm_q) in.q_norm_w = Tensor::uniform({d.C()}, table, cpu, seed + 4, 0.5, 1.5);
  if (norm_k) in.k_norm_w = Tensor::uniform({d.C()}, table, cpu, seed + 5, 0.5, 1.5);
  auto rope = rope_tables(d.N(), d.D, table, cpu, /*offset=*/static_cast<int64_t>(seed % 7));
  in.rope_cos = rope.first;
  in.rope_sin = rope.second;
  in.opt.k_scale = 1.0 / std::sqrt(static_cast<double>(d.D * d.S));
  return in;
}

// The same inputs converted to another dtype (tables follow the f64 rule).
inline LayerInputs convert(const LayerInputs& in, DType dtype) {
  LayerInputs out = in;
  const DType table = dtype == DType::f64 ? DType::f64 : DType::f32;
  out.qkv = in.qkv.to(dtype);
  out.beta = in.beta.to(dtype);
  out.decay = in.decay.to(dtype);
  if (in.q_norm_w.defined()) out.q_norm_w = in.q_norm_w.to(table);
  if (in.k_norm_w.defined()) out.k_norm_w = in.k_norm_w.to(table);
  out.rope_cos = in.rope_cos.to(table);
  out.rope_sin = in.rope_sin.to(table);
  if (in.rope_cos_q.defined()) out.rope_cos_q = in.rope_cos_q.to(table);
  if (in.rope_sin_q.defined()) out.rope_sin_q = in.rope_sin_q.to(table);
  return out;
}

// Marks every defined floating input except the rope tables as requiring grad.
inline void require_grads(LayerInputs& in) {
  for (Tensor* t : {&in.qkv, &in.beta, &in.decay, &in.q_norm_w, &in.k_norm_w})
    if (t->defined()) t->requires_grad_();
}

}  // namespace test
}  // namespace gdncp
