// src/cp/scan/exchange.cpp — Note [exchange] (exchange.h): the log-depth and
// hierarchical exchanges of the CP scan's composites, on the fold twins.
#include "cp/scan/exchange.h"

#include <cerrno>
#include <cstdlib>
#include <string>
#include <utility>

#include "cp/scan/region.h"
#include "cp/scan/scan_engine.h"
#include "gdncp/error.h"
#include "kernels/cp_kernels.h"

namespace gdncp {
namespace cp {

const char* exchange_name(Exchange e) {
  switch (e) {
    case Exchange::automatic: return "auto";
    case Exchange::all_gather: return "allgather";
    case Exchange::log: return "log";
    case Exchange::hierarchical: return "hierarchical";
  }
  return "unknown";
}

namespace detail {
namespace {

// Groups of at most this many ranks in one node keep the all-gather under `automatic`
// (docs/scaling.md: on NVLink its one collective beats ⌈log₂P⌉ dependent rounds there).
constexpr int kAllGatherMaxRanks = 8;

int env_node_size() {
  const char* s = std::getenv("GDNCP_CP_NODE_SIZE");
  if (!s || !*s) return 0;
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  GDNCP_CHECK(errno == 0 && end && *end == '\0' && v >= 1 && v <= (1 << 20),
              "GDNCP_CP_NODE_SIZE: must be a rank count >= 1, got \"", s, "\"");
  return static_cast<int>(v);
}

// Independent folds in one launch; the batch is emptied for the next ones.
void run_batch(std::vector<Fold>& batch, int64_t BH, int64_t D) {
  if (!batch.empty()) kern::folds(batch, BH, D);
  batch.clear();
}

// Sizes shared by one exchange; transpose: the backward's adjoint maps a → Nᵀ a + h.
struct Ops {
  int64_t BH = 0, D = 0;
  DType dt = DType::f32;
  Device dev = Device::cpu;
  bool transpose = false;
  Tensor zeros;  // (BH·D·D): the additive part of a product

  Tensor flat(int64_t E) const { return Tensor::empty({BH * D * E}, dt, dev); }
  // op(N) x + h (x undefined: h), into `into` where given. With a batch, the result is computed
  // when the batch runs.
  Tensor apply(const Tensor& N, const Tensor& h, const Tensor& x, int64_t E, std::vector<Fold>* batch = nullptr,
               const Tensor& into = Tensor()) const {
    GDNCP_CHECK(!x.defined() || N.defined(), "cp exchange: a transition that did not travel is needed");
    return submit(step(into.defined() ? into : flat(E), x, N, transpose, h, E), batch);
  }
  // The linear part of b∘a (a applied first): N_b N_a, or N_a N_b for the transposed maps.
  Tensor product(const Tensor& Nb, const Tensor& Na, std::vector<Fold>* batch = nullptr,
                 const Tensor& into = Tensor()) const {
    GDNCP_CHECK(Na.defined() && Nb.defined(), "cp exchange: a transition that did not travel is needed");
    return submit(step(into.defined() ? into : flat(D), transpose ? Nb : Na, transpose ? Na : Nb, false, zeros, D),
                  batch);
  }

 private:
  // One fold step X = op(M) init + H.
  static Fold step(const Tensor& X, const Tensor& init, const Tensor& M, bool t, const Tensor& H, int64_t E) {
    Fold f;
    f.X = X;
    f.init = init;
    f.Mbuf = M;
    f.transpose = t;
    f.Hbuf = H;
    f.E = E;
    f.order = {0};
    return f;
  }
  Tensor submit(const Fold& f, std::vector<Fold>* batch) const {
    if (batch) {
      batch->push_back(f);
    } else {
      std::vector<Fold> one = {f};
      kern::folds(one, BH, D);
    }
    return f.X;
  }
};

// x → op(N) x + h; N undefined where no reader needs it (Note [exchange]).
struct Affine {
  Tensor N, h;
};

// One map of the log scan over G positions (nodes) of n ranks; this rank's lane is rank mod n.
struct Item {
  int64_t E = 0;
  bool reverse = false;  // positions run over the nodes from the last one
  Tensor init;           // the initial state the exclusive composite is applied to (undefined = 0)
  bool want_total = false;
  Affine own;
  // The buffer own lies in, where its parts share one (place_own's; a node of one rank's pack),
  // and the element offsets of own.h and own.N there (-1: not there).
  Tensor home;
  int64_t home_h = -1, home_N = -1;
  Tensor out;    // the exclusive composite applied to init; undefined when none (position 0, no init)
  Tensor total;  // want_total: the inclusive composite of all positions applied to 0, on every rank
};

int pos_of(int node, int G, bool reverse) { return reverse ? G - 1 - node : node; }
// Does a composite whose range starts at position lo carry its N in a round?
bool carries_N(int lo, bool last, bool has_init) { return has_init || (lo > 0 && !last); }
// Does the map of position pos itself need its N? It travels with it, or the inclusive
// composite that starts with it is composed further (at the last position: only for the total).
bool own_needs_N(int pos, int G, bool has_init, bool want_total) {
  return G > 1 && (has_init || pos > 0) && (pos < G - 1 || want_total);
}

// The log scan of Note [exchange] over the nodes (positions) of every item, this rank at node g.
void log_scan(Communicator& comm, const Ops& ops, int n, std::vector<Item>& items) {
  const int P = comm.size(), r = comm.rank(), G = P / n, g = r / n, lane = r % n;
  int rounds = 0;
  while ((1 << rounds) < G) ++rounds;
  struct State {
    Affine incl, excl;
    bool have_excl = false;
  };
  std::vector<State> st(items.size());
  for (size_t i = 0; i < items.size(); ++i) st[i].incl = items[i].own;
  const int64_t DD = ops.D * ops.D;
  // Both rank orders of a round in one step, each a way of its own: a transfer to the rank 2ᵏ
  // ahead in its order, from the one 2ᵏ behind.
  struct Way {
    bool dir = false;
    int pos = 0;
    std::vector<size_t> mine;
  };
  std::vector<Way> ways;
  for (bool dir : {false, true}) {
    Way w;
    w.dir = dir;
    w.pos = pos_of(g, G, dir);
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].reverse == dir) w.mine.push_back(i);
    if (!w.mine.empty()) ways.push_back(w);
  }
  // A message of a way in round k whose composites start at position lo: per item h, then N
  // where it travels (at[2q], at[2q + 1] for the way's q-th item; -1: not in it). Sender and
  // receiver lay it out by this one rule.
  struct Layout {
    std::vector<int64_t> at;
    int64_t total = 0;
  };
  auto layout = [&](int k, int lo, const Way& w) {
    Layout m;
    for (size_t i : w.mine) {
      m.at.push_back(m.total);
      m.total += ops.BH * ops.D * items[i].E;
      const bool N = carries_N(lo, k == rounds - 1, items[i].init.defined());
      m.at.push_back(N ? m.total : -1);
      m.total += N ? ops.BH * DD : 0;
    }
    return m;
  };
  // What a way sends in round k. The message is allocated a round ahead, so that the
  // compositions of the round before write into it (placed: already there) and only maps not
  // composed then are copied in.
  struct Outbox {
    int dst = -1;
    Layout m;
    std::vector<char> placed;
    Tensor msg;
  };
  // Round 0's message of a way whose items' own maps lie in their home in the message's layout
  // (place_own's home; a node of one rank's pack, which lays out h then M job after job as a
  // middle rank's message does): that region of the home, sent as it is. Undefined otherwise.
  auto at_home = [&](const Way& w, const Layout& m) {
    const Item& first = items[w.mine[0]];
    const int64_t base = first.home_h - m.at[0];
    for (size_t q = 0; q < w.mine.size(); ++q) {
      const Item& it = items[w.mine[q]];
      if (!it.home.defined() || !it.home.same_as(first.home) || it.home_h != base + m.at[2 * q] ||
          (m.at[2 * q + 1] >= 0 && it.home_N != base + m.at[2 * q + 1]))
        return Tensor();
    }
    return region(first.home, base, m.total);
  };
  auto outbox = [&](int k, const Way& w) {
    Outbox o;
    const int s = 1 << k;
    o.dst = w.pos + s < G ? pos_of(w.pos + s, G, w.dir) * n + lane : -1;
    o.m = layout(k, std::max(0, w.pos - s + 1), w);
    if (o.dst >= 0 && k == 0) o.msg = at_home(w, o.m);
    o.placed.assign(o.m.at.size(), o.msg.defined() ? 1 : 0);
    if (o.dst >= 0 && !o.msg.defined()) o.msg = Tensor::empty({o.m.total}, ops.dt, ops.dev);
    return o;
  };
  // Where a composition of round k's item q goes: its slot in the next message, if it has one.
  auto slot = [&](Outbox& o, size_t q, int64_t n_elems) {
    if (!o.msg.defined() || o.m.at[q] < 0) return Tensor();
    o.placed[q] = 1;
    return region(o.msg, o.m.at[q], n_elems);
  };
  std::vector<Outbox> out;
  for (const Way& w : ways) out.push_back(rounds > 0 ? outbox(0, w) : Outbox());
  for (int k = 0; k < rounds; ++k) {
    const int s = 1 << k;
    const bool last = k == rounds - 1;
    std::vector<Communicator::Transfer> ts;
    std::vector<Layout> in;  // per way: the message it receives, whose composites start 2ᵏ⁺¹ − 1 back
    for (size_t wi = 0; wi < ways.size(); ++wi) {
      const Way& w = ways[wi];
      Outbox& o = out[wi];
      for (size_t q = 0; o.msg.defined() && q < w.mine.size(); ++q) {
        const Affine& a = st[w.mine[q]].incl;
        if (!o.placed[2 * q]) kern::copy_region(o.msg, o.m.at[2 * q], a.h, 0, a.h.numel());
        if (o.m.at[2 * q + 1] >= 0 && !o.placed[2 * q + 1]) {
          GDNCP_CHECK(a.N.defined(), "cp exchange: a transition that must travel is missing");
          kern::copy_region(o.msg, o.m.at[2 * q + 1], a.N, 0, a.N.numel());
        }
      }
      Communicator::Transfer t;
      t.dst = o.dst;
      t.send = o.msg;
      t.src = w.pos - s >= 0 ? pos_of(w.pos - s, G, w.dir) * n + lane : -1;
      in.push_back(layout(k, std::max(0, w.pos - 2 * s + 1), w));
      if (t.src >= 0) t.recv = Tensor::empty({in.back().total}, ops.dt, ops.dev);
      ts.push_back(t);
    }
    comm.send_recv_group(ts);
    std::vector<Fold> batch;  // the round's compositions, independent of each other: one launch
    for (size_t wi = 0; wi < ways.size(); ++wi) {
      const Way& w = ways[wi];
      Outbox next = last ? Outbox() : outbox(k + 1, w);
      for (size_t q = 0; ts[wi].src >= 0 && q < w.mine.size(); ++q) {
        Item& it = items[w.mine[q]];
        // The received map, read where it arrived; its N travelled iff the new composites,
        // which start where it does, keep theirs.
        const int64_t h_at = in[wi].at[2 * q], N_at = in[wi].at[2 * q + 1];
        const bool keep_N = N_at >= 0;
        Affine a;
        a.h = region(ts[wi].recv, h_at, ops.BH * ops.D * it.E);
        if (keep_N) a.N = region(ts[wi].recv, N_at, ops.BH * DD);
        State& t = st[w.mine[q]];
        if (t.have_excl) {
          Affine e;
          e.h = ops.apply(t.excl.N, t.excl.h, a.h, it.E, &batch);
          if (keep_N) e.N = ops.product(t.excl.N, a.N, &batch);
          t.excl = e;
        } else {
          t.excl = a;
          t.have_excl = true;
        }
        const bool incl_used = w.pos < G - 1 || it.want_total;
        if ((!last && incl_used) || (last && it.want_total && w.pos == G - 1)) {  // it travels on, or is the total
          Affine c;
          c.h = ops.apply(t.incl.N, t.incl.h, a.h, it.E, &batch, slot(next, 2 * q, ops.BH * ops.D * it.E));
          if (keep_N && !last) c.N = ops.product(t.incl.N, a.N, &batch, slot(next, 2 * q + 1, ops.BH * DD));
          t.incl = c;
        }
      }
      out[wi] = next;
    }
    run_batch(batch, ops.BH, ops.D);
  }
  // The results, and the totals broadcast from the last node's first lane (the same bits everywhere).
  int64_t total_n = 0;
  std::vector<Fold> batch;
  for (size_t i = 0; i < items.size(); ++i) {
    Item& it = items[i];
    const State& t = st[i];
    if (it.init.defined())
      it.out = t.have_excl ? ops.apply(t.excl.N, t.excl.h, it.init, it.E, &batch) : it.init;
    else if (t.have_excl)
      it.out = t.excl.h;
    if (!it.want_total) continue;
    GDNCP_CHECK(!it.reverse, "cp exchange: a terminal state needs the forward rank order");
    total_n += ops.BH * ops.D * it.E;
  }
  run_batch(batch, ops.BH, ops.D);
  if (total_n == 0) return;
  const int root = (G - 1) * n;
  Tensor totals = Tensor::empty({total_n}, ops.dt, ops.dev);
  int64_t off = 0;
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].want_total) {
      if (r == root) kern::copy_region(totals, off, st[i].incl.h, 0, st[i].incl.h.numel());
      off += ops.BH * ops.D * items[i].E;
    }
  comm.broadcast(totals, root);
  off = 0;
  for (Item& it : items)
    if (it.want_total) {  // read where it arrived
      it.total = region(totals, off, ops.BH * ops.D * it.E);
      off += it.total.numel();
    }
}

// The n packs of this rank's node into all (slot l: lane l's), by a ring of n − 1 exchanges,
// each received straight into its slot; this rank's own is copied in unless it lies there.
void node_gather(Communicator& comm, int n, const Tensor& pack, Tensor all) {
  const int r = comm.rank(), base = r / n * n, lane = r % n;
  const int64_t m = pack.numel();
  GDNCP_CHECK(all.numel() == n * m, "cp exchange: a node buffer of ", all.numel(), " elements for ", n, " packs of ",
              m);
  if (region(all, lane * m, m).data() != pack.data()) kern::copy_region(all, lane * m, pack, 0, m);
  for (int t = 1; t < n; ++t) {
    const int from = (lane - t + n) % n;
    Tensor slot = region(all, from * m, m);
    comm.send_recv(pack, base + (lane + t) % n, slot, base + from);
  }
}

// The node's lanes in a job's logical order.
std::vector<int> lanes_in_order(int n, bool reverse) {
  std::vector<int> v;
  for (int q = 0; q < n; ++q) v.push_back(reverse ? n - 1 - q : q);
  return v;
}

// A fold of job j over the lanes `order` of a node: M_l from Mbuf (slot j.M_off of lane l's slice,
// slices m_stride apart; the identity where j's M was not packed), H_l from hbuf likewise (slot
// h_off, slices h_stride apart); transpose: the adjoint maps. From a zero state (init undefined).
Fold node_fold(const ExchangeJob& j, const Tensor& Mbuf, int64_t m_stride, bool transpose, const Tensor& hbuf,
               int64_t h_off, int64_t h_stride, std::vector<int> order) {
  Fold f;
  if (j.M_off >= 0) f.Mbuf = Mbuf;
  f.m_off = std::max<int64_t>(j.M_off, 0);
  f.m_stride = m_stride;
  f.transpose = transpose;
  f.Hbuf = hbuf;
  f.h_off = h_off;
  f.h_stride = h_stride;
  f.E = j.E;
  f.order = std::move(order);
  return f;
}

// The product of the node's transitions in logical order, M_last ⋯ M_first: the linear
// part of the node's forward map and, as transposed storage, of its adjoint map. One lane's is its
// M where it lies; more lanes fold the rest onto the first one's, read in place, in batch.
Tensor node_product(const Ops& ops, const Tensor& nodebuf, int64_t stride, const ExchangeJob& j, int n,
                    std::vector<Fold>& batch, const Tensor& into = Tensor()) {
  GDNCP_CHECK(j.M_off >= 0, "cp exchange: the node's transitions were not packed");
  const std::vector<int> order = lanes_in_order(n, j.reverse);
  const Tensor first = region(nodebuf, order[0] * stride + j.M_off, ops.BH * ops.D * ops.D);
  if (n == 1) return first;
  Fold f = node_fold(j, nodebuf, stride, false, ops.zeros, 0, 0, {order.begin() + 1, order.end()});
  f.E = ops.D;  // the product's columns: M_first's
  f.X = into.defined() ? into : ops.flat(ops.D);
  f.init = first;
  batch.push_back(f);
  return f.X;
}

Ops ops_of(const Tensor& like, int64_t BH, int64_t D, bool transpose) {
  Ops o;
  o.BH = BH;
  o.D = D;
  o.dt = like.dtype();
  o.dev = like.device();
  o.transpose = transpose;
  o.zeros = Tensor::zeros({BH * D * D}, o.dt, o.dev);
  return o;
}

// With more than one lane a node's own maps are fold results. Those of each rank order are
// written into one home laid out as the order's first message (item after item, h, then N where
// the item needs it), which log_scan then sends as it is (at_home). It reads the items' E,
// reverse, init and want_total. Nothing travels over one node, and one lane's maps lie in its pack.
void place_own(std::vector<Item>& items, const Ops& ops, int n, int g, int G) {
  if (n == 1 || G == 1) return;
  for (bool dir : {false, true}) {
    int64_t total = 0;
    for (Item& it : items) {
      if (it.reverse != dir) continue;
      it.home_h = total;
      total += ops.BH * ops.D * it.E;
      if (own_needs_N(pos_of(g, G, dir), G, it.init.defined(), it.want_total)) {
        it.home_N = total;
        total += ops.BH * ops.D * ops.D;
      }
    }
    if (total == 0) continue;
    const Tensor home = Tensor::empty({total}, ops.dt, ops.dev);
    for (Item& it : items)
      if (it.reverse == dir) it.home = home;
  }
}

// This node's own map in an item (its lanes' maps folded in the item's order; transpose:
// the adjoint maps, M from Mbuf, addends from hbuf), when it travels or is the total, and its
// N when it is needed; into the item's home where place_own gave it one. It reads the item's E,
// reverse, init and want_total. The folds go into batch (with one lane the map is that lane's,
// read where it lies, and that is its home).
void fill_own(Item& it, const ExchangeJob& j, const Ops& ops, int n, int g, int G, const Tensor& Mbuf,
              int64_t fwd_total, bool transpose, const Tensor& hbuf, int64_t h_off, int64_t h_total,
              std::vector<Fold>& batch) {
  const int pos = pos_of(g, G, it.reverse);
  if (G > 1 || it.want_total) {  // the node's own map travels (or is the total)
    GDNCP_CHECK(j.M_off >= 0 || n == 1, "cp exchange: the node's transitions were not packed");
    Fold f = node_fold(j, Mbuf, fwd_total, transpose, hbuf, h_off, h_total, lanes_in_order(n, it.reverse));
    if (it.home.defined()) f.X = state_view(it.home, it.home_h, ops.BH, ops.D, j.E);
    it.own.h = fold_into(f, batch, ops.BH, ops.D);
  }
  if (own_needs_N(pos, G, it.init.defined(), it.want_total))
    it.own.N = node_product(ops, Mbuf, fwd_total, j, n, batch,
                            it.home_N >= 0 ? region(it.home, it.home_N, ops.BH * ops.D * ops.D) : Tensor());
  if (n == 1 && it.own.h.defined()) {  // views of the pack (fold_into, node_product)
    it.home = hbuf;
    it.home_h = h_off;
    if (it.own.N.defined() && Mbuf.same_as(hbuf)) it.home_N = j.M_off;
  }
}

}  // namespace

void check_exchange_only(const char* entry, const CpOptions& o) {
  GDNCP_CHECK(!o.reverse_rank_order, entry,
              ": cp_options.reverse_rank_order: not an option of this entry (it scans both directions)");
  GDNCP_CHECK(o.truncate_to_active == 0, entry, ": cp_options.truncate_to_active: not an option of this entry");
}

ExchangePlan plan_exchange(Communicator& comm, Exchange requested, int node_size) {
  const int P = comm.size();
  GDNCP_CHECK(requested == Exchange::automatic || requested == Exchange::all_gather || requested == Exchange::log ||
                  requested == Exchange::hierarchical,
              "exchange: ", static_cast<int>(requested), " is not an Exchange (auto, allgather, log, hierarchical)");
  GDNCP_CHECK(node_size >= 0, "node_size: must be >= 0 (0: detect), got ", node_size);
  if (requested == Exchange::all_gather || (requested == Exchange::automatic && P <= 2))
    return {Exchange::all_gather, P};
  if (requested == Exchange::log) return {Exchange::log, 1};
  int n = node_size > 0 ? node_size : env_node_size();
  if (n == 0) n = comm.node_size();
  if (n <= 0 || n > P) n = P;  // unknown: one node
  if (requested == Exchange::hierarchical) {
    GDNCP_CHECK(P % n == 0, "exchange hierarchical: node_size ", n, " does not divide the group's ", P,
                " ranks (set CpOptions::node_size or GDNCP_CP_NODE_SIZE)");
    return {Exchange::hierarchical, n};
  }
  if (n == P) return P <= kAllGatherMaxRanks ? ExchangePlan{Exchange::all_gather, P} : ExchangePlan{Exchange::log, 1};
  if (n > 1 && P % n == 0) return {Exchange::hierarchical, n};
  return {Exchange::log, 1};
}

int64_t kept_elements(const ExchangePlan& plan, const std::vector<ExchangeJob>& jobs, int64_t fwd_total, int64_t BH,
                      int64_t D) {
  int64_t n = static_cast<int64_t>(plan.node) * fwd_total;
  for (const ExchangeJob& j : jobs) n += BH * D * j.E * (j.terminal ? 2 : 1);
  return n;
}

void exchange_forward(Communicator& comm, const ExchangePlan& plan, const std::vector<ExchangeJob>& jobs,
                      const Tensor& pack, int64_t fwd_total, int64_t BH, int64_t D, Tensor& kept,
                      std::vector<Tensor>& X0, std::vector<Tensor>& T) {
  const int P = comm.size(), r = comm.rank(), n = plan.node, G = P / n, g = r / n, lane = r % n;
  GDNCP_CHECK(n >= 1 && P % n == 0, "cp exchange: bad node size ", n);
  const int64_t node_n = static_cast<int64_t>(n) * fwd_total, kept_n = kept_elements(plan, jobs, fwd_total, BH, D);
  X0.assign(jobs.size(), Tensor());
  T.assign(jobs.size(), Tensor());
  auto views = [&](const Tensor& buf) {  // X0 and T as views into the kept buffer (Note [exchange])
    int64_t off = node_n;
    const auto next = [&](const ExchangeJob& j) {
      Tensor v = state_view(buf, off, BH, D, j.E);
      off += BH * D * j.E;
      return v;
    };
    for (size_t i = 0; i < jobs.size(); ++i) X0[i] = next(jobs[i]);
    for (size_t i = 0; i < jobs.size(); ++i)
      if (jobs[i].terminal) T[i] = next(jobs[i]);
  };
  GDNCP_CHECK(pack.defined() || kept.defined(), "cp exchange: neither composites nor kept results");
  GDNCP_CHECK(!kept.defined() || kept.numel() == kept_n, "cp scan: kept composites do not match this call (",
              kept.numel(), " elements)");
  if (!pack.defined()) return views(kept);  // a checkpoint recompute: what the forward kept

  const Ops ops = ops_of(pack, BH, D, false);
  const Tensor buf = kept.defined() ? kept : Tensor::empty({kept_n}, pack.dtype(), pack.device());
  views(buf);
  const Tensor nodebuf = region(buf, 0, node_n);
  node_gather(comm, n, pack, nodebuf);
  std::vector<Item> items(jobs.size());
  std::vector<Fold> batch;  // the nodes' own maps, then X0: one launch each
  for (size_t i = 0; i < jobs.size(); ++i) {
    items[i].E = jobs[i].E;
    items[i].reverse = jobs[i].reverse;
    items[i].want_total = jobs[i].terminal;
  }
  place_own(items, ops, n, g, G);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const ExchangeJob& j = jobs[i];
    fill_own(items[i], j, ops, n, g, G, nodebuf, fwd_total, false, nodebuf, j.h_off, fwd_total, batch);
  }
  run_batch(batch, BH, D);
  log_scan(comm, ops, n, items);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const ExchangeJob& j = jobs[i];
    const int lp = j.reverse ? n - 1 - lane : lane;
    const std::vector<int> all = lanes_in_order(n, j.reverse);
    GDNCP_CHECK(j.M_off >= 0 || (lp + (items[i].out.defined() ? 1 : 0)) <= 1,
                "cp exchange: the fold needs composites that were not gathered");
    // over the lanes before this one, into X0
    Fold f = node_fold(j, nodebuf, fwd_total, false, nodebuf, j.h_off, fwd_total, {all.begin(), all.begin() + lp});
    f.X = X0[i];
    f.init = items[i].out;
    batch.push_back(f);
    if (j.terminal) kern::copy_region(T[i], 0, items[i].total, 0, T[i].numel());
  }
  run_batch(batch, BH, D);
  kept = buf;  // complete
}

void exchange_backward(Communicator& comm, const ExchangePlan& plan, const std::vector<ExchangeJob>& jobs,
                       const Tensor& kept, int64_t fwd_total, const Tensor& pack, int64_t BH, int64_t D,
                       std::vector<Tensor>& seed) {
  const int P = comm.size(), r = comm.rank(), n = plan.node, G = P / n, g = r / n, lane = r % n;
  GDNCP_CHECK(n >= 1 && P % n == 0, "cp exchange: bad node size ", n);
  GDNCP_CHECK(kept.defined() && kept.numel() >= static_cast<int64_t>(n) * fwd_total,
              "cp scan backward: the forward composites are missing");
  const Ops ops = ops_of(pack, BH, D, true);
  const int64_t bwd_total = pack.numel();

  // Σ over ranks of dT: one all-reduce of them packed (bitwise the same on every rank).
  int64_t dT_n = 0;
  for (const ExchangeJob& j : jobs)
    if (j.terminal) dT_n += BH * D * j.E;
  std::vector<Tensor> a0(jobs.size());
  if (dT_n > 0) {
    Tensor sums = Tensor::empty({dT_n}, ops.dt, ops.dev);
    int64_t off = 0;
    for (const ExchangeJob& j : jobs)
      if (j.terminal) {
        kern::copy_region(sums, off, pack, j.dT_off, BH * D * j.E);
        off += BH * D * j.E;
      }
    comm.all_reduce_sum(sums);
    off = 0;
    for (size_t i = 0; i < jobs.size(); ++i)
      if (jobs[i].terminal) {
        a0[i] = ops.flat(jobs[i].E);
        kern::copy_region(a0[i], 0, sums, off, a0[i].numel());
        off += a0[i].numel();
      }
  }

  // The adjoint maps run in the reverse logical order: within the node and over the nodes. A node
  // of one rank reads its pack where it is (nothing is kept from the backward).
  Tensor nbuf = pack;
  if (n > 1) {
    nbuf = Tensor::empty({static_cast<int64_t>(n) * bwd_total}, ops.dt, ops.dev);
    node_gather(comm, n, pack, nbuf);
  }
  std::vector<Item> items(jobs.size());
  std::vector<Fold> batch;  // the nodes' own maps, then the seeds: one launch each
  for (size_t i = 0; i < jobs.size(); ++i) {
    items[i].E = jobs[i].E;
    items[i].reverse = !jobs[i].reverse;
    items[i].init = a0[i];
  }
  place_own(items, ops, n, g, G);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const ExchangeJob& j = jobs[i];
    fill_own(items[i], j, ops, n, g, G, kept, fwd_total, true, nbuf, j.dX0_off, bwd_total, batch);
  }
  run_batch(batch, BH, D);
  log_scan(comm, ops, n, items);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const ExchangeJob& j = jobs[i];
    const std::vector<int> all = lanes_in_order(n, !j.reverse);  // backward order
    const int bp = j.reverse ? lane : n - 1 - lane;              // this lane's backward position
    const Tensor& init = items[i].out;
    if (bp == 0) {
      seed[i] = init;
      continue;
    }
    GDNCP_CHECK(j.M_off >= 0 || (bp + (init.defined() ? 1 : 0)) <= 1,
                "cp scan backward: the fold needs composites that were not gathered");
    // over the lanes after this one
    Fold f = node_fold(j, kept, fwd_total, true, nbuf, j.dX0_off, bwd_total, {all.begin(), all.begin() + bp});
    f.X = seed[i] = ops.flat(j.E);
    f.init = init;
    batch.push_back(f);
  }
  run_batch(batch, BH, D);
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
