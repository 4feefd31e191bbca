/*
 * shape.h — the job shape (DESIGN §4), defined once.  One table of its
 * fields (dep__shape_fields: struct dep_job_shape's members and the world
 * size the memory is laid out for) drives their limits and the check both
 * ends run (dep__shape_check), the comparison of two ranks' shapes
 * (dep__shape_diff) and the key of the memory made for a shape
 * (dep__shape_key).  A field added to struct dep_job_shape and given a row
 * here is checked, compared and keyed everywhere with no other edit; a
 * field compared in one place and forgotten in another once let ranks that
 * disagreed on max_ll_tokens_per_rank get wrong data with DEP_OK.
 *
 * Comparisons and keys use each field's effective value: a field with a
 * default (zero_means) reads 0 as that default, so max_ll_tokens_per_rank 0
 * and 256 at max_tokens_per_rank 4096 are one layout, one key and no
 * mismatch.
 */
#ifndef DEP_SHAPE_H
#define DEP_SHAPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepep.h"

/* The limits, for code that must size something by them (the kernels, which
 * read this header through kabi.h). */
#define DEP_SHAPE_MAX_TOKENS 65536u
#define DEP_SHAPE_HIDDEN_STEP 128u /* channels per FP8 scale */
#define DEP_SHAPE_MAX_HIDDEN 16384u
#define DEP_SHAPE_MAX_EXPERTS 65536u
#define DEP_SHAPE_MAX_TOPK 16u
#define DEP_SHAPE_LL_DEFAULT 256u /* max_ll_tokens_per_rank 0: min(max_tokens_per_rank, this) */

/* What the table describes: a shape and the world it is laid out for. */
struct dep_shape_world {
  struct dep_job_shape shape;
  uint32_t world_size;
};

/* The table's rows, in the order they are checked and compared: a field's
 * rules may name only fields before it. */
enum dep_shape_field_id {
  DEP_SHAPE_F_WORLD_SIZE,
  DEP_SHAPE_F_MAX_TOKENS_PER_RANK,
  DEP_SHAPE_F_HIDDEN,
  DEP_SHAPE_F_NUM_EXPERTS,
  DEP_SHAPE_F_TOPK,
  DEP_SHAPE_F_MAX_LL_TOKENS_PER_RANK,
  DEP_SHAPE_F_DTYPE,
  DEP_SHAPE_NFIELDS
};

struct dep_shape_field {
  const char *name;     /* as the API and messages spell it */
  size_t off;           /* of its uint32_t in struct dep_shape_world */
  uint32_t lo, hi;      /* allowed range */
  uint32_t step;        /* a multiple of this (0: any) */
  int step_of;          /* ... and of this earlier field's value (-1: none) */
  int at_most;          /* at most this earlier field's value (-1: none) */
  uint32_t zero_means;  /* 0 asks for min(at_most's value, zero_means); 0: no default */
  const char *meaning;  /* what each allowed value means, for messages (NULL: a number) */
};

extern const struct dep_shape_field dep__shape_fields[DEP_SHAPE_NFIELDS];

/* Field f's value as given (raw) or as it takes effect (defaults applied). */
uint32_t dep__shape_raw(const struct dep_job_shape *s, uint32_t world_size, unsigned f);
uint32_t dep__shape_value(const struct dep_job_shape *s, uint32_t world_size, unsigned f);
/* The low-latency bound in effect (the one default the table has today). */
uint32_t dep__shape_max_ll(const struct dep_job_shape *s);

/*
 * Every field within its limits, in table order.  0, or DEP_ERR_INVALID with
 * a message naming the first bad field, its value and what is allowed
 * ("topk 17 is out of range (allowed 1..16)"); why may be NULL.
 */
int dep__shape_check(const struct dep_job_shape *s, uint32_t world_size, char *why, size_t whylen);

/*
 * Whether two shapes (each with its world size) differ in any field's
 * effective value.  When they do, the first such field's name and both
 * values (a's, b's) are stored where the pointers are not NULL.
 */
bool dep__shape_diff(const struct dep_job_shape *a, uint32_t world_a, const struct dep_job_shape *b,
                    uint32_t world_b, const char **field, uint64_t *va, uint64_t *vb);

/* A hash (FNV-1a) of every field's effective value: equal for shapes that
 * dep__shape_diff calls equal, so memory made for one serves the other. */
uint64_t dep__shape_key(const struct dep_job_shape *s, uint32_t world_size);

#endif /* DEP_SHAPE_H */
