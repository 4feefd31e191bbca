/*
 * check_memory.c — the warm memory as the ranks of a job see it (DESIGN §4,
 * §5).  Every test starts the real deepepd and forks real rank processes,
 * each with its own libdeepep-client handle, that attach through the
 * daemon's rendezvous and then read and write the slabs it lent, through
 * their own mappings.  The tests are specifications of: sharing inside a
 * job, isolation between jobs and users, scrubbing, the buffer cache,
 * deferred pools, ranks that die, an exhausted pool, bad input, and fd and
 * memory leaks over many attaches.
 *
 * One body per test, two memories: on the host backend the slabs are host
 * pointers; with DEP_TEST_BACKEND=cuda they are device pointers, reached
 * through the driver (cuda/cudadrv.h) inside the rank processes only, so
 * the test process itself never initialises CUDA before it forks.
 *
 * A rank runs a small script (FILL, CHECK, SYNC, ...) so that each test
 * reads as the sequence of what its ranks do; SYNC meets the test process
 * through a pipe, where it checks what the daemon reports in between.  The
 * rank processes and what observes the daemon live in memranks.c.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "config_value.h"
#include "daemonwire.h"
#include "deepep.h"
#include "memranks.h"
#include "proto.h"
#include "slab.h"
#include "testutil.h"

#ifndef __has_feature
#define __has_feature(x) 0
#endif

/* Small: 346 KiB a slab at world size 2, 603 and 612 KiB at 4 and 8 (each with 86-88 KiB of
 * private area). */
static const struct dep_job_shape TINY = {.max_tokens_per_rank = 16, .hidden = 1024,
                                          .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};
/* For a world of 6 ranks: a slab of 640 KiB in an arena, like TINY's at 8. */
static const struct dep_job_shape TINY6 = {.max_tokens_per_rank = 20, .hidden = 1024,
                                           .num_experts = 6, .topk = 2,
                                           .dtype = DEP_DTYPE_BF16};
/* About 2 MiB a slab at world size 2, 4 MiB at 4 or 8. */
static const struct dep_job_shape WIDE = {.max_tokens_per_rank = 128, .hidden = 1024,
                                          .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};
/* About 64.3 MiB a slab at world size 4: more than a 64 MiB pool holds. */
static const struct dep_job_shape HUGE = {.max_tokens_per_rank = 1024, .hidden = 4096,
                                          .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};

/* ---- one job -------------------------------------------------------------------- */

START_TEST(eight_ranks_share_one_job_and_read_every_peers_slab) {
  MR_NEEDS_BACKEND();
  struct tu_daemon d;
  mr_start(&d, 64, NULL);
  dep_client_t *obs = mr_observer(&d);
  /* Per GPU, one block of exactly its slabs (to the granule): on the host
   * 33 MiB, which no run of 2 MiB preallocated blocks would be. */
  const uint64_t slab = mr_slab_of(&WIDE, 8, 8), arena = mr_arena_of(&WIDE, 8, 8);
  static const struct mr_step script[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  struct mr_grp g;
  mr_grp_init(&g);
  /* Global ranks run opposite to local ranks, so that mixing the two up shows. */
  for (uint32_t i = 0; i < 8; i++) {
    struct mr_rank_spec s = mr_spec(&d, "moe-8", 7 - i, 8, i, 8, WIDE, script);
    mr_grp_spawn(&g, &s);
  }
  mr_grp_sync(&g, 8); /* every rank has written its slab */
  struct mr_pool_now p = mr_pool_now(obs);
  ck_assert_uint_eq(p.total, mr_gpus() * 64 * MR_MIB); /* a pool per GPU in use */
  ck_assert_uint_eq(p.used, arena);
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status(obs, &st), 0);
  ck_assert_uint_eq(st->num_jobs, 1);
  ck_assert_str_eq(st->jobs[0].job_id, "moe-8");
  ck_assert_uint_eq(st->jobs[0].ranks_attached, 8);
  ck_assert_uint_eq(st->jobs[0].slab_bytes, slab);
  ck_assert_uint_eq(st->jobs[0].owner_uid, getuid());
  dep_status_free(st);
  mr_grp_go(&g, 8);
  mr_grp_sync(&g, 8); /* every rank has read all eight patterns through its own mapping */
  mr_grp_go(&g, 8);
  mr_grp_reap(&g);
  /* The buffer cache (on by default) keeps the slabs, scrubbed, for the next job. */
  mr_wait_pool(obs, 0, arena);
  ck_assert_int_eq(mr_job_ranks(obs, "moe-8"), -1);
  mr_stop_ok(&d, obs);
}
END_TEST

/*
 * An arena larger than pool.max_allocation comes in equal pieces, one fd
 * each (the daemon holds one per piece), and every rank maps them as one
 * range: each fills its whole slab and reads every peer's across the
 * pieces' seams.  On cuda with every rank on one GPU the arena stays one
 * allocation: no peer GPU maps it.
 */
START_TEST(an_arena_over_max_allocation_comes_in_pieces_that_map_as_one) {
  MR_NEEDS_BACKEND();
  const uint64_t cap = 4 * MR_MIB, g = mr_granule(), slab = mr_slab_of(&WIDE, 8, 8);
  const uint32_t gpus = mr_gpus();
  const bool whole = mr_on_cuda() && gpus == 1;
  uint64_t used = 0;
  int pieces = 0;
  for (uint32_t i = 0; i < gpus; i++) { /* local ranks i, i + gpus, ... on GPU i */
    const uint64_t arena = dep_round_up((8 - i + gpus - 1) / gpus * slab, g);
    const uint64_t n = whole ? 1 : (arena + cap - 1) / cap;
    const uint64_t piece = dep_round_up((arena + n - 1) / n, g);
    ck_assert_uint_le(whole ? 0 : piece, cap);
    used += n * piece;
    pieces += (int)n;
  }
  ck_assert_int_ge(pieces, whole ? 1 : 8); /* the arenas are several times the cap */
  struct tu_daemon d;
  /* No reserve, so that the daemon's fds count the job's pieces alone. */
  mr_start_pool(&d, 64, "  max_allocation: 4MiB\n", "preallocation: false\n");
  dep_client_t *obs = mr_observer(&d);
  mr_wait_alone(obs); /* tu_daemon_start's probe connection is gone */
  const int fds_before = mr_daemon_fds(d.pid);
  static const struct mr_step script[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  struct mr_grp grp;
  mr_grp_init(&grp);
  mr_grp_spawn_job(&grp, &d, "in-pieces", 8, WIDE, script);
  mr_grp_sync(&grp, 8); /* every rank has filled its slab */
  ck_assert_uint_eq(mr_pool_now(obs).used, used);
  mr_grp_go(&grp, 8);
  mr_grp_sync(&grp, 8); /* every rank has read all eight patterns */
  mr_grp_go(&grp, 8);
  mr_grp_reap(&grp);
  mr_wait_pool(obs, 0, used); /* cached, pieces and all */
  mr_wait_alone(obs);
  ck_assert_int_eq(mr_daemon_fds(d.pid) - fds_before, pieces);
  mr_stop_ok(&d, obs);
}
END_TEST

/* ---- isolation ---------------------------------------------------------------------- */

START_TEST(two_jobs_of_different_users_cannot_join_or_see_each_other) {
  MR_NEEDS_BACKEND();
  MR_NEEDS_ROOT();
  struct tu_daemon d;
  mr_start(&d, 64, MR_ALLOW_NOBODY);
  dep_client_t *obs = mr_observer(&d);
  static const struct mr_step a_script[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  static const struct mr_step b_script[] = {{CHECK_OWN, 0}, {FILL, 2}, {OWN_JOBS, 1}, {SYNC, 0},
                                            {CHECK, 2}, {END, 0}};
  struct mr_grp ga, gb, gi;
  mr_grp_init(&ga);
  mr_grp_init(&gb);
  mr_grp_init(&gi);
  mr_grp_spawn_job(&ga, &d, "job-root", 2, TINY, a_script);
  mr_grp_sync(&ga, 2);
  /* Another user's job starts beside it: its memory is all zero, its status shows it alone. */
  for (uint32_t i = 0; i < 2; i++) {
    struct mr_rank_spec s = mr_spec(&d, "job-nobody", i, 2, i, 2, TINY, b_script);
    s.uid = MR_NOBODY;
    mr_grp_spawn(&gb, &s);
  }
  mr_grp_sync(&gb, 2);
  /* Neither user can join the other's job. */
  struct mr_rank_spec in = mr_spec(&d, "job-root", 1, 2, 1, 2, TINY, NULL);
  in.uid = MR_NOBODY;
  in.want = DEP_ERR_PERMISSION;
  in.want_msg = "job job-root belongs to another user";
  mr_grp_spawn(&gi, &in);
  in = mr_spec(&d, "job-nobody", 1, 2, 1, 2, TINY, NULL);
  in.want = DEP_ERR_PERMISSION;
  in.want_msg = "job job-nobody belongs to another user";
  mr_grp_spawn(&gi, &in);
  mr_grp_reap(&gi);
  struct mr_pool_now p = mr_pool_now(obs);
  ck_assert_uint_eq(p.jobs, 2);
  ck_assert_uint_eq(p.used, 2 * mr_arena_of(&TINY, 2, 2));
  ck_assert_int_eq(mr_job_ranks(obs, "job-root"), 2);
  ck_assert_int_eq(mr_job_ranks(obs, "job-nobody"), 2);
  /* The first job's bytes are as it wrote them: the other's writes went elsewhere. */
  mr_grp_go(&ga, 2);
  mr_grp_sync(&ga, 2);
  mr_grp_go(&gb, 2);
  mr_grp_reap(&gb);
  mr_grp_go(&ga, 2);
  mr_grp_reap(&ga);
  mr_wait_pool(obs, 0, 2 * mr_arena_of(&TINY, 2, 2));
  mr_stop_ok(&d, obs);
}
END_TEST

/*
 * The first tenant leaves a block behind, cached or (cache off) free, and
 * keeps a mapping of it past DETACH, as a hostile tenant could; the pool's
 * budget holds only one such block.  While that mapping lives, the memory
 * stays charged (held): the second tenant is refused rather than given
 * memory past the budget, and the first cannot see or reach anything of
 * it.  Once the first tenant's processes are gone, the second gets fresh
 * memory, all zero.
 */
static void new_tenant_gets_fresh_memory(bool cache) {
  struct tu_daemon d;
  const uint64_t arena = mr_arena_of(&TINY, 4, 4), budget = 4 * MR_MIB;
  ck_assert_uint_le(arena, budget);
  ck_assert_uint_gt(2 * arena, budget); /* two such blocks do not fit */
  mr_start(&d, (unsigned)(budget / MR_MIB),
           cache ? MR_ALLOW_NOBODY : MR_ALLOW_NOBODY "buffer_cache_enabled: false\n");
  dep_client_t *obs = mr_observer(&d);
  static const struct mr_step a_script[] = {{FILL, 1},        {ALIAS, 0}, {DETACH, 0},
                                            {SYNC, 0},        {CHECK_ALIAS, 0}, {FILL_ALIAS, 3},
                                            {END, 0}};
  static const struct mr_step b_script[] = {{CHECK_OWN, 0}, {FILL, 2}, {SYNC, 0}, {CHECK, 2},
                                            {END, 0}};
  struct mr_grp ga, gb, gc;
  mr_grp_init(&ga);
  mr_grp_init(&gb);
  mr_grp_init(&gc);
  mr_grp_spawn_job(&ga, &d, "tenant-root", 4, TINY, a_script);
  mr_grp_sync(&ga, 4);
  mr_wait_pool(obs, 0, cache ? arena : 0);
  struct mr_pool_now p = mr_pool_now(obs);
  ck_assert_uint_eq(p.held, arena); /* its ranks keep mappings: still theirs */
  for (uint32_t i = 0; i < 4; i++) {
    struct mr_rank_spec s = mr_spec(&d, "tenant-nobody", i, 4, i, 4, TINY, NULL);
    s.uid = MR_NOBODY;
    s.want = DEP_ERR_NO_MEMORY;
    s.want_msg = "still hold";
    mr_grp_spawn(&gb, &s);
  }
  mr_grp_reap(&gb);
  p = mr_pool_now(obs);
  ck_assert_uint_le(p.used + p.held, p.total); /* nothing was made past the budget */
  /* The first tenant's kept mapping shows the scrub; what it writes there reaches nobody. */
  mr_grp_go(&ga, 4);
  mr_grp_reap(&ga);
  for (int i = 0; i < 500 && mr_pool_now(obs).held != 0; i++)
    usleep(10000);
  ck_assert_uint_eq(mr_pool_now(obs).held, 0);
  for (uint32_t i = 0; i < 4; i++) {
    struct mr_rank_spec s = mr_spec(&d, "tenant-nobody", i, 4, i, 4, TINY, b_script);
    s.uid = MR_NOBODY;
    mr_grp_spawn(&gc, &s);
  }
  mr_grp_sync(&gc, 4); /* the new tenant read zeros and wrote its pattern */
  p = mr_pool_now(obs);
  ck_assert_uint_eq(p.used, arena);
  ck_assert_uint_eq(p.cached, 0);
  ck_assert_uint_eq(p.total, budget);
  mr_grp_go(&gc, 4);
  mr_grp_reap(&gc);
  mr_stop_ok(&d, obs);
}

START_TEST(another_users_job_never_sees_old_bytes_even_through_a_kept_mapping) {
  MR_NEEDS_BACKEND_ONE_GPU();
  MR_NEEDS_ROOT();
  new_tenant_gets_fresh_memory(true);  /* the first tenant's block is evicted from the cache */
  new_tenant_gets_fresh_memory(false); /* ... is free, of the very size the second needs */
}
END_TEST

/* ---- buffer cache and deferred pools --------------------------------------------- */

/*
 * Job 1 writes, keeps a mapping and leaves; job 2 of the same shape and uid
 * reads zeros; job 1's kept mapping then shows job 2's bytes, which proves
 * the very same memory was lent again, so the zeros are the scrub's work.
 */
static void reuse_after_scrub(bool cache) {
  struct tu_daemon d;
  /* With the cache, a budget that the job of another shape at the end (6 ranks
   * ranks) fits only by evicting the first job's cached block. */
  const uint64_t first = mr_arena_of(&TINY, 2, 2), whole = mr_arena_of(&TINY6, 6, 6);
  const uint64_t budget = cache ? dep_round_up(whole, MR_CHUNK) : 4 * MR_MIB;
  if (cache)
    ck_assert_uint_gt(first + whole, budget);
  char pool_yaml[64];
  snprintf(pool_yaml, sizeof pool_yaml, "%s",
           cache ? "" : "buffer_cache_enabled: false\n");
  mr_start(&d, (unsigned)(budget / MR_MIB), pool_yaml);
  dep_client_t *obs = mr_observer(&d);
  const uint64_t cached = cache ? first : 0;
  static const struct mr_step one[] = {{FILL, 1}, {ALIAS, 0}, {DETACH, 0}, {SYNC, 0},
                                       {CHECK_ALIAS, 2}, {SYNC, 0}, {END, 0}};
  static const struct mr_step two[] = {{CHECK_OWN, 0}, {FILL, 2}, {SYNC, 0}, {END, 0}};
  struct mr_grp g1, g2;
  mr_grp_init(&g1);
  mr_grp_init(&g2);
  mr_grp_spawn_job(&g1, &d, "first", 2, TINY, one);
  mr_grp_sync(&g1, 2);
  mr_wait_pool(obs, 0, cached); /* between the jobs */
  if (cache) {
    char cmd[700], out[8192] = "";
    snprintf(cmd, sizeof cmd, "%s -s %s --json status", tu_bin("deepepctl"), d.sock);
    FILE *f = popen(cmd, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    ck_assert_int_eq(pclose(f), 0);
    char want[64];
    snprintf(want, sizeof want, "\"pool_cached_bytes\":%llu", (unsigned long long)first);
    ck_assert_msg(strstr(out, want) != NULL, "deepepctl: %s", out);
  }
  mr_grp_spawn_job(&g2, &d, "second", 2, TINY, two);
  mr_grp_sync(&g2, 2);
  /* The first job's block was taken again (cached, or free and of this uid), not a fresh one. */
  mr_wait_pool(obs, first, 0);
  mr_grp_go(&g1, 2);
  mr_grp_sync(&g1, 2);
  mr_grp_go(&g1, 2);
  mr_grp_reap(&g1);
  mr_grp_go(&g2, 2);
  mr_grp_reap(&g2);
  mr_wait_pool(obs, 0, cached);
  if (cache) {
    /* A cached block gives way to a job of another shape that needs its room. */
    static const struct mr_step all[] = {{CHECK, 0}, {SYNC, 0}, {END, 0}};
    struct mr_grp g3;
    mr_grp_init(&g3);
    for (uint32_t i = 0; i < 6; i++) {
      struct mr_rank_spec s = mr_spec(&d, "whole-pool", i, 6, i, 6, TINY6, all);
      mr_grp_spawn(&g3, &s);
    }
    mr_grp_sync(&g3, 6);
    mr_wait_pool(obs, whole, 0);
    ck_assert_uint_eq(mr_pool_now(obs).total, budget);
    mr_grp_go(&g3, 6);
    mr_grp_reap(&g3);
    mr_wait_pool(obs, 0, whole);
  }
  mr_stop_ok(&d, obs);
}

START_TEST(with_the_cache_on_the_next_job_of_the_shape_reuses_scrubbed_slabs) {
  MR_NEEDS_BACKEND_ONE_GPU();
  reuse_after_scrub(true);
}
END_TEST

START_TEST(with_the_cache_off_blocks_return_scrubbed_and_nothing_is_cached) {
  MR_NEEDS_BACKEND_ONE_GPU();
  reuse_after_scrub(false);
}
END_TEST

START_TEST(without_preallocation_the_pool_is_made_on_first_attach) {
  MR_NEEDS_BACKEND_ONE_GPU();
  static const struct mr_step script[] = {{CHECK_OWN, 0}, {FILL, 1}, {SYNC, 0}, {END, 0}};
  for (int pre = 1; pre >= 0; pre--) {
    struct tu_daemon d;
    mr_start(&d, 16, pre ? "preallocation: true\n" : "preallocation: false\n");
    dep_client_t *obs = mr_observer(&d);
    struct mr_pool_now p = mr_pool_now(obs);
    ck_assert_uint_eq(p.total, 16 * MR_MIB); /* reported before any memory is made */
    ck_assert_uint_eq(p.used, 0);
    mr_wait_alone(obs); /* tu_daemon_start's probe connection is gone */
    int fds0 = mr_daemon_fds(d.pid);
    struct mr_grp g;
    mr_grp_init(&g);
    mr_grp_spawn_job(&g, &d, "first", 2, TINY, script);
    mr_grp_sync(&g, 2);
    ck_assert_uint_eq(mr_pool_now(obs).used, mr_arena_of(&TINY, 2, 2));
    mr_grp_go(&g, 2);
    mr_grp_reap(&g);
    mr_wait_pool(obs, 0, mr_arena_of(&TINY, 2, 2));
    mr_wait_alone(obs);
    /* One fd per block: none new when the pool was made at start (the
     * arena's block is a preallocated one, or took the room of one), the
     * arena's block when it was made on demand (and kept for the next job). */
    int grew = mr_daemon_fds(d.pid) - fds0;
    if (pre)
      ck_assert_int_eq(grew, 0);
    else
      ck_assert_int_ge(grew, 1);
    ck_assert_uint_eq(mr_pool_now(obs).total, 16 * MR_MIB);
    mr_stop_ok(&d, obs);
  }
}
END_TEST

/*
 * A preallocated pool, every block free and of pool.chunk_size: a job whose
 * arena is of another size gets one block of exactly that size, made in
 * the room of the free blocks it releases (and the log says so), within
 * the same budget.
 */
START_TEST(a_job_of_a_new_size_gets_one_block_in_the_room_of_free_ones) {
  MR_NEEDS_BACKEND_ONE_GPU();
  struct tu_daemon d;
  mr_start(&d, 4, NULL); /* two preallocated blocks of 2 MiB */
  dep_client_t *obs = mr_observer(&d);
  const uint64_t arena = mr_arena_of(&TINY6, 6, 6);
  ck_assert_uint_gt(arena, MR_CHUNK); /* more than one preallocated block holds */
  ck_assert_uint_le(arena, 4 * MR_MIB);
  static const struct mr_step script[] = {{CHECK_OWN, 0}, {FILL, 1}, {SYNC, 0}, {CHECK, 1},
                                          {END, 0}};
  struct mr_grp g;
  mr_grp_init(&g);
  for (uint32_t i = 0; i < 6; i++) {
    struct mr_rank_spec s = mr_spec(&d, "odd-size", i, 6, i, 6, TINY6, script);
    mr_grp_spawn(&g, &s);
  }
  mr_grp_sync(&g, 6);
  struct mr_pool_now p = mr_pool_now(obs);
  ck_assert_uint_eq(p.total, 4 * MR_MIB);
  ck_assert_uint_eq(p.used, arena);
  ck_assert_uint_eq(p.cached, 0);
  char a[32], want[160];
  config_value_size_text(arena, a, sizeof a);
  snprintf(want, sizeof want, "unmade 2 free and 0 cached block(s), 4 MiB in all, to make room "
           "for a block of %s", a);
  ck_assert_msg(dw_log_has(&d, want, 3000), "the log lacks \"%s\"", want);
  snprintf(want, sizeof want, "made a block of %s (1 allocation(s) of %s) for a job of uid %u",
           a, a, (unsigned)getuid());
  ck_assert_msg(dw_log_has(&d, want, 3000), "the log lacks \"%s\"", want);
  mr_grp_go(&g, 6);
  mr_grp_reap(&g);
  mr_wait_pool(obs, 0, arena);
  mr_stop_ok(&d, obs);
}
END_TEST

/* ---- ranks that die ------------------------------------------------------------------ */

/* The next job after a death attaches and reads nothing of the dead job. */
static void next_job_reads_zero(const struct tu_daemon *d, const char *id, uint32_t lws,
                                const struct dep_job_shape *shape) {
  static const struct mr_step script[] = {{CHECK, 0}, {END, 0}};
  struct mr_grp g;
  mr_grp_init(&g);
  mr_grp_spawn_job(&g, d, id, lws, *shape, script);
  mr_grp_reap(&g);
}

static void sigkill_ranks(bool all) {
  struct tu_daemon d;
  mr_start(&d, 64, NULL);
  dep_client_t *obs = mr_observer(&d);
  const uint64_t arena = mr_arena_of(&WIDE, 4, 4);
  static const struct mr_step script[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  struct mr_grp g;
  mr_grp_init(&g);
  mr_grp_spawn_job(&g, &d, "doomed", 4, WIDE, script);
  mr_grp_sync(&g, 4);
  ck_assert_uint_eq(mr_pool_now(obs).used, arena);
  if (all) {
    for (int i = 0; i < 4; i++)
      mr_grp_kill(&g, i);
    mr_wait_job_ranks(obs, "doomed", -1);
  } else {
    mr_grp_kill(&g, 2);
    mr_wait_job_ranks(obs, "doomed", 3);
    /* Live ranks may still touch the dead rank's slab: it stays lent, unscrubbed. */
    ck_assert_uint_eq(mr_pool_now(obs).used, arena);
    mr_grp_go(&g, 3);
    mr_grp_sync(&g, 3); /* the survivors read all four patterns, the dead rank's too */
    ck_assert_uint_eq(mr_pool_now(obs).used, arena);
    mr_grp_go(&g, 3);
  }
  mr_grp_reap(&g);
  mr_wait_pool(obs, 0, arena);
  mr_wait_alone(obs);
  next_job_reads_zero(&d, "doomed", 4, &WIDE);
  mr_stop_ok(&d, obs);
}

START_TEST(sigkill_of_one_rank_keeps_the_memory_until_the_last_rank_leaves) {
  MR_NEEDS_BACKEND();
  sigkill_ranks(false);
}
END_TEST

START_TEST(sigkill_of_every_rank_returns_the_memory) {
  MR_NEEDS_BACKEND();
  sigkill_ranks(true);
}
END_TEST

START_TEST(sigkill_of_a_rank_mid_attach) {
  MR_NEEDS_BACKEND();
  struct tu_daemon d;
  mr_start(&d, 64, NULL);
  dep_client_t *obs = mr_observer(&d);
  const uint64_t arena = mr_arena_of(&WIDE, 4, 4), small = mr_arena_of(&TINY, 2, 2);
  static const struct mr_step script[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {END, 0}};
  /* A rank killed while it waits in the rendezvous frees its place for a successor. */
  struct mr_grp g;
  mr_grp_init(&g);
  for (uint32_t i = 0; i < 3; i++) {
    struct mr_rank_spec s = mr_spec(&d, "mid", i, 4, i, 4, WIDE, script);
    mr_grp_spawn(&g, &s);
  }
  mr_wait_job_ranks(obs, "mid", 3);
  mr_grp_kill(&g, 1);
  mr_wait_job_ranks(obs, "mid", 2);
  ck_assert_uint_eq(mr_pool_now(obs).used, 0); /* nothing is lent before the rendezvous */
  for (uint32_t i = 1; i < 4; i += 2) {
    struct mr_rank_spec s = mr_spec(&d, "mid", i, 4, i, 4, WIDE, script);
    mr_grp_spawn(&g, &s);
  }
  mr_grp_sync(&g, 4);
  ck_assert_uint_eq(mr_pool_now(obs).used, arena);
  mr_grp_go(&g, 4);
  mr_grp_reap(&g);
  mr_wait_pool(obs, 0, arena);
  /* A job of the shape below first, so that its block is made and cached
   * before the daemon's fds are counted. */
  next_job_reads_zero(&d, "warm", 2, &TINY);
  mr_wait_pool(obs, 0, arena + small);
  mr_wait_alone(obs);
  /* A rank killed after its ATTACH completed the job, before it read the reply:
   * the fds on their way to it must not stay open in the daemon. */
  int fds0 = mr_daemon_fds(d.pid);
  static const struct mr_step lib_script[] = {{FILL, 2}, {SYNC, 0}, {CHECK_OWN, 2}, {END, 0}};
  static const struct mr_step raw_script[] = {{SYNC, 0}, {END, 0}};
  mr_grp_init(&g);
  struct mr_rank_spec s = mr_spec(&d, "mid-raw", 0, 2, 0, 2, TINY, lib_script);
  mr_grp_spawn(&g, &s);
  s = mr_spec(&d, "mid-raw", 1, 2, 1, 2, TINY, raw_script);
  s.raw = true;
  int raw = mr_grp_spawn(&g, &s);
  mr_grp_sync(&g, 2);
  mr_grp_kill(&g, raw);
  mr_wait_job_ranks(obs, "mid-raw", 1);
  ck_assert_uint_eq(mr_pool_now(obs).used, small);
  mr_grp_go(&g, 1);
  mr_grp_reap(&g);
  mr_wait_pool(obs, 0, arena + small);
  mr_wait_alone(obs);
  ck_assert_int_eq(mr_daemon_fds(d.pid), fds0);
  next_job_reads_zero(&d, "after", 2, &TINY);
  mr_stop_ok(&d, obs);
}
END_TEST

/* ---- limits and bad input ------------------------------------------------------------- */

START_TEST(pool_exhaustion_is_no_memory_and_the_rest_carries_on) {
  MR_NEEDS_BACKEND_ONE_GPU();
  struct tu_daemon d;
  const uint64_t budget = 18 * MR_MIB;
  mr_start(&d, (unsigned)(budget / MR_MIB), NULL);
  dep_client_t *obs = mr_observer(&d);
  /* The greedy job fits the budget alone, but not beside the holder. */
  const uint64_t holder = mr_arena_of(&WIDE, 2, 2), greedy = mr_arena_of(&WIDE, 4, 4);
  const uint64_t modest = mr_arena_of(&TINY, 2, 2);
  ck_assert_uint_le(greedy, budget);
  ck_assert_uint_gt(holder + greedy, budget);
  ck_assert_uint_le(holder + modest, budget);
  static const struct mr_step hold[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  static const struct mr_step use[] = {{CHECK_OWN, 0}, {FILL, 3}, {SYNC, 0}, {CHECK, 3}, {END, 0}};
  struct mr_grp ga, gb, gc;
  mr_grp_init(&ga);
  mr_grp_init(&gb);
  mr_grp_init(&gc);
  mr_grp_spawn_job(&ga, &d, "holder", 2, WIDE, hold);
  mr_grp_sync(&ga, 2);
  /* Every rank hears why, with the figures: what it needs, the budget, what live jobs hold. */
  char n[32], t[32], u[32];
  static char want[256];
  snprintf(want, sizeof want, "cannot lend this job a block of %s: its pool's budget is %s and "
           "live jobs hold %s of it; raise pool.size_per_device",
           config_value_size_text(greedy, n, sizeof n), config_value_size_text(budget, t, sizeof t),
           config_value_size_text(holder, u, sizeof u));
  for (uint32_t i = 0; i < 4; i++) {
    struct mr_rank_spec s = mr_spec(&d, "greedy", i, 4, i, 4, WIDE, NULL);
    s.want = DEP_ERR_NO_MEMORY;
    s.want_msg = want;
    mr_grp_spawn(&gb, &s);
  }
  mr_grp_reap(&gb);
  ck_assert_int_eq(mr_job_ranks(obs, "greedy"), -1);
  ck_assert_uint_eq(mr_pool_now(obs).used, holder);
  /* A job that fits still attaches; the holder's memory is untouched. */
  mr_grp_spawn_job(&gc, &d, "modest", 2, TINY, use);
  mr_grp_sync(&gc, 2);
  ck_assert_uint_eq(mr_pool_now(obs).used, holder + modest);
  mr_grp_go(&gc, 2);
  mr_grp_reap(&gc);
  mr_grp_go(&ga, 2);
  mr_grp_sync(&ga, 2);
  mr_grp_go(&ga, 2);
  mr_grp_reap(&ga);
  mr_wait_pool(obs, 0, holder + modest); /* both jobs' blocks, cached */
  /* With no live job left the greedy job fits: the cached blocks give way. */
  next_job_reads_zero(&d, "greedy", 4, &WIDE);
  mr_wait_pool(obs, 0, greedy);
  mr_stop_ok(&d, obs);
}
END_TEST

/* ATTACH on a raw connection: the daemon's own answer, whatever the library checks first. */
static int raw_attach_error(const struct tu_daemon *d, const struct dep_attach_args *a, char *msg,
                            size_t len) {
  int fd = tu_connect_raw(d->sock);
  ck_assert_int_ge(fd, 0);
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct dep_msg_hello h = {.version = DEP_PROTO_VERSION};
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_HELLO, 0, 1, &h), 0);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_ATTACH, 0, 2, a), 0);
  ck_assert_int_eq(send(fd, b.data, b.len, MSG_NOSIGNAL), (ssize_t)b.len);
  proto_buf_free(&b);
  static uint8_t body[DEP_PROTO_MAX_BODY];
  struct dep_frame_hdr fh = {0};
  do {
    uint8_t hdr[DEP_PROTO_HDR_LEN];
    ck_assert_int_eq(recv(fd, hdr, sizeof hdr, MSG_WAITALL), (ssize_t)sizeof hdr);
    ck_assert_int_eq(proto_hdr_decode(hdr, DEP_PROTO_MAX_BODY, &fh, NULL, 0), 0);
    ck_assert_int_eq(recv(fd, body, fh.body_len, MSG_WAITALL), (ssize_t)fh.body_len);
  } while (fh.type == DEP_MSG_HELLO_OK);
  ck_assert_str_eq(proto_type_name(fh.type), "ERROR");
  struct dep_msg_error e;
  ck_assert_int_eq(proto_decode_error(body, fh.body_len, &e), 0);
  snprintf(msg, len, "%s", e.message);
  close(fd);
  return e.code;
}

/*
 * Each refused rank gets its own error; the gathering job it named fails at
 * once for the rank waiting in it, with the same code (DESIGN §5); every
 * job it did not name carries on.
 */
START_TEST(bad_input_fails_its_own_job_at_once_and_every_other_job_carries_on) {
  MR_NEEDS_BACKEND_ONE_GPU();
  struct tu_daemon d;
  /* Whole blocks, refused where they do not fit (auto, the default, would stream few_ll's). */
  mr_start(&d, 64, "stream_chunk_rows: 0\n");
  dep_client_t *obs = mr_observer(&d);
  static const struct mr_step run[] = {{FILL, 1}, {SYNC, 0}, {CHECK, 1}, {SYNC, 0}, {END, 0}};
  struct mr_grp gj, gwait, gbad;
  mr_grp_init(&gj);
  mr_grp_init(&gwait);
  mr_grp_init(&gbad);
  mr_grp_spawn_job(&gj, &d, "steady", 2, TINY, run);
  mr_grp_sync(&gj, 2);
  /* Jobs with a first rank waiting, for the claims below to collide with;
   * each learns of the refusal at once, not after the 30 s attach timeout. */
  static const struct {
    const char *job;
    uint32_t lws;
    int code;
  } waiting[] = {{"dup-local", 2, DEP_ERR_EXISTS},
                 {"dup-rank", 2, DEP_ERR_EXISTS},
                 {"lws", 2, DEP_ERR_MISMATCH}};
  for (int i = 0; i < 3; i++) {
    struct mr_rank_spec s = mr_spec(&d, waiting[i].job, 0, 4, 0, waiting[i].lws, TINY, NULL);
    s.want = waiting[i].code;
    s.want_msg = "cannot start";
    mr_grp_spawn(&gwait, &s);
    mr_wait_job_ranks(obs, waiting[i].job, 1);
  }

  struct mr_rank_spec bad[6];
  bad[0] = mr_spec(&d, "huge", 0, 4, 0, 1, HUGE, NULL);
  bad[0].want = DEP_ERR_NO_MEMORY;
  bad[0].want_msg = "lower max_tokens_per_rank or hidden";
  bad[1] = mr_spec(&d, "past-world", 2, 2, 0, 1, TINY, NULL);
  bad[1].want = DEP_ERR_INVALID;
  bad[1].want_msg = "rank 2 is out of range (allowed 0..1 for world_size 2)";
  bad[2] = mr_spec(&d, "dup-local", 1, 4, 0, 2, TINY, NULL); /* local rank 0 again */
  bad[2].want = DEP_ERR_EXISTS;
  bad[2].want_msg = "local rank 0 of job dup-local is already attached by pid";
  bad[3] = mr_spec(&d, "dup-rank", 0, 4, 1, 2, TINY, NULL); /* global rank 0 again */
  bad[3].want = DEP_ERR_EXISTS;
  bad[3].want_msg = "rank 0 of job dup-rank is already attached by pid";
  bad[4] = mr_spec(&d, "nowhere", 0, 1, 0, 1, TINY, NULL);
  memset(bad[4].a.device_uuid, 0xde, 16);
  bad[4].own_uuid = true;
  bad[4].want = DEP_ERR_NOT_FOUND;
  bad[4].want_msg = "dededede-dede-dede-dede-dededededede";
  bad[5] = mr_spec(&d, "lws", 1, 4, 1, 3, TINY, NULL);
  bad[5].want = DEP_ERR_MISMATCH;
  bad[5].want_msg = "local_world_size 3 but the ranks already attached give 2";
  int64_t t0 = mr_now_ms();
  for (int i = 0; i < 6; i++)
    mr_grp_spawn(&gbad, &bad[i]);
  mr_grp_reap(&gbad);
  mr_grp_reap(&gwait); /* each waiting rank got its job's refusal */
  ck_assert_int_lt(mr_now_ms() - t0, 10000);
  /* The daemon's own checks, for what the library refuses before sending. */
  char msg[DEP_MSG_TEXT_MAX];
  ck_assert_int_eq(raw_attach_error(&d, &bad[1].a, msg, sizeof msg), DEP_ERR_INVALID);
  ck_assert_msg(strstr(msg, "rank 2 is out of range") != NULL, "said: %s", msg);
  /* HUGE's low-latency rows (the default, 256) outweigh any chunk, so it is told no chunk; with
   * one low-latency row, 64-row chunks are the largest power of two whose rank fits 64 MiB
   * (40.3 MiB: deepepctl size --world 4 --ranks-per-node 1 --tokens 1024 --hidden 4096
   * --experts 8 --topk 2 --ll-tokens 1 --chunk-rows 64; 128 rows take 80.4). */
  ck_assert_int_eq(raw_attach_error(&d, &bad[0].a, msg, sizeof msg), DEP_ERR_NO_MEMORY);
  ck_assert_msg(strstr(msg, "stream_chunk_rows") == NULL, "said: %s", msg);
  struct dep_attach_args few_ll = bad[0].a;
  few_ll.shape.max_ll_tokens_per_rank = 1;
  ck_assert_int_eq(raw_attach_error(&d, &few_ll, msg, sizeof msg), DEP_ERR_NO_MEMORY);
  ck_assert_msg(strstr(msg, "or set stream_chunk_rows: 64 on every node (40.3 MiB per rank;") !=
                    NULL,
                "said: %s", msg);
  ck_assert_int_eq(raw_attach_error(&d, &bad[4].a, msg, sizeof msg), DEP_ERR_NOT_FOUND);
  ck_assert_msg(strstr(msg, "device dededede-dede-dede-dede-dededededede is not served") != NULL,
                "said: %s", msg);

  /* The job no refusal named carries on. */
  struct mr_pool_now p = mr_pool_now(obs);
  ck_assert_uint_eq(p.jobs, 1);
  const uint64_t steady = mr_arena_of(&TINY, 2, 2);
  ck_assert_uint_eq(p.used, steady);
  mr_grp_go(&gj, 2);
  mr_grp_sync(&gj, 2);
  mr_grp_go(&gj, 2);
  mr_grp_reap(&gj);
  mr_wait_pool(obs, 0, steady);
  next_job_reads_zero(&d, "afterwards", 2, &TINY);
  mr_stop_ok(&d, obs);
}
END_TEST

/*
 * limits.memory_per_uid charges a uid what it was lent and may still hold
 * (DESIGN §4): ranks that keep a mapping past their job's end keep their
 * uid charged, so its next job is refused with DEP_ERR_LIMIT naming the
 * key, while the pool shows the memory held; once those processes are
 * gone, the same job fits.
 */
START_TEST(memory_ranks_keep_after_their_job_stays_charged_to_their_uid) {
  MR_NEEDS_BACKEND_ONE_GPU();
  const uint64_t first = mr_arena_of(&TINY, 2, 2), second = mr_arena_of(&TINY, 4, 4);
  const uint64_t quota = second > 2 * MR_MIB ? second : 2 * MR_MIB;
  ck_assert_uint_gt(first + second, quota);
  char yaml[128];
  snprintf(yaml, sizeof yaml, "limits:\n  memory_per_uid: %lluKiB\n",
           (unsigned long long)(quota / 1024));
  struct tu_daemon d;
  mr_start(&d, 64, yaml);
  dep_client_t *obs = mr_observer(&d);
  static const struct mr_step keep[] = {{FILL, 1}, {ALIAS, 0}, {DETACH, 0}, {SYNC, 0}, {END, 0}};
  struct mr_grp ga, gb, gc;
  mr_grp_init(&ga);
  mr_grp_init(&gb);
  mr_grp_init(&gc);
  mr_grp_spawn_job(&ga, &d, "keeper", 2, TINY, keep);
  mr_grp_sync(&ga, 2);
  mr_wait_pool(obs, 0, first); /* cached, and still held by the keepers */
  ck_assert_uint_eq(mr_pool_now(obs).held, first);
  for (uint32_t i = 0; i < 4; i++) {
    struct mr_rank_spec s = mr_spec(&d, "over-quota", i, 4, i, 4, TINY, NULL);
    s.want = DEP_ERR_LIMIT;
    s.want_msg = "limits.memory_per_uid";
    mr_grp_spawn(&gb, &s);
  }
  mr_grp_reap(&gb);
  mr_grp_go(&ga, 2);
  mr_grp_reap(&ga);
  for (int i = 0; i < 500 && mr_pool_now(obs).held != 0; i++)
    usleep(10000);
  ck_assert_uint_eq(mr_pool_now(obs).held, 0);
  for (uint32_t i = 0; i < 4; i++) {
    struct mr_rank_spec s = mr_spec(&d, "over-quota", i, 4, i, 4, TINY, NULL);
    mr_grp_spawn(&gc, &s);
  }
  mr_grp_reap(&gc);
  mr_stop_ok(&d, obs);
}
END_TEST


/* The daemon's fds once its transient ones are gone: the fewest of a few
 * looks 5 ms apart (its worker threads open files for a moment, e.g. the
 * held file's write, so one look may see two more than it keeps). */
static int settled_fds(pid_t pid) {
  int least = mr_daemon_fds(pid);
  for (int i = 0; i < 20; i++) {
    dw_sleep_ms(5);
    int n = mr_daemon_fds(pid);
    least = n < least ? n : least;
  }
  return least;
}

/* ---- leaks --------------------------------------------------------------------------- */

START_TEST(a_thousand_attach_detach_cycles_leak_no_fd_or_memory) {
  MR_NEEDS_BACKEND();
#if defined(__SANITIZE_ADDRESS__) || __has_feature(address_sanitizer)
  /* Under make asan the daemon is instrumented too: ASan's quarantine holds
   * freed memory back, which would read as growth. */
  char opts[512];
  const char *old = getenv("ASAN_OPTIONS");
  snprintf(opts, sizeof opts, "%s%squarantine_size_mb=0:thread_local_quarantine_size_kb=0",
           old != NULL ? old : "", old != NULL && old[0] != '\0' ? ":" : "");
  setenv("ASAN_OPTIONS", opts, 1);
#endif
  struct tu_daemon d;
  mr_start(&d, 16, NULL);
  dep_client_t *obs = mr_observer(&d);
  static const struct mr_step script[] = {{CYCLES, 50}, {SYNC, 0}, {CYCLES, 1000}, {SYNC, 0},
                                          {FREED, 0}, {END, 0}};
  struct mr_grp g;
  mr_grp_init(&g);
  struct mr_rank_spec s = mr_spec(&d, "cycling", 0, 1, 0, 1, TINY, script);
  mr_grp_spawn(&g, &s);
  mr_grp_sync(&g, 1); /* warmed up: the daemon's allocations have settled */
  int fds0 = settled_fds(d.pid);
  long rss0 = mr_daemon_rss_kib(d.pid);
  int64_t t0 = mr_now_ms();
  mr_grp_go(&g, 1);
  mr_grp_sync(&g, 1);
  int64_t ms = mr_now_ms() - t0;
  int fds1 = settled_fds(d.pid);
  long rss1 = mr_daemon_rss_kib(d.pid);
  printf("a_thousand_attach_detach_cycles: %lld ms (%.3f ms a cycle); daemon fds %d -> %d, "
         "VmRSS %ld -> %ld KiB\n", (long long)ms, (double)ms / 1000, fds0, fds1, rss0, rss1);
  ck_assert_int_le(fds1, fds0);
  ck_assert_msg(rss1 - rss0 <= 256, "deepepd's VmRSS grew by %ld KiB over 1000 cycles",
                rss1 - rss0);
  mr_grp_go(&g, 1);
  mr_grp_reap(&g);
  mr_wait_pool(obs, 0, mr_arena_of(&TINY, 1, 1));
  mr_stop_ok(&d, obs);
}
END_TEST

Suite *memory_suite(void);
Suite *memory_suite(void) {
  Suite *s = suite_create("memory");
  struct {
    const char *name;
    const TTest *tests[6];
  } cases[] = {
      {"share",
       {eight_ranks_share_one_job_and_read_every_peers_slab,
        an_arena_over_max_allocation_comes_in_pieces_that_map_as_one, NULL}},
      {"isolation",
       {two_jobs_of_different_users_cannot_join_or_see_each_other,
        another_users_job_never_sees_old_bytes_even_through_a_kept_mapping, NULL}},
      {"cache",
       {with_the_cache_on_the_next_job_of_the_shape_reuses_scrubbed_slabs,
        with_the_cache_off_blocks_return_scrubbed_and_nothing_is_cached,
        without_preallocation_the_pool_is_made_on_first_attach,
        a_job_of_a_new_size_gets_one_block_in_the_room_of_free_ones, NULL}},
      {"death",
       {sigkill_of_one_rank_keeps_the_memory_until_the_last_rank_leaves,
        sigkill_of_every_rank_returns_the_memory, sigkill_of_a_rank_mid_attach, NULL}},
      {"limits",
       {pool_exhaustion_is_no_memory_and_the_rest_carries_on,
        bad_input_fails_its_own_job_at_once_and_every_other_job_carries_on,
        memory_ranks_keep_after_their_job_stays_charged_to_their_uid, NULL}},
      {"leaks", {a_thousand_attach_detach_cycles_leak_no_fd_or_memory, NULL}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    TCase *tc = tcase_create(cases[i].name);
    /* Every case runs on device memory too (DEP_TEST_BACKEND=cuda make check-gpu). */
    tcase_set_tags(tc, "gpu");
    tcase_set_timeout(tc, 60);
    for (size_t k = 0; cases[i].tests[k] != NULL; k++)
      tcase_add_test(tc, cases[i].tests[k]);
    suite_add_tcase(s, tc);
  }
  return s;
}
