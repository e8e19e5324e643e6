// src/reference/ops_output_divide.cpp — ops::output_divide, out = num / (den + eps)
// (docs/design.md §5), one autograd node.
//
//   out[b,n,h,j] = num[b,n,h,j] / (den[b,h,n] + eps)
//   dnum = dout / (den + eps),   dden[b,h,n] = −Σ_j dout_j num_j / (den + eps)²
// Computed in num's dtype (the compute dtype); out is rounded to out_dtype.
// Gradient rule: fresh gradients for num and den in their dtypes.
#include "reference/ops_common.h"

namespace gdncp {
namespace ops {
namespace {

using namespace cpu::detail;
using namespace ops::detail;

TokenRows geometry(const Tensor& num, const Tensor& den) {
  const char* op = "ops::output_divide";
  require_cpu_inputs(op, {{num, "num"}, {den, "den"}});
  GDNCP_CHECK(num.dim() == 4, op, ": num must be (B, N, H, D), got ", num.str());
  const TokenRows g{num.size(0), num.size(1), num.size(2), num.size(3)};
  GDNCP_CHECK(den.shape() == Shape({g.B, g.H, g.N}), op, ": den must be (B, H, N), got ", den.str());
  return g;
}

inline size_t den_at(const TokenRows& g, int64_t b, int64_t n, int64_t h) {
  return static_cast<size_t>((b * g.H + h) * g.N + n);
}

template <typename T>
Tensor divide_forward(const Tensor& num_t, const Tensor& den_t, double eps, DType out_dtype) {
  const TokenRows g = geometry(num_t, den_t);
  const std::vector<T> num = values<T>(num_t, num_t.numel()), den = values<T>(den_t, den_t.numel());
  std::vector<T> out(num.size());
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t n = 0; n < g.N; ++n)
      for (int64_t h = 0; h < g.H; ++h) {
        const T q = den[den_at(g, b, n, h)] + static_cast<T>(eps);
        const size_t r = g.row(b, n, h);
        for (int64_t j = 0; j < g.D; ++j) out[r + static_cast<size_t>(j)] = num[r + static_cast<size_t>(j)] / q;
      }
  return tensor_from(out, num_t.shape(), out_dtype);
}

class OutputDivideNode : public RefNode<OutputDivideNode> {
 public:
  explicit OutputDivideNode(double eps) : RefNode("ops::output_divide"), eps_(eps) {}

  template <typename T>
  std::vector<Tensor> run(const std::vector<Tensor>& grads) {
    const Tensor& gout = grads[0];
    const Tensor &num_t = saved(0), &den_t = saved(1);
    const TokenRows g = geometry(num_t, den_t);
    const std::vector<T> num = values<T>(num_t, num_t.numel()), den = values<T>(den_t, den_t.numel());
    const std::vector<T> go = values<T>(gout, num_t.numel());
    std::vector<T> dnum(num.size()), dden(den.size(), T(0));
    for (int64_t b = 0; b < g.B; ++b)
      for (int64_t n = 0; n < g.N; ++n)
        for (int64_t h = 0; h < g.H; ++h) {
          const T q = den[den_at(g, b, n, h)] + static_cast<T>(eps_);
          const size_t r = g.row(b, n, h);
          T s = T(0);
          for (int64_t j = 0; j < g.D; ++j) {
            dnum[r + static_cast<size_t>(j)] = go[r + static_cast<size_t>(j)] / q;
            s += go[r + static_cast<size_t>(j)] * num[r + static_cast<size_t>(j)];
          }
          dden[den_at(g, b, n, h)] = -s / (q * q);
        }
    return grads_like_saved<T>({&dnum, &dden});
  }

 private:
  double eps_;
};

}  // namespace

Tensor output_divide(const Tensor& num, const Tensor& den, double eps, DType out_dtype) {
  const Tensor out = num.dtype() == DType::f64 ? divide_forward<double>(num, den, eps, out_dtype)
                                               : divide_forward<float>(num, den, eps, out_dtype);
  record_saving_inputs<OutputDivideNode>({num, den}, {out}, eps);
  return out;
}

}  // namespace ops
}  // namespace gdncp
