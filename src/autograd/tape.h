// src/autograd/tape.h — the thread's tape, and scoped replacement of it (the
// checkpoint node recomputes on a tape of its own).
#pragma once

#include <memory>
#include <vector>

#include "gdncp/autograd.h"

namespace gdncp {
namespace autograd {

struct Tape {
  std::vector<std::shared_ptr<Node>> nodes;
};

Tape& current_tape();

// Makes `tape` the thread's current tape for the scope's lifetime.
class TapeScope {
 public:
  explicit TapeScope(Tape& tape);
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape* prev_;
};

}  // namespace autograd
}  // namespace gdncp
