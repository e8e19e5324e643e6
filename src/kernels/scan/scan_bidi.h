// src/kernels/scan/scan_bidi.h — the single-rank bidirectional scan (kernels.h, scan_bidi_fwd /
// scan_bidi_bwd: same arguments, same results) composed of the sweeps and transition gradients of
// the scan core (src/kernels/cp_kernels.h, Note [scan step]) through the cp::kern dispatchers: it runs
// on the device of its tensors. Both twins of scan_bidi are this composition (the CUDA one on
// the 3xTF32 sweeps of src/kernels/scan/scan_sweep.cu, its forward and anti-causal sweeps as pairs
// that write Msum, dA and their z twins). Shapes are the caller's to check.
#pragma once

#include "gdncp/tensor.h"
#include "kernels/kernels.h"

namespace gdncp {
namespace scan_core {

void scan_bidi_fwd(Tensor& Mf, Tensor& Mr, Tensor& Msum, Tensor& zf, Tensor& zr, Tensor& zsum, const Tensor& P,
                   const Tensor& A, const Tensor& Pz, const Tensor& bz, const Tensor& decay, const Tensor& clip_starts,
                   const Dims& d);

void scan_bidi_bwd(Tensor& dP, Tensor& dA, Tensor& dPz, Tensor& dbz, Tensor& ddecay, const Tensor& dMsum,
                   const Tensor& dzsum, const Tensor& P, const Tensor& Pz, const Tensor& decay, const Tensor& Mf,
                   const Tensor& Mr, const Tensor& zf, const Tensor& zr, const Tensor& clip_starts, const Dims& d);

}  // namespace scan_core
}  // namespace gdncp
