/*
 * check_xfer.c — the TCP data path's checks and its hold on a job's
 * exchange regions (daemon/xfer.c, xfer_internal.h), in process: a route
 * of a 4-rank job with ranks 0 and 1 here and 2 and 3 on peer 0, its
 * exchange regions plain memory.  A frame's header is checked against the
 * job before any byte of it may be written (a peer daemon is untrusted
 * input), and names exactly the in block and slot of its source in its
 * destination's region; a route that threads still send from or receive
 * into outlives its job's end until they are done, and a receive the peer
 * stalls is cut rather than waited out.
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "job.h"
#include "log.h"
#include "slab.h"
#include "xfer_internal.h"
#include "xring.h"

/* A route as xfer_job_start makes it, listed in X->routes. */
struct xf {
  struct job *job;
  struct xfer_route *r;
  uint8_t *region[2];
};

static void xf_make(struct xf *f, const char *id) {
  memset(X, 0, sizeof *X);
  pthread_rwlock_init(&X->lock, NULL);
  pthread_mutex_init(&X->routes_mu, NULL);
  pthread_cond_init(&X->routes_cv, NULL);
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    for (int i = 0; i < XFER_CONNS_MAX; i++)
      X->peers[k].in_fds[i] = -1;
  X->active = true;
  f->job = calloc(1, sizeof *f->job + 2 * sizeof(struct job_rank));
  f->r = calloc(1, sizeof *f->r);
  ck_assert_ptr_nonnull(f->job);
  ck_assert_ptr_nonnull(f->r);
  struct xfer_route *r = f->r;
  snprintf(r->id, sizeof r->id, "%s", id);
  r->job = f->job;
  r->world = 4;
  r->local_world = 2;
  struct dep_job_shape shape = {.max_tokens_per_rank = 16, .hidden = 256, .num_experts = 8,
                                .topk = 2, .dtype = DEP_DTYPE_BF16, .max_ll_tokens_per_rank = 16};
  char why[256];
  ck_assert_msg(dep__slab_layout_nodes(&shape, 4, 2, &r->lay, why, sizeof why) == 0, "%s", why);
  for (uint32_t g = 0; g < 4; g++) {
    r->peer_of[g] = g < 2 ? -1 : 0;
    r->local_of[g] = g < 2 ? (int16_t)g : -1;
    r->remote_of[g] = g < 2 ? 0 : g - 2;
  }
  for (uint32_t i = 0; i < 2; i++) {
    r->rank_of[i] = i;
    f->region[i] = calloc(1, r->lay.xchg_bytes);
    ck_assert_ptr_nonnull(f->region[i]);
    r->xchg[i] = f->region[i];
  }
  X->routes = r;
}

/* End the job if it has not (its route goes) and free what xf_make made. */
static void xf_free(struct xf *f) {
  xfer_job_end(f->job);
  for (int i = 0; i < 2; i++)
    free(f->region[i]);
  free(f->job);
}

static struct dep_xfer_hdr xf_hdr(const char *id, uint32_t src, uint32_t dest, uint32_t parity,
                                  uint64_t bytes) {
  struct dep_xfer_hdr h = {.magic = DEP_XFER_MAGIC, .src = src, .dest = dest, .parity = parity,
                           .seq = 1, .bytes = bytes};
  snprintf(h.job_id, sizeof h.job_id, "%s", id);
  return h;
}

static int xf_target(int k, const struct dep_xfer_hdr *h, uint8_t **block, uint8_t **slot) {
  struct xfer_route *r;
  char why[256] = "";
  *block = *slot = NULL;
  return xfer__frame_target(k, h, &r, block, slot, why, sizeof why);
}

START_TEST(a_frame_names_the_in_block_and_slot_of_its_source_in_its_destination) {
  struct xf f;
  xf_make(&f, "xf");
  const struct dep_slab_layout *l = &f.r->lay;
  for (uint32_t src = 2; src < 4; src++)
    for (uint32_t dest = 0; dest < 2; dest++)
      for (uint32_t par = 0; par < 2; par++) {
        struct dep_xfer_hdr h = xf_hdr("xf", src, dest, par, l->block_bytes);
        uint8_t *block, *slot;
        ck_assert_int_eq(xf_target(0, &h, &block, &slot), 0);
        ck_assert_ptr_eq(block, f.region[dest] + dep_slab_in_block(l, par, src - 2));
        ck_assert_ptr_eq(slot, f.region[dest] + dep_slab_in_slot(l, par, src - 2));
        ck_assert_uint_le(block + h.bytes - f.region[dest], l->xchg_bytes);
      }
  xf_free(&f);
}
END_TEST

START_TEST(a_frame_the_job_does_not_allow_is_refused_before_a_byte_is_written) {
  struct xf f;
  xf_make(&f, "xf");
  const uint64_t bb = f.r->lay.block_bytes;
  const struct {
    int peer;
    struct dep_xfer_hdr h;
    int rc;
    const char *what;
  } cases[] = {
      {0, xf_hdr("xf", 2, 1, 1, bb), 0, "a frame the job allows"},
      {1, xf_hdr("xf", 2, 1, 1, bb), DEP_ERR_PROTOCOL, "a source the sending peer does not hold"},
      {0, xf_hdr("xf", 0, 1, 1, bb), DEP_ERR_PROTOCOL, "a source held here"},
      {0, xf_hdr("xf", 2, 3, 1, bb), DEP_ERR_PROTOCOL, "a destination not held here"},
      {0, xf_hdr("xf", 4, 1, 1, bb), DEP_ERR_PROTOCOL, "a source past the world"},
      {0, xf_hdr("xf", 2, 9, 1, bb), DEP_ERR_PROTOCOL, "a destination past the world"},
      {0, xf_hdr("xf", 2, 1, 2, bb), DEP_ERR_PROTOCOL, "parity 2"},
      {0, xf_hdr("xf", 2, 1, 1, bb + 1), DEP_ERR_PROTOCOL, "more bytes than a block"},
      {0, xf_hdr("other", 2, 1, 1, bb), DEP_ERR_STATE, "a job not here (yet)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint8_t *block, *slot;
    int rc = xf_target(cases[i].peer, &cases[i].h, &block, &slot);
    ck_assert_msg(rc == cases[i].rc, "%s: %d, want %d", cases[i].what, rc, cases[i].rc);
    if (rc != 0)
      ck_assert_msg(block == NULL && slot == NULL, "%s: a target was named", cases[i].what);
  }
  /* A failed route and an ended job: their bytes have no reader. */
  struct dep_xfer_hdr h = xf_hdr("xf", 2, 1, 1, bb);
  uint8_t *block, *slot;
  atomic_store(&f.r->failed, DEP_ERR_PEER);
  ck_assert_int_eq(xf_target(0, &h, &block, &slot), DEP_ERR_NOT_FOUND);
  atomic_store(&f.r->failed, 0);
  xfer_job_end(f.job);
  ck_assert_int_eq(xf_target(0, &h, &block, &slot), DEP_ERR_NOT_FOUND);
  xf_free(&f);
}
END_TEST

START_TEST(a_frame_is_published_fields_first_and_the_flag_last) {
  struct xf f;
  xf_make(&f, "xf");
  struct dep_xfer_hdr h = xf_hdr("xf", 3, 0, 1, 0);
  const uint64_t flag = 7;
  memcpy(h.slot, &flag, sizeof flag);
  memset(h.slot + 8, 0xab, sizeof h.slot - 8);
  uint8_t *block, *slot;
  ck_assert_int_eq(xf_target(0, &h, &block, &slot), 0);
  xfer__frame_publish(slot, &h);
  ck_assert_int_eq(memcmp(slot, h.slot, sizeof h.slot), 0);
  xf_free(&f);
}
END_TEST

/* A thread using the route's regions: it holds the route, sleeps or reads
 * fd until it ends, then gives the route back. */
struct xf_user {
  struct xfer_route *r;
  int ms; /* > 0: sleep this long; else read fd */
  int fd;
  _Atomic int64_t put_ms;
};

static int64_t xf_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void *xf_user_main(void *arg) {
  struct xf_user *u = arg;
  if (u->ms > 0) {
    struct timespec ts = {u->ms / 1000, (long)(u->ms % 1000) * 1000000l};
    nanosleep(&ts, NULL);
  } else {
    char c;
    (void)read(u->fd, &c, 1); /* until the far end is cut */
  }
  atomic_store(&u->put_ms, xf_now_ms());
  xfer__route_put(u->r);
  return NULL;
}

START_TEST(a_job_ends_only_once_its_sends_and_receives_are_done) {
  struct xf f;
  xf_make(&f, "xf");
  struct xf_user u = {.r = f.r, .ms = 300};
  atomic_fetch_add(&f.r->users, 1); /* as batch_ref or a receiver does, lock held */
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, xf_user_main, &u), 0);
  xfer_job_end(f.job);
  const int64_t ended = xf_now_ms();
  pthread_join(t, NULL);
  ck_assert_msg(ended >= atomic_load(&u.put_ms),
                "the job's route went %lld ms before its last user gave it back",
                (long long)(atomic_load(&u.put_ms) - ended));
  ck_assert_ptr_null(X->routes);
  xf_free(&f);
}
END_TEST

START_TEST(a_receive_the_peer_stalls_at_the_job_end_is_cut_not_waited_out) {
  struct xf f;
  xf_make(&f, "xf");
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  X->peers[0].in_fds[0] = sv[0]; /* the inbound connection from peer 0 the receiver reads */
  struct xf_user u = {.r = f.r, .fd = sv[0]};
  atomic_fetch_add(&f.r->users, 1);
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, xf_user_main, &u), 0);
  const int64_t t0 = xf_now_ms();
  xfer_job_end(f.job); /* sv[1] never sends: the peer stalls */
  const int64_t took = xf_now_ms() - t0;
  pthread_join(t, NULL);
  ck_assert_msg(took >= 2000 && took < 5000, "the job's end took %lld ms", (long long)took);
  close(sv[0]);
  close(sv[1]);
  xf_free(&f);
}
END_TEST

Suite *xfer_suite(void);
Suite *xfer_suite(void) {
  Suite *s = suite_create("xfer");
  TCase *t = tcase_create("frames");
  tcase_add_test(t, a_frame_names_the_in_block_and_slot_of_its_source_in_its_destination);
  tcase_add_test(t, a_frame_the_job_does_not_allow_is_refused_before_a_byte_is_written);
  tcase_add_test(t, a_frame_is_published_fields_first_and_the_flag_last);
  tcase_add_test(t, a_job_ends_only_once_its_sends_and_receives_are_done);
  tcase_add_test(t, a_receive_the_peer_stalls_at_the_job_end_is_cut_not_waited_out);
  tcase_set_timeout(t, 20);
  suite_add_tcase(s, t);
  return s;
}
