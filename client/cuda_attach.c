/*
 * cuda_attach.c — the cuda backend's part of dep_attach and dep_detach:
 * the kernels loaded (the daemon's compile of them where it lends one, else
 * the embedded fatbin, with cuModuleLoadData: no run-time compilation), the
 * error record pinned, the operations' memory placed in the rank's private
 * area of its slab, the SM budget, the proxy's ring and the exchange region
 * bound for the device (a job across nodes), the stats page, the warm-up of
 * every kernel; and their undoing.  The operations themselves are
 * cuda_ops.c's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "cuda_ops_internal.h"
#include "deepep_daemon.h"
#include "kimage.h"
#include "shape.h"
#include "sm_budget.h"
#include "xring.h"

#ifdef DEP_HAVE_FATBIN
static const char *const kernel_names[CUOPS_K_COUNT] = {
#define CUOPS__NAME(name, sym) sym,
    CUOPS_KERNELS(CUOPS__NAME)
#undef CUOPS__NAME
};
#endif

#ifdef DEP_HAVE_FATBIN
/* Point j's per-world counters (kabi.h cuops_world_carve) at the arrays for a world of W at
 * device address base. */
static void world_bind(struct cuops_job *j, CUdeviceptr base, uint32_t W) {
  uint64_t at[CUOPS_WORLD_ARRAYS];
  (void)cuops_world_carve(W, at);
  j->arrive = (uint32_t *)(uintptr_t)(base + at[0]);
  j->xseen = (unsigned long long *)(uintptr_t)(base + at[1]);
  j->chan_took = (unsigned long long *)(uintptr_t)(base + at[2]);
  j->chan_front = (uint32_t *)(uintptr_t)(base + at[3]);
  j->chan_sent = (unsigned long long *)(uintptr_t)(base + at[4]);
  j->own_mask = (unsigned long long *)(uintptr_t)(base + at[5]);
  j->pend_mask = (unsigned long long *)(uintptr_t)(base + at[6]);
  j->fan = (unsigned long long *)(uintptr_t)(base + at[9]);
  j->fan_rank = (uint32_t *)(uintptr_t)(base + at[10]);
  j->node_acc = (uint32_t *)(uintptr_t)(base + at[11]);
  j->node_push = (unsigned long long *)(uintptr_t)(base + at[12]);
  j->n_nodes = 0;
}

static double mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/*
 * Run every kernel once (bf16 and FP8 low-latency alike) with zero tokens,
 * on a private stream, so that the module is resident and the first real
 * call runs at steady-state latency.  dep__k_ll_info excepted: it serves
 * dep_ll_handle_info, which no exchange waits for, and its outputs (a row
 * per local expert and row) would not fit the warm-up's scratch.  The calls run on a loopback world of
 * one rank whose slab and counters are scratch memory of this client: the
 * same code paths (posting, waiting, the end-of-call ticket) without
 * depending on any peer, without writing into the job's slabs (which stay
 * as the daemon lent them: zero) and without touching the job's call count.
 */
static int warmup(dep_client_t *c) {
  const char *op = "dep_attach (kernel warm-up)";
  struct cuops_state *st = &c->cuops;
  struct dep_handle *h = calloc(1, sizeof *h);
  if (h == NULL)
    return client_seterr(c, DEP_ERR_NO_MEMORY, "%s: out of memory", op);
  host_ops_handle_init(h);
  st->warm_h = h;
  const uint64_t seq = c->ops.seq;
  /* Its scratch is in this rank's private area of its slab (zeroed on
   * st->stream, ahead of these calls), which lasts until detach. */
  CUstream s = st->stream;
  CUresult r;
  double t0 = mono_ms();
  const struct cuops_job job = st->job;
  const uint32_t grid = st->grid;
  st->job.world = 1;
  st->job.rank = 0;
  st->job.remote_mask = 0; /* no ring, no exchange region: nothing leaves this rank */
  st->job.slabs[0] = (uint8_t *)(uintptr_t)st->loop_slab;
  st->job.le = job.num_experts;
  st->job.kd = job.topk < job.num_experts ? job.topk : job.num_experts;
  st->grid = dep__kernel_grid(8, 1, &st->job.parts); /* 8 CTAs, a part each */
  st->job.dev = (struct cuops_dev *)(uintptr_t)st->loop_dev;
  world_bind(&st->job, st->loop_world, 1);
  int32_t *scr = (int32_t *)(uintptr_t)st->scratch;
  uint32_t nrecv = 0;
  int rc = cuops_handle_reserve(c, h, op, st->warm_mem);
  struct dep_layout_args la = {.size = sizeof la, .index_type = DEP_INDEX_I64,
                               .tokens_per_rank = scr, .tokens_per_expert = scr};
  struct dep_dispatch_args da = {.size = sizeof da, .index_type = DEP_INDEX_I64, .recv_x = scr,
                                 .recv_topk_idx = scr, .recv_topk_weights = (float *)scr,
                                 .recv_count_per_expert = scr, .num_recv = &nrecv,
                                 .expert_alignment = 2 /* dep__k_align warmed too */};
  struct dep_combine_args ca = {.size = sizeof ca};
  struct dep_ll_dispatch_args lda = {.size = sizeof lda, .index_type = DEP_INDEX_I64,
                                     .recv_x = scr, .recv_scales = (float *)scr,
                                     .recv_count = scr};
  struct dep_ll_combine_args lca = {.size = sizeof lca, .x = scr, .index_type = DEP_INDEX_I64};
  if (rc == 0)
    rc = cuda_ops_layout(c, &la, s);
  if (rc == 0)
    rc = cuda_ops_dispatch(c, &da, h, s);
  /* A job with node channels dispatches with a kernel of its own (kabi.h): warmed too, in
   * the world of one, where no rank takes a node channel (its fan table is zeros). */
  st->job.n_nodes = job.n_nodes;
  if (rc == 0 && job.n_nodes != 0)
    rc = cuda_ops_dispatch(c, &da, h, s);
  st->job.n_nodes = 0;
  if (rc == 0)
    rc = cuda_ops_combine(c, &ca, h, s);
  /* Low-latency ops refuse jobs above CUOPS_LL_MAX_EXPERTS: nothing to warm there. */
  const bool ll = job.num_experts <= CUOPS_LL_MAX_EXPERTS;
  for (int fp8 = 0; fp8 < 2 && rc == 0 && ll; fp8++) {
    lda.use_fp8 = fp8;
    rc = cuda_ops_ll_dispatch(c, &lda, h, s);
    if (rc == 0)
      rc = cuda_ops_ll_combine(c, &lca, h, s);
  }
  st->job = job;
  st->grid = grid;
  /* The warm-up's calls ran on its own world of one: the job's count of calls (dep_next_call)
   * is what it was. */
  c->ops.seq = seq;
  /* The job's own slabs last: read a word of every 64 KiB of each, so the
   * page tables of the peers' memory are walked here, not by the first
   * operation. */
  struct cuops_touch_args ta = {c->layout.total_bytes};
  if (rc == 0)
    rc = cuops_launch(c, CUOPS_K_TOUCH, job.world, &ta, s, op);
  if ((r = drv()->cuStreamSynchronize(s)) != CUDA_SUCCESS && rc == 0)
    rc = cu_fail(c, op, "cuStreamSynchronize", r);
  if (rc == 0)
    rc = cuops_poll(c, op, s, true);
  c->times.warmup_ms = mono_ms() - t0;
  return rc;
}
#endif

int cuops_block_layout(const struct dep_job_shape *shape, uint32_t world,
                       const struct dep_slab_layout *lay, int sms, struct dep_slab_priv *out,
                       char *why, size_t whylen) {
  if (sms < 1 || (unsigned)sms > DEP_SLAB_MAX_SMS) {
    snprintf(why, whylen, "this GPU has %d SMs; the slab's private area holds the operations' "
             "scratch for GPUs of 1 to %u SMs: run deepepd with backend: host on it, or use a "
             "build that raises DEP_SLAB_MAX_SMS", sms, DEP_SLAB_MAX_SMS);
    return DEP_ERR_UNSUPPORTED;
  }
  dep__slab_priv(shape, world, lay, out);
  return 0;
}

#ifdef DEP_HAVE_FATBIN
/* The SMs of the current context's GPU (16 when the driver does not say). */
static int gpu_sms(const struct cudadrv *cu) {
  int sms = 0;
  CUdevice dev;
  if (cu->cuCtxGetDevice(&dev) != CUDA_SUCCESS ||
      cu->cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
      sms < 1)
    sms = 16; /* unknown: small enough to fit anywhere */
  return sms;
}

/*
 * The rank's budget: $DEEPEP_KERNEL_CTAS where it is set, else the daemon's
 * choice for the job's key (TUNE: adaptive_optimization's table) where it
 * keeps every rank resident, else the default (cuops_sm_budget's, which in a
 * job across nodes the daemon's answer leaves as it is).  The daemon is told the
 * environment's value, so that deepepctl stats says which one the rank runs
 * with; a daemon that does not know TUNE leaves the default.
 */
static int sm_budget(dep_client_t *c, uint32_t *out) {
  char why[256] = "";
  const char *env = getenv(CUOPS_CTAS_ENV);
  const uint32_t sharing = c->ranks_on_dev ? c->ranks_on_dev : c->ops.world;
  const uint32_t xworld = c->ops.lay.n_remote != 0 ? c->ops.world : 0;
  int rc = cuops_sm_budget(c->cuops.sms, sharing, xworld, env, out, why, sizeof why);
  if (rc != 0)
    return client_seterr(c, rc, "dep_attach: %s", why);
  const bool by_env = env != NULL && env[0] != '\0';
  /* Every rank's CTAs resident at once, at the CTAs an SM holds of this world's kernels
   * (shmem_fit); the default budget (one CTA an SM, shared out) always is. */
  const uint32_t fit = dep__fit_ctas(c->cuops.sms, sharing, c->cuops.ctas_per_sm);
  if (by_env && *out > fit)
    return client_seterr(c, DEP_ERR_INVALID, "dep_attach: $" CUOPS_CTAS_ENV "=\"%s\" must be "
                         "a number of CTAs from 1 to %u: a world of %u ranks holds enough shared "
                         "memory a CTA that an SM keeps %u of them at once (%d SMs, %u ranks of "
                         "the job on this GPU); lower or unset it", env, fit, c->ops.world,
                         c->cuops.ctas_per_sm, c->cuops.sms, sharing);
  struct dep_msg_tune m = {.sms = (uint32_t)c->cuops.sms, .env_ctas = by_env ? *out : 0};
  struct dep_msg_tune_ok ok;
  struct client_frame f;
  if (m.sms > DEP_TUNE_MAX_SMS)
    return 0;
  rc = client_request(c, DEP_MSG_TUNE, &m, DEP_MSG_TUNE_OK, CLIENT_REQUEST_TIMEOUT_MS, &f);
  if (rc != 0)
    return c->fd < 0 ? rc : 0;
  if (!by_env && proto_decode_tune_ok(f.body, f.hdr.body_len, &ok) == 0 && ok.ctas >= 1 &&
      ok.ctas <= fit)
    *out = ok.ctas;
  client_frame_release(&f);
  return 0;
}
#endif

/*
 * The error record: host memory the kernels write through a device
 * mapping.  A page of our own pinned with cuMemHostRegister rather than
 * cuMemHostAlloc, which sets up the driver's pinned pool and makes attach
 * several times slower (BENCHMARKS.md, run 17).
 * After the record, in the same registration, the dispatch's rows from
 * each rank of the world (cuops_job.recv_from, which the library reads
 * after the dispatch's synchronisation), then room for `le` counts: a
 * dispatch given recv_count_per_expert_host copies its counts there on its
 * stream (a copy into pinned memory is queued, not staged), before the
 * synchronisation it makes anyway.  One page holds the record, the rows of
 * 64 sources and some 890 counts.
 */
#ifdef DEP_HAVE_FATBIN
#define HOST_FROM_OFF dep_round_up(sizeof(struct cuops_host), 64)
#define HOST_COUNTS_OFF(world) (HOST_FROM_OFF + dep_round_up(4ull * (world), 64))

static size_t host_record_bytes(uint32_t world, uint32_t le) {
  return dep_round_up(HOST_COUNTS_OFF(world) + (uint64_t)le * sizeof(int32_t),
                      (uint64_t)sysconf(_SC_PAGESIZE));
}

static CUresult host_record_make(const struct cudadrv *cu, struct cuops_state *st, uint32_t world,
                                 uint32_t le) {
  const size_t bytes = host_record_bytes(world, le);
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult r = cu->cuMemHostRegister(p, bytes, CU_MEMHOSTREGISTER_PORTABLE |
                                                   CU_MEMHOSTREGISTER_DEVICEMAP);
  if (r != CUDA_SUCCESS) {
    munmap(p, bytes);
    return r;
  }
  st->host = p; /* zero, as anonymous memory is */
  st->host_bytes = bytes;
  st->host_from = (uint32_t *)((uint8_t *)p + HOST_FROM_OFF);
  st->host_from_cap = world;
  st->host_counts = (int32_t *)((uint8_t *)p + HOST_COUNTS_OFF(world));
  st->host_counts_cap = le;
  return CUDA_SUCCESS;
}
#endif

static void host_record_free(const struct cudadrv *cu, struct cuops_state *st) {
  if (st->host == NULL)
    return;
  cu->cuMemHostUnregister(st->host);
  munmap(st->host, st->host_bytes);
}

bool dep__client_kernels_lent(const dep_client_t *c) {
  return c != NULL && c->attached && c->cuda && c->cuops.lent_kernels;
}

void cuda_ops_drop_kernels(dep_client_t *c) {
  if (c->lent_kernels != NULL)
    munmap(c->lent_kernels, c->lent_kernels_bytes);
  c->lent_kernels = NULL;
  c->lent_kernels_bytes = 0;
}

/* Take the cubin of a KERNELS_OK if it is a compile of this very image for this GPU. */
static void take_kernels(dep_client_t *c, const struct client_frame *f, const struct kimage *img,
                         int arch) {
  struct dep_msg_kernels_ok ok;
  int driver = 0;
  struct stat sb;
  if (proto_decode_kernels_ok(f->body, f->hdr.body_len, &ok) != 0 || f->nfds != 1 ||
      ok.arch != (uint32_t)arch || strcmp(ok.build, img->id) != 0 ||
      drv()->cuDriverGetVersion(&driver) != CUDA_SUCCESS || ok.driver != driver ||
      fstat(f->fds[0], &sb) != 0 || (uint64_t)sb.st_size != ok.bytes)
    return; /* another build, driver or GPU (or a malformed reply): the fatbin serves */
  void *p = mmap(NULL, (size_t)ok.bytes, PROT_READ, MAP_PRIVATE, f->fds[0], 0);
  if (p == MAP_FAILED)
    return;
  c->lent_kernels = p;
  c->lent_kernels_bytes = (size_t)ok.bytes;
}

int cuda_ops_world_check(dep_client_t *c, const struct dep_attach_args *a) {
  if (a->world_size <= DEP_MAX_WORLD)
    return 0;
  return client_seterr(c, DEP_ERR_UNSUPPORTED, "dep_attach: job \"%s\" has a world of %u "
                       "ranks; the cuda backend serves worlds of up to %u ranks (DEP_MAX_WORLD), "
                       "so run it with fewer ranks",
                       a->job_id, a->world_size, DEP_MAX_WORLD);
}

int cuda_ops_fetch_kernels(dep_client_t *c) {
  cuda_ops_drop_kernels(c);
  struct kimage img;
  const struct cudadrv *cu = drv();
  int major = 0, minor = 0;
  if (!kimage_embedded(&img) || cu == NULL ||
      cu->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                               c->cuda_dev) != CUDA_SUCCESS ||
      cu->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                               c->cuda_dev) != CUDA_SUCCESS ||
      kimage_fit(img.data, img.len, major, minor) == KIMAGE_SASS)
    return 0;
  const char *own = getenv(CUOPS_OWN_KERNELS_ENV);
  if (own != NULL && own[0] != '\0' && strcmp(own, "0") != 0) {
    if (strcmp(own, "1") == 0)
      return 0;
    return client_seterr(c, DEP_ERR_INVALID, "$" CUOPS_OWN_KERNELS_ENV "=\"%s\" must be 0 or 1; "
                         "fix or unset it", own);
  }
  struct dep_msg_kernels m;
  memcpy(m.device_uuid, c->args.device_uuid, sizeof m.device_uuid);
  struct client_frame f;
  int rc = client_request(c, DEP_MSG_KERNELS, &m, DEP_MSG_KERNELS_OK, CLIENT_REQUEST_TIMEOUT_MS,
                          &f);
  if (rc != 0)
    return c->fd < 0 ? rc : 0; /* the daemon has none to lend: the fatbin's PTX serves */
  take_kernels(c, &f, &img, major * 10 + minor);
  client_frame_release(&f);
  return 0;
}

#ifdef DEP_HAVE_FATBIN
/*
 * The shared memory of the job's kernels (kabi.h "Shared memory"), as the
 * module is loaded: for each kernel that holds some (dep__shmem_of, for
 * the world and experts this rank asks for), its static bytes and the
 * dynamic ones must fit what the GPU gives a CTA when asked (the opt-in
 * maximum), else the world is DEP_ERR_UNSUPPORTED, saying why; above the
 * 48 KiB a CTA gets unasked the kernel is opted in for its bytes.  How many
 * CTAs of the largest an SM holds at once, at most CUOPS_CTAS_PER_SM, goes
 * to st->ctas_per_sm, the SM budget's residency (sm_budget).  The
 * warm-up's world of one needs less.
 */
static int shmem_fit(dep_client_t *c, uint32_t world, uint32_t num_experts) {
  struct cuops_state *st = &c->cuops;
  const struct cudadrv *cu = drv();
  CUdevice dev;
  int optin = 0, per_sm = 0, reserved = 0;
  CUresult r = cu->cuCtxGetDevice(&dev);
  if (r == CUDA_SUCCESS)
    r = cu->cuDeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                 dev);
  if (r == CUDA_SUCCESS)
    r = cu->cuDeviceGetAttribute(&per_sm, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                                 dev);
  if (r == CUDA_SUCCESS)
    r = cu->cuDeviceGetAttribute(&reserved, CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
                                 dev);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "cuDeviceGetAttribute (shared memory)", r);
  st->ctas_per_sm = CUOPS_CTAS_PER_SM;
  for (int k = 0; k < CUOPS_K_COUNT; k++) {
    const unsigned dyn = dep__shmem_of((enum cuops_kernel)k, world, num_experts);
    /* The low-latency calls refuse a job of more experts (cuda_ops.c): never launched. */
    if (dyn == 0 || (k == CUOPS_K_LL_DISPATCH && num_experts > CUOPS_LL_MAX_EXPERTS))
      continue;
    int fixed = 0;
    if ((r = cu->cuFuncGetAttribute(&fixed, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, st->fn[k])) !=
        CUDA_SUCCESS)
      return cu_fail(c, "dep_attach", "cuFuncGetAttribute (shared memory)", r);
    const uint64_t need = (uint64_t)fixed + dyn;
    if (need > (uint64_t)optin)
      return client_seterr(c, DEP_ERR_UNSUPPORTED, "dep_attach: a world of %u ranks needs %llu "
                           "bytes of shared memory a CTA in kernel %s, more than this GPU gives "
                           "one (%d); run the job with fewer ranks (or fewer experts), or with "
                           "backend: host", world, (unsigned long long)need, kernel_names[k],
                           optin);
    if (need > 48u * 1024u &&
        (r = cu->cuFuncSetAttribute(st->fn[k], CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    (int)dyn)) != CUDA_SUCCESS)
      return cu_fail(c, "dep_attach", "cuFuncSetAttribute (dynamic shared memory)", r);
    const uint32_t fit = dep__ctas_per_sm(need + (uint64_t)reserved, (uint64_t)per_sm);
    st->ctas_per_sm = fit < st->ctas_per_sm ? fit : st->ctas_per_sm;
  }
  return 0;
}
#endif

int cuda_ops_prepare(dep_client_t *c) {
  struct cuops_state *st = &c->cuops;
  memset(st, 0, sizeof *st);
#ifndef DEP_HAVE_FATBIN
  return 0; /* memory is lent all the same; the operations say why they cannot run */
#else
  const char *op = "dep_attach";
  char why[256] = "";
  double t0 = mono_ms();
  const struct cudadrv *cu = cudadrv_load(why, sizeof why);
  if (cu == NULL)
    return client_seterr(c, DEP_ERR_UNSUPPORTED, "%s: %s", op, why);
  CUresult r = cu->cuCtxGetCurrent(&st->ctx);
  if (r != CUDA_SUCCESS || st->ctx == NULL)
    return client_seterr(c, DEP_ERR_CUDA, "%s: no CUDA context is current", op);
  /* The daemon's compile where it lent one (a driver that refuses it still
   * has the fatbin to compile), else the embedded fatbin. */
  struct kimage img;
  kimage_embedded(&img);
  r = CUDA_ERROR_INVALID_IMAGE;
  if (c->lent_kernels != NULL && (r = cu->cuModuleLoadData(&st->mod, c->lent_kernels)) != CUDA_SUCCESS)
    st->mod = NULL;
  st->lent_kernels = r == CUDA_SUCCESS;
  cuda_ops_drop_kernels(c);
  if (!st->lent_kernels && (r = cu->cuModuleLoadData(&st->mod, img.data)) != CUDA_SUCCESS) {
    st->mod = NULL;
    return cu_fail(c, op, "loading the embedded kernels (cuModuleLoadData)", r);
  }
  for (int k = 0; k < CUOPS_K_COUNT; k++)
    if ((r = cu->cuModuleGetFunction(&st->fn[k], st->mod, kernel_names[k])) != CUDA_SUCCESS)
      return client_seterr(c, DEP_ERR_CUDA, "%s: kernel %s: %s", op, kernel_names[k],
                           cudadrv_errstr(r));
  /* The job's local experts as this rank asks for them (the daemon checks the shape; one
   * it refuses gets no room, and no call). */
  const struct dep_attach_args *aa = &c->args;
  const uint32_t le = aa->world_size > 0 && aa->shape.num_experts <= DEP_SHAPE_MAX_EXPERTS
                          ? aa->shape.num_experts / aa->world_size : 0;
  /* The rows from each source, for the world this rank asks for (one the daemon refuses gets
   * no call; cuda_ops_attach checks the world it binds against this room). */
  const uint32_t world = aa->world_size <= DEP_MAX_WORLD ? aa->world_size : 0;
  int rc = shmem_fit(c, world, aa->shape.num_experts);
  if (rc != 0)
    return rc;
  if ((r = host_record_make(cu, st, world, le)) != CUDA_SUCCESS)
    return cu_fail(c, op, "pinning the error record (cuMemHostRegister)", r);
  if ((r = cu->cuMemHostGetDevicePointer(&st->host_dev, st->host, 0)) != CUDA_SUCCESS)
    return cu_fail(c, op, "cuMemHostGetDevicePointer (the error record)", r);
  /* The operations' memory is this rank's private area of its slab
   * (slab.h), placed by cuda_ops_attach once the slabs are mapped: one
   * cuMemAlloc fewer on the attach path (BENCHMARKS.md).  It is zeroed on this private stream, which the
   * warm-up then runs on. */
  st->sms = gpu_sms(cu);
  if ((r = cu->cuStreamCreate(&st->stream, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
    st->stream = NULL;
    return cu_fail(c, op, "cuStreamCreate", r);
  }
  st->prepared = true;
  c->times.setup_ms = mono_ms() - t0;
  return 0;
#endif
}

#ifdef DEP_HAVE_FATBIN
/* The 64-bit word at device address at set to v on st's stream, after the private area's
 * zeroing (two 32-bit memsets: the driver has no 64-bit one). */
static CUresult dev_set64(const struct cuops_state *st, CUdeviceptr at, uint64_t v) {
  const struct cudadrv *cu = drv();
  CUresult r = cu->cuMemsetD32Async(at, (unsigned)v, 1, st->stream);
  return r == CUDA_SUCCESS ? cu->cuMemsetD32Async(at + 4, (unsigned)(v >> 32), 1, st->stream)
                           : r;
}

/*
 * A job that spans nodes: the proxy's ring and the exchange region after it
 * (xring.h, slab.h), one host mapping registered for the device, where the
 * kernels push their descriptors, write their blocks for other nodes and
 * read and wait on the blocks from them (kabi.h).  cuda_ops_detach
 * unregisters it, before client_unmap drains and unmaps it.
 */
static int ring_bind(dep_client_t *c) {
  struct cuops_state *st = &c->cuops;
  struct cuops_job *j = &st->job;
  const struct ops_ctx *o = &c->ops;
  j->in_slot_off = o->lay.in_slot_off;
  j->out_slot_off = o->lay.out_slot_off;
  j->in_off = o->lay.in_off;
  j->out_off = o->lay.out_off;
  j->in_mark_off = o->lay.in_mark_off;
  j->out_mark_off = o->lay.out_mark_off;
  j->n_remote = o->lay.n_remote;
  j->ring = j->xchg = NULL;
  if (j->n_remote == 0)
    return 0;
  const struct cudadrv *cu = drv();
  CUresult r = cu->cuMemHostRegister(c->xring, DEP_XRING_BYTES + o->lay.xchg_bytes,
                                     CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "registering the ring to the daemon's proxy and the exchange "
                   "region for the GPU (cuMemHostRegister)", r);
  st->ring_pinned = c->xring;
  CUdeviceptr d = 0;
  if ((r = cu->cuMemHostGetDevicePointer(&d, c->xring, 0)) != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "cuMemHostGetDevicePointer (the ring to the proxy)", r);
  j->ring = (uint8_t *)(uintptr_t)d;
  j->xchg = j->ring + DEP_XRING_BYTES;
  /* The kernels push from the ring's head as it is, not from 0: a rank that came back to an
   * elastic job is lent the ring its rank had, whose head and tail the daemon keeps (its
   * proxy reads them; job_elastic.c elastic_scrub_xchg).  Their counters from 0 would
   * publish a head behind the tail, and the proxy fails the job on it.  Nothing pushes
   * meanwhile: this rank is the ring's only producer and no kernel of it has run. */
  const uint64_t head = atomic_load_explicit(&c->xring->head, memory_order_acquire);
  const uint64_t tail = atomic_load_explicit(&c->xring->tail, memory_order_acquire);
  const CUdeviceptr dev = st->dev;
  if ((r = dev_set64(st, dev + offsetof(struct cuops_dev, xr_next), head)) != CUDA_SUCCESS ||
      (r = dev_set64(st, dev + offsetof(struct cuops_dev, xr_pub), head)) != CUDA_SUCCESS ||
      (r = dev_set64(st, dev + offsetof(struct cuops_dev, xr_tail), tail)) != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "setting the kernels' place in the ring to the proxy", r);
  return 0;
}

/*
 * Where the kernels find each rank's slab and its place among the remote
 * ranks (ops_dev.cuh slab_of, is_remote): in the job descriptor for a world
 * of at most CUOPS_MAX_RANKS (slabs[], remote_mask), else in the world
 * arrays at base (kabi.h wslabs, xnum), copied there on the stream after
 * the private area's zeroing, from memory that lives until that copy is
 * done (the stream is synchronised here: a large world's attach only).
 */
static int rank_tables(dep_client_t *c, CUdeviceptr base) {
  struct cuops_state *st = &c->cuops;
  struct cuops_job *j = &st->job;
  const struct ops_ctx *o = &c->ops;
  uint64_t at[CUOPS_WORLD_ARRAYS];
  (void)cuops_world_carve(o->world, at);
  j->remote_mask = 0;
  j->wslabs = NULL;
  j->xnum = NULL;
  if (o->world <= CUOPS_MAX_RANKS) {
    for (uint32_t i = 0; i < o->world; i++) {
      j->slabs[i] = o->slabs[i];
      j->remote_mask |= o->remote[i] >= 0 ? 1ull << i : 0;
    }
    return 0;
  }
  memset(j->slabs, 0, sizeof j->slabs);
  uint8_t **slabs = calloc(o->world, sizeof *slabs);
  int32_t *xnum = calloc(o->world, sizeof *xnum);
  const struct cudadrv *cu = drv();
  CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
  if (slabs != NULL && xnum != NULL) {
    for (uint32_t i = 0; i < o->world; i++) {
      slabs[i] = o->slabs[i];
      xnum[i] = o->remote[i];
    }
    r = cu->cuMemcpyHtoDAsync(base + at[7], slabs, o->world * sizeof *slabs, st->stream);
    if (r == CUDA_SUCCESS)
      r = cu->cuMemcpyHtoDAsync(base + at[8], xnum, o->world * sizeof *xnum, st->stream);
    const CUresult rs = cu->cuStreamSynchronize(st->stream);
    r = r == CUDA_SUCCESS ? rs : r;
  }
  free(slabs);
  free(xnum);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "copying the world's slab table to the GPU", r);
  j->wslabs = (uint8_t **)(uintptr_t)(base + at[7]);
  j->xnum = (int32_t *)(uintptr_t)(base + at[8]);
  return 0;
}

/*
 * A streamed dispatch's node channels (kabi.h cuops_job.fan): the nodes the
 * ring's fan table names, as the host operations read and checked it at
 * attach (host_ops.c init_fan: c->ops's nodes), into the world arrays, copied
 * on the stream after the private area's zeroing.  A job of whole blocks
 * keeps a channel per rank (its kernels have no node channel), and so do
 * the ranks of a node whose ranks are not consecutive: the kernels' waits
 * end only where every rank of a node claims the other nodes' sources in
 * one order (kernels/ops_node.cuh "Deadlock").  A node of more ranks than a
 * daemon holds is refused: the kernels' per-node state is sized by
 * DEP_MAX_LOCAL_RANKS.
 */
static int fan_tables(dep_client_t *c) {
  struct cuops_state *st = &c->cuops;
  struct cuops_job *j = &st->job;
  const struct ops_ctx *o = &c->ops;
  if (o->n_nodes == 0 || o->lay.chan_rows >= o->lay.max_tokens)
    return 0;
  for (uint32_t n = 0; n < o->n_nodes; n++)
    if (o->node[n].n > DEP_MAX_LOCAL_RANKS)
      return client_seterr(c, DEP_ERR_INVALID, "dep_attach: the proxy's ring makes a node of "
                           "%u ranks of rank %u's, more than a daemon holds (%u); is the daemon "
                           "of another build? restart the job with matching deepepd builds",
                           o->node[n].n, o->node[n].lead, DEP_MAX_LOCAL_RANKS);
  uint64_t *fan = calloc(o->world, sizeof *fan);
  uint32_t *rank = calloc(o->world, sizeof *rank);
  const struct cudadrv *cu = drv();
  CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
  if (fan != NULL && rank != NULL) {
    for (uint32_t n = 0; n < o->n_nodes; n++) {
      const struct ops_node *nd = &o->node[n];
      if (o->node_ranks[nd->first + nd->n - 1] - o->node_ranks[nd->first] != nd->n - 1)
        continue; /* ascending: consecutive when the last is n - 1 past the first */
      j->n_nodes++;
      for (uint32_t i = 0; i < nd->n; i++) {
        const uint32_t d = o->node_ranks[nd->first + i];
        rank[nd->first + i] = d;
        fan[d] = CUOPS_FAN(nd->lead, i, nd->n, nd->first);
      }
    }
    r = cu->cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)j->fan, fan, o->world * sizeof *fan,
                              st->stream);
    if (r == CUDA_SUCCESS)
      r = cu->cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)j->fan_rank, rank,
                                o->world * sizeof *rank, st->stream);
    const CUresult rs = cu->cuStreamSynchronize(st->stream);
    r = r == CUDA_SUCCESS ? rs : r;
  }
  free(fan);
  free(rank);
  if (r != CUDA_SUCCESS) {
    j->n_nodes = 0;
    return cu_fail(c, "dep_attach", "copying the node channels' table to the GPU", r);
  }
  return 0;
}

/* A rank that came back to an elastic job starts at its join call (slab.h): the counter the
 * kernels count calls by, set on the stream after the private area's zeroing (and the host's
 * count beside it). */
static int join_at(dep_client_t *c) {
  const struct cudadrv *cu = drv();
  struct cuops_state *st = &c->cuops;
  const struct ops_ctx *o = &c->ops;
  uint64_t join = 0;
  CUresult r = cu->cuMemcpyDtoH(&join, (CUdeviceptr)(uintptr_t)(o->slabs[o->rank] +
                                                                dep_slab_mask_join(&o->lay,
                                                                                   o->rank)),
                                sizeof join);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "reading the rank's join call", r);
  if (join == 0)
    return 0;
  if ((r = dev_set64(st, st->dev + offsetof(struct cuops_dev, seq), join - 1)) != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "setting the rank's first call", r);
  host_ops_join_at(&c->ops, join);
  return 0;
}
#endif

int cuda_ops_attach(dep_client_t *c) {
#ifndef DEP_HAVE_FATBIN
  return 0;
#else
  struct cuops_state *st = &c->cuops;
  /* A job spanning nodes whose daemon lent no ring: its operations refuse
   * (ops.c, saying why), so nothing is bound. */
  if (!st->prepared || !client_ops_here(c))
    return 0;
  const struct cudadrv *cu = drv();
  struct cuops_job *j = &st->job;
  const struct ops_ctx *o = &c->ops;
  struct dep_slab_priv b;
  char why[256] = "";
  int rc = cuops_block_layout(&o->shape, o->world, &o->lay, st->sms, &b, why, sizeof why);
  if (rc != 0)
    return client_seterr(c, rc, "dep_attach: %s", why);
  const CUdeviceptr priv = (CUdeviceptr)(uintptr_t)(o->slabs[o->rank] + o->lay.priv_off);
  st->dev = priv + b.dev;
  st->world_arrays = priv + b.world;
  st->loop_world = priv + b.loop_world;
  st->scratch = priv + b.scratch;
  st->stage = priv + b.stage;
  st->tcnt = priv + b.tcnt;
  st->tcnt_bytes = b.tcnt_bytes;
  st->loop_dev = priv + b.loop_dev;
  st->loop_slab = priv + b.loop_slab;
  st->warm_mem = priv + b.warm_handle;
  CUresult r = cu->cuMemsetD8Async(priv, 0, b.end, st->stream);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "zeroing the operations' memory", r);
  if ((rc = join_at(c)) != 0)
    return rc;
  if ((rc = rank_tables(c, priv + b.world)) != 0)
    return rc;
  if ((rc = ring_bind(c)) != 0)
    return rc;
  j->data_off = o->lay.data_off;
  j->mask_epoch_off = dep_slab_mask_epoch(&o->lay);
  j->mask_word_off = dep_slab_mask_word(&o->lay, 0);
  j->mask_join_off = dep_slab_mask_join(&o->lay, 0);
  j->block_bytes = o->lay.block_bytes;
  j->parity_bytes = o->lay.parity_bytes;
  j->row_bytes = o->lay.row_bytes;
  j->world = o->world;
  j->rank = o->rank;
  j->hidden = o->shape.hidden;
  j->topk = o->shape.topk;
  j->num_experts = o->shape.num_experts;
  j->le = o->shape.num_experts / o->world;
  j->kd = j->topk < j->le ? j->topk : j->le;
  j->max_tokens = o->shape.max_tokens_per_rank;
  j->max_ll = o->lay.max_ll_tokens;
  j->chunk_rows = o->lay.chunk_rows;
  j->chan_rows = o->lay.chan_rows;
  uint32_t budget = 0;
  rc = sm_budget(c, &budget);
  if (rc != 0)
    return rc;
  st->grid = dep__kernel_grid(budget, o->world, &j->parts);
  /* The dispatch senders' counts: one word per (destination, sender warp);
   * the warm-up's world of one (8 parts) needs at most this or 4 KiB. */
  if ((uint64_t)o->world * j->parts * CUOPS_WARPS * 4 + 4096 > st->tcnt_bytes)
    return client_seterr(c, DEP_ERR_INTERNAL, "dep_attach: %u parts of %u ranks overrun the "
                         "dispatch's count scratch (%llu bytes); this is a bug, please report it",
                         j->parts, o->world, (unsigned long long)st->tcnt_bytes);
  j->tcnt = (uint32_t *)(uintptr_t)st->tcnt;
  if (o->world > st->host_from_cap)
    return client_seterr(c, DEP_ERR_INTERNAL, "dep_attach: a world of %u ranks overruns the "
                         "pinned record's room for %u; this is a bug, please report it",
                         o->world, st->host_from_cap);
  world_bind(j, st->world_arrays, o->world);
  if ((rc = fan_tables(c)) != 0)
    return rc;
  j->recv_from = (uint32_t *)(uintptr_t)(st->host_dev + HOST_FROM_OFF);
  j->timeout_ns = (uint64_t)o->timeout_ms * 1000000ull;
  j->host = (struct cuops_host *)(uintptr_t)st->host_dev;
  j->dev = (struct cuops_dev *)(uintptr_t)st->dev;
  st->ready = true;
  rc = c->attach_ok.kernel_warmup ? warmup(c) : 0;
  /* The block's zeroing is done before any operation uses it. */
  r = cu->cuStreamSynchronize(st->stream);
  if (r != CUDA_SUCCESS && rc == 0)
    rc = cu_fail(c, "dep_attach", "cuStreamSynchronize", r);
  cu->cuStreamDestroy(st->stream);
  st->stream = NULL;
  return rc;
#endif
}

void cuda_ops_stats_bind(dep_client_t *c) {
#ifdef DEP_HAVE_FATBIN
  struct cuops_state *st = &c->cuops;
  const struct cudadrv *cu = drv();
  if (c->stats.page == NULL || !st->ready || cu == NULL)
    return;
  CUcontext dummy;
  if (cu->cuCtxPushCurrent(st->ctx) != CUDA_SUCCESS)
    return;
  CUdeviceptr d = 0;
  void *p = c->stats.page;
  if (cu->cuMemHostRegister(p, c->stats.bytes, CU_MEMHOSTREGISTER_PORTABLE |
                                                   CU_MEMHOSTREGISTER_DEVICEMAP) ==
      CUDA_SUCCESS) {
    if (cu->cuMemHostGetDevicePointer(&d, p, 0) == CUDA_SUCCESS) {
      st->stats_pinned = p;
      st->job.stats = (struct dep_stats_page *)(uintptr_t)d;
    } else {
      cu->cuMemHostUnregister(p);
    }
  }
  cu->cuCtxPopCurrent(&dummy);
#else
  (void)c;
#endif
}

void cuda_ops_detach(dep_client_t *c) {
  struct cuops_state *st = &c->cuops;
  cuda_ops_drop_kernels(c);
  if (st->ctx == NULL && st->warm_h == NULL) {
    memset(st, 0, sizeof *st);
    return; /* never loaded: do not initialise CUDA here (a parent may fork after) */
  }
  const struct cudadrv *cu = drv();
  if (st->warm_h != NULL) {
    cuda_ops_handle_free(st->warm_h);
    host_ops_handle_fini(st->warm_h);
    free(st->warm_h);
  }
  if (cu != NULL && st->ctx != NULL) {
    CUcontext dummy;
    bool pushed = cu->cuCtxPushCurrent(st->ctx) == CUDA_SUCCESS;
    if (st->mod != NULL)
      cu->cuModuleUnload(st->mod);
    host_record_free(cu, st);
    if (st->stats_pinned != NULL)
      cu->cuMemHostUnregister(st->stats_pinned);
    if (st->ring_pinned != NULL)
      cu->cuMemHostUnregister(st->ring_pinned);
    if (st->stream != NULL)
      cu->cuStreamDestroy(st->stream);
    if (pushed)
      cu->cuCtxPopCurrent(&dummy);
  }
  memset(st, 0, sizeof *st);
}
