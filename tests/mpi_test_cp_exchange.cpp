// tests/mpi_test_cp_exchange.cpp — the composites' exchanges of the CP scan
// (gdncp/cp.h Exchange, Note [exchange] in src/cp/scan/exchange.h) on CPU ranks:
//   - every exchange (all-gather, log, hierarchical with every node size that
//     divides P, auto) == one rank, f64, forward and every gradient, for every
//     entry: uneven splits with empty ranks, clip masks crossing rank and node
//     boundaries, reverse rank order, truncation;
//   - checkpointing on == off bitwise under each exchange, and overlap_exchange on == off;
//   - the f32 layer within 1e-6 of f64, the decay gradient included;
//   - the log exchange sends exactly the composites Note [exchange] says;
//   - a node size that does not divide P, an exchange out of range, a bad
//     GDNCP_CP_NODE_SIZE and the one-direction options on the bidirectional
//     entries: an error on every rank.
// gdncp-mpi-np: 1 2 3 4 5 6 7 8 16
#include <cstdlib>
#include <string>
#include <vector>

#include "mpi_cp_entries.h"
#include "mpi_cp_fixtures.h"

namespace gdncp {
namespace test {
namespace {

// The exchanges to run at this group size: every algorithm, hierarchical with
// every node size of {2, 3, 4} below P that divides it (one node of P when none does).
std::vector<cp::CpOptions> exchanges(const cp::CpOptions& base = {}) {
  const int P = nranks();
  std::vector<cp::CpOptions> out;
  for (cp::Exchange x : {cp::Exchange::automatic, cp::Exchange::all_gather, cp::Exchange::log}) {
    cp::CpOptions o = base;
    o.exchange = x;
    out.push_back(o);
  }
  std::vector<int> nodes;
  for (int n : {2, 3, 4})
    if (n < P && P % n == 0) nodes.push_back(n);
  if (nodes.empty() && P > 1) nodes.push_back(P);  // P prime: one node
  for (int n : nodes) {
    cp::CpOptions o = base;
    o.exchange = cp::Exchange::hierarchical;
    o.node_size = n;
    out.push_back(o);
  }
  return out;
}

std::string name_of(const cp::CpOptions& o) {
  return std::string(cp::exchange_name(o.exchange)) + (o.node_size ? " node " + std::to_string(o.node_size) : "");
}

// Splits of this group size: balanced, and uneven with empty ranks first, inside and last.
std::vector<std::vector<int64_t>> exchange_splits(int P) {
  std::vector<std::vector<int64_t>> s(2);
  for (int r = 0; r < P; ++r) {
    s[0].push_back(cp::balanced_split(P + 3, P, r).frames);
    s[1].push_back(P == 1 ? 4 : (r == 0 || r == P - 1 || r % 3 == 2) ? 0 : 1 + r % 2);
  }
  if (P == 2) s[1] = {0, 3};
  return s;
}

int64_t total(const std::vector<int64_t>& split) { return std::accumulate(split.begin(), split.end(), int64_t{0}); }

// The entry under every exchange and split, with and without clips, in f64.
void check_exchanges(const std::function<Entry(const cp::CpOptions&, int64_t Ft, uint64_t seed)>& make,
                     const cp::CpOptions& base, bool with_clips, uint64_t seed) {
  for (const cp::CpOptions& o : exchanges(base))
    for (const auto& split : exchange_splits(nranks()))
      for (bool clips : {false, true}) {
        if (clips && !with_clips) continue;
        SCOPED_TRACE(name_of(o) + ", split " + split_str(split) + (clips ? ", clips" : ""));
        check_against_one_rank(make(o, total(split), seed), split, o, clips, DType::f64, seed);
        seed += 17;
      }
}

TEST(CpExchange, ScanMatchesOneRank) {
  check_exchanges(
      [](const cp::CpOptions& o, int64_t Ft, uint64_t s) { return scan_entry(false, o, Ft, DType::f64, s); }, {}, true,
      100);
}
TEST(CpExchange, ScanReversedMatchesOneRank) {
  check_exchanges(
      [](const cp::CpOptions& o, int64_t Ft, uint64_t s) { return scan_entry(false, o, Ft, DType::f64, s); },
      reversed_ranks(), true, 200);
}
TEST(CpExchange, BidiScanMatchesOneRank) {
  check_exchanges([](const cp::CpOptions& o, int64_t Ft, uint64_t s) { return scan_entry(true, o, Ft, DType::f64, s); },
                  {}, true, 300);
}
TEST(CpExchange, BigdnCpMatchesOneRank) {
  check_exchanges([](const cp::CpOptions& o, int64_t Ft,
                     uint64_t s) { return layer_entry(true, o, Ft, DType::f64, s, Checkpoint::off); },
                  {}, true, 400);
}
TEST(CpExchange, CamReversedMatchesOneRank) {
  check_exchanges(
      [](const cp::CpOptions& o, int64_t Ft, uint64_t s) { return cam_entry(o, Ft, DType::f64, s, Checkpoint::off); },
      reversed_ranks(), false, 500);
}

// Truncation at a frame inside the group (the terminal state: the broadcast of the log
// scan's total; its gradient: the all-reduce of dT seeding the adjoint scan).
void check_truncated_exchanges(const std::function<Entry(const cp::CpOptions&, int64_t, uint64_t)>& make, bool clips,
                               uint64_t seed) {
  for (const auto& split : exchange_splits(nranks())) {
    cp::CpOptions base;
    base.truncate_to_active = std::max<int64_t>(1, total(split) / 2 + 1);
    for (const cp::CpOptions& o : exchanges(base))
      for (bool c : {false, true}) {
        if (c && !clips) continue;
        SCOPED_TRACE(name_of(o) + ", split " + split_str(split) + ", K = " + std::to_string(o.truncate_to_active) +
                     (c ? ", clips" : ""));
        check_against_one_rank(make(o, total(split), seed), split, o, c, DType::f64, seed);
        seed += 17;
      }
  }
}

TEST(CpExchange, ScanTruncatedMatchesOneRank) {
  check_truncated_exchanges(
      [](const cp::CpOptions& o, int64_t Ft, uint64_t s) { return scan_entry(false, o, Ft, DType::f64, s); }, true,
      600);
}
TEST(CpExchange, RawTruncatedMatchesOneRank) {
  check_truncated_exchanges([](const cp::CpOptions& o, int64_t Ft,
                               uint64_t s) { return layer_entry(false, o, Ft, DType::f64, s, Checkpoint::off); },
                            true, 700);
}
TEST(CpExchange, CamTruncatedMatchesOneRank) {
  check_truncated_exchanges(
      [](const cp::CpOptions& o, int64_t Ft, uint64_t s) { return cam_entry(o, Ft, DType::f64, s, Checkpoint::off); },
      false, 800);
}

// The recompute reads the kept exchange results: no collective, the same bits.
TEST(CpExchange, CheckpointBitwiseEqual) {
  for (const auto& split : exchange_splits(nranks())) {
    const int64_t Ft = total(split);
    for (const cp::CpOptions& o : exchanges()) {
      SCOPED_TRACE(name_of(o) + ", split " + split_str(split));
      check_checkpoint_bitwise([&](Checkpoint ck) { return layer_entry(true, o, Ft, DType::f32, 900, ck); }, split,
                               true);
      cp::CpOptions t = o;
      t.truncate_to_active = Ft;
      check_checkpoint_bitwise([&](Checkpoint ck) { return layer_entry(false, t, Ft, DType::f32, 950, ck); }, split,
                               true);
    }
  }
}

// The exchange hidden behind the sweeps it does not read (Note [hidden exchange]): the same
// sweeps in two batches, so overlap on == off bitwise, forward and every gradient, f32 and f64,
// under every exchange (log and hierarchical ignore it), with checkpointing, truncation, reverse
// rank order and clips.
TEST(CpExchange, OverlapBitwiseEqual) {
  for (const auto& split : exchange_splits(nranks())) {
    const int64_t Ft = total(split);
    for (const cp::CpOptions& base : exchanges())
      for (DType dt : {DType::f32, DType::f64}) {
        SCOPED_TRACE(name_of(base) + ", split " + split_str(split) + ", " + dtype_name(dt));
        const auto with = [&](cp::CpOptions o, bool on) {
          o.overlap_exchange = on;
          return o;
        };
        check_variants_bitwise(
            [&](bool on) { return layer_entry(true, with(base, on), Ft, dt, 1000, Checkpoint::off); }, split, true);
        check_variants_bitwise([&](bool on) { return layer_entry(true, with(base, on), Ft, dt, 1010, Checkpoint::on); },
                               split, false);
        cp::CpOptions t = base;
        t.truncate_to_active = Ft;
        check_variants_bitwise([&](bool on) { return layer_entry(false, with(t, on), Ft, dt, 1020, Checkpoint::off); },
                               split, true);
        check_variants_bitwise([&](bool on) { return scan_entry(true, with(base, on), Ft, dt, 1030); }, split, true);
        cp::CpOptions rev = base;
        rev.reverse_rank_order = true;
        check_variants_bitwise([&](bool on) { return cam_entry(with(rev, on), Ft, dt, 1040, Checkpoint::off); }, split,
                               false);
      }
  }
}

// The f32 CP layer against f64 at 11 frames a rank (22 at P = 2, the production split), every
// output and gradient within docs/design.md §8's 1e-6, the decay gradient included (its frames'
// sums over both directions' KV and Z terms in the wider type, rounded once).
// At the production D = 112, where f32 sums of a frame's D² terms miss the bar (2.0e-6 to 2.3e-6
// at P = 1, 2 when the CPU twin summed them in f32).
TEST(CpExchangePrecision, F32LayerWithin1e6OfF64) {
  const int P = nranks(), r = rank();
  const int64_t F = 11, S = 8, D = 112;
  const LayerInputs g = make_layer_inputs(dims(1, 2, D, F * P, S), DType::f64, 1100);
  const Tensor w = Tensor::randn({1, F * P * S, 2, D}, DType::f64, Device::cpu, 1101);
  std::vector<std::vector<Tensor>> res;  // f64, f32: out, dqkv, dbeta, ddecay
  for (DType dt : {DType::f64, DType::f32}) {
    const LayerInputs l = convert(local_block(g, F, r), dt);
    std::vector<Tensor> x = {leaf(l.qkv), leaf(l.beta), leaf(l.decay), leaf(l.q_norm_w), leaf(l.k_norm_w)};
    const Tensor out = cp::bigdn_cp(*world(), x[0], x[1], x[2], x[3], x[4], l.rope_cos, l.rope_sin, F, S, l.opt);
    backward_weighted({out}, {rank_block(w, 1, F * S, r).to(dt)});
    res.push_back({out, x[0].grad(), x[1].grad(), x[2].grad()});
  }
  const char* names[] = {"out", "dqkv", "dbeta", "ddecay"};
  for (size_t k = 0; k < 4; ++k) EXPECT_TRUE(close_rel(res[1][k], res[0][k], tol::f32_layer, names[k])) << "rank " << r;
}

// Bytes the log exchange sends from this rank in one cp_scan forward (KV and Z, forward
// order, no terminal state): per round k the inclusive composite's h of both jobs, and
// its M where a later round reads it (it does not start at rank 0, not the last round).
int64_t log_scan_bytes(int P, int r, int64_t BH, int64_t D) {
  int rounds = 0;
  while ((1 << rounds) < P) ++rounds;
  int64_t elems = 0;
  for (int k = 0; k < rounds; ++k) {
    const int s = 1 << k;
    if (r + s >= P) continue;
    elems += BH * D * (D + 1);
    if (r - s + 1 > 0 && k < rounds - 1) elems += 2 * BH * D * D;
  }
  return elems * static_cast<int64_t>(sizeof(double));
}

TEST(CpExchange, LogSendsOnlyWhatIsRead) {
  const int P = nranks(), r = rank();
  if (P < 3) GTEST_SKIP() << "log is one round of states at P <= 2";
  cp::CpOptions o;
  o.exchange = cp::Exchange::log;
  const int64_t F = 2, Ft = F * P;
  const Entry e = scan_entry(false, o, Ft, DType::f64, 1000);
  const std::vector<Tensor> local = local_inputs(e, r * F, (r + 1) * F);
  autograd::NoGradGuard ng;
  world()->set_validation(cp::Validation::off);
  e.call(*world(), local, F, Tensor());  // the record of this call, once
  world()->reset_stats();
  e.call(*world(), local, F, Tensor());
  const int64_t bytes = world()->stats().bytes;
  world()->set_validation(cp::Validation::every_call);
  EXPECT_EQ(bytes, log_scan_bytes(P, r, kB * kH, kD)) << "rank " << r;
}

// The scan entry (bidi: both directions) with options o on one frame per rank: an
// error on every rank containing what.
void expect_one_frame_scan_error(bool bidi, const cp::CpOptions& o, uint64_t seed, const std::string& what) {
  const Entry e = scan_entry(bidi, o, nranks(), DType::f64, seed);
  const std::vector<Tensor> local = local_inputs(e, rank(), rank() + 1);
  expect_all_throw([&] { e.call(*world(), local, 1, Tensor()); }, what);
}

// Node sizes and options that cannot work: an error on every rank, naming them.
TEST(CpExchangeErrors, NodeSizeNotDividingRanks) {
  const int P = nranks();
  if (P < 3) GTEST_SKIP() << "every node size up to P divides P <= 2 or is P";
  cp::CpOptions o;
  o.exchange = cp::Exchange::hierarchical;
  o.node_size = P - 1;
  expect_one_frame_scan_error(false, o, 1100, "node_size");
}
TEST(CpExchangeErrors, ExchangeOutOfRange) {
  if (nranks() < 2) GTEST_SKIP() << "one rank exchanges nothing";
  cp::CpOptions o;
  o.exchange = static_cast<cp::Exchange>(7);
  expect_one_frame_scan_error(false, o, 1200, "exchange: 7 is not an Exchange");
}
TEST(CpExchangeErrors, BadNodeSizeVariable) {
  if (nranks() < 3) GTEST_SKIP() << "auto needs no node size at P <= 2";
  cp::CpOptions o;
  o.exchange = cp::Exchange::hierarchical;
  ASSERT_EQ(setenv("GDNCP_CP_NODE_SIZE", "two", 1), 0);
  expect_one_frame_scan_error(false, o, 1300, "GDNCP_CP_NODE_SIZE");
  unsetenv("GDNCP_CP_NODE_SIZE");
}
// The environment variable declares nodes on one machine: hierarchical over them == one rank.
TEST(CpExchange, NodeSizeFromEnvironmentMatchesOneRank) {
  const int P = nranks();
  if (P < 4 || P % 2 != 0) GTEST_SKIP() << "needs two nodes of at least two ranks";
  ASSERT_EQ(setenv("GDNCP_CP_NODE_SIZE", "2", 1), 0);
  cp::CpOptions o;
  o.exchange = cp::Exchange::automatic;  // several nodes of 2: hierarchical
  const std::vector<int64_t> split = exchange_splits(P)[1];
  check_against_one_rank(scan_entry(true, o, total(split), DType::f64, 1400), split, o, true, DType::f64, 1400);
  unsetenv("GDNCP_CP_NODE_SIZE");
}
TEST(CpExchangeErrors, OneDirectionOptionsOnBidirectionalEntries) {
  for (bool reverse : {true, false}) {
    cp::CpOptions o;
    o.reverse_rank_order = reverse;
    o.truncate_to_active = reverse ? 0 : 1;
    expect_one_frame_scan_error(
        true, o, 1500, reverse ? "cp_bidi_scan: cp_options.reverse_rank_order" : "cp_bidi_scan: cp_options.truncate");
  }
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
