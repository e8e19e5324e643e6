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
constexpr int kMaxRanks = 256;

struct SweepArgs {
  float* ob = nullptr;
  float* oa = nullptr;
  float* fin = nullptr;
  const float* P = nullptr;
  In decay;
  const float* vb = nullptr;
  const float* ua = nullptr;
  const float* init = nullptr;
  int D = 0, F = 0, E = 0, active = 0, init_kind = 0;
  bool descending = false, transpose = false;
};

template <int NC>
__global__ void __launch_bounds__(kRowThreads) sweep_kernel(SweepArgs a) {
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
      const float g = a.decay[static_cast<int64_t>(bh) * a.F + t];
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

template <int NC>
__global__ void __launch_bounds__(kRowThreads) fold_kernel(FoldArgs a) {
  __shared__ float Ps[kRowThreads * kPitch];
  __shared__ __align__(16) float Ys[kRowThreads * NC];
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

struct OuterArgs {
  float* dP = nullptr;
  float* dg = nullptr;
  const float* L = nullptr;
  const float* R = nullptr;
  const float* R0 = nullptr;
  const float* P = nullptr;
  In decay;
  int D = 0, F = 0, E = 0, active = 0;
  bool shifted = false, accumulate = false;
};

__global__ void __launch_bounds__(kOuterThreads) outer_kernel(OuterArgs a) {
  __shared__ float Ls[kChunk * kOuterPitch];
  __shared__ float Rs[kChunk * kOuterPitch];
  __shared__ float red[kOuterThreads];
  const int64_t bt = blockIdx.x;
  const int t = static_cast<int>(bt % a.F);
  const int64_t bh = bt / a.F;
  const int64_t DD = static_cast<int64_t>(a.D) * a.D, DE = static_cast<int64_t>(a.D) * a.E;
  float* dPt = a.dP + bt * DD;
  if (t >= a.active) {  // frozen frame: no gradient
    if (!a.accumulate)
      for (int64_t k = threadIdx.x; k < DD; k += blockDim.x) dPt[k] = 0.f;
    return;
  }
  const float* Lt = a.L + bt * DE;
  const float* Rp = a.shifted ? a.R + bt * DE : (t > 0 ? a.R + (bt - 1) * DE : (a.R0 ? a.R0 + bh * DE : nullptr));
  const int E = a.E;
  float acc[8][8];
  outer_tile(
      acc, [&](int r, int e) { return Lt[static_cast<int64_t>(r) * E + e]; },
      [&](int r, int e) { return Rp ? Rp[static_cast<int64_t>(r) * E + e] : 0.f; }, a.D, E, Ls, Rs);
  const float g = a.decay[bt];
  const float* Pt = a.P + bt * DD;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float part = 0.f;
#pragma unroll
  for (int ia = 0; ia < 8; ++ia)
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
      const int i = ty + 16 * ia, k = tx + 16 * kb;
      if (i < a.D && k < a.D) {
        const float v = acc[ia][kb];
        const int64_t o = static_cast<int64_t>(i) * a.D + k;
        part += v * ((i == k ? 1.f : 0.f) - Pt[o]);
        dPt[o] = a.accumulate ? dPt[o] - g * v : -g * v;
      }
    }
  const float s = block_sum<kOuterThreads>(part, red);
  if (threadIdx.x == 0) a.dg[bt] += s;
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

void scan_sweep(Tensor& out_before, Tensor& out_after, Tensor& final_state, const Tensor& P, const Tensor& decay,
                const Tensor& add_before, const Tensor& add_after, const Tensor& init, const SweepSpec& s) {
  check_dims(s);
  SweepArgs a;
  a.ob = f32_out(out_before, "out_before");
  a.oa = f32_out(out_after, "out_after");
  a.fin = f32_out(final_state, "final_state");
  a.P = f32_in(P, "P");
  a.decay = decay_of(decay);
  a.vb = f32_in(add_before, "add_before");
  a.ua = f32_in(add_after, "add_after");
  a.init = s.init == Init::given ? f32_in(init, "init") : nullptr;
  GDNCP_CHECK(s.init != Init::given || a.init, "scan_sweep: init is undefined");
  a.D = static_cast<int>(s.D);
  a.F = static_cast<int>(s.F);
  a.E = static_cast<int>(s.E);
  a.active = static_cast<int>(std::min(s.active, s.F));
  a.init_kind = static_cast<int>(s.init);
  a.descending = s.descending;
  a.transpose = s.transpose;
  if (s.E == 1) {
    sweep_kernel<1><<<dim3(1, static_cast<unsigned>(s.BH)), kRowThreads, 0, stream()>>>(a);
    check_launch("sweep_kernel<1>");
  } else {
    const unsigned blocks = static_cast<unsigned>((s.E + kCols - 1) / kCols);
    sweep_kernel<kCols><<<dim3(blocks, static_cast<unsigned>(s.BH)), kRowThreads, 0, stream()>>>(a);
    check_launch("sweep_kernel<16>");
  }
}

void scan_grad_outer(Tensor& dP, Tensor& dg, const Tensor& L, const Tensor& R, const Tensor& R0, const Tensor& P,
                     const Tensor& decay, const SweepSpec& s, bool shifted, bool accumulate) {
  check_dims(s);
  OuterArgs a;
  a.dP = f32_out(dP, "dP");
  a.dg = f32_out(dg, "dg");
  a.L = f32_in(L, "L");
  a.R = f32_in(R, "R");
  a.R0 = f32_in(R0, "R0");
  a.P = f32_in(P, "P");
  a.decay = decay_of(decay);
  a.D = static_cast<int>(s.D);
  a.F = static_cast<int>(s.F);
  a.E = static_cast<int>(s.E);
  a.active = static_cast<int>(std::min(s.active, s.F));
  a.shifted = shifted;
  a.accumulate = accumulate;
  outer_kernel<<<static_cast<unsigned>(s.BH * s.F), kOuterThreads, 0, stream()>>>(a);
  check_launch("outer_kernel");
}

void fold(Tensor& X, const Tensor& init, const Tensor& Mbuf, int64_t m_off, int64_t m_stride, bool transpose,
          const Tensor& Hbuf, int64_t h_off, int64_t h_stride, const std::vector<int>& order, int64_t BH, int64_t D,
          int64_t E) {
  GDNCP_CHECK(order.size() <= static_cast<size_t>(kMaxRanks), "cp cuda fold: more than ", kMaxRanks, " ranks");
  GDNCP_CHECK(D >= 1 && D <= kRowThreads && (E == 1 || E == D), "cp cuda fold: bad sizes D = ", D, ", E = ", E);
  FoldArgs a;
  a.X = f32_out(X, "X");
  a.init = f32_in(init, "init");
  a.M = f32_in(Mbuf, "Mbuf");
  a.H = f32_in(Hbuf, "Hbuf");
  a.m_off = m_off;
  a.m_stride = m_stride;
  a.h_off = h_off;
  a.h_stride = h_stride;
  a.D = static_cast<int>(D);
  a.E = static_cast<int>(E);
  a.n = static_cast<int>(order.size());
  a.transpose = transpose;
  std::copy(order.begin(), order.end(), a.order);
  if (E == 1) {
    fold_kernel<1><<<dim3(1, static_cast<unsigned>(BH)), kRowThreads, 0, stream()>>>(a);
    check_launch("fold_kernel<1>");
  } else {
    const unsigned blocks = static_cast<unsigned>((E + kCols - 1) / kCols);
    fold_kernel<kCols><<<dim3(blocks, static_cast<unsigned>(BH)), kRowThreads, 0, stream()>>>(a);
    check_launch("fold_kernel<16>");
  }
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
