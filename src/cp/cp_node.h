// src/cp/cp_node.h — what every CP autograd node holds: a share of the
// communicator's ownership, this rank's first global frame and every rank's F.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "gdncp/autograd.h"
#include "gdncp/cp.h"

namespace gdncp {
namespace cp {
namespace detail {

class CpNode : public autograd::Node {
 protected:
  CpNode(std::shared_ptr<Communicator> comm, int64_t offset, std::vector<int64_t> frames)
      : owner_(std::move(comm)), comm_(*owner_), offset_(offset), frames_(std::move(frames)) {}

  std::shared_ptr<Communicator> owner_;  // shares the communicator's ownership: it outlives this node
  Communicator& comm_;
  int64_t offset_;               // this rank's first global frame
  std::vector<int64_t> frames_;  // the deterministic mode: every rank's F (ScanContext::frames)
};

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
