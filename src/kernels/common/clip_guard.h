// src/kernels/common/clip_guard.h — the values of a clip mask checked where the
// kernels read it (Note [clip mask values]).
//
// Note [clip mask values]. A clip mask holds 0 or 1 (docs/design.md §4a, §9);
// the sweeps read it as "≠ 0", so any other value (0.5, 2, −1, NaN) would be
// taken as a clip start without a word. A host mask is checked before any work
// (validate_clip_values). A device mask is not read by the host, which would
// then wait for the device on every call (§10); instead every batch of kernels
// that reads a mask (cp::kern::scan_sweep(s), scan_grad_outer(s): every entry
// that takes a mask runs its scan through them) is followed by one
// single-block launch, guard_clip_mask, that checks the mask on the device.
// On a value other than 0 or 1 it
//   1. fills that batch's outputs with NaN: the states, the transition and
//      decay gradients, and in CP the composites this rank sends, so every
//      number that depends on the mask — on every rank — is NaN, never a
//      silently wrong one;
//   2. writes the first bad value and its place into the clip fault record,
//      host memory that the device writes and the host reads without waiting.
// report_clip_fault(entry), at the start of every entry that takes a mask
// (given or not), raises the recorded fault once as gdncp::Error naming
// clip_starts. In the CP entries it runs inside the local validation, so the
// error travels with the validation record and every rank raises at once.
// The fault is reported by the first such call that starts after the guard
// ran on the device (a host copy of a result, or synchronize(), orders them).
// The CPU twin does the same on host tensors; the host check in front of it
// leaves it nothing to find in the public entries.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gdncp/tensor.h"

namespace gdncp {
namespace kernels {

// The clip fault record: written by one thread of a guard that found a bad
// value (fields first, then seq + 1, with a system-wide fence between), read
// by report_clip_fault. Lives for the process.
struct ClipFault {
  int64_t index = 0;  // flat index into the (B, F) mask of the first bad value
  int64_t cols = 1;   // F
  float value = 0;
  uint32_t seq = 0;  // faults written so far
};

// The record, allocated on first use (host-mapped memory in CUDA builds). Never null.
ClipFault* clip_fault_record();

// Checks that every value of the clip mask (B, F) f32 is 0 or 1; on any other
// value fills every tensor of `outputs` with NaN and writes the clip fault
// record. No host wait: the CUDA twin is one launch on the current stream.
// Undefined mask or outputs: nothing.
void guard_clip_mask(const Tensor& mask, const std::vector<Tensor>& outputs);
namespace cpu {
void guard_clip_mask(const Tensor& mask, const std::vector<Tensor>& outputs);
}
namespace cuda {
void guard_clip_mask(const Tensor& mask, const std::vector<Tensor>& outputs);
}

// Raises a clip fault recorded since the last report (once), as gdncp::Error
// "<entry>: clip_starts: must hold 0 or 1 ...".
void report_clip_fault(const char* entry);

// The message of a bad clip value v at (b, f) of an entry's mask; `where`
// says how it was found.
std::string clip_value_message(const char* entry, float v, int64_t b, int64_t f, const char* where);

}  // namespace kernels
}  // namespace gdncp
