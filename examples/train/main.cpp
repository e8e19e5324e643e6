// examples/train/main.cpp — gdncp_train: MPI start-up, flags, and the error
// policy around train::train().
//
// Errors: a bad flag or checkpoint is detected identically on every rank
// (UsageError): rank 0 prints it and every rank exits with status 2 (flags)
// or 1 (checkpoint). Any other error may hit one rank only, while the others
// wait in a collective: that rank prints it and aborts the job (MPI_Abort,
// non-zero status) rather than leave the others hanging. A lost or hung rank:
// every collective has the deadline of --timeout, so the others raise there
// and abort the job (MPI_Finalize would wait for the lost rank).
#include <mpi.h>

#include <cstdio>
#include <exception>
#include <string>

#include "trainer.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  train::Config cfg;
  int status = 0;
  try {
    if (!train::parse_args(argc, argv, cfg)) {
      if (rank == 0) std::printf("%s", train::usage().c_str());
      MPI_Finalize();
      return 0;
    }
  } catch (const train::UsageError& e) {
    if (rank == 0) std::fprintf(stderr, "gdncp_train: %s\n", e.what());
    MPI_Finalize();
    return 2;
  }
  try {
    const train::Result r = train::train(cfg, MPI_COMM_WORLD);
    if (rank == 0 && cfg.print_every > 0 && !r.losses.empty()) {
      std::printf("done: %zu steps in %.1f s, loss %.6f -> %.6f\n", r.losses.size(), r.seconds, r.losses.front(),
                  r.losses.back());
      if (!cfg.log_path.empty()) std::printf("log:  %s\n", cfg.log_path.c_str());
      const std::string plot = train::default_plot_path(cfg);
      if (!plot.empty()) std::printf("plot: %s\n", plot.c_str());
    }
  } catch (const train::UsageError& e) {
    if (rank == 0) std::fprintf(stderr, "gdncp_train: error: %s\n", e.what());
    status = 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gdncp_train: rank %d: error: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return status;
}
