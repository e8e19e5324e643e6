// bench/modeled_link.h — modeled links for gdncp_bench --cp --emulate P: each
// collective of a rank on stand-in peers (loopback_comm.h) occupies a
// communication stream for α + bytes/β of the link it crosses, so one GPU
// measures a rank's time including the exchange (and whatever overlaps it).
//
// Presets (per GPU, one direction), from published NCCL measurements:
//   nvlink — H100/H200 SXM, NVLink 4 through NVSwitch, 8 GPUs a node: nccl-tests
//            all_gather_perf / sendrecv_perf bus bandwidth at large messages about
//            360–370 GB/s (all_reduce 460–480 GB/s with NVLS; NVIDIA's DGX H100 NCCL
//            figures and the nccl-tests reference tables, e.g. docs.alayanew.com
//            "NCCL-tests in practice", 2026), small-message latency about 8 µs per
//            operation (nccl-tests -b 8 rows on one node);
//   ib     — one 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100/H200 SuperPOD):
//            nccl-tests multi-node bus bandwidth about 45 GB/s per GPU (88 % of the
//            50 GB/s line rate with GPUDirect RDMA), latency about 20 µs per
//            inter-node operation (nccl-tests -b 8 rows across two nodes).
// A collective of P ranks is one round: all-gather α + (P−1)·m/β (m the bytes per
// rank; β of the slowest link the group spans), send/recv α + max(sent, received)/β
// of the link between the two ranks, broadcast and all-reduce ⌈log₂P⌉·α + 2·bytes/β.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace gdncp {
namespace bench {

struct Link {
  std::string name = "none";
  double alpha_s = 0;   // latency per operation, seconds
  double beta_Bps = 0;  // bandwidth, bytes per second (0: no model)
};

// "nvlink", "ib" or "none"; anything else throws gdncp::Error naming --link.
Link link_preset(const std::string& name);

// Links of an emulated group: NVLink inside nodes of `node` ranks, `inter` between them.
struct LinkModel {
  Link intra, inter;
  int node = 8;
  bool on() const { return intra.beta_Bps > 0; }
};

// Occupies `stream` for `seconds` (one device thread spinning on the global timer).
void link_delay(cudaStream_t stream, double seconds);

}  // namespace bench
}  // namespace gdncp
