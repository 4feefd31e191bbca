/*
 * check_shape.c — the job shape's one table (proto/shape.c, shape.h) as a
 * specification: its rows cover struct dep_shape_world once each; any one
 * field changed alone is checked, compared, named and keyed; a default and
 * the value it stands for are one shape; and the attach check, the slab
 * layout and the table refuse a bad shape with the same message naming
 * the field.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto.h"
#include "shape.h"
#include "slab.h"

/* A valid shape and the world it is laid out for. */
static struct dep_shape_world sample_shape(void) {
  return (struct dep_shape_world){
      .shape = {.max_tokens_per_rank = 4096, .hidden = 7168, .num_experts = 256, .topk = 8,
                .dtype = DEP_DTYPE_FP8_E4M3, .max_ll_tokens_per_rank = 128},
      .world_size = 64};
}

static uint32_t *field_at(struct dep_shape_world *sw, unsigned f) {
  return (uint32_t *)(void *)((char *)sw + dep__shape_fields[f].off);
}

/* Another value of field f that keeps the shape valid: the first of its
 * range's ends, midpoint and neighbours that does. */
static uint32_t other_valid_value(const struct dep_shape_world *base, unsigned f) {
  const struct dep_shape_field *d = &dep__shape_fields[f];
  uint32_t v = *field_at((struct dep_shape_world *)base, f), step = d->step > 1 ? d->step : 1;
  const uint32_t cand[] = {d->lo, d->hi, (d->lo + d->hi) / 2 / step * step, v + step, v - step};
  for (size_t i = 0; i < sizeof cand / sizeof cand[0]; i++) {
    struct dep_shape_world sw = *base;
    *field_at(&sw, f) = cand[i];
    if (cand[i] != v && dep__shape_check(&sw.shape, sw.world_size, NULL, 0) == 0 &&
        dep__shape_value(&sw.shape, sw.world_size, f) != dep__shape_value(&base->shape,
                                                                          base->world_size, f))
      return cand[i];
  }
  ck_abort_msg("no other valid value of %s found", d->name);
  return v;
}

START_TEST(the_shape_table_covers_every_field_once) {
  /* Every row names a distinct uint32_t of struct dep_shape_world, and
   * together they cover all of it (shape.c also asserts the count). */
  uint64_t seen = 0;
  for (unsigned f = 0; f < DEP_SHAPE_NFIELDS; f++) {
    const struct dep_shape_field *d = &dep__shape_fields[f];
    ck_assert_ptr_nonnull(d->name);
    ck_assert_uint_eq(d->off % 4, 0);
    ck_assert_uint_lt(d->off, sizeof(struct dep_shape_world));
    ck_assert_msg(!(seen & (1ull << (d->off / 4))), "%s shares an offset", d->name);
    seen |= 1ull << (d->off / 4);
    ck_assert_uint_le(d->lo, d->hi);
    /* A rule may name only an earlier field: the check reads it validated. */
    ck_assert_int_lt(d->step_of, (int)f);
    ck_assert_int_lt(d->at_most, (int)f);
    if (d->zero_means != 0)
      ck_assert_int_ge(d->at_most, 0);
  }
  ck_assert_uint_eq(seen, (1ull << (sizeof(struct dep_shape_world) / 4)) - 1);
  ck_assert_str_eq(dep__shape_fields[DEP_SHAPE_F_MAX_LL_TOKENS_PER_RANK].name,
                   "max_ll_tokens_per_rank");
}
END_TEST

/* Changing any one field of the table alone: the diff names that field with
 * both values, the key changes, and each end of its range is refused with a
 * message naming it; so a field added to the table is checked, compared and
 * keyed everywhere. */
START_TEST(every_shape_field_is_checked_compared_and_keyed) {
  const struct dep_shape_world base = sample_shape();
  ck_assert_int_eq(dep__shape_check(&base.shape, base.world_size, NULL, 0), 0);
  const uint64_t key = dep__shape_key(&base.shape, base.world_size);
  ck_assert(!dep__shape_diff(&base.shape, base.world_size, &base.shape, base.world_size, NULL, NULL,
                            NULL));
  for (unsigned f = 0; f < DEP_SHAPE_NFIELDS; f++) {
    const struct dep_shape_field *d = &dep__shape_fields[f];
    struct dep_shape_world sw = base;
    uint32_t v = other_valid_value(&base, f);
    *field_at(&sw, f) = v;
    const char *name = NULL;
    uint64_t va = 0, vb = 0;
    ck_assert_msg(dep__shape_diff(&base.shape, base.world_size, &sw.shape, sw.world_size, &name,
                                 &va, &vb), "%s %u: no difference found", d->name, v);
    ck_assert_str_eq(name, d->name);
    ck_assert_uint_eq(va, dep__shape_value(&base.shape, base.world_size, f));
    ck_assert_uint_eq(vb, dep__shape_value(&sw.shape, sw.world_size, f));
    ck_assert_uint_ne(va, vb);
    ck_assert(dep__shape_diff(&sw.shape, sw.world_size, &base.shape, base.world_size, &name, &va,
                             &vb));
    ck_assert_str_eq(name, d->name);
    ck_assert_msg(dep__shape_key(&sw.shape, sw.world_size) != key, "%s %u: same key", d->name, v);
    /* Just past each end of its range. */
    const uint32_t out[2] = {d->lo - 1, d->hi + 1};
    for (int e = 0; e < 2; e++) {
      if ((e == 0 && d->lo == 0) || (e == 1 && d->hi == UINT32_MAX))
        continue;
      sw = base;
      *field_at(&sw, f) = out[e];
      char why[256] = "", want[80];
      ck_assert_int_eq(dep__shape_check(&sw.shape, sw.world_size, why, sizeof why),
                       DEP_ERR_INVALID);
      snprintf(want, sizeof want, "%s %u ", d->name, out[e]);
      ck_assert_msg(strncmp(why, want, strlen(want)) == 0, "want \"%s...\", got \"%s\"", want,
                    why);
      ck_assert_ptr_nonnull(strstr(why, "allowed"));
    }
  }
}
END_TEST

/* max_ll_tokens_per_rank 0 means min(max_tokens_per_rank, 256): 0 and its
 * effective value are one layout, one key and no mismatch. */
START_TEST(a_default_and_its_value_are_the_same_shape) {
  struct dep_shape_world a = sample_shape(), b = a;
  a.shape.max_tokens_per_rank = b.shape.max_tokens_per_rank = 4096;
  a.shape.max_ll_tokens_per_rank = 0;
  b.shape.max_ll_tokens_per_rank = 256;
  ck_assert_uint_eq(dep__shape_max_ll(&a.shape), 256);
  ck_assert(!dep__shape_diff(&a.shape, a.world_size, &b.shape, b.world_size, NULL, NULL, NULL));
  ck_assert_uint_eq(dep__shape_key(&a.shape, a.world_size), dep__shape_key(&b.shape, b.world_size));
  struct dep_slab_layout la, lb;
  char why[256] = "";
  ck_assert_int_eq(dep__slab_layout(&a.shape, a.world_size, &la, why, sizeof why), 0);
  ck_assert_int_eq(dep__slab_layout(&b.shape, b.world_size, &lb, why, sizeof why), 0);
  ck_assert_uint_eq(la.max_ll_tokens, 256);
  ck_assert_uint_eq(la.total_bytes, lb.total_bytes);
  /* Under 256 tokens the default is max_tokens_per_rank itself. */
  a.shape.max_tokens_per_rank = b.shape.max_tokens_per_rank = 100;
  b.shape.max_ll_tokens_per_rank = 100;
  ck_assert_uint_eq(dep__shape_max_ll(&a.shape), 100);
  ck_assert(!dep__shape_diff(&a.shape, a.world_size, &b.shape, b.world_size, NULL, NULL, NULL));
  ck_assert_uint_eq(dep__shape_key(&a.shape, a.world_size), dep__shape_key(&b.shape, b.world_size));
  /* Another bound is another shape, named with the values in effect. */
  const char *name = NULL;
  uint64_t va = 0, vb = 0;
  b.shape.max_ll_tokens_per_rank = 99;
  ck_assert(dep__shape_diff(&a.shape, a.world_size, &b.shape, b.world_size, &name, &va, &vb));
  ck_assert_str_eq(name, "max_ll_tokens_per_rank");
  ck_assert_uint_eq(va, 100);
  ck_assert_uint_eq(vb, 99);
  ck_assert_uint_ne(dep__shape_key(&a.shape, a.world_size), dep__shape_key(&b.shape, b.world_size));
  /* The same raw 0 under another max_tokens_per_rank: that field is named first. */
  b = a;
  b.shape.max_tokens_per_rank = 4096;
  ck_assert(dep__shape_diff(&a.shape, a.world_size, &b.shape, b.world_size, &name, &va, &vb));
  ck_assert_str_eq(name, "max_tokens_per_rank");
}
END_TEST

/* The attach check, the slab layout and the table say the same about a bad shape. */
START_TEST(shape_limits_are_one_definition_with_messages_naming_the_field) {
  static const struct {
    unsigned f;
    uint32_t v;
    const char *msg;
  } cases[] = {
    {DEP_SHAPE_F_WORLD_SIZE, 0, "world_size 0 is out of range (allowed 1..4096)"},
    {DEP_SHAPE_F_MAX_TOKENS_PER_RANK, 65537,
     "max_tokens_per_rank 65537 is out of range (allowed 1..65536)"},
    {DEP_SHAPE_F_HIDDEN, 200, "hidden 200 is out of range (allowed a multiple of 128 in "
                              "128..16384)"},
    {DEP_SHAPE_F_NUM_EXPERTS, 100, "num_experts 100 is not divisible by world_size 64 (allowed a "
                                   "multiple of 64 in 1..65536)"},
    {DEP_SHAPE_F_TOPK, 17, "topk 17 is out of range (allowed 1..16)"},
    {DEP_SHAPE_F_MAX_LL_TOKENS_PER_RANK, 4097,
     "max_ll_tokens_per_rank 4097 exceeds max_tokens_per_rank 4096 (allowed 0 = default, or "
     "1..4096)"},
    {DEP_SHAPE_F_DTYPE, 3, "dtype 3 is not supported (allowed 1 = bf16, 2 = fp8_e4m3)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct dep_shape_world sw = sample_shape();
    *field_at(&sw, cases[i].f) = cases[i].v;
    char w1[256] = "", w2[256] = "", w3[256] = "";
    ck_assert_int_eq(dep__shape_check(&sw.shape, sw.world_size, w1, sizeof w1), DEP_ERR_INVALID);
    ck_assert_str_eq(w1, cases[i].msg);
    struct dep_slab_layout l;
    ck_assert_int_eq(dep__slab_layout(&sw.shape, sw.world_size, &l, w2, sizeof w2),
                     DEP_ERR_INVALID);
    ck_assert_str_eq(w2, cases[i].msg);
    struct dep_attach_args a = {.size = sizeof a, .job_id = "shape-limits", .rank = 0,
                                .world_size = sw.world_size, .local_rank = 0,
                                .local_world_size = 1, .shape = sw.shape};
    ck_assert_int_eq(proto_check_attach(&a, w3, sizeof w3), DEP_ERR_INVALID);
    ck_assert_str_eq(w3, cases[i].msg);
  }
  /* A cross-field rule: top-k within the experts there are. */
  struct dep_shape_world sw = sample_shape();
  sw.world_size = 1;
  sw.shape.num_experts = 4;
  char why[256] = "";
  ck_assert_int_eq(dep__shape_check(&sw.shape, sw.world_size, why, sizeof why), DEP_ERR_INVALID);
  ck_assert_str_eq(why, "topk 8 exceeds num_experts 4 (allowed 1..4)");
  ck_assert_int_eq(dep__shape_check(NULL, 1, why, sizeof why), DEP_ERR_INVALID);
}
END_TEST

/*
 * A job that spans nodes: its slab is the single-node one (the remote count
 * changes nothing in it, nor its cache key), and its exchange region holds,
 * for each parity and remote rank, an in slot, an out slot, an in block and
 * an out block, none overlapping another, the blocks 4 KiB aligned, all
 * within xchg_bytes; a single-node job has none.
 */
START_TEST(the_exchange_region_holds_every_remote_ranks_slots_and_blocks_apart) {
  struct dep_shape_world sw = sample_shape();
  sw.world_size = 8;
  sw.shape.max_tokens_per_rank = 64;
  sw.shape.max_ll_tokens_per_rank = 0;
  sw.shape.hidden = 256;
  sw.shape.num_experts = 16;
  sw.shape.topk = 4;
  struct dep_slab_layout one, l;
  char why[256] = "";
  ck_assert_int_eq(dep__slab_layout(&sw.shape, 8, &one, why, sizeof why), 0);
  ck_assert_uint_eq(one.n_remote, 0);
  ck_assert_uint_eq(one.xchg_bytes, 0);
  ck_assert_int_eq(dep__slab_layout_nodes(&sw.shape, 8, 3, 0, &l, why, sizeof why), 0);
  ck_assert_uint_eq(l.n_remote, 5);
  ck_assert_uint_eq(l.total_bytes, one.total_bytes);
  ck_assert_uint_eq(l.priv_off, one.priv_off);
  ck_assert_uint_eq(dep__slab_key(&sw.shape, 8, 0), dep__shape_key(&sw.shape, 8));
  ck_assert_uint_ne(dep__slab_key(&sw.shape, 8, 1), dep__shape_key(&sw.shape, 8));
  ck_assert_uint_eq(l.in_off % DEP_SLAB_ALIGN, 0);
  ck_assert_uint_eq(l.xchg_bytes % DEP_SLAB_ALIGN, 0);
  /* Mark every byte each (parity, remote) part claims: each claimed once, inside the region. */
  uint8_t *seen = calloc(1, l.xchg_bytes);
  ck_assert_ptr_nonnull(seen);
  for (unsigned p = 0; p < 2; p++)
    for (uint32_t ri = 0; ri < l.n_remote; ri++) {
      const uint64_t at[4] = {dep_slab_in_slot(&l, p, ri), dep_slab_out_slot(&l, p, ri),
                              dep_slab_in_block(&l, p, ri), dep_slab_out_block(&l, p, ri)};
      const uint64_t len[4] = {DEP_SLAB_CTRL_SLOT, DEP_SLAB_CTRL_SLOT, l.xblock_bytes,
                               l.xblock_bytes};
      for (int k = 0; k < 4; k++) {
        ck_assert_uint_le(at[k] + len[k], l.xchg_bytes);
        /* No ck_assert a byte: each one that passes writes a mark point to Check's
         * pipe, which took this case past its timeout on a loaded machine. */
        for (uint64_t b = at[k]; b < at[k] + len[k]; b++) {
          if (seen[b] != 0)
            ck_abort_msg("byte %llu of the exchange region claimed twice", (unsigned long long)b);
          seen[b] = 1;
        }
      }
    }
  free(seen);
}
END_TEST

/*
 * The live mask (slab.h) lies between the control slots and the data, in
 * every world: its epoch word right after the last (parity, source) slot,
 * a bit for every rank, a join word for every rank, the whole inside
 * ctrl_bytes and before data_off,
 * so that the daemon's writes to it never touch a slot or a block.
 */
START_TEST(the_live_mask_has_a_bit_per_rank_between_the_slots_and_the_data) {
  struct dep_shape_world sw = sample_shape();
  sw.shape.max_tokens_per_rank = 64;
  sw.shape.max_ll_tokens_per_rank = 0;
  sw.shape.hidden = 256;
  sw.shape.topk = 4;
  static const uint32_t worlds[] = {1, 2, 63, 64, 65, 128, 1000, DEP_MAX_WORLD};
  for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
    const uint32_t W = worlds[i];
    sw.shape.num_experts = W * 4;
    struct dep_slab_layout l;
    char why[256] = "";
    ck_assert_msg(dep__slab_layout(&sw.shape, W, &l, why, sizeof why) == 0, "%s", why);
    ck_assert_uint_eq(dep_slab_mask_epoch(&l), DEP_SLAB_CTRL_SLOT_AT(W, 2, 0));
    ck_assert_uint_eq(dep_slab_mask_word(&l, 0), dep_slab_mask_epoch(&l) + 8);
    ck_assert_uint_eq(dep_slab_mask_word(&l, 63), dep_slab_mask_word(&l, 0));
    ck_assert_uint_eq(dep_slab_mask_word(&l, W - 1), l.mask_off + 8 * ((W - 1) / 64 + 1));
    ck_assert_uint_le(dep_slab_mask_word(&l, W - 1) + 8, l.ctrl_bytes);
    /* The join words follow the bits, one per rank, and end the area. */
    ck_assert_uint_eq(dep_slab_mask_join(&l, 0), dep_slab_mask_word(&l, W - 1) + 8);
    ck_assert_uint_eq(dep_slab_mask_join(&l, W - 1) + 8,
                      l.mask_off + DEP_SLAB_MASK_AREA_BYTES(W));
    ck_assert_uint_le(dep_slab_mask_join(&l, W - 1) + 8, l.ctrl_bytes);
    ck_assert_uint_le(l.ctrl_bytes, l.data_off);
    ck_assert_uint_eq(DEP_SLAB_MASK_BIT(W - 1), 1ull << ((W - 1) % 64));
  }
}
END_TEST

Suite *shape_suite(void);
Suite *shape_suite(void) {
  Suite *s = suite_create("shape");
  TCase *tc = tcase_create("table");
  tcase_add_test(tc, the_shape_table_covers_every_field_once);
  tcase_add_test(tc, every_shape_field_is_checked_compared_and_keyed);
  tcase_add_test(tc, a_default_and_its_value_are_the_same_shape);
  tcase_add_test(tc, shape_limits_are_one_definition_with_messages_naming_the_field);
  tcase_add_test(tc, the_exchange_region_holds_every_remote_ranks_slots_and_blocks_apart);
  tcase_add_test(tc, the_live_mask_has_a_bit_per_rank_between_the_slots_and_the_data);
  suite_add_tcase(s, tc);
  return s;
}
