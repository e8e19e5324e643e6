// examples/train/checkpoint.h — gdncp_train's checkpoint file.
//
// One self-describing binary file per save (little-endian, as written by the
// host): magic "GDNCPCKP", version, the run's identity as key=value strings
// (model shape, data and rank layout), step, RNG state, optimizer step count,
// named tensors (parameters, AdamW moments; f32), the loss history, and an
// FNV-1a checksum of everything before it. Written to <path>.tmp, flushed and
// renamed over <path>, so a crash never leaves a half-written checkpoint under
// the real name.
#pragma once

#include <gdncp/tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace train {

struct Checkpoint {
  std::vector<std::pair<std::string, std::string>> identity;  // must match on resume
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
// A checkpoint file, or a directory holding step_*.ckpt files (the latest is
// taken). Returns "" when none is found (reason in *why).
std::string resolve_checkpoint(const std::string& path, std::string* why);
// <dir>/step_<step, 8 digits>.ckpt
std::string checkpoint_path(const std::string& dir, int64_t step);

}  // namespace train
