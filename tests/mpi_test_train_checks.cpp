// tests/mpi_test_train_checks.cpp — gdncp_train's start-up checks and its
// recovery from an interrupted run, in-process on 2 CPU ranks:
//   - every path flag and the sizes are checked before any step, the error
//     (a UsageError on every rank) names the flag;
//   - --resume DIR whose newest checkpoint is corrupt resumes from the newest
//     good one, says which it skipped, and trains as the uninterrupted run;
//   - the temporary file of an interrupted save is removed;
//   - the JSON-lines log of a resumed run holds every step once.
// gdncp-mpi-np: 2
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "mpi_train_fixtures.h"

namespace {

namespace fs = std::filesystem;

using gdncp::test::world_rank;

#if GDNCP_HAVE_TRAINER

// A scratch directory of this binary (scratch_dir), made empty.
std::string scratch(const std::string& name) { return gdncp::test::empty_scratch_dir("gdncp_train_checks", name); }

train::Config small() { return gdncp::test::small_cp2_config(); }

// train() must throw a UsageError containing every one of parts (on every rank).
void expect_usage(const train::Config& c, const std::vector<std::string>& parts) {
  try {
    train::train(c, MPI_COMM_WORLD);
    ADD_FAILURE() << "rank " << world_rank() << ": no UsageError; expected one naming " << parts.front();
  } catch (const train::UsageError& e) {
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "rank " << world_rank() << ": no '" << p << "' in: " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << world_rank() << ": not a UsageError: " << e.what();
  }
}

train::Result run(const train::Config& c) {
  try {
    return train::train(c, MPI_COMM_WORLD);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << world_rank() << ": train() threw: " << e.what();
    return {};
  }
}

// A regular file: paths "below" it cannot be created.
std::string plain_file(const std::string& dir) {
  const std::string f = dir + "/plain";
  if (world_rank() == 0) std::ofstream(f) << "x";
  MPI_Barrier(MPI_COMM_WORLD);
  return f;
}

// Every rank fails if any rank failed.
class TrainChecks : public gdncp::test::AllRanksTest {};

// --- paths and sizes, checked at start ------------------------------------------------------

TEST_F(TrainChecks, SaveDirThatCannotBeCreatedIsFoundBeforeAnyStep) {
  const std::string dir = scratch("savedir");
  train::Config c = small();
  c.steps = 3;
  c.save_dir = plain_file(dir) + "/ckpts";
  c.log_path = dir + "/log.jsonl";
  expect_usage(c, {"--save-dir " + c.save_dir, "cannot write checkpoints"});
  EXPECT_FALSE(fs::exists(c.log_path)) << "the run started before the error";
}

// small() with one path flag set to value: a UsageError containing every one of parts.
void expect_bad_path(std::string train::Config::*flag, const std::string& value,
                     const std::vector<std::string>& parts) {
  train::Config c = small();
  c.*flag = value;
  expect_usage(c, parts);
}

TEST_F(TrainChecks, SaveDirThatIsAFile) {
  expect_bad_path(&train::Config::save_dir, plain_file(scratch("savefile")), {"--save-dir", "not a directory"});
}

TEST_F(TrainChecks, LogThatCannotBeWritten) {
  const std::string log = plain_file(scratch("log")) + "/log.jsonl";
  expect_bad_path(&train::Config::log_path, log, {"--log " + log});
}

TEST_F(TrainChecks, LogThatIsADirectory) {
  expect_bad_path(&train::Config::log_path, scratch("logdir"), {"--log", "is a directory"});
}

TEST_F(TrainChecks, PlotThatCannotBeWritten) {
  const std::string plot = plain_file(scratch("plot")) + "/loss.svg";
  expect_bad_path(&train::Config::plot_path, plot, {"--plot " + plot});
}

TEST_F(TrainChecks, ResumeDirectoryWithoutCheckpoints) {
  const std::string dir = scratch("noresume");
  expect_bad_path(&train::Config::resume, dir, {"--resume " + dir, "no step_*.ckpt"});
}

TEST_F(TrainChecks, SizesThatOverflowNameTheFlags) {
  train::Config c = small();
  c.batch = int64_t(1) << 40;
  c.tokens = int64_t(1) << 40;
  expect_usage(c, {"--batch × --frames × --tokens", "overflows"});
}

TEST_F(TrainChecks, DataSetLargerThanTheHostNamesTheFlags) {
  train::Config c = small();
  c.tokens = int64_t(1) << 36;  // 2^36 tokens × 4 frames × 2 videos × 4 batches × 16 channels: far beyond any host
  expect_usage(c, {"--pool × --batch × --frames × --tokens × --heads × --head-dim", "bytes of memory"});
}

// --- an interrupted run ------------------------------------------------------------------------

TEST_F(TrainChecks, CorruptNewestCheckpointFallsBackToTheNewestGoodOne) {
  const std::string dir = scratch("fallback");
  train::Config c = small();
  c.steps = 6;
  const train::Result full = run(c);

  train::Config first = c;
  first.steps = 4;
  first.save_dir = dir;
  first.save_every = 2;
  run(first);
  const std::string newest = dir + "/step_00000004.ckpt";
  if (world_rank() == 0) fs::resize_file(newest, fs::file_size(newest) - 9);  // a torn write
  MPI_Barrier(MPI_COMM_WORLD);

  train::Config second = c;
  second.resume = dir;
  const train::Result b = run(second);
  EXPECT_EQ(b.first_step, 3);
  EXPECT_EQ(fs::path(b.resumed_from).filename(), "step_00000002.ckpt");
  ASSERT_EQ(b.skipped_checkpoints.size(), 1u);
  EXPECT_NE(b.skipped_checkpoints[0].find("step_00000004.ckpt"), std::string::npos) << b.skipped_checkpoints[0];
  ASSERT_EQ(full.losses.size(), 6u);
  ASSERT_EQ(b.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(b.losses[i], full.losses[2 + i]) << "step " << i + 3;
  EXPECT_EQ(b.param_hash, full.param_hash);
}

TEST_F(TrainChecks, EveryCheckpointCorruptIsAnErrorNamingResume) {
  const std::string dir = scratch("allbad");
  if (world_rank() == 0) {
    std::ofstream(dir + "/step_00000002.ckpt") << "junk";
    std::ofstream(dir + "/step_00000001.ckpt") << "GDNCPCKP";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  train::Config c = small();
  c.resume = dir;
  expect_usage(c, {"--resume " + dir, "no usable checkpoint", "step_00000002.ckpt", "step_00000001.ckpt"});
}

TEST_F(TrainChecks, TemporaryFileOfAnInterruptedSaveIsRemoved) {
  const std::string dir = scratch("stale");
  const std::string tmp = dir + "/step_00000007.ckpt.tmp";
  if (world_rank() == 0) std::ofstream(tmp) << "half a checkpoint";
  MPI_Barrier(MPI_COMM_WORLD);
  train::Config c = small();
  c.steps = 2;
  c.save_dir = dir;
  run(c);
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_TRUE(fs::exists(dir + "/step_00000002.ckpt"));
}

TEST_F(TrainChecks, ResumedLogHoldsEveryStepOnce) {
  const std::string dir = scratch("logonce");
  train::Config c = small();
  c.save_dir = dir;
  c.save_every = 2;
  c.log_path = dir + "/log.jsonl";
  train::Config first = c;
  first.steps = 5;  // logs steps 1..5, the last checkpoint is step 4
  run(first);
  if (world_rank() == 0) fs::remove(dir + "/step_00000005.ckpt");  // killed before its final save
  MPI_Barrier(MPI_COMM_WORLD);
  c.steps = 7;
  c.resume = dir;  // from step 4: steps 5..7 run again or anew
  run(c);
  std::map<long long, int> seen;
  std::ifstream log(c.log_path);
  for (std::string line; std::getline(log, line);)
    if (line.find("\"loss\"") != std::string::npos) ++seen[std::stoll(line.substr(line.find("\"step\":") + 7))];
  EXPECT_EQ(seen.size(), 7u);
  for (const auto& [step, n] : seen) EXPECT_EQ(n, 1) << "step " << step << " is logged " << n << " times";
}

#else
TEST(TrainChecks, SkippedWithoutExamples) { GTEST_SKIP() << "built with GDNCP_BUILD_EXAMPLES=OFF"; }
#endif

}  // namespace

int main(int argc, char** argv) { return gdncp::test::train_test_main(argc, argv, "gdncp_train_checks"); }
