// src/capi/c_api.cpp — the C ABI (include/gdncp/gdncp_c.h) over the C++ entries.
//
// Every function is one `guarded` body: exceptions become a status and a
// thread-local message, so nothing C++ crosses the door. Inputs arrive as
// DLManagedTensors and become Tensors over the same memory
// (Note [DLPack ownership] in src/capi/dlpack.cpp).
//
// Note [graphs across the door]: a call that records gets a tape of its own
// (a TapeScope around the forward), held by the graph handle; the backward
// walks that tape only. So graphs of several layers are independent, may be
// backpropagated in any order and on any thread (PyTorch runs a CUDA
// backward on its device thread), and a graph dropped without backward frees
// its saved tensors. Outputs leave detached: the caller's copy of an output
// does not keep the graph's saved tensors alive.
#include <mpi.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "autograd/tape.h"
#include "capi/dlpack.h"
#include "cp/validate_cp.h"
#include "gdncp/bigdn.h"
#include "gdncp/cp.h"
#include "gdncp/error.h"
#include "gdncp/gdncp_c.h"

#if GDNCP_WITH_CUDA
#include <cuda_runtime.h>
#endif

using gdncp::Device;
using gdncp::Error;
using gdncp::Tensor;

struct gdncp_comm {
  std::shared_ptr<gdncp::cp::Communicator> c;
};

struct gdncp_graph {
  gdncp::autograd::Tape tape;
  std::vector<Tensor> outputs;                    // the roots (undefined where the call has none)
  std::vector<Tensor> inputs;                     // the differentiable inputs (undefined where absent)
  std::shared_ptr<gdncp::cp::Communicator> comm;  // kept alive for the backward's collectives
  int device = -1;                                // CUDA device of the call, -1 = CPU
  bool consumed = false;
  size_t n_outputs = 0, n_inputs = 0;  // the counts, kept after the backward drops outputs and inputs
};

namespace {

thread_local std::string t_last_error;

// Note [handle registry]: the live handles the door gave out. Every function
// that takes a handle looks it up first, so a destroyed, foreign or garbage
// pointer is an argument error naming it, never a use after free.
std::mutex g_handles_mutex;
std::set<const void*>& live_handles() {
  static std::set<const void*>* h = new std::set<const void*>();  // never destroyed: usable at exit
  return *h;
}
void register_handle(const void* p) {
  std::lock_guard<std::mutex> lock(g_handles_mutex);
  live_handles().insert(p);
}
bool is_live(const void* p) {
  std::lock_guard<std::mutex> lock(g_handles_mutex);
  return live_handles().count(p) != 0;
}
// Removes p; false when it was not live.
bool unregister_handle(const void* p) {
  std::lock_guard<std::mutex> lock(g_handles_mutex);
  return live_handles().erase(p) != 0;
}

// A fault of the caller found by the door itself (status GDNCP_ERROR_ARGUMENT).
struct ArgumentError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void argument_error(const Args&... args) {
  std::ostringstream os;
  gdncp::detail::append(os, args...);
  throw ArgumentError(os.str());
}

template <typename Body>
gdncp_status guarded(Body body) {
  try {
    body();
    t_last_error.clear();
    return GDNCP_OK;
  } catch (const ArgumentError& e) {
    t_last_error = e.what();
    return GDNCP_ERROR_ARGUMENT;
  } catch (const Error& e) {
    t_last_error = e.what();
    return GDNCP_ERROR;
  } catch (const std::bad_alloc&) {
    t_last_error = "out of host memory";
    return GDNCP_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    t_last_error = std::string("internal error: ") + e.what();
    return GDNCP_ERROR_INTERNAL;
  } catch (...) {
    t_last_error = "internal error: an unknown exception";
    return GDNCP_ERROR_INTERNAL;
  }
}

template <typename T>
T* not_null(T* p, const char* fn, const char* what) {
  if (!p) argument_error(fn, ": ", what, " is NULL");
  return p;
}

// The calling thread's CUDA device for the scope of a call (CPU: nothing).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
#if GDNCP_WITH_CUDA
    if (device < 0) return;
    GDNCP_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device)
      GDNCP_CUDA_CHECK(cudaSetDevice(device));
    else
      prev_ = -1;
#else
    (void)device;
#endif
  }
  ~DeviceScope() {
#if GDNCP_WITH_CUDA
    if (prev_ >= 0) cudaSetDevice(prev_);
#endif
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = -1;
};

// The input DLManagedTensors of one call, consumed whatever happens: take()
// imports one (its storage owns it from then on); the rest are deleted when
// the call ends.
class Inputs {
 public:
  // A tensor given for two arguments is imported once and shared by both
  // (deleted once).
  Inputs(const char* fn, std::vector<DLManagedTensor*> ms, std::vector<const char*> names)
      : fn_(fn), ms_(std::move(ms)), names_(std::move(names)), first_(ms_.size()), taken_(ms_.size()) {
    for (size_t i = 0; i < ms_.size(); ++i) {
      first_[i] = i;
      for (size_t j = 0; j < i; ++j)
        if (ms_[i] && ms_[j] == ms_[i]) {
          first_[i] = first_[j];
          break;
        }
    }
  }
  ~Inputs() {
    for (size_t i = 0; i < ms_.size(); ++i)
      if (first_[i] == i && ms_[i] && ms_[i]->deleter) ms_[i]->deleter(ms_[i]);
  }
  Inputs(const Inputs&) = delete;
  Inputs& operator=(const Inputs&) = delete;

  // The CUDA device every CUDA input is on (-1: all on the CPU); inputs on
  // two devices, or a CUDA input to a build without CUDA, are refused.
  int device() const {
    int dev = -1;
    const char* first = nullptr;
    for (size_t i = 0; i < ms_.size(); ++i) {
      const DLManagedTensor* m = ms_[i];
      if (!m || m->dl_tensor.device.device_type != kDLCUDA) continue;
#if !GDNCP_WITH_CUDA
      argument_error(fn_, ": ", names_[i], " is a CUDA tensor but gdncp was built without CUDA");
#endif
      const int d = m->dl_tensor.device.device_id;
      if (dev >= 0 && d != dev)
        argument_error(fn_, ": ", names_[i], " is on CUDA device ", d, " but ", first, " is on CUDA device ", dev);
      dev = d;
      first = names_[i];
    }
    return dev;
  }

  bool given(size_t i) const { return ms_[i] != nullptr; }

  void require(size_t i) const {
    if (!ms_[i]) argument_error(fn_, ": ", names_[i], " is NULL");
  }

  Tensor take(size_t i) {
    const size_t f = first_[i];
    if (taken_[f].defined() || !ms_[f]) return taken_[f];
    DLManagedTensor* m = ms_[f];
    for (size_t j = f; j < ms_.size(); ++j)
      if (first_[j] == f) ms_[j] = nullptr;  // the import owns m from here, whatever it decides
    const std::string what = std::string(fn_) + ": " + names_[i];
    try {
      taken_[f] = gdncp::detail::from_dlpack(m, what.c_str());
    } catch (const Error& e) {
      throw ArgumentError(e.what());
    }
    return taken_[f];
  }

 private:
  const char* fn_;
  std::vector<DLManagedTensor*> ms_;
  std::vector<const char*> names_;
  std::vector<size_t> first_;  // the first argument given the same tensor
  std::vector<Tensor> taken_;  // imported, per first argument
};

gdncp::BigdnOptions layer_options(const gdncp_layer_options* o, const char* fn) {
  gdncp::BigdnOptions opt;
  if (!o) return opt;
  // Fields added at the end read as their defaults from a struct of an older size.
  const size_t before_deterministic = offsetof(gdncp_layer_options, deterministic);
  if (o->struct_size < before_deterministic)
    argument_error(fn, ": options->struct_size ", o->struct_size, " < ", before_deterministic,
                   " (fill options with gdncp_layer_options_init)");
  opt.deterministic = o->struct_size >= sizeof(gdncp_layer_options) && o->deterministic != 0;
  opt.k_scale = o->k_scale;
  opt.norm_eps = o->norm_eps;
  opt.eps = o->eps;
  switch (o->precision) {
    case GDNCP_PRECISION_AUTO: opt.precision = gdncp::Precision::automatic; break;
    case GDNCP_PRECISION_BF16: opt.precision = gdncp::Precision::bf16; break;
    case GDNCP_PRECISION_TF32: opt.precision = gdncp::Precision::tf32; break;
    case GDNCP_PRECISION_IEEE: opt.precision = gdncp::Precision::ieee; break;
    default: argument_error(fn, ": options->precision ", o->precision, " is not a gdncp_precision");
  }
  switch (o->checkpoint) {
    case GDNCP_CHECKPOINT_OFF: opt.checkpoint = gdncp::Checkpoint::off; break;
    case GDNCP_CHECKPOINT_ON: opt.checkpoint = gdncp::Checkpoint::on; break;
    case GDNCP_CHECKPOINT_AUTO: opt.checkpoint = gdncp::Checkpoint::automatic; break;
    default: argument_error(fn, ": options->checkpoint ", o->checkpoint, " is not a gdncp_checkpoint");
  }
  return opt;
}

gdncp::cp::CpOptions cp_options_of(const gdncp_cp_options* o, const char* fn) {
  gdncp::cp::CpOptions opt;
  if (!o) return opt;
  // The fields up to truncate_to_active are the first version's; later ones are read when present.
  constexpr size_t first_size = offsetof(gdncp_cp_options, truncate_to_active) + sizeof(int64_t);
  if (o->struct_size < first_size)
    argument_error(fn, ": cp_options->struct_size ", o->struct_size, " < ", first_size,
                   " (fill cp_options with gdncp_cp_options_init)");
  const auto has = [&](size_t offset) { return o->struct_size >= offset + sizeof(int); };
  opt.deterministic = has(offsetof(gdncp_cp_options, deterministic)) && o->deterministic != 0;
  opt.reverse_rank_order = o->reverse_rank_order != 0;
  opt.truncate_to_active = o->truncate_to_active;
  if (!has(offsetof(gdncp_cp_options, node_size))) return opt;
  if (o->exchange < GDNCP_EXCHANGE_AUTO || o->exchange > GDNCP_EXCHANGE_HIERARCHICAL)
    argument_error(fn, ": cp_options->exchange ", o->exchange, " is not a gdncp_exchange");
  if (o->node_size < 0) argument_error(fn, ": cp_options->node_size ", o->node_size, " < 0 (0: detect)");
  opt.exchange = static_cast<gdncp::cp::Exchange>(o->exchange);
  opt.node_size = o->node_size;
  if (!has(offsetof(gdncp_cp_options, overlap_exchange))) return opt;
  if (o->overlap_exchange != 0 && o->overlap_exchange != 1)
    argument_error(fn, ": cp_options->overlap_exchange ", o->overlap_exchange, " is not 0 or 1");
  opt.overlap_exchange = o->overlap_exchange != 0;
  return opt;
}

gdncp::cp::Communicator& comm_of(gdncp_comm* comm, const char* fn) {
  not_null(comm, fn, "comm");
  if (!is_live(comm) || !comm->c)
    argument_error(fn, ": comm is not a live gdncp_comm (destroyed, or not made by gdncp_comm_create_*)");
  return *comm->c;
}

// A communicator getter: checks out and comm, then writes get(comm) to *out.
template <typename T, typename Get>
gdncp_status comm_get(const gdncp_comm* comm, T* out, const char* fn, const char* what, Get get) {
  return guarded([&] {
    not_null(out, fn, what);
    *out = get(comm_of(const_cast<gdncp_comm*>(comm), fn));
  });
}

const gdncp_graph* graph_of(const gdncp_graph* graph, const char* fn) {
  not_null(graph, fn, "graph");
  if (!is_live(graph)) argument_error(fn, ": graph is not a live gdncp_graph (destroyed, or not made by gdncp)");
  return graph;
}

// What every layer call shares: validates the request, imports the inputs,
// runs fn under a graph's tape (or without grad) and hands out the outputs.
using Forward = std::function<std::vector<Tensor>(std::vector<Tensor>&)>;

void run_layer(const char* fn, Inputs& in, size_t n_diff, size_t n_in, uint32_t requires_grad, void* stream,
               std::shared_ptr<gdncp::cp::Communicator> comm, const Forward& forward, DLManagedTensor** outs,
               size_t n_outs, gdncp_graph** graph) {
  if (requires_grad >> n_diff)
    argument_error(fn, ": requires_grad 0x", std::hex, requires_grad, std::dec, " flags inputs beyond the ", n_diff,
                   " differentiable ones");
  const int device = in.device();
  DeviceScope dev(device);
  gdncp::StreamGuard stream_scope(stream);
  std::vector<Tensor> x(n_in);
  for (size_t i = 0; i < n_in; ++i) x[i] = in.take(i);
  for (size_t i = 0; i < n_diff; ++i)
    if (x[i].defined() && ((requires_grad >> i) & 1u)) x[i].requires_grad_(true);

  std::unique_ptr<gdncp_graph> g;
  std::vector<Tensor> y;
  if (graph) {
    g = std::make_unique<gdncp_graph>();
    gdncp::autograd::TapeScope tape(g->tape);
    gdncp::autograd::EnableGradGuard grad;
    y = forward(x);
    g->inputs.assign(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n_diff));
    g->outputs = y;
    g->comm = std::move(comm);
    g->device = device;
    g->n_outputs = y.size();
    g->n_inputs = n_diff;
  } else {
    gdncp::NoGradGuard no_grad;
    y = forward(x);
  }
  // Export; on a failure half-way, free what was exported already.
  std::vector<DLManagedTensor*> done;
  try {
    for (size_t k = 0; k < n_outs; ++k)
      done.push_back(k < y.size() && y[k].defined() ? gdncp::detail::to_dlpack(y[k].detach()) : nullptr);
  } catch (...) {
    for (DLManagedTensor* m : done)
      if (m) m->deleter(m);
    throw;
  }
  for (size_t k = 0; k < n_outs; ++k) outs[k] = done[k];
  if (graph) {
    register_handle(g.get());
    *graph = g.release();
  }
}

// Note [refused before the entry]: a CP call the door refuses on this rank
// before the C++ entry runs (a bad DLPack tensor, a NULL argument, bad
// options) leaves the other ranks in the entry's collectives. The rank joins
// them with its error — the entry's validation exchange, which a rank with a
// bad argument always makes (Note [validation policy]) — so that they raise
// at once, not at their deadline; then it reports its own error. Errors from
// inside the entry reach every rank by the entry's own exchange.
template <typename Body>
void collective_call(gdncp::cp::Communicator& comm, const char* entry, bool& entered, Body body) {
  try {
    body();
  } catch (const std::exception& e) {
    if (!entered && !comm.aborted()) {
      try {
        gdncp::cp::detail::CallRecord rec;
        const std::string why = e.what();
        gdncp::cp::detail::validate_collective(comm, entry, rec,
                                               [&](gdncp::cp::detail::CallRecord&) { throw Error(why); });
      } catch (const std::exception&) {
        // this rank's own error (or the group's verdict on it) is the one reported
      }
    }
    throw;
  }
}

namespace comm_callbacks {

// The caller's table, shared by the communicator's callbacks: the last of
// them to go (when the communicator is freed) calls release(user), once the
// communicator was made (armed).
struct Table {
  gdncp_comm_callbacks cb;
  bool armed = false;
  ~Table() {
    if (armed && cb.release) cb.release(cb.user);
  }
};
using Shared = std::shared_ptr<Table>;

// "" for status 0, else the status and the caller's message.
std::string result(const Table& t, int status) {
  if (status == 0) return std::string();
  const char* msg = t.cb.error_message ? t.cb.error_message(t.cb.user) : nullptr;
  return "status " + std::to_string(status) + (msg && *msg ? std::string(": ") + msg : std::string());
}

}  // namespace comm_callbacks

std::mutex g_mpi_mutex;
bool g_mpi_initialised_here = false;

// The inputs of the layer entries in the order of their parameters; the first
// kLayerDiff are differentiable. The q tables are optional as a pair (the
// layer checks that).
const char* const kLayerNames[] = {"qkv",      "beta",     "decay",      "q_norm_w",   "k_norm_w",
                                   "rope_cos", "rope_sin", "rope_cos_q", "rope_sin_q", "clip_starts"};
constexpr size_t kLayerInputs = sizeof kLayerNames / sizeof kLayerNames[0];
constexpr size_t kLayerDiff = 5;

std::vector<const char*> layer_names() { return std::vector<const char*>(kLayerNames, kLayerNames + kLayerInputs); }

// What the CP layer entries share: the layer's inputs and options checked under
// collective_call (Note [refused before the entry]), then run_layer; layer makes
// the outputs from the imported inputs once the C++ entry is entered.
using CpLayer = std::function<std::vector<Tensor>(gdncp::cp::Communicator&, std::vector<Tensor>&,
                                                  const gdncp::BigdnOptions&, const gdncp::cp::CpOptions&)>;

void cp_layer_call(const char* fn, const char* entry, gdncp_comm* comm, std::vector<DLManagedTensor*> tensors,
                   const gdncp_layer_options* options, const gdncp_cp_options* cp_options, void* stream,
                   uint32_t requires_grad, DLManagedTensor** outs, const char* outs_name, size_t n_outs,
                   gdncp_graph** graph, const CpLayer& layer) {
  Inputs in(fn, std::move(tensors), layer_names());
  auto& c = comm_of(comm, fn);
  bool entered = false;
  collective_call(c, entry, entered, [&] {
    for (size_t i : {0, 1, 2, 5, 6}) in.require(i);
    not_null(outs, fn, outs_name);
    const gdncp::BigdnOptions opt = layer_options(options, fn);
    const gdncp::cp::CpOptions cp_opt = cp_options_of(cp_options, fn);
    run_layer(
        fn, in, kLayerDiff, kLayerInputs, requires_grad, stream, comm->c,
        [&](std::vector<Tensor>& x) {
          entered = true;
          return layer(c, x, opt, cp_opt);
        },
        outs, n_outs, graph);
  });
}

}  // namespace

extern "C" {

int gdncp_abi_version(void) { return GDNCP_C_ABI_VERSION; }

const char* gdncp_last_error(void) { return t_last_error.c_str(); }

const char* gdncp_status_name(gdncp_status status) {
  switch (status) {
    case GDNCP_OK: return "ok";
    case GDNCP_ERROR_ARGUMENT: return "argument";
    case GDNCP_ERROR: return "error";
    case GDNCP_ERROR_OUT_OF_MEMORY: return "out of memory";
    case GDNCP_ERROR_INTERNAL: return "internal";
  }
  return "unknown status";
}

int gdncp_cuda_available(void) {
  try {
    return gdncp::cuda_available() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

gdncp_status gdncp_layer_options_init(gdncp_layer_options* options) {
  return guarded([&] {
    not_null(options, "gdncp_layer_options_init", "options");
    const gdncp::BigdnOptions d;
    options->struct_size = sizeof(gdncp_layer_options);
    options->k_scale = d.k_scale;
    options->norm_eps = d.norm_eps;
    options->eps = d.eps;
    options->precision = GDNCP_PRECISION_AUTO;
    options->checkpoint = GDNCP_CHECKPOINT_OFF;
    options->deterministic = 0;
  });
}

gdncp_status gdncp_cp_options_init(gdncp_cp_options* options) {
  return guarded([&] {
    not_null(options, "gdncp_cp_options_init", "options");
    options->struct_size = sizeof(gdncp_cp_options);
    options->reverse_rank_order = 0;
    options->truncate_to_active = 0;
    options->exchange = GDNCP_EXCHANGE_AUTO;
    options->node_size = 0;
    options->deterministic = 0;
    options->overlap_exchange = 0;
  });
}

// --- communicators ---------------------------------------------------------------

gdncp_status gdncp_unique_id(unsigned char id[GDNCP_UNIQUE_ID_BYTES]) {
  return guarded([&] {
    not_null(id, "gdncp_unique_id", "id");
    const gdncp::cp::UniqueId u = gdncp::cp::make_unique_id();
    std::memcpy(id, u.bytes, GDNCP_UNIQUE_ID_BYTES);
  });
}

gdncp_status gdncp_comm_create_nccl(const unsigned char id[GDNCP_UNIQUE_ID_BYTES], int rank, int size, int device,
                                    gdncp_comm** comm) {
  return guarded([&] {
    not_null(id, "gdncp_comm_create_nccl", "id");
    not_null(comm, "gdncp_comm_create_nccl", "comm");
    gdncp::cp::UniqueId u;
    static_assert(sizeof u.bytes == GDNCP_UNIQUE_ID_BYTES, "the id's size is part of the ABI");
    std::memcpy(u.bytes, id, GDNCP_UNIQUE_ID_BYTES);
    auto c = std::make_unique<gdncp_comm>();
    c->c = gdncp::cp::make_nccl_communicator(u, rank, size, device);
    register_handle(c.get());
    *comm = c.release();
  });
}

gdncp_status gdncp_comm_create_mpi_world(gdncp_comm** comm) {
  return guarded([&] {
    not_null(comm, "gdncp_comm_create_mpi_world", "comm");
    {
      std::lock_guard<std::mutex> lock(g_mpi_mutex);
      int init = 0, fin = 0;
      GDNCP_MPI_CHECK(MPI_Initialized(&init));
      GDNCP_MPI_CHECK(MPI_Finalized(&fin));
      GDNCP_CHECK(!fin, "gdncp_comm_create_mpi_world: MPI was finalized already");
      if (!init) {
        int provided = 0;
        GDNCP_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
        g_mpi_initialised_here = true;
      }
    }
    auto c = std::make_unique<gdncp_comm>();
    c->c = gdncp::cp::make_mpi_communicator(MPI_COMM_WORLD);
    register_handle(c.get());
    *comm = c.release();
  });
}

gdncp_status gdncp_comm_callbacks_init(gdncp_comm_callbacks* callbacks) {
  return guarded([&] {
    not_null(callbacks, "gdncp_comm_callbacks_init", "callbacks");
    std::memset(callbacks, 0, sizeof *callbacks);
    callbacks->struct_size = sizeof(gdncp_comm_callbacks);
  });
}

gdncp_status gdncp_comm_create_callbacks(const gdncp_comm_callbacks* callbacks, int rank, int size, int device,
                                         gdncp_comm** comm) {
  const char* fn = "gdncp_comm_create_callbacks";
  return guarded([&] {
    not_null(callbacks, fn, "callbacks");
    not_null(comm, fn, "comm");
    if (callbacks->struct_size < sizeof(gdncp_comm_callbacks))
      argument_error(fn, ": callbacks->struct_size ", callbacks->struct_size, " < ", sizeof(gdncp_comm_callbacks),
                     " (fill callbacks with gdncp_comm_callbacks_init)");
    if (!callbacks->all_gather) argument_error(fn, ": callbacks->all_gather is NULL (required)");
    if (!callbacks->broadcast) argument_error(fn, ": callbacks->broadcast is NULL (required)");
    if (device < -1) argument_error(fn, ": device ", device, " is neither -1 (CPU) nor a CUDA device");
    const comm_callbacks::Shared t = std::make_shared<comm_callbacks::Table>();
    t->cb = *callbacks;
    gdncp::cp::CollectiveCallbacks c;
    c.all_gather = [t](void* out, const void* in, size_t bytes, void* stream) {
      return comm_callbacks::result(*t, t->cb.all_gather(t->cb.user, out, in, bytes, stream));
    };
    c.broadcast = [t](void* data, size_t bytes, int root, void* stream) {
      return comm_callbacks::result(*t, t->cb.broadcast(t->cb.user, data, bytes, root, stream));
    };
    if (t->cb.send_recv)
      c.send_recv = [t](const void* send, size_t sb, int dst, void* recv, size_t rb, int src, void* stream) {
        return comm_callbacks::result(*t, t->cb.send_recv(t->cb.user, send, sb, dst, recv, rb, src, stream));
      };
    DeviceScope dev(device);
    auto h = std::make_unique<gdncp_comm>();
    h->c = gdncp::cp::make_callback_communicator(std::move(c), rank, size,
                                                 device >= 0 ? gdncp::Device::cuda : gdncp::Device::cpu);
    t->armed = true;  // from here on the communicator owns user (release when it is freed)
    register_handle(h.get());
    *comm = h.release();
  });
}

gdncp_status gdncp_mpi_finalize(void) {
  return guarded([&] {
    std::lock_guard<std::mutex> lock(g_mpi_mutex);
    if (!g_mpi_initialised_here) return;
    gdncp::cp::finalize_mpi();
  });
}

gdncp_status gdncp_comm_destroy(gdncp_comm* comm) {
  return guarded([&] {
    if (!comm) return;
    if (!unregister_handle(comm))
      argument_error("gdncp_comm_destroy: comm is not a live gdncp_comm (destroyed already, or not made by gdncp)");
    delete comm;
  });
}

gdncp_status gdncp_comm_rank(const gdncp_comm* comm, int* rank) {
  return comm_get(comm, rank, "gdncp_comm_rank", "rank", [](gdncp::cp::Communicator& c) { return c.rank(); });
}

gdncp_status gdncp_comm_size(const gdncp_comm* comm, int* size) {
  return comm_get(comm, size, "gdncp_comm_size", "size", [](gdncp::cp::Communicator& c) { return c.size(); });
}

gdncp_status gdncp_comm_backend(const gdncp_comm* comm, const char** backend) {
  return comm_get(comm, backend, "gdncp_comm_backend", "backend",
                  [](gdncp::cp::Communicator& c) { return c.backend(); });
}

gdncp_status gdncp_comm_set_timeout(gdncp_comm* comm, double seconds) {
  return guarded([&] {
    auto& c = comm_of(comm, "gdncp_comm_set_timeout");
    if (!(std::isfinite(seconds) && seconds > 0))
      argument_error("gdncp_comm_set_timeout: seconds must be finite and > 0, got ", seconds);
    c.set_timeout_seconds(seconds);
  });
}

gdncp_status gdncp_comm_timeout(const gdncp_comm* comm, double* seconds) {
  return comm_get(comm, seconds, "gdncp_comm_timeout", "seconds",
                  [](gdncp::cp::Communicator& c) { return c.timeout_seconds(); });
}

gdncp_status gdncp_comm_aborted(const gdncp_comm* comm, int* aborted) {
  return comm_get(comm, aborted, "gdncp_comm_aborted", "aborted",
                  [](gdncp::cp::Communicator& c) { return c.aborted() ? 1 : 0; });
}

gdncp_status gdncp_comm_all_reduce_sum(gdncp_comm* comm, DLManagedTensor* t, void* stream) {
  const char* fn = "gdncp_comm_all_reduce_sum";
  return guarded([&] {
    Inputs in(fn, {t}, {"t"});
    auto& c = comm_of(comm, fn);
    Tensor x;
    int device = -1;
    try {
      in.require(0);
      device = in.device();
      DeviceScope dev(device);
      x = in.take(0);
    } catch (const std::exception&) {
      // Refused here: the collective still runs with this rank's argument
      // missing, so that the other ranks raise at once (MPI) instead of
      // waiting for it; then this rank reports its own error.
      Tensor none;
      try {
        c.all_reduce_sum(none);
      } catch (const std::exception&) {
      }
      throw;
    }
    DeviceScope dev(device);
    gdncp::StreamGuard stream_scope(stream);
    c.all_reduce_sum(x);
  });
}

// --- graphs ------------------------------------------------------------------------

gdncp_status gdncp_graph_num_outputs(const gdncp_graph* graph, int* n) {
  return guarded([&] {
    graph_of(graph, "gdncp_graph_num_outputs");
    *not_null(n, "gdncp_graph_num_outputs", "n") = static_cast<int>(graph->n_outputs);
  });
}

gdncp_status gdncp_graph_num_inputs(const gdncp_graph* graph, int* n) {
  return guarded([&] {
    graph_of(graph, "gdncp_graph_num_inputs");
    *not_null(n, "gdncp_graph_num_inputs", "n") = static_cast<int>(graph->n_inputs);
  });
}

gdncp_status gdncp_graph_backward(gdncp_graph* graph, DLManagedTensor* const* grad_outputs, void* stream,
                                  DLManagedTensor** grad_inputs) {
  const char* fn = "gdncp_graph_backward";
  return guarded([&] {
    const size_t n_out = graph && is_live(graph) ? graph->n_outputs : 0;
    std::vector<DLManagedTensor*> ms(grad_outputs ? grad_outputs : nullptr,
                                     grad_outputs ? grad_outputs + n_out : nullptr);
    ms.resize(n_out, nullptr);
    std::vector<std::string> names_s(n_out);
    std::vector<const char*> names(n_out);
    for (size_t k = 0; k < n_out; ++k) {
      names_s[k] = "grad_outputs[" + std::to_string(k) + "]";
      names[k] = names_s[k].c_str();
    }
    Inputs in(fn, ms, names);
    graph_of(graph, fn);
    not_null(grad_inputs, fn, "grad_inputs");
    if (graph->consumed) argument_error(fn, ": the graph's backward ran already (once per graph)");
    DeviceScope dev(graph->device);
    gdncp::StreamGuard stream_scope(stream);
    gdncp::autograd::TapeScope tape(graph->tape);
    std::vector<Tensor> roots, grads;
    for (size_t k = 0; k < n_out; ++k) {
      Tensor g = in.take(k);
      const Tensor& y = graph->outputs[k];
      if (!y.defined() || !y.requires_grad()) continue;
      if (!g.defined()) g = Tensor::zeros(y.shape(), y.dtype(), y.device());
      if (g.shape() != y.shape() || g.dtype() != y.dtype() || g.device() != y.device())
        argument_error(fn, ": ", names[k], " is ", g.str(), " but output ", k, " is ", y.str());
      roots.push_back(y);
      grads.push_back(g);
    }
    // Every gradient was accepted: from here the graph is spent (a refused
    // one leaves it for a retry).
    graph->consumed = true;
    if (!roots.empty()) gdncp::autograd::backward(roots, grads);
    gdncp::autograd::clear_tape();  // frees the saved tensors also when nothing needed a gradient
    const size_t n_in = graph->inputs.size();
    std::vector<DLManagedTensor*> done;
    try {
      for (size_t i = 0; i < n_in; ++i) {
        const Tensor& x = graph->inputs[i];
        if (!x.defined() || !x.requires_grad()) {
          done.push_back(nullptr);
          continue;
        }
        Tensor g = x.grad();
        if (!g.defined()) g = Tensor::zeros(x.shape(), x.dtype(), x.device());  // no path from the outputs
        done.push_back(gdncp::detail::to_dlpack(g));
      }
    } catch (...) {
      for (DLManagedTensor* m : done)
        if (m) m->deleter(m);
      throw;
    }
    for (size_t i = 0; i < n_in; ++i) grad_inputs[i] = done[i];
    // The inputs stay referenced by the caller's framework; drop the graph's hold on them now.
    graph->outputs.clear();
    for (Tensor& x : graph->inputs) x = Tensor();
    graph->comm.reset();
  });
}

gdncp_status gdncp_graph_destroy(gdncp_graph* graph) {
  return guarded([&] {
    if (!graph) return;
    if (!unregister_handle(graph))
      argument_error("gdncp_graph_destroy: graph is not a live gdncp_graph (destroyed already, or not made by gdncp)");
    DeviceScope dev(graph->device);  // device memory returns to that device's cache
    delete graph;
  });
}

// --- the layers ---------------------------------------------------------------------

gdncp_status gdncp_bigdn(DLManagedTensor* qkv, DLManagedTensor* beta, DLManagedTensor* decay, DLManagedTensor* q_norm_w,
                         DLManagedTensor* k_norm_w, DLManagedTensor* rope_cos, DLManagedTensor* rope_sin,
                         DLManagedTensor* rope_cos_q, DLManagedTensor* rope_sin_q, DLManagedTensor* clip_starts,
                         int64_t F, int64_t S, const gdncp_layer_options* options, void* stream, uint32_t requires_grad,
                         DLManagedTensor** out, gdncp_graph** graph) {
  const char* fn = "gdncp_bigdn";
  return guarded([&] {
    Inputs in(fn, {qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q, clip_starts},
              layer_names());
    for (size_t i : {0, 1, 2, 5, 6}) in.require(i);
    not_null(out, fn, "out");
    const gdncp::BigdnOptions opt = layer_options(options, fn);
    run_layer(
        fn, in, kLayerDiff, kLayerInputs, requires_grad, stream, nullptr,
        [&](std::vector<Tensor>& x) {
          return std::vector<Tensor>{
              gdncp::bigdn(x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, S, opt, x[9], x[7], x[8])};
        },
        out, 1, graph);
  });
}

gdncp_status gdncp_bigdn_cp(gdncp_comm* comm, DLManagedTensor* qkv, DLManagedTensor* beta, DLManagedTensor* decay,
                            DLManagedTensor* q_norm_w, DLManagedTensor* k_norm_w, DLManagedTensor* rope_cos,
                            DLManagedTensor* rope_sin, DLManagedTensor* rope_cos_q, DLManagedTensor* rope_sin_q,
                            DLManagedTensor* clip_starts, int64_t F, int64_t S, const gdncp_layer_options* options,
                            void* stream, uint32_t requires_grad, DLManagedTensor** out, gdncp_graph** graph) {
  return gdncp_bigdn_cp_ex(comm, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q,
                           clip_starts, F, S, options, nullptr, stream, requires_grad, out, graph);
}

gdncp_status gdncp_bigdn_cp_ex(gdncp_comm* comm, DLManagedTensor* qkv, DLManagedTensor* beta, DLManagedTensor* decay,
                               DLManagedTensor* q_norm_w, DLManagedTensor* k_norm_w, DLManagedTensor* rope_cos,
                               DLManagedTensor* rope_sin, DLManagedTensor* rope_cos_q, DLManagedTensor* rope_sin_q,
                               DLManagedTensor* clip_starts, int64_t F, int64_t S, const gdncp_layer_options* options,
                               const gdncp_cp_options* cp_options, void* stream, uint32_t requires_grad,
                               DLManagedTensor** out, gdncp_graph** graph) {
  const char* fn = "gdncp_bigdn_cp";
  return guarded([&] {
    cp_layer_call(fn, "bigdn_cp", comm,
                  {qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q, clip_starts},
                  options, cp_options, stream, requires_grad, out, "out", 1, graph,
                  [&](gdncp::cp::Communicator& c, std::vector<Tensor>& x, const gdncp::BigdnOptions& opt,
                      const gdncp::cp::CpOptions& cp_opt) {
                    return std::vector<Tensor>{gdncp::cp::bigdn_cp(c, x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, S,
                                                                   opt, x[9], x[7], x[8], cp_opt)};
                  });
  });
}

gdncp_status gdncp_cp_gdn_raw(gdncp_comm* comm, DLManagedTensor* qkv, DLManagedTensor* beta, DLManagedTensor* decay,
                              DLManagedTensor* q_norm_w, DLManagedTensor* k_norm_w, DLManagedTensor* rope_cos,
                              DLManagedTensor* rope_sin, DLManagedTensor* rope_cos_q, DLManagedTensor* rope_sin_q,
                              DLManagedTensor* clip_starts, int64_t F, int64_t S, const gdncp_layer_options* options,
                              const gdncp_cp_options* cp_options, void* stream, uint32_t requires_grad,
                              DLManagedTensor* outputs[4], gdncp_graph** graph) {
  const char* fn = "gdncp_cp_gdn_raw";
  return guarded([&] {
    cp_layer_call(fn, "cp_gdn_raw", comm,
                  {qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q, clip_starts},
                  options, cp_options, stream, requires_grad, outputs, "outputs", 4, graph,
                  [&](gdncp::cp::Communicator& c, std::vector<Tensor>& x, const gdncp::BigdnOptions& opt,
                      const gdncp::cp::CpOptions& cp_opt) {
                    gdncp::cp::RawResult r = gdncp::cp::cp_gdn_raw(c, x[0], x[1], x[2], x[3], x[4], x[5], x[6], F, S,
                                                                   opt, cp_opt, x[9], x[7], x[8]);
                    return std::vector<Tensor>{r.num, r.den, r.terminal_M, r.terminal_z};
                  });
  });
}

gdncp_status gdncp_cp_scan(gdncp_comm* comm, DLManagedTensor* P, DLManagedTensor* A, DLManagedTensor* Pz,
                           DLManagedTensor* bz, DLManagedTensor* decay, DLManagedTensor* clip_starts,
                           const gdncp_cp_options* cp_options, void* stream, uint32_t requires_grad,
                           DLManagedTensor* outputs[4], gdncp_graph** graph) {
  const char* fn = "gdncp_cp_scan";
  return guarded([&] {
    Inputs in(fn, {P, A, Pz, bz, decay, clip_starts}, {"P", "A", "Pz", "bz", "decay", "clip_starts"});
    auto& c = comm_of(comm, fn);
    bool entered = false;
    collective_call(c, "cp_scan", entered, [&] {
      for (size_t i = 0; i < 5; ++i) in.require(i);
      not_null(outputs, fn, "outputs");
      const gdncp::cp::CpOptions cp_opt = cp_options_of(cp_options, fn);
      run_layer(
          fn, in, 5, 6, requires_grad, stream, comm->c,
          [&](std::vector<Tensor>& x) {
            entered = true;
            gdncp::cp::ScanResult r = gdncp::cp::cp_scan(c, x[0], x[1], x[2], x[3], x[4], cp_opt, x[5]);
            return std::vector<Tensor>{r.M, r.z, r.terminal_M, r.terminal_z};
          },
          outputs, 4, graph);
    });
  });
}

gdncp_status gdncp_cp_cam_gdn_num(gdncp_comm* comm, DLManagedTensor* q, DLManagedTensor* k, DLManagedTensor* v,
                                  DLManagedTensor* beta, DLManagedTensor* decay, int64_t F, int64_t S,
                                  const gdncp_cp_options* cp_options, int checkpoint, void* stream,
                                  uint32_t requires_grad, DLManagedTensor* outputs[2], gdncp_graph** graph) {
  const char* fn = "gdncp_cp_cam_gdn_num";
  return guarded([&] {
    Inputs in(fn, {q, k, v, beta, decay}, {"q", "k", "v", "beta", "decay"});
    auto& c = comm_of(comm, fn);
    bool entered = false;
    collective_call(c, "cp_cam_gdn_num", entered, [&] {
      for (size_t i = 0; i < 5; ++i) in.require(i);
      not_null(outputs, fn, "outputs");
      const gdncp::cp::CpOptions cp_opt = cp_options_of(cp_options, fn);
      if (checkpoint < GDNCP_CHECKPOINT_OFF || checkpoint > GDNCP_CHECKPOINT_AUTO)
        argument_error(fn, ": checkpoint ", checkpoint, " is not a gdncp_checkpoint");
      gdncp_layer_options lo;  // the one mapping of gdncp_checkpoint, through the layer options
      gdncp_layer_options_init(&lo);
      lo.checkpoint = checkpoint;
      const gdncp::Checkpoint ckpt = layer_options(&lo, fn).checkpoint;
      run_layer(
          fn, in, 5, 5, requires_grad, stream, comm->c,
          [&](std::vector<Tensor>& x) {
            entered = true;
            gdncp::cp::CamResult r = gdncp::cp::cp_cam_gdn_num(c, x[0], x[1], x[2], x[3], x[4], F, S, cp_opt, ckpt);
            return std::vector<Tensor>{r.out, r.terminal_M};
          },
          outputs, 2, graph);
    });
  });
}

}  // extern "C"
