// src/cp/scan/scan_engine.cpp — Note [CP scan] (scan_engine.h): composites, the
// one all-gather, the fold over ranks, the rescan, and their backward.
//
// Gradient rule: dU of each job is fresh (overwritten); dP accumulates when
// the job says so (jobs sharing one transition); dg always accumulates.
#include "cp/scan/scan_engine.h"

#include <algorithm>
#include <limits>

#include "cp/scan/comm_stream.h"
#include "cp/scan/deterministic.h"
#include "cp/scan/exchange.h"
#include "gdncp/error.h"

namespace gdncp {
namespace cp {
namespace detail {
namespace {

DType compute_dtype(const std::vector<ScanJob>& jobs) { return jobs.front().P.dtype(); }

// Logical position of a physical rank in a job's rank order.
int logical(const ScanJob& j, int rank, int P) { return (j.anti || j.rank_reverse) ? P - 1 - rank : rank; }
int physical(const ScanJob& j, int pos, int P) { return (j.anti || j.rank_reverse) ? P - 1 - pos : pos; }

// adjoint: a sweep of the state adjoint (Note [clip cuts]: the forward scan
// cuts before a step, the anti-causal one after it, their adjoints the other way).
SweepSpec spec_of(const ScanContext& c, const ScanJob& j, bool adjoint) {
  SweepSpec s;
  s.BH = c.BH;
  s.F = c.F;
  s.D = c.D;
  s.E = j.E;
  s.active = j.active;
  s.H = c.H;
  if (c.cuts.defined()) s.cut = (j.anti != adjoint) ? Cut::after : Cut::before;
  return s;
}

// Note [which composites travel]. The folds start from a zero state, and their
// first step is X = h of the first rank in order, with no product. So the
// forward folds read M only of logical positions 1 … P−2 (1 … P−1 for the
// terminal fold), and the backward folds, from a zero adjoint, only of
// positions r'+1 … P−2 (up to P−1 from a terminal gradient). No rank ever reads
// the M of logical position 0, and with two ranks and no terminal state no rank
// reads any M: the pack then carries only the states h, and no rank sweeps a
// product of transitions beyond the Wcum its correction needs.
bool gathers_M(const ScanJob& j, int P) { return P > 2 || j.terminal; }

// The buffer a rank sends its composites (or their adjoints) in. Its slots that no sweep writes
// are read by no rank (Note [which composites travel], Note [rescan]): on the CPU the whole pack
// starts as NaN, so that reading any slot left unwritten would spoil the results of the CPU tests
// (every exchange, P = 1 … 16). On CUDA it starts as zeros, one fill for the whole pack: stand-in
// peers (bench/loopback_comm.h) hand a rank's own pack back as the other ranks', and read there,
// its unwritten slots must be finite and the same run to run.
Tensor blank_pack(Tensor pack) {
  pack.fill_(pack.device() == Device::cpu ? std::numeric_limits<double>::quiet_NaN() : 0.0);
  return pack;
}
Tensor new_pack(int64_t n, DType dt, Device dev) { return blank_pack(Tensor::empty({n}, dt, dev)); }

// Note [rescan]. A rank whose incoming state X0 comes from earlier ranks gets its states either by
// the correction Y_t = Y_loc,t + Wcum_t X0 (the local scan from zero beside a sweep of the
// cumulative products Wcum, D columns written for every frame, then one GEMM) or by a second sweep
// from X0 once it is known (the same linear map: results equal up to rounding). The rescan is
// chosen
//  - for a job of one column (E = 1: the z of the Z stream): D times less CP-only work for one
//    more short sweep after the exchange. Its sweep from zero then runs for the composite h
//    alone, and its Wcum only where its M travels (Note [which composites travel]), for M alone;
//  - for a job whose composite no rank reads (the logically last rank, no terminal state) on a
//    rank that has sweeps of other jobs to run before the exchange (the other direction of a
//    bidirectional call: at P = 2 every rank is first in one direction and last in the other).
//    Nothing of such a job is swept before the exchange, and its one sweep from X0 is all its
//    scan: no CP-only sweep at all. Where the rank has no other sweep (a one-directional call),
//    the local scan and Wcum run while the earlier ranks sweep, and only the correction waits.
// Backward likewise: the adjoint sweep rerun from the arriving adjoint a replaces Rcum and its
// correction (M comes from the forward); a job of one column reruns wherever a arrives, a job
// whose X0 came from no rank (the logically first, which sends no dX0) on a rank with other
// sweeps to run before the exchange. The rank's sweep after the exchange leaves most of the device
// idle, but the transition-gradient GEMMs of the direction already done, run beside it on a
// second stream, made the rank slower, not faster (docs/history.md).
bool rescans(const ScanJob& j, int64_t D) { return j.E < D; }

// A rank's composite of job j at logical position pos is read by a later rank's fold, or by the
// terminal fold (Note [which composites travel]).
bool composite_read(const ScanJob& j, int pos, int P) { return pos < P - 1 || j.terminal; }

// How many all-gathers carry the forward composites: with overlap at P > 2, where every Wcum
// feeds a travelling M and so nothing of the forward is left to hide the one all-gather behind,
// two — the first half of the jobs (a bidirectional call's forward direction; KV of a
// one-directional one) is gathered while the second half is swept (Note [hidden exchange]).
int forward_parts(const ScanContext& c, const ExchangePlan& plan, size_t jobs, int P) {
  return c.overlap && P > 2 && plan.algo == Exchange::all_gather && jobs >= 2 ? 2 : 1;
}

// Offsets (elements) of each job's pieces inside one rank's packed slice.
struct Layout {
  std::vector<int64_t> h, M;  // forward: composite state, composite transition (-1: not gathered)
  int64_t fwd_total = 0;
  std::vector<int64_t> dX0, dT;  // backward: adjoint of X0, adjoint of the terminal state
  int64_t bwd_total = 0;
  // The forward pack in parts gathered one after another (forward_parts): part 0 holds the jobs
  // before `split` at elements [begin[0], begin[1]) of the pack, part 1 (empty with one part)
  // the rest at [begin[1], begin[2]); the gathered copy of part q, rank p's at
  // P·begin[q] + p·(begin[q + 1] − begin[q]), fills the same elements of the gathered buffer as
  // the one all-gather's would.
  int parts = 1;
  size_t split = 0;
  int64_t begin[3] = {0, 0, 0};
  int P = 1;

  size_t part(size_t i) const { return i < split ? 0 : 1; }
  // Rank p's h (or M) of job i in the gathered buffer: off(i, L.h[i]) + p·stride(i).
  int64_t stride(size_t i) const { return begin[part(i) + 1] - begin[part(i)]; }
  int64_t off(size_t i, int64_t at) const { return at + (P - 1) * begin[part(i)]; }
};

Layout layout_of(const ScanContext& c, const std::vector<ScanJob>& jobs, int P, int parts) {
  Layout L;
  L.P = P;
  for (const auto& j : jobs) {
    L.h.push_back(L.fwd_total);
    L.fwd_total += c.BH * c.D * j.E;
    L.M.push_back(gathers_M(j, P) ? L.fwd_total : -1);
    if (gathers_M(j, P)) L.fwd_total += c.BH * c.D * c.D;
  }
  for (const auto& j : jobs) {
    L.dX0.push_back(L.bwd_total);
    L.bwd_total += c.BH * c.D * j.E;
  }
  for (const auto& j : jobs) {
    L.dT.push_back(L.bwd_total);
    if (j.terminal) L.bwd_total += c.BH * c.D * j.E;
  }
  L.parts = parts;
  L.split = parts == 2 ? jobs.size() / 2 : jobs.size();
  L.begin[1] = L.split < jobs.size() ? L.h[L.split] : L.fwd_total;
  L.begin[2] = L.fwd_total;
  return L;
}

// Folds over ranks, each fold's X set here (fold_into), those with a product in one launch.
void run_folds(std::vector<Fold>& fs, int64_t BH, int64_t D) {
  std::vector<Fold> products;
  for (Fold& f : fs) f.X = fold_into(f, products, BH, D);
  kern::folds(products, BH, D);
}

// Forward step 4: Y_t = Y_loc,t + Wcum_t X0 for every frame of the jobs with cumulative products,
// the sweep from X0 for those that rescan (Note [rescan]).
void correct_from_X0(std::vector<ScanJob>& jobs, const std::vector<Tensor>& cum, std::vector<Sweep>& redo,
                     const Tensor& decay, int64_t BH, int64_t F, int64_t D) {
  std::vector<Correction> cs;
  std::vector<Sweep> again;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (cum[i].defined()) cs.push_back(Correction{jobs[i].Y, cum[i], jobs[i].X0, jobs[i].E});
    if (redo[i].spec.E == 0) continue;
    again.push_back(redo[i]);
    again.back().init = jobs[i].X0;
  }
  kern::scan_correct(cs, BH, F, D);
  if (!again.empty()) kern::scan_sweeps(again, decay);
}

// The offsets and roles of every job, for the exchanges of exchange.h.
std::vector<ExchangeJob> exchange_jobs(const std::vector<ScanJob>& jobs, const Layout& L) {
  std::vector<ExchangeJob> out;
  for (size_t i = 0; i < jobs.size(); ++i) {
    ExchangeJob x;
    x.E = jobs[i].E;
    x.reverse = jobs[i].anti || jobs[i].rank_reverse;
    x.terminal = jobs[i].terminal;
    x.h_off = L.h[i];
    x.M_off = L.M[i];
    x.dX0_off = L.dX0[i];
    x.dT_off = jobs[i].terminal ? L.dT[i] : -1;
    out.push_back(x);
  }
  return out;
}

}  // namespace

Tensor fold_into(Fold f, std::vector<Fold>& batch, int64_t BH, int64_t D) {
  const Shape shape = state_shape(BH, D, f.E);
  if (!f.X.defined()) {
    if (!f.init.defined() && f.order.empty()) return Tensor::zeros(shape, f.Hbuf.dtype(), f.Hbuf.device());
    if (!f.init.defined() && f.order.size() == 1)
      return state_view(f.Hbuf, f.h_off + f.order[0] * f.h_stride, BH, D, f.E);
    f.X = Tensor::empty(shape, f.Hbuf.dtype(), f.Hbuf.device());
  }
  batch.push_back(f);
  return f.X;
}

int64_t active_frames(int64_t K, int64_t offset, int64_t F) {
  if (K <= 0) return F;
  return std::min<int64_t>(F, std::max<int64_t>(0, K - offset));
}

void scan_forward(ScanContext& ctx, std::vector<ScanJob>& jobs) {
  Communicator& comm = *ctx.comm;
  const int P = comm.size(), r = comm.rank();
  // The deterministic mode: the one-rank scan over the global sequence (Note [deterministic scan]).
  if (P > 1 && !ctx.frames.empty()) return deterministic_scan_forward(ctx, jobs);
  const DType dt = compute_dtype(jobs);
  const Device dev = jobs.front().P.device();
  const int64_t BH = ctx.BH, F = ctx.F, D = ctx.D;
  const ExchangePlan plan = P > 1 ? plan_exchange(comm, ctx.exchange, ctx.node_size) : ExchangePlan();
  const Layout L = layout_of(ctx, jobs, P, forward_parts(ctx, plan, jobs.size(), P));

  // 1. The local scans from a zero state (all jobs in one batch of sweeps):
  //    states Y_loc into Y, and with P > 1 the composite state h (last state)
  //    written straight into the all-gather's pack; where a correction will
  //    follow (X0 ≠ 0), the cumulative products Wcum per frame, whose last is
  //    the composite transition M (into the pack where it travels: Note [which
  //    composites travel]). A job that rescans (Note [rescan]) writes at most h and M
  //    here: its states come from X0; one whose composite no rank reads writes nothing (its
  //    slots of the pack stay unwritten: new_pack). A checkpoint recompute
  //    (composites kept) writes no composites. With overlap, the sweeps the all-gather does not read (Wcum
  //    where M does not travel) run after it is issued, and with two parts
  //    (forward_parts) the second part's sweeps after the first part's
  //    all-gather is issued (Note [hidden exchange]).
  const bool gather = P > 1 && !ctx.gathered.defined();
  const bool hide = ctx.overlap && gather && plan.algo == Exchange::all_gather;
  // With the log or hierarchical exchange the pack is this rank's slot of the buffer the exchange
  // keeps (exchange.h): its node's ring and the backward read it where the sweeps write it.
  const std::vector<ExchangeJob> xjobs =  // what the log or hierarchical exchange sees of the jobs
      plan.algo != Exchange::all_gather ? exchange_jobs(jobs, L) : std::vector<ExchangeJob>();
  Tensor pack, kept;
  if (gather && plan.algo != Exchange::all_gather) {
    kept = Tensor::empty({kept_elements(plan, xjobs, L.fwd_total, BH, D)}, dt, dev);
    pack = blank_pack(region(kept, kept_pack_offset(plan, r, L.fwd_total), L.fwd_total));
  } else if (gather) {
    pack = new_pack(L.fwd_total, dt, dev);
  }
  std::vector<Sweep> batch[2], later;  // by part of the pack; later: read by no all-gather
  std::vector<Tensor> cum(jobs.size());
  std::vector<Sweep> redo(jobs.size());  // Note [rescan]: from X0 (spec.E = 0: none)
  // Jobs with nothing to sweep before the exchange (Note [rescan]): corrected, composite unread,
  // and the rank has other jobs' sweeps to run meanwhile. The same on a checkpoint recompute.
  std::vector<char> idle(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const int pos = logical(jobs[i], r, P);
    idle[i] = P > 1 && pos > 0 && !composite_read(jobs[i], pos, P);
  }
  const bool others = std::find(idle.begin(), idle.end(), 0) != idle.end();
  for (size_t i = 0; i < jobs.size(); ++i) {
    ScanJob& j = jobs[i];
    j.Y = Tensor::empty(states_shape(BH, F, D, j.E), dt, dev);
    Sweep sh;
    sh.P = j.P;
    sh.add_after = j.U;
    sh.cuts = ctx.cuts;
    sh.spec = spec_of(ctx, j, false);
    sh.spec.descending = j.anti;
    sh.spec.init = Init::zero;
    (j.anti ? sh.out_before : sh.out_after) = j.Y;
    if (P == 1 && j.terminal) {  // one rank: the terminal state is its last state
      j.T = Tensor::empty(state_shape(BH, D, j.E), dt, dev);
      sh.final_state = j.T;
    }
    const int pos = logical(j, r, P);
    const bool corrected = P > 1 && pos > 0;  // X0 ≠ 0 here
    const bool skip = idle[i] && others;
    const bool rescan = corrected && (rescans(j, D) || skip);
    const bool M_swept = corrected && (!rescan || (L.M[i] >= 0 && composite_read(j, pos, P)));
    if (rescan) {  // the states come from the sweep from X0; this one gives the composite only
      redo[i] = sh;
      redo[i].spec.init = Init::given;
      sh.out_before = sh.out_after = Tensor();
    }
    if (P > 1) {
      sh.final_state = pack;
      sh.final_offset = L.h[i];
    }
    if (M_swept) {  // Wcum for the correction, or M alone where it travels
      Sweep sm = sh;
      sm.out_before = sm.out_after = Tensor();
      if (!rescan) {
        cum[i] = Tensor::empty({BH, F, D, D}, dt, dev);
        (j.anti ? sm.out_before : sm.out_after) = cum[i];
      }
      sm.final_state = L.M[i] >= 0 ? pack : Tensor();
      sm.final_offset = std::max<int64_t>(L.M[i], 0);
      sm.add_after = Tensor();
      sm.spec.init = Init::identity;
      sm.spec.E = D;
      (hide && L.M[i] < 0 ? later : batch[L.part(i)]).push_back(sm);
    }
    if (!skip) batch[L.part(i)].push_back(sh);
  }
  CommStream lane(hide && dev == Device::cuda);
  if (hide) {
    Tensor gathered = Tensor::empty({static_cast<int64_t>(P) * L.fwd_total}, dt, dev);
    for (int q = 0; q < L.parts; ++q) {
      kern::scan_sweeps(batch[q], ctx.decay);
      const int64_t b = L.begin[q], n = L.begin[q + 1] - b;
      Tensor in = region(pack, b, n), out = region(gathered, P * b, P * n);
      lane.issue([&] { comm.all_gather(out, in); });
    }
    ctx.gathered = gathered;
    if (!later.empty()) kern::scan_sweeps(later, ctx.decay);
    lane.join();
  } else {  // one batch (two parts only lay out the kept composites of a recompute)
    batch[0].insert(batch[0].end(), batch[1].begin(), batch[1].end());
    kern::scan_sweeps(batch[0], ctx.decay);
  }
  if (P == 1) {
    for (auto& j : jobs) j.X0 = Tensor::zeros(state_shape(BH, D, j.E), dt, dev);
    return;
  }

  // 2-3 by the log-depth or hierarchical exchange (exchange.h): X0 and T directly.
  if (plan.algo != Exchange::all_gather) {
    std::vector<Tensor> X0s, Ts;  // views into ctx.gathered
    if (gather) ctx.gathered = kept;
    exchange_forward(comm, plan, xjobs, pack, L.fwd_total, BH, D, ctx.gathered, X0s, Ts);
    for (size_t i = 0; i < jobs.size(); ++i) {
      jobs[i].X0 = X0s[i];
      if (jobs[i].terminal) jobs[i].T = Ts[i];
    }
    return correct_from_X0(jobs, cum, redo, ctx.decay, BH, F, D);
  }

  // 2. One all-gather of every job's composites (kept: a checkpoint recompute passes them back in).
  if (gather && !hide) {
    Tensor gathered = Tensor::empty({static_cast<int64_t>(P) * L.fwd_total}, dt, dev);
    comm.all_gather(gathered, pack);
    ctx.gathered = gathered;
  }
  GDNCP_CHECK(ctx.gathered.numel() == static_cast<int64_t>(P) * L.fwd_total,
              "cp scan: kept composites do not match this call (", ctx.gathered.numel(), " elements)");

  // 3. The incoming state of every job (and the terminal states): folds over the ranks.
  std::vector<Fold> fs;
  std::vector<size_t> x0_at(jobs.size()), t_at(jobs.size());  // their folds in fs
  for (size_t i = 0; i < jobs.size(); ++i) {
    ScanJob& j = jobs[i];
    Fold f;
    f.Hbuf = ctx.gathered;
    if (L.M[i] >= 0) f.Mbuf = ctx.gathered;
    f.m_off = L.off(i, std::max<int64_t>(L.M[i], 0));
    f.h_off = L.off(i, L.h[i]);
    f.m_stride = f.h_stride = L.stride(i);
    f.E = j.E;
    for (int pos = 0; pos < logical(j, r, P); ++pos) f.order.push_back(physical(j, pos, P));
    GDNCP_CHECK(f.Mbuf.defined() || f.order.size() <= 1, "cp scan: the fold needs composites that were not gathered");
    x0_at[i] = fs.size();
    fs.push_back(f);
    if (j.terminal) {
      GDNCP_CHECK(!j.anti && !j.rank_reverse, "cp scan: a terminal state needs the forward rank order");
      Fold ft = f;
      ft.order.clear();
      for (int p = 0; p < P; ++p) ft.order.push_back(p);
      t_at[i] = fs.size();
      fs.push_back(ft);
    }
  }
  run_folds(fs, BH, D);
  for (size_t i = 0; i < jobs.size(); ++i) {
    jobs[i].X0 = fs[x0_at[i]].X;
    if (jobs[i].terminal) jobs[i].T = fs[t_at[i]].X;
  }

  // 4. The correction of docs/design.md §6, all frames at once: Y_t = Y_loc,t + Wcum_t X0.
  correct_from_X0(jobs, cum, redo, ctx.decay, BH, F, D);
}

void scan_backward(ScanContext& ctx, std::vector<ScanJob>& jobs, Tensor& dg) {
  Communicator& comm = *ctx.comm;
  const int P = comm.size(), r = comm.rank();
  // The deterministic mode: the one-rank scan over the global sequence (Note [deterministic scan]).
  if (P > 1 && !ctx.frames.empty()) return deterministic_scan_backward(ctx, jobs, dg);
  const DType dt = compute_dtype(jobs);
  const Device dev = jobs.front().P.device();
  const int64_t BH = ctx.BH, F = ctx.F, D = ctx.D;
  const ExchangePlan plan = P > 1 ? plan_exchange(comm, ctx.exchange, ctx.node_size) : ExchangePlan();
  const Layout L = layout_of(ctx, jobs, P, forward_parts(ctx, plan, jobs.size(), P));

  // Sweeps of the state adjoint: anti jobs run ascending with the slot
  // gradient added after the step, forward jobs descending with it added before.
  auto adjoint = [&](const ScanJob& j, const Tensor& out_before, const Tensor& final_state, const Tensor& init) {
    Sweep w;
    w.out_before = out_before;
    w.final_state = final_state;
    w.P = j.P;
    w.init = init;
    w.cuts = ctx.cuts;
    w.spec = spec_of(ctx, j, true);
    w.spec.transpose = true;
    w.spec.init = init.defined() ? Init::given : Init::zero;
    w.spec.descending = !j.anti;
    if (j.anti)
      w.add_after = j.dY;
    else
      w.add_before = j.dY;
    return w;
  };
  // Does the adjoint arriving from later ranks (a) exist for job j?
  auto seeded = [&](const ScanJob& j) { return j.terminal || logical(j, r, P) < P - 1; };
  std::vector<Tensor> rcum(jobs.size());
  std::vector<char> rerun(jobs.size());
  // Step 4: the adjoint seeded with a is λ_t + Rcum_t a, all frames at once, or for a job that
  // reruns the adjoint sweep from a (Note [rescan]).
  auto seed_adjoints = [&](const std::vector<Tensor>& seed) {
    std::vector<Correction> cs;
    std::vector<Sweep> again;
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (!seed[i].defined()) continue;
      const Tensor a = seed[i].reshape(state_shape(BH, D, jobs[i].E));
      if (rcum[i].defined())
        cs.push_back(Correction{jobs[i].dU, rcum[i], a, jobs[i].E});
      else
        again.push_back(adjoint(jobs[i], jobs[i].dU, Tensor(), a));
      GDNCP_CHECK(rcum[i].defined() || rerun[i], "cp scan backward: missing cumulative products");
    }
    kern::scan_correct(cs, BH, F, D);
    if (!again.empty()) kern::scan_sweeps(again, ctx.decay);
  };

  // 1. The adjoint sweep of every job from its own output gradients (λ, into
  //    dU; its final state is the adjoint of X0), and where an adjoint a will
  //    arrive from later ranks, the cumulative products Rcum_t of the
  //    transposed transitions it passes through. One batch.
  //    With P > 1 the adjoints of X0 go straight into the all-gather's pack.
  //    With overlap, the Rcum sweeps run after the all-gather is issued (Note [hidden exchange]).
  const bool hide = ctx.overlap && P > 1 && plan.algo == Exchange::all_gather;
  std::vector<Sweep> sweeps, later;
  Tensor pack = P > 1 ? new_pack(std::max<int64_t>(L.bwd_total, 1), dt, dev) : Tensor();
  // Jobs that sweep nothing before the exchange (Note [rescan]): no dX0 to send (the logically
  // first rank), on a rank whose other jobs send theirs meanwhile.
  bool others = false;
  for (const ScanJob& j : jobs) others = others || logical(j, r, P) > 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    ScanJob& j = jobs[i];
    j.dU = Tensor::empty(states_shape(BH, F, D, j.E), dt, dev);
    if (P == 1) {  // one rank: the only seed is the terminal state's gradient
      sweeps.push_back(adjoint(j, j.dU, Tensor(), j.terminal ? j.dT : Tensor()));
      continue;
    }
    const bool has_dX0 = logical(j, r, P) > 0;  // the adjoint of X0, where X0 came from earlier ranks
    if (j.terminal) {                           // Σ over ranks of dT: a rank without one adds zeros
      if (j.dT.defined())
        kern::copy_region(pack, L.dT[i], j.dT, 0, j.dT.numel());
      else
        region(pack, L.dT[i], BH * D * j.E).fill_(0.0);
    }
    rerun[i] = seeded(j) && (rescans(j, D) || (!has_dX0 && others));  // Note [rescan]: dU from the rerun
    if (!rerun[i] || has_dX0) {
      sweeps.push_back(adjoint(j, rerun[i] ? Tensor() : j.dU, has_dX0 ? pack : Tensor(), Tensor()));
      sweeps.back().final_offset = L.dX0[i];
    }
    if (seeded(j) && !rerun[i]) {
      rcum[i] = Tensor::empty({BH, F, D, D}, dt, dev);
      Sweep w = adjoint(j, rcum[i], Tensor(), Tensor());
      w.add_before = w.add_after = Tensor();
      w.spec.init = Init::identity;
      w.spec.E = D;
      (hide ? later : sweeps).push_back(w);
    }
  }
  kern::scan_sweeps(sweeps, ctx.decay);

  if (P > 1 && plan.algo != Exchange::all_gather) {  // 2-3 by the exchange of exchange.h
    std::vector<Tensor> seed(jobs.size());
    exchange_backward(comm, plan, exchange_jobs(jobs, L), ctx.gathered, L.fwd_total, pack, BH, D, seed);
    seed_adjoints(seed);
  } else if (P > 1) {
    GDNCP_CHECK(ctx.gathered.defined(), "cp scan backward: the forward composites are missing");
    // 2. One all-gather of the adjoints of X0 and of the terminal states' gradients.
    Tensor gathered = Tensor::empty({static_cast<int64_t>(P) * pack.numel()}, dt, dev);
    CommStream lane(hide && dev == Device::cuda);
    lane.issue([&] { comm.all_gather(gathered, pack); });
    if (!later.empty()) kern::scan_sweeps(later, ctx.decay);
    lane.join();
    const int64_t stride = pack.numel();
    // 3. Σ over ranks of dT (rank order: the same bits everywhere), then the
    //    adjoint a arriving from the logically later ranks: a ← dX0_j + M_jᵀ a.
    std::vector<Fold> sums, backs;
    std::vector<size_t> sum_of, back_of;  // the job of each fold in sums, in backs
    std::vector<Tensor> a0(jobs.size()), seed(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (!jobs[i].terminal) continue;
      Fold f;
      f.Hbuf = gathered;
      f.h_off = L.dT[i];
      f.h_stride = stride;
      f.E = jobs[i].E;
      for (int p = 0; p < P; ++p) f.order.push_back(p);
      sum_of.push_back(i);
      sums.push_back(f);
    }
    run_folds(sums, BH, D);
    for (size_t k = 0; k < sums.size(); ++k) a0[sum_of[k]] = sums[k].X;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const ScanJob& j = jobs[i];
      Fold f;
      for (int pos = P - 1; pos > logical(j, r, P); --pos) f.order.push_back(physical(j, pos, P));
      if (f.order.empty()) {
        seed[i] = a0[i];
        continue;
      }
      GDNCP_CHECK(L.M[i] >= 0 || (f.order.size() == 1 && !a0[i].defined()),
                  "cp scan backward: the fold needs composites that were not gathered");
      f.init = a0[i];
      if (L.M[i] >= 0) f.Mbuf = ctx.gathered;
      f.m_off = L.off(i, std::max<int64_t>(L.M[i], 0));
      f.m_stride = L.stride(i);
      f.transpose = true;
      f.Hbuf = gathered;
      f.h_off = L.dX0[i];
      f.h_stride = stride;
      f.E = j.E;
      back_of.push_back(i);
      backs.push_back(f);
    }
    run_folds(backs, BH, D);
    for (size_t k = 0; k < backs.size(); ++k) seed[back_of[k]] = backs[k].X;
    // 4. The composite's gradient folded into the last state (Note [CP scan]).
    seed_adjoints(seed);
  }

  // 5. The transition gradients, grouped by the P they belong to (one launch).
  std::vector<OuterGroup> groups;
  for (const ScanJob& j : jobs) {
    OuterSource src;
    src.L = j.dU;
    src.R = j.Y;
    src.R0 = j.anti ? Tensor() : j.X0;
    src.shifted = j.anti;
    src.active = j.active;
    auto same = std::find_if(groups.begin(), groups.end(), [&](const OuterGroup& g) { return g.dP.same_as(j.dP); });
    if (same != groups.end()) {
      GDNCP_CHECK(same->sources.size() < 2 && same->E == j.E, "cp scan backward: bad transition sharing");
      same->sources.push_back(src);
      continue;
    }
    OuterGroup g;
    g.dP = j.dP;
    g.P = j.P;
    g.E = j.E;
    g.accumulate_dP = j.dP_accumulate;
    g.cuts = ctx.cuts;
    g.H = ctx.H;
    g.dg = dg;  // every group adds to the one dg: its f64 sum per frame is rounded once (Note [dg in f64])
    g.sources.push_back(src);
    groups.push_back(g);
  }
  kern::scan_grad_outers(groups, ctx.decay, BH, F, D);
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
