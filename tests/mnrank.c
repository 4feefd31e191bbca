/*
 * mnrank.c — raw-wire ranks of the multi-node suites (mnrank.h).
 */
#include "mnrank.h"

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

/* Global rank `rank` of job `id`, a world of `world` ranks, as local rank lr of lws. */
struct dep_attach_args job_args(const char *id, uint32_t rank, uint32_t world,
                                uint32_t lr, uint32_t lws) {
  struct dep_attach_args a = dw_job_args(id, lr, lws);
  a.rank = rank;
  a.world_size = world;
  if (world % 3 == 0)
    a.shape.num_experts = 12; /* a multiple of the world */
  return a;
}

/* ATTACH *a on a new connection to d: the connection. */
int attach_args(const struct tu_daemon *d, const struct dep_attach_args *a) {
  int fd = dw_client(d);
  dw_attach(fd, a, 7);
  return fd;
}

/* ATTACH global rank `rank` of a job of `world` ranks as local rank lr of lws on d. */
int attach_rank(const struct tu_daemon *d, const char *id, uint32_t rank, uint32_t world,
                uint32_t lr, uint32_t lws) {
  struct dep_attach_args a = job_args(id, rank, world, lr, lws);
  return attach_args(d, &a);
}

/* The ATTACH reply: SLAB frames (their fds closed), then ATTACH_OK for lws local ranks. */
void expect_ready(int fd, uint32_t lws) {
  struct dep_msg_attach_ok ok;
  dw_expect_attach_ok(fd, 7, &ok);
  ck_assert_uint_eq(ok.local_world_size, lws);
}

/* Rank `rank` of job `id`, a world of two, attaches on node `node` (its only
 * local rank); the other node of two says it has the job's MEMBERSHIP
 * within timeout_ms.  The connection. */
int attach_announced(const struct nodes *ns, int node, const char *id, uint32_t rank,
                     int timeout_ms) {
  int fd = attach_rank(&ns->d[node], id, rank, 2, 0, 1);
  char has[64];
  dw_sfmt(has, sizeof has, "job %s: node 127.0.0.1:", id);
  ck_assert(dw_log_has(&ns->d[1 - node], has, timeout_ms));
  return fd;
}

/* A job `id` of 1 + 1 ranks (rank 0 on node 0, rank 1 on node 1) is ready on both; then its
 * ranks leave. */
void expect_1_plus_1_runs(const struct nodes *ns, const char *id) {
  int a = attach_rank(&ns->d[0], id, 0, 2, 0, 1);
  int b = attach_rank(&ns->d[1], id, 1, 2, 0, 1);
  expect_ready(a, 1);
  expect_ready(b, 1);
  close(a);
  close(b);
}

/* An ERROR with this code whose message holds every needle (NULL-terminated). */
void expect_fail(int fd, int code, const char *needle, const char *needle2) {
  char msg[DEP_MSG_TEXT_MAX];
  dw_expect_error(fd, code, msg, sizeof msg);
  ck_assert_msg(strstr(msg, needle) != NULL, "\"%s\" not in: %s", needle, msg);
  ck_assert_msg(needle2 == NULL || strstr(msg, needle2) != NULL, "\"%s\" not in: %s", needle2,
                msg);
}

/*
 * In a child that became uid/gid 65534: ATTACH rank `rank` of job `id` of
 * `world` ranks (one local rank) on sock.  want < 0: expect that error, its
 * message holding `needle` and naming neither another uid nor a node (no
 * "uid 0", no address); want 0: expect no reply for 2 s (the job gathers,
 * not failed).  The exit status is 0 when so, else the step that went wrong.
 */
int attach_as_nobody(const char *sock, const char *id, uint32_t rank, uint32_t world,
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

/* Two nodes (attach_timeout_ms `timeout`) that any user may attach to,
 * node 1's socket open to uid 65534, started; false, with test skipped
 * saying why, unless root (a rank runs as uid 65534). */
bool nodes_start_for_nobody(struct nodes *ns, const char *test, int timeout) {
  if (geteuid() != 0) {
    tu_skip_part(test, "running a rank as uid 65534 needs root");
    return false;
  }
  nodes_config_with(ns, 2, timeout, "", "allow: {any_user: true}\n");
  nodes_start_all(ns);
  chmod(ns->d[1].dir, 0755); /* uid 65534 reaches node 1's socket */
  return true;
}

void expect_child_ok(pid_t pid, const char *what) {
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                "%s: uid 65534's rank failed at step %d of attach_as_nobody", what,
                WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}
