// tests/mpi_test_cp_uneven.cpp — uneven frame ownership and packed clips in
// every CP entry (docs/design.md §1, §4a, §6) on CPU ranks:
//   - P ranks holding any split of F_total frames (empty ranks included) ==
//     one rank over the whole sequence, forward and every gradient (norm
//     weights after all_reduce_grads), with and without a clip mask, in
//     reverse rank order and truncated inside a short rank;
//   - packed clips == each clip run as its own row (one rank, no mask);
//   - checkpointing on == off bitwise;
//   - bad masks, S differing between ranks and an empty sequence: an error on
//     every rank.
// gdncp-mpi-np: 1 2 3 4 8
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "mpi_cp_fixtures.h"
#include "util/tolerance.h"

namespace gdncp {
namespace test {
namespace {

// --- splits ------------------------------------------------------------------------

// Frames of each logical block, per group size: 11 and 21 frames, 3 frames
// on 4 and 8 ranks (empty ranks), and unbalanced splits with empty ranks first,
// inside and last.
std::vector<std::vector<int64_t>> splits_for(int P) {
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

std::string split_str(const std::vector<int64_t>& s) {
  std::string out;
  for (int64_t f : s) out += (out.empty() ? "" : "+") + std::to_string(f);
  return out;
}

// Where logical block b sits: {offset, frames}.
std::pair<int64_t, int64_t> block_of(const std::vector<int64_t>& split, int b) {
  const int64_t off = std::accumulate(split.begin(), split.begin() + b, int64_t{0});
  return {off, split[static_cast<size_t>(b)]};
}

// A clip mask (B, F_total) f32: rows pack differently; row 1 starts clips at
// every block boundary too (a start on a rank's first frame), row 0 has
// 1-frame clips.
Tensor clip_mask(int64_t B, const std::vector<int64_t>& split) {
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
std::vector<std::pair<int64_t, int64_t>> clips_of(const Tensor& mask, int64_t b) {
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

Tensor frames(const Tensor& t, const Ax& a, int64_t lo, int64_t hi) {
  return a.frame < 0 ? t : slice(t, a.frame, lo * a.per, hi * a.per);
}
Tensor row_frames(const Tensor& t, const Ax& a, int64_t b, int64_t lo, int64_t hi) {
  const Tensor r = a.row < 0 ? t : slice(t, a.row, b * a.group, (b + 1) * a.group);
  return frames(r, a, lo, hi);
}

// dst + src placed at row block b and frame lo (a tensor of dst's shape); unsplit tensors add whole.
Tensor place(const Tensor& dst, const Tensor& src, const Ax& a, int64_t b, int64_t lo) {
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

// Forward on comm, then backward of Σ⟨w_k, out_k⟩ with w = weights(outs).
Run run(const Entry& e, cp::Communicator& comm, const std::vector<Tensor>& in, int64_t F, const Tensor& mask,
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
std::vector<Tensor> global_weights(const std::vector<Tensor>& outs, uint64_t seed) {
  std::vector<Tensor> w;
  for (size_t k = 0; k < outs.size(); ++k)
    w.push_back(outs[k].defined() ? Tensor::randn(outs[k].shape(), outs[k].dtype(), Device::cpu, seed + 100 + k)
                                  : Tensor());
  return w;
}

Tensor scaled(const Tensor& t, double s) {
  std::vector<double> v = t.to_vector();
  for (double& e : v) e *= s;
  return Tensor::from_vector(v, t.shape(), t.dtype());
}

// The entries over inputs of F_total frames. B = 2 (rows pack differently), small H, D, S.
// Not smaller: at D = 4, S = 2 some tokens of short clips have den ≈ 0, where one
// rank in f32 is already 1e-3 off f64, so f32 rounding order alone exceeds tol::f32.
constexpr int64_t kB = 2, kH = 2, kD = 8, kS = 4;

Entry scan_entry(bool bidi, const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t seed) {
  Entry e;
  e.name = bidi ? "cp_bidi_scan" : "cp_scan";
  const int64_t BH = kB * kH;
  e.in = {make_P(BH, Ft, kD, dt, seed + 1), Tensor::randn({BH, Ft, kD, kD}, dt, Device::cpu, seed + 2),
          make_P(BH, Ft, kD, dt, seed + 3), Tensor::randn({BH, Ft, kD}, dt, Device::cpu, seed + 4),
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
  e.call = [bidi, o](cp::Communicator& c, const std::vector<Tensor>& x, int64_t, const Tensor& mask) {
    if (bidi) return cp::cp_bidi_scan(c, x[0], x[1], x[2], x[3], x[4], mask);
    return scan_outputs(cp::cp_scan(c, x[0], x[1], x[2], x[3], x[4], o, mask));
  };
  return e;
}

Entry layer_entry(bool bidi, const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t seed, Checkpoint ck) {
  Entry e;
  e.name = bidi ? "bigdn_cp" : "cp_gdn_raw";
  const DType table = dt == DType::f64 ? DType::f64 : DType::f32;
  const int64_t N = Ft * kS, C = kH * kD;
  const auto rope = N > 0 ? rope_tables(N, kD, table, Device::cpu, /*offset=*/3)
                           : std::make_pair(Tensor::empty({0, kD}, table), Tensor::empty({0, kD}, table));
  e.in = {Tensor::randn({kB, N, 3, kH, kD}, dt, Device::cpu, seed + 1),
          Tensor::uniform({kB, kH, Ft, kS}, dt, Device::cpu, seed + 2, 0.1, 0.9),
          Tensor::uniform({kB, kH, Ft}, dt, Device::cpu, seed + 3, 0.5, 0.99),
          Tensor::uniform({C}, table, Device::cpu, seed + 4, 0.5, 1.5),
          Tensor::uniform({C}, table, Device::cpu, seed + 5, 0.5, 1.5),
          rope.first,
          rope.second};
  const Ax tok{0, 1, 1, kS}, fr{0, 1, 2, 1}, whole{}, table_rows{-1, 1, 0, kS}, den{0, 1, 2, kS};
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
  opt.k_scale = 1.0 / std::sqrt(static_cast<double>(kD * kS));
  opt.checkpoint = ck;
  e.call = [bidi, o, opt](cp::Communicator& c, const std::vector<Tensor>& x, int64_t F, const Tensor& mask) {
    if (bidi) return std::vector<Tensor>{cp::bigdn_cp(c, x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, kS, opt, mask)};
    return raw_outputs(cp::cp_gdn_raw(c, x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, kS, opt, o, mask));
  };
  return e;
}

Entry cam_entry(const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t seed, Checkpoint ck) {
  Entry e;
  e.name = "cp_cam_gdn_num";
  const int64_t N = Ft * kS;
  e.in = {Tensor::randn({kB, kH, kD, N}, dt, Device::cpu, seed + 1),
          Tensor::randn({kB, kH, kD, N}, dt, Device::cpu, seed + 2, 1.0 / std::sqrt(double(kS * kD))),
          Tensor::randn({kB, kH, kD, N}, dt, Device::cpu, seed + 3),
          Tensor::uniform({kB, kH, Ft, kS}, dt, Device::cpu, seed + 4, 0.1, 0.9),
          Tensor::uniform({kB, kH, Ft}, dt, Device::cpu, seed + 5, 0.5, 0.99)};
  const Ax tok{0, 1, 3, kS}, fr{0, 1, 2, 1}, whole{};
  e.in_ax = {tok, tok, tok, fr, fr};
  e.diff = {true, true, true, true, true};
  e.reduced = {false, false, false, false, false};
  e.out_ax = {tok};
  e.copies = {false};
  if (o.truncate_to_active > 0) {
    e.out_ax = {tok, whole};
    e.copies = {false, true};
  }
  e.call = [o, ck](cp::Communicator& c, const std::vector<Tensor>& x, int64_t F, const Tensor&) {
    const cp::CamResult r = cp::cp_cam_gdn_num(c, x[0], x[1], x[2], x[3], x[4], F, kS, o, ck);
    std::vector<Tensor> out = {r.out};
    if (r.terminal_M.defined()) out.push_back(r.terminal_M);
    return out;
  };
  return e;
}

// Relative-L2 tolerance of the dtype (tests/util/tolerance.h).
double tol_of(DType dt) { return dt == DType::f64 ? tol::f64 : tol::f32; }

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << " is undefined on rank " << rank();
  if (want.numel() == 0) {  // an empty rank: an empty result of the right shape
    EXPECT_EQ(got.shape(), want.shape()) << what << " on rank " << rank();
    return;
  }
  EXPECT_TRUE(close_rel(got, want, tol, what)) << "rank " << rank();
}

// --- P ranks == one rank -----------------------------------------------------------

// The entry on P ranks holding `split` (in logical order; reversed: physical
// rank r holds logical block P−1−r) against one rank over the global sequence.
void check_against_one_rank(const Entry& e, const std::vector<int64_t>& split, const cp::CpOptions& o, bool clips,
                            DType dt, uint64_t seed) {
  const int P = nranks(), r = rank();
  ASSERT_EQ(split.size(), static_cast<size_t>(P));
  const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
  const int b = o.reverse_rank_order ? P - 1 - r : r;
  const auto [off, F] = block_of(split, b);
  const Tensor mask = clips ? clip_mask(kB, split) : Tensor();
  const Ax mask_ax{0, 1, 1, 1};

  std::vector<Tensor> wg;
  const Run ref = run(
      e, *self(), e.in, Ft, mask,
      [&](const std::vector<Tensor>& outs) {
        wg = global_weights(outs, seed);
        std::vector<Tensor> w = wg;  // every rank holds a copy: the P-rank loss counts it P times
        for (size_t k = 0; k < w.size(); ++k)
          if (e.copies[k]) w[k] = scaled(w[k], P);
        return w;
      },
      false);

  std::vector<Tensor> local;
  for (size_t k = 0; k < e.in.size(); ++k) local.push_back(frames(e.in[k], e.in_ax[k], off, off + F));
  const Run got = run(
      e, *world(), local, F, clips ? frames(mask, mask_ax, off, off + F) : Tensor(),
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

// Every split of this group size, f64 and f32, with and without clips.
void check_entry_splits(const std::function<Entry(int64_t Ft, DType dt, uint64_t seed)>& make,
                        const cp::CpOptions& o, bool with_clips, uint64_t seed) {
  for (const auto& split : splits_for(nranks()))
    for (DType dt : {DType::f64, DType::f32})
      for (bool clips : {false, true}) {
        if (clips && !with_clips) continue;
        const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
        SCOPED_TRACE("split " + split_str(split) + ", " + dtype_name(dt) + (clips ? ", clips" : ""));
        check_against_one_rank(make(Ft, dt, seed), split, o, clips, dt, seed);
        seed += 17;
      }
}

TEST(CpUneven, ScanMatchesOneRank) {
  check_entry_splits([](int64_t Ft, DType dt, uint64_t s) { return scan_entry(false, {}, Ft, dt, s); }, {}, true, 100);
}
TEST(CpUneven, ScanReversedMatchesOneRank) {
  cp::CpOptions o;
  o.reverse_rank_order = true;
  check_entry_splits([o](int64_t Ft, DType dt, uint64_t s) { return scan_entry(false, o, Ft, dt, s); }, o, true, 200);
}
TEST(CpUneven, BidiScanMatchesOneRank) {
  check_entry_splits([](int64_t Ft, DType dt, uint64_t s) { return scan_entry(true, {}, Ft, dt, s); }, {}, true, 300);
}
TEST(CpUneven, BigdnCpMatchesOneRank) {
  check_entry_splits(
      [](int64_t Ft, DType dt, uint64_t s) { return layer_entry(true, {}, Ft, dt, s, Checkpoint::off); }, {}, true,
      400);
}
TEST(CpUneven, RawMatchesOneRank) {
  check_entry_splits(
      [](int64_t Ft, DType dt, uint64_t s) { return layer_entry(false, {}, Ft, dt, s, Checkpoint::off); }, {}, true,
      500);
}
TEST(CpUneven, RawReversedMatchesOneRank) {
  cp::CpOptions o;
  o.reverse_rank_order = true;
  check_entry_splits(
      [o](int64_t Ft, DType dt, uint64_t s) { return layer_entry(false, o, Ft, dt, s, Checkpoint::off); }, o, true,
      600);
}
TEST(CpUneven, CamMatchesOneRank) {
  check_entry_splits(
      [](int64_t Ft, DType dt, uint64_t s) { return cam_entry({}, Ft, dt, s, Checkpoint::off); }, {}, false, 700);
}
TEST(CpUneven, CamReversedMatchesOneRank) {
  cp::CpOptions o;
  o.reverse_rank_order = true;
  check_entry_splits([o](int64_t Ft, DType dt, uint64_t s) { return cam_entry(o, Ft, dt, s, Checkpoint::off); }, o,
                     false, 800);
}

// Truncation at a K inside the shortest non-empty rank (K − 1 its first frame),
// with and without clips (clip starts at frames ≥ K are ignored).
cp::CpOptions truncated_inside_short_rank(const std::vector<int64_t>& split) {
  size_t pick = 0;
  for (size_t k = 0; k < split.size(); ++k)
    if (split[k] > 0 && (split[pick] == 0 || split[k] <= split[pick])) pick = k;
  cp::CpOptions o;
  o.truncate_to_active = block_of(split, static_cast<int>(pick)).first + 1;
  return o;
}

void check_truncated(const std::function<Entry(const cp::CpOptions&, int64_t, DType, uint64_t)>& make, bool clips,
                     uint64_t seed) {
  for (const auto& split : splits_for(nranks()))
    for (DType dt : {DType::f64, DType::f32}) {
      const cp::CpOptions o = truncated_inside_short_rank(split);
      const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
      SCOPED_TRACE("split " + split_str(split) + ", K = " + std::to_string(o.truncate_to_active) + ", " +
                   dtype_name(dt));
      check_against_one_rank(make(o, Ft, dt, seed), split, o, false, dt, seed);
      if (clips) check_against_one_rank(make(o, Ft, dt, seed + 1), split, o, true, dt, seed + 1);
      seed += 17;
    }
}

TEST(CpUneven, ScanTruncatedInShortRank) {
  check_truncated([](const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t s) { return scan_entry(false, o, Ft, dt, s); },
                  true, 900);
}
TEST(CpUneven, RawTruncatedInShortRank) {
  check_truncated(
      [](const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t s) {
        return layer_entry(false, o, Ft, dt, s, Checkpoint::off);
      },
      true, 1000);
}
TEST(CpUneven, CamTruncatedInShortRank) {
  check_truncated(
      [](const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t s) { return cam_entry(o, Ft, dt, s, Checkpoint::off); },
      false, 1100);
}

// --- checkpointing on == off, bitwise -----------------------------------------------

void check_checkpoint_bitwise(const std::function<Entry(Checkpoint)>& make, const std::vector<int64_t>& split,
                              bool clips) {
  const int r = rank();
  const auto [off, F] = block_of(split, r);
  const Tensor mask = clips ? frames(clip_mask(kB, split), Ax{0, 1, 1, 1}, off, off + F) : Tensor();
  Run runs[2];
  for (int on = 0; on < 2; ++on) {
    const Entry e = make(on ? Checkpoint::on : Checkpoint::off);
    std::vector<Tensor> local;
    for (size_t k = 0; k < e.in.size(); ++k) local.push_back(frames(e.in[k], e.in_ax[k], off, off + F));
    runs[on] = run(
        e, *world(), local, F, mask, [&](const std::vector<Tensor>& outs) { return global_weights(outs, 77); }, true);
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

TEST(CpUneven, CheckpointBitwiseEqual) {
  for (const auto& split : splits_for(nranks())) {
    const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
    SCOPED_TRACE("split " + split_str(split));
    for (bool bidi : {true, false})
      check_checkpoint_bitwise([&](Checkpoint ck) { return layer_entry(bidi, {}, Ft, DType::f32, 1200, ck); }, split,
                               true);
    cp::CpOptions o;
    o.truncate_to_active = Ft;
    check_checkpoint_bitwise([&](Checkpoint ck) { return cam_entry(o, Ft, DType::f32, 1300, ck); }, split, false);
  }
}

// The RoPE rows of a rank are the global table's rows from o_r·S: rope_tables
// with that offset, and balanced_split gives o_r.
TEST(CpUneven, BalancedSplitAndRopeOffset) {
  const int P = nranks(), r = rank();
  for (int64_t Ft : {0, 1, 3, 11, 21}) {
    int64_t sum = 0, expect_off = 0;
    for (int j = 0; j < P; ++j) {
      const cp::FrameSplit s = cp::balanced_split(Ft, P, j);
      EXPECT_EQ(s.offset, expect_off) << "F_total " << Ft << " rank " << j;
      EXPECT_EQ(s.frames, Ft / P + (j < Ft % P ? 1 : 0)) << "F_total " << Ft << " rank " << j;
      expect_off += s.frames;
      sum += s.frames;
    }
    EXPECT_EQ(sum, Ft);
    const cp::FrameSplit mine = cp::balanced_split(Ft, P, r);
    if (mine.frames == 0) continue;
    const auto global = rope_tables(Ft * kS, kD, DType::f64, Device::cpu, 5);
    const auto local = rope_tables(mine.frames * kS, kD, DType::f64, Device::cpu, 5 + mine.offset * kS);
    EXPECT_TRUE(bitwise_equal(local.first, slice(global.first, 0, mine.offset * kS, (mine.offset + mine.frames) * kS)));
    EXPECT_TRUE(bitwise_equal(local.second, slice(global.second, 0, mine.offset * kS, (mine.offset + mine.frames) * kS)));
  }
  EXPECT_THROW(cp::balanced_split(-1, P, 0), Error);
  EXPECT_THROW(cp::balanced_split(4, 0, 0), Error);
  EXPECT_THROW(cp::balanced_split(4, P, P), Error);
}

// --- packed clips == separate clips ------------------------------------------------

// The entry on P ranks over packed rows against one rank running every clip as
// its own row (B = 1, no mask), pasted back into place.
void check_packed_equals_separate(const Entry& e, const std::vector<int64_t>& split, const Tensor& mask) {
  const int r = rank();
  const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
  const auto [off, F] = block_of(split, r);
  const std::vector<Tensor> wg = [&] {
    std::vector<Tensor> probe;  // output shapes from a one-rank run (no gradients needed)
    autograd::NoGradGuard ng;
    probe = e.call(*self(), e.in, Ft, mask);
    return global_weights(probe, 4242);
  }();

  // Reference: every clip alone; outputs and gradients pasted into global tensors.
  std::vector<Tensor> ref_out, ref_grad;
  for (const Tensor& w : wg) ref_out.push_back(Tensor::zeros(w.shape(), w.dtype(), Device::cpu));
  for (size_t k = 0; k < e.in.size(); ++k)
    ref_grad.push_back(e.diff[k] ? Tensor::zeros(e.in[k].shape(), e.in[k].dtype(), Device::cpu) : Tensor());
  int clips = 0;
  for (int64_t b = 0; b < kB; ++b)
    for (const auto& [lo, hi] : clips_of(mask, b)) {
      std::vector<Tensor> in;
      for (size_t k = 0; k < e.in.size(); ++k) in.push_back(row_frames(e.in[k], e.in_ax[k], b, lo, hi));
      const Run one = run(
          e, *self(), in, hi - lo, Tensor(),
          [&](const std::vector<Tensor>&) {
            std::vector<Tensor> w;
            for (size_t k = 0; k < wg.size(); ++k) w.push_back(row_frames(wg[k], e.out_ax[k], b, lo, hi));
            return w;
          },
          false);
      for (size_t k = 0; k < wg.size(); ++k) ref_out[k] = place(ref_out[k], one.outs[k], e.out_ax[k], b, lo);
      for (size_t k = 0; k < e.in.size(); ++k)
        if (e.diff[k]) ref_grad[k] = place(ref_grad[k], one.grads[k], e.in_ax[k], b, lo);
      ++clips;
    }
  ASSERT_GT(clips, kB) << "the mask must pack several clips";

  std::vector<Tensor> local;
  for (size_t k = 0; k < e.in.size(); ++k) local.push_back(frames(e.in[k], e.in_ax[k], off, off + F));
  const Run got = run(
      e, *world(), local, F, frames(mask, Ax{0, 1, 1, 1}, off, off + F),
      [&](const std::vector<Tensor>&) {
        std::vector<Tensor> w;
        for (size_t k = 0; k < wg.size(); ++k) w.push_back(frames(wg[k], e.out_ax[k], off, off + F));
        return w;
      },
      true);
  for (size_t k = 0; k < wg.size(); ++k)
    expect_close(got.outs[k], frames(ref_out[k], e.out_ax[k], off, off + F), tol::f64,
                 e.name + " packed output " + std::to_string(k));
  for (size_t k = 0; k < e.in.size(); ++k) {
    if (!e.diff[k]) continue;
    expect_close(got.grads[k], frames(ref_grad[k], e.in_ax[k], off, off + F), tol::f64,
                 e.name + " packed gradient of input " + std::to_string(k));
  }
}

// Rows packed differently, clips crossing rank boundaries, 1-frame clips and a
// clip starting on a rank's first frame, over 9 frames.
Tensor packed_mask() {
  const int64_t Ft = 9;
  // row 0: clips 4 | 1 | 4 (starts 0, 4, 5); row 1: 2 | 3 | 1 | 1 | 2 (starts 0, 2, 5, 6, 7).
  std::vector<double> c(static_cast<size_t>(kB * Ft), 0.0);
  for (int64_t f : {0, 4, 5}) c[static_cast<size_t>(f)] = 1.0;
  for (int64_t f : {2, 5, 6, 7}) c[static_cast<size_t>(Ft + f)] = 1.0;
  return Tensor::from_vector(c, {kB, Ft}, DType::f32);
}

std::vector<int64_t> packed_split(int P) {
  switch (P) {
    case 1: return {9};
    case 2: return {5, 4};
    case 3: return {3, 3, 3};
    case 4: return {3, 0, 4, 2};
    default: {
      std::vector<int64_t> s;
      for (int r = 0; r < P; ++r) s.push_back(cp::balanced_split(9, P, r).frames);
      return s;
    }
  }
}

TEST(CpClip, ScanPackedEqualsSeparate) {
  const Tensor mask = packed_mask();
  check_packed_equals_separate(scan_entry(false, {}, 9, DType::f64, 2000), packed_split(nranks()), mask);
}
TEST(CpClip, BidiScanPackedEqualsSeparate) {
  const Tensor mask = packed_mask();
  check_packed_equals_separate(scan_entry(true, {}, 9, DType::f64, 2100), packed_split(nranks()), mask);
}
TEST(CpClip, BigdnCpPackedEqualsSeparate) {
  const Tensor mask = packed_mask();
  check_packed_equals_separate(layer_entry(true, {}, 9, DType::f64, 2200, Checkpoint::off), packed_split(nranks()),
                               mask);
}
TEST(CpClip, RawPackedEqualsSeparate) {
  const Tensor mask = packed_mask();
  check_packed_equals_separate(layer_entry(false, {}, 9, DType::f64, 2300, Checkpoint::off), packed_split(nranks()),
                               mask);
}
// Every frame its own clip (still images).
TEST(CpClip, AllOneFrameClipsEqualSeparate) {
  const std::vector<double> ones(static_cast<size_t>(kB * 9), 1.0);
  const Tensor mask = Tensor::from_vector(ones, {kB, 9}, DType::f32);
  check_packed_equals_separate(layer_entry(true, {}, 9, DType::f64, 2400, Checkpoint::off), packed_split(nranks()),
                               mask);
}

// --- bad input: an error on every rank -----------------------------------------------

TEST(CpClipErrors, MaskShapeOrDtypeOnOneRank) {
  const int P = nranks(), r = rank(), last = P - 1;
  const std::string others = "bad argument on rank " + std::to_string(last);
  const std::vector<int64_t> split = splits_for(P)[0];
  const auto [off, F] = block_of(split, r);
  const Entry e = layer_entry(true, {}, std::accumulate(split.begin(), split.end(), int64_t{0}), DType::f64, 3000,
                              Checkpoint::off);
  std::vector<Tensor> local;
  for (size_t k = 0; k < e.in.size(); ++k) local.push_back(frames(e.in[k], e.in_ax[k], off, off + F));
  const Tensor good = Tensor::zeros({kB, F}, DType::f32, Device::cpu);
  const Tensor wrong_shape = r == last ? Tensor::zeros({kB, F + 1}, DType::f32, Device::cpu) : good;
  expect_all_throw([&] { e.call(*world(), local, F, wrong_shape); }, "clip_starts: must be (B, F)", others);
  const Tensor wrong_dtype = r == last ? Tensor::zeros({kB, F}, DType::f64, Device::cpu) : good;
  expect_all_throw([&] { e.call(*world(), local, F, wrong_dtype); }, "clip_starts: must be f32", others);
  const Entry s = scan_entry(false, {}, std::accumulate(split.begin(), split.end(), int64_t{0}), DType::f64, 3010);
  std::vector<Tensor> ls;
  for (size_t k = 0; k < s.in.size(); ++k) ls.push_back(frames(s.in[k], s.in_ax[k], off, off + F));
  const Tensor rows = r == last ? Tensor::zeros({kB * kH, F}, DType::f32, Device::cpu) : good;
  expect_all_throw([&] { s.call(*world(), ls, F, rows); }, "clip_starts: must be (B, F)", others);
}

TEST(CpUnevenErrors, TokensPerFrameDifferBetweenRanks) {
  if (nranks() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int r = rank();
  const int64_t S = r == 1 ? 3 : 2, F = r == 0 ? 2 : 1;
  const auto rope = rope_tables(F * S, kD, DType::f64, Device::cpu);
  const Tensor qkv = Tensor::randn({1, F * S, 3, kH, kD}, DType::f64, Device::cpu, 1);
  const Tensor beta = Tensor::uniform({1, kH, F, S}, DType::f64, Device::cpu, 2, 0.1, 0.9);
  const Tensor decay = Tensor::uniform({1, kH, F}, DType::f64, Device::cpu, 3, 0.5, 0.99);
  expect_all_throw(
      [&] { cp::bigdn_cp(*world(), qkv, beta, decay, Tensor(), Tensor(), rope.first, rope.second, F, S); },
      "S differs");
}

TEST(CpUnevenErrors, EveryRankEmpty) {
  const Entry e = layer_entry(true, {}, 0, DType::f64, 3100, Checkpoint::off);
  expect_all_throw([&] { e.call(*world(), e.in, 0, Tensor()); }, "every rank of the CP group holds 0 frames");
  const Entry s = scan_entry(false, {}, 0, DType::f64, 3110);
  expect_all_throw([&] { s.call(*world(), s.in, 0, Tensor()); }, "every rank of the CP group holds 0 frames");
  const Entry c = cam_entry({}, 0, DType::f64, 3120, Checkpoint::off);
  expect_all_throw([&] { c.call(*world(), c.in, 0, Tensor()); }, "every rank of the CP group holds 0 frames");
}

TEST(CpUnevenErrors, TruncateBeyondTotalFrames) {
  const std::vector<int64_t> split = splits_for(nranks())[0];
  const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
  const auto [off, F] = block_of(split, rank());
  cp::CpOptions o;
  o.truncate_to_active = Ft + 1;
  const Entry s = scan_entry(false, o, Ft, DType::f64, 3200);
  std::vector<Tensor> ls;
  for (size_t k = 0; k < s.in.size(); ++k) ls.push_back(frames(s.in[k], s.in_ax[k], off, off + F));
  expect_all_throw([&] { s.call(*world(), ls, F, Tensor()); }, "truncate_to_active: must be in [1, F_total]");
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
