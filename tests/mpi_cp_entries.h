// tests/mpi_cp_entries.h — the CP entries as data for the multi-rank tests: global
// inputs split by frames over the ranks (any split, empty ranks, reverse order, a clip
// mask), each entry's call, and the checks P ranks == one rank and checkpointing on ==
// off bitwise.
#pragma once

#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "mpi_cp_fixtures.h"
#include "util/tolerance.h"

namespace gdncp {
namespace test {

// --- splits ------------------------------------------------------------------------

// Frames of each logical block, per group size: 11 and 21 frames, 3 frames
// on 4 and 8 ranks (empty ranks), and unbalanced splits with empty ranks first,
// inside and last.
inline std::vector<std::vector<int64_t>> splits_for(int P) {
  switch (P) {
    case 1: return {{11}, {21}, {3}};
    case 2: return {{6, 5}, {11, 10}, {0, 3}, {2, 9}};
    case 3: return {{4, 4, 3}, {7, 7, 7}, {5, 0, 6}, {1, 1, 0}};
    case 4: return {{3, 3, 3, 2}, {6, 5, 5, 5}, {1, 1, 1, 0}, {0, 4, 0, 7}};
    case 8: return {{3, 3, 3, 3, 3, 2, 2, 2}, {2, 2, 2, 1, 1, 1, 1, 1}, {1, 1, 1, 0, 0, 0, 0, 0}};
    default: {
      std::vector<std::vector<int64_t>> s(1);
      for (int r = 0; r < P; ++r) s[0].push_back(cp::balanced_split(11, P, r).frames);
      return s;
    }
  }
}

inline std::string split_str(const std::vector<int64_t>& s) {
  std::string out;
  for (int64_t f : s) out += (out.empty() ? "" : "+") + std::to_string(f);
  return out;
}

// Where logical block b sits: {offset, frames}.
inline std::pair<int64_t, int64_t> block_of(const std::vector<int64_t>& split, int b) {
  const int64_t off = std::accumulate(split.begin(), split.begin() + b, int64_t{0});
  return {off, split[static_cast<size_t>(b)]};
}

// A clip mask (B, F_total) f32: rows pack differently; row 1 starts clips at
// every block boundary too (a start on a rank's first frame), row 0 has
// 1-frame clips.
inline Tensor clip_mask(int64_t B, const std::vector<int64_t>& split) {
  const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
  std::vector<double> c(static_cast<size_t>(B * Ft), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t f = 0; f < Ft; ++f) {
      const bool start = b % 2 == 0 ? (f % 5 == 0 || f % 5 == 1 || f % 7 == 3) : (f % 4 == 2);
      if (start) c[static_cast<size_t>(b * Ft + f)] = 1.0;
    }
    if (b % 2 == 1)
      for (size_t k = 0, off = 0; k < split.size(); off += static_cast<size_t>(split[k]), ++k)
        if (off < static_cast<size_t>(Ft)) c[static_cast<size_t>(b * Ft) + off] = 1.0;
  }
  return Tensor::from_vector(c, {B, Ft}, DType::f32);
}

// The clips of row b of a mask: [start, end) pairs (frame 0 always starts one).
inline std::vector<std::pair<int64_t, int64_t>> clips_of(const Tensor& mask, int64_t b) {
  const int64_t Ft = mask.size(1);
  const std::vector<double> c = mask.to_vector();
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t f = 0; f < Ft; ++f)
    if (f == 0 || c[static_cast<size_t>(b * Ft + f)] != 0.0) {
      if (!out.empty()) out.back().second = f;
      out.push_back({f, Ft});
    }
  return out;
}

// --- tensors split by rows and frames ----------------------------------------------

// How a tensor of an entry is laid out: `group` rows of its row axis per batch
// row (H for B·H axes), `per` elements of its frame axis per frame (S for
// token axes). -1: no such axis (norm weights: neither; RoPE tables: no row axis).
struct Ax {
  int row = -1;
  int64_t group = 1;
  int frame = -1;
  int64_t per = 1;
};

inline Tensor frames(const Tensor& t, const Ax& a, int64_t lo, int64_t hi) {
  return a.frame < 0 ? t : slice(t, a.frame, lo * a.per, hi * a.per);
}
inline Tensor row_frames(const Tensor& t, const Ax& a, int64_t b, int64_t lo, int64_t hi) {
  const Tensor r = a.row < 0 ? t : slice(t, a.row, b * a.group, (b + 1) * a.group);
  return frames(r, a, lo, hi);
}

// dst + src placed at row block b and frame lo (a tensor of dst's shape); unsplit tensors add whole.
inline Tensor place(const Tensor& dst, const Tensor& src, const Ax& a, int64_t b, int64_t lo) {
  std::vector<double> d = dst.to_vector();
  const std::vector<double> s = src.to_vector();
  const Shape &ds = dst.shape(), &ss = src.shape();
  std::vector<int64_t> idx(ss.size(), 0);
  for (size_t n = 0; n < s.size(); ++n) {
    int64_t rem = static_cast<int64_t>(n), flat = 0;
    for (size_t k = ss.size(); k-- > 0;) {
      idx[k] = rem % ss[k];
      rem /= ss[k];
    }
    for (size_t k = 0; k < ss.size(); ++k) {
      int64_t i = idx[k];
      if (static_cast<int>(k) == a.row) i += b * a.group;
      if (static_cast<int>(k) == a.frame) i += lo * a.per;
      flat = flat * ds[k] + i;
    }
    d[static_cast<size_t>(flat)] += s[n];
  }
  return Tensor::from_vector(d, ds, dst.dtype());
}

// --- entries -----------------------------------------------------------------------

// One CP entry: inputs (with which get gradients), outputs, and the call on
// comm for F local frames and a mask (undefined: none).
struct Entry {
  std::string name;
  std::vector<Tensor> in;  // global inputs
  std::vector<Ax> in_ax, out_ax;
  std::vector<bool> diff;     // inputs that get gradients
  std::vector<bool> reduced;  // gradients summed over ranks (the norm weights)
  std::vector<bool> copies;   // outputs every rank holds a copy of (terminal states)
  std::function<std::vector<Tensor>(cp::Communicator&, const std::vector<Tensor>&, int64_t, const Tensor&)> call;
};

struct Run {
  std::vector<Tensor> outs, grads;
};

// The entry's global inputs cut to frames [lo, hi) (unsplit inputs whole).
inline std::vector<Tensor> local_inputs(const Entry& e, int64_t lo, int64_t hi) {
  std::vector<Tensor> local;
  for (size_t k = 0; k < e.in.size(); ++k) local.push_back(frames(e.in[k], e.in_ax[k], lo, hi));
  return local;
}

// Forward on comm, then backward of Σ⟨w_k, out_k⟩ with w = weights(outs).
inline Run run(const Entry& e, cp::Communicator& comm, const std::vector<Tensor>& in, int64_t F, const Tensor& mask,
               const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& weights, bool reduce) {
  std::vector<Tensor> x;
  for (size_t k = 0; k < in.size(); ++k) x.push_back(e.diff[k] ? leaf(in[k]) : in[k]);
  Run r;
  r.outs = e.call(comm, x, F, mask);
  backward_weighted(r.outs, weights(r.outs));
  std::vector<Tensor> red;
  for (size_t k = 0; k < x.size(); ++k)
    if (e.reduced[k] && x[k].defined()) red.push_back(x[k]);
  if (reduce && !red.empty()) cp::all_reduce_grads(comm, red);
  for (size_t k = 0; k < x.size(); ++k) r.grads.push_back(e.diff[k] && x[k].defined() ? x[k].grad() : Tensor());
  return r;
}

// Output weights of the global outputs (seeded by shape and position).
inline std::vector<Tensor> global_weights(const std::vector<Tensor>& outs, uint64_t seed) {
  std::vector<Tensor> w;
  for (size_t k = 0; k < outs.size(); ++k)
    w.push_back(outs[k].defined() ? Tensor::randn(outs[k].shape(), outs[k].dtype(), Device::cpu, seed + 100 + k)
                                  : Tensor());
  return w;
}

inline Tensor scaled(const Tensor& t, double s) {
  std::vector<double> v = t.to_vector();
  for (double& e : v) e *= s;
  return Tensor::from_vector(v, t.shape(), t.dtype());
}

// The entries over inputs of F_total frames. B = 2 (rows pack differently), small H, D, S.
// Not smaller: at D = 4, S = 2 some tokens of short clips have den ≈ 0, where one
// rank in f32 is already 1e-3 off f64, so f32 rounding order alone exceeds tol::f32.
constexpr int64_t kB = 2, kH = 2, kD = 8, kS = 4;

// The head size D, the tokens per frame S and the deterministic mode (docs/design.md §12)
// of the entries: by default kD, kS, off.
struct EntryMode {
  int64_t D = kD, S = kS;
  bool deterministic = false;
};

inline Entry scan_entry(bool bidi, const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t seed,
                        const EntryMode& m = {}) {
  const int64_t D = m.D;
  Entry e;
  e.name = bidi ? "cp_bidi_scan" : "cp_scan";
  const int64_t BH = kB * kH;
  e.in = {make_P(BH, Ft, D, dt, seed + 1), Tensor::randn({BH, Ft, D, D}, dt, Device::cpu, seed + 2),
          make_P(BH, Ft, D, dt, seed + 3), Tensor::randn({BH, Ft, D}, dt, Device::cpu, seed + 4),
          Tensor::uniform({kB, kH, Ft}, dt, Device::cpu, seed + 5, 0.5, 0.99)};
  const Ax st{0, kH, 1, 1}, dc{0, 1, 2, 1}, whole{};
  e.in_ax = {st, st, st, st, dc};
  e.diff = {true, true, true, true, true};
  e.reduced = {false, false, false, false, false};
  e.out_ax = {st, st};
  e.copies = {false, false};
  if (!bidi && o.truncate_to_active > 0) {
    e.out_ax = {st, st, whole, whole};
    e.copies = {false, false, true, true};
  }
  cp::CpOptions od = o;
  if (m.deterministic) od.deterministic = true;
  e.call = [bidi, od](cp::Communicator& c, const std::vector<Tensor>& x, int64_t, const Tensor& mask) {
    if (bidi) return cp::cp_bidi_scan(c, x[0], x[1], x[2], x[3], x[4], mask, od);
    return scan_outputs(cp::cp_scan(c, x[0], x[1], x[2], x[3], x[4], od, mask));
  };
  return e;
}

inline Entry layer_entry(bool bidi, const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t seed, Checkpoint ck,
                         const EntryMode& m = {}) {
  const int64_t D = m.D, S = m.S;
  Entry e;
  e.name = bidi ? "bigdn_cp" : "cp_gdn_raw";
  const DType table = dt == DType::f64 ? DType::f64 : DType::f32;
  const int64_t N = Ft * S, C = kH * D;
  const auto rope = N > 0 ? rope_tables(N, D, table, Device::cpu, /*offset=*/3)
                          : std::make_pair(Tensor::empty({0, D}, table), Tensor::empty({0, D}, table));
  e.in = {Tensor::randn({kB, N, 3, kH, D}, dt, Device::cpu, seed + 1),
          Tensor::uniform({kB, kH, Ft, S}, dt, Device::cpu, seed + 2, 0.1, 0.9),
          Tensor::uniform({kB, kH, Ft}, dt, Device::cpu, seed + 3, 0.5, 0.99),
          Tensor::uniform({C}, table, Device::cpu, seed + 4, 0.5, 1.5),
          Tensor::uniform({C}, table, Device::cpu, seed + 5, 0.5, 1.5),
          rope.first,
          rope.second};
  const Ax tok{0, 1, 1, S}, fr{0, 1, 2, 1}, whole{}, table_rows{-1, 1, 0, S}, den{0, 1, 2, S};
  e.in_ax = {tok, fr, fr, whole, whole, table_rows, table_rows};
  e.diff = {true, true, true, true, true, false, false};
  e.reduced = {false, false, false, true, true, false, false};
  if (bidi) {
    e.out_ax = {tok};
    e.copies = {false};
  } else {
    e.out_ax = {tok, den};
    e.copies = {false, false};
    if (o.truncate_to_active > 0) {
      e.out_ax = {tok, den, whole, whole};
      e.copies = {false, false, true, true};
    }
  }
  BigdnOptions opt;
  opt.k_scale = 1.0 / std::sqrt(static_cast<double>(D * S));
  opt.checkpoint = ck;
  opt.deterministic = m.deterministic;
  e.call = [bidi, o, opt, S](cp::Communicator& c, const std::vector<Tensor>& x, int64_t F, const Tensor& mask) {
    if (bidi)
      return std::vector<Tensor>{
          cp::bigdn_cp(c, x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, S, opt, mask, Tensor(), Tensor(), o)};
    return raw_outputs(cp::cp_gdn_raw(c, x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, S, opt, o, mask));
  };
  return e;
}

inline Entry cam_entry(const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t seed, Checkpoint ck,
                       const EntryMode& m = {}) {
  const int64_t D = m.D, S = m.S;
  Entry e;
  e.name = "cp_cam_gdn_num";
  const int64_t N = Ft * S;
  e.in = {Tensor::randn({kB, kH, D, N}, dt, Device::cpu, seed + 1),
          Tensor::randn({kB, kH, D, N}, dt, Device::cpu, seed + 2, 1.0 / std::sqrt(double(S * D))),
          Tensor::randn({kB, kH, D, N}, dt, Device::cpu, seed + 3),
          Tensor::uniform({kB, kH, Ft, S}, dt, Device::cpu, seed + 4, 0.1, 0.9),
          Tensor::uniform({kB, kH, Ft}, dt, Device::cpu, seed + 5, 0.5, 0.99)};
  const Ax tok{0, 1, 3, S}, fr{0, 1, 2, 1}, whole{};
  e.in_ax = {tok, tok, tok, fr, fr};
  e.diff = {true, true, true, true, true};
  e.reduced = {false, false, false, false, false};
  e.out_ax = {tok};
  e.copies = {false};
  if (o.truncate_to_active > 0) {
    e.out_ax = {tok, whole};
    e.copies = {false, true};
  }
  cp::CpOptions od = o;
  if (m.deterministic) od.deterministic = true;
  e.call = [od, ck, S](cp::Communicator& c, const std::vector<Tensor>& x, int64_t F, const Tensor&) {
    const cp::CamResult r = cp::cp_cam_gdn_num(c, x[0], x[1], x[2], x[3], x[4], F, S, od, ck);
    std::vector<Tensor> out = {r.out};
    if (r.terminal_M.defined()) out.push_back(r.terminal_M);
    return out;
  };
  return e;
}

// Relative-L2 tolerance of the dtype (tests/util/tolerance.h).
inline double tol_of(DType dt) { return dt == DType::f64 ? tol::f64 : tol::f32; }

inline void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << " is undefined on rank " << rank();
  if (want.numel() == 0) {  // an empty rank: an empty result of the right shape
    EXPECT_EQ(got.shape(), want.shape()) << what << " on rank " << rank();
    return;
  }
  EXPECT_TRUE(close_rel(got, want, tol, what)) << "rank " << rank();
}

// --- P ranks == one rank -----------------------------------------------------------

// This rank's block of `split` (in logical order; reversed: physical rank r holds
// logical block P−1−r): frames [off, off + F) of Ft, and the clip mask of all Ft
// frames (undefined: no clips).
struct RankBlock {
  int64_t Ft, off, F;
  Tensor mask;
  Tensor local_mask() const { return mask.defined() ? frames(mask, Ax{0, 1, 1, 1}, off, off + F) : Tensor(); }
};

inline RankBlock rank_block(const std::vector<int64_t>& split, const cp::CpOptions& o, bool clips) {
  const int P = nranks(), r = rank();
  const auto [off, F] = block_of(split, o.reverse_rank_order ? P - 1 - r : r);
  return {std::accumulate(split.begin(), split.end(), int64_t{0}), off, F, clips ? clip_mask(kB, split) : Tensor()};
}

// The entry on P ranks holding `split` (in logical order; reversed: physical
// rank r holds logical block P−1−r) against one rank over the global sequence.
inline void check_against_one_rank(const Entry& e, const std::vector<int64_t>& split, const cp::CpOptions& o,
                                   bool clips, DType dt, uint64_t seed) {
  const int P = nranks();
  ASSERT_EQ(split.size(), static_cast<size_t>(P));
  const RankBlock rb = rank_block(split, o, clips);
  const int64_t off = rb.off, F = rb.F;

  std::vector<Tensor> wg;
  const Run ref = run(
      e, *self(), e.in, rb.Ft, rb.mask,
      [&](const std::vector<Tensor>& outs) {
        wg = global_weights(outs, seed);
        std::vector<Tensor> w = wg;  // every rank holds a copy: the P-rank loss counts it P times
        for (size_t k = 0; k < w.size(); ++k)
          if (e.copies[k]) w[k] = scaled(w[k], P);
        return w;
      },
      false);

  const Run got = run(
      e, *world(), local_inputs(e, off, off + F), F, rb.local_mask(),
      [&](const std::vector<Tensor>&) {
        std::vector<Tensor> w;
        for (size_t k = 0; k < wg.size(); ++k) w.push_back(frames(wg[k], e.out_ax[k], off, off + F));
        return w;
      },
      true);

  const double tol = tol_of(dt);
  ASSERT_EQ(got.outs.size(), ref.outs.size());
  for (size_t k = 0; k < ref.outs.size(); ++k)
    expect_close(got.outs[k], frames(ref.outs[k], e.out_ax[k], off, off + F), tol,
                 e.name + " output " + std::to_string(k));
  for (size_t k = 0; k < ref.grads.size(); ++k) {
    if (!ref.grads[k].defined()) continue;
    expect_close(got.grads[k], frames(ref.grads[k], e.in_ax[k], off, off + F), tol,
                 e.name + " gradient of input " + std::to_string(k));
  }
}

// --- every split ---------------------------------------------------------------------

// A check of an entry on a split: (entry, split, options, clips, dtype, seed).
using SplitCheck =
    std::function<void(const Entry&, const std::vector<int64_t>&, const cp::CpOptions&, bool, DType, uint64_t)>;

// check on every split of this group size, f64 and f32, with and without clips.
inline void check_each_split(const SplitCheck& check,
                             const std::function<Entry(int64_t Ft, DType dt, uint64_t seed)>& make,
                             const cp::CpOptions& o, bool with_clips, uint64_t seed) {
  for (const auto& split : splits_for(nranks()))
    for (DType dt : {DType::f64, DType::f32})
      for (bool clips : {false, true}) {
        if (clips && !with_clips) continue;
        const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
        SCOPED_TRACE("split " + split_str(split) + ", " + dtype_name(dt) + (clips ? ", clips" : ""));
        check(make(Ft, dt, seed), split, o, clips, dt, seed);
        seed += 17;
      }
}

// Truncation at a K inside the shortest non-empty rank (K − 1 its first frame).
inline cp::CpOptions truncated_inside_short_rank(const std::vector<int64_t>& split) {
  size_t pick = 0;
  for (size_t k = 0; k < split.size(); ++k)
    if (split[k] > 0 && (split[pick] == 0 || split[k] <= split[pick])) pick = k;
  cp::CpOptions o;
  o.truncate_to_active = block_of(split, static_cast<int>(pick)).first + 1;
  return o;
}

// check on every split truncated inside its short rank, f64 and f32, with clips too
// when asked (clip starts at frames ≥ K are ignored).
inline void check_each_truncated(const SplitCheck& check,
                                 const std::function<Entry(const cp::CpOptions&, int64_t, DType, uint64_t)>& make,
                                 bool clips, uint64_t seed) {
  for (const auto& split : splits_for(nranks()))
    for (DType dt : {DType::f64, DType::f32}) {
      const cp::CpOptions o = truncated_inside_short_rank(split);
      const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
      SCOPED_TRACE("split " + split_str(split) + ", K = " + std::to_string(o.truncate_to_active) + ", " +
                   dtype_name(dt));
      check(make(o, Ft, dt, seed), split, o, false, dt, seed);
      if (clips) check(make(o, Ft, dt, seed + 1), split, o, true, dt, seed + 1);
      seed += 17;
    }
}

// --- two variants of one call (a schedule option on and off), bitwise -------------------

// make(on): the entry with the variant off (false) and on (true); outputs and every gradient
// must agree bitwise on every rank.
inline void check_variants_bitwise(const std::function<Entry(bool on)>& make, const std::vector<int64_t>& split,
                                   bool clips) {
  const int r = rank();
  const auto [off, F] = block_of(split, r);
  const Tensor mask = clips ? frames(clip_mask(kB, split), Ax{0, 1, 1, 1}, off, off + F) : Tensor();
  Run runs[2];
  for (int on = 0; on < 2; ++on) {
    const Entry e = make(on != 0);
    runs[on] = run(
        e, *world(), local_inputs(e, off, off + F), F, mask,
        [&](const std::vector<Tensor>& outs) { return global_weights(outs, 77); }, true);
  }
  ASSERT_EQ(runs[0].outs.size(), runs[1].outs.size());
  for (size_t k = 0; k < runs[0].outs.size(); ++k)
    EXPECT_TRUE(bitwise_equal(runs[1].outs[k], runs[0].outs[k])) << "output " << k << " rank " << r;
  for (size_t k = 0; k < runs[0].grads.size(); ++k) {
    ASSERT_EQ(runs[1].grads[k].defined(), runs[0].grads[k].defined()) << "gradient " << k;
    if (!runs[0].grads[k].defined()) continue;
    EXPECT_TRUE(bitwise_equal(runs[1].grads[k], runs[0].grads[k])) << "gradient " << k << " rank " << r;
  }
}

// Checkpointing on == off.
inline void check_checkpoint_bitwise(const std::function<Entry(Checkpoint)>& make, const std::vector<int64_t>& split,
                                     bool clips) {
  check_variants_bitwise([&](bool on) { return make(on ? Checkpoint::on : Checkpoint::off); }, split, clips);
}

}  // namespace test
}  // namespace gdncp
