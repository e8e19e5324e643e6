// src/cp/communicator.cpp — what every Communicator shares: the deadline, the
// abort check and the padded record exchange of the validation policy.
#include <cmath>
#include <cstring>
#include <vector>

#include "gdncp/cp.h"
#include "gdncp/error.h"

namespace gdncp {
namespace cp {

const char* validation_name(Validation v) {
  switch (v) {
    case Validation::every_call:
      return "every_call";
    case Validation::on_change:
      return "on_change";
    case Validation::off:
      return "off";
  }
  return "?";
}

void Communicator::set_timeout_seconds(double s) {
  GDNCP_CHECK(std::isfinite(s) && s > 0, "set_timeout_seconds: timeout must be finite and > 0, got ", s);
  timeout_seconds_ = s;
}

void Communicator::check_usable(const char* what) const {
  if (!aborted()) return;
  GDNCP_FAIL(what, ": the ", backend(), " communicator (rank ", rank(), " of ", size(),
             ") was aborted: ", abort_reason());
}

// Padded to kRecordBytes: the exchanges of different entries have one size,
// so ranks in different entries see each other's records instead of a
// truncated message.
void Communicator::exchange_record(void* out, const void* in, size_t bytes) {
  GDNCP_CHECK(bytes <= kRecordBytes, "exchange_record: ", bytes, " bytes exceed kRecordBytes = ", kRecordBytes);
  std::vector<unsigned char> mine(kRecordBytes, 0), all(kRecordBytes * static_cast<size_t>(size()));
  std::memcpy(mine.data(), in, bytes);
  all_gather_host(all.data(), mine.data(), kRecordBytes);
  for (int r = 0; r < size(); ++r)
    std::memcpy(static_cast<unsigned char*>(out) + r * bytes, all.data() + r * kRecordBytes, bytes);
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.validations += 1;
}

}  // namespace cp
}  // namespace gdncp
