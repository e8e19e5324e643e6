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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
  return gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, F, S, opt, NULL, mask, out, graph);
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
  EXPECT(st == GDNCP_OK && co.struct_size == sizeof co && co.deterministic == 0, "cp defaults");
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
  gdncp_status st = gdncp_bigdn(in[0], NULL, in[2], in[3], in[4], in[5], in[6], NULL, F, S, NULL, NULL, 0, &out, NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "beta") != NULL, "%d '%s'", st, gdncp_last_error());
  EXPECT(L->b[0].deleted == 1 && L->b[1].deleted == 0 && L->b[6].deleted == 1, "inputs consumed once");
  EXPECT(out == NULL, "no output on failure");

  /* A DLPack dtype the library does not take (int32), naming qkv. */
  layer_wrap(L, in);
  in[0]->dl_tensor.dtype.code = kDLInt;
  in[0]->dl_tensor.dtype.bits = 32;
  st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, F, S, NULL, NULL, 0, &out, NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "qkv") != NULL, "%d '%s'", st, gdncp_last_error());
  EXPECT(all_deleted_once(L), "inputs consumed once");

  /* Non-contiguous strides, naming decay. */
  layer_wrap(L, in);
  int64_t strides[3] = {1, 1, 2};
  in[2]->dl_tensor.strides = strides;
  st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, F, S, NULL, NULL, 0, &out, NULL);
  EXPECT(st == GDNCP_ERROR_ARGUMENT && strstr(gdncp_last_error(), "decay") != NULL &&
             strstr(gdncp_last_error(), "contiguous") != NULL,
         "%d '%s'", st, gdncp_last_error());
  EXPECT(all_deleted_once(L), "inputs consumed once");

  /* A wrong size the library itself finds (F·S != N): gdncp::Error, naming the argument. */
  layer_wrap(L, in);
  st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, F + 1, S, NULL, NULL, 0, &out, NULL);
  EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "qkv") != NULL, "%d '%s'", st, gdncp_last_error());
  EXPECT(all_deleted_once(L), "inputs consumed once");
  EXPECT(out == NULL, "no output on failure");

  /* The same failure in a call that records a graph: no graph, inputs consumed once. */
  {
    gdncp_graph* fg = NULL;
    layer_wrap(L, in);
    st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], NULL, F + 1, S, NULL, NULL, 0x1f, &out, &fg);
    EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "qkv") != NULL, "%d '%s'", st, gdncp_last_error());
    EXPECT(fg == NULL && out == NULL && all_deleted_once(L), "no graph, no output, inputs consumed once");
  }

  /* A clip mask of the wrong shape, (B, F + 1): refused by name, and consumed. */
  {
    float clip[B * (F + 1)] = {0};
    Blob cb;
    const int64_t cs[] = {B, F + 1};
    layer_wrap(L, in);
    st = gdncp_bigdn(in[0], in[1], in[2], in[3], in[4], in[5], in[6], wrap(&cb, clip, kDLFloat, 32, 2, cs), F, S, NULL,
                     NULL, 0, &out, NULL);
    EXPECT(st == GDNCP_ERROR && strstr(gdncp_last_error(), "clip_starts") != NULL, "%d '%s'", st,
           gdncp_last_error());
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

/* In place through the door: a 1-rank MPI world sums into the caller's buffer
 * (the result lands in the same memory; nothing is copied out). */
static void case_dlpack_in_place(void) {
  gdncp_comm* comm = NULL;
  gdncp_status st = gdncp_comm_create_mpi_world(&comm);
  EXPECT(st == GDNCP_OK, "%d '%s'", st, gdncp_last_error());
  if (st != GDNCP_OK) return;
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
  EXPECT(gdncp_comm_destroy(comm) == GDNCP_OK, "destroy");
  EXPECT(gdncp_mpi_finalize() == GDNCP_OK, "finalize: '%s'", gdncp_last_error());
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s status|thread_messages|bad_argument|bigdn_backward|dlpack_in_place\n", argv[0]);
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
