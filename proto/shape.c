/*
 * shape.c — the job shape's one table, and its check, comparison and key
 * (see shape.h).
 */
#include "shape.h"
#include "why.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define OFF(member) offsetof(struct dep_shape_world, member)
#define NONE (-1)

const struct dep_shape_field dep__shape_fields[DEP_SHAPE_NFIELDS] = {
    [DEP_SHAPE_F_WORLD_SIZE] = {"world_size", OFF(world_size), 1, DEP_MAX_WORLD, 0, NONE, NONE,
                                0, NULL},
    [DEP_SHAPE_F_MAX_TOKENS_PER_RANK] = {"max_tokens_per_rank", OFF(shape.max_tokens_per_rank), 1,
                                         DEP_SHAPE_MAX_TOKENS, 0, NONE, NONE, 0, NULL},
    [DEP_SHAPE_F_HIDDEN] = {"hidden", OFF(shape.hidden), DEP_SHAPE_HIDDEN_STEP,
                            DEP_SHAPE_MAX_HIDDEN, DEP_SHAPE_HIDDEN_STEP, NONE, NONE, 0, NULL},
    /* Experts are owned in contiguous blocks, the same number per rank. */
    [DEP_SHAPE_F_NUM_EXPERTS] = {"num_experts", OFF(shape.num_experts), 1, DEP_SHAPE_MAX_EXPERTS,
                                 0, DEP_SHAPE_F_WORLD_SIZE, NONE, 0, NULL},
    [DEP_SHAPE_F_TOPK] = {"topk", OFF(shape.topk), 1, DEP_SHAPE_MAX_TOPK, 0, NONE,
                          DEP_SHAPE_F_NUM_EXPERTS, 0, NULL},
    [DEP_SHAPE_F_MAX_LL_TOKENS_PER_RANK] = {"max_ll_tokens_per_rank",
                                            OFF(shape.max_ll_tokens_per_rank), 0,
                                            DEP_SHAPE_MAX_TOKENS, 0, NONE,
                                            DEP_SHAPE_F_MAX_TOKENS_PER_RANK,
                                            DEP_SHAPE_LL_DEFAULT, NULL},
    [DEP_SHAPE_F_DTYPE] = {"dtype", OFF(shape.dtype), DEP_DTYPE_BF16, DEP_DTYPE_FP8_E4M3, 0, NONE,
                           NONE, 0, "1 = bf16, 2 = fp8_e4m3"},
};

/* Every member of struct dep_job_shape is a uint32_t with a row above, and
 * the world size is the one row outside it: a member added without a row
 * fails here rather than going unchecked and uncompared. */
_Static_assert(sizeof(struct dep_job_shape) == 4 * (DEP_SHAPE_NFIELDS - 1),
               "every member of struct dep_job_shape needs a row in dep__shape_fields");
_Static_assert(DEP_DTYPE_BF16 == 1 && DEP_DTYPE_FP8_E4M3 == 2,
               "dtype's row (range and meaning) assumes bf16 = 1, fp8_e4m3 = 2");

uint32_t dep__shape_raw(const struct dep_job_shape *s, uint32_t world_size, unsigned f) {
  const struct dep_shape_world sw = {*s, world_size};
  uint32_t v;
  memcpy(&v, (const char *)&sw + dep__shape_fields[f].off, sizeof v);
  return v;
}

uint32_t dep__shape_value(const struct dep_job_shape *s, uint32_t world_size, unsigned f) {
  const struct dep_shape_field *d = &dep__shape_fields[f];
  uint32_t v = dep__shape_raw(s, world_size, f);
  if (v == 0 && d->zero_means != 0) {
    uint32_t cap = dep__shape_raw(s, world_size, (unsigned)d->at_most);
    v = cap < d->zero_means ? cap : d->zero_means;
  }
  return v;
}

uint32_t dep__shape_max_ll(const struct dep_job_shape *s) {
  return dep__shape_value(s, 1, DEP_SHAPE_F_MAX_LL_TOKENS_PER_RANK);
}


/* What field d allows, for a message: "1..16", "a multiple of 128 in 128..16384". */
static void allowed(const struct dep_shape_field *d, uint32_t hi, char *out, size_t len) {
  if (d->meaning != NULL)
    snprintf(out, len, "%s", d->meaning);
  else if (d->zero_means != 0)
    snprintf(out, len, "0 = default, or 1..%u", hi);
  else if (d->step > 1)
    snprintf(out, len, "a multiple of %u in %u..%u", d->step, d->lo, hi);
  else
    snprintf(out, len, "%u..%u", d->lo, hi);
}

int dep__shape_check(const struct dep_job_shape *s, uint32_t world_size, char *why, size_t whylen) {
  if (s == NULL)
    return why_fail(why, whylen, DEP_ERR_INVALID, "job shape is missing");
  char ok[80];
  for (unsigned f = 0; f < DEP_SHAPE_NFIELDS; f++) {
    const struct dep_shape_field *d = &dep__shape_fields[f];
    uint32_t v = dep__shape_raw(s, world_size, f);
    if (v < d->lo || v > d->hi || (d->step > 1 && v % d->step != 0)) {
      allowed(d, d->hi, ok, sizeof ok);
      return why_fail(why, whylen, DEP_ERR_INVALID, d->meaning != NULL ? "%s %u is not supported (allowed %s)"
                                                 : "%s %u is out of range (allowed %s)",
                 d->name, v, ok);
    }
    if (d->step_of != NONE) {
      const struct dep_shape_field *o = &dep__shape_fields[d->step_of];
      uint32_t m = dep__shape_value(s, world_size, (unsigned)d->step_of);
      if (v % m != 0)
        return why_fail(why, whylen, DEP_ERR_INVALID, "%s %u is not divisible by %s %u (allowed a multiple of %u in "
                   "%u..%u)", d->name, v, o->name, m, m, d->lo, d->hi);
    }
    if (d->at_most != NONE) {
      const struct dep_shape_field *o = &dep__shape_fields[d->at_most];
      uint32_t m = dep__shape_value(s, world_size, (unsigned)d->at_most);
      if (v > m) {
        allowed(d, m < d->hi ? m : d->hi, ok, sizeof ok);
        return why_fail(why, whylen, DEP_ERR_INVALID, "%s %u exceeds %s %u (allowed %s)", d->name, v, o->name, m, ok);
      }
    }
  }
  return 0;
}

bool dep__shape_diff(const struct dep_job_shape *a, uint32_t world_a, const struct dep_job_shape *b,
                    uint32_t world_b, const char **field, uint64_t *va, uint64_t *vb) {
  for (unsigned f = 0; f < DEP_SHAPE_NFIELDS; f++) {
    uint32_t x = dep__shape_value(a, world_a, f), y = dep__shape_value(b, world_b, f);
    if (x == y)
      continue;
    if (field != NULL)
      *field = dep__shape_fields[f].name;
    if (va != NULL)
      *va = x;
    if (vb != NULL)
      *vb = y;
    return true;
  }
  return false;
}

uint64_t dep__shape_key(const struct dep_job_shape *s, uint32_t world_size) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a, 4 little-endian bytes a field */
  for (unsigned f = 0; f < DEP_SHAPE_NFIELDS; f++) {
    uint32_t v = dep__shape_value(s, world_size, f);
    for (int b = 0; b < 4; b++)
      h = (h ^ ((v >> (8 * b)) & 0xffu)) * 1099511628211ull;
  }
  return h;
}
