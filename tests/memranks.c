/*
 * memranks.c — the machinery behind check_memory.c: rank processes, forked
 * from the test, that each attach through the real deepepd with their own
 * libdeepep-client handle and run a small script (FILL, CHECK, SYNC, ...)
 * over the slabs they were lent; groups of them seen from the test process;
 * and the daemon as STATUS and /proc show it.
 *
 * A rank reaches its memory as host pointers on the host backend, or as
 * device pointers through the driver (cuda/cudadrv.h) with
 * DEP_TEST_BACKEND=cuda, inside the rank process only, so the test process
 * itself never initialises CUDA before it forks.  On cuda, DEP_TEST_GPUS
 * spreads a job's local ranks over GPUs (local rank l on GPU l % N), and the
 * daemon serves exactly those GPUs.  A rank that fails reports the line here
 * that failed over the group's pipe and writes why on stderr.
 */
#include "clienttest.h"
#include "memranks.h"

#include <check.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudadrv.h"
#include "proto.h"
#include "slab.h"
#include "uuid.h"

int64_t mr_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static bool test_on_cuda(void) {
  const char *b = getenv("DEP_TEST_BACKEND");
  return b != NULL && strcmp(b, "cuda") == 0;
}

/* The daemon places a job's slabs this far apart in its arena. */
#define SLAB_ALIGN (64 * 1024ull)

/* Bytes from one slab of this shape to the next in an arena (dep_attach_info's slab_bytes),
 * for a job with `local` of its `world` ranks on this node. */
uint64_t mr_slab_of(const struct dep_job_shape *s, uint32_t world, uint32_t local) {
  struct dep_slab_layout l;
  char why[256];
  ck_assert_msg(dep__slab_layout_nodes(s, world, local, 0, &l, why, sizeof why) == 0, "%s", why);
  return dep_round_up(l.total_bytes, SLAB_ALIGN);
}

/* The GPUs the ranks spread over, once mr_backend_ready has asked (cuda only). */
static struct tu_gpus test_gpus;
static bool test_gpus_known;

static uint32_t gpus_in_use(void) {
  return test_on_cuda() && test_gpus_known ? (uint32_t)test_gpus.n : 1;
}

uint32_t mr_gpus(void) { return gpus_in_use(); }

bool mr_on_cuda(void) { return test_on_cuda(); }

uint64_t mr_granule(void) {
  return test_on_cuda() ? 2 * MR_MIB : (uint64_t)sysconf(_SC_PAGESIZE);
}

/* What a job of `local` ranks takes from the pools: per device, one block of
 * the slabs of the local ranks placed there (l % N), to the granule. */
uint64_t mr_arena_of(const struct dep_job_shape *s, uint32_t world, uint32_t local) {
  const uint32_t n = gpus_in_use();
  uint64_t total = 0;
  for (uint32_t g = 0; g < n && g < local; g++) {
    uint32_t on_g = (local - g + n - 1) / n; /* local ranks g, g + n, g + 2n, ... */
    total += dep_round_up(on_g * mr_slab_of(s, world, local), mr_granule());
  }
  return total;
}

/* ---- inside a rank: its memory, host or device --------------------------- */

static const struct cudadrv *rank_cu; /* set when this rank's slabs are device memory */

static int dm_put(void *dst, const void *src, size_t n) {
  if (rank_cu == NULL) {
    memcpy(dst, src, n);
    return 0;
  }
  return rank_cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, n) == CUDA_SUCCESS ? 0 : -1;
}

static int dm_get(void *dst, const void *src, size_t n) {
  if (rank_cu == NULL) {
    memcpy(dst, src, n);
    return 0;
  }
  return rank_cu->cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, n) == CUDA_SUCCESS ? 0 : -1;
}

/*
 * Map the memory at [base, base + bytes) a second time, as a rank that means
 * to keep it past dep_detach would: every chunk of the arena the slab lies
 * in, mapped again at a new address (on the host a second mapping of each
 * chunk's pages by mremap with old size 0, found in /proc/self/maps; on cuda
 * a retained handle of each chunk, found with cuMemGetAddressRange).
 * Returns the slab's address in the new mapping, or NULL.
 */
static void *dm_alias(void *base, uint64_t bytes) {
  uintptr_t lo = (uintptr_t)base, hi = lo + bytes;
  if (rank_cu == NULL) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (f == NULL)
      return NULL;
    uintptr_t vs[64], ve[64];
    int n = 0;
    unsigned long s0, e0;
    char line[512];
    while (n < 64 && fgets(line, sizeof line, f) != NULL)
      if (sscanf(line, "%lx-%lx", &s0, &e0) == 2 && e0 > lo && s0 < hi) {
        vs[n] = s0;
        ve[n++] = e0;
      }
    fclose(f);
    if (n == 0)
      return NULL;
    uint8_t *to = mmap(NULL, ve[n - 1] - vs[0], PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (to == MAP_FAILED)
      return NULL;
    for (int i = 0; i < n; i++)
      if (mremap((void *)vs[i], 0, ve[i] - vs[i], MREMAP_MAYMOVE | MREMAP_FIXED,
                 to + (vs[i] - vs[0])) == MAP_FAILED)
        return NULL;
    return to + (lo - vs[0]);
  }
  CUresult (*retain)(CUmemGenericAllocationHandle *, void *) = NULL;
  CUresult (*range)(CUdeviceptr *, size_t *, CUdeviceptr) = NULL;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib != NULL) {
    *(void **)&retain = dlsym(lib, "cuMemRetainAllocationHandle");
    *(void **)&range = dlsym(lib, "cuMemGetAddressRange_v2");
  }
  CUdevice dev = 0;
  CUdeviceptr first = 0, va = 0, s0 = 0;
  size_t sz = 0;
  if (retain == NULL || range == NULL || rank_cu->cuCtxGetDevice(&dev) != CUDA_SUCCESS ||
      range(&first, &sz, lo) != CUDA_SUCCESS)
    return NULL;
  uintptr_t end = first;
  while (end < hi) { /* the chunks the slab spans */
    if (range(&s0, &sz, end) != CUDA_SUCCESS)
      return NULL;
    end = s0 + sz;
  }
  if (rank_cu->cuMemAddressReserve(&va, end - first, 0, 0, 0) != CUDA_SUCCESS)
    return NULL;
  for (uintptr_t at = first; at < end; at = s0 + sz) {
    CUmemGenericAllocationHandle h = 0;
    if (range(&s0, &sz, at) != CUDA_SUCCESS || retain(&h, (void *)at) != CUDA_SUCCESS ||
        rank_cu->cuMemMap(va + (s0 - first), sz, 0, h, 0) != CUDA_SUCCESS)
      return NULL;
  }
  CUmemAccessDesc acc = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, dev},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  if (rank_cu->cuMemSetAccess(va, end - first, &acc, 1) != CUDA_SUCCESS)
    return NULL;
  return (void *)(uintptr_t)(va + (lo - first));
}

/* The device this rank uses: all zero on the host backend; on cuda, the
 * UUID of the GPU DEP_TEST_GPUS places local rank `local_rank` on. */
static int rank_device(uint8_t uuid[16], uint32_t local_rank, char *why, size_t len) {
  memset(uuid, 0, 16);
  if (!test_on_cuda())
    return 0;
  const struct cudadrv *cu = cudadrv_load(why, len);
  int ordinal = 0;
  if (cu == NULL || tu_gpu_for_rank(local_rank, &ordinal, why, len) != 0)
    return -1;
  CUdevice dev;
  CUuuid u;
  CUresult r = cu->cuDeviceGet(&dev, ordinal);
  if (r == CUDA_SUCCESS)
    r = cu->cuDeviceGetUuid(&u, dev);
  if (r != CUDA_SUCCESS) {
    snprintf(why, len, "GPU %d: %s", ordinal, cudadrv_errstr(r));
    return -1;
  }
  memcpy(uuid, u.bytes, 16);
  return 0;
}

/* Word i of the pattern that rank `rank` of a job tagged `tag` writes; tag 0 is all zero. */
static uint64_t pat(uint32_t tag, uint32_t rank, uint64_t i) {
  return tag == 0 ? 0 : ((uint64_t)(tag * 64 + rank + 1) << 40) | i;
}

/* ---- a rank process and its script ----------------------------------------- */

struct rank {
  const struct mr_rank_spec *s;
  int rep, go;
  dep_client_t *c;
  bool attached;
  struct dep_attach_info info;
  uint64_t *buf;
  void *alias;
};

static void rank_fail(const struct rank *r, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));
static void rank_fail(const struct rank *r, int line, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "memranks.c:%d: rank %u of job %s (pid %d, uid %d): %s\n", line,
          r->s->a.rank, r->s->a.job_id, (int)getpid(), (int)getuid(), msg);
  int code = -line;
  if (write(r->rep, &code, sizeof code) < 0)
    _exit(1);
  _exit(1);
}
#define RCHECK(r, cond, ...)                  \
  do {                                        \
    if (!(cond))                              \
      rank_fail((r), __LINE__, __VA_ARGS__);  \
  } while (0)

static void rank_sync(struct rank *r) {
  int zero = 0;
  char byte;
  if (write(r->rep, &zero, sizeof zero) != sizeof zero || read(r->go, &byte, 1) != 1)
    _exit(3); /* the test process is gone */
}

/* What every successful attach must give, whatever the test. */
static void rank_attached(struct rank *r) {
  const struct dep_attach_args *a = &r->s->a;
  struct dep_attach_info *in = &r->info;
  in->size = sizeof *in;
  RCHECK(r, dep_attach_info(r->c, in) == 0, "dep_attach_info: %s", dep_errmsg(r->c));
  RCHECK(r, strcmp(in->backend, test_on_cuda() ? "cuda" : "host") == 0, "backend %s",
         in->backend);
  rank_cu = strcmp(in->backend, "cuda") == 0 ? cudadrv_load(NULL, 0) : NULL;
  RCHECK(r, in->local_rank == a->local_rank && in->local_world_size == a->local_world_size,
         "attach info names local rank %u of %u", in->local_rank, in->local_world_size);
  RCHECK(r, in->slab_bytes == mr_slab_of(&a->shape, a->world_size, a->local_world_size), "slab of %llu bytes",
         (unsigned long long)in->slab_bytes);
  RCHECK(r, in->ranks[a->local_rank] == a->rank, "ranks[%u] = %u", a->local_rank,
         in->ranks[a->local_rank]);
  for (uint32_t i = 0; i < in->local_world_size; i++) {
    RCHECK(r, in->slabs[i] != NULL && in->ranks[i] < a->world_size, "local rank %u: slab %p, rank %u",
           i, in->slabs[i], in->ranks[i]);
    for (uint32_t k = 0; k < i; k++)
      RCHECK(r, in->ranks[k] != in->ranks[i] &&
                    ((uint8_t *)in->slabs[k] + in->slab_bytes <= (uint8_t *)in->slabs[i] ||
                     (uint8_t *)in->slabs[i] + in->slab_bytes <= (uint8_t *)in->slabs[k]),
             "local ranks %u and %u share a rank or overlap", k, i);
  }
  /* Where the time went: the parts inside dep_attach fit inside the whole;
   * mapping always happens; the kernels are set up on cuda only.  The
   * warm-up runs the kernels inside dep_attach on cuda; on the host it maps
   * the slabs' pages in after dep_attach returns (deepep.h), outside the
   * whole. */
  struct dep_attach_times tm = {.size = sizeof tm};
  RCHECK(r, dep_attach_times(r->c, &tm) == 0, "dep_attach_times: %s", dep_errmsg(r->c));
  const double inside = tm.wait_ms + tm.map_ms + tm.setup_ms + (test_on_cuda() ? tm.warmup_ms : 0);
  RCHECK(r, tm.total_ms == in->attach_ms && tm.wait_ms >= 0 && tm.map_ms > 0 &&
                tm.setup_ms >= 0 && tm.warmup_ms >= 0 && inside <= tm.total_ms + 1e-6,
         "attach times: total %.3f, wait %.3f, map %.3f, setup %.3f, warmup %.3f ms",
         tm.total_ms, tm.wait_ms, tm.map_ms, tm.setup_ms, tm.warmup_ms);
  RCHECK(r, test_on_cuda() ? tm.setup_ms > 0 : tm.setup_ms == 0,
         "attach times on %s: setup %.3f, warmup %.3f ms", in->backend, tm.setup_ms,
         tm.warmup_ms);
  r->attached = true;
}

/*
 * The words of a slab that a fresh job's ranks have written themselves
 * before a test reads it: on cuda, each rank's library keeps its operation
 * state in its slab's private area (slab.h) and its warm-up has run there.
 * The host library leaves the area alone, so the host backend's runs check
 * that the daemon scrubs it too.
 */
static void own_words(const struct rank *r, uint64_t *from, uint64_t *to) {
  struct dep_slab_layout l;
  char why[256];
  *from = *to = 0;
  if (test_on_cuda() && dep__slab_layout(&r->s->a.shape, r->s->a.world_size, &l, why,
                                        sizeof why) == 0)
    *from = l.priv_off / 8, *to = (l.priv_off + l.priv_bytes) / 8;
}

/* Compare n words at p with pattern(tag, rank); with any_rank, the rank is read from word 0. */
static void rank_expect(struct rank *r, const void *p, uint32_t tag, uint32_t rank, bool any_rank,
                        const char *what) {
  uint64_t n = r->info.slab_bytes / 8, from, to;
  RCHECK(r, dm_get(r->buf, p, r->info.slab_bytes) == 0, "reading %s", what);
  if (any_rank && tag != 0)
    rank = (uint32_t)((r->buf[0] >> 40) - tag * 64 - 1);
  own_words(r, &from, &to);
  /* The abort words are the daemon's (slab.h): it writes them when a rank of
   * the job leaves, so they are no part of any rank's pattern. */
  const uint64_t ab0 = DEP_SLAB_ABORT_OFF / 8, ab1 = ab0 + sizeof(struct dep_slab_abort) / 8;
  for (uint64_t i = 0; i < n; i++)
    RCHECK(r, (tag == 0 && i >= from && i < to) || (i >= ab0 && i < ab1) ||
                  r->buf[i] == pat(tag, rank, i),
           "%s: word %llu of %llu is %#llx, expected %#llx (%s)", what, (unsigned long long)i,
           (unsigned long long)n, (unsigned long long)r->buf[i],
           (unsigned long long)pat(tag, rank, i), tag == 0 ? "zero" : "the job's pattern");
}

static void rank_fill(struct rank *r, void *p, uint32_t tag) {
  uint64_t n = r->info.slab_bytes / 8;
  for (uint64_t i = 0; i < n; i++)
    r->buf[i] = pat(tag, r->s->a.rank, i);
  RCHECK(r, dm_put(p, r->buf, r->info.slab_bytes) == 0, "writing %llu bytes",
         (unsigned long long)r->info.slab_bytes);
}

static void rank_step(struct rank *r, const struct mr_step *st) {
  const struct dep_attach_args *a = &r->s->a;
  char what[64];
  switch (st->op) {
  case END:
    break;
  case SYNC:
    rank_sync(r);
    break;
  case FILL:
    rank_fill(r, r->info.slabs[a->local_rank], st->arg);
    break;
  case CHECK:
  case CHECK_OWN:
    for (uint32_t i = 0; i < r->info.local_world_size; i++) {
      if (st->op == CHECK_OWN && i != a->local_rank)
        continue;
      snprintf(what, sizeof what, "local rank %u's slab", i);
      rank_expect(r, r->info.slabs[i], st->arg, r->info.ranks[i], false, what);
    }
    break;
  case ALIAS:
    r->alias = dm_alias(r->info.slabs[a->local_rank], r->info.slab_bytes);
    RCHECK(r, r->alias != NULL, "cannot map my slab a second time");
    break;
  case DETACH:
    RCHECK(r, dep_detach(r->c) == 0, "dep_detach: %s", dep_errmsg(r->c));
    r->attached = false;
    break;
  case FILL_ALIAS:
    rank_fill(r, r->alias, st->arg);
    break;
  case CHECK_ALIAS:
    rank_expect(r, r->alias, st->arg, 0, true, "the mapping kept past DETACH");
    break;
  case FREED: {
    /* A rank process that had no context of its own gets the GPU's
     * primary context from dep_attach: once, however often it attaches,
     * and given back with the handle. */
    const struct cudadrv *cu = rank_cu;
    CUdevice dev = -1;
    RCHECK(r, cu == NULL || cu->cuCtxGetDevice(&dev) == CUDA_SUCCESS, "no current context");
    dep_client_free(r->c);
    r->c = NULL;
    r->attached = false;
    unsigned flags = 0;
    int active = 0;
    RCHECK(r, cu == NULL || (cu->cuDevicePrimaryCtxGetState(dev, &flags, &active) ==
                                 CUDA_SUCCESS && active == 0),
           "GPU %d's primary context is still held after dep_client_free", (int)dev);
    break;
  }
  case OWN_JOBS: {
    struct dep_status *stat = NULL;
    RCHECK(r, dep_status(r->c, &stat) == 0, "dep_status: %s", dep_errmsg(r->c));
    RCHECK(r, stat->num_jobs == st->arg, "status lists %u jobs, expected %u", stat->num_jobs,
           st->arg);
    for (uint32_t i = 0; i < stat->num_jobs; i++)
      RCHECK(r, stat->jobs[i].owner_uid == getuid(), "status shows job %s of uid %u",
             stat->jobs[i].job_id, stat->jobs[i].owner_uid);
    dep_status_free(stat);
    break;
  }
  case CYCLES:
    for (uint32_t k = 0; k < st->arg; k++) {
      uint64_t word = k + 1, back = 0;
      RCHECK(r, dep_detach(r->c) == 0, "cycle %u: dep_detach: %s", k, dep_errmsg(r->c));
      RCHECK(r, dep_attach(r->c, a) == 0, "cycle %u: dep_attach: %s", k, dep_errmsg(r->c));
      r->info.size = sizeof r->info;
      RCHECK(r, dep_attach_info(r->c, &r->info) == 0 && r->info.slabs[0] != NULL, "cycle %u", k);
      uint8_t *last = (uint8_t *)r->info.slabs[0] + r->info.slab_bytes - 8;
      RCHECK(r, dm_get(&back, last, 8) == 0 && back == 0 && dm_put(last, &word, 8) == 0 &&
                    dm_get(&back, last, 8) == 0 && back == word,
             "cycle %u: the slab's last word read %llu", k, (unsigned long long)back);
    }
    break;
  }
}

/* A rank speaking the protocol by hand: HELLO and ATTACH, then only SYNCs. */
static void rank_raw(struct rank *r) {
  int fd = tu_connect_raw(r->s->sock);
  RCHECK(r, fd >= 0, "cannot connect to %s", r->s->sock);
  struct dep_msg_hello h = {.version = DEP_PROTO_VERSION, .pid = (uint32_t)getpid()};
  struct proto_buf b;
  proto_buf_init(&b);
  RCHECK(r, proto_frame_encode(&b, DEP_MSG_HELLO, 0, 1, &h) == 0 &&
                proto_frame_encode(&b, DEP_MSG_ATTACH, 0, 2, &r->s->a) == 0 &&
                send(fd, b.data, b.len, MSG_NOSIGNAL) == (ssize_t)b.len,
         "sending HELLO and ATTACH");
  proto_buf_free(&b);
  for (const struct mr_step *st = r->s->script; st->op != END; st++)
    rank_step(r, st);
  close(fd);
  _exit(0);
}

static void rank_main(const struct mr_rank_spec *s, int rep, int go, pid_t parent) {
  struct rank r = {.s = s, .rep = rep, .go = go};
  char why[256] = "";
  if (s->uid != 0)
    RCHECK(&r, setgroups(0, NULL) == 0 && setgid(s->uid) == 0 && setuid(s->uid) == 0,
           "cannot become uid %d: %s", (int)s->uid, strerror(errno));
  /* Die with the test process (set after setuid, which clears it). */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent)
    _exit(3);
  struct mr_rank_spec copy = *s;
  r.s = &copy;
  if (!s->own_uuid)
    RCHECK(&r, rank_device(copy.a.device_uuid, s->a.local_rank, why, sizeof why) == 0,
           "no device: %s", why);
  if (s->raw)
    rank_raw(&r);
  RCHECK(&r, dep_client_new(&r.c) == 0, "dep_client_new");
  RCHECK(&r, dep_connect(r.c, s->sock) == 0, "dep_connect: %s", dep_errmsg(r.c));
  int rc = dep_attach(r.c, &copy.a);
  RCHECK(&r, rc == s->want, "dep_attach gave %s (%s), expected %s", dep_errname(rc),
         dep_errmsg(r.c), dep_errname(s->want));
  if (rc != 0)
    RCHECK(&r, s->want_msg == NULL || strstr(dep_errmsg(r.c), s->want_msg) != NULL,
           "the message \"%s\" lacks \"%s\"", dep_errmsg(r.c), s->want_msg);
  else
    rank_attached(&r);
  r.buf = malloc(r.info.slab_bytes + 8);
  RCHECK(&r, r.buf != NULL, "out of memory");
  for (const struct mr_step *st = s->script; st != NULL && st->op != END; st++)
    rank_step(&r, st);
  if (r.attached)
    RCHECK(&r, dep_detach(r.c) == 0, "dep_detach: %s", dep_errmsg(r.c));
  dep_client_free(r.c);
  free(r.buf);
  _exit(0);
}

struct mr_rank_spec mr_spec(const struct tu_daemon *d, const char *job, uint32_t rank,
                            uint32_t world, uint32_t local_rank, uint32_t lws,
                            struct dep_job_shape shape, const struct mr_step *script) {
  struct mr_rank_spec s = {.sock = d->sock, .script = script};
  s.a.size = sizeof s.a;
  snprintf(s.a.job_id, sizeof s.a.job_id, "%s", job);
  s.a.rank = rank;
  s.a.world_size = world;
  s.a.local_rank = local_rank;
  s.a.local_world_size = lws;
  s.a.shape = shape;
  return s;
}

/* ---- the test process's side: groups of ranks ------------------------------- */

void mr_grp_init(struct mr_grp *g) {
  memset(g, 0, sizeof *g);
  /* Close-on-exec keeps the pipes out of the daemon, which is exec'd. */
  ck_assert_int_eq(pipe2(g->rep, O_CLOEXEC), 0);
}

void mr_grp_spawn_job(struct mr_grp *g, const struct tu_daemon *d, const char *job, uint32_t lws,
                      struct dep_job_shape shape, const struct mr_step *script) {
  for (uint32_t i = 0; i < lws; i++) {
    struct mr_rank_spec s = mr_spec(d, job, i, lws, i, lws, shape, script);
    mr_grp_spawn(g, &s);
  }
}

int mr_grp_spawn(struct mr_grp *g, const struct mr_rank_spec *s) {
  ck_assert_int_lt(g->n, MR_GRP_MAX);
  int *go = g->go[g->n];
  ck_assert_int_eq(pipe2(go, O_CLOEXEC), 0);
  pid_t parent = getpid();
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    close(g->rep[0]);
    close(go[1]);
    rank_main(s, g->rep[1], go[0], parent);
  }
  g->pid[g->n] = pid;
  return g->n++;
}

/* n ranks of the group reach a SYNC (each reports 0; a failing rank reports its line). */
void mr_grp_sync(struct mr_grp *g, int n) {
  for (int i = 0; i < n; i++) {
    struct pollfd p = {.fd = g->rep[0], .events = POLLIN};
    ck_assert_msg(poll(&p, 1, 30000) == 1, "%d of %d ranks did not report within 30 s", n - i, n);
    int code = 1;
    ck_assert_int_eq(read(g->rep[0], &code, sizeof code), (ssize_t)sizeof code);
    ck_assert_msg(code == 0, "a rank failed at memranks.c:%d (its stderr says why)", -code);
  }
}

/* Let every live rank of the group (n of them) past its SYNC. */
void mr_grp_go(struct mr_grp *g, int n) {
  int live = 0;
  for (int i = 0; i < g->n; i++)
    if (!g->done[i]) {
      ck_assert_int_eq(write(g->go[i][1], "g", 1), 1);
      live++;
    }
  ck_assert_int_eq(live, n);
}

void mr_grp_kill(struct mr_grp *g, int i) {
  ck_assert_int_eq(kill(g->pid[i], SIGKILL), 0);
  ck_assert_int_eq(waitpid(g->pid[i], NULL, 0), g->pid[i]);
  g->done[i] = true;
}

/* Every rank not killed exits 0; then the pipes close. */
void mr_grp_reap(struct mr_grp *g) {
  int64_t deadline = mr_now_ms() + 30000;
  for (int i = 0; i < g->n; i++) {
    int st = 0;
    pid_t r;
    while (!g->done[i] && (r = waitpid(g->pid[i], &st, WNOHANG)) == 0 && mr_now_ms() < deadline)
      sleep_ms(5);
    if (g->done[i])
      continue;
    ck_assert_msg(r == g->pid[i], "rank process %d did not exit within 30 s", (int)g->pid[i]);
    g->done[i] = true;
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
      int code = 0;
      struct pollfd p = {.fd = g->rep[0], .events = POLLIN};
      if (poll(&p, 1, 0) == 1 && read(g->rep[0], &code, sizeof code) == sizeof code && code < 0)
        ck_abort_msg("a rank failed at memranks.c:%d (its stderr says why)", -code);
      ck_abort_msg("rank process %d ended with wait status %#x", (int)g->pid[i], st);
    }
  }
  close(g->rep[0]);
  close(g->rep[1]);
  for (int i = 0; i < g->n; i++) {
    close(g->go[i][0]);
    close(g->go[i][1]);
  }
}

/* ---- the daemon, as status and /proc show it ------------------------------- */

/*
 * On cuda, a devices: list naming the GPUs the ranks use, so that the pools
 * STATUS shows are exactly theirs (on a machine of 8 GPUs, with the ranks on
 * 2, the other 6 pools would only blur the counts).
 */
static void devices_yaml(char *out, size_t len, const char *extra) {
  out[0] = '\0';
  if (!test_on_cuda() || !test_gpus_known || (extra != NULL && strstr(extra, "devices:") != NULL))
    return;
  size_t at = (size_t)snprintf(out, len, "devices: [");
  for (int i = 0; i < test_gpus.n && at < len; i++) {
    char u[37];
    dep__uuid_str(test_gpus.uuid[i], u);
    at += (size_t)snprintf(out + at, len - at, "%sGPU-%s", i ? ", " : "", u);
  }
  if (at < len)
    snprintf(out + at, len - at, "]\n");
  ck_assert_uint_lt(at, len);
}

void mr_start(struct tu_daemon *d, unsigned pool_mib, const char *extra) {
  mr_start_pool(d, pool_mib, NULL, extra);
}

void mr_start_pool(struct tu_daemon *d, unsigned pool_mib, const char *pool_keys,
                   const char *extra) {
  char devices[TU_GPUS_MAX * 48 + 16], yaml[TU_GPUS_MAX * 48 + 1024];
  devices_yaml(devices, sizeof devices, extra);
  int n = snprintf(yaml, sizeof yaml, "pool:\n  host_size: %uMiB\n  size_per_device: %uMiB\n"
                   "  chunk_size: 2MiB\n%s%s%s", pool_mib, pool_mib,
                   pool_keys != NULL ? pool_keys : "", devices, extra != NULL ? extra : "");
  ck_assert_int_lt(n, (int)sizeof yaml);
  ck_assert_msg(tu_daemon_start(d, yaml) == 0, "deepepd did not start");
}

dep_client_t *mr_observer(const struct tu_daemon *d) {
  return cl_connect(d->sock);
}

/* The daemon survived everything: it still answers and exits cleanly on SIGTERM. */
void mr_stop_ok(struct tu_daemon *d, dep_client_t *obs) {
  ck_assert_msg(waitpid(d->pid, NULL, WNOHANG) == 0, "deepepd died during the test");
  dep_client_free(obs);
  int st = tu_daemon_stop(d);
  ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "deepepd did not exit cleanly (wait status %#x)", st);
  tu_daemon_cleanup(d);
}

struct mr_pool_now mr_pool_now(dep_client_t *c) {
  struct dep_status *st = NULL;
  ck_assert_msg(dep_status(c, &st) == 0, "dep_status: %s", dep_errmsg(c));
  ck_assert_msg(st->num_devices == gpus_in_use(), "deepepd serves %u devices, the ranks use %u",
                st->num_devices, gpus_in_use());
  struct mr_pool_now p = {.jobs = st->num_jobs, .clients = st->num_clients};
  for (uint32_t i = 0; i < st->num_devices; i++) {
    p.total += st->devices[i].pool_total_bytes;
    p.used += st->devices[i].pool_used_bytes;
    p.cached += st->devices[i].pool_cached_bytes;
    p.held += st->devices[i].pool_held_bytes;
  }
  dep_status_free(st);
  return p;
}

/* Wait (5 s) for the pool to show used and cached bytes: closes are asynchronous. */
void mr_wait_pool(dep_client_t *c, uint64_t used, uint64_t cached) {
  struct mr_pool_now p;
  for (int i = 0; i < 500; i++, sleep_ms(10))
    if ((p = mr_pool_now(c)).used == used && p.cached == cached)
      return;
  ck_abort_msg("the pool shows %llu bytes used and %llu cached, expected %llu and %llu",
               (unsigned long long)p.used, (unsigned long long)p.cached,
               (unsigned long long)used, (unsigned long long)cached);
}

/* Ranks of the job attached now, or -1 when it is not listed. */
int mr_job_ranks(dep_client_t *c, const char *id) {
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status(c, &st), 0);
  int n = -1;
  for (uint32_t i = 0; i < st->num_jobs; i++)
    if (strcmp(st->jobs[i].job_id, id) == 0)
      n = (int)st->jobs[i].ranks_attached;
  dep_status_free(st);
  return n;
}

void mr_wait_job_ranks(dep_client_t *c, const char *id, int n) {
  int now = -2;
  for (int i = 0; i < 500 && (now = mr_job_ranks(c, id)) != n; i++)
    sleep_ms(10);
  ck_assert_msg(now == n, "job %s has %d ranks attached, expected %d (-1: gone)", id, now, n);
}

/*
 * Wait until only the observer is connected, so /proc counts no other
 * socket.  The daemon closes a connection's fd in a close callback at the
 * end of the loop turn that counted it gone (which may also answer our
 * next STATUS); a pause lets that turn end.
 */
void mr_wait_alone(dep_client_t *c) {
  for (int i = 0; i < 500 && mr_pool_now(c).clients != 1; i++)
    sleep_ms(10);
  sleep_ms(50);
  ck_assert_uint_eq(mr_pool_now(c).clients, 1);
}

int mr_daemon_fds(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *dir = opendir(path);
  ck_assert_ptr_nonnull(dir);
  int n = 0;
  for (struct dirent *e; (e = readdir(dir)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

long mr_daemon_rss_kib(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  long kib = -1;
  while (fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
      break;
  fclose(f);
  ck_assert_int_gt(kib, 0);
  return kib;
}

/*
 * With DEP_TEST_BACKEND=cuda the slabs are device memory: skip, saying so,
 * where there is no GPU, and fail where DEP_TEST_GPUS cannot be met.  The
 * probe runs in a child so that this process, which forks the ranks, never
 * initialises CUDA; what it finds (the GPUs in use) stays for mr_start,
 * mr_arena_of and mr_pool_now.
 */
bool mr_backend_ready(const char *test) {
  if (!test_on_cuda())
    return true;
  char why[256] = "";
  int rc = tu_gpus_probe(&test_gpus, why, sizeof why);
  ck_assert_msg(rc >= 0, "%s", why);
  test_gpus_known = rc > 0;
  if (rc > 0)
    return true;
  tu_skip(test, "DEP_TEST_BACKEND=cuda but no usable GPU (%s)", why);
  return false;
}
