// examples/train/trainer.h — gdncp_train's training loop, reusable in-process
// (the program's main() and tests/mpi_test_train.cpp both drive it).
//
// The model (per layer l, latents x (B, N, C), N = frames·tokens, C = H·D):
//   qkv   = x · W_qkv                              (B, N, 3, H, D)
//   beta  = sigmoid(x · w_β)                       per head and token (B, H, F, S)
//   decay = sigmoid(per-frame mean of x · w_g)     per head and frame (B, H, F)
//   out   = BiGDN(qkv, beta, decay, q_norm_w, k_norm_w)   (CP over the frames)
//           with --clips, each video is several clips packed back to back: no
//           state crosses a clip start, and RoPE positions restart at each clip
//   x     ← x + out · W_o
// Loss: mean squared error against a fixed-seed teacher of the same
// architecture on the same inputs.
//
// Ranks: world = DP × CP. Consecutive ranks form a CP group (frames split
// inside it as evenly as it goes, gdncp::cp::balanced_split); the groups are
// the data-parallel replicas (different videos).
// Gradients are summed over the world and divided by DP (= summed over CP,
// averaged over DP); every rank ends a step with bitwise-identical parameters,
// which is checked every check_every steps with an all-gathered hash.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace train {

struct Config {
  int64_t steps = 60;  // total steps of the run (a resumed run continues to this step)
  int64_t layers = 2;
  int64_t heads = 2;      // H
  int64_t head_dim = 16;  // D (even, 2..128)
  int64_t frames = 4;     // frames per video, global (any count >= 1, split over the CP group)
  int64_t tokens = 16;    // tokens per frame, S
  int64_t batch = 4;      // videos per step per data-parallel group
  int64_t pool = 8;       // distinct batches per data-parallel group (the data set)
  // Lengths of the clips packed back to back in each video, summing to frames; empty = one clip.
  std::vector<int64_t> clips;
  double lr = 2e-2;
  int64_t warmup = 5;  // linear learning-rate warm-up steps
  double weight_decay = 0.01;
  std::string device = "cpu";                    // cpu | cuda
  std::string dtype = "f32";                     // f32 | bf16 (parameters and optimizer stay f32)
  std::string checkpointing = "auto";            // on | off | auto (the layer's activation checkpointing)
  uint64_t seed = 1;                             // student init and data; the teacher's seed is fixed
  int64_t cp = 1;                                // context-parallel group size; DP = world / cp
  std::string log_path = "out/train/log.jsonl";  // JSON lines; "" = none
  std::string plot_path;                         // SVG loss curve; default <log dir>/loss.svg; "" with no log = none
  std::string save_dir;                          // checkpoints go here; "" = none
  int64_t save_every = 0;                        // 0 = only at the end (when save_dir is set)
  std::string resume;                            // a checkpoint file, or a directory (its latest checkpoint)
  int64_t check_every = 10;                      // parameter-identity check period (and at the end)
  int64_t print_every = 1;                       // progress line period on rank 0; 0 = silent
  double timeout = 300;                          // seconds: the deadline of every collective
  // The layer's deterministic mode (docs/design.md §12): the same losses and
  // parameters bitwise for every --cp (Note [layout] in trainer.cpp).
  bool deterministic = false;
  // The CP layer's all-gather exchange on a communication stream (gdncp/cp.h
  // CpOptions::overlap_exchange): bitwise the same results; nothing changes on the CPU.
  bool overlap_exchange = false;
};

// A bad flag or a bad checkpoint: raised identically on every rank (so the
// program can exit cleanly everywhere, rank 0 printing the message).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string usage();
// Where the loss plot goes: --plot, else loss.svg beside --log when the log
// is (or will be) a regular file, else nowhere ("").
std::string default_plot_path(const Config& cfg);
// Fills cfg from the command line. Returns false when --help was given.
// Throws UsageError naming the flag.
bool parse_args(int argc, char** argv, Config& cfg);

struct Result {
  int64_t first_step = 1;      // global step of losses[0] (> 1 after --resume)
  std::vector<double> losses;  // global loss of every step run here
  uint64_t param_hash = 0;     // hash of the final parameters (identical on every rank)
  double seconds = 0;          // wall time of the training steps
  int dp = 1, cp = 1;
  std::string resumed_from;                      // the checkpoint --resume loaded ("" without --resume)
  int resumed_dp = 0, resumed_cp = 0;            // the layout it was written with (0: not recorded)
  std::vector<std::string> skipped_checkpoints;  // newer ones it could not read, each with the reason
};

// Runs the training on the ranks of world (collective over world).
// Throws UsageError (same on every rank) for a config or checkpoint that does
// not fit, gdncp::Error for library errors.
Result train(const Config& cfg, MPI_Comm world);

}  // namespace train
