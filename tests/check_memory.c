/*
 * check_memory.c — the warm memory as the ranks of a job see it (DESIGN §4,
 * §5).  Every test starts the real deepepd and forks real rank processes,
 * each with its own libdeepep-client handle, that attach through the
 * daemon's rendezvous and then read and write the slabs it lent, through
 * their own mappings.  The tests are specifications of: sharing inside a
 * job, isolation between jobs and users, scrubbing, the buffer cache,
 * deferred pools, ranks that die, an exhausted pool, bad input, and fd and
 * memory leaks over many attaches.
 *
 * One body per test, two memories: on the host backend the slabs are host
 * pointers; with DEP_TEST_BACKEND=cuda they are device pointers, reached
 * through the driver (kernels/cudadrv.h) inside the rank processes only, so
 * the test process itself never initialises CUDA before it forks.
 *
 * A rank runs a small script (FILL, CHECK, SYNC, ...) so that each test
 * reads as the sequence of what its ranks do; SYNC meets the test process
 * through a pipe, where it checks what the daemon reports in between.
 */
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
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudadrv.h"
#include "deepep.h"
#include "proto.h"
#include "slab.h"
#include "testutil.h"

#define MIB (1024ull * 1024ull)
#define CHUNK (2 * MIB) /* pool.chunk_size in every daemon these tests start */
#define NOBODY 65534
#define ALLOW_NOBODY "allow:\n  users: [\"65534\"]\n"
#define GRP_MAX 16
#ifndef __has_feature
#define __has_feature(x) 0
#endif

/* One chunk per rank for any world size up to 8. */
static const struct dep_job_shape TINY = {.max_tokens_per_rank = 16, .hidden = 1024,
                                          .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};
/* Three chunks per rank at world size 4 or 8: one mapping must join them. */
static const struct dep_job_shape WIDE = {.max_tokens_per_rank = 128, .hidden = 1024,
                                          .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};
/* 33 chunks per rank at world size 4: more than a 64 MiB pool holds. */
static const struct dep_job_shape HUGE = {.max_tokens_per_rank = 1024, .hidden = 4096,
                                          .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};

static int64_t now_ms(void) {
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

/* Bytes from one slab of this shape to the next in an arena (dep_attach_info's slab_bytes). */
static uint64_t slab_of(const struct dep_job_shape *s, uint32_t world) {
  struct dep_slab_layout l;
  char why[256];
  ck_assert_msg(dep_slab_layout(s, world, &l, why, sizeof why) == 0, "%s", why);
  return dep_round_up(l.total_bytes, SLAB_ALIGN);
}

/* What a job of `local` ranks on one device takes from its pool: one arena, whole chunks. */
static uint64_t arena_of(const struct dep_job_shape *s, uint32_t world, uint32_t local) {
  return dep_round_up(local * slab_of(s, world), CHUNK);
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

/* The device this rank uses: all zero on the host backend, GPU 0's UUID on cuda. */
static int rank_device(uint8_t uuid[16], char *why, size_t len) {
  memset(uuid, 0, 16);
  if (!test_on_cuda())
    return 0;
  const struct cudadrv *cu = cudadrv_load(why, len);
  CUdevice dev;
  CUuuid u;
  if (cu == NULL || cu->cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cu->cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS)
    return -1;
  memcpy(uuid, u.bytes, 16);
  return 0;
}

/* Word i of the pattern that rank `rank` of a job tagged `tag` writes; tag 0 is all zero. */
static uint64_t pat(uint32_t tag, uint32_t rank, uint64_t i) {
  return tag == 0 ? 0 : ((uint64_t)(tag * 64 + rank + 1) << 40) | i;
}

/* ---- a rank process and its script ----------------------------------------- */

enum op {
  END,         /* detach (if attached) and exit 0 */
  SYNC,        /* tell the test process, wait for its word */
  FILL,        /* write pattern(arg, my rank) over my whole slab */
  CHECK,       /* every local rank's slab holds pattern(arg, its rank); arg 0: all zero */
  CHECK_OWN,   /* the same for my slab alone */
  ALIAS,       /* map my slab a second time, to keep past DETACH */
  DETACH,      /* dep_detach */
  FILL_ALIAS,  /* write pattern(arg, my rank) through the kept mapping */
  CHECK_ALIAS, /* the kept mapping holds pattern(arg, some rank of the job); arg 0: all zero */
  OWN_JOBS,    /* dep_status lists exactly arg jobs, all of my uid */
  CYCLES,      /* arg times: detach, attach again, touch the slab */
};
struct step {
  enum op op;
  uint32_t arg;
};

struct rank_spec {
  const char *sock;
  struct dep_attach_args a;
  uid_t uid;              /* become this uid first (0: stay) */
  bool raw;               /* send HELLO and ATTACH by hand and never read the reply */
  bool own_uuid;          /* keep a.device_uuid instead of this backend's device */
  int want;               /* what dep_attach must return */
  const char *want_msg;   /* ... and a piece of its message when that is an error */
  const struct step *script;
};

struct rank {
  const struct rank_spec *s;
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
  fprintf(stderr, "check_memory.c:%d: rank %u of job %s (pid %d, uid %d): %s\n", line,
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
  RCHECK(r, dep_attach_info(r->c, in) == 0, "dep_attach_info: %s", dep_errmsg(r->c));
  RCHECK(r, strcmp(in->backend, test_on_cuda() ? "cuda" : "host") == 0, "backend %s",
         in->backend);
  rank_cu = strcmp(in->backend, "cuda") == 0 ? cudadrv_load(NULL, 0) : NULL;
  RCHECK(r, in->local_rank == a->local_rank && in->local_world_size == a->local_world_size,
         "attach info names local rank %u of %u", in->local_rank, in->local_world_size);
  RCHECK(r, in->slab_bytes == slab_of(&a->shape, a->world_size), "slab of %llu bytes",
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
  r->attached = true;
}

/* Compare n words at p with pattern(tag, rank); with any_rank, the rank is read from word 0. */
static void rank_expect(struct rank *r, const void *p, uint32_t tag, uint32_t rank, bool any_rank,
                        const char *what) {
  uint64_t n = r->info.slab_bytes / 8;
  RCHECK(r, dm_get(r->buf, p, r->info.slab_bytes) == 0, "reading %s", what);
  if (any_rank && tag != 0)
    rank = (uint32_t)((r->buf[0] >> 40) - tag * 64 - 1);
  for (uint64_t i = 0; i < n; i++)
    RCHECK(r, r->buf[i] == pat(tag, rank, i),
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

static void rank_step(struct rank *r, const struct step *st) {
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
  for (const struct step *st = r->s->script; st->op != END; st++)
    rank_step(r, st);
  close(fd);
  _exit(0);
}

static void rank_main(const struct rank_spec *s, int rep, int go, pid_t parent) {
  struct rank r = {.s = s, .rep = rep, .go = go};
  char why[256] = "";
  if (s->uid != 0)
    RCHECK(&r, setgroups(0, NULL) == 0 && setgid(s->uid) == 0 && setuid(s->uid) == 0,
           "cannot become uid %d: %s", (int)s->uid, strerror(errno));
  /* Die with the test process (set after setuid, which clears it). */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent)
    _exit(3);
  struct rank_spec copy = *s;
  r.s = &copy;
  if (!s->own_uuid)
    RCHECK(&r, rank_device(copy.a.device_uuid, why, sizeof why) == 0, "no device: %s", why);
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
  for (const struct step *st = s->script; st != NULL && st->op != END; st++)
    rank_step(&r, st);
  if (r.attached)
    RCHECK(&r, dep_detach(r.c) == 0, "dep_detach: %s", dep_errmsg(r.c));
  dep_client_free(r.c);
  free(r.buf);
  _exit(0);
}

static struct rank_spec spec(const struct tu_daemon *d, const char *job, uint32_t rank,
                             uint32_t world, uint32_t local_rank, uint32_t lws,
                             struct dep_job_shape shape, const struct step *script) {
  struct rank_spec s = {.sock = d->sock, .script = script};
  snprintf(s.a.job_id, sizeof s.a.job_id, "%s", job);
  s.a.rank = rank;
  s.a.world_size = world;
  s.a.local_rank = local_rank;
  s.a.local_world_size = lws;
  s.a.shape = shape;
  return s;
}

/* ---- the test process's side: groups of ranks ------------------------------- */

/* Ranks report on one shared pipe; each waits for its word on a pipe of its
 * own, so that a quick rank cannot take a slow one's word as well. */
struct grp {
  int rep[2];
  int n;
  int go[GRP_MAX][2];
  pid_t pid[GRP_MAX];
  bool done[GRP_MAX];
};

static void grp_init(struct grp *g) {
  memset(g, 0, sizeof *g);
  /* Close-on-exec keeps the pipes out of the daemon, which is exec'd. */
  ck_assert_int_eq(pipe2(g->rep, O_CLOEXEC), 0);
}

static int grp_spawn(struct grp *g, const struct rank_spec *s) {
  ck_assert_int_lt(g->n, GRP_MAX);
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
static void grp_sync(struct grp *g, int n) {
  for (int i = 0; i < n; i++) {
    struct pollfd p = {.fd = g->rep[0], .events = POLLIN};
    ck_assert_msg(poll(&p, 1, 30000) == 1, "%d of %d ranks did not report within 30 s", n - i, n);
    int code = 1;
    ck_assert_int_eq(read(g->rep[0], &code, sizeof code), (ssize_t)sizeof code);
    ck_assert_msg(code == 0, "a rank failed at check_memory.c:%d (its stderr says why)", -code);
  }
}

/* Let every live rank of the group (n of them) past its SYNC. */
static void grp_go(struct grp *g, int n) {
  int live = 0;
  for (int i = 0; i < g->n; i++)
    if (!g->done[i]) {
      ck_assert_int_eq(write(g->go[i][1], "g", 1), 1);
      live++;
    }
  ck_assert_int_eq(live, n);
}

static void grp_kill(struct grp *g, int i) {
  ck_assert_int_eq(kill(g->pid[i], SIGKILL), 0);
  ck_assert_int_eq(waitpid(g->pid[i], NULL, 0), g->pid[i]);
  g->done[i] = true;
}

/* Every rank not killed exits 0; then the pipes close. */
static void grp_reap(struct grp *g) {
  int64_t deadline = now_ms() + 30000;
  for (int i = 0; i < g->n; i++) {
    int st = 0;
    pid_t r;
    while (!g->done[i] && (r = waitpid(g->pid[i], &st, WNOHANG)) == 0 && now_ms() < deadline)
      sleep_ms(5);
    if (g->done[i])
      continue;
    ck_assert_msg(r == g->pid[i], "rank process %d did not exit within 30 s", (int)g->pid[i]);
    g->done[i] = true;
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
      int code = 0;
      struct pollfd p = {.fd = g->rep[0], .events = POLLIN};
      if (poll(&p, 1, 0) == 1 && read(g->rep[0], &code, sizeof code) == sizeof code && code < 0)
        ck_abort_msg("a rank failed at check_memory.c:%d (its stderr says why)", -code);
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

static void start(struct tu_daemon *d, unsigned pool_mib, const char *extra) {
  char yaml[1024];
  snprintf(yaml, sizeof yaml, "pool:\n  host_size: %uMiB\n  size_per_device: %uMiB\n"
           "  chunk_size: 2MiB\n%s", pool_mib, pool_mib, extra != NULL ? extra : "");
  ck_assert_msg(tu_daemon_start(d, yaml) == 0, "deepepd did not start");
}

static dep_client_t *observer(const struct tu_daemon *d) {
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), 0);
  ck_assert_msg(dep_connect(c, d->sock) == 0, "%s", dep_errmsg(c));
  return c;
}

/* The daemon survived everything: it still answers and exits cleanly on SIGTERM. */
static void stop_ok(struct tu_daemon *d, dep_client_t *obs) {
  ck_assert_msg(waitpid(d->pid, NULL, WNOHANG) == 0, "deepepd died during the test");
  dep_client_free(obs);
  int st = tu_daemon_stop(d);
  ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "deepepd did not exit cleanly (wait status %#x)", st);
  tu_daemon_cleanup(d);
}

struct pool_now {
  uint64_t total, used, cached;
  uint32_t jobs, clients;
};

static struct pool_now pool_now(dep_client_t *c) {
  struct dep_status *st = NULL;
  ck_assert_msg(dep_status(c, &st) == 0, "dep_status: %s", dep_errmsg(c));
  ck_assert_uint_eq(st->num_devices, 1);
  struct pool_now p = {st->devices[0].pool_total_bytes, st->devices[0].pool_used_bytes,
                       st->devices[0].pool_cached_bytes, st->num_jobs, st->num_clients};
  dep_status_free(st);
  return p;
}

/* Wait (5 s) for the pool to show used and cached bytes: closes are asynchronous. */
static void wait_pool(dep_client_t *c, uint64_t used, uint64_t cached) {
  struct pool_now p;
  for (int i = 0; i < 500; i++, sleep_ms(10))
    if ((p = pool_now(c)).used == used && p.cached == cached)
      return;
  ck_abort_msg("the pool shows %llu bytes used and %llu cached, expected %llu and %llu",
               (unsigned long long)p.used, (unsigned long long)p.cached,
               (unsigned long long)used, (unsigned long long)cached);
}

/* Ranks of the job attached now, or -1 when it is not listed. */
static int job_ranks(dep_client_t *c, const char *id) {
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status(c, &st), 0);
  int n = -1;
  for (uint32_t i = 0; i < st->num_jobs; i++)
    if (strcmp(st->jobs[i].job_id, id) == 0)
      n = (int)st->jobs[i].ranks_attached;
  dep_status_free(st);
  return n;
}

static void wait_job_ranks(dep_client_t *c, const char *id, int n) {
  int now = -2;
  for (int i = 0; i < 500 && (now = job_ranks(c, id)) != n; i++)
    sleep_ms(10);
  ck_assert_msg(now == n, "job %s has %d ranks attached, expected %d (-1: gone)", id, now, n);
}

/*
 * Wait until only the observer is connected, so /proc counts no other
 * socket.  The daemon closes a connection's fd in a close callback at the
 * end of the loop turn that counted it gone (which may also answer our
 * next STATUS); a pause lets that turn end.
 */
static void wait_alone(dep_client_t *c) {
  for (int i = 0; i < 500 && pool_now(c).clients != 1; i++)
    sleep_ms(10);
  sleep_ms(50);
  ck_assert_uint_eq(pool_now(c).clients, 1);
}

static int daemon_fds(pid_t pid) {
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

static long daemon_rss_kib(pid_t pid) {
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
 * where there is no GPU.  The probe runs in a child so that this process,
 * which forks the ranks, never initialises CUDA.
 */
static bool backend_ready(const char *test) {
  if (!test_on_cuda())
    return true;
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0)
    _exit(tu_have_gpu() ? 0 : 1);
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
    return true;
  size_t n = strlen(test); /* __func__ of a Check test ends in "_fn" */
  printf("%.*s: skipped: DEP_TEST_BACKEND=cuda but no usable GPU (libcuda.so.1 or a device "
         "is missing)\n", (int)(n > 3 ? n - 3 : n), test);
  return false;
}
#define NEEDS_BACKEND()              \
  do {                               \
    if (!backend_ready(__func__))    \
      return;                        \
  } while (0)
#define NEEDS_ROOT()                                                                      \
  do {                                                                                    \
    if (getuid() != 0) {                                                                  \
      printf("%.*s: skipped: needs root to run a rank as uid %d\n",                      \
             (int)strlen(__func__) - 3, __func__, NOBODY);                                \
      return;                                                                             \
    }                                                                                     \
  } while (0)

/* ---- one job -------------------------------------------------------------------- */

START_TEST(eight_ranks_share_one_job_and_read_every_peers_slab) {
  NEEDS_BACKEND();
  struct tu_daemon d;
  start(&d, 64, NULL);
  dep_client_t *obs = observer(&d);
  const uint64_t slab = slab_of(&WIDE, 8), arena = arena_of(&WIDE, 8, 8);
  ck_assert_uint_gt(arena, 8 * CHUNK); /* many chunks: the library must join them */
  static const struct step script[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  struct grp g;
  grp_init(&g);
  /* Global ranks run opposite to local ranks, so that mixing the two up shows. */
  for (uint32_t i = 0; i < 8; i++) {
    struct rank_spec s = spec(&d, "moe-8", 7 - i, 8, i, 8, WIDE, script);
    grp_spawn(&g, &s);
  }
  grp_sync(&g, 8); /* every rank has written its slab */
  struct pool_now p = pool_now(obs);
  ck_assert_uint_eq(p.total, 64 * MIB);
  ck_assert_uint_eq(p.used, arena);
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status(obs, &st), 0);
  ck_assert_uint_eq(st->num_jobs, 1);
  ck_assert_str_eq(st->jobs[0].job_id, "moe-8");
  ck_assert_uint_eq(st->jobs[0].ranks_attached, 8);
  ck_assert_uint_eq(st->jobs[0].slab_bytes, slab);
  ck_assert_uint_eq(st->jobs[0].owner_uid, getuid());
  dep_status_free(st);
  grp_go(&g, 8);
  grp_sync(&g, 8); /* every rank has read all eight patterns through its own mapping */
  grp_go(&g, 8);
  grp_reap(&g);
  /* The buffer cache (on by default) keeps the slabs, scrubbed, for the next job. */
  wait_pool(obs, 0, arena);
  ck_assert_int_eq(job_ranks(obs, "moe-8"), -1);
  stop_ok(&d, obs);
}
END_TEST

/* ---- isolation ---------------------------------------------------------------------- */

START_TEST(two_jobs_of_different_users_cannot_join_or_see_each_other) {
  NEEDS_BACKEND();
  NEEDS_ROOT();
  struct tu_daemon d;
  start(&d, 64, ALLOW_NOBODY);
  dep_client_t *obs = observer(&d);
  static const struct step a_script[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  static const struct step b_script[] = {{CHECK_OWN, 0}, {FILL, 2}, {OWN_JOBS, 1}, {SYNC, 0},
                                         {CHECK, 2}, {END, 0}};
  struct grp ga, gb, gi;
  grp_init(&ga);
  grp_init(&gb);
  grp_init(&gi);
  for (uint32_t i = 0; i < 2; i++) {
    struct rank_spec s = spec(&d, "job-root", i, 2, i, 2, TINY, a_script);
    grp_spawn(&ga, &s);
  }
  grp_sync(&ga, 2);
  /* Another user's job starts beside it: its memory is all zero, its status shows it alone. */
  for (uint32_t i = 0; i < 2; i++) {
    struct rank_spec s = spec(&d, "job-nobody", i, 2, i, 2, TINY, b_script);
    s.uid = NOBODY;
    grp_spawn(&gb, &s);
  }
  grp_sync(&gb, 2);
  /* Neither user can join the other's job. */
  struct rank_spec in = spec(&d, "job-root", 1, 2, 1, 2, TINY, NULL);
  in.uid = NOBODY;
  in.want = DEP_ERR_PERMISSION;
  in.want_msg = "job job-root belongs to another user";
  grp_spawn(&gi, &in);
  in = spec(&d, "job-nobody", 1, 2, 1, 2, TINY, NULL);
  in.want = DEP_ERR_PERMISSION;
  in.want_msg = "job job-nobody belongs to another user";
  grp_spawn(&gi, &in);
  grp_reap(&gi);
  struct pool_now p = pool_now(obs);
  ck_assert_uint_eq(p.jobs, 2);
  ck_assert_uint_eq(p.used, 2 * arena_of(&TINY, 2, 2));
  ck_assert_int_eq(job_ranks(obs, "job-root"), 2);
  ck_assert_int_eq(job_ranks(obs, "job-nobody"), 2);
  /* The first job's bytes are as it wrote them: the other's writes went elsewhere. */
  grp_go(&ga, 2);
  grp_sync(&ga, 2);
  grp_go(&gb, 2);
  grp_reap(&gb);
  grp_go(&ga, 2);
  grp_reap(&ga);
  wait_pool(obs, 0, 2 * arena_of(&TINY, 2, 2));
  stop_ok(&d, obs);
}
END_TEST

START_TEST(another_users_job_never_sees_old_bytes_even_through_a_kept_mapping) {
  NEEDS_BACKEND();
  NEEDS_ROOT();
  struct tu_daemon d;
  /* One chunk: the second job must take the very chunk the first one used. */
  ck_assert_uint_eq(arena_of(&TINY, 2, 2), CHUNK);
  start(&d, 2, ALLOW_NOBODY);
  dep_client_t *obs = observer(&d);
  /* The first job's ranks keep a mapping of their slabs past DETACH, as a
   * hostile tenant could, and look through it while the next job runs. */
  static const struct step a_script[] = {{FILL, 1},        {ALIAS, 0}, {DETACH, 0},
                                         {SYNC, 0},        {CHECK_ALIAS, 0}, {FILL_ALIAS, 3},
                                         {SYNC, 0},        {END, 0}};
  static const struct step b_script[] = {{CHECK_OWN, 0}, {FILL, 2}, {SYNC, 0}, {CHECK, 2}, {END, 0}};
  struct grp ga, gb;
  grp_init(&ga);
  grp_init(&gb);
  for (uint32_t i = 0; i < 2; i++) {
    struct rank_spec s = spec(&d, "tenant-root", i, 2, i, 2, TINY, a_script);
    grp_spawn(&ga, &s);
  }
  grp_sync(&ga, 2);
  wait_pool(obs, 0, CHUNK);
  for (uint32_t i = 0; i < 2; i++) {
    struct rank_spec s = spec(&d, "tenant-nobody", i, 2, i, 2, TINY, b_script);
    s.uid = NOBODY;
    grp_spawn(&gb, &s);
  }
  grp_sync(&gb, 2); /* the new tenant read zeros and wrote its pattern */
  struct pool_now p = pool_now(obs);
  ck_assert_uint_eq(p.used, CHUNK);
  ck_assert_uint_eq(p.cached, 0);
  ck_assert_uint_eq(p.total, 2 * MIB);
  /* The old tenant sees none of it, and what it writes reaches nobody. */
  grp_go(&ga, 2);
  grp_sync(&ga, 2);
  grp_go(&gb, 2);
  grp_reap(&gb);
  grp_go(&ga, 2);
  grp_reap(&ga);
  stop_ok(&d, obs);
}
END_TEST

/* ---- buffer cache and deferred pools --------------------------------------------- */

/*
 * Job 1 writes, keeps a mapping and leaves; job 2 of the same shape and uid
 * reads zeros; job 1's kept mapping then shows job 2's bytes, which proves
 * the very same memory was lent again, so the zeros are the scrub's work.
 */
static void reuse_after_scrub(bool cache) {
  struct tu_daemon d;
  /* With the cache, a pool the 8-rank job at the end fills only by evicting it. */
  const uint64_t first = arena_of(&TINY, 2, 2), whole = arena_of(&TINY, 8, 8);
  char pool_yaml[64];
  snprintf(pool_yaml, sizeof pool_yaml, "%s",
           cache ? "" : "buffer_cache_enabled: false\n");
  start(&d, cache ? (unsigned)(whole / MIB) : 4, pool_yaml);
  dep_client_t *obs = observer(&d);
  const uint64_t cached = cache ? first : 0;
  static const struct step one[] = {{FILL, 1}, {ALIAS, 0}, {DETACH, 0}, {SYNC, 0},
                                    {CHECK_ALIAS, 2}, {SYNC, 0}, {END, 0}};
  static const struct step two[] = {{CHECK_OWN, 0}, {FILL, 2}, {SYNC, 0}, {END, 0}};
  struct grp g1, g2;
  grp_init(&g1);
  grp_init(&g2);
  for (uint32_t i = 0; i < 2; i++) {
    struct rank_spec s = spec(&d, "first", i, 2, i, 2, TINY, one);
    grp_spawn(&g1, &s);
  }
  grp_sync(&g1, 2);
  wait_pool(obs, 0, cached); /* between the jobs */
  if (cache) {
    char cmd[700], out[8192] = "";
    snprintf(cmd, sizeof cmd, "%s -s %s --json status", tu_bin("deepepctl"), d.sock);
    FILE *f = popen(cmd, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    ck_assert_int_eq(pclose(f), 0);
    char want[64];
    snprintf(want, sizeof want, "\"pool_cached_bytes\":%llu", (unsigned long long)first);
    ck_assert_msg(strstr(out, want) != NULL, "deepepctl: %s", out);
  }
  for (uint32_t i = 0; i < 2; i++) {
    struct rank_spec s = spec(&d, "second", i, 2, i, 2, TINY, two);
    grp_spawn(&g2, &s);
  }
  grp_sync(&g2, 2);
  /* The cached slabs were taken, not fresh chunks. */
  wait_pool(obs, first, 0);
  grp_go(&g1, 2);
  grp_sync(&g1, 2);
  grp_go(&g1, 2);
  grp_reap(&g1);
  grp_go(&g2, 2);
  grp_reap(&g2);
  wait_pool(obs, 0, cached);
  if (cache) {
    /* Cached slabs give way to a job of another shape that needs the whole pool. */
    static const struct step all[] = {{CHECK, 0}, {SYNC, 0}, {END, 0}};
    struct grp g3;
    grp_init(&g3);
    for (uint32_t i = 0; i < 8; i++) {
      struct rank_spec s = spec(&d, "whole-pool", i, 8, i, 8, TINY, all);
      grp_spawn(&g3, &s);
    }
    grp_sync(&g3, 8);
    wait_pool(obs, whole, 0);
    grp_go(&g3, 8);
    grp_reap(&g3);
    wait_pool(obs, 0, whole);
  }
  stop_ok(&d, obs);
}

START_TEST(with_the_cache_on_the_next_job_of_the_shape_reuses_scrubbed_slabs) {
  NEEDS_BACKEND();
  reuse_after_scrub(true);
}
END_TEST

START_TEST(with_the_cache_off_chunks_return_scrubbed_and_nothing_is_cached) {
  NEEDS_BACKEND();
  reuse_after_scrub(false);
}
END_TEST

START_TEST(without_preallocation_the_pool_is_made_on_first_attach) {
  NEEDS_BACKEND();
  static const struct step script[] = {{CHECK_OWN, 0}, {FILL, 1}, {SYNC, 0}, {END, 0}};
  for (int pre = 1; pre >= 0; pre--) {
    struct tu_daemon d;
    start(&d, 16, pre ? "preallocation: true\n" : "preallocation: false\n");
    dep_client_t *obs = observer(&d);
    struct pool_now p = pool_now(obs);
    ck_assert_uint_eq(p.total, 16 * MIB); /* reported before any memory is made */
    ck_assert_uint_eq(p.used, 0);
    wait_alone(obs); /* tu_daemon_start's probe connection is gone */
    int fds0 = daemon_fds(d.pid);
    struct grp g;
    grp_init(&g);
    for (uint32_t i = 0; i < 2; i++) {
      struct rank_spec s = spec(&d, "first", i, 2, i, 2, TINY, script);
      grp_spawn(&g, &s);
    }
    grp_sync(&g, 2);
    ck_assert_uint_eq(pool_now(obs).used, arena_of(&TINY, 2, 2));
    grp_go(&g, 2);
    grp_reap(&g);
    wait_pool(obs, 0, arena_of(&TINY, 2, 2));
    wait_alone(obs);
    /* One fd per chunk: none new when the pool was made at start, the
     * arena's chunk when it was made on demand (and kept for the next job). */
    int grew = daemon_fds(d.pid) - fds0;
    if (pre)
      ck_assert_int_eq(grew, 0);
    else
      ck_assert_int_ge(grew, (int)(arena_of(&TINY, 2, 2) / CHUNK));
    ck_assert_uint_eq(pool_now(obs).total, 16 * MIB);
    stop_ok(&d, obs);
  }
}
END_TEST

/* ---- ranks that die ------------------------------------------------------------------ */

/* The next job after a death attaches and reads nothing of the dead job. */
static void next_job_reads_zero(const struct tu_daemon *d, const char *id, uint32_t lws,
                                const struct dep_job_shape *shape) {
  static const struct step script[] = {{CHECK, 0}, {END, 0}};
  struct grp g;
  grp_init(&g);
  for (uint32_t i = 0; i < lws; i++) {
    struct rank_spec s = spec(d, id, i, lws, i, lws, *shape, script);
    grp_spawn(&g, &s);
  }
  grp_reap(&g);
}

static void sigkill_ranks(bool all) {
  struct tu_daemon d;
  start(&d, 64, NULL);
  dep_client_t *obs = observer(&d);
  const uint64_t arena = arena_of(&WIDE, 4, 4);
  ck_assert_uint_gt(arena, 4 * CHUNK);
  static const struct step script[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  struct grp g;
  grp_init(&g);
  for (uint32_t i = 0; i < 4; i++) {
    struct rank_spec s = spec(&d, "doomed", i, 4, i, 4, WIDE, script);
    grp_spawn(&g, &s);
  }
  grp_sync(&g, 4);
  ck_assert_uint_eq(pool_now(obs).used, arena);
  if (all) {
    for (int i = 0; i < 4; i++)
      grp_kill(&g, i);
    wait_job_ranks(obs, "doomed", -1);
  } else {
    grp_kill(&g, 2);
    wait_job_ranks(obs, "doomed", 3);
    /* Live ranks may still touch the dead rank's slab: it stays lent, unscrubbed. */
    ck_assert_uint_eq(pool_now(obs).used, arena);
    grp_go(&g, 3);
    grp_sync(&g, 3); /* the survivors read all four patterns, the dead rank's too */
    ck_assert_uint_eq(pool_now(obs).used, arena);
    grp_go(&g, 3);
  }
  grp_reap(&g);
  wait_pool(obs, 0, arena);
  wait_alone(obs);
  next_job_reads_zero(&d, "doomed", 4, &WIDE);
  stop_ok(&d, obs);
}

START_TEST(sigkill_of_one_rank_keeps_the_memory_until_the_last_rank_leaves) {
  NEEDS_BACKEND();
  sigkill_ranks(false);
}
END_TEST

START_TEST(sigkill_of_every_rank_returns_the_memory) {
  NEEDS_BACKEND();
  sigkill_ranks(true);
}
END_TEST

START_TEST(sigkill_of_a_rank_mid_attach) {
  NEEDS_BACKEND();
  struct tu_daemon d;
  start(&d, 64, NULL);
  dep_client_t *obs = observer(&d);
  const uint64_t arena = arena_of(&WIDE, 4, 4), small = arena_of(&TINY, 2, 2);
  static const struct step script[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {END, 0}};
  /* A rank killed while it waits in the rendezvous frees its place for a successor. */
  struct grp g;
  grp_init(&g);
  for (uint32_t i = 0; i < 3; i++) {
    struct rank_spec s = spec(&d, "mid", i, 4, i, 4, WIDE, script);
    grp_spawn(&g, &s);
  }
  wait_job_ranks(obs, "mid", 3);
  grp_kill(&g, 1);
  wait_job_ranks(obs, "mid", 2);
  ck_assert_uint_eq(pool_now(obs).used, 0); /* nothing is lent before the rendezvous */
  for (uint32_t i = 1; i < 4; i += 2) {
    struct rank_spec s = spec(&d, "mid", i, 4, i, 4, WIDE, script);
    grp_spawn(&g, &s);
  }
  grp_sync(&g, 4);
  ck_assert_uint_eq(pool_now(obs).used, arena);
  grp_go(&g, 4);
  grp_reap(&g);
  wait_pool(obs, 0, arena);
  wait_alone(obs);
  /* A rank killed after its ATTACH completed the job, before it read the reply:
   * the fds on their way to it must not stay open in the daemon. */
  int fds0 = daemon_fds(d.pid);
  static const struct step lib_script[] = {{FILL, 2}, {SYNC, 0}, {CHECK_OWN, 2}, {END, 0}};
  static const struct step raw_script[] = {{SYNC, 0}, {END, 0}};
  grp_init(&g);
  struct rank_spec s = spec(&d, "mid-raw", 0, 2, 0, 2, TINY, lib_script);
  grp_spawn(&g, &s);
  s = spec(&d, "mid-raw", 1, 2, 1, 2, TINY, raw_script);
  s.raw = true;
  int raw = grp_spawn(&g, &s);
  grp_sync(&g, 2);
  grp_kill(&g, raw);
  wait_job_ranks(obs, "mid-raw", 1);
  ck_assert_uint_eq(pool_now(obs).used, small);
  grp_go(&g, 1);
  grp_reap(&g);
  wait_pool(obs, 0, arena + small);
  wait_alone(obs);
  ck_assert_int_eq(daemon_fds(d.pid), fds0);
  next_job_reads_zero(&d, "after", 2, &TINY);
  stop_ok(&d, obs);
}
END_TEST

/* ---- limits and bad input ------------------------------------------------------------- */

START_TEST(pool_exhaustion_is_no_memory_and_the_rest_carries_on) {
  NEEDS_BACKEND();
  struct tu_daemon d;
  start(&d, 18, NULL); /* nine chunks */
  dep_client_t *obs = observer(&d);
  ck_assert_uint_eq(arena_of(&WIDE, 4, 4), 9 * CHUNK);
  ck_assert_uint_eq(arena_of(&TINY, 2, 2), CHUNK);
  static const struct step hold[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  static const struct step use[] = {{CHECK_OWN, 0}, {FILL, 3}, {SYNC, 0}, {CHECK, 3}, {END, 0}};
  struct grp ga, gb, gc;
  grp_init(&ga);
  grp_init(&gb);
  grp_init(&gc);
  for (uint32_t i = 0; i < 2; i++) {
    struct rank_spec s = spec(&d, "holder", i, 2, i, 2, TINY, hold);
    grp_spawn(&ga, &s);
  }
  grp_sync(&ga, 2);
  /* Nine chunks fit the pool, but only eight are free: every rank hears why. */
  for (uint32_t i = 0; i < 4; i++) {
    struct rank_spec s = spec(&d, "greedy", i, 4, i, 4, WIDE, NULL);
    s.want = DEP_ERR_NO_MEMORY;
    s.want_msg = "free of 9; raise pool.size_per_device";
    grp_spawn(&gb, &s);
  }
  grp_reap(&gb);
  ck_assert_int_eq(job_ranks(obs, "greedy"), -1);
  ck_assert_uint_eq(pool_now(obs).used, CHUNK);
  /* A job that fits still attaches; the holder's memory is untouched. */
  for (uint32_t i = 0; i < 2; i++) {
    struct rank_spec s = spec(&d, "modest", i, 2, i, 2, TINY, use);
    grp_spawn(&gc, &s);
  }
  grp_sync(&gc, 2);
  ck_assert_uint_eq(pool_now(obs).used, 2 * CHUNK);
  grp_go(&gc, 2);
  grp_reap(&gc);
  grp_go(&ga, 2);
  grp_sync(&ga, 2);
  grp_go(&ga, 2);
  grp_reap(&ga);
  wait_pool(obs, 0, 2 * CHUNK); /* the holder's and the modest job's arenas */
  /* With the pool free again the same job fits. */
  next_job_reads_zero(&d, "greedy", 4, &WIDE);
  stop_ok(&d, obs);
}
END_TEST

/* ATTACH on a raw connection: the daemon's own answer, whatever the library checks first. */
static int raw_attach_error(const struct tu_daemon *d, const struct dep_attach_args *a, char *msg,
                            size_t len) {
  int fd = tu_connect_raw(d->sock);
  ck_assert_int_ge(fd, 0);
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct dep_msg_hello h = {.version = DEP_PROTO_VERSION};
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_HELLO, 0, 1, &h), 0);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_ATTACH, 0, 2, a), 0);
  ck_assert_int_eq(send(fd, b.data, b.len, MSG_NOSIGNAL), (ssize_t)b.len);
  proto_buf_free(&b);
  static uint8_t body[DEP_PROTO_MAX_BODY];
  struct dep_frame_hdr fh = {0};
  do {
    uint8_t hdr[DEP_PROTO_HDR_LEN];
    ck_assert_int_eq(recv(fd, hdr, sizeof hdr, MSG_WAITALL), (ssize_t)sizeof hdr);
    ck_assert_int_eq(proto_hdr_decode(hdr, DEP_PROTO_MAX_BODY, &fh, NULL, 0), 0);
    ck_assert_int_eq(recv(fd, body, fh.body_len, MSG_WAITALL), (ssize_t)fh.body_len);
  } while (fh.type == DEP_MSG_HELLO_OK);
  ck_assert_str_eq(proto_type_name(fh.type), "ERROR");
  struct dep_msg_error e;
  ck_assert_int_eq(proto_decode_error(body, fh.body_len, &e), 0);
  snprintf(msg, len, "%s", e.message);
  close(fd);
  return e.code;
}

START_TEST(bad_input_gets_its_own_error_and_every_other_job_carries_on) {
  NEEDS_BACKEND();
  struct tu_daemon d;
  start(&d, 64, NULL);
  dep_client_t *obs = observer(&d);
  static const struct step run[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  struct grp gj, gk, gm, gbad;
  grp_init(&gj);
  grp_init(&gk);
  grp_init(&gm);
  grp_init(&gbad);
  for (uint32_t i = 0; i < 2; i++) {
    struct rank_spec s = spec(&d, "steady", i, 2, i, 2, TINY, run);
    grp_spawn(&gj, &s);
  }
  grp_sync(&gj, 2);
  /* Jobs with a first rank waiting, for the claims below to collide with. */
  struct rank_spec s = spec(&d, "dup", 0, 2, 0, 2, TINY, run);
  grp_spawn(&gk, &s);
  s = spec(&d, "lws", 0, 4, 0, 2, TINY, run);
  grp_spawn(&gm, &s);
  wait_job_ranks(obs, "dup", 1);
  wait_job_ranks(obs, "lws", 1);

  struct rank_spec bad[6];
  bad[0] = spec(&d, "huge", 0, 4, 0, 1, HUGE, NULL);
  ck_assert_uint_gt(slab_of(&HUGE, 4), 64 * MIB);
  bad[0].want = DEP_ERR_NO_MEMORY;
  bad[0].want_msg = "lower max_tokens_per_rank or hidden";
  bad[1] = spec(&d, "past-world", 2, 2, 0, 1, TINY, NULL);
  bad[1].want = DEP_ERR_INVALID;
  bad[1].want_msg = "rank 2 is out of range (allowed 0..1 for world_size 2)";
  bad[2] = spec(&d, "dup", 0, 2, 0, 2, TINY, NULL); /* the same local and global rank */
  bad[2].want = DEP_ERR_EXISTS;
  bad[2].want_msg = "local rank 0 of job dup is already attached by pid";
  bad[3] = spec(&d, "dup", 0, 2, 1, 2, TINY, NULL); /* the same global rank elsewhere */
  bad[3].want = DEP_ERR_EXISTS;
  bad[3].want_msg = "rank 0 of job dup is already attached by pid";
  bad[4] = spec(&d, "nowhere", 0, 1, 0, 1, TINY, NULL);
  memset(bad[4].a.device_uuid, 0xde, 16);
  bad[4].own_uuid = true;
  bad[4].want = DEP_ERR_NOT_FOUND;
  bad[4].want_msg = "dededede-dede-dede-dede-dededededede";
  bad[5] = spec(&d, "lws", 1, 4, 1, 3, TINY, NULL);
  bad[5].want = DEP_ERR_MISMATCH;
  bad[5].want_msg = "local_world_size 3 but the ranks already attached give 2";
  for (int i = 0; i < 6; i++)
    grp_spawn(&gbad, &bad[i]);
  grp_reap(&gbad);
  /* The daemon's own checks, for what the library refuses before sending. */
  char msg[DEP_MSG_TEXT_MAX];
  ck_assert_int_eq(raw_attach_error(&d, &bad[1].a, msg, sizeof msg), DEP_ERR_INVALID);
  ck_assert_msg(strstr(msg, "rank 2 is out of range") != NULL, "said: %s", msg);
  ck_assert_int_eq(raw_attach_error(&d, &bad[4].a, msg, sizeof msg), DEP_ERR_NOT_FOUND);
  ck_assert_msg(strstr(msg, "device dededede-dede-dede-dede-dededededede is not served") != NULL,
                "said: %s", msg);

  /* Every job the errors came near carries on: the waiting ones complete. */
  s = spec(&d, "dup", 1, 2, 1, 2, TINY, run);
  grp_spawn(&gk, &s);
  s = spec(&d, "lws", 1, 4, 1, 2, TINY, run);
  grp_spawn(&gm, &s);
  grp_sync(&gk, 2);
  grp_sync(&gm, 2);
  struct pool_now p = pool_now(obs);
  ck_assert_uint_eq(p.jobs, 3);
  const uint64_t three = 2 * arena_of(&TINY, 2, 2) + arena_of(&TINY, 4, 2);
  ck_assert_uint_eq(p.used, three);
  struct grp *all[] = {&gj, &gk, &gm};
  for (int i = 0; i < 3; i++)
    grp_go(all[i], 2);
  for (int i = 0; i < 3; i++)
    grp_sync(all[i], 2);
  for (int i = 0; i < 3; i++) {
    grp_go(all[i], 2);
    grp_reap(all[i]);
  }
  wait_pool(obs, 0, three);
  next_job_reads_zero(&d, "afterwards", 2, &TINY);
  stop_ok(&d, obs);
}
END_TEST

/* ---- leaks --------------------------------------------------------------------------- */

START_TEST(a_thousand_attach_detach_cycles_leak_no_fd_or_memory) {
  NEEDS_BACKEND();
#if defined(__SANITIZE_ADDRESS__) || __has_feature(address_sanitizer)
  /* Under make asan the daemon is instrumented too: ASan's quarantine holds
   * freed memory back, which would read as growth. */
  char opts[512];
  const char *old = getenv("ASAN_OPTIONS");
  snprintf(opts, sizeof opts, "%s%squarantine_size_mb=0:thread_local_quarantine_size_kb=0",
           old != NULL ? old : "", old != NULL && old[0] != '\0' ? ":" : "");
  setenv("ASAN_OPTIONS", opts, 1);
#endif
  struct tu_daemon d;
  start(&d, 16, NULL);
  dep_client_t *obs = observer(&d);
  static const struct step script[] = {{CYCLES, 50}, {SYNC, 0}, {CYCLES, 1000}, {SYNC, 0},
                                       {END, 0}};
  struct grp g;
  grp_init(&g);
  struct rank_spec s = spec(&d, "cycling", 0, 1, 0, 1, TINY, script);
  grp_spawn(&g, &s);
  grp_sync(&g, 1); /* warmed up: the daemon's allocations have settled */
  int fds0 = daemon_fds(d.pid);
  long rss0 = daemon_rss_kib(d.pid);
  int64_t t0 = now_ms();
  grp_go(&g, 1);
  grp_sync(&g, 1);
  int64_t ms = now_ms() - t0;
  int fds1 = daemon_fds(d.pid);
  long rss1 = daemon_rss_kib(d.pid);
  printf("a_thousand_attach_detach_cycles: %lld ms (%.3f ms a cycle); daemon fds %d -> %d, "
         "VmRSS %ld -> %ld KiB\n", (long long)ms, (double)ms / 1000, fds0, fds1, rss0, rss1);
  ck_assert_int_le(fds1, fds0);
  ck_assert_msg(rss1 - rss0 <= 256, "deepepd's VmRSS grew by %ld KiB over 1000 cycles",
                rss1 - rss0);
  grp_go(&g, 1);
  grp_reap(&g);
  wait_pool(obs, 0, CHUNK);
  stop_ok(&d, obs);
}
END_TEST

Suite *memory_suite(void);
Suite *memory_suite(void) {
  Suite *s = suite_create("memory");
  struct {
    const char *name;
    const TTest *tests[6];
  } cases[] = {
      {"share", {eight_ranks_share_one_job_and_read_every_peers_slab, NULL}},
      {"isolation",
       {two_jobs_of_different_users_cannot_join_or_see_each_other,
        another_users_job_never_sees_old_bytes_even_through_a_kept_mapping, NULL}},
      {"cache",
       {with_the_cache_on_the_next_job_of_the_shape_reuses_scrubbed_slabs,
        with_the_cache_off_chunks_return_scrubbed_and_nothing_is_cached,
        without_preallocation_the_pool_is_made_on_first_attach, NULL}},
      {"death",
       {sigkill_of_one_rank_keeps_the_memory_until_the_last_rank_leaves,
        sigkill_of_every_rank_returns_the_memory, sigkill_of_a_rank_mid_attach, NULL}},
      {"limits",
       {pool_exhaustion_is_no_memory_and_the_rest_carries_on,
        bad_input_gets_its_own_error_and_every_other_job_carries_on, NULL}},
      {"leaks", {a_thousand_attach_detach_cycles_leak_no_fd_or_memory, NULL}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    TCase *tc = tcase_create(cases[i].name);
    /* Every case runs on device memory too (DEP_TEST_BACKEND=cuda make check-gpu). */
    tcase_set_tags(tc, "gpu");
    tcase_set_timeout(tc, 60);
    for (size_t k = 0; cases[i].tests[k] != NULL; k++)
      tcase_add_test(tc, cases[i].tests[k]);
    suite_add_tcase(s, tc);
  }
  return s;
}
