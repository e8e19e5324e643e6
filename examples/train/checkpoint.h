// examples/train/checkpoint.h — gdncp_train's checkpoint file.
//
// One self-describing binary file per save (little-endian, as written by the
// host): magic "GDNCPCKP", version, the run's identity as key=value strings
// (model shape, data and rank layout), step, RNG state, optimizer step count,
// named tensors (parameters, AdamW moments; f32), the loss history, and an
// FNV-1a checksum of everything before it. Written to <path>.tmp, flushed and
// renamed over <path>, so a crash never leaves a half-written checkpoint under
// the real name (a crash may leave <path>.tmp: remove_stale_temps() clears it).
//
// save_checkpoint / load_checkpoint move the trainer's state (parameters,
// AdamW moments and step count, RNG, loss history) to and from such a file,
// collectively over the ranks (rank 0 does the file I/O).
#pragma once

#include <gdncp/optim.h>
#include <gdncp/tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace train {

struct Config;
class Dist;
struct Model;

struct Checkpoint {
  std::vector<std::pair<std::string, std::string>> identity;  // run_identity (must match) + run_layout
  int64_t step = 0;                                           // steps completed
  uint64_t rng_state = 0;
  int64_t optimizer_steps = 0;
  std::vector<std::pair<std::string, gdncp::Tensor>> tensors;  // host tensors
  std::vector<double> losses;                                  // loss of steps 1..step
};

std::vector<char> serialize(const Checkpoint& ck);
// Throws UsageError("<what>: ...") for a truncated, corrupt or foreign file.
Checkpoint deserialize(const std::vector<char>& bytes, const std::string& what);

// Writes bytes to path atomically (temp file + fsync + rename). Returns "" on
// success, else the reason.
std::string write_atomic(const std::string& path, const std::vector<char>& bytes);
// Reads a whole file. Returns "" on success, else the reason.
std::string read_file(const std::string& path, std::vector<char>& bytes);
// A checkpoint file, or the step_*.ckpt files of a directory, newest first.
// Empty when there is none (reason in *why).
std::vector<std::string> checkpoint_candidates(const std::string& path, std::string* why);
// <dir>/step_<step, 8 digits>.ckpt
std::string checkpoint_path(const std::string& dir, int64_t step);
// Deletes the <dir>/step_*.ckpt.tmp files an interrupted save left; returns their paths.
std::vector<std::string> remove_stale_temps(const std::string& dir);

// The run facts a checkpoint must match to be resumed (model shape, data).
std::vector<std::pair<std::string, std::string>> run_identity(const Config& c);
// The rank layout ("cp", "dp"): recorded in the checkpoint, free to change on
// resume (Note [layout] in trainer.cpp).
std::vector<std::pair<std::string, std::string>> run_layout(const Dist& d);

// What a checkpoint holds of a run, by pointer into the trainer's objects.
struct TrainState {
  Model* student;
  gdncp::optim::AdamW* opt;
  uint64_t* rng;
  std::vector<double>* history;  // losses of steps 1..step
};

// Rank 0 writes the state after `step` to path; throws UsageError on every rank if it fails.
void save_checkpoint(const Config& c, const Dist& dist, const TrainState& st, int64_t step, const std::string& path);

struct Resumed {
  int64_t step = 0;                                         // steps the checkpoint completed
  std::string path;                                         // the checkpoint loaded
  std::vector<std::string> skipped;                         // newer checkpoints that could not be read, with the reason
  std::vector<std::pair<std::string, std::string>> layout;  // the layout it was written with (run_layout's keys)
};
// Loads --resume into the state (the same on every rank). A directory's newest
// checkpoint that is truncated or corrupt is skipped for the next newest (each
// skip is reported in Resumed::skipped); one that belongs to another run is an
// error. Throws UsageError naming --resume when nothing usable is found.
Resumed load_checkpoint(const Config& c, const Dist& dist, const TrainState& st);

}  // namespace train
