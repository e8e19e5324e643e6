// tests/mpi_test_cp_gpu.cpp — the CP kernels and layers on GPUs with NCCL.
// Skips cleanly when gdncp has no CUDA or there are fewer GPUs than ranks.
//   - the NCCL communicator's collectives;
//   - cp_scan, cp_gdn_raw, bigdn_cp and the camera branch on P GPUs against one
//     GPU over the gathered sequence (a one-rank NCCL communicator built from
//     the ncclComm_t of a one-rank group, the third bootstrap), in f32 and bf16, and
//     against the f64 CPU oracle; checkpoint on vs off bitwise;
//   - uneven splits (empty ranks included) and clip masks: the CUDA twins with
//     cuts and with no frame, and the layers and camera branch on P GPUs vs one;
//   - clip masks holding values other than 0 and 1, checked on the device;
//   - a bad argument on one rank over NCCL: every rank raises at once (call headers).
// gdncp-mpi-np: 1 2
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bigdn_fixtures.h"
#include "mpi_async_fixtures.h"
#include "mpi_cp_entries.h"
#include "mpi_cp_fixtures.h"

#if GDNCP_WITH_CUDA
#include "gdncp/cp_nccl.h"
#endif

namespace gdncp {
namespace test {
namespace {

// A one-rank NCCL group per process (null without GPUs); nccl_world: mpi_cp_fixtures.h.
std::shared_ptr<cp::Communicator>& nccl_self() {
  static std::shared_ptr<cp::Communicator> c;
  return c;
}

Tensor gpu(const Tensor& t) { return t.defined() ? t.to(Device::cuda) : Tensor(); }
Tensor cpu(const Tensor& t) { return t.defined() ? t.to(Device::cpu) : Tensor(); }

// --- the NCCL communicator -------------------------------------------------------------------

TEST(NcclComm, Collectives) {
  REQUIRE_NCCL_WORLD();
  cp::Communicator& c = *nccl_world();
  const int P = c.size(), r = c.rank();
  EXPECT_EQ(c.device(), Device::cuda);
  EXPECT_STREQ(c.backend(), "nccl");
  auto contribution = [](int rr) { return Tensor::randn({9}, DType::f32, Device::cpu, 100 + rr); };
  Tensor out = Tensor::empty({P, 9}, DType::f32, Device::cuda);
  poison(out);
  c.all_gather(out, gpu(contribution(r)));
  for (int k = 0; k < P; ++k) EXPECT_TRUE(bitwise_equal(slice(out, 0, k, k + 1).reshape({9}), contribution(k)));
  Tensor s = gpu(contribution(r));
  c.all_reduce_sum(s);
  Tensor all = Tensor::empty({P, 9}, DType::f32, Device::cuda);
  c.all_gather(all, s);
  for (int k = 0; k < P; ++k) EXPECT_TRUE(bitwise_equal(slice(all, 0, k, k + 1).reshape({9}), cpu(s)));
  Tensor b = gpu(contribution(r));
  c.broadcast(b, P - 1);
  EXPECT_TRUE(bitwise_equal(cpu(b), contribution(P - 1)));
  Tensor recv = Tensor::zeros({9}, DType::f32, Device::cuda);
  c.send_recv(gpu(contribution(r)), r > 0 ? r - 1 : -1, recv, r + 1 < P ? r + 1 : -1);
  if (r + 1 < P) {
    EXPECT_TRUE(bitwise_equal(cpu(recv), contribution(r + 1)));
  }
  int64_t mine = 7 * r + 3;
  std::vector<int64_t> got(static_cast<size_t>(P));
  c.all_gather_host(got.data(), &mine, sizeof mine);
  for (int k = 0; k < P; ++k) EXPECT_EQ(got[static_cast<size_t>(k)], 7 * k + 3);
  // CPU tensors are refused without desynchronising the group.
  Tensor host = Tensor::zeros({2}, DType::f32);
  EXPECT_THROW(c.all_reduce_sum(host), Error);
  c.barrier();
  EXPECT_FALSE(c.aborted());
  EXPECT_GT(c.stats().calls, 0);
}

// Asynchronous collectives: a call returns once its collective is enqueued
// (no host wait of any kind is counted); the results are those of the data
// once the stream has run, and the watchdog counts the completed collectives.
TEST(NcclCommAsync, CollectivesReturnOnceEnqueued) {
  REQUIRE_NCCL_WORLD();
  cp::Communicator& c = *nccl_world();
  const int P = c.size(), r = c.rank();
  auto contribution = [](int rr) { return Tensor::randn({9}, DType::f32, Device::cpu, 200 + rr); };
  Tensor out = Tensor::empty({P, 9}, DType::f32, Device::cuda);
  poison(out);
  Tensor in = gpu(contribution(r)), s = gpu(contribution(r));
  c.all_gather(out, in);  // warm: NCCL connects lazily on the first call
  synchronize();
  // The watchdog counts a collective when it sees it complete: let it count the
  // warm-up (and what earlier tests left) first, until the count holds still.
  for (int64_t seen = -1, spins = 0; c.stats().calls != seen && spins < 100; ++spins) {
    seen = c.stats().calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  c.reset_stats();
  c.all_gather(out, in);
  c.all_reduce_sum(s);
  EXPECT_EQ(c.stats().host_waits, 0) << "a collective made the host wait";
  synchronize();
  for (int k = 0; k < P; ++k) EXPECT_TRUE(bitwise_equal(slice(out, 0, k, k + 1).reshape({9}), contribution(k)));
  for (int spins = 0; c.stats().calls < 2 && spins < 2000; ++spins)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(c.stats().calls, 2) << "the watchdog counts completed collectives";
  EXPECT_FALSE(c.aborted());
}

// --- layers on P GPUs vs one GPU and vs the f64 CPU oracle ---------------------------------

std::vector<Tensor> leaves_on(const LayerInputs& in, Device dev) {
  auto mk = [&](const Tensor& t) {
    if (!t.defined()) return Tensor();
    Tensor x = t.to(dev);
    x.requires_grad_(true);
    return x;
  };
  return {mk(in.qkv),      mk(in.beta),         mk(in.decay),       mk(in.q_norm_w),
          mk(in.k_norm_w), in.rope_cos.to(dev), in.rope_sin.to(dev)};
}

struct Result {
  Tensor out;
  std::vector<Tensor> grads;  // qkv, beta, decay, q_norm_w, k_norm_w on the CPU
};

// f64 CPU copy of inputs (the oracle sees exactly the values the GPU saw).
LayerInputs as_f64(const LayerInputs& in) { return convert(in, DType::f64); }

// The global inputs of a GPU layer test, in bf16 math for bf16 data, else IEEE f32.
LayerInputs global_layer_inputs(const Dims& d, DType dt, uint64_t seed) {
  LayerInputs g = make_layer_inputs(d, dt, seed);
  g.opt.precision = dt == DType::bf16 ? Precision::bf16 : Precision::ieee;
  return g;
}

void check_layer_gpu(DType dt, uint64_t seed) {
  REQUIRE_NCCL_WORLD();
  const int P = nranks(), r = rank();
  const int64_t F = 3, S = 37, D = 112, H = 2;
  const LayerInputs g = global_layer_inputs(dims(1, H, D, F * P, S), dt, seed);
  const Tensor w = Tensor::randn({1, F * P * S, H, D}, dt, Device::cpu, seed + 9);

  auto run = [&](cp::Communicator* comm, const LayerInputs& in, const Tensor& wt, Device dev, bool reduce) {
    const std::vector<Tensor> x = leaves_on(in, dev);
    Tensor out = comm ? cp::bigdn_cp(*comm, x[0], x[1], x[2], x[3], x[4], x[5], x[6], in.d.F, S, in.opt)
                      : bigdn(x[0], x[1], x[2], x[3], x[4], x[5], x[6], in.d.F, S, in.opt);
    backward_weighted({out}, {wt.to(dev).to(out.dtype())});
    if (reduce) cp::all_reduce_grads(*comm, {x[3], x[4]});
    Result res{cpu(out), {}};
    for (size_t k = 0; k < 5; ++k) res.grads.push_back(cpu(x[k].grad()));
    return res;
  };
  const Result cpres = run(nccl_world().get(), local_block(g, F, r), rank_block(w, 1, F * S, r), Device::cuda, true);
  const Result self = run(nccl_self().get(), g, w, Device::cuda, false);  // the same code on one GPU
  const Result one = run(nullptr, g, w, Device::cuda, false);             // the single-GPU layer
  const Result oracle = run(nullptr, as_f64(g), w, Device::cpu, false);   // f64 on the CPU

  auto local = [&](const Tensor& t, size_t k) {
    if (k == 0) return rank_block(t, 1, F * S, r);
    if (k == 1 || k == 2) return rank_block(t, 2, F, r);
    return t;
  };
  const char* names[] = {"dqkv", "dbeta", "ddecay", "dq_norm_w", "dk_norm_w"};
  // P GPUs vs one GPU running the same code: tol_fwd / tol_grad. Against the
  // single-GPU layer (other scan kernels) and the f64 oracle: the layer's own
  // accuracy bar (test::tol::f32 in IEEE mode, test::tol::bf16 for bf16 data).
  const double loose = dt == DType::bf16 ? test::tol::bf16 : test::tol::f32;
  EXPECT_TRUE(close_rel(cpres.out, rank_block(self.out, 1, F * S, r), tol_fwd(dt), "out vs P=1")) << "rank " << r;
  EXPECT_TRUE(close_rel(cpres.out, rank_block(one.out, 1, F * S, r), loose, "out vs bigdn")) << "rank " << r;
  EXPECT_TRUE(close_rel(cpres.out, rank_block(oracle.out, 1, F * S, r), loose, "out vs f64")) << "rank " << r;
  for (size_t k = 0; k < 5; ++k) {
    const std::string n = names[k];
    EXPECT_TRUE(close_rel(cpres.grads[k], local(self.grads[k], k), tol_grad(dt), n + " vs P=1")) << "rank " << r;
    EXPECT_TRUE(close_rel(cpres.grads[k], local(one.grads[k], k), loose, n + " vs bigdn")) << "rank " << r;
    EXPECT_TRUE(close_rel(cpres.grads[k], local(oracle.grads[k], k), loose, n + " vs f64")) << "rank " << r;
  }
}

TEST(BigdnCpGpu, MatchesOneGpuAndOracleF32) { check_layer_gpu(DType::f32, 300); }
TEST(BigdnCpGpu, MatchesOneGpuAndOracleBf16) { check_layer_gpu(DType::bf16, 310); }

TEST(BigdnCpGpu, CheckpointOnEqualsOffBitwise) {
  REQUIRE_NCCL_WORLD();
  const int r = rank();
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, 112, 2 * nranks(), 37), DType::bf16, 320), 2, r);
  Result res[2];
  for (int on = 0; on < 2; ++on) {
    BigdnOptions opt = l.opt;
    opt.checkpoint = on ? Checkpoint::on : Checkpoint::off;
    const std::vector<Tensor> x = leaves_on(l, Device::cuda);
    Tensor out = cp::bigdn_cp(*nccl_world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], 2, 37, opt);
    backward_weighted({out}, {Tensor::randn(out.shape(), out.dtype(), Device::cuda, 321)});
    res[on].out = cpu(out);
    for (size_t k = 0; k < 5; ++k) res[on].grads.push_back(cpu(x[k].grad()));
  }
  EXPECT_TRUE(bitwise_equal(res[1].out, res[0].out));
  for (size_t k = 0; k < 5; ++k) EXPECT_TRUE(bitwise_equal(res[1].grads[k], res[0].grads[k])) << "grad " << k;
}

// Raw single direction (truncated) and the camera branch: P GPUs vs one GPU (NCCL, one rank).
void check_raw_gpu(DType dt, uint64_t seed) {
  REQUIRE_NCCL_WORLD();
  const int P = nranks(), r = rank();
  const int64_t F = 2, S = 21, D = 64, H = 2;
  const LayerInputs g = global_layer_inputs(dims(1, H, D, F * P, S), dt, seed);
  cp::CpOptions o;
  o.truncate_to_active = F * P - 1;
  const std::vector<Tensor> w = {Tensor::randn({1, F * P * S, H, D}, DType::f32, Device::cpu, seed + 1),
                                 Tensor::randn({1, H, F * P * S}, DType::f32, Device::cpu, seed + 2),
                                 Tensor::randn({H, D, D}, DType::f32, Device::cpu, seed + 3),
                                 Tensor::randn({H, D}, DType::f32, Device::cpu, seed + 4)};
  auto run = [&](cp::Communicator& comm, const LayerInputs& in, const std::vector<Tensor>& wt, double tscale) {
    const std::vector<Tensor> x = leaves_on(in, Device::cuda);
    const cp::RawResult rr = cp::cp_gdn_raw(comm, x[0], x[1], x[2], x[3], x[4], x[5], x[6], in.d.F, S, in.opt, o);
    std::vector<Tensor> ws;
    for (size_t k = 0; k < 4; ++k) {
      std::vector<double> v = wt[k].to_vector();
      if (k >= 2)
        for (double& e : v) e *= tscale;
      ws.push_back(Tensor::from_vector(v, wt[k].shape(), DType::f32, Device::cuda));
    }
    backward_weighted({rr.num, rr.den, rr.terminal_M, rr.terminal_z}, ws);
    Result res{cpu(rr.num), {}};
    res.grads = {cpu(rr.den), cpu(rr.terminal_M), cpu(x[0].grad()), cpu(x[1].grad()), cpu(x[2].grad())};
    return res;
  };
  const Result a = run(*nccl_world(), local_block(g, F, r),
                       {rank_block(w[0], 1, F * S, r), rank_block(w[1], 2, F * S, r), w[2], w[3]}, 1.0);
  const Result b = run(*nccl_self(), g, w, P);
  EXPECT_TRUE(close_rel(a.out, rank_block(b.out, 1, F * S, r), tol_fwd(dt), "num"));
  EXPECT_TRUE(close_rel(a.grads[0], rank_block(b.grads[0], 2, F * S, r), tol_fwd(dt), "den"));
  EXPECT_TRUE(close_rel(a.grads[1], b.grads[1], tol_fwd(dt), "terminal_M"));
  EXPECT_TRUE(close_rel(a.grads[2], rank_block(b.grads[2], 1, F * S, r), tol_grad(dt), "dqkv"));
  EXPECT_TRUE(close_rel(a.grads[3], rank_block(b.grads[3], 2, F, r), tol_grad(dt), "dbeta"));
  EXPECT_TRUE(close_rel(a.grads[4], rank_block(b.grads[4], 2, F, r), tol_grad(dt), "ddecay"));
}

TEST(CpRawGpu, MatchesOneGpuF32) { check_raw_gpu(DType::f32, 400); }
TEST(CpRawGpu, MatchesOneGpuBf16) { check_raw_gpu(DType::bf16, 410); }

// cp_cam_gdn_num over CUDA leaves of in (q, k, v, beta, decay; F frames of S
// tokens) with the loss ⟨wt, out⟩: out and the five gradients, on the CPU.
std::vector<Tensor> run_cam_gpu(cp::Communicator& comm, const std::vector<Tensor>& in, const Tensor& wt, int64_t F,
                                int64_t S, const cp::CpOptions& o = {}) {
  std::vector<Tensor> x;
  for (const Tensor& t : in) {
    Tensor y = t.to(Device::cuda);
    y.requires_grad_(true);
    x.push_back(y);
  }
  const cp::CamResult cr = cp::cp_cam_gdn_num(comm, x[0], x[1], x[2], x[3], x[4], F, S, o);
  backward_weighted({cr.out}, {wt.to(Device::cuda)});
  std::vector<Tensor> res = {cpu(cr.out)};
  for (const Tensor& t : x) res.push_back(cpu(t.grad()));
  return res;
}

void check_cam_gpu(DType dt, uint64_t seed) {
  REQUIRE_NCCL_WORLD();
  const int P = nranks(), r = rank();
  const int64_t F = 2, S = 19, D = 48, H = 2, N = F * P * S;
  const Tensor q = Tensor::randn({1, H, D, N}, dt, Device::cpu, seed + 1);
  const Tensor k = Tensor::randn({1, H, D, N}, dt, Device::cpu, seed + 2, 1.0 / std::sqrt(double(S * D)));
  const Tensor v = Tensor::randn({1, H, D, N}, dt, Device::cpu, seed + 3);
  const Tensor beta = Tensor::uniform({1, H, F * P, S}, dt, Device::cpu, seed + 4, 0.1, 0.9);
  const Tensor decay = Tensor::uniform({1, H, F * P}, dt, Device::cpu, seed + 5, 0.5, 0.99);
  const Tensor w = Tensor::randn(q.shape(), dt, Device::cpu, seed + 6);
  cp::CpOptions o;
  o.reverse_rank_order = true;
  const int b = P - 1 - r;
  auto run = [&](cp::Communicator& comm, const std::vector<Tensor>& in, const Tensor& wt, int64_t Fl) {
    return run_cam_gpu(comm, in, wt, Fl, S, o);
  };
  const std::vector<Tensor> mine =
      run(*nccl_world(),
          {rank_block(q, 3, F * S, b), rank_block(k, 3, F * S, b), rank_block(v, 3, F * S, b),
           rank_block(beta, 2, F, b), rank_block(decay, 2, F, b)},
          rank_block(w, 3, F * S, b), F);
  cp::CpOptions ref_o;
  o = ref_o;  // the reference runs the logical order directly
  const std::vector<Tensor> ref = run(*nccl_self(), {q, k, v, beta, decay}, w, F * P);
  const char* names[] = {"out", "dq", "dk", "dv", "dbeta", "ddecay"};
  for (size_t i = 0; i < 6; ++i) {
    const Tensor e = i <= 3 ? rank_block(ref[i], 3, F * S, b) : rank_block(ref[i], 2, F, b);
    EXPECT_TRUE(close_rel(mine[i], e, i == 0 ? tol_fwd(dt) : tol_grad(dt), names[i])) << "rank " << r;
  }
}

TEST(CpCamGpu, MatchesOneGpuF32) { check_cam_gpu(DType::f32, 500); }
TEST(CpCamGpu, MatchesOneGpuBf16) { check_cam_gpu(DType::bf16, 510); }

// --- uneven splits and packed clips on P GPUs vs one GPU ------------------------------------

// Splits of each group size (logical block frames), empty ranks included.
std::vector<std::vector<int64_t>> gpu_splits(int P) {
  if (P == 1) return {{5}};
  if (P == 2) return {{4, 1}, {0, 3}};
  std::vector<std::vector<int64_t>> s(1);
  for (int r = 0; r < P; ++r) s[0].push_back(cp::balanced_split(2 * P + 1, P, r).frames);
  return s;
}

// A clip mask (B, F_total): row 0 a 1-frame clip and a start inside, row 1 a start every 2 frames.
Tensor gpu_clip_mask(int64_t B, int64_t Ft) {
  std::vector<double> c(static_cast<size_t>(B * Ft), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t f = 0; f < Ft; ++f)
      c[static_cast<size_t>(b * Ft + f)] = (b == 0 ? (f == 1 || f == 2) : f % 2 == 1) ? 1.0 : 0.0;
  return Tensor::from_vector(c, {B, Ft}, DType::f32);
}

// bigdn_cp and cp_gdn_raw (truncated inside the last non-empty block) over an
// uneven split with a clip mask, P GPUs vs one GPU running the same code.
void check_layers_uneven_gpu(bool bidi, uint64_t seed) {
  REQUIRE_NCCL_WORLD();
  const int P = nranks(), r = rank();
  const int64_t S = 9, D = 32, H = 2, B = 2;
  for (const auto& split : gpu_splits(P)) {
    int64_t Ft = 0, off = 0;
    for (size_t k = 0; k < split.size(); ++k) {
      if (static_cast<int>(k) < r) off += split[k];
      Ft += split[k];
    }
    const int64_t F = split[static_cast<size_t>(r)];
    LayerInputs g = make_layer_inputs(dims(B, H, D, Ft, S), DType::f32, seed);
    g.opt.precision = Precision::ieee;
    const Tensor mask = gpu_clip_mask(B, Ft);
    cp::CpOptions o;
    if (!bidi) o.truncate_to_active = Ft - 1;
    auto call = [&](cp::Communicator& comm, const LayerInputs& in, int64_t Fl, const Tensor& m, int64_t woff,
                    double tscale) {
      const std::vector<Tensor> x = leaves_on(in, Device::cuda);
      std::vector<Tensor> outs, ws;
      if (bidi) {
        outs = {cp::bigdn_cp(comm, x[0], x[1], x[2], x[3], x[4], x[5], x[6], Fl, S, in.opt, gpu(m))};
      } else {
        const cp::RawResult rr =
            cp::cp_gdn_raw(comm, x[0], x[1], x[2], x[3], x[4], x[5], x[6], Fl, S, in.opt, o, gpu(m));
        outs = {rr.num, rr.den, rr.terminal_M, rr.terminal_z};
      }
      for (size_t k = 0; k < outs.size(); ++k) {
        Tensor w = Tensor::randn(k == 0   ? Shape{B, Ft * S, H, D}
                                 : k == 1 ? Shape{B, H, Ft * S}
                                          : outs[k].shape(),
                                 DType::f32, Device::cpu, seed + 20 + k);
        if (k == 0) w = slice(w, 1, woff * S, (woff + Fl) * S);
        if (k == 1) w = slice(w, 2, woff * S, (woff + Fl) * S);
        if (k >= 2) {
          std::vector<double> v = w.to_vector();
          for (double& e : v) e *= tscale;
          w = Tensor::from_vector(v, w.shape(), DType::f32);
        }
        ws.push_back(gpu(w));
      }
      backward_weighted(outs, ws);
      if (&comm == nccl_world().get()) cp::all_reduce_grads(comm, {x[3], x[4]});
      std::vector<Tensor> res;
      for (const Tensor& t : outs) res.push_back(cpu(t));
      for (size_t k = 0; k < 5; ++k) res.push_back(cpu(x[k].grad()));
      return res;
    };
    LayerInputs l = g;
    l.d.F = F;
    l.qkv = slice(g.qkv, 1, off * S, (off + F) * S);
    l.beta = slice(g.beta, 2, off, off + F);
    l.decay = slice(g.decay, 2, off, off + F);
    l.rope_cos = slice(g.rope_cos, 0, off * S, (off + F) * S);
    l.rope_sin = slice(g.rope_sin, 0, off * S, (off + F) * S);
    const std::vector<Tensor> mine = call(*nccl_world(), l, F, slice(mask, 1, off, off + F), off, 1.0);
    const std::vector<Tensor> ref = call(*nccl_self(), g, Ft, mask, 0, P);
    const size_t nout = bidi ? 1 : 4;
    auto local = [&](const Tensor& t, int axis, int64_t per) { return slice(t, axis, off * per, (off + F) * per); };
    const std::string tag =
        std::string(bidi ? "bigdn_cp" : "cp_gdn_raw") + " split rank " + std::to_string(r) + " F=" + std::to_string(F);
    if (F > 0) {
      EXPECT_TRUE(close_rel(mine[0], local(ref[0], 1, S), tol_fwd(DType::f32), tag + " out/num"));
      if (!bidi) {
        EXPECT_TRUE(close_rel(mine[1], local(ref[1], 2, S), tol_fwd(DType::f32), tag + " den"));
      }
      EXPECT_TRUE(close_rel(mine[nout], local(ref[nout], 1, S), tol_grad(DType::f32), tag + " dqkv"));
      EXPECT_TRUE(close_rel(mine[nout + 1], local(ref[nout + 1], 2, 1), tol_grad(DType::f32), tag + " dbeta"));
      EXPECT_TRUE(close_rel(mine[nout + 2], local(ref[nout + 2], 2, 1), tol_grad(DType::f32), tag + " ddecay"));
    } else {
      EXPECT_EQ(mine[0].numel(), 0) << tag;
      EXPECT_EQ(mine[nout].numel(), 0) << tag;
    }
    if (!bidi) {
      EXPECT_TRUE(close_rel(mine[2], ref[2], tol_fwd(DType::f32), tag + " terminal_M"));
      EXPECT_TRUE(close_rel(mine[3], ref[3], tol_fwd(DType::f32), tag + " terminal_z"));
    }
    EXPECT_TRUE(close_rel(mine[nout + 3], ref[nout + 3], tol_grad(DType::f32), tag + " dq_norm_w"));
    EXPECT_TRUE(close_rel(mine[nout + 4], ref[nout + 4], tol_grad(DType::f32), tag + " dk_norm_w"));
    seed += 31;
  }
}

TEST(CpUnevenGpu, BigdnCpClipsMatchOneGpu) { check_layers_uneven_gpu(true, 600); }
TEST(CpUnevenGpu, RawTruncatedClipsMatchOneGpu) { check_layers_uneven_gpu(false, 700); }

// The camera branch over an uneven split (empty ranks included), P GPUs vs one GPU.
TEST(CpUnevenGpu, CamMatchesOneGpu) {
  REQUIRE_NCCL_WORLD();
  const int P = nranks(), r = rank();
  const int64_t S = 7, D = 24, H = 2;
  for (const auto& split : gpu_splits(P)) {
    int64_t Ft = 0, off = 0;
    for (size_t k = 0; k < split.size(); ++k) {
      if (static_cast<int>(k) < r) off += split[k];
      Ft += split[k];
    }
    const int64_t F = split[static_cast<size_t>(r)], N = Ft * S;
    const std::vector<Tensor> in = {Tensor::randn({1, H, D, N}, DType::f32, Device::cpu, 801),
                                    Tensor::randn({1, H, D, N}, DType::f32, Device::cpu, 802, 1.0 / std::sqrt(S * D)),
                                    Tensor::randn({1, H, D, N}, DType::f32, Device::cpu, 803),
                                    Tensor::uniform({1, H, Ft, S}, DType::f32, Device::cpu, 804, 0.1, 0.9),
                                    Tensor::uniform({1, H, Ft}, DType::f32, Device::cpu, 805, 0.5, 0.99)};
    const Tensor w = Tensor::randn({1, H, D, N}, DType::f32, Device::cpu, 806);
    auto run = [&](cp::Communicator& comm, const std::vector<Tensor>& x_in, const Tensor& wt, int64_t Fl) {
      return run_cam_gpu(comm, x_in, wt, Fl, S);
    };
    const std::vector<Tensor> mine =
        run(*nccl_world(),
            {slice(in[0], 3, off * S, (off + F) * S), slice(in[1], 3, off * S, (off + F) * S),
             slice(in[2], 3, off * S, (off + F) * S), slice(in[3], 2, off, off + F), slice(in[4], 2, off, off + F)},
            slice(w, 3, off * S, (off + F) * S), F);
    const std::vector<Tensor> ref = run(*nccl_self(), in, w, Ft);
    if (F == 0) {
      for (const Tensor& t : mine) EXPECT_EQ(t.numel(), 0);
      continue;
    }
    const char* names[] = {"out", "dq", "dk", "dv", "dbeta", "ddecay"};
    for (size_t i = 0; i < 6; ++i) {
      const Tensor e = i <= 3 ? slice(ref[i], 3, off * S, (off + F) * S) : slice(ref[i], 2, off, off + F);
      EXPECT_TRUE(close_rel(mine[i], e, i == 0 ? tol_fwd(DType::f32) : tol_grad(DType::f32), names[i])) << "rank " << r;
    }
  }
}

// --- clip mask values checked on the device (Note [clip mask values]) --------------------

bool all_nan(const Tensor& t) {
  for (double v : t.to_vector())
    if (!std::isnan(v)) return false;
  return true;
}

// Every entry that takes a clip mask, over comm with its tensors on dev: rank
// 0's mask holds `bad` at a random place of its frames (the other values 0 or
// 1). On rank 0 every output and every gradient is NaN, and so is every
// output of every other rank, whose states all start from rank 0's; the next
// call with a good mask raises gdncp::Error naming clip_starts (on every rank
// for the CP entries, at once), and the call after it equals the run before
// the bad mask bitwise.
void check_bad_mask_on_device(cp::Communicator& comm, Device dev, float bad, uint64_t seed) {
  const int P = comm.size(), r = comm.rank();
  const int64_t F = 3, Ft = F * P, lo = F * r;
  std::mt19937_64 rng(seed);
  const int64_t bad_b = static_cast<int64_t>(rng() % kB), bad_f = static_cast<int64_t>(rng() % F);
  std::vector<double> m(static_cast<size_t>(kB * Ft));
  for (double& v : m) v = static_cast<double>(rng() % 2);
  const Tensor good = Tensor::from_vector(m, {kB, Ft}, DType::f32);
  m[static_cast<size_t>(bad_b * Ft + bad_f)] = bad;  // rank 0's frames
  const Tensor bad_mask = Tensor::from_vector(m, {kB, Ft}, DType::f32);
  auto on = [&](const Tensor& t) { return t.defined() ? t.to(dev) : Tensor(); };

  std::vector<std::pair<Entry, bool>> entries;  // (entry, collective)
  for (bool bidi : {false, true}) {
    entries.push_back({scan_entry(bidi, {}, Ft, DType::f32, seed + 10), true});
    entries.push_back({layer_entry(bidi, {}, Ft, DType::f32, seed + 20, Checkpoint::off), true});
  }
  {  // the one-rank layer on each rank's frames
    Entry e = layer_entry(true, {}, Ft, DType::f32, seed + 30, Checkpoint::off);
    e.name = "bigdn";
    BigdnOptions opt;
    opt.k_scale = 1.0 / std::sqrt(static_cast<double>(kD * kS));
    e.call = [opt](cp::Communicator&, const std::vector<Tensor>& x, int64_t Fl, const Tensor& mask) {
      return std::vector<Tensor>{bigdn(x[0], x[1], x[2], x[3], x[4], x[5], x[6], Fl, kS, opt, mask)};
    };
    entries.push_back({e, false});
  }
  for (const auto& [e, collective] : entries) {
    const std::string tag = e.name + " rank " + std::to_string(r) + " value " + std::to_string(bad);
    std::vector<Tensor> in;
    for (const Tensor& t : local_inputs(e, lo, lo + F)) in.push_back(on(t));
    const auto weights = [&](const std::vector<Tensor>& outs) {
      std::vector<Tensor> w;
      for (size_t k = 0; k < outs.size(); ++k)
        w.push_back(Tensor::randn(outs[k].shape(), outs[k].dtype(), Device::cpu, seed + 40 + k).to(dev));
      return w;
    };
    auto call = [&](const Tensor& mask) { return run(e, comm, in, F, on(slice(mask, 1, lo, lo + F)), weights, false); };
    const Run ref = call(good);
    const Run poisoned = call(bad_mask);
    for (size_t k = 0; k < poisoned.outs.size(); ++k) {
      if (r == 0 || collective) {
        EXPECT_TRUE(all_nan(poisoned.outs[k])) << tag << ": output " << k << " not all NaN";
      }
    }
    for (size_t k = 0; k < poisoned.grads.size(); ++k) {
      if (r == 0 && poisoned.grads[k].defined()) {
        EXPECT_TRUE(all_nan(poisoned.grads[k])) << tag << ": gradient " << k << " not all NaN";
      }
    }
    const std::string what = e.name + ": clip_starts: must hold 0 or 1";
    if (collective)
      expect_all_throw([&] { call(good); }, r == 0 ? what : "bad argument on rank 0");
    else if (r == 0)
      try {
        call(good);
        ADD_FAILURE() << tag << ": no error at the call after the bad mask";
      } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find(what), std::string::npos) << tag << ": " << err.what();
      }
    autograd::clear_tape();
    const Run again = call(good);
    for (size_t k = 0; k < ref.outs.size(); ++k)
      EXPECT_TRUE(bitwise_equal(again.outs[k].to(Device::cpu), ref.outs[k].to(Device::cpu))) << tag << ": output " << k;
    for (size_t k = 0; k < ref.grads.size(); ++k) {
      if (ref.grads[k].defined()) {
        EXPECT_TRUE(bitwise_equal(again.grads[k].to(Device::cpu), ref.grads[k].to(Device::cpu)))
            << tag << ": gradient " << k;
      }
    }
  }
}

// On P GPUs (one per rank; a one-rank world on one GPU). Every call is
// validated: a rank that raises alone would otherwise be out of step with
// ranks that skipped the exchange (NCCL carries no error header).
TEST(HardenClipMaskGpu, BadValuesGiveNaNThenAnErrorNamingClipStarts) {
  REQUIRE_NCCL_WORLD();
  const cp::Validation policy = nccl_world()->validation();
  nccl_world()->set_validation(cp::Validation::every_call);
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (float bad : {0.5f, 2.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()})
    check_bad_mask_on_device(*nccl_world(), Device::cuda, bad, seed);
  nccl_world()->set_validation(policy);
}

// A CUDA mask adds no host wait: the check is a launch.
TEST(HardenClipMaskGpu, DeviceCheckAddsNoHostWait) {
  REQUIRE_NCCL_WORLD();
  const LayerInputs g = global_layer_inputs(dims(1, 2, 16, 4, 8), DType::f32, 900);
  const std::vector<Tensor> x = leaves_on(g, Device::cuda);
  const Tensor mask = gpu(Tensor::from_vector({0.0, 1.0, 0.0, 1.0}, {1, 4}, DType::f32));
  auto step = [&] { return bigdn(x[0], x[1], x[2], x[3], x[4], x[5], x[6], 4, 8, g.opt, mask); };
  step();  // warm
  const int64_t waits = cuda_host_waits();
  step();
  EXPECT_EQ(cuda_host_waits(), waits);
  autograd::clear_tape();
}

// --- a bad argument on one rank over NCCL (Note [NCCL call headers]) ------------------------

// One forward of bigdn_cp on this rank's block (beta of the wrong shape when
// bad); no host wait.
void nccl_layer_step(cp::Communicator& c, bool bad) {
  const int64_t F = 2, S = 3;
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, 8, F * c.size(), S), DType::f32, 1600), F, c.rank());
  const std::vector<Tensor> x = leaves_on(l, Device::cuda);
  const Tensor beta = bad ? Tensor::zeros({1, 2, F, S + 1}, DType::f32, Device::cuda) : x[1];
  cp::bigdn_cp(c, x[0], beta, x[2], x[3], x[4], x[5], x[6], F, S, l.opt);
  autograd::clear_tape();
}

// In a steady state (validated calls) under `policy`, the last rank passes a
// bad beta: every rank raises within seconds, not at the deadline (60 s), the
// last rank its own error, the others "bad argument on rank P-1" (they went
// on with their collectives: the communicator is then aborted). Under
// every_call every rank waits for the call headers: nobody goes on, and the
// communicator stays usable.
void check_bad_argument_on_one_rank(cp::Validation policy) {
  REQUIRE_NCCL_WORLD();
  if (nranks() < 2) GTEST_SKIP() << "needs 2 ranks";
  auto c = cp::make_nccl_communicator(MPI_COMM_WORLD);  // its own: it may end aborted
  c->set_timeout_seconds(60);
  c->set_validation(policy);
  const int last = nranks() - 1;
  nccl_layer_step(*c, false);
  nccl_layer_step(*c, false);
  synchronize();
  const std::string mine = "beta", theirs = "bad argument on rank " + std::to_string(last);
  expect_error_in_time(
      [&] {
        if (rank() == last) return nccl_layer_step(*c, true);
        for (int i = 0; i < 1000; ++i) {  // raises once the watchdog has seen the headers
          nccl_layer_step(*c, false);
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      },
      {rank() == last ? mine : theirs}, 10);
  if (policy == cp::Validation::every_call) {
    EXPECT_FALSE(c->aborted()) << "rank " << rank();
    EXPECT_NO_THROW(nccl_layer_step(*c, false)) << "rank " << rank();
    EXPECT_NO_THROW(synchronize()) << "rank " << rank();
  }
}

TEST(HardenNccl, BadArgumentOnOneRankInSteadyStateReachesEveryRankAtOnce) {
  check_bad_argument_on_one_rank(cp::Validation::on_change);
}
TEST(HardenNccl, BadArgumentOnOneRankUnderEveryCallKeepsTheCommunicator) {
  check_bad_argument_on_one_rank(cp::Validation::every_call);
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) {
  using namespace gdncp;
#if GDNCP_WITH_CUDA
  std::shared_ptr<cp::Communicator> one_owner;
  // The NCCL groups are made once, before the tests, on every rank or on none.
  auto setup = [&] {
    int ok = cuda_device_count() >= test::nranks() ? 1 : 0, all = 0;
    GDNCP_MPI_CHECK(MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    if (!all) return;
    test::nccl_world() = cp::make_nccl_communicator(MPI_COMM_WORLD);  // sets this rank's device
    test::nccl_world()->set_timeout_seconds(120);
    int dev = 0;
    GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
    // A one-rank group on this rank's device, used through the third bootstrap
    // (the caller's ncclComm_t + stream).
    one_owner = cp::make_nccl_communicator(MPI_COMM_SELF, dev);
    test::nccl_self() = cp::make_nccl_communicator(cp::nccl_comm(*one_owner), nullptr);
  };
  auto teardown = [&] {
    test::nccl_self().reset();
    one_owner.reset();
    test::nccl_world().reset();
  };
  return test::run_mpi_tests(argc, argv, setup, teardown);
#else
  return test::run_mpi_tests(argc, argv);
#endif
}
