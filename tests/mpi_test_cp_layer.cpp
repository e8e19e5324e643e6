// tests/mpi_test_cp_layer.cpp — the CP layers on CPU ranks: bigdn_cp against
// the single-rank bigdn on the gathered sequence, the raw single-direction
// entry against one rank (and its one-rank path against a composition of the
// fine ops), norm-weight gradients after all_reduce_grads, checkpointing, and
// arguments that are bad on one rank or differ between ranks.
// gdncp-mpi-np: 1 2 3 4 8
#include <functional>
#include <string>
#include <vector>

#include "autograd/tensor_internals.h"
#include "bigdn_fixtures.h"
#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {
namespace {

struct LayerRun {
  std::vector<Tensor> outs;
  std::vector<Tensor> grads;  // qkv, beta, decay, q_norm_w, k_norm_w (undefined when absent)
};

std::vector<Tensor> leaves_of(const LayerInputs& in) {
  return {leaf(in.qkv), leaf(in.beta), leaf(in.decay), leaf(in.q_norm_w), leaf(in.k_norm_w), in.rope_cos, in.rope_sin};
}

LayerRun finish(const std::vector<Tensor>& x, const std::vector<Tensor>& outs, const std::vector<Tensor>& w,
                cp::Communicator* reduce_over) {
  LayerRun run;
  run.outs = outs;
  backward_weighted(outs, w);
  if (reduce_over) cp::all_reduce_grads(*reduce_over, {x[3], x[4]});
  for (size_t k = 0; k < 5; ++k) run.grads.push_back(x[k].defined() ? x[k].grad() : Tensor());
  return run;
}

const char* kGradNames[] = {"dqkv", "dbeta", "ddecay", "dq_norm_w", "dk_norm_w"};

// Local slice of a global gradient k (the norm weights are not split).
Tensor grad_block(const Tensor& g, size_t k, int64_t F, int64_t S, int b) {
  if (k == 0) return rank_block(g, 1, F * S, b);
  if (k == 1 || k == 2) return rank_block(g, 2, F, b);
  return g;
}

// --- bigdn_cp vs bigdn ----------------------------------------------------------------

// q's own RoPE tables over the global sequence (another offset and base than k's).
void give_q_tables(LayerInputs& g) {
  auto rope = rope_tables(g.d.N(), g.d.D, g.rope_cos.dtype(), Device::cpu, /*offset=*/5, /*base=*/500.0);
  g.rope_cos_q = rope.first;
  g.rope_sin_q = rope.second;
}

void check_bigdn_cp(DType dt, bool norms, uint64_t seed, double tol_out, double tol_g, int64_t B = 1, int64_t D = 6,
                    bool q_tables = false) {
  const int P = nranks(), r = rank();
  const int64_t F = 2, S = 3;
  LayerInputs g = make_layer_inputs(dims(B, 2, D, F * P, S), dt, seed, norms, norms);
  if (q_tables) give_q_tables(g);
  const Tensor w = Tensor::randn({B, F * P * S, 2, D}, dt, Device::cpu, seed + 50);

  const std::vector<Tensor> xg = leaves_of(g);
  const LayerRun ref = finish(
      xg,
      {bigdn(xg[0], xg[1], xg[2], xg[3], xg[4], xg[5], xg[6], g.d.F, S, g.opt, Tensor(), g.rope_cos_q, g.rope_sin_q)},
      {w}, nullptr);
  const LayerInputs l = local_block(g, F, r);
  const std::vector<Tensor> xl = leaves_of(l);
  const LayerRun cp = finish(xl,
                             {cp::bigdn_cp(*world(), xl[0], xl[1], xl[2], xl[3], xl[4], xl[5], xl[6], F, S, l.opt,
                                           Tensor(), l.rope_cos_q, l.rope_sin_q)},
                             {rank_block(w, 1, F * S, r)}, world().get());

  EXPECT_TRUE(close_rel(cp.outs[0], rank_block(ref.outs[0], 1, F * S, r), tol_out, "out")) << "rank " << r;
  for (size_t k = 0; k < 5; ++k) {
    ASSERT_EQ(cp.grads[k].defined(), ref.grads[k].defined()) << kGradNames[k];
    if (!ref.grads[k].defined()) continue;
    EXPECT_TRUE(close_rel(cp.grads[k], grad_block(ref.grads[k], k, F, S, r), tol_g, kGradNames[k])) << "rank " << r;
  }
}

TEST(BigdnCp, MatchesBigdnF64) { check_bigdn_cp(DType::f64, true, 100, tol::f64, tol::f64); }
TEST(BigdnCp, MatchesBigdnF64Batch2HeadDim12) { check_bigdn_cp(DType::f64, true, 140, tol::f64, tol::f64, 2, 12); }
TEST(BigdnCp, MatchesBigdnF64NoNormWeights) { check_bigdn_cp(DType::f64, false, 110, tol::f64, tol::f64); }
TEST(BigdnCp, MatchesBigdnF32) { check_bigdn_cp(DType::f32, true, 120, tol::f32_short, tol::f32); }
// bf16 storage, f32 compute on both sides: the only difference is the order
// of f32 roundings plus the bf16 rounding of out and of the gradients.
TEST(BigdnCp, MatchesBigdnBf16) { check_bigdn_cp(DType::bf16, true, 130, tol::bf16, tol::bf16); }
// Separate q tables (the single-rank layer with them is checked against independent codings in test_bigdn).
TEST(BigdnCp, RopeQMatchesBigdnF64) { check_bigdn_cp(DType::f64, true, 150, tol::f64, tol::f64, 1, 6, true); }
TEST(BigdnCp, RopeQMatchesBigdnF32) { check_bigdn_cp(DType::f32, true, 160, tol::f32_short, tol::f32, 1, 6, true); }

// --- raw single direction -------------------------------------------------------------

void check_raw(DType dt, const cp::CpOptions& o, uint64_t seed, bool q_tables = false) {
  const int P = nranks(), r = rank();
  const int64_t F = 2, S = 3, D = 6, H = 2;
  LayerInputs g = make_layer_inputs(dims(1, H, D, F * P, S), dt, seed);
  if (q_tables) give_q_tables(g);
  const int b = o.reverse_rank_order ? P - 1 - r : r;
  const DType ct = dt == DType::f64 ? DType::f64 : DType::f32;
  const std::vector<Tensor> w = {Tensor::randn({1, F * P * S, H, D}, ct, Device::cpu, seed + 1),
                                 Tensor::randn({1, H, F * P * S}, ct, Device::cpu, seed + 2),
                                 Tensor::randn({H, D, D}, ct, Device::cpu, seed + 3),
                                 Tensor::randn({H, D}, ct, Device::cpu, seed + 4)};
  std::vector<Tensor> wref = w;  // every rank holds the terminal states: the P-rank loss counts them P times
  for (size_t k = 2; k < 4; ++k) {
    std::vector<double> v = w[k].to_vector();
    for (double& e : v) e *= P;
    wref[k] = Tensor::from_vector(v, w[k].shape(), ct);
  }
  cp::CpOptions ref_opt = o;
  ref_opt.reverse_rank_order = false;
  const std::vector<Tensor> xg = leaves_of(g);
  const LayerRun ref =
      finish(xg,
             raw_outputs(cp::cp_gdn_raw(*self(), xg[0], xg[1], xg[2], xg[3], xg[4], xg[5], xg[6], F * P, S, g.opt,
                                        ref_opt, Tensor(), g.rope_cos_q, g.rope_sin_q)),
             wref, nullptr);
  const LayerInputs l = local_block(g, F, b);
  const std::vector<Tensor> xl = leaves_of(l);
  const LayerRun cp = finish(xl,
                             raw_outputs(cp::cp_gdn_raw(*world(), xl[0], xl[1], xl[2], xl[3], xl[4], xl[5], xl[6], F, S,
                                                        l.opt, o, Tensor(), l.rope_cos_q, l.rope_sin_q)),
                             {rank_block(w[0], 1, F * S, b), rank_block(w[1], 2, F * S, b), w[2], w[3]}, world().get());

  ASSERT_EQ(cp.outs.size(), ref.outs.size());
  EXPECT_TRUE(close_rel(cp.outs[0], rank_block(ref.outs[0], 1, F * S, b), tol_fwd(dt), "num")) << "rank " << r;
  EXPECT_TRUE(close_rel(cp.outs[1], rank_block(ref.outs[1], 2, F * S, b), tol_fwd(dt), "den")) << "rank " << r;
  for (size_t k = 2; k < cp.outs.size(); ++k)
    EXPECT_TRUE(close_rel(cp.outs[k], ref.outs[k], tol_fwd(dt), k == 2 ? "terminal_M" : "terminal_z"));
  for (size_t k = 0; k < 5; ++k)
    EXPECT_TRUE(close_rel(cp.grads[k], grad_block(ref.grads[k], k, F, S, b), tol_grad(dt), kGradNames[k]))
        << "rank " << r;
}

TEST(CpRaw, MatchesOneRankF64) { check_raw(DType::f64, {}, 200); }
TEST(CpRaw, RopeQMatchesOneRankF64) { check_raw(DType::f64, {}, 230, true); }
TEST(CpRaw, RopeQReversedF64) { check_raw(DType::f64, reversed_ranks(), 240, true); }
TEST(CpRaw, MatchesOneRankF32) { check_raw(DType::f32, {}, 210); }
TEST(CpRaw, ReversedF64) { check_raw(DType::f64, reversed_ranks(), 220); }
TEST(CpRaw, TruncatedF64) {
  cp::CpOptions o;
  o.truncate_to_active = 1;  // inside rank 0's frames
  check_raw(DType::f64, o, 230);
  o.truncate_to_active = 2 * nranks();  // K = P·F
  check_raw(DType::f64, o, 231);
}

// The raw entry's one-rank path against an independent coding: the fine ops
// (rms_norm, relu_rope, phase_a, phase_c) around the one-rank cp_scan, which
// mpi_test_cp_scan checks against a naive loop and finite differences.
TEST(CpRaw, OneRankMatchesFineOpsComposition) {
  const LayerInputs g = make_layer_inputs(dims(2, 2, 4, 3, 2), DType::f64, 300);
  cp::CpOptions o;
  o.truncate_to_active = 2;
  const std::vector<Tensor> w = {
      Tensor::randn({2, 6, 2, 4}, DType::f64, Device::cpu, 301), Tensor::randn({2, 2, 6}, DType::f64, Device::cpu, 302),
      Tensor::randn({4, 4, 4}, DType::f64, Device::cpu, 303), Tensor::randn({4, 4}, DType::f64, Device::cpu, 304)};
  const std::vector<Tensor> xa = leaves_of(g);
  const LayerRun fused =
      finish(xa, raw_outputs(cp::cp_gdn_raw(*self(), xa[0], xa[1], xa[2], xa[3], xa[4], xa[5], xa[6], 3, 2, g.opt, o)),
             w, nullptr);
  const std::vector<Tensor> xb = leaves_of(g);
  const Tensor qkv_hat = ops::rms_norm(xb[0], xb[3], xb[4], g.opt.norm_eps);
  const std::vector<Tensor> prep = ops::relu_rope(qkv_hat, xb[5], xb[6], g.opt.k_scale);
  const std::vector<Tensor> a = ops::phase_a(prep[3], prep[1], qkv_hat, xb[1], 3, 2);
  const cp::ScanResult s = cp::cp_scan(*self(), a[0], a[1], a[2], a[3], xb[2], o);
  const std::vector<Tensor> c = ops::phase_c(prep[2], prep[0], s.M, s.z, 3, 2);
  const LayerRun composed = finish(xb, {c[0], c[1], s.terminal_M, s.terminal_z}, w, nullptr);
  const char* names[] = {"num", "den", "terminal_M", "terminal_z"};
  for (size_t k = 0; k < 4; ++k) EXPECT_TRUE(close_rel(fused.outs[k], composed.outs[k], tol::f64, names[k]));
  for (size_t k = 0; k < 5; ++k) EXPECT_TRUE(close_rel(fused.grads[k], composed.grads[k], tol::f64, kGradNames[k]));
}

// --- checkpointing -----------------------------------------------------------------------

// Checkpoint on vs off: bitwise equal outputs and gradients, fewer saved bytes
// after the forward, the recompute issues no collective, and it makes the
// `skipped` tensors that phase C would write shape-only (nothing allocated).
template <typename Entry>
void check_checkpoint(const Entry& entry, uint64_t seed, size_t skipped) {
  const int P = nranks(), r = rank();
  const int64_t F = 2, S = 3;
  const LayerInputs g = make_layer_inputs(dims(1, 2, 6, F * P, S), DType::f64, seed);
  const LayerInputs l = local_block(g, F, r);
  LayerRun runs[2];
  size_t saved[2], shape_only[2];
  int64_t calls[2];
  for (int on = 0; on < 2; ++on) {
    BigdnOptions opt = l.opt;
    opt.checkpoint = on ? Checkpoint::on : Checkpoint::off;
    const std::vector<Tensor> x = leaves_of(l);
    world()->reset_stats();
    const size_t made = gdncp::detail::TensorInternals::shape_only_made();
    const size_t before = autograd::saved_bytes();
    const std::vector<Tensor> outs = entry(x, opt);
    saved[on] = autograd::saved_bytes() - before;
    std::vector<Tensor> w;
    for (size_t k = 0; k < outs.size(); ++k)
      w.push_back(Tensor::randn(outs[k].shape(), outs[k].dtype(), Device::cpu, seed + 10 + k));
    runs[on] = finish(x, outs, w, nullptr);
    calls[on] = world()->stats().calls;
    shape_only[on] = gdncp::detail::TensorInternals::shape_only_made() - made;
  }
  for (size_t k = 0; k < runs[0].outs.size(); ++k)
    EXPECT_TRUE(bitwise_equal(runs[1].outs[k], runs[0].outs[k])) << "output " << k << " rank " << r;
  for (size_t k = 0; k < 5; ++k) EXPECT_TRUE(bitwise_equal(runs[1].grads[k], runs[0].grads[k])) << kGradNames[k];
  EXPECT_LT(saved[1], saved[0]) << "checkpointing should hold fewer saved bytes after the forward";
  EXPECT_EQ(calls[0], P > 1 ? 3 : 1) << "validation + one all-gather forward + one backward";
  EXPECT_EQ(calls[1], calls[0]) << "the recompute must not issue collectives";
  EXPECT_EQ(shape_only[0], 0u) << "no checkpoint, no recompute";
  EXPECT_EQ(shape_only[1], skipped) << "what phase C writes must be shape-only in the recompute";
}

TEST(BigdnCp, CheckpointOnEqualsOffBitwise) {
  check_checkpoint(
      [](const std::vector<Tensor>& x, const BigdnOptions& opt) {
        return std::vector<Tensor>{cp::bigdn_cp(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], 2, 3, opt)};
      },
      400, /*skipped: out, and den (phase C scratch)*/ 2);
}

TEST(CpRaw, CheckpointOnEqualsOffBitwise) {
  check_checkpoint(
      [](const std::vector<Tensor>& x, const BigdnOptions& opt) {
        cp::CpOptions o;
        o.truncate_to_active = 2 * nranks() - 1;
        return raw_outputs(cp::cp_gdn_raw(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], 2, 3, opt, o));
      },
      410, /*skipped: num, den (the terminal states are the scan's)*/ 2);
}

TEST(BigdnCp, CheckpointAutoFollowsGradMode) {
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, 4, 2 * nranks(), 2), DType::f64, 420), 2, rank());
  BigdnOptions opt = l.opt;
  opt.checkpoint = Checkpoint::automatic;
  const std::vector<Tensor> x = leaves_of(l);
  const size_t before = autograd::saved_bytes();
  Tensor out = cp::bigdn_cp(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], 2, 2, opt);
  const size_t with_grad = autograd::saved_bytes() - before;
  opt.checkpoint = Checkpoint::off;
  Tensor out_off = cp::bigdn_cp(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], 2, 2, opt);
  const size_t off = autograd::saved_bytes() - before - with_grad;
  EXPECT_LT(with_grad, off) << "auto with grad mode on and inputs requiring grad must checkpoint";
  autograd::clear_tape();
  NoGradGuard no_grad;
  opt.checkpoint = Checkpoint::automatic;
  Tensor out_ng = cp::bigdn_cp(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], 2, 2, opt);
  EXPECT_EQ(autograd::tape_size(), 0u);
  EXPECT_TRUE(bitwise_equal(out_ng, out));
}

// --- bad arguments, on one rank or differing between ranks ---------------------------

Tensor call_bigdn_cp(const LayerInputs& l, int64_t F, int64_t S) {
  return cp::bigdn_cp(*world(), l.qkv, l.beta, l.decay, l.q_norm_w, l.k_norm_w, l.rope_cos, l.rope_sin, F, S, l.opt);
}

TEST(CpLayerErrors, SizesDifferBetweenRanks) {
  if (nranks() < 2) GTEST_SKIP() << "needs 2 ranks";
  const bool odd = rank() == 1;
  // S differs
  {
    const int64_t S = odd ? 3 : 2;
    const LayerInputs l = make_layer_inputs(dims(1, 2, 4, 2, S), DType::f64, 510);
    expect_all_throw([&] { call_bigdn_cp(l, 2, S); }, "S differs");
  }
  // H differs (B·H differs)
  {
    const LayerInputs l = make_layer_inputs(dims(1, odd ? 3 : 2, 4, 2, 2), DType::f64, 520);
    expect_all_throw([&] { call_bigdn_cp(l, 2, 2); }, "H differs");
  }
  // D differs
  {
    const LayerInputs l = make_layer_inputs(dims(1, 2, odd ? 6 : 4, 2, 2), DType::f64, 530);
    expect_all_throw([&] { call_bigdn_cp(l, 2, 2); }, "D differs");
  }
  // dtype differs
  {
    const LayerInputs l = make_layer_inputs(dims(1, 2, 4, 2, 2), odd ? DType::bf16 : DType::f32, 540);
    expect_all_throw([&] { call_bigdn_cp(l, 2, 2); }, "dtype differs");
  }
  // a norm weight on some ranks only
  {
    const LayerInputs l = make_layer_inputs(dims(1, 2, 4, 2, 2), DType::f64, 550, true, !odd);
    expect_all_throw([&] { call_bigdn_cp(l, 2, 2); }, "k_norm_w presence differs");
  }
  // k_scale differs
  {
    LayerInputs l = make_layer_inputs(dims(1, 2, 4, 2, 2), DType::f64, 560);
    if (odd) l.opt.k_scale *= 2;
    expect_all_throw([&] { call_bigdn_cp(l, 2, 2); }, "k_scale");
  }
}

TEST(CpLayerErrors, BadArgumentOnOneRank) {
  const int last = nranks() - 1;
  const std::string others = "bad argument on rank " + std::to_string(last);
  // beta of the wrong shape on the last rank
  {
    LayerInputs l = make_layer_inputs(dims(1, 2, 4, 2, 2), DType::f64, 600);
    if (rank() == last) l.beta = Tensor::uniform({1, 2, 2, 3}, DType::f64, Device::cpu, 1, 0.1, 0.9);
    expect_all_throw([&] { call_bigdn_cp(l, 2, 2); }, "beta", others);
  }
  // rope rows missing on the last rank
  {
    LayerInputs l = make_layer_inputs(dims(1, 2, 4, 2, 2), DType::f64, 610);
    if (rank() == last) l.rope_cos = slice(l.rope_cos, 0, 0, 3);
    expect_all_throw([&] { call_bigdn_cp(l, 2, 2); }, "rope_cos", others);
  }
  // odd D everywhere
  {
    LayerInputs l = make_layer_inputs(dims(1, 2, 4, 2, 2), DType::f64, 620);
    l.qkv = Tensor::randn({1, 4, 3, 2, 5}, DType::f64, Device::cpu, 2);
    expect_all_throw([&] { call_bigdn_cp(l, 2, 2); }, "qkv");
  }
  // N ≠ F·S
  {
    const LayerInputs l = make_layer_inputs(dims(1, 2, 4, 2, 2), DType::f64, 630);
    expect_all_throw([&] { call_bigdn_cp(l, 2, 3); }, "qkv");
  }
}

TEST(CpLayerErrors, TruncateOptions) {
  const LayerInputs l = make_layer_inputs(dims(1, 2, 4, 2, 2), DType::f64, 700);
  auto raw = [&](const cp::CpOptions& o) {
    cp::cp_gdn_raw(*world(), l.qkv, l.beta, l.decay, l.q_norm_w, l.k_norm_w, l.rope_cos, l.rope_sin, 2, 2, l.opt, o);
  };
  cp::CpOptions o;
  o.truncate_to_active = 2 * nranks() + 1;
  expect_all_throw([&] { raw(o); }, "truncate_to_active: must be in [1, F_total]");
  o.truncate_to_active = -3;
  expect_all_throw([&] { raw(o); }, "truncate_to_active");
  o.truncate_to_active = 1;
  o.reverse_rank_order = true;
  expect_all_throw([&] { raw(o); }, "reverse_rank_order");
}

TEST(CpLayerErrors, AllReduceGradsParameterSetsDiffer) {
  if (nranks() < 2) GTEST_SKIP() << "needs 2 ranks";
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, 4, 2 * nranks(), 2), DType::f32, 710), 2, rank());
  const std::vector<Tensor> x = leaves_of(l);
  Tensor out = cp::bigdn_cp(*world(), x[0], x[1], x[2], x[3], x[4], x[5], x[6], 2, 2, l.opt);
  backward_weighted({out}, {Tensor::randn(out.shape(), DType::f32, Device::cpu, 711)});
  // Both norm weights have gradients on every rank; rank 0 passes one more: an error everywhere, no hang.
  std::vector<Tensor> ps = {x[4]};
  if (rank() == 0) ps.push_back(x[3]);
  expect_all_throw([&] { cp::all_reduce_grads(*world(), ps); }, "different set of gradients");
}

TEST(CpLayer, AllReduceGradsSumsInRankOrder) {
  // Each rank's gradient is (rank+1)·ones: the sum is P(P+1)/2 on every rank, bitwise the same.
  Tensor p = Tensor::zeros({5}, DType::f32);
  p.requires_grad_(true);
  Tensor q = Tensor::zeros({2}, DType::f64);
  q.requires_grad_(true);
  // Build the grads through a trivial graph: backward of a leaf root with a given gradient.
  autograd::backward(p, Tensor::full({5}, rank() + 1.0, DType::f32));
  autograd::backward(q, Tensor::full({2}, 0.5 * (rank() + 1.0), DType::f64));
  cp::all_reduce_grads(*world(), {p, Tensor(), q});
  const double P = nranks();
  for (double v : p.grad().to_vector()) EXPECT_EQ(v, P * (P + 1) / 2);
  for (double v : q.grad().to_vector()) EXPECT_EQ(v, 0.5 * P * (P + 1) / 2);
}

// After the errors the communicator still works.
TEST(CpLayerErrors, CommunicatorUsableAfterErrors) { check_bigdn_cp(DType::f64, true, 800, tol::f64, tol::f64); }

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
