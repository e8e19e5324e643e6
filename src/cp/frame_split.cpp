// src/cp/frame_split.cpp — balanced_split (gdncp/cp.h): the even split of a
// sequence's frames over the CP group.
#include <algorithm>

#include "gdncp/cp.h"
#include "gdncp/error.h"

namespace gdncp {
namespace cp {

FrameSplit balanced_split(int64_t F_total, int P, int r) {
  GDNCP_CHECK(F_total >= 0, "balanced_split: F_total: must be >= 0, got ", F_total);
  GDNCP_CHECK(P >= 1, "balanced_split: P: must be >= 1, got ", P);
  GDNCP_CHECK(r >= 0 && r < P, "balanced_split: r: must be in [0, ", P, "), got ", r);
  const int64_t base = F_total / P, extra = F_total % P;
  FrameSplit s;
  s.frames = base + (r < extra ? 1 : 0);
  s.offset = base * r + std::min<int64_t>(r, extra);
  return s;
}

}  // namespace cp
}  // namespace gdncp
