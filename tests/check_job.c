/*
 * check_job.c — the daemon's job table as ranks meet in it: the ATTACH
 * rendezvous (nobody hears back until every local rank of the job has
 * come), the conflicts a job refuses (another shape, a rank taken twice,
 * a job already running), the attach timeout, and DETACH and closes that
 * remove ranks and then the job; and the pool block a job's arena is lent
 * as (one fd of exactly the arena's size, the same block again for the next
 * job of the shape, never one another uid used).  Every test starts the
 * real deepepd and speaks the protocol on raw sockets (daemonwire.h),
 * checking the slabs and fds of the reply itself rather than trusting the
 * client library.
 */
#include <check.h>
#include <grp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "memranks.h"
#include "proto.h"
#include "slab.h"
#include "testutil.h"

/* Wait (up to 3 s) for the job to disappear from STATUS: closes are asynchronous. */
static bool job_gone(int fd, const char *id) {
  for (int i = 0; i < 300; i++) {
    if (!dw_job_listed(fd, id, NULL, NULL))
      return true;
    dw_sleep_ms(10);
  }
  return false;
}

/* Wait (up to 3 s) until STATUS shows n ranks of the job attached. */
static bool wait_attached(int fd, const char *id, uint32_t n) {
  for (int i = 0; i < 300; i++) {
    uint32_t at = 0;
    if (dw_job_listed(fd, id, &at, NULL) && at == n)
      return true;
    dw_sleep_ms(10);
  }
  return false;
}

/* The arena a one-node job of a's shape is lent: its slabs 64 KiB apart, to the page. */
static uint64_t arena_of(const struct dep_attach_args *a) {
  struct dep_slab_layout l;
  char why[256];
  ck_assert_msg(dep__slab_layout(&a->shape, a->world_size, &l, why, sizeof why) == 0, "%s", why);
  uint64_t stride = dep_round_up(l.total_bytes, 64 * 1024);
  return dep_round_up(a->local_world_size * stride, (uint64_t)sysconf(_SC_PAGESIZE));
}

/* The same for dw_job_args' shape with lws local ranks. */
static uint64_t arena_bytes(uint32_t lws) {
  struct dep_attach_args a = dw_job_args("any", 0, lws);
  return arena_of(&a);
}

/*
 * A SLAB frame answering request req, decoded into *m, with its fds (as
 * many as it names chunks, each a file of exactly chunk_bytes) in fds.
 */
static void recv_slab(int fd, uint32_t req, struct dep_msg_slab *m, int fds[DEP_PROTO_MAX_FDS]) {
  int nfds = 0;
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame_fds(fd, f, 5000, fds, &nfds), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "SLAB");
  ck_assert_uint_eq(f->h.request_id, req);
  ck_assert_int_eq(proto_decode_slab(f->body, f->h.body_len, m), 0);
  ck_assert_int_eq(nfds, (int)m->n_chunks);
  for (int i = 0; i < nfds; i++) {
    struct stat sb;
    ck_assert_int_eq(fstat(fds[i], &sb), 0);
    ck_assert_uint_eq((uint64_t)sb.st_size, m->chunk_bytes);
  }
  free(f);
}

/*
 * The ATTACH reply: a SLAB frame (one arena per device: on the host backend
 * one, holding every slab) whose one fd is one block of exactly the arena's
 * size, not a run of pool.chunk_size blocks, then ATTACH_OK.  With block
 * NULL the block's fd is closed and -1 returned; else its fstat goes to
 * *block and the fd is returned, for the caller to close.
 */
static int expect_attach_ok(int fd, uint32_t req, uint32_t lws, struct stat *block) {
  bool seen[DEP_MAX_LOCAL_RANKS] = {false};
  int fds[DEP_PROTO_MAX_FDS];
  struct dep_msg_slab m;
  recv_slab(fd, req, &m, fds);
  ck_assert_uint_eq(m.n_ranks, lws);
  ck_assert_uint_eq(m.n_chunks, 1);
  ck_assert_uint_eq(m.chunk_bytes, arena_bytes(lws));
  for (uint32_t i = 0; i < m.n_ranks; i++) {
    ck_assert_uint_lt(m.ranks[i].local_rank, lws);
    ck_assert(!seen[m.ranks[i].local_rank]);
    seen[m.ranks[i].local_rank] = true;
    ck_assert_uint_lt(m.ranks[i].offset, m.chunk_bytes);
  }
  int kept = -1;
  if (block != NULL) {
    ck_assert_int_eq(fstat(fds[0], block), 0);
    kept = fds[0];
  } else {
    close(fds[0]);
  }
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "ATTACH_OK");
  ck_assert_uint_eq(f->h.request_id, req);
  struct dep_msg_attach_ok ok;
  ck_assert_int_eq(proto_decode_attach_ok(f->body, f->h.body_len, &ok), 0);
  ck_assert_uint_eq(ok.local_world_size, lws);
  ck_assert_uint_eq(ok.num_fds, 0);
  ck_assert_str_eq(ok.backend, "host");
  ck_assert_uint_eq(ok.op_timeout_ms, 10000); /* limits.op_timeout_ms, default */
  free(f);
  return kept;
}

static bool same_file(const struct stat *a, const struct stat *b) {
  return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

START_TEST(test_attach_rendezvous) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int obs = dw_client(&d);
  int fds[4];
  for (uint32_t i = 0; i < 4; i++)
    fds[i] = dw_client(&d);
  for (uint32_t i = 0; i < 3; i++) {
    struct dep_attach_args a = dw_job_args("train-1", i, 4);
    dw_attach(fds[i], &a, 20 + i);
  }
  /* Three of four: nobody hears anything yet. */
  for (uint32_t i = 0; i < 3; i++)
    dw_expect_silence(fds[i], 150);
  uint32_t at = 0, ex = 0;
  ck_assert(dw_job_listed(obs, "train-1", &at, &ex));
  ck_assert_uint_eq(at, 3);
  ck_assert_uint_eq(ex, 4);
  struct dep_attach_args a = dw_job_args("train-1", 3, 4);
  dw_attach(fds[3], &a, 23);
  /* Every rank is sent the same block: the job's one arena. */
  struct stat blk[4];
  for (uint32_t i = 0; i < 4; i++) {
    close(expect_attach_ok(fds[i], 20 + i, 4, &blk[i]));
    ck_assert(same_file(&blk[i], &blk[0]));
  }
  ck_assert(dw_job_listed(obs, "train-1", &at, &ex));
  ck_assert_uint_eq(at, 4);
  ck_assert_uint_eq(ex, 4);
  /* A running job takes no newcomers; a connection attaches once. */
  int late = dw_client(&d);
  dw_attach(late, &a, 30);
  dw_expect_error(late, DEP_ERR_STATE, NULL, 0);
  struct dep_attach_args other = dw_job_args("train-2", 0, 2);
  dw_attach(fds[0], &other, 31);
  dw_expect_error(fds[0], DEP_ERR_STATE, NULL, 0);
  /* DETACH frees the rank; closing the rest removes the job. */
  ck_assert_int_eq(dw_send_frame(fds[0], DEP_MSG_DETACH, 32, NULL), 0);
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fds[0], f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "DETACH_OK");
  free(f);
  ck_assert(dw_job_listed(obs, "train-1", &at, NULL));
  ck_assert_uint_eq(at, 3);
  for (uint32_t i = 1; i < 4; i++)
    close(fds[i]);
  ck_assert(job_gone(obs, "train-1"));
  ck_assert(dw_log_has(&d, "job train-1: removed (no ranks left)", 3000));
  close(fds[0]);
  close(late);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

/*
 * Every way a joining rank can be refused (another shape, another world,
 * a local or global rank taken, a field out of range, a device the daemon
 * does not serve) refuses it and fails the job at once for the rank that
 * waits in it, with the reason naming the refused rank (DESIGN §5): never
 * a wait until limits.attach_timeout_ms.
 */
START_TEST(test_attach_conflicts) {
  struct tu_daemon d;
  dw_start(&d, NULL); /* attach_timeout_ms 30000: a wait for it would fail the test's timeout */
  int obs = dw_client(&d);
  char msg[DEP_MSG_TEXT_MAX];
  struct {
    const char *what;
    int code;
    const char *says;
  } cases[] = {
      {"hidden", DEP_ERR_MISMATCH, "hidden 2048"},
      {"max_ll_tokens_per_rank", DEP_ERR_MISMATCH, "max_ll_tokens_per_rank"},
      {"world_size", DEP_ERR_MISMATCH, "world_size 8"},
      {"local rank", DEP_ERR_EXISTS, "local rank 0 of job job-c is already attached by pid"},
      {"rank", DEP_ERR_EXISTS, "rank 0 of job job-c is already attached"},
      {"range", DEP_ERR_INVALID, "5 is out of range"},
      {"device", DEP_ERR_NOT_FOUND, "device"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int r0 = dw_client(&d), x = dw_client(&d);
    struct dep_attach_args a = dw_job_args("job-c", 0, 4);
    dw_attach(r0, &a, 1);
    ck_assert(wait_attached(obs, "job-c", 1));
    struct dep_attach_args b = dw_job_args("job-c", 1, 4);
    if (i == 0)
      b.shape.hidden = 2048;
    else if (i == 1)
      b.shape.max_ll_tokens_per_rank = 1;
    else if (i == 2)
      b = dw_job_args("job-c", 1, 8), b.world_size = 8;
    else if (i == 3)
      b = dw_job_args("job-c", 0, 4);
    else if (i == 4)
      b = dw_job_args("job-c", 2, 4), b.rank = 0;
    else if (i == 5)
      b = dw_job_args("job-c", 5, 4);
    else
      memset(b.device_uuid, 0x5a, sizeof b.device_uuid);
    int64_t t0 = dw_now_ms();
    dw_attach(x, &b, 2);
    dw_expect_error(x, cases[i].code, msg, sizeof msg);
    ck_assert_msg(strstr(msg, cases[i].says) != NULL, "%s: the refused rank was told: %s",
                  cases[i].what, msg);
    /* The waiting rank learns at once, with the same code and the reason. */
    dw_expect_error(r0, cases[i].code, msg, sizeof msg);
    ck_assert_msg(strstr(msg, "job job-c cannot start") && strstr(msg, "was refused") &&
                      strstr(msg, cases[i].says),
                  "%s: the waiting rank was told: %s", cases[i].what, msg);
    ck_assert_int_lt(dw_now_ms() - t0, 5000);
    ck_assert(job_gone(obs, "job-c"));
    close(x);
    close(r0);
  }
  /* A rank that leaves while others wait (no refusal) frees its slot for a successor. */
  int r0 = dw_client(&d), x = dw_client(&d);
  struct dep_attach_args a = dw_job_args("job-c", 0, 4);
  dw_attach(r0, &a, 1);
  struct dep_attach_args b = dw_job_args("job-c", 1, 4);
  dw_attach(x, &b, 7);
  ck_assert(wait_attached(obs, "job-c", 2));
  close(x);
  ck_assert(wait_attached(obs, "job-c", 1));
  int y = dw_client(&d);
  dw_attach(y, &b, 8);
  ck_assert(wait_attached(obs, "job-c", 2));
  dw_expect_silence(y, 50);
  dw_expect_silence(r0, 50);
  /* Another uid's refusal could not fail this job: it is told the id is taken (check_daemon). */
  close(y);
  close(r0);
  ck_assert(job_gone(obs, "job-c"));
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

/*
 * limits.max_jobs_per_uid: one user cannot fill limits.max_jobs (nor squat
 * every job id) — a job still gathering its ranks counts; past the bound
 * that user is refused with DEP_ERR_LIMIT naming the key, while another
 * user still starts jobs, and an ended job frees its place.
 */
START_TEST(test_jobs_per_uid_are_bounded) {
  struct tu_daemon d;
  dw_start(&d, "allow:\n  any_user: true\nlimits:\n  max_jobs_per_uid: 2\n");
  int obs = dw_client(&d);
  int r[3];
  char msg[DEP_MSG_TEXT_MAX];
  for (int i = 0; i < 3; i++) {
    char id[32];
    snprintf(id, sizeof id, "mine-%d", i);
    struct dep_attach_args a = dw_job_args(id, 0, 2);
    r[i] = dw_client(&d);
    dw_attach(r[i], &a, 1);
  }
  ck_assert(wait_attached(obs, "mine-0", 1));
  ck_assert(wait_attached(obs, "mine-1", 1));
  dw_expect_error(r[2], DEP_ERR_LIMIT, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "limits.max_jobs_per_uid") != NULL, "said: %s", msg);
  ck_assert(!dw_job_listed(obs, "mine-2", NULL, NULL));
  if (geteuid() == 0) {
    /* Another uid is not held back by this one's jobs. */
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
      if (setgroups(0, NULL) != 0 || setgid(MR_NOBODY) != 0 || setuid(MR_NOBODY) != 0)
        _exit(10);
      int fd = dw_client(&d);
      struct dep_attach_args a = dw_job_args("theirs", 0, 2);
      dw_attach(fd, &a, 1);
      dw_expect_silence(fd, 300); /* waiting for its second rank, not refused */
      _exit(0);
    }
    int st = 0;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "uid %d's job: status %#x", MR_NOBODY,
                  st);
  } else {
    tu_skip_part(__func__, "the other-uid part needs root to become uid %d", MR_NOBODY);
  }
  /* An ended job frees its place. */
  close(r[0]);
  ck_assert(job_gone(obs, "mine-0"));
  struct dep_attach_args a = dw_job_args("mine-2", 0, 2);
  dw_attach(r[2], &a, 2);
  ck_assert(wait_attached(obs, "mine-2", 1));
  close(r[1]);
  close(r[2]);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_attach_timeout) {
  struct tu_daemon d;
  dw_start(&d, "limits:\n  attach_timeout_ms: 300\n");
  int r0 = dw_client(&d), r1 = dw_client(&d), obs = dw_client(&d);
  struct dep_attach_args a = dw_job_args("slow-job", 0, 4);
  dw_attach(r0, &a, 1);
  a = dw_job_args("slow-job", 1, 4);
  dw_attach(r1, &a, 2);
  int64_t t0 = dw_now_ms();
  char msg[DEP_MSG_TEXT_MAX];
  dw_expect_error(r0, DEP_ERR_TIMEOUT, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "2 of 4 local ranks attached after 300 ms; missing local ranks 2,3"),
                "said: %s", msg);
  dw_expect_error(r1, DEP_ERR_TIMEOUT, NULL, 0);
  ck_assert_int_lt(dw_now_ms() - t0, 2000);
  ck_assert(!dw_job_listed(obs, "slow-job", NULL, NULL));
  /* The connections stay usable: the job can be tried again. */
  a = dw_job_args("slow-job", 0, 1);
  dw_attach(r0, &a, 3);
  expect_attach_ok(r0, 3, 1, NULL);
  close(r0);
  close(r1);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

/* The daemon's open fds, once only obs (and the daemon's own) remain connected. */
static int fds_when_alone(const struct tu_daemon *d, int obs) {
  for (int i = 0; i < 300; i++) {
    struct dep_status *st = dw_status(obs);
    uint32_t clients = st->num_clients;
    dep_status_free(st);
    if (clients == 1)
      break;
    dw_sleep_ms(10);
  }
  /* The daemon closes a connection's fd at the end of the loop turn that counted it gone. */
  dw_sleep_ms(50);
  return mr_daemon_fds(d->pid);
}

/* A job of lws ranks of dw_job_args' shape attaches; the block it was lent (its fd open). */
static int run_job(const struct tu_daemon *d, const char *id, uint32_t lws, struct stat *block) {
  int fds[DEP_MAX_LOCAL_RANKS], kept = -1;
  for (uint32_t i = 0; i < lws; i++) {
    fds[i] = dw_client(d);
    struct dep_attach_args a = dw_job_args(id, i, lws);
    dw_attach(fds[i], &a, 1);
  }
  for (uint32_t i = 0; i < lws; i++) {
    struct stat sb;
    int fd = expect_attach_ok(fds[i], 1, lws, &sb);
    if (i == 0) {
      *block = sb;
      kept = fd;
    } else {
      ck_assert(same_file(&sb, block));
      close(fd);
    }
  }
  for (uint32_t i = 0; i < lws; i++)
    close(fds[i]);
  return kept;
}

/* The warm path: the next job of a shape and uid is lent the very block the last one had. */
START_TEST(test_next_job_of_a_shape_gets_the_same_block) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int obs = dw_client(&d);
  struct stat first, second;
  close(run_job(&d, "first", 2, &first));
  ck_assert(job_gone(obs, "first"));
  ck_assert(dw_log_has(&d, "made a block of", 3000)); /* the first job of the shape pays */
  int fds0 = fds_when_alone(&d, obs);
  close(run_job(&d, "second", 2, &second));
  ck_assert(job_gone(obs, "second"));
  ck_assert_msg(same_file(&first, &second), "the second job got another block (inode %lu, "
                "the first's %lu)", (unsigned long)second.st_ino, (unsigned long)first.st_ino);
  /* No block was made for it: the daemon holds no new fd. */
  ck_assert_int_eq(fds_when_alone(&d, obs), fds0);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

/* Uid 65534 runs a one-rank job; 0 when the block it is lent is not `other` (another inode). */
static int nobody_gets_another_block(const char *sock, const struct stat *other) {
  if (setgroups(0, NULL) != 0 || setgid(MR_NOBODY) != 0 || setuid(MR_NOBODY) != 0)
    return 10;
  int fd = tu_connect_raw(sock);
  if (fd < 0)
    return 11;
  dw_hello_as(fd, DEP_PROTO_VERSION);
  dw_expect_hello_ok(fd);
  struct dep_attach_args a = dw_job_args("theirs", 0, 1);
  dw_attach(fd, &a, 2);
  struct stat sb;
  int blk = expect_attach_ok(fd, 2, 1, &sb);
  close(blk);
  close(fd);
  if (sb.st_size != other->st_size)
    return 12; /* not the case this test sets up */
  return same_file(&sb, other) ? 13 : 0;
}

/*
 * With the cache off, a job's block goes back free, and it is of exactly
 * the size the next job of the shape needs; yet a job of another uid never
 * gets it, since a rank of the old job may still map it: it gets a fresh
 * block.  The test keeps the old block's fd open so that its inode cannot
 * be reused.
 */
START_TEST(test_another_uid_never_gets_a_block_another_uid_used) {
  if (getuid() != 0) {
    tu_skip(__func__, "needs root to run a rank as uid %d", MR_NOBODY);
    return;
  }
  struct tu_daemon d;
  dw_start(&d, MR_ALLOW_NOBODY "buffer_cache_enabled: false\n");
  int obs = dw_client(&d);
  struct stat mine;
  int kept = run_job(&d, "mine", 1, &mine);
  ck_assert(job_gone(obs, "mine"));
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0)
    _exit(nobody_gets_another_block(d.sock, &mine));
  int st = 0;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "uid %d's job: wait status %#x (13: it "
                "was lent root's old block)", MR_NOBODY, st);
  /* Root's own next job still finds a block: the old one went, a fresh one is made. */
  struct stat again;
  close(run_job(&d, "mine-again", 1, &again));
  close(kept);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

/* How the daemon split one arena: its SLAB frame's word, checked against the fds. */
struct split {
  uint32_t n_chunks;
  uint64_t chunk_bytes;
};

/*
 * One rank's ATTACH reply: a SLAB frame whose n_chunks fds are each a file
 * of exactly chunk_bytes (closed here), then ATTACH_OK.
 */
static struct split expect_split(int fd, uint32_t req) {
  int fds[DEP_PROTO_MAX_FDS];
  struct dep_msg_slab m;
  recv_slab(fd, req, &m, fds);
  for (uint32_t i = 0; i < m.n_chunks; i++)
    close(fds[i]);
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "ATTACH_OK");
  ck_assert_uint_eq(f->h.request_id, req);
  free(f);
  return (struct split){.n_chunks = m.n_chunks, .chunk_bytes = m.chunk_bytes};
}

/*
 * Attach every local rank of a one-node job of shape a on its own
 * connection (conns[lws]), and return how its arena came: the same split
 * on every rank's SLAB frame.
 */
static struct split attach_job(const struct tu_daemon *d, struct dep_attach_args a, int *conns) {
  for (uint32_t i = 0; i < a.local_world_size; i++) {
    conns[i] = dw_client(d);
    a.rank = a.local_rank = i;
    dw_attach(conns[i], &a, 40 + i);
  }
  struct split first = expect_split(conns[0], 40);
  for (uint32_t i = 1; i < a.local_world_size; i++) {
    struct split s = expect_split(conns[i], 40 + i);
    ck_assert_uint_eq(s.n_chunks, first.n_chunks);
    ck_assert_uint_eq(s.chunk_bytes, first.chunk_bytes);
  }
  return first;
}

/* DETACH every rank, close them, and see the job gone from STATUS.  The bounds are ceilings
 * against a hang, not timings: a detach of a 1 GiB host arena under ThreadSanitizer took past
 * 5 s (the case's own timeout bounds it first in a plain build). */
static void detach_job(int obs, const char *id, const int *conns, uint32_t lws) {
  struct dw_frame *f = dw_frame_new();
  for (uint32_t i = 0; i < lws; i++) {
    ck_assert_int_eq(dw_send_frame(conns[i], DEP_MSG_DETACH, 60 + i, NULL), 0);
    ck_assert_int_eq(dw_recv_frame(conns[i], f, 120000), 0);
    ck_assert_str_eq(proto_type_name(f->h.type), "DETACH_OK");
    close(conns[i]);
  }
  free(f);
  bool gone = false;
  for (int i = 0; i < 3000 && !gone; i++) {
    gone = !dw_job_listed(obs, id, NULL, NULL);
    if (!gone)
      dw_sleep_ms(10);
  }
  ck_assert_msg(gone, "job %s still listed after every rank detached", id);
}

/* Rewrite d's file as a host daemon with these pool lines, and RELOAD it over obs. */
static void reload_host_pool(const struct tu_daemon *d, int obs, const char *pool,
                             struct dep_msg_reload_ok *m) {
  char yaml[1024];
  dw_sfmt(yaml, sizeof yaml, "socket:\n  path: %s\n  mode: 0666\nbackend: host\n%s", d->sock,
          pool);
  ck_assert_int_eq(tu_write_file(d->conf, yaml), 0);
  dw_reload(obs, 2, m);
}

/*
 * pool.max_allocation is live: after a RELOAD that raises it, the next
 * job's arena comes in one piece where the old value would have split it.
 * On the host backend a set value holds for every arena (one memfd a piece).
 */
START_TEST(test_reload_of_max_allocation_splits_the_next_arena_anew) {
  const uint64_t mib = 1024 * 1024, cap = 4 * mib;
  static const char pool_fmt[] = "pool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n"
                                 "  max_allocation: %s\npreallocation: false\n";
  char yaml[1024];
  dw_sfmt(yaml, sizeof yaml, pool_fmt, "4MiB");
  struct tu_daemon d;
  dw_start(&d, yaml);
  int obs = dw_client(&d);
  int conns[8];

  /* Eight ranks of the fixed shape: an arena of several times the cap. */
  struct dep_attach_args wide = dw_job_args("split-by-4MiB", 0, 8);
  const uint64_t wide_arena = arena_of(&wide);
  ck_assert_uint_gt(wide_arena, 2 * cap);
  struct split s = attach_job(&d, wide, conns);
  ck_assert_msg(s.n_chunks > 1, "an arena of %llu bytes came in one piece under a 4 MiB cap",
                (unsigned long long)wide_arena);
  ck_assert_uint_le(s.chunk_bytes, cap);
  ck_assert_uint_ge((uint64_t)s.n_chunks * s.chunk_bytes, wide_arena);
  detach_job(obs, wide.job_id, conns, 8);

  /* Raise the cap over RELOAD: applied, and nothing waits for a restart. */
  char pool[256];
  dw_sfmt(pool, sizeof pool, pool_fmt, "64MiB");
  struct dep_msg_reload_ok m;
  reload_host_pool(&d, obs, pool, &m);
  ck_assert_msg(strstr(m.message, "applied") != NULL &&
                    strstr(m.message, "nothing needs a restart") != NULL, "RELOAD_OK said: %s",
                m.message);

  /* A job of another shape (no cached arena to fall back on), over the
   * old cap and under the new one: one piece. */
  struct dep_attach_args tall = dw_job_args("whole-under-64MiB", 0, 4);
  tall.shape.hidden = 2048;
  const uint64_t tall_arena = arena_of(&tall);
  ck_assert_uint_gt(tall_arena, cap);
  s = attach_job(&d, tall, conns);
  ck_assert_msg(s.n_chunks == 1, "an arena of %llu bytes came in %u pieces after the cap was "
                "raised to 64 MiB: the reload did not reach it",
                (unsigned long long)tall_arena, s.n_chunks);
  ck_assert_uint_eq(s.chunk_bytes, tall_arena);
  detach_job(obs, tall.job_id, conns, 4);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

/*
 * pool.max_allocation's default, 0, lets the daemon choose: on the host an
 * arena is then one allocation whatever its size (pieces help no driver
 * there and cost every rank an fd and an mmap); once the key is set, over
 * RELOAD, it cuts the next host arena too.
 */
START_TEST(test_max_allocation_0_keeps_host_arenas_whole_and_a_set_value_cuts_them) {
  const uint64_t mib = 1024 * 1024;
  static const char pool_fmt[] = "pool:\n  host_size: 1GiB\n  chunk_size: 2MiB\n%s"
                                 "preallocation: false\n";
  char yaml[1024], pool[256];
  dw_sfmt(yaml, sizeof yaml, pool_fmt, "");
  struct tu_daemon d;
  dw_start(&d, yaml);
  int obs = dw_client(&d);
  int conns[2];
  /* Two ranks of 32768 tokens: an arena over the 480 MiB a cuda arena that
   * peer GPUs map would be cut at. */
  struct dep_attach_args big = dw_job_args("whole-by-default", 0, 2);
  big.shape.max_tokens_per_rank = 32768;
  const uint64_t big_arena = arena_of(&big);
  ck_assert_uint_gt(big_arena, 480 * mib);
  struct split s = attach_job(&d, big, conns);
  ck_assert_msg(s.n_chunks == 1 && s.chunk_bytes == big_arena,
                "a host arena of %llu bytes came in %u pieces of %llu with the key unset",
                (unsigned long long)big_arena, s.n_chunks, (unsigned long long)s.chunk_bytes);
  detach_job(obs, big.job_id, conns, 2);

  dw_sfmt(pool, sizeof pool, pool_fmt, "  max_allocation: 480MiB\n");
  struct dep_msg_reload_ok m;
  reload_host_pool(&d, obs, pool, &m);
  ck_assert_msg(strstr(m.message, "applied") != NULL, "RELOAD_OK said: %s", m.message);
  struct dep_attach_args cut = big;
  dw_sfmt(cut.job_id, sizeof cut.job_id, "%s", "cut-at-480MiB");
  cut.shape.max_tokens_per_rank = 32704; /* another shape: nothing cached to fall back on */
  const uint64_t cut_arena = arena_of(&cut);
  s = attach_job(&d, cut, conns);
  ck_assert_msg(s.n_chunks == 2 && s.chunk_bytes <= 480 * mib &&
                    (uint64_t)s.n_chunks * s.chunk_bytes >= cut_arena,
                "a host arena of %llu bytes under a 480 MiB cap came in %u pieces of %llu",
                (unsigned long long)cut_arena, s.n_chunks, (unsigned long long)s.chunk_bytes);
  detach_job(obs, cut.job_id, conns, 2);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

Suite *job_suite(void);
Suite *job_suite(void) {
  Suite *s = suite_create("job");
  TCase *tc = tcase_create("attach");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_attach_rendezvous);
  tcase_add_test(tc, test_attach_conflicts);
  tcase_add_test(tc, test_jobs_per_uid_are_bounded);
  tcase_add_test(tc, test_attach_timeout);
  suite_add_tcase(s, tc);
  tc = tcase_create("blocks");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_next_job_of_a_shape_gets_the_same_block);
  tcase_add_test(tc, test_another_uid_never_gets_a_block_another_uid_used);
  tcase_add_test(tc, test_reload_of_max_allocation_splits_the_next_arena_anew);
  tcase_add_test(tc, test_max_allocation_0_keeps_host_arenas_whole_and_a_set_value_cuts_them);
  suite_add_tcase(s, tc);
  return s;
}
