// src/cp/scan_engine.cpp — Note [CP scan] (scan_engine.h): composites, the
// one all-gather, the fold over ranks, the rescan, and their backward.
//
// Gradient rule: dU of each job is fresh (overwritten); dP accumulates when
// the job says so (jobs sharing one transition); dg always accumulates.
#include "cp/scan_engine.h"

#include <algorithm>

#include "gdncp/error.h"

namespace gdncp {
namespace cp {
namespace detail {
namespace {

DType compute_dtype(const std::vector<ScanJob>& jobs) { return jobs.front().P.dtype(); }

// Logical position of a physical rank in a job's rank order.
int logical(const ScanJob& j, int rank, int P) { return (j.anti || j.rank_reverse) ? P - 1 - rank : rank; }
int physical(const ScanJob& j, int pos, int P) { return (j.anti || j.rank_reverse) ? P - 1 - pos : pos; }

SweepSpec spec_of(const ScanContext& c, const ScanJob& j) {
  SweepSpec s;
  s.BH = c.BH;
  s.F = c.F;
  s.D = c.D;
  s.E = j.E;
  s.active = j.active;
  return s;
}

Tensor none;  // an absent optional argument

// Offsets (elements) of each job's pieces inside one rank's packed slice.
struct Layout {
  std::vector<int64_t> h, M;  // forward: composite state, composite transition
  int64_t fwd_total = 0;
  std::vector<int64_t> dX0, dT;  // backward: adjoint of X0, adjoint of the terminal state
  int64_t bwd_total = 0;
};

Layout layout_of(const ScanContext& c, const std::vector<ScanJob>& jobs) {
  Layout L;
  for (const auto& j : jobs) {
    L.h.push_back(L.fwd_total);
    L.fwd_total += c.BH * c.D * j.E;
    L.M.push_back(L.fwd_total);
    L.fwd_total += c.BH * c.D * c.D;
  }
  for (const auto& j : jobs) {
    L.dX0.push_back(L.bwd_total);
    L.bwd_total += c.BH * c.D * j.E;
  }
  for (const auto& j : jobs) {
    L.dT.push_back(L.bwd_total);
    if (j.terminal) L.bwd_total += c.BH * c.D * j.E;
  }
  return L;
}

// (BH, D) for the Z stream (E = 1), else (BH, D, E); with frames: (BH, F, D[, E]).
Shape state_shape(int64_t BH, int64_t D, int64_t E) { return E == 1 ? Shape{BH, D} : Shape{BH, D, E}; }
Shape states_shape(int64_t BH, int64_t F, int64_t D, int64_t E) {
  return E == 1 ? Shape{BH, F, D} : Shape{BH, F, D, E};
}

}  // namespace

int64_t active_frames(int64_t K, int rank, int64_t F) {
  if (K <= 0) return F;
  return std::min<int64_t>(F, std::max<int64_t>(0, K - static_cast<int64_t>(rank) * F));
}

void scan_forward(ScanContext& ctx, std::vector<ScanJob>& jobs) {
  Communicator& comm = *ctx.comm;
  const int P = comm.size(), r = comm.rank();
  const DType dt = compute_dtype(jobs);
  const Device dev = jobs.front().P.device();
  const int64_t BH = ctx.BH, F = ctx.F, D = ctx.D;
  const Layout L = layout_of(ctx, jobs);

  if (P > 1) {
    if (!ctx.gathered.defined()) {
      Tensor pack = Tensor::empty({L.fwd_total}, dt, dev);
      for (size_t i = 0; i < jobs.size(); ++i) {
        ScanJob& j = jobs[i];
        SweepSpec s = spec_of(ctx, j);
        s.descending = j.anti;
        Tensor h = Tensor::empty(state_shape(BH, D, j.E), dt, dev);
        Tensor M = Tensor::empty({BH, D, D}, dt, dev);
        s.init = Init::zero;
        kern::scan_sweep(none, none, h, j.P, ctx.decay, none, j.U, none, s);
        SweepSpec sm = s;
        sm.init = Init::identity;
        sm.E = D;
        kern::scan_sweep(none, none, M, j.P, ctx.decay, none, none, none, sm);
        kern::copy_region(pack, L.h[i], h, 0, h.numel());
        kern::copy_region(pack, L.M[i], M, 0, M.numel());
      }
      Tensor gathered = Tensor::empty({static_cast<int64_t>(P) * L.fwd_total}, dt, dev);
      comm.all_gather(gathered, pack);
      ctx.gathered = gathered;
    }
    GDNCP_CHECK(ctx.gathered.numel() == static_cast<int64_t>(P) * L.fwd_total,
                "cp scan: kept composites do not match this call (", ctx.gathered.numel(), " elements)");
    for (size_t i = 0; i < jobs.size(); ++i) {
      ScanJob& j = jobs[i];
      std::vector<int> before;
      for (int pos = 0; pos < logical(j, r, P); ++pos) before.push_back(physical(j, pos, P));
      j.X0 = Tensor::empty(state_shape(BH, D, j.E), dt, dev);
      kern::fold(j.X0, none, ctx.gathered, L.M[i], L.fwd_total, false, ctx.gathered, L.h[i], L.fwd_total, before, BH,
                 D, j.E);
      if (j.terminal) {
        GDNCP_CHECK(!j.anti && !j.rank_reverse, "cp scan: a terminal state needs the forward rank order");
        std::vector<int> all;
        for (int p = 0; p < P; ++p) all.push_back(p);
        j.T = Tensor::empty(state_shape(BH, D, j.E), dt, dev);
        kern::fold(j.T, none, ctx.gathered, L.M[i], L.fwd_total, false, ctx.gathered, L.h[i], L.fwd_total, all, BH,
                   D, j.E);
      }
    }
  } else {
    for (auto& j : jobs) j.X0 = Tensor::zeros(state_shape(BH, D, j.E), dt, dev);
  }

  for (auto& j : jobs) {
    SweepSpec s = spec_of(ctx, j);
    s.init = Init::given;
    j.Y = Tensor::empty(states_shape(BH, F, D, j.E), dt, dev);
    Tensor fin;
    if (P == 1 && j.terminal) {  // one rank: the terminal state is its last state
      j.T = Tensor::empty(state_shape(BH, D, j.E), dt, dev);
      fin = j.T;
    }
    if (j.anti) {
      s.descending = true;
      kern::scan_sweep(j.Y, none, fin, j.P, ctx.decay, none, j.U, j.X0, s);
    } else {
      kern::scan_sweep(none, j.Y, fin, j.P, ctx.decay, none, j.U, j.X0, s);
    }
  }
}

void scan_backward(ScanContext& ctx, std::vector<ScanJob>& jobs, Tensor& dg) {
  Communicator& comm = *ctx.comm;
  const int P = comm.size(), r = comm.rank();
  const DType dt = compute_dtype(jobs);
  const Device dev = jobs.front().P.device();
  const int64_t BH = ctx.BH, D = ctx.D;
  const Layout L = layout_of(ctx, jobs);

  // Sweeps of the state adjoint: anti jobs run ascending with the slot
  // gradient added after the step, forward jobs descending with it added before.
  auto adjoint_sweep = [&](const ScanJob& j, Tensor& out_before, Tensor& final_state, const Tensor& init) {
    SweepSpec s = spec_of(ctx, j);
    s.transpose = true;
    s.init = init.defined() ? Init::given : Init::zero;
    if (j.anti) {
      s.descending = false;
      kern::scan_sweep(out_before, none, final_state, j.P, ctx.decay, none, j.dY, init, s);
    } else {
      s.descending = true;
      kern::scan_sweep(out_before, none, final_state, j.P, ctx.decay, j.dY, none, init, s);
    }
  };

  std::vector<Tensor> seed(jobs.size());  // the adjoint a of each job's last state
  if (P > 1) {
    GDNCP_CHECK(ctx.gathered.defined(), "cp scan backward: the forward composites are missing");
    Tensor pack = Tensor::zeros({std::max<int64_t>(L.bwd_total, 1)}, dt, dev);
    for (size_t i = 0; i < jobs.size(); ++i) {
      const ScanJob& j = jobs[i];
      if (logical(j, r, P) > 0) {  // the logically first rank's X0 is the constant 0
        Tensor dX0 = Tensor::empty(state_shape(BH, D, j.E), dt, dev);
        adjoint_sweep(j, none, dX0, none);
        kern::copy_region(pack, L.dX0[i], dX0, 0, dX0.numel());
      }
      if (j.terminal && j.dT.defined()) kern::copy_region(pack, L.dT[i], j.dT, 0, j.dT.numel());
    }
    Tensor gathered = Tensor::empty({static_cast<int64_t>(P) * pack.numel()}, dt, dev);
    comm.all_gather(gathered, pack);
    const int64_t stride = pack.numel();
    for (size_t i = 0; i < jobs.size(); ++i) {
      const ScanJob& j = jobs[i];
      Tensor a0;
      if (j.terminal) {  // Σ over ranks of dT, in rank order: the same bits everywhere
        std::vector<int> all;
        for (int p = 0; p < P; ++p) all.push_back(p);
        a0 = Tensor::empty(state_shape(BH, D, j.E), dt, dev);
        kern::fold(a0, none, none, 0, 0, false, gathered, L.dT[i], stride, all, BH, D, j.E);
      }
      std::vector<int> after;
      for (int pos = P - 1; pos > logical(j, r, P); --pos) after.push_back(physical(j, pos, P));
      if (after.empty()) {
        seed[i] = a0;
      } else {
        seed[i] = Tensor::empty(state_shape(BH, D, j.E), dt, dev);
        kern::fold(seed[i], a0, ctx.gathered, L.M[i], L.fwd_total, true, gathered, L.dX0[i], stride, after, BH, D,
                   j.E);
      }
    }
  } else {
    for (size_t i = 0; i < jobs.size(); ++i)
      if (jobs[i].terminal) seed[i] = jobs[i].dT;
  }

  for (size_t i = 0; i < jobs.size(); ++i) {
    ScanJob& j = jobs[i];
    j.dU = Tensor::empty(states_shape(BH, ctx.F, D, j.E), dt, dev);
    adjoint_sweep(j, j.dU, none, seed[i]);
    SweepSpec s = spec_of(ctx, j);
    kern::scan_grad_outer(j.dP, dg, j.dU, j.Y, j.anti ? none : j.X0, j.P, ctx.decay, s, j.anti, j.dP_accumulate);
  }
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
