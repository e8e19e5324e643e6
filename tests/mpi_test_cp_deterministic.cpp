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

#include "mpi_cp_entries.h"
#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {
namespace {

// The entries at D = 4, S = 2 in the deterministic mode. Tiny: the comparisons are
// bitwise, so no tolerance asks for larger shapes.
constexpr EntryMode kTiny{4, 2, true};

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
  const int r = rank();
  ASSERT_EQ(split.size(), static_cast<size_t>(nranks()));
  const RankBlock rb = rank_block(split, o, clips);
  const int64_t off = rb.off, F = rb.F;

  std::vector<Tensor> wg;
  const auto ref_weights = [&](const std::vector<Tensor>& outs) {
    wg = global_weights(outs, seed);
    return wg;
  };
  const Run ref = one_rank ? one_rank(e.in, rb.Ft, rb.mask, ref_weights)
                           : run(e, *self(), e.in, rb.Ft, rb.mask, ref_weights, false);

  const Run got = run(
      e, *world(), local_inputs(e, off, off + F), F, rb.local_mask(),
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

// check_bitwise as a SplitCheck (the dtype is the entry's).
void check_bitwise_split(const Entry& e, const std::vector<int64_t>& split, const cp::CpOptions& o, bool clips, DType,
                         uint64_t seed) {
  check_bitwise(e, split, o, clips, seed);
}

// Every split of this group size, bitwise (check_each_split).
void check_splits(const std::function<Entry(int64_t Ft, DType dt, uint64_t seed)>& make, const cp::CpOptions& o,
                  bool with_clips, uint64_t seed) {
  check_each_split(check_bitwise_split, make, o, with_clips, seed);
}

// Truncated inside a short rank, bitwise (check_each_truncated).
void check_truncated(const std::function<Entry(const cp::CpOptions&, int64_t, DType, uint64_t)>& make, bool clips,
                     uint64_t seed) {
  check_each_truncated(check_bitwise_split, make, clips, seed);
}

cp::CpOptions reversed() {
  cp::CpOptions o;
  o.reverse_rank_order = true;
  return o;
}

TEST(CpDeterministic, ScanBitwiseOverRanks) {
  check_splits([](int64_t Ft, DType dt, uint64_t s) { return scan_entry(false, {}, Ft, dt, s, kTiny); }, {}, true, 100);
}
TEST(CpDeterministic, ScanReversedBitwiseOverRanks) {
  check_splits([](int64_t Ft, DType dt, uint64_t s) { return scan_entry(false, reversed(), Ft, dt, s, kTiny); },
               reversed(), true, 200);
}
TEST(CpDeterministic, ScanTruncatedBitwiseOverRanks) {
  check_truncated(
      [](const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t s) { return scan_entry(false, o, Ft, dt, s, kTiny); },
      true, 300);
}
TEST(CpDeterministic, BigdnCpBitwiseOverRanks) {
  for (Checkpoint ck : {Checkpoint::off, Checkpoint::on}) {
    SCOPED_TRACE(ck == Checkpoint::on ? "checkpoint on" : "checkpoint off");
    check_splits([ck](int64_t Ft, DType dt, uint64_t s) { return layer_entry(true, {}, Ft, dt, s, ck, kTiny); }, {},
                 true, 400);
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
        const Entry e = layer_entry(true, {}, Ft, dt, seed, Checkpoint::off, kTiny);
        BigdnOptions opt;
        opt.k_scale = 1.0 / std::sqrt(static_cast<double>(kTiny.D * kTiny.S));
        opt.deterministic = true;
        check_bitwise(e, split, {}, clips, seed,
                      [&](const std::vector<Tensor>& in, int64_t F, const Tensor& mask,
                          const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& weights) {
                        std::vector<Tensor> x;
                        for (size_t k = 0; k < in.size(); ++k) x.push_back(e.diff[k] ? leaf(in[k]) : in[k]);
                        test::Run r;
                        r.outs = {bigdn(x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, kTiny.S, opt, mask)};
                        backward_weighted(r.outs, weights(r.outs));
                        for (size_t k = 0; k < x.size(); ++k)
                          r.grads.push_back(e.diff[k] && x[k].defined() ? x[k].grad() : Tensor());
                        return r;
                      });
        seed += 17;
      }
}
TEST(CpDeterministic, RawBitwiseOverRanks) {
  check_splits(
      [](int64_t Ft, DType dt, uint64_t s) { return layer_entry(false, {}, Ft, dt, s, Checkpoint::on, kTiny); }, {},
      true, 500);
}
TEST(CpDeterministic, RawReversedBitwiseOverRanks) {
  check_splits([](int64_t Ft, DType dt,
                  uint64_t s) { return layer_entry(false, reversed(), Ft, dt, s, Checkpoint::off, kTiny); },
               reversed(), true, 600);
}
TEST(CpDeterministic, RawTruncatedBitwiseOverRanks) {
  check_truncated([](const cp::CpOptions& o, int64_t Ft, DType dt,
                     uint64_t s) { return layer_entry(false, o, Ft, dt, s, Checkpoint::off, kTiny); },
                  true, 700);
}
TEST(CpDeterministic, CamBitwiseOverRanks) {
  for (Checkpoint ck : {Checkpoint::off, Checkpoint::on})
    check_splits([ck](int64_t Ft, DType dt, uint64_t s) { return cam_entry({}, Ft, dt, s, ck, kTiny); }, {}, false,
                 800);
}
TEST(CpDeterministic, CamReversedAndTruncatedBitwiseOverRanks) {
  check_splits(
      [](int64_t Ft, DType dt, uint64_t s) { return cam_entry(reversed(), Ft, dt, s, Checkpoint::off, kTiny); },
      reversed(), false, 900);
  check_truncated([](const cp::CpOptions& o, int64_t Ft, DType dt,
                     uint64_t s) { return cam_entry(o, Ft, dt, s, Checkpoint::off, kTiny); },
                  false, 950);
}

// Ranks that disagree on the mode get an error naming it on every rank.
TEST(CpDeterministic, ModeDifferingBetweenRanksIsAnError) {
  if (nranks() < 2) GTEST_SKIP() << "needs two ranks";
  const Entry e = scan_entry(false, {}, nranks(), DType::f64, 11, kTiny);
  cp::CpOptions o;
  o.deterministic = rank() == 1;
  const std::vector<Tensor> x = local_inputs(e, rank(), rank() + 1);
  expect_all_throw([&] { cp::cp_scan(*world(), x[0], x[1], x[2], x[3], x[4], o); }, "deterministic");
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
