/*
 * check_multinode.c — multi-node jobs (daemon/job_members.c over daemon/peer.c,
 * DESIGN §7): the MEMBERSHIP / JOB_FAIL / JOB_END codec, then real daemons
 * on 127.0.0.1 with raw wire clients.  A job whose world spans two or
 * three daemons becomes ready on every node with no bootstrap of its own;
 * a node whose ranks never come, a rank claimed twice, a shape that
 * differs across nodes, a daemon killed while the job gathers: each fails
 * the job with an error that names the rank or node, and a new job works
 * after.  Once a job runs, a rank or a whole node that goes away is told
 * to the ranks left on the other nodes through the abort words of their
 * slabs.  A failed job's late ranks, refused memberships and a fake node
 * flooding memberships are check_multinode_fail.c's suite; the raw-wire
 * ranks both attach are mnrank.c's.
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

static pid_t fork_nobody(const char *sock, const char *id, uint32_t rank, uint32_t world,
                         int want, const char *needle) {
  fflush(stdout);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0)
    _exit(attach_as_nobody(sock, id, rank, world, want, needle));
  return pid;
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

/* ---- a world larger than one node holds ----------------------------------- */

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

/* ---- a daemon without peers ------------------------------------------------ */

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
  suite_add_tcase(s, tc);
  return s;
}
