/*
 * check_stream.c — the throughput operations streaming through bounded
 * channels on real daemons (DESIGN §6, slab.h): daemons configured with
 * stream_chunk_rows lend slabs whose channels hold 4 chunks rather than a
 * block of max_tokens_per_rank rows for each source, say so at attach, and
 * the job's ranks (real processes on the public API, on one node and over
 * two or three nodes, whose channels between nodes pass through the
 * exchange regions and both daemons) get bit for bit what they get with
 * whole blocks.
 */
#include <check.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "nodes.h"
#include "opsworld.h"
#include "ref.h"
#include "slab.h"
#include "testutil.h"
#include "xnbytes.h"
#include "xnjob.h"
#include "xring.h"

/* A ceiling for a job's ranks on a loaded 2-core machine, not a timing. */
#define ST_OP_TIMEOUT_MS 20000

/* Run d's rounds as job on ns, placed as p, into fresh results (munmap'ed by the caller). */
static struct xn_result *st_run(struct nodes *ns, const struct xn_place *p, const char *job,
                                struct ow_case *d) {
  struct xn_run run = {.d = d, .rounds = 2, .alternate_fp8 = true, .modes = true};
  struct xn_result *res = xn_results(d->sc.world);
  xn_run_job(ns, p, job, &run, res);
  return res;
}

/*
 * Each layout's job, run on daemons that stream in chunks of one row (4
 * rows a channel) and of three (12 rows a channel), so that every call
 * streams many chunks, on one node and spread over its nodes, gives every
 * rank bit for bit what the same job gives on daemons of whole blocks;
 * every op (layout, dispatch bf16 and FP8, cached, combine weighted and
 * not, LL between them) against the oracle on the way (xn_round,
 * xn_round_modes).  The layouts include every row to one rank on the other
 * node, rows of all -1 and calls of no tokens (xnjob.c).
 */
START_TEST(a_job_streaming_in_small_chunks_gets_what_whole_blocks_give) {
  const struct xn_layout *L = &xn_layouts[_i];
  ow_seed_init(5000 + (uint64_t)_i);
  struct ow_case *d = xn_case_new(&L->sc, L->sc.fp8);
  const uint32_t n = L->sc.world;
  struct xn_place one, spread;
  memset(&one, 0, sizeof one);
  memset(&spread, 0, sizeof spread);
  uint32_t all[NODES_MAX] = {n};
  xn_place(&one, all, 1);
  xn_place(&spread, L->split, L->nodes);
  struct nodes whole;
  xn_nodes_start(&whole, L->nodes, 20000, ST_OP_TIMEOUT_MS, "");
  struct xn_result *r0 = st_run(&whole, &one, "whole", d);
  nodes_stop(&whole);
  static const uint32_t chunks[] = {1, 3};
  for (size_t k = 0; k < sizeof chunks / sizeof chunks[0]; k++) {
    char cfg[64];
    snprintf(cfg, sizeof cfg, "stream_chunk_rows: %u\n", chunks[k]);
    struct nodes streamed;
    xn_nodes_start(&streamed, L->nodes, 20000, ST_OP_TIMEOUT_MS, cfg);
    struct xn_result *r1 = st_run(&streamed, &one, "stream-one", d);
    struct xn_result *r2 = st_run(&streamed, &spread, "stream-spread", d);
    nodes_stop(&streamed);
    for (uint32_t g = 0; g < n; g++) {
      ck_assert_msg(r1[g].digest == r0[g].digest && r2[g].digest == r0[g].digest,
                    "rank %u got other outputs streaming in chunks of %u (one node %d, %d nodes "
                    "%d) than with whole blocks [%s] (seed %llu)", g, chunks[k],
                    r1[g].digest == r0[g].digest, L->nodes, r2[g].digest == r0[g].digest,
                    d->desc, (unsigned long long)ow_seed);
      ck_assert_uint_eq(atomic_load(&r1[g].rounds), 2);
      ck_assert_uint_eq(atomic_load(&r2[g].rounds), 2);
    }
    printf("stream: %s: chunks of %u rows on one node and over %d nodes as whole blocks\n",
           d->desc, chunks[k], L->nodes);
    munmap(r1, n * sizeof *r1);
    munmap(r2, n * sizeof *r2);
  }
  munmap(r0, n * sizeof *r0);
  xn_case_free(d);
}
END_TEST

/*
 * A receiver on another node that comes late to every round: its senders
 * fill the 4 rows of their channels to it and wait for its credit, which
 * comes back through both daemons, and never write over a row it has not
 * taken: its outputs and everyone's are bit for bit those of whole blocks.
 */
START_TEST(a_sender_outrunning_a_slow_receiver_on_another_node_waits_for_its_credit) {
  ow_seed_init(6100);
  const struct ow_scenario sc = {4, 256, 4, 8, 32, 8, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  struct ow_case *d = xn_case_new(&sc, 0);
  struct xn_place one, spread;
  memset(&one, 0, sizeof one);
  memset(&spread, 0, sizeof spread);
  const uint32_t all[NODES_MAX] = {4}, split[NODES_MAX] = {2, 2};
  xn_place(&one, all, 1);
  xn_place(&spread, split, 2);
  struct nodes whole, streamed;
  xn_nodes_start(&whole, 1, 20000, ST_OP_TIMEOUT_MS, "");
  struct xn_result *r0 = st_run(&whole, &one, "slow-whole", d);
  nodes_stop(&whole);
  xn_nodes_start(&streamed, 2, 20000, ST_OP_TIMEOUT_MS, "stream_chunk_rows: 1\n");
  struct xn_run run = {.d = d, .rounds = 3, .modes = true, .slow_ms = 100, .slow_rank = 3};
  struct xn_result *r1 = xn_results(4);
  xn_run_job(&streamed, &spread, "slow-stream", &run, r1);
  nodes_stop(&streamed);
  for (uint32_t g = 0; g < 4; g++) {
    ck_assert_uint_eq(atomic_load(&r1[g].rounds), 3);
    ck_assert_msg(r1[g].digest != 0, "rank %u has no digest", g);
  }
  /* Three rounds against two: compare the slow job with whole blocks run as long. */
  struct nodes again;
  xn_nodes_start(&again, 1, 20000, ST_OP_TIMEOUT_MS, "");
  struct xn_run run3 = {.d = d, .rounds = 3, .modes = true};
  struct xn_result *r3 = xn_results(4);
  xn_run_job(&again, &one, "slow-whole-3", &run3, r3);
  nodes_stop(&again);
  for (uint32_t g = 0; g < 4; g++)
    ck_assert_msg(r1[g].digest == r3[g].digest, "rank %u: a late receiver on another node changed "
                  "its outputs (seed %llu)", g, (unsigned long long)ow_seed);
  munmap(r0, 4 * sizeof *r0);
  munmap(r1, 4 * sizeof *r1);
  munmap(r3, 4 * sizeof *r3);
  xn_case_free(d);
}
END_TEST

/*
 * The channels between nodes mirror each other's rings, so every node of a
 * job streams in the same chunks: two daemons whose stream_chunk_rows
 * differ fail the job at attach on both nodes, naming the key, rather than
 * writing rows where the other end does not read them.
 */
START_TEST(daemons_streaming_in_other_chunks_fail_the_job_at_attach_saying_so) {
  ow_seed_init(6200);
  const struct ow_scenario sc = {2, 128, 2, 4, 16, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};
  struct ow_case *d = xn_case_new(&sc, 0);
  struct nodes ns;
  char limits[64];
  snprintf(limits, sizeof limits, ", op_timeout_ms: %d", ST_OP_TIMEOUT_MS);
  nodes_config_with(&ns, 2, 20000, limits, "");
  strncat(ns.yaml[1], "stream_chunk_rows: 2\n", sizeof ns.yaml[1] - strlen(ns.yaml[1]) - 1);
  nodes_start_all(&ns);
  struct xn_place p;
  memset(&p, 0, sizeof p);
  const uint32_t split[NODES_MAX] = {1, 1};
  xn_place(&p, split, 2);
  struct xn_run run = {.d = d, .rounds = 1};
  struct xn_result *res = xn_results(2);
  pid_t pids[2];
  xn_spawn(&ns, &p, "chunks-differ", &run, res, pids);
  (void)xn_reap(pids, 2, ST_OP_TIMEOUT_MS * 3);
  for (uint32_t g = 0; g < 2; g++) {
    ck_assert_msg(atomic_load(&res[g].done), "rank %u hung", g);
    ck_assert_msg(res[g].rc == DEP_ERR_MISMATCH && strstr(res[g].msg, "stream_chunk_rows") != NULL,
                  "rank %u: %s, want DEP_ERR_MISMATCH naming stream_chunk_rows: %s", g,
                  dep_errname(res[g].rc), res[g].msg);
  }
  munmap(res, 2 * sizeof *res);
  nodes_stop(&ns);
  xn_case_free(d);
}
END_TEST

/*
 * What a rank is lent follows the channels: a daemon that streams lends
 * each rank the slab of dep__slab_layout_nodes with its chunk, which no
 * longer holds max_tokens_per_rank rows for every source, and dep_status
 * (deepepctl status) says so.
 */
START_TEST(a_streaming_daemon_lends_the_smaller_slab_and_status_shows_it) {
  const struct dep_job_shape shape = {.max_tokens_per_rank = 512, .hidden = 1024,
                                      .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16,
                                      .max_ll_tokens_per_rank = 8};
  struct dep_slab_layout whole, chunked;
  char why[256];
  ck_assert_int_eq(dep__slab_layout_nodes(&shape, 2, 2, 0, &whole, why, sizeof why), 0);
  ck_assert_int_eq(dep__slab_layout_nodes(&shape, 2, 2, 8, &chunked, why, sizeof why), 0);
  ck_assert_uint_eq(chunked.chan_rows, 8 * DEP_SLAB_CHUNKS);
  ck_assert_uint_lt(chunked.total_bytes * 4, whole.total_bytes);
  for (int streamed = 0; streamed < 2; streamed++) {
    struct nodes ns;
    xn_nodes_start(&ns, 1, 20000, ST_OP_TIMEOUT_MS, streamed ? "stream_chunk_rows: 8\n" : "");
    dep_client_t *c[2] = {NULL, NULL};
    int rc[2];
    /* Two ranks attach at once: each dep_attach waits for the other. */
    pid_t child = fork();
    ck_assert_int_ge(child, 0);
    for (uint32_t r = 0; r < 2; r++) {
      if ((r == 1) != (child == 0))
        continue;
      ck_assert_int_eq(dep_client_new(&c[r]), 0);
      ck_assert_int_eq(dep_connect(c[r], ns.d[0].sock), 0);
      struct dep_attach_args a = {.size = sizeof a, .rank = r, .world_size = 2, .local_rank = r,
                                  .local_world_size = 2, .shape = shape};
      snprintf(a.job_id, sizeof a.job_id, "lent-%d", streamed);
      rc[r] = dep_attach(c[r], &a);
      if (child == 0)
        _exit(rc[r] == 0 && dep_detach(c[r]) == 0 ? 0 : 1);
    }
    ck_assert_msg(rc[0] == 0, "attach: %s", dep_errmsg(c[0]));
    struct dep_status *st = NULL;
    ck_assert_int_eq(dep_status(c[0], &st), 0);
    ck_assert_uint_eq(st->num_jobs, 1);
    const uint64_t want = (streamed ? chunked : whole).total_bytes;
    ck_assert_msg(st->jobs[0].slab_bytes >= want && st->jobs[0].slab_bytes < want + 65536,
                  "%s daemon: a slab of %llu bytes, the layout's %llu", streamed ? "a streaming"
                  : "a whole-block", (unsigned long long)st->jobs[0].slab_bytes,
                  (unsigned long long)want);
    ck_assert_uint_eq(st->jobs[0].host_bytes, 0); /* one node: no ring, no exchange region */
    dep_status_free(st);
    int wst = 0;
    ck_assert_int_eq(waitpid(child, &wst, 0), child);
    ck_assert_msg(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "rank 1 failed its attach or detach");
    ck_assert_int_eq(dep_detach(c[0]), 0);
    dep_client_free(c[0]);
    nodes_stop(&ns);
  }
}
END_TEST

/*
 * Between nodes the exchange region follows the channels too: a job of 2 +
 * 2 ranks on two daemons that stream in chunks of 8 rows is lent, per rank,
 * the ring and exchange region of dep__slab_layout_nodes with that chunk,
 * a quarter or less of what whole blocks take, and dep_status (deepepctl
 * status's HOST) says so on both nodes; a job on one node is lent none.
 */
START_TEST(two_streaming_daemons_lend_the_smaller_exchange_region_and_status_shows_it) {
  const struct dep_job_shape shape = {.max_tokens_per_rank = 512, .hidden = 1024,
                                      .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16,
                                      .max_ll_tokens_per_rank = 8};
  struct dep_slab_layout whole, chunked;
  char why[256];
  ck_assert_int_eq(dep__slab_layout_nodes(&shape, 4, 2, 0, &whole, why, sizeof why), 0);
  ck_assert_int_eq(dep__slab_layout_nodes(&shape, 4, 2, 8, &chunked, why, sizeof why), 0);
  ck_assert_uint_lt(chunked.xchg_bytes * 4, whole.xchg_bytes);
  for (int streamed = 0; streamed < 2; streamed++) {
    struct nodes ns;
    xn_nodes_start(&ns, 2, 20000, ST_OP_TIMEOUT_MS,
                   streamed ? "stream_chunk_rows: 8\n" : "stream_chunk_rows: 0\n");
    /* Ranks 1-3 attach in children (each dep_attach waits for the rest),
     * rank 0 here; each child waits for its pipe to close before it
     * detaches, so that the job is whole while status is asked. */
    int hold[2];
    ck_assert_int_eq(pipe(hold), 0);
    pid_t kids[3];
    for (uint32_t r = 1; r < 4; r++) {
      pid_t k = fork();
      ck_assert_int_ge(k, 0);
      if (k == 0) {
        close(hold[1]);
        dep_client_t *c = NULL;
        struct dep_attach_args a = {.size = sizeof a, .rank = r, .world_size = 4,
                                    .local_rank = r % 2, .local_world_size = 2, .shape = shape};
        snprintf(a.job_id, sizeof a.job_id, "xlent-%d", streamed);
        int rc = dep_client_new(&c) == 0 && dep_connect(c, ns.d[r / 2].sock) == 0 &&
                         dep_attach(c, &a) == 0
                     ? 0
                     : 1;
        char b;
        (void)read(hold[0], &b, 1);
        _exit(rc == 0 && dep_detach(c) == 0 ? 0 : 1);
      }
      kids[r - 1] = k;
    }
    close(hold[0]);
    dep_client_t *c = NULL;
    ck_assert_int_eq(dep_client_new(&c), 0);
    ck_assert_int_eq(dep_connect(c, ns.d[0].sock), 0);
    struct dep_attach_args a = {.size = sizeof a, .rank = 0, .world_size = 4, .local_rank = 0,
                                .local_world_size = 2, .shape = shape};
    snprintf(a.job_id, sizeof a.job_id, "xlent-%d", streamed);
    ck_assert_msg(dep_attach(c, &a) == 0, "attach: %s", dep_errmsg(c));
    const uint64_t want = DEP_XRING_BYTES + (streamed ? chunked : whole).xchg_bytes;
    for (int n = 0; n < 2; n++) {
      dep_client_t *q = NULL;
      ck_assert_int_eq(dep_client_new(&q), 0);
      ck_assert_int_eq(dep_connect(q, ns.d[n].sock), 0);
      struct dep_status *st = NULL;
      ck_assert_int_eq(dep_status(q, &st), 0);
      ck_assert_uint_eq(st->num_jobs, 1);
      ck_assert_msg(st->jobs[0].host_bytes == want, "node %d, %s daemons: %llu bytes of pinned "
                    "host a rank, the layout's %llu", n, streamed ? "streaming" : "whole-block",
                    (unsigned long long)st->jobs[0].host_bytes, (unsigned long long)want);
      dep_status_free(st);
      dep_client_free(q);
    }
    close(hold[1]);
    for (int k = 0; k < 3; k++) {
      int wst = 0;
      ck_assert_int_eq(waitpid(kids[k], &wst, 0), kids[k]);
      ck_assert_msg(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "rank %d failed", k + 1);
    }
    ck_assert_int_eq(dep_detach(c), 0);
    dep_client_free(c);
    nodes_stop(&ns);
  }
}
END_TEST

/*
 * One crossing per destination node: a rank's dispatch of one call, over
 * two daemons of 3 ranks each (top-6 of 12 experts: most tokens go to
 * several ranks of the other node), whole blocks and chunks of 1 and 3
 * rows.  What each daemon's proxy sent of rows for the job (deepepctl
 * status's payload_out) is, to the byte, each row once per node other
 * than its sender's that holds one of its experts (layout's row_bytes
 * each), counted here from the test's own topk; and every rank's outputs
 * are the oracle's, bit for bit.  A token for 3 ranks of the other node
 * crosses once, not 3 times.
 */
#define ST_ONE_W 6
struct st_once {
  _Atomic int ready;  /* the rank dispatched and checked what it got */
  int rc;             /* 0, a DEP_ERR_* or 1 (a wrong row) */
  char msg[OW_MSG];
};

/* Rank g: attach (placed as p), one fresh dispatch against the oracle,
 * then hold the job until `hold` closes, so that its counters are read
 * while it runs. */
static int st_once_rank(const struct nodes *ns, const struct xn_place *p, const char *job,
                        const struct ow_case *d, uint32_t g, int hold, struct st_once *res) {
  dep_client_t *c = NULL;
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  struct dep_attach_args a = {.size = sizeof a, .rank = g, .world_size = d->sc.world,
                              .local_rank = p->local[g], .local_world_size = p->lws[g],
                              .shape = d->shape};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, ns->d[p->node[g]].sock);
  if (rc == 0)
    rc = dep_attach(c, &a);
  dep_handle_t *hd = NULL;
  if (rc == 0)
    rc = dep_handle_new(c, &hd);
  const struct ref_rank_in *in = &d->in[g];
  const struct ref_dispatch_out *want = &d->disp[g];
  struct dep_dispatch_args da = {.size = sizeof da, .x = in->x, .topk_idx = d->idx[g],
                                 .index_type = d->sc.itype, .topk_weights = in->topk_weights,
                                 .num_tokens = in->num_tokens, .recv_x = o.rx,
                                 .recv_topk_idx = o.ridx, .recv_topk_weights = o.rw,
                                 .recv_count_per_expert = o.cnt, .num_recv = &o.num_recv};
  if (rc == 0)
    rc = dep_dispatch(c, &da, hd, NULL);
  const size_t n = rc == 0 ? o.num_recv : 0, h = d->sc.hidden, k = d->sc.topk;
  if (rc != 0)
    snprintf(res->msg, sizeof res->msg, "rank %u: %s", g, c ? dep_errmsg(c) : "no client");
  else if (n != want->num_recv || memcmp(o.rx, want->x, n * h * 2) != 0 ||
           memcmp(o.rw, want->topk_weights, n * k * sizeof(float)) != 0 ||
           (d->sc.itype == DEP_INDEX_I32 && memcmp(o.ridx, want->topk_idx, n * k * 4) != 0))
    rc = 1, snprintf(res->msg, sizeof res->msg, "rank %u: %zu rows, the oracle's %u, or their "
                     "bytes, ids or weights differ", g, n, want->num_recv);
  res->rc = rc;
  atomic_store(&res->ready, 1);
  char b;
  (void)read(hold, &b, 1);
  if (hd != NULL)
    dep_handle_free(hd);
  if (c != NULL && dep_detach(c) != 0 && rc == 0)
    rc = DEP_ERR_INTERNAL;
  dep_client_free(c);
  ow_outs_free(&o);
  return rc;
}

/* What the job's proxy on node i sent of rows (xnbytes.h). */
static uint64_t st_payload_out(const struct nodes *ns, int i, const char *job) {
  char why[512] = "";
  const uint64_t v = xn_payload_out(ns, i, job, why, sizeof why);
  ck_assert_msg(v != UINT64_MAX, "%s", why);
  return v;
}

START_TEST(a_dispatch_row_crosses_once_per_destination_node_as_the_daemons_count_it) {
  static const char *const cfgs[] = {"", "stream_chunk_rows: 1\n", "stream_chunk_rows: 3\n"};
  static const uint32_t chunk[] = {0, 1, 3};
  static const char *const how[] = {"whole blocks", "chunks of 1 row", "chunks of 3 rows"};
  ow_seed_init(7100 + (uint64_t)_i);
  const struct ow_scenario sc = {ST_ONE_W, 128, 6, 12, 16, 8, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  struct ow_case *d = xn_case_new(&sc, 0);
  struct xn_place p;
  const uint32_t split[NODES_MAX] = {3, 3};
  xn_place(&p, split, 2);
  struct dep_slab_layout lay;
  char why[256];
  ck_assert_int_eq(dep__slab_layout_nodes(&d->shape, ST_ONE_W, 3, chunk[_i], &lay, why,
                                          sizeof why), 0);
  /* The layout's count: per sending node, each token once per other node
   * that holds one of its experts; and what one crossing per rank was. */
  uint64_t rows[2], per_rank[2];
  xn_cross_rows(d, &p, 2, rows, per_rank);
  ck_assert_msg(per_rank[0] > rows[0] && per_rank[1] > rows[1], "a test whose tokens go to one "
                "rank of a node at most shows nothing (seed %llu)", (unsigned long long)ow_seed);
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, ST_OP_TIMEOUT_MS, cfgs[_i]);
  struct st_once *res = mmap(NULL, ST_ONE_W * sizeof *res, PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(res, MAP_FAILED);
  memset(res, 0, ST_ONE_W * sizeof *res);
  int hold[2];
  ck_assert_int_eq(pipe(hold), 0);
  pid_t kids[ST_ONE_W];
  for (uint32_t g = 0; g < ST_ONE_W; g++) {
    kids[g] = fork();
    ck_assert_int_ge(kids[g], 0);
    if (kids[g] == 0) {
      close(hold[1]);
      _exit(st_once_rank(&ns, &p, "once", d, g, hold[0], &res[g]) == 0 ? 0 : 1);
    }
  }
  close(hold[0]);
  /* Every rank's dispatch returns within the op timeout (ranks that fail say so). */
  for (int waited = 0; waited < 2 * ST_OP_TIMEOUT_MS; waited += 20) {
    uint32_t ready = 0;
    for (uint32_t g = 0; g < ST_ONE_W; g++)
      ready += atomic_load(&res[g].ready) != 0;
    if (ready == ST_ONE_W)
      break;
    dw_sleep_ms(20);
  }
  for (uint32_t g = 0; g < ST_ONE_W; g++)
    ck_assert_msg(atomic_load(&res[g].ready) && res[g].rc == 0, "rank %u: rc %d: %s", g,
                  res[g].rc, res[g].msg);
  const uint64_t got[2] = {st_payload_out(&ns, 0, "once"), st_payload_out(&ns, 1, "once")};
  close(hold[1]);
  bool reaped = xn_reap(kids, ST_ONE_W, 2 * ST_OP_TIMEOUT_MS);
  nodes_stop(&ns);
  for (int i = 0; i < 2; i++)
    ck_assert_msg(got[i] == rows[i] * lay.row_bytes, "node %d sent %llu bytes of rows for one "
                  "dispatch (%s): %llu rows of %llu bytes, once per destination node, are "
                  "%llu; once per destination rank, %llu", i, (unsigned long long)got[i],
                  how[_i], (unsigned long long)rows[i],
                  (unsigned long long)lay.row_bytes,
                  (unsigned long long)(rows[i] * lay.row_bytes),
                  (unsigned long long)(per_rank[i] * lay.row_bytes));
  ck_assert(reaped);
  printf("stream: one dispatch over 2 nodes (%s): %llu + %llu row bytes between nodes, "
         "%llu + %llu once per rank\n", how[_i],
         (unsigned long long)got[0], (unsigned long long)got[1],
         (unsigned long long)(per_rank[0] * lay.row_bytes),
         (unsigned long long)(per_rank[1] * lay.row_bytes));
  munmap(res, ST_ONE_W * sizeof *res);
  xn_case_free(d);
}
END_TEST

/*
 * A rank killed while its job streams (4 ranks in one-row chunks, calls
 * back to back; on one daemon, and 2 + 2 on two, where rank 3's channels
 * to ranks 0 and 1 pass through both daemons): every survivor's call fails
 * with DEP_ERR_PEER naming it, within the op timeout's ceiling rather than
 * hanging on a channel the dead rank will never drain or fill; the daemons
 * then run a new job.
 */
START_TEST(a_rank_killed_mid_stream_fails_the_survivors_with_peer_not_a_hang) {
  ow_seed_init(4242);
  const struct ow_scenario sc = {4, 128, 4, 8, 64, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};
  struct ow_case *d = xn_case_new(&sc, 0);
  const int nodes = 1 + _i;
  struct nodes ns;
  xn_nodes_start(&ns, nodes, 20000, ST_OP_TIMEOUT_MS, "stream_chunk_rows: 1\n");
  struct xn_place p;
  memset(&p, 0, sizeof p);
  const uint32_t split[2][NODES_MAX] = {{4}, {2, 2}};
  xn_place(&p, split[_i], nodes);
  struct xn_run run = {.d = d, .until_error = true};
  struct xn_result *res = xn_results(4);
  pid_t pids[4];
  xn_spawn(&ns, &p, "doomed-stream", &run, res, pids);
  xn_await_rounds(res, 0, 20, 60000);
  const int64_t killed = xn_mono_ms();
  kill(pids[3], SIGKILL);
  (void)xn_reap(pids, 4, ST_OP_TIMEOUT_MS * 3); /* the survivors exit 1: their call failed */
  for (uint32_t g = 0; g < 3; g++) {
    ck_assert_msg(atomic_load(&res[g].done), "rank %u hung after rank 3 was killed", g);
    ck_assert_msg(res[g].rc == DEP_ERR_PEER && strstr(res[g].msg, "rank 3") != NULL,
                  "rank %u: %s, want DEP_ERR_PEER naming rank 3: %s", g, dep_errname(res[g].rc),
                  res[g].msg);
    const int64_t after = res[g].fail_ms - killed;
    ck_assert_msg(after < ST_OP_TIMEOUT_MS, "rank %u failed %lld ms after the kill: %s", g,
                  (long long)after, res[g].msg);
    printf("stream: rank 3 killed mid-stream (%d node(s)): rank %u failed after %lld ms with "
           "%s\n", nodes, g, (long long)after, dep_errname(res[g].rc));
  }
  munmap(res, 4 * sizeof *res);
  struct xn_result *again = st_run(&ns, &p, "after-stream", d);
  for (uint32_t g = 0; g < 4; g++)
    ck_assert_uint_eq(atomic_load(&again[g].rounds), 2);
  munmap(again, 4 * sizeof *again);
  nodes_stop(&ns);
  xn_case_free(d);
}
END_TEST

Suite *stream_suite(void);
Suite *stream_suite(void) {
  Suite *s = suite_create("stream");
  TCase *t = tcase_create("daemons");
  tcase_set_timeout(t, 240);
  tcase_add_loop_test(t, a_job_streaming_in_small_chunks_gets_what_whole_blocks_give, 0,
                      xn_nlayouts);
  tcase_add_test(t, a_streaming_daemon_lends_the_smaller_slab_and_status_shows_it);
  tcase_add_test(t, a_sender_outrunning_a_slow_receiver_on_another_node_waits_for_its_credit);
  tcase_add_test(t, daemons_streaming_in_other_chunks_fail_the_job_at_attach_saying_so);
  tcase_add_test(t, two_streaming_daemons_lend_the_smaller_exchange_region_and_status_shows_it);
  tcase_add_loop_test(t, a_rank_killed_mid_stream_fails_the_survivors_with_peer_not_a_hang, 0, 2);
  tcase_add_loop_test(t, a_dispatch_row_crosses_once_per_destination_node_as_the_daemons_count_it,
                      0, 3);
  suite_add_tcase(s, t);
  return s;
}
