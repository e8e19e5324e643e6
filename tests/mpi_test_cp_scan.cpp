// tests/mpi_test_cp_scan.cpp — the distributed frame scan (docs/design.md §6) and the
// camera branch on CPU ranks: P ranks against one rank over the concatenated
// sequence, forward and every gradient; the one-rank path itself against a
// naive loop and fp64 finite differences; checkpointing; bad arguments.
// gdncp-mpi-np: 1 2 3 4 8
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {
namespace {

// --- inputs ----------------------------------------------------------------------

struct ScanInputs {
  int64_t B = 1, H = 2, D = 5, F = 3;  // F: frames of the tensors held (global or local)
  Tensor P, A, Pz, bz, decay;
  std::vector<Tensor> list() const { return {P, A, Pz, bz, decay}; }
};

ScanInputs make_scan_inputs(int64_t B, int64_t H, int64_t D, int64_t F, DType dt, uint64_t seed) {
  ScanInputs in;
  in.B = B;
  in.H = H;
  in.D = D;
  in.F = F;
  const int64_t BH = B * H;
  in.P = make_P(BH, F, D, dt, seed + 1);
  in.A = Tensor::randn({BH, F, D, D}, dt, Device::cpu, seed + 2);
  in.Pz = make_P(BH, F, D, dt, seed + 3);
  in.bz = Tensor::randn({BH, F, D}, dt, Device::cpu, seed + 4);
  in.decay = Tensor::uniform({B, H, F}, dt, Device::cpu, seed + 5, 0.5, 0.99);
  return in;
}

// Frame block `b` (F frames) of global inputs.
ScanInputs block_of(const ScanInputs& g, int64_t F, int b) {
  ScanInputs l = g;
  l.F = F;
  l.P = rank_block(g.P, 1, F, b);
  l.A = rank_block(g.A, 1, F, b);
  l.Pz = rank_block(g.Pz, 1, F, b);
  l.bz = rank_block(g.bz, 1, F, b);
  l.decay = rank_block(g.decay, 2, F, b);
  return l;
}

// Loss weights of the outputs (M, z, terminal M, terminal z), global.
std::vector<Tensor> scan_weights(const ScanInputs& g, uint64_t seed) {
  const int64_t BH = g.B * g.H;
  return {Tensor::randn({BH, g.F, g.D, g.D}, g.P.dtype(), Device::cpu, seed + 11),
          Tensor::randn({BH, g.F, g.D}, g.P.dtype(), Device::cpu, seed + 12),
          Tensor::randn({BH, g.D, g.D}, g.P.dtype(), Device::cpu, seed + 13),
          Tensor::randn({BH, g.D}, g.P.dtype(), Device::cpu, seed + 14)};
}

struct ScanRun {
  std::vector<Tensor> outs;   // M, z [, TM, Tz]
  std::vector<Tensor> grads;  // P, A, Pz, bz, decay
};

// cp_scan on comm over `in` with loss Σ⟨w, out⟩; weights already local.
ScanRun run_cp_scan(cp::Communicator& comm, const ScanInputs& in, const cp::CpOptions& o,
                    const std::vector<Tensor>& w) {
  std::vector<Tensor> x;
  for (const Tensor& t : in.list()) x.push_back(leaf(t));
  const cp::ScanResult r = cp::cp_scan(comm, x[0], x[1], x[2], x[3], x[4], o);
  ScanRun run;
  run.outs = scan_outputs(r);
  backward_weighted(run.outs, w);
  for (const Tensor& t : x) run.grads.push_back(t.grad());
  return run;
}

// P ranks vs one rank over the global sequence in logical order (rank r holds
// logical block r, or P−1−r when the rank order is reversed).
void check_scan_against_one_rank(DType dt, const cp::CpOptions& o, uint64_t seed) {
  const int P = nranks(), r = rank();
  const int64_t F = 3;
  const ScanInputs g = make_scan_inputs(1, 2, 5, F * P, dt, seed);
  const std::vector<Tensor> wg = scan_weights(g, seed);
  const int b = o.reverse_rank_order ? P - 1 - r : r;

  // Every rank holds a copy of the terminal state, so the P-rank loss counts it P times.
  std::vector<Tensor> wref = wg;
  for (int k = 2; k < 4; ++k) {
    std::vector<double> v = wg[static_cast<size_t>(k)].to_vector();
    for (double& e : v) e *= P;
    wref[static_cast<size_t>(k)] = Tensor::from_vector(v, wg[static_cast<size_t>(k)].shape(), dt);
  }
  cp::CpOptions ref_opt = o;
  ref_opt.reverse_rank_order = false;  // the global sequence is already in logical order
  const ScanRun ref = run_cp_scan(*self(), g, ref_opt, wref);

  const ScanInputs local = block_of(g, F, b);
  const std::vector<Tensor> wl = {rank_block(wg[0], 1, F, b), rank_block(wg[1], 1, F, b), wg[2], wg[3]};
  const ScanRun cp = run_cp_scan(*world(), local, o, wl);

  const char* names[] = {"M", "z", "terminal_M", "terminal_z"};
  ASSERT_EQ(cp.outs.size(), ref.outs.size());
  for (size_t k = 0; k < cp.outs.size(); ++k) {
    const Tensor expect = k < 2 ? rank_block(ref.outs[k], 1, F, b) : ref.outs[k];
    EXPECT_TRUE(close_rel(cp.outs[k], expect, tol_fwd(dt), names[k])) << "rank " << r;
  }
  const char* gnames[] = {"dP", "dA", "dPz", "dbz", "ddecay"};
  for (size_t k = 0; k < 5; ++k) {
    const Tensor expect = k < 4 ? rank_block(ref.grads[k], 1, F, b) : rank_block(ref.grads[k], 2, F, b);
    ASSERT_TRUE(cp.grads[k].defined()) << gnames[k];
    EXPECT_TRUE(close_rel(cp.grads[k], expect, tol_grad(dt), gnames[k])) << "rank " << r;
  }
}

TEST(CpScan, MatchesOneRankF64) { check_scan_against_one_rank(DType::f64, {}, 100); }
TEST(CpScan, MatchesOneRankF32) { check_scan_against_one_rank(DType::f32, {}, 200); }

TEST(CpScan, ReversedRankOrderF64) { check_scan_against_one_rank(DType::f64, reversed_ranks(), 300); }
TEST(CpScan, ReversedRankOrderF32) { check_scan_against_one_rank(DType::f32, reversed_ranks(), 310); }

TEST(CpScan, TruncatedInsideFirstRankF64) {
  for (int64_t K : {1, 2}) {  // F = 3: K inside rank 0's frames
    cp::CpOptions o;
    o.truncate_to_active = K;
    SCOPED_TRACE("K = " + std::to_string(K));
    check_scan_against_one_rank(DType::f64, o, 400 + static_cast<uint64_t>(K));
  }
}
TEST(CpScan, TruncatedAtEndF64) {
  cp::CpOptions o;
  o.truncate_to_active = 3 * nranks();  // K = P·F
  check_scan_against_one_rank(DType::f64, o, 500);
}
TEST(CpScan, TruncatedF32) {
  cp::CpOptions o;
  o.truncate_to_active = 3 * nranks() - 1;
  check_scan_against_one_rank(DType::f32, o, 510);
}

// --- the one-rank path itself -------------------------------------------------------

// Naive per-frame loop of docs/design.md §4/§6 in double: M_t = g (I − P) M_{t−1} + A, with
// frames ≥ K frozen.
std::vector<std::vector<double>> naive_scan(const ScanInputs& in, int64_t K) {
  const int64_t BH = in.B * in.H, F = in.F, D = in.D;
  const std::vector<double> P = in.P.to_vector(), A = in.A.to_vector(), Pz = in.Pz.to_vector(), bz = in.bz.to_vector(),
                            g = in.decay.to_vector();
  std::vector<double> M(static_cast<size_t>(BH * F * D * D)), z(static_cast<size_t>(BH * F * D));
  for (int64_t bh = 0; bh < BH; ++bh) {
    std::vector<double> m(static_cast<size_t>(D * D), 0.0), zz(static_cast<size_t>(D), 0.0);
    for (int64_t t = 0; t < F; ++t) {
      if (K <= 0 || t < K) {
        const size_t o = static_cast<size_t>((bh * F + t) * D * D);
        const double gt = g[static_cast<size_t>(bh * F + t)];
        std::vector<double> m2(m.size()), z2(zz.size());
        for (int64_t i = 0; i < D; ++i) {
          for (int64_t j = 0; j < D; ++j) {
            double s = m[static_cast<size_t>(i * D + j)];
            for (int64_t k = 0; k < D; ++k)
              s -= P[o + static_cast<size_t>(i * D + k)] * m[static_cast<size_t>(k * D + j)];
            m2[static_cast<size_t>(i * D + j)] = gt * s + A[o + static_cast<size_t>(i * D + j)];
          }
          double s = zz[static_cast<size_t>(i)];
          for (int64_t k = 0; k < D; ++k) s -= Pz[o + static_cast<size_t>(i * D + k)] * zz[static_cast<size_t>(k)];
          z2[static_cast<size_t>(i)] = gt * s + bz[static_cast<size_t>((bh * F + t) * D + i)];
        }
        m = m2;
        zz = z2;
      }
      std::copy(m.begin(), m.end(), M.begin() + (bh * F + t) * D * D);
      std::copy(zz.begin(), zz.end(), z.begin() + (bh * F + t) * D);
    }
  }
  return {M, z};
}

TEST(CpScan, OneRankMatchesNaiveLoop) {
  const ScanInputs in = make_scan_inputs(2, 1, 4, 5, DType::f64, 600);
  for (int64_t K : {0, 3}) {
    cp::CpOptions o;
    o.truncate_to_active = K;
    const cp::ScanResult r = cp::cp_scan(*self(), in.P, in.A, in.Pz, in.bz, in.decay, o);
    const std::vector<std::vector<double>> ref = naive_scan(in, K);
    EXPECT_TRUE(close_rel(r.M, Tensor::from_vector(ref[0], r.M.shape(), DType::f64), tol::f64_scan, "M")) << "K=" << K;
    EXPECT_TRUE(close_rel(r.z, Tensor::from_vector(ref[1], r.z.shape(), DType::f64), tol::f64_scan, "z")) << "K=" << K;
    if (K > 0) {  // terminal = state at frame K−1
      EXPECT_TRUE(close_rel(r.terminal_M, slice(r.M, 1, K - 1, K).reshape(r.terminal_M.shape()), 0.0, "TM"));
      EXPECT_TRUE(close_rel(r.terminal_z, slice(r.z, 1, K - 1, K).reshape(r.terminal_z.shape()), 0.0, "Tz"));
    }
  }
}

TEST(CpScan, OneRankGradcheck) {
  const ScanInputs in = make_scan_inputs(1, 2, 3, 3, DType::f64, 700);
  for (int64_t K : {0, 2}) {
    cp::CpOptions o;
    o.truncate_to_active = K;
    std::vector<Tensor> x = in.list();
    for (Tensor& t : x) t.requires_grad_(true);
    const GradcheckResult res = gradcheck(
        [&](const std::vector<Tensor>& v) {
          const cp::ScanResult r = cp::cp_scan(*self(), v[0], v[1], v[2], v[3], v[4], o);
          std::vector<Tensor> out = {r.M, r.z};
          if (K > 0) {
            out.push_back(r.terminal_M);
            out.push_back(r.terminal_z);
          }
          return out;
        },
        x);
    EXPECT_LE(res.max_rel_error, tol::gradcheck_scan) << "K=" << K << "\n" << res.report;
  }
}

// --- bidirectional scan vs the single-rank op ---------------------------------------

void check_bidi(DType dt, uint64_t seed) {
  const int P = nranks(), r = rank();
  const int64_t F = 2;
  const ScanInputs g = make_scan_inputs(1, 2, 4, F * P, dt, seed);
  const std::vector<Tensor> wg = scan_weights(g, seed);

  std::vector<Tensor> xg;
  for (const Tensor& t : g.list()) xg.push_back(leaf(t));
  const std::vector<Tensor> ref = ops::bidi_scan(xg[0], xg[1], xg[2], xg[3], xg[4]);
  backward_weighted(ref, {wg[0], wg[1]});

  const ScanInputs l = block_of(g, F, r);
  std::vector<Tensor> xl;
  for (const Tensor& t : l.list()) xl.push_back(leaf(t));
  const std::vector<Tensor> out = cp::cp_bidi_scan(*world(), xl[0], xl[1], xl[2], xl[3], xl[4]);
  backward_weighted(out, {rank_block(wg[0], 1, F, r), rank_block(wg[1], 1, F, r)});

  EXPECT_TRUE(close_rel(out[0], rank_block(ref[0], 1, F, r), tol_fwd(dt), "M + M~")) << "rank " << r;
  EXPECT_TRUE(close_rel(out[1], rank_block(ref[1], 1, F, r), tol_fwd(dt), "z + z~")) << "rank " << r;
  const char* names[] = {"dP", "dA", "dPz", "dbz", "ddecay"};
  for (size_t k = 0; k < 5; ++k) {
    const Tensor expect = rank_block(xg[k].grad(), k < 4 ? 1 : 2, F, r);
    EXPECT_TRUE(close_rel(xl[k].grad(), expect, tol_grad(dt), names[k])) << "rank " << r;
  }
}

TEST(CpBidiScan, MatchesSingleRankOpF64) { check_bidi(DType::f64, 800); }
TEST(CpBidiScan, MatchesSingleRankOpF32) { check_bidi(DType::f32, 810); }

// --- camera branch -------------------------------------------------------------------

struct CamInputs {
  int64_t B = 1, H = 2, D = 4, F = 2, S = 3;
  Tensor q, k, v, beta, decay;
  std::vector<Tensor> list() const { return {q, k, v, beta, decay}; }
};

CamInputs make_cam_inputs(int64_t F, bool per_frame, DType dt, uint64_t seed) {
  CamInputs c;
  c.F = F;
  const int64_t N = F * c.S;
  c.q = Tensor::randn({c.B, c.H, c.D, N}, dt, Device::cpu, seed + 1);
  c.k = Tensor::randn({c.B, c.H, c.D, N}, dt, Device::cpu, seed + 2, 1.0 / std::sqrt(double(c.S * c.D)));
  c.v = Tensor::randn({c.B, c.H, c.D, N}, dt, Device::cpu, seed + 3);
  c.beta = per_frame ? Tensor::uniform({c.B, c.H, F}, dt, Device::cpu, seed + 4, 0.1, 0.9)
                     : Tensor::uniform({c.B, c.H, F, c.S}, dt, Device::cpu, seed + 4, 0.1, 0.9);
  c.decay = Tensor::uniform({c.B, c.H, F}, dt, Device::cpu, seed + 5, 0.5, 0.99);
  return c;
}

CamInputs cam_block(const CamInputs& g, int64_t F, int b) {
  CamInputs l = g;
  l.F = F;
  l.q = rank_block(g.q, 3, F * g.S, b);
  l.k = rank_block(g.k, 3, F * g.S, b);
  l.v = rank_block(g.v, 3, F * g.S, b);
  l.beta = rank_block(g.beta, 2, F, b);
  l.decay = rank_block(g.decay, 2, F, b);
  return l;
}

ScanRun run_cam(cp::Communicator& comm, const CamInputs& in, const cp::CpOptions& o, const std::vector<Tensor>& w,
                Checkpoint ck = Checkpoint::off) {
  std::vector<Tensor> x;
  for (const Tensor& t : in.list()) x.push_back(leaf(t));
  const cp::CamResult r = cp::cp_cam_gdn_num(comm, x[0], x[1], x[2], x[3], x[4], in.F, in.S, o, ck);
  ScanRun run;
  run.outs = {r.out};
  if (r.terminal_M.defined()) run.outs.push_back(r.terminal_M);
  backward_weighted(run.outs, w);
  for (const Tensor& t : x) run.grads.push_back(t.grad());
  return run;
}

void check_cam(DType dt, bool per_frame, const cp::CpOptions& o, uint64_t seed) {
  const int P = nranks(), r = rank();
  const int64_t F = 2;
  const CamInputs g = make_cam_inputs(F * P, per_frame, dt, seed);
  const int b = o.reverse_rank_order ? P - 1 - r : r;
  const Tensor w_out = Tensor::randn(g.q.shape(), dt, Device::cpu, seed + 21);
  const Tensor w_T = Tensor::randn({g.B * g.H, g.D, g.D}, dt, Device::cpu, seed + 22);
  std::vector<double> wTp = w_T.to_vector();
  for (double& e : wTp) e *= P;
  cp::CpOptions ref_opt = o;
  ref_opt.reverse_rank_order = false;
  const ScanRun ref = run_cam(*self(), g, ref_opt, {w_out, Tensor::from_vector(wTp, w_T.shape(), dt)});
  const ScanRun cp = run_cam(*world(), cam_block(g, F, b), o, {rank_block(w_out, 3, F * g.S, b), w_T});

  EXPECT_TRUE(close_rel(cp.outs[0], rank_block(ref.outs[0], 3, F * g.S, b), tol_fwd(dt), "out")) << "rank " << r;
  if (o.truncate_to_active > 0) {
    EXPECT_TRUE(close_rel(cp.outs[1], ref.outs[1], tol_fwd(dt), "terminal_M"));
  }
  const char* names[] = {"dq", "dk", "dv", "dbeta", "ddecay"};
  for (size_t k = 0; k < 5; ++k) {
    const Tensor expect = k < 3 ? rank_block(ref.grads[k], 3, F * g.S, b) : rank_block(ref.grads[k], 2, F, b);
    EXPECT_TRUE(close_rel(cp.grads[k], expect, tol_grad(dt), names[k])) << "rank " << r;
  }
}

TEST(CpCam, MatchesOneRankF64) { check_cam(DType::f64, false, {}, 900); }
TEST(CpCam, MatchesOneRankPerFrameBetaF32) { check_cam(DType::f32, true, {}, 910); }
TEST(CpCam, ReversedF64) { check_cam(DType::f64, false, reversed_ranks(), 920); }
TEST(CpCam, TruncatedF64) {
  cp::CpOptions o;
  o.truncate_to_active = 1;
  check_cam(DType::f64, true, o, 930);
  o.truncate_to_active = 2 * nranks();
  check_cam(DType::f64, false, o, 931);
}

TEST(CpCam, OneRankMatchesNaiveAndGradcheck) {
  const CamInputs c = make_cam_inputs(3, false, DType::f64, 950);
  // Naive: right-multiply form of the seed, S_t = S_{t−1} W + U, out = S q.
  const int64_t D = c.D, S = c.S, F = c.F, N = F * S, BH = c.B * c.H;
  const std::vector<double> q = c.q.to_vector(), k = c.k.to_vector(), v = c.v.to_vector(), be = c.beta.to_vector(),
                            g = c.decay.to_vector();
  std::vector<double> out(q.size());
  for (int64_t bh = 0; bh < BH; ++bh) {
    std::vector<double> St(static_cast<size_t>(D * D), 0.0);
    for (int64_t f = 0; f < F; ++f) {
      std::vector<double> W(static_cast<size_t>(D * D), 0.0), U(W.size(), 0.0);
      for (int64_t i = 0; i < D; ++i) W[static_cast<size_t>(i * D + i)] = 1.0;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t n = f * S + s;
        const double bb = be[static_cast<size_t>((bh * F + f) * S + s)];
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) {
            const double ki = k[static_cast<size_t>((bh * D + i) * N + n)],
                         kj = k[static_cast<size_t>((bh * D + j) * N + n)];
            W[static_cast<size_t>(i * D + j)] -= bb * ki * kj;
            U[static_cast<size_t>(i * D + j)] += bb * v[static_cast<size_t>((bh * D + i) * N + n)] * kj;
          }
      }
      std::vector<double> S2(St.size(), 0.0);
      for (int64_t i = 0; i < D; ++i)
        for (int64_t j = 0; j < D; ++j) {
          double s = 0;
          for (int64_t m = 0; m < D; ++m) s += St[static_cast<size_t>(i * D + m)] * W[static_cast<size_t>(m * D + j)];
          S2[static_cast<size_t>(i * D + j)] =
              g[static_cast<size_t>(bh * F + f)] * s + U[static_cast<size_t>(i * D + j)];
        }
      St = S2;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t n = f * S + s;
        for (int64_t i = 0; i < D; ++i) {
          double acc = 0;
          for (int64_t m = 0; m < D; ++m)
            acc += St[static_cast<size_t>(i * D + m)] * q[static_cast<size_t>((bh * D + m) * N + n)];
          out[static_cast<size_t>((bh * D + i) * N + n)] = acc;
        }
      }
    }
  }
  const cp::CamResult r = cp::cp_cam_gdn_num(*self(), c.q, c.k, c.v, c.beta, c.decay, F, S);
  EXPECT_TRUE(close_rel(r.out, Tensor::from_vector(out, c.q.shape(), DType::f64), tol::f64_scan, "cam out vs naive"));

  std::vector<Tensor> x = c.list();
  for (Tensor& t : x) t.requires_grad_(true);
  const GradcheckResult res = gradcheck(
      [&](const std::vector<Tensor>& y) {
        cp::CpOptions o;
        o.truncate_to_active = 2;
        const cp::CamResult rr = cp::cp_cam_gdn_num(*self(), y[0], y[1], y[2], y[3], y[4], F, S, o);
        return std::vector<Tensor>{rr.out, rr.terminal_M};
      },
      x);
  EXPECT_LE(res.max_rel_error, tol::gradcheck_scan) << res.report;
}

// Checkpointing: bitwise the same, and the recompute issues no collective.
TEST(CpCam, CheckpointOnEqualsOffBitwise) {
  const int P = nranks(), r = rank();
  const CamInputs g = make_cam_inputs(2 * P, false, DType::f64, 970);
  const CamInputs l = cam_block(g, 2, r);
  const Tensor w = rank_block(Tensor::randn(g.q.shape(), DType::f64, Device::cpu, 971), 3, 2 * g.S, r);
  world()->reset_stats();
  const ScanRun off = run_cam(*world(), l, {}, {w}, Checkpoint::off);
  const int64_t calls_off = world()->stats().calls;
  world()->reset_stats();
  const ScanRun on = run_cam(*world(), l, {}, {w}, Checkpoint::on);
  const int64_t calls_on = world()->stats().calls;
  EXPECT_TRUE(bitwise_equal(on.outs[0], off.outs[0]));
  for (size_t k = 0; k < 5; ++k) EXPECT_TRUE(bitwise_equal(on.grads[k], off.grads[k])) << "grad " << k;
  // validation + forward gather + backward gather (P > 1), or validation only.
  EXPECT_EQ(calls_off, P > 1 ? 3 : 1);
  EXPECT_EQ(calls_on, calls_off);
}

// --- bad arguments and cross-rank mismatches -----------------------------------------

TEST(CpScanErrors, HeadDimDiffersBetweenRanks) {
  if (nranks() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ScanInputs in = make_scan_inputs(1, 2, rank() == nranks() - 1 ? 4 : 3, 2, DType::f64, 1010);
  expect_all_throw([&] { cp::cp_scan(*world(), in.P, in.A, in.Pz, in.bz, in.decay); }, "D differs");
}

TEST(CpScanErrors, BatchHeadsDifferBetweenRanks) {
  if (nranks() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ScanInputs in = make_scan_inputs(1, rank() == 0 ? 3 : 2, 3, 2, DType::f64, 1020);
  expect_all_throw([&] { cp::cp_scan(*world(), in.P, in.A, in.Pz, in.bz, in.decay); }, "H differs");
}

TEST(CpScanErrors, DtypeDiffersBetweenRanks) {
  if (nranks() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ScanInputs in = make_scan_inputs(1, 2, 3, 2, rank() == 1 ? DType::f32 : DType::f64, 1030);
  expect_all_throw([&] { cp::cp_scan(*world(), in.P, in.A, in.Pz, in.bz, in.decay); }, "dtype differs");
}

TEST(CpScanErrors, BadShapeOnOneRank) {
  const ScanInputs in = make_scan_inputs(1, 2, 3, 2, DType::f64, 1040);
  const bool bad = rank() == nranks() - 1;
  const Tensor bz = bad ? Tensor::randn({2, 2, 4}, DType::f64, Device::cpu, 1) : in.bz;
  expect_all_throw([&] { cp::cp_scan(*world(), in.P, in.A, in.Pz, bz, in.decay); }, "bz",
                   "bad argument on rank " + std::to_string(nranks() - 1));
}

TEST(CpScanErrors, TruncateOutOfRangeOrReversed) {
  const ScanInputs in = make_scan_inputs(1, 2, 3, 2, DType::f64, 1050);
  for (int64_t K : {int64_t(-1), int64_t(2 * nranks() + 1)}) {
    cp::CpOptions o;
    o.truncate_to_active = K;
    expect_all_throw([&] { cp::cp_scan(*world(), in.P, in.A, in.Pz, in.bz, in.decay, o); }, "truncate_to_active");
  }
  cp::CpOptions o;
  o.truncate_to_active = 1;
  o.reverse_rank_order = true;
  expect_all_throw([&] { cp::cp_scan(*world(), in.P, in.A, in.Pz, in.bz, in.decay, o); }, "reverse_rank_order");
  // Only one rank asks for truncation: a cross-rank mismatch.
  if (nranks() > 1) {
    cp::CpOptions o1;
    o1.truncate_to_active = rank() == 0 ? 1 : 0;
    expect_all_throw([&] { cp::cp_scan(*world(), in.P, in.A, in.Pz, in.bz, in.decay, o1); },
                     "truncate_to_active differs");
  }
}

TEST(CpCamErrors, BadArguments) {
  const CamInputs c = make_cam_inputs(2, false, DType::f64, 1060);
  // N ≠ F·S on every rank.
  expect_all_throw([&] { cp::cp_cam_gdn_num(*world(), c.q, c.k, c.v, c.beta, c.decay, 2, c.S + 1); }, "F·S");
  // k of a different shape on rank 0 only.
  const Tensor k0 = rank() == 0 ? Tensor::randn({1, 2, 4, 5}, DType::f64, Device::cpu, 3) : c.k;
  expect_all_throw([&] { cp::cp_cam_gdn_num(*world(), c.q, k0, c.v, c.beta, c.decay, 2, c.S); },
                   "k:", "bad argument on rank 0");
}

// After all the errors above the communicator still works.
TEST(CpScanErrors, CommunicatorUsableAfterErrors) { check_scan_against_one_rank(DType::f64, {}, 1100); }

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
