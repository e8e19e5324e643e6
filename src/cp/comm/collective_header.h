// src/cp/comm/collective_header.h — the header every rank sends before the
// payload of a collective, and the one check every rank applies to the
// headers it receives (Note [collective header]).
//
// Note [collective header]: each rank sends every peer of a collective a
// fixed-size header (kind, payload size, sequence number on the
// communicator, root, the outcome of the rank's argument checks and their
// message). Every rank then checks every header it received the same way
// (header_verdict), so every rank reaches the same verdict: ranks in
// different collectives, with different sizes or roots, fail at once on
// every rank with a message naming both; a rank whose arguments are bad
// sends its error, which every rank raises. The backends carry it their way:
//   MPI: in front of each collective's payload, one message per peer
//        received at the size that arrives (comm_mpi.cpp, Note [MPI collectives]);
//   callbacks (CPU): an all-gather of the headers before each collective
//        (comm_callbacks.cpp);
//   NCCL: an all-gather of the headers at the start of each CP entry call,
//        enqueued like any collective; the host does not wait for it, the
//        watchdog checks it (comm_nccl.cpp, Note [NCCL call headers]).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gdncp {
namespace cp {
namespace detail {

struct CollectiveHeader {
  int64_t magic = 0;
  int64_t kind = 0;     // what the collective is (its name below)
  int64_t bytes = 0;    // payload size, or what else must agree
  int64_t seq = 0;      // collectives on the communicator before it
  int64_t root = 0;     // broadcast: the root (it must agree too)
  int64_t ok = 1;       // this rank's arguments passed its checks
  int64_t flags = 0;    // backend-specific, not compared (NCCL: the rank waits for the verdict)
  char name[48] = {0};  // the collective's name, for messages
  char msg[408] = {0};  // the argument error when !ok
};
static_assert(sizeof(CollectiveHeader) == 512, "the header is sent as 512 bytes");
constexpr int64_t kHeaderMagic = 0x67646e6370687232;  // "gdncphr2"

CollectiveHeader make_header(int64_t kind, const char* name, int64_t bytes, int64_t seq, const std::string& bad,
                             int64_t root = 0);

// The verdict of rank `rank` of `size` on the headers `got` of the ranks
// `from` (its own included or not; empty: got[r] is rank r's) in the
// collective it entered with `want`:
// "" when they agree, else the error. A bad argument wins (its own message on
// its rank, "<name>: bad argument on rank r of P: ..." elsewhere), then a
// missing header, a different root, then a different collective or size;
// hint_kind: a kind whose mismatch gets `hint` appended; size_word: what
// `bytes` counts, for messages.
std::string header_verdict(const std::vector<CollectiveHeader>& got, const std::vector<int>& from,
                           const CollectiveHeader& want, int rank, int size, const char* call, int64_t hint_kind = -1,
                           const char* hint = "", const char* size_word = "bytes");

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
