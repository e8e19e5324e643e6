// tests/mpi_test_train_watchdog.cpp — gdncp_train with a lost rank: 2 CPU
// ranks (CP = 2) with --timeout 5; once training runs, one rank is stopped
// (SIGSTOP). The other must print one error line naming the deadline within
// 10 s, and the job must exit non-zero within 15 s. The job is launched by a
// nested mpirun (with the outer launcher's environment removed), so this
// binary does not join MPI itself. Nothing is left behind: a process still
// alive at the end is continued and killed.
// gdncp-mpi-np: 1
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "util/mpi_main.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The pids of the processes named `name` whose parent is `parent`.
std::vector<pid_t> children_named(pid_t parent, const std::string& name) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string d = e.path().filename().string();
    if (d.empty() || d.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_file(e.path() / "stat");
    const size_t lp = stat.find('('), rp = stat.rfind(')');
    if (lp == std::string::npos || rp == std::string::npos) continue;
    const std::string comm = stat.substr(lp + 1, rp - lp - 1);
    std::istringstream rest(stat.substr(rp + 2));
    char state = 0;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent && name.compare(0, comm.size(), comm) == 0) out.push_back(static_cast<pid_t>(std::stol(d)));
  }
  return out;
}

std::string find_on_path(const std::string& exe) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::string d;
  while (std::getline(dirs, d, ':'))
    if (!d.empty() && access((d + "/" + exe).c_str(), X_OK) == 0) return d + "/" + exe;
  return "";
}

TEST(TrainWatchdog, StoppedRankEndsTheRunInTime) {
  const fs::path self = fs::read_symlink("/proc/self/exe");
  const fs::path train = self.parent_path().parent_path() / "examples" / "gdncp_train";
  if (!fs::exists(train)) GTEST_SKIP() << "gdncp_train not built (" << train << ")";
  const std::string mpirun = find_on_path("mpirun");
  if (mpirun.empty()) GTEST_SKIP() << "no mpirun on PATH";

  // The outer launcher's variables would make the nested mpirun join its job.
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const bool launcher = kv.rfind("OMPI_", 0) == 0 || kv.rfind("PMIX_", 0) == 0 || kv.rfind("OPAL_", 0) == 0 ||
                          kv.rfind("PRTE_", 0) == 0;
    // The machine's own launcher settings stay (e.g. a plm_rsh_agent for hosts without ssh).
    if (!launcher || kv.rfind("OMPI_ALLOW_RUN_AS_ROOT", 0) == 0 || kv.rfind("OMPI_MCA_plm_", 0) == 0) env.push_back(kv);
  }
  // A one-node launch needs no remote shell, but Open MPI's launcher insists on
  // finding one: where there is no ssh or rsh, point it at false.
  const bool has_agent = std::any_of(env.begin(), env.end(),
                                     [](const std::string& kv) { return kv.rfind("OMPI_MCA_plm_rsh_agent=", 0) == 0; });
  if (!has_agent && find_on_path("ssh").empty() && find_on_path("rsh").empty())
    env.push_back("OMPI_MCA_plm_rsh_agent=false");
  const fs::path log = fs::temp_directory_path() / ("gdncp_train_watchdog_" + std::to_string(getpid()) + ".log");
  std::vector<std::string> args = {mpirun,
                                   "-np",
                                   "2",
                                   "--oversubscribe",
                                   "--allow-run-as-root",
                                   "--bind-to",
                                   "none",
                                   train.string(),
                                   "--cp",
                                   "2",
                                   "--timeout",
                                   "5",
                                   "--steps",
                                   "1000000",
                                   "--log",
                                   "",
                                   "--frames",
                                   "4",
                                   "--tokens",
                                   "4",
                                   "--heads",
                                   "1",
                                   "--head-dim",
                                   "8",
                                   "--batch",
                                   "1",
                                   "--layers",
                                   "1",
                                   "--print-every",
                                   "1",
                                   "--check-every",
                                   "0"};
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    execve(mpirun.c_str(), argv.data(), envp.data());
    _exit(127);
  }

  // Training runs: rank 0 has printed a few steps; both ranks are there.
  std::vector<pid_t> ranks;
  const auto start = Clock::now();
  while (since(start) < 60) {
    ranks = children_named(launcher, "gdncp_train");
    const std::string out = read_file(log);
    if (ranks.size() == 2 && out.find("\nstep") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  int status = 0;
  bool exited = false;
  double raised_after = -1, exited_after = -1;
  if (ranks.size() == 2) {
    kill(ranks[1], SIGSTOP);
    const auto t0 = Clock::now();
    while (since(t0) < 25) {
      if (raised_after < 0 && read_file(log).find("did not complete within the deadline of 5 s") != std::string::npos)
        raised_after = since(t0);
      if (waitpid(launcher, &status, WNOHANG) == launcher) {
        exited = true;
        exited_after = since(t0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (raised_after < 0 && read_file(log).find("did not complete within the deadline of 5 s") != std::string::npos)
      raised_after = exited_after;
  }
  // Leave nothing behind.
  for (pid_t p : ranks) {
    kill(p, SIGCONT);
    kill(p, SIGKILL);
  }
  if (!exited) {
    kill(launcher, SIGKILL);
    waitpid(launcher, &status, 0);
  }
  const std::string out = read_file(log);
  fs::remove(log);
  ASSERT_EQ(ranks.size(), 2u) << "gdncp_train did not start:\n" << out;
  EXPECT_TRUE(exited) << "the job did not exit within 25 s of the stop:\n" << out;
  EXPECT_GE(raised_after, 0) << "no error line naming the deadline:\n" << out;
  EXPECT_LT(raised_after, 10.0) << out;
  EXPECT_LT(exited_after, 15.0) << out;
  EXPECT_TRUE(WIFEXITED(status) ? WEXITSTATUS(status) != 0 : true) << "the job must exit non-zero";
}

}  // namespace

int main(int argc, char** argv) { return gdncp::test::launcher_main(argc, argv); }
