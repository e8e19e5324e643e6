// gdncp/cp_nccl.h — the third bootstrap of a CP communicator: from the
// caller's own NCCL communicator and stream (for trainers that already run
// NCCL). Needs nccl.h and the CUDA runtime; only for CUDA builds of gdncp.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>

#include "gdncp/cp.h"

namespace gdncp {
namespace cp {

// Wraps comm (not owned: the caller destroys it after the communicator, and
// keeps the device current). Collectives run on `stream` (nullptr: the current
// stream), ordered after the current stream's work by an event and before any
// later work on it. A timeout calls ncclCommAbort on comm — the caller's comm
// is unusable after that, as after any NCCL error.
std::shared_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream);

}  // namespace cp
}  // namespace gdncp
