// bench/scan_bench.cpp — times the CUDA kernels of the CP scan (src/kernels/scan/scan_sweep.cu,
// src/kernels/scan/fold.cu) on the launches one forward and one backward of the bidirectional CP layer give them (the
// jobs KV fwd, Z fwd, KV anti, Z anti of cp_layers.cpp, batched as scan_engine.cpp batches them), at P = 1 (all frames
// on one rank), at P = 2 (rank 0's half) and for a middle rank of P > 2 on as many frames: the sequential sweeps, the
// corrections, a fold step and the transition gradients. One GPU, no communication. Prints per launch the median time
// (CUDA events, warm-up first) and, for sweeps, the time per frame step; a checksum of the P = 1 forward states lets
// two builds be compared.
//
//   scan_bench [--bh 20] [--dim 112] [--frames 22] [--warmup 3] [--iters 20]
//
// Built by bench/CMakeLists.txt (scripts/gpu.sh bench runs it): it links libgdncp, so the same
// binary times whichever scan kernels the library it loads was built with.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "gdncp/error.h"
#include "gdncp/tensor.h"
#include "kernels/cp_kernels.h"
#include "timing.h"

namespace gdncp {
namespace bench {
namespace {

using cp::Correction;
using cp::Fold;
using cp::Init;
using cp::OuterGroup;
using cp::OuterSource;
using cp::Sweep;
using cp::SweepSpec;

struct Cfg {
  int64_t BH = 20, D = 112, F = 22;  // F: the global frames (P = 2 runs F / 2 per rank)
  int warmup = 3, iters = 20;
};

Tensor rnd(const Shape& s, uint64_t seed, double sd) { return Tensor::randn(s, DType::f32, Device::cuda, seed, sd); }
Tensor out(const Shape& s) { return Tensor::empty(s, DType::f32, Device::cuda); }

// Median microseconds of f() over cfg.iters timed calls after cfg.warmup untimed ones.
double median_us(const Cfg& c, const std::function<void()>& f) { return 1e3 * time_ms(f, c.warmup, c.iters); }

// One scan of the layer (cp_layers.cpp layer_jobs) on F frames of one rank.
struct Job {
  int64_t E = 0;
  bool anti = false;
  Tensor P, U, Y, dY, dU, h, M, cum, rcum, X0, dX0;
};

// A sweep of job j's transitions over F frames of D×E states (none frozen):
// transposed for the backward sweeps, which run against the job's direction,
// and from the identity for the transition products.
Sweep sweep_of(const Cfg& c, int64_t F, const Job& j, int64_t E, bool backward, bool from_identity) {
  Sweep w;
  w.P = j.P;
  w.spec.BH = c.BH;
  w.spec.F = F;
  w.spec.D = c.D;
  w.spec.E = E;
  w.spec.active = F;
  w.spec.transpose = backward;
  w.spec.descending = backward ? !j.anti : j.anti;
  if (from_identity) w.spec.init = Init::identity;
  return w;
}

// The local sweep of a job (scan_engine.cpp, forward step 1); with_h: its final state too.
Sweep local_sweep(const Cfg& c, int64_t F, Job& j, bool with_h) {
  Sweep w = sweep_of(c, F, j, j.E, false, false);
  w.add_after = j.U;
  (j.anti ? w.out_before : w.out_after) = j.Y;
  if (with_h) w.final_state = j.h;
  return w;
}
// The composite sweep from I (with the cumulative products when `cum`).
Sweep composite_sweep(const Cfg& c, int64_t F, Job& j, bool cum) {
  Sweep w = sweep_of(c, F, j, c.D, false, true);
  w.final_state = j.M;
  if (cum) (j.anti ? w.out_before : w.out_after) = j.cum;
  return w;
}
// The adjoint sweep (backward step 1); with_dx0: its final state (the adjoint of X0).
Sweep adjoint_sweep(const Cfg& c, int64_t F, Job& j, bool with_dx0) {
  Sweep w = sweep_of(c, F, j, j.E, true, false);
  w.out_before = j.dU;
  if (with_dx0) w.final_state = j.dX0;
  (j.anti ? w.add_after : w.add_before) = j.dY;
  return w;
}
Sweep rcum_sweep(const Cfg& c, int64_t F, Job& j) {
  Sweep w = sweep_of(c, F, j, c.D, true, true);
  w.out_before = j.rcum;
  return w;
}

std::vector<Job> make_jobs(const Cfg& c, int64_t F, const Tensor& P, const Tensor& Pz, uint64_t seed) {
  const int64_t BH = c.BH, D = c.D;
  std::vector<Job> jobs(4);
  for (int k = 0; k < 4; ++k) {
    Job& j = jobs[static_cast<size_t>(k)];
    j.E = k % 2 == 0 ? D : 1;
    j.anti = k >= 2;
    j.P = k % 2 == 0 ? P : Pz;
    const Shape st = j.E == 1 ? Shape{BH, F, D} : Shape{BH, F, D, j.E};
    j.U = rnd(st, seed + 10 * k + 1, 1.0);
    j.dY = rnd(st, seed + 10 * k + 2, 1.0);
    j.Y = out(st);
    j.dU = out(st);
    j.h = out({BH, D, j.E});
    j.X0 = rnd({BH, D, j.E}, seed + 10 * k + 3, 1.0);
    j.dX0 = out({BH, D, j.E});
    j.M = out({BH, D, D});
    j.cum = out({BH, F, D, D});
    j.rcum = out({BH, F, D, D});
  }
  return jobs;
}

double checksum(const Tensor& t) {
  double s = 0;
  for (const double v : t.to(Device::cpu).to_vector()) s += std::fabs(v);
  return s;
}

struct Line {
  std::string name;
  int64_t frames = 0;  // sequential frame steps of the launch (0: not a sweep)
  double us = 0;
};

int run(const Cfg& c) {
  GDNCP_CHECK(cuda_device_count() >= 1, "scan_bench: no CUDA device");
  GDNCP_CHECK(c.F % 2 == 0 && c.F >= 2, "scan_bench: --frames must be even");
  const int64_t BH = c.BH, D = c.D, F1 = c.F, F2 = c.F / 2;
  const Tensor decay1 = Tensor::uniform({1, BH, F1}, DType::f32, Device::cuda, 7, 0.5, 0.99);
  const Tensor decay2 = Tensor::uniform({1, BH, F2}, DType::f32, Device::cuda, 8, 0.5, 0.99);
  const Tensor P1 = rnd({BH, F1, D, D}, 1, 0.5 / D), Pz1 = rnd({BH, F1, D, D}, 2, 0.5 / D);
  const Tensor P2 = rnd({BH, F2, D, D}, 3, 0.5 / D), Pz2 = rnd({BH, F2, D, D}, 4, 0.5 / D);
  std::vector<Job> one = make_jobs(c, F1, P1, Pz1, 100), two = make_jobs(c, F2, P2, Pz2, 200);
  std::vector<Line> lines;
  auto time = [&](const std::string& name, int64_t frames, const std::function<void()>& f) {
    lines.push_back(Line{name, frames, median_us(c, f)});
  };

  // P = 1: the local sweeps of the four jobs, then their adjoints.
  time("P=1 fwd sweeps (2 wide + 2 narrow)", F1, [&] {
    std::vector<Sweep> s;
    for (Job& j : one) s.push_back(local_sweep(c, F1, j, false));
    cp::cuda::scan_sweeps(s, decay1);
  });
  const double sum_y = checksum(one[0].Y) + checksum(one[2].Y), sum_z = checksum(one[1].Y) + checksum(one[3].Y);
  time("P=1 bwd sweeps (2 wide + 2 narrow)", F1, [&] {
    std::vector<Sweep> s;
    for (Job& j : one) s.push_back(adjoint_sweep(c, F1, j, false));
    cp::cuda::scan_sweeps(s, decay1);
  });
  const double sum_du = checksum(one[0].dU) + checksum(one[2].dU);

  // P = 2, rank 0: logical position 0 for the forward-order jobs, 1 for the anti ones, so each
  // direction is swept once (Note [rescan] in scan_engine.cpp): before the exchange the forward
  // jobs from zero (their h travels) and the anti jobs' adjoints (their dX0 travels), after it the
  // anti jobs from X0 and the forward jobs' adjoints from the arriving adjoint (X0 stands in).
  const auto from = [](Sweep w, const Tensor& init) {
    w.init = init;
    w.spec.init = Init::given;
    return w;
  };
  time("P=2 fwd sweeps before exchange (1w + 1n)", F2, [&] {
    std::vector<Sweep> s;
    for (Job& j : two)
      if (!j.anti) s.push_back(local_sweep(c, F2, j, true));
    cp::cuda::scan_sweeps(s, decay2);
  });
  time("P=2 fwd sweeps from X0 (1w + 1n)", F2, [&] {
    std::vector<Sweep> s;
    for (Job& j : two)
      if (j.anti) s.push_back(from(local_sweep(c, F2, j, false), j.X0));
    cp::cuda::scan_sweeps(s, decay2);
  });
  time("P=2 bwd sweeps before exchange (1w + 1n)", F2, [&] {
    std::vector<Sweep> s;
    for (Job& j : two)
      if (j.anti) s.push_back(adjoint_sweep(c, F2, j, true));
    cp::cuda::scan_sweeps(s, decay2);
  });
  time("P=2 bwd sweeps from the adjoint (1w + 1n)", F2, [&] {
    std::vector<Sweep> s;
    for (Job& j : two)
      if (!j.anti) s.push_back(from(adjoint_sweep(c, F2, j, false), j.X0));
    cp::cuda::scan_sweeps(s, decay2);
  });

  // A middle rank of P > 2 (both directions corrected, every M travels; z rescans from X0 and
  // its adjoint reruns, Note [rescan]), on the same frames.
  time("P>2 mid fwd sweeps (6 wide + 2 narrow)", F2, [&] {
    std::vector<Sweep> s;
    for (Job& j : two) {
      s.push_back(composite_sweep(c, F2, j, /*cum=*/j.E > 1));
      s.push_back(local_sweep(c, F2, j, true));
    }
    cp::cuda::scan_sweeps(s, decay2);
  });
  time("P>2 mid bwd sweeps (4 wide + 2 narrow)", F2, [&] {
    std::vector<Sweep> s;
    for (Job& j : two) {
      s.push_back(adjoint_sweep(c, F2, j, /*dX0=*/true));
      if (j.E > 1) s.push_back(rcum_sweep(c, F2, j));
    }
    cp::cuda::scan_sweeps(s, decay2);
  });
  time("P>2 mid fwd corrections (KV, both)", 0, [&] {
    std::vector<Correction> cs;
    for (Job& j : two)
      if (j.E > 1) cs.push_back(Correction{j.Y, j.cum, j.X0, j.E});
    cp::cuda::scan_correct(cs, BH, F2, D);
  });
  time("P>2 mid bwd corrections (KV, both)", 0, [&] {
    std::vector<Correction> cs;
    for (Job& j : two)
      if (j.E > 1) cs.push_back(Correction{j.dU, j.rcum, j.X0, j.E});
    cp::cuda::scan_correct(cs, BH, F2, D);
  });
  // Two ranks' composites packed like scan_engine.cpp (h, M per job); one fold step from X0.
  int64_t per_rank = 0;
  std::vector<int64_t> h_off, m_off;
  for (const Job& j : two) {
    h_off.push_back(per_rank);
    per_rank += BH * D * j.E;
    m_off.push_back(per_rank);
    per_rank += BH * D * D;
  }
  const Tensor gathered = rnd({2 * per_rank}, 9, 0.05);
  time("P>2 fwd fold step (4 jobs, one rank)", 0, [&] {
    std::vector<Fold> fs;
    for (size_t i = 0; i < two.size(); ++i) {
      Fold f;
      f.X = two[i].dX0;
      f.init = two[i].X0;
      f.Mbuf = f.Hbuf = gathered;
      f.m_off = m_off[i];
      f.h_off = h_off[i];
      f.m_stride = f.h_stride = per_rank;
      f.E = two[i].E;
      f.order = {1};
      fs.push_back(f);
    }
    cp::cuda::folds(fs, BH, D);
  });
  for (const int64_t F : {F1, F2}) {
    std::vector<Job>& jobs = F == F1 ? one : two;
    const Tensor& decay = F == F1 ? decay1 : decay2;
    Tensor dP = out({BH, F, D, D}), dPz = out({BH, F, D, D});
    const Tensor dg = Tensor::zeros({BH, F}, DType::f32, Device::cuda),
                 dgz = Tensor::zeros({BH, F}, DType::f32, Device::cuda);
    time("outer (dP, dPz; 2 sources each), F=" + std::to_string(F), 0, [&] {
      std::vector<OuterGroup> groups(2);
      for (int k = 0; k < 2; ++k) {
        OuterGroup& g = groups[static_cast<size_t>(k)];
        g.dP = k == 0 ? dP : dPz;
        g.P = jobs[static_cast<size_t>(k)].P;
        g.E = jobs[static_cast<size_t>(k)].E;
        g.dg = k == 0 ? dg : dgz;
        for (int a = 0; a < 2; ++a) {
          const Job& j = jobs[static_cast<size_t>(k + 2 * a)];
          OuterSource s;
          s.L = j.dU;
          s.R = j.Y;
          s.R0 = j.anti ? Tensor() : j.X0;
          s.shifted = j.anti;
          s.active = F;
          g.sources.push_back(s);
        }
      }
      cp::cuda::scan_grad_outers(groups, decay, BH, F, D);
    });
  }

  std::printf("scan_bench: B*H=%lld D=%lld, %lld global frames (P=2: %lld per rank), f32, median of %d after %d\n",
              static_cast<long long>(BH), static_cast<long long>(D), static_cast<long long>(F1),
              static_cast<long long>(F2), c.iters, c.warmup);
  std::printf("  %-40s %7s %12s %14s\n", "launch", "frames", "us/launch", "us/frame step");
  for (const Line& l : lines) {
    if (l.frames)
      std::printf("  %-40s %7lld %12.1f %14.2f\n", l.name.c_str(), static_cast<long long>(l.frames), l.us,
                  l.us / static_cast<double>(l.frames));
    else
      std::printf("  %-40s %7s %12.1f %14s\n", l.name.c_str(), "-", l.us, "-");
  }
  std::printf("  checksums (sum |x|) P=1: Y %.9e  z %.9e  dU %.9e\n", sum_y, sum_z, sum_du);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace gdncp

int main(int argc, char** argv) {
  gdncp::bench::Cfg c;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : "";
    if (f == "--bh")
      c.BH = std::stoll(v);
    else if (f == "--dim")
      c.D = std::stoll(v);
    else if (f == "--frames")
      c.F = std::stoll(v);
    else if (f == "--warmup")
      c.warmup = std::stoi(v);
    else if (f == "--iters")
      c.iters = std::stoi(v);
    else {
      std::fprintf(stderr, "scan_bench: unknown flag %s\n", f.c_str());
      return 1;
    }
    ++i;
  }
  try {
    return gdncp::bench::run(c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scan_bench: %s\n", e.what());
    return 1;
  }
}
