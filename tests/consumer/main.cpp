// Uses the installed gdncp: runs the layer forward and backward on the CPU
// and checks that every gradient came back finite and of the input's shape.
#include <gdncp/gdncp.h>

#include <cmath>
#include <cstdio>

int main() {
  using namespace gdncp;
  const int64_t B = 1, H = 2, D = 8, F = 3, S = 4, N = F * S;
  Tensor qkv = Tensor::randn({B, N, 3, H, D}, DType::f32, Device::cpu, 1).requires_grad_();
  Tensor beta = Tensor::uniform({B, H, F, S}, DType::f32, Device::cpu, 2, 0.1, 0.9).requires_grad_();
  Tensor decay = Tensor::uniform({B, H, F}, DType::f32, Device::cpu, 3, 0.5, 1.0).requires_grad_();
  Tensor qw = Tensor::uniform({H * D}, DType::f32, Device::cpu, 4, 0.5, 1.5).requires_grad_();
  Tensor kw = Tensor::uniform({H * D}, DType::f32, Device::cpu, 5, 0.5, 1.5).requires_grad_();
  auto [cos, sin] = rope_tables(N, D, DType::f32, Device::cpu);
  Tensor out = bigdn(qkv, beta, decay, qw, kw, cos, sin, F, S);
  backward(out, Tensor::full(out.shape(), 1.0, DType::f32));
  for (const Tensor* t : {&qkv, &beta, &decay, &qw, &kw}) {
    if (!t->grad().defined() || t->grad().shape() != t->shape()) {
      std::printf("consumer: missing gradient\n");
      return 1;
    }
    for (double v : t->grad().to_vector())
      if (!std::isfinite(v)) {
        std::printf("consumer: non-finite gradient\n");
        return 1;
      }
  }
  std::printf("consumer: ok, out %s\n", out.str().c_str());
  return 0;
}
