// src/cp/scan/kv_z_scan.cpp — the KV and Z scans of one CP call (kv_z_scan.h).
#include "cp/scan/kv_z_scan.h"

#include "kernels/cp_kernels.h"

namespace gdncp {
namespace cp {
namespace detail {

std::vector<ScanJob> kv_z_jobs(const Tensor& P, const Tensor& A, const Tensor& Pz, const Tensor& bz, int64_t D,
                               int64_t F, bool bidi, const CpOptions& o, int64_t offset) {
  std::vector<ScanJob> jobs;
  auto add = [&](const Tensor& p, const Tensor& u, int64_t E, bool anti) {
    ScanJob j;
    j.P = p;
    j.U = u;
    j.E = E;
    j.anti = anti;
    j.rank_reverse = !anti && o.reverse_rank_order;
    j.terminal = !anti && o.truncate_to_active > 0;
    j.active = anti ? F : active_frames(o.truncate_to_active, offset, F);
    jobs.push_back(j);
  };
  add(P, A, D, false);
  add(Pz, bz, 1, false);
  if (bidi) {
    add(P, A, D, true);
    add(Pz, bz, 1, true);
  }
  return jobs;
}

std::pair<Tensor, Tensor> kv_z_states(const std::vector<ScanJob>& jobs, bool bidi) {
  if (!bidi) return {jobs[0].Y, jobs[1].Y};
  Tensor M = Tensor::empty(jobs[0].Y.shape(), jobs[0].Y.dtype(), jobs[0].Y.device());
  Tensor z = Tensor::empty(jobs[1].Y.shape(), jobs[1].Y.dtype(), jobs[1].Y.device());
  kern::add(M, jobs[0].Y, jobs[2].Y);
  kern::add(z, jobs[1].Y, jobs[3].Y);
  return {M, z};
}

KvZGrads kv_z_backward(ScanContext& ctx, std::vector<ScanJob>& jobs, bool bidi, const Tensor& dM, const Tensor& dz,
                       const Tensor& dT_M, const Tensor& dT_z) {
  const Tensor& P = jobs[0].P;
  KvZGrads g;
  g.dP = Tensor::empty(P.shape(), P.dtype(), P.device());
  g.dPz = Tensor::empty(jobs[1].P.shape(), P.dtype(), P.device());
  g.dg = Tensor::zeros({ctx.BH, ctx.F}, P.dtype(), P.device());
  jobs[0].dY = dM;
  jobs[1].dY = dz;
  jobs[0].dP = g.dP;
  jobs[1].dP = g.dPz;
  jobs[0].dT = dT_M;
  jobs[1].dT = dT_z;
  if (bidi) {  // both directions write the same dP: the anti-causal jobs accumulate
    jobs[2].dY = dM;
    jobs[3].dY = dz;
    jobs[2].dP = g.dP;
    jobs[3].dP = g.dPz;
    jobs[2].dP_accumulate = jobs[3].dP_accumulate = true;
  }
  scan_backward(ctx, jobs, g.dg);
  g.dA = jobs[0].dU;
  g.dbz = jobs[1].dU;
  if (bidi) {
    kern::add(g.dA, g.dA, jobs[2].dU);
    kern::add(g.dbz, g.dbz, jobs[3].dU);
  }
  return g;
}

}  // namespace detail
}  // namespace cp
}  // namespace gdncp
