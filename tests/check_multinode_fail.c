/*
 * check_multinode_fail.c — suite multinode_fail: multi-node jobs that
 * fail before they start (DESIGN §5, §7), over real daemons on 127.0.0.1.
 * A job that failed while it gathered answers its late ranks at once, its
 * own uid's only, and the job started again under the id runs; a
 * MEMBERSHIP refused after the sender holds every rank, and a first rank
 * refused by a limit, fail the job on every node at once; a fake node
 * flooding MEMBERSHIPs is refused past its share while a real job runs.
 * The raw-wire ranks it shares with check_multinode.c are mnrank.c's.
 */
#include <arpa/inet.h>
#include <check.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sodium.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clienttest.h"
#include "daemonwire.h"
#include "deepep.h"
#include "mnrank.h"
#include "nodes.h"
#include "peerauth.h"
#include "peer_proto.h"
#include "proto.h"
#include "slab.h"
#include "testutil.h"

/* ---- a failed job's late ranks, and the job started again ---------------- */

/* What a rank process's ATTACH got (in memory shared with the test). */
struct rank_said {
  int done;                  /* 1 once rc and msg are set */
  int rc;                    /* dep_attach's */
  int64_t ms;                /* from its gate opening to the answer */
  char msg[DEP_MSG_TEXT_MAX];
};

/* Rank `rank` (local lr of lws) of job id, a world of six: a small shape. */
static struct dep_attach_args late_args(const char *id, uint32_t rank, uint32_t world,
                                        uint32_t lr, uint32_t lws) {
  struct dep_attach_args a = job_args(id, rank, world, lr, lws);
  a.shape.num_experts = 12; /* a multiple of the world */
  a.shape.max_tokens_per_rank = 8;
  a.shape.hidden = 256;
  return a;
}

/*
 * A rank process on the public API: forked now, it attaches global rank
 * `rank` (local lr of lws) of job `id`, a world of `world`, on sock once a
 * byte comes on `gate`; after an ATTACH_OK it stays attached until a byte
 * comes on `hold`.  Its answer lands in *out.
 */
static pid_t fork_rank(const char *sock, const char *id, uint32_t rank, uint32_t world,
                       uint32_t lr, uint32_t lws, int gate, int hold, struct rank_said *out) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid != 0)
    return pid;
  char b;
  if (read(gate, &b, 1) != 1)
    _exit(2);
  int64_t t0 = dw_now_ms();
  dep_client_t *c = NULL;
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  struct dep_attach_args a = late_args(id, rank, world, lr, lws);
  if (rc == 0)
    rc = dep_attach(c, &a);
  out->ms = dw_now_ms() - t0;
  out->rc = rc;
  snprintf(out->msg, sizeof out->msg, "%s", c != NULL ? dep_errmsg(c) : "");
  __atomic_store_n(&out->done, 1, __ATOMIC_RELEASE);
  if (rc == 0 && read(hold, &b, 1) == 1)
    dep_detach(c);
  dep_client_free(c);
  _exit(0);
}

/* n answers in memory shared with the rank processes, zeroed (munmap when done). */
static struct rank_said *said_new(int n) {
  struct rank_said *said = mmap(NULL, (size_t)n * sizeof *said, PROT_READ | PROT_WRITE,
                                MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(said, MAP_FAILED);
  memset(said, 0, (size_t)n * sizeof *said);
  return said;
}

/* Open n gates of a pipe (write n bytes). */
static void open_gates(int fd, int n) {
  for (int i = 0; i < n; i++)
    ck_assert_int_eq(write(fd, "g", 1), 1);
}

/* Wait up to timeout_ms for n answers; false (the rest killed) when some never came. */
static bool ranks_answer(struct rank_said *said, const pid_t *pids, int n, int timeout_ms) {
  int64_t until = dw_now_ms() + timeout_ms;
  for (int i = 0; i < n; i++) {
    while (!__atomic_load_n(&said[i].done, __ATOMIC_ACQUIRE) && dw_now_ms() < until)
      dw_sleep_ms(5);
    if (!__atomic_load_n(&said[i].done, __ATOMIC_ACQUIRE)) {
      for (int k = 0; k < n; k++)
        kill(pids[k], SIGKILL);
      return false;
    }
  }
  return true;
}

static void reap_all(const pid_t *pids, int n) {
  for (int i = 0; i < n; i++)
    waitpid(pids[i], NULL, 0);
}

/* The kernel's clock, in /proc/PID/stat's starttime unit. */
static uint64_t boot_ticks(void) {
  struct timespec ts;
  ck_assert_int_eq(clock_gettime(CLOCK_BOOTTIME, &ts), 0);
  long hz = sysconf(_SC_CLK_TCK);
  return (uint64_t)ts.tv_sec * (uint64_t)hz + (uint64_t)ts.tv_nsec / (1000000000u / (uint64_t)hz);
}

static uint64_t start_tick(pid_t pid) {
  char path[64], buf[1024];
  dw_sfmt(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "re");
  ck_assert_ptr_nonnull(f);
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  char *p = strrchr(buf, ')');
  ck_assert_ptr_nonnull(p);
  unsigned long long start = 0;
  ck_assert_int_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d "
                          "%*d %*d %*d %*d %llu", &start), 1);
  return start;
}

/* Wait until the kernel's clock has ticked past the start of each of the n
 * processes (its unit of process start times): a failure after this comes
 * after they started, as a trainer's late ranks' would. */
static void tick_past_start(const pid_t *pids, int n) {
  uint64_t started = 0;
  for (int i = 0; i < n; i++) {
    uint64_t s = start_tick(pids[i]);
    started = s > started ? s : started;
  }
  while (boot_ticks() <= started)
    dw_sleep_ms(2);
}

/* Job id (a world of `world`) fails on node 0: its rank 0 (local 0 of 2)
 * attaches there, then a rank 1 (local 1 of 2) with another hidden size is
 * refused.  Their connections in *r0 and *r1. */
static void fail_on_node0(const struct nodes *ns, const char *id, uint32_t world, int *r0,
                          int *r1) {
  *r0 = dw_client(&ns->d[0]);
  *r1 = dw_client(&ns->d[0]);
  struct dep_attach_args x = late_args(id, 0, world, 0, 2);
  dw_attach(*r0, &x, 7);
  char waits[64];
  dw_sfmt(waits, sizeof waits, "job %s: rank 0 (local 0", id);
  ck_assert(dw_log_has(&ns->d[0], waits, 5000));
  x = late_args(id, 1, world, 1, 2);
  x.shape.hidden = 512;
  dw_attach(*r1, &x, 7);
  expect_fail(*r1, DEP_ERR_MISMATCH, "hidden", NULL);
}

/*
 * A multi-node job that fails while it gathers answers its late ranks at
 * once, on every node (DESIGN §5), and the same id started again runs.
 * Three nodes, a world of six, two ranks on each (node 0 ranks 0-1, node
 * 1 ranks 2-3, node 2 ranks 4-5).  Rank processes for ranks 1, 3, 4 and 5
 * are started first but attach only after the failure (late ranks of that
 * attempt).  Rank 2 waits on node 1; on node 0 rank 0 waits and a process
 * claiming rank 1 gives another hidden size: refused, the job fails on
 * every node with that reason.  The late ranks, on the node that failed
 * (1), on a node whose other rank waited (3) and on a node where none had
 * attached (4, 5), must hear it within 8 s (a ceiling for a loaded
 * machine; attach_timeout_ms is 120 s).  They once gathered the id anew
 * and waited out the timeout; rank 2 was not even told (a rank refused on
 * one node failed the job there only).  Then the trainer starts the job
 * again with the same id: six new processes, all ready on every node.  (A
 * process that heard the failure and tries again gathers anew too:
 * a_rank_claimed_on_both_nodes_fails_on_both.)
 */
START_TEST(a_failed_jobs_late_ranks_hear_it_at_once_and_the_job_started_again_runs) {
  enum { WORLD = 6, LATE = 4, ALL = 6 };
  struct nodes ns;
  nodes_start(&ns, 3, 120000);
  struct rank_said *said = said_new(LATE + ALL);
  int gate[2], hold[2];
  ck_assert_int_eq(pipe(gate), 0);
  ck_assert_int_eq(pipe(hold), 0);
  /* global rank: node, local rank, local world */
  static const uint32_t at[WORLD][3] = {{0, 0, 2}, {0, 1, 2}, {1, 0, 2},
                                        {1, 1, 2}, {2, 0, 2}, {2, 1, 2}};
  static const uint32_t late[LATE] = {1, 3, 4, 5};
  pid_t pids[LATE + ALL];
  for (int i = 0; i < LATE; i++) {
    uint32_t g = late[i];
    pids[i] = fork_rank(ns.d[at[g][0]].sock, "late", g, WORLD, at[g][1], at[g][2], gate[0],
                        hold[0], &said[i]);
  }
  /* The failure comes a clock tick after they started. */
  tick_past_start(pids, LATE);
  int r2 = dw_client(&ns.d[1]), r0, r1;
  struct dep_attach_args x = late_args("late", 2, WORLD, 0, 2);
  dw_attach(r2, &x, 7);
  ck_assert(dw_log_has(&ns.d[1], "job late: rank 2 (local 0", 5000));
  fail_on_node0(&ns, "late", WORLD, &r0, &r1);
  expect_fail(r0, DEP_ERR_MISMATCH, "hidden", "rank 1");
  expect_fail(r2, DEP_ERR_MISMATCH, "hidden", "failed on node 127.0.0.1:");
  ck_assert(dw_log_has(&ns.d[2], "before any of its ranks attached here", 5000));
  open_gates(gate[1], LATE);
  bool answered = ranks_answer(said, pids, LATE, 8000);
  reap_all(pids, LATE);
  ck_assert_msg(answered, "a late rank of the failed job was not answered within 8 s");
  for (int i = 0; i < LATE; i++) {
    ck_assert_msg(said[i].rc == DEP_ERR_MISMATCH && strstr(said[i].msg, "hidden") != NULL &&
                      strstr(said[i].msg, "before this rank attached") != NULL,
                  "late rank %u: %s (%d)", late[i], said[i].msg, said[i].rc);
  }
  ck_assert_msg(strstr(said[0].msg, "failed on this node") != NULL, "%s", said[0].msg);
  for (int i = 1; i < LATE; i++)
    ck_assert_msg(strstr(said[i].msg, "failed on node 127.0.0.1:") != NULL, "%s", said[i].msg);
  close(r0);
  close(r1);
  close(r2);

  /* Started again: new processes, the same id, every rank. */
  for (uint32_t g = 0; g < WORLD; g++)
    pids[LATE + g] = fork_rank(ns.d[at[g][0]].sock, "late", g, WORLD, at[g][1], at[g][2],
                               gate[0], hold[0], &said[LATE + g]);
  open_gates(gate[1], ALL);
  answered = ranks_answer(said + LATE, pids + LATE, ALL, 15000);
  if (answered)
    open_gates(hold[1], ALL);
  reap_all(pids + LATE, ALL);
  ck_assert_msg(answered, "the job started again was not ready within 15 s");
  for (uint32_t g = 0; g < WORLD; g++)
    ck_assert_msg(said[LATE + g].rc == 0, "rank %u of the job started again: %s (%d)", g,
                  said[LATE + g].msg, said[LATE + g].rc);
  munmap(said, (LATE + ALL) * sizeof *said);
  for (int i = 0; i < 2; i++) {
    close(gate[i]);
    close(hold[i]);
  }
  nodes_stop(&ns);
}
END_TEST

/*
 * A failure is remembered under its owner's uid: uid 65534's rank of the
 * same id, its process started before root's job failed, learns nothing
 * of it and gathers its own job (no reply within attach_as_nobody's 2 s),
 * while root's late rank, the same global rank on the same node, hears
 * the failure at once.  Root only (a rank runs as uid 65534).
 */
START_TEST(a_remembered_failure_is_told_to_its_own_uids_late_ranks_only) {
  struct nodes ns;
  if (!nodes_start_for_nobody(&ns, __func__, 120000))
    return;
  struct rank_said *said = said_new(1);
  int gate[2], hold[2], ngate[2];
  ck_assert_int_eq(pipe(gate), 0);
  ck_assert_int_eq(pipe(hold), 0);
  ck_assert_int_eq(pipe(ngate), 0);
  /* World 3: node 0 holds ranks 0-1, node 1 rank 2. */
  pid_t late = fork_rank(ns.d[1].sock, "uidlate", 2, 3, 0, 1, gate[0], hold[0], said);
  fflush(stdout);
  pid_t nobody = fork();
  ck_assert_int_ge(nobody, 0);
  if (nobody == 0) {
    char g;
    _exit(read(ngate[0], &g, 1) == 1 ? attach_as_nobody(ns.d[1].sock, "uidlate", 2, 3, 0, NULL)
                                      : 20);
  }
  const pid_t both[2] = {late, nobody};
  tick_past_start(both, 2); /* the failure comes a clock tick after they started */
  int r0, r1;
  fail_on_node0(&ns, "uidlate", 3, &r0, &r1);
  expect_fail(r0, DEP_ERR_MISMATCH, "hidden", NULL);
  ck_assert(dw_log_has(&ns.d[1], "before any of its ranks attached here", 5000));
  open_gates(gate[1], 1);
  bool answered = ranks_answer(said, &late, 1, 8000);
  reap_all(&late, 1);
  ck_assert_msg(answered, "root's late rank was not answered within 8 s");
  ck_assert_msg(said->rc == DEP_ERR_MISMATCH && strstr(said->msg, "before this rank attached"),
                "root's late rank: %s (%d)", said->msg, said->rc);
  open_gates(ngate[1], 1);
  expect_child_ok(nobody, "uid 65534's rank of an id whose root job failed");
  close(r0);
  close(r1);
  munmap(said, sizeof *said);
  for (int i = 0; i < 2; i++) {
    close(gate[i]);
    close(hold[i]);
    close(ngate[i]);
  }
  nodes_stop(&ns);
}
END_TEST

/*
 * A node answers its ranks only once every node holding ranks of the job
 * has taken its MEMBERSHIP (MEMBERSHIP_OK), so that a refusal reaches
 * ranks still waiting for their ATTACH.  Node 0 takes at most one job's
 * MEMBERSHIP from node 1 (limits.max_jobs 1 on node 0 only), and job
 * "held" keeps that place (node 1's rank of it waits).  Job "taken":
 * node 0's rank attaches first and node 1 takes its MEMBERSHIP; then node
 * 1's rank attaches, and node 1 holds every rank while node 0 refuses
 * node 1's MEMBERSHIP.  Node 1's rank must get that refusal as its
 * ATTACH's error (DEP_ERR_LIMIT, "too many jobs pending"): it once got
 * ATTACH_OK from node 1, which had started the job on holding every
 * record, and then only the abort words of a job that had failed.  Once
 * "held" is gone, the same ranks attach "taken" again and it runs.
 */
/* Two nodes configured with attach_timeout_ms `timeout`, node 0 also with `more` limits. */
static void nodes_config_node0(struct nodes *ns, int timeout, const char *more) {
  nodes_config(ns, 2, timeout);
  char was[64];
  dw_sfmt(was, sizeof was, "attach_timeout_ms: %d}", timeout);
  char *lim = strstr(ns->yaml[0], was);
  ck_assert_ptr_nonnull(lim);
  char rest[sizeof ns->yaml[0]];
  dw_sfmt(rest, sizeof rest, "%s", lim + strlen(was) - 1);
  dw_sfmt(lim, sizeof ns->yaml[0] - (size_t)(lim - ns->yaml[0]), "attach_timeout_ms: %d%s%s",
          timeout, more, rest);
}

START_TEST(a_membership_refused_after_the_sender_holds_every_rank_fails_its_attach_cleanly) {
  struct nodes ns;
  nodes_config_node0(&ns, 8000, ", max_jobs: 1");
  nodes_start_all(&ns);
  int h1 = attach_announced(&ns, 1, "held", 1, 5000);
  int a = attach_announced(&ns, 0, "taken", 0, 5000);
  int b = attach_rank(&ns.d[1], "taken", 1, 2, 0, 1);
  expect_fail(b, DEP_ERR_LIMIT, "too many jobs pending from node 127.0.0.1:", "limits.max_jobs");
  expect_fail(a, DEP_ERR_LIMIT, "too many jobs pending from node 127.0.0.1:", NULL);
  close(a);
  close(b);
  close(h1);
  ck_assert(dw_log_has(&ns.d[1], "job held: removed", 5000));
  expect_1_plus_1_runs(&ns, "taken");
  nodes_stop(&ns);
}
END_TEST

/*
 * The first rank of a multi-node job that a node refuses before the job
 * exists there (a limit: limits.max_jobs 1 on node 0, which runs a job
 * of one rank) fails the job on every node at once (DESIGN §5): node 1's
 * rank, waiting, gets the reason within 4 s (a ceiling for a loaded
 * machine; attach_timeout_ms is 60 s).  It once waited out the timeout,
 * since only the refused rank was answered.
 */
START_TEST(a_first_rank_refused_by_a_limit_fails_the_job_on_every_node_at_once) {
  struct nodes ns;
  nodes_config_node0(&ns, 60000, ", max_jobs: 1");
  nodes_start_all(&ns);
  int b = attach_announced(&ns, 1, "full", 1, 5000);
  int busy = attach_rank(&ns.d[0], "busy", 0, 1, 0, 1);
  expect_ready(busy, 1);
  int a = attach_rank(&ns.d[0], "full", 0, 2, 0, 1);
  int64_t t0 = dw_now_ms();
  expect_fail(a, DEP_ERR_LIMIT, "limits.max_jobs", NULL);
  expect_fail(b, DEP_ERR_LIMIT, "limits.max_jobs", "cannot start: its rank 0");
  ck_assert_int_lt(dw_now_ms() - t0, 4000);
  close(a);
  close(b);
  close(busy);
  nodes_stop(&ns);
}
END_TEST

/* ---- a fake node: an authenticated peer link the test speaks itself ---- */

static void fake_send_raw(int fd, const struct proto_buf *b) {
  struct dep_msg_opaque o = {.data = b->data, .len = b->len};
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_PEER, 0, &o), 0);
}

static void fake_send(int fd, const struct dep_peer_msg *m) {
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(peer_proto_encode(&b, m), 0);
  fake_send_raw(fd, &b);
  proto_buf_free(&b);
}

/* The next peer message into *m (its bytes stay in f), within timeout_ms. */
static void fake_recv(int fd, struct dw_frame *f, struct dep_peer_msg *m, int timeout_ms) {
  ck_assert_int_eq(dw_recv_frame(fd, f, timeout_ms), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "PEER");
  char why[256] = "";
  ck_assert_msg(peer_proto_decode(f->body, f->h.body_len, m, why, sizeof why) == 0, "%s", why);
}

/*
 * Open a peer link into node `into` from 127.0.0.1 as the configured peer
 * node `as` (its listen port; that daemon is not started), with the nodes'
 * key, and run the handshake as the connecting end: HELLO, AUTH, AUTH_OK,
 * then the acceptor's XPORT (TCP on loopback).  The link is up at the far
 * end when XPORT comes.
 */
static int fake_peer_open(const struct nodes *ns, int into, int as) {
  static uint8_t key[PEERAUTH_KEY_MAX];
  size_t keylen = 0;
  char why[256];
  ck_assert_msg(peerauth_key_load(ns->key, key, sizeof key, &keylen, why, sizeof why) == 0, "%s",
                why);
  ck_assert_int_ge(sodium_init(), 0);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ck_assert_int_ge(fd, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)ns->port[into])};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  static struct peerauth_hs hs;
  hs = (struct peerauth_hs){.connector = true, .key = key, .keylen = keylen};
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(peerauth_hello(&hs, "fake", "127.0.0.1", (uint16_t)ns->port[as], &b), 0);
  fake_send_raw(fd, &b);
  proto_buf_free(&b);
  struct dw_frame *f = dw_frame_new();
  struct dep_peer_msg *m = malloc(sizeof *m);
  ck_assert_ptr_nonnull(m);
  for (bool xport = false; !xport;) {
    fake_recv(fd, f, m, 5000);
    switch (m->type) {
    case DEP_PEER_HELLO: {
      ck_assert_int_eq(peerauth_take(&hs, f->body, f->h.body_len), 0);
      struct dep_peer_msg a = {.type = DEP_PEER_AUTH};
      peerauth_mac(&hs, a.u.auth.mac);
      fake_send(fd, &a);
      break;
    }
    case DEP_PEER_AUTH:
      ck_assert(peerauth_check(&hs, m->u.auth.mac));
      fake_send(fd, &(struct dep_peer_msg){.type = DEP_PEER_AUTH_OK});
      break;
    case DEP_PEER_AUTH_OK:
      break;
    case DEP_PEER_XPORT:
      ck_assert_uint_eq(m->u.xport.kind, DEP_PEER_XPORT_TCP);
      xport = true;
      break;
    default:
      ck_abort_msg("the daemon said %s during the handshake: %s",
                   peer_proto_type_name(m->type), m->u.error.message);
    }
  }
  free(m);
  free(f);
  return fd;
}

/* A well-formed MEMBERSHIP of job id: rank 1 of a world of two, held by the sender. */
static void fake_membership(struct dep_peer_msg *m, const char *id) {
  memset(m, 0, sizeof *m);
  m->type = DEP_PEER_MEMBERSHIP;
  struct dep_peer_membership *x = &m->u.membership;
  dw_sfmt(x->job_id, sizeof x->job_id, "%s", id);
  x->owner_uid = 0;
  x->sw.world_size = 2;
  x->sw.shape = dw_job_args(id, 0, 1).shape;
  x->local_world_size = x->n_ranks = 1;
  x->ranks[0] = 1;
  struct dep_slab_layout l;
  char why[256];
  ck_assert_msg(dep__slab_layout_nodes(&x->sw.shape, 2, 1, 0, &l, why, sizeof why) == 0, "%s", why);
  x->n_windows = 1;
  x->windows[0] = (struct dep_peer_window){0, 0, l.xchg_bytes, 0, 0};
}

/* Read what is waiting on the fake link (for up to wait_ms for the first):
 * JOB_FAILs counted into *refused (each checked), KEEPALIVEs answered. */
static void fake_drain(int fd, int wait_ms, uint32_t *refused, struct dw_frame *f,
                       struct dep_peer_msg *m) {
  for (int ms = wait_ms;; ms = 0) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, ms) <= 0)
      return;
    fake_recv(fd, f, m, 5000);
    if (m->type == DEP_PEER_KEEPALIVE && m->u.keepalive.reply == 0) {
      m->u.keepalive.reply = 1;
      fake_send(fd, m);
    } else if (m->type == DEP_PEER_JOB_FAIL) {
      ck_assert_int_eq(m->u.job.code, DEP_ERR_LIMIT);
      ck_assert_msg(strstr(m->u.job.message, "too many jobs pending from node 127.0.0.1:") !=
                        NULL, "%s", m->u.job.message);
      (*refused)++;
    }
  }
}

/*
 * An authenticated peer cannot exhaust the table of what peers report: a
 * fake node sends 5000 MEMBERSHIPs of jobs that never come into node 0.
 * Node 0 keeps as many as limits.max_jobs (64) from it and refuses each
 * one past them back to it at once (JOB_FAIL, "too many jobs pending from
 * node ..."); then a two-node job of the real nodes runs.  Before, the
 * 4096-record table filled for every peer and the job half-completed: node
 * 1's rank attached, node 0's waited.
 */
START_TEST(a_peer_flooding_memberships_is_refused_past_its_share_and_a_real_job_runs) {
  enum { FLOOD = 5000, KEPT = 64 /* limits.max_jobs's default */ };
  struct nodes ns;
  nodes_config(&ns, 3, 8000);
  node_start(&ns, 0);
  node_start(&ns, 1);
  int fd = fake_peer_open(&ns, 0, 2);
  struct dw_frame *f = dw_frame_new();
  struct dep_peer_msg *m = malloc(sizeof *m), *in = malloc(sizeof *in);
  ck_assert_ptr_nonnull(m);
  ck_assert_ptr_nonnull(in);
  uint32_t refused = 0;
  int64_t t0 = dw_now_ms();
  for (int i = 0; i < FLOOD; i++) {
    char id[32];
    dw_sfmt(id, sizeof id, "flood-%d", i);
    fake_membership(m, id);
    fake_send(fd, m);
    fake_drain(fd, 0, &refused, f, in);
  }
  /* Every refusal comes back as its MEMBERSHIP is read: 10 s from the
   * first send for all of them is a ceiling for a loaded machine (the
   * test's own timeout is 20 s). */
  while (refused < FLOOD - KEPT && dw_now_ms() - t0 < 10000)
    fake_drain(fd, 5000, &refused, f, in);
  ck_assert_uint_eq(refused, FLOOD - KEPT);
  ck_assert(dw_log_has(&ns.d[0], "too many jobs pending from node 127.0.0.1:", 2000));
  expect_1_plus_1_runs(&ns, "real");
  close(fd);
  free(m);
  free(in);
  free(f);
  nodes_stop(&ns);
}
END_TEST

Suite *multinode_fail_suite(void);
Suite *multinode_fail_suite(void) {
  Suite *s = suite_create("multinode_fail");
  TCase *tc = tcase_create("daemons");
  tcase_set_timeout(tc, 20);
  tcase_add_test(tc, a_failed_jobs_late_ranks_hear_it_at_once_and_the_job_started_again_runs);
  tcase_add_test(tc, a_remembered_failure_is_told_to_its_own_uids_late_ranks_only);
  tcase_add_test(tc, a_membership_refused_after_the_sender_holds_every_rank_fails_its_attach_cleanly);
  tcase_add_test(tc, a_first_rank_refused_by_a_limit_fails_the_job_on_every_node_at_once);
  tcase_add_test(tc, a_peer_flooding_memberships_is_refused_past_its_share_and_a_real_job_runs);
  suite_add_tcase(s, tc);
  return s;
}
