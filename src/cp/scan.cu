// src/cp/scan.cu — CUDA twins of the CP scan kernels (Note [scan step] in
// cp_kernels.h), f32, same signatures and semantics as scan_ref.cpp.
//
//   sweep_kernel   one block per (column block of 16 state columns, b·h): the
//                  block walks the frames with its slice of the state in
//                  registers (Note [row threads]); the Z stream is one column.
//   fold_kernel    the same structure over the gathered composites of the ranks.
//   outer_kernel   one block per (b·h, frame): Gr = L Rᵀ (Note [outer tiles]),
//                  then dP (=, +=) −g·Gr and dg += ⟨Gr, I − P⟩ (fixed-order sum).
// Gradient rule as the CPU twin: dg accumulates, dP when asked; the rest overwritten.
// No atomics: every result is bitwise reproducible.
#include <algorithm>

#include "cp/cp_cuda.cuh"
#include "cp/cp_kernels.h"

namespace gdncp {
namespace cp {
namespace cuda {
namespace {

using namespace dev;

constexpr int kCols = 16;
constexpr int kMaxRanks = 64;

struct SweepArgs {
  float* ob = nullptr;
  float* oa = nullptr;
  float* fin = nullptr;
  const float* P = nullptr;
  const float* vb = nullptr;
  const float* ua = nullptr;
  const float* init = nullptr;
  int D = 0, F = 0, E = 0, active = 0, init_kind = 0;
  bool descending = false, transpose = false;
};

constexpr int kMaxSweeps = 8;
struct SweepBatch {
  SweepArgs s[kMaxSweeps];
  In decay;
};

// blockIdx = (column block, b·h, sweep).
template <int NC>
__global__ void __launch_bounds__(kRowThreads) sweep_kernel(const __grid_constant__ SweepBatch batch) {
  const SweepArgs& a = batch.s[blockIdx.z];
  if (static_cast<int>(blockIdx.x) * NC >= a.E) return;  // a sweep with fewer columns than the widest
  __shared__ float Ps[kRowThreads * kPitch];
  __shared__ __align__(16) float Ys[kRowThreads * NC];
  const int c0 = blockIdx.x * NC, bh = blockIdx.y, i = threadIdx.x;
  const int nc = min(NC, a.E - c0);
  const bool row = i < a.D;
  const int64_t DE = static_cast<int64_t>(a.D) * a.E;
  float y[NC], acc[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    float v = 0.f;
    if (row && c < nc) {
      if (a.init_kind == static_cast<int>(Init::identity)) v = (i == c0 + c) ? 1.f : 0.f;
      if (a.init_kind == static_cast<int>(Init::given)) v = a.init[bh * DE + static_cast<int64_t>(i) * a.E + c0 + c];
    }
    y[c] = v;
  }
  for (int step = 0; step < a.F; ++step) {
    const int t = a.descending ? a.F - 1 - step : step;
    const int64_t base = (static_cast<int64_t>(bh) * a.F + t) * DE + static_cast<int64_t>(i) * a.E + c0;
    const bool frozen = t >= a.active;  // uniform over the block
    if (row) {
#pragma unroll
      for (int c = 0; c < NC; ++c)
        if (c < nc) {
          if (a.vb) y[c] += a.vb[base + c];
          if (a.ob) a.ob[base + c] = frozen ? 0.f : y[c];
        }
    }
    if (!frozen) {
      if (row) {
#pragma unroll
        for (int c = 0; c < NC; ++c) Ys[i * NC + c] = y[c];
      }
      apply_mat<NC>(acc, a.P + (static_cast<int64_t>(bh) * a.F + t) * a.D * a.D, a.transpose, Ys, Ps, a.D, i);
      const float g = batch.decay[static_cast<int64_t>(bh) * a.F + t];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        y[c] = g * (y[c] - acc[c]);
        if (row && c < nc && a.ua) y[c] += a.ua[base + c];
      }
    }
    if (row && a.oa) {
#pragma unroll
      for (int c = 0; c < NC; ++c)
        if (c < nc) a.oa[base + c] = y[c];
    }
  }
  if (row && a.fin) {
#pragma unroll
    for (int c = 0; c < NC; ++c)
      if (c < nc) a.fin[bh * DE + static_cast<int64_t>(i) * a.E + c0 + c] = y[c];
  }
}

struct FoldArgs {
  float* X = nullptr;
  const float* init = nullptr;
  const float* M = nullptr;
  const float* H = nullptr;
  int64_t m_off = 0, m_stride = 0, h_off = 0, h_stride = 0;
  int D = 0, E = 0, n = 0;
  bool transpose = false;
  int order[kMaxRanks];
};
constexpr int kMaxFolds = 4;
struct FoldBatch {
  FoldArgs f[kMaxFolds];
};

// blockIdx = (column block, b·h, fold).
template <int NC>
__global__ void __launch_bounds__(kRowThreads) fold_kernel(const __grid_constant__ FoldBatch batch) {
  __shared__ float Ps[kRowThreads * kPitch];
  __shared__ __align__(16) float Ys[kRowThreads * NC];
  const FoldArgs& a = batch.f[blockIdx.z];
  if (static_cast<int>(blockIdx.x) * NC >= a.E) return;
  const int c0 = blockIdx.x * NC, bh = blockIdx.y, i = threadIdx.x;
  const int nc = min(NC, a.E - c0);
  const bool row = i < a.D;
  const int64_t DE = static_cast<int64_t>(a.D) * a.E, DD = static_cast<int64_t>(a.D) * a.D;
  const int64_t at = bh * DE + static_cast<int64_t>(i) * a.E + c0;
  float y[NC], acc[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) y[c] = (row && c < nc && a.init) ? a.init[at + c] : 0.f;
  for (int q = 0; q < a.n; ++q) {
    const int j = a.order[q];
    const float* h = a.H + a.h_off + j * a.h_stride;
    if (a.M) {
      if (row) {
#pragma unroll
        for (int c = 0; c < NC; ++c) Ys[i * NC + c] = y[c];
      }
      apply_mat<NC>(acc, a.M + a.m_off + j * a.m_stride + bh * DD, a.transpose, Ys, Ps, a.D, i);
#pragma unroll
      for (int c = 0; c < NC; ++c) y[c] = acc[c];
    }
    if (row) {
#pragma unroll
      for (int c = 0; c < NC; ++c)
        if (c < nc) y[c] += h[at + c];
    }
  }
  if (row) {
#pragma unroll
    for (int c = 0; c < NC; ++c)
      if (c < nc) a.X[at + c] = y[c];
  }
}

struct OuterSrc {
  const float* L = nullptr;
  const float* R = nullptr;
  const float* R0 = nullptr;
  bool shifted = false;
  int active = 0;
};
struct OuterArgs {
  float* dP = nullptr;
  float* dg = nullptr;
  const float* P = nullptr;
  OuterSrc src[2];
  int nsrc = 0, E = 0;
  bool accumulate = false;
};
constexpr int kMaxGroups = 4;
struct OuterBatch {
  OuterArgs g[kMaxGroups];
  In decay;
  int D = 0, F = 0;
};

// blockIdx = (b·h·F + t, group): Gr = Σ_src L_t R'_tᵀ, then dP and dg.
__global__ void __launch_bounds__(kOuterThreads) outer_kernel(const __grid_constant__ OuterBatch batch) {
  __shared__ float Ls[kChunk * kOuterPitch];
  __shared__ float Rs[kChunk * kOuterPitch];
  __shared__ float red[kOuterThreads];
  const OuterArgs& a = batch.g[blockIdx.y];
  const int D = batch.D, F = batch.F, E = a.E;
  const int64_t bt = blockIdx.x;
  const int t = static_cast<int>(bt % F);
  const int64_t bh = bt / F;
  const int64_t DD = static_cast<int64_t>(D) * D, DE = static_cast<int64_t>(D) * E;
  float* dPt = a.dP + bt * DD;
  float sum[8][8];
#pragma unroll
  for (int ia = 0; ia < 8; ++ia)
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) sum[ia][kb] = 0.f;
  bool any = false;
  for (int q = 0; q < a.nsrc; ++q) {
    const OuterSrc& src = a.src[q];
    if (t >= src.active) continue;  // a frozen frame of this source: no gradient
    any = true;
    const float* Lt = src.L + bt * DE;
    const float* Rp =
        src.shifted ? src.R + bt * DE : (t > 0 ? src.R + (bt - 1) * DE : (src.R0 ? src.R0 + bh * DE : nullptr));
    float acc[8][8];
    outer_tile(
        acc, [&](int r, int e) { return Lt[static_cast<int64_t>(r) * E + e]; },
        [&](int r, int e) { return Rp ? Rp[static_cast<int64_t>(r) * E + e] : 0.f; }, D, E, Ls, Rs);
#pragma unroll
    for (int ia = 0; ia < 8; ++ia)
#pragma unroll
      for (int kb = 0; kb < 8; ++kb) sum[ia][kb] += acc[ia][kb];
  }
  if (!any) {  // every source frozen: dP_t = 0, dg unchanged
    if (!a.accumulate)
      for (int64_t k = threadIdx.x; k < DD; k += blockDim.x) dPt[k] = 0.f;
    return;
  }
  const float g = batch.decay[bt];
  const float* Pt = a.P + bt * DD;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float part = 0.f;
#pragma unroll
  for (int ia = 0; ia < 8; ++ia)
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
      const int i = ty + 16 * ia, k = tx + 16 * kb;
      if (i < D && k < D) {
        const float v = sum[ia][kb];
        const int64_t o = static_cast<int64_t>(i) * D + k;
        part += v * ((i == k ? 1.f : 0.f) - Pt[o]);
        dPt[o] = a.accumulate ? dPt[o] - g * v : -g * v;
      }
    }
  const float total = block_sum<kOuterThreads>(part, red);
  if (threadIdx.x == 0) a.dg[bt] += total;
}

struct CorrectArgs {
  float* X = nullptr;
  const float* C = nullptr;
  const float* v = nullptr;
  int E = 0;
};
constexpr int kMaxCorrections = 4;
struct CorrectBatch {
  CorrectArgs c[kMaxCorrections];
  int D = 0, F = 0;
};

// blockIdx = (column block, b·h·F + t, correction): X_t += C_t · v (Note [row threads]).
template <int NC>
__global__ void __launch_bounds__(kRowThreads) correct_kernel(const __grid_constant__ CorrectBatch batch) {
  __shared__ float Ps[kRowThreads * kPitch];
  __shared__ __align__(16) float Ys[kRowThreads * NC];
  const CorrectArgs& a = batch.c[blockIdx.z];
  if (static_cast<int>(blockIdx.x) * NC >= a.E) return;
  const int D = batch.D, c0 = blockIdx.x * NC, i = threadIdx.x;
  const int nc = min(NC, a.E - c0);
  const int64_t bt = blockIdx.y, bh = bt / batch.F;
  const int64_t DE = static_cast<int64_t>(D) * a.E, DD = static_cast<int64_t>(D) * D;
  for (int idx = threadIdx.x; idx < D * NC; idx += blockDim.x) {
    const int k = idx / NC, c = idx % NC;
    Ys[k * NC + c] = c < nc ? a.v[bh * DE + static_cast<int64_t>(k) * a.E + c0 + c] : 0.f;
  }
  float acc[NC];
  apply_mat<NC>(acc, a.C + bt * DD, false, Ys, Ps, D, i);
  if (i < D) {
    float* x = a.X + bt * DE + static_cast<int64_t>(i) * a.E + c0;
#pragma unroll
    for (int c = 0; c < NC; ++c)
      if (c < nc) x[c] += acc[c];
  }
}

__global__ void add_kernel(float* out, const float* x, const float* y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}

In decay_of(const Tensor& decay) { return in_of(decay, "decay"); }

void check_dims(const SweepSpec& s) {
  GDNCP_CHECK(s.D >= 1 && s.D <= kRowThreads, "cp cuda scan: D = ", s.D, " must be in [1, ", kRowThreads, "]");
  GDNCP_CHECK(s.E == 1 || s.E == s.D, "cp cuda scan: E = ", s.E, " must be 1 or D");
}

}  // namespace

void scan_sweeps(std::vector<Sweep>& sweeps, const Tensor& decay) {
  const In dc = decay_of(decay);
  for (size_t first = 0; first < sweeps.size(); first += kMaxSweeps) {
    const size_t n = std::min<size_t>(kMaxSweeps, sweeps.size() - first);
    SweepBatch batch;
    batch.decay = dc;
    int64_t BH = 0, maxE = 1;
    for (size_t k = 0; k < n; ++k) {
      Sweep& w = sweeps[first + k];
      const SweepSpec& s = w.spec;
      check_dims(s);
      GDNCP_CHECK(k == 0 || s.BH == BH, "scan_sweeps: sweeps of one batch must share B·H");
      BH = s.BH;
      maxE = std::max(maxE, s.E);
      SweepArgs& a = batch.s[k];
      a.ob = f32_out(w.out_before, "out_before");
      a.oa = f32_out(w.out_after, "out_after");
      a.fin = f32_out(w.final_state, "final_state");
      a.P = f32_in(w.P, "P");
      a.vb = f32_in(w.add_before, "add_before");
      a.ua = f32_in(w.add_after, "add_after");
      a.init = s.init == Init::given ? f32_in(w.init, "init") : nullptr;
      GDNCP_CHECK(s.init != Init::given || a.init, "scan_sweep: init is undefined");
      a.D = static_cast<int>(s.D);
      a.F = static_cast<int>(s.F);
      a.E = static_cast<int>(s.E);
      a.active = static_cast<int>(std::min(s.active, s.F));
      a.init_kind = static_cast<int>(s.init);
      a.descending = s.descending;
      a.transpose = s.transpose;
    }
    if (maxE == 1) {
      sweep_kernel<1>
          <<<dim3(1, static_cast<unsigned>(BH), static_cast<unsigned>(n)), kRowThreads, 0, stream()>>>(batch);
      check_launch("sweep_kernel<1>");
    } else {
      const unsigned blocks = static_cast<unsigned>((maxE + kCols - 1) / kCols);
      sweep_kernel<kCols>
          <<<dim3(blocks, static_cast<unsigned>(BH), static_cast<unsigned>(n)), kRowThreads, 0, stream()>>>(batch);
      check_launch("sweep_kernel<16>");
    }
  }
}

void scan_sweep(Tensor& out_before, Tensor& out_after, Tensor& final_state, const Tensor& P, const Tensor& decay,
                const Tensor& add_before, const Tensor& add_after, const Tensor& init, const SweepSpec& s) {
  std::vector<Sweep> one(1);
  one[0] = Sweep{out_before, out_after, final_state, P, add_before, add_after, init, s};
  scan_sweeps(one, decay);
}

void scan_grad_outers(std::vector<OuterGroup>& groups, const Tensor& decay, int64_t BH, int64_t F, int64_t D) {
  GDNCP_CHECK(D >= 1 && D <= kRowThreads, "cp cuda scan: D = ", D, " must be in [1, ", kRowThreads, "]");
  for (size_t first = 0; first < groups.size(); first += kMaxGroups) {
    const size_t n = std::min<size_t>(kMaxGroups, groups.size() - first);
    OuterBatch batch;
    batch.decay = decay_of(decay);
    batch.D = static_cast<int>(D);
    batch.F = static_cast<int>(F);
    for (size_t k = 0; k < n; ++k) {
      OuterGroup& g = groups[first + k];
      GDNCP_CHECK(g.sources.size() >= 1 && g.sources.size() <= 2, "scan_grad_outers: 1 or 2 sources per group");
      OuterArgs& a = batch.g[k];
      a.dP = f32_out(g.dP, "dP");
      a.dg = f32_out(g.dg, "dg");
      a.P = f32_in(g.P, "P");
      a.E = static_cast<int>(g.E);
      a.accumulate = g.accumulate_dP;
      a.nsrc = static_cast<int>(g.sources.size());
      for (size_t q = 0; q < g.sources.size(); ++q) {
        const OuterSource& src = g.sources[q];
        a.src[q].L = f32_in(src.L, "L");
        a.src[q].R = f32_in(src.R, "R");
        a.src[q].R0 = f32_in(src.R0, "R0");
        a.src[q].shifted = src.shifted;
        a.src[q].active = static_cast<int>(std::min(src.active, F));
      }
    }
    outer_kernel<<<dim3(static_cast<unsigned>(BH * F), static_cast<unsigned>(n)), kOuterThreads, 0, stream()>>>(batch);
    check_launch("outer_kernel");
  }
}

void scan_grad_outer(Tensor& dP, Tensor& dg, const Tensor& L, const Tensor& R, const Tensor& R0, const Tensor& P,
                     const Tensor& decay, const SweepSpec& s, bool shifted, bool accumulate) {
  check_dims(s);
  std::vector<OuterGroup> one(1);
  one[0].dP = dP;
  one[0].dg = dg;
  one[0].P = P;
  one[0].E = s.E;
  one[0].accumulate_dP = accumulate;
  OuterSource src;
  src.L = L;
  src.R = R;
  src.R0 = R0;
  src.shifted = shifted;
  src.active = s.active;
  one[0].sources.push_back(src);
  scan_grad_outers(one, decay, s.BH, s.F, s.D);
}

void scan_correct(std::vector<Correction>& cs, int64_t BH, int64_t F, int64_t D) {
  GDNCP_CHECK(D >= 1 && D <= kRowThreads, "cp cuda correct: D = ", D, " must be in [1, ", kRowThreads, "]");
  for (size_t first = 0; first < cs.size(); first += kMaxCorrections) {
    const size_t n = std::min<size_t>(kMaxCorrections, cs.size() - first);
    CorrectBatch batch;
    batch.D = static_cast<int>(D);
    batch.F = static_cast<int>(F);
    int64_t maxE = 1;
    for (size_t k = 0; k < n; ++k) {
      Correction& c = cs[first + k];
      GDNCP_CHECK(c.E == 1 || c.E == D, "cp cuda correct: E = ", c.E, " must be 1 or D");
      batch.c[k].X = f32_out(c.X, "X");
      batch.c[k].C = f32_in(c.C, "C");
      batch.c[k].v = f32_in(c.v, "v");
      batch.c[k].E = static_cast<int>(c.E);
      maxE = std::max(maxE, c.E);
    }
    const dim3 grid(static_cast<unsigned>((maxE + kCols - 1) / kCols), static_cast<unsigned>(BH * F),
                    static_cast<unsigned>(n));
    if (maxE == 1) {
      correct_kernel<1><<<grid, kRowThreads, 0, stream()>>>(batch);
      check_launch("correct_kernel<1>");
    } else {
      correct_kernel<kCols><<<grid, kRowThreads, 0, stream()>>>(batch);
      check_launch("correct_kernel<16>");
    }
  }
}

void folds(std::vector<Fold>& fs, int64_t BH, int64_t D) {
  GDNCP_CHECK(D >= 1 && D <= kRowThreads, "cp cuda fold: D = ", D, " must be in [1, ", kRowThreads, "]");
  for (size_t first = 0; first < fs.size(); first += kMaxFolds) {
    const size_t n = std::min<size_t>(kMaxFolds, fs.size() - first);
    FoldBatch batch;
    int64_t maxE = 1;
    for (size_t k = 0; k < n; ++k) {
      Fold& f = fs[first + k];
      GDNCP_CHECK(f.order.size() <= static_cast<size_t>(kMaxRanks), "cp cuda fold: more than ", kMaxRanks, " ranks");
      GDNCP_CHECK(f.E == 1 || f.E == D, "cp cuda fold: E = ", f.E, " must be 1 or D");
      FoldArgs& a = batch.f[k];
      a.X = f32_out(f.X, "X");
      a.init = f32_in(f.init, "init");
      a.M = f32_in(f.Mbuf, "Mbuf");
      a.H = f32_in(f.Hbuf, "Hbuf");
      a.m_off = f.m_off;
      a.m_stride = f.m_stride;
      a.h_off = f.h_off;
      a.h_stride = f.h_stride;
      a.D = static_cast<int>(D);
      a.E = static_cast<int>(f.E);
      a.n = static_cast<int>(f.order.size());
      a.transpose = f.transpose;
      std::copy(f.order.begin(), f.order.end(), a.order);
      maxE = std::max(maxE, f.E);
    }
    if (maxE == 1) {
      fold_kernel<1><<<dim3(1, static_cast<unsigned>(BH), static_cast<unsigned>(n)), kRowThreads, 0, stream()>>>(batch);
      check_launch("fold_kernel<1>");
    } else {
      const unsigned blocks = static_cast<unsigned>((maxE + kCols - 1) / kCols);
      fold_kernel<kCols>
          <<<dim3(blocks, static_cast<unsigned>(BH), static_cast<unsigned>(n)), kRowThreads, 0, stream()>>>(batch);
      check_launch("fold_kernel<16>");
    }
  }
}

void fold(Tensor& X, const Tensor& init, const Tensor& Mbuf, int64_t m_off, int64_t m_stride, bool transpose,
          const Tensor& Hbuf, int64_t h_off, int64_t h_stride, const std::vector<int>& order, int64_t BH, int64_t D,
          int64_t E) {
  std::vector<Fold> one(1);
  Fold& f = one[0];
  f.X = X;
  f.init = init;
  f.Mbuf = Mbuf;
  f.Hbuf = Hbuf;
  f.m_off = m_off;
  f.m_stride = m_stride;
  f.h_off = h_off;
  f.h_stride = h_stride;
  f.E = E;
  f.transpose = transpose;
  f.order = order;
  folds(one, BH, D);
}

void copy_region(Tensor& dst, int64_t dst_off, const Tensor& src, int64_t src_off, int64_t n) {
  GDNCP_CHECK(dst.dtype() == src.dtype(), "copy_region: dtype mismatch");
  GDNCP_CHECK(dst_off + n <= dst.numel() && src_off + n <= src.numel(), "copy_region: out of range");
  if (n == 0) return;
  const size_t es = dtype_size(dst.dtype());
  GDNCP_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst.data()) + dst_off * es,
                                   static_cast<const char*>(src.data()) + src_off * es, static_cast<size_t>(n) * es,
                                   cudaMemcpyDeviceToDevice, stream()));
}

void add(Tensor& out, const Tensor& a, const Tensor& b) {
  GDNCP_CHECK(a.numel() == out.numel() && b.numel() == out.numel(), "add: size mismatch");
  float* o = f32_out(out, "out");
  const float* x = f32_in(a, "a");
  const float* y = f32_in(b, "b");
  const int64_t n = out.numel();
  if (n == 0) return;
  add_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream()>>>(o, x, y, n);
  check_launch("add_kernel");
}

}  // namespace cuda
}  // namespace cp
}  // namespace gdncp
