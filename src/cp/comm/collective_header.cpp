// src/cp/comm/collective_header.cpp — Note [collective header] (collective_header.h).
#include "cp/comm/collective_header.h"

#include <cstring>

namespace gdncp {
namespace cp {
namespace detail {
namespace {

std::string text(const char* s, size_t cap) { return std::string(s, strnlen(s, cap)); }
std::string name_of(const CollectiveHeader& h) { return text(h.name, sizeof h.name); }

}  // namespace

CollectiveHeader make_header(int64_t kind, const char* name, int64_t bytes, int64_t seq, const std::string& bad,
                             int64_t root) {
  CollectiveHeader h;
  h.magic = kHeaderMagic;
  h.kind = kind;
  h.bytes = bytes;
  h.seq = seq;
  h.root = root;
  h.ok = bad.empty();
  std::strncpy(h.name, name, sizeof(h.name) - 1);
  std::strncpy(h.msg, bad.c_str(), sizeof(h.msg) - 1);
  return h;
}

std::string header_verdict(const std::vector<CollectiveHeader>& got, const std::vector<int>& from,
                           const CollectiveHeader& want, int rank, int size, const char* call, int64_t hint_kind,
                           const char* hint, const char* size_word) {
  auto at = [&](const CollectiveHeader& h) {
    return name_of(h) + " (" + std::to_string(h.bytes) + " " + size_word + ", collective #" + std::to_string(h.seq) +
           ")";
  };
  const auto rank_of = [&](size_t i) { return from.empty() ? static_cast<int>(i) : from[i]; };
  const std::string here = at(want);
  for (size_t i = 0; i < got.size(); ++i) {
    const CollectiveHeader& h = got[i];
    if (h.magic != kHeaderMagic || h.ok) continue;
    const std::string msg = text(h.msg, sizeof h.msg);
    if (rank_of(i) == rank) return msg;
    return name_of(h) + ": bad argument on rank " + std::to_string(rank_of(i)) + " of " + std::to_string(size) + ": " +
           msg;
  }
  if (!want.ok) return text(want.msg, sizeof want.msg);
  for (size_t i = 0; i < got.size(); ++i) {
    const CollectiveHeader& h = got[i];
    const std::string r = std::to_string(rank_of(i));
    if (h.magic != kHeaderMagic)
      return std::string(call) + ": the ranks are out of step: rank " + r + " sent no gdncp header where rank " +
             std::to_string(rank) + " is in " + here;
    if (h.kind == want.kind && h.bytes == want.bytes && h.seq == want.seq && h.root == want.root) continue;
    if (h.kind == want.kind && h.bytes == want.bytes && h.seq == want.seq)
      return std::string(call) + ": the ranks disagree on the root of " + name_of(want) + ": rank " + r +
             " names rank " + std::to_string(h.root) + ", rank " + std::to_string(rank) + " names rank " +
             std::to_string(want.root);
    std::string why = std::string(call) + ": the ranks are out of step: rank " + r + " is in " + at(h) +
                      " while rank " + std::to_string(rank) + " is in " + here;
    if (h.kind == want.kind && h.seq == want.seq)
      why += " (the sizes of a call must agree on every rank)";
    else if (h.kind == hint_kind || want.kind == hint_kind)
      why += hint;
    return why;
  }
  return std::string();
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
