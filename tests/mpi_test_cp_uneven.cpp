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

#include "mpi_cp_entries.h"
#include "mpi_cp_fixtures.h"
#include "util/tolerance.h"

namespace gdncp {
namespace test {
namespace {

// Every split of this group size against one rank (check_each_split).
void check_entry_splits(const std::function<Entry(int64_t Ft, DType dt, uint64_t seed)>& make, const cp::CpOptions& o,
                        bool with_clips, uint64_t seed) {
  check_each_split(check_against_one_rank, make, o, with_clips, seed);
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
  check_entry_splits([](int64_t Ft, DType dt, uint64_t s) { return layer_entry(true, {}, Ft, dt, s, Checkpoint::off); },
                     {}, true, 400);
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
  check_entry_splits([](int64_t Ft, DType dt, uint64_t s) { return cam_entry({}, Ft, dt, s, Checkpoint::off); }, {},
                     false, 700);
}
TEST(CpUneven, CamReversedMatchesOneRank) {
  cp::CpOptions o;
  o.reverse_rank_order = true;
  check_entry_splits([o](int64_t Ft, DType dt, uint64_t s) { return cam_entry(o, Ft, dt, s, Checkpoint::off); }, o,
                     false, 800);
}

// Truncated inside a short rank against one rank (check_each_truncated).
void check_truncated(const std::function<Entry(const cp::CpOptions&, int64_t, DType, uint64_t)>& make, bool clips,
                     uint64_t seed) {
  check_each_truncated(check_against_one_rank, make, clips, seed);
}

TEST(CpUneven, ScanTruncatedInShortRank) {
  check_truncated(
      [](const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t s) { return scan_entry(false, o, Ft, dt, s); }, true,
      900);
}
TEST(CpUneven, RawTruncatedInShortRank) {
  check_truncated([](const cp::CpOptions& o, int64_t Ft, DType dt,
                     uint64_t s) { return layer_entry(false, o, Ft, dt, s, Checkpoint::off); },
                  true, 1000);
}
TEST(CpUneven, CamTruncatedInShortRank) {
  check_truncated(
      [](const cp::CpOptions& o, int64_t Ft, DType dt, uint64_t s) { return cam_entry(o, Ft, dt, s, Checkpoint::off); },
      false, 1100);
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
    EXPECT_TRUE(
        bitwise_equal(local.second, slice(global.second, 0, mine.offset * kS, (mine.offset + mine.frames) * kS)));
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

  const std::vector<Tensor> local = local_inputs(e, off, off + F);
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
  const Entry e =
      layer_entry(true, {}, std::accumulate(split.begin(), split.end(), int64_t{0}), DType::f64, 3000, Checkpoint::off);
  const std::vector<Tensor> local = local_inputs(e, off, off + F);
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
  expect_all_throw([&] { cp::bigdn_cp(*world(), qkv, beta, decay, Tensor(), Tensor(), rope.first, rope.second, F, S); },
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
