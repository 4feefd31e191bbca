/*
 * check_xfer_fair.c — across two real daemons, the proxy serves its rings
 * fairly (daemon/xfer_proxy.c): a rank that keeps its ring full holds up
 * another job's calls by a bounded time, never past the op timeout.
 */
#include <check.h>
#include <grp.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "daemonwire.h"
#include "deepep.h"
#include "nodes.h"
#include "slab.h"
#include "xring.h"

/* Calls of each phase of the victim (a dispatch and a combine per iteration, each rank). */
#define FAIR_ITERS 150
/* The op timeout the daemons run with: what a starved call fails at. */
#define FAIR_OP_TIMEOUT_MS 10000
/*
 * The ceiling on the victim's slowest call beside the flood.  Each call
 * waits for the other rank's block, which node 0's proxy takes from the
 * victim's ring in its turn of the round robin: ahead of it go at most one
 * quantum (4 MiB) of the flooder's ring and the batch already on the wire,
 * a few 4 MiB sends over loopback, milliseconds each.  2 s leaves room for
 * a loaded machine and the sanitizers, and is a fifth of the op timeout,
 * which every call reached when the proxy served the newest job first.
 */
#define FAIR_WORST_MS 2000

/* What the test and its rank processes share. */
struct fair_shared {
  _Atomic int phase;           /* 1: the victim's calls alone; 2: beside the flood; 3: stop */
  _Atomic uint32_t ready;      /* rank processes attached (victim's and flooder's) */
  _Atomic uint64_t pushed;     /* descriptors the flooder pushed */
  struct {
    _Atomic int done;          /* phases finished */
    int rc;                    /* 0, or the first failing call's code (msg says) */
    char msg[300];
    uint32_t us[2][2 * FAIR_ITERS]; /* by phase: each call's time, microseconds */
  } v[2];
  int flood_rc;
  char flood_msg[300];
};

/* The victim: world 2, one rank on each node, one token each way per call. */
static const struct dep_job_shape fair_victim_shape = {
    .max_tokens_per_rank = 4, .hidden = 128, .num_experts = 4, .topk = 2,
    .dtype = DEP_DTYPE_BF16, .max_ll_tokens_per_rank = 4};
/* The flooder: blocks just under 4 MiB (hidden 7168, 288 tokens; the low-latency
 * bound kept small so that it does not set the block). */
static const struct dep_job_shape fair_flood_shape = {
    .max_tokens_per_rank = 288, .hidden = 7168, .num_experts = 16, .topk = 8,
    .dtype = DEP_DTYPE_BF16, .max_ll_tokens_per_rank = 16};

static dep_client_t *fair_attach(const char *sock, const char *job, uint32_t rank,
                                 const struct dep_job_shape *shape, char *msg, size_t len) {
  dep_client_t *c = NULL;
  struct dep_attach_args a = {.size = sizeof a, .rank = rank, .world_size = 2,
                              .local_world_size = 1, .shape = *shape};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  if (rc == 0)
    rc = dep_attach(c, &a);
  if (rc != 0) {
    snprintf(msg, len, "%s rank %u: attach: %s: %s", job, rank, dep_errname(rc),
             c ? dep_errmsg(c) : "");
    return NULL;
  }
  return c;
}

static uint32_t fair_us_since(int64_t t0_ns) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint32_t)(((int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec - t0_ns) / 1000);
}

static int64_t fair_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* A rank of the victim's job, as uid 65534 where the test is root: attach,
 * then at each phase FAIR_ITERS dispatches and combines, each timed. */
static void fair_victim_main(const char *sock, uint32_t g, struct fair_shared *sh) {
  __typeof__(sh->v[0]) *me = &sh->v[g];
  if (geteuid() == 0 && (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0))
    _exit(3);
  dep_client_t *c = fair_attach(sock, "victim", g, &fair_victim_shape, me->msg, sizeof me->msg);
  if (c == NULL) {
    me->rc = 1;
    atomic_store(&me->done, 2);
    _exit(1);
  }
  atomic_fetch_add(&sh->ready, 1);
  /* One token to the other rank: experts 0 and 1 are rank 0's, 2 and 3 rank 1's. */
  const int64_t idx[2] = {g == 0 ? 2 : 0, g == 0 ? 3 : 1};
  const float w[2] = {0.5f, 0.25f};
  static uint16_t x[128], rx[8 * 128], out[128];
  static int32_t ridx[8 * 2], cnt[2];
  static float rw[8 * 2];
  uint32_t nrecv = 0;
  dep_handle_t *h = NULL;
  int rc = dep_handle_new(c, &h);
  if (rc != 0)
    snprintf(me->msg, sizeof me->msg, "handle: %s: %s", dep_errname(rc), dep_errmsg(c));
  for (int phase = 1; phase <= 2 && rc == 0; phase++) {
    while (atomic_load(&sh->phase) < phase)
      dw_sleep_ms(1);
    for (uint32_t i = 0; i < FAIR_ITERS && rc == 0; i++) {
      struct dep_dispatch_args da = {.size = sizeof da, .x = x, .topk_idx = idx,
                                     .index_type = DEP_INDEX_I64, .topk_weights = w,
                                     .num_tokens = 1, .recv_x = rx, .recv_topk_idx = ridx,
                                     .recv_topk_weights = rw, .recv_count_per_expert = cnt,
                                     .num_recv = &nrecv};
      int64_t t0 = fair_now_ns();
      rc = dep_dispatch(c, &da, h, NULL);
      me->us[phase - 1][2 * i] = fair_us_since(t0);
      if (rc == 0 && nrecv != 1) {
        snprintf(me->msg, sizeof me->msg, "dispatch %u of phase %d: %u rows, want 1", i, phase,
                 nrecv);
        rc = 1;
        break;
      }
      struct dep_combine_args ca = {.size = sizeof ca, .x = rx, .out = out};
      t0 = fair_now_ns();
      if (rc == 0)
        rc = dep_combine(c, &ca, h, NULL);
      me->us[phase - 1][2 * i + 1] = fair_us_since(t0);
      if (rc != 0)
        snprintf(me->msg, sizeof me->msg, "call %u of phase %d: %s: %s", 2 * i, phase,
                 dep_errname(rc), dep_errmsg(c));
    }
    atomic_store(&me->done, phase);
  }
  me->rc = rc;
  atomic_store(&me->done, 2);
  dep_handle_free(h);
  dep_detach(c);
  dep_client_free(c);
  _exit(rc == 0 ? 0 : 1);
}

/*
 * A rank of the flooding job (the test's uid).  Rank 1 only holds its
 * place.  Rank 0 writes one well-formed descriptor of a full block over and
 * over, for as long as the test runs: its out slot holds call 2, and each
 * descriptor names rank 1, parity 0, call 2 and every byte of the block,
 * which the proxy checks and sends, 4 MiB each time.
 */
static void fair_flood_main(const char *sock, uint32_t g, struct fair_shared *sh) {
  dep_client_t *c = fair_attach(sock, "flood", g, &fair_flood_shape, sh->flood_msg,
                                sizeof sh->flood_msg);
  if (c == NULL) {
    sh->flood_rc = 1;
    _exit(1);
  }
  atomic_fetch_add(&sh->ready, 1);
  struct dep_xring *ring = c->xring;
  if (ring == NULL) {
    snprintf(sh->flood_msg, sizeof sh->flood_msg, "flood rank %u: %s", g, c->xring_why);
    sh->flood_rc = 1;
    _exit(1);
  }
  if (g == 1) {
    while (atomic_load(&sh->phase) < 3)
      dw_sleep_ms(5);
    _exit(0);
  }
  const struct dep_slab_layout *l = &c->layout;
  uint8_t *xchg = dep_xring_xchg(ring);
  atomic_store_explicit((_Atomic uint64_t *)(xchg + dep_slab_out_slot(l, 0, 0)), 2,
                        memory_order_release);
  const struct dep_xring_desc d = {.dest = 1, .parity = 0, .seq = 2, .bytes = l->xblock_bytes};
  while (atomic_load(&sh->phase) < 3) {
    if (atomic_load_explicit(&ring->failed, memory_order_acquire) != 0) {
      snprintf(sh->flood_msg, sizeof sh->flood_msg, "the proxy stopped the flood's ring: %s",
               dep_errname(atomic_load(&ring->failed)));
      sh->flood_rc = 1;
      _exit(1);
    }
    uint64_t head = atomic_load_explicit(&ring->head, memory_order_relaxed);
    if (head - atomic_load_explicit(&ring->tail, memory_order_acquire) >= DEP_XRING_ENTRIES) {
      struct timespec ts = {0, 20000}; /* full: the proxy has all it can take */
      nanosleep(&ts, NULL);
      continue;
    }
    ring->desc[head % DEP_XRING_ENTRIES] = d;
    atomic_store_explicit(&ring->head, head + 1, memory_order_release);
    atomic_fetch_add(&sh->pushed, 1);
  }
  _exit(0);
}

static int fair_cmp_u32(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return x < y ? -1 : x > y;
}

/* Every call of both victim ranks in a phase, sorted: median and worst (us). */
static void fair_stats(const struct fair_shared *sh, int phase, uint32_t *median,
                       uint32_t *worst) {
  static uint32_t all[2 * 2 * FAIR_ITERS];
  memcpy(all, sh->v[0].us[phase], sizeof sh->v[0].us[phase]);
  memcpy(all + 2 * FAIR_ITERS, sh->v[1].us[phase], sizeof sh->v[1].us[phase]);
  qsort(all, 4 * FAIR_ITERS, sizeof all[0], fair_cmp_u32);
  *median = all[2 * FAIR_ITERS];
  *worst = all[4 * FAIR_ITERS - 1];
}

/* Wait (polling, up to ms) until the victim's two ranks have finished phase. */
static bool fair_wait_phase(const struct fair_shared *sh, int phase, int ms) {
  for (int t = 0; t < ms; t += 10) {
    if (atomic_load(&sh->v[0].done) >= phase && atomic_load(&sh->v[1].done) >= phase)
      return true;
    dw_sleep_ms(10);
  }
  return false;
}

/*
 * The victim's job (another uid) runs its calls across the two nodes
 * alone, then beside a newer job one of whose ranks keeps its ring full of
 * well-formed descriptors of 4 MiB blocks.  Every call completes, and the
 * slowest stays under FAIR_WORST_MS.  (The proxy used to sweep its rings
 * from the newest job and stop at 4 MiB batched, so it never came to the
 * victim's: every one of its calls timed out.)
 */
START_TEST(a_rank_flooding_its_ring_holds_up_another_jobs_calls_a_bounded_time) {
  struct nodes ns;
  char extra[200];
  /* One proxy thread serves both rings, whatever this machine's default (each job's rank on
   * node 0 is its local rank 0, which thread 0 serves anyway). */
  snprintf(extra, sizeof extra, "allow: {any_user: true}\nproxy_threads: 1\npool:\n  "
                                "host_size: 128MiB\n  chunk_size: 2MiB\n");
  char limits[64];
  snprintf(limits, sizeof limits, ", op_timeout_ms: %d", FAIR_OP_TIMEOUT_MS);
  nodes_config_with(&ns, 2, 20000, limits, extra);
  nodes_start_all(&ns);
  for (int i = 0; i < 2; i++)
    chmod(ns.d[i].dir, 0755); /* uid 65534 reaches the sockets */
  struct fair_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                                MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(sh, MAP_FAILED);
  memset(sh, 0, sizeof *sh);
  pid_t pids[4];
  for (uint32_t g = 0; g < 2; g++) {
    fflush(NULL);
    pids[g] = fork();
    ck_assert_int_ge(pids[g], 0);
    if (pids[g] == 0)
      fair_victim_main(ns.d[g].sock, g, sh);
  }
  for (int t = 0; t < 30000 && atomic_load(&sh->ready) < 2; t += 10)
    dw_sleep_ms(10);
  ck_assert_msg(atomic_load(&sh->ready) == 2, "the victim's ranks did not attach: %s%s",
                sh->v[0].msg, sh->v[1].msg);
  atomic_store(&sh->phase, 1);
  bool alone = fair_wait_phase(sh, 1, 120000);
  /* The flood's job comes second: the newer route, which the old sweep served first. */
  for (uint32_t g = 0; g < 2; g++) {
    fflush(NULL);
    pids[2 + g] = fork();
    ck_assert_int_ge(pids[2 + g], 0);
    if (pids[2 + g] == 0)
      fair_flood_main(ns.d[g].sock, g, sh);
  }
  /* The flood is on once the proxy has taken a ring's worth of it (the ring wrapped). */
  for (int t = 0; t < 30000 && sh->flood_rc == 0 &&
                  atomic_load(&sh->pushed) <= 2 * DEP_XRING_ENTRIES; t += 10)
    dw_sleep_ms(10);
  const uint64_t pushed0 = atomic_load(&sh->pushed);
  atomic_store(&sh->phase, 2);
  bool beside = fair_wait_phase(sh, 2, 120000);
  const uint64_t flood = atomic_load(&sh->pushed) - pushed0;
  atomic_store(&sh->phase, 3);
  for (int i = 0; i < 4; i++) {
    int st;
    for (int t = 0; t < 30000 && waitpid(pids[i], &st, WNOHANG) == 0; t += 10)
      dw_sleep_ms(10);
    kill(pids[i], SIGKILL);
    waitpid(pids[i], &st, 0);
  }
  ck_assert_msg(alone, "the victim's calls alone did not finish");
  ck_assert_msg(sh->flood_rc == 0 && pushed0 > 2 * DEP_XRING_ENTRIES,
                "the flood did not run (%llu descriptors pushed): %s",
                (unsigned long long)pushed0, sh->flood_msg);
  for (int g = 0; g < 2; g++)
    ck_assert_msg(sh->v[g].rc == 0, "victim rank %d: %s", g, sh->v[g].msg);
  ck_assert_msg(beside, "the victim's calls beside the flood did not finish");
  uint32_t med[2], worst[2];
  for (int phase = 0; phase < 2; phase++)
    fair_stats(sh, phase, &med[phase], &worst[phase]);
  struct dep_slab_layout fl;
  char why[256];
  ck_assert_int_eq(dep__slab_layout_nodes(&fair_flood_shape, 2, 1, 0, &fl, why, sizeof why), 0);
  printf("xfer: the victim's %d calls (2 ranks, 1 token each way) alone: median %.2f ms, worst "
         "%.2f ms; beside a rank flooding its ring (%llu descriptors of %.2f MiB blocks "
         "meanwhile): median %.2f ms, worst %.2f ms\n", 4 * FAIR_ITERS, med[0] / 1000.0,
         worst[0] / 1000.0, (unsigned long long)flood, fl.xblock_bytes / 1048576.0,
         med[1] / 1000.0, worst[1] / 1000.0);
  ck_assert_msg(worst[1] < FAIR_WORST_MS * 1000u, "beside the flood the victim's slowest call "
                "took %.1f ms (ceiling %d ms)", worst[1] / 1000.0, FAIR_WORST_MS);
  munmap(sh, sizeof *sh);
  nodes_stop(&ns);
}
END_TEST

Suite *xfer_fair_suite(void);
Suite *xfer_fair_suite(void) {
  Suite *s = suite_create("xfer_fair");
  TCase *f = tcase_create("fairness");
  tcase_add_test(f, a_rank_flooding_its_ring_holds_up_another_jobs_calls_a_bounded_time);
  tcase_set_timeout(f, 240);
  suite_add_tcase(s, f);
  return s;
}
