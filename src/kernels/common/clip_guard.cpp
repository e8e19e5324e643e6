// src/kernels/common/clip_guard.cpp — the clip fault record, its report, the
// CPU twin of guard_clip_mask and its dispatcher (Note [clip mask values] in
// clip_guard.h).
#include "kernels/common/clip_guard.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <sstream>

#include "gdncp/error.h"

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace gdncp {
namespace kernels {
namespace {

std::atomic<ClipFault*> g_record{nullptr};
std::atomic<uint32_t> g_reported{0};  // the record's seq when it was last reported

ClipFault* allocate_record() {
#if GDNCP_WITH_CUDA
  if (cuda_available()) {
    // Mapped (the device writes it through unified addressing) and portable
    // (every device of the process). Relaxed capture mode: the first guard may
    // run while a CUDA graph is captured.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    GDNCP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, sizeof(ClipFault), cudaHostAllocMapped | cudaHostAllocPortable);
    GDNCP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    GDNCP_CUDA_CHECK(e);
    return new (p) ClipFault();
  }
#endif
  return new ClipFault();
}

}  // namespace

ClipFault* clip_fault_record() {
  static std::once_flag once;
  std::call_once(once, [] { g_record.store(allocate_record(), std::memory_order_release); });
  return g_record.load(std::memory_order_acquire);
}

std::string clip_value_message(const char* entry, float v, int64_t b, int64_t f, const char* where) {
  std::ostringstream os;
  os << entry << ": clip_starts: must hold 0 or 1 (1 where a frame begins a clip), got " << v << " at (" << b << ", "
     << f << ")" << where;
  return os.str();
}

void report_clip_fault(const char* entry) {
  const volatile ClipFault* r = g_record.load(std::memory_order_acquire);
  if (r == nullptr) return;  // no guard has run
  uint32_t seen = g_reported.load();
  uint32_t seq = r->seq;
  if (seq == seen) return;
  // The device writes the fields before seq; read them until seq holds still.
  int64_t index = 0, cols = 1;
  float value = 0;
  for (;;) {
    std::atomic_thread_fence(std::memory_order_acquire);
    index = r->index;
    cols = r->cols > 0 ? r->cols : 1;
    value = r->value;
    std::atomic_thread_fence(std::memory_order_acquire);
    const uint32_t again = r->seq;
    if (again == seq) break;
    seq = again;
  }
  if (!g_reported.compare_exchange_strong(seen, seq)) return;  // another thread reports it
  GDNCP_FAIL(clip_value_message(entry, value, index / cols, index % cols,
                                " in a CUDA mask given to an earlier call (checked on the device: that call's outputs "
                                "and gradients are NaN)"));
}

void guard_clip_mask(const Tensor& mask, const std::vector<Tensor>& outputs) {
  if (!mask.defined()) return;
  GDNCP_CHECK(mask.dtype() == DType::f32 && mask.dim() == 2, "guard_clip_mask: the mask must be (B, F) f32, got ",
              mask.str());
#if GDNCP_WITH_CUDA
  if (mask.is_cuda()) return cuda::guard_clip_mask(mask, outputs);
#endif
  GDNCP_CHECK(!mask.is_cuda(), "guard_clip_mask: got a CUDA mask, but gdncp was built without CUDA");
  cpu::guard_clip_mask(mask, outputs);
}

namespace cpu {

void guard_clip_mask(const Tensor& mask, const std::vector<Tensor>& outputs) {
  const float* c = mask.data_ptr<float>();
  const int64_t n = mask.numel();
  int64_t bad = 0;
  while (bad < n && (c[bad] == 0.0f || c[bad] == 1.0f)) ++bad;
  if (bad == n) return;
  for (Tensor t : outputs)
    if (t.defined()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  volatile ClipFault* r = clip_fault_record();
  r->index = bad;
  r->cols = mask.size(1);
  r->value = c[bad];
  std::atomic_thread_fence(std::memory_order_release);
  r->seq = r->seq + 1;
}

}  // namespace cpu
}  // namespace kernels
}  // namespace gdncp
