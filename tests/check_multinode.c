/*
 * check_multinode.c — multi-node jobs (daemon/job.c over daemon/peer.c,
 * DESIGN §7): the MEMBERSHIP / JOB_FAIL / JOB_END codec, then real daemons
 * on 127.0.0.1 with raw wire clients.  A job whose world spans two or
 * three daemons becomes ready on every node with no bootstrap of its own;
 * a node whose ranks never come, a rank claimed twice, a shape that
 * differs across nodes, a daemon killed while the job gathers: each fails
 * the job with an error that names the rank or node, and a new job works
 * after.  Once a job runs, a rank or a whole node that goes away is told
 * to the ranks left on the other nodes through the abort words of their
 * slabs.
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
#include "nodes.h"
#include "peerauth.h"
#include "peer_proto.h"
#include "proto.h"
#include "slab.h"
#include "testutil.h"

/* ---- codec ---------------------------------------------------------------- */

static struct dep_peer_msg sample_membership(void) {
  struct dep_peer_msg m = {.type = DEP_PEER_MEMBERSHIP};
  struct dep_peer_membership *x = &m.u.membership;
  snprintf(x->job_id, sizeof x->job_id, "train-7");
  x->owner_uid = 1000;
  x->sw.world_size = 4;
  x->sw.shape = (struct dep_job_shape){.max_tokens_per_rank = 128, .hidden = 1024,
                                       .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};
  x->local_world_size = x->n_ranks = 2;
  x->ranks[0] = 2;
  x->ranks[1] = 3;
  /* Rank 3's slab spans two pieces: two windows; rank 2's is not registered (rkey 0). */
  x->n_windows = 3;
  x->windows[0] = (struct dep_peer_window){0, 0, 4096, 0, 0};
  x->windows[1] = (struct dep_peer_window){1, 0, 1024, 0x7f0000001000ull, 0x1234};
  x->windows[2] = (struct dep_peer_window){1, 1024, 3072, 0x7f0000100000ull, 0x5678};
  return m;
}

START_TEST(membership_and_job_events_round_trip) {
  struct dep_peer_msg m[6] = {sample_membership(), {.type = DEP_PEER_JOB_FAIL},
                              {.type = DEP_PEER_JOB_END}, {.type = DEP_PEER_XPORT},
                              {.type = DEP_PEER_XPORT_NAK}, {.type = DEP_PEER_MEMBERSHIP_OK}};
  snprintf(m[5].u.job.job_id, sizeof m[5].u.job.job_id, "train-7");
  m[5].u.job.owner_uid = 1000;
  m[3].u.xport.kind = DEP_PEER_XPORT_RDMA;
  memset(m[3].u.xport.token, 0xab, sizeof m[3].u.xport.token);
  m[3].u.xport.mbox_addr = 0x55550000ull;
  m[3].u.xport.mbox_rkey = 77;
  m[3].u.xport.mbox_len = 64;
  m[4].u.nak.code = DEP_ERR_UNSUPPORTED;
  snprintf(m[4].u.nak.message, sizeof m[4].u.nak.message, "transport: tcp here");
  snprintf(m[1].u.job.job_id, sizeof m[1].u.job.job_id, "train-7");
  m[1].u.job.owner_uid = 1000;
  m[1].u.job.rank = 3;
  m[1].u.job.detached = 1;
  m[1].u.job.code = DEP_ERR_PEER;
  snprintf(m[1].u.job.message, sizeof m[1].u.job.message, "rank 3 detached");
  snprintf(m[2].u.job.job_id, sizeof m[2].u.job.job_id, "train-7");
  m[2].u.job.rank = DEP_PEER_NO_RANK;
  for (int i = 0; i < 6; i++) {
    struct proto_buf b;
    proto_buf_init(&b);
    ck_assert_int_eq(peer_proto_encode(&b, &m[i]), 0);
    struct dep_peer_msg out;
    char why[256];
    ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), 0);
    ck_assert_uint_eq(out.type, m[i].type);
    ck_assert_mem_eq(&out.u, &m[i].u, sizeof out.u);
    for (size_t n = 0; n < b.len; n++)
      ck_assert_int_ne(peer_proto_decode(b.data, n, &out, NULL, 0), 0);
    proto_buf_free(&b);
  }
}
END_TEST

START_TEST(a_membership_with_bad_counts_is_refused_both_ways) {
  struct dep_peer_msg m = sample_membership(), out;
  struct proto_buf b;
  proto_buf_init(&b);
  m.u.membership.n_ranks = 1; /* not its local_world_size */
  ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
  m = sample_membership();
  m.u.membership.n_windows = DEP_PEER_WINDOWS_MAX + 1;
  ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
  m = sample_membership();
  m.u.membership.windows[1].rank_index = 2; /* past n_ranks */
  ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
  m = sample_membership();
  m.u.membership.windows[2].len = 0;
  ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
  ck_assert_uint_eq(b.len, 0);
  /* A decoder refuses the same from a peer that encodes them anyway: the
   * last window's len (8 bytes after its rank index and offset) made 0. */
  m = sample_membership();
  ck_assert_int_eq(peer_proto_encode(&b, &m), 0);
  size_t last = b.len - (4 + 8 + 8 + 8 + 4);
  memset(b.data + last + 4 + 8, 0, 8);
  char wwhy[256];
  ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, wwhy, sizeof wwhy), DEP_ERR_PROTOCOL);
  ck_assert_ptr_nonnull(strstr(wwhy, "window 2"));
  b.len = 0;
  /* An XPORT of an unknown kind, a NAK that is not an error. */
  struct dep_peer_msg xp = {.type = DEP_PEER_XPORT};
  xp.u.xport.kind = 2;
  ck_assert_int_eq(peer_proto_encode(&b, &xp), DEP_ERR_INVALID);
  struct dep_peer_msg nak = {.type = DEP_PEER_XPORT_NAK};
  ck_assert_int_eq(peer_proto_encode(&b, &nak), DEP_ERR_INVALID);
  ck_assert_uint_eq(b.len, 0);
  m = sample_membership();
  ck_assert_int_eq(peer_proto_encode(&b, &m), 0);
  /* The shape's field count follows the job id (2 + 7 bytes) and the uid. */
  size_t at = DEP_PEER_HDR_LEN + 2 + 7 + 4;
  b.data[at] = (uint8_t)(DEP_SHAPE_NFIELDS + 1);
  char why[256];
  ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), DEP_ERR_PROTOCOL);
  ck_assert_ptr_nonnull(strstr(why, "same deepepd version"));
  proto_buf_free(&b);
  /* JOB_FAIL needs an error code; JOB_END none. */
  struct dep_peer_msg f = {.type = DEP_PEER_JOB_FAIL};
  ck_assert_int_eq(peer_proto_encode(&b, &f), DEP_ERR_INVALID);
  f.type = DEP_PEER_JOB_END;
  f.u.job.code = DEP_ERR_PEER;
  ck_assert_int_eq(peer_proto_encode(&b, &f), DEP_ERR_INVALID);
  proto_buf_free(&b);
}
END_TEST

/* ---- real daemons ---------------------------------------------------------- */

/* Global rank `rank` of job `id`, a world of `world` ranks, as local rank lr of lws. */
static struct dep_attach_args job_args(const char *id, uint32_t rank, uint32_t world,
                                       uint32_t lr, uint32_t lws) {
  struct dep_attach_args a = dw_job_args(id, lr, lws);
  a.rank = rank;
  a.world_size = world;
  if (world % 3 == 0)
    a.shape.num_experts = 12; /* a multiple of the world */
  return a;
}

/* ATTACH *a on a new connection to d: the connection. */
static int attach_args(const struct tu_daemon *d, const struct dep_attach_args *a) {
  int fd = dw_client(d);
  dw_attach(fd, a, 7);
  return fd;
}

/* ATTACH global rank `rank` of a job of `world` ranks as local rank lr of lws on d. */
static int attach_rank(const struct tu_daemon *d, const char *id, uint32_t rank, uint32_t world,
                       uint32_t lr, uint32_t lws) {
  struct dep_attach_args a = job_args(id, rank, world, lr, lws);
  return attach_args(d, &a);
}

/* The ATTACH reply: SLAB frames (their fds closed), then ATTACH_OK for lws local ranks. */
static void expect_ready(int fd, uint32_t lws) {
  struct dep_msg_attach_ok ok;
  dw_expect_attach_ok(fd, 7, &ok);
  ck_assert_uint_eq(ok.local_world_size, lws);
}

/* Rank `rank` of job `id`, a world of two, attaches on node `node` (its only
 * local rank); the other node of two says it has the job's MEMBERSHIP
 * within timeout_ms.  The connection. */
static int attach_announced(const struct nodes *ns, int node, const char *id, uint32_t rank,
                            int timeout_ms) {
  int fd = attach_rank(&ns->d[node], id, rank, 2, 0, 1);
  char has[64];
  dw_sfmt(has, sizeof has, "job %s: node 127.0.0.1:", id);
  ck_assert(dw_log_has(&ns->d[1 - node], has, timeout_ms));
  return fd;
}

/* A job `id` of 1 + 1 ranks (rank 0 on node 0, rank 1 on node 1) is ready on both; then its
 * ranks leave. */
static void expect_1_plus_1_runs(const struct nodes *ns, const char *id) {
  int a = attach_rank(&ns->d[0], id, 0, 2, 0, 1);
  int b = attach_rank(&ns->d[1], id, 1, 2, 0, 1);
  expect_ready(a, 1);
  expect_ready(b, 1);
  close(a);
  close(b);
}

/* An ERROR with this code whose message holds every needle (NULL-terminated). */
static void expect_fail(int fd, int code, const char *needle, const char *needle2) {
  char msg[DEP_MSG_TEXT_MAX];
  dw_expect_error(fd, code, msg, sizeof msg);
  ck_assert_msg(strstr(msg, needle) != NULL, "\"%s\" not in: %s", needle, msg);
  ck_assert_msg(needle2 == NULL || strstr(msg, needle2) != NULL, "\"%s\" not in: %s", needle2,
                msg);
}

/* A local rank's slab, mapped from the fd of its SLAB frame, to watch its abort words. */
struct slab_map {
  void *base;
  size_t len;
  const struct dep_slab_abort *abort;
};

/* As expect_ready for one local rank, keeping its slab mapped in *sm. */
static void expect_ready_mapped(int fd, struct slab_map *sm) {
  struct dw_frame *f = dw_frame_new();
  int fds[DEP_PROTO_MAX_FDS], nfds = 0;
  ck_assert_int_eq(dw_recv_frame_fds(fd, f, 5000, fds, &nfds), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "SLAB");
  struct dep_msg_slab m;
  ck_assert_int_eq(proto_decode_slab(f->body, f->h.body_len, &m), 0);
  ck_assert_int_eq(nfds, (int)m.n_chunks);
  ck_assert_uint_eq(m.n_ranks, 1);
  uint64_t at = m.ranks[0].offset + DEP_SLAB_ABORT_OFF;
  ck_assert_uint_le(at + sizeof(struct dep_slab_abort), m.chunk_bytes);
  sm->len = (size_t)m.chunk_bytes;
  sm->base = mmap(NULL, sm->len, PROT_READ, MAP_SHARED, fds[0], 0);
  ck_assert_ptr_ne(sm->base, MAP_FAILED);
  sm->abort = (const struct dep_slab_abort *)((const char *)sm->base + at);
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  free(f);
  expect_ready(fd, 1);
  ck_assert_int_eq(__atomic_load_n(&sm->abort->code, __ATOMIC_ACQUIRE), 0);
}

/* Wait up to timeout_ms for the abort code; returns it (0 when it never came). */
static int32_t wait_abort(const struct slab_map *sm, int timeout_ms) {
  int32_t code = 0;
  for (int t = 0; t <= timeout_ms; t += 10) {
    if ((code = __atomic_load_n(&sm->abort->code, __ATOMIC_ACQUIRE)) != 0)
      break;
    dw_sleep_ms(10);
  }
  return code;
}

START_TEST(a_two_node_job_of_1_plus_1_is_ready_on_both_nodes_and_a_late_peer_learns_it) {
  struct nodes ns;
  nodes_config(&ns, 2, 8000);
  node_start(&ns, 0);
  /* Node 0's rank attaches before node 1 runs: its membership goes out
   * when the link comes up. */
  int a = attach_rank(&ns.d[0], "mn", 0, 2, 0, 1);
  dw_expect_silence(a, 200);
  node_start(&ns, 1);
  nodes_wait_up(&ns);
  dw_expect_silence(a, 200);
  int b = attach_rank(&ns.d[1], "mn", 1, 2, 0, 1);
  expect_ready(a, 1);
  expect_ready(b, 1);
  close(a);
  close(b);
  nodes_stop(&ns);
}
END_TEST

START_TEST(a_two_node_job_of_2_plus_2_is_ready_on_both_nodes) {
  struct nodes ns;
  nodes_start(&ns, 2, 8000);
  int fd[4];
  fd[0] = attach_rank(&ns.d[0], "mn4", 0, 4, 0, 2);
  fd[1] = attach_rank(&ns.d[0], "mn4", 1, 4, 1, 2);
  fd[2] = attach_rank(&ns.d[1], "mn4", 2, 4, 0, 2);
  dw_expect_silence(fd[0], 300); /* rank 3 is not here yet */
  fd[3] = attach_rank(&ns.d[1], "mn4", 3, 4, 1, 2);
  for (int i = 0; i < 4; i++)
    expect_ready(fd[i], 2);
  /* deepepctl status shows the job's nodes and remote ranks. */
  char cmd[700], out[8192];
  dw_sfmt(cmd, sizeof cmd, "%s -s %s status --json", tu_bin("deepepctl"), ns.d[0].sock);
  FILE *f = popen(cmd, "r");
  ck_assert_ptr_nonnull(f);
  size_t got = fread(out, 1, sizeof out - 1, f);
  out[got] = '\0';
  pclose(f);
  ck_assert_msg(strstr(out, "\"world_size\":4") != NULL, "%s", out);
  ck_assert_msg(strstr(out, "\"nodes\":2,\"remote_ranks\":2") != NULL, "%s", out);
  for (int i = 0; i < 4; i++)
    close(fd[i]);
  nodes_stop(&ns);
}
END_TEST

START_TEST(a_node_whose_ranks_never_come_times_out_naming_them) {
  struct nodes ns;
  nodes_start(&ns, 2, 1500);
  int a0 = attach_rank(&ns.d[0], "lonely", 0, 4, 0, 2);
  int a1 = attach_rank(&ns.d[0], "lonely", 1, 4, 1, 2);
  int64_t t0 = dw_now_ms();
  expect_fail(a0, DEP_ERR_TIMEOUT, "missing global ranks 2-3", "peers up: 127.0.0.1:");
  expect_fail(a1, DEP_ERR_TIMEOUT, "missing global ranks 2-3", NULL);
  ck_assert_int_lt(dw_now_ms() - t0, 4000);
  close(a0);
  close(a1);
  nodes_stop(&ns);
}
END_TEST

START_TEST(a_rank_claimed_on_both_nodes_fails_on_both) {
  struct nodes ns;
  nodes_start(&ns, 2, 8000);
  int a = attach_rank(&ns.d[0], "twice", 0, 2, 0, 1);
  int b = attach_rank(&ns.d[1], "twice", 0, 2, 0, 1);
  expect_fail(a, DEP_ERR_EXISTS, "rank 0 is claimed by two nodes", NULL);
  expect_fail(b, DEP_ERR_EXISTS, "rank 0 is claimed by two nodes", NULL);
  close(a);
  close(b);
  /* A right one works at once after. */
  expect_1_plus_1_runs(&ns, "twice");
  nodes_stop(&ns);
}
END_TEST

START_TEST(a_shape_that_differs_across_nodes_fails_on_both) {
  struct nodes ns;
  nodes_start(&ns, 2, 8000);
  int a = attach_rank(&ns.d[0], "shape", 0, 2, 0, 1);
  int b = dw_client(&ns.d[1]);
  struct dep_attach_args x = dw_job_args("shape", 0, 1);
  x.rank = 1;
  x.world_size = 2;
  x.shape.hidden = 2048;
  dw_attach(b, &x, 7);
  expect_fail(a, DEP_ERR_MISMATCH, "hidden", "every rank of a job must pass the same values");
  expect_fail(b, DEP_ERR_MISMATCH, "hidden", NULL);
  close(a);
  close(b);
  nodes_stop(&ns);
}
END_TEST

START_TEST(a_daemon_killed_while_the_job_gathers_fails_it_at_once_then_a_new_job_works) {
  struct nodes ns;
  nodes_start(&ns, 2, 8000);
  /* Node 1 holds ranks 2 and 3; node 0 has one of its two. */
  int b0 = attach_rank(&ns.d[1], "gone", 2, 4, 0, 2);
  int b1 = attach_rank(&ns.d[1], "gone", 3, 4, 1, 2);
  int a0 = attach_rank(&ns.d[0], "gone", 0, 4, 0, 2);
  dw_expect_silence(a0, 300);
  kill(ns.d[1].pid, SIGKILL);
  waitpid(ns.d[1].pid, NULL, 0);
  ns.d[1].pid = 0;
  int64_t t0 = dw_now_ms();
  char port[32];
  dw_sfmt(port, sizeof port, "127.0.0.1:%d", ns.port[1]);
  expect_fail(a0, DEP_ERR_PEER, "went down", port);
  ck_assert_int_lt(dw_now_ms() - t0, 2000);
  close(a0);
  close(b0);
  close(b1);
  /* Node 1 back: a new job works. */
  ck_assert_int_eq(tu_daemon_start_in(&ns.d[1], ns.d[1].dir, ns.yaml[1]), 0);
  nodes_wait_up(&ns);
  expect_1_plus_1_runs(&ns, "again");
  nodes_stop(&ns);
}
END_TEST

START_TEST(a_three_node_job_of_1_plus_1_plus_1_is_ready_on_every_node) {
  struct nodes ns;
  nodes_start(&ns, 3, 8000);
  int fd[3];
  for (int i = 0; i < 3; i++)
    fd[i] = attach_rank(&ns.d[i], "three", (uint32_t)(2 - i), 3, 0, 1);
  for (int i = 0; i < 3; i++)
    expect_ready(fd[i], 1);
  for (int i = 0; i < 3; i++)
    close(fd[i]);
  nodes_stop(&ns);
}
END_TEST

/* A 1+1 job that runs, on two nodes; a's slab is mapped in *sm. */
static void running_1_plus_1(struct nodes *ns, const char *id, int *a, int *b,
                             struct slab_map *sm) {
  nodes_start(ns, 2, 8000);
  *a = attach_rank(&ns->d[0], id, 0, 2, 0, 1);
  *b = attach_rank(&ns->d[1], id, 1, 2, 0, 1);
  expect_ready_mapped(*a, sm);
  expect_ready(*b, 1);
}

START_TEST(a_running_job_whose_remote_rank_disconnects_aborts_the_local_rank_naming_it) {
  struct nodes ns;
  struct slab_map sm;
  int a, b;
  running_1_plus_1(&ns, "run-rank", &a, &b, &sm);
  dw_expect_silence(a, 200);
  ck_assert_int_eq(__atomic_load_n(&sm.abort->code, __ATOMIC_ACQUIRE), 0);
  int64_t t0 = dw_now_ms();
  close(b); /* rank 1's process is gone */
  ck_assert_int_eq(wait_abort(&sm, 2000), DEP_ERR_PEER);
  ck_assert_int_lt(dw_now_ms() - t0, 2000);
  ck_assert_uint_eq(sm.abort->rank, 1);
  ck_assert_uint_eq(sm.abort->detached, 0);
  munmap(sm.base, sm.len);
  close(a);
  nodes_stop(&ns);
}
END_TEST

START_TEST(a_running_job_whose_remote_daemon_is_killed_aborts_the_local_rank_naming_it) {
  struct nodes ns;
  struct slab_map sm;
  int a, b;
  running_1_plus_1(&ns, "run-node", &a, &b, &sm);
  int64_t t0 = dw_now_ms();
  kill(ns.d[1].pid, SIGKILL);
  waitpid(ns.d[1].pid, NULL, 0);
  ns.d[1].pid = 0;
  ck_assert_int_eq(wait_abort(&sm, 2000), DEP_ERR_PEER);
  ck_assert_int_lt(dw_now_ms() - t0, 2000);
  ck_assert_uint_eq(sm.abort->rank, 1);
  munmap(sm.base, sm.len);
  close(a);
  close(b);
  nodes_stop(&ns);
}
END_TEST

/* A clean stop (SIGTERM) leaves the stopping node's jobs running (DESIGN §13),
 * but its peer links drop: on the other nodes a gathering job fails and a
 * running job's ranks get the abort words naming the stopped node's rank. */
START_TEST(a_daemon_stopped_cleanly_fails_a_gathering_job_and_aborts_a_running_one_elsewhere) {
  struct nodes ns;
  struct slab_map sm;
  int a, b;
  running_1_plus_1(&ns, "stop-run", &a, &b, &sm);
  int ga = attach_rank(&ns.d[0], "stop-gather", 0, 3, 0, 1);
  int gb = attach_rank(&ns.d[1], "stop-gather", 1, 3, 0, 1);
  dw_expect_silence(ga, 300); /* rank 2 is nowhere */
  ck_assert(dw_log_has(&ns.d[0], "job stop-gather: node 127.0.0.1:", 2000));
  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(tu_daemon_stop(&ns.d[1]), 0);
  char port[32];
  dw_sfmt(port, sizeof port, "127.0.0.1:%d", ns.port[1]);
  expect_fail(ga, DEP_ERR_PEER, "went down", port);
  ck_assert_int_eq(wait_abort(&sm, 2000), DEP_ERR_PEER);
  ck_assert_uint_eq(sm.abort->rank, 1);
  ck_assert_uint_eq(sm.abort->detached, DEP_SLAB_GONE_NODE); /* its node is lost */
  ck_assert_int_lt(dw_now_ms() - t0, 3000);
  ck_assert(dw_log_has(&ns.d[0], "is stopping", 2000));
  munmap(sm.base, sm.len);
  close(a);
  close(b);
  close(ga);
  close(gb);
  nodes_stop(&ns);
}
END_TEST

/*
 * In a child that became uid/gid 65534: ATTACH rank `rank` of job `id` of
 * `world` ranks (one local rank) on sock.  want < 0: expect that error, its
 * message holding `needle` and naming neither another uid nor a node (no
 * "uid 0", no address); want 0: expect no reply for 2 s (the job gathers,
 * not failed).  The exit status is 0 when so, else the step that went wrong.
 */
static int attach_as_nobody(const char *sock, const char *id, uint32_t rank, uint32_t world,
                            int want, const char *needle) {
  if (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0)
    return 10;
  int fd = tu_connect_raw(sock);
  if (fd < 0)
    return 11;
  struct dep_msg_hello h = {.version = DEP_PROTO_VERSION};
  static struct dw_frame f;
  if (dw_send_frame(fd, DEP_MSG_HELLO, 1, &h) != 0 || dw_recv_frame(fd, &f, 5000) != 0 ||
      f.h.type != DEP_MSG_HELLO_OK)
    return 12;
  struct dep_attach_args x = job_args(id, rank, world, 0, 1);
  if (dw_send_frame(fd, DEP_MSG_ATTACH, 7, &x) != 0)
    return 13;
  int rc = dw_recv_frame(fd, &f, want == 0 ? 2000 : 5000);
  if (want == 0)
    return rc == -2 ? 0 : 14;
  struct dep_msg_error e;
  if (rc != 0 || f.h.type != DEP_MSG_ERROR || proto_decode_error(f.body, f.h.body_len, &e) != 0)
    return 15;
  if (e.code != want || strstr(e.message, needle) == NULL)
    return 16;
  if (strstr(e.message, "uid 0") != NULL || strstr(e.message, "127.0.0.1") != NULL)
    return 17; /* it names the owner or its node */
  return 0;
}

static pid_t fork_nobody(const char *sock, const char *id, uint32_t rank, uint32_t world,
                         int want, const char *needle) {
  fflush(stdout);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0)
    _exit(attach_as_nobody(sock, id, rank, world, want, needle));
  return pid;
}

/* Two nodes (attach_timeout_ms `timeout`) that any user may attach to,
 * node 1's socket open to uid 65534, started; false, with test skipped
 * saying why, unless root (a rank runs as uid 65534). */
static bool nodes_start_for_nobody(struct nodes *ns, const char *test, int timeout) {
  if (geteuid() != 0) {
    tu_skip_part(test, "running a rank as uid 65534 needs root");
    return false;
  }
  nodes_config_with(ns, 2, timeout, "", "allow: {any_user: true}\n");
  nodes_start_all(ns);
  chmod(ns->d[1].dir, 0755); /* uid 65534 reaches node 1's socket */
  return true;
}

static void expect_child_ok(pid_t pid, const char *what) {
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "%s: uid 65534's rank failed at step %d of attach_as_nobody", what,
                WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

/*
 * Across nodes a job is its (owner uid, id) (DESIGN §4).  Root's rank 0 of
 * a job of two waits on node 0, its MEMBERSHIP on node 1: uid 65534 asking
 * node 1 for that id learns only that it is taken, and root's job goes on.
 * (It once failed root's job with DEP_ERR_PERMISSION, and uid 65534's error
 * named root's uid and node.)  Then the case where neither uid is first:
 * root's job of three gathers on node 0 with one of its two local ranks
 * (nothing announced yet) while uid 65534's job of that id gathers on node
 * 1 and announces itself to node 0: the two are held apart and neither
 * fails.  Root's jobs then complete with their own ranks.
 */
START_TEST(a_job_id_another_uid_takes_on_another_node_fails_nothing_and_names_no_owner) {
  struct nodes ns;
  if (!nodes_start_for_nobody(&ns, __func__, 8000))
    return;
  int a = attach_announced(&ns, 0, "uids", 0, 3000); /* as root */
  pid_t pid = fork_nobody(ns.d[1].sock, "uids", 1, 2, DEP_ERR_PERMISSION,
                          "job uids belongs to another user");
  expect_child_ok(pid, "an id a peer holds for root");
  dw_expect_silence(a, 300); /* root's job still gathers */
  int b = attach_rank(&ns.d[1], "uids", 1, 2, 0, 1);
  expect_ready(a, 1);
  expect_ready(b, 1);
  close(a);
  close(b);

  int a0 = attach_rank(&ns.d[0], "mix", 0, 3, 0, 2);
  pid = fork_nobody(ns.d[1].sock, "mix", 2, 3, 0, NULL);
  ck_assert(dw_log_has(&ns.d[0], "they are two jobs, held apart", 3000));
  dw_expect_silence(a0, 300);
  expect_child_ok(pid, "its own job of an id root's job gathers under elsewhere");
  int a1 = attach_rank(&ns.d[0], "mix", 1, 3, 1, 2);
  int b2 = attach_rank(&ns.d[1], "mix", 2, 3, 0, 1);
  expect_ready(a0, 2);
  expect_ready(a1, 2);
  expect_ready(b2, 1);
  close(a0);
  close(a1);
  close(b2);
  nodes_stop(&ns);
}
END_TEST

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

/* ATTACH global rank `rank` of job `id`, a world of `world` ranks larger
 * than one node holds (DEP_MAX_LOCAL_RANKS), in a small shape: its
 * experts a multiple of the world, its memory a few MiB a node. */
static int attach_wide(const struct tu_daemon *d, const char *id, uint32_t rank, uint32_t world,
                       uint32_t lr, uint32_t lws) {
  struct dep_attach_args a = job_args(id, rank, world, lr, lws);
  a.shape = (struct dep_job_shape){.max_tokens_per_rank = 4, .hidden = 128,
                                   .num_experts = world, .topk = 2, .dtype = DEP_DTYPE_BF16};
  return attach_args(d, &a);
}

/*
 * A world is bounded by DEP_MAX_WORLD, not by one node's ranks: a world of
 * 65 over two nodes (33 on node 0, 32 on node 1) is ready on both, each
 * rank's reply carrying its node's slabs.  Before, no node lent an
 * exchange region above 64 ranks and each refused the other's MEMBERSHIP:
 * every rank failed with DEP_ERR_UNSUPPORTED ("lent no exchange region").
 * (check_bigworld.c runs the largest worlds, through the library.)
 */
START_TEST(a_world_above_64_ranks_across_nodes_is_ready_on_both) {
  enum { WORLD = DEP_MAX_LOCAL_RANKS + 1, ON1 = WORLD / 2, ON0 = WORLD - ON1 };
  struct nodes ns;
  nodes_start(&ns, 2, 120000);
  int fd[WORLD];
  for (uint32_t i = 0; i < ON1; i++)
    fd[ON0 + i] = attach_wide(&ns.d[1], "wide", ON0 + i, WORLD, i, ON1);
  for (uint32_t i = 0; i < ON0; i++)
    fd[i] = attach_wide(&ns.d[0], "wide", i, WORLD, i, ON0);
  for (uint32_t i = 0; i < WORLD; i++)
    expect_ready(fd[i], i < ON0 ? ON0 : ON1);
  for (uint32_t i = 0; i < WORLD; i++)
    close(fd[i]);
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

/*
 * A rank of a job that spans nodes, on a daemon with no peers: it attaches
 * (the memory is lent for its local ranks) but no node holds the others,
 * so every operation is DEP_ERR_UNSUPPORTED saying so, and nothing waits.
 */
START_TEST(a_job_spanning_nodes_on_a_daemon_without_peers_runs_no_operation) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  dep_client_t *c = cl_connect(d.sock);
  struct dep_attach_args a = {.size = sizeof a, .rank = 0, .world_size = 2, .local_rank = 0,
                              .local_world_size = 1,
                              .shape = {.max_tokens_per_rank = 4, .hidden = 128,
                                        .num_experts = 4, .topk = 2,
                                        .dtype = DEP_DTYPE_BF16}};
  snprintf(a.job_id, sizeof a.job_id, "lonely");
  ck_assert_msg(dep_attach(c, &a) == 0, "%s", dep_errmsg(c));
  int64_t idx[2] = {0, 3};
  int32_t tpr[2], tpe[4];
  uint8_t tir[2];
  struct dep_layout_args la = {.size = sizeof la, .topk_idx = idx, .index_type = DEP_INDEX_I64,
                               .num_tokens = 1, .tokens_per_rank = tpr,
                               .tokens_per_expert = tpe, .token_in_rank = tir};
  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(dep_layout(c, &la, NULL), DEP_ERR_UNSUPPORTED);
  ck_assert_int_lt(dw_now_ms() - t0, 1000);
  ck_assert_msg(strstr(dep_errmsg(c), "spans nodes") != NULL &&
                strstr(dep_errmsg(c), "no peers") != NULL, "%s", dep_errmsg(c));
  ck_assert_int_eq(dep_detach(c), 0);
  dep_client_free(c);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
}
END_TEST

Suite *multinode_suite(void);
Suite *multinode_suite(void) {
  Suite *s = suite_create("multinode");
  TCase *tc = tcase_create("codec");
  tcase_add_test(tc, membership_and_job_events_round_trip);
  tcase_add_test(tc, a_membership_with_bad_counts_is_refused_both_ways);
  suite_add_tcase(s, tc);
  tc = tcase_create("daemons");
  tcase_set_timeout(tc, 20);
  tcase_add_test(tc, a_two_node_job_of_1_plus_1_is_ready_on_both_nodes_and_a_late_peer_learns_it);
  tcase_add_test(tc, a_job_spanning_nodes_on_a_daemon_without_peers_runs_no_operation);
  tcase_add_test(tc, a_two_node_job_of_2_plus_2_is_ready_on_both_nodes);
  tcase_add_test(tc, a_node_whose_ranks_never_come_times_out_naming_them);
  tcase_add_test(tc, a_rank_claimed_on_both_nodes_fails_on_both);
  tcase_add_test(tc, a_shape_that_differs_across_nodes_fails_on_both);
  tcase_add_test(tc, a_daemon_killed_while_the_job_gathers_fails_it_at_once_then_a_new_job_works);
  tcase_add_test(tc, a_three_node_job_of_1_plus_1_plus_1_is_ready_on_every_node);
  tcase_add_test(tc, a_running_job_whose_remote_rank_disconnects_aborts_the_local_rank_naming_it);
  tcase_add_test(tc, a_running_job_whose_remote_daemon_is_killed_aborts_the_local_rank_naming_it);
  tcase_add_test(tc, a_daemon_stopped_cleanly_fails_a_gathering_job_and_aborts_a_running_one_elsewhere);
  tcase_add_test(tc, a_job_id_another_uid_takes_on_another_node_fails_nothing_and_names_no_owner);
  tcase_add_test(tc, a_world_above_64_ranks_across_nodes_is_ready_on_both);
  tcase_add_test(tc, a_failed_jobs_late_ranks_hear_it_at_once_and_the_job_started_again_runs);
  tcase_add_test(tc, a_remembered_failure_is_told_to_its_own_uids_late_ranks_only);
  tcase_add_test(tc, a_membership_refused_after_the_sender_holds_every_rank_fails_its_attach_cleanly);
  tcase_add_test(tc, a_first_rank_refused_by_a_limit_fails_the_job_on_every_node_at_once);
  tcase_add_test(tc, a_peer_flooding_memberships_is_refused_past_its_share_and_a_real_job_runs);
  suite_add_tcase(s, tc);
  return s;
}
