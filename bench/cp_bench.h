// bench/cp_bench.h — the context-parallel benchmark of the bidirectional CP
// layer, callable from gdncp_bench --cp.
//
// Run under mpirun, one rank per GPU (-np 1 or 2 on a 2-GPU machine). Every
// rank times, in the same run: the single-GPU layer bigdn() over the global
// sequence (the baseline), bigdn_cp on one GPU (a one-rank NCCL group) and
// bigdn_cp on all P GPUs, for strong scaling (global_frames split over the
// ranks) and weak scaling (frames_per_rank each), with checkpointing off and
// on: forward+backward median (CUDA events, warm-up), device time inside the
// NCCL collectives, and peak device memory above the inputs. Validates first
// (bigdn_cp on P GPUs against bigdn on one GPU, bf16 tolerance).
#pragma once

#include <cstdint>
#include <string>

#include "gdncp/cp.h"

namespace gdncp {
namespace bench {

struct CpBenchConfig {
  int64_t batch = 1, tokens = 920, heads = 20, head_dim = 112;
  int64_t frames_per_rank = 11;  // weak scaling; <= 0: the largest share of global_frames over the ranks
  int64_t global_frames = 22;    // strong scaling: any count >= 1, balanced split over the ranks
  int warmup = 5, iters = 20;
  std::string json;  // write the results here (rank 0) when set
  // > 0: one GPU, no mpirun: each rank r of `emulate` ranks runs on stand-in
  // peers (bench/loopback_comm.h) beside the one-GPU rows (run_emulated).
  int emulate = 0;
  // >= 0 with emulate: run only this row, its timed steps between
  // cudaProfilerStart/Stop (for ncu --profile-from-start off), and print nothing else.
  int profile_row = -1;
  // The composites' exchange (gdncp/cp.h Exchange) and the ranks per node, for every CP row.
  cp::Exchange exchange = cp::Exchange::automatic;
  int node_size = 8;
  // Every CP row in the deterministic mode (gdncp/cp.h CpOptions::deterministic).
  bool deterministic = false;
  // Every CP row with the exchange hidden behind work (CpOptions::overlap_exchange).
  bool overlap = false;
  // With emulate: the modeled links (modeled_link.h): "none" (collectives cost a device
  // copy), "nvlink" (one NVLink domain) or "ib" (NVLink inside nodes of node_size ranks,
  // InfiniBand between them).
  std::string link = "none";
};

// Initialises MPI if the caller has not (and finalises it then). Returns a
// process exit code (0 = validated and timed).
//
// Ranks hold the balanced split of global_frames (gdncp::cp::balanced_split:
// 21 on 2 ranks = 11 + 10); the strong-scaling rows print each rank's time.
//
// With emulate = P (one process, one GPU): bigdn and bigdn_cp on one GPU over
// global_frames, bigdn_cp on one GPU over the largest rank's frames,
// and bigdn_cp as each rank r of P (its F_r frames) on stand-in peers — that rank's kernels, the
// collectives replaced by device copies — with checkpointing off and on. The
// rank rows are the compute of a P-GPU run; the real run adds the collectives'
// time and the ranks' skew, so what it prints are bounds, not the scaling itself.
// With a link other than "none" the collectives take their modeled time on a
// communication stream (loopback_comm.h), so the rank rows include the exchange
// of the chosen algorithm; above 8 ranks only ranks 0, 1, P/2 and P−1 are timed,
// and the one-GPU rows over the global frames only up to 256 frames (memory).
int run_cp_bench(const CpBenchConfig& config);

}  // namespace bench
}  // namespace gdncp
