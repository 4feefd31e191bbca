/*
 * check_pool.c — the pool's lending rules, driven directly (daemon/pool.c)
 * on a backend that is the host backend plus two things a test needs: a
 * scrub that can be made to fail, and a count of allocations made.  The
 * daemon-level behaviour (the block a job receives, isolation, the cache,
 * exhaustion) is specified with real daemons in check_job.c and
 * check_memory.c; this suite pins what those cannot reach: the budget under
 * a long random mix of jobs, a scrub that fails, and the eviction order.
 */
#include <check.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "log.h"
#include "pool.h"
#include "testutil.h"

#define KIB 1024ull
#define MIB (1024ull * 1024ull)

static int fail_next_scrubs; /* the next this many scrubs fail */
static int fail_create_at;   /* when > 0, the allocation made as number fail_create_at fails */
static int made;             /* allocations made so far */

static int test_create(struct backend_dev *d, uint64_t bytes, struct chunk_mem *out, char *why,
                       size_t whylen) {
  if (fail_create_at > 0 && made + 1 == fail_create_at) {
    snprintf(why, whylen, "allocation failed on purpose");
    return DEP_ERR_NO_MEMORY;
  }
  int rc = backend_host_ops.chunk_create(d, bytes, out, why, whylen);
  made += rc == 0;
  return rc;
}

static int test_scrub(struct backend_dev *d, struct chunk_mem *m, char *why, size_t whylen) {
  if (fail_next_scrubs > 0) {
    fail_next_scrubs--;
    snprintf(why, whylen, "scrub failed on purpose");
    return DEP_ERR_INTERNAL;
  }
  return backend_host_ops.chunk_scrub(d, m, why, whylen);
}

static const struct backend_ops test_ops = {
    .name = "host",
    .cuts_only_when_set = true,
    .probe = NULL,
    .chunk_create = test_create,
    .chunk_destroy = NULL, /* set from the host backend in setup */
    .chunk_scrub = test_scrub,
    .release_dev = NULL,
};

static struct backend_ops ops;

/* A host pool of budget bytes, reserve 2 MiB, preallocated or not. */
static void pool_open(struct pool *p, uint64_t budget, bool prealloc) {
  log_set_level(LOG_PRIO_WARNING); /* the suite's output stays readable */
  ops = test_ops;
  ops.chunk_destroy = backend_host_ops.chunk_destroy;
  fail_next_scrubs = 0;
  fail_create_at = 0;
  made = 0;
  struct backend_dev dev;
  char why[256] = "";
  ck_assert_int_eq(backend_host_ops.probe(&dev, 1, why, sizeof why), 1);
  ck_assert_int_eq(pool_init(p, &ops, &dev, budget, 2 * MIB, prealloc, why, sizeof why), 0);
}

/* How many fds this process has open. */
static int open_fds(void) {
  int n = 0;
  for (int fd = 0; fd < 4096; fd++)
    n += fcntl(fd, F_GETFD) != -1;
  return n;
}

static ino_t inode_of(const struct pool_block *b) {
  struct stat sb;
  ck_assert_int_eq(fstat(pool_block_fd(b, 0), &sb), 0);
  ck_assert_uint_eq((uint64_t)sb.st_size, pool_block_piece_bytes(b));
  return sb.st_ino;
}

/* The pool's figures agree with its blocks, and stay within the budget. */
static void check_books(const struct pool *p) {
  uint64_t made_b = 0, used = 0, cached = 0;
  uint32_t n = 0;
  for (const struct pool_block *b = p->blocks; b != NULL; b = b->next, n++) {
    ck_assert_uint_eq(pool_block_bytes(b) % p->dev.granularity, 0);
    made_b += pool_block_bytes(b);
    used += b->state == POOL_BLOCK_LENT ? pool_block_bytes(b) : 0;
    cached += b->state == POOL_BLOCK_CACHED ? pool_block_bytes(b) : 0;
  }
  ck_assert_uint_eq(n, p->n_blocks);
  ck_assert_uint_eq(made_b, p->made_bytes);
  ck_assert_uint_eq(used, p->used_bytes);
  ck_assert_uint_eq(cached, p->cached_bytes);
  ck_assert_uint_le(p->made_bytes, p->budget_bytes);
}

/*
 * Many jobs of three uids and five sizes come and go at random, cache on
 * and off, with and without a cap on the pieces: the budget always holds,
 * every lend is exactly the size its layout says, a block is only ever
 * lent to the uid that used it last (or to anyone when fresh), and a
 * refusal happens only when the live jobs leave too little of the budget.
 */
START_TEST(random_jobs_keep_the_budget_and_never_cross_uids) {
  struct pool p;
  pool_open(&p, 16 * MIB, true);
  const uint64_t page = p.dev.granularity;
  const uint64_t sizes[] = {640 * KIB, 2 * MIB, 3 * MIB + 5, 4032 * KIB, 7 * MIB};
  const uint64_t caps[] = {0, 1 * MIB, 3 * MIB};
  struct {
    struct pool_block *b;
    uid_t uid;
  } live[8] = {{0}};
  struct {
    ino_t ino;
    uid_t uid;
  } seen[4096];
  int n_seen = 0;
  unsigned seed = 12345;
  for (int step = 0; step < 3000; step++) {
    int slot = rand_r(&seed) % 8;
    if (live[slot].b != NULL) {
      pool_block_put(live[slot].b, rand_r(&seed) % 2);
      live[slot].b = NULL;
    } else {
      uid_t uid = 1000 + (uid_t)(rand_r(&seed) % 3);
      uint64_t want = sizes[rand_r(&seed) % 5], cap = caps[rand_r(&seed) % 3], piece;
      uint32_t n;
      uint64_t room = p.budget_bytes - p.used_bytes;
      uint64_t size = pool_block_layout(&p, want, cap, &n, &piece);
      ck_assert_uint_lt(size - (want + page - 1) / page * page, n * page);
      char why[512] = "";
      struct pool_block *b = NULL;
      int rc = pool_block_get(&p, want, cap, uid, want ^ uid, 0, &b, why, sizeof why);
      if (size > room) {
        ck_assert_int_eq(rc, DEP_ERR_NO_MEMORY);
        ck_assert_msg(strstr(why, "raise pool.size_per_device") != NULL, "said: %s", why);
      } else {
        ck_assert_msg(rc == 0, "step %d: %s", step, why);
        ck_assert_uint_eq(pool_block_bytes(b), size);
        ck_assert_uint_eq(pool_block_pieces(b), n);
        ino_t ino = inode_of(b);
        int k = 0;
        while (k < n_seen && seen[k].ino != ino)
          k++;
        ck_assert_msg(k == n_seen || seen[k].uid == uid,
                      "step %d: uid %u was lent a block uid %u used", step, (unsigned)uid,
                      (unsigned)seen[k].uid);
        if (k == n_seen) {
          ck_assert_int_lt(n_seen, 4096);
          n_seen++;
        }
        seen[k].ino = ino;
        seen[k].uid = uid;
        live[slot].b = b;
        live[slot].uid = uid;
      }
    }
    check_books(&p);
  }
  for (int i = 0; i < 8; i++)
    if (live[i].b != NULL)
      pool_block_put(live[i].b, true);
  check_books(&p);
  ck_assert_uint_eq(p.used_bytes, 0);
  pool_fini(&p);
}
END_TEST

/* A block whose scrub fails is never lent again: it is unmade, and the next job gets another. */
START_TEST(a_block_that_fails_its_scrub_is_unmade) {
  struct pool p;
  pool_open(&p, 8 * MIB, false);
  char why[512] = "";
  struct pool_block *b = NULL;
  ck_assert_int_eq(pool_block_get(&p, 640 * KIB, 0, 1000, 7, 0, &b, why, sizeof why), 0);
  ino_t first = inode_of(b);
  int fd = dup(pool_block_fd(b, 0)); /* keeps the inode from being reused */
  fail_next_scrubs = 1;
  pool_block_put(b, true);
  ck_assert_uint_eq(p.made_bytes, 0);
  ck_assert_uint_eq(p.used_bytes, 0);
  ck_assert_uint_eq(p.cached_bytes, 0);
  ck_assert_uint_eq(p.n_blocks, 0);
  ck_assert_int_eq(pool_block_get(&p, 640 * KIB, 0, 1000, 7, 0, &b, why, sizeof why), 0);
  ck_assert(inode_of(b) != first);
  ck_assert_int_eq(made, 2);
  pool_block_put(b, true);
  check_books(&p);
  close(fd);
  pool_fini(&p);
}
END_TEST

/*
 * The warm path makes nothing; room for a new size comes from free blocks
 * first, then from the cache, the block cached longest ago first.
 */
START_TEST(room_comes_from_free_blocks_then_the_oldest_cached) {
  struct pool p;
  pool_open(&p, 8 * MIB, false);
  char why[512] = "";
  struct pool_block *a, *b, *c, *d;
  ck_assert_int_eq(pool_block_get(&p, 3 * MIB, 0, 1000, 1, 0, &a, why, sizeof why), 0);
  ck_assert_int_eq(pool_block_get(&p, 3 * MIB, 0, 1000, 2, 0, &b, why, sizeof why), 0);
  ck_assert_int_eq(pool_block_get(&p, 2 * MIB, 0, 1000, 3, 0, &c, why, sizeof why), 0);
  ino_t ia = inode_of(a), ib = inode_of(b);
  pool_block_put(a, true); /* cached first: the oldest */
  pool_block_put(b, true);
  pool_block_put(c, false); /* free */
  ck_assert_int_eq(made, 3);
  /* 1 MiB: the free 2 MiB block makes the room; the cache is untouched. */
  ck_assert_int_eq(pool_block_get(&p, 1 * MIB, 0, 1000, 4, 0, &d, why, sizeof why), 0);
  ck_assert_uint_eq(p.cached_bytes, 6 * MIB);
  ck_assert_uint_eq(p.made_bytes, 7 * MIB);
  pool_block_put(d, false);
  /* 4 MiB: the free 1 MiB block goes, then one cached block, the oldest (a's). */
  ck_assert_int_eq(pool_block_get(&p, 4 * MIB, 0, 1000, 5, 0, &d, why, sizeof why), 0);
  ck_assert_uint_eq(p.cached_bytes, 3 * MIB);
  ck_assert_uint_eq(p.made_bytes, 7 * MIB);
  struct pool_block *again;
  ck_assert_int_eq(pool_block_get(&p, 3 * MIB, 0, 1000, 2, 0, &again, why, sizeof why), 0);
  ck_assert(inode_of(again) == ib); /* b survived, and is the warm block of its shape */
  ck_assert(inode_of(again) != ia);
  ck_assert_int_eq(made, 5);
  pool_block_put(again, true);
  /* A live job holds 4 MiB of 8: 5 MiB is refused with the figures, and the cache stays. */
  struct pool_block *none = NULL;
  ck_assert_int_eq(pool_block_get(&p, 5 * MIB, 0, 1000, 6, 0, &none, why, sizeof why),
                   DEP_ERR_NO_MEMORY);
  ck_assert_msg(strstr(why, "a block of 5 MiB: its pool's budget is 8 MiB and live jobs hold "
                            "4 MiB of it") != NULL, "said: %s", why);
  ck_assert_uint_eq(p.cached_bytes, 3 * MIB);
  ck_assert_int_eq(made, 5);
  pool_block_put(d, true);
  check_books(&p);
  pool_fini(&p);
}
END_TEST

/*
 * A preallocated pool, and jobs of exactly the reserve's size: they take
 * reserve blocks as they are (nothing made).  Freed (cache off), a block
 * goes back to the uid that used it before any unused block does, and
 * never to another uid, who gets an unused one.
 */
START_TEST(reserve_blocks_are_lent_as_they_are_and_free_ones_go_back_to_their_uid) {
  struct pool p;
  pool_open(&p, 8 * MIB, true);
  ck_assert_int_eq(made, 4);
  char why[512] = "";
  struct pool_block *b, *again, *other;
  ck_assert_int_eq(pool_block_get(&p, 2 * MIB - 100, 0, 1000, 1, 0, &b, why, sizeof why), 0);
  ck_assert_uint_eq(pool_block_bytes(b), 2 * MIB);
  ino_t first = inode_of(b);
  pool_block_put(b, false);
  for (int i = 0; i < 3; i++) { /* whatever order the blocks are in */
    ck_assert_int_eq(pool_block_get(&p, 2 * MIB, 0, 1001, 2, 0, &other, why, sizeof why), 0);
    ck_assert(inode_of(other) != first);
    pool_block_put(other, false);
    ck_assert_int_eq(pool_block_get(&p, 2 * MIB, 0, 1000, 1, 0, &again, why, sizeof why), 0);
    ck_assert(inode_of(again) == first);
    pool_block_put(again, false);
  }
  ck_assert_int_eq(made, 4);
  check_books(&p);
  pool_fini(&p);
}
END_TEST

/*
 * What the daemon's start-up warm-up used goes back as if never lent
 * (pool_forget): a block of the reserve's size rejoins the reserve unowned,
 * so that another uid is lent it as it is; one of another size is unmade
 * and the reserve made whole; a block of another shape is left alone; and
 * without preallocation nothing stays made.
 */
START_TEST(the_warm_ups_blocks_go_back_as_if_never_lent) {
  struct pool p;
  char why[512] = "";
  struct pool_block *b, *keep, *got[3];
  const uid_t self = 0, user = 1000;
  pool_open(&p, 8 * MIB, true);
  ck_assert_int_eq(pool_block_get(&p, 2 * MIB, 0, self, 42, 0, &b, why, sizeof why), 0);
  pool_block_put(b, true);
  ck_assert_int_eq(pool_block_get(&p, 2 * MIB, 0, self, 43, 0, &keep, why, sizeof why), 0);
  pool_block_put(keep, true);
  ck_assert_uint_eq(p.cached_bytes, 4 * MIB);
  pool_forget(&p, self, 42);
  ck_assert_uint_eq(p.cached_bytes, 2 * MIB); /* shape 43's stays cached */
  check_books(&p);
  /* Three unowned blocks, the forgotten one among them: all lent as they are. */
  for (int i = 0; i < 3; i++)
    ck_assert_int_eq(pool_block_get(&p, 2 * MIB, 0, user, 7, 0, &got[i], why, sizeof why), 0);
  ck_assert_int_eq(made, 4);
  for (int i = 0; i < 3; i++)
    pool_block_put(got[i], false);
  check_books(&p);
  pool_fini(&p);

  /* Another size replaced a reserve block: unmade, and the reserve made again. */
  pool_open(&p, 8 * MIB, true);
  ck_assert_int_eq(pool_block_get(&p, MIB + 5, 0, self, 42, 0, &b, why, sizeof why), 0);
  ck_assert_int_eq(made, 5);
  pool_block_put(b, true);
  pool_forget(&p, self, 42);
  ck_assert_int_eq(made, 6);
  ck_assert_uint_eq(p.n_blocks, 4);
  ck_assert_uint_eq(p.made_bytes, 8 * MIB);
  ck_assert_uint_eq(p.cached_bytes, 0);
  for (const struct pool_block *x = p.blocks; x != NULL; x = x->next)
    ck_assert(x->state == POOL_BLOCK_FREE && !x->has_owner &&
              pool_block_bytes(x) == 2 * MIB);
  check_books(&p);
  pool_fini(&p);

  /* No reserve: what the warm-up made is unmade. */
  pool_open(&p, 8 * MIB, false);
  ck_assert_int_eq(pool_block_get(&p, 2 * MIB, 0, self, 42, 0, &b, why, sizeof why), 0);
  pool_block_put(b, false);
  pool_forget(&p, self, 42);
  ck_assert_uint_eq(p.n_blocks, 0);
  ck_assert_uint_eq(p.made_bytes, 0);
  check_books(&p);
  pool_fini(&p);
}
END_TEST

/*
 * Under a cap, a block is equal pieces (one fd each), every one at most the
 * cap and a whole number of pages, together the size asked to within a
 * page a piece; every piece is scrubbed between jobs; and the warm path
 * matches the layout, so the same shape asked without the cap gets a block
 * of its own.
 */
START_TEST(a_capped_block_is_equal_scrubbed_pieces) {
  struct pool p;
  pool_open(&p, 32 * MIB, false);
  const uint64_t page = p.dev.granularity, want = 7 * MIB + 5;
  const uint64_t size = (want + page - 1) / page * page;
  char why[512] = "";
  struct pool_block *b = NULL;
  ck_assert_int_eq(pool_block_get(&p, want, 2 * MIB, 1000, 9, 0, &b, why, sizeof why), 0);
  const uint32_t n = pool_block_pieces(b);
  const uint64_t piece = pool_block_piece_bytes(b);
  ck_assert_uint_eq(n, 4);
  ck_assert_uint_le(piece, 2 * MIB);
  ck_assert_uint_eq(piece % page, 0);
  ck_assert_uint_eq(pool_block_bytes(b), n * piece);
  ck_assert_uint_ge(n * piece, size);
  ck_assert_uint_lt(n * piece - size, n * page);
  ck_assert_int_eq(made, 4);
  ino_t ino[4];
  for (uint32_t i = 0; i < n; i++) {
    struct stat sb;
    ck_assert_int_eq(fstat(pool_block_fd(b, i), &sb), 0);
    ck_assert_uint_eq((uint64_t)sb.st_size, piece);
    ino[i] = sb.st_ino;
    for (uint32_t k = 0; k < i; k++)
      ck_assert(ino[k] != ino[i]);
    /* The job writes into every piece, last byte included. */
    uint8_t *m = mmap(NULL, piece, PROT_READ | PROT_WRITE, MAP_SHARED, pool_block_fd(b, i), 0);
    ck_assert(m != MAP_FAILED);
    m[0] = m[piece - 1] = 0xA5;
    munmap(m, piece);
  }
  ck_assert_int_eq(pool_block_fd(b, n), -1);
  check_books(&p);
  pool_block_put(b, true);
  /* The same shape without a cap: another layout, so a block of its own. */
  struct pool_block *whole = NULL;
  ck_assert_int_eq(pool_block_get(&p, want, 0, 1000, 9, 0, &whole, why, sizeof why), 0);
  ck_assert_uint_eq(pool_block_pieces(whole), 1);
  ck_assert_uint_eq(pool_block_bytes(whole), size);
  ck_assert_int_eq(made, 5);
  pool_block_put(whole, false);
  /* With the cap again: the cached block, every piece scrubbed. */
  struct pool_block *again = NULL;
  ck_assert_int_eq(pool_block_get(&p, want, 2 * MIB, 1000, 9, 0, &again, why, sizeof why), 0);
  ck_assert_ptr_eq(again, b);
  ck_assert_int_eq(made, 5);
  for (uint32_t i = 0; i < n; i++) {
    uint8_t *m = mmap(NULL, piece, PROT_READ, MAP_SHARED, pool_block_fd(again, i), 0);
    ck_assert(m != MAP_FAILED);
    ck_assert_msg(m[0] == 0 && m[piece - 1] == 0, "piece %u was not scrubbed", i);
    munmap(m, piece);
  }
  /* A scrub that fails on a piece drops the whole block. */
  fail_next_scrubs = 1;
  pool_block_put(again, true);
  ck_assert_uint_eq(p.n_blocks, 1);
  ck_assert_uint_eq(p.made_bytes, size);
  check_books(&p);
  pool_fini(&p);
}
END_TEST

/*
 * A block whose third piece cannot be made: the error says which
 * allocation failed, the two made are given back (their fds closed), and
 * the pool's books are as before; the next try makes the whole block.
 */
START_TEST(a_block_that_fails_midway_gives_back_its_pieces) {
  struct pool p;
  pool_open(&p, 32 * MIB, false);
  char why[512] = "";
  struct pool_block *b = NULL;
  const int fds_before = open_fds();
  fail_create_at = 3;
  ck_assert_int_eq(pool_block_get(&p, 8 * MIB, 2 * MIB, 1000, 1, 0, &b, why, sizeof why),
                   DEP_ERR_NO_MEMORY);
  ck_assert_msg(strstr(why, "allocation 3 of 4") != NULL &&
                    strstr(why, "allocation failed on purpose") != NULL, "said: %s", why);
  ck_assert_int_eq(open_fds(), fds_before);
  ck_assert_uint_eq(p.n_blocks, 0);
  ck_assert_uint_eq(p.made_bytes, 0);
  ck_assert_uint_eq(p.used_bytes, 0);
  fail_create_at = 0;
  ck_assert_int_eq(pool_block_get(&p, 8 * MIB, 2 * MIB, 1000, 1, 0, &b, why, sizeof why), 0);
  ck_assert_uint_eq(pool_block_pieces(b), 4);
  check_books(&p);
  pool_block_put(b, false);
  pool_fini(&p);
  ck_assert_int_eq(open_fds(), fds_before);
}
END_TEST

/*
 * The layout's edges: no cap is one piece; a cap below the granularity is
 * the granularity; past POOL_MAX_PIECES the pieces grow beyond the cap
 * rather than multiply.
 */
START_TEST(the_layout_keeps_to_whole_pages_and_at_most_max_pieces) {
  struct pool p;
  pool_open(&p, 8 * MIB, false);
  const uint64_t page = p.dev.granularity;
  uint32_t n;
  uint64_t piece;
  ck_assert_uint_eq(pool_block_layout(&p, 5 * MIB + 1, 0, &n, &piece), 5 * MIB + page);
  ck_assert_uint_eq(n, 1);
  ck_assert_uint_eq(pool_block_layout(&p, 3 * page, 1, &n, &piece), 3 * page);
  ck_assert_uint_eq(n, 3);
  ck_assert_uint_eq(piece, page);
  const uint64_t big = (uint64_t)(POOL_MAX_PIECES * 2 + 3) * page;
  ck_assert_uint_eq(pool_block_layout(&p, big, page, &n, &piece), POOL_MAX_PIECES * 3 * page);
  ck_assert_uint_eq(n, POOL_MAX_PIECES);
  ck_assert_uint_eq(piece, 3 * page);
  ck_assert_uint_eq(pool_block_layout(&p, 4 * MIB, 2 * MIB, &n, &piece), 4 * MIB);
  ck_assert_uint_eq(n, 2);
  pool_fini(&p);
}
END_TEST

static int unregistered;             /* test_unregister calls */
static bool mapped_when_unregistered; /* the region's last byte still read back then */

static void test_unregister(struct pool_region *r) {
  mapped_when_unregistered = ((volatile uint8_t *)r->map)[r->bytes - 1] == 0x5a;
  unregistered++;
  r->unregister = NULL;
}

/*
 * The pool knows no NIC: what registered a region elsewhere (nicreg.c, on
 * the RDMA device) hangs its undo on the region, and the pool runs it once
 * when it unmakes the region, while the memory is still mapped (a NIC must
 * never be left registered on unmapped memory).  A region cached for its
 * uid's next job keeps its registration; the pool's end unmakes it too.
 */
START_TEST(a_region_is_unregistered_once_before_it_is_unmapped) {
  struct pool p;
  pool_open(&p, 8 * MIB, false);
  unregistered = 0;
  char why[256] = "";
  struct pool_region *r = NULL, *again = NULL;
  ck_assert_int_eq(pool_region_get(&p, MIB, 1000, 7, 0, &r, why, sizeof why), 0);
  ((uint8_t *)r->map)[r->bytes - 1] = 0x5a;
  r->unregister = test_unregister;
  pool_region_put(r, true);
  ck_assert_int_eq(unregistered, 0);
  ck_assert_int_eq(pool_region_get(&p, MIB, 1000, 7, 0, &again, why, sizeof why), 0);
  ck_assert_ptr_eq(again, r);
  ck_assert(again->warm);
  pool_region_put(again, false);
  ck_assert_int_eq(unregistered, 1);
  ck_assert(mapped_when_unregistered);

  mapped_when_unregistered = false;
  ck_assert_int_eq(pool_region_get(&p, MIB, 1000, 8, 0, &r, why, sizeof why), 0);
  ((uint8_t *)r->map)[r->bytes - 1] = 0x5a;
  r->unregister = test_unregister;
  pool_region_put(r, true);
  pool_fini(&p);
  ck_assert_int_eq(unregistered, 2);
  ck_assert(mapped_when_unregistered);
}
END_TEST

/*
 * Arrows point down (STYLE: lower modules take callbacks; DESIGN §2): the
 * pool leaves the NIC to the layer that registers its regions (above), and
 * the device list formats and reads UUIDs with proto/uuid.h, not through
 * the CUDA driver's seam, which only the cuda backend and the kernel
 * checks call.  Read from the objects as built (nm -u: what each calls), so that
 * an include added later that brings the arrow back fails here.
 */
static const struct {
  const char *obj;       /* under DEP_BUILD */
  const char *never[3];  /* prefixes of what it must not call */
} layers[] = {
    {"obj/daemon/pool.o", {"nicreg_", "rdmaxp_", "ibv_"}},
    {"obj/daemon/devices.o", {"cudadrv_", NULL}},
};

START_TEST(the_pools_and_their_device_list_call_nothing_above_them) {
  for (size_t i = 0; i < sizeof layers / sizeof layers[0]; i++) {
    char cmd[700], line[512];
    snprintf(cmd, sizeof cmd, "nm -u %s 2>&1", tu_bin(layers[i].obj));
    FILE *f = popen(cmd, "r");
    ck_assert_ptr_nonnull(f);
    int n = 0;
    while (fgets(line, sizeof line, f) != NULL) {
      char kind[8], name[256];
      ck_assert_msg(sscanf(line, "%7s %255s", kind, name) == 2 && strcmp(kind, "U") == 0,
                    "%s: unexpected nm line: %s", layers[i].obj, line);
      n++;
      for (size_t k = 0; k < 3 && layers[i].never[k] != NULL; k++)
        ck_assert_msg(strncmp(name, layers[i].never[k], strlen(layers[i].never[k])) != 0,
                      "%s calls %s", layers[i].obj, name);
    }
    ck_assert_msg(pclose(f) == 0, "nm -u %s failed (binutils)", tu_bin(layers[i].obj));
    /* Every object here calls libc and the log at least: none read means nm read nothing. */
    ck_assert_msg(n > 0, "nm -u %s listed nothing", tu_bin(layers[i].obj));
  }
}
END_TEST

Suite *pool_suite(void);
Suite *pool_suite(void) {
  Suite *s = suite_create("pool");
  TCase *tc = tcase_create("lending");
  /* The random walk makes and scrubs some 1,500 memfds: 3.5 s of system
   * time on the 2-core dev machine, past Check's default 4 s when the other
   * core is busy (seen twice there). */
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, random_jobs_keep_the_budget_and_never_cross_uids);
  tcase_add_test(tc, a_block_that_fails_its_scrub_is_unmade);
  tcase_add_test(tc, room_comes_from_free_blocks_then_the_oldest_cached);
  tcase_add_test(tc, reserve_blocks_are_lent_as_they_are_and_free_ones_go_back_to_their_uid);
  tcase_add_test(tc, the_warm_ups_blocks_go_back_as_if_never_lent);
  tcase_add_test(tc, a_capped_block_is_equal_scrubbed_pieces);
  tcase_add_test(tc, a_block_that_fails_midway_gives_back_its_pieces);
  tcase_add_test(tc, the_layout_keeps_to_whole_pages_and_at_most_max_pieces);
  tcase_add_test(tc, a_region_is_unregistered_once_before_it_is_unmapped);
  suite_add_tcase(s, tc);
  TCase *layer = tcase_create("layers");
  tcase_add_test(layer, the_pools_and_their_device_list_call_nothing_above_them);
  suite_add_tcase(s, layer);
  return s;
}
