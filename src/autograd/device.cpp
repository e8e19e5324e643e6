// src/autograd/device.cpp — devices, streams, copies and the CUDA caching allocator.
//
// Note [caching allocator]: blocks freed by tensors go to a per-device cache
// keyed by size and are handed out again to later allocations of a similar
// size, so steady-state training does no cudaMalloc/cudaFree. The cache is
// stream-ordered under one assumption: all device work runs on one stream at
// a time (the thread's current stream). A block freed while kernels that use
// it are still queued is reused only by work queued after them on the same
// stream, which runs after them. Mixing streams needs a synchronize first.
#include <map>
#include <mutex>
#include <unordered_map>

#include "autograd/device.h"
#include "gdncp/error.h"

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace gdncp {

namespace {
thread_local void* t_current_stream = nullptr;
}

void* current_stream() { return t_current_stream; }
void set_current_stream(void* stream) { t_current_stream = stream; }

#if GDNCP_WITH_CUDA

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not an error for CPU runs
    return 0;
  }
  return n;
}

bool cuda_available() { return cuda_device_count() > 0; }

void synchronize() { GDNCP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(t_current_stream))); }

namespace {

// Sizes are rounded up so that blocks are interchangeable between requests of
// nearly the same size; a cached block is reused for a request of at least
// half its size (bounds the waste to 2x).
size_t round_size(size_t n) {
  const size_t small = 512, large = size_t(2) << 20;
  if (n < large) return (n + small - 1) / small * small;
  return (n + large - 1) / large * large;
}

struct DeviceCache {
  std::multimap<size_t, void*> free_blocks;
  std::unordered_map<void*, size_t> live;  // ptr -> rounded size
  MemoryStats stats;
};

class CachingAllocator {
 public:
  void* alloc(size_t nbytes, int* device_index) {
    int dev = 0;
    GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
    *device_index = dev;
    const size_t size = round_size(nbytes == 0 ? 1 : nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    DeviceCache& c = caches_[dev];
    void* ptr = nullptr;
    auto it = c.free_blocks.lower_bound(size);
    size_t got = size;
    if (it != c.free_blocks.end() && it->first <= 2 * size) {
      got = it->first;
      ptr = it->second;
      c.free_blocks.erase(it);
      c.stats.cached -= got;
    } else {
      cudaError_t err = cudaMalloc(&ptr, size);
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        release_cached(dev, c);
        err = cudaMalloc(&ptr, size);
      }
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        GDNCP_FAIL("CUDA call cudaMalloc(", size, " bytes) failed: ", cudaGetErrorString(err),
                   " (allocated ", c.stats.allocated, " bytes, cached ", c.stats.cached, ")");
      }
    }
    c.live[ptr] = got;
    c.stats.allocated += got;
    if (c.stats.allocated > c.stats.peak_allocated) c.stats.peak_allocated = c.stats.allocated;
    owner_[ptr] = dev;
    return ptr;
  }

  void free(void* ptr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto o = owner_.find(ptr);
    if (o == owner_.end()) return;  // not ours: never happens for tensors
    DeviceCache& c = caches_[o->second];
    owner_.erase(o);
    auto it = c.live.find(ptr);
    const size_t size = it->second;
    c.live.erase(it);
    c.stats.allocated -= size;
    c.stats.cached += size;
    c.free_blocks.emplace(size, ptr);
  }

  MemoryStats stats() {
    int dev = 0;
    GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
    std::lock_guard<std::mutex> lock(mu_);
    return caches_[dev].stats;
  }

  void reset_peak() {
    int dev = 0;
    GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
    std::lock_guard<std::mutex> lock(mu_);
    caches_[dev].stats.peak_allocated = caches_[dev].stats.allocated;
  }

  void empty_cache() {
    int dev = 0;
    GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
    std::lock_guard<std::mutex> lock(mu_);
    release_cached(dev, caches_[dev]);
  }

 private:
  // Caller holds mu_. Waits for queued work so no kernel still uses a block.
  void release_cached(int dev, DeviceCache& c) {
    GDNCP_CUDA_CHECK(cudaDeviceSynchronize());
    for (auto& kv : c.free_blocks) GDNCP_CUDA_CHECK(cudaFree(kv.second));
    c.free_blocks.clear();
    c.stats.cached = 0;
    (void)dev;
  }

  std::mutex mu_;
  std::map<int, DeviceCache> caches_;
  std::unordered_map<void*, int> owner_;
};

// Leaked on purpose: tensors freed during static destruction must still find it.
CachingAllocator& allocator() {
  static CachingAllocator* a = new CachingAllocator();
  return *a;
}

}  // namespace

MemoryStats cuda_memory_stats() { return allocator().stats(); }
void reset_peak_memory() { allocator().reset_peak(); }
void empty_cuda_cache() { allocator().empty_cache(); }

namespace detail {

void* cuda_alloc(size_t nbytes, int* device_index) { return allocator().alloc(nbytes, device_index); }
void cuda_free(void* ptr) { allocator().free(ptr); }
int current_device() {
  int dev = 0;
  GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_dev == Device::cpu && src_dev == Device::cpu) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  auto stream = static_cast<cudaStream_t>(t_current_stream);
  const cudaMemcpyKind kind = dst_dev == Device::cpu   ? cudaMemcpyDeviceToHost
                              : src_dev == Device::cpu ? cudaMemcpyHostToDevice
                                                       : cudaMemcpyDeviceToDevice;
  GDNCP_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kind, stream));
  // The host reads (D2H) or may free/reuse (H2D, pageable) its buffer right after.
  if (kind != cudaMemcpyDeviceToDevice) GDNCP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace detail

#else  // no CUDA in this build

int cuda_device_count() { return 0; }
bool cuda_available() { return false; }
void synchronize() {}
MemoryStats cuda_memory_stats() { return {}; }
void reset_peak_memory() {}
void empty_cuda_cache() {}

namespace detail {

void* cuda_alloc(size_t, int*) { GDNCP_FAIL("device: gdncp was built without CUDA; CUDA tensors are unavailable"); }
void cuda_free(void*) {}
int current_device() { return 0; }
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes) {
  GDNCP_CHECK(dst_dev == Device::cpu && src_dev == Device::cpu, "device: gdncp was built without CUDA");
  if (nbytes) std::memcpy(dst, src, nbytes);
}
void cuda_fill(void*, DType, int64_t, double) { GDNCP_FAIL("device: gdncp was built without CUDA"); }
void cuda_cast(void*, DType, const void*, DType, int64_t) { GDNCP_FAIL("device: gdncp was built without CUDA"); }
void cuda_add(void*, const void*, const void*, DType, int64_t) { GDNCP_FAIL("device: gdncp was built without CUDA"); }

}  // namespace detail

#endif

}  // namespace gdncp
