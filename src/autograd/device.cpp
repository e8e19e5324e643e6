// src/autograd/device.cpp — devices, streams, copies and the CUDA caching allocator.
//
// Note [caching allocator]: blocks freed by tensors go to a per-device cache
// keyed by size and are handed out again to later allocations of a similar
// size, so steady-state training does no cudaMalloc/cudaFree. The cache is
// stream-ordered under one assumption: all device work runs on one stream at
// a time (the thread's current stream). A block freed while kernels that use
// it are still queued is reused only by work queued after them on the same
// stream, which runs after them. Mixing streams needs a synchronize first.
// A captured CUDA graph keeps its blocks in a pool of its own (Note [graph pools]).
#include "autograd/device.h"

#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>

#include "gdncp/error.h"

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace gdncp {

namespace {
thread_local void* t_current_stream = nullptr;
std::atomic<int64_t> g_host_waits{0};
}  // namespace

int64_t cuda_host_waits() { return g_host_waits.load(); }

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

void synchronize() {
  g_host_waits += 1;
  GDNCP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(t_current_stream)));
}

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

// Note [graph pools]: while a CUDA graph is captured, its allocations come
// from a private pool, and every block the capture touches (allocated in it,
// or freed during it) stays in that pool until the graph is destroyed, so a
// replay finds its memory where the capture left it and no other tensor is
// ever given it. The pool is filled from the cache first (an eager warm-up
// step leaves what the capture needs there); a capture makes no cudaMalloc,
// cudaFree or synchronisation unless the cache runs dry (then cudaMalloc in
// relaxed capture mode, counted in capture_mallocs).
struct GraphPool {
  int device = 0;
  bool alive = true;                         // false: the graph is gone, blocks return to the cache when freed
  std::multimap<size_t, void*> free_blocks;  // reusable by this graph's capture only
  int64_t capture_mallocs = 0;
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
    GraphPool* pool = capturing_ ? &pools_[capturing_] : nullptr;
    void* ptr = nullptr;
    size_t got = size;
    // While capturing, the best fit over the graph's pool and the cache
    // together: the same block sizes an eager step finds in its one cache,
    // so a capture after an eager warm-up needs no cudaMalloc.
    const bool pool_first = pool && fits_better(pool->free_blocks, c.free_blocks, size);
    if (pool_first && take(pool->free_blocks, size, &ptr, &got)) {
      // from the graph's own pool
    } else if (take(c.free_blocks, size, &ptr, &got)) {
      c.stats.cached -= got;
    } else {
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      if (pool) {
        GDNCP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
        pool->capture_mallocs += 1;
      }
      c.stats.mallocs += 1;
      cudaError_t err = cudaMalloc(&ptr, size);
      if (err == cudaErrorMemoryAllocation && !pool) {  // never synchronise while capturing
        (void)cudaGetLastError();
        release_cached(dev, c);
        err = cudaMalloc(&ptr, size);
      }
      if (pool) cudaThreadExchangeStreamCaptureMode(&mode);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        GDNCP_FAIL("CUDA call cudaMalloc(", size, " bytes) failed: ", cudaGetErrorString(err), " (allocated ",
                   c.stats.allocated, " bytes, cached ", c.stats.cached, ")");
      }
    }
    if (pool) pool_of_[ptr] = capturing_;
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
    // Freed during a capture: the graph may read it on replay (Note [graph pools]).
    if (capturing_ && pool_of_.find(ptr) == pool_of_.end()) pool_of_[ptr] = capturing_;
    auto p = pool_of_.find(ptr);
    if (p != pool_of_.end()) {
      GraphPool& pool = pools_[p->second];
      if (pool.alive) {
        pool.free_blocks.emplace(size, ptr);
        return;
      }
      pool_of_.erase(p);
    }
    c.stats.cached += size;
    c.free_blocks.emplace(size, ptr);
  }

  int64_t begin_capture() {
    int dev = 0;
    GDNCP_CUDA_CHECK(cudaGetDevice(&dev));
    std::lock_guard<std::mutex> lock(mu_);
    GDNCP_CHECK(capturing_ == 0, "begin_capture: another CUDA graph is being captured");
    const int64_t id = ++next_pool_;
    pools_[id].device = dev;
    capturing_ = id;
    return id;
  }
  void end_capture() {
    std::lock_guard<std::mutex> lock(mu_);
    capturing_ = 0;
  }
  int64_t capture_mallocs(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(id);
    return it == pools_.end() ? 0 : it->second.capture_mallocs;
  }
  // The graph is gone: its free blocks go back to the cache, its live ones when freed.
  void release_pool(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(id);
    if (it == pools_.end()) return;
    GraphPool& pool = it->second;
    DeviceCache& c = caches_[pool.device];
    for (auto& kv : pool.free_blocks) {
      pool_of_.erase(kv.second);
      c.stats.cached += kv.first;
      c.free_blocks.emplace(kv.first, kv.second);
    }
    pool.free_blocks.clear();
    pool.alive = false;
    bool live = false;
    for (auto& kv : pool_of_) live |= kv.second == id;
    if (!live) pools_.erase(it);
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
    GDNCP_CHECK(capturing_ == 0, "empty_cuda_cache: not while a CUDA graph is captured");
    release_cached(dev, caches_[dev]);
  }

 private:
  // A free block of at least size and at most twice it (bounds the waste).
  // True when a's best fit for size is at least as tight as b's (and a has one).
  static bool fits_better(const std::multimap<size_t, void*>& a, const std::multimap<size_t, void*>& b, size_t size) {
    const auto ia = a.lower_bound(size), ib = b.lower_bound(size);
    if (ia == a.end() || ia->first > 2 * size) return false;
    return ib == b.end() || ia->first <= ib->first;
  }

  static bool take(std::multimap<size_t, void*>& blocks, size_t size, void** ptr, size_t* got) {
    auto it = blocks.lower_bound(size);
    if (it == blocks.end() || it->first > 2 * size) return false;
    *got = it->first;
    *ptr = it->second;
    blocks.erase(it);
    return true;
  }

  // Caller holds mu_. Waits for queued work so no kernel still uses a block.
  void release_cached(int dev, DeviceCache& c) {
    g_host_waits += 1;
    GDNCP_CUDA_CHECK(cudaDeviceSynchronize());
    for (auto& kv : c.free_blocks) GDNCP_CUDA_CHECK(cudaFree(kv.second));
    c.free_blocks.clear();
    c.stats.cached = 0;
    (void)dev;
  }

  std::mutex mu_;
  std::map<int, DeviceCache> caches_;
  std::unordered_map<void*, int> owner_;
  std::map<int64_t, GraphPool> pools_;
  std::unordered_map<void*, int64_t> pool_of_;  // blocks that belong to a graph's pool
  int64_t capturing_ = 0, next_pool_ = 0;
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
int64_t begin_pool_capture() { return allocator().begin_capture(); }
void end_pool_capture() { allocator().end_capture(); }
void release_pool(int64_t id) { allocator().release_pool(id); }
int64_t pool_capture_mallocs(int64_t id) { return allocator().capture_mallocs(id); }

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
  // The host reads (D2H) or may free/reuse (H2D, pageable) its buffer right
  // after: the copy waits, which a captured graph cannot.
  if (kind != cudaMemcpyDeviceToDevice) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    GDNCP_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
    GDNCP_CHECK(st == cudaStreamCaptureStatusNone,
                "copy between host and device while a CUDA graph is captured: the host would wait for the device");
  }
  GDNCP_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kind, stream));
  if (kind != cudaMemcpyDeviceToDevice) {
    g_host_waits += 1;
    GDNCP_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
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
int64_t begin_pool_capture() { GDNCP_FAIL("CUDA graphs: gdncp was built without CUDA"); }
void end_pool_capture() {}
void release_pool(int64_t) {}
int64_t pool_capture_mallocs(int64_t) { return 0; }
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
