// tests/mpi_test_train.cpp — gdncp_train's loop (examples/train/trainer.h)
// driven in-process on sub-groups of 4 CPU ranks:
//   - 2-rank training (DP=2 on ranks {0,1}, CP=2 on {2,3}) lowers the loss ≥ 50% in 30 steps;
//   - CP=2 equals CP=1 on the same videos (first 5 losses, tol::f32 relative);
//   - DP=2 × CP=2 on 4 ranks equals one rank with the whole global batch, and keeps
//     the parameters bitwise identical on every rank;
//   - save at step 10 + resume to 20 equals 20 uninterrupted steps bitwise;
//   - uneven splits (5 frames on CP=2, 3 frames on CP=4 with an empty rank) and
//     packed clips (--clips, a clip spanning two ranks) train, and equal one rank;
//   - --overlap-exchange trains bitwise as without it on CPU ranks;
//   - bad checkpoints and flags give UsageError on every rank, no hang.
// Pass/fail is reduced over all ranks.
// gdncp-mpi-np: 4
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "mpi_train_fixtures.h"
#include "util/mpi_main.h"
#include "util/tolerance.h"

#if __has_include("trainer.h")  // examples/ built (GDNCP_BUILD_EXAMPLES): it links the trainer in
#include <gdncp/error.h>

#include "dist.h"
#include "trainer.h"
#define GDNCP_HAVE_TRAINER 1
#endif

namespace {

using gdncp::test::world_rank;

#if GDNCP_HAVE_TRAINER

// Ranks with color >= 0 get a communicator of their color; the others MPI_COMM_NULL.
class SubGroup {
 public:
  explicit SubGroup(int color) {
    MPI_Comm_split(MPI_COMM_WORLD, color >= 0 ? color : MPI_UNDEFINED, world_rank(), &comm_);
  }
  ~SubGroup() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  MPI_Comm comm() const { return comm_; }
  bool member() const { return comm_ != MPI_COMM_NULL; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

// Rank root's vector, on every rank of the world.
std::vector<double> from_rank(int root, std::vector<double> v) {
  int n = static_cast<int>(v.size());
  MPI_Bcast(&n, 1, MPI_INT, root, MPI_COMM_WORLD);
  v.resize(static_cast<size_t>(n));
  MPI_Bcast(v.data(), n, MPI_DOUBLE, root, MPI_COMM_WORLD);
  return v;
}

// A scratch directory of this binary (not created).
std::string scratch_dir(const std::string& name) { return gdncp::test::scratch_dir("gdncp_train_test", name); }

train::Config small() { return gdncp::test::small_config(2, 16, 16, 4, 8); }

// Two sub-groups of two ranks, {0,1} (color 0) and {2,3} (color 1), each with
// small() at its CP degree (cp0, cp1) and, given a scratch name, a scratch
// directory of its own (dir; none when empty).
struct RankPairs {
  int color = world_rank() / 2;
  SubGroup g{color};
  train::Config c = small();
  std::string dir;
  RankPairs(int64_t cp0, int64_t cp1, const std::string& scratch = "") {
    c.cp = color == 0 ? cp0 : cp1;
    if (!scratch.empty()) dir = scratch_dir(scratch + std::to_string(color));
  }
};

int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
#define NEEDS_FOUR_RANKS() \
  if (world_size() != 4) GTEST_SKIP() << "needs exactly 4 ranks (mpirun -np 4)"

// train::train, with an exception turned into a test failure so that the
// test's later collectives still run on every rank (no hang on a failure).
train::Result run(const train::Config& c, MPI_Comm comm) {
  try {
    return train::train(c, comm);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "train() threw: " << e.what();
    return {};
  }
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-300); }

// Every rank fails if any rank failed.
class TrainTest : public gdncp::test::AllRanksTest {};

TEST_F(TrainTest, TwoRankTrainingHalvesTheLossIn30Steps) {
  NEEDS_FOUR_RANKS();
  // Ranks {0,1}: DP=2 × CP=1; ranks {2,3}: DP=1 × CP=2. Both are 2-rank CPU trainings.
  RankPairs pairs(1, 2);
  train::Config& c = pairs.c;
  c.steps = 30;
  const train::Result r = run(c, pairs.g.comm());
  ASSERT_EQ(r.losses.size(), 30u);
  double tail = 0;
  for (size_t i = 25; i < 30; ++i) tail += r.losses[i] / 5;  // mean of steps 26..30: batch-to-batch noise averaged
  EXPECT_LE(tail, 0.5 * r.losses[0]) << "cp=" << c.cp << ": loss " << r.losses[0] << " -> " << tail;
  for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
}

TEST_F(TrainTest, CpTwoMatchesCpOneForTheFirstFiveSteps) {
  NEEDS_FOUR_RANKS();
  // Ranks {0,1} run CP=2; rank 2 runs the same videos on one rank; rank 3 idles.
  const int r = world_rank();
  SubGroup g(r < 2 ? 0 : r == 2 ? 1 : -1);
  train::Config c = small();
  c.steps = 5;
  std::vector<double> losses;
  if (g.member()) {
    c.cp = r < 2 ? 2 : 1;
    losses = run(c, g.comm()).losses;
  }
  const std::vector<double> cp2 = from_rank(0, losses), cp1 = from_rank(2, losses);
  ASSERT_EQ(cp2.size(), 5u);
  ASSERT_EQ(cp1.size(), 5u);
  // f32 throughout; the two runs differ only in summation order (the CP scan's
  // prefix merge, the split loss and gradient sums): tol::f32 relative.
  for (size_t i = 0; i < 5; ++i)
    EXPECT_LE(rel(cp2[i], cp1[i]), gdncp::test::tol::f32) << "step " << i + 1 << ": " << cp2[i] << " vs " << cp1[i];
}

TEST_F(TrainTest, UnevenFramesAndPackedClipsTrainOnTwoRanks) {
  NEEDS_FOUR_RANKS();
  // Ranks {0,1}: CP=2 over 5 frames (3 + 2); ranks {2,3}: the same videos as clips 2,2,1
  // (the clip of frames 2..3 spans the two ranks). Both are 2-rank CPU trainings.
  RankPairs pairs(2, 2);
  train::Config& c = pairs.c;
  c.steps = 30;
  c.frames = 5;
  if (pairs.color == 1) c.clips = {2, 2, 1};
  const train::Result r = run(c, pairs.g.comm());
  ASSERT_EQ(r.losses.size(), 30u);
  double tail = 0;
  for (size_t i = 25; i < 30; ++i) tail += r.losses[i] / 5;
  EXPECT_LE(tail, 0.5 * r.losses[0]) << (pairs.color ? "clips" : "uneven") << ": loss " << r.losses[0] << " -> "
                                     << tail;
  for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
}

// One run of base (changed by setup) per color on the ranks of that color (none for color < 0);
// returns, on every rank, the losses of the runs whose first ranks are `roots`.
std::vector<std::vector<double>> losses_by_color(const train::Config& base, int color, const std::vector<int>& roots,
                                                 const std::function<void(train::Config&, int)>& setup) {
  SubGroup g(color);
  std::vector<double> mine;
  if (g.member()) {
    train::Config c = base;
    setup(c, color);
    mine = run(c, g.comm()).losses;
  }
  std::vector<std::vector<double>> out;
  for (int root : roots) out.push_back(from_rank(root, mine));
  return out;
}

// small() for 5 steps over videos of 5 frames (3 + 2 on CP=2).
train::Config five_steps_of_five_frames() {
  train::Config c = small();
  c.steps = 5;
  c.frames = 5;
  return c;
}

TEST_F(TrainTest, UnevenSplitMatchesOneRank) {
  NEEDS_FOUR_RANKS();
  // Ranks {0,1}: CP=2 over 5 frames (3 + 2); rank 2: the same videos on one rank; rank 3 idles.
  const int r = world_rank();
  train::Config base = five_steps_of_five_frames();
  const auto l = losses_by_color(base,
                                 r < 2    ? 0
                                 : r == 2 ? 1
                                          : -1,
                                 {0, 2}, [](train::Config& c, int color) { c.cp = color == 0 ? 2 : 1; });
  ASSERT_EQ(l[0].size(), 5u);
  ASSERT_EQ(l[1].size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_LE(rel(l[0][i], l[1][i]), 1e-5) << "step " << i + 1 << ": " << l[0][i] << " vs " << l[1][i];

  // 3 frames on CP=4 (1 + 1 + 1 + 0: rank 3 holds no frame but joins every collective) against rank 0 alone.
  base.frames = 3;
  base.batch = 2;
  train::Config c4 = base;
  c4.cp = 4;
  const train::Result all = run(c4, MPI_COMM_WORLD);
  const auto one = losses_by_color(base, r == 0 ? 0 : -1, {0}, [](train::Config& c, int) { c.cp = 1; });
  ASSERT_EQ(all.losses.size(), 5u);
  ASSERT_EQ(one[0].size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_LE(rel(all.losses[i], one[0][i]), 1e-5)
        << "CP=4, step " << i + 1 << ": " << all.losses[i] << " vs " << one[0][i];
}

TEST_F(TrainTest, PackedClipsCpMatchesCpOne) {
  NEEDS_FOUR_RANKS();
  // Ranks {0,1}: CP=2 over clips 2,2,1 (a clip spans the ranks); rank 2: the same on one rank;
  // rank 3: the same videos as one clip, which must train differently.
  const int r = world_rank();
  train::Config base = five_steps_of_five_frames();
  const auto l = losses_by_color(base, r < 2 ? 0 : r, {0, 2, 3}, [](train::Config& c, int color) {
    c.cp = color == 0 ? 2 : 1;
    if (color != 3) c.clips = {2, 2, 1};
  });
  for (const auto& v : l) ASSERT_EQ(v.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_LE(rel(l[0][i], l[1][i]), 1e-5) << "step " << i + 1 << ": " << l[0][i] << " vs " << l[1][i];
  EXPECT_GT(rel(l[1][0], l[2][0]), 1e-3) << "clips 2,2,1 trained like one clip: " << l[1][0] << " vs " << l[2][0];
}

TEST_F(TrainTest, DataTimesContextParallelMatchesOneRankAndKeepsParametersIdentical) {
  NEEDS_FOUR_RANKS();
  // All 4 ranks: DP=2 × CP=2, batch 2 per DP group; rank 0 alone afterwards with
  // the whole global batch (4 videos) — the same videos (see Note [data]).
  train::Config c = small();
  c.steps = 5;
  c.cp = 2;
  c.batch = 2;
  const train::Result r = run(c, MPI_COMM_WORLD);  // check_every = 1: throws on any divergence
  unsigned long long h = r.param_hash, h0 = h;
  MPI_Bcast(&h0, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  EXPECT_EQ(h, h0) << "final parameters differ from rank 0's";

  SubGroup one(world_rank() == 0 ? 0 : -1);
  std::vector<double> single;
  if (one.member()) {
    train::Config s = small();
    s.steps = 5;
    s.cp = 1;
    s.batch = 4;
    single = run(s, one.comm()).losses;
  }
  single = from_rank(0, single);
  ASSERT_EQ(r.losses.size(), 5u);
  ASSERT_EQ(single.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_LE(rel(r.losses[i], single[i]), gdncp::test::tol::f32)
        << "step " << i + 1 << ": " << r.losses[i] << " vs " << single[i];
}

TEST_F(TrainTest, ResumeFromStep10EqualsTwentyUninterruptedStepsBitwise) {
  NEEDS_FOUR_RANKS();
  // Ranks {0,1}: CP=2; ranks {2,3}: DP=2 — both layouts are resumed.
  RankPairs pairs(2, 1, "resume");  // CP=2 and DP=2
  train::Config c = pairs.c;
  c.check_every = 5;
  c.steps = 20;
  const train::Result full = run(c, pairs.g.comm());

  train::Config first = c;
  first.steps = 10;
  first.save_dir = pairs.dir;
  first.save_every = 10;
  first.log_path = pairs.dir + "/log.jsonl";
  const train::Result a = run(first, pairs.g.comm());
  EXPECT_TRUE(std::filesystem::exists(pairs.dir + "/step_00000010.ckpt"));
  EXPECT_FALSE(std::filesystem::exists(pairs.dir + "/step_00000010.ckpt.tmp"));

  train::Config second = c;
  second.resume = pairs.dir;  // a directory: its latest checkpoint
  second.log_path = pairs.dir + "/log.jsonl";
  const train::Result b = run(second, pairs.g.comm());
  MPI_Barrier(MPI_COMM_WORLD);  // the last collective: asserts may return early after it
  if (world_rank() % 2 == 0) std::filesystem::remove_all(pairs.dir);
  ASSERT_EQ(full.losses.size(), 20u);
  ASSERT_EQ(a.losses.size(), 10u);
  ASSERT_EQ(b.losses.size(), 10u);
  EXPECT_EQ(b.first_step, 11);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(a.losses[i], full.losses[i]) << "step " << i + 1;
    EXPECT_EQ(b.losses[i], full.losses[10 + i]) << "step " << i + 11 << " after resume";
  }
  EXPECT_EQ(b.param_hash, full.param_hash) << "final parameters differ from the uninterrupted run";
}

// --deterministic: 40 steps on CP=2 (ranks {0,1}), saved at step 20, resumed on
// CP=1 (rank 0) and on CP=4 (all ranks): the resumed runs continue with bitwise
// the losses and final parameters of the uninterrupted CP=2 run (Note [layout]
// in examples/train/trainer.cpp). Tiny shapes: the comparison is exact.
TEST_F(TrainTest, DeterministicResumeOnAnotherCpDegreeIsBitwise) {
  NEEDS_FOUR_RANKS();
  const std::string dir = scratch_dir("determ");
  train::Config c = small();
  c.heads = 2;
  c.head_dim = 4;
  c.tokens = 4;
  c.batch = 2;
  c.pool = 3;
  c.steps = 40;
  c.check_every = 10;
  c.deterministic = true;
  std::vector<double> full_losses;
  unsigned long long full_hash = 0;
  {
    SubGroup g(world_rank() < 2 ? 0 : -1);
    if (g.member()) {
      train::Config a = c;
      a.cp = 2;
      a.save_dir = dir;
      a.save_every = 20;
      const train::Result r = run(a, g.comm());
      full_losses = r.losses;
      full_hash = r.param_hash;
    }
  }
  full_losses = from_rank(0, full_losses);
  MPI_Bcast(&full_hash, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  ASSERT_EQ(full_losses.size(), 40u);

  train::Config b = c;
  b.resume = dir + "/step_00000020.ckpt";
  std::vector<double> cp1_losses;
  unsigned long long cp1_hash = 0;
  int cp1_from = 0;
  {
    SubGroup one(world_rank() == 0 ? 0 : -1);
    if (one.member()) {
      b.cp = 1;
      const train::Result r = run(b, one.comm());
      cp1_losses = r.losses;
      cp1_hash = r.param_hash;
      cp1_from = r.resumed_cp;
    }
  }
  cp1_losses = from_rank(0, cp1_losses);
  MPI_Bcast(&cp1_hash, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  MPI_Bcast(&cp1_from, 1, MPI_INT, 0, MPI_COMM_WORLD);
  b.cp = 4;
  const train::Result cp4 = run(b, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);  // the last collective: asserts may return early after it
  if (world_rank() == 0) std::filesystem::remove_all(std::filesystem::path(dir).parent_path());

  EXPECT_EQ(cp1_from, 2) << "the checkpoint records the layout it was written with";
  EXPECT_EQ(cp4.resumed_cp, 2);
  EXPECT_EQ(cp4.first_step, 21);
  ASSERT_EQ(cp1_losses.size(), 20u);
  ASSERT_EQ(cp4.losses.size(), 20u);
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(cp1_losses[i], full_losses[20 + i]) << "step " << i + 21 << " resumed on CP=1";
    EXPECT_EQ(cp4.losses[i], full_losses[20 + i]) << "step " << i + 21 << " resumed on CP=4";
  }
  EXPECT_EQ(cp1_hash, full_hash) << "final parameters on CP=1 differ from the uninterrupted CP=2 run";
  EXPECT_EQ(cp4.param_hash, full_hash) << "final parameters on CP=4 differ from the uninterrupted CP=2 run";
  EXPECT_LT(full_losses[39], full_losses[0]) << "the run did not train";
}

TEST_F(TrainTest, ResumeLeavesLogAndPlotOfTheWholeRun) {
  NEEDS_FOUR_RANKS();
  RankPairs pairs(2, 1, "logplot");  // CP=2 and DP=2
  train::Config c = pairs.c;
  c.steps = 6;
  c.save_dir = pairs.dir;
  c.save_every = 3;
  c.log_path = pairs.dir + "/log.jsonl";
  train::Config first = c;
  first.steps = 3;
  run(first, pairs.g.comm());
  c.resume = pairs.dir;
  run(c, pairs.g.comm());
  // The log has both halves and the plot exists.
  int log_steps = 0;
  std::ifstream log(pairs.dir + "/log.jsonl");
  for (std::string line; std::getline(log, line);) log_steps += line.find("\"loss\"") != std::string::npos;
  if (pairs.g.member() && world_rank() % 2 == 0) {
    EXPECT_EQ(log_steps, 6);
    EXPECT_TRUE(std::filesystem::exists(pairs.dir + "/loss.svg"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() % 2 == 0) std::filesystem::remove_all(pairs.dir);
}

TEST_F(TrainTest, ActivationCheckpointingGivesBitwiseTheSameTraining) {
  NEEDS_FOUR_RANKS();
  // Ranks {0,1}: CP=2 (the recompute re-enters the CP layer); ranks {2,3}: DP=2.
  RankPairs pairs(2, 1);
  train::Config& c = pairs.c;
  SubGroup& g = pairs.g;
  c.steps = 4;
  c.checkpointing = "off";
  const train::Result off = run(c, g.comm());
  c.checkpointing = "on";
  const train::Result on = run(c, g.comm());
  ASSERT_EQ(off.losses.size(), 4u);
  ASSERT_EQ(on.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(on.losses[i], off.losses[i]) << "step " << i + 1;
  EXPECT_EQ(on.param_hash, off.param_hash);
}

// --overlap-exchange on CPU ranks: accepted, and the training is bitwise the same (the
// option only reorders the sweeps around the all-gather; docs/design.md §6).
TEST_F(TrainTest, OverlapExchangeGivesBitwiseTheSameTraining) {
  NEEDS_FOUR_RANKS();
  RankPairs pairs(2, 1);  // ranks {0,1}: CP=2; ranks {2,3}: DP=2 (no CP layer exchange)
  train::Config& c = pairs.c;
  SubGroup& g = pairs.g;
  c.steps = 4;
  const train::Result off = run(c, g.comm());
  c.overlap_exchange = true;
  const train::Result on = run(c, g.comm());
  ASSERT_EQ(off.losses.size(), 4u);
  ASSERT_EQ(on.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(on.losses[i], off.losses[i]) << "step " << i + 1;
  EXPECT_EQ(on.param_hash, off.param_hash);
}

TEST_F(TrainTest, ParameterCheckCatchesOneUlpOnOneRank) {
  NEEDS_FOUR_RANKS();
  train::Dist dist(MPI_COMM_WORLD, 2, gdncp::Device::cpu);
  gdncp::Tensor p = gdncp::Tensor::randn({5, 7}, gdncp::DType::f32, gdncp::Device::cpu, 99);
  EXPECT_NO_THROW(dist.check_identical(train::hash_tensors({p}), "same"));
  if (world_rank() == 3) {
    float* v = p.data_ptr<float>();
    v[17] = std::nextafter(v[17], 1e30f);
  }
  try {
    dist.check_identical(train::hash_tensors({p}), "params");
    ADD_FAILURE() << "a one-ulp difference on rank 3 went unnoticed";
  } catch (const gdncp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 3 differ"), std::string::npos) << e.what();
  }
}

TEST_F(TrainTest, BadCheckpointsAreUsageErrorsOnEveryRank) {
  NEEDS_FOUR_RANKS();
  const int color = world_rank() / 2;
  SubGroup g(color);
  const std::string dir = scratch_dir("bad" + std::to_string(color));
  train::Config c = small();
  c.steps = 2;
  c.cp = 1;
  c.save_dir = dir;
  run(c, g.comm());  // writes step_00000002.ckpt
  const std::string ck = dir + "/step_00000002.ckpt";

  auto expect_usage = [&](train::Config bad, const std::string& needle) {
    try {
      train::train(bad, g.comm());
      ADD_FAILURE() << "no UsageError; expected one mentioning '" << needle << "'";
    } catch (const train::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  train::Config r = c;
  r.save_dir = "";
  r.steps = 4;
  r.resume = dir + "/missing.ckpt";
  expect_usage(r, "does not exist");
  r.resume = ck;
  train::Config other = r;
  other.heads = 4;
  other.head_dim = 8;
  expect_usage(other, "heads = 2, this run 4");
  train::Config done = r;
  done.steps = 2;
  expect_usage(done, "nothing to do");
  MPI_Barrier(g.comm());
  if (world_rank() % 2 == 0) {  // truncate a copy
    std::filesystem::copy_file(ck, dir + "/cut.ckpt");
    std::filesystem::resize_file(dir + "/cut.ckpt", std::filesystem::file_size(ck) / 2);
    std::ofstream(dir + "/junk.ckpt") << "not a checkpoint";
  }
  MPI_Barrier(g.comm());
  r.resume = dir + "/cut.ckpt";
  expect_usage(r, "corrupt");
  r.resume = dir + "/junk.ckpt";
  expect_usage(r, "bad magic");
  r.resume = dir;
  const train::Result ok = run(r, g.comm());  // the directory's latest: step 2 -> 3, 4
  EXPECT_EQ(ok.first_step, 3);
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() % 2 == 0) std::filesystem::remove_all(dir);
}

TEST_F(TrainTest, BadFlagsAreUsageErrors) {
  NEEDS_FOUR_RANKS();
  auto parse = [](std::vector<std::string> args) {
    std::vector<char*> argv{const_cast<char*>("gdncp_train")};
    for (auto& a : args) argv.push_back(a.data());
    train::Config c;
    return train::parse_args(static_cast<int>(argv.size()), argv.data(), c);
  };
  auto expect_usage = [&](std::vector<std::string> args, const std::string& needle) {
    try {
      parse(args);
      ADD_FAILURE() << "no UsageError for " << args[0];
    } catch (const train::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  EXPECT_TRUE(parse({"--steps", "5", "--lr=0.1", "--device", "cpu"}));
  EXPECT_FALSE(parse({"--help"}));
  expect_usage({"--stepz", "5"}, "unknown flag --stepz");
  expect_usage({"--steps"}, "missing value");
  expect_usage({"--steps", "five"}, "expected an integer");
  expect_usage({"--steps", "0"}, "out of range");
  expect_usage({"--head-dim", "130"}, "out of range");
  expect_usage({"--lr", "1e"}, "expected a number");
  expect_usage({"--device", "tpu"}, "cpu | cuda");
  expect_usage({"--checkpointing", "maybe"}, "on | off | auto");
  expect_usage({"steps"}, "unexpected argument");
  expect_usage({"--clips", "3,,2"}, "expected an integer");
  expect_usage({"--clips", "0,3"}, "out of range");
  // Checks against the world, raised by train() before any work.
  SubGroup g(world_rank() < 2 ? 0 : 1);
  train::Config c = small();
  c.cp = 3;
  EXPECT_THROW(train::train(c, g.comm()), train::UsageError);  // 3 does not divide 2 ranks
  c.cp = 2;
  c.frames = 5;
  c.clips = {2, 2};
  EXPECT_THROW(train::train(c, g.comm()), train::UsageError);  // clips of 4 frames in videos of 5
  c = small();
  c.head_dim = 15;
  EXPECT_THROW(train::train(c, g.comm()), train::UsageError);
}

#else
TEST(TrainTest, SkippedWithoutExamples) { GTEST_SKIP() << "built with GDNCP_BUILD_EXAMPLES=OFF"; }
#endif

}  // namespace

int main(int argc, char** argv) { return gdncp::test::train_test_main(argc, argv, "gdncp_train_test"); }
