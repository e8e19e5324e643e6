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
// later work on it. Collective over the ranks of comm: it splits a second
// NCCL communicator off comm (ncclCommSplit) for the validation exchange.
// The communicator's watchdog thread calls ncclCommAbort on comm when a
// collective misses its deadline or NCCL reports an asynchronous error — the
// caller's comm is unusable after that, as after any NCCL error.
std::shared_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream);

// The ncclComm_t of an NCCL communicator (throws for an MPI one). It stays
// owned by c.
ncclComm_t nccl_comm(const Communicator& c);

}  // namespace cp
}  // namespace gdncp
