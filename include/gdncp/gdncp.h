// gdncp/gdncp.h — everything a trainer needs: tensors, autograd, the layer.
#pragma once

#include "gdncp/autograd.h"
#include "gdncp/bigdn.h"
#include "gdncp/error.h"
#include "gdncp/ops.h"
#include "gdncp/tensor.h"
