/*
 * ranks.c — the peer benchmark's rank processes: each is forked once into
 * its node's network namespace and then runs one attach per round, as
 * bench/attach's do: connect, dep_attach (which returns when every rank of
 * the job, on every node, has attached), check the slabs are mapped, report
 * the time, then (once every rank is ready) the attach's parts, hold the job
 * until the parent says, detach.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../benchlib.h"
#include "peers.h"

/* Read exactly len bytes; false at EOF or on an error. */
static bool read_all(int fd, void *buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    ssize_t n = read(fd, (char *)buf + got, len - got);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return false;
    got += (size_t)n;
  }
  return true;
}

/* In the rank process: one round. */
static void rank_round(const struct rank_cmd *cmd, int in, int out) {
  dep_client_t *c;
  if (dep_client_new(&c) != 0)
    _exit(1);
  struct dep_attach_args a = {.size = sizeof a, .rank = cmd->rank, .world_size = cmd->world_size,
                              .local_rank = cmd->local_rank,
                              .local_world_size = cmd->local_world_size, .shape = cmd->shape};
  snprintf(a.job_id, sizeof a.job_id, "%s", cmd->job_id);
  int rc = dep_connect(c, cmd->sock);
  if (rc == 0)
    rc = dep_attach(c, &a);
  if (rc != 0) {
    fprintf(stderr, "peers: rank %u of job %s: attach failed: %s (%s)\n", cmd->rank,
            cmd->job_id, dep_errmsg(c), dep_strerror(rc));
    _exit(1);
  }
  double now = bench_now_ms();
  /* Ready: every local slab is mapped (a missing pointer would be a lazy map). */
  struct dep_attach_info info = {.size = sizeof info};
  if (dep_attach_info(c, &info) != 0)
    _exit(1);
  for (uint32_t i = 0; i < info.local_world_size; i++)
    if (info.slabs[i] == NULL)
      _exit(1);
  /* The attach's parts once every rank is ready: dep_attach_times finishes the host
   * warm-up, which runs after dep_attach returns (client/warm.h), and would take the
   * CPU from the ranks still attaching. */
  char go;
  struct dep_attach_times tm = {.size = sizeof tm};
  if (write(out, &now, sizeof now) != sizeof now || !read_all(in, &go, 1) ||
      dep_attach_times(c, &tm) != 0)
    _exit(1);
  struct rank_time t = {now, tm.total_ms, tm.wait_ms, tm.map_ms};
  if (write(out, &t, sizeof t) != sizeof t || !read_all(in, &go, 1)) /* hold the job */
    _exit(1);
  dep_detach(c);
  dep_client_free(c);
  if (write(out, "x", 1) != 1)
    _exit(1);
}

void rank_spawn(struct rank_proc *rp, const char *ns) {
  int to[2], from[2];
  char path[64];
  snprintf(path, sizeof path, "/run/netns/%s", ns);
  if (pipe2(to, O_CLOEXEC) != 0 || pipe2(from, O_CLOEXEC) != 0)
    die("pipe: %s", strerror(errno));
  fflush(stdout);
  rp->pid = fork();
  if (rp->pid < 0)
    die("fork: %s", strerror(errno));
  if (rp->pid == 0) {
    /* Its pipes on stdin and stdout, and nothing else of the parent's: a
     * rank holding another rank's pipe would keep it from seeing the end. */
    dup2(to[0], STDIN_FILENO);
    dup2(from[1], STDOUT_FILENO);
    close_range(3, ~0u, 0);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
      fprintf(stderr, "peers: a rank cannot enter %s: %s\n", path, strerror(errno));
      _exit(1);
    }
    close(fd);
    struct rank_cmd cmd;
    while (read_all(STDIN_FILENO, &cmd, sizeof cmd))
      rank_round(&cmd, STDIN_FILENO, STDOUT_FILENO);
    _exit(0);
  }
  close(to[0]);
  close(from[1]);
  rp->to = to[1];
  rp->from = from[0];
}

double ranks_round(struct rank_proc *const *rp, const struct rank_cmd *cmd, int n,
                   struct rank_time *t, double *detach_ms) {
  double t0 = bench_now_ms(), last = t0;
  for (int i = 0; i < n; i++)
    if (write(rp[i]->to, &cmd[i], sizeof cmd[i]) != (ssize_t)sizeof cmd[i])
      die("cannot release a rank");
  for (int i = 0; i < n; i++) {
    double ready = 0;
    if (!read_all(rp[i]->from, &ready, sizeof ready))
      die("rank %u of job %s died before it was ready", cmd[i].rank, cmd[i].job_id);
    last = ready > last ? ready : last;
  }
  for (int i = 0; i < n; i++)
    if (write(rp[i]->to, "t", 1) != 1)
      die("cannot ask a rank for its attach's parts");
  for (int i = 0; i < n; i++) {
    if (!read_all(rp[i]->from, &t[i], sizeof t[i]))
      die("rank %u of job %s died after it was ready", cmd[i].rank, cmd[i].job_id);
    t[i].ready_ms -= t0; /* the rank sent its clock: from the release */
  }
  double td = bench_now_ms();
  for (int i = 0; i < n; i++)
    if (write(rp[i]->to, "d", 1) != 1)
      die("cannot tell a rank to detach");
  for (int i = 0; i < n; i++) {
    char x;
    if (!read_all(rp[i]->from, &x, 1))
      die("rank %u of job %s died while detaching", cmd[i].rank, cmd[i].job_id);
  }
  *detach_ms = bench_now_ms() - td;
  return last - t0;
}

void rank_stop(struct rank_proc *rp) {
  close(rp->to);
  int st;
  waitpid(rp->pid, &st, 0);
  close(rp->from);
}
