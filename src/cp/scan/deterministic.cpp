// src/cp/scan/deterministic.cpp — Note [deterministic scan] (deterministic.h).
#include "cp/scan/deterministic.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>

#include "cp/scan/scan_engine.h"
#include "gdncp/error.h"
#include "kernels/cp_kernels.h"
#include "kernels/prep/norm_w_frames.h"

namespace gdncp {
namespace cp {
namespace detail {
namespace {

class SelfCommunicator : public Communicator {
 public:
  explicit SelfCommunicator(Device device) : device_(device) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return device_; }
  void all_gather(Tensor& out, const Tensor& in) override {
    GDNCP_CHECK(out.dtype() == in.dtype() && out.numel() == in.numel(), "all_gather: out ", out.str(),
                " does not hold in ", in.str());
    if (in.numel() > 0) kern::copy_region(out, 0, in, 0, in.numel());
  }
  void all_reduce_sum(Tensor&) override {}
  void broadcast(Tensor&, int root) override {
    GDNCP_CHECK(root == 0, "broadcast: root ", root, " of a one-rank group");
  }
  void send_recv(const Tensor& send, int dst, Tensor& recv, int src) override {
    if (dst == 0 && src == 0 && send.numel() > 0) kern::copy_region(recv, 0, send, 0, send.numel());
  }
  void barrier() override {}
  void all_gather_host(void* out, const void* in, size_t bytes) override {
    if (bytes > 0) std::memmove(out, in, bytes);
  }
  bool aborted() const override { return false; }
  const char* backend() const override { return "self"; }

 private:
  Device device_;
};

// The global sequence concatenates the ranks in reverse order for a
// rank-reversed scan; the anti-causal scan sweeps the forward concatenation
// backwards.
bool reversed_order(const ScanJob& j) { return j.rank_reverse && !j.anti; }

// Where this rank's frames start in the global sequence of the given order.
int64_t global_offset(const std::vector<int64_t>& frames, int r, bool reversed) {
  int64_t o = 0;
  for (int p = 0; p < static_cast<int>(frames.size()); ++p)
    if (reversed ? p > r : p < r) o += frames[static_cast<size_t>(p)];
  return o;
}

// Offsets of the per-frame pieces inside one rank's slice of the exchange:
// rows × Fmax frames × X elements each. Jobs that share a transition and a
// width (the two directions of a bidirectional call) share their pieces.
struct Pieces {
  int64_t Fmax = 0, slice = 0;
  std::vector<int64_t> P, U;  // per job: its transition, its input
  int64_t decay = 0, cuts = -1;
};

Pieces pieces_of(const ScanContext& c, const std::vector<ScanJob>& jobs) {
  Pieces L;
  L.Fmax = *std::max_element(c.frames.begin(), c.frames.end());
  const int64_t rows = c.BH * L.Fmax;
  for (size_t i = 0; i < jobs.size(); ++i) {
    size_t k = 0;
    while (k < i && !(jobs[k].P.same_as(jobs[i].P) && jobs[k].E == jobs[i].E)) ++k;
    if (k < i) {
      L.P.push_back(L.P[k]);
      L.U.push_back(L.U[k]);
      continue;
    }
    L.P.push_back(L.slice);
    L.slice += rows * c.D * c.D;
    L.U.push_back(L.slice);
    L.slice += rows * c.D * jobs[i].E;
  }
  L.decay = L.slice;
  L.slice += rows;
  if (c.cuts.defined()) {
    L.cuts = L.slice;
    L.slice += (c.BH / c.H) * L.Fmax;
  }
  return L;
}

// Writes t (rows, F, X) into pack at off as (rows, Fmax, X).
void put(Tensor& pack, int64_t off, const Tensor& t, int64_t rows, int64_t F, int64_t Fmax, int64_t X) {
  if (F == 0) return;
  GDNCP_CHECK(t.numel() == rows * F * X, "deterministic scan: a piece of ", t.str(), " is not ", rows, "x", F, "x", X);
  kern::copy_region(pack, off, t, 0, F * X, rows, Fmax * X, F * X);
}

// The global (rows, F_total, X) tensor of shape `shape` from the pieces at off of every rank.
Tensor assemble(const Tensor& gathered, int64_t slice, int64_t off, const Shape& shape, int64_t rows, int64_t X,
                const std::vector<int64_t>& frames, int64_t Fmax, bool reversed) {
  const int P = static_cast<int>(frames.size());
  const int64_t Ft = std::accumulate(frames.begin(), frames.end(), int64_t{0});
  Tensor g = Tensor::empty(shape, gathered.dtype(), gathered.device());
  GDNCP_CHECK(g.numel() == rows * Ft * X, "deterministic scan: ", g.str(), " is not ", rows, "x", Ft, "x", X);
  int64_t o = 0;
  for (int pos = 0; pos < P; ++pos) {
    const int p = reversed ? P - 1 - pos : pos;
    const int64_t F = frames[static_cast<size_t>(p)];
    if (F > 0) kern::copy_region(g, o * X, gathered, p * slice + off, F * X, rows, Ft * X, Fmax * X);
    o += F;
  }
  return g;
}

// This rank's frames [o, o + F) of a global (rows, F_total, X) tensor, as `shape`.
Tensor slice_frames(const Tensor& g, int64_t o, const Shape& shape, int64_t rows, int64_t Ft, int64_t X) {
  Tensor t = Tensor::empty(shape, g.dtype(), g.device());
  const int64_t F = rows > 0 ? t.numel() / (rows * X) : 0;
  if (F > 0) kern::copy_region(t, 0, g, o * X, F * X, rows, F * X, Ft * X);
  return t;
}

Shape with_frames(Shape s, int64_t F) {
  s[1] = F;
  return s;
}

// The global sequence of one call: a one-rank context over all frames per rank order.
struct Global {
  std::shared_ptr<Communicator> self;
  Pieces L;
  int64_t Ft = 0;
  Tensor decay[2], cuts[2];                           // per order (forward, reversed), assembled on first use
  std::map<std::pair<int64_t, bool>, Tensor> pieces;  // (offset, reversed) -> global tensor: shared jobs share it

  Global(const ScanContext& c, const std::vector<ScanJob>& jobs, Device dev)
      : self(make_self_communicator(dev)), L(pieces_of(c, jobs)) {
    Ft = std::accumulate(c.frames.begin(), c.frames.end(), int64_t{0});
  }
  ScanContext context(const ScanContext& c, bool reversed) {
    const int o = reversed ? 1 : 0;
    const int64_t B = c.BH / c.H;
    if (!decay[o].defined()) {
      decay[o] = assemble(c.gathered, L.slice, L.decay, {c.BH, Ft}, c.BH, 1, c.frames, L.Fmax, reversed);
      if (L.cuts >= 0)
        cuts[o] = assemble(c.gathered, L.slice, L.cuts, {B, Ft}, B, 1, c.frames, L.Fmax, reversed).to(DType::f32);
    }
    return ScanContext{self.get(), c.BH, Ft, c.D, decay[o], Tensor(), cuts[o], c.H, {}, 0};
  }
  // The job over the global sequence (forward inputs from the exchange).
  ScanJob job(const ScanContext& c, const ScanJob& j, size_t i, bool with_U) {
    ScanJob g;
    const bool rev = reversed_order(j);
    const auto piece = [&](int64_t off, const Shape& shape, int64_t X) {
      Tensor& t = pieces[{off, rev}];
      if (!t.defined()) t = assemble(c.gathered, L.slice, off, shape, c.BH, X, c.frames, L.Fmax, rev);
      return t;
    };
    g.P = piece(L.P[i], {c.BH, Ft, c.D, c.D}, c.D * c.D);
    if (with_U) g.U = piece(L.U[i], states_shape(c.BH, Ft, c.D, j.E), c.D * j.E);
    g.E = j.E;
    g.anti = j.anti;
    g.terminal = j.terminal;
    g.active = (!j.anti && c.truncate > 0) ? c.truncate : Ft;
    return g;
  }
};

}  // namespace

std::shared_ptr<Communicator> make_self_communicator(Device device) {
  return std::make_shared<SelfCommunicator>(device);
}

std::vector<int64_t> rank_frames(Communicator& comm, int64_t F) {
  std::vector<int64_t> frames(static_cast<size_t>(comm.size()));
  comm.all_gather_host(frames.data(), &F, sizeof(F));
  return frames;
}

void deterministic_scan_forward(ScanContext& ctx, std::vector<ScanJob>& jobs) {
  Communicator& comm = *ctx.comm;
  const int r = comm.rank();
  const DType dt = jobs.front().P.dtype();
  const Device dev = jobs.front().P.device();
  const int64_t BH = ctx.BH, F = ctx.F, D = ctx.D;
  GDNCP_CHECK(static_cast<int>(ctx.frames.size()) == comm.size() && ctx.frames[static_cast<size_t>(r)] == F,
              "deterministic scan: the frame counts do not match this call");
  Global G(ctx, jobs, dev);
  const Pieces& L = G.L;

  // The one exchange (kept: a checkpoint recompute passes it back in).
  if (!ctx.gathered.defined()) {
    // Every piece this rank holds is written; a rank with fewer frames than the longest
    // zeroes its padding, which no rank reads, so that no undefined bytes travel.
    Tensor pack = F < L.Fmax ? Tensor::zeros({L.slice}, dt, dev) : Tensor::empty({L.slice}, dt, dev);
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (std::find(L.P.begin(), L.P.begin() + static_cast<std::ptrdiff_t>(i), L.P[i]) != L.P.begin() + i) continue;
      put(pack, L.P[i], jobs[i].P, BH, F, L.Fmax, D * D);  // once per shared transition
      put(pack, L.U[i], jobs[i].U, BH, F, L.Fmax, D * jobs[i].E);
    }
    put(pack, L.decay, ctx.decay.to(dt), BH, F, L.Fmax, 1);
    if (L.cuts >= 0) put(pack, L.cuts, ctx.cuts.to(dt), BH / ctx.H, F, L.Fmax, 1);
    ctx.gathered = Tensor::empty({static_cast<int64_t>(comm.size()) * L.slice}, dt, dev);
    comm.all_gather(ctx.gathered, pack);
  }
  GDNCP_CHECK(ctx.gathered.numel() == static_cast<int64_t>(comm.size()) * L.slice,
              "deterministic scan: kept exchange does not match this call (", ctx.gathered.numel(), " elements)");

  // The one-rank scan of every job over the global sequence, then this rank's frames.
  for (const bool rev : {false, true}) {
    std::vector<size_t> idx;
    std::vector<ScanJob> g;
    for (size_t i = 0; i < jobs.size(); ++i)
      if (reversed_order(jobs[i]) == rev) {
        idx.push_back(i);
        g.push_back(G.job(ctx, jobs[i], i, /*with_U=*/true));
      }
    if (g.empty()) continue;
    ScanContext gc = G.context(ctx, rev);
    scan_forward(gc, g);
    const int64_t o = global_offset(ctx.frames, r, rev);
    for (size_t k = 0; k < idx.size(); ++k) {
      ScanJob& j = jobs[idx[k]];
      j.Y = slice_frames(g[k].Y, o, with_frames(g[k].Y.shape(), F), BH, G.Ft, D * j.E);
      j.X0 = Tensor::zeros(g[k].X0.shape(), dt, dev);  // unused: the backward rescans globally
      if (j.terminal) j.T = g[k].T;
    }
  }
}

void deterministic_scan_backward(ScanContext& ctx, std::vector<ScanJob>& jobs, Tensor& dg) {
  Communicator& comm = *ctx.comm;
  const int P = comm.size(), r = comm.rank();
  const DType dt = jobs.front().P.dtype();
  const Device dev = jobs.front().P.device();
  const int64_t BH = ctx.BH, F = ctx.F, D = ctx.D;
  GDNCP_CHECK(ctx.gathered.defined(), "deterministic scan backward: the forward exchange is missing");
  Global G(ctx, jobs, dev);
  const int64_t Fmax = G.L.Fmax, rows = BH * Fmax;

  // One all-gather of every job's states Y and their gradients dY (per frame),
  // and of the terminal states' gradients (per rank).
  std::vector<int64_t> y_off, dy_off, dt_off;
  int64_t slice = 0;
  for (const ScanJob& j : jobs) {
    y_off.push_back(slice);
    slice += rows * D * j.E;
    dy_off.push_back(slice);
    slice += rows * D * j.E;
    dt_off.push_back(j.terminal ? slice : -1);
    if (j.terminal) slice += BH * D * j.E;
  }
  bool every_piece = F == Fmax;  // else zeros stand for the padding and the absent gradients
  for (const ScanJob& j : jobs) every_piece = every_piece && j.dY.defined() && (!j.terminal || j.dT.defined());
  const Shape pack_shape = {std::max<int64_t>(slice, 1)};
  Tensor pack = every_piece ? Tensor::empty(pack_shape, dt, dev) : Tensor::zeros(pack_shape, dt, dev);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const ScanJob& j = jobs[i];
    put(pack, y_off[i], j.Y, BH, F, Fmax, D * j.E);
    if (j.dY.defined()) put(pack, dy_off[i], j.dY, BH, F, Fmax, D * j.E);
    if (j.terminal && j.dT.defined()) kern::copy_region(pack, dt_off[i], j.dT, 0, j.dT.numel());
  }
  slice = pack.numel();
  Tensor gathered = Tensor::empty({static_cast<int64_t>(P) * slice}, dt, dev);
  comm.all_gather(gathered, pack);

  for (const bool rev : {false, true}) {
    std::vector<size_t> idx;
    std::vector<ScanJob> g;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const ScanJob& j = jobs[i];
      if (reversed_order(j) != rev) continue;
      idx.push_back(i);
      ScanJob gj = G.job(ctx, j, i, /*with_U=*/false);
      const Shape ys = states_shape(BH, G.Ft, D, j.E);
      gj.Y = assemble(gathered, slice, y_off[i], ys, BH, D * j.E, ctx.frames, Fmax, rev);
      gj.dY = assemble(gathered, slice, dy_off[i], ys, BH, D * j.E, ctx.frames, Fmax, rev);
      gj.X0 = Tensor::zeros(state_shape(BH, D, j.E), dt, dev);
      if (j.terminal) {  // Σ over ranks of dT, in rank order
        gj.dT = Tensor::zeros(gj.X0.shape(), dt, dev);
        Tensor dTp = Tensor::empty(gj.X0.shape(), dt, dev);
        for (int p = 0; p < P; ++p) {
          kern::copy_region(dTp, 0, gathered, p * slice + dt_off[i], dTp.numel());
          kern::add(gj.dT, gj.dT, dTp);
        }
      }
      g.push_back(gj);
    }
    if (g.empty()) continue;
    // The transition gradients shared the way the jobs share them: the first job of a shared
    // one writes it whole (the engine's outer products overwrite), the others add to it.
    for (size_t k = 0; k < g.size(); ++k) {
      const ScanJob& j = jobs[idx[k]];
      size_t s = 0;
      while (s < k && !jobs[idx[s]].dP.same_as(j.dP)) ++s;
      g[k].dP = s < k ? g[s].dP : Tensor::empty(g[k].P.shape(), dt, dev);
      g[k].dP_accumulate = s < k;
    }
    ScanContext gc = G.context(ctx, rev);
    Tensor gdg = Tensor::zeros({BH, G.Ft}, dt, dev);
    scan_backward(gc, g, gdg);
    const int64_t o = global_offset(ctx.frames, r, rev);
    kern::add(dg, dg, slice_frames(gdg, o, {BH, F}, BH, G.Ft, 1));
    for (size_t k = 0; k < g.size(); ++k) {
      ScanJob& j = jobs[idx[k]];
      j.dU = slice_frames(g[k].dU, o, with_frames(g[k].dU.shape(), F), BH, G.Ft, D * j.E);
      bool first = true;  // the first job of a shared dP writes it
      for (size_t s = 0; s < k; ++s) first = first && !jobs[idx[s]].dP.same_as(j.dP);
      if (!first) continue;
      const Tensor dP = slice_frames(g[k].dP, o, j.dP.shape(), BH, G.Ft, D * D);
      if (j.dP_accumulate)
        kern::add(j.dP, j.dP, dP);
      else if (dP.numel() > 0)
        kern::copy_region(j.dP, 0, dP, 0, dP.numel());
    }
  }
}

void frame_ordered_sum(Communicator& comm, Tensor& out, const Tensor& partials, const std::vector<int64_t>& frames,
                       bool reversed) {
  const int P = comm.size(), r = comm.rank();
  const int64_t C = out.numel(), Fmax = *std::max_element(frames.begin(), frames.end());
  const int64_t Ft = std::accumulate(frames.begin(), frames.end(), int64_t{0});
  GDNCP_CHECK(partials.numel() == frames[static_cast<size_t>(r)] * C, "frame_ordered_sum: partials ", partials.str(),
              " are not (", frames[static_cast<size_t>(r)], ", ", C, ")");
  Tensor pack = Tensor::zeros({std::max<int64_t>(Fmax * C, 1)}, partials.dtype(), partials.device());
  put(pack, 0, partials, 1, frames[static_cast<size_t>(r)], Fmax, C);
  const int64_t slice = pack.numel();
  Tensor gathered = Tensor::empty({static_cast<int64_t>(P) * slice}, partials.dtype(), partials.device());
  comm.all_gather(gathered, pack);
  if (r != 0) {
    out.fill_(0.0);
    return;
  }
  const Tensor all = assemble(gathered, slice, 0, {Ft, C}, 1, C, frames, Fmax, reversed);
  kernels::frame_sum(out, all);
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
