/*
 * check_stats.c — operability (DESIGN §10) as a specification, through a
 * real deepepd and real rank processes on the host backend: the stats each
 * rank's page reports, counted exactly; a job's figures kept after its
 * ranks are killed; a first call slower than warn_first_call_ratio x the
 * steady median logged naming job, rank and op (a page forged by its rank
 * is check_stats_forged.c's);
 * `deepepctl metrics` read by a real Prometheus parser
 * (python3-prometheus-client's; the same
 * exposition scraped from metrics.listen is check_metrics.c's); `deepepctl
 * doctor` passing on a healthy daemon and failing each check it can be
 * made to fail here.  The rank processes are tests/statsranks.c's.  The histogram's buckets and quantiles are checked on
 * their own first.  A world above one node's ranks is
 * check_stats_world.c's.  Tagged "gpu" (make check-gpu; it skips elsewhere,
 * saying why): a cuda rank's stats, the kernels' own GPU times, against
 * CUDA events around the same calls, and its refused call counted.
 *
 * What doctor's tests cannot provoke on the host backend, and so do not:
 * the kernels check's FAIL (a GPU whose architecture the fatbin has
 * neither SASS nor PTX for, or a library built without nvcc on a cuda
 * daemon) and its WARN (PTX only, and no compile of this build lent), the
 * memory check's FAIL and WARN (a GPU too full for what its pool may still
 * make), a GPU's compute mode and MPS: no GPU here (check_doctor.c
 * provokes them on the GPU machine and judges them with simulated values
 * everywhere).  On the host both the kernels and the memory check say
 * SKIP, which the healthy node's test holds.  The conditions they do provoke are real, none simulated: no
 * socket, a socket any user may use, a configured peer that is not there,
 * a pool too full for the largest job seen, and a job routing every token
 * to one rank.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client_internal.h"
#include "cudaranks.h"
#include "daemonwire.h"
#include "deepep.h"
#include "nodes.h"
#include "opsworld.h"
#include "proto.h"
#include "stats_page.h"
#include "statsranks.h"
#include "testutil.h"

/* ---- the histogram ------------------------------------------------------------- */

START_TEST(buckets_cover_every_duration_in_order) {
  unsigned prev = 0;
  for (uint64_t ns = 1; ns < (1ull << 33); ns += ns / 7 + 1) {
    unsigned b = dep__stats_bucket(ns);
    ck_assert_uint_lt(b, DEP_STATS_BUCKETS);
    ck_assert_uint_ge(b, prev);
    prev = b;
    if (b + 1 < DEP_STATS_BUCKETS) {
      ck_assert_uint_le(dep__stats_bucket_low(b), ns);
      ck_assert_uint_gt(dep__stats_bucket_low(b + 1), ns);
    }
  }
}
END_TEST

START_TEST(quantiles_are_within_an_eighth_of_the_value) {
  uint32_t hist[DEP_STATS_BUCKETS] = {0};
  /* 99 calls of 10 us and one of 5 ms: median 10 us, p99 10 us, p100 5 ms. */
  hist[dep__stats_bucket(10000)] = 99;
  hist[dep__stats_bucket(5000000)] = 1;
  uint64_t med = dep__stats_quantile(hist, 100, 0.5);
  ck_assert_msg(med >= 8750 && med <= 11250, "median %llu", (unsigned long long)med);
  uint64_t p99 = dep__stats_quantile(hist, 100, 0.99);
  ck_assert_msg(p99 >= 8750 && p99 <= 11250, "p99 %llu", (unsigned long long)p99);
  uint64_t top = dep__stats_quantile(hist, 100, 1.0);
  ck_assert_msg(top >= 4375000 && top <= 5625000, "p100 %llu", (unsigned long long)top);
  ck_assert_uint_eq(dep__stats_quantile(hist, 0, 0.5), 0);
}
END_TEST

/* ---- the messages ------------------------------------------------------------------ */

START_TEST(stats_messages_round_trip_and_refuse_bad_counts) {
  struct dep_msg_stats_rank m;
  memset(&m, 0, sizeof m);
  snprintf(m.job_id, sizeof m.job_id, "job-1");
  m.rank = 3;
  m.world = 4;
  m.ops[DEP_STATS_OP_LL_DISPATCH].calls = 42;
  m.ops[DEP_STATS_OP_LL_DISPATCH].median_ns = 45056;
  /* The newest layout's tokens to every rank of the largest world. */
  uint32_t *tokens = calloc(DEP_MAX_WORLD, sizeof *tokens);
  ck_assert_ptr_nonnull(tokens);
  tokens[100] = 77;
  tokens[DEP_MAX_WORLD - 1] = 5;
  m.tokens_world = DEP_MAX_WORLD;
  m.tokens = tokens;
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(proto_encode_stats_rank(&b, &m), 0);
  struct dep_msg_stats_rank back;
  ck_assert_int_eq(proto_decode_stats_rank(b.data, b.len, &back), 0);
  ck_assert_str_eq(back.job_id, "job-1");
  ck_assert_uint_eq(back.ops[DEP_STATS_OP_LL_DISPATCH].calls, 42);
  ck_assert_uint_eq(back.ops[DEP_STATS_OP_LL_DISPATCH].median_ns, 45056);
  ck_assert_uint_eq(back.tokens_world, DEP_MAX_WORLD);
  ck_assert_uint_eq(back.tokens[100], 77);
  ck_assert_uint_eq(back.tokens[DEP_MAX_WORLD - 1], 5);
  proto_stats_rank_free(&back);
  /* Every shorter body is refused, leaving nothing allocated, and so is one a byte longer. */
  for (size_t n = 0; n < b.len; n++) {
    ck_assert_int_eq(proto_decode_stats_rank(b.data, n, &back), DEP_ERR_PROTOCOL);
    ck_assert_ptr_null(back.tokens);
  }
  uint8_t *longer = malloc(b.len + 1);
  memcpy(longer, b.data, b.len);
  longer[b.len] = 0;
  ck_assert_int_eq(proto_decode_stats_rank(longer, b.len + 1, &back), DEP_ERR_PROTOCOL);
  free(longer);
  /* Counts past their bounds cannot be encoded, nor counts without their array. */
  m.tokens_world = DEP_MAX_WORLD + 1;
  proto_buf_reset(&b);
  ck_assert_int_eq(proto_encode_stats_rank(&b, &m), DEP_ERR_INVALID);
  m.tokens_world = 1;
  m.tokens = NULL;
  ck_assert_int_eq(proto_encode_stats_rank(&b, &m), DEP_ERR_INVALID);
  free(tokens);
  struct dep_msg_client one = {.pid = 7, .uid = 1000, .rank = 1, .attached = 1};
  snprintf(one.name, sizeof one.name, "libdeepep-client 0.1.0");
  struct dep_msg_clients cl = {.n = 1, .left_out = 2, .clients = &one}, cb;
  proto_buf_reset(&b);
  ck_assert_int_eq(proto_encode_clients(&b, &cl), 0);
  ck_assert_int_eq(proto_decode_clients(b.data, b.len, &cb), 0);
  ck_assert_uint_eq(cb.n, 1);
  ck_assert_uint_eq(cb.left_out, 2);
  ck_assert_str_eq(cb.clients[0].name, "libdeepep-client 0.1.0");
  proto_clients_free(&cb);
  ck_assert_int_eq(proto_decode_clients(b.data, b.len - 1, &cb), DEP_ERR_PROTOCOL);
  ck_assert_ptr_null(cb.clients);
  proto_buf_free(&b);
}
END_TEST

START_TEST(stats_ok_carries_each_pool_s_made_bytes) {
  struct dep_msg_stats_ok m, back;
  memset(&m, 0, sizeof m);
  m.ranks = 2;
  m.n_pools = 2;
  m.pools[1].uuid[15] = 9;
  m.pools[1].made_bytes = 48ull << 20;
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(proto_encode_stats_ok(&b, &m), 0);
  ck_assert_int_eq(proto_decode_stats_ok(b.data, b.len, &back), 0);
  ck_assert_uint_eq(back.n_pools, 2);
  ck_assert_uint_eq(back.pools[1].uuid[15], 9);
  ck_assert_uint_eq(back.pools[1].made_bytes, 48ull << 20);
  for (size_t n = 0; n < b.len; n++)
    ck_assert_int_eq(proto_decode_stats_ok(b.data, n, &back), DEP_ERR_PROTOCOL);
  /* A count past the bound: not encoded, and refused on the wire before any pool is read. */
  m.n_pools = DEP_STATS_WIRE_POOLS + 1;
  proto_buf_reset(&b);
  ck_assert_int_eq(proto_encode_stats_ok(&b, &m), DEP_ERR_INVALID);
  m.n_pools = 0;
  ck_assert_int_eq(proto_encode_stats_ok(&b, &m), 0);
  const uint32_t many = DEP_STATS_WIRE_POOLS + 1;
  memcpy(b.data + b.len - 4, &many, 4); /* little-endian, as the codec writes */
  ck_assert_int_eq(proto_decode_stats_ok(b.data, b.len, &back), DEP_ERR_PROTOCOL);
  proto_buf_free(&b);
}
END_TEST

/* ---- asking the daemon -------------------------------------------------------------- */

START_TEST(stats_count_every_call_and_outlive_the_job) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  const struct st_plan plan = {.layouts = 3, .pairs = 10, .ll_pairs = 12, .bad = 2};
  struct st_rank r[ST_W];
  st_job_start(r, &d, "st-count", &plan);
  struct dep_msg_stats_rank got[ST_W];
  struct dep_msg_stats_ok ok;
  ck_assert_uint_eq(st_fetch(&d, "st-count", got, &ok), ST_W);
  /* One pool (the host's): it has made at least the job's arena, lent now, within its budget
   * (the tests' 64 MiB). */
  ck_assert_uint_eq(ok.n_pools, 1);
  ck_assert_uint_ge(ok.pools[0].made_bytes, ok.largest_bytes);
  ck_assert_uint_gt(ok.largest_bytes, 0);
  ck_assert_uint_le(ok.pools[0].made_bytes, 64ull << 20);
  const uint64_t tp = dep_stats_bytes(ST_TOKENS, ST_HIDDEN, false);
  const uint64_t ll = dep_stats_bytes(ST_LL, ST_HIDDEN, false);
  for (uint32_t i = 0; i < ST_W; i++) {
    const struct dep_msg_stats_rank *g = &got[i];
    ck_assert_uint_eq(g->finished, 0);
    ck_assert_uint_eq(g->cuda, 0);
    ck_assert_uint_eq(g->attached, 1);
    ck_assert_uint_gt(g->attach_total_ns, 0);
    ck_assert_uint_eq(g->dropped, 0);
    st_expect_op(g, DEP_STATS_OP_LAYOUT, 3, 0, 0);
    st_expect_op(g, DEP_STATS_OP_DISPATCH, 10, 2, 10 * tp);
    st_expect_op(g, DEP_STATS_OP_COMBINE, 10, 0, 10 * tp);
    st_expect_op(g, DEP_STATS_OP_LL_DISPATCH, 12, 0, 12 * ll);
    st_expect_op(g, DEP_STATS_OP_LL_COMBINE, 12, 0, 12 * ll);
    /* Tokens per rank: with topk 2 over 4 experts a rank, token t selects experts t and
     * t + 4 (mod 8), one on each rank: every token goes to both ranks. */
    ck_assert_uint_eq(g->layouts, 3);
    ck_assert_uint_eq(g->tokens_world, ST_W);
    ck_assert_uint_eq(g->tokens[0], ST_TOKENS);
    ck_assert_uint_eq(g->tokens[1], ST_TOKENS);
  }
  /* The ranks die: the job ends, and its figures stay, marked ended. */
  st_job_end(r, true);
  int64_t deadline = dw_now_ms() + 5000;
  do {
    dw_sleep_ms(50);
    ck_assert_uint_eq(st_fetch(&d, "st-count", got, &ok), ST_W);
  } while (got[0].finished == 0 && dw_now_ms() < deadline);
  ck_assert_uint_eq(got[0].finished, 1);
  ck_assert_uint_eq(got[1].finished, 1);
  ck_assert_uint_eq(got[0].ops[DEP_STATS_OP_DISPATCH].calls, 10);
  ck_assert_uint_ge(ok.finished_jobs, 1);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(a_slow_first_call_is_logged_with_job_rank_and_op) {
  struct tu_daemon d;
  dw_start(&d, "warn_first_call_ratio: 2\n");
  /* The first dispatch moves 1024 tokens of 2048 channels, the next 20 one token each:
   * the first is hundreds of times the steady median (a large first input, no hook). */
  struct st_plan plan = {.pairs = 21, .tokens = 1,
                         .shape = {.max_tokens_per_rank = 1024, .hidden = 2048,
                                   .num_experts = ST_EXPERTS, .topk = ST_TOPK,
                                   .max_ll_tokens_per_rank = ST_LL, .dtype = DEP_DTYPE_BF16}};
  struct st_rank r[ST_W];
  st_job_start(r, &d, "st-slow", &plan);
  ck_assert_msg(dw_log_has(&d, "job st-slow rank 0: the first dispatch took", 5000),
                "no first-call warning for rank 0's dispatch in:\n%s", tu_daemon_log(&d));
  ck_assert(dw_log_has(&d, "job st-slow rank 1: the first dispatch took", 5000));
  ck_assert(dw_log_has(&d, "(warn_first_call_ratio 2)", 0));
  struct dep_msg_stats_rank got[ST_W];
  struct dep_msg_stats_ok ok;
  st_fetch(&d, "st-slow", got, &ok);
  ck_assert_uint_ge(ok.warnings, 2);
  ck_assert_uint_eq(ok.warn_ratio_milli, 2000);
  st_job_end(r, false);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(an_ordinary_first_call_is_not_logged) {
  struct tu_daemon d;
  dw_start(&d, "warn_first_call_ratio: 100\n");
  /* A first dispatch of one token against steady ones of 1024 tokens of 2048 channels
   * (milliseconds each): its cold buffers, or a loaded machine's stall, stay far below
   * 100 x that median, so that no warning is the only right outcome. */
  const struct st_plan plan = {.pairs = 12, .first_tokens = 1,
                               .shape = {.max_tokens_per_rank = 1024, .hidden = 2048,
                                         .num_experts = ST_EXPERTS, .topk = ST_TOPK,
                                         .max_ll_tokens_per_rank = ST_LL,
                                         .dtype = DEP_DTYPE_BF16}};
  struct st_rank r[ST_W];
  st_job_start(r, &d, "st-calm", &plan);
  struct dep_msg_stats_rank got[ST_W];
  struct dep_msg_stats_ok ok;
  st_fetch(&d, "st-calm", got, &ok); /* folds, and so checks, what the ranks wrote */
  ck_assert_uint_eq(got[0].ops[DEP_STATS_OP_DISPATCH].calls, 12);
  ck_assert(!dw_log_has(&d, "the first dispatch took", 300));
  ck_assert_uint_eq(ok.warnings, 0);
  st_job_end(r, false);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(systemd_status_says_jobs_ranks_and_warnings) {
  struct tu_daemon d;
  int ns = dw_start_notifying(&d, false);
  dw_expect_notify(ns, "READY=1");
  const struct st_plan plan = {.pairs = 2};
  struct st_rank r[ST_W];
  st_job_start(r, &d, "st-notify", &plan);
  char want[400];
  dw_sfmt(want, sizeof want,
          "STATUS=ready on %s: 1 job(s), 2 rank(s) reporting, 0 first-call warning(s)", d.sock);
  dw_expect_notify(ns, want);
  st_job_end(r, false);
  dw_sfmt(want, sizeof want,
          "STATUS=ready on %s: 0 job(s), 0 rank(s) reporting, 0 first-call warning(s)", d.sock);
  dw_expect_notify(ns, want);
  close(ns);
  dw_stop_ok(&d);
}
END_TEST

/* ---- deepepctl --------------------------------------------------------------------- */

START_TEST(metrics_parse_with_a_prometheus_parser) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  const struct st_plan plan = {.pairs = 10};
  struct st_rank r[ST_W];
  st_job_start(r, &d, "st-prom", &plan);
  char *out = NULL;
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "metrics")), 0);
  char *said = NULL;
  int rc = st_prometheus_parse(d.dir, "deepep.prom", out, &said);
  ck_assert_msg(rc == 0, "the Prometheus parser refused deepepctl metrics (is "
                "python3-prometheus-client installed? make deps): %s\n--- metrics:\n%s",
                said, out);
  ck_assert_msg(strstr(said, "parsed") != NULL, "%s", said);
  free(said);
  free(out);
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "--json", "stats", "st-prom")), 0);
  ck_assert_msg(strstr(out, "\"op\":\"dispatch\"") != NULL, "%s", out);
  ck_assert_msg(strstr(out, "\"calls\":10,") != NULL, "%s", out);
  free(out);
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "--json", "clients")), 0);
  ck_assert_msg(strstr(out, "\"job\":\"st-prom\",\"rank\":1,") != NULL, "%s", out);
  ck_assert_msg(strstr(out, "\"attached\":\"yes\"") != NULL, "%s", out);
  free(out);
  st_job_end(r, false);
  dw_stop_ok(&d);
}
END_TEST

/* doctor's result for one check ("OK", "WARN", "FAIL") in its JSON. */
static bool st_doctor_says(const char *out, const char *check, const char *result) {
  char want[160];
  dw_sfmt(want, sizeof want, "{\"check\":\"%s\",\"result\":\"%s\"", check, result);
  return strstr(out, want) != NULL;
}

START_TEST(doctor_passes_on_a_healthy_node) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  /* The mode a node's socket has (the tests' daemons make theirs 0666 for other uids). */
  ck_assert_int_eq(chmod(d.sock, 0660), 0);
  const struct st_plan plan = {.layouts = 2, .pairs = 2};
  struct st_rank r[ST_W];
  st_job_start(r, &d, "st-healthy", &plan);
  char *out = NULL;
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "--json", "doctor")), 0);
  /* The kernels and the GPUs' memory do not apply to the host backend: skipped, not passed. */
  const char *checks[] = {"connections", "kernels", "allocation", "memory", "balance"};
  const char *want[] = {"OK", "SKIP", "OK", "SKIP", "OK"};
  for (int i = 0; i < 5; i++)
    ck_assert_msg(st_doctor_says(out, checks[i], want[i]), "%s not %s: %s", checks[i], want[i],
                  out);
  ck_assert_msg(strstr(out, "rank 0 receives 1.00 x the mean") != NULL ||
                    strstr(out, "rank 1 receives 1.00 x the mean") != NULL, "%s", out);
  free(out);
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "doctor")), 0);
  ck_assert_msg(strstr(out, "balance      OK") != NULL, "%s", out);
  ck_assert_msg(strstr(out, "memory       SKIP  host backend: no device memory") != NULL, "%s",
                out);
  free(out);
  st_job_end(r, false);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(doctor_fails_connections_without_a_daemon_or_a_peer) {
  char dir[200];
  tu_tmpdir(dir, sizeof dir);
  char sock[300];
  dw_sfmt(sock, sizeof sock, "%s/none.sock", dir);
  char *out = NULL;
  ck_assert_int_eq(st_ctl(dir, &out, DW_ARGS("-s", sock, "--json", "doctor")), 1);
  ck_assert_msg(st_doctor_says(out, "connections", "FAIL"), "%s", out);
  ck_assert_msg(strstr(out, "no control socket at") != NULL, "%s", out);
  free(out);
  tu_rmtree(dir);
  /* A peer configured where no daemon listens, and a socket any user may use. */
  struct tu_daemon d;
  char y[300];
  int port = 20000 + 8 * (int)(getpid() % 1500) + 3;
  dw_sfmt(y, sizeof y, "peers: [{host: 127.0.0.1, port: %d}]\npeer_insecure: true\n"
          "peer_wait_ms: 0\n", port);
  dw_start(&d, y);
  ck_assert_int_eq(chmod(d.sock, 0666), 0);
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "--json", "doctor")), 1);
  ck_assert_msg(st_doctor_says(out, "connections", "FAIL"), "%s", out);
  ck_assert_msg(strstr(out, "peer 127.0.0.1:") != NULL, "%s", out);
  ck_assert_msg(strstr(out, "any local user may connect") != NULL, "%s", out);
  ck_assert_msg(st_doctor_says(out, "allocation", "OK"), "%s", out);
  free(out);
  dw_stop_ok(&d);
}
END_TEST

/* net.ipv4.tcp_slow_start_after_idle as this process's namespace has it, or -1. */
static int st_ssai(void) {
  char *v = dw_slurp("/proc/sys/net/ipv4/tcp_slow_start_after_idle");
  int n = v != NULL ? atoi(v) : -1;
  free(v);
  return n;
}

/*
 * deepepctl doctor --json against d in a fresh network namespace whose
 * tcp_slow_start_after_idle is v (root; the daemon's socket is a path, reached from any):
 * its output, or NULL where no namespace could be made.
 */
static char *st_doctor_in_netns(const struct tu_daemon *d, int v) {
  char path[300];
  dw_sfmt(path, sizeof path, "%s/ssai.out", d->dir);
  pid_t pid = dw_fork_stdout_to(path);
  if (pid == 0) {
    FILE *f = NULL;
    if (unshare(CLONE_NEWNET) != 0 ||
        (f = fopen("/proc/sys/net/ipv4/tcp_slow_start_after_idle", "we")) == NULL)
      _exit(3);
    fprintf(f, "%d\n", v);
    if (fclose(f) != 0)
      _exit(3);
    unsetenv(DEP_SOCKET_ENV);
    execl(tu_bin("deepepctl"), "deepepctl", "-s", d->sock, "--json", "doctor", (char *)NULL);
    _exit(127);
  }
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert(WIFEXITED(st));
  return WEXITSTATUS(st) == 3 ? NULL : dw_slurp(path);
}

/*
 * Where peers are up over TCP, doctor's connections check reads this node's
 * net.ipv4.tcp_slow_start_after_idle: 1 (Linux's default) restarts a connection idle past
 * its retransmission timeout from its initial window, which a job's first call after a pause
 * pays (docs/between-nodes.md), so WARN with the sysctl to set; 0 is OK.  As the machine has
 * it, and as root both ways in namespaces of its own.  A WARN is not a failure (exit 0).
 */
START_TEST(doctor_warns_of_tcp_slow_start_after_idle_where_peers_run_over_tcp) {
  struct nodes ns;
  nodes_start(&ns, 2, 5000);
  ck_assert_int_eq(chmod(ns.d[0].sock, 0660), 0);
  char *out = NULL;
  const int here = st_ssai();
  ck_assert_int_eq(st_ctl(ns.d[0].dir, &out, DW_ARGS("-s", ns.d[0].sock, "--json", "doctor")),
                   0);
  if (here == 0) {
    ck_assert_msg(st_doctor_says(out, "connections", "OK"), "%s", out);
    ck_assert_msg(strstr(out, "tcp_slow_start_after_idle 0: the data connections to the 1 TCP "
                              "peer(s) keep their window") != NULL, "%s", out);
  } else if (here > 0) {
    ck_assert_msg(st_doctor_says(out, "connections", "WARN"), "%s", out);
    ck_assert_msg(strstr(out, "with 1 peer(s) over TCP") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "sysctl -w net.ipv4.tcp_slow_start_after_idle=0") != NULL, "%s",
                  out);
  }
  free(out);
  for (int v = 0; v <= 1 && geteuid() == 0; v++) {
    out = st_doctor_in_netns(&ns.d[0], v);
    if (out == NULL) {
      fprintf(stderr, "stats: no network namespace here: doctor's setting %d not tried\n", v);
      break;
    }
    ck_assert_msg(st_doctor_says(out, "connections", v == 0 ? "OK" : "WARN"), "%d: %s", v, out);
    ck_assert_msg(strstr(out, v == 0 ? "tcp_slow_start_after_idle 0:"
                                     : "tcp_slow_start_after_idle 1 with 1 peer(s)") != NULL,
                  "%d: %s", v, out);
    free(out);
  }
  nodes_stop(&ns);
}
END_TEST

START_TEST(doctor_fails_allocation_when_the_largest_job_cannot_start_again) {
  /* A 48 MiB pool; job A's arena (two slabs of 512 tokens of 4096 channels) is about
   * 33 MB: it runs and ends; job B's (384 tokens) about 25 MB runs: A could not start again
   * now. */
  struct tu_daemon d;
  dw_start(&d, "pool:\n  host_size: 48MiB\n  chunk_size: 2MiB\n");
  ck_assert_int_eq(chmod(d.sock, 0660), 0);
  struct st_plan big = {.pairs = 1,
                        .shape = {.max_tokens_per_rank = 512, .hidden = 4096,
                                  .num_experts = ST_EXPERTS, .topk = ST_TOPK,
                                  .max_ll_tokens_per_rank = ST_LL, .dtype = DEP_DTYPE_BF16}};
  struct st_plan other = big;
  other.shape.max_tokens_per_rank = 384;
  struct st_rank a[ST_W], b[ST_W];
  st_job_start(a, &d, "st-big", &big);
  st_job_end(a, false);
  st_job_start(b, &d, "st-other", &other);
  char *out = NULL;
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "--json", "doctor")), 1);
  ck_assert_msg(st_doctor_says(out, "allocation", "FAIL"), "%s", out);
  ck_assert_msg(strstr(out, "job st-big, the largest seen") != NULL, "%s", out);
  ck_assert_msg(st_doctor_says(out, "connections", "OK"), "%s", out);
  free(out);
  st_job_end(b, false);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(doctor_fails_balance_when_every_token_goes_to_one_rank) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  const struct st_plan plan = {.layouts = 1, .to_rank0 = true};
  struct st_rank r[ST_W];
  st_job_start(r, &d, "st-skew", &plan);
  char *out = NULL;
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "--json", "doctor")), 1);
  /* Every token of both ranks to rank 0: it receives 2 x the mean, past the FAIL bound. */
  ck_assert_msg(st_doctor_says(out, "balance", "FAIL"), "%s", out);
  ck_assert_msg(strstr(out, "job st-skew: rank 0 receives 2.00 x the mean") != NULL, "%s", out);
  free(out);
  st_job_end(r, false);
  dw_stop_ok(&d);
}
END_TEST


/*
 * The stats of a cuda rank are GPU times the kernels take themselves (the
 * global timer, stats_page.h), so they must agree with CUDA events recorded
 * on the rank's stream around the same calls: within the histogram's
 * resolution above (a median reads as its bucket's middle, within 12.5 %),
 * and below by at most what the events hold outside the kernel (the launch,
 * the start of the kernel, and for dispatch the host's synchronisation
 * before the event after it: 6-16 us measured on an H200, BENCHMARKS.md).
 * So, per op, with M the steady median of the events and S the daemon's:
 *     0.875 * (M - SG_OUTSIDE_NS) <= S <= 1.125 * M + 2 us.
 * Host clocks around the asynchronous launches (a few us) fail the lower
 * bound; a unit slip fails both.
 */
#define SG_CALLS 200
#define SG_OUTSIDE_NS 25000.0

struct sg_arg {
  const struct ow_case *d;
  float ms[ST_W][4][SG_CALLS]; /* per rank, op (stats_page.h order less layout), call */
};

static int sg_body(struct rk *k, void *arg) {
  struct sg_arg *a = arg;
  const struct ow_case *d = a->d;
  const uint32_t r = k->rank, n = d->in[r].num_tokens, h = k->h_, K = k->K;
  if (cr_put(k, B_X, d->in[r].x, (size_t)n * h * 2) ||
      cr_put(k, B_IDX, d->idx[r], (size_t)n * K * (d->sc.itype == DEP_INDEX_I64 ? 8 : 4)) ||
      cr_put(k, B_W, d->in[r].topk_weights, (size_t)n * K * 4) ||
      cr_put(k, B_CX, d->cx[r], (size_t)d->disp[r].num_recv * h * 2) ||
      cr_put(k, B_LX, d->lx[r], k->sz[B_LX]))
    return 1;
  uint32_t nrecv = 0;
  int rc;
  struct dep_dispatch_args da = {.size = sizeof(struct dep_dispatch_args), .x = CR_DEV(k, B_X),
                                 .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                 .topk_weights = CR_DEV(k, B_W), .num_tokens = n,
                                 .recv_x = CR_DEV(k, B_RX), .recv_topk_idx = CR_DEV(k, B_RIDX),
                                 .recv_topk_weights = CR_DEV(k, B_RW),
                                 .recv_count_per_expert = CR_DEV(k, B_CNT), .num_recv = &nrecv};
  struct dep_combine_args ca = {.size = sizeof(struct dep_combine_args), .x = CR_DEV(k, B_CX),
                                .out = CR_DEV(k, B_OUT)};
  struct dep_ll_dispatch_args la = {.size = sizeof(struct dep_ll_dispatch_args), .x = CR_DEV(k, B_X),
                                    .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                    .num_tokens = d->in_ll[r].num_tokens,
                                    .recv_x = CR_DEV(k, B_LRX), .recv_count = CR_DEV(k, B_LCNT)};
  struct dep_ll_combine_args lc = {.size = sizeof(struct dep_ll_combine_args), .x = CR_DEV(k, B_LX),
                                   .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                   .topk_weights = CR_DEV(k, B_W), .out = CR_DEV(k, B_LOUT)};
  /* One layout: its kernel's last CTA writes the tokens to each rank into the page. */
  struct dep_layout_args lay = {sizeof(struct dep_layout_args), CR_DEV(k, B_IDX), d->sc.itype, n,
                                CR_DEV(k, B_TPR), CR_DEV(k, B_TPE), CR_DEV(k, B_TIR)};
  if ((rc = dep_layout(k->c, &lay, k->s)) != 0)
    return ow_fail(k->msg, "rank %u: dep_layout: %s", r, dep_errmsg(k->c));
  /* One call refused before launch: counted as an error of its op, never as a call. */
  struct dep_dispatch_args bad = da;
  bad.num_tokens = k->mt + 1;
  rc = dep_dispatch(k->c, &bad, k->h, k->s);
  if (rc != DEP_ERR_INVALID)
    return ow_fail(k->msg, "rank %u: a dispatch of %u tokens (bound %u) returned %s", r,
                   bad.num_tokens, k->mt, dep_errname(rc));
  CUevent ev[5];
  for (int i = 0; i < 5; i++)
    CR_CU(k, k->cu->cuEventCreate(&ev[i], CU_EVENT_DEFAULT), "cuEventCreate");
  for (int i = 0; i < SG_CALLS; i++) {
    CR_CU(k, k->cu->cuEventRecord(ev[0], k->s), "cuEventRecord");
    if ((rc = dep_dispatch(k->c, &da, k->h, k->s)) != 0)
      return ow_fail(k->msg, "rank %u: dep_dispatch: %s", r, dep_errmsg(k->c));
    CR_CU(k, k->cu->cuEventRecord(ev[1], k->s), "cuEventRecord");
    if ((rc = dep_combine(k->c, &ca, k->h, k->s)) != 0)
      return ow_fail(k->msg, "rank %u: dep_combine: %s", r, dep_errmsg(k->c));
    CR_CU(k, k->cu->cuEventRecord(ev[2], k->s), "cuEventRecord");
    if ((rc = dep_ll_dispatch(k->c, &la, k->h, k->s)) != 0)
      return ow_fail(k->msg, "rank %u: dep_ll_dispatch: %s", r, dep_errmsg(k->c));
    CR_CU(k, k->cu->cuEventRecord(ev[3], k->s), "cuEventRecord");
    if ((rc = dep_ll_combine(k->c, &lc, k->h, k->s)) != 0)
      return ow_fail(k->msg, "rank %u: dep_ll_combine: %s", r, dep_errmsg(k->c));
    CR_CU(k, k->cu->cuEventRecord(ev[4], k->s), "cuEventRecord");
    CR_CU(k, k->cu->cuEventSynchronize(ev[4]), "cuEventSynchronize");
    for (int op = 0; op < 4; op++)
      CR_CU(k, k->cu->cuEventElapsedTime(&a->ms[r][op][i], ev[op], ev[op + 1]),
            "cuEventElapsedTime");
  }
  for (int i = 0; i < 5; i++)
    k->cu->cuEventDestroy(ev[i]);
  return 0;
}

static int sg_cmp_float(const void *x, const void *y) {
  float a = *(const float *)x, b = *(const float *)y;
  return (a > b) - (a < b);
}

START_TEST(cuda_stats_match_cuda_events_of_the_same_calls) {
  struct tu_gpus g;
  if (!cr_gpu_probe(__func__, &g))
    return;
  if (g.mps) {
    /* Ranks as threads of one process (no time-slicing to blur either clock) need a
     * hardware queue per stream, which MPS clients do not get (check_cuda_ops.c). */
    tu_skip(__func__, "MPS is running; this test's ranks are threads of one process, which "
            "need a hardware queue per stream: run it without MPS");
    return;
  }
  ow_seed_init(500);
  /* bench/ep's shape of BENCHMARKS.md: calls of 45-90 us, well above the events' outside part. */
  static const struct ow_scenario sc = {ST_W, 7168, 8, 64, 512, 128, P_RANDOM, T_MAX,
                                        DEP_INDEX_I64, 0};
  struct ow_case *d = malloc(sizeof *d);
  struct sg_arg *a = calloc(1, sizeof *a);
  ck_assert(d != NULL && a != NULL);
  ow_case_make(d, &sc, 0);
  a->d = d;
  struct cr_world w;
  cr_world_start(&w, NULL);
  cr_run_threads(&w, "st-gpu-timer", &d->shape, ST_W, sg_body, a, "stats against CUDA events");
  /* The job ended with its ranks: its last calls are folded once the daemon sees it. */
  struct dep_msg_stats_rank got[ST_W];
  struct dep_msg_stats_ok ok;
  int64_t deadline = dw_now_ms() + 5000;
  do {
    ck_assert_uint_eq(st_fetch(&w.dm, "st-gpu-timer", got, &ok), ST_W);
  } while ((got[0].finished == 0 || got[1].finished == 0) && dw_now_ms() < deadline &&
           (dw_sleep_ms(50), 1));
  ck_assert(got[0].finished && got[1].finished);
  static const unsigned sop[4] = {DEP_STATS_OP_DISPATCH, DEP_STATS_OP_COMBINE,
                                  DEP_STATS_OP_LL_DISPATCH, DEP_STATS_OP_LL_COMBINE};
  for (uint32_t r = 0; r < ST_W; r++) {
    ck_assert_msg(got[r].cuda == 1, "rank %u's stats are not the GPU timer's", r);
    /* The layout's tokens to each rank, as the kernel wrote them into the page (the layout
     * entry after the calls' ring, stats_page.h), are the oracle's. */
    int32_t tpr[ST_W], *tpe = malloc(sc.experts * 4u);
    uint8_t *tir = malloc((size_t)sc.max_tokens * ST_W);
    ck_assert(tpe != NULL && tir != NULL);
    ref_layout(&d->shape, ST_W, &d->in[r], tpr, tpe, tir);
    ck_assert_uint_eq(got[r].tokens_world, ST_W);
    for (uint32_t dst = 0; dst < ST_W; dst++)
      ck_assert_msg(got[r].tokens[dst] == (uint32_t)tpr[dst],
                    "rank %u: the kernel says %u tokens to rank %u, the oracle %d", r,
                    got[r].tokens[dst], dst, tpr[dst]);
    free(tpe);
    free(tir);
    for (int op = 0; op < 4; op++) {
      const struct dep_msg_stats_op *o = &got[r].ops[sop[op]];
      const char *name = dep__stats_op_name(sop[op]);
      ck_assert_msg(o->calls == SG_CALLS && o->steady_calls == SG_CALLS - 1,
                    "rank %u %s: %llu calls (%llu steady), want %d", r, name,
                    (unsigned long long)o->calls, (unsigned long long)o->steady_calls, SG_CALLS);
      ck_assert_msg(o->errors == (op == 0 ? 1u : 0u) && o->timeouts == 0,
                    "rank %u %s: %llu errors, %llu timeouts; want %d (the refused call)", r,
                    name, (unsigned long long)o->errors, (unsigned long long)o->timeouts,
                    op == 0);
      /* The events' steady median: every call after the first, as the daemon's. */
      float *m = a->ms[r][op];
      qsort(m + 1, SG_CALLS - 1, sizeof *m, sg_cmp_float);
      const double ev = (double)m[1 + (SG_CALLS - 1) / 2] * 1e6;
      const double lo = 0.875 * (ev - SG_OUTSIDE_NS), hi = 1.125 * ev + 2000.0;
      printf("stats on cuda: rank %u %-11s kernels' median %7.1f us, CUDA events' %7.1f us "
             "(bounds %.1f-%.1f), first call %.1f us\n", r, name, (double)o->median_ns / 1e3,
             ev / 1e3, lo / 1e3, hi / 1e3, (double)o->first_ns / 1e3);
      ck_assert_msg((double)o->median_ns >= lo && (double)o->median_ns <= hi,
                    "rank %u %s: the kernels' median %.1f us is outside %.1f-%.1f us of the "
                    "CUDA events' %.1f us", r, name, (double)o->median_ns / 1e3, lo / 1e3,
                    hi / 1e3, ev / 1e3);
      ck_assert_uint_gt(o->first_ns, 0);
    }
  }
  fflush(stdout);
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
  free(a);
}
END_TEST

/* On cuda, doctor names for each served GPU what serves its kernels and its free memory. */
START_TEST(doctor_on_cuda_names_each_gpu_s_kernels_and_memory) {
  struct tu_gpus g;
  if (!cr_gpu_probe(__func__, &g))
    return;
  struct tu_daemon d;
  dw_start(&d, NULL);
  char *out = NULL;
  int rc = st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "--json", "doctor"));
  printf("doctor on cuda (exit %d): %s\n", rc, out);
  /* This build's fatbin has SASS for sm_80, sm_90 and sm_100 (or the daemon lends a compile). */
  ck_assert_msg(st_doctor_says(out, "kernels", "OK"), "%s", out);
  ck_assert_msg(strstr(out, "SASS for it in the fatbin") != NULL ||
                    strstr(out, "the daemon lends its cached compile") != NULL, "%s", out);
  /* The tests' daemon preallocates its pool: nothing left to take from the GPU. */
  ck_assert_msg(st_doctor_says(out, "memory", "OK"), "%s", out);
  ck_assert_msg(strstr(out, "GiB free; its pool has made") != NULL, "%s", out);
  free(out);
  dw_stop_ok(&d);
}
END_TEST

Suite *stats_suite(void);
Suite *stats_suite(void) {
  Suite *s = suite_create("stats");
  TCase *t = tcase_create("histogram");
  tcase_add_test(t, buckets_cover_every_duration_in_order);
  tcase_add_test(t, quantiles_are_within_an_eighth_of_the_value);
  tcase_add_test(t, stats_messages_round_trip_and_refuse_bad_counts);
  tcase_add_test(t, stats_ok_carries_each_pool_s_made_bytes);
  suite_add_tcase(s, t);
  t = tcase_create("ranks");
  tcase_set_timeout(t, 60);
  tcase_add_test(t, stats_count_every_call_and_outlive_the_job);
  tcase_add_test(t, a_slow_first_call_is_logged_with_job_rank_and_op);
  tcase_add_test(t, an_ordinary_first_call_is_not_logged);
  tcase_add_test(t, systemd_status_says_jobs_ranks_and_warnings);
  tcase_add_test(t, metrics_parse_with_a_prometheus_parser);
  suite_add_tcase(s, t);
  t = tcase_create("gpu timer");
  tcase_set_tags(t, "gpu");
  tcase_set_timeout(t, 120);
  tcase_add_test(t, cuda_stats_match_cuda_events_of_the_same_calls);
  tcase_add_test(t, doctor_on_cuda_names_each_gpu_s_kernels_and_memory);
  suite_add_tcase(s, t);
  t = tcase_create("doctor");
  tcase_set_timeout(t, 60);
  tcase_add_test(t, doctor_passes_on_a_healthy_node);
  tcase_add_test(t, doctor_fails_connections_without_a_daemon_or_a_peer);
  tcase_add_test(t, doctor_warns_of_tcp_slow_start_after_idle_where_peers_run_over_tcp);
  tcase_add_test(t, doctor_fails_allocation_when_the_largest_job_cannot_start_again);
  tcase_add_test(t, doctor_fails_balance_when_every_token_goes_to_one_rank);
  suite_add_tcase(s, t);
  return s;
}
