// gdncp/gdncp.h — everything a single-process trainer needs: tensors,
// autograd, the layer and its ops, the generic ops and the optimizer.
// Context parallelism (MPI/NCCL) is in gdncp/cp.h (and gdncp/cp_nccl.h).
#pragma once

#include "gdncp/autograd.h"
#include "gdncp/bigdn.h"
#include "gdncp/error.h"
#include "gdncp/graph.h"
#include "gdncp/nn.h"
#include "gdncp/ops.h"
#include "gdncp/optim.h"
#include "gdncp/tensor.h"
