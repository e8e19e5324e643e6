// src/kernels/common/cuda_common.cuh — the one set of device helpers that every .cu of gdncp
// includes: the current stream and launch sizes, tensor views, async copies (cp.async),
// warp and block reductions, tensor-core fragments (mma.sync, ldmatrix), and the pieces the
// frame kernels share (token prep, staged loads). A kernel launch is checked with
// GDNCP_CUDA_CHECK_LAUNCH("kernel_name") (gdncp/error.h), which names the kernel.
//
// Note [warp tiles]: every matrix product of the layer (S×D by D×D, D×S by S×D)
// runs on a per-warp tile of TM×TN accumulator fragments of 16×8 in the
// register layout of mma.sync (thread (g = lane/4, t = lane%4) holds rows g and
// g+8, columns 2t and 2t+1 of each fragment). The three matrix-unit modes share
// that layout, so loads and epilogues are written once:
//   bf16: mma.m16n8k16 on bf16 operands, f32 accumulation;
//   tf32: mma.m16n8k8 on tf32 operands, f32 accumulation;
//   ieee: the same fragments accumulated with plain f32 FMAs (the accuracy mode).
// Operands live in shared memory as f32 and are rounded when a fragment is
// built. An operand is read as element (mn, k): OpMK stores it as [mn][k]
// (contiguous along k), OpKM as [k][mn]. The sum over a k slab does not care
// in which order its k are fed to the matrix unit, so thread t's k-slots
// {2t, 2t+1, 2t+8, 2t+9} of an m16n8k16 slab take k = 4t..4t+3 (one 16-byte
// load from an OpMK tile), and its slots {t, t+4} of an m16n8k8 slab take
// k = 2t, 2t+1; A and B use the same map. The row pitches below make the
// fragment loads of each mode free of bank conflicts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "gdncp/error.h"
#include "gdncp/tensor.h"
#include "kernels/common/head_dims.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace cuda {
namespace detail {

// --- streams and launch sizes --------------------------------------------------------
// Every kernel runs on gdncp's current stream (gdncp::current_stream()).
inline cudaStream_t stream() { return static_cast<cudaStream_t>(current_stream()); }

// ⌈a / b⌉ for launch sizes (a ≥ 0, b > 0).
constexpr int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid-stride kernels: kGridThreads threads a block, blocks_for(n) blocks (capped; the loop
// covers the rest).
constexpr int kGridThreads = 256;
inline unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kGridThreads - 1) / kGridThreads, 65535)));
}
#define GDNCP_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

inline int sm_count() {
  int dev = 0, n = 0;
  GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
  GDNCP_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// Raises a kernel's dynamic shared-memory limit (needed above 48 KB) to at least `bytes` on the
// current device; remembers what it raised, so a launch in a loop pays the driver call once.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  static std::mutex m;
  static std::map<std::pair<const void*, int>, size_t> raised;  // (kernel, device) → limit set
  int dev = 0;
  GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(m);
  size_t& limit = raised[{reinterpret_cast<const void*>(kernel), dev}];
  if (limit >= bytes) return;
  GDNCP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  limit = bytes;
}

// How many blocks to split each of `units` work items into so that the grid fills whole waves
// of `slots` resident blocks: minimises waves per unit of work, with a small charge per split
// (each split re-reads its block's matrices).
inline int wave_splits(int64_t units, int64_t slots, int max_splits) {
  int best = 1;
  double best_cost = 1e300;
  for (int s = 1; s <= std::max(1, max_splits); ++s) {
    const double waves = static_cast<double>((units * s + slots - 1) / slots);
    const double cost = waves / s + 0.01 * s;
    if (cost < best_cost - 1e-9) {
      best_cost = cost;
      best = s;
    }
  }
  return best;
}

// Calls fn(std::integral_constant<int, DP>{}, std::integral_constant<MathMode, M>{}) for the runtime (D, mode).
template <int DP, typename Fn>
void with_mode(MathMode mode, Fn&& fn) {
  switch (mode) {
    case MathMode::bf16:
      fn(std::integral_constant<int, DP>{}, std::integral_constant<MathMode, MathMode::bf16>{});
      return;
    case MathMode::tf32:
      fn(std::integral_constant<int, DP>{}, std::integral_constant<MathMode, MathMode::tf32>{});
      return;
    case MathMode::ieee:
      fn(std::integral_constant<int, DP>{}, std::integral_constant<MathMode, MathMode::ieee>{});
      return;
  }
  GDNCP_FAIL("unknown MathMode ", static_cast<int>(mode));
}
// Calls fn(std::integral_constant<int, DP>{}) with DP = padded_dim(D): one instantiation per
// entry of kPaddedDims (Note [head dims]).
template <int I = 0, typename Fn>
void with_dp(int64_t D, Fn&& fn) {
  if constexpr (I < kNumPaddedDims) {
    if (D <= kPaddedDims[I]) return fn(std::integral_constant<int, kPaddedDims[I]>{});
    with_dp<I + 1>(D, fn);
  } else {
    GDNCP_FAIL("head dim D = ", D, " exceeds the largest padded dim ", kMaxPaddedDim);
  }
}
template <typename Fn>
void with_dp_mode(int64_t D, MathMode mode, Fn&& fn) {
  with_dp(D, [&](auto dp) { with_mode<decltype(dp)::value>(mode, fn); });
}
// Calls fn(std::integral_constant<int, DP>{}, std::bool_constant<flag>{}) for the runtime (D, flag).
template <typename Fn>
void with_dp_flag(int64_t D, bool flag, Fn&& fn) {
  with_dp(D, [&](auto dp) {
    if (flag)
      fn(dp, std::true_type{});
    else
      fn(dp, std::false_type{});
  });
}

// The sizes the frame-tiled kernels (phase A, phase C) take, as ints, and B·H·F (their
// grid's frame axis). Checks what their tiling relies on; op names the twin in the message.
struct FrameSizes {
  int H, D, F, S;
  int64_t BHF;
};
inline FrameSizes frame_sizes(const Dims& d, const char* op) {
  GDNCP_CHECK(supported_head_dim(d.D), op, ": D must be even in [", kMinHeadDim, ", ", kMaxHeadDim, "], got ", d.D);
  GDNCP_CHECK(d.B > 0 && d.H > 0 && d.F > 0 && d.S > 0, op, ": sizes must be positive");
  return FrameSizes{static_cast<int>(d.H), static_cast<int>(d.D), static_cast<int>(d.F), static_cast<int>(d.S),
                    d.BH() * d.F};
}

// --- tensors seen from a kernel ------------------------------------------------
// Note [tensor views]: a view is storage that is bf16 or f32, chosen at run time (the branch
// is uniform), read or written as f32. One helper, two read paths:
//   In       reads through the read-only global path (__ldg): explicit global loads also let
//            the compiler batch them ahead of shared-memory stores. The layer kernels use it.
//   InPlain  reads with plain loads. The CP kernels (cam.cu, fold.cu) use it: they were
//            measured with plain loads, and moving them to __ldg is a change of their code,
//            not of a helper's name.
// Both are valid only for data that no thread writes while the kernel runs.
template <bool kReadOnly>
struct InView {
  const void* p = nullptr;
  bool bf = false;
  __device__ __forceinline__ float operator[](int64_t i) const {
    if constexpr (kReadOnly)
      return bf ? __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(p) + i))
                : __ldg(static_cast<const float*>(p) + i);
    else
      return bf ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  // Elements i, i+1 (i even).
  __device__ __forceinline__ float2 pair(int64_t i) const {
    if constexpr (kReadOnly) {
      if (bf)
        return __bfloat1622float2(
            __ldg(reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(p) + i)));
      return __ldg(reinterpret_cast<const float2*>(static_cast<const float*>(p) + i));
    } else {
      if (bf)
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(p) + i));
      return *reinterpret_cast<const float2*>(static_cast<const float*>(p) + i);
    }
  }
};
using In = InView<true>;
using InPlain = InView<false>;

struct Out {
  void* p = nullptr;
  bool bf = false;
  __device__ __forceinline__ void set(int64_t i, float v) const {
    if (bf)
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(p)[i] = v;
  }
  __device__ __forceinline__ void set_pair(int64_t i, float a, float b) const {
    if (bf)
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p) + i) = __floats2bfloat162_rn(a, b);
    else
      *reinterpret_cast<float2*>(static_cast<float*>(p) + i) = make_float2(a, b);
  }
};

// Views and raw pointers of tensors, checked on the host; `what` names the argument in the
// message. Undefined inputs give a null view (null pointer): the kernels test for absent
// optional inputs; f32_out requires its tensor, f32_out_or_null does not.
inline void require_float_storage(const Tensor& t, const char* what) {
  GDNCP_CHECK(t.is_cuda(), "cuda kernel: ", what, " must be a CUDA tensor, got ", t.str());
  GDNCP_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, "cuda kernel: ", what,
              " must be f32 or bf16 on CUDA, got ", t.str());
}
inline void require_f32(const Tensor& t, const char* what) {
  GDNCP_CHECK(t.is_cuda() && t.dtype() == DType::f32, "cuda kernel: ", what, " must be an f32 CUDA tensor, got ",
              t.str());
}
template <typename View = In>
View in_of(const Tensor& t, const char* what) {
  if (!t.defined()) return View{};
  require_float_storage(t, what);
  return View{t.data(), t.dtype() == DType::bf16};
}
inline Out out_of(Tensor& t, const char* what) {
  require_float_storage(t, what);
  return Out{t.data(), t.dtype() == DType::bf16};
}
inline const float* f32_or_null(const Tensor& t, const char* what) {
  if (!t.defined()) return nullptr;
  require_f32(t, what);
  return static_cast<const float*>(t.data());
}
inline float* f32_out(Tensor& t, const char* what) {
  require_f32(t, what);
  return static_cast<float*>(t.data());
}
inline float* f32_out_or_null(Tensor& t, const char* what) { return t.defined() ? f32_out(t, what) : nullptr; }
inline const float* f32_in(const Tensor& t, const char* what) {  // a required f32 input
  require_f32(t, what);
  return static_cast<const float*>(t.data());
}
// 16-byte vector loads and stores (and 16-byte cp.async) need 16-byte aligned pointers.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
// 8-byte (float2) accesses need 8-byte aligned pointers.
inline bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

// Typed pointers and element conversions for the kernels templated on the storage type
// (GDNCP_CUDA_FLOAT_SWITCH); Tensor::data_ptr knows only the host bf16 type.
template <typename T>
T* ptr(Tensor& t) {
  return static_cast<T*>(t.data());
}
template <typename T>
const T* ptr(const Tensor& t) {
  return static_cast<const T*>(t.data());
}
__device__ __forceinline__ float load_f(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store_f(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

// Calls body with scalar_t = float or __nv_bfloat16 for dtype (f64 is rejected before any
// twin runs).
#define GDNCP_CUDA_FLOAT_SWITCH(dtype, op, ...)                                         \
  do {                                                                                  \
    if ((dtype) == ::gdncp::DType::f32) {                                               \
      using scalar_t = float;                                                           \
      __VA_ARGS__();                                                                    \
    } else if ((dtype) == ::gdncp::DType::bf16) {                                       \
      using scalar_t = __nv_bfloat16;                                                   \
      __VA_ARGS__();                                                                    \
    } else {                                                                            \
      GDNCP_FAIL(op, ": CUDA supports f32 and bf16, got ", ::gdncp::dtype_name(dtype)); \
    }                                                                                   \
  } while (0)

// --- the qkv layout (B, N, 3, H, D) and the token prep (docs/design.md §2) ---------------
__host__ __device__ __forceinline__ int64_t qkv_index(int64_t b, int64_t n, int c, int h, int d, int64_t N, int H,
                                                      int D) {
  return ((b * N + n) * 3 + c) * static_cast<int64_t>(H) * D + static_cast<int64_t>(h) * D + d;
}

// Channels d, d+1 (d even) of one q or k row: x̂ = x·r·w, x⁺ = relu(x̂)·scale, xʳ = rope(x⁺) with
// rope(x)[d] = x[d]·cos[d] + x[d^1]·sin[d].
__device__ __forceinline__ void prep_pair(float2 x, float r, float2 w, float scale, float2 c, float2 s, float2& plus,
                                          float2& rot) {
  const float h0 = x.x * r * w.x, h1 = x.y * r * w.y;
  plus.x = (h0 > 0.f ? h0 : 0.f) * scale;
  plus.y = (h1 > 0.f ? h1 : 0.f) * scale;
  rot.x = plus.x * c.x + plus.y * s.x;
  rot.y = plus.y * c.y + plus.x * s.y;
}
// Shared-memory pair, and read-only global pair.
__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 ldg2(const float* p) { return __ldg(reinterpret_cast<const float2*>(p)); }
__device__ __forceinline__ void st2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t pack_bf16_pair(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // lo in the low half
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float2 weight_pair(const float* w, int i) { return w ? ldg2(w + i) : make_float2(1.f, 1.f); }

// --- reductions -------------------------------------------------------------------
// Sum over each group of kLanes consecutive lanes (a power of two ≤ 32), every lane of the
// group gets it: halves, quarters, ... of the group are added (xor 16, 8, ... for a warp).
template <int kLanes = 32, typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Sum over the 4 lanes of a fragment row (thread t = lane % 4 of Note [warp tiles]), added
// as (t ^ 1) first, then (t ^ 2): the order the fragment epilogues were written in.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}
// Deterministic block sum (fixed tree) of one value per thread over THREADS threads; the
// result in thread 0. red holds THREADS values in shared memory.
template <int THREADS, typename T>
__device__ __forceinline__ T block_sum(T v, T* red) {
  red[threadIdx.x] = v;
  __syncthreads();
#pragma unroll
  for (int s = THREADS / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  return red[0];
}

// --- async copies -----------------------------------------------------------------
// Note [cp.async]: the copies, their commit and their waits all carry a "memory" clobber, so
// the compiler keeps ordinary shared-memory accesses on their side of each: a buffer is not
// read before the wait that lands it, nor read after a copy that overwrites it is issued.
// ok = false: the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(ok ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N committed groups of this thread are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Waits for every copy of this thread, committed or not.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// --- staged loads (Note [staged loads]) -------------------------------------------
// The bf16-mode frame kernels copy the raw rows of their next token chunk (k/q and v in
// bf16, the RoPE rows in f32) into shared memory with cp.async while the matrix unit works
// on the current chunk, then prep them from shared memory in octets: 8 consecutive channels
// per thread, 16-byte accesses. (Loading through registers left the loads and the products
// in separate phases of every block: the kernels were latency-bound on global loads.)
// The staged path needs bf16 qkv and D % 8 == 0 (16-byte aligned rows); the kernels fall
// back to their per-pair loaders otherwise.
// A thread's share of staging a chunk of `rows` rows, D channels each (T bf16 or float, 16-byte
// copies), from a source whose rows lie `stride` elements apart into dst + r·D: its copy i is
// the 16-byte piece e = threadIdx.x + i·kThreadsT of the chunk, at row e / (D/kPer). Those
// offsets are the same for every chunk, so they are computed once: a division and a 64-bit
// row index per copy per chunk cost more issue slots than the copies themselves.
// kCopies ≥ ⌈rows·D/kPer / kThreadsT⌉; the host checks rows·stride < 2³¹.
template <int kThreadsT, typename T, int kCopies>
struct RowStager {
  static constexpr int kPer = 16 / sizeof(T);
  int off[kCopies];  // source offset of copy i from the chunk's first row (elements)
  int per_row, n;    // 16-byte pieces a row, a chunk

  __device__ __forceinline__ RowStager(int rows, int D, int stride) : per_row(D / kPer), n(rows * (D / kPer)) {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int e = threadIdx.x + i * kThreadsT, r = e / per_row;
      off[i] = r * stride + (e - r * per_row) * kPer;
    }
  }
  // Issues the copies of the chunk whose first row is src; rows at or beyond valid_rows are
  // zero-filled (and read nothing).
  __device__ __forceinline__ void issue(T* dst, const T* src, int valid_rows) const {
    const int valid = valid_rows * per_row;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int e = threadIdx.x + i * kThreadsT;
      if (e < n) cp_async16(dst + e * kPer, e < valid ? src + off[i] : src, e < valid);
    }
  }
};

// 8 channels from a staged row (16-byte shared loads).
__device__ __forceinline__ void ld8h(float (&x)[8], const __nv_bfloat16* p) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    x[2 * q] = f.x, x[2 * q + 1] = f.y;
  }
}
__device__ __forceinline__ void ld8f(float (&x)[8], const float* p) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
// Stores 8 values as bf16 (one 16-byte shared store; p 16-byte aligned).
__device__ __forceinline__ void st8h(__nv_bfloat16* p, const float (&x)[8]) {
  uint4 u;
  u.x = pack_bf16_pair(x[0], x[1]), u.y = pack_bf16_pair(x[2], x[3]), u.z = pack_bf16_pair(x[4], x[5]),
  u.w = pack_bf16_pair(x[6], x[7]);
  *reinterpret_cast<uint4*>(p) = u;
}
// The token prep of an octet of k or q channels (prep_pair on each pair).
__device__ __forceinline__ void prep_octet(const float (&x)[8], float r, const float (&w)[8], float scale,
                                           const float (&c)[8], const float (&s)[8], float (&plus)[8],
                                           float (&rot)[8]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float2 pl, ro;
    prep_pair(make_float2(x[2 * q], x[2 * q + 1]), r, make_float2(w[2 * q], w[2 * q + 1]), scale,
              make_float2(c[2 * q], c[2 * q + 1]), make_float2(s[2 * q], s[2 * q + 1]), pl, ro);
    plus[2 * q] = pl.x, plus[2 * q + 1] = pl.y, rot[2 * q] = ro.x, rot[2 * q + 1] = ro.y;
  }
}

// --- matrix fragments (Note [warp tiles]) --------------------------------------
struct OpMK {  // element (mn, k) at p[mn·ld + k]
  const float* p;
  int ld;
  __device__ __forceinline__ float at(int mn, int k) const { return p[mn * ld + k]; }
  __device__ __forceinline__ float2 pair(int mn, int k) const { return ld2(p + mn * ld + k); }
  __device__ __forceinline__ float4 quad(int mn, int k) const {  // k % 4 == 0
    return *reinterpret_cast<const float4*>(p + mn * ld + k);
  }
};
struct OpKM {  // element (mn, k) at p[k·ld + mn]
  const float* p;
  int ld;
  __device__ __forceinline__ float at(int mn, int k) const { return p[k * ld + mn]; }
  __device__ __forceinline__ float2 pair(int mn, int k) const {
    return make_float2(p[k * ld + mn], p[(k + 1) * ld + mn]);
  }
  __device__ __forceinline__ float4 quad(int mn, int k) const {
    return make_float4(p[k * ld + mn], p[(k + 1) * ld + mn], p[(k + 2) * ld + mn], p[(k + 3) * ld + mn]);
  }
};

// Row pitches (in floats) of a tile with `cols` columns (a multiple of 32), for the loads of
// warp_mma: OpMK 16-byte loads at g·ld + 4t (bf16) or 8-byte loads at g·ld + 2t (tf32);
// OpKM words at (4t + j)·ld + g (bf16) or (2t + j)·ld + g (tf32). All pitches are even.
constexpr int pitch_mk(int cols, MathMode m) { return cols + (m == MathMode::tf32 ? 8 : 16); }
constexpr int pitch_km(int cols, MathMode m) { return cols + (m == MathMode::bf16 ? 2 : 4); }

__device__ __forceinline__ uint32_t pack_bf16(float2 v) {
  __nv_bfloat162 h = __floats2bfloat162_rn(v.x, v.y);  // .x (lower k) in the low half
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t tf32_of(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
// 3xTF32: x = hi + lo, hi is x rounded to TF32 (half an ulp added, the 13 low bits cleared: two
// integer ops where cvt.rna.tf32 costs four), lo the exact rest, which the matrix unit truncates
// to TF32. hi·hi + hi·lo + lo·hi keeps f32 accuracy (the dropped terms are 2^-21 relative).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// acc[i][j] += A[m0+16i .., 0..K) · B[0..K), n0+8j ..] for one warp. Fragments whose first
// row (column) lies at or beyond mlim (nlim) are skipped: they hold padding only.
// K must be a multiple of 16; A and B must be zero in the padded part of K.
template <MathMode MODE, int TM, int TN, typename OA, typename OB>
__device__ __forceinline__ void warp_mma(float (&acc)[TM][TN][4], const OA& a, int m0, const OB& b, int n0, int K,
                                         int mlim, int nlim) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (MODE == MathMode::bf16) {
    for (int k = 0; k < K; k += 16) {
      uint32_t af[TM][4] = {}, bfr[TN][2] = {};
#pragma unroll
      for (int i = 0; i < TM; ++i)
        if (m0 + 16 * i < mlim) {
          const int m = m0 + 16 * i + g;
          const float4 lo = a.quad(m, k + 4 * t), hi = a.quad(m + 8, k + 4 * t);
          af[i][0] = pack_bf16(make_float2(lo.x, lo.y));  // slots 2t, 2t+1   (row g)
          af[i][1] = pack_bf16(make_float2(hi.x, hi.y));  //                  (row g+8)
          af[i][2] = pack_bf16(make_float2(lo.z, lo.w));  // slots 2t+8, 2t+9 (row g)
          af[i][3] = pack_bf16(make_float2(hi.z, hi.w));
        }
#pragma unroll
      for (int j = 0; j < TN; ++j)
        if (n0 + 8 * j < nlim) {
          const float4 q = b.quad(n0 + 8 * j + g, k + 4 * t);
          bfr[j][0] = pack_bf16(make_float2(q.x, q.y));
          bfr[j][1] = pack_bf16(make_float2(q.z, q.w));
        }
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j)
          if (m0 + 16 * i < mlim && n0 + 8 * j < nlim) mma_bf16(acc[i][j], af[i], bfr[j]);
    }
  } else if constexpr (MODE == MathMode::tf32) {
    for (int k = 0; k < K; k += 8) {
      uint32_t af[TM][4] = {}, bfr[TN][2] = {};
#pragma unroll
      for (int i = 0; i < TM; ++i)
        if (m0 + 16 * i < mlim) {
          const int m = m0 + 16 * i + g;
          const float2 lo = a.pair(m, k + 2 * t), hi = a.pair(m + 8, k + 2 * t);
          af[i][0] = tf32_of(lo.x);  // slot t   (row g)
          af[i][1] = tf32_of(hi.x);  //          (row g+8)
          af[i][2] = tf32_of(lo.y);  // slot t+4 (row g)
          af[i][3] = tf32_of(hi.y);
        }
#pragma unroll
      for (int j = 0; j < TN; ++j)
        if (n0 + 8 * j < nlim) {
          const float2 q = b.pair(n0 + 8 * j + g, k + 2 * t);
          bfr[j][0] = tf32_of(q.x);
          bfr[j][1] = tf32_of(q.y);
        }
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j)
          if (m0 + 16 * i < mlim && n0 + 8 * j < nlim) mma_tf32(acc[i][j], af[i], bfr[j]);
    }
  } else {
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
      float av[TM][2], bv[TN][2];
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        av[i][0] = a.at(m0 + 16 * i + g, k);
        av[i][1] = a.at(m0 + 16 * i + g + 8, k);
      }
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        bv[j][0] = b.at(n0 + 8 * j + 2 * t, k);
        bv[j][1] = b.at(n0 + 8 * j + 2 * t + 1, k);
      }
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          acc[i][j][0] = fmaf(av[i][0], bv[j][0], acc[i][j][0]);
          acc[i][j][1] = fmaf(av[i][0], bv[j][1], acc[i][j][1]);
          acc[i][j][2] = fmaf(av[i][1], bv[j][0], acc[i][j][2]);
          acc[i][j][3] = fmaf(av[i][1], bv[j][1], acc[i][j][3]);
        }
    }
  }
}

// --- bf16 tiles read with ldmatrix (bf16 mode) -----------------------------------
// Note [ldmatrix tiles]: in bf16 mode the kernels keep their operand tiles in shared
// memory as bf16 and build every fragment with one ldmatrix per 16×16 block (instead of
// scalar loads and per-fragment conversion, which made the f32-tile kernels issue-bound).
// The standard k map of mma.m16n8k16 is used (thread t: k = 2t, 2t+1, 2t+8, 2t+9), so these
// fragments must not be mixed with warp_mma's. An operand is seen as element (mn, k):
//   LdRow: stored [mn][k] (k contiguous)  -> ldmatrix
//   LdCol: stored [k][mn] (mn contiguous) -> ldmatrix.trans
// Rows must start 16-byte aligned; a pitch of cols + 8 elements (cols a multiple of 32)
// puts the 8 rows of each 8×8 block in distinct bank groups.
constexpr int pitch_ld(int cols) { return cols + 8; }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x2_t(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
}

struct LdRow {  // element (mn, k) at p[mn·ld + k]
  const __nv_bfloat16* p;
  int ld;
  // A fragment of rows m..m+15, k..k+15: lanes 0-15 address rows m+l at k, lanes 16-31 at k+8.
  __device__ __forceinline__ void a(uint32_t (&r)[4], int m, int k, int lane) const {
    ldsm_x4(r, p + (m + (lane & 15)) * ld + k + ((lane >> 4) << 3));
  }
  // B fragments of columns n..n+7 (r0) and n+8..n+15 (r1).
  __device__ __forceinline__ void b2(uint32_t (&r0)[2], uint32_t (&r1)[2], int n, int k, int lane) const {
    uint32_t q[4];
    ldsm_x4(q, p + (n + (lane & 7) + ((lane >> 4) << 3)) * ld + k + (((lane >> 3) & 1) << 3));
    r0[0] = q[0], r0[1] = q[1], r1[0] = q[2], r1[1] = q[3];
  }
  __device__ __forceinline__ void b1(uint32_t (&r0)[2], int n, int k, int lane) const {
    ldsm_x2(r0, p + (n + (lane & 7)) * ld + k + (((lane >> 3) & 1) << 3));
  }
};
struct LdCol {  // element (mn, k) at p[k·ld + mn]
  const __nv_bfloat16* p;
  int ld;
  __device__ __forceinline__ void a(uint32_t (&r)[4], int m, int k, int lane) const {
    ldsm_x4_t(r, p + (k + (lane & 7) + ((lane >> 4) << 3)) * ld + m + (((lane >> 3) & 1) << 3));
  }
  __device__ __forceinline__ void b2(uint32_t (&r0)[2], uint32_t (&r1)[2], int n, int k, int lane) const {
    uint32_t q[4];
    ldsm_x4_t(q, p + (k + (lane & 7) + (((lane >> 3) & 1) << 3)) * ld + n + ((lane >> 4) << 3));
    r0[0] = q[0], r0[1] = q[1], r1[0] = q[2], r1[1] = q[3];
  }
  __device__ __forceinline__ void b1(uint32_t (&r0)[2], int n, int k, int lane) const {
    ldsm_x2_t(r0, p + (k + (lane & 15)) * ld + n);
  }
};

// warp_mma for bf16 tiles (Note [ldmatrix tiles]): acc[i][j] += A[m0+16i.., 0..K) · B[0..K), n0+8j..].
// Same skipping rule and K contract as warp_mma. Fragments are loaded whole, so the tiles must
// extend to m0 + 16·TM rows and n0 + 8·TN columns (padding may hold anything finite or not:
// skipped fragments never reach the matrix unit).
template <int TM, int TN, typename OA, typename OB>
__device__ __forceinline__ void warp_mma_ld(float (&acc)[TM][TN][4], const OA& a, int m0, const OB& b, int n0, int K,
                                            int mlim, int nlim) {
  const int lane = threadIdx.x & 31;
  for (int k = 0; k < K; k += 16) {
    uint32_t af[TM][4] = {}, bfr[TN][2] = {};
#pragma unroll
    for (int i = 0; i < TM; ++i)
      if (m0 + 16 * i < mlim) a.a(af[i], m0 + 16 * i, k, lane);
#pragma unroll
    for (int j = 0; j + 1 < TN; j += 2)
      if (n0 + 8 * j < nlim) b.b2(bfr[j], bfr[j + 1], n0 + 8 * j, k, lane);
    if constexpr (TN % 2 == 1)
      if (n0 + 8 * (TN - 1) < nlim) b.b1(bfr[TN - 1], n0 + 8 * (TN - 1), k, lane);
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j)
        if (m0 + 16 * i < mlim && n0 + 8 * j < nlim) mma_bf16(acc[i][j], af[i], bfr[j]);
  }
}

// Stores a warp's accumulator tile (rows m0 + 16i + .., columns n0 + 8j + ..) into the
// row-major D×D matrix out, dropping the padding rows and columns.
template <int TM, int TN>
__device__ __forceinline__ void store_tile(float* out, const float (&acc)[TM][TN][4], int m0, int n0, int D) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int row = m0 + 16 * i + g, col = n0 + 8 * j + 2 * t;
      if (col >= D) continue;
      if (row < D) st2(out + row * D + col, acc[i][j][0], acc[i][j][1]);
      if (row + 8 < D) st2(out + (row + 8) * D + col, acc[i][j][2], acc[i][j][3]);
    }
}

// K rounded up to the mma step (16 covers bf16 and tf32).
__host__ __device__ __forceinline__ int round16(int k) { return (k + 15) / 16 * 16; }

}  // namespace detail
}  // namespace cuda
}  // namespace gdncp
