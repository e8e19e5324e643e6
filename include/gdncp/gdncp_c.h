/* gdncp/gdncp_c.h — the C ABI of gdncp (docs/design.md §11).
 *
 * The C API, for trainers outside C++ (Python through ctypes, Julia, Rust, C):
 * opaque handles, tensors in and out as DLPack DLManagedTensor without a
 * copy, and no C++ type or exception crossing it.
 *
 * Status: every function returns a gdncp_status; GDNCP_OK is 0. After a call
 * that failed, gdncp_last_error() gives its message on the calling thread
 * (thread-local; a successful call leaves it empty). Nothing here aborts.
 *
 * Tensors in (Note [DLPack ownership]): an input DLManagedTensor* is CONSUMED
 * by the call whatever its status — the library calls its deleter when it
 * no longer needs the memory (possibly after the call returns: a layer keeps
 * its inputs for backward); one tensor given for two arguments is shared by
 * both and deleted once. Inputs must be dense row-major (strides NULL or
 * compact; a tensor with no elements may have any strides), with data +
 * byte_offset aligned to the element size, f32, f64 or bf16, on the CPU or on
 * one CUDA device; a CUDA
 * call runs on that device and on `stream` (a cudaStream_t; NULL = the legacy
 * default stream), and returns once the work is enqueued.
 * Tensors out: fresh DLManagedTensor*s owned by the caller, who calls their
 * deleter (or hands them to a framework's from_dlpack, which does).
 *
 * Autograd across the C API: a layer call given a non-NULL `graph` records
 * the computation for the inputs flagged in `requires_grad` (bit i = input i
 * in the order listed at the call) and returns an opaque graph;
 * gdncp_graph_backward() runs its backward once, returning the gradients of
 * the flagged inputs; gdncp_graph_destroy() frees it (with or without a
 * backward). A graph keeps its inputs and communicator alive.
 *
 * DLPack: <dlpack/dlpack.h> as Debian's libdlpack-dev 0.6 ships it (DLPACK_VERSION
 * 60, the version torch 1.13 exchanges); the legacy DLManagedTensor used here
 * has the same layout in DLPack 0.6 to 1.x.
 */
#ifndef GDNCP_GDNCP_C_H_
#define GDNCP_GDNCP_C_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of this ABI; bumped when a declaration here changes. */
#define GDNCP_C_ABI_VERSION 2
int gdncp_abi_version(void);

typedef enum gdncp_status {
  GDNCP_OK = 0,
  GDNCP_ERROR_ARGUMENT = 1,      /* the C API's own checks: a null pointer, a bad enum, a bad DLPack tensor */
  GDNCP_ERROR = 2,               /* a gdncp::Error: bad input (named), CUDA/NCCL/MPI failure, a timeout */
  GDNCP_ERROR_OUT_OF_MEMORY = 3, /* host memory */
  GDNCP_ERROR_INTERNAL = 4       /* anything else thrown inside the library */
} gdncp_status;

/* Message of the last failed call on this thread ("" after a success); valid
 * until the next gdncp call on this thread. Never NULL. */
const char* gdncp_last_error(void);
/* "ok", "argument", "error", "out of memory", "internal". */
const char* gdncp_status_name(gdncp_status status);

/* 1 when gdncp was built with CUDA and a device is visible, else 0. */
int gdncp_cuda_available(void);

/* --- options ------------------------------------------------------------------ */
typedef enum gdncp_precision {
  GDNCP_PRECISION_AUTO = 0, /* bf16 operands for bf16 input, IEEE f32 for f32 input */
  GDNCP_PRECISION_BF16 = 1,
  GDNCP_PRECISION_TF32 = 2,
  GDNCP_PRECISION_IEEE = 3
} gdncp_precision;

typedef enum gdncp_checkpoint {
  GDNCP_CHECKPOINT_OFF = 0,
  GDNCP_CHECKPOINT_ON = 1,  /* keep only the inputs, recompute in backward */
  GDNCP_CHECKPOINT_AUTO = 2 /* on iff the call records a graph */
} gdncp_checkpoint;

/* The layer's scalars (gdncp/bigdn.h BigdnOptions). Fill with
 * gdncp_layer_options_init(), then change fields: struct_size lets later
 * versions add fields at the end. */
typedef struct gdncp_layer_options {
  size_t struct_size;
  double k_scale;  /* default 1; Sana's production blocks use D^-1/2 S^-1/2 */
  double norm_eps; /* default 1e-5 */
  double eps;      /* default 1e-6 */
  int precision;   /* gdncp_precision */
  int checkpoint;  /* gdncp_checkpoint */
  /* 0 | 1 (default 0): bitwise the same for every CP degree and frame split (docs/design.md §12) */
  int deterministic;
} gdncp_layer_options;
gdncp_status gdncp_layer_options_init(gdncp_layer_options* options);

/* Options of the CP scan (gdncp/cp.h CpOptions). */
typedef struct gdncp_cp_options {
  size_t struct_size;
  int reverse_rank_order;     /* 0 | 1 */
  int64_t truncate_to_active; /* 0 = off */
  int exchange;               /* gdncp_exchange (gdncp/cp.h Exchange); init: GDNCP_EXCHANGE_AUTO */
  int node_size;              /* ranks per node for the exchange, 0 = detect */
  int deterministic;          /* 0 | 1 (default 0): docs/design.md §12 */
  /* 0 | 1 (default 0), gdncp/cp.h CpOptions::overlap_exchange: on CUDA the all-gather exchange runs on a
   * communication stream beside the sweeps it does not read (bitwise the same results; the log and
   * hierarchical exchanges run as without it); on the CPU it changes nothing. Another value:
   * GDNCP_ERROR_ARGUMENT naming it. It lies in the tail padding of the struct before it, so struct_size
   * cannot tell an older caller's struct: fill the struct with gdncp_cp_options_init. */
  int overlap_exchange;
} gdncp_cp_options;
typedef enum gdncp_exchange {
  GDNCP_EXCHANGE_AUTO = 0,
  GDNCP_EXCHANGE_ALLGATHER = 1,
  GDNCP_EXCHANGE_LOG = 2,
  GDNCP_EXCHANGE_HIERARCHICAL = 3
} gdncp_exchange;
gdncp_status gdncp_cp_options_init(gdncp_cp_options* options);

/* --- communicators --------------------------------------------------------------- */
typedef struct gdncp_comm gdncp_comm;

/* Bootstrap without MPI: one rank makes an id (an ncclUniqueId's bytes), the
 * caller moves it to every rank by any means, then every rank calls
 * gdncp_comm_create_nccl collectively. device >= 0 becomes the calling
 * thread's current device. Both fail (GDNCP_ERROR) without CUDA. */
#define GDNCP_UNIQUE_ID_BYTES 128
gdncp_status gdncp_unique_id(unsigned char id[GDNCP_UNIQUE_ID_BYTES]);
gdncp_status gdncp_comm_create_nccl(const unsigned char id[GDNCP_UNIQUE_ID_BYTES], int rank, int size, int device,
                                    gdncp_comm** comm);

/* An MPI communicator over MPI_COMM_WORLD (CPU tensors), e.g. under mpirun.
 * Initialises MPI (MPI_Init_thread, MPI_THREAD_MULTIPLE requested) when
 * nobody has; then gdncp_mpi_finalize() ends it before the process exits. */
gdncp_status gdncp_comm_create_mpi_world(gdncp_comm** comm);
/* MPI_Finalize, if gdncp_comm_create_mpi_world initialised MPI and it is not
 * finalized yet; a no-op otherwise. Destroy the MPI communicators first.
 * After an MPI communicator of the process was aborted it returns GDNCP_OK
 * without finalizing: MPI_Finalize synchronises with every rank, a lost one
 * included, and could wait for it forever (exit the process then). */
gdncp_status gdncp_mpi_finalize(void);

/* Any process group: a communicator whose collectives the caller runs (e.g.
 * a torch.distributed group of any backend; gdncp/cp.h
 * make_callback_communicator). Each callback returns 0 on success, anything
 * else on failure; the library then aborts the communicator and fails the
 * call with GDNCP_ERROR naming the collective and error_message(user) (every
 * later call on it fails too). Pointers are memory on the communicator's
 * device (host memory for device -1); stream is the cudaStream_t the
 * collective must be ordered on (NULL on the CPU). A callback may be called
 * from any thread that calls the library (a backward on a framework's
 * device thread included), never from two at once for one communicator.
 * Deadlines: the library cannot interrupt a collective the caller runs, so
 * it has no watchdog for these and gdncp_comm_set_timeout is recorded but
 * not enforced: a hung peer ends when the caller's transport times out and
 * the callback returns an error (torch.distributed's `timeout`). */
typedef struct gdncp_comm_callbacks {
  size_t struct_size; /* sizeof(gdncp_comm_callbacks) (gdncp_comm_callbacks_init) */
  void* user;         /* handed to every callback */
  /* Required. out (size * bytes) = the `bytes` bytes at in of every rank, in rank order. */
  int (*all_gather)(void* user, void* out, const void* in, size_t bytes, void* stream);
  /* Required. root's `bytes` bytes at data to every rank. */
  int (*broadcast)(void* user, void* data, size_t bytes, int root, void* stream);
  /* Optional (the layers do not use it): sends send to dst, receives recv from src (-1 = none). */
  int (*send_recv)(void* user, const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes, int src,
                   void* stream);
  /* Optional: the message of the failure just returned by a callback on this thread (NULL = none). */
  const char* (*error_message)(void* user);
  /* Optional: called once when the communicator is freed — after gdncp_comm_destroy and every graph
   * that uses it — so the caller can free user. */
  void (*release)(void* user);
} gdncp_comm_callbacks;
/* Zeroes the struct and sets struct_size. */
gdncp_status gdncp_comm_callbacks_init(gdncp_comm_callbacks* callbacks);
/* rank in [0, size); device: -1 = CPU tensors, >= 0 = that CUDA device's tensors. Not collective (no
 * communication). On failure release is not called (the caller still owns user). */
gdncp_status gdncp_comm_create_callbacks(const gdncp_comm_callbacks* callbacks, int rank, int size, int device,
                                         gdncp_comm** comm);

/* Frees the handle (NULL is a no-op). A graph that used the communicator
 * keeps it alive until the graph is destroyed. Handles are checked: a
 * destroyed or foreign communicator or graph given to any function is
 * GDNCP_ERROR_ARGUMENT naming it. */
gdncp_status gdncp_comm_destroy(gdncp_comm* comm);
gdncp_status gdncp_comm_rank(const gdncp_comm* comm, int* rank);
gdncp_status gdncp_comm_size(const gdncp_comm* comm, int* size);
/* "mpi", "nccl" or "callbacks" (a static string). */
gdncp_status gdncp_comm_backend(const gdncp_comm* comm, const char** backend);
/* Deadline of each collective (seconds, finite and > 0; default 300). A missed
 * deadline aborts the communicator; every later call on it fails. */
gdncp_status gdncp_comm_set_timeout(gdncp_comm* comm, double seconds);
gdncp_status gdncp_comm_timeout(const gdncp_comm* comm, double* seconds);
gdncp_status gdncp_comm_aborted(const gdncp_comm* comm, int* aborted);
/* In place sum over the ranks of a tensor on the communicator's device
 * (e.g. the partial parameter gradients of a CP layer). Consumes t as any
 * input; the sum is written into its memory. */
gdncp_status gdncp_comm_all_reduce_sum(gdncp_comm* comm, DLManagedTensor* t, void* stream);

/* --- graphs (autograd across the C API) ----------------------------------------------- */
typedef struct gdncp_graph gdncp_graph;

/* Outputs and differentiable inputs of the call that made the graph. */
gdncp_status gdncp_graph_num_outputs(const gdncp_graph* graph, int* n);
gdncp_status gdncp_graph_num_inputs(const gdncp_graph* graph, int* n);
/* Backward of the graph's outputs with the given gradients (an array of
 * num_outputs entries, each consumed; NULL entries count as zeros). Writes
 * num_inputs entries into grad_inputs: the gradient of each input flagged at
 * the call, NULL for the others. Once per graph; collective for a CP layer.
 * A call refused for a gradient of the wrong shape, dtype or device leaves
 * the graph for a retry; the counts above stay after the backward. Given a
 * graph that is not live (destroyed, foreign), nothing is consumed: the
 * number of grad_outputs is unknown. */
gdncp_status gdncp_graph_backward(gdncp_graph* graph, DLManagedTensor* const* grad_outputs, void* stream,
                                  DLManagedTensor** grad_inputs);
/* Frees the graph (NULL is a no-op). */
gdncp_status gdncp_graph_destroy(gdncp_graph* graph);

/* --- the layers --------------------------------------------------------------------- */
/* Inputs (gdncp/bigdn.h for the math and layouts): 0 qkv (B, F*S, 3, H, D),
 * 1 beta (B, H, F, S), 2 decay (B, H, F), 3 q_norm_w (C) or NULL, 4 k_norm_w
 * (C) or NULL, rope_cos and rope_sin (F*S, D) (not differentiable),
 * rope_cos_q and rope_sin_q: q's own tables (F*S, D), or both NULL = q is
 * rotated with rope_cos/rope_sin (not differentiable), clip_starts: the
 * clip-start mask (B, F) f32 of docs/design.md §4a, or NULL
 * (one clip per row). Output (graph output 0): out (B, F*S, H, D). options
 * NULL = defaults. graph NULL: no recording (inference). */
gdncp_status gdncp_bigdn(DLManagedTensor* qkv, DLManagedTensor* beta, DLManagedTensor* decay, DLManagedTensor* q_norm_w,
                         DLManagedTensor* k_norm_w, DLManagedTensor* rope_cos, DLManagedTensor* rope_sin,
                         DLManagedTensor* rope_cos_q, DLManagedTensor* rope_sin_q, DLManagedTensor* clip_starts,
                         int64_t F, int64_t S, const gdncp_layer_options* options, void* stream, uint32_t requires_grad,
                         DLManagedTensor** out, gdncp_graph** graph);

/* The bidirectional CP layer (gdncp/cp.h bigdn_cp): the same inputs, this
 * rank's F frames; collective over comm (forward and backward). */
gdncp_status gdncp_bigdn_cp(gdncp_comm* comm, DLManagedTensor* qkv, DLManagedTensor* beta, DLManagedTensor* decay,
                            DLManagedTensor* q_norm_w, DLManagedTensor* k_norm_w, DLManagedTensor* rope_cos,
                            DLManagedTensor* rope_sin, DLManagedTensor* rope_cos_q, DLManagedTensor* rope_sin_q,
                            DLManagedTensor* clip_starts, int64_t F, int64_t S, const gdncp_layer_options* options,
                            void* stream, uint32_t requires_grad, DLManagedTensor** out, gdncp_graph** graph);
/* The same with CP options: only exchange, node_size and overlap_exchange apply (reverse_rank_order
 * and truncate_to_active: GDNCP_ERROR_ARGUMENT); cp_options NULL = gdncp_bigdn_cp. */
gdncp_status gdncp_bigdn_cp_ex(gdncp_comm* comm, DLManagedTensor* qkv, DLManagedTensor* beta, DLManagedTensor* decay,
                               DLManagedTensor* q_norm_w, DLManagedTensor* k_norm_w, DLManagedTensor* rope_cos,
                               DLManagedTensor* rope_sin, DLManagedTensor* rope_cos_q, DLManagedTensor* rope_sin_q,
                               DLManagedTensor* clip_starts, int64_t F, int64_t S, const gdncp_layer_options* options,
                               const gdncp_cp_options* cp_options, void* stream, uint32_t requires_grad,
                               DLManagedTensor** out, gdncp_graph** graph);

/* One direction, raw (gdncp/cp.h cp_gdn_raw): inputs as gdncp_bigdn_cp;
 * outputs (graph outputs 0-3) num (B, F*S, H, D), den (B, H, F*S), and with
 * truncate_to_active the terminal states (B*H, D, D), (B*H, D) (else NULL).
 * cp_options NULL = defaults. */
gdncp_status gdncp_cp_gdn_raw(gdncp_comm* comm, DLManagedTensor* qkv, DLManagedTensor* beta, DLManagedTensor* decay,
                              DLManagedTensor* q_norm_w, DLManagedTensor* k_norm_w, DLManagedTensor* rope_cos,
                              DLManagedTensor* rope_sin, DLManagedTensor* rope_cos_q, DLManagedTensor* rope_sin_q,
                              DLManagedTensor* clip_starts, int64_t F, int64_t S, const gdncp_layer_options* options,
                              const gdncp_cp_options* cp_options, void* stream, uint32_t requires_grad,
                              DLManagedTensor* outputs[4], gdncp_graph** graph);

/* The distributed frame scan (gdncp/cp.h cp_scan): inputs 0 P, 1 A, 2 Pz
 * (B*H, F, D, D), 3 bz (B*H, F, D), 4 decay (B, H, F); outputs M, z and with
 * truncate_to_active terminal_M, terminal_z (else NULL). */
gdncp_status gdncp_cp_scan(gdncp_comm* comm, DLManagedTensor* P, DLManagedTensor* A, DLManagedTensor* Pz,
                           DLManagedTensor* bz, DLManagedTensor* decay, DLManagedTensor* clip_starts,
                           const gdncp_cp_options* cp_options, void* stream, uint32_t requires_grad,
                           DLManagedTensor* outputs[4], gdncp_graph** graph);

/* The camera branch, numerator only (gdncp/cp.h cp_cam_gdn_num): inputs 0 q,
 * 1 k, 2 v (B, H, D, N) already rotated, 3 beta (B, H, F, S) or (B, H, F),
 * 4 decay (B, H, F), one float dtype; checkpoint a gdncp_checkpoint. Outputs
 * (graph outputs 0-1) out (B, H, D, N) and with truncate_to_active the
 * terminal state (B*H, D, D) [key][value] (else NULL). No clip mask.
 * cp_options NULL = defaults. Collective over comm (forward and backward). */
gdncp_status gdncp_cp_cam_gdn_num(gdncp_comm* comm, DLManagedTensor* q, DLManagedTensor* k, DLManagedTensor* v,
                                  DLManagedTensor* beta, DLManagedTensor* decay, int64_t F, int64_t S,
                                  const gdncp_cp_options* cp_options, int checkpoint, void* stream,
                                  uint32_t requires_grad, DLManagedTensor* outputs[2], gdncp_graph** graph);

#ifdef __cplusplus
}
#endif

#endif /* GDNCP_GDNCP_C_H_ */
