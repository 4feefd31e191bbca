/*
 * check_bigworld.c — worlds larger than one node: a world is bounded by
 * DEP_MAX_WORLD, a node's ranks by DEP_MAX_LOCAL_RANKS (deepep.h), and
 * every per-world table of the daemons and the library is sized by the job.
 * Real daemons on 127.0.0.1 (nodes.h), real rank processes on the public
 * API that attach, wait for the test's word and detach: a job of 128 ranks
 * over two daemons (64 a node, the most a node holds) and one of 96 over
 * three attach on every rank, and deepepctl status, peers and stats show
 * them; both jobs run every operation of the host backend against the
 * oracle; more than 64 ranks on one node is refused at attach with the
 * limit named; the cuda library refuses a world its kernels cannot address
 * before it sends anything.  Shapes are small (a few tokens a rank), so a
 * job of 128 processes costs a 2-core machine seconds.
 */
#include <check.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_ops.h"
#include "cudaranks.h"
#include "cudarounds.h"
#include "daemonwire.h"
#include "deepep.h"
#include "fake_daemon.h"
#include "nodes.h"
#include "slab.h"
#include "sm_budget.h"
#include "testutil.h"
#include "xngpu.h"
#include "xnjob.h"

/* What every rank and the test must finish within: a ceiling for 128
 * processes attaching on a loaded 2-core machine, far above the seconds it
 * takes; the job's attach_timeout_ms is above it, so a rank that is not
 * answered fails the test here rather than by that timeout. */
#define BW_CEILING_MS 120000
#define BW_ATTACH_TIMEOUT_MS 180000
#define BW_MAXW 128

/* What a rank process says of its attach, in memory shared with the test. */
struct bw_result {
  int rc;
  char msg[256];
};

/* A small shape for a world of `world` ranks: one expert a rank, a few tokens. */
static struct dep_job_shape bw_shape(uint32_t world) {
  return (struct dep_job_shape){.max_tokens_per_rank = 4, .hidden = 128, .num_experts = world,
                                .topk = 2, .dtype = DEP_DTYPE_BF16, .max_ll_tokens_per_rank = 4};
}

/*
 * A rank: attach as (rank of world, local rank lr of lws) to job on sock,
 * say so on rep (one byte, after res is written), wait until the test
 * closes go's write end, detach.  Exits 0 when the attach and the detach
 * both returned DEP_OK.
 */
static void bw_rank_main(const char *sock, const char *job, uint32_t rank, uint32_t world,
                         uint32_t lr, uint32_t lws, struct bw_result *res, int rep, int go) {
  dep_client_t *c = NULL;
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  struct dep_attach_args a = {.size = sizeof a, .rank = rank, .world_size = world,
                              .local_rank = lr, .local_world_size = lws,
                              .shape = bw_shape(world)};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  if (rc == 0)
    rc = dep_attach(c, &a);
  res->rc = rc;
  snprintf(res->msg, sizeof res->msg, "%s", rc == 0 || c == NULL ? "" : dep_errmsg(c));
  char one = 1;
  if (write(rep, &one, 1) != 1)
    _exit(3);
  struct pollfd p = {.fd = go, .events = POLLIN};
  if (poll(&p, 1, BW_CEILING_MS) != 1)
    _exit(4);
  if (rc == 0)
    rc = dep_detach(c);
  dep_client_free(c);
  _exit(rc == 0 ? 0 : 1);
}

/* A job's rank processes and how the test talks to them. */
struct bw_job {
  uint32_t world;
  pid_t pid[BW_MAXW];
  struct bw_result *res;
  int rep[2], go[2];
};

/* Fork the job's ranks: split[i] of them on node i, in blocks of global ranks. */
static void bw_spawn(struct bw_job *b, const struct nodes *ns, const char *job,
                     const uint32_t *split) {
  b->world = 0;
  for (int i = 0; i < ns->n; i++)
    b->world += split[i];
  ck_assert_uint_le(b->world, BW_MAXW);
  b->res = mmap(NULL, BW_MAXW * sizeof *b->res, PROT_READ | PROT_WRITE,
                MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(b->res, MAP_FAILED);
  ck_assert_int_eq(pipe(b->rep), 0);
  ck_assert_int_eq(pipe(b->go), 0);
  uint32_t g = 0;
  for (int i = 0; i < ns->n; i++)
    for (uint32_t l = 0; l < split[i]; l++, g++) {
      fflush(stdout);
      fflush(stderr);
      pid_t pid = fork();
      ck_assert_int_ge(pid, 0);
      if (pid == 0) {
        close(b->rep[0]);
        close(b->go[1]);
        bw_rank_main(ns->d[i].sock, job, g, b->world, l, split[i], &b->res[g], b->rep[1],
                     b->go[0]);
      }
      b->pid[g] = pid;
    }
  close(b->rep[1]);
  close(b->go[0]);
}

/* Wait (BW_CEILING_MS in all) until every rank has said how its attach went. */
static void bw_wait_attached(struct bw_job *b) {
  const int64_t until = dw_now_ms() + BW_CEILING_MS;
  uint32_t said = 0;
  while (said < b->world) {
    int64_t left = until - dw_now_ms();
    struct pollfd p = {.fd = b->rep[0], .events = POLLIN};
    ck_assert_msg(left > 0 && poll(&p, 1, (int)left) == 1,
                  "%u of %u ranks said nothing of their attach within %d ms", b->world - said,
                  b->world, BW_CEILING_MS);
    char buf[BW_MAXW];
    ssize_t n = read(b->rep[0], buf, sizeof buf);
    ck_assert_int_gt(n, 0);
    said += (uint32_t)n;
  }
}

/* Every rank's attach returned DEP_OK (else the test fails, naming each that did not). */
static void bw_expect_all_ok(const struct bw_job *b) {
  char all[4096] = "";
  uint32_t bad = 0;
  for (uint32_t g = 0; g < b->world; g++)
    if (b->res[g].rc != 0 && bad++ < 8)
      snprintf(all + strlen(all), sizeof all - strlen(all), "\n  rank %u: %s: %s", g,
               dep_errname(b->res[g].rc), b->res[g].msg);
  ck_assert_msg(bad == 0, "%u of %u ranks failed to attach:%s", bad, b->world, all);
}

/* Let every rank detach and exit; each must exit 0 within BW_CEILING_MS. */
static void bw_finish(struct bw_job *b, bool want_ok) {
  close(b->go[1]);
  const int64_t until = dw_now_ms() + BW_CEILING_MS;
  uint32_t failed = 0;
  for (uint32_t g = 0; g < b->world; g++) {
    int st = 0;
    while (waitpid(b->pid[g], &st, WNOHANG) != b->pid[g]) {
      if (dw_now_ms() > until) {
        for (uint32_t k = g; k < b->world; k++)
          kill(b->pid[k], SIGKILL);
        waitpid(b->pid[g], &st, 0);
        break;
      }
      dw_sleep_ms(5);
    }
    failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  close(b->rep[0]);
  munmap(b->res, BW_MAXW * sizeof *b->res);
  if (want_ok)
    ck_assert_msg(failed == 0, "%u ranks did not detach cleanly", failed);
}

/* deepepctl's `what` (status, peers, stats) as JSON on node i, into out. */
static void bw_ctl(const struct nodes *ns, int i, const char *what, char *out, size_t len) {
  char cmd[700];
  dw_sfmt(cmd, sizeof cmd, "%s -s %s %s --json", tu_bin("deepepctl"), ns->d[i].sock, what);
  FILE *f = popen(cmd, "r");
  ck_assert_ptr_nonnull(f);
  size_t got = fread(out, 1, len - 1, f);
  out[got] = '\0';
  ck_assert_int_eq(pclose(f), 0);
}

static void expect_has(const char *out, const char *needle) {
  ck_assert_msg(strstr(out, needle) != NULL, "\"%s\" not in: %.3000s", needle, out);
}

/* How many times needle occurs in s. */
static uint32_t count_of(const char *s, const char *needle) {
  uint32_t n = 0;
  for (const char *p = s; (p = strstr(p, needle)) != NULL; p += strlen(needle))
    n++;
  return n;
}

/* The first global rank on node i (ranks are placed in blocks). */
static uint32_t first_of(const uint32_t *split, int i) {
  uint32_t g = 0;
  for (int k = 0; k < i; k++)
    g += split[k];
  return g;
}

/*
 * A job of world ranks split over ns->n nodes attaches on every rank, and
 * each node's deepepctl status shows it whole: its world, its nodes, the
 * ranks held here and elsewhere; peers shows every other node up; stats
 * lists the job's ranks here.
 */
static void expect_job_attaches(const uint32_t *split, int nodes, const char *job) {
  struct nodes ns;
  nodes_start(&ns, nodes, BW_ATTACH_TIMEOUT_MS);
  struct bw_job b;
  bw_spawn(&b, &ns, job, split);
  bw_wait_attached(&b);
  bw_expect_all_ok(&b);
  static char out[1 << 20];
  char want[128];
  for (int i = 0; i < nodes; i++) {
    bw_ctl(&ns, i, "status", out, sizeof out);
    dw_sfmt(want, sizeof want, "\"world_size\":%u", b.world);
    expect_has(out, want);
    dw_sfmt(want, sizeof want, "\"nodes\":%d,\"remote_ranks\":%u", nodes, b.world - split[i]);
    expect_has(out, want);
    dw_sfmt(want, sizeof want, "\"ranks_attached\":%u,\"ranks_expected\":%u", split[i],
            split[i]);
    expect_has(out, want);
    bw_ctl(&ns, i, "peers", out, sizeof out);
    ck_assert_msg(count_of(out, "\"state\":\"up\"") == (uint32_t)nodes - 1, "%.3000s", out);
    bw_ctl(&ns, i, "stats", out, sizeof out);
    dw_sfmt(want, sizeof want, "\"job\":\"%s\"", job);
    ck_assert_msg(count_of(out, want) == split[i], "%.3000s", out);
    for (uint32_t l = 0; l < split[i]; l++) {
      dw_sfmt(want, sizeof want, "\"job\":\"%s\",\"rank\":%u,", job, first_of(split, i) + l);
      expect_has(out, want);
    }
  }
  bw_finish(&b, true);
  nodes_stop(&ns);
}

START_TEST(a_job_of_128_ranks_over_two_nodes_of_64_attaches_and_shows_whole) {
  const uint32_t split[] = {DEP_MAX_LOCAL_RANKS, DEP_MAX_LOCAL_RANKS};
  expect_job_attaches(split, 2, "bw128");
}
END_TEST

START_TEST(a_job_of_96_ranks_over_three_nodes_of_32_attaches_and_shows_whole) {
  const uint32_t split[] = {32, 32, 32};
  expect_job_attaches(split, 3, "bw96");
}
END_TEST

/*
 * Every operation of the host backend runs in a world above 64 ranks: the
 * job's ranks over `nodes` real daemons each run two rounds of layout,
 * dispatch, combine, LL dispatch (FP8 in the second) and LL combine
 * (xn_round), then a dispatch in FP8, a cached one and a weighted combine
 * (xn_round_modes), each checked against the oracle.  Before, the job attached
 * but every operation returned DEP_ERR_UNSUPPORTED ("world above 64").
 * The op timeout is a ceiling for 128 processes sharing 2 loaded cores.
 */
static void expect_job_runs_every_op(const struct ow_scenario *sc, const uint32_t *split,
                                     int nodes, const char *job) {
  ow_seed_init(sc->world);
  struct ow_case *d = xn_case_new(sc, 0);
  struct nodes ns;
  xn_nodes_start(&ns, nodes, BW_ATTACH_TIMEOUT_MS, 60000, "");
  struct xn_place p;
  xn_place(&p, split, nodes);
  struct xn_run run = {.d = d, .rounds = 2, .alternate_fp8 = true, .modes = true};
  struct xn_result *res = xn_results(sc->world);
  xn_run_job(&ns, &p, job, &run, res);
  for (uint32_t g = 0; g < sc->world; g++)
    ck_assert_uint_eq(atomic_load(&res[g].rounds), 2);
  munmap(res, sc->world * sizeof *res);
  nodes_stop(&ns);
  xn_case_free(d);
}

START_TEST(every_op_runs_against_the_oracle_in_a_job_of_128_ranks_over_two_nodes) {
  /* world hidden topk experts max_tokens max_ll routing tokens index fp8 */
  const struct ow_scenario sc = {128, 128, 4, 256, 2, 2, P_RANDOM, T_MIXED, DEP_INDEX_I32, 0};
  const uint32_t split[] = {DEP_MAX_LOCAL_RANKS, DEP_MAX_LOCAL_RANKS};
  expect_job_runs_every_op(&sc, split, 2, "bwops128");
}
END_TEST

START_TEST(every_op_runs_against_the_oracle_in_a_job_of_96_ranks_over_three_nodes) {
  const struct ow_scenario sc = {96, 128, 3, 96, 4, 4, P_DUP, T_MAX, DEP_INDEX_I64, 0};
  const uint32_t split[] = {32, 32, 32};
  expect_job_runs_every_op(&sc, split, 3, "bwops96");
}
END_TEST

/*
 * A node holds at most DEP_MAX_LOCAL_RANKS ranks of a job: a 65th local
 * rank is refused at attach, naming the bound, by the library before
 * anything goes on the wire and by the daemon for a client that sends it
 * anyway (each at once: the ceiling of 10 s is for a loaded machine).
 */
START_TEST(more_than_64_ranks_on_one_node_are_refused_at_attach_naming_the_limit) {
  enum { WORLD = DEP_MAX_LOCAL_RANKS + 1 };
  struct tu_daemon d;
  dw_start(&d, NULL);
  struct dep_attach_args a = {.size = sizeof a, .rank = 0, .world_size = WORLD, .local_rank = 0,
                              .local_world_size = WORLD, .shape = bw_shape(WORLD)};
  snprintf(a.job_id, sizeof a.job_id, "wide1");
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), 0);
  ck_assert_int_eq(dep_connect(c, d.sock), 0);
  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
  expect_has(dep_errmsg(c), "local_world_size 65 is out of range (allowed 1..64)");
  dep_client_free(c);
  int fd = dw_client(&d);
  dw_attach(fd, &a, 7);
  char msg[DEP_MSG_TEXT_MAX];
  dw_expect_error(fd, DEP_ERR_INVALID, msg, sizeof msg);
  expect_has(msg, "local_world_size 65 is out of range (allowed 1..64)");
  ck_assert_int_lt(dw_now_ms() - t0, 10000);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

/*
 * A world above DEP_MAX_WORLD on cuda is refused at dep_attach naming the
 * limit, before the library touches the driver or sends anything: the fake
 * daemon (which says its backend is cuda) hears no request after HELLO.
 * The library's own check (cuda_ops_world_check) refuses it too, naming
 * DEP_MAX_WORLD, where it refused every world above 512 before (the
 * kernels' static shared memory).
 */
START_TEST(the_cuda_library_refuses_a_world_above_DEP_MAX_WORLD_before_sending_anything) {
  struct fake_daemon f;
  fake_daemon_start(&f, FAKE_CUDA_SILENT);
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), 0);
  ck_assert_int_eq(dep_connect(c, f.sock), 0);
  const uint32_t W = DEP_MAX_WORLD + 1;
  struct dep_attach_args a = {.size = sizeof a, .rank = 0, .world_size = W, .local_rank = 0,
                              .local_world_size = DEP_MAX_LOCAL_RANKS, .shape = bw_shape(W)};
  snprintf(a.job_id, sizeof a.job_id, "cudawide");
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_INVALID);
  char want[128];
  snprintf(want, sizeof want, "world_size %u is out of range (allowed 1..%u)", W, DEP_MAX_WORLD);
  expect_has(dep_errmsg(c), want);
  ck_assert_int_eq(cuda_ops_world_check(c, &a), DEP_ERR_UNSUPPORTED);
  snprintf(want, sizeof want, "world of %u ranks; the cuda backend serves worlds of up to %u", W,
           DEP_MAX_WORLD);
  expect_has(dep_errmsg(c), want);
  dep_client_free(c);
  ck_assert_int_eq(fake_daemon_wait(&f), 0);
}
END_TEST

/*
 * A world above 64 ranks on cuda (issue 27): the library's check passes
 * worlds of 65, 128 (two nodes of 64), 512, 1024 and DEP_MAX_WORLD, and the
 * layouts of jobs of 128 ranks over two nodes of 64 and of 1024 ranks over
 * sixteen bind as every other (cuops_block_layout), the private area
 * holding the per-world tables the kernels address a large world by
 * (kabi.h cuops_world_carve: the counters, the masks' words, every rank's
 * slab and its number among the remote ranks) between the counters and the
 * scratch.  The old library refused every world above 512 ranks (the
 * kernels' per-source state in static shared memory).
 */
START_TEST(the_cuda_library_takes_a_world_of_1024_and_carves_its_tables) {
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), 0);
  static const uint32_t ok[] = {DEP_MAX_LOCAL_RANKS + 1, 2 * DEP_MAX_LOCAL_RANKS, 512, 1024,
                                DEP_MAX_WORLD};
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    struct dep_attach_args a = {.size = sizeof a, .world_size = ok[i],
                                .local_world_size = DEP_MAX_LOCAL_RANKS, .shape = bw_shape(ok[i])};
    ck_assert_msg(cuda_ops_world_check(c, &a) == 0, "world %u: %s", ok[i], dep_errmsg(c));
  }
  dep_client_free(c);
  static const uint32_t worlds[] = {2 * DEP_MAX_LOCAL_RANKS, 1024};
  for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
    const uint32_t W = worlds[i];
    const struct dep_job_shape sh = bw_shape(W);
    struct dep_slab_layout l;
    char why[256] = "";
    ck_assert_msg(dep__slab_layout_nodes(&sh, W, DEP_MAX_LOCAL_RANKS, 0, &l, why, sizeof why) ==
                      0, "world %u: %s", W, why);
    ck_assert_uint_eq(l.n_remote, W - DEP_MAX_LOCAL_RANKS);
    struct dep_slab_priv b;
    ck_assert_msg(cuops_block_layout(&sh, W, &l, 132, &b, why, sizeof why) == 0, "world %u: %s",
                  W, why);
    uint64_t at[CUOPS_WORLD_ARRAYS];
    const uint64_t bytes = cuops_world_carve(W, at);
    ck_assert_uint_eq(at[7] + 8 * W <= at[8] ? 1 : 0, 1);    /* wslabs: a pointer a rank */
    ck_assert_uint_eq(at[8] + 4 * W <= bytes ? 1 : 0, 1);    /* xnum: a number a rank */
    ck_assert_uint_ge(at[6] - at[5], 8 * DEP_SLAB_MASK_WORDS(W)); /* own mask */
    ck_assert(b.dev + sizeof(struct cuops_dev) <= b.world && b.world + bytes <= b.scratch);
    ck_assert_uint_le(b.end, l.priv_bytes);
  }
}
END_TEST

/*
 * The kernels' dynamic shared memory (kabi.h "Shared memory",
 * dep__kernel_shmem): 24 bytes a source (and 8, rounded to 16) for every
 * receiving kernel, the low-latency dispatch's 8 bytes an expert besides,
 * the one function the launch, the opt-in and the residency read.  The
 * bytes for worlds of 8, 64, 512, 1024 and DEP_MAX_WORLD: up to 512 sources
 * with CUOPS_LL_MAX_EXPERTS experts the low-latency dispatch's CTA stays
 * within the 48 KiB a kernel gets unasked (no opt-in, as before), the
 * throughput kernels' up to 1024 sources, and DEP_MAX_WORLD within the
 * opt-in maximum of every GPU the fatbin is built for (sm_80's 163 KiB,
 * the least; H100's is 227 KiB).  BW_STATIC_SHM and BW_LL_STATIC_SHM are
 * ceilings of the kernels' static shared memory (ptxas -v on sm_90: 9.8
 * KiB at the most, the throughput dispatch's; the low-latency dispatch's
 * 2.6 KiB), and 1 KiB is what the GPU reserves a CTA.  An SM (H100: 228
 * KiB) keeps CUOPS_CTAS_PER_SM CTAs of a world of 1024 at once and one of
 * DEP_MAX_WORLD with 4096 experts, which the budget's ceiling follows
 * (dep__fit_ctas).  Before, the per-source state was static shared memory
 * sized for 512 sources, the most that fitted.
 */
#define BW_STATIC_SHM (12u * 1024u)
#define BW_LL_STATIC_SHM (3u * 1024u)
START_TEST(the_kernels_shared_memory_is_sized_by_the_world_and_fits_the_opt_in) {
  static const struct {
    uint32_t world, recv;
  } want[] = {{8, 208}, {64, 1552}, {512, 12304}, {1024, 24592}, {DEP_MAX_WORLD, 98320}};
  const uint32_t E = CUOPS_LL_MAX_EXPERTS;
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const uint32_t W = want[i].world;
    ck_assert_uint_eq(dep__kernel_shmem(W, E, false), want[i].recv);
    ck_assert_uint_eq(dep__kernel_shmem(W, E, true), want[i].recv + CUOPS_LL_SHMEM(E));
    ck_assert_uint_eq(dep__kernel_shmem(W, 8, true), want[i].recv + 64);
    /* The offsets the kernels read it at: each array after the last, all within it, the
     * 8-byte ones aligned. */
    ck_assert_uint_eq(CUOPS_SHM_FIRST(W), 0);
    ck_assert_uint_eq(CUOPS_SHM_OFF(W), CUOPS_SHM_FIRST(W) + 4 * (W + 1));
    ck_assert_uint_eq(CUOPS_SHM_ROWS(W), CUOPS_SHM_OFF(W) + 4 * W);
    ck_assert_uint_eq(CUOPS_SHM_OP(W), CUOPS_SHM_ROWS(W) + 4 * W);
    ck_assert_uint_ge(CUOPS_SHM_REF(W), CUOPS_SHM_OP(W) + 4 * W);
    ck_assert_uint_eq(CUOPS_SHM_REF(W) % 8, 0);
    ck_assert_uint_le(CUOPS_SHM_REF(W) + 8 * W, want[i].recv);
    ck_assert_uint_eq(want[i].recv % 16, 0);
    const uint64_t ll = BW_LL_STATIC_SHM + dep__kernel_shmem(W, E, true);
    const uint64_t tp = BW_STATIC_SHM + dep__kernel_shmem(W, E, false);
    if (W <= 512)
      ck_assert_uint_le(ll, 48u * 1024u);
    if (W <= 1024)
      ck_assert_uint_le(tp, 48u * 1024u);
    ck_assert_uint_le(ll, 163u * 1024u);
    ck_assert_uint_le(tp, 163u * 1024u);
  }
  const uint64_t h100_sm = 228u * 1024u, reserved = 1024u;
  ck_assert_uint_eq(
      dep__ctas_per_sm(BW_LL_STATIC_SHM + dep__kernel_shmem(1024, E, true) + reserved, h100_sm),
      CUOPS_CTAS_PER_SM);
  const uint64_t widest = BW_LL_STATIC_SHM + dep__kernel_shmem(DEP_MAX_WORLD, E, true);
  ck_assert_uint_eq(dep__ctas_per_sm(widest + reserved, h100_sm), 1);
  ck_assert_uint_eq(dep__ctas_per_sm(h100_sm + 1, h100_sm), 0);
  ck_assert_uint_eq(dep__fit_ctas(132, 1, CUOPS_CTAS_PER_SM), cuops_most_ctas(132, 1));
  ck_assert_uint_eq(dep__fit_ctas(132, 1, 1), 132);
  ck_assert_uint_eq(dep__fit_ctas(132, 8, 1), 16);
}
END_TEST

/* ---- the cuda backend above 64 ranks: daemons sharing one GPU (gpu) ---------------- */

/* Worlds of 65 to 80 ranks over two or three daemons, tiny shapes (one or two experts a
 * rank, four tokens), FP8 and bf16, both index types. */
static const struct xn_layout gpu_big[] = {
  /* world hidden topk experts max_tokens max_ll routing tokens index fp8;  nodes, split */
  {{65, 128, 2, 65, 4, 4, P_RANDOM, T_MAX, DEP_INDEX_I32, 1}, 2, {33, 32}},
  {{72, 128, 2, 144, 4, 4, P_RANDOM, T_MIXED, DEP_INDEX_I64, 0}, 3, {24, 24, 24}},
  {{80, 128, 2, 80, 4, 4, P_ONE_RANK, T_MAX, DEP_INDEX_I32, 1}, 2, {64, 16}},
};

/*
 * Rank processes of a world of 65 to 80 on the cuda backend, over two or
 * three daemons on this machine's GPU 0, every output twice (under two
 * poisons) as the oracle says: masks and gone/left bitmaps of two words,
 * ranks from 64 on addressed through the world tables (kabi.h wslabs,
 * xnum), and a budget of 4 CTAs a rank, far below the world, so each CTA
 * loops over 17 to 20 units (4: what a daemon holding 64 ranks of a GPU of
 * 132 SMs allows, sm_budget.h).  65 to 80 processes are more than MPS
 * takes (some 48 clients a GPU), so this runs time-sliced, without MPS,
 * and skips under it: each context runs alone in its slice and a call's
 * waits end as the others get theirs, so the bounds are generous
 * (op_timeout_ms 120 s, the case 900 s).
 */
START_TEST(on_the_gpu_worlds_of_65_to_80_over_daemons_sharing_it_match_the_oracle) {
  struct tu_gpus g;
  if (!cr_gpu_probe(__func__, &g))
    return;
  if (g.mps) {
    tu_skip(__func__, "65 to 80 rank processes on one GPU are more clients than MPS takes; "
            "run this test without MPS (time-sliced)");
    return;
  }
  setenv("DEP_TEST_GPUS", "1", 1); /* all on GPU 0: this test runs in a process of its own */
  const struct xn_layout *L = &gpu_big[_i];
  ow_seed_init(5000 + (uint64_t)_i);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &L->sc, L->sc.fp8);
  struct nodes ns;
  nodes_config_with(&ns, L->nodes, 300000, ", op_timeout_ms: 120000", "");
  nodes_start_all(&ns);
  struct cr_rounds a = {d, 1, 2};
  char job[32];
  snprintf(job, sizeof job, "gpu-wide-%d", _i);
  static char fails[OW_FAILS_LEN];
  int nfail = xg_run_ctas(&ns, L->split, job, d, cr_body_rounds, &a, false, "4", fails,
                          sizeof fails);
  OW_ASSERT_NONE_FAILED(d->desc, nfail, fails);
  printf("bigworld gpu: %s over %d daemons on one GPU: as the oracle says\n", d->desc, L->nodes);
  nodes_stop(&ns);
  ow_case_free(d);
  free(d);
}
END_TEST

Suite *bigworld_suite(void);
Suite *bigworld_suite(void) {
  Suite *s = suite_create("bigworld");
  TCase *tc = tcase_create("attach");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, a_job_of_128_ranks_over_two_nodes_of_64_attaches_and_shows_whole);
  tcase_add_test(tc, a_job_of_96_ranks_over_three_nodes_of_32_attaches_and_shows_whole);
  suite_add_tcase(s, tc);
  TCase *ops = tcase_create("ops");
  tcase_set_timeout(ops, 300);
  tcase_add_test(ops, every_op_runs_against_the_oracle_in_a_job_of_128_ranks_over_two_nodes);
  tcase_add_test(ops, every_op_runs_against_the_oracle_in_a_job_of_96_ranks_over_three_nodes);
  suite_add_tcase(s, ops);
  TCase *lim = tcase_create("limits");
  tcase_add_test(lim, more_than_64_ranks_on_one_node_are_refused_at_attach_naming_the_limit);
  tcase_add_test(lim, the_cuda_library_refuses_a_world_above_DEP_MAX_WORLD_before_sending_anything);
  tcase_add_test(lim, the_cuda_library_takes_a_world_of_1024_and_carves_its_tables);
  tcase_add_test(lim, the_kernels_shared_memory_is_sized_by_the_world_and_fits_the_opt_in);
  suite_add_tcase(s, lim);
  TCase *g = tcase_create("gpu");
  tcase_set_tags(g, "gpu");
  tcase_set_timeout(g, 900);
  tcase_add_loop_test(g, on_the_gpu_worlds_of_65_to_80_over_daemons_sharing_it_match_the_oracle,
                      0, (int)(sizeof gpu_big / sizeof gpu_big[0]));
  suite_add_tcase(s, g);
  return s;
}
