// tests/mpi_test_cp_gpu.cpp — the CP kernels and layers on GPUs with NCCL.
// Skips cleanly when gdncp has no CUDA or there are fewer GPUs than ranks.
//   - every CUDA twin of src/cp against its CPU twin (outputs poisoned first);
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
#include "kernels/cp_kernels.h"
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

// --- CUDA twins vs CPU twins -------------------------------------------------------------

#if GDNCP_WITH_CUDA  // the cuda:: twins exist only in CUDA builds
Tensor rnd(const Shape& s, uint64_t seed, double sd = 1.0) {
  return Tensor::randn(s, DType::f32, Device::cpu, seed, sd);
}
// A sweep of BH scans of D×E states over F frames, none frozen.
cp::SweepSpec sweep_spec(int64_t BH, int64_t F, int64_t D, int64_t E) {
  cp::SweepSpec s;
  s.BH = BH;
  s.F = F;
  s.D = D;
  s.E = E;
  s.active = F;
  return s;
}
Tensor poisoned(const Shape& s, Device dev) {
  Tensor t = Tensor::empty(s, DType::f32, dev);
  poison(t);
  return t;
}
// A fold over the ranks `order` of buffers laid out rank after rank (a rank's slice `stride`
// elements; its M at 0, its h at h_off), from init.
cp::Fold fold_of(const Tensor& X, const Tensor& init, const Tensor& Mbuf, int64_t stride, bool transpose,
                 const Tensor& Hbuf, int64_t h_off, std::vector<int> order, int64_t E) {
  cp::Fold f;
  f.X = X;
  f.init = init;
  f.Mbuf = Mbuf;
  f.m_stride = f.h_stride = stride;
  f.transpose = transpose;
  f.Hbuf = Hbuf;
  f.h_off = h_off;
  f.E = E;
  f.order = std::move(order);
  return f;
}
// One fold by the CUDA twin (cuda) or the CPU one.
void run_fold(bool cuda, const cp::Fold& f, int64_t BH, int64_t D) {
  std::vector<cp::Fold> one = {f};
  if (cuda)
    cp::cuda::folds(one, BH, D);
  else
    cp::cpu::folds(one, BH, D);
}

TEST(CudaTwins, ScanSweepMatchesCpu) {
  REQUIRE_NCCL_WORLD();
  struct Case {
    int64_t D, E;
  };
  for (const Case c : {Case{5, 5}, Case{5, 1}, Case{16, 16}, Case{112, 112}, Case{112, 1}, Case{128, 128}}) {
    const int64_t BH = 3, F = 4, D = c.D, E = c.E;
    const Tensor P = rnd({BH, F, D, D}, 1, 0.5 / D), V = rnd({BH, F, D, E}, 2), U = rnd({BH, F, D, E}, 3);
    const Tensor X0 = rnd({BH, D, E}, 4);
    const Tensor decay = Tensor::uniform({1, BH, F}, DType::f32, Device::cpu, 5, 0.5, 0.99);
    for (int mode = 0; mode < 4; ++mode) {
      cp::SweepSpec s = sweep_spec(BH, F, D, E);
      // 0: forward scan from X0 with 1 frozen frame; 1: anti-causal scan; 2: forward adjoint; 3: composite from I
      s.descending = mode == 1 || mode == 2;
      s.transpose = mode == 2;
      s.init = mode == 3 ? (E == D ? cp::Init::identity : cp::Init::zero) : cp::Init::given;
      if (mode == 0 || mode == 2) s.active = F - 1;
      const bool use_vb = mode == 2, use_ua = mode != 2, use_ob = mode == 1 || mode == 2, use_oa = mode == 0;
      Tensor res[2][3];
      for (int g = 0; g < 2; ++g) {
        const Device dev = g ? Device::cuda : Device::cpu;
        auto mv = [&](const Tensor& t) { return g ? gpu(t) : t; };
        Tensor ob = use_ob ? poisoned({BH, F, D, E}, dev) : Tensor();
        Tensor oa = use_oa ? poisoned({BH, F, D, E}, dev) : Tensor();
        Tensor fin = poisoned({BH, D, E}, dev);
        const Tensor p = mv(P), dc = mv(decay), vb = use_vb ? mv(V) : Tensor(), ua = use_ua ? mv(U) : Tensor(),
                     x0 = mv(X0);
        if (g)
          cp::cuda::scan_sweep(ob, oa, fin, p, dc, vb, ua, x0, s);
        else
          cp::cpu::scan_sweep(ob, oa, fin, p, dc, vb, ua, x0, s);
        res[g][0] = cpu(ob);
        res[g][1] = cpu(oa);
        res[g][2] = cpu(fin);
      }
      const std::string what = "D=" + std::to_string(D) + " E=" + std::to_string(E) + " mode " + std::to_string(mode);
      for (int k = 0; k < 3; ++k) {
        if (!res[0][k].defined()) continue;
        EXPECT_FALSE(has_nonfinite(res[1][k])) << what << " output " << k << " not fully written";
        EXPECT_TRUE(close_rel(res[1][k], res[0][k], test::tol::f32, what));
      }
    }
  }
}

// A final state written into a pack at an offset that is not 16-byte aligned (a Z job's
// B·H·D elements before it, B·H·D % 4 != 0): the sweep writes exactly its elements
// (src/kernels/scan/scan_sweep.cu; an offset that is not 8-byte aligned either, which moves the
// state accesses from float2 to scalar, is in CudaTwins.ScanCoreSweepVariants).
TEST(CudaTwins, ScanSweepUnalignedPackOffset) {
  REQUIRE_NCCL_WORLD();
  const int64_t BH = 3, F = 3, D = 16, E = 16, off = 2, n = BH * D * E;
  const Tensor P = rnd({BH, F, D, D}, 80, 0.5 / D), U = rnd({BH, F, D, E}, 81);
  const Tensor decay = Tensor::uniform({1, BH, F}, DType::f32, Device::cpu, 82, 0.5, 0.99);
  Tensor pack[2], states[2];
  for (int g = 0; g < 2; ++g) {
    const Device dev = g ? Device::cuda : Device::cpu;
    std::vector<cp::Sweep> sw(1);
    sw[0].P = g ? gpu(P) : P;
    sw[0].add_after = g ? gpu(U) : U;
    sw[0].out_after = poisoned({BH, F, D, E}, dev);
    sw[0].final_state = poisoned({off + n + 1}, dev);
    sw[0].final_offset = off;
    sw[0].spec = cp::SweepSpec{BH, F, D, E, false, false, cp::Init::zero, F};
    if (g)
      cp::cuda::scan_sweeps(sw, gpu(decay));
    else
      cp::cpu::scan_sweeps(sw, decay);
    pack[g] = cpu(sw[0].final_state);
    states[g] = cpu(sw[0].out_after);
  }
  EXPECT_TRUE(close_rel(states[1], states[0], test::tol::f32, "states"));
  const std::vector<double> a = pack[1].to_vector(), b = pack[0].to_vector();
  for (int64_t i = 0; i < off + n + 1; ++i) {
    const bool inside = i >= off && i < off + n;
    EXPECT_EQ(std::isfinite(a[static_cast<size_t>(i)]), inside) << "pack element " << i;
    if (inside) {
      const double want = b[static_cast<size_t>(i)];
      EXPECT_NEAR(a[static_cast<size_t>(i)], want, test::tol::f32 * (1 + std::fabs(want))) << "pack element " << i;
    }
  }
}

// Large B·H: many column blocks of the sweeps (src/kernels/scan/scan_sweep.cu) with a wide and
// a narrow sweep in one batch, a correction over many (b·h, t), and a fold whose launch puts
// 2 and 4 state slices (warps) in one block, sharing the staged transitions, with idle warps
// where D/8 slices do not divide (src/kernels/scan/fold.cu, Note [fold slices]).
TEST(CudaTwins, ScanKernelsManySlicesMatchCpu) {
  REQUIRE_NCCL_WORLD();
  const int64_t D = 112, F = 3;
  for (const int64_t BH : {int64_t(80), int64_t(160)}) {
    const Tensor P = rnd({BH, F, D, D}, 60, 0.5 / D), U = rnd({BH, F, D, D}, 61), u = rnd({BH, F, D, 1}, 62);
    const Tensor X0 = rnd({BH, D, D}, 63);
    const Tensor decay = Tensor::uniform({1, BH, F}, DType::f32, Device::cpu, 64, 0.5, 0.99);
    Tensor res[2][4];
    for (int g = 0; g < 2; ++g) {
      const Device dev = g ? Device::cuda : Device::cpu;
      auto mv = [&](const Tensor& t) { return g ? gpu(t) : t; };
      std::vector<cp::Sweep> sw(2);
      // A forward scan from X0 (one frozen frame) and a transposed, descending narrow one.
      sw[0].P = sw[1].P = mv(P);
      sw[0].add_after = mv(U);
      sw[0].init = mv(X0);
      sw[0].out_after = poisoned({BH, F, D, D}, dev);
      sw[0].final_state = poisoned({BH, D, D}, dev);
      sw[0].spec = cp::SweepSpec{BH, F, D, D, false, false, cp::Init::given, F - 1};
      sw[1].add_before = mv(u);
      sw[1].out_before = poisoned({BH, F, D, 1}, dev);
      sw[1].final_state = poisoned({BH, D, 1}, dev);
      sw[1].spec = cp::SweepSpec{BH, F, D, 1, true, true, cp::Init::zero, F};
      const Tensor dc = mv(decay);
      if (g)
        cp::cuda::scan_sweeps(sw, dc);
      else
        cp::cpu::scan_sweeps(sw, dc);
      res[g][0] = cpu(sw[0].out_after);
      res[g][1] = cpu(sw[0].final_state);
      res[g][2] = cpu(sw[1].out_before);
      res[g][3] = cpu(sw[1].final_state);
    }
    for (int k = 0; k < 4; ++k) {
      const std::string what = "B*H=" + std::to_string(BH) + " output " + std::to_string(k);
      EXPECT_FALSE(has_nonfinite(res[1][k])) << what << " not fully written";
      EXPECT_TRUE(close_rel(res[1][k], res[0][k], test::tol::f32, what));
    }
  }
  {  // 40·4 (b·h, t) × 7 slices: 4 warps per block; and a fold over 2 "ranks" with B·H = 160.
    const int64_t BH = 40, Fc = 4;
    const Tensor X = rnd({BH, Fc, D, D}, 70), C = rnd({BH, Fc, D, D}, 71, 0.3), v = rnd({BH, D, D}, 72);
    Tensor got[2];
    for (int g = 0; g < 2; ++g) {
      std::vector<cp::Correction> cs{cp::Correction{g ? gpu(X) : X.clone(), g ? gpu(C) : C, g ? gpu(v) : v, D}};
      if (g)
        cp::cuda::scan_correct(cs, BH, Fc, D);
      else
        cp::cpu::scan_correct(cs, BH, Fc, D);
      got[g] = cpu(cs[0].X);
    }
    EXPECT_TRUE(close_rel(got[1], got[0], test::tol::f32, "correct B*H=40 F=4"));
    const int64_t BHf = 160, per = BHf * D * D * 2;
    const Tensor buf = rnd({2 * per}, 73, 0.05), init = rnd({BHf, D, D}, 74);
    Tensor Xf[2];
    for (int g = 0; g < 2; ++g) {
      Xf[g] = poisoned({BHf, D, D}, g ? Device::cuda : Device::cpu);
      const Tensor b = g ? gpu(buf) : buf;
      run_fold(g, fold_of(Xf[g], g ? gpu(init) : init, b, per, true, b, BHf * D * D, {1, 0}, D), BHf, D);
    }
    EXPECT_FALSE(has_nonfinite(cpu(Xf[1])));
    EXPECT_TRUE(close_rel(cpu(Xf[1]), Xf[0], test::tol::f32, "fold B*H=160"));
  }
}

// scan_grad_outer on CPU and on CUDA from the same dP0 and dg0 (dP0 poisoned
// unless accumulating; R0 unused when shifted; cuts: the clip mask, or
// undefined): the CUDA dP fully written, dP and dg within tol::f32 of the CPU.
void expect_grad_outer_twins(const Tensor& dP0, const Tensor& dg0, const Tensor& L, const Tensor& R, const Tensor& R0,
                             const Tensor& P, const Tensor& decay, const cp::SweepSpec& s, bool shifted, bool acc,
                             const Tensor& cuts, const std::string& what) {
  Tensor out[2][2];
  for (int g = 0; g < 2; ++g) {
    Tensor dP = g ? gpu(dP0) : dP0.clone(), dg = g ? gpu(dg0) : dg0.clone();
    if (!acc) poison(dP);
    if (g)
      cp::cuda::scan_grad_outer(dP, dg, gpu(L), gpu(R), shifted ? Tensor() : gpu(R0), gpu(P), gpu(decay), s, shifted,
                                acc, gpu(cuts));
    else
      cp::cpu::scan_grad_outer(dP, dg, L, R, shifted ? Tensor() : R0, P, decay, s, shifted, acc, cuts);
    out[g][0] = cpu(dP);
    out[g][1] = cpu(dg);
  }
  EXPECT_FALSE(has_nonfinite(out[1][0])) << what;
  EXPECT_TRUE(close_rel(out[1][0], out[0][0], test::tol::f32, what + " dP"));
  EXPECT_TRUE(close_rel(out[1][1], out[0][1], test::tol::f32, what + " dg"));
}

TEST(CudaTwins, GradOuterAndFoldMatchCpu) {
  REQUIRE_NCCL_WORLD();
  for (const int64_t D : {int64_t(7), int64_t(112)})
    for (const int64_t E : {int64_t(1), D}) {
      const int64_t BH = 2, F = 3;
      const Tensor L = rnd({BH, F, D, E}, 10), R = rnd({BH, F, D, E}, 11), R0 = rnd({BH, D, E}, 12),
                   P = rnd({BH, F, D, D}, 13, 0.3);
      const Tensor decay = Tensor::uniform({1, BH, F}, DType::f32, Device::cpu, 14, 0.5, 0.99);
      const Tensor dP0 = rnd({BH, F, D, D}, 15), dg0 = rnd({BH, F}, 16);
      for (int variant = 0; variant < 3; ++variant) {
        cp::SweepSpec s = sweep_spec(BH, F, D, E);
        s.active = variant == 2 ? 2 : F;
        const bool shifted = variant == 1, acc = variant != 0;
        expect_grad_outer_twins(
            dP0, dg0, L, R, R0, P, decay, s, shifted, acc, Tensor(),
            "outer D=" + std::to_string(D) + " E=" + std::to_string(E) + " v" + std::to_string(variant));
      }
      // fold over 3 "ranks" in the order 2, 0, 1, plain and transposed, and with identity M.
      const int64_t per = BH * D * D + BH * D * E;
      const Tensor buf = rnd({3 * per}, 17, 0.4), init = rnd({BH, D, E}, 18);
      for (int variant = 0; variant < 3; ++variant) {
        Tensor X[2];
        for (int g = 0; g < 2; ++g) {
          X[g] = poisoned({BH, D, E}, g ? Device::cuda : Device::cpu);
          const Tensor b = g ? gpu(buf) : buf;
          const Tensor M = variant == 2 ? Tensor() : b;
          run_fold(g, fold_of(X[g], g ? gpu(init) : init, M, per, variant == 1, b, BH * D * D, {2, 0, 1}, E), BH, D);
        }
        EXPECT_TRUE(close_rel(cpu(X[1]), X[0], test::tol::f32, "fold v" + std::to_string(variant)));
      }
    }
}

TEST(CudaTwins, CorrectionMatchesCpu) {
  REQUIRE_NCCL_WORLD();
  for (const int64_t D : {int64_t(9), int64_t(112), int64_t(128)}) {
    const int64_t BH = 3, F = 5;
    std::vector<Tensor> X0, C, v;
    for (const int64_t E : {D, int64_t(1)}) {
      X0.push_back(rnd({BH, F, D, E}, 40 + E));
      C.push_back(rnd({BH, F, D, D}, 41, 0.3));
      v.push_back(rnd({BH, D, E}, 42 + E));
    }
    Tensor out[2][2];
    for (int g = 0; g < 2; ++g) {
      std::vector<cp::Correction> cs;
      for (size_t k = 0; k < 2; ++k) {
        out[g][k] = g ? gpu(X0[k]) : X0[k].clone();
        cs.push_back(cp::Correction{out[g][k], g ? gpu(C[k]) : C[k], g ? gpu(v[k]) : v[k], k == 0 ? D : 1});
      }
      if (g)
        cp::cuda::scan_correct(cs, BH, F, D);
      else
        cp::cpu::scan_correct(cs, BH, F, D);
    }
    for (size_t k = 0; k < 2; ++k)
      EXPECT_TRUE(close_rel(cpu(out[1][k]), out[0][k], test::tol::f32,
                            "correct D=" + std::to_string(D) + " E" + std::to_string(k)));
  }
}

TEST(CudaTwins, CameraKernelsMatchCpu) {
  REQUIRE_NCCL_WORLD();
  for (const bool per_frame : {false, true})
    for (const DType dt : {DType::f32, DType::bf16}) {
      cp::CamDims d;
      d.B = 1;
      d.H = 2;
      d.D = 112;
      d.F = 2;
      d.S = 37;  // not a multiple of the 16-token tile
      d.beta_per_frame = per_frame;
      const int64_t BH = d.BH(), D = d.D, N = d.N();
      const Tensor q = Tensor::randn({1, 2, D, N}, dt, Device::cpu, 20),
                   k = Tensor::randn({1, 2, D, N}, dt, Device::cpu, 21, 0.02),
                   v = Tensor::randn({1, 2, D, N}, dt, Device::cpu, 22);
      const Tensor beta = per_frame ? Tensor::uniform({1, 2, d.F}, dt, Device::cpu, 23, 0.1, 0.9)
                                    : Tensor::uniform({1, 2, d.F, d.S}, dt, Device::cpu, 23, 0.1, 0.9);
      const Tensor M = rnd({BH, d.F, D, D}, 24), dPc = rnd({BH, d.F, D, D}, 25), dAc = rnd({BH, d.F, D, D}, 26);
      const Tensor dout = Tensor::randn({1, 2, D, N}, dt, Device::cpu, 27);
      std::vector<Tensor> res[2];
      for (int g = 0; g < 2; ++g) {
        const Device dev = g ? Device::cuda : Device::cpu;
        auto mv = [&](const Tensor& t) { return g ? gpu(t) : t; };
        Tensor Pc = poisoned({BH, d.F, D, D}, dev), Ac = poisoned({BH, d.F, D, D}, dev);
        Tensor out = Tensor::empty(q.shape(), dt, dev), dq = Tensor::empty(q.shape(), dt, dev);
        Tensor dk = Tensor::empty(q.shape(), dt, dev), dv = Tensor::empty(q.shape(), dt, dev);
        Tensor db = Tensor::empty(beta.shape(), dt, dev), dM = poisoned({BH, d.F, D, D}, dev);
        for (Tensor* t : {&out, &dq, &dk, &dv, &db}) poison(*t);
        if (g) {
          cp::cuda::cam_phase_a_fwd(Pc, Ac, mv(k), mv(v), mv(beta), d);
          cp::cuda::cam_phase_a_bwd(dk, dv, db, mv(dPc), mv(dAc), mv(k), mv(v), mv(beta), d);
          cp::cuda::cam_out_fwd(out, mv(q), mv(M), d);
          cp::cuda::cam_out_bwd(dq, dM, mv(dout), mv(q), mv(M), d);
        } else {
          cp::cpu::cam_phase_a_fwd(Pc, Ac, k, v, beta, d);
          cp::cpu::cam_phase_a_bwd(dk, dv, db, dPc, dAc, k, v, beta, d);
          cp::cpu::cam_out_fwd(out, q, M, d);
          cp::cpu::cam_out_bwd(dq, dM, dout, q, M, d);
        }
        for (const Tensor& t : {Pc, Ac, out, dq, dk, dv, db, dM}) res[g].push_back(cpu(t));
      }
      const char* names[] = {"Pc", "Ac", "out", "dq", "dk", "dv", "dbeta", "dM"};
      // f32 arithmetic on both sides; bf16-stored outputs differ by one rounding at most.
      const double tol = dt == DType::bf16 ? test::tol::bf16_vs_f64 : test::tol::f32;
      for (size_t i = 0; i < res[0].size(); ++i) {
        EXPECT_FALSE(has_nonfinite(res[1][i])) << names[i];
        EXPECT_TRUE(close_rel(res[1][i], res[0][i], tol, std::string(names[i]) + (per_frame ? " per-frame" : "")));
      }
    }
}

// Clip cuts (Note [clip cuts]): every sweep kind with a mask cutting before and
// after the step, rows with different masks (B = 2, H = 2), and the sweep of a
// rank with no frame (F = 0: the final state is the initial one).
TEST(CudaTwins, ScanSweepClipCutsMatchCpu) {
  REQUIRE_NCCL_WORLD();
  const int64_t B = 2, H = 2, BH = B * H;
  for (const int64_t D : {int64_t(5), int64_t(16), int64_t(112)})
    for (const int64_t E : {D, int64_t(1)})
      for (const int64_t F : {int64_t(0), int64_t(5)}) {
        const int64_t Fa = std::max<int64_t>(F, 1);  // inputs of F = 0 stay allocatable
        const Tensor P = rnd({BH, Fa, D, D}, 30, 0.5 / D), V = rnd({BH, Fa, D, E}, 31), U = rnd({BH, Fa, D, E}, 32);
        const Tensor X0 = rnd({BH, D, E}, 33);
        const Tensor decay = Tensor::uniform({B, H, F}, DType::f32, Device::cpu, 34, 0.5, 0.99);
        std::vector<double> c(static_cast<size_t>(B * F), 0.0);
        for (int64_t f = 0; f < F; ++f) {
          c[static_cast<size_t>(f)] = f == 2 ? 1.0 : 0.0;                          // row 0: one start inside
          c[static_cast<size_t>(F + f)] = f == 0 || f == 3 || f == 4 ? 1.0 : 0.0;  // row 1: first frame, 1-frame clip
        }
        const Tensor cuts = Tensor::from_vector(c, {B, F}, DType::f32);
        for (int mode = 0; mode < 4; ++mode)
          for (const cp::Cut cut : {cp::Cut::before, cp::Cut::after}) {
            cp::SweepSpec s = sweep_spec(BH, F, D, E);
            s.H = H;
            s.cut = cut;
            s.active = mode == 0 ? std::max<int64_t>(F - 1, 0) : F;  // a frozen frame ignores its cut
            s.descending = mode == 1 || mode == 2;
            s.transpose = mode == 2;
            s.init = mode == 3 ? (E == D ? cp::Init::identity : cp::Init::zero) : cp::Init::given;
            const bool use_vb = mode == 2, use_ua = mode != 2 && mode != 3, use_ob = mode == 1 || mode == 2,
                       use_oa = mode == 0 || mode == 3;
            Tensor res[2][3];
            for (int g = 0; g < 2; ++g) {
              const Device dev = g ? Device::cuda : Device::cpu;
              auto mv = [&](const Tensor& t) { return g ? gpu(t) : t; };
              auto part = [&](const Tensor& t) {
                return F == 0 ? Tensor::empty({BH, 0, D, t.size(3)}, DType::f32) : t;
              };
              Tensor ob = use_ob ? poisoned({BH, F, D, E}, dev) : Tensor();
              Tensor oa = use_oa ? poisoned({BH, F, D, E}, dev) : Tensor();
              Tensor fin = poisoned({BH, D, E}, dev);
              const Tensor p = mv(part(P)), dc = mv(decay), vb = use_vb ? mv(part(V)) : Tensor(),
                           ua = use_ua ? mv(part(U)) : Tensor(), x0 = mv(X0), cm = mv(cuts);
              if (g)
                cp::cuda::scan_sweep(ob, oa, fin, p, dc, vb, ua, x0, s, cm);
              else
                cp::cpu::scan_sweep(ob, oa, fin, p, dc, vb, ua, x0, s, cm);
              res[g][0] = cpu(ob);
              res[g][1] = cpu(oa);
              res[g][2] = cpu(fin);
            }
            const std::string what = "D=" + std::to_string(D) + " E=" + std::to_string(E) + " F=" + std::to_string(F) +
                                     " mode " + std::to_string(mode) + (cut == cp::Cut::before ? " before" : " after");
            for (int k = 0; k < 3; ++k) {
              if (!res[0][k].defined() || res[0][k].numel() == 0) continue;
              EXPECT_FALSE(has_nonfinite(res[1][k])) << what << " output " << k << " not fully written";
              EXPECT_TRUE(close_rel(res[1][k], res[0][k], test::tol::f32, what));
            }
          }
      }
}

// Frames cut by the mask get no transition gradient (dP = 0 or unchanged, dg unchanged).
TEST(CudaTwins, GradOuterClipCutsMatchCpu) {
  REQUIRE_NCCL_WORLD();
  const int64_t B = 2, H = 2, BH = B * H, F = 4;
  const std::vector<double> c = {0, 1, 0, 1, 1, 0, 0, 1};
  const Tensor cuts = Tensor::from_vector(c, {B, F}, DType::f32);
  for (const int64_t D : {int64_t(7), int64_t(112)})
    for (const int64_t E : {int64_t(1), D}) {
      const Tensor L = rnd({BH, F, D, E}, 40), R = rnd({BH, F, D, E}, 41), R0 = rnd({BH, D, E}, 42),
                   P = rnd({BH, F, D, D}, 43, 0.3);
      const Tensor decay = Tensor::uniform({B, H, F}, DType::f32, Device::cpu, 44, 0.5, 0.99);
      const Tensor dP0 = rnd({BH, F, D, D}, 45), dg0 = rnd({BH, F}, 46);
      for (int variant = 0; variant < 2; ++variant) {
        cp::SweepSpec s = sweep_spec(BH, F, D, E);
        s.H = H;
        const bool shifted = variant == 1, acc = variant == 1;
        expect_grad_outer_twins(dP0, dg0, L, R, R0, P, decay, s, shifted, acc, cuts,
                                "cut outer D=" + std::to_string(D) + " E=" + std::to_string(E));
      }
    }
}

#endif

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
