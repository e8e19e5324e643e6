// tests/util/test_util.cpp — comparisons and the f64 central-difference gradcheck.
#include "util/test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>

namespace gdncp {
namespace test {

namespace {
double norm2(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}
}  // namespace

double rel_l2(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  if (x.size() != y.size()) return std::numeric_limits<double>::infinity();
  double num = 0;
  for (size_t i = 0; i < x.size(); ++i) num += (x[i] - y[i]) * (x[i] - y[i]);
  if (std::isnan(num)) return std::numeric_limits<double>::infinity();
  return std::sqrt(num) / std::max(norm2(y), 1e-300);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  if (x.size() != y.size()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = std::fabs(x[i] - y[i]);
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    m = std::max(m, d);
  }
  return m;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.to(Device::cpu), y = b.to(Device::cpu);
  return x.nbytes() == 0 || std::memcmp(x.data(), y.data(), x.nbytes()) == 0;  // empty: no data pointer
}

::testing::AssertionResult close_rel(const Tensor& actual, const Tensor& expected, double tol,
                                     const std::string& what) {
  if (actual.shape() != expected.shape())
    return ::testing::AssertionFailure() << what << ": shape " << shape_str(actual.shape()) << " vs expected "
                                         << shape_str(expected.shape());
  const double err = rel_l2(actual, expected);
  if (err <= tol) return ::testing::AssertionSuccess() << what << ": rel L2 " << err;
  const std::vector<double> x = actual.to_vector(), y = expected.to_vector();
  double scale = 0;
  for (double v : y) scale = std::max(scale, std::fabs(v));
  std::ostringstream os;
  os << what << ": rel L2 error " << err << " > tol " << tol << ", max abs diff " << max_abs_diff(actual, expected)
     << " (max |expected| " << scale << "); first mismatches:";
  int shown = 0;
  for (size_t i = 0; i < x.size() && shown < 8; ++i) {
    const double d = std::fabs(x[i] - y[i]);
    if (!(d <= tol * std::max(scale, 1e-300))) {
      os << "\n  [" << i << "] actual " << x[i] << " expected " << y[i];
      ++shown;
    }
  }
  return ::testing::AssertionFailure() << os.str();
}

void poison(Tensor& t) { t.fill_(std::numeric_limits<double>::quiet_NaN()); }

bool small_only() {
  const char* v = std::getenv("GDNCP_TEST_SMALL");
  return v && std::string(v) == "1";
}

bool has_nonfinite(const Tensor& t) {
  for (double v : t.to_vector())
    if (!std::isfinite(v)) return true;
  return false;
}

// --- gradcheck -------------------------------------------------------------------------

namespace {

double weighted_sum(const std::vector<Tensor>& outs, const std::vector<std::vector<double>>& w) {
  double s = 0;
  for (size_t k = 0; k < outs.size(); ++k) {
    const std::vector<double> v = outs[k].to_vector();
    for (size_t i = 0; i < v.size(); ++i) s += w[k][i] * v[i];
  }
  return s;
}

}  // namespace

GradcheckResult gradcheck(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, double step, int64_t max_elems, uint64_t seed) {
  for (const Tensor& t : inputs)
    if (t.defined())
      GDNCP_CHECK(t.dtype() == DType::f64 && t.device() == Device::cpu, "gradcheck: inputs must be f64 CPU, got ",
                  t.str());
  // Fixed random weights turn the outputs into one scalar loss.
  std::vector<Tensor> outs0;
  {
    NoGradGuard no_grad;
    outs0 = fn(inputs);
  }
  std::vector<std::vector<double>> w;
  std::vector<Tensor> w_tensors;
  for (size_t k = 0; k < outs0.size(); ++k) {
    Tensor wk = Tensor::randn(outs0[k].shape(), DType::f64, Device::cpu, seed + 7919 * (k + 1));
    w.push_back(wk.to_vector());
    w_tensors.push_back(wk);
  }

  // Analytic gradients through the tape.
  autograd::clear_tape();
  std::vector<Tensor> leaves;
  for (const Tensor& t : inputs) {
    if (!t.defined()) {
      leaves.emplace_back();
      continue;
    }
    Tensor x = t.clone();
    x.requires_grad_(t.requires_grad());
    leaves.push_back(x);
  }
  std::vector<Tensor> outs = fn(leaves);
  std::vector<Tensor> roots, grads;
  for (size_t k = 0; k < outs.size(); ++k)
    if (outs[k].requires_grad()) {
      roots.push_back(outs[k]);
      grads.push_back(w_tensors[k]);
    }
  if (!roots.empty()) backward(roots, grads);

  GradcheckResult result;
  std::ostringstream report;
  std::mt19937_64 rng(seed);
  int64_t compared = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    const int64_t n = inputs[i].numel();
    std::vector<int64_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    if (n > max_elems) {
      std::shuffle(idx.begin(), idx.end(), rng);
      idx.resize(static_cast<size_t>(max_elems));
    }
    const Tensor g = leaves[i].grad();
    const std::vector<double> analytic_all =
        g.defined() ? g.to_vector() : std::vector<double>(static_cast<size_t>(n), 0.0);
    std::vector<double> analytic, numeric;
    for (int64_t e : idx) {
      std::vector<Tensor> plus = inputs, minus = inputs;
      plus[i] = inputs[i].clone();
      minus[i] = inputs[i].clone();
      plus[i].data_ptr<double>()[e] += step;
      minus[i].data_ptr<double>()[e] -= step;
      NoGradGuard no_grad;
      const double lp = weighted_sum(fn(plus), w), lm = weighted_sum(fn(minus), w);
      numeric.push_back((lp - lm) / (2 * step));
      analytic.push_back(analytic_all[static_cast<size_t>(e)]);
    }
    compared += static_cast<int64_t>(numeric.size());
    double diff = 0;
    for (size_t k = 0; k < numeric.size(); ++k) diff += (analytic[k] - numeric[k]) * (analytic[k] - numeric[k]);
    const double denom = std::max(norm2(numeric), norm2(analytic));
    const double err = denom > 0 ? std::sqrt(diff) / denom : 0.0;
    result.max_rel_error = std::max(result.max_rel_error, std::isnan(err) ? 1e300 : err);
    report << "input " << i << " " << inputs[i].str() << ": rel error " << err << " over " << idx.size()
           << " elements, |numeric| " << norm2(numeric) << "\n";
  }
  // A check that compared nothing proves nothing: it fails.
  result.elements_checked = compared;
  if (compared == 0) {
    result.max_rel_error = std::numeric_limits<double>::infinity();
    report << "gradcheck compared no element (no input requires grad, or all are empty)\n";
  }
  result.report = report.str();
  return result;
}

}  // namespace test
}  // namespace gdncp
