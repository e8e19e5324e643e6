// bench/modeled_link.cu — the link presets and the stream delay of modeled_link.h.
#include "gdncp/error.h"
#include "modeled_link.h"

namespace gdncp {
namespace bench {
namespace {

__global__ void spin_ns(unsigned long long ns) {
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(200);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

}  // namespace

Link link_preset(const std::string& name) {
  Link l;
  l.name = name;
  if (name == "nvlink") {
    l.alpha_s = 8e-6;
    l.beta_Bps = 365e9;
  } else if (name == "ib") {
    l.alpha_s = 20e-6;
    l.beta_Bps = 45e9;
  } else {
    GDNCP_CHECK(name == "none", "--link: ", name, " is not a link preset (nvlink, ib, none)");
  }
  return l;
}

void link_delay(cudaStream_t stream, double seconds) {
  if (seconds <= 0) return;
  spin_ns<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(seconds * 1e9));
  GDNCP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace bench
}  // namespace gdncp
