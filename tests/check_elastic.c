/*
 * check_elastic.c — elastic jobs, the daemon's side (daemon/job_elastic.c,
 * DESIGN §14): real daemons, real rank processes (forked, each on its own
 * connection, killed with SIGKILL), and this test process as rank 0 with
 * its node's arena mapped, so that it reads every local rank's live mask
 * and abort words as the operations do.  A rank of an elastic job that dies
 * or detaches is masked in every survivor's slab with a new epoch, on its
 * node and on the others, and nobody is aborted; a lost node masks its
 * ranks; deepepctl status shows the epoch, the mask and the history.  A job
 * that is not elastic still aborts its survivors; ranks that disagree on
 * the flag are refused, on one node or across two.
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

#include "daemonwire.h"
#include "deepep.h"
#include "mnrank.h"
#include "nodes.h"
#include "peer_proto.h"
#include "proto.h"
#include "slab.h"
#include "testutil.h"

/* How long a survivor's mask may take to change: the daemon's loop notices a
 * closed connection (or a peer's JOB_MASK) within milliseconds; 5 s is a
 * ceiling for a loaded CI machine, not an expectation. */
#define MASK_WAIT_MS 5000

/* ---- JOB_MASK, the peers' word for it ----------------------------------------- */

/* m encoded, decoded into out (which the caller compares), and every truncation of it refused;
 * b is left holding the encoding, for the caller's forgeries (then proto_buf_free). */
static void peer_round_trip(const struct dep_peer_msg *m, struct dep_peer_msg *out,
                            struct proto_buf *b) {
  char why[256];
  proto_buf_init(b);
  ck_assert_int_eq(peer_proto_encode(b, m), 0);
  for (size_t n = 0; n < b->len; n++)
    ck_assert_int_ne(peer_proto_decode(b->data, n, out, NULL, 0), 0);
  ck_assert_int_eq(peer_proto_decode(b->data, b->len, out, why, sizeof why), 0);
}

START_TEST(job_mask_round_trips_and_only_a_masking_change_is_taken) {
  struct dep_peer_msg m = {.type = DEP_PEER_JOB_MASK}, out;
  const struct dep_peer_job_mask good[] = {
      {.job_id = "train-7", .owner_uid = 1000, .rank = 5, .gen = 3, .why = DEP_SLAB_GONE_NODE,
       .epoch = 9},
      /* A rank back (peer protocol 8): an even count with its join call. */
      {.job_id = "train-7", .owner_uid = 1000, .rank = 5, .gen = 4,
       .why = DEP_JOB_EVENT_REJOINED, .epoch = 10, .join = 77},
  };
  struct proto_buf b;
  char why[256];
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    m.u.mask = good[i];
    peer_round_trip(&m, &out, &b);
    ck_assert_mem_eq(&out.u.mask, &m.u.mask, sizeof m.u.mask);
    proto_buf_free(&b);
  }
  /* An even count without its join call (or with a reason that is no return), an odd one
   * with a join call, a reason that is no leave, a rank past every world: refused by both
   * ends. */
  const struct dep_peer_job_mask bad[] = {
      {.job_id = "j", .rank = 1, .gen = 2, .why = DEP_SLAB_GONE_DIED},
      {.job_id = "j", .rank = 1, .gen = 2, .why = DEP_JOB_EVENT_REJOINED},
      {.job_id = "j", .rank = 1, .gen = 2, .why = DEP_SLAB_GONE_DIED, .join = 5},
      {.job_id = "j", .rank = 1, .gen = 1, .why = DEP_SLAB_GONE_DIED, .join = 5},
      {.job_id = "j", .rank = 1, .gen = 1, .why = DEP_SLAB_GONE_DAEMON},
      {.job_id = "j", .rank = 1, .gen = 1, .why = DEP_JOB_EVENT_REJOINED},
      {.job_id = "j", .rank = DEP_MAX_WORLD, .gen = 1, .why = DEP_SLAB_GONE_DIED},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    m.u.mask = bad[i];
    proto_buf_init(&b);
    ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
    m.u.mask.gen = 1;
    m.u.mask.why = DEP_SLAB_GONE_DIED;
    m.u.mask.rank = 1;
    m.u.mask.join = 0;
    ck_assert_int_eq(peer_proto_encode(&b, &m), 0);
    /* The same fields forged on the wire: rank, gen and why end before the 8-byte epoch,
     * and the 8-byte join call is last. */
    b.data[b.len - 24] = (uint8_t)bad[i].gen;
    b.data[b.len - 20] = (uint8_t)bad[i].why;
    b.data[b.len - 28] = (uint8_t)(bad[i].rank & 0xff);
    b.data[b.len - 27] = (uint8_t)(bad[i].rank >> 8);
    b.data[b.len - 8] = (uint8_t)bad[i].join;
    ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), DEP_ERR_PROTOCOL);
    ck_assert_ptr_nonnull(strstr(why, "JOB_MASK"));
    proto_buf_free(&b);
  }
  /* JOB_JOINED, the answer to a return: round trips; an odd count or an ok past 1 is
   * refused. */
  m.type = DEP_PEER_JOB_JOINED;
  m.u.joined = (struct dep_peer_job_joined){.job_id = "train-7", .owner_uid = 1000, .rank = 5,
                                            .gen = 4, .ok = 1, .posted = 70};
  proto_buf_init(&b);
  ck_assert_int_eq(peer_proto_encode(&b, &m), 0);
  ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), 0);
  ck_assert_mem_eq(&out.u.joined, &m.u.joined, sizeof m.u.joined);
  proto_buf_free(&b);
  m.u.joined.gen = 3;
  proto_buf_init(&b);
  ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
  m.u.joined.gen = 4;
  m.u.joined.ok = 2;
  ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
  proto_buf_free(&b);
}
END_TEST

/*
 * JOB_HELD (peer protocol 9), a daemon's view of an elastic job as a link comes back: round
 * trips; a rank at or past the world in either set, a held rank the sender finds masked, no
 * held rank at all, or a world of 0 or past DEP_MAX_WORLD is refused by both ends (the
 * decoder's check forged on the wire: the sets are the body's last 2 x 512 bytes).
 */
START_TEST(job_held_round_trips_and_a_view_that_is_no_daemon_s_is_refused) {
  static struct dep_peer_msg m, out;
  memset(&m, 0, sizeof m);
  m.type = DEP_PEER_JOB_HELD;
  snprintf(m.u.held.job_id, sizeof m.u.held.job_id, "train-7");
  m.u.held.owner_uid = 1000;
  m.u.held.world_size = 12;
  m.u.held.live[0] = 0x3b;            /* ranks 0, 1, 3, 4, 5 */
  m.u.held.live[1] = 0x08;            /* and 11 */
  m.u.held.held[0] = 0x18;            /* the sender's: 3 and 4 */
  struct proto_buf b;
  char why[256];
  peer_round_trip(&m, &out, &b);
  ck_assert_mem_eq(&out.u.held, &m.u.held, sizeof m.u.held);
  const size_t live = b.len - 2 * DEP_PEER_RANK_BYTES, held = b.len - DEP_PEER_RANK_BYTES;
  /* Each forgery: the byte at `at` set to `v`. */
  const struct { size_t at; uint8_t v; } bad[] = {
      {live + 1, 0x18},  /* rank 12 live in a world of 12 */
      {held + 1, 0x10},  /* rank 12 held */
      {held, 0x1c},      /* rank 2 held but masked */
      {held, 0x00},      /* none held */
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct proto_buf f;
    proto_buf_init(&f);
    ck_assert_int_eq(peer_proto_encode(&f, &m), 0);
    f.data[bad[i].at] = bad[i].v;
    ck_assert_int_eq(peer_proto_decode(f.data, f.len, &out, why, sizeof why), DEP_ERR_PROTOCOL);
    ck_assert_ptr_nonnull(strstr(why, "JOB_HELD"));
    proto_buf_free(&f);
  }
  m.u.held.world_size = 0;
  ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
  m.u.held.world_size = DEP_MAX_WORLD + 1;
  ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
  m.u.held.world_size = 12;
  m.u.held.held[0] = 0x04;
  ck_assert_int_eq(peer_proto_encode(&b, &m), DEP_ERR_INVALID);
  proto_buf_free(&b);
}
END_TEST

/* ---- ranks ------------------------------------------------------------------ */

/* Ask for the rank's stats page on fd (STATS_LEND): whether it came. */
static bool stats_page_lent(int fd, struct dw_frame *f) {
  int fds[DEP_PROTO_MAX_FDS], nfds = 0;
  if (dw_send_frame(fd, DEP_MSG_STATS_LEND, 8, NULL) != 0 ||
      dw_recv_frame_fds(fd, f, 10000, fds, &nfds) != 0)
    return false;
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  return f->h.type == DEP_MSG_STATS_LEND_OK && nfds == 1;
}

/* A rank process: attaches *a on d and takes its stats page, as the library
 * does, reports 'r' once both are answered (or 'f'), then on the word 'd'
 * detaches and reports 'D'; it exits when the go pipe closes, or is killed. */
static void rank_spawn(struct dw_child *c, const struct tu_daemon *d,
                       const struct dep_attach_args *a) {
  dw_child_fork(c);
  if (c->pid != 0)
    return;
  int fd = attach_args(d, a);
  struct dw_frame *f = dw_frame_new();
  char word = 'f';
  for (;;) {
    int fds[DEP_PROTO_MAX_FDS], nfds = 0;
    if (dw_recv_frame_fds(fd, f, 10000, fds, &nfds) != 0)
      break;
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    if (f->h.type == DEP_MSG_ATTACH_OK)
      word = 'r';
    if (f->h.type != DEP_MSG_SLAB)
      break;
  }
  if (word == 'r' && !stats_page_lent(fd, f))
    word = 'f';
  if (write(c->rep, &word, 1) != 1)
    _exit(3);
  char x;
  while (read(c->go, &x, 1) == 1) {
    if (x != 'd')
      continue;
    word = dw_send_frame(fd, DEP_MSG_DETACH, 9, NULL) == 0 && dw_recv_frame(fd, f, 5000) == 0 &&
                   f->h.type == DEP_MSG_DETACH_OK
               ? 'D'
               : 'f';
    if (write(c->rep, &word, 1) != 1)
      _exit(3);
  }
  _exit(0);
}


static char rank_word(const struct dw_child *c) {
  struct pollfd p = {.fd = c->rep, .events = POLLIN};
  char x = '?';
  if (poll(&p, 1, 10000) == 1 && read(c->rep, &x, 1) != 1)
    x = '?';
  return x;
}

static void rank_kill(struct dw_child *c) {
  kill(c->pid, SIGKILL);
  waitpid(c->pid, NULL, 0);
  c->pid = 0;
}

static void rank_reap(struct dw_child *c) {
  if (c->pid > 0)
    rank_kill(c);
  close(c->rep);
  close(c->go);
}

/* Rank `rank` of an elastic (or not) job of `world`, local rank lr of lws. */
static struct dep_attach_args eargs(const char *id, uint32_t rank, uint32_t world, uint32_t lr,
                                    uint32_t lws, uint32_t flags) {
  struct dep_attach_args a = job_args(id, rank, world, lr, lws);
  a.flags = flags;
  return a;
}

/* ---- this process as rank 0: its node's arena mapped ------------------------ */

struct arena {
  int fd;                    /* the rank's connection */
  uint8_t *base;
  size_t len;
  struct dep_msg_slab m;     /* which local rank's slab is where */
  struct dep_slab_layout l;  /* where the mask is in each */
};

/* ATTACH *a on d and map the arena of the reply (the host backend: one arena, one piece). */
static void arena_attach(struct arena *ar, const struct tu_daemon *d,
                         const struct dep_attach_args *a) {
  ar->fd = attach_args(d, a);
  struct dw_frame *f = dw_frame_new();
  int fds[DEP_PROTO_MAX_FDS], nfds = 0;
  ck_assert_int_eq(dw_recv_frame_fds(ar->fd, f, 10000, fds, &nfds), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "SLAB");
  ck_assert_int_eq(proto_decode_slab(f->body, f->h.body_len, &ar->m), 0);
  ck_assert_uint_eq(ar->m.n_chunks, 1);
  ck_assert_uint_eq(ar->m.n_ranks, a->local_world_size);
  ar->len = (size_t)ar->m.chunk_bytes;
  ar->base = mmap(NULL, ar->len, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  ck_assert_ptr_ne(ar->base, MAP_FAILED);
  close(fds[0]);
  ck_assert_int_eq(dw_recv_frame(ar->fd, f, 10000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "ATTACH_OK");
  struct dep_msg_attach_ok ok;
  ck_assert_int_eq(proto_body_decode(f->h.type, f->body, f->h.body_len, &ok), 0);
  char why[256];
  ck_assert_int_eq(dep__slab_layout_nodes(&a->shape, a->world_size, a->local_world_size,
                                          ok.chunk_rows, &ar->l, why, sizeof why), 0);
  free(f);
}

static void arena_done(struct arena *ar) {
  munmap(ar->base, ar->len);
  close(ar->fd);
}

static uint8_t *arena_slab(const struct arena *ar, uint32_t lr) {
  for (uint32_t i = 0; i < ar->m.n_ranks; i++)
    if (ar->m.ranks[i].local_rank == lr)
      return ar->base + ar->m.ranks[i].offset;
  ck_abort_msg("local rank %u is not in the arena", lr);
  return NULL;
}

static uint64_t epoch_of(const struct arena *ar, uint32_t lr) {
  const uint64_t *w = (const uint64_t *)(arena_slab(ar, lr) + dep_slab_mask_epoch(&ar->l));
  return __atomic_load_n(w, __ATOMIC_ACQUIRE);
}

static bool masked_in(const struct arena *ar, uint32_t lr, uint32_t rank) {
  const uint64_t *w = (const uint64_t *)(arena_slab(ar, lr) + dep_slab_mask_word(&ar->l, rank));
  return (__atomic_load_n(w, __ATOMIC_ACQUIRE) & DEP_SLAB_MASK_BIT(rank)) != 0;
}

static int32_t abort_code(const struct arena *ar, uint32_t lr) {
  const struct dep_slab_abort *ab =
      (const struct dep_slab_abort *)(arena_slab(ar, lr) + DEP_SLAB_ABORT_OFF);
  return __atomic_load_n(&ab->code, __ATOMIC_ACQUIRE);
}

/* Wait (MASK_WAIT_MS at most) until local rank lr's epoch is `want`; it must not pass it. */
static void expect_epoch(const struct arena *ar, uint32_t lr, uint64_t want) {
  int64_t until = dw_now_ms() + MASK_WAIT_MS;
  uint64_t e;
  while ((e = epoch_of(ar, lr)) < want && dw_now_ms() < until)
    dw_sleep_ms(2);
  ck_assert_msg(e == want, "local rank %u: epoch %llu, expected %llu within %d ms", lr,
                (unsigned long long)e, (unsigned long long)want, MASK_WAIT_MS);
}

/* Every local rank in lrs[n] sees epoch `epoch`, exactly the ranks in `set`
 * (a byte per world rank) masked, and no abort. */
static void expect_mask(const struct arena *ar, const uint32_t *lrs, int n, uint32_t world,
                        uint64_t epoch, const char *set) {
  for (int i = 0; i < n; i++) {
    expect_epoch(ar, lrs[i], epoch);
    for (uint32_t r = 0; r < world; r++)
      ck_assert_msg(masked_in(ar, lrs[i], r) == (set[r] == '1'),
                    "local rank %u: rank %u masked %d, expected mask %s", lrs[i], r,
                    (int)masked_in(ar, lrs[i], r), set);
    ck_assert_msg(abort_code(ar, lrs[i]) == 0, "local rank %u was aborted (code %d)", lrs[i],
                  (int)abort_code(ar, lrs[i]));
  }
}

/* deepepctl status --json on d holds every needle (NULL-terminated). */
static void expect_status(const struct tu_daemon *d, const char *const *needles) {
  char *out = NULL;
  ck_assert_int_eq(dw_run_ctl(NULL, d->dir, &out, DW_ARGS("-s", d->sock, "status", "--json")), 0);
  for (const char *const *n = needles; *n != NULL; n++)
    ck_assert_msg(strstr(out, *n) != NULL, "status --json lacks %s:\n%s", *n, out);
  free(out);
}
#define EXPECT_STATUS(d, ...) expect_status((d), (const char *const[]){__VA_ARGS__, NULL})

/* A job `id` of W ranks on daemon d: ranks 1..W-1 in child processes (c[r]), rank 0 here
 * with its arena (ar), each rank attached ('r' from every child) before it returns. */
static void job_up(const struct tu_daemon *d, const char *id, uint32_t W, uint32_t flags,
                   struct dw_child *c, struct arena *ar) {
  for (uint32_t r = 1; r < W; r++) {
    struct dep_attach_args a = eargs(id, r, W, r, W, flags);
    rank_spawn(&c[r], d, &a);
  }
  struct dep_attach_args a0 = eargs(id, 0, W, 0, W, flags);
  arena_attach(ar, d, &a0);
  for (uint32_t r = 1; r < W; r++)
    ck_assert_int_eq(rank_word(&c[r]), 'r');
}

/* ---- one daemon --------------------------------------------------------------- */

START_TEST(an_elastic_job_masks_each_rank_that_dies_or_detaches_and_goes_on) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  enum { W = 4 };
  struct dw_child c[W];
  struct arena ar;
  job_up(&d, "el4", W, DEP_ATTACH_ELASTIC, c, &ar);
  const uint32_t all[] = {0, 1, 2, 3};
  expect_mask(&ar, all, 4, W, 0, "0000");

  /* A SIGKILL: rank 2 is masked everywhere, epoch 1; nobody is aborted. */
  rank_kill(&c[2]);
  expect_mask(&ar, all, 4, W, 1, "0010");
  uint32_t attached = 0;
  int s = dw_client(&d);
  ck_assert(dw_job_listed(s, "el4", &attached, NULL));
  ck_assert_uint_eq(attached, 3);
  EXPECT_STATUS(&d, "\"job_id\":\"el4\"", "\"elastic\":true,\"epoch\":1,\"masked_ranks\":\"2\"",
                "\"rank\":2,\"event\":\"died\"");
  /* The line says how long the mask's write took (on cuda, a wait for the GPU). */
  ck_assert(dw_log_has(&d, "1 of 4 ranks masked; write ", 5000));

  /* A second one, then a detach on purpose. */
  rank_kill(&c[3]);
  expect_mask(&ar, all, 4, W, 2, "0011");
  ck_assert_int_eq(write(c[1].go, "d", 1), 1);
  ck_assert_int_eq(rank_word(&c[1]), 'D');
  expect_mask(&ar, all, 4, W, 3, "0111");
  EXPECT_STATUS(&d, "\"epoch\":3,\"masked_ranks\":\"1-3\"", "\"rank\":3,\"event\":\"died\"",
                "\"rank\":1,\"event\":\"detached\"");

  /* Another job is not touched by any of it. */
  int o = attach_rank(&d, "other", 0, 1, 0, 1);
  expect_ready(o, 1);
  close(o);

  /* Its last rank gone, the job ends as any job does. */
  arena_done(&ar);
  ck_assert(dw_log_has(&d, "job el4: removed", 5000));
  ck_assert(!dw_job_listed(s, "el4", NULL, NULL));
  close(s);
  for (uint32_t r = 1; r < W; r++)
    rank_reap(&c[r]);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(a_job_that_is_not_elastic_still_aborts_its_survivors) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  struct dw_child cs[2], *c = &cs[1];
  struct arena ar;
  job_up(&d, "plain", 2, 0, cs, &ar);
  rank_kill(c);
  int64_t until = dw_now_ms() + MASK_WAIT_MS;
  while (abort_code(&ar, 0) == 0 && dw_now_ms() < until)
    dw_sleep_ms(2);
  ck_assert_int_eq(abort_code(&ar, 0), DEP_ERR_PEER);
  ck_assert_uint_eq(epoch_of(&ar, 0), 0);
  ck_assert(!masked_in(&ar, 0, 1));
  EXPECT_STATUS(&d, "\"elastic\":false,\"epoch\":0,\"masked_ranks\":\"\"", "\"job_events\":[]");
  arena_done(&ar);
  rank_reap(c);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(ranks_that_disagree_on_elastic_are_refused_naming_the_flag) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  struct dep_attach_args a0 = eargs("mixed", 0, 2, 0, 2, DEP_ATTACH_ELASTIC);
  struct dep_attach_args a1 = eargs("mixed", 1, 2, 1, 2, 0);
  int f0 = attach_args(&d, &a0);
  int f1 = attach_args(&d, &a1);
  expect_fail(f1, DEP_ERR_MISMATCH, "DEP_ATTACH_ELASTIC", "gives flags");
  expect_fail(f0, DEP_ERR_MISMATCH, "DEP_ATTACH_ELASTIC", NULL);
  close(f0);
  close(f1);
  /* A bit no deepepd knows is refused, naming the flags. */
  struct dep_attach_args x = eargs("future", 0, 1, 0, 1, 0x80u);
  int fx = attach_args(&d, &x);
  expect_fail(fx, DEP_ERR_INVALID, "flags 0x80", NULL);
  close(fx);
  dw_stop_ok(&d);
}
END_TEST

/* Whether bytes [off, off + len) of local rank lr's slab are all `v`. */
static bool slab_all(const struct arena *ar, uint32_t lr, uint64_t off, uint64_t len, uint8_t v) {
  const uint8_t *p = arena_slab(ar, lr) + off;
  for (uint64_t i = 0; i < len; i++)
    if (p[i] != v)
      return false;
  return true;
}

/* The daemon's open fds (/proc/<pid>/fd). */
static int daemon_fds(const struct tu_daemon *d) {
  char cmd[128];
  dw_sfmt(cmd, sizeof cmd, "ls /proc/%d/fd | wc -l", (int)d->pid);
  char *out = tu_sh_out(cmd, NULL);
  int n = atoi(out);
  free(out);
  return n;
}

START_TEST(a_process_that_attaches_as_a_rank_that_left_gets_its_memory_scrubbed) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  enum { W = 4 };
  struct dw_child c[W];
  struct arena ar;
  job_up(&d, "back", W, DEP_ATTACH_ELASTIC, c, &ar);
  rank_kill(&c[2]);
  const uint32_t all[] = {0, 1, 2, 3};
  expect_mask(&ar, all, 4, W, 1, "0010");

  /* What rank 2's protocol reads, dirtied as a dead rank's calls would leave it: its own
   * slots and error words, its private area, and the slots it posted into rank 0's slab. */
  const struct dep_slab_layout *l = &ar.l;
  memset(arena_slab(&ar, 2), 0xa5, l->mask_off);
  memset(arena_slab(&ar, 2) + l->priv_off, 0xa5, l->priv_bytes);
  memset(arena_slab(&ar, 0) + dep_slab_ctrl_slot(l, 1, 2), 0xa5, DEP_SLAB_CTRL_SLOT);
  /* Rank 1 posted call 41 to rank 0 (a slot's flag is its first word, kabi.h): that slot is
   * not rank 2's and stays, and rank 2 comes back from a call above it. */
  uint64_t *posted = (uint64_t *)(arena_slab(&ar, 0) + dep_slab_ctrl_slot(l, 1, 1));
  __atomic_store_n(posted, 41, __ATOMIC_RELEASE);

  /* A new process attaches as rank 2: answered at once, with the same arena. */
  struct arena back;
  struct dep_attach_args a2 = eargs("back", 2, W, 2, W, DEP_ATTACH_ELASTIC);
  arena_attach(&back, &d, &a2);
  /* Its stats page is its own, not the dead process's. */
  struct dw_frame *f = dw_frame_new();
  ck_assert(stats_page_lent(back.fd, f));
  free(f);
  for (uint32_t i = 0; i < W; i++) {
    ck_assert_uint_eq(back.m.ranks[i].local_rank, ar.m.ranks[i].local_rank);
    ck_assert_uint_eq(back.m.ranks[i].offset, ar.m.ranks[i].offset);
  }
  ck_assert(slab_all(&ar, 2, 0, l->mask_off, 0));
  ck_assert(slab_all(&ar, 2, l->priv_off, l->priv_bytes, 0));
  ck_assert(slab_all(&ar, 0, dep_slab_ctrl_slot(l, 1, 2), DEP_SLAB_CTRL_SLOT, 0));
  ck_assert_uint_eq(__atomic_load_n(posted, __ATOMIC_ACQUIRE), 41);
  /* Its bit is clear in every slab, its own new one too, with a new epoch, and it takes part
   * from call 49 (the newest posted, 41, and the daemon's 8 calls of room: job_elastic.c). */
  expect_mask(&ar, all, 4, W, 2, "0000");
  expect_mask(&back, all, 4, W, 2, "0000");
  for (uint32_t lr = 0; lr < W; lr++) {
    const uint64_t *join = (const uint64_t *)(arena_slab(&ar, lr) + dep_slab_mask_join(l, 2));
    ck_assert_uint_eq(__atomic_load_n(join, __ATOMIC_ACQUIRE), 49);
  }
  ck_assert(dw_log_has(&d, "is rank 2 again, from call 49", 5000));
  /* And where the rejoin's time went, phase by phase. */
  ck_assert(dw_log_has(&d, "ranks masked; scrub ", 5000));
  ck_assert(dw_log_has(&d, " ms, write and read again ", 5000));
  EXPECT_STATUS(&d, "\"rank\":2,\"event\":\"rejoined\"", "\"ranks_attached\":4",
                "\"epoch\":2,\"masked_ranks\":\"\"");

  /* A rank that is live cannot be taken, nor one that left under another rank's id. */
  struct dep_attach_args a1 = eargs("back", 1, W, 1, W, DEP_ATTACH_ELASTIC);
  int f1 = attach_args(&d, &a1);
  expect_fail(f1, DEP_ERR_EXISTS, "is attached by pid", NULL);
  close(f1);
  arena_done(&back);
  expect_mask(&ar, all, 4, W, 3, "0010");
  struct dep_attach_args wrong = eargs("back", 3, W, 2, W, DEP_ATTACH_ELASTIC);
  int fw = attach_args(&d, &wrong);
  expect_fail(fw, DEP_ERR_MISMATCH, "is rank 2, not 3", NULL);
  close(fw);
  struct dep_attach_args shape = eargs("back", 2, W, 2, W, DEP_ATTACH_ELASTIC);
  shape.shape.hidden *= 2;
  int fs = attach_args(&d, &shape);
  expect_fail(fs, DEP_ERR_MISMATCH, "hidden", NULL);
  close(fs);
  arena_done(&ar);
  for (uint32_t r = 1; r < W; r++)
    rank_reap(&c[r]);
  dw_stop_ok(&d);
}
END_TEST

/* A rejoin whose survivors ran past its join call while the epoch went out
 * (DEEPEPD_TEST_JOIN_OVERTAKEN makes the first one so) is undone: the rank is
 * masked again, the process told to attach again, and the next try works. */
START_TEST(a_rejoin_overtaken_by_the_survivors_calls_is_undone_and_can_be_tried_again) {
  struct tu_daemon d;
  setenv("DEEPEPD_TEST_JOIN_OVERTAKEN", "1", 1);
  dw_start(&d, NULL);
  unsetenv("DEEPEPD_TEST_JOIN_OVERTAKEN");
  struct dw_child cs[2], *c = &cs[1];
  struct arena ar;
  job_up(&d, "overtaken", 2, DEP_ATTACH_ELASTIC, cs, &ar);
  struct dep_attach_args a1 = eargs("overtaken", 1, 2, 1, 2, DEP_ATTACH_ELASTIC);
  rank_kill(c);
  rank_reap(c);
  const uint32_t here[] = {0};
  expect_mask(&ar, here, 1, 2, 1, "01");
  int f = attach_args(&d, &a1);
  expect_fail(f, DEP_ERR_STATE, "attach again", "brought back from call 8");
  close(f);
  /* Live at epoch 2, masked again at 3 (a survivor that had taken call 8 with the rank live
   * has its wait on it completed masked when the epoch changes: the operations' part). */
  expect_mask(&ar, here, 1, 2, 3, "01");
  EXPECT_STATUS(&d, "\"rank\":1,\"event\":\"rejoined\"", "\"rank\":1,\"event\":\"detached\"",
                "\"ranks_attached\":1");
  rank_spawn(c, &d, &a1);
  ck_assert_int_eq(rank_word(c), 'r');
  expect_mask(&ar, here, 1, 2, 4, "00");
  rank_reap(c);
  arena_done(&ar);
  dw_stop_ok(&d);
}
END_TEST

/* The count; each cycle is a fork, an attach and a SIGKILL (seconds in all). */
#define REJOIN_CYCLES 500

START_TEST(kill_and_rejoin_cycles_leak_no_fd_and_no_memory) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  struct dw_child cs[2], *c = &cs[1];
  struct arena ar;
  job_up(&d, "cycles", 2, DEP_ATTACH_ELASTIC, cs, &ar);
  struct dep_attach_args a1 = eargs("cycles", 1, 2, 1, 2, DEP_ATTACH_ELASTIC);
  rank_kill(c);
  rank_reap(c);
  const uint32_t here[] = {0};
  expect_mask(&ar, here, 1, 2, 1, "01");
  int s = dw_client(&d);
  struct dep_status *st0 = dw_status(s);
  const int fds0 = daemon_fds(&d);
  for (int i = 0; i < REJOIN_CYCLES; i++) {
    rank_spawn(c, &d, &a1);
    ck_assert_msg(rank_word(c) == 'r', "cycle %d: the rank did not rejoin", i);
    expect_mask(&ar, here, 1, 2, 2u + 2u * (uint64_t)i, "00");
    rank_kill(c);
    rank_reap(c);
    /* Masked again before the next one comes. */
    expect_mask(&ar, here, 1, 2, 3u + 2u * (uint64_t)i, "01");
  }
  ck_assert_int_eq(daemon_fds(&d), fds0);
  struct dep_status *st1 = dw_status(s);
  ck_assert_uint_eq(st1->devices[0].pool_used_bytes, st0->devices[0].pool_used_bytes);
  ck_assert_uint_eq(st1->devices[0].pool_held_bytes, st0->devices[0].pool_held_bytes);
  dep_status_free(st0);
  dep_status_free(st1);
  close(s);
  arena_done(&ar);
  dw_stop_ok(&d);
}
END_TEST

/* ---- two daemons -------------------------------------------------------------- */

/* An elastic job `id` of 2 + 2 ranks over the daemons of ns: rank 0 this process on node 0
 * (its arena mapped: ar), rank 1 on node 0 and ranks 2 and 3 on node 1 in child processes
 * (c[r]), each attached before it returns. */
enum { XW = 4 };
static void xjob_up(const struct nodes *ns, const char *id, struct dw_child *c,
                    struct arena *ar) {
  for (uint32_t r = 1; r < XW; r++) {
    struct dep_attach_args a = eargs(id, r, XW, r % 2, 2, DEP_ATTACH_ELASTIC);
    rank_spawn(&c[r], &ns->d[r / 2], &a);
  }
  struct dep_attach_args a0 = eargs(id, 0, XW, 0, 2, DEP_ATTACH_ELASTIC);
  arena_attach(ar, &ns->d[0], &a0);
  for (uint32_t r = 1; r < XW; r++)
    ck_assert_int_eq(rank_word(&c[r]), 'r');
}

START_TEST(an_elastic_job_over_two_daemons_masks_a_remote_rank_then_its_lost_node) {
  struct nodes ns;
  nodes_start(&ns, 2, 8000);
  enum { W = XW };
  struct dw_child c[W];
  struct arena ar;
  xjob_up(&ns, "el22", c, &ar);
  const uint32_t here[] = {0, 1};
  expect_mask(&ar, here, 2, W, 0, "0000");

  /* A rank on the other node is killed: its daemon tells this one (JOB_MASK). */
  rank_kill(&c[3]);
  expect_mask(&ar, here, 2, W, 1, "0001");
  EXPECT_STATUS(&ns.d[0], "\"epoch\":1,\"masked_ranks\":\"3\"", "\"rank\":3,\"event\":\"died\"");
  EXPECT_STATUS(&ns.d[1], "\"epoch\":1,\"masked_ranks\":\"3\"", "\"rank\":3,\"event\":\"died\"");
  /* It comes back only on its own node. */
  struct dep_attach_args a3 = eargs("el22", 3, W, 1, 2, DEP_ATTACH_ELASTIC);
  int f3 = attach_args(&ns.d[0], &a3);
  expect_fail(f3, DEP_ERR_MISMATCH, "is held by node", "attach there");
  close(f3);

  /* The other node is lost: its rank left is masked here, and the job goes on. */
  kill(ns.d[1].pid, SIGKILL);
  waitpid(ns.d[1].pid, NULL, 0);
  ns.d[1].pid = 0;
  expect_mask(&ar, here, 2, W, 2, "0011");
  EXPECT_STATUS(&ns.d[0], "\"epoch\":2,\"masked_ranks\":\"2-3\"",
                "\"rank\":2,\"event\":\"node lost\"");
  /* A lost node's ranks cannot come back: nothing holds their memory. */
  struct dep_attach_args a2 = eargs("el22", 2, W, 0, 2, DEP_ATTACH_ELASTIC);
  int f2 = attach_args(&ns.d[0], &a2);
  expect_fail(f2, DEP_ERR_STATE, "a node that is lost", "cannot come back");
  close(f2);
  expect_mask(&ar, here, 2, W, 2, "0011");
  arena_done(&ar);
  for (uint32_t r = 1; r < W; r++)
    rank_reap(&c[r]);
  nodes_stop(&ns);
}
END_TEST

/*
 * A rejoin across nodes is agreed by both daemons: node 1 (DEEPEPD_TEST_JOIN_OVERTAKEN
 * makes its first answer so) says its ranks ran past the join call, so node 0 masks the
 * rank again on both nodes and refuses the ATTACH, naming node 1; the job goes on with the
 * rank masked, and the next try brings it back on both, with twice the calls ahead (the
 * ranks made none here: 16 past call 0).
 */
START_TEST(a_rejoin_that_the_other_node_finds_overtaken_is_undone_on_both) {
  struct nodes ns;
  nodes_config(&ns, 2, 8000);
  node_start(&ns, 0);
  setenv("DEEPEPD_TEST_JOIN_OVERTAKEN", "1", 1);
  node_start(&ns, 1);
  unsetenv("DEEPEPD_TEST_JOIN_OVERTAKEN");
  nodes_wait_up(&ns);
  struct dw_child c[XW];
  struct arena ar;
  xjob_up(&ns, "xover", c, &ar);
  rank_kill(&c[1]);
  const uint32_t here[] = {0, 1};
  expect_mask(&ar, here, 2, XW, 1, "0100");
  struct dep_attach_args a1 = eargs("xover", 1, XW, 1, 2, DEP_ATTACH_ELASTIC);
  int f = attach_args(&ns.d[0], &a1);
  expect_fail(f, DEP_ERR_STATE, "calls on node", "attach again (the next attempt joins 16 calls");
  close(f);
  /* Live at epoch 2 on both, masked again at 3 on both. */
  expect_mask(&ar, here, 2, XW, 3, "0100");
  EXPECT_STATUS(&ns.d[1], "\"epoch\":3,\"masked_ranks\":\"1\"",
                "\"rank\":1,\"event\":\"rejoined\"", "\"rank\":1,\"event\":\"detached\"");
  EXPECT_STATUS(&ns.d[0], "\"epoch\":3,\"masked_ranks\":\"1\"", "\"ranks_attached\":1");
  rank_reap(&c[1]);
  rank_spawn(&c[1], &ns.d[0], &a1);
  ck_assert_int_eq(rank_word(&c[1]), 'r');
  expect_mask(&ar, here, 2, XW, 4, "0000");
  EXPECT_STATUS(&ns.d[1], "\"epoch\":4,\"masked_ranks\":\"\"");
  ck_assert(dw_log_has(&ns.d[0], "is rank 1 again, from call 16", 5000));
  /* Its line says how long node 1 took to answer; node 1's, its write and read. */
  ck_assert(dw_log_has(&ns.d[0], " ms, peers ", 5000));
  ck_assert(dw_log_has(&ns.d[1], "ranks masked (write and read ", 5000));
  arena_done(&ar);
  for (uint32_t r = 1; r < XW; r++)
    rank_reap(&c[r]);
  nodes_stop(&ns);
}
END_TEST

/* Kill and rejoin cycles across nodes (the one-daemon test makes 500; each of these is two
 * rejoins, one on each node, with a round trip between the daemons for each). */
#define XREJOIN_CYCLES 50

START_TEST(kill_and_rejoin_cycles_across_nodes_leak_no_fd_and_no_memory) {
  struct nodes ns;
  nodes_start(&ns, 2, 8000);
  struct dw_child c[XW];
  struct arena ar;
  xjob_up(&ns, "xcycles", c, &ar);
  rank_kill(&c[1]);
  rank_kill(&c[3]);
  const uint32_t here[] = {0, 1};
  expect_mask(&ar, here, 2, XW, 2, "0101");
  int s[2];
  struct dep_status *st0[2];
  int fds0[2];
  for (int i = 0; i < 2; i++) {
    s[i] = dw_client(&ns.d[i]);
    st0[i] = dw_status(s[i]);
    fds0[i] = daemon_fds(&ns.d[i]);
  }
  for (int i = 0; i < XREJOIN_CYCLES; i++) {
    const uint64_t e = 2u + 4u * (uint64_t)i;
    static const char *const live[] = {"0001", "0100"};
    for (int n = 0; n < 2; n++) {
      const uint32_t q = n == 0 ? 1 : 3;
      struct dep_attach_args a = eargs("xcycles", q, XW, 1, 2, DEP_ATTACH_ELASTIC);
      rank_reap(&c[q]);
      rank_spawn(&c[q], &ns.d[n], &a);
      ck_assert_msg(rank_word(&c[q]) == 'r', "cycle %d: rank %u did not rejoin", i, q);
      expect_mask(&ar, here, 2, XW, e + 1u + 2u * (uint64_t)n, live[n]);
      rank_kill(&c[q]);
      expect_mask(&ar, here, 2, XW, e + 2u + 2u * (uint64_t)n, "0101");
    }
  }
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(daemon_fds(&ns.d[i]), fds0[i]);
    struct dep_status *st1 = dw_status(s[i]);
    ck_assert_uint_eq(st1->devices[0].pool_used_bytes, st0[i]->devices[0].pool_used_bytes);
    ck_assert_uint_eq(st1->devices[0].pool_held_bytes, st0[i]->devices[0].pool_held_bytes);
    dep_status_free(st0[i]);
    dep_status_free(st1);
    close(s[i]);
  }
  arena_done(&ar);
  for (uint32_t r = 1; r < XW; r++)
    rank_reap(&c[r]);
  nodes_stop(&ns);
}
END_TEST

START_TEST(ranks_that_disagree_on_elastic_across_nodes_fail_the_job_on_both) {
  struct nodes ns;
  nodes_start(&ns, 2, 8000);
  struct dep_attach_args a0 = eargs("xmixed", 0, 2, 0, 1, DEP_ATTACH_ELASTIC);
  struct dep_attach_args a1 = eargs("xmixed", 1, 2, 0, 1, 0);
  int f0 = attach_args(&ns.d[0], &a0);
  int f1 = attach_args(&ns.d[1], &a1);
  expect_fail(f0, DEP_ERR_MISMATCH, "DEP_ATTACH_ELASTIC", NULL);
  expect_fail(f1, DEP_ERR_MISMATCH, "DEP_ATTACH_ELASTIC", NULL);
  close(f0);
  close(f1);
  nodes_stop(&ns);
}
END_TEST

Suite *elastic_suite(void);
Suite *elastic_suite(void) {
  Suite *s = suite_create("elastic");
  TCase *tc = tcase_create("codec");
  tcase_add_test(tc, job_mask_round_trips_and_only_a_masking_change_is_taken);
  tcase_add_test(tc, job_held_round_trips_and_a_view_that_is_no_daemon_s_is_refused);
  suite_add_tcase(s, tc);
  tc = tcase_create("one_daemon");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, an_elastic_job_masks_each_rank_that_dies_or_detaches_and_goes_on);
  tcase_add_test(tc, a_job_that_is_not_elastic_still_aborts_its_survivors);
  tcase_add_test(tc, ranks_that_disagree_on_elastic_are_refused_naming_the_flag);
  tcase_add_test(tc, a_process_that_attaches_as_a_rank_that_left_gets_its_memory_scrubbed);
  tcase_add_test(tc, kill_and_rejoin_cycles_leak_no_fd_and_no_memory);
  tcase_add_test(tc, a_rejoin_overtaken_by_the_survivors_calls_is_undone_and_can_be_tried_again);
  suite_add_tcase(s, tc);
  tc = tcase_create("two_daemons");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, an_elastic_job_over_two_daemons_masks_a_remote_rank_then_its_lost_node);
  tcase_add_test(tc, ranks_that_disagree_on_elastic_across_nodes_fail_the_job_on_both);
  tcase_add_test(tc, a_rejoin_that_the_other_node_finds_overtaken_is_undone_on_both);
  tcase_add_test(tc, kill_and_rejoin_cycles_across_nodes_leak_no_fd_and_no_memory);
  suite_add_tcase(s, tc);
  return s;
}
