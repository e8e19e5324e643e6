// src/kernels/scan/scan_sweep_ref.cpp — CPU twins of the CP scan kernels (Note [scan step] in
// cp_kernels.h), templated on float and double. Plain loops in a fixed order:
// results are bitwise reproducible.
//
// Gradient rule: scan_grad_outer accumulates (+=) into dg always and into dP
// when asked (several sweeps share one transition); every other output is
// overwritten. A frame's dg (sums of D² terms of both signs, over every source of
// the groups of a scan_grad_outers call that share it) is summed in a wider type
// and rounded once (Note [dg in f64] in scan_sweep.cu). These sweeps are also the CPU twin of the single-rank scan
// (src/kernels/scan/scan_bidi.cpp).
#include <algorithm>
#include <cstring>
#include <vector>

#include "gdncp/error.h"
#include "kernels/common/cpu_common.h"
#include "kernels/cp_kernels.h"

namespace gdncp {
namespace cp {
namespace cpu {
namespace {

template <typename T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}
template <typename T>
T* mut_or_null(Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// decay in the compute dtype (a copy; decay may be bf16/f32/f64).
template <typename T>
Tensor decay_as(const Tensor& decay) {
  return decay.dtype() == dtype_of<T>::value ? decay : decay.to(dtype_of<T>::value);
}

// y (D×E) ← g·(y − op(P) y), op(P)[i][k] = P[i][k] or P[k][i].
template <typename T>
void transition(T* y, T* tmp, const T* P, T g, int64_t D, int64_t E, bool transpose) {
  std::fill(tmp, tmp + D * E, T(0));
  for (int64_t i = 0; i < D; ++i)
    for (int64_t k = 0; k < D; ++k) {
      const T p = transpose ? P[k * D + i] : P[i * D + k];
      const T* yk = y + k * E;
      T* ti = tmp + i * E;
      for (int64_t j = 0; j < E; ++j) ti[j] += p * yk[j];
    }
  for (int64_t i = 0; i < D * E; ++i) y[i] = g * (y[i] - tmp[i]);
}

// The clip mask (B, F) f32 (Note [clip cuts]): checked, and its data or null.
const float* cuts_of(const Tensor& cuts, int64_t BH, int64_t H, int64_t F, const char* what) {
  if (!cuts.defined()) return nullptr;
  GDNCP_CHECK(H >= 1 && BH % H == 0, what, ": H = ", H, " does not divide B·H = ", BH);
  GDNCP_CHECK(cuts.dtype() == DType::f32 && cuts.numel() == BH / H * F, what, ": cuts: must be (B, F) = (", BH / H,
              ", ", F, ") f32, got ", cuts.str());
  return cuts.data_ptr<float>();
}

template <typename T>
void sweep(Tensor& out_before, Tensor& out_after, Tensor& final_state, const Tensor& P, const Tensor& decay,
           const Tensor& add_before, const Tensor& add_after, const Tensor& init, const SweepSpec& s,
           const Tensor& cuts) {
  const int64_t D = s.D, E = s.E, F = s.F, DE = D * E, DD = D * D;
  const float* c = s.cut == Cut::none ? nullptr : cuts_of(cuts, s.BH, s.H, F, "scan_sweep");
  GDNCP_CHECK(s.init != Init::identity || E == D, "scan_sweep: identity init needs E == D");
  GDNCP_CHECK(s.init != Init::given || init.defined(), "scan_sweep: init is undefined");
  const Tensor g_t = decay_as<T>(decay);
  const T* g = g_t.data_ptr<T>();
  const T* p = P.data_ptr<T>();
  const T* vb = ptr_or_null<T>(add_before);
  const T* ua = ptr_or_null<T>(add_after);
  const T* y0 = s.init == Init::given ? init.data_ptr<T>() : nullptr;
  T* ob = mut_or_null<T>(out_before);
  T* oa = mut_or_null<T>(out_after);
  T* fin = mut_or_null<T>(final_state);
  std::vector<T> y(DE), tmp(DE);
  for (int64_t bh = 0; bh < s.BH; ++bh) {
    if (s.init == Init::given)
      std::copy(y0 + bh * DE, y0 + (bh + 1) * DE, y.begin());
    else
      std::fill(y.begin(), y.end(), T(0));
    if (s.init == Init::identity)
      for (int64_t i = 0; i < D; ++i) y[i * E + i] = T(1);
    for (int64_t step = 0; step < F; ++step) {
      const int64_t t = s.descending ? F - 1 - step : step;
      const int64_t at = (bh * F + t) * DE;
      const bool frozen = t >= s.active;
      const bool cut = c && !frozen && c[(bh / s.H) * F + t] != 0.f;
      if (cut && s.cut == Cut::before) std::fill(y.begin(), y.end(), T(0));
      if (vb)
        for (int64_t i = 0; i < DE; ++i) y[i] += vb[at + i];
      if (ob) {
        if (frozen)
          std::fill(ob + at, ob + at + DE, T(0));
        else
          std::copy(y.begin(), y.end(), ob + at);
      }
      if (!frozen) {
        transition(y.data(), tmp.data(), p + (bh * F + t) * DD, g[bh * F + t], D, E, s.transpose);
        if (ua)
          for (int64_t i = 0; i < DE; ++i) y[i] += ua[at + i];
      }
      if (cut && s.cut == Cut::after) std::fill(y.begin(), y.end(), T(0));
      if (oa) std::copy(y.begin(), y.end(), oa + at);
    }
    if (fin) std::copy(y.begin(), y.end(), fin + bh * DE);
  }
}

template <typename T>
using Wide = typename gdncp::cpu::detail::Wider<T>::type;

// wide: where the frames' dg terms go, summed in the wider type (BH·F); null: added to dg.
template <typename T>
void grad_outer(Tensor& dP, Tensor& dg, const Tensor& L, const Tensor& R, const Tensor& R0, const Tensor& P,
                const Tensor& decay, const SweepSpec& s, bool shifted, bool accumulate, const Tensor& cuts,
                Wide<T>* wide = nullptr) {
  const int64_t D = s.D, E = s.E, F = s.F, DE = D * E, DD = D * D;
  const float* c = cuts_of(cuts, s.BH, s.H, F, "scan_grad_outer");
  const Tensor g_t = decay_as<T>(decay);
  const T* g = g_t.data_ptr<T>();
  const T* p = P.data_ptr<T>();
  const T* l = L.data_ptr<T>();
  const T* r = R.data_ptr<T>();
  const T* r0 = ptr_or_null<T>(R0);
  T* dp = dP.data_ptr<T>();
  T* dgp = dg.data_ptr<T>();
  const std::vector<T> zero(DE, T(0));
  std::vector<T> gr(DD);
  for (int64_t bh = 0; bh < s.BH; ++bh)
    for (int64_t t = 0; t < F; ++t) {
      T* dpt = dp + (bh * F + t) * DD;
      T& dgt = dgp[bh * F + t];
      if (t >= s.active || (c && c[(bh / s.H) * F + t] != 0.f)) {  // frozen or cut: the transition is unused
        if (!accumulate) std::fill(dpt, dpt + DD, T(0));
        continue;
      }
      const T* lt = l + (bh * F + t) * DE;
      const T* prev =
          shifted ? r + (bh * F + t) * DE : (t > 0 ? r + (bh * F + t - 1) * DE : (r0 ? r0 + bh * DE : zero.data()));
      for (int64_t i = 0; i < D; ++i)
        for (int64_t k = 0; k < D; ++k) {
          T acc = 0;
          for (int64_t e = 0; e < E; ++e) acc += lt[i * E + e] * prev[k * E + e];
          gr[i * D + k] = acc;
        }
      const T gt = g[bh * F + t];
      const T* pt = p + (bh * F + t) * DD;
      Wide<T> dgs = 0;  // D² terms of both signs
      for (int64_t i = 0; i < D; ++i)
        for (int64_t k = 0; k < D; ++k) {
          const T v = gr[i * D + k];
          dgs += static_cast<decltype(dgs)>(v) * ((i == k ? T(1) : T(0)) - pt[i * D + k]);
          if (accumulate)
            dpt[i * D + k] += -gt * v;
          else
            dpt[i * D + k] = -gt * v;
        }
      if (wide)
        wide[bh * F + t] += dgs;
      else
        dgt += static_cast<T>(dgs);
    }
}

// The groups in order; the groups that share one dg (its storage) chain one wide sum per frame.
template <typename T>
void grad_outers_impl(std::vector<OuterGroup>& groups, const Tensor& decay, int64_t BH, int64_t F, int64_t D) {
  std::vector<Wide<T>> wide(static_cast<size_t>(BH * F));
  T* dg = nullptr;
  const auto flush = [&] {
    if (dg)
      for (size_t i = 0; i < wide.size(); ++i) dg[i] = static_cast<T>(wide[i]);
  };
  for (OuterGroup& g : groups) {
    T* mine = g.dg.data_ptr<T>();
    if (mine != dg) {
      flush();
      dg = mine;
      for (size_t i = 0; i < wide.size(); ++i) wide[i] = g.accumulate_dg ? static_cast<Wide<T>>(dg[i]) : 0;
    } else if (!g.accumulate_dg) {
      std::fill(wide.begin(), wide.end(), Wide<T>(0));
    }
    for (size_t i = 0; i < g.sources.size(); ++i) {
      const OuterSource& src = g.sources[i];
      SweepSpec s;
      s.BH = BH;
      s.F = F;
      s.D = D;
      s.E = g.E;
      s.active = src.active;
      s.H = g.H;
      grad_outer<T>(g.dP, g.dg, src.L, src.R, src.R0, g.P, decay, s, src.shifted, i > 0 || g.accumulate_dP, g.cuts,
                    wide.data());
    }
  }
  flush();
}

template <typename T>
void fold_impl(Fold& f, int64_t BH, int64_t D) {
  const int64_t E = f.E, DE = D * E, DD = D * D;
  T* x = f.X.data_ptr<T>();
  const T* x0 = ptr_or_null<T>(f.init);
  const T* mb = ptr_or_null<T>(f.Mbuf);
  const T* hb = f.Hbuf.data_ptr<T>();
  std::vector<T> tmp(DE);
  for (int64_t bh = 0; bh < BH; ++bh) {
    T* xb = x + bh * DE;
    if (x0)
      std::copy(x0 + bh * DE, x0 + (bh + 1) * DE, xb);
    else
      std::fill(xb, xb + DE, T(0));
    for (size_t q = 0; q < f.order.size(); ++q) {
      const int j = f.order[q];
      const T* h = hb + f.h_off + j * f.h_stride + bh * DE;
      if (mb && (x0 || q > 0)) {  // from a zero state the first step is X = h: M_j is never read there
        const T* m = mb + f.m_off + j * f.m_stride + bh * DD;
        std::fill(tmp.begin(), tmp.end(), T(0));
        for (int64_t i = 0; i < D; ++i)
          for (int64_t k = 0; k < D; ++k) {
            const T mik = f.transpose ? m[k * D + i] : m[i * D + k];
            for (int64_t e = 0; e < E; ++e) tmp[i * E + e] += mik * xb[k * E + e];
          }
        for (int64_t i = 0; i < DE; ++i) xb[i] = tmp[i] + h[i];
      } else {
        for (int64_t i = 0; i < DE; ++i) xb[i] += h[i];
      }
    }
  }
}

template <typename T>
void add_impl(Tensor& out, const Tensor& a, const Tensor& b) {
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  T* po = out.data_ptr<T>();
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
}

bool is_f64(const Tensor& t) { return t.dtype() == DType::f64; }

void check_compute(const Tensor& t, const char* what) {
  GDNCP_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64, what, ": compute tensors are f32 or f64, got ",
              dtype_name(t.dtype()));
}

}  // namespace

void scan_sweep(Tensor& out_before, Tensor& out_after, Tensor& final_state, const Tensor& P, const Tensor& decay,
                const Tensor& add_before, const Tensor& add_after, const Tensor& init, const SweepSpec& s,
                const Tensor& cuts) {
  check_compute(P, "scan_sweep: P");
  if (is_f64(P))
    sweep<double>(out_before, out_after, final_state, P, decay, add_before, add_after, init, s, cuts);
  else
    sweep<float>(out_before, out_after, final_state, P, decay, add_before, add_after, init, s, cuts);
}

void scan_grad_outer(Tensor& dP, Tensor& dg, const Tensor& L, const Tensor& R, const Tensor& R0, const Tensor& P,
                     const Tensor& decay, const SweepSpec& s, bool shifted, bool accumulate, const Tensor& cuts) {
  check_compute(P, "scan_grad_outer: P");
  if (is_f64(P))
    grad_outer<double>(dP, dg, L, R, R0, P, decay, s, shifted, accumulate, cuts);
  else
    grad_outer<float>(dP, dg, L, R, R0, P, decay, s, shifted, accumulate, cuts);
}

void copy_region(Tensor& dst, int64_t dst_off, const Tensor& src, int64_t src_off, int64_t n, int64_t rows,
                 int64_t dst_pitch, int64_t src_pitch) {
  GDNCP_CHECK(dst.dtype() == src.dtype(), "copy_region: dtype mismatch");
  check_region("dst", dst.numel(), dst_off, n, rows, dst_pitch);
  check_region("src", src.numel(), src_off, n, rows, src_pitch);
  const size_t es = dtype_size(dst.dtype());
  for (int64_t r = 0; r < rows && n > 0; ++r)
    std::memcpy(static_cast<char*>(dst.data()) + (dst_off + r * dst_pitch) * es,
                static_cast<const char*>(src.data()) + (src_off + r * src_pitch) * es, static_cast<size_t>(n) * es);
}

void add(Tensor& out, const Tensor& a, const Tensor& b) {
  check_compute(out, "add: out");
  GDNCP_CHECK(
      a.numel() == out.numel() && b.numel() == out.numel() && a.dtype() == out.dtype() && b.dtype() == out.dtype(),
      "add: shape or dtype mismatch");
  if (is_f64(out))
    add_impl<double>(out, a, b);
  else
    add_impl<float>(out, a, b);
}

void scan_sweeps(std::vector<Sweep>& sweeps, const Tensor& decay) {
  // A pair's sweeps and sum, checked as the CUDA twin checks them.
  std::vector<bool> paired(sweeps.size(), false);
  for (size_t k = 0; k < sweeps.size(); ++k) {
    const int p = sweeps[k].partner;
    if (p < 0) continue;
    const size_t q = static_cast<size_t>(p);
    GDNCP_CHECK(q < sweeps.size() && q != k && sweeps[q].partner < 0 && !paired[k] && !paired[q], "scan_sweeps: sweep ",
                k, ": partner ", p, " is not a free sweep of the batch");
    const SweepSpec &s = sweeps[k].spec, &o = sweeps[q].spec;
    GDNCP_CHECK(s.F == o.F && s.E == o.E, "scan_sweeps: sweeps ", k, " and ", p, " of a pair differ in F or E");
    GDNCP_CHECK(sweeps[k].sum.defined() && sweeps[k].sum.numel() == s.BH * s.F * s.D * s.E, "scan_sweeps: sweep ", k,
                ": sum must be (B·H, F, D, E)");
    GDNCP_CHECK((sweeps[k].out_after.defined() || sweeps[k].out_before.defined()) &&
                    (sweeps[q].out_after.defined() || sweeps[q].out_before.defined()),
                "scan_sweeps: a pair's sweeps need out_after or out_before");
    paired[k] = paired[q] = true;
  }
  for (Sweep& w : sweeps) {
    if (!w.final_state.defined() || w.final_offset == 0) {
      scan_sweep(w.out_before, w.out_after, w.final_state, w.P, decay, w.add_before, w.add_after, w.init, w.spec,
                 w.cuts);
      continue;
    }
    Tensor fin = Tensor::empty({w.spec.BH, w.spec.D, w.spec.E}, w.final_state.dtype());
    scan_sweep(w.out_before, w.out_after, fin, w.P, decay, w.add_before, w.add_after, w.init, w.spec, w.cuts);
    copy_region(w.final_state, w.final_offset, fin, 0, fin.numel());
  }
  const auto summed = [](const Sweep& w) -> const Tensor& {
    return w.out_after.defined() ? w.out_after : w.out_before;
  };
  for (Sweep& w : sweeps)
    if (w.partner >= 0) add(w.sum, summed(w), summed(sweeps[static_cast<size_t>(w.partner)]));
}

void scan_grad_outers(std::vector<OuterGroup>& groups, const Tensor& decay, int64_t BH, int64_t F, int64_t D) {
  if (groups.empty()) return;
  for (const OuterGroup& g : groups) {
    check_compute(g.P, "scan_grad_outers: P");
    GDNCP_CHECK(g.dg.dtype() == groups.front().P.dtype() && g.P.dtype() == groups.front().P.dtype(),
                "scan_grad_outers: the groups' P and dg must share one compute dtype");
  }
  if (is_f64(groups.front().P))
    grad_outers_impl<double>(groups, decay, BH, F, D);
  else
    grad_outers_impl<float>(groups, decay, BH, F, D);
}

namespace {
template <typename T>
void correct_impl(Correction& c, int64_t BH, int64_t F, int64_t D) {
  const int64_t E = c.E, DE = D * E, DD = D * D;
  T* x = c.X.data_ptr<T>();
  const T* m = c.C.data_ptr<T>();
  const T* v = c.v.data_ptr<T>();
  std::vector<T> tmp(static_cast<size_t>(DE));
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t t = 0; t < F; ++t) {
      const T* ct = m + (bh * F + t) * DD;
      const T* vb = v + bh * DE;
      std::fill(tmp.begin(), tmp.end(), T(0));
      for (int64_t i = 0; i < D; ++i)
        for (int64_t k = 0; k < D; ++k) {
          const T cik = ct[i * D + k];
          for (int64_t e = 0; e < E; ++e) tmp[static_cast<size_t>(i * E + e)] += cik * vb[k * E + e];
        }
      T* xt = x + (bh * F + t) * DE;
      for (int64_t i = 0; i < DE; ++i) xt[i] += tmp[static_cast<size_t>(i)];
    }
}
}  // namespace

void scan_correct(std::vector<Correction>& cs, int64_t BH, int64_t F, int64_t D) {
  for (Correction& c : cs) {
    check_compute(c.X, "scan_correct: X");
    if (is_f64(c.X))
      correct_impl<double>(c, BH, F, D);
    else
      correct_impl<float>(c, BH, F, D);
  }
}

void folds(std::vector<Fold>& fs, int64_t BH, int64_t D) {
  for (Fold& f : fs) {
    check_compute(f.X, "fold: X");
    if (is_f64(f.X))
      fold_impl<double>(f, BH, D);
    else
      fold_impl<float>(f, BH, D);
  }
}

}  // namespace cpu
}  // namespace cp
}  // namespace gdncp
