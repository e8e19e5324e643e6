// bench/gdncp_bench.cu — gdncp_bench: validate first, then time the fused
// single-GPU BiGDN layer (forward, forward+backward, each kernel phase) and set
// the times against ceilings measured in the same run (device-to-device copy
// bandwidth, cuBLAS bf16 GEMM rate) and against the floor of the work.
//
//   gdncp_bench [--json PATH] [--batches 1,4,8] [--dims 112,128] [--frames 11] [--tokens 920]
//               [--heads 20] [--warmup 5] [--iters 30] [--quick] [--cp [--emulate P [--profile-row K]]]
//               [--exchange auto|allgather|log|hierarchical] [--node-size 8] [--link none|nvlink|ib]
//               [--profile] [--validate-full]
// --profile runs one forward+backward of the first configuration and exits (to run under ncu).
// --validate-full adds the production shape against the f64 CPU layer (IEEE f32 bar 1e-6).
// --cp --emulate P: the CP benchmark on one GPU, each rank of P on stand-in peers (cp_bench.h);
// --profile-row K then runs only row K's steps between cudaProfilerStart/Stop (for ncu);
// --link nvlink|ib then models each collective's time on a communication stream (modeled_link.h).
// With --cp, --frames is the video's global frame count (default 22), any count: the ranks hold
// the balanced split (21 on 2 ranks = 11 + 10) and each rank's time is printed.
//
// Floor: max(bytes / copy bandwidth, flops / GEMM rate), where bytes count every
// input read once and every output written once (intermediates free) and flops
// count the matrix products of docs/design.md §3-5 and their backward.
// Exit code: 0 ok, 1 no GPU / bad flag, 2 validation failed.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "cp_bench.h"
#include "gdncp/gdncp.h"
#include "kernels/common/cuda_common.cuh"
#include "kernels/kernels.h"
#include "kernels/scan/scan_bidi.h"
#include "timing.h"

namespace {

using namespace gdncp;

// --- flags --------------------------------------------------------------------
struct Args {
  std::string json;
  std::vector<int64_t> batches = {1, 4, 8};
  std::vector<int64_t> head_dims = {112, 128};
  int64_t frames = 11, tokens = 920, heads = 20;
  int warmup = 5, iters = 30;
  bool cp = false;
  bool frames_given = false;          // --cp: --frames is the global count (else 2 x the default)
  int emulate = 0, profile_row = -1;  // --cp on one GPU with stand-in peers (cp_bench.h)
  // --cp: the composites' exchange and nodes; --emulate: the modeled links (modeled_link.h).
  std::string exchange = "auto", link = "none";
  int node_size = 8;
  bool deterministic = false;  // --cp: the deterministic mode
  bool overlap = false;        // --cp: the exchange on a communication stream (CpOptions::overlap_exchange)
  bool profile = false;        // one forward+backward of the first configuration, nothing else (for ncu)
  bool validate_full = false;  // also the production shape against the f64 CPU layer (slow: minutes of CPU)
};

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

void set_frames(Args& a, const std::string& v) {
  a.frames = std::stoll(v);
  a.frames_given = true;
}

bool parse_args(int argc, char** argv, Args& a) {
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("flag " + f + " needs a value");
      return argv[++i];
    };
    if (f == "--json")
      a.json = next();
    else if (f == "--batches")
      a.batches = parse_list(next());
    else if (f == "--dims")
      a.head_dims = parse_list(next());
    else if (f == "--frames")
      set_frames(a, next());
    else if (f == "--tokens")
      a.tokens = std::stoll(next());
    else if (f == "--heads")
      a.heads = std::stoll(next());
    else if (f == "--warmup")
      a.warmup = std::stoi(next());
    else if (f == "--iters")
      a.iters = std::stoi(next());
    else if (f == "--quick") {
      a.batches = {1, 4};
      a.head_dims = {112};
      a.iters = 20;
    } else if (f == "--cp")
      a.cp = true;
    else if (f == "--emulate")
      a.emulate = std::stoi(next());
    else if (f == "--profile-row")
      a.profile_row = std::stoi(next());
    else if (f == "--exchange")
      a.exchange = next();
    else if (f == "--link")
      a.link = next();
    else if (f == "--node-size")
      a.node_size = std::stoi(next());
    else if (f == "--deterministic")
      a.deterministic = true;
    else if (f == "--overlap")
      a.overlap = true;
    else if (f == "--profile")
      a.profile = true;
    else if (f == "--validate-full")
      a.validate_full = true;
    else if (f == "--help" || f == "-h") {
      std::printf(
          "gdncp_bench [--json PATH] [--batches 1,4,8] [--dims 112,128] [--frames 11] [--tokens 920]\n"
          "            [--heads 20] [--warmup 5] [--iters 30] [--quick] [--cp [--emulate P [--profile-row K]]]\n"
          "            [--exchange auto|allgather|log|hierarchical] [--node-size 8] [--link none|nvlink|ib]\n"
          "            [--deterministic] [--overlap] [--profile] [--validate-full]\n"
          "  --cp --emulate P       one GPU times each rank of P on stand-in peers (P up to 256: above 8,\n"
          "                         ranks 0, 1, P/2, P-1)\n"
          "  --exchange X           the CP composites' exchange (gdncp/cp.h Exchange)\n"
          "  --node-size N          ranks per node for the exchange and the link model\n"
          "  --link L               with --emulate, modeled links: each collective occupies a communication\n"
          "                         stream for alpha + bytes/beta of each round of the exchange; nvlink: one\n"
          "                         NVLink domain (8 us, 365 GB/s), ib: NVLink inside nodes, NDR InfiniBand\n"
          "                         between them (20 us, 45 GB/s); none: collectives are device copies\n"
          "  --deterministic        with --cp, the CP rows in the deterministic mode (docs/design.md §12)\n"
          "  --overlap              with --cp, the all-gather on a communication stream behind the sweeps\n"
          "                         it does not read (CpOptions::overlap_exchange)\n");
      std::exit(0);
    } else {
      std::fprintf(stderr, "gdncp_bench: unknown flag %s (try --help)\n", f.c_str());
      return false;
    }
  }
  return (a.iters >= 20 || a.profile_row >= 0) && a.warmup >= 1;
}

// --- timing -------------------------------------------------------------------
using gdncp::cuda::detail::stream;

// Fast device-side random fill for timing inputs (Tensor::randn draws on the host, which takes
// seconds for the largest configurations): about N(0, 1) from a hash of (seed, i) — random
// data, never zeros, so timings see real values.
__global__ void fill_random_kernel(void* p, bool bf, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) * 0xBF58476D1CE4E5B9ull;
    float sum = 0.f;
    for (int k = 0; k < 4; ++k) {  // Irwin–Hall: 4 uniforms, mean 2, variance 1/3
      z ^= z >> 31;
      z *= 0x94D049BB133111EBull;
      z ^= z >> 29;
      sum += static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
    }
    const float v = (sum - 2.f) * 1.7320508f;
    if (bf)
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(p)[i] = v;
  }
}

Tensor device_random(const Shape& shape, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda);
  fill_random_kernel<<<1024, 256, 0, stream()>>>(t.data(), dtype == DType::bf16, t.numel(), seed);
  GDNCP_CUDA_CHECK_LAUNCH("fill_random_kernel");
  return t;
}

using bench::time_ms;

// --- ceilings -----------------------------------------------------------------
struct Ceilings {
  double copy_gbs = 0;     // device-to-device copy, bytes read + written per second / 1e9
  double gemm_tflops = 0;  // cuBLAS bf16 GEMM (f32 accumulation), 8192³
};

Ceilings measure_ceilings(int iters) {
  Ceilings c;
  const int64_t n = int64_t(1) << 28;  // 1 GiB of f32
  Tensor src = device_random({n}, DType::f32, 7), dst = Tensor::empty({n}, DType::f32, Device::cuda);
  const double ms = time_ms(
      [&] {
        GDNCP_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, stream()));
      },
      3, iters);
  c.copy_gbs = 2.0 * static_cast<double>(src.nbytes()) / (ms * 1e-3) / 1e9;
  src = Tensor();
  dst = Tensor();

  const int m = 8192;
  Tensor A = device_random({m, m}, DType::bf16, 8), B = device_random({m, m}, DType::bf16, 9);
  Tensor C = Tensor::empty({m, m}, DType::bf16, Device::cuda);
  cublasHandle_t h;
  GDNCP_CUBLAS_CHECK(cublasCreate(&h));
  GDNCP_CUBLAS_CHECK(cublasSetStream(h, stream()));
  const float one = 1.f, zero = 0.f;
  const double gms = time_ms(
      [&] {
        GDNCP_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &one, A.data(), CUDA_R_16BF, m, B.data(),
                                        CUDA_R_16BF, m, &zero, C.data(), CUDA_R_16BF, m, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
      },
      3, iters);
  GDNCP_CUBLAS_CHECK(cublasDestroy(h));
  c.gemm_tflops = 2.0 * m * double(m) * m / (gms * 1e-3) / 1e12;
  return c;
}

// --- the layer's inputs ---------------------------------------------------------
struct Inputs {
  Dims d;
  Tensor qkv, beta, decay, qw, kw, cs, sn, dout;
  BigdnOptions opt;
};

Inputs make_inputs(const Dims& d, DType dtype, Device dev, uint64_t seed) {
  Inputs in;
  in.d = d;
  const DType table = dtype == DType::f64 ? DType::f64 : DType::f32;
  in.qkv = Tensor::randn({d.B, d.N(), 3, d.H, d.D}, dtype, dev, seed + 1);
  in.beta = Tensor::uniform({d.B, d.H, d.F, d.S}, dtype == DType::f64 ? dtype : DType::f32, dev, seed + 2, 0.1, 0.9);
  in.decay = Tensor::uniform({d.B, d.H, d.F}, dtype == DType::f64 ? dtype : DType::f32, dev, seed + 3, 0.5, 0.99);
  in.qw = Tensor::uniform({d.C()}, table, dev, seed + 4, 0.5, 1.5);
  in.kw = Tensor::uniform({d.C()}, table, dev, seed + 5, 0.5, 1.5);
  auto rope = rope_tables(d.N(), d.D, table, dev);
  in.cs = rope.first;
  in.sn = rope.second;
  in.dout = Tensor::randn({d.B, d.N(), d.H, d.D}, dtype, dev, seed + 6);
  in.opt.k_scale = 1.0 / std::sqrt(static_cast<double>(d.D * d.S));  // D^-½·S^-½
  return in;
}

Inputs convert(const Inputs& in, DType dtype, Device dev) {
  Inputs o = in;
  const DType table = dtype == DType::f64 ? DType::f64 : DType::f32;
  const DType gate = dtype == DType::f64 ? DType::f64 : DType::f32;
  o.qkv = in.qkv.to(dev).to(dtype);
  o.beta = in.beta.to(dev).to(gate);
  o.decay = in.decay.to(dev).to(gate);
  o.qw = in.qw.to(dev).to(table);
  o.kw = in.kw.to(dev).to(table);
  o.cs = in.cs.to(dev).to(table);
  o.sn = in.sn.to(dev).to(table);
  o.dout = in.dout.to(dev).to(dtype);
  return o;
}

struct Result {
  Tensor out, dqkv, dbeta, ddecay, dqw, dkw;
};

// One forward + backward through autograd with fresh leaves.
Result fwd_bwd(const Inputs& in) {
  Tensor qkv = in.qkv.detach(), beta = in.beta.detach(), decay = in.decay.detach(), qw = in.qw.detach(),
         kw = in.kw.detach();
  for (Tensor* t : {&qkv, &beta, &decay, &qw, &kw}) t->requires_grad_();
  Result r;
  const Tensor out = bigdn(qkv, beta, decay, qw, kw, in.cs, in.sn, in.d.F, in.d.S, in.opt);
  backward(out, in.dout);
  r.out = out.detach();
  r.dqkv = qkv.grad();
  r.dbeta = beta.grad();
  r.ddecay = decay.grad();
  r.dqw = qw.grad();
  r.dkw = kw.grad();
  return r;
}

double rel_l2(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  const double r = std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
  return std::isfinite(r) ? r : 1e300;
}

double worst(const Result& a, const Result& b, std::string& report) {
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> items[] = {
      {"out", {&a.out, &b.out}},          {"dqkv", {&a.dqkv, &b.dqkv}},    {"dbeta", {&a.dbeta, &b.dbeta}},
      {"ddecay", {&a.ddecay, &b.ddecay}}, {"dq_norm_w", {&a.dqw, &b.dqw}}, {"dk_norm_w", {&a.dkw, &b.dkw}}};
  double w = 0;
  std::ostringstream os;
  for (const auto& it : items) {
    const double e = rel_l2(*it.second.first, *it.second.second);
    os << " " << it.first << " " << e;
    w = std::max(w, e);
  }
  report = os.str();
  return w;
}

// Validation before timing: (a) a small shape against the f64 CPU layer (bf16 and IEEE modes),
// (b) the production shape, GPU IEEE f32 against GPU bf16; with --validate-full (c) the production
// shape against the f64 CPU layer.
bool validate(const Args& a, std::ostringstream& js) {
  bool ok = true;
  std::string rep;
  const Dims ds = Dims{1, 2, 112, 3, 70};
  const Inputs base = make_inputs(ds, DType::f32, Device::cpu, 11);
  const Result ref = fwd_bwd(convert(base, DType::f64, Device::cpu));
  Inputs ieee = convert(base, DType::f32, Device::cuda);
  ieee.opt.precision = Precision::ieee;
  const double e_ieee = worst(fwd_bwd(ieee), ref, rep);
  std::printf("validate small (B=1 H=2 D=112 F=3 S=70) ieee f32 vs CPU f64: worst rel L2 %.3g (bar 1e-5):%s\n", e_ieee,
              rep.c_str());
  ok = ok && e_ieee <= 1e-5;
  const Inputs bfb = convert(base, DType::bf16, Device::cpu);
  const Result ref_b = fwd_bwd(convert(bfb, DType::f64, Device::cpu));
  const double e_bf = worst(fwd_bwd(convert(bfb, DType::bf16, Device::cuda)), ref_b, rep);
  std::printf("validate small bf16 vs CPU f64: worst rel L2 %.3g (bar 1e-2):%s\n", e_bf, rep.c_str());
  ok = ok && e_bf <= 1e-2;

  const Dims db = Dims{1, a.heads, 112, a.frames, a.tokens};
  const Inputs big = make_inputs(db, DType::bf16, Device::cuda, 12);
  Inputs big32 = convert(big, DType::f32, Device::cuda);
  big32.opt.precision = Precision::ieee;
  const double e_big = worst(fwd_bwd(big), fwd_bwd(big32), rep);
  std::printf(
      "validate production shape (B=1 H=%lld D=112 F=%lld S=%lld) GPU bf16 vs GPU ieee f32: worst rel L2 %.3g "
      "(bar 1e-2):%s\n",
      static_cast<long long>(a.heads), static_cast<long long>(a.frames), static_cast<long long>(a.tokens), e_big,
      rep.c_str());
  ok = ok && e_big <= 1e-2;
  js << "\"validation\": {\"small_ieee_vs_f64\": " << e_ieee << ", \"small_bf16_vs_f64\": " << e_bf
     << ", \"big_bf16_vs_ieee\": " << e_big;
  if (a.validate_full) {
    // (c) The production shape against the f64 CPU layer. The inputs are bf16 values, so the f32
    // and f64 copies hold the same numbers and one f64 run serves both modes.
    const Result ref_big = fwd_bwd(convert(big, DType::f64, Device::cpu));
    const double e_full_ieee = worst(fwd_bwd(big32), ref_big, rep);
    std::printf("validate production shape ieee f32 vs CPU f64: worst rel L2 %.3g (bar 1e-6):%s\n", e_full_ieee,
                rep.c_str());
    const double e_full_bf = worst(fwd_bwd(big), ref_big, rep);
    std::printf("validate production shape bf16 vs CPU f64: worst rel L2 %.3g (bar 1e-2):%s\n", e_full_bf, rep.c_str());
    ok = ok && e_full_ieee <= 1e-6 && e_full_bf <= 1e-2;
    js << ", \"full_ieee_vs_f64\": " << e_full_ieee << ", \"full_bf16_vs_f64\": " << e_full_bf;
  }
  js << ", \"ok\": " << (ok ? "true" : "false") << "},\n";
  return ok;
}

// --- work counts ----------------------------------------------------------------
struct Work {
  double bytes = 0, flops = 0;
};

// Phase-by-phase compulsory traffic (each input read once, each output written once) and matrix flops.
struct PhaseWork {
  Work rms, a_fwd, scan_fwd, c_fwd, c_bwd, scan_bwd, a_bwd, rms_bwd, fwd, fwd_bwd;
};

PhaseWork count_work(const Dims& d, size_t e /* qkv element bytes */, size_t eh /* dq̂, dk̂ element bytes */) {
  const double B = double(d.B), N = double(d.N()), H = double(d.H), D = double(d.D), F = double(d.F);
  const double BH = B * H, C = H * D, tok = B * N, mat = BH * F * D * D * 4, vec = BH * F * D * 4;
  const double chan = tok * C * e, hat = tok * C * eh, rope = 2 * N * D * 4, gate = B * H * N * 4;
  const double gemm_tok = 2 * BH * N * D * D, gemm_state = 2 * BH * F * D * D * D;
  PhaseWork w;
  w.rms = {2 * chan + tok * 8, 0};
  w.a_fwd = {2 * chan + gate + rope + tok * 8 + 3 * mat + vec, 3 * gemm_tok};
  w.scan_fwd = {3 * mat + vec + 3 * mat + 3 * vec, 2 * gemm_state};
  w.c_fwd = {chan + rope + tok * 8 + mat + vec + chan + gate, gemm_tok};
  w.c_bwd = {2 * chan + rope + tok * 8 + mat + vec + hat + mat + vec, 2 * gemm_tok};
  w.scan_bwd = {5 * mat + 4 * vec + 4 * mat + vec + BH * F * 4, 2 * gemm_state + 2 * gemm_state};
  w.a_bwd = {3 * mat + vec + 2 * chan + rope + gate + tok * 8 + hat + chan + gate, 4 * gemm_tok};
  w.rms_bwd = {2 * hat + 2 * chan + tok * 8 + 2 * chan + 2 * C * 4, 0};
  // The layer: inputs once, outputs once.
  const double in_fwd = 3 * chan + gate + BH * F * 4 + 2 * C * 4 + rope, out_fwd = chan;
  w.fwd = {in_fwd + out_fwd, w.a_fwd.flops + w.scan_fwd.flops + w.c_fwd.flops};
  w.fwd_bwd = {in_fwd + out_fwd + in_fwd + chan /*dout*/ + 3 * chan + gate + BH * F * 4 + 2 * C * 4,
               w.fwd.flops + w.c_bwd.flops + w.scan_bwd.flops + w.a_bwd.flops};
  return w;
}

struct Row {
  std::string name;
  double ms = 0;
  Work w;
};

double floor_ms(const Work& w, const Ceilings& c) {
  return std::max(w.bytes / (c.copy_gbs * 1e9), w.flops / (c.gemm_tflops * 1e12)) * 1e3;
}

// --- one configuration ------------------------------------------------------------
void bench_config(const Args& a, const Ceilings& c, int64_t B, int64_t D, std::ostringstream& js, bool first) {
  const Dims d = Dims{B, a.heads, D, a.frames, a.tokens};
  const uint64_t seed = 100 + static_cast<uint64_t>(B * 1000 + D);
  Inputs in = make_inputs(Dims{1, a.heads, D, 1, 1}, DType::bf16, Device::cuda, seed);  // tables, weights
  in.d = d;
  in.qkv = device_random({d.B, d.N(), 3, d.H, d.D}, DType::bf16, seed + 1);
  in.dout = device_random({d.B, d.N(), d.H, d.D}, DType::bf16, seed + 6);
  in.beta = Tensor::uniform({d.B, d.H, d.F, d.S}, DType::f32, Device::cuda, seed + 2, 0.1, 0.9);
  in.decay = Tensor::uniform({d.B, d.H, d.F}, DType::f32, Device::cuda, seed + 3, 0.5, 0.99);
  in.qw = Tensor::uniform({d.C()}, DType::f32, Device::cuda, seed + 4, 0.5, 1.5);
  in.kw = Tensor::uniform({d.C()}, DType::f32, Device::cuda, seed + 5, 0.5, 1.5);
  auto rope = rope_tables(d.N(), d.D, DType::f32, Device::cuda);
  in.cs = rope.first;
  in.sn = rope.second;
  in.opt.k_scale = 1.0 / std::sqrt(static_cast<double>(d.D * d.S));
  const MathMode mode = resolve_math_mode(in.opt.precision, DType::bf16);
  const DType hat = grad_hat_dtype(mode, DType::bf16);  // dq̂, dk̂ as the layer stores them
  const PhaseWork w = count_work(d, 2, dtype_size(hat));
  std::vector<Row> rows;

  // Leaves that require grad, as in training.
  Tensor qkv = in.qkv.detach(), beta = in.beta.detach(), decay = in.decay.detach(), qw = in.qw.detach(),
         kw = in.kw.detach();
  for (Tensor* t : {&qkv, &beta, &decay, &qw, &kw}) t->requires_grad_();
  const auto zero_grads = [&] {
    for (Tensor* t : {&qkv, &beta, &decay, &qw, &kw}) t->zero_grad();
  };

  // Peak device memory of one forward+backward above the inputs (and dout).
  synchronize();
  zero_grads();
  reset_peak_memory();
  const size_t base = cuda_memory_stats().allocated;
  {
    Tensor out = bigdn(qkv, beta, decay, qw, kw, in.cs, in.sn, d.F, d.S, in.opt);
    backward(out, in.dout);
  }
  synchronize();
  const double peak_gib = static_cast<double>(cuda_memory_stats().peak_allocated - base) / double(1 << 30);
  zero_grads();

  rows.push_back({"forward",
                  time_ms(
                      [&] {
                        Tensor out = bigdn(qkv, beta, decay, qw, kw, in.cs, in.sn, d.F, d.S, in.opt);
                        autograd::clear_tape();
                      },
                      a.warmup, a.iters),
                  w.fwd});
  rows.push_back({"forward+backward",
                  time_ms(
                      [&] {
                        Tensor out = bigdn(qkv, beta, decay, qw, kw, in.cs, in.sn, d.F, d.S, in.opt);
                        backward(out, in.dout);
                        zero_grads();
                      },
                      a.warmup, a.iters),
                  w.fwd_bwd});

  // Each phase alone, on the intermediates of one real pass.
  const Device dev = Device::cuda;
  const DType f32 = DType::f32;
  const int64_t BH = d.BH(), N = d.N();
  const Shape mat = {BH, d.F, D, D}, vec = {BH, d.F, D}, tok = {d.B, N, d.H, D};
  Tensor rstd = Tensor::empty({d.B, N, 2}, f32, dev);
  Tensor P = Tensor::empty(mat, f32, dev), A = Tensor::empty(mat, f32, dev), Pz = Tensor::empty(mat, f32, dev),
         bz = Tensor::empty(vec, f32, dev);
  Tensor Mf = Tensor::empty(mat, f32, dev), Mr = Tensor::empty(mat, f32, dev), Ms = Tensor::empty(mat, f32, dev);
  Tensor zf = Tensor::empty(vec, f32, dev), zr = Tensor::empty(vec, f32, dev), zs = Tensor::empty(vec, f32, dev);
  Tensor out = Tensor::empty(tok, DType::bf16, dev), den = Tensor::empty({d.B, d.H, N}, f32, dev);
  Tensor dq = Tensor::empty(tok, hat, dev), dk = Tensor::empty(tok, hat, dev);
  Tensor dMs = Tensor::empty(mat, f32, dev), dzs = Tensor::empty(vec, f32, dev);
  Tensor dP = Tensor::empty(mat, f32, dev), dA = Tensor::empty(mat, f32, dev), dPz = Tensor::empty(mat, f32, dev),
         dbz = Tensor::empty(vec, f32, dev);
  Tensor ddecay = Tensor::empty(in.decay.shape(), in.decay.dtype(), dev);
  Tensor dqkv = Tensor::empty(in.qkv.shape(), in.qkv.dtype(), dev),
         dbeta = Tensor::empty(in.beta.shape(), in.beta.dtype(), dev);
  Tensor dqw = Tensor::empty({d.C()}, f32, dev), dkw = Tensor::empty({d.C()}, f32, dev);
  const auto& o = in.opt;
  const std::function<void()> phases[] = {
      [&] { kernels::rms_stats(rstd, in.qkv, in.qw, in.kw, d, o.norm_eps); },
      [&] { kernels::phase_a_fwd(P, A, Pz, bz, in.qkv, rstd, in.kw, in.cs, in.sn, in.beta, d, o.k_scale, mode); },
      [&] { kernels::scan_bidi_fwd(Mf, Mr, Ms, zf, zr, zs, P, A, Pz, bz, in.decay, Tensor(), d); },
      [&] { kernels::phase_c_fwd(out, den, in.qkv, rstd, in.qw, in.cs, in.sn, Ms, zs, d, o.eps, true, mode); },
      [&] {
        kernels::phase_c_bwd(dq, dMs, dzs, in.dout, Tensor(), in.qkv, rstd, in.qw, in.cs, in.sn, Ms, zs, d, o.eps, true,
                             mode);
      },
      [&] { kernels::scan_bidi_bwd(dP, dA, dPz, dbz, ddecay, dMs, dzs, P, Pz, in.decay, Mf, Mr, zf, zr, Tensor(), d); },
      [&] {
        kernels::phase_a_bwd(dk, dqkv, dbeta, dP, dA, dPz, dbz, in.qkv, rstd, in.kw, in.cs, in.sn, in.beta, d,
                             o.k_scale, mode);
      },
      [&] { kernels::rms_norm_bwd(dqkv, dqw, dkw, dq, dk, in.qkv, rstd, in.qw, in.kw, d); },
      // The same scan called as the scan core's composition (kernels/scan_bidi_sweeps.h) without the layer's shape
      // checks: the layer's scan_bidi is this composition; last, like before.
      [&] { scan_core::scan_bidi_fwd(Mf, Mr, Ms, zf, zr, zs, P, A, Pz, bz, in.decay, Tensor(), d); },
      [&] {
        scan_core::scan_bidi_bwd(dP, dA, dPz, dbz, ddecay, dMs, dzs, P, Pz, in.decay, Mf, Mr, zf, zr, Tensor(), d);
      }};
  const char* names[] = {"rms_stats",     "phase_a_fwd", "scan_bidi_fwd", "phase_c_fwd",     "phase_c_bwd",
                         "scan_bidi_bwd", "phase_a_bwd", "rms_norm_bwd",  "scan_sweeps_fwd", "scan_sweeps_bwd"};
  const Work works[] = {w.rms,      w.a_fwd, w.scan_fwd, w.c_fwd,    w.c_bwd,
                        w.scan_bwd, w.a_bwd, w.rms_bwd,  w.scan_fwd, w.scan_bwd};
  constexpr int kPhases = sizeof(names) / sizeof(names[0]);
  static_assert(kPhases == sizeof(phases) / sizeof(phases[0]) && kPhases == sizeof(works) / sizeof(works[0]),
                "one name and one work estimate per phase");
  for (int i = 0; i < kPhases - 2; ++i) phases[i]();  // real intermediates for every phase
  for (int i = 0; i < kPhases; ++i) rows.push_back({names[i], time_ms(phases[i], a.warmup, a.iters), works[i]});

  std::printf("\nB=%lld F=%lld S=%lld H=%lld D=%lld bf16, k_scale=D^-1/2 S^-1/2   peak memory above inputs: %.3f GiB\n",
              static_cast<long long>(B), static_cast<long long>(d.F), static_cast<long long>(d.S),
              static_cast<long long>(d.H), static_cast<long long>(D), peak_gib);
  std::printf("  %-17s %9s %9s %8s %8s %9s %8s\n", "what", "ms", "floor ms", "x floor", "GB/s", "TFLOP/s", "MB");
  if (!first) js << ",\n";
  js << "    {\"B\": " << B << ", \"F\": " << d.F << ", \"S\": " << d.S << ", \"H\": " << d.H << ", \"D\": " << D
     << ", \"dtype\": \"bf16\", \"peak_gib_above_inputs\": " << peak_gib << ", \"rows\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double fl = floor_ms(r.w, c), gbs = r.w.bytes / (r.ms * 1e-3) / 1e9, tf = r.w.flops / (r.ms * 1e-3) / 1e12;
    std::printf("  %-17s %9.4f %9.4f %8.1f %8.0f %9.1f %8.1f\n", r.name.c_str(), r.ms, fl, r.ms / fl, gbs, tf,
                r.w.bytes / 1e6);
    js << (i ? ", " : "") << "{\"name\": \"" << r.name << "\", \"ms\": " << r.ms << ", \"floor_ms\": " << fl
       << ", \"bytes\": " << r.w.bytes << ", \"flops\": " << r.w.flops << ", \"gbs\": " << gbs << ", \"tflops\": " << tf
       << "}";
  }
  js << "]}";
}

// --cp: the bidirectional CP layer under mpirun (bench/cp_bench.cpp): strong
// scaling over the global --frames (balanced split over the ranks), weak
// scaling at the largest rank's share per rank.
int run_cp(const Args& a) {
  bench::CpBenchConfig c;
  c.batch = a.batches.at(0);
  c.tokens = a.tokens;
  c.heads = a.heads;
  c.head_dim = a.head_dims.at(0);
  c.global_frames = a.frames_given ? a.frames : 2 * a.frames;
  c.frames_per_rank = 0;  // the largest share of the split
  c.warmup = a.warmup;
  c.iters = a.iters;
  c.json = a.json;
  c.emulate = a.emulate;
  c.profile_row = a.profile_row;
  const std::vector<std::pair<std::string, cp::Exchange>> xs = {{"auto", cp::Exchange::automatic},
                                                                {"allgather", cp::Exchange::all_gather},
                                                                {"log", cp::Exchange::log},
                                                                {"hierarchical", cp::Exchange::hierarchical}};
  const auto x = std::find_if(xs.begin(), xs.end(), [&](const auto& p) { return p.first == a.exchange; });
  if (x == xs.end() || a.node_size < 1 || (a.link != "none" && a.link != "nvlink" && a.link != "ib")) {
    std::fprintf(stderr, "gdncp_bench: bad --exchange %s, --node-size %d or --link %s (try --help)\n",
                 a.exchange.c_str(), a.node_size, a.link.c_str());
    return 1;
  }
  c.exchange = x->second;
  c.node_size = a.node_size;
  c.deterministic = a.deterministic;
  c.overlap = a.overlap;
  c.link = a.link;
  return bench::run_cp_bench(c);
}

int run(const Args& a) {
  if (!cuda_available()) {
    std::fprintf(stderr, "gdncp_bench: no CUDA device visible\n");
    return 1;
  }
  if (a.cp) return run_cp(a);
  if (a.profile) {
    const Inputs in = make_inputs(Dims{a.batches.at(0), a.heads, a.head_dims.at(0), a.frames, a.tokens}, DType::bf16,
                                  Device::cuda, 5);
    fwd_bwd(in);
    synchronize();
    std::printf("gdncp_bench --profile: ran one forward+backward\n");
    return 0;
  }
  int dev = 0;
  cudaDeviceProp prop;
  GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
  GDNCP_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("gdncp_bench on %s (%d SMs, %.0f MiB)\n", prop.name, prop.multiProcessorCount,
              static_cast<double>(prop.totalGlobalMem) / (1 << 20));
  std::ostringstream js;
  js.precision(6);
  js << "{\n\"device\": \"" << prop.name << "\",\n";
  if (!validate(a, js)) {
    std::printf("VALIDATION FAILED: not timing\n");
    if (!a.json.empty()) {
      js << "\"configs\": []\n}\n";
      std::ofstream(a.json) << js.str();
    }
    return 2;
  }
  const Ceilings c = measure_ceilings(a.iters);
  std::printf("ceilings measured here: device copy %.0f GB/s (read+write), cuBLAS bf16 GEMM %.0f TFLOP/s\n", c.copy_gbs,
              c.gemm_tflops);
  js << "\"ceilings\": {\"copy_gbs\": " << c.copy_gbs << ", \"gemm_bf16_tflops\": " << c.gemm_tflops << "},\n";
  js << "\"timing\": \"CUDA events, " << a.warmup << " warm-up, median of " << a.iters << "\",\n\"configs\": [\n";
  bool first = true;
  for (int64_t D : a.head_dims)
    for (int64_t B : a.batches) {
      bench_config(a, c, B, D, js, first);
      first = false;
    }
  js << "\n]\n}\n";
  if (!a.json.empty()) {
    std::ofstream f(a.json);
    f << js.str();
    std::printf("\nwrote %s\n", a.json.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    if (!parse_args(argc, argv, a)) {
      std::fprintf(stderr, "gdncp_bench: bad flags (iters must be >= 20, warmup >= 1)\n");
      return 1;
    }
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gdncp_bench: %s\n", e.what());
    return 1;
  }
}
