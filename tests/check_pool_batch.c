/*
 * check_pool_batch.c — the pool's batches of copies (daemon/pool.c pool_batch) on the host
 * backend, through a backend that records what it is handed: every word lands, in the order
 * listed, one backend batch per device (on cuda, one wait for the GPU: backend.h), cut into
 * pieces no larger than the backend's staging, and a failed copy fails the batch.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "log.h"
#include "pool.h"

#define KIB 1024ull
#define MIB (1024ull * 1024ull)

/* One copy the backend was handed, and in which of its batches (counted from 1). */
struct rec {
  const struct chunk_mem *m;
  uint64_t off;
  size_t len;
  bool write, zeros;
  unsigned call;
};
static struct rec recs[512];
static unsigned n_recs, calls;
static size_t most_staged; /* the most bytes one batch copied through buf */
static unsigned fail_call;  /* > 0: the batch with this number fails */

static int rec_batch(struct backend_dev *d, const struct chunk_io *io, size_t n, char *why,
                     size_t whylen) {
  calls++;
  if (calls == fail_call) {
    snprintf(why, whylen, "copy failed on purpose");
    return DEP_ERR_CUDA;
  }
  size_t staged = 0;
  for (size_t i = 0; i < n; i++) {
    ck_assert_uint_lt(n_recs, sizeof recs / sizeof recs[0]);
    recs[n_recs++] =
        (struct rec){io[i].m, io[i].off, io[i].len, !io[i].read, io[i].buf == NULL, calls};
    staged += io[i].buf != NULL ? io[i].len : 0;
  }
  most_staged = staged > most_staged ? staged : most_staged;
  return backend_host_ops.chunk_batch(d, io, n, why, whylen);
}

static struct backend_ops ops;

/* A host pool of 8 MiB whose batches rec_batch sees, staging at most stage bytes each. */
static void pool_open(struct pool *p, size_t stage) {
  log_set_level(LOG_PRIO_WARNING);
  ops = backend_host_ops;
  ops.chunk_batch = rec_batch;
  ops.batch_bytes = stage;
  n_recs = calls = fail_call = 0;
  most_staged = 0;
  struct backend_dev dev;
  char why[256] = "";
  ck_assert_int_eq(backend_host_ops.probe(&dev, 1, why, sizeof why), 1);
  ck_assert_int_eq(pool_init(p, &ops, &dev, 8 * MIB, 2 * MIB, false, why, sizeof why), 0);
}

/* A block of 64 KiB in four pieces of 16 KiB. */
static struct pool_block *block4(struct pool *p) {
  char why[256] = "";
  struct pool_block *b = NULL;
  ck_assert_int_eq(pool_block_get(p, 64 * KIB, 16 * KIB, 1000, 1, 0, &b, why, sizeof why), 0);
  ck_assert_uint_eq(pool_block_pieces(b), 4);
  ck_assert_uint_eq(pool_block_piece_bytes(b), 16 * KIB);
  return b;
}

/* Byte off of block b, through the daemon's own mapping of its piece. */
static uint8_t *at(struct pool_block *b, uint64_t off) {
  return (uint8_t *)b->piece[off / b->piece_bytes].host_ptr + off % b->piece_bytes;
}

static void expect_rec(unsigned i, const struct pool_block *b, uint32_t piece, uint64_t off,
                       size_t len, bool zeros, unsigned call) {
  ck_assert_uint_lt(i, n_recs);
  ck_assert_msg(recs[i].m == &b->piece[piece] && recs[i].off == off && recs[i].len == len &&
                    recs[i].zeros == zeros && recs[i].call == call,
                "copy %u: piece %ld off %llu len %zu zeros %d batch %u; wanted piece %u off %llu "
                "len %zu zeros %d batch %u", i, (long)(recs[i].m - b->piece),
                (unsigned long long)recs[i].off, recs[i].len, recs[i].zeros, recs[i].call, piece,
                (unsigned long long)off, len, zeros, call);
}

/*
 * Writes across a piece boundary, zeros, and two writes of one word: the
 * backend gets them in one batch, cut at the pieces, in the order listed,
 * so the later word of the two is the one that stays, and every byte is
 * where it was sent.
 */
START_TEST(every_word_lands_in_the_order_listed_in_one_batch) {
  struct pool p;
  pool_open(&p, 4096);
  struct pool_block *b = block4(&p);
  memset(at(b, 20 * KIB), 0xff, 200);
  uint8_t across[24];
  for (unsigned i = 0; i < sizeof across; i++)
    across[i] = (uint8_t)(i + 1);
  uint64_t first = 0x1111, second = 0x2222;
  const struct pool_io io[] = {
      {b, 16 * KIB - 8, across, sizeof across, false},
      {b, 20 * KIB, NULL, 100, false},
      {b, 40 * KIB, &first, sizeof first, false},
      {b, 40 * KIB, &second, sizeof second, false},
  };
  char why[256] = "";
  ck_assert_int_eq(pool_batch(io, 4, why, sizeof why), 0);
  ck_assert_uint_eq(calls, 1);
  ck_assert_uint_eq(n_recs, 5);
  expect_rec(0, b, 0, 16 * KIB - 8, 8, false, 1);
  expect_rec(1, b, 1, 0, 16, false, 1);
  expect_rec(2, b, 1, 4 * KIB, 100, true, 1);
  expect_rec(3, b, 2, 8 * KIB, 8, false, 1);
  expect_rec(4, b, 2, 8 * KIB, 8, false, 1);
  for (unsigned i = 0; i < sizeof across; i++)
    ck_assert_uint_eq(*at(b, 16 * KIB - 8 + i), i + 1);
  for (unsigned i = 0; i < 100; i++)
    ck_assert_uint_eq(*at(b, 20 * KIB + i), 0);
  ck_assert_uint_eq(*at(b, 20 * KIB + 100), 0xff);
  uint64_t w;
  memcpy(&w, at(b, 40 * KIB), sizeof w);
  ck_assert_uint_eq(w, second);
  pool_block_put(b, false);
  pool_fini(&p);
}
END_TEST

/* What a batch wrote, a read batch of other ranges and lengths gives back, in one batch. */
START_TEST(a_read_batch_returns_what_was_written) {
  struct pool p;
  pool_open(&p, 64 * KIB);
  struct pool_block *b = block4(&p);
  static uint8_t in[3][5000], out[3][5000];
  const uint64_t off[3] = {100, 16 * KIB - 2500, 64 * KIB - 5000};
  struct pool_io w[3], r[3];
  for (unsigned k = 0; k < 3; k++) {
    for (unsigned i = 0; i < sizeof in[k]; i++)
      in[k][i] = (uint8_t)(i * 7 + k * 31 + 1);
    w[k] = (struct pool_io){b, off[k], in[k], sizeof in[k], false};
    r[k] = (struct pool_io){b, off[k], out[k], sizeof out[k], true};
  }
  char why[256] = "";
  ck_assert_int_eq(pool_batch(w, 3, why, sizeof why), 0);
  ck_assert_int_eq(pool_batch(r, 3, why, sizeof why), 0);
  ck_assert_uint_eq(calls, 2);
  for (unsigned k = 0; k < 3; k++)
    ck_assert_msg(memcmp(in[k], out[k], sizeof in[k]) == 0, "read %u differs", k);
  /* One word, as pool_block_read reads the counters. */
  uint64_t word = 0;
  ck_assert_int_eq(pool_block_read(b, 100, &word, sizeof word, why, sizeof why), 0);
  ck_assert_mem_eq(&word, in[0], sizeof word);
  pool_block_put(b, false);
  pool_fini(&p);
}
END_TEST

/*
 * More bytes than the staging holds: pieces of at most its size, one after
 * another in the order listed (the later write of a byte stays); zeros are
 * not staged; and more copies than one backend batch takes go in two.
 */
START_TEST(a_batch_larger_than_the_staging_goes_in_pieces) {
  struct pool p;
  pool_open(&p, 40);
  struct pool_block *b = block4(&p);
  uint8_t a[100], c[30], back[130];
  memset(a, 0xaa, sizeof a);
  memset(c, 0xcc, sizeof c);
  memset(at(b, 1000), 0xff, 5000);
  const struct pool_io io[] = {{b, 0, a, sizeof a, false},
                               {b, 1000, NULL, 5000, false},
                               {b, 8, c, sizeof c, false}};
  char why[256] = "";
  ck_assert_int_eq(pool_batch(io, 3, why, sizeof why), 0);
  ck_assert_uint_le(most_staged, 40);
  ck_assert_uint_eq(calls, 4); /* 130 bytes staged, 40 a batch */
  for (unsigned i = 0; i < 100; i++)
    ck_assert_uint_eq(*at(b, i), i >= 8 && i < 38 ? 0xcc : 0xaa);
  for (unsigned i = 0; i < 5000; i++)
    ck_assert_uint_eq(*at(b, 1000 + i), 0);
  /* A read of more than the staging, in pieces too. */
  calls = 0;
  const struct pool_io r = {b, 0, back, sizeof back, true};
  ck_assert_int_eq(pool_batch(&r, 1, why, sizeof why), 0);
  ck_assert_uint_eq(calls, 4);
  ck_assert_mem_eq(back, at(b, 0), sizeof back);
  /* 70 copies of one byte each: more than a backend batch is handed at once. */
  calls = 0;
  ops.batch_bytes = SIZE_MAX;
  struct pool_io many[70];
  uint8_t bytes[70];
  for (unsigned i = 0; i < 70; i++) {
    bytes[i] = (uint8_t)(i + 1);
    many[i] = (struct pool_io){b, 2000 + 2 * i, &bytes[i], 1, false};
  }
  ck_assert_int_eq(pool_batch(many, 70, why, sizeof why), 0);
  ck_assert_uint_eq(calls, 2);
  for (unsigned i = 0; i < 70; i++)
    ck_assert_uint_eq(*at(b, 2000 + 2 * i), i + 1);
  pool_block_put(b, false);
  pool_fini(&p);
}
END_TEST

/*
 * A copy that fails fails the batch with the backend's words, and no piece
 * after it is sent; a copy past the end of its block is refused before any
 * copy is made.
 */
START_TEST(a_failing_copy_fails_the_whole_batch) {
  struct pool p;
  pool_open(&p, 40);
  struct pool_block *b = block4(&p);
  uint8_t a[100];
  memset(a, 0xaa, sizeof a);
  const struct pool_io io = {b, 0, a, sizeof a, false};
  char why[256] = "";
  fail_call = 2;
  ck_assert_int_eq(pool_batch(&io, 1, why, sizeof why), DEP_ERR_CUDA);
  ck_assert_str_eq(why, "copy failed on purpose");
  ck_assert_uint_eq(calls, 2); /* the third piece was never sent */
  ck_assert_uint_eq(*at(b, 39), 0xaa);
  ck_assert_uint_eq(*at(b, 40), 0);
  /* Past the end: nothing is copied, the valid first copy included. */
  calls = 0;
  fail_call = 0;
  memset(at(b, 0), 0, 100);
  const struct pool_io past[] = {{b, 0, a, 8, false}, {b, 64 * KIB - 4, a, 8, false}};
  ck_assert_int_eq(pool_batch(past, 2, why, sizeof why), DEP_ERR_INVALID);
  ck_assert_msg(strstr(why, "passes the end of a block of 65536 bytes") != NULL, "%s", why);
  ck_assert_uint_eq(calls, 0);
  ck_assert_uint_eq(*at(b, 0), 0);
  const struct pool_io huge = {b, 64 * KIB + 1, a, 0, true};
  ck_assert_int_eq(pool_batch(&huge, 1, why, sizeof why), DEP_ERR_INVALID);
  /* A read with nowhere to go. */
  const struct pool_io nowhere = {b, 0, NULL, 8, true};
  ck_assert_int_eq(pool_batch(&nowhere, 1, why, sizeof why), DEP_ERR_INVALID);
  ck_assert_msg(strstr(why, "has nowhere to go") != NULL, "%s", why);
  ck_assert_uint_eq(calls, 0);
  pool_block_put(b, false);
  pool_fini(&p);
}
END_TEST

/*
 * Reads and writes in one batch, as a daemon writes an epoch and then reads
 * the call counters: each read sees the writes listed before it and none
 * after, and the whole is one backend batch (one wait for the GPU on cuda).
 */
START_TEST(a_read_in_a_batch_sees_the_writes_listed_before_it) {
  struct pool p;
  pool_open(&p, 4096);
  struct pool_block *b = block4(&p);
  uint64_t old = 7, mid = 8, last = 0x900000009ull, seen[3] = {0, 0, 0};
  memcpy(at(b, 16 * KIB + 64), &old, sizeof old);
  const struct pool_io io[] = {
      {b, 16 * KIB + 64, &seen[0], 8, true},
      {b, 16 * KIB + 64, &mid, 8, false},
      {b, 16 * KIB + 64, &seen[1], 8, true},
      {b, 16 * KIB + 64, &last, 8, false},
      {b, 16 * KIB + 64, NULL, 4, false},
      {b, 16 * KIB + 64, &seen[2], 8, true},
  };
  char why[256] = "";
  ck_assert_int_eq(pool_batch(io, 6, why, sizeof why), 0);
  ck_assert_uint_eq(calls, 1);
  ck_assert_uint_eq(seen[0], old);
  ck_assert_uint_eq(seen[1], mid);
  ck_assert_uint_eq(seen[2], last & ~0xffffffffull); /* its low half zeroed after it */
  for (unsigned i = 0; i < 6; i++)
    ck_assert_uint_eq(recs[i].write, !io[i].read);
  pool_block_put(b, false);
  pool_fini(&p);
}
END_TEST

/* Blocks of two devices, listed in turn: one backend batch a device, each in the listed order. */
START_TEST(each_devices_copies_are_one_batch) {
  struct pool p, q;
  pool_open(&p, 4096);
  struct backend_dev dev;
  char why[256] = "";
  ck_assert_int_eq(backend_host_ops.probe(&dev, 1, why, sizeof why), 1);
  ck_assert_int_eq(pool_init(&q, &ops, &dev, 8 * MIB, 2 * MIB, false, why, sizeof why), 0);
  struct pool_block *a = block4(&p), *b = block4(&q);
  uint64_t w[4] = {1, 2, 3, 4};
  const struct pool_io io[] = {{a, 8, &w[0], 8, false}, {b, 16, &w[1], 8, false},
                               {a, 24, &w[2], 8, false}, {b, 32, &w[3], 8, false}};
  ck_assert_int_eq(pool_batch(io, 4, why, sizeof why), 0);
  ck_assert_uint_eq(calls, 2);
  expect_rec(0, a, 0, 8, 8, false, 1);
  expect_rec(1, a, 0, 24, 8, false, 1);
  expect_rec(2, b, 0, 16, 8, false, 2);
  expect_rec(3, b, 0, 32, 8, false, 2);
  ck_assert_mem_eq(at(a, 24), &w[2], 8);
  ck_assert_mem_eq(at(b, 32), &w[3], 8);
  pool_block_put(a, false);
  pool_block_put(b, false);
  pool_fini(&p);
  pool_fini(&q);
}
END_TEST

Suite *pool_batch_suite(void);
Suite *pool_batch_suite(void) {
  Suite *s = suite_create("pool_batch");
  TCase *tc = tcase_create("batches");
  tcase_add_test(tc, every_word_lands_in_the_order_listed_in_one_batch);
  tcase_add_test(tc, a_read_batch_returns_what_was_written);
  tcase_add_test(tc, a_read_in_a_batch_sees_the_writes_listed_before_it);
  tcase_add_test(tc, a_batch_larger_than_the_staging_goes_in_pieces);
  tcase_add_test(tc, a_failing_copy_fails_the_whole_batch);
  tcase_add_test(tc, each_devices_copies_are_one_batch);
  suite_add_tcase(s, tc);
  return s;
}
