/*
 * check_stats_forged.c — suite stats_forged: a stats page is another
 * process's memory (stats_page.h), so a page forged by its rank costs the
 * daemon little, and one that breaks the ring's rule is dropped with a log
 * line naming the entry, the rank's figures so far kept.  Through a real
 * deepepd and real rank processes on the host backend (the honest ranks
 * are tests/statsranks.c's).
 */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client_internal.h"
#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "stats_page.h"
#include "statsranks.h"
#include "testutil.h"

/* ---- forged pages ----------------------------------------------------------------- */

/* What a rank writes into its stats page by hand, each in a job of its own: the rule broken
 * (stats_page.h) five ways, then kept in two. */
enum st_forge {
  ST_FORGE_AHEAD,    /* calls[1] says call 2, where call 1 belongs */
  ST_FORGE_REVERSED, /* calls[1..16] hold calls 16 down to 1 */
  ST_FORGE_HUGE,     /* calls[1] holds call 2^64 - 4095: in its slot, past any real count */
  ST_FORGE_BACK,     /* every entry says call 1 */
  ST_FORGE_LAYOUT,   /* layouts[3] says layout 5 */
  ST_FORGE_KEPT,     /* calls 1..100 in their slots, each of huge bytes and the largest time */
  ST_FORGE_LAPPED,   /* calls 4097..8192: a writer that lapped the ring before the first fold */
  ST_FORGED
};
static const char *const st_forge_job[ST_FORGED] = {
    "st-forge-ahead", "st-forge-reversed", "st-forge-huge",  "st-forge-back",
    "st-forge-layout", "st-forge-kept",    "st-forge-lapped"};
/* What the daemon's log says of each page it rejects (NULL: not rejected). */
static const char *const st_forge_said[ST_FORGED] = {
    "its stats page holds calls[1] = 2, a number that entry cannot hold",
    "its stats page holds calls[1] = 16, a number that entry cannot hold",
    "its stats page holds calls[1] = 18446744073709547521, a number that entry cannot hold",
    "its stats page holds calls[2] = 1, a number that entry cannot hold",
    "its stats page holds layouts[3] = 5, a number that entry cannot hold",
    NULL,
    NULL};

/* Entry `slot` says it is a dispatch numbered seq, its seq stored last (statrec.h's order). */
static void st_forge_call(struct dep_stats_page *p, uint32_t slot, uint64_t seq, uint64_t bytes,
                          uint32_t ns) {
  struct dep_stats_call *e = &p->calls[slot];
  e->bytes = bytes;
  e->ns = ns;
  e->op = DEP_STATS_OP_DISPATCH;
  e->status = 0;
  __atomic_store_n(&e->seq, seq, __ATOMIC_RELEASE);
}

static void st_forge_write(struct dep_stats_page *p, enum st_forge what) {
  switch (what) {
  case ST_FORGE_AHEAD:
    p->calls[1].seq = 2;
    break;
  case ST_FORGE_REVERSED:
    for (uint32_t i = 1; i <= 16; i++)
      p->calls[i].seq = 17 - i;
    break;
  case ST_FORGE_HUGE:
    p->calls[1].seq = 0ull - (DEP_STATS_RING - 1);
    break;
  case ST_FORGE_BACK:
    for (uint32_t i = 0; i < DEP_STATS_RING; i++)
      p->calls[i].seq = 1;
    break;
  case ST_FORGE_LAYOUT:
    dep_stats_layout_at(p, p->world, 3)->n = 5;
    break;
  case ST_FORGE_KEPT:
    for (uint32_t i = 1; i <= 100; i++)
      st_forge_call(p, i, i, UINT64_MAX / 128, UINT32_MAX);
    break;
  case ST_FORGE_LAPPED:
    /* Call 8192 first and call 4097 last, so that whenever a fold first finds a call to take
     * (4097, where it looks for call 1), the ring holds them all: what it counts is the same
     * whenever the daemon folds. */
    st_forge_call(p, 0, 2 * DEP_STATS_RING, 1000, 1000);
    for (uint32_t i = DEP_STATS_RING - 1; i >= 1; i--)
      st_forge_call(p, i, DEP_STATS_RING + i, 1000, 1000);
    break;
  case ST_FORGED:
    break;
  }
}

/* A rank of a job of one that attaches, forges its page so and waits for the word. */
static void st_forge_spawn(struct dw_child *ch, const struct tu_daemon *d, enum st_forge what) {
  dw_child_fork(ch);
  if (ch->pid != 0)
    return;
  struct dep_attach_args a = dw_job_args(st_forge_job[what], 0, 1);
  char msg[400] = "ok";
  dep_client_t *c = NULL;
  int rc = dep_client_new(&c);
  if (rc != 0)
    snprintf(msg, sizeof msg, "dep_client_new: %s", dep_errname(rc));
  else if ((rc = dep_connect(c, d->sock)) != 0 || (rc = dep_attach(c, &a)) != 0)
    snprintf(msg, sizeof msg, "attach: %s", dep_errmsg(c));
  else if (c->stats.page == NULL)
    snprintf(msg, sizeof msg, "the daemon lent no stats page");
  else
    st_forge_write(c->stats.page, what);
  if (write(ch->rep, msg, strlen(msg) + 1) < 0)
    _exit(3);
  char g;
  if (read(ch->go, &g, 1) == 1)
    dep_detach(c);
  dep_client_free(c);
  _exit(0);
}

/* The CPU time a process has used so far, its threads' together, in ms (/proc's utime and
 * stime: work done, whatever the machine's load). */
static uint64_t st_cpu_ms(pid_t pid) {
  char path[64], line[1024];
  dw_sfmt(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
  ck_assert(fgets(line, sizeof line, f) != NULL);
  fclose(f);
  const char *p = strrchr(line, ')'); /* after the command's name, which may hold spaces */
  unsigned long ut = 0, st = 0;
  ck_assert(p != NULL);
  ck_assert_int_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st),
                   2);
  return (uint64_t)(ut + st) * 1000u / (uint64_t)sysconf(_SC_CLK_TCK);
}

/* STATS for every job (each one's pages folded first, stats_refresh); the ranks it gave. */
static uint32_t st_fetch_all(const struct tu_daemon *d, struct dw_frame *f) {
  int fd = dw_client(d);
  struct dep_msg_stats_req req;
  memset(&req, 0, sizeof req);
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_STATS, 9, &req), 0);
  uint32_t n = 0;
  /* A generous wait: the old fold was slow over such pages, which the CPU check, not this,
   * is to catch. */
  while (dw_recv_frame(fd, f, 60000) == 0 && f->h.type == DEP_MSG_STATS_RANK)
    n++;
  ck_assert_msg(f->h.type == DEP_MSG_STATS_OK, "got %s", proto_type_name(f->h.type));
  close(fd);
  return n;
}

/* How many times needle is in hay. */
static unsigned st_count(const char *hay, const char *needle) {
  unsigned n = 0;
  for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle))
    n++;
  return n;
}

START_TEST(a_forged_page_costs_the_daemon_little_and_one_that_breaks_the_rule_is_dropped) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  const struct st_plan plan = {.pairs = 10};
  struct st_rank honest[ST_W];
  st_job_start(honest, &d, "st-honest", &plan);
  struct dw_child forger[ST_FORGED];
  for (unsigned k = 0; k < ST_FORGED; k++)
    st_forge_spawn(&forger[k], &d, (enum st_forge)k);
  for (unsigned k = 0; k < ST_FORGED; k++) {
    char msg[400] = "";
    ck_assert_msg(read(forger[k].rep, msg, sizeof msg - 1) > 0, "%s exited", st_forge_job[k]);
    ck_assert_msg(strcmp(msg, "ok") == 0, "%s: %s", st_forge_job[k], msg);
  }
  /*
   * Every STATS folds every page first.  Over the first two pages the old
   * fold reread the whole ring for each entry it looked for (4096 x 4096
   * reads a page a fold), at every STATS and every tick.  Now a fold passes
   * over a ring at most twice and over a rejected page not at all, so the
   * daemon's CPU here is that of answering.  The ceiling is CPU time, the
   * daemon's work, which a loaded machine stretching the wall-clock time
   * does not move; it is far above what answering takes (under ASan too)
   * and far below what the old fold took.
   */
  enum { ST_STATS_ASKED = 100, ST_CPU_CEILING_MS = 500 };
  struct dw_frame *f = dw_frame_new();
  uint64_t cpu0 = st_cpu_ms(d.pid);
  for (unsigned i = 0; i < ST_STATS_ASKED; i++)
    ck_assert_uint_eq(st_fetch_all(&d, f), ST_W + ST_FORGED);
  uint64_t cpu = st_cpu_ms(d.pid) - cpu0;
  free(f);
  ck_assert_msg(cpu <= ST_CPU_CEILING_MS, "deepepd used %llu ms of CPU for %d STATS (ceiling %d)",
                (unsigned long long)cpu, ST_STATS_ASKED, ST_CPU_CEILING_MS);
  printf("stats: %u forged pages beside an honest job: deepepd used %llu ms of CPU for %d STATS "
         "(ceiling %d)\n", (unsigned)ST_FORGED, (unsigned long long)cpu, ST_STATS_ASKED,
         ST_CPU_CEILING_MS);
  /* Each page that broke the ring's rule was rejected at its first fold, said once. */
  char *log = tu_daemon_log(&d);
  for (unsigned k = 0; k < ST_FORGED; k++) {
    char want[300];
    dw_sfmt(want, sizeof want, "job %s rank 0 (pid %d): ", st_forge_job[k], (int)forger[k].pid);
    if (st_forge_said[k] == NULL) {
      ck_assert_msg(strstr(log, want) == NULL, "%s rejected:\n%s", st_forge_job[k], log);
      continue;
    }
    strncat(want, st_forge_said[k], sizeof want - strlen(want) - 1);
    ck_assert_msg(st_count(log, want) == 1, "\"%s\" not logged once in:\n%s", want, log);
  }
  free(log);
  /* The page that kept the rule was folded as any other; the honest job counted exactly. */
  struct dep_msg_stats_rank got[ST_W];
  struct dep_msg_stats_ok ok;
  ck_assert_uint_eq(st_fetch(&d, st_forge_job[ST_FORGE_KEPT], got, &ok), 1);
  ck_assert_uint_eq(got[0].ops[DEP_STATS_OP_DISPATCH].calls, 100);
  ck_assert_uint_eq(got[0].ops[DEP_STATS_OP_DISPATCH].steady_calls, 99);
  ck_assert_uint_eq(got[0].dropped, 0);
  /* The lapped writer's: caught up with to half a ring behind its newest call, the calls
   * before counted as dropped. */
  ck_assert_uint_eq(st_fetch(&d, st_forge_job[ST_FORGE_LAPPED], got, &ok), 1);
  ck_assert_uint_eq(got[0].ops[DEP_STATS_OP_DISPATCH].calls, DEP_STATS_RING / 2);
  ck_assert_uint_eq(got[0].ops[DEP_STATS_OP_DISPATCH].bytes, DEP_STATS_RING / 2 * 1000ull);
  ck_assert_uint_eq(got[0].dropped, 2 * DEP_STATS_RING - DEP_STATS_RING / 2);
  ck_assert_uint_eq(st_fetch(&d, "st-honest", got, &ok), ST_W);
  for (uint32_t i = 0; i < ST_W; i++)
    st_expect_op(&got[i], DEP_STATS_OP_DISPATCH, 10, 0, 10 * dep_stats_bytes(ST_TOKENS, ST_HIDDEN,
                                                                             false));
  for (unsigned k = 0; k < ST_FORGED; k++) {
    ck_assert_int_eq(write(forger[k].go, "g", 1), 1);
    int st = 0;
    ck_assert_int_eq(waitpid(forger[k].pid, &st, 0), forger[k].pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: status 0x%x", st_forge_job[k], st);
    close(forger[k].rep);
    close(forger[k].go);
  }
  st_job_end(honest, false);
  dw_stop_ok(&d);
}
END_TEST

Suite *stats_forged_suite(void);
Suite *stats_forged_suite(void) {
  Suite *s = suite_create("stats_forged");
  TCase *t = tcase_create("forged pages");
  tcase_set_timeout(t, 120);
  tcase_add_test(t, a_forged_page_costs_the_daemon_little_and_one_that_breaks_the_rule_is_dropped);
  suite_add_tcase(s, t);
  return s;
}
