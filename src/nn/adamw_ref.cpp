// src/nn/adamw_ref.cpp — CPU twin of one AdamW update (in place on p, m, v).
// Gradient rule: the parameter and both moments are updated in place; g is read.
#include <cmath>

#include "nn/nn_kernels.h"

namespace gdncp {
namespace cpu {
namespace {

template <typename T>
void adamw_loop(T* p, T* m, T* v, const T* g, const AdamWStep& s, int64_t n) {
  const T lr = static_cast<T>(s.lr), decay = static_cast<T>(s.lr * s.weight_decay);
  const T b1 = static_cast<T>(s.beta1), b2 = static_cast<T>(s.beta2), eps = static_cast<T>(s.eps);
  const T bc1 = static_cast<T>(s.bias_corr1), bc2 = static_cast<T>(s.bias_corr2);
  const T gs = static_cast<T>(s.grad_scale);
  for (int64_t i = 0; i < n; ++i) {
    const T gi = gs * g[i];
    T pi = p[i] - decay * p[i];
    m[i] = b1 * m[i] + (T(1) - b1) * gi;
    v[i] = b2 * v[i] + (T(1) - b2) * gi * gi;
    pi -= lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
    p[i] = pi;
  }
}

}  // namespace

void adamw_step(Tensor& p, Tensor& m, Tensor& v, const Tensor& g, const AdamWStep& s) {
  if (p.dtype() == DType::f64)
    return adamw_loop(p.data_ptr<double>(), m.data_ptr<double>(), v.data_ptr<double>(), g.data_ptr<double>(), s,
                      p.numel());
  adamw_loop(p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(), s, p.numel());
}

}  // namespace cpu
}  // namespace gdncp
