// src/kernels/scan/scan_sweep.cu — the device scan core: the CUDA twins of scan_sweep(s) and
// scan_grad_outer(s) (src/kernels/cp_kernels.h, Note [scan step], Note [clip cuts]), on which every
// CP entry and the single-rank bidirectional scan (cuda::scan_bidi_fwd / scan_bidi_bwd, composed
// in src/kernels/scan/scan_bidi.cpp, scan_core) run. f32 state, step products as 3xTF32
// (Note [3xTF32 steps]): f32 accuracy whatever the matrix-unit mode (docs/design.md §8).
//
//   sweep_kernel   one block per (sweep, column block, b·h): Note [column blocks]; a pair of
//                  sweeps (Sweep::partner) runs as a cluster of 2 that writes their sum.
//   Z GEMMs        the transition gradients' Gr_t = L_t R'_tᵀ of the KV states (E = D):
//                  strided-batched cuBLAS f32 GEMMs over all frames (Note [Z GEMMs]);
//   outer_kernel   then dP (=, +=) −g Gr and dg (=, +=) ⟨Gr, I − P⟩, one block per frame; for the
//                  z vector (E = 1) it forms the rank ≤ 2 Gr itself. dg in f64 (Note [dg in f64]).
//
// Note [dg in f64]. A frame's decay gradient ⟨Gr, I − P⟩ sums D² products of both signs, and the
// groups of a batch that share dg (the KV and Z transitions of one decay) add terms that cancel
// in part: summed in f32, the cancellation amplifies the f32 rounding of the partial sums into the
// result (the CP layer's decay gradient once sat at 1.7e-6 against f64, growing with F). The
// block sums its terms in f64, and the groups sharing one dg chain that f64 sum: dg is rounded
// to f32 once per frame. O(B·H·F) values: the f64 adds cost nothing beside the D² products.
// No atomics: every result is bitwise reproducible.
//
// Note [clips are a template]: the sweep kernel takes CLIPS (a mask is given) as a template
// argument, so a sweep without a mask runs code without the per-step mask load (that load sits
// on the scan's latency-bound critical path: +15 % per scan when read at run time). Where the
// mask cuts (before or after the step) is a uniform run-time branch: the two sweeps of a pair
// cut at different places and share one kernel.
//
// Note [column blocks]: a step Y ← g (Y − op(P) Y) + U acts on every column of Y alone, so one
// block owns kCols columns of one sweep's state (D×E; E = 1: the z vector, one column) of one
// b·h and walks the frames with its slice on chip. Why 16 (measured, docs/history.md): blocks of
// 8 columns read P twice as often from L2 (a CP rank's one-direction sweeps: its CP-only time
// +18 %); blocks of 32 lengthen each block's product (two blocks an SM: the scan +38 % forward,
// +14 % backward); a column block as a cluster of two blocks that split the product's k (partial
// products through distributed shared memory, a cluster barrier a step) made the one-direction
// sweeps 10 % slower. Each step costs two block barriers: one before the product (the panel of P
// and the state's shared copy visible), one after it (every warp done reading the copy before
// it is rewritten). A step whose result nothing observes (the last one of a sweep without
// out_after and final state) or that multiplies a known-zero state (the first one from
// Init::zero without add_before) skips its product. Any D in [1, kMaxHeadDim] runs at its own
// size: the product's k runs to D rounded up to a slab of 8 (zeros beyond D), its rows to whole
// warps of 16; no padding to the tile table of head_dims.h,
// whose larger entries would multiply zero rows and columns every step.
//
// Note [3xTF32 steps]: the product op(P) Y of a step runs on the tensor cores as three TF32
// products, hi·hi + (hi·lo + lo·hi) with y = hi + lo split at TF32's 11 bits, which keeps the
// f32 accuracy of the scan (the dropped lo·lo term and lo's truncation are 2^-21 relative) at a
// fraction of the instructions of f32 FMAs. Warp w owns rows [16w, 16w + 16) of the slice: it
// stages its own panel of P_t (the 16 rows of P, or for op = transpose the 16 columns) with
// cp.async and starts the next product step's panel as soon as its product is done, so the load
// runs under the block's barrier and state update. The state lives in registers in the
// accumulator layout; a copy in shared memory is the B operand of the next step, and the thread
// writes its own elements of each frame to global memory.
// A step is bound by each warp's latency, not by issue (ncu, a CP rank's one-direction launch:
// 2.5 warps a scheduler, 65 % of cycles with none eligible, short fixed-latency dependencies the
// top stall). The k-loop is unrolled by two with no branch inside, so the compiler issues the
// next slab's shared loads and TF32 splits under this slab's products: the one-direction sweeps
// 5–6 % shorter. Unrolled by four, or with the loads one slab ahead by hand, the kernel spills at
// its 80 registers and gains less or loses (docs/history.md).
#include <cooperative_groups.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/common/cublas_handle.h"
#include "kernels/common/cuda_common.cuh"
#include "kernels/cp_kernels.h"
#include "kernels/kernels.h"
#include "kernels/scan/scan_bidi.h"

namespace gdncp {
namespace cp {
namespace cuda {
namespace {

using namespace ::gdncp::cuda::detail;
namespace cg = cooperative_groups;

constexpr int kScanThreads = 256;  // 8 warps of 16 rows: D ≤ 128
constexpr int kCols = 16;          // state columns per block: two n-tiles of 8
constexpr int kRows = 16;          // rows per warp: one m-tile
constexpr int kLdX = kCols + 4;    // pitch of [k][16] tiles: words (2t + j)·kLdX + g are conflict-free
static_assert(kScanThreads / 32 * kRows >= kMaxHeadDim, "a warp of rows per 16 rows of the largest head dim");
constexpr int kPairBatch = 4;  // pair-sum elements a thread loads before it stores any
constexpr int kMaxSweeps = 8;  // sweeps (pair members count one each) per launch

// Shared memory of one block, in floats: one panel of P per warp that owns rows, then the
// state slice X as [Kp][kLdX].
struct ScanLayout {
  int Kp;     // D rounded up to a k-slab of 8
  int ldp;    // rows panel [16][Kp] pitch, ≡ 8 (mod 16): 8-byte loads g·ldp + 2t are conflict-free
  int panel;  // floats a panel: rows [16][ldp], columns (op = transpose) [Kp][kLdX]
  int tiles;  // warps that own rows
  __host__ __device__ ScanLayout(int D, bool rows)
      : Kp((D + 7) / 8 * 8),
        ldp((Kp + 15) / 16 * 16 + 8),
        panel(rows ? kRows * ldp : Kp * kLdX),
        tiles((D + 15) / 16) {}
  __host__ __device__ size_t floats() const {
    return static_cast<size_t>(tiles) * panel + static_cast<size_t>(Kp) * kLdX;
  }
};

// One sweep of a launch. so: its summed output (out_after, else out_before) when it is a pair
// member; sum: the pair's sum (first member).
struct SweepArgs {
  float* ob = nullptr;
  float* oa = nullptr;
  float* fin = nullptr;
  float* sum = nullptr;
  const float* so = nullptr;
  const float* P = nullptr;
  const float* vb = nullptr;
  const float* ua = nullptr;
  const float* init = nullptr;
  const float* cuts = nullptr;  // clip mask (B, F), row bh / H (Note [clip cuts])
  int D = 0, F = 0, E = 0, active = 0, H = 1, init_kind = 0, ncb = 0;
  bool descending = false, cut_after = false;
  bool vec4 = false;  // D % 4 == 0 and P 16-byte aligned: panels in 16-byte copies
  bool vec2 = false;  // E even and every state pointer 8-byte aligned: column pairs as float2
};
struct SweepBatch {
  SweepArgs s[kMaxSweeps];
  int block0[kMaxSweeps];  // first block of each job (a sweep, or a pair: members 2k, 2k + 1)
  int jobs = 0;
  bool paired = false;
  In decay;
};

// Step order of Note [scan step] per block (Note [column blocks], Note [3xTF32 steps]).
// TRANSPOSE: op(P) = Pᵀ (panels of columns of P). blockIdx.x: jobs one after another; in a job
// the column block varies fastest, then b·h (then, paired, the member: 2·unit + member).
template <bool TRANSPOSE, bool CLIPS>
__global__ void __launch_bounds__(kScanThreads, 3)  // 3 blocks an SM: ≤ 85 registers
    sweep_kernel(const __grid_constant__ SweepBatch batch) {
  extern __shared__ __align__(16) float smem[];
  int job = 0;
  while (job + 1 < batch.jobs && static_cast<int>(blockIdx.x) >= batch.block0[job + 1]) ++job;
  int rel = static_cast<int>(blockIdx.x) - batch.block0[job];
  const int member = batch.paired ? rel % 2 : 0;
  if (batch.paired) rel /= 2;
  const SweepArgs& a = batch.s[batch.paired ? 2 * job + member : job];
  const int D = a.D, E = a.E, F = a.F, cb = rel % a.ncb, bh = rel / a.ncb, tid = threadIdx.x;
  const ScanLayout L(D, !TRANSPOSE);
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3, m0 = warp * kRows;
  const bool owner = warp < L.tiles;
  float* panel = smem + warp * L.panel;  // this warp's P rows (or columns) [m0, m0 + 16)
  float* Xs = smem + L.tiles * L.panel;  // the state slice, [Kp][kLdX]

  const int c0 = cb * kCols, nc = min(kCols, E - c0);
  const int64_t DD = static_cast<int64_t>(D) * D, DE = static_cast<int64_t>(D) * E;
  const float* Pm = a.P + static_cast<int64_t>(bh) * F * DD;
  const auto frame = [&](int s) { return a.descending ? F - 1 - s : s; };
  const auto at = [&](auto* base, int f) { return base + (static_cast<int64_t>(bh) * F + f) * DE; };
  const float* mask = CLIPS ? a.cuts + static_cast<int64_t>(bh / a.H) * F : nullptr;
  const auto cut_at = [&](int f) { return CLIPS && f < a.active && __ldg(mask + f) != 0.f; };  // frozen: no cut
  // This thread's elements of the slice: rows m0 + g + 8h, columns 8j + 2t4 and + 1, in the
  // accumulator layout (v[j][2h], v[j][2h + 1]); their offsets in a frame (< D·E) and in X.
  int eoff[2][2], xoff[2][2];
  unsigned in0 = 0, in1 = 0, in_x = 0;  // bit 2j + h: column 2t4 (in0), 2t4 + 1 (in1) inside, row < Kp
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g + 8 * h, c = 8 * j + 2 * t4, b = 2 * j + h;
      eoff[j][h] = i * E + c0 + c;
      xoff[j][h] = i * kLdX + c;
      in0 |= (owner && i < D && c < nc ? 1u : 0u) << b;
      in1 |= (owner && i < D && c + 1 < nc ? 1u : 0u) << b;
      in_x |= (owner && i < L.Kp ? 1u : 0u) << b;
    }
  // v = this thread's elements of the D×E matrix at base (0 outside the slice).
  const auto load = [&](const float* base, float(&v)[2][4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int b = 2 * j + h;
        float2 e = make_float2(0.f, 0.f);
        if (a.vec2) {
          if (in0 >> b & 1u) e = ldg2(base + eoff[j][h]);
        } else {
          if (in0 >> b & 1u) e.x = __ldg(base + eoff[j][h]);
          if (in1 >> b & 1u) e.y = __ldg(base + eoff[j][h] + 1);
        }
        v[j][2 * h] = e.x;
        v[j][2 * h + 1] = e.y;
      }
  };
  const auto store = [&](float* base, const float(&v)[2][4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int b = 2 * j + h;
        if (a.vec2) {
          if (in0 >> b & 1u) st2(base + eoff[j][h], v[j][2 * h], v[j][2 * h + 1]);
        } else {
          if (in0 >> b & 1u) base[eoff[j][h]] = v[j][2 * h];
          if (in1 >> b & 1u) base[eoff[j][h] + 1] = v[j][2 * h + 1];
        }
      }
  };
  // The state to X: elements outside the slice as zeros (rows ≥ D: the padded k of the product).
  const auto to_x = [&](const float(&v)[2][4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int b = 2 * j + h;
        if (in_x >> b & 1u)
          st2(Xs + xoff[j][h], in0 >> b & 1u ? v[j][2 * h] : 0.f, in1 >> b & 1u ? v[j][2 * h + 1] : 0.f);
      }
  };
  const auto add_to = [&](float(&x)[2][4], const float(&v)[2][4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[j][e] += v[j][e];
  };
  const auto clear = [&](float(&x)[2][4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[j][e] = 0.f;
  };
  // This warp's panel of P_f (zeros beyond D), one cp.async group. With 16-byte copies a lane
  // owns one 16-byte chunk of each row it visits (Kp ≤ 128), so the addresses step by a row.
  const auto stage_panel = [&](int f) {
    const float* Pp = Pm + f * DD;
    if (!TRANSPOSE && a.vec4) {  // rows m0 .. m0 + 15, columns 0 .. Kp − 1, as [16][ldp]
      const int k = 4 * lane;
      if (k < L.Kp) {
        const float* src = Pp + static_cast<int64_t>(m0) * D + k;
        float* dst = panel + k;
        for (int r = 0; r < kRows; ++r, src += D, dst += L.ldp) {
          const bool ok = k < D && m0 + r < D;
          cp_async16(dst, ok ? src : Pp, ok);
        }
      }
    } else if (!TRANSPOSE) {
      for (int r = 0; r < kRows; ++r) {
        const int i = m0 + r;
        for (int k = lane; k < L.Kp; k += 32) {
          const bool ok = i < D && k < D;
          cp_async4(panel + r * L.ldp + k, ok ? Pp + static_cast<int64_t>(i) * D + k : Pp, ok);
        }
      }
    } else if (a.vec4) {  // columns m0 .. m0 + 15 of rows 0 .. Kp − 1, as [Kp][kLdX]
      const int q = 4 * (lane & 3);
      const float* src = Pp + static_cast<int64_t>(lane >> 2) * D + m0 + q;
      float* dst = panel + (lane >> 2) * kLdX + q;
      for (int k = lane >> 2; k < L.Kp; k += 8, src += 8 * D, dst += 8 * kLdX) {
        const bool ok = k < D && m0 + q < D;
        cp_async16(dst, ok ? src : Pp, ok);
      }
    } else {
      for (int k = lane >> 4; k < L.Kp; k += 2) {
        const int q = lane & 15;
        const bool ok = k < D && m0 + q < D;
        cp_async4(panel + k * kLdX + q, ok ? Pp + static_cast<int64_t>(k) * D + m0 + q : Pp, ok);
      }
    }
    cp_async_commit();
  };
  // This lane's elements of slab k0: of the A fragment (P's panel) and of both B fragments (X).
  // Slot t4 of a k-slab takes k0 + 2t4 and slot t4 + 4 takes k0 + 2t4 + 1 (Note [warp tiles]),
  // in A and B alike.
  const auto fetch = [&](int k0, float(&av)[4], float(&bv)[2][2]) {
    if (!TRANSPOSE) {
      const float2 lo = ld2(panel + g * L.ldp + k0 + 2 * t4), hi = ld2(panel + (g + 8) * L.ldp + k0 + 2 * t4);
      av[0] = lo.x, av[1] = hi.x, av[2] = lo.y, av[3] = hi.y;
    } else {
      const float* r = panel + (k0 + 2 * t4) * kLdX + g;
      av[0] = r[0], av[1] = r[8], av[2] = r[kLdX], av[3] = r[kLdX + 8];
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float* xb = Xs + (k0 + 2 * t4) * kLdX + 8 * j + g;
      bv[j][0] = xb[0], bv[j][1] = xb[kLdX];
    }
  };
  // y = op(P) X for this warp's rows, 3xTF32 (Note [3xTF32 steps]). Both n-tiles always (the z
  // vector's second one multiplies zero columns of X), so that a slab is straight-line code and
  // two unrolled slabs overlap.
  const auto product = [&](float(&y)[2][4]) {
    float ylo[2][4];  // the small terms: a second accumulator chain
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[j][e] = ylo[j][e] = 0.f;
#pragma unroll 2
    for (int k0 = 0; k0 < L.Kp; k0 += 8) {
      float av[4], bv[2][2];
      fetch(k0, av, bv);
      uint32_t ahi[4], alo[4], bhi[2][2], blo[2][2];
#pragma unroll
      for (int e = 0; e < 4; ++e) split_tf32(av[e], ahi[e], alo[e]);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        split_tf32(bv[j][0], bhi[j][0], blo[j][0]), split_tf32(bv[j][1], bhi[j][1], blo[j][1]);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        mma_tf32(ylo[j], alo, bhi[j]);
        mma_tf32(ylo[j], ahi, blo[j]);
        mma_tf32(y[j], ahi, bhi[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[j][e] += ylo[j][e];
  };
  // Steps with a product (Note [column blocks]); uniform over the block.
  const bool last_unseen = !a.oa && !a.fin, first_zero = a.init_kind == static_cast<int>(Init::zero) && !a.vb;
  const auto multiplies = [&](int s) {
    return frame(s) < a.active && !(s == 0 && first_zero) && !(s == F - 1 && last_unseen);
  };
  // Steps 1 and 2 of frame f (cut before, add_before, out_before) on the state x.
  const auto before_step = [&](float(&x)[2][4], int f, bool cut, const float(&v)[2][4]) {
    if (cut) clear(x);
    if (a.vb) add_to(x, v);
    if (a.ob) {
      if (f < a.active) {
        store(at(a.ob, f), x);
      } else {
        float zeros[2][4] = {};
        store(at(a.ob, f), zeros);
      }
    }
  };

  float x[2][4] = {}, vb[2][4] = {};
  if (a.init_kind == static_cast<int>(Init::given)) {
    load(a.init + bh * DE, x);
  } else if (a.init_kind == static_cast<int>(Init::identity)) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = m0 + g + 8 * h, c = c0 + 8 * j + 2 * t4, b = 2 * j + h;
        x[j][2 * h] = (in0 >> b & 1u) && i == c ? 1.f : 0.f;
        x[j][2 * h + 1] = (in1 >> b & 1u) && i == c + 1 ? 1.f : 0.f;
      }
  }
  if (F > 0) {
    const int f0 = frame(0);
    if (a.vb) load(at(a.vb, f0), vb);
    before_step(x, f0, !a.cut_after && cut_at(f0), vb);
    if (owner && multiplies(0)) stage_panel(f0);
  }
  to_x(x);
  for (int s = 0; s < F; ++s) {
    const int f = frame(s), fn = s + 1 < F ? frame(s + 1) : f;
    const bool frozen = f >= a.active, prod = multiplies(s);
    // Loads of this step and the next, issued before the barriers.
    float un[2][4] = {};
    if (a.ua && !frozen) load(at(a.ua, f), un);
    const float gf = frozen ? 0.f : batch.decay[static_cast<int64_t>(bh) * F + f];
    const bool cut_now = a.cut_after && cut_at(f), cut_next = s + 1 < F && !a.cut_after && cut_at(fn);
    if (a.vb && s + 1 < F) load(at(a.vb, fn), vb);
    cp_async_wait_all();
    __syncthreads();  // this warp's panel of P_f and the whole of X are visible
    if (owner) {
      float y[2][4] = {};
      if (prod) {
        product(y);
        __syncwarp();  // the panel is free: start the next product step's
      }
      if (s + 1 < F && multiplies(s + 1)) stage_panel(fn);
      if (!frozen) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) x[j][e] = gf * (x[j][e] - y[j][e]) + un[j][e];
      }
    }
    __syncthreads();  // every warp is done reading X
    if (cut_now) clear(x);
    if (a.oa) store(at(a.oa, f), x);
    if (s + 1 < F) before_step(x, fn, cut_next, vb);
    to_x(x);
  }
  if (a.fin) store(a.fin + bh * DE, x);
  cp_async_wait_all();

  if (batch.paired) {  // the pair's sum: the two members split the frames (f ≡ member mod 2)
    __threadfence();
    cg::this_cluster().sync();
    const SweepArgs& a0 = batch.s[2 * job];
    const float* pa = batch.s[2 * job].so + static_cast<int64_t>(bh) * F * DE;
    const float* pb = batch.s[2 * job + 1].so + static_cast<int64_t>(bh) * F * DE;
    float* sum = a0.sum + static_cast<int64_t>(bh) * F * DE;
    const bool pairs = a0.vec2 && batch.s[2 * job + 1].vec2;  // column pairs as float2
    const int w = pairs ? 2 : 1, per_row = (nc + w - 1) / w, per_frame = D * per_row;
    const int64_t total = static_cast<int64_t>((F - member + 1) / 2) * per_frame;
    for (int64_t e0 = tid; e0 < total; e0 += kPairBatch * kScanThreads) {
      float2 va[kPairBatch], vv[kPairBatch];
      int64_t o[kPairBatch];
      bool ok[kPairBatch];
#pragma unroll
      for (int q = 0; q < kPairBatch; ++q) {
        const int64_t e = e0 + q * kScanThreads, fr = e / per_frame;
        const int r = static_cast<int>(e - fr * per_frame), i = r / per_row, c = w * (r - i * per_row);
        ok[q] = e < total;
        o[q] = ok[q] ? (member + 2 * fr) * DE + static_cast<int64_t>(i) * E + c0 + c : 0;
        va[q] = vv[q] = make_float2(0.f, 0.f);
        if (ok[q]) {
          if (pairs) {
            va[q] = __ldcg(reinterpret_cast<const float2*>(pa + o[q]));
            vv[q] = __ldcg(reinterpret_cast<const float2*>(pb + o[q]));
          } else {
            va[q].x = __ldcg(pa + o[q]);
            vv[q].x = __ldcg(pb + o[q]);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kPairBatch; ++q)
        if (ok[q]) {
          if (pairs)
            st2(sum + o[q], va[q].x + vv[q].x, va[q].y + vv[q].y);
          else
            sum[o[q]] = va[q].x + vv[q].x;
        }
    }
  }
}

using SweepKernel = void (*)(SweepBatch);
SweepKernel sweep_kernel_of(bool transpose, bool clips) {
  if (transpose) return clips ? sweep_kernel<true, true> : sweep_kernel<true, false>;
  return clips ? sweep_kernel<false, true> : sweep_kernel<false, false>;
}

void check_dims(const SweepSpec& s) {
  GDNCP_CHECK(s.D >= 1 && s.D <= kMaxHeadDim, "cp cuda scan: D = ", s.D, " must be in [1, ", kMaxHeadDim, "]");
  GDNCP_CHECK(s.E == 1 || s.E == s.D, "cp cuda scan: E = ", s.E, " must be 1 or D");
  GDNCP_CHECK(s.BH >= 0 && s.F >= 0 && s.F <= INT32_MAX, "cp cuda scan: bad sizes B·H = ", s.BH, ", F = ", s.F);
}

// The clip mask of a sweep or outer group (B, F) f32 on the device, or null.
const float* cuts_of(const Tensor& cuts, int64_t BH, int64_t H, int64_t F) {
  if (!cuts.defined()) return nullptr;
  GDNCP_CHECK(H >= 1 && BH % H == 0, "cp cuda scan: H = ", H, " does not divide B·H = ", BH);
  GDNCP_CHECK(cuts.numel() == BH / H * F, "cp cuda scan: cuts: must be (B, F) = (", BH / H, ", ", F, "), got ",
              cuts.str());
  return f32_or_null(cuts, "cuts");
}

// The kernel arguments of one sweep, checked.
SweepArgs args_of(Sweep& w) {
  const SweepSpec& s = w.spec;
  check_dims(s);
  GDNCP_CHECK(s.init != Init::identity || s.E == s.D, "scan_sweep: identity init needs E == D");
  GDNCP_CHECK(w.P.defined(), "scan_sweep: P is undefined");  // (null data: a rank with no frame)
  SweepArgs a;
  a.ob = f32_out_or_null(w.out_before, "out_before");
  a.oa = f32_out_or_null(w.out_after, "out_after");
  a.fin = f32_out_or_null(w.final_state, "final_state");
  GDNCP_CHECK(!a.fin || (w.final_offset >= 0 && w.final_offset + s.BH * s.D * s.E <= w.final_state.numel()),
              "scan_sweeps: final_offset ", w.final_offset, " leaves no room for the final states in ",
              w.final_state.str());
  if (a.fin) a.fin += w.final_offset;
  a.P = f32_or_null(w.P, "P");
  a.vb = f32_or_null(w.add_before, "add_before");
  a.ua = f32_or_null(w.add_after, "add_after");
  a.init = s.init == Init::given ? f32_or_null(w.init, "init") : nullptr;
  GDNCP_CHECK(s.init != Init::given || a.init, "scan_sweep: init is undefined");
  a.D = static_cast<int>(s.D);
  a.F = static_cast<int>(s.F);
  a.E = static_cast<int>(s.E);
  a.active = static_cast<int>(std::min(s.active, s.F));
  a.H = static_cast<int>(s.H);
  a.init_kind = static_cast<int>(s.init);
  a.cuts = s.cut == Cut::none ? nullptr : cuts_of(w.cuts, s.BH, s.H, s.F);
  a.cut_after = s.cut == Cut::after;
  a.ncb = static_cast<int>(cdiv(s.E, kCols));
  a.descending = s.descending;
  a.vec4 = s.D % 4 == 0 && aligned16(a.P);
  a.vec2 = s.E % 2 == 0 && aligned8(a.ob) && aligned8(a.oa) && aligned8(a.fin) && aligned8(a.vb) && aligned8(a.ua) &&
           aligned8(a.init);
  return a;
}

// One launch of jobs sharing (transpose, clips, paired): sweeps, or pairs (members 2k, 2k + 1).
void launch_sweeps(SweepBatch& batch, int nargs, int64_t BH, int D, bool transpose, bool clips) {
  batch.jobs = batch.paired ? nargs / 2 : nargs;
  int64_t blocks = 0;
  for (int k = 0; k < batch.jobs; ++k) {
    batch.block0[k] = static_cast<int>(blocks);
    blocks += (batch.paired ? 2 : 1) * BH * batch.s[batch.paired ? 2 * k : k].ncb;
    GDNCP_CHECK(blocks < (int64_t{1} << 31), "scan_sweeps: too many blocks (", blocks, ")");
  }
  if (blocks == 0) return;
  const size_t smem = ScanLayout(D, !transpose).floats() * sizeof(float);
  SweepKernel kernel = sweep_kernel_of(transpose, clips);
  allow_smem(kernel, smem);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(kScanThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;  // the two members of a pair
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = batch.paired ? 1 : 0;
  GDNCP_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, batch));
  GDNCP_CUDA_CHECK_LAUNCH("sweep_kernel");
}

}  // namespace

void scan_sweeps(std::vector<Sweep>& sweeps, const Tensor& decay) {
  const In dc = in_of(decay, "decay");
  const int n = static_cast<int>(sweeps.size());
  int64_t BH = 0, D = 0;
  std::vector<SweepArgs> args(sweeps.size());
  for (int k = 0; k < n; ++k) {
    const SweepSpec& s = sweeps[k].spec;
    args[k] = args_of(sweeps[k]);
    GDNCP_CHECK(k == 0 || (s.BH == BH && s.D == D), "scan_sweeps: sweeps of one batch must share B·H and D");
    BH = s.BH;
    D = s.D;
  }
  // Pairs (Sweep::partner): a cluster of 2 when they share the kernel, else two sweeps and an add.
  std::vector<int> member_of(sweeps.size(), -1);
  std::vector<std::pair<int, int>> adds;
  for (int k = 0; k < n; ++k) {
    const int p = sweeps[k].partner;
    if (p < 0) continue;
    GDNCP_CHECK(p < n && p != k && sweeps[p].partner < 0 && member_of[k] < 0 && member_of[p] < 0, "scan_sweeps: sweep ",
                k, ": partner ", p, " is not a free sweep of the batch");
    const SweepSpec &s = sweeps[k].spec, &q = sweeps[p].spec;
    GDNCP_CHECK(s.F == q.F && s.E == q.E, "scan_sweeps: sweeps ", k, " and ", p, " of a pair differ in F or E");
    GDNCP_CHECK(sweeps[k].sum.defined() && sweeps[k].sum.numel() == s.BH * s.F * s.D * s.E, "scan_sweeps: sweep ", k,
                ": sum must be (B·H, F, D, E)");
    GDNCP_CHECK((sweeps[k].out_after.defined() || sweeps[k].out_before.defined()) &&
                    (sweeps[p].out_after.defined() || sweeps[p].out_before.defined()),
                "scan_sweeps: a pair's sweeps need out_after or out_before");
    float* sum = f32_out(sweeps[k].sum, "sum");
    args[k].so = sweeps[k].out_after.defined() ? args[k].oa : args[k].ob;
    args[p].so = sweeps[p].out_after.defined() ? args[p].oa : args[p].ob;
    args[k].sum = sum;
    args[k].vec2 = args[k].vec2 && aligned8(sum);  // the pair's sum in float2 only where it is aligned too
    member_of[k] = p;
    member_of[p] = k;
    if (s.transpose != q.transpose || (args[k].cuts != nullptr) != (args[p].cuts != nullptr)) adds.push_back({k, p});
  }
  for (const auto& kp : adds) member_of[kp.first] = member_of[kp.second] = -1;
  for (int paired = 0; paired < 2; ++paired)
    for (int transpose = 0; transpose < 2; ++transpose)
      for (int clips = 0; clips < 2; ++clips) {
        SweepBatch batch;
        batch.decay = dc;
        batch.paired = paired != 0;
        int nargs = 0;
        for (int k = 0; k < n; ++k) {
          if (sweeps[k].spec.transpose != (transpose != 0) || (args[k].cuts != nullptr) != (clips != 0)) continue;
          if (paired ? !(member_of[k] >= 0 && sweeps[k].partner >= 0) : member_of[k] >= 0) continue;
          if (nargs + (paired ? 2 : 1) > kMaxSweeps) {
            launch_sweeps(batch, nargs, BH, static_cast<int>(D), transpose, clips);
            nargs = 0;
          }
          batch.s[nargs++] = args[k];
          if (paired) batch.s[nargs++] = args[member_of[k]];
        }
        if (nargs > 0) launch_sweeps(batch, nargs, BH, static_cast<int>(D), transpose, clips);
      }
  for (const auto& kp : adds) {
    Sweep& w = sweeps[kp.first];
    const Tensor& a = w.out_after.defined() ? w.out_after : w.out_before;
    const Sweep& q = sweeps[kp.second];
    add(w.sum, a, q.out_after.defined() ? q.out_after : q.out_before);
  }
}

void scan_sweep(Tensor& out_before, Tensor& out_after, Tensor& final_state, const Tensor& P, const Tensor& decay,
                const Tensor& add_before, const Tensor& add_after, const Tensor& init, const SweepSpec& s,
                const Tensor& cuts) {
  std::vector<Sweep> one(1);
  one[0] = Sweep{out_before, out_after, final_state, P, add_before, add_after, init, s, 0, cuts, Tensor(), -1};
  scan_sweeps(one, decay);
}

// --- transition gradients -----------------------------------------------------------------------
namespace {

// Note [Z GEMMs]. For a KV group (E = D) Gr_t = Σ_src L_t R'_tᵀ is formed by strided-batched
// cuBLAS f32 GEMMs over the flat frames j = b·h·F + t into a buffer Z (dP itself when dP is
// overwritten), one Z per distinct `active` of the sources (outer_kernel counts frame t of a Z
// only when t < its active). A shifted source is one GEMM over all frames, Z_j += L_j R_jᵀ. An
// unshifted one reads R_{j−1}: one GEMM over j ≥ 1, wrong at t = 0 of b·h ≥ 1 (the previous
// b·h's last frame), so the unshifted GEMMs of a Z run first and its t = 0 frames are then
// overwritten: a GEMM over b·h with R0 (L_{bh,0} R0_bhᵀ), or zeros without R0; the shifted GEMMs
// accumulate after that. The z vector (E = 1) needs no GEMM: outer_kernel forms its Gr, of rank
// ≤ 2, itself.
constexpr int kOuterThreads = 512;
constexpr int kMaxGroups = 4;
constexpr int kMaxZ = 2;

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
  const float* cuts = nullptr;  // clip mask (B, F), row bh / H: a cut frame gets no gradient
  const float* Z[kMaxZ] = {};   // KV: Gr of the sources with active zact[z]
  int zact[kMaxZ] = {};
  int nz = 0;
  OuterSrc src[2];  // z vector: the sources
  int nsrc = 0, E = 0, H = 1;
  bool accumulate = false, accumulate_dg = true, vec = false;  // vec: D·D % 4 == 0 and dP, P, Z 16-byte aligned
};
struct OuterBatch {
  OuterArgs g[kMaxGroups];
  In decay;
  int n = 0, D = 0, F = 0;
};

// blockIdx.x = b·h·F + t; the groups of the batch one after another (groups may share dg).
__global__ void __launch_bounds__(kOuterThreads) outer_kernel(const __grid_constant__ OuterBatch batch) {
  __shared__ double red[kOuterThreads / 32];
  __shared__ float lv[2][kMaxHeadDim], rv[2][kMaxHeadDim];  // z vector: L_t and R'_t of each source
  const int D = batch.D, F = batch.F, tid = threadIdx.x;
  const int64_t bt = blockIdx.x, bh = bt / F, DD = static_cast<int64_t>(D) * D;
  const int t = static_cast<int>(bt % F);
  const float gt = batch.decay[bt];
  // Thread 0's f64 sum of the dg the groups share (Note [dg in f64]): written when the next
  // group names another dg, and after the last group.
  float* dg = nullptr;
  double dgs = 0.0;
  const auto flush = [&] {
    if (dg && tid == 0) dg[bt] = static_cast<float>(dgs);
  };
  for (int k = 0; k < batch.n; ++k) {
    const OuterArgs& a = batch.g[k];
    if (a.dg != dg) {
      flush();
      dg = a.dg;
      dgs = tid == 0 && a.accumulate_dg ? static_cast<double>(dg[bt]) : 0.0;
    } else if (!a.accumulate_dg) {
      dgs = 0.0;
    }
    float* dPt = a.dP + bt * DD;
    const float* Pt = a.P + bt * DD;
    bool any = false;  // some source counts frame t
    if (a.E == 1)
      for (int q = 0; q < a.nsrc; ++q) any |= t < a.src[q].active;
    else
      for (int z = 0; z < a.nz; ++z) any |= t < a.zact[z];
    const bool cut = a.cuts && a.cuts[(bh / a.H) * F + t] != 0.f;  // the transition is unused
    if (cut || !any) {                                             // dP_t = 0 (or unchanged), dg unchanged
      if (!a.accumulate)
        for (int64_t e = tid; e < DD; e += kOuterThreads) dPt[e] = 0.f;
      continue;
    }
    if (a.E == 1) {
      if (tid < kMaxHeadDim)
        for (int q = 0; q < 2; ++q) {
          const OuterSrc& s = a.src[q];
          const bool on = q < a.nsrc && t < s.active && tid < D;
          const float* Rp = nullptr;  // R'_t: R_t shifted, else R_{t−1} (R0 at t = 0, or 0)
          if (on) Rp = s.shifted ? s.R + bt * D : t > 0 ? s.R + (bt - 1) * D : s.R0 ? s.R0 + bh * D : nullptr;
          lv[q][tid] = on ? s.L[bt * D + tid] : 0.f;
          rv[q][tid] = Rp ? Rp[tid] : 0.f;
        }
      __syncthreads();
    }
    const float* Z0 = a.nz > 0 && t < a.zact[0] ? a.Z[0] + bt * DD : nullptr;
    const float* Z1 = a.nz > 1 && t < a.zact[1] ? a.Z[1] + bt * DD : nullptr;
    // Element (i, c) of frame t with Gr = v: dP = −g v (+ dP), and this thread's part of ⟨Gr, I − P⟩.
    double part = 0.0;
    const auto element = [&](int i, int c, float v, float p, float d) {
      part += static_cast<double>(v) * ((i == c ? 1.0 : 0.0) - static_cast<double>(p));
      return a.accumulate ? d - gt * v : -gt * v;
    };
    const auto gr = [&](int i, int c, int64_t e) {
      if (a.E == 1) return lv[0][i] * rv[0][c] + lv[1][i] * rv[1][c];
      return (Z0 ? Z0[e] : 0.f) + (Z1 ? Z1[e] : 0.f);
    };
    if (a.vec) {
      for (int64_t e = 4 * tid; e < DD; e += 4 * kOuterThreads) {
        const float4 p = *reinterpret_cast<const float4*>(Pt + e);
        const float4 d = a.accumulate ? *reinterpret_cast<const float4*>(dPt + e) : make_float4(0.f, 0.f, 0.f, 0.f);
        float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        if (a.E != 1) {
          if (Z0) z = *reinterpret_cast<const float4*>(Z0 + e);
          if (Z1) {
            const float4 w = *reinterpret_cast<const float4*>(Z1 + e);
            z.x += w.x, z.y += w.y, z.z += w.z, z.w += w.w;
          }
        }
        int i = static_cast<int>(e / D), c = static_cast<int>(e - static_cast<int64_t>(i) * D);
        float4 out;
        float* o = &out.x;
        const float* zz = &z.x;
        const float* pp = &p.x;
        const float* dd = &d.x;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          o[q] = element(i, c, a.E == 1 ? gr(i, c, 0) : zz[q], pp[q], dd[q]);
          if (++c == D) c = 0, ++i;
        }
        *reinterpret_cast<float4*>(dPt + e) = out;
      }
    } else {
      for (int64_t e = tid; e < DD; e += kOuterThreads) {
        const int i = static_cast<int>(e / D), c = static_cast<int>(e % D);
        dPt[e] = element(i, c, gr(i, c, e), Pt[e], a.accumulate ? dPt[e] : 0.f);
      }
    }
    part = warp_sum(part);
    if ((tid & 31) == 0) red[tid >> 5] = part;
    __syncthreads();
    if (tid == 0)
      for (int w = 0; w < kOuterThreads / 32; ++w) dgs += red[w];
    __syncthreads();  // red, lv and rv are reused by the next group
  }
  flush();
}

// C_j = A_j·B_jᵀ (+ C_j when accumulate) for `batch` row-major D×D frames, strides in floats, in
// IEEE f32. Column-major, the buffers hold A_jᵀ, B_jᵀ, C_jᵀ, and C_jᵀ = B_j·A_jᵀ = op_T(B_jᵀ)·op_N(A_jᵀ)
// (Note [row-major through cuBLAS] in matmul.cu).
void frame_gemm_nt(float* C, int64_t sc, const float* A, int64_t sa, const float* B, int64_t sb, int D, int64_t batch,
                   bool accumulate) {
  if (batch <= 0) return;
  GDNCP_CHECK(batch <= INT32_MAX, "cuda scan: ", batch, " frames exceed cuBLAS's 32-bit batch count");
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  GDNCP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(::gdncp::cuda::cublas_handle(), CUBLAS_OP_T, CUBLAS_OP_N, D, D, D, &one,
                                                B, CUDA_R_32F, D, sb, A, CUDA_R_32F, D, sa, &beta, C, CUDA_R_32F, D, sc,
                                                static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Z = Σ_srcs L R'ᵀ over every frame (Note [Z GEMMs]).
void z_gemms(float* Z, const std::vector<const OuterSource*>& srcs, int64_t BH, int64_t F, int D) {
  const int64_t DD = static_cast<int64_t>(D) * D, N = BH * F;
  bool written = false, t0 = false, unshifted = false;
  for (const OuterSource* s : srcs)
    if (!s->shifted) {
      frame_gemm_nt(Z + DD, DD, f32_in(s->L, "L") + DD, DD, f32_in(s->R, "R"), DD, D, N - 1, written);
      written = unshifted = true;
    }
  for (const OuterSource* s : srcs)
    if (!s->shifted && s->R0.defined()) {
      frame_gemm_nt(Z, F * DD, f32_in(s->L, "L"), F * DD, f32_in(s->R0, "R0"), DD, D, BH, t0);
      t0 = true;
    }
  if (unshifted && !t0)
    GDNCP_CUDA_CHECK(cudaMemset2DAsync(Z, static_cast<size_t>(F * DD) * sizeof(float), 0,
                                       static_cast<size_t>(DD) * sizeof(float), static_cast<size_t>(BH), stream()));
  for (const OuterSource* s : srcs)
    if (s->shifted) {
      frame_gemm_nt(Z, DD, f32_in(s->L, "L"), DD, f32_in(s->R, "R"), DD, D, N, written);
      written = true;
    }
}

}  // namespace

void scan_grad_outers(std::vector<OuterGroup>& groups, const Tensor& decay, int64_t BH, int64_t F, int64_t D) {
  GDNCP_CHECK(D >= 1 && D <= kMaxHeadDim, "cp cuda scan: D = ", D, " must be in [1, ", kMaxHeadDim, "]");
  const int64_t N = checked_mul(BH, F, "cp cuda scan: B·H·F");
  GDNCP_CHECK(N <= INT32_MAX, "cp cuda scan: B·H·F = ", N, " exceeds the grid");
  const int64_t DD = D * D;
  std::vector<Tensor> work;  // Z buffers beyond dP's own storage, alive until the launch is queued
  for (size_t first = 0; first < groups.size(); first += kMaxGroups) {
    const size_t n = std::min<size_t>(kMaxGroups, groups.size() - first);
    OuterBatch batch;
    batch.decay = in_of(decay, "decay");
    batch.D = static_cast<int>(D);
    batch.F = static_cast<int>(F);
    batch.n = static_cast<int>(n);
    for (size_t k = 0; k < n; ++k) {
      OuterGroup& g = groups[first + k];
      GDNCP_CHECK(g.sources.size() >= 1 && g.sources.size() <= 2, "scan_grad_outers: 1 or 2 sources per group");
      GDNCP_CHECK(g.E == 1 || g.E == D, "cp cuda scan: E = ", g.E, " must be 1 or D");
      OuterArgs& a = batch.g[k];
      a.dP = f32_out(g.dP, "dP");
      a.dg = f32_out(g.dg, "dg");
      a.P = f32_in(g.P, "P");
      a.E = static_cast<int>(g.E);
      a.accumulate = g.accumulate_dP;
      a.accumulate_dg = g.accumulate_dg;
      a.cuts = cuts_of(g.cuts, BH, g.H, F);
      a.H = static_cast<int>(g.H);
      for (const OuterSource& s : g.sources) {
        f32_in(s.L, "L");
        f32_in(s.R, "R");
        f32_or_null(s.R0, "R0");
      }
      if (g.E == 1) {  // the z vector: outer_kernel forms Gr
        a.nsrc = static_cast<int>(g.sources.size());
        for (size_t q = 0; q < g.sources.size(); ++q) {
          const OuterSource& s = g.sources[q];
          a.src[q] = OuterSrc{f32_in(s.L, "L"), f32_in(s.R, "R"), f32_or_null(s.R0, "R0"), s.shifted,
                              static_cast<int>(std::min(s.active, F))};
        }
      } else if (N > 0) {  // KV: one Z per distinct active (Note [Z GEMMs])
        std::vector<int64_t> acts;
        for (const OuterSource& s : g.sources)
          if (std::find(acts.begin(), acts.end(), std::min(s.active, F)) == acts.end())
            acts.push_back(std::min(s.active, F));
        for (size_t z = 0; z < acts.size(); ++z) {
          std::vector<const OuterSource*> srcs;
          for (const OuterSource& s : g.sources)
            if (std::min(s.active, F) == acts[z]) srcs.push_back(&s);
          float* Z = a.dP;
          if (z > 0 || g.accumulate_dP) {
            work.push_back(Tensor::empty({N, D, D}, DType::f32, Device::cuda));
            Z = static_cast<float*>(work.back().data());
          }
          z_gemms(Z, srcs, BH, F, static_cast<int>(D));
          a.Z[z] = Z;
          a.zact[z] = static_cast<int>(acts[z]);
        }
        a.nz = static_cast<int>(acts.size());
      }
      a.vec = DD % 4 == 0 && aligned16(a.dP) && aligned16(a.P) && aligned16(a.Z[0]) && aligned16(a.Z[1]);
    }
    if (N == 0) continue;
    outer_kernel<<<static_cast<unsigned>(N), kOuterThreads, 0, stream()>>>(batch);
    GDNCP_CUDA_CHECK_LAUNCH("outer_kernel");
  }
}

void scan_grad_outer(Tensor& dP, Tensor& dg, const Tensor& L, const Tensor& R, const Tensor& R0, const Tensor& P,
                     const Tensor& decay, const SweepSpec& s, bool shifted, bool accumulate, const Tensor& cuts) {
  check_dims(s);
  std::vector<OuterGroup> one(1);
  one[0].dP = dP;
  one[0].dg = dg;
  one[0].P = P;
  one[0].E = s.E;
  one[0].accumulate_dP = accumulate;
  one[0].cuts = cuts;
  one[0].H = s.H;
  one[0].sources.push_back(OuterSource{L, R, R0, shifted, s.active});
  scan_grad_outers(one, decay, s.BH, s.F, s.D);
}

}  // namespace cuda
}  // namespace cp

// ---------------------------------------------------------------------------
// the single-rank bidirectional scan: the scan core's composition (scan_bidi.h)
// ---------------------------------------------------------------------------
namespace cuda {
namespace {
void check_dims(const Dims& d) {
  GDNCP_CHECK(supported_head_dim(d.D), "cuda scan: D must be even in [", kMinHeadDim, ", ", kMaxHeadDim, "], got ",
              d.D);
  GDNCP_CHECK(d.B > 0 && d.H > 0 && d.F > 0, "cuda scan: sizes must be positive");
}
}  // namespace

void scan_bidi_fwd(Tensor& Mf, Tensor& Mr, Tensor& Msum, Tensor& zf, Tensor& zr, Tensor& zsum, const Tensor& P,
                   const Tensor& A, const Tensor& Pz, const Tensor& bz, const Tensor& decay, const Tensor& clip_starts,
                   const Dims& d) {
  check_dims(d);
  scan_core::scan_bidi_fwd(Mf, Mr, Msum, zf, zr, zsum, P, A, Pz, bz, decay, clip_starts, d);
}

void scan_bidi_bwd(Tensor& dP, Tensor& dA, Tensor& dPz, Tensor& dbz, Tensor& ddecay, const Tensor& dMsum,
                   const Tensor& dzsum, const Tensor& P, const Tensor& Pz, const Tensor& decay, const Tensor& Mf,
                   const Tensor& Mr, const Tensor& zf, const Tensor& zr, const Tensor& clip_starts, const Dims& d) {
  check_dims(d);
  scan_core::scan_bidi_bwd(dP, dA, dPz, dbz, ddecay, dMsum, dzsum, P, Pz, decay, Mf, Mr, zf, zr, clip_starts, d);
}

}  // namespace cuda
}  // namespace gdncp
