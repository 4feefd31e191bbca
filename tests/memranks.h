/*
 * memranks.h — helpers for check_memory.c: groups of real rank processes
 * that attach through deepepd and run a script over the memory they were
 * lent, and the daemon's pool as the test process observes it.  Prefix mr_
 * (as testutil's tu_); the script's steps keep short names (FILL, CHECK,
 * SYNC, ...) so that a test's scripts read as what its ranks do.
 */
#ifndef DEP_MEMRANKS_H
#define DEP_MEMRANKS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>  /* the skip macros print */
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "deepep.h"
#include "testutil.h"

#define MR_MIB (1024ull * 1024ull)
#define MR_CHUNK (2 * MR_MIB) /* pool.chunk_size in every daemon mr_start starts */
#define MR_NOBODY 65534
#define MR_ALLOW_NOBODY "allow:\n  users: [\"65534\"]\n"
#define MR_GRP_MAX 16

/* ---- what a rank does ------------------------------------------------------- */

enum mr_op {
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
  FREED,       /* dep_client_free; on cuda, then the GPU's primary context is no longer held */
};
struct mr_step {
  enum mr_op op;
  uint32_t arg;
};

struct mr_rank_spec {
  const char *sock;
  struct dep_attach_args a;
  uid_t uid;              /* become this uid first (0: stay) */
  bool raw;               /* send HELLO and ATTACH by hand and never read the reply */
  bool own_uuid;          /* keep a.device_uuid instead of this backend's device */
  int want;               /* what dep_attach must return */
  const char *want_msg;   /* ... and a piece of its message when that is an error */
  const struct mr_step *script; /* ends with END; NULL: attach (as want says), detach, exit */
};

/* A rank of job `job` on d's socket running script (want 0, this uid, the backend's device). */
struct mr_rank_spec mr_spec(const struct tu_daemon *d, const char *job, uint32_t rank,
                            uint32_t world, uint32_t local_rank, uint32_t lws,
                            struct dep_job_shape shape, const struct mr_step *script);

/* Bytes from one slab of this shape to the next in an arena (dep_attach_info's slab_bytes). */
uint64_t mr_slab_of(const struct dep_job_shape *s, uint32_t world, uint32_t local);

/* The device's allocation granularity: the page size on the host backend, 2 MiB on cuda
 * (the VMM granularity of every GPU these tests run on). */
uint64_t mr_granule(void);
/* Whether the ranks' memory is device memory (DEP_TEST_BACKEND=cuda). */
bool mr_on_cuda(void);

/* What a job of `local` ranks takes from the pools: per device, one block holding its
 * local slabs, rounded up to mr_granule() (all on one device unless DEP_TEST_GPUS
 * spreads local rank l to GPU l % N). */
uint64_t mr_arena_of(const struct dep_job_shape *s, uint32_t world, uint32_t local);

/* CLOCK_MONOTONIC in milliseconds. */
int64_t mr_now_ms(void);

/* ---- the test process's side: groups of ranks ------------------------------- */

/* Ranks report on one shared pipe; each waits for its word on a pipe of its
 * own, so that a quick rank cannot take a slow one's word as well. */
struct mr_grp {
  int rep[2];
  int n;
  int go[MR_GRP_MAX][2];
  pid_t pid[MR_GRP_MAX];
  bool done[MR_GRP_MAX];
};

void mr_grp_init(struct mr_grp *g);
/* Fork a rank running s; returns its index in the group. */
int mr_grp_spawn(struct mr_grp *g, const struct mr_rank_spec *s);
/* Fork all lws ranks of a one-node job (rank = local rank), each running script. */
void mr_grp_spawn_job(struct mr_grp *g, const struct tu_daemon *d, const char *job, uint32_t lws,
                      struct dep_job_shape shape, const struct mr_step *script);
/* n ranks of the group reach a SYNC (a rank that fails there fails the test). */
void mr_grp_sync(struct mr_grp *g, int n);
/* Let every live rank of the group (n of them) past its SYNC. */
void mr_grp_go(struct mr_grp *g, int n);
/* SIGKILL rank i and reap it. */
void mr_grp_kill(struct mr_grp *g, int i);
/* Every rank not killed exits 0 (within 30 s); then the pipes close. */
void mr_grp_reap(struct mr_grp *g);

/* ---- the daemon, as status and /proc show it ------------------------------- */

/* deepepd with a pool of pool_mib MiB on each device it serves (on cuda, the GPUs the
 * ranks use), preallocated in blocks of MR_CHUNK unless extra turns preallocation off,
 * plus extra YAML (may be NULL). */
void mr_start(struct tu_daemon *d, unsigned pool_mib, const char *extra);
/* The same with pool_keys (may be NULL) added under `pool:`, e.g. "  max_allocation: 4MiB\n". */
void mr_start_pool(struct tu_daemon *d, unsigned pool_mib, const char *pool_keys,
                   const char *extra);
/* A library client connected to d, for STATUS. */
dep_client_t *mr_observer(const struct tu_daemon *d);
/* The daemon survived everything: it still runs and exits cleanly on SIGTERM. */
void mr_stop_ok(struct tu_daemon *d, dep_client_t *obs);

/* The pools of the devices the ranks use, summed (one device unless DEP_TEST_GPUS
 * spreads them), and the daemon's counts, from STATUS. */
struct mr_pool_now {
  uint64_t total, used, cached, held;
  uint32_t jobs, clients;
};
struct mr_pool_now mr_pool_now(dep_client_t *c);
/* Wait (5 s) for the pool to show used and cached bytes: closes are asynchronous. */
void mr_wait_pool(dep_client_t *c, uint64_t used, uint64_t cached);
/* Ranks of the job attached now, or -1 when it is not listed; wait (5 s) for n of them. */
int mr_job_ranks(dep_client_t *c, const char *id);
void mr_wait_job_ranks(dep_client_t *c, const char *id, int n);
/* Wait until only the observer is connected, so /proc counts no other socket. */
void mr_wait_alone(dep_client_t *c);
/* The daemon's open fds and VmRSS, from /proc. */
int mr_daemon_fds(pid_t pid);
long mr_daemon_rss_kib(pid_t pid);

/* Whether the backend under test can run here (false: says why, as a skip, on stdout). */
bool mr_backend_ready(const char *test);

/* GPUs the ranks spread over (1 on the host backend), once mr_backend_ready has asked. */
uint32_t mr_gpus(void);

/* Skip the calling test, saying so, without a usable backend or without root. */
#define MR_NEEDS_BACKEND()             \
  do {                                 \
    if (!mr_backend_ready(__func__))   \
      return;                          \
  } while (0)

/*
 * The same, for a test whose figures are one device's pool and blocks
 * (scrub, cache, exhaustion): its ranks stay on GPU 0 whatever
 * DEP_TEST_GPUS says (Check runs each test in its own process).
 */
#define MR_NEEDS_BACKEND_ONE_GPU()      \
  do {                                 \
    setenv("DEP_TEST_GPUS", "1", 1);   \
    MR_NEEDS_BACKEND();                \
  } while (0)
#define MR_NEEDS_ROOT()                                                                 \
  do {                                                                                  \
    if (getuid() != 0) {                                                                \
      tu_skip(__func__, "needs root to run a rank as uid %d", MR_NOBODY);                \
      return;                                                                           \
    }                                                                                   \
  } while (0)

#endif
