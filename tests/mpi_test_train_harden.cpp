// tests/mpi_test_train_harden.cpp — gdncp_train's writes and flags, in-process
// on 2 CPU ranks:
//   - a log whose writes fail (a full disk: /dev/full) is an error naming the
//     file, not a run that ends well with its log lost;
//   - the default plot goes beside the log only when the log is a regular file;
//   - --save-every without --save-dir is a usage error on every rank;
//   - the log's start event gives the clips and the frames of each CP rank.
// gdncp-mpi-np: 2
#include <gtest/gtest.h>
#include <mpi.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "mpi_train_fixtures.h"

namespace {

namespace fs = std::filesystem;

using gdncp::test::world_rank;

#if GDNCP_HAVE_TRAINER

std::string scratch(const std::string& name) { return gdncp::test::empty_scratch_dir("gdncp_train_harden", name); }

train::Config small() {
  train::Config c = gdncp::test::small_cp2_config();
  c.steps = 2;
  return c;
}

class TrainHarden : public gdncp::test::AllRanksTest {};

// One rank alone (MPI_COMM_SELF): the log's writes fail, and train() says so naming the file.
TEST_F(TrainHarden, FullDiskLogIsAnErrorNamingTheFile) {
  if (world_rank() == 0) {
    train::Config c = small();
    c.cp = 1;
    c.log_path = "/dev/full";
    try {
      train::train(c, MPI_COMM_SELF);
      ADD_FAILURE() << "a log written to /dev/full was reported as written";
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("--log /dev/full"), std::string::npos) << msg;
      EXPECT_NE(msg.find("No space left"), std::string::npos) << msg;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_F(TrainHarden, DefaultPlotOnlyBesideARegularLog) {
  train::Config c = small();
  c.log_path = "/dev/full";
  EXPECT_EQ(train::default_plot_path(c), "") << "no plot beside a device";
  c.log_path = "/dev/stdout";
  EXPECT_EQ(train::default_plot_path(c), "");
  const std::string dir = scratch("plot");
  c.log_path = dir + "/log.jsonl";  // not there yet: it will be a regular file
  EXPECT_EQ(train::default_plot_path(c), dir + "/loss.svg");
  c.plot_path = dir + "/elsewhere.svg";
  EXPECT_EQ(train::default_plot_path(c), c.plot_path);
}

TEST_F(TrainHarden, SaveEveryWithoutSaveDirIsAUsageError) {
  train::Config c = small();
  c.save_every = 2;
  try {
    train::train(c, MPI_COMM_WORLD);
    ADD_FAILURE() << "rank " << world_rank() << ": --save-every without --save-dir was ignored";
  } catch (const train::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--save-every 2: needs --save-dir"), std::string::npos) << e.what();
  }
}

TEST_F(TrainHarden, StartEventGivesClipsAndLayout) {
  const std::string dir = scratch("start");
  train::Config c = small();
  c.frames = 5;
  c.clips = {2, 3};
  c.log_path = dir + "/log.jsonl";
  train::train(c, MPI_COMM_WORLD);
  if (world_rank() == 0) {
    std::ifstream f(c.log_path);
    std::string first;
    std::getline(f, first);
    EXPECT_NE(first.find("\"event\":\"start\""), std::string::npos) << first;
    EXPECT_NE(first.find("\"clips\":[2,3]"), std::string::npos) << first;
    EXPECT_NE(first.find("\"frames_per_cp_rank\":[3,2]"), std::string::npos) << first;
    EXPECT_TRUE(fs::exists(dir + "/loss.svg")) << "the plot beside the log";
  }
}

#else
TEST(TrainHarden, SkippedWithoutExamples) { GTEST_SKIP() << "built with GDNCP_BUILD_EXAMPLES=OFF"; }
#endif

}  // namespace

int main(int argc, char** argv) { return gdncp::test::train_test_main(argc, argv, "gdncp_train_harden"); }
