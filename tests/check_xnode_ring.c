/*
 * check_xnode_ring.c — the host backend's side of a job that spans nodes
 * (DESIGN §7), with no daemon and no proxy: a rank of world 2 whose peer is
 * on another node writes its rows for that peer into the out channel, the
 * chunk's mark and the out slot of its exchange region and a descriptor
 * into the proxy's ring, reads the peer's from the in channel once the
 * in slot and the chunk's in mark say so, waits a bounded time on a full
 * ring and fails at once on one the proxy stopped.  Then one case with two
 * real daemons: a ring whose head is behind its tail fails its job, saying
 * so.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include "client_internal.h"
#include "daemonwire.h"
#include "deepep.h"
#include "host_ops.h"
#include "slab.h"
#include "xnjob.h"
#include "xfer_internal.h"
#include "xnround.h"
#include "xring.h"

/* ---- the ring, with no proxy: a rank of world 2 whose peer is on another node ------ */

struct ring_rank {
  struct dep_job_shape s;
  struct dep_slab_layout lay;
  uint8_t *slab;
  struct dep_xring *ring;
  struct ops_ctx c;
  dep_handle_t h; /* the handle its calls use */
};

static void ring_rank_open(struct ring_rank *r, uint32_t timeout_ms) {
  memset(r, 0, sizeof *r);
  r->s = (struct dep_job_shape){.max_tokens_per_rank = 4, .hidden = 128, .num_experts = 4,
                                .topk = 2, .dtype = DEP_DTYPE_BF16};
  char why[256];
  ck_assert_msg(dep__slab_layout_nodes(&r->s, 2, 1, 0, &r->lay, why, sizeof why) == 0, "%s", why);
  ck_assert_uint_eq(r->lay.n_remote, 1);
  ck_assert_uint_gt(r->lay.xchg_bytes, 0);
  r->slab = aligned_alloc(4096, dep_round_up(r->lay.total_bytes, 4096));
  r->ring = aligned_alloc(4096, DEP_XRING_BYTES + r->lay.xchg_bytes);
  ck_assert(r->slab != NULL && r->ring != NULL);
  memset(r->slab, 0, r->lay.total_bytes);
  memset(r->ring, 0, DEP_XRING_BYTES + r->lay.xchg_bytes);
  r->ring->magic = DEP_XRING_MAGIC;
  r->ring->version = DEP_XRING_VERSION;
  r->ring->entries = DEP_XRING_ENTRIES;
  r->ring->xchg_bytes = r->lay.xchg_bytes;
  uint8_t *slabs[DEP_MAX_LOCAL_RANKS] = {r->slab, NULL};
  ck_assert_msg(host_ops_init_nodes(&r->c, &r->s, 2, 0, slabs, r->ring, 0, timeout_ms, why,
                                    sizeof why) == 0, "%s", why);
  host_ops_handle_init(&r->h);
}

static void ring_rank_close(struct ring_rank *r) {
  host_ops_handle_fini(&r->h);
  host_ops_fini(&r->c);
  free(r->slab);
  free(r->ring);
}

/* One token to rank 1 (experts 2 and 3 are its), with the rank's handle. */
static int ring_dispatch(struct ring_rank *r, uint16_t *x) {
  static int64_t idx[2] = {2, 3};
  static float w[2] = {0.5f, 0.25f};
  static uint16_t rx[8 * 128];
  static int32_t ridx[8 * 2], cnt[2];
  static float rw[8 * 2];
  static uint32_t nrecv;
  struct dep_dispatch_args a = {.size = sizeof a, .x = x, .topk_idx = idx,
                                .index_type = DEP_INDEX_I64, .topk_weights = w, .num_tokens = 1,
                                .recv_x = rx, .recv_topk_idx = ridx, .recv_topk_weights = rw,
                                .recv_count_per_expert = cnt, .num_recv = &nrecv};
  return host_ops_dispatch(&r->c, &a, &r->h);
}

/* The rows for the remote rank go to the out channel of the exchange region (after the
 * ring, not the slab), the chunk's mark to out_mark and the slot image to the out slot,
 * one descriptor after: a chunk with the slot. */
START_TEST(a_block_for_a_remote_rank_is_an_out_block_a_slot_image_and_a_descriptor) {
  struct ring_rank r;
  ring_rank_open(&r, 100);
  uint16_t x[128];
  for (int i = 0; i < 128; i++)
    x[i] = (uint16_t)(0x3f00 + i);
  ck_assert_int_eq(ring_dispatch(&r, x), DEP_ERR_TIMEOUT); /* no proxy: rank 1 never posts */
  ck_assert_uint_eq(atomic_load(&r.ring->head), 1);
  const struct dep_xring_desc *d = &r.ring->desc[0];
  ck_assert_uint_eq(d->dest, 1);
  ck_assert_uint_eq(d->parity, 1);
  ck_assert_uint_eq(d->seq, 1);
  ck_assert_uint_eq(d->bytes, r.lay.row_bytes);
  ck_assert_uint_eq(d->kind, DEP_XRING_CHUNK | DEP_XRING_SLOT);
  ck_assert_uint_eq(d->row0, 0);
  uint8_t *xchg = dep_xring_xchg(r.ring);
  ck_assert_uint_eq(*(const uint64_t *)(xchg + dep_slab_out_mark(&r.lay, 1, 0, 0)),
                    DEP_SLAB_CHAN_AT(1, 1));
  const struct ops_slot *sl = (const struct ops_slot *)(xchg + dep_slab_out_slot(&r.lay, 1, 0));
  ck_assert_uint_eq(atomic_load(&sl->flag), 1);
  ck_assert_uint_eq(sl->rows, 1);
  ck_assert_uint_eq(sl->op, OPS_OP_DISPATCH);
  ck_assert_int_eq(memcmp(xchg + dep_slab_out_block(&r.lay, 1, 0), x, sizeof x), 0);
  /* Rank 1 has no slab here, and no byte for it went into ours: the slab's
   * data area past rank 0's own blocks is as it was. */
  for (uint64_t o = dep_slab_block(&r.lay, 0, 1); o < r.lay.data_off + 2 * r.lay.parity_bytes; o++)
    if (o < dep_slab_block(&r.lay, 1, 0) || o >= dep_slab_block(&r.lay, 1, 1))
      ck_assert_uint_eq(r.slab[o], 0);
  ring_rank_close(&r);
}
END_TEST

/*
 * What the remote rank sent is read from the in slot and in channel of the
 * exchange region, as the daemon writes them there: a combine's vector
 * from rank 1, written (rows, then the chunk's mark, then the slot, flag
 * last) before the call, is summed into rank 0's output; the same bytes in
 * rank 1's slot and block of the slab are not looked at.
 */
START_TEST(a_block_from_a_remote_rank_is_read_from_the_in_block_and_in_slot) {
  struct ring_rank r;
  ring_rank_open(&r, 2000);
  uint16_t x[128];
  for (int i = 0; i < 128; i++)
    x[i] = (uint16_t)(0x3f80 + i); /* 1.0, 1.0078, ... */
  /* Rank 1's part of the dispatch (call 1, parity 1): no rows for rank 0. */
  uint8_t *xchg = dep_xring_xchg(r.ring);
  struct ops_slot *in = (struct ops_slot *)(xchg + dep_slab_in_slot(&r.lay, 1, 0));
  in->rows = 0;
  in->op = OPS_OP_DISPATCH;
  in->num_tokens = 0;
  atomic_store_explicit(&in->flag, 1, memory_order_release);
  ck_assert_int_eq(ring_dispatch(&r, x), 0);
  ck_assert_uint_eq(r.h.recv_from[1], 0);
  ck_assert_uint_eq(r.h.recv_from[0], 0);
  ck_assert_uint_eq(atomic_load(&r.ring->head), 1);
  /* The combine (call 2, parity 0): rank 1 sends back its vector for our token. */
  uint16_t back[128];
  for (int i = 0; i < 128; i++)
    back[i] = 0x4000; /* 2.0 */
  memcpy(xchg + dep_slab_in_block(&r.lay, 0, 0), back, sizeof back);
  *(uint64_t *)(xchg + dep_slab_in_mark(&r.lay, 0, 0, 0)) = DEP_SLAB_CHAN_AT(2, 1);
  in = (struct ops_slot *)(xchg + dep_slab_in_slot(&r.lay, 0, 0));
  in->rows = 1;
  in->op = OPS_OP_COMBINE;
  in->ref_seq = 1;
  in->num_tokens = 0;
  atomic_store_explicit(&in->flag, 2, memory_order_release);
  /* A decoy in the slab where a local rank 1 would have written. */
  struct ops_slot *decoy = (struct ops_slot *)(r.slab + dep_slab_ctrl_slot(&r.lay, 0, 1));
  decoy->rows = 7;
  uint16_t out[128];
  struct dep_combine_args ca = {.size = sizeof ca, .x = x, .out = out};
  ck_assert_msg(host_ops_combine(&r.c, &ca, &r.h) == 0, "%s", r.c.why);
  for (int i = 0; i < 128; i++)
    ck_assert_uint_eq(out[i], 0x4000);
  ring_rank_close(&r);
}
END_TEST

/* A ring the proxy does not drain: the call waits, bounded, and overwrites nothing. */
START_TEST(a_full_ring_is_a_bounded_wait_that_overwrites_nothing) {
  struct ring_rank r;
  ring_rank_open(&r, 300);
  for (uint32_t i = 0; i < DEP_XRING_ENTRIES; i++)
    r.ring->desc[i] = (struct dep_xring_desc){.dest = 7, .parity = 0, .seq = 1000 + i};
  atomic_store(&r.ring->head, DEP_XRING_ENTRIES); /* tail 0: full */
  uint16_t x[128] = {0};
  int64_t t0 = xn_mono_ms();
  ck_assert_int_eq(ring_dispatch(&r, x), DEP_ERR_TIMEOUT);
  int64_t waited = xn_mono_ms() - t0;
  ck_assert_msg(waited >= 290 && waited < 3000, "waited %lld ms for a 300 ms bound",
                (long long)waited);
  ck_assert_msg(strstr(r.c.why, "ring stayed full") != NULL, "%s", r.c.why);
  ck_assert_uint_eq(atomic_load(&r.ring->head), DEP_XRING_ENTRIES);
  for (uint32_t i = 0; i < DEP_XRING_ENTRIES; i++)
    ck_assert_uint_eq(r.ring->desc[i].seq, 1000 + i);
  struct ops_err_record er;
  host_ops_err_read(r.slab, &er);
  ck_assert_int_eq(atomic_load(&er.code), DEP_ERR_TIMEOUT);
  ck_assert_uint_eq(er.source, 1);
  /* The context is broken: the ranks are out of step. */
  ck_assert_int_eq(ring_dispatch(&r, x), DEP_ERR_STATE);
  ring_rank_close(&r);
}
END_TEST

/* A ring the proxy stopped serving (its job failed): the call fails at once with its code. */
START_TEST(a_ring_the_proxy_stopped_fails_the_call_at_once) {
  struct ring_rank r;
  ring_rank_open(&r, 5000);
  atomic_store(&r.ring->failed, DEP_ERR_PEER);
  uint16_t x[128] = {0};
  int64_t t0 = xn_mono_ms();
  ck_assert_int_eq(ring_dispatch(&r, x), DEP_ERR_PEER);
  ck_assert_int_lt(xn_mono_ms() - t0, 1000);
  ck_assert_msg(strstr(r.c.why, "stopped serving this rank") != NULL, "%s", r.c.why);
  ck_assert_uint_eq(atomic_load(&r.ring->head), 0);
  ring_rank_close(&r);
}
END_TEST

/* A remote rank needs a ring, and a ring must be this rank's. */
START_TEST(init_refuses_a_remote_rank_without_a_ring_and_a_ring_of_another_rank) {
  struct ring_rank r;
  ring_rank_open(&r, 100);
  char why[256] = "";
  uint8_t *slabs[DEP_MAX_LOCAL_RANKS] = {r.slab, NULL};
  struct ops_ctx c;
  ck_assert_int_eq(host_ops_init_nodes(&c, &r.s, 2, 0, slabs, NULL, 0, 100, why, sizeof why),
                   DEP_ERR_INVALID);
  ck_assert_msg(strstr(why, "slab of rank 1 is not mapped") != NULL, "%s", why);
  r.ring->rank = 1;
  ck_assert_int_eq(host_ops_init_nodes(&c, &r.s, 2, 0, slabs, r.ring, 0, 100, why, sizeof why),
                   DEP_ERR_INVALID);
  ck_assert_msg(strstr(why, "not one for rank 0") != NULL, "%s", why);
  ring_rank_close(&r);
}
END_TEST

/* ---- split calls, the daemons played by the test --------------------------------------- */

/* A low-latency dispatch of one token to rank 1's experts (2 and 3), in phases, into h
 * (rows into rx: 2 experts x 2 ranks x max_ll_tokens bf16 rows of 128). */
static int ring_ll(struct ring_rank *r, struct dep_handle *h, uint16_t *rx, uint32_t phases) {
  static uint16_t x[128];
  static int64_t idx[2] = {2, 3};
  static int32_t cnt[2];
  struct dep_ll_dispatch_args a = {.size = sizeof a, .x = x, .topk_idx = idx,
                                   .index_type = DEP_INDEX_I64, .num_tokens = 1, .recv_x = rx,
                                   .recv_count = cnt, .phases = phases};
  return host_ops_ll_dispatch(&r->c, &a, h);
}

/* Rank 1's post of call seq to rank 0 (no rows), as its node's daemon writes it. */
static struct ops_slot *ring_post_in(struct ring_rank *r, uint64_t seq, uint32_t prev_read) {
  struct ops_slot *in =
      (struct ops_slot *)(dep_xring_xchg(r->ring) + dep_slab_in_slot(&r->lay, seq & 1, 0));
  in->rows = 0;
  in->op = OPS_OP_LL_DISPATCH;
  in->prev_read = prev_read;
  atomic_store_explicit(&in->flag, seq, memory_order_release);
  return in;
}

/* How rank 1 says it has read call 1, or (RING_NONE) does not. */
enum ring_read { RING_NONE, RING_TAKEN_FRAME, RING_PREV_READ, RING_POST_3 };

/*
 * Split calls in a job across nodes (host_ops.h "Split calls"): send 1,
 * send 2, both of rank 1's posts in (its call 2 posted before it read call
 * 1: prev_read 0), the receive of call 1, which stores its taken word in
 * the in slot and pushes a TAKEN descriptor for rank 1 (its receive ran
 * after a later send), the receive of call 2 (no descriptor: no later send
 * yet); then send 3, which reuses call 1's out block and rank 1's in block,
 * waits until rank 1 says it has read call 1: through its taken frame
 * (the out slot's taken word), its post of call 2 (prev_read) or its post
 * of call 3.  With none of them it times out naming call 1, having written
 * nothing (the old code posted it at once).
 */
START_TEST(a_split_call_across_nodes_waits_for_the_remote_receivers_read) {
  for (int how = RING_NONE; how <= RING_POST_3; how++) {
    struct ring_rank r;
    ring_rank_open(&r, 300);
    struct dep_handle h2;
    host_ops_handle_init(&h2);
    uint16_t *rx = malloc((size_t)2 * 2 * r.lay.max_ll_tokens * 128 * 2);
    ck_assert_ptr_nonnull(rx);
    uint8_t *xchg = dep_xring_xchg(r.ring);
    ck_assert_msg(ring_ll(&r, &r.h, rx, DEP_LL_SEND) == 0, "%s", r.c.why);
    ck_assert_msg(ring_ll(&r, &h2, rx, DEP_LL_SEND) == 0, "%s", r.c.why);
    ck_assert_uint_eq(atomic_load(&r.ring->head), 2);
    struct ops_slot *in1 = ring_post_in(&r, 1, 1);
    ring_post_in(&r, 2, 0);
    ck_assert_msg(ring_ll(&r, &r.h, rx, DEP_LL_RECV) == 0, "%s", r.c.why);
    ck_assert_uint_eq(atomic_load(&r.ring->head), 3);
    const struct dep_xring_desc *d = &r.ring->desc[2];
    ck_assert_uint_eq(d->kind, DEP_XRING_TAKEN);
    ck_assert_uint_eq(d->dest, 1);
    ck_assert_uint_eq(d->seq, 1);
    ck_assert_uint_eq(d->parity, 1);
    ck_assert_uint_eq(atomic_load(&in1->taken), 1);
    ck_assert_msg(ring_ll(&r, &h2, rx, DEP_LL_RECV) == 0, "%s", r.c.why);
    ck_assert_uint_eq(atomic_load(&r.ring->head), 3);
    struct ops_slot *out1 = (struct ops_slot *)(xchg + dep_slab_out_slot(&r.lay, 1, 0));
    if (how == RING_TAKEN_FRAME)
      atomic_store(&out1->taken, 1); /* as the daemon stores a TAKEN frame's word */
    else if (how == RING_PREV_READ)
      ring_post_in(&r, 2, 1);
    else if (how == RING_POST_3)
      ring_post_in(&r, 3, 0);
    const int rc = ring_ll(&r, &r.h, rx, DEP_LL_SEND);
    if (how == RING_NONE) {
      ck_assert_int_eq(rc, DEP_ERR_TIMEOUT);
      ck_assert_msg(strstr(r.c.why, "has not read call 1") != NULL, "%s", r.c.why);
      ck_assert_uint_eq(atomic_load(&r.ring->head), 3);
      ck_assert_uint_eq(atomic_load(&out1->flag), 1);
    } else {
      ck_assert_msg(rc == 0, "way %d: %s", how, r.c.why);
      ck_assert_uint_eq(atomic_load(&r.ring->head), 4);
      ck_assert_uint_eq(atomic_load(&out1->flag), 3);
    }
    free(rx);
    host_ops_handle_fini(&h2);
    ring_rank_close(&r);
  }
}
END_TEST

/* ---- the proxy: a ring whose head is behind its tail ------------------------------- */

/* What the two ranks of the stale-head job share (MAP_SHARED). */
struct stale_head {
  _Atomic int done;    /* rank 0 saw its ring stopped, or gave up: rank 1 may go */
  int64_t failed_ms;   /* how long the proxy took to stop the forged ring */
  int32_t failed;      /* the code it stopped it with */
};

/* Ceiling on the proxy's answer to the forged ring: it sweeps every ring it serves
 * continually, so this is only a bound for a loaded machine, far past the few
 * milliseconds it takes; a hang would be the op timeout's or forever. */
#define STALE_HEAD_CEILING_MS 20000
#define STALE_HEAD_TAIL 5u

/* Rank 0 forges its ring as a process that pushed from a stale head leaves it (head 0,
 * tail STALE_HEAD_TAIL, in one store, so that the proxy sees nothing else) and waits for
 * the proxy to stop it; rank 1, on the other node, holds its place till then. */
static int stale_head_rank(dep_client_t *c, const struct xn_run *run, uint32_t rank,
                           struct xn_result *res) {
  struct stale_head *sh = run->arg;
  if (rank != 0) {
    for (int64_t until = xn_mono_ms() + 2 * STALE_HEAD_CEILING_MS;
         !atomic_load(&sh->done) && xn_mono_ms() < until;)
      dw_sleep_ms(5);
    return 0;
  }
  struct dep_xring *ring = c->xring;
  if (ring == NULL) {
    snprintf(res->msg, sizeof res->msg, "rank 0 has no ring: %s", c->xring_why);
    atomic_store(&sh->done, 1);
    return 1;
  }
  const int64_t t0 = xn_mono_ms();
  atomic_store_explicit(&ring->tail, STALE_HEAD_TAIL, memory_order_release);
  while (atomic_load_explicit(&ring->failed, memory_order_acquire) == 0 &&
         xn_mono_ms() - t0 < STALE_HEAD_CEILING_MS)
    dw_sleep_ms(5);
  sh->failed = atomic_load_explicit(&ring->failed, memory_order_acquire);
  sh->failed_ms = xn_mono_ms() - t0;
  atomic_store(&sh->done, 1);
  return 0;
}

/* The proxy fails the job of a ring whose head is behind its tail at once, naming both
 * and what it means (it used to say "18446744073709551611 descriptors are waiting, more
 * than it holds": head - tail, unsigned). */
START_TEST(a_ring_whose_head_is_behind_its_tail_fails_its_job_naming_both) {
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, XN_OP_TIMEOUT_MS, "");
  struct xn_place pl;
  const struct xn_layout *lay = &xn_layouts[0]; /* world 2, one rank on each node */
  xn_place(&pl, lay->split, lay->nodes);
  struct ow_case *d = xn_case_new(&lay->sc, 0);
  struct stale_head *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(sh, MAP_FAILED);
  memset(sh, 0, sizeof *sh);
  struct xn_result *res = xn_results(2);
  const struct xn_run run = {.d = d, .body = stale_head_rank, .arg = sh};
  pid_t pids[2];
  xn_spawn(&ns, &pl, "stalehead", &run, res, pids);
  const bool ok = xn_reap(pids, 2, 4 * STALE_HEAD_CEILING_MS);
  char *log = tu_daemon_log(&ns.d[0]);
  nodes_stop(&ns);
  ck_assert_msg(ok, "the ranks failed: rank 0: %s; rank 1: %s", res[0].msg, res[1].msg);
  ck_assert_msg(sh->failed == DEP_ERR_PROTOCOL,
                "the proxy did not stop the ring within %d ms (its word: %d)",
                STALE_HEAD_CEILING_MS, (int)sh->failed);
  char want[200];
  snprintf(want, sizeof want, "ring has its head (0) behind its tail (%u): the rank pushed from "
           "a stale head; the job fails", STALE_HEAD_TAIL);
  ck_assert_msg(log != NULL && strstr(log, want) != NULL, "node 0's log does not say \"%s\":\n%s",
                want, log != NULL ? log : "(none)");
  free(log);
  munmap(res, 2 * sizeof *res);
  munmap(sh, sizeof *sh);
  xn_case_free(d);
}
END_TEST

/* ---- the populate of a new job's exchange regions, off the loop -------------------- */

#define FILL_CEILING_MS 20000

struct fill_hold {
  _Atomic int attached[2]; /* rank g is attached */
  _Atomic int go;          /* the test has looked: detach */
};

/* Each rank says it is attached and holds its place until the test has looked. */
static int fill_hold_rank(dep_client_t *c, const struct xn_run *run, uint32_t rank,
                          struct xn_result *res) {
  struct fill_hold *fh = run->arg;
  atomic_store(&fh->attached[rank], 1);
  for (int64_t until = xn_mono_ms() + 2 * FILL_CEILING_MS;
       !atomic_load(&fh->go) && xn_mono_ms() < until;)
    dw_sleep_ms(5);
  return 0;
}

/* Until every daemon of ns has `want` threads named deepepd-fill, at most FILL_CEILING_MS
 * (a bound for a loaded machine, not a timing); fails the test saying what it saw. */
static void fill_threads_await(const struct nodes *ns, int want, const char *when) {
  int got[2] = {-1, -1};
  for (int64_t until = xn_mono_ms() + FILL_CEILING_MS;; dw_sleep_ms(5)) {
    for (int i = 0; i < 2; i++)
      got[i] = tu_threads(ns->d[i].pid, "deepepd-fill");
    if ((got[0] == want && got[1] == want) || xn_mono_ms() > until)
      break;
  }
  ck_assert_msg(got[0] == want && got[1] == want, "%s: the daemons have %d and %d threads "
                "mapping exchange regions in, not %d", when, got[0], got[1], want);
}

/* A job of world 2, one rank on each of two daemons whose populate of a new job's exchange
 * regions the test's hook holds ($DEEPEPD_TEST_XCHG_FILL_HOLD_FD: hold[0], until hold[1] is
 * written or closed); fh says what the ranks do. */
struct fill_case {
  int hold[2];
  struct nodes ns;
  struct fill_hold *fh;
  struct ow_case *d;
  struct xn_result *res;
  pid_t pids[2];
};

/* Start fc's daemons and spawn its ranks; returns once both daemons' populate is held. */
static void fill_case_start(struct fill_case *fc) {
  ck_assert_int_eq(pipe(fc->hold), 0);
  char v[16];
  snprintf(v, sizeof v, "%d", fc->hold[0]);
  setenv("DEEPEPD_TEST_XCHG_FILL_HOLD_FD", v, 1);
  xn_nodes_start(&fc->ns, 2, 20000, XN_OP_TIMEOUT_MS, "");
  unsetenv("DEEPEPD_TEST_XCHG_FILL_HOLD_FD");
  struct xn_place pl;
  const struct xn_layout *lay = &xn_layouts[0]; /* world 2, one rank on each node */
  xn_place(&pl, lay->split, lay->nodes);
  fc->d = xn_case_new(&lay->sc, 0);
  fc->fh = mmap(NULL, sizeof *fc->fh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(fc->fh, MAP_FAILED);
  memset(fc->fh, 0, sizeof *fc->fh);
  fc->res = xn_results(2);
  const struct xn_run run = {.d = fc->d, .body = fill_hold_rank, .arg = fc->fh};
  xn_spawn(&fc->ns, &pl, "fillheld", &run, fc->res, fc->pids);
  fill_threads_await(&fc->ns, 1, "every rank held, the populate held");
}

/* Once fc's populate has stopped (when: how), each daemon stops cleanly on SIGTERM (under
 * make asan: the held thread touched nothing freed), and node 0's log does not say a frame
 * was still being received; then everything of fc goes. */
static void fill_case_end(struct fill_case *fc, const char *when) {
  fill_threads_await(&fc->ns, 0, when);
  char *log = tu_daemon_log(&fc->ns.d[0]);
  int st[2];
  for (int i = 0; i < 2; i++)
    st[i] = tu_daemon_stop(&fc->ns.d[i]);
  nodes_stop(&fc->ns);
  for (int i = 0; i < 2; i++)
    ck_assert_msg(st[i] == 0, "node %d's daemon's wait status on SIGTERM: %#x", i, st[i]);
  ck_assert_msg(log != NULL && strstr(log, "still being received") == NULL,
                "node 0's log:\n%s", log != NULL ? log : "(none)");
  free(log);
  close(fc->hold[0]);
  close(fc->hold[1]);
  munmap(fc->res, 2 * sizeof *fc->res);
  munmap(fc->fh, sizeof *fc->fh);
  xn_case_free(fc->d);
}

/*
 * A daemon maps a new job's exchange regions into its page tables on a
 * thread of its own, not on its loop, and answers the job's ranks once
 * they are in: with the test's hook holding that thread, deepepctl status
 * answers on each node and no rank is attached; let go, the ranks attach
 * and run, and the threads end.  Before the thread, the loop mapped the
 * regions itself while every other client's request waited (no status
 * answered while held); before the ranks waited for it, they attached at
 * once and their first calls faulted the regions in, page by page
 * (BENCHMARKS.md: a first dispatch 3.4 times the median between namespaces).
 */
START_TEST(a_new_jobs_ranks_are_answered_once_its_exchange_regions_are_mapped_in) {
  struct fill_case fc;
  fill_case_start(&fc);
  struct fill_hold *fh = fc.fh;
  char out[8192];
  for (int i = 0; i < 2; i++) {
    xn_ctl_json_at(&fc.ns, i, "status", out, sizeof out); /* fails the test if it does not answer */
    ck_assert_msg(strstr(out, "fillheld") != NULL, "node %d's status lacks the job: %s", i, out);
  }
  const bool early = atomic_load(&fh->attached[0]) || atomic_load(&fh->attached[1]);
  ck_assert_int_eq(write(fc.hold[1], "x", 1), 1); /* let the populate go */
  for (int64_t until = xn_mono_ms() + 2 * FILL_CEILING_MS;
       !(atomic_load(&fh->attached[0]) && atomic_load(&fh->attached[1])) &&
       xn_mono_ms() < until;)
    dw_sleep_ms(5);
  const bool attached = atomic_load(&fh->attached[0]) && atomic_load(&fh->attached[1]);
  atomic_store(&fh->go, 1);
  const bool ok = xn_reap(fc.pids, 2, 4 * FILL_CEILING_MS);
  ck_assert_msg(!early, "a rank was answered while its job's exchange regions were being "
                "mapped in (%d, %d)", atomic_load(&fh->attached[0]),
                atomic_load(&fh->attached[1]));
  ck_assert_msg(attached && ok, "the ranks did not attach (%d, %d) or failed: rank 0: %s; "
                "rank 1: %s", atomic_load(&fh->attached[0]), atomic_load(&fh->attached[1]),
                fc.res[0].msg, fc.res[1].msg);
  fill_case_end(&fc, "the populate let go");
}
END_TEST

/*
 * A job whose ranks go while its exchange regions are being mapped in (the
 * populate held, as above; the ranks killed while they wait for ATTACH_OK)
 * ends, and its populate stops between pieces: the threads end with the
 * hold never let go, and the regions go back to the pool only after (the
 * daemons stop cleanly).
 */
START_TEST(a_job_that_ends_while_its_regions_are_mapped_in_stops_their_populate) {
  struct fill_case fc;
  fill_case_start(&fc);
  for (int i = 0; i < 2; i++) {
    kill(fc.pids[i], SIGKILL);
    waitpid(fc.pids[i], NULL, 0);
  }
  fill_case_end(&fc, "the ranks killed, the populate still held");
}
END_TEST

/* ---- the data connections: little unsent ahead of a credit ----------------------- */

/* The TCP sockets of process pid whose TCP_NOTSENT_LOWAT is XFER_NOTSENT_LOWAT (each taken
 * into this process by pidfd_getfd), or -1 with why when they cannot be looked at. */
static int lowat_sockets(pid_t pid, char *why, size_t len) {
  const int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
  char dir[64];
  snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
  DIR *d = pfd >= 0 ? opendir(dir) : NULL;
  if (d == NULL) {
    snprintf(why, len, "pidfd_open or %s: %s", dir, strerror(errno));
    if (pfd >= 0)
      close(pfd);
    return -1;
  }
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    char path[512], link[64] = "";
    snprintf(path, sizeof path, "%s/%.256s", dir, e->d_name);
    if (e->d_name[0] == '.' || readlink(path, link, sizeof link - 1) < 0 ||
        strncmp(link, "socket:", 7) != 0)
      continue;
    const int fd = (int)syscall(SYS_pidfd_getfd, pfd, atoi(e->d_name), 0);
    if (fd < 0) {
      snprintf(why, len, "pidfd_getfd of fd %.16s: %s", e->d_name, strerror(errno));
      n = -1;
      break;
    }
    int proto = 0, lowat = 0;
    socklen_t sl = sizeof proto, ll = sizeof lowat;
    if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &sl) == 0 && proto == IPPROTO_TCP &&
        getsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, &ll) == 0 &&
        lowat == XFER_NOTSENT_LOWAT)
      n++;
    close(fd);
  }
  closedir(d);
  close(pfd);
  return n;
}

/* Ceiling on the data connections' opening: they follow the peer link at once, so this
 * is only a bound for a loaded machine. */
#define LOWAT_CEILING_MS 20000

/*
 * Every data connection holds at most XFER_NOTSENT_LOWAT bytes unsent
 * (TCP_NOTSENT_LOWAT): a credit the proxy sends goes out behind what the
 * socket holds unsent, and its sender waits for it.  Before, a connection
 * took up to its 4 MiB send buffer, all of it ahead of the next credit.
 * Each daemon has its two data connections and its control lane out, and
 * the peer's three in.
 */
START_TEST(a_daemons_data_connections_hold_little_unsent_ahead_of_a_credit) {
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, XN_OP_TIMEOUT_MS, "");
  char why[256] = "";
  int n[2] = {0, 0};
  for (int i = 0; i < 2; i++)
    for (int64_t until = xn_mono_ms() + LOWAT_CEILING_MS;
         (n[i] = lowat_sockets(ns.d[i].pid, why, sizeof why)) >= 0 && n[i] < 6 &&
         xn_mono_ms() < until;)
      dw_sleep_ms(20);
  nodes_stop(&ns);
  for (int i = 0; i < 2; i++) {
    ck_assert_msg(n[i] >= 0, "node %d's sockets could not be looked at: %s", i, why);
    ck_assert_msg(n[i] == 6, "node %d's daemon has %d TCP sockets that hold at most %d bytes "
                  "unsent, want its 2 data connections and its control lane out and 3 in", i, n[i],
                  XFER_NOTSENT_LOWAT);
  }
}
END_TEST

Suite *xnode_ring_suite(void);
Suite *xnode_ring_suite(void) {
  Suite *s = suite_create("xnode_ring");
  TCase *r = tcase_create("ring");
  tcase_add_test(r, a_block_for_a_remote_rank_is_an_out_block_a_slot_image_and_a_descriptor);
  tcase_add_test(r, a_block_from_a_remote_rank_is_read_from_the_in_block_and_in_slot);
  tcase_add_test(r, a_full_ring_is_a_bounded_wait_that_overwrites_nothing);
  tcase_add_test(r, a_ring_the_proxy_stopped_fails_the_call_at_once);
  tcase_add_test(r, init_refuses_a_remote_rank_without_a_ring_and_a_ring_of_another_rank);
  tcase_add_test(r, a_split_call_across_nodes_waits_for_the_remote_receivers_read);
  suite_add_tcase(s, r);
  TCase *p = tcase_create("proxy");
  tcase_set_timeout(p, 120);
  tcase_add_test(p, a_ring_whose_head_is_behind_its_tail_fails_its_job_naming_both);
  tcase_add_test(p, a_daemons_data_connections_hold_little_unsent_ahead_of_a_credit);
  tcase_add_test(p, a_new_jobs_ranks_are_answered_once_its_exchange_regions_are_mapped_in);
  tcase_add_test(p, a_job_that_ends_while_its_regions_are_mapped_in_stops_their_populate);
  suite_add_tcase(s, p);
  return s;
}
