/* tests/test_capi.c — the C ABI (gdncp/gdncp_c.h) from plain C.
 *
 * One program, one case per run (`test_capi <case>`), each a ctest entry
 * CApi.<case>: exit 0 pass, 1 fail, 77 skipped. Inputs are caller-owned
 * buffers wrapped as DLManagedTensors whose deleter only counts, so the
 * tests see that every input is consumed exactly once and that the library
 * reads and writes the caller's memory in place.
 */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gdncp/gdncp_c.h"

static int g_failures = 0;
#define EXPECT(cond, ...)                                                \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "%s:%d: failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                      \
      fprintf(stderr, "\n");                                             \
      ++g_failures;                                                      \
    }                                                                    \
  } while (0)

/* The MPI world as a gdncp communicator, or NULL after a failed expectation. */
static gdncp_comm* mpi_world(void) {
  gdncp_comm* comm = NULL;
  const gdncp_status st = gdncp_comm_create_mpi_world(&comm);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  return st == GDNCP_OK ? comm : NULL;
}

/* --- caller-owned tensors ------------------------------------------------------ */
typedef struct Blob {
  DLManagedTensor m;
  int64_t shape[8];
  int64_t strides[8];
  int deleted; /* deleter calls */
} Blob;

static void count_delete(DLManagedTensor* self) { ((Blob*)self->manager_ctx)->deleted += 1; }

/* Wraps data (caller-owned) as a dense row-major DLPack tensor; deleter counts. */
static DLManagedTensor* wrap(Blob* b, void* data, uint8_t code, uint8_t bits, int ndim, const int64_t* shape) {
  memset(b, 0, sizeof *b);
  memcpy(b->shape, shape, (size_t)ndim * sizeof(int64_t));
  b->m.dl_tensor.data = data;
  b->m.dl_tensor.device.device_type = kDLCPU;
  b->m.dl_tensor.device.device_id = 0;
  b->m.dl_tensor.ndim = ndim;
  b->m.dl_tensor.dtype.code = code;
  b->m.dl_tensor.dtype.bits = bits;
  b->m.dl_tensor.dtype.lanes = 1;
  b->m.dl_tensor.shape = b->shape;
  b->m.dl_tensor.strides = NULL;
  b->m.manager_ctx = b;
  b->m.deleter = count_delete;
  return &b->m;
}

static DLManagedTensor* wrap_f64(Blob* b, double* data, int ndim, const int64_t* shape) {
  return wrap(b, data, kDLFloat, 64, ndim, shape);
}

static int64_t numel(const DLTensor* t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

static void release(DLManagedTensor* m) {
  if (m && m->deleter) m->deleter(m);
}

/* Seeded uniform on [lo, hi). */
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static double uniform(double lo, double hi) {
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return lo + (hi - lo) * (double)(g_rng >> 11) * (1.0 / 9007199254740992.0);
}

/* --- a small layer problem in f64 ------------------------------------------------ */
enum { B = 1, H = 2, D = 4, F = 3, S = 2, N = F * S, C = H * D };
typedef struct Layer {
  double qkv[B * N * 3 * H * D], beta[B * H * F * S], decay[B * H * F], qw[C], kw[C], cos_[N * D], sin_[N * D];
  Blob b[7];
} Layer;

static void layer_init(Layer* L) {
  for (size_t i = 0; i < sizeof L->qkv / sizeof(double); ++i) L->qkv[i] = uniform(-1.0, 1.0);
  for (size_t i = 0; i < sizeof L->beta / sizeof(double); ++i) L->beta[i] = uniform(0.1, 0.9);
  for (size_t i = 0; i < sizeof L->decay / sizeof(double); ++i) L->decay[i] = uniform(0.5, 0.99);
  for (int i = 0; i < C; ++i) L->qw[i] = uniform(0.5, 1.5), L->kw[i] = uniform(0.5, 1.5);
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < D / 2; ++i) {
      const double theta = n * pow(10000.0, -2.0 * i / D);
      L->cos_[n * D + 2 * i] = L->cos_[n * D + 2 * i + 1] = cos(theta);
      L->sin_[n * D + 2 * i] = -sin(theta);
      L->sin_[n * D + 2 * i + 1] = sin(theta);
    }
}

/* The seven inputs of gdncp_bigdn over L's buffers (counts reset). */
static void layer_wrap(Layer* L, DLManagedTensor* in[7]) {
  const int64_t s_qkv[] = {B, N, 3, H, D}, s_beta[] = {B, H, F, S}, s_decay[] = {B, H, F}, s_w[] = {C},
                s_rope[] = {N, D};
  in[0] = wrap_f64(&L->b[0], L->qkv, 5, s_qkv);
  in[1] = wrap_f64(&L->b[1], L->beta, 4, s_beta);
  in[2] = wrap_f64(&L->b[2], L->decay, 3, s_decay);
  in[3] = wrap_f64(&L->b[3], L->qw, 1, s_w);
  in[4] = wrap_f64(&L->b[4], L->kw, 1, s_w);
  in[5] = wrap_f64(&L->b[5], L->cos_, 2, s_rope);
  in[6] = wrap_f64(&L->b[6], L->sin_, 2, s_rope);
}

static int all_deleted_once(const Layer* L) {
  for (int i = 0; i < 7; ++i)
    if (L->b[i].deleted != 1) return 0;
  return 1;
}

static gdncp_status layer_call(Layer* L, const gdncp_layer_options* opt, uint32_t mask, DLManagedTensor** out,
                               gdncp_graph** graph) {
  DLManagedTensor* in[7];
  layer_wrap(L, in);
  return gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL, NULL, F, S, opt, NULL, mask, out,
                     graph);
}

/* Σ w·out over the layer's output (w fixed per element). */
static double weighted_sum(const DLManagedTensor* out) {
  const double* y = (const double*)out->dl_tensor.data;
  double s = 0;
  for (int64_t i = 0; i < numel(&out->dl_tensor); ++i) s += y[i] * sin(0.37 * (double)i + 0.1);
  return s;
}

/* --- cases ------------------------------------------------------------------------- */

static void case_status(void) {
  EXPECT(gdncp_abi_version() == GDNCP_C_ABI_VERSION, "abi %d", gdncp_abi_version());
  gdncp_status st = gdncp_layer_options_init(NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT, "status %d", st);
  EXPECT(strstr(gdncp_last_error(), "options") != NULL, "message '%s'", gdncp_last_error());
  EXPECT(strcmp(gdncp_status_name(st), "argument") == 0, "%s", gdncp_status_name(st));
  gdncp_layer_options o;
  st = gdncp_layer_options_init(&o);
  EXPECT(st == GDNCP_OK, "status %d", st);
  EXPECT(gdncp_last_error()[0] == '\0', "a success leaves no message, got '%s'", gdncp_last_error());
  EXPECT(o.struct_size == sizeof o && o.k_scale == 1.0 && o.norm_eps == 1e-5 && o.eps == 1e-6, "defaults");
  EXPECT(o.deterministic == 0, "deterministic defaults to off, got %d", o.deterministic);
  gdncp_cp_options co;
  st = gdncp_cp_options_init(&co);
  EXPECT(st == GDNCP_OK && co.struct_size == sizeof co && co.deterministic == 0 && co.overlap_exchange == 0,
         "cp defaults");
  /* A NULL handle names the argument. */
  st = gdncp_comm_set_timeout(NULL, 1.0);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "comm") != NULL, "%d '%s'", st, gdncp_last_error());
  /* The NCCL bootstrap: a bad rank, or no CUDA build or no GPU, fails with a
   * message (a CUDA build makes the id without a GPU; the communicator fails). */
  unsigned char id[GDNCP_UNIQUE_ID_BYTES] = {0};
  gdncp_comm* c = NULL;
  st = gdncp_comm_create_nccl(id, 2, 2, 0, &c);
  EXPECT(st == GDNCP_ERROR && c == NULL && strstr(gdncp_last_error(), "make_nccl_communicator") != NULL, "%d '%s'", st,
         gdncp_last_error());
  if (!gdncp_cuda_available()) {
    st = gdncp_unique_id(id);
    if (st != GDNCP_OK) {
      EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "unique_id") != NULL, "%d '%s'", st, gdncp_last_error());
    } else {
      st = gdncp_comm_create_nccl(id, 0, 1, 0, &c);
      EXPECT(st == GDNCP_ERROR && c == NULL && strstr(gdncp_last_error(), "device") != NULL, "%d '%s'", st,
             gdncp_last_error());
    }
  }
}

typedef struct ThreadArg {
  const char* which; /* the argument the thread gets wrong */
  int rounds;
  int ok;
} ThreadArg;

static void* thread_body(void* p) {
  ThreadArg* a = (ThreadArg*)p;
  a->ok = 1;
  for (int r = 0; r < a->rounds; ++r) {
    gdncp_status st;
    if (strcmp(a->which, "rank") == 0) {
      st = gdncp_comm_rank(NULL, NULL);
    } else {
      gdncp_layer_options o;
      gdncp_layer_options_init(&o);
      o.precision = 99;
      DLManagedTensor* out = NULL;
      Layer* L = (Layer*)calloc(1, sizeof(Layer));
      layer_init(L);
      st = layer_call(L, &o, 0, &out, NULL);
      free(L);
    }
    const char* msg = gdncp_last_error();
    if (st != GDNCP_ERROR_ARGUMENT || strstr(msg, a->which) == NULL) a->ok = 0;
  }
  return NULL;
}

static void case_thread_messages(void) {
  /* This thread's message survives other threads' failures. */
  gdncp_layer_options_init(NULL);
  char mine[512];
  snprintf(mine, sizeof mine, "%s", gdncp_last_error());
  ThreadArg a = {"rank", 200, 0}, b = {"precision", 200, 0};
  pthread_t ta, tb;
  pthread_create(&ta, NULL, thread_body, &a);
  pthread_create(&tb, NULL, thread_body, &b);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  EXPECT(a.ok, "thread 'rank' read another thread's message");
  EXPECT(b.ok, "thread 'precision' read another thread's message");
  EXPECT(strcmp(mine, gdncp_last_error()) == 0, "main thread's message changed to '%s'", gdncp_last_error());
}

static void case_bad_argument(void) {
  Layer* L = (Layer*)calloc(1, sizeof(Layer));
  layer_init(L);
  DLManagedTensor* in[7];
  DLManagedTensor* out = NULL;

  /* NULL beta: the door's own check, naming it; every other input consumed. */
  layer_wrap(L, in);
  gdncp_status st =
      gdncp_bigdn(in[0], NULL, in[2], in[3], in[4], in[5], in[6], NULL, NULL, NULL, F, S, NULL, NULL, 0, &out, NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "beta") != NULL, "%d '%s'", st, gdncp_last_error());
  EXPECT(L->b[0].deleted == 1 && L->b[1].deleted == 0 && L->b[6].deleted == 1, "inputs consumed once");
  EXPECT(out == NULL, "no output on failure");

  /* A DLPack dtype the library does not take (int32), naming qkv. */
  layer_wrap(L, in);
  in[0]->dl_tensor.dtype.code = kDLInt;
  in[0]->dl_tensor.dtype.bits = 32;
  st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL, NULL, F, S, NULL, NULL, 0, &out, NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "qkv") != NULL, "%d '%s'", st, gdncp_last_error());
  EXPECT(all_deleted_once(L), "inputs consumed once");

  /* Non-contiguous strides, naming decay. */
  layer_wrap(L, in);
  int64_t strides[3] = {1, 1, 2};
  in[2]->dl_tensor.strides = strides;
  st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL, NULL, F, S, NULL, NULL, 0, &out, NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "decay") != NULL &&
             strstr(gdncp_last_error(), "contiguous") != NULL,
         "%d '%s'", st, gdncp_last_error());
  EXPECT(all_deleted_once(L), "inputs consumed once");

  /* A wrong size the library itself finds (F·S != N): gdncp::Error, naming the argument. */
  layer_wrap(L, in);
  st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL, NULL, F + 1, S, NULL, NULL, 0, &out,
                   NULL);
  EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "qkv") != NULL, "%d '%s'", st, gdncp_last_error());
  EXPECT(all_deleted_once(L), "inputs consumed once");
  EXPECT(out == NULL, "no output on failure");

  /* The same failure in a call that records a graph: no graph, inputs consumed once. */
  {
    gdncp_graph* fg = NULL;
    layer_wrap(L, in);
    st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL, NULL, F + 1, S, NULL, NULL, 0x1f,
                     &out, &fg);
    EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "qkv") != NULL, "%d '%s'", st, gdncp_last_error());
    EXPECT(fg == NULL && out == NULL && all_deleted_once(L), "no graph, no output, inputs consumed once");
  }

  /* A clip mask of the wrong shape, (B, F + 1): refused by name, and consumed. */
  {
    float clip[B * (F + 1)] = {0};
    Blob cb;
    const int64_t cs[] = {B, F + 1};
    layer_wrap(L, in);
    st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL, wrap(&cb, clip, kDLFloat, 32, 2, cs),
                     F, S, NULL, NULL, 0, &out, NULL);
    EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "clip_starts") != NULL, "%d '%s'", st, gdncp_last_error());
    EXPECT(all_deleted_once(L) && cb.deleted == 1, "inputs consumed once");
  }

  /* requires_grad flags beyond the five differentiable inputs. */
  gdncp_graph* g = NULL;
  st = layer_call(L, NULL, 1u << 5, &out, &g);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "requires_grad") != NULL, "%d '%s'", st,
         gdncp_last_error());
  EXPECT(g == NULL && all_deleted_once(L), "no graph, inputs consumed");

  free(L);
}

/* Forward + backward through the door on caller buffers: the graph holds the
 * inputs until it is destroyed, and every gradient matches a central
 * difference of the door's own forward. */
static void case_bigdn_backward(void) {
  Layer* L = (Layer*)calloc(1, sizeof(Layer));
  layer_init(L);
  gdncp_layer_options o;
  gdncp_layer_options_init(&o);
  o.k_scale = 1.0 / sqrt((double)(D * S));
  DLManagedTensor* out = NULL;
  gdncp_graph* g = NULL;
  gdncp_status st = layer_call(L, &o, 0x1f, &out, &g);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  if (st != GDNCP_OK) return;
  int n_out = 0, n_in = 0;
  gdncp_graph_num_outputs(g, &n_out);
  gdncp_graph_num_inputs(g, &n_in);
  EXPECT(n_out == 1 && n_in == 5, "graph %d outputs, %d inputs", n_out, n_in);
  const DLTensor* y = &out->dl_tensor;
  EXPECT(y->ndim == 4 && y->shape[0] == B && y->shape[1] == N && y->shape[2] == H && y->shape[3] == D, "out shape");
  EXPECT(y->dtype.code == kDLFloat && y->dtype.bits == 64 && y->device.device_type == kDLCPU, "out dtype/device");
  EXPECT(y->strides == NULL || (y->strides[3] == 1 && y->strides[2] == D), "out dense");
  EXPECT(L->b[0].deleted == 0, "the graph keeps qkv for backward");
  const double loss0 = weighted_sum(out);

  /* grad_out = w (the weights of weighted_sum), in a caller buffer. */
  double* w = (double*)malloc((size_t)numel(y) * sizeof(double));
  for (int64_t i = 0; i < numel(y); ++i) w[i] = sin(0.37 * (double)i + 0.1);
  Blob gb;
  const int64_t ys[] = {B, N, H, D};
  DLManagedTensor* grad_out[1] = {wrap_f64(&gb, w, 4, ys)};
  DLManagedTensor* grads[5] = {0};
  st = gdncp_graph_backward(g, grad_out, NULL, grads);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  EXPECT(gb.deleted == 1, "grad_out consumed");
  /* A second backward is refused. */
  DLManagedTensor* again[5] = {0};
  const gdncp_status st2 = gdncp_graph_backward(g, NULL, NULL, again);
  EXPECT(st2 == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "once") != NULL, "%d '%s'", st2, gdncp_last_error());
  gdncp_graph_destroy(g);
  EXPECT(all_deleted_once(L), "every input released once the graph is gone");
  release(out);

  /* Directional derivative along a random direction, per input, vs the door's gradient. */
  double* bufs[5] = {L->qkv, L->beta, L->decay, L->qw, L->kw};
  const int64_t sizes[5] = {B * N * 3 * H * D, B * H * F * S, B * H * F, C, C};
  const char* names[5] = {"qkv", "beta", "decay", "q_norm_w", "k_norm_w"};
  int checked = 0;
  for (int k = 0; k < 5 && st == GDNCP_OK; ++k) {
    EXPECT(grads[k] != NULL && numel(&grads[k]->dl_tensor) == sizes[k], "grad %s", names[k]);
    if (!grads[k]) continue;
    const double* gk = (const double*)grads[k]->dl_tensor.data;
    double* dir = (double*)malloc((size_t)sizes[k] * sizeof(double));
    double analytic = 0;
    for (int64_t i = 0; i < sizes[k]; ++i) dir[i] = uniform(-1.0, 1.0), analytic += gk[i] * dir[i];
    const double h = 1e-6;
    double lp = 0, lm = 0;
    for (int sgn = 1; sgn >= -1; sgn -= 2) {
      for (int64_t i = 0; i < sizes[k]; ++i) bufs[k][i] += sgn * h * dir[i];
      DLManagedTensor* o2 = NULL;
      st = layer_call(L, &o, 0, &o2, NULL);
      EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
      if (st == GDNCP_OK) *(sgn > 0 ? &lp : &lm) = weighted_sum(o2);
      release(o2);
      for (int64_t i = 0; i < sizes[k]; ++i) bufs[k][i] -= sgn * h * dir[i];
    }
    const double numeric = (lp - lm) / (2 * h);
    /* tests/util/tolerance.h tol::gradcheck */
    const double rel = fabs(numeric - analytic) / fmax(fabs(analytic), 1e-300);
    EXPECT(rel <= 1e-8, "d loss / d %s: door %.17g, central difference %.17g (rel %.3g)", names[k], analytic, numeric,
           rel);
    printf("d loss / d %-8s door %+.12e  central difference %+.12e  rel %.2e\n", names[k], analytic, numeric, rel);
    free(dir);
    release(grads[k]);
    ++checked;
  }
  EXPECT(checked == 5, "checked %d of 5 gradients", checked);
  (void)loss0;
  free(w);
  free(L);
}

/* gdncp_cp_options' exchange fields: a value out of range is refused by name; a caller built
 * against the first version of the struct (struct_size without them) still runs. */
static void cp_options_exchange(gdncp_comm* comm) {
  float P[4] = {0.1f, 0, 0, 0.1f}, A[4] = {1, 2, 3, 4}, Pz[4] = {0.1f, 0, 0, 0.1f}, bz[2] = {1, 2}, dc[1] = {0.5f};
  const int64_t s4[] = {1, 1, 2, 2}, s3[] = {1, 1, 2}, sd[] = {1, 1, 1};
  for (int round = 0; round < 2; ++round) {
    Blob b[5];
    gdncp_cp_options o;
    EXPECT(gdncp_cp_options_init(&o) == GDNCP_OK && o.exchange == GDNCP_EXCHANGE_AUTO && o.node_size == 0, "init");
    if (round == 0) {
      o.exchange = 9;
    } else {
      o.exchange = 9; /* beyond the first version's struct_size: not read */
      o.struct_size = offsetof(gdncp_cp_options, exchange);
    }
    DLManagedTensor* outs[4] = {NULL, NULL, NULL, NULL};
    const gdncp_status st =
        gdncp_cp_scan(comm, wrap(&b[0], P, kDLFloat, 32, 4, s4), wrap(&b[1], A, kDLFloat, 32, 4, s4),
                      wrap(&b[2], Pz, kDLFloat, 32, 4, s4), wrap(&b[3], bz, kDLFloat, 32, 3, s3),
                      wrap(&b[4], dc, kDLFloat, 32, 3, sd), NULL, &o, NULL, 0, outs, NULL);
    if (round == 0)
      EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "cp_options->exchange 9") != NULL, "%d '%s'", st,
             gdncp_last_error());
    else
      EXPECT(st == GDNCP_OK && outs[0] != NULL, "first-version struct: %d '%s'", st, gdncp_last_error());
    for (int k = 0; k < 4; ++k) release(outs[k]);
  }
}

/* In place through the door: a 1-rank MPI world sums into the caller's buffer
 * (the result lands in the same memory; nothing is copied out). */
static void case_dlpack_in_place(void) {
  gdncp_comm* comm = mpi_world();
  if (!comm) return;
  gdncp_status st;
  int rank = -1, size = -1;
  const char* backend = NULL;
  gdncp_comm_rank(comm, &rank);
  gdncp_comm_size(comm, &size);
  gdncp_comm_backend(comm, &backend);
  EXPECT(rank == 0 && size == 1 && backend && strcmp(backend, "mpi") == 0, "rank %d size %d backend %s", rank, size,
         backend ? backend : "?");
  EXPECT(gdncp_comm_set_timeout(comm, 0.0) == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "seconds"),
         "timeout 0: '%s'", gdncp_last_error());
  EXPECT(gdncp_comm_set_timeout(comm, NAN) == GDNCP_ERROR_ARGUMENT, "timeout NaN");
  double t = 0;
  EXPECT(gdncp_comm_set_timeout(comm, 42.5) == GDNCP_OK && gdncp_comm_timeout(comm, &t) == GDNCP_OK && t == 42.5,
         "timeout %g", t);
  float v[6] = {1, 2, 3, 4, 5, 6};
  Blob b;
  const int64_t shape[] = {2, 3};
  DLManagedTensor* m = wrap(&b, v, kDLFloat, 32, 2, shape);
  st = gdncp_comm_all_reduce_sum(comm, m, NULL);
  EXPECT(st == GDNCP_OK && b.deleted == 1, "%d '%s', deleted %d", st, gdncp_last_error(), b.deleted);
  EXPECT(v[0] == 1 && v[5] == 6, "one rank's sum is itself, in place");
  /* A bf16 view of the same bytes is accepted too (dtype through DLPack). */
  m = wrap(&b, v, kDLBfloat, 16, 2, shape);
  EXPECT(gdncp_comm_all_reduce_sum(comm, m, NULL) == GDNCP_OK, "bf16: '%s'", gdncp_last_error());
  /* An int tensor is refused, naming the argument t. */
  m = wrap(&b, v, kDLInt, 32, 2, shape);
  st = gdncp_comm_all_reduce_sum(comm, m, NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "t:") != NULL && b.deleted == 1, "%d '%s'", st,
         gdncp_last_error());
  cp_options_exchange(comm);
  EXPECT(gdncp_comm_destroy(comm) == GDNCP_OK, "destroy");
  EXPECT(gdncp_mpi_finalize() == GDNCP_OK, "finalize: '%s'", gdncp_last_error());
}

/* The hidden exchange (gdncp_cp_options.overlap_exchange) on the MPI world's CPU ranks: accepted and
 * changing nothing — out and every gradient of the bidirectional layer and of one raw direction
 * bitwise the same with it on and off, under the all-gather and the log exchange; a value other
 * than 0 or 1 refused on every rank, naming the field; a struct of the size before it does not
 * read it. Runs on any number of ranks (ctest: CApi.OverlapExchange and .np2 under mpirun). */
static double* copy_out(const DLManagedTensor* t) {
  const size_t bytes = (size_t)numel(&t->dl_tensor) * sizeof(double);
  double* c = (double*)malloc(bytes);
  memcpy(c, t->dl_tensor.data, bytes);
  return c;
}

typedef struct ExchangeRun {
  double* got[6]; /* out, then the gradients of qkv, beta, decay, q_norm_w, k_norm_w */
  int64_t n[6];
} ExchangeRun;

/* One forward and backward of entry 0 (gdncp_bigdn_cp_ex) or 1 (gdncp_cp_gdn_raw, num only) on L,
 * the output gradient sin(0.37 i + 0.1); copies of out and the five gradients into r. */
static gdncp_status exchange_run(gdncp_comm* comm, Layer* L, int entry, const gdncp_cp_options* co, ExchangeRun* r) {
  DLManagedTensor* in[7];
  layer_wrap(L, in);
  gdncp_layer_options o;
  gdncp_layer_options_init(&o);
  o.k_scale = 1.0 / sqrt((double)(D * S));
  DLManagedTensor* outs[4] = {NULL, NULL, NULL, NULL};
  gdncp_graph* g = NULL;
  gdncp_status st = entry == 0 ? gdncp_bigdn_cp_ex(comm, in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL,
                                                   NULL, F, S, &o, co, NULL, 0x1f, &outs[0], &g)
                               : gdncp_cp_gdn_raw(comm, in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL,
                                                  NULL, F, S, &o, co, NULL, 0x1f, outs, &g);
  if (st != GDNCP_OK) return st;
  Blob gb;
  const DLTensor* y = &outs[0]->dl_tensor;
  double* w = (double*)malloc((size_t)numel(y) * sizeof(double));
  for (int64_t i = 0; i < numel(y); ++i) w[i] = sin(0.37 * (double)i + 0.1);
  DLManagedTensor* grad_out[4] = {wrap_f64(&gb, w, y->ndim, y->shape), NULL, NULL, NULL};
  DLManagedTensor* grads[5] = {0};
  st = gdncp_graph_backward(g, grad_out, NULL, grads);
  if (st == GDNCP_OK) {
    r->got[0] = copy_out(outs[0]), r->n[0] = numel(y);
    for (int k = 0; k < 5; ++k) r->got[k + 1] = copy_out(grads[k]), r->n[k + 1] = numel(&grads[k]->dl_tensor);
  }
  for (int k = 0; k < 5; ++k) release(grads[k]);
  for (int k = 0; k < 4; ++k) release(outs[k]);
  gdncp_graph_destroy(g);
  free(w);
  return st;
}

static void case_OverlapExchange(void) {
  gdncp_comm* comm = mpi_world();
  if (!comm) return;
  gdncp_status st;
  int rank = -1, size = -1;
  gdncp_comm_rank(comm, &rank);
  gdncp_comm_size(comm, &size);
  g_rng ^= (uint64_t)time(NULL) * 0x2545F4914F6CDD1Dull + (uint64_t)rank; /* fresh inputs, each rank its own */
  Layer* L = (Layer*)calloc(1, sizeof(Layer));
  layer_init(L);
  const char* names[6] = {"out", "d qkv", "d beta", "d decay", "d q_norm_w", "d k_norm_w"};
  const int exchanges[2] = {GDNCP_EXCHANGE_ALLGATHER, GDNCP_EXCHANGE_LOG};
  int compared = 0;
  for (int entry = 0; entry < 2; ++entry)
    for (int x = 0; x < 2; ++x) {
      ExchangeRun run[2];
      memset(run, 0, sizeof run);
      for (int on = 0; on < 2; ++on) {
        gdncp_cp_options co;
        gdncp_cp_options_init(&co);
        co.exchange = exchanges[x];
        co.overlap_exchange = on;
        st = exchange_run(comm, L, entry, &co, &run[on]);
        EXPECT(st == GDNCP_OK, "entry %d exchange %d overlap %d: %d '%s'", entry, exchanges[x], on, st,
               gdncp_last_error());
      }
      for (int k = 0; k < 6; ++k) {
        if (!run[0].got[k] || !run[1].got[k]) continue;
        EXPECT(run[0].n[k] == run[1].n[k] &&
                   memcmp(run[0].got[k], run[1].got[k], (size_t)run[0].n[k] * sizeof(double)) == 0,
               "rank %d, entry %d, exchange %d: %s differs with overlap_exchange on", rank, entry, exchanges[x],
               names[k]);
        ++compared;
      }
      for (int on = 0; on < 2; ++on)
        for (int k = 0; k < 6; ++k) free(run[on].got[k]);
    }
  EXPECT(compared == 24, "compared %d of 24 tensors", compared);

  /* A bad value on every rank: each names the field. On rank 0 alone: every rank fails, rank 0
   * naming the field; the communicator stays usable. */
  for (int only_rank0 = 0; only_rank0 < (size > 1 ? 2 : 1); ++only_rank0) {
    gdncp_cp_options co;
    gdncp_cp_options_init(&co);
    if (!only_rank0 || rank == 0) co.overlap_exchange = 2;
    ExchangeRun r;
    memset(&r, 0, sizeof r);
    st = exchange_run(comm, L, 0, &co, &r);
    if (co.overlap_exchange == 2)
      EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "cp_options->overlap_exchange 2") != NULL,
             "rank %d: %d '%s'", rank, st, gdncp_last_error());
    else
      EXPECT(st != GDNCP_OK, "rank %d: a bad value on rank 0 fails here too", rank);
    for (int k = 0; k < 6; ++k) free(r.got[k]);
  }
  /* A caller's struct of the size before overlap_exchange: the field is not read. */
  gdncp_cp_options co;
  gdncp_cp_options_init(&co);
  co.overlap_exchange = 7;
  co.struct_size = offsetof(gdncp_cp_options, overlap_exchange);
  ExchangeRun r;
  memset(&r, 0, sizeof r);
  st = exchange_run(comm, L, 0, &co, &r);
  EXPECT(st == GDNCP_OK, "older struct: %d '%s'", st, gdncp_last_error());
  for (int k = 0; k < 6; ++k) free(r.got[k]);
  printf("rank %d of %d: %d tensors bitwise equal with overlap_exchange on and off\n", rank, size, compared);
  free(L);
  EXPECT(gdncp_comm_destroy(comm) == GDNCP_OK, "destroy");
  EXPECT(gdncp_mpi_finalize() == GDNCP_OK, "finalize: '%s'", gdncp_last_error());
}

/* The camera branch through the door on a 1-rank MPI world: out and the
 * truncated terminal state against the recurrence coded here (S = S W + U,
 * out = S q), every gradient against a central difference of that coding. */
enum { CB = 1, CH = 2, CD = 4, CF = 3, CS = 2, CN = CF * CS, CK = 2 /* truncate_to_active */ };
typedef struct Cam {
  double x[5][CB * CH * CD * CN]; /* q, k, v (B, H, D, N); beta (B, H, F, S); decay (B, H, F) */
  Blob b[5];
} Cam;
static const int64_t kCamSizes[5] = {CB * CH * CD * CN, CB* CH* CD* CN, CB* CH* CD* CN, CB* CH* CF* CS, CB* CH* CF};

/* out (B, H, D, N) under truncate_to_active = CK and the state after frame CK-1 as [key][value] (B*H, D, D). */
static void cam_reference(const Cam* c, double* out, double* terminal) {
  const double *q = c->x[0], *k = c->x[1], *v = c->x[2], *beta = c->x[3], *decay = c->x[4];
  for (int bh = 0; bh < CB * CH; ++bh) {
    double St[CD][CD] = {{0}}; /* [value][key] */
    for (int f = 0; f < CF; ++f) {
      double W[CD][CD], U[CD][CD] = {{0}}, next[CD][CD];
      const double g = decay[bh * CF + f];
      for (int i = 0; i < CD; ++i)
        for (int j = 0; j < CD; ++j) W[i][j] = (i == j);
      for (int s = 0; s < CS; ++s) {
        const int n = f * CS + s;
        const double bt = beta[(bh * CF + f) * CS + s];
        for (int i = 0; i < CD; ++i)
          for (int j = 0; j < CD; ++j) {
            const double kj = k[(bh * CD + j) * CN + n];
            W[i][j] -= bt * k[(bh * CD + i) * CN + n] * kj;
            U[i][j] += bt * v[(bh * CD + i) * CN + n] * kj;
          }
      }
      for (int i = 0; i < CD; ++i)
        for (int j = 0; j < CD; ++j) {
          double a = U[i][j];
          for (int l = 0; l < CD; ++l) a += St[i][l] * g * W[l][j];
          next[i][j] = a;
        }
      if (f < CK) memcpy(St, next, sizeof St); /* truncate_to_active: later frames keep the state */
      for (int s = 0; s < CS; ++s)
        for (int i = 0; i < CD; ++i) {
          double a = 0;
          for (int j = 0; j < CD; ++j) a += St[i][j] * q[(bh * CD + j) * CN + f * CS + s];
          out[(bh * CD + i) * CN + f * CS + s] = a;
        }
      if (f == CK - 1 && terminal)
        for (int i = 0; i < CD; ++i)
          for (int j = 0; j < CD; ++j) terminal[(bh * CD + j) * CD + i] = St[i][j];
    }
  }
}

static double cam_loss(const double* out) {
  double s = 0;
  for (int i = 0; i < CB * CH * CD * CN; ++i) s += out[i] * sin(0.37 * i + 0.1);
  return s;
}

static void case_cam_gdn_num(void) {
  gdncp_comm* comm = mpi_world();
  if (!comm) return;
  gdncp_status st;
  Cam* c = (Cam*)calloc(1, sizeof(Cam));
  for (int t = 0; t < 5; ++t)
    for (int64_t i = 0; i < kCamSizes[t]; ++i)
      c->x[t][i] = t < 3 ? uniform(-0.6, 0.6) : t == 3 ? uniform(0.1, 0.9) : uniform(0.5, 0.99);
  const int64_t s_qkv[] = {CB, CH, CD, CN}, s_beta[] = {CB, CH, CF, CS}, s_decay[] = {CB, CH, CF};
  const int64_t* shapes[5] = {s_qkv, s_qkv, s_qkv, s_beta, s_decay};
  const int ndims[5] = {4, 4, 4, 4, 3};
  DLManagedTensor* in[5];
  for (int t = 0; t < 5; ++t) in[t] = wrap_f64(&c->b[t], c->x[t], ndims[t], shapes[t]);
  gdncp_cp_options co;
  gdncp_cp_options_init(&co);
  co.truncate_to_active = CK;
  DLManagedTensor* outs[2] = {0};
  gdncp_graph* g = NULL;
  st = gdncp_cp_cam_gdn_num(comm, in[0], in[1], in[2], in[3], in[4], CF, CS, &co, GDNCP_CHECKPOINT_OFF, NULL, 0x1f,
                            outs, &g);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  if (st == GDNCP_OK) {
    static double out_ref[CB * CH * CD * CN], term_ref[CB * CH * CD * CD];
    cam_reference(c, out_ref, term_ref);
    EXPECT(outs[0] && numel(&outs[0]->dl_tensor) == CB * CH * CD * CN && outs[0]->dl_tensor.ndim == 4, "out shape");
    EXPECT(outs[1] && numel(&outs[1]->dl_tensor) == CB * CH * CD * CD && outs[1]->dl_tensor.ndim == 3,
           "terminal shape");
    double err = 0, ref = 0;
    for (int i = 0; outs[0] && i < CB * CH * CD * CN; ++i) {
      const double d = ((const double*)outs[0]->dl_tensor.data)[i] - out_ref[i];
      err += d * d, ref += out_ref[i] * out_ref[i];
    }
    for (int i = 0; outs[1] && i < CB * CH * CD * CD; ++i) {
      const double d = ((const double*)outs[1]->dl_tensor.data)[i] - term_ref[i];
      err += d * d, ref += term_ref[i] * term_ref[i];
    }
    EXPECT(sqrt(err / ref) <= 1e-12, "out and terminal state: rel %.3g", sqrt(err / ref));
    /* Backward of loss = Σ w·out, each gradient along a random direction vs a central difference. */
    static double w[CB * CH * CD * CN];
    for (int i = 0; i < CB * CH * CD * CN; ++i) w[i] = sin(0.37 * i + 0.1);
    Blob gb;
    DLManagedTensor* grad_out[2] = {wrap_f64(&gb, w, 4, s_qkv), NULL};
    DLManagedTensor* grads[5] = {0};
    st = gdncp_graph_backward(g, grad_out, NULL, grads);
    EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
    const char* names[5] = {"q", "k", "v", "beta", "decay"};
    for (int t = 0; t < 5 && st == GDNCP_OK; ++t) {
      EXPECT(grads[t] && numel(&grads[t]->dl_tensor) == kCamSizes[t], "grad %s", names[t]);
      if (!grads[t]) continue;
      double analytic = 0, lp = 0, lm = 0;
      static double dir[CB * CH * CD * CN], o2[CB * CH * CD * CN];
      for (int64_t i = 0; i < kCamSizes[t]; ++i)
        dir[i] = uniform(-1.0, 1.0), analytic += ((const double*)grads[t]->dl_tensor.data)[i] * dir[i];
      const double h = 1e-6;
      for (int sgn = 1; sgn >= -1; sgn -= 2) {
        for (int64_t i = 0; i < kCamSizes[t]; ++i) c->x[t][i] += sgn * h * dir[i];
        cam_reference(c, o2, NULL);
        *(sgn > 0 ? &lp : &lm) = cam_loss(o2);
        for (int64_t i = 0; i < kCamSizes[t]; ++i) c->x[t][i] -= sgn * h * dir[i];
      }
      const double numeric = (lp - lm) / (2 * h), rel = fabs(numeric - analytic) / fmax(fabs(analytic), 1e-300);
      EXPECT(rel <= 1e-8, "d loss / d %s: door %.17g, central difference %.17g (rel %.3g)", names[t], analytic, numeric,
             rel);
      printf("d loss / d %-6s door %+.12e  central difference %+.12e  rel %.2e\n", names[t], analytic, numeric, rel);
      release(grads[t]);
    }
  }
  gdncp_graph_destroy(g);
  release(outs[0]);
  release(outs[1]);
  for (int t = 0; t < 5; ++t) EXPECT(c->b[t].deleted == 1, "input %d released once", t);
  /* A bad checkpoint value and a missing input are refused, naming them; the inputs are consumed. */
  for (int t = 0; t < 5; ++t) in[t] = wrap_f64(&c->b[t], c->x[t], ndims[t], shapes[t]);
  st = gdncp_cp_cam_gdn_num(comm, in[0], in[1], in[2], in[3], in[4], CF, CS, NULL, 7, NULL, 0, outs, NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "checkpoint"), "%d '%s'", st, gdncp_last_error());
  for (int t = 0; t < 4; ++t) in[t] = wrap_f64(&c->b[t], c->x[t], ndims[t], shapes[t]);
  st = gdncp_cp_cam_gdn_num(comm, in[0], in[1], in[2], in[3], NULL, CF, CS, NULL, 0, NULL, 0, outs, NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "decay"), "%d '%s'", st, gdncp_last_error());
  for (int t = 0; t < 5; ++t) EXPECT(c->b[t].deleted == 1, "input %d consumed once", t);
  free(c);
  EXPECT(gdncp_comm_destroy(comm) == GDNCP_OK, "destroy");
  EXPECT(gdncp_mpi_finalize() == GDNCP_OK, "finalize: '%s'", gdncp_last_error());
}

/* q's own RoPE tables through the door: equal to the k tables (other buffers) they give bitwise
 * the output of NULL; one without the other is refused by name and consumed. */
static void case_rope_q(void) {
  Layer* L = (Layer*)calloc(1, sizeof(Layer));
  layer_init(L);
  double* cq = (double*)malloc(sizeof L->cos_);
  double* sq = (double*)malloc(sizeof L->sin_);
  memcpy(cq, L->cos_, sizeof L->cos_);
  memcpy(sq, L->sin_, sizeof L->sin_);
  const int64_t s_rope[] = {N, D};
  DLManagedTensor *in[7], *ref = NULL, *out = NULL;
  Blob bc, bs;
  gdncp_status st = layer_call(L, NULL, 0, &ref, NULL);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  layer_wrap(L, in);
  st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], wrap_f64(&bc, cq, 2, s_rope),
                   wrap_f64(&bs, sq, 2, s_rope), NULL, F, S, NULL, NULL, 0, &out, NULL);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  EXPECT(all_deleted_once(L) && bc.deleted == 1 && bs.deleted == 1, "inputs consumed once");
  if (ref && out)
    EXPECT(memcmp(ref->dl_tensor.data, out->dl_tensor.data, (size_t)numel(&out->dl_tensor) * sizeof(double)) == 0,
           "equal q tables: out differs from the one with NULL");
  release(out);
  out = NULL;
  layer_wrap(L, in);
  st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], wrap_f64(&bc, cq, 2, s_rope), NULL, NULL, F, S,
                   NULL, NULL, 0, &out, NULL);
  EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "rope_sin_q") != NULL && out == NULL, "%d '%s'", st,
         gdncp_last_error());
  EXPECT(all_deleted_once(L) && bc.deleted == 1, "inputs consumed once");
  release(ref);
  free(cq);
  free(sq);
  free(L);
}

/* A one-rank communicator whose collectives this test runs: memcpy for the all-gather. */
typedef struct Peers {
  int gathers, broadcasts, releases, fail;
} Peers;

static int peers_all_gather(void* user, void* out, const void* in, size_t bytes, void* stream) {
  Peers* p = (Peers*)user;
  (void)stream;
  if (p->fail) return 7;
  memmove(out, in, bytes);
  p->gathers += 1;
  return 0;
}
static int peers_broadcast(void* user, void* data, size_t bytes, int root, void* stream) {
  (void)data, (void)bytes, (void)root, (void)stream;
  ((Peers*)user)->broadcasts += 1;
  return 0;
}
static const char* peers_error(void* user) {
  (void)user;
  return "the link is down";
}
static void peers_release(void* user) { ((Peers*)user)->releases += 1; }

static void case_comm_callbacks(void) {
  Peers peers = {0, 0, 0, 0};
  gdncp_comm_callbacks cb;
  EXPECT(gdncp_comm_callbacks_init(&cb) == GDNCP_OK && cb.struct_size == sizeof cb && cb.all_gather == NULL, "init");
  cb.user = &peers;
  cb.all_gather = peers_all_gather;
  gdncp_comm* comm = NULL;
  /* Refused: no broadcast; a rank outside the group. Neither takes ownership of user. */
  gdncp_status st = gdncp_comm_create_callbacks(&cb, 0, 1, -1, &comm);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "broadcast") != NULL && comm == NULL, "%d '%s'", st,
         gdncp_last_error());
  cb.broadcast = peers_broadcast;
  cb.error_message = peers_error;
  cb.release = peers_release;
  st = gdncp_comm_create_callbacks(&cb, 1, 1, -1, &comm);
  EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "rank") != NULL && comm == NULL, "%d '%s'", st,
         gdncp_last_error());
  EXPECT(peers.releases == 0, "a failed creation does not release user");
  st = gdncp_comm_create_callbacks(&cb, 0, 1, -1, &comm);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  if (st != GDNCP_OK) return;
  const char* backend = NULL;
  gdncp_comm_backend(comm, &backend);
  EXPECT(backend && strcmp(backend, "callbacks") == 0, "backend %s", backend ? backend : "?");

  /* The CP layer on one rank through the caller's collectives equals the single-rank layer. */
  Layer* L = (Layer*)calloc(1, sizeof(Layer));
  layer_init(L);
  DLManagedTensor *ref = NULL, *out = NULL, *in[7];
  st = layer_call(L, NULL, 0, &ref, NULL);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  layer_wrap(L, in);
  gdncp_graph* g = NULL;
  st = gdncp_bigdn_cp(comm, in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL, NULL, F, S, NULL, NULL, 0x1f,
                      &out, &g);
  EXPECT(st == GDNCP_OK && g != NULL, "%d '%s'", st, gdncp_last_error());
  EXPECT(peers.gathers > 0, "the layer's collectives ran through the callbacks (%d all-gathers)", peers.gathers);
  if (ref && out) {
    const double *a = (const double*)ref->dl_tensor.data, *b = (const double*)out->dl_tensor.data;
    double err = 0, nrm = 0;
    for (int64_t i = 0; i < numel(&out->dl_tensor); ++i) err += (a[i] - b[i]) * (a[i] - b[i]), nrm += a[i] * a[i];
    EXPECT(sqrt(err / nrm) <= 1e-12, "bigdn_cp on one rank vs bigdn: rel L2 %.3g", sqrt(err / nrm));
  }
  /* The graph keeps the communicator (and user) alive past the handle. */
  EXPECT(gdncp_comm_destroy(comm) == GDNCP_OK && peers.releases == 0, "released %d with a graph alive", peers.releases);
  DLManagedTensor* grads[5] = {0};
  st = gdncp_graph_backward(g, NULL, NULL, grads);
  EXPECT(st == GDNCP_OK && grads[0] != NULL && grads[4] != NULL, "backward: %d '%s'", st, gdncp_last_error());
  for (int k = 0; k < 5; ++k) release(grads[k]);
  gdncp_graph_destroy(g);
  EXPECT(peers.releases == 1, "release once the graph is gone, got %d", peers.releases);
  release(out);
  release(ref);

  /* A failing collective: an error naming it and the caller's message; the communicator is aborted after. */
  peers = (Peers){0, 0, 0, 1};
  comm = NULL;
  st = gdncp_comm_create_callbacks(&cb, 0, 1, -1, &comm);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  float v[3] = {1, 2, 3};
  Blob b;
  const int64_t shape[] = {3};
  st = gdncp_comm_all_reduce_sum(comm, wrap(&b, v, kDLFloat, 32, 1, shape), NULL);
  EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "all_") != NULL &&
             strstr(gdncp_last_error(), "the link is down") != NULL,
         "%d '%s'", st, gdncp_last_error());
  int aborted = 0;
  EXPECT(gdncp_comm_aborted(comm, &aborted) == GDNCP_OK && aborted == 1, "aborted %d", aborted);
  peers.fail = 0;
  st = gdncp_comm_all_reduce_sum(comm, wrap(&b, v, kDLFloat, 32, 1, shape), NULL);
  EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "aborted") != NULL, "%d '%s'", st, gdncp_last_error());
  gdncp_comm_destroy(comm);
  EXPECT(peers.releases == 1, "released %d", peers.releases);
  free(L);
}

/* --- hardening: handles, ownership, DLPack, backward retries ----------------------------- */

/* Destroyed and foreign handles are argument errors naming them, never a use
 * after free; a tensor given to a call on a dead communicator is consumed. */
static void case_HardenHandles(void) {
  gdncp_comm* comm = mpi_world();
  if (!comm) return;
  gdncp_status st;
  EXPECT(gdncp_comm_destroy(comm) == GDNCP_OK, "destroy: '%s'", gdncp_last_error());
  st = gdncp_comm_destroy(comm);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "comm") != NULL, "second destroy: %d '%s'", st,
         gdncp_last_error());
  int rank = -1;
  st = gdncp_comm_rank(comm, &rank);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "comm") != NULL, "rank of a destroyed comm: %d '%s'",
         st, gdncp_last_error());
  float v[3] = {1, 2, 3};
  Blob b;
  const int64_t shape[] = {3};
  st = gdncp_comm_all_reduce_sum(comm, wrap(&b, v, kDLFloat, 32, 1, shape), NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "comm") != NULL && b.deleted == 1,
         "all_reduce_sum on a destroyed comm: %d '%s', deleted %d", st, gdncp_last_error(), b.deleted);
  double foreign[16] = {0};
  st = gdncp_comm_set_timeout((gdncp_comm*)foreign, 1.0);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "comm") != NULL, "foreign comm: %d '%s'", st,
         gdncp_last_error());

  Layer* L = (Layer*)calloc(1, sizeof(Layer));
  layer_init(L);
  DLManagedTensor* out = NULL;
  gdncp_graph* g = NULL;
  st = layer_call(L, NULL, 0x1f, &out, &g);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  release(out);
  EXPECT(gdncp_graph_destroy(g) == GDNCP_OK, "destroy: '%s'", gdncp_last_error());
  EXPECT(all_deleted_once(L), "inputs released once with the graph");
  st = gdncp_graph_destroy(g);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "graph") != NULL, "second destroy: %d '%s'", st,
         gdncp_last_error());
  int n = -1;
  st = gdncp_graph_num_outputs(g, &n);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "graph") != NULL, "num_outputs: %d '%s'", st,
         gdncp_last_error());
  DLManagedTensor* grads[5] = {0};
  st = gdncp_graph_backward(g, NULL, NULL, grads);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "graph") != NULL, "backward: %d '%s'", st,
         gdncp_last_error());
  st = gdncp_graph_backward((gdncp_graph*)foreign, NULL, NULL, grads);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "graph") != NULL, "foreign graph: %d '%s'", st,
         gdncp_last_error());
  free(L);
  EXPECT(gdncp_mpi_finalize() == GDNCP_OK, "finalize: '%s'", gdncp_last_error());
}

/* One managed tensor given for two arguments: shared, deleted once (with and
 * without a graph), and the result equals the call with two tensors. */
static void case_HardenSameTensorTwice(void) {
  Layer* L = (Layer*)calloc(1, sizeof(Layer));
  layer_init(L);
  memcpy(L->kw, L->qw, sizeof L->qw); /* the two-tensor call of the same values */
  DLManagedTensor* in[7];
  DLManagedTensor* ref = NULL;
  gdncp_status st = layer_call(L, NULL, 0, &ref, NULL);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  for (int with_graph = 0; with_graph < 2 && st == GDNCP_OK; ++with_graph) {
    layer_wrap(L, in);
    DLManagedTensor* out = NULL;
    gdncp_graph* g = NULL;
    /* q_norm_w for both norm weights, rope_cos for both tables' slots is not the same math: only the weights. */
    st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[3], in[5], in[6], NULL, NULL, NULL, F, S, NULL, NULL,
                     with_graph ? 0x1f : 0, &out, with_graph ? &g : NULL);
    release(in[4]); /* not given to the call */
    EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
    if (st != GDNCP_OK) break;
    const double* a = (const double*)out->dl_tensor.data;
    const double* r = (const double*)ref->dl_tensor.data;
    int same = 1;
    for (int64_t i = 0; i < numel(&out->dl_tensor); ++i) same &= a[i] == r[i];
    EXPECT(same, "one tensor for q_norm_w and k_norm_w gives the two-tensor result");
    if (with_graph) {
      EXPECT(L->b[3].deleted == 0, "the graph holds the shared tensor");
      DLManagedTensor* grads[5] = {0};
      st = gdncp_graph_backward(g, NULL, NULL, grads);
      EXPECT(st == GDNCP_OK, "backward: %d '%s'", st, gdncp_last_error());
      for (int k = 0; k < 5; ++k) release(grads[k]);
      gdncp_graph_destroy(g);
    }
    EXPECT(all_deleted_once(L), "every tensor deleted once (q_norm_w %d)", L->b[3].deleted);
    release(out);
  }
  release(ref);
  free(L);
}

/* DLPack refusals name the argument and consume every input once; an empty
 * tensor is accepted whatever its strides. */
static void case_HardenDlpack(void) {
  Layer* L = (Layer*)calloc(1, sizeof(Layer));
  layer_init(L);
  DLManagedTensor* in[7];
  DLManagedTensor* out = NULL;
  gdncp_status st;
  /* 0: misaligned byte_offset (qkv), 1: a negative size (beta), 2: sizes whose product overflows (decay),
   * 3: null data (rope_cos). */
  const char* names[4] = {"qkv", "beta", "decay", "rope_cos"};
  const char* why[4] = {"aligned", "negative", "overflow", "null"};
  for (int k = 0; k < 4; ++k) {
    layer_wrap(L, in);
    int64_t huge[3] = {INT64_C(1) << 40, INT64_C(1) << 40, 4};
    if (k == 0) in[0]->dl_tensor.byte_offset = 4;
    if (k == 1) L->b[1].shape[2] = -3;
    if (k == 2) in[2]->dl_tensor.shape = huge;
    if (k == 3) in[5]->dl_tensor.data = NULL;
    st =
        gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL, NULL, F, S, NULL, NULL, 0, &out, NULL);
    EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), names[k]) != NULL &&
               strstr(gdncp_last_error(), why[k]) != NULL,
           "%s: %d '%s'", names[k], st, gdncp_last_error());
    EXPECT(all_deleted_once(L) && out == NULL, "%s: inputs consumed once, no output", names[k]);
  }
  free(L);

  gdncp_comm* comm = mpi_world();
  if (!comm) return;
  /* An empty tensor with torch's strides (sizes taken as at least 1): (2, 0, 3) with strides (3, 3, 1). */
  Blob b;
  const int64_t shape[] = {2, 0, 3};
  DLManagedTensor* m = wrap(&b, NULL, kDLFloat, 32, 3, shape);
  b.strides[0] = 3, b.strides[1] = 3, b.strides[2] = 1;
  m->dl_tensor.strides = b.strides;
  st = gdncp_comm_all_reduce_sum(comm, m, NULL);
  EXPECT(st == GDNCP_OK && b.deleted == 1, "empty tensor: %d '%s'", st, gdncp_last_error());
  EXPECT(gdncp_comm_destroy(comm) == GDNCP_OK, "destroy");
  EXPECT(gdncp_mpi_finalize() == GDNCP_OK, "finalize: '%s'", gdncp_last_error());
}

/* A backward refused for a bad gradient can be retried with a good one; a
 * second backward consumes its gradients; the counts stay after the backward;
 * a clip mask value other than 0 or 1 is refused by name. */
static void case_HardenBackward(void) {
  Layer* L = (Layer*)calloc(1, sizeof(Layer));
  layer_init(L);
  DLManagedTensor* out = NULL;
  gdncp_graph* g = NULL;
  gdncp_status st = layer_call(L, NULL, 0x1f, &out, &g);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  if (st != GDNCP_OK) return;
  const int64_t n_y = numel(&out->dl_tensor);
  double* w = (double*)calloc((size_t)n_y + 1, sizeof(double));
  for (int64_t i = 0; i < n_y; ++i) w[i] = 1.0;
  Blob bad, good, late;
  const int64_t wrong[] = {B, N, H, D + 1}, right[] = {B, N, H, D};
  DLManagedTensor* go[1] = {wrap_f64(&bad, w, 4, wrong)};
  DLManagedTensor* grads[5] = {0};
  st = gdncp_graph_backward(g, go, NULL, grads);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "grad_outputs[0]") != NULL && bad.deleted == 1,
         "bad gradient: %d '%s', deleted %d", st, gdncp_last_error(), bad.deleted);
  go[0] = wrap_f64(&good, w, 4, right);
  st = gdncp_graph_backward(g, go, NULL, grads);
  EXPECT(st == GDNCP_OK && good.deleted == 1, "retry: %d '%s'", st, gdncp_last_error());
  int got = 0;
  for (int k = 0; k < 5; ++k) got += grads[k] != NULL, release(grads[k]);
  EXPECT(got == 5, "%d gradients of 5", got);
  int n_out = -1, n_in = -1;
  gdncp_graph_num_outputs(g, &n_out);
  gdncp_graph_num_inputs(g, &n_in);
  EXPECT(n_out == 1 && n_in == 5, "after backward: %d outputs, %d inputs", n_out, n_in);
  go[0] = wrap_f64(&late, w, 4, right);
  st = gdncp_graph_backward(g, go, NULL, grads);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && late.deleted == 1, "second backward: %d '%s', deleted %d", st,
         gdncp_last_error(), late.deleted);
  gdncp_graph_destroy(g);
  release(out);

  /* Clip mask values: 0.5, 2, -1, NaN. */
  const float bad_values[4] = {0.5f, 2.0f, -1.0f, NAN};
  for (int k = 0; k < 4; ++k) {
    float clip[B * F] = {1, 0, 0};
    clip[1] = bad_values[k];
    Blob cb;
    const int64_t cs[] = {B, F};
    DLManagedTensor* in[7];
    layer_wrap(L, in);
    st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, NULL, wrap(&cb, clip, kDLFloat, 32, 2, cs),
                     F, S, NULL, NULL, 0, &out, NULL);
    EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "clip_starts") != NULL && cb.deleted == 1, "%g: %d '%s'",
           (double)bad_values[k], st, gdncp_last_error());
  }
  free(w);
  free(L);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s <case> (see tests/CMakeLists.txt)\n", argv[0]);
    return 2;
  }
  const char* c = argv[1];
  if (strcmp(c, "status") == 0)
    case_status();
  else if (strcmp(c, "thread_messages") == 0)
    case_thread_messages();
  else if (strcmp(c, "bad_argument") == 0)
    case_bad_argument();
  else if (strcmp(c, "bigdn_backward") == 0)
    case_bigdn_backward();
  else if (strcmp(c, "dlpack_in_place") == 0)
    case_dlpack_in_place();
  else if (strcmp(c, "cam_gdn_num") == 0)
    case_cam_gdn_num();
  else if (strcmp(c, "rope_q") == 0)
    case_rope_q();
  else if (strcmp(c, "comm_callbacks") == 0)
    case_comm_callbacks();
  else if (strcmp(c, "OverlapExchange") == 0)
    case_OverlapExchange();
  else if (strcmp(c, "HardenHandles") == 0)
    case_HardenHandles();
  else if (strcmp(c, "HardenSameTensorTwice") == 0)
    case_HardenSameTensorTwice();
  else if (strcmp(c, "HardenDlpack") == 0)
    case_HardenDlpack();
  else if (strcmp(c, "HardenBackward") == 0)
    case_HardenBackward();
  else {
    fprintf(stderr, "unknown case %s\n", c);
    return 2;
  }
  if (g_failures)
    fprintf(stderr, "%s: %d failure(s)\n", c, g_failures);
  else
    printf("%s: passed\n", c);
  return g_failures ? 1 : 0;
}
