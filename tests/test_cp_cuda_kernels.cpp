// tests/test_cp_cuda_kernels.cpp — every CUDA twin of the CP kernels (src/kernels/cp_kernels.h:
// the sweeps, transition gradients, corrections, folds and the camera branch's kernels) against
// its CPU twin, outputs poisoned first: within tol::f32 and fully written. One process, no
// communicator (so compute-sanitizer sees these kernels alone: scripts/gpu.sh sanitize, with
// GDNCP_TEST_SMALL=1 for the smaller shapes); skips without a GPU, and holds no test where gdncp
// is built without CUDA (the cuda:: twins exist only there).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "gdncp/gdncp.h"
#include "kernels/cp_kernels.h"
#include "util/test_util.h"
#include "util/tolerance.h"

#if GDNCP_WITH_CUDA
namespace gdncp {
namespace test {
namespace {

Tensor gpu(const Tensor& t) { return t.defined() ? t.to(Device::cuda) : Tensor(); }
Tensor cpu(const Tensor& t) { return t.defined() ? t.to(Device::cpu) : Tensor(); }
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
  REQUIRE_GPU();
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
  REQUIRE_GPU();
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
// a narrow sweep in one batch, a correction over many (b·h, t), and a fold over many
// (b·h, slice) blocks (src/kernels/scan/fold.cu, Note [fold slices]). GDNCP_TEST_SMALL=1 (under
// compute-sanitizer) keeps the smaller B·H of each.
TEST(CudaTwins, ScanKernelsManySlicesMatchCpu) {
  REQUIRE_GPU();
  const int64_t D = 112, F = 3;
  for (const int64_t BH : small_only() ? std::vector<int64_t>{80} : std::vector<int64_t>{80, 160}) {
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
  {  // a correction over 40·4 (b·h, t); a fold over 2 "ranks" with B·H = 160 (40 small).
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
    const int64_t BHf = small_only() ? 40 : 160, per = BHf * D * D * 2;
    const Tensor buf = rnd({2 * per}, 73, 0.05), init = rnd({BHf, D, D}, 74);
    Tensor Xf[2];
    for (int g = 0; g < 2; ++g) {
      Xf[g] = poisoned({BHf, D, D}, g ? Device::cuda : Device::cpu);
      const Tensor b = g ? gpu(buf) : buf;
      run_fold(g, fold_of(Xf[g], g ? gpu(init) : init, b, per, true, b, BHf * D * D, {1, 0}, D), BHf, D);
    }
    EXPECT_FALSE(has_nonfinite(cpu(Xf[1])));
    EXPECT_TRUE(close_rel(cpu(Xf[1]), Xf[0], test::tol::f32, "fold B*H=" + std::to_string(BHf)));
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
  REQUIRE_GPU();
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
  REQUIRE_GPU();
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
  REQUIRE_GPU();
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
  REQUIRE_GPU();
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
  REQUIRE_GPU();
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

}  // namespace
}  // namespace test
}  // namespace gdncp
#endif
