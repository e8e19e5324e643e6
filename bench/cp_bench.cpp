// bench/cp_bench.cpp — the context-parallel benchmark (see cp_bench.h).
//
// Hooked into gdncp_bench --cp; built standalone (its own main) with
// -DGDNCP_CP_BENCH_MAIN. One rank per GPU under mpirun.
#include "cp_bench.h"

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gdncp/cp.h"
#include "gdncp/error.h"
#include "gdncp/gdncp.h"
#include "loopback_comm.h"
#include "modeled_link.h"
#include "timing.h"

namespace gdncp {
namespace bench {
namespace {

cudaStream_t stream() { return static_cast<cudaStream_t>(current_stream()); }

struct Layer {  // inputs of one rank (leaves) and the output gradient
  Tensor qkv, beta, decay, qw, kw, cos, sin, gout;
  int64_t F = 0, S = 0;
  cp::CpOptions cpo;  // the exchange of the CP calls
};

// Rows [lo, hi) of axis `axis` of a CUDA tensor (a strided device copy; empty when lo == hi).
Tensor slice_rows(const Tensor& t, int axis, int64_t lo, int64_t hi) {
  const Shape& s = t.shape();
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= s[static_cast<size_t>(i)];
  for (size_t i = static_cast<size_t>(axis) + 1; i < s.size(); ++i) inner *= s[i];
  Shape shape = s;
  shape[static_cast<size_t>(axis)] = hi - lo;
  Tensor out = Tensor::empty(shape, t.dtype(), t.device());
  if (hi == lo) return out;
  const size_t es = dtype_size(t.dtype());
  const size_t row = static_cast<size_t>(s[static_cast<size_t>(axis)] * inner) * es;
  const size_t width = static_cast<size_t>((hi - lo) * inner) * es;
  GDNCP_CUDA_CHECK(cudaMemcpy2DAsync(out.data(), width, static_cast<const char*>(t.data()) + lo * inner * es, row,
                                     width, static_cast<size_t>(outer), cudaMemcpyDeviceToDevice, stream()));
  return out;
}

Tensor leaf(Tensor t) {
  t.requires_grad_(true);
  return t;
}

// The global inputs of Fg frames (seeded: every rank makes the same), and the F frames from F0 on.
Layer make_layer(const CpBenchConfig& c, int64_t Fg, int64_t F0, int64_t F, DType dt, uint64_t seed) {
  const int64_t B = c.batch, H = c.heads, D = c.head_dim, S = c.tokens, Ng = Fg * S, N = F * S, N0 = F0 * S, C = H * D;
  const Device cu = Device::cuda;
  Layer g;
  g.qkv = Tensor::randn({B, Ng, 3, H, D}, dt, cu, seed + 1);
  g.beta = Tensor::uniform({B, H, Fg, S}, dt, cu, seed + 2, 0.1, 0.9);
  g.decay = Tensor::uniform({B, H, Fg}, dt, cu, seed + 3, 0.5, 0.99);
  g.qw = Tensor::uniform({C}, DType::f32, cu, seed + 4, 0.5, 1.5);
  g.kw = Tensor::uniform({C}, DType::f32, cu, seed + 5, 0.5, 1.5);
  auto rope = rope_tables(Ng, D, DType::f32, cu);
  Layer l;
  l.F = F;
  l.S = S;
  l.cpo.exchange = c.exchange;
  l.cpo.node_size = c.node_size;
  l.cpo.deterministic = c.deterministic;
  l.cpo.overlap_exchange = c.overlap;
  l.qkv = leaf(slice_rows(g.qkv, 1, N0, N0 + N));
  l.beta = leaf(slice_rows(g.beta, 2, F0, F0 + F));
  l.decay = leaf(slice_rows(g.decay, 2, F0, F0 + F));
  l.qw = leaf(g.qw);
  l.kw = leaf(g.kw);
  l.cos = slice_rows(rope.first, 0, N0, N0 + N);
  l.sin = slice_rows(rope.second, 0, N0, N0 + N);
  l.gout = Tensor::randn({B, N, H, D}, dt, cu, seed + 6);
  return l;
}

BigdnOptions options(const CpBenchConfig& c, Checkpoint ck) {
  BigdnOptions o;
  o.k_scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim * c.tokens));
  o.precision = Precision::bf16;
  o.checkpoint = ck;
  return o;
}

// comm == nullptr: the single-GPU layer bigdn().
Tensor forward(cp::Communicator* comm, const Layer& l, const BigdnOptions& o) {
  return comm ? cp::bigdn_cp(*comm, l.qkv, l.beta, l.decay, l.qw, l.kw, l.cos, l.sin, l.F, l.S, o, Tensor(), Tensor(),
                             Tensor(), l.cpo)
              : bigdn(l.qkv, l.beta, l.decay, l.qw, l.kw, l.cos, l.sin, l.F, l.S, o);
}

void zero_grads(Layer& l) {
  for (Tensor* t : {&l.qkv, &l.beta, &l.decay, &l.qw, &l.kw}) t->zero_grad();
}

// One timed step: forward and backward from fresh gradients.
void fwd_bwd(cp::Communicator* comm, Layer& l, const BigdnOptions& o) {
  zero_grads(l);
  Tensor out = forward(comm, l, o);
  backward(out, l.gout);
}

struct Row {
  std::string name;
  int P = 1;
  int64_t F = 0;  // frames of this rank (rank 0's in the printed table)
  Checkpoint ck = Checkpoint::off;
  double ms = 0, comm_ms = 0, comm_calls = 0;
  double peak_mib = 0, held_mib = 0;  // peak above the inputs during fwd+bwd; held after the forward
  std::vector<double> rank_ms;        // each rank's own median (ms is their max)
  std::vector<int64_t> rank_F;        // each rank's frames
};

double max_over_ranks(double v) {
  double m = v;
  GDNCP_MPI_CHECK(MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  return m;
}

Row measure(const std::string& name, cp::Communicator* comm, Layer& l, Checkpoint ck, const CpBenchConfig& c) {
  const BigdnOptions o = options(c, ck);
  auto step = [&] { fwd_bwd(comm, l, o); };
  Row row;
  row.name = name;
  row.P = comm ? comm->size() : 1;
  row.F = l.F;
  row.ck = ck;
  // Memory: one step from a clean state.
  zero_grads(l);
  synchronize();
  empty_cuda_cache();  // whole cached blocks would otherwise blur the counts
  reset_peak_memory();
  const size_t base = cuda_memory_stats().allocated;
  {
    Tensor out = forward(comm, l, o);
    synchronize();
    row.held_mib = static_cast<double>(cuda_memory_stats().allocated - base) / (1 << 20);
    backward(out, l.gout);
  }
  synchronize();
  row.peak_mib = static_cast<double>(cuda_memory_stats().peak_allocated - base) / (1 << 20);
  // Time: warm-up, then the median of per-iteration device times.
  for (int i = 0; i < c.warmup; ++i) step();
  synchronize();
  GDNCP_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  if (comm) comm->reset_stats();
  const double mine = time_ms(step, /*warmup=*/0, c.iters);
  row.ms = max_over_ranks(mine);
  int P = 1;
  GDNCP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &P));
  row.rank_ms.resize(static_cast<size_t>(P));
  row.rank_F.resize(static_cast<size_t>(P));
  GDNCP_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_DOUBLE, row.rank_ms.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD));
  const long long F = l.F;
  std::vector<long long> Fs(static_cast<size_t>(P));
  GDNCP_MPI_CHECK(MPI_Allgather(&F, 1, MPI_LONG_LONG, Fs.data(), 1, MPI_LONG_LONG, MPI_COMM_WORLD));
  for (int i = 0; i < P; ++i) row.rank_F[static_cast<size_t>(i)] = Fs[static_cast<size_t>(i)];
  if (comm) {
    row.comm_ms = max_over_ranks(comm->stats().seconds * 1e3 / c.iters);
    row.comm_calls = static_cast<double>(comm->stats().calls) / c.iters;
  }
  row.peak_mib = max_over_ranks(row.peak_mib);
  row.held_mib = max_over_ranks(row.held_mib);
  return row;
}

// Peak device memory above the inputs of a stack of L layer calls: L forwards
// (each keeps what its backward needs, as in a deep model), then one backward
// through all of them. This is where checkpointing pays: L times the held
// memory of one layer, plus one layer's backward transient.
double stack_peak_mib(cp::Communicator* comm, Layer& l, Checkpoint ck, const CpBenchConfig& c, int L) {
  const BigdnOptions o = options(c, ck);
  zero_grads(l);
  synchronize();
  empty_cuda_cache();
  reset_peak_memory();
  const size_t base = cuda_memory_stats().allocated;
  {
    std::vector<Tensor> outs, grads;
    for (int i = 0; i < L; ++i) {
      outs.push_back(forward(comm, l, o));
      grads.push_back(l.gout);
    }
    backward(outs, grads);
  }
  synchronize();
  return max_over_ranks(static_cast<double>(cuda_memory_stats().peak_allocated - base) / (1 << 20));
}

// bigdn_cp on P GPUs (the balanced split) against bigdn on one GPU over the Fg frames.
double validate(cp::Communicator& world, const CpBenchConfig& c, int64_t Fg) {
  const int P = world.size(), r = world.rank();
  const cp::FrameSplit sp = cp::balanced_split(Fg, P, r);
  const int64_t N0 = sp.offset * c.tokens, N = sp.frames * c.tokens;
  Layer one = make_layer(c, Fg, 0, Fg, DType::bf16, 77);
  Layer mine = make_layer(c, Fg, sp.offset, sp.frames, DType::bf16, 77);
  NoGradGuard no_grad;
  const Tensor ref = slice_rows(forward(nullptr, one, options(c, Checkpoint::off)), 1, N0, N0 + N);
  const Tensor out = forward(&world, mine, options(c, Checkpoint::off));
  const std::vector<double> a = out.to(Device::cpu).to_vector(), b = ref.to(Device::cpu).to_vector();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return max_over_ranks(std::sqrt(num / std::max(den, 1e-300)));
}

// One GPU, stand-in peers (CpBenchConfig::emulate, loopback_comm.h).
int run_emulated(const CpBenchConfig& c) {
  const int P = c.emulate;
  // Stand-in peers report this rank's sizes as every rank's, so an empty rank would see an empty group.
  GDNCP_CHECK(c.global_frames >= P, "cp_bench: --emulate ", P, " needs at least ", P, " global frames, got ",
              c.global_frames);
  const int64_t Fg = c.global_frames, F = cp::balanced_split(Fg, P, 0).frames;  // the largest share
  int dev = 0;
  cudaDeviceProp prop;
  GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
  GDNCP_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::shared_ptr<cp::Communicator> one = cp::make_nccl_communicator(MPI_COMM_SELF, dev);
  LinkModel model;
  model.node = c.node_size;
  model.intra = link_preset(c.link == "none" ? "none" : "nvlink");
  model.inter = link_preset(c.link);
  // The ranks timed: all of them up to 8, else the first two, the middle one and the last.
  std::vector<int> timed;
  for (int r = 0; r < P; ++r)
    if (P <= 8 || r <= 1 || r == P / 2 || r == P - 1) timed.push_back(r);
  std::vector<std::shared_ptr<cp::Communicator>> peers(static_cast<size_t>(P));
  for (int r : timed) peers[static_cast<size_t>(r)] = std::make_shared<LoopbackPeers>(r, P, model);
  const bool whole = Fg <= 256;  // the one-GPU rows over the global frames fit

  struct Spec {
    std::string name;
    cp::Communicator* comm;  // nullptr: bigdn
    int64_t frames;          // this rank's
    int64_t offset;          // its first frame of the Fg
    Checkpoint ck;
  };
  std::vector<Spec> specs;
  for (const Checkpoint ck : {Checkpoint::off, Checkpoint::on}) {
    const std::string cks = ck == Checkpoint::on ? " ckpt" : "";
    if (whole) specs.push_back({"bigdn 1 GPU" + cks, nullptr, Fg, 0, ck});
    if (whole) specs.push_back({"bigdn_cp P=1" + cks, one.get(), Fg, 0, ck});
    specs.push_back({"bigdn_cp P=1 F_0" + cks, one.get(), F, 0, ck});
    for (int r : timed) {
      const cp::FrameSplit sp = cp::balanced_split(Fg, P, r);
      specs.push_back({"bigdn_cp rank " + std::to_string(r) + "/" + std::to_string(P) + cks, peers[r].get(), sp.frames,
                       sp.offset, ck});
    }
  }
  if (c.profile_row >= 0) {  // one row, its steps bracketed for ncu
    GDNCP_CHECK(c.profile_row < static_cast<int>(specs.size()), "cp_bench: --profile-row ", c.profile_row, " of ",
                specs.size());
    const Spec& s = specs[static_cast<size_t>(c.profile_row)];
    Layer l = make_layer(c, whole ? Fg : s.frames, whole ? s.offset : 0, s.frames, DType::bf16, 5);
    const BigdnOptions o = options(c, s.ck);
    for (int i = 0; i < c.warmup; ++i) fwd_bwd(s.comm, l, o);
    synchronize();
    GDNCP_CUDA_CHECK(cudaProfilerStart());
    for (int i = 0; i < c.iters; ++i) fwd_bwd(s.comm, l, o);
    synchronize();
    GDNCP_CUDA_CHECK(cudaProfilerStop());
    std::printf("cp_bench: profiled row %d (%s), %d steps\n", c.profile_row, s.name.c_str(), c.iters);
    return 0;
  }
  std::printf(
      "cp_bench on one %s, %d ranks emulated (stand-in peers: each rank's kernels, collectives replaced by device "
      "copies): B=%lld S=%lld H=%lld D=%lld bf16, %lld global frames\n",
      prop.name, P, static_cast<long long>(c.batch), static_cast<long long>(c.tokens), static_cast<long long>(c.heads),
      static_cast<long long>(c.head_dim), static_cast<long long>(Fg));
  std::printf(
      "  exchange %s%s%s, nodes of %d ranks, links: %s (intra %.1f us + bytes / %.0f GB/s, inter %.1f us + bytes / "
      "%.0f GB/s; modeled on a communication stream)\n",
      cp::exchange_name(c.exchange), c.deterministic ? " (deterministic mode)" : "", c.overlap ? " (overlapped)" : "",
      c.node_size, c.link.c_str(), model.intra.alpha_s * 1e6, model.intra.beta_Bps / 1e9, model.inter.alpha_s * 1e6,
      model.inter.beta_Bps / 1e9);
  std::vector<Row> rows;
  for (const Spec& s : specs) {
    // Beyond `whole`, a rank's own frames only (its kernels do not depend on the global count).
    Layer l = make_layer(c, whole ? Fg : s.frames, whole ? s.offset : 0, s.frames, DType::bf16, 5);
    rows.push_back(measure(s.name, s.comm, l, s.ck, c));
  }
  std::printf("\n  %-28s %4s %10s %10s %10s %10s\n", "config", "F/rk", "fwd+bwd ms", "link ms", "peak MiB", "held MiB");
  for (const Row& x : rows)
    std::printf("  %-28s %4lld %10.3f %10.3f %10.1f %10.1f\n", x.name.c_str(), static_cast<long long>(x.F), x.ms,
                x.comm_ms, x.peak_mib, x.held_mib);
  const size_t lead = whole ? 3 : 1, per_ck = lead + timed.size();
  for (size_t k = 0; k < 2; ++k) {
    const Row& t1f = rows[k * per_ck + lead - 1];
    double worst = 0;
    for (size_t i = 0; i < timed.size(); ++i) worst = std::max(worst, rows[k * per_ck + lead + i].ms);
    std::printf("  %s: slowest timed rank %.3f ms; its CP-only time (vs one GPU on the largest share) %.3f ms",
                k ? "ckpt" : "off ", worst, worst - t1f.ms);
    if (whole)
      std::printf("; strong scaling %s: %.1f%%",
                  model.on() ? "with the modeled links, without skew"
                             : "without the collectives' time and skew (an upper bound)",
                  100.0 * rows[k * per_ck + 1].ms / (P * worst));
    std::printf("\n");
  }
  // Memory of a deep model (as in run()): stacks of layer calls as rank 0 of P.
  std::vector<std::pair<int, std::pair<double, double>>> stacks;
  {
    Layer l = make_layer(c, whole ? Fg : F, 0, F, DType::bf16, 5);
    for (const int L : {1, 8, 20}) {
      const double off = stack_peak_mib(peers[0].get(), l, Checkpoint::off, c, L);
      const double on = stack_peak_mib(peers[0].get(), l, Checkpoint::on, c, L);
      stacks.push_back({L, {off, on}});
      std::printf(
          "  checkpointing a stack of %2d layer calls, rank 0/%d: peak %.0f -> %.0f MiB (%+.0f%%, ratio %.3f)\n", L, P,
          off, on, 100.0 * (on - off) / off, on / off);
    }
  }
  if (!c.json.empty()) {
    std::ostringstream js;
    js << "{\n\"device\": \"" << prop.name << "\", \"emulated_ranks\": " << P << ", \"B\": " << c.batch
       << ", \"S\": " << c.tokens << ", \"H\": " << c.heads << ", \"D\": " << c.head_dim
       << ", \"global_frames\": " << Fg << ", \"exchange\": \"" << cp::exchange_name(c.exchange)
       << "\", \"deterministic\": " << (c.deterministic ? "true" : "false")
       << ", \"overlap\": " << (c.overlap ? "true" : "false") << ", \"node_size\": " << c.node_size << ", \"link\": \""
       << c.link << "\", \"link_alpha_us\": [" << model.intra.alpha_s * 1e6 << ", " << model.inter.alpha_s * 1e6
       << "], \"link_beta_GBps\": [" << model.intra.beta_Bps / 1e9 << ", " << model.inter.beta_Bps / 1e9 << "]"
       << ", \"dtype\": \"bf16\",\n\"timing\": \"CUDA events, " << c.warmup << " warm-up, median of " << c.iters
       << "\",\n\"stacks_rank0\": [";
    for (size_t i = 0; i < stacks.size(); ++i)
      js << (i ? ", " : "") << "{\"layers\": " << stacks[i].first << ", \"peak_mib_off\": " << stacks[i].second.first
         << ", \"peak_mib_ckpt\": " << stacks[i].second.second << "}";
    js << "],\n\"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i)
      js << (i ? ",\n" : "") << "{\"name\": \"" << rows[i].name << "\", \"frames_per_rank\": " << rows[i].F
         << ", \"ms\": " << rows[i].ms << ", \"link_ms\": " << rows[i].comm_ms << ", \"peak_mib\": " << rows[i].peak_mib
         << ", \"held_mib\": " << rows[i].held_mib << "}";
    js << "\n]\n}\n";
    std::ofstream(c.json) << js.str();
    std::printf("\nwrote %s\n", c.json.c_str());
  }
  return 0;
}

int run(const CpBenchConfig& c) {
  if (c.emulate > 0) return run_emulated(c);
  int P = 1, r = 0;
  GDNCP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &P));
  GDNCP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &r));
  GDNCP_CHECK(cuda_device_count() >= 1, "cp_bench: no CUDA device");
  GDNCP_CHECK(c.global_frames >= 1, "cp_bench: global_frames must be >= 1, got ", c.global_frames);
  const cp::FrameSplit split = cp::balanced_split(c.global_frames, P, r);
  const int64_t weak_F = c.frames_per_rank > 0 ? c.frames_per_rank : cp::balanced_split(c.global_frames, P, 0).frames;
  std::shared_ptr<cp::Communicator> world = cp::make_nccl_communicator(MPI_COMM_WORLD);
  int dev = 0;
  cudaDeviceProp prop;
  GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
  std::shared_ptr<cp::Communicator> one = cp::make_nccl_communicator(MPI_COMM_SELF, dev);  // P = 1, same GPU
  GDNCP_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));

  const double err = validate(*world, c, c.global_frames);
  const bool valid = err <= 2e-2;
  if (r == 0)
    std::printf(
        "cp_bench on %d x %s: B=%lld S=%lld H=%lld D=%lld bf16; validation bigdn_cp(P=%d) vs bigdn(1 GPU) "
        "over %lld frames: rel L2 %.3g %s\n",
        P, prop.name, static_cast<long long>(c.batch), static_cast<long long>(c.tokens),
        static_cast<long long>(c.heads), static_cast<long long>(c.head_dim), P, static_cast<long long>(c.global_frames),
        err, valid ? "ok" : "FAILED");
  if (!valid) return 2;

  std::vector<Row> rows;
  for (const Checkpoint ck : {Checkpoint::off, Checkpoint::on}) {
    const char* cks = ck == Checkpoint::on ? "ckpt" : "";
    {  // strong scaling: the global frames, on 1 GPU (bigdn, bigdn_cp) and on P GPUs
      Layer g1 = make_layer(c, c.global_frames, 0, c.global_frames, DType::bf16, 5);
      rows.push_back(measure(std::string("bigdn 1 GPU ") + cks, nullptr, g1, ck, c));
      rows.push_back(measure(std::string("bigdn_cp P=1 ") + cks, one.get(), g1, ck, c));
    }
    if (P > 1) {
      Layer gp = make_layer(c, c.global_frames, split.offset, split.frames, DType::bf16, 5);
      rows.push_back(measure("bigdn_cp P=" + std::to_string(P) + " strong " + cks, world.get(), gp, ck, c));
    }
    {  // weak scaling: frames_per_rank on each GPU
      Layer w1 = make_layer(c, weak_F, 0, weak_F, DType::bf16, 6);
      rows.push_back(measure(std::string("bigdn_cp P=1 weak ") + cks, one.get(), w1, ck, c));
      if (P > 1) {
        Layer wp = make_layer(c, weak_F * P, r * weak_F, weak_F, DType::bf16, 6);
        rows.push_back(measure("bigdn_cp P=" + std::to_string(P) + " weak " + cks, world.get(), wp, ck, c));
      }
    }
  }

  if (r == 0) {
    std::printf("\n  %-28s %2s %4s %10s %10s %6s %10s %10s\n", "config", "P", "F/rk", "fwd+bwd ms", "comm ms", "colls",
                "peak MiB", "held MiB");
    for (const Row& x : rows) {
      std::printf("  %-28s %2d %4lld %10.3f %10.3f %6.1f %10.1f %10.1f\n", x.name.c_str(), x.P,
                  static_cast<long long>(x.F), x.ms, x.comm_ms, x.comm_calls, x.peak_mib, x.held_mib);
      if (x.P > 1) {  // each rank's own time: the split may be uneven
        std::printf("  %-28s", "  per rank (F: ms)");
        for (size_t i = 0; i < x.rank_ms.size(); ++i)
          std::printf(" r%zu %lld: %.3f", i, static_cast<long long>(x.rank_F[i]), x.rank_ms[i]);
        std::printf("\n");
      }
    }
    auto find = [&](const std::string& n) -> const Row* {
      for (const Row& x : rows)
        if (x.name == n) return &x;
      return nullptr;
    };
    for (const char* cks : {"", "ckpt"}) {
      const Row* s1 = find(std::string("bigdn_cp P=1 ") + cks);
      const Row* sp = find("bigdn_cp P=" + std::to_string(P) + " strong " + cks);
      const Row* w1 = find(std::string("bigdn_cp P=1 weak ") + cks);
      const Row* wp = find("bigdn_cp P=" + std::to_string(P) + " weak " + cks);
      if (s1 && sp)
        std::printf("  strong scaling %s: %.2fx on %d GPUs, efficiency %.0f%%\n", cks[0] ? "(ckpt)" : "",
                    s1->ms / sp->ms, P, 100.0 * s1->ms / (P * sp->ms));
      if (w1 && wp)
        std::printf("  weak scaling %s: efficiency %.0f%%\n", cks[0] ? "(ckpt)" : "", 100.0 * w1->ms / wp->ms);
    }
    for (const std::string& base : {std::string("bigdn_cp P=1 "), "bigdn_cp P=" + std::to_string(P) + " strong "}) {
      const Row *off = find(base), *on = find(base + "ckpt");
      if (off && on && off != on)
        std::printf(
            "  checkpointing %s: peak %.0f -> %.0f MiB (%.0f%%), held after forward %.0f -> %.0f MiB, time %+.0f%%\n",
            base.c_str(), off->peak_mib, on->peak_mib, 100.0 * (on->peak_mib - off->peak_mib) / off->peak_mib,
            off->held_mib, on->held_mib, 100.0 * (on->ms - off->ms) / off->ms);
    }
  }
  // A deep model's memory: stacks of layer calls at several depths (Sana-video
  // has 20 blocks), strong-scaling shapes. Per depth: the peak with checkpointing
  // off and on, and the peak less depth × the held memory per layer (the strong
  // rows above). That rest is one layer's backward transient, plus what the stack
  // holds beyond depth × held (the leaf gradients: every call reuses one layer's
  // leaves), less what the layers already back-propagated have freed (without
  // checkpointing, their saved state): no like-for-like transient between off
  // and on. The peaks are like for like.
  const int kDepths[] = {1, 8, 20};
  constexpr int kStack = 8;  // the depth of the older single-depth fields
  constexpr size_t kNumDepths = sizeof(kDepths) / sizeof(kDepths[0]);
  double stack_mib[kNumDepths][2] = {};
  {
    Layer gp = make_layer(c, c.global_frames, split.offset, split.frames, DType::bf16, 5);
    for (size_t i = 0; i < kNumDepths; ++i)
      for (const Checkpoint ck : {Checkpoint::off, Checkpoint::on})
        stack_mib[i][ck == Checkpoint::on] = stack_peak_mib(world.get(), gp, ck, c, kDepths[i]);
  }
  double held[2] = {0, 0};  // held after the forward, per layer call (the strong rows; P = 1: the P=1 rows)
  {
    const std::string base = P > 1 ? "bigdn_cp P=" + std::to_string(P) + " strong " : std::string("bigdn_cp P=1 ");
    for (const Row& x : rows)
      for (int on = 0; on < 2; ++on)
        if (x.name == base + (on ? "ckpt" : "")) held[on] = x.held_mib;
  }
  size_t at8 = 0;
  for (size_t i = 0; i < kNumDepths; ++i)
    if (kDepths[i] == kStack) at8 = i;
  if (r == 0) {
    std::printf("  held after the forward per layer call, P=%d strong: %.1f MiB off, %.1f MiB ckpt\n", P, held[0],
                held[1]);
    for (size_t i = 0; i < kNumDepths; ++i) {
      const double off = stack_mib[i][0], on = stack_mib[i][1], L = kDepths[i];
      std::printf(
          "  checkpointing a stack of %2d layer calls, P=%d strong: peak %.0f -> %.0f MiB (%+.0f%%, ratio %.2f); "
          "peak - depth x held %.0f -> %.0f MiB\n",
          kDepths[i], P, off, on, 100.0 * (on - off) / off, on / off, off - L * held[0], on - L * held[1]);
    }
    if (!c.json.empty()) {
      std::ostringstream js;
      js << "{\n\"device\": \"" << prop.name << "\", \"gpus\": " << P << ", \"B\": " << c.batch
         << ", \"S\": " << c.tokens << ", \"H\": " << c.heads << ", \"D\": " << c.head_dim
         << ", \"dtype\": \"bf16\",\n\"validation_rel_l2\": " << err << ",\n\"stack_layers\": " << kStack
         << ", \"stack_peak_mib_off\": " << stack_mib[at8][0] << ", \"stack_peak_mib_ckpt\": " << stack_mib[at8][1]
         << ",\n\"held_per_layer_mib_off\": " << held[0] << ", \"held_per_layer_mib_ckpt\": " << held[1]
         << ",\n\"stacks\": [";
      for (size_t i = 0; i < kNumDepths; ++i)
        js << (i ? ", " : "") << "{\"layers\": " << kDepths[i] << ", \"peak_mib_off\": " << stack_mib[i][0]
           << ", \"peak_mib_ckpt\": " << stack_mib[i][1] << ", \"ratio\": " << stack_mib[i][1] / stack_mib[i][0] << "}";
      js << "],\n\"timing\": \"CUDA events, " << c.warmup << " warm-up, median of " << c.iters
         << ", max over ranks\",\n\"rows\": [\n";
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& x = rows[i];
        js << (i ? ",\n" : "") << "{\"name\": \"" << x.name << "\", \"P\": " << x.P << ", \"frames_per_rank\": " << x.F
           << ", \"checkpoint\": \"" << checkpoint_name(x.ck) << "\", \"ms\": " << x.ms
           << ", \"comm_ms\": " << x.comm_ms << ", \"collectives\": " << x.comm_calls
           << ", \"peak_mib\": " << x.peak_mib << ", \"held_mib\": " << x.held_mib << ", \"rank_ms\": [";
        for (size_t k = 0; k < x.rank_ms.size(); ++k)
          js << (k ? ", " : "") << "{\"frames\": " << x.rank_F[k] << ", \"ms\": " << x.rank_ms[k] << "}";
        js << "]}";
      }
      js << "\n]\n}\n";
      std::ofstream(c.json) << js.str();
      std::printf("\nwrote %s\n", c.json.c_str());
    }
  }
  one.reset();
  world.reset();
  return 0;
}

}  // namespace

int run_cp_bench(const CpBenchConfig& config) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) MPI_Init(nullptr, nullptr);
  int rc = 1;
  try {
    rc = run(config);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cp_bench: %s\n", e.what());
    rc = 1;
  }
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!init) MPI_Finalize();
  return worst;
}

}  // namespace bench
}  // namespace gdncp

#ifdef GDNCP_CP_BENCH_MAIN
// Standalone: cp_bench [--frames 11] [--global-frames 22] [--tokens 920] [--heads 20] [--dim 112]
//                      [--warmup 5] [--iters 20] [--json PATH] [--emulate P [--profile-row K]] [--overlap]
int main(int argc, char** argv) {
  gdncp::bench::CpBenchConfig c;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (f == "--frames")
      c.frames_per_rank = std::stoll(next());
    else if (f == "--global-frames")
      c.global_frames = std::stoll(next());
    else if (f == "--tokens")
      c.tokens = std::stoll(next());
    else if (f == "--heads")
      c.heads = std::stoll(next());
    else if (f == "--dim")
      c.head_dim = std::stoll(next());
    else if (f == "--batch")
      c.batch = std::stoll(next());
    else if (f == "--warmup")
      c.warmup = std::stoi(next());
    else if (f == "--iters")
      c.iters = std::stoi(next());
    else if (f == "--json")
      c.json = next();
    else if (f == "--emulate")
      c.emulate = std::stoi(next());
    else if (f == "--profile-row")
      c.profile_row = std::stoi(next());
    else if (f == "--overlap")
      c.overlap = true;
    else {
      std::fprintf(stderr, "cp_bench: unknown flag %s\n", f.c_str());
      return 1;
    }
  }
  return gdncp::bench::run_cp_bench(c);
}
#endif
