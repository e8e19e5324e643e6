// tests/mpi_test_cp_deterministic.cpp — the deterministic mode (docs/design.md §12)
// on CPU ranks: every CP entry on P ranks holding any split of F_total frames
// (empty ranks, uneven splits), with clips across rank boundaries, in reverse
// rank order, truncated, with and without checkpointing, f32 and f64, is
// BITWISE equal to one rank in the same mode — forward and every gradient
// (norm weights after all_reduce_grads) — and bigdn_cp to the single-rank
// layer bigdn in that mode.
// gdncp-mpi-np: 1 2 3 4 8
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "mpi_cp_fixtures.h"

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
// Tiny: the comparisons are bitwise, so no tolerance asks for larger shapes.
constexpr int64_t kB = 2, kH = 2, kD = 4, kS = 2;

Entry scan_entry(const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t seed) {
  Entry e;
  e.name = "cp_scan";
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
  if (o.truncate_to_active > 0) {
    e.out_ax = {st, st, whole, whole};
    e.copies = {false, false, true, true};
  }
  cp::CpOptions od = o;
  od.deterministic = true;
  e.call = [od](cp::Communicator& c, const std::vector<Tensor>& x, int64_t, const Tensor& mask) {
    return scan_outputs(cp::cp_scan(c, x[0], x[1], x[2], x[3], x[4], od, mask));
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
  opt.deterministic = true;
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
  cp::CpOptions od = o;
  od.deterministic = true;
  e.call = [od, ck](cp::Communicator& c, const std::vector<Tensor>& x, int64_t F, const Tensor&) {
    const cp::CamResult r = cp::cp_cam_gdn_num(c, x[0], x[1], x[2], x[3], x[4], F, kS, od, ck);
    std::vector<Tensor> out = {r.out};
    if (r.terminal_M.defined()) out.push_back(r.terminal_M);
    return out;
  };
  return e;
}

// Bitwise: the same shape and the same bits of every element (f32 and bf16 widen exactly to double).
void expect_bitwise(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << " is undefined on rank " << rank();
  ASSERT_EQ(got.shape(), want.shape()) << what << " on rank " << rank();
  ASSERT_EQ(got.dtype(), want.dtype()) << what << " on rank " << rank();
  const std::vector<double> a = got.to_vector(), b = want.to_vector();
  int64_t diff = 0, first = -1;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) {
      ++diff;
      if (first < 0) first = static_cast<int64_t>(i);
    }
  EXPECT_EQ(diff, 0) << what << " on rank " << rank() << ": " << diff << " of " << a.size()
                     << " elements differ, first at " << first << " (" << (first >= 0 ? a[first] : 0.0) << " vs "
                     << (first >= 0 ? b[first] : 0.0) << ")";
}

// The entry on P ranks holding `split` (in logical order; reversed: physical
// rank r holds logical block P−1−r) against one rank over the global sequence,
// bitwise. The terminal states are copies on every rank: only rank 0's enter
// the loss, so their gradient sums to the one-rank gradient exactly.
// one_rank: the reference, by default the entry on a one-rank group.
void check_bitwise(
    const Entry& e, const std::vector<int64_t>& split, const cp::CpOptions& o, bool clips, uint64_t seed,
    const std::function<Run(const std::vector<Tensor>&, int64_t, const Tensor&,
                            const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>&)>& one_rank = {}) {
  const int P = nranks(), r = rank();
  ASSERT_EQ(split.size(), static_cast<size_t>(P));
  const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
  const int b = o.reverse_rank_order ? P - 1 - r : r;
  const auto [off, F] = block_of(split, b);
  const Tensor mask = clips ? clip_mask(kB, split) : Tensor();
  const Ax mask_ax{0, 1, 1, 1};

  std::vector<Tensor> wg;
  const auto ref_weights = [&](const std::vector<Tensor>& outs) {
    wg = global_weights(outs, seed);
    return wg;
  };
  const Run ref =
      one_rank ? one_rank(e.in, Ft, mask, ref_weights) : run(e, *self(), e.in, Ft, mask, ref_weights, false);

  std::vector<Tensor> local;
  for (size_t k = 0; k < e.in.size(); ++k) local.push_back(frames(e.in[k], e.in_ax[k], off, off + F));
  const Run got = run(
      e, *world(), local, F, clips ? frames(mask, mask_ax, off, off + F) : Tensor(),
      [&](const std::vector<Tensor>&) {
        std::vector<Tensor> w;
        for (size_t k = 0; k < wg.size(); ++k)
          w.push_back(e.copies[k] && r != 0 ? scaled(wg[k], 0.0) : frames(wg[k], e.out_ax[k], off, off + F));
        return w;
      },
      true);

  ASSERT_EQ(got.outs.size(), ref.outs.size());
  for (size_t k = 0; k < ref.outs.size(); ++k)
    expect_bitwise(got.outs[k], frames(ref.outs[k], e.out_ax[k], off, off + F),
                   e.name + " output " + std::to_string(k));
  for (size_t k = 0; k < ref.grads.size(); ++k) {
    if (!ref.grads[k].defined()) continue;
    expect_bitwise(got.grads[k], frames(ref.grads[k], e.in_ax[k], off, off + F),
                   e.name + " gradient of input " + std::to_string(k));
  }
}

// Every split of this group size, f64 and f32, with and without clips.
void check_splits(const std::function<Entry(int64_t Ft, DType dt, uint64_t seed)>& make, const cp::CpOptions& o,
                  bool with_clips, uint64_t seed) {
  for (const auto& split : splits_for(nranks()))
    for (DType dt : {DType::f64, DType::f32})
      for (bool clips : {false, true}) {
        if (clips && !with_clips) continue;
        const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
        SCOPED_TRACE("split " + split_str(split) + ", " + dtype_name(dt) + (clips ? ", clips" : ""));
        check_bitwise(make(Ft, dt, seed), split, o, clips, seed);
        seed += 17;
      }
}

// Truncation at a K inside the shortest non-empty rank (K − 1 its first frame).
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
      check_bitwise(make(o, Ft, dt, seed), split, o, false, seed);
      if (clips) check_bitwise(make(o, Ft, dt, seed + 1), split, o, true, seed + 1);
      seed += 17;
    }
}

cp::CpOptions reversed() {
  cp::CpOptions o;
  o.reverse_rank_order = true;
  return o;
}

TEST(CpDeterministic, ScanBitwiseOverRanks) {
  check_splits([](int64_t Ft, DType dt, uint64_t s) { return scan_entry({}, Ft, dt, s); }, {}, true, 100);
}
TEST(CpDeterministic, ScanReversedBitwiseOverRanks) {
  check_splits([](int64_t Ft, DType dt, uint64_t s) { return scan_entry(reversed(), Ft, dt, s); }, reversed(), true,
               200);
}
TEST(CpDeterministic, ScanTruncatedBitwiseOverRanks) {
  check_truncated([](const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t s) { return scan_entry(o, Ft, dt, s); },
                  true, 300);
}
TEST(CpDeterministic, BigdnCpBitwiseOverRanks) {
  for (Checkpoint ck : {Checkpoint::off, Checkpoint::on}) {
    SCOPED_TRACE(ck == Checkpoint::on ? "checkpoint on" : "checkpoint off");
    check_splits([ck](int64_t Ft, DType dt, uint64_t s) { return layer_entry(true, {}, Ft, dt, s, ck); }, {}, true,
                 400);
  }
}
// The CP layer on P ranks == the single-rank layer bigdn in the same mode, bitwise.
TEST(CpDeterministic, BigdnCpBitwiseEqualsBigdn) {
  uint64_t seed = 450;
  for (const auto& split : splits_for(nranks()))
    for (DType dt : {DType::f64, DType::f32})
      for (bool clips : {false, true}) {
        const int64_t Ft = std::accumulate(split.begin(), split.end(), int64_t{0});
        SCOPED_TRACE("split " + split_str(split) + ", " + dtype_name(dt) + (clips ? ", clips" : ""));
        const Entry e = layer_entry(true, {}, Ft, dt, seed, Checkpoint::off);
        BigdnOptions opt;
        opt.k_scale = 1.0 / std::sqrt(static_cast<double>(kD * kS));
        opt.deterministic = true;
        check_bitwise(e, split, {}, clips, seed,
                      [&](const std::vector<Tensor>& in, int64_t F, const Tensor& mask,
                          const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& weights) {
                        std::vector<Tensor> x;
                        for (size_t k = 0; k < in.size(); ++k) x.push_back(e.diff[k] ? leaf(in[k]) : in[k]);
                        test::Run r;
                        r.outs = {bigdn(x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, kS, opt, mask)};
                        backward_weighted(r.outs, weights(r.outs));
                        for (size_t k = 0; k < x.size(); ++k)
                          r.grads.push_back(e.diff[k] && x[k].defined() ? x[k].grad() : Tensor());
                        return r;
                      });
        seed += 17;
      }
}
TEST(CpDeterministic, RawBitwiseOverRanks) {
  check_splits([](int64_t Ft, DType dt, uint64_t s) { return layer_entry(false, {}, Ft, dt, s, Checkpoint::on); }, {},
               true, 500);
}
TEST(CpDeterministic, RawReversedBitwiseOverRanks) {
  check_splits(
      [](int64_t Ft, DType dt, uint64_t s) { return layer_entry(false, reversed(), Ft, dt, s, Checkpoint::off); },
      reversed(), true, 600);
}
TEST(CpDeterministic, RawTruncatedBitwiseOverRanks) {
  check_truncated([](const cp::CpOptions& o, int64_t Ft, DType dt,
                     uint64_t s) { return layer_entry(false, o, Ft, dt, s, Checkpoint::off); },
                  true, 700);
}
TEST(CpDeterministic, CamBitwiseOverRanks) {
  for (Checkpoint ck : {Checkpoint::off, Checkpoint::on})
    check_splits([ck](int64_t Ft, DType dt, uint64_t s) { return cam_entry({}, Ft, dt, s, ck); }, {}, false, 800);
}
TEST(CpDeterministic, CamReversedAndTruncatedBitwiseOverRanks) {
  check_splits([](int64_t Ft, DType dt, uint64_t s) { return cam_entry(reversed(), Ft, dt, s, Checkpoint::off); },
               reversed(), false, 900);
  check_truncated(
      [](const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t s) { return cam_entry(o, Ft, dt, s, Checkpoint::off); },
      false, 950);
}

// Ranks that disagree on the mode get an error naming it on every rank.
TEST(CpDeterministic, ModeDifferingBetweenRanksIsAnError) {
  if (nranks() < 2) GTEST_SKIP() << "needs two ranks";
  const Entry e = scan_entry({}, nranks(), DType::f64, 11);
  cp::CpOptions o;
  o.deterministic = rank() == 1;
  std::vector<Tensor> x;
  for (size_t k = 0; k < e.in.size(); ++k) x.push_back(frames(e.in[k], e.in_ax[k], rank(), rank() + 1));
  expect_all_throw([&] { cp::cp_scan(*world(), x[0], x[1], x[2], x[3], x[4], o); }, "deterministic");
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
