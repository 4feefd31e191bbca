/*
 * tune.h — adaptive_optimization (DESIGN §6, §9): the operations' tunable,
 * the SM budget of a communicating kernel (client/cuda_ops.h: CTAs per
 * rank, $DEEPEP_KERNEL_CTAS), chosen by measurement per (GPU model, job
 * shape, ranks per GPU, world size) and kept in kernel_cache_dir across
 * restarts.
 *
 * A job whose key has no entry gets the library's default at once and its
 * key is queued; the daemon measures it later, when it has no job at all
 * (tunechild.c: a child process times each candidate budget on the daemon's
 * own jobs), so a measurement never runs inside a job's critical path.  The
 * next job of that key is given the table's value at attach (TUNE_OK).
 *
 * An entry is one file per key, named for a hash of the key and holding the
 * key again, the candidates' measured medians, the choice and a BLAKE2b
 * checksum: a file that is cut short, altered or of another key is removed
 * and its key measured again; one made by another build of the kernels or
 * another driver is stale (the figures were of other code) and removed.
 * The measurement is handed in (struct tune_measure), so the table's logic
 * runs without a GPU.
 */
#ifndef DEP_TUNE_H
#define DEP_TUNE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepep.h"
#include "kimage.h"

/* The operations a candidate is timed on, in the order of every per-op array. */
#define TUNE_OPS(XX) XX(DISPATCH, "dispatch") XX(COMBINE, "combine") \
  XX(LL_DISPATCH, "ll_dispatch") XX(LL_COMBINE, "ll_combine")
enum tune_op {
#define TUNE__OP(name, str) TUNE_OP_##name,
  TUNE_OPS(TUNE__OP)
#undef TUNE__OP
  TUNE_NOPS
};

/* At most this many candidate budgets per key. */
#define TUNE_MAX_CANDS 8u
/* A candidate is chosen only if no op is slower than the default's by more
 * than TUNE_WORSE_MAX and the ops' mean time ratio to the default's is
 * below 1 - TUNE_GAIN_MIN: a choice never trades one op for another, and a
 * difference inside the measurement's noise keeps the default. */
#define TUNE_WORSE_MAX 0.02
#define TUNE_GAIN_MIN 0.02

struct tune_key {
  char gpu[64];                  /* the GPU's model name, as the driver says it */
  uint32_t sms;                  /* its multiprocessors */
  uint32_t ranks_per_gpu;        /* the job's ranks on that GPU */
  uint32_t world;                /* the job's world size */
  struct dep_job_shape shape;    /* every field of the job's shape */
  int32_t driver;                /* cuDriverGetVersion */
  char build[KIMAGE_ID_LEN + 1]; /* the kernels' build id (the fatbin's SHA-256) */
};

struct tune_cand {
  uint32_t ctas;                 /* the budget timed */
  uint32_t ns[TUNE_NOPS];        /* each op's median, slowest rank per call */
};

struct tune_entry {
  struct tune_key key;
  uint32_t ctas;                 /* the choice */
  uint32_t default_ctas;         /* the library's default for the key */
  uint32_t n_cands;
  struct tune_cand cands[TUNE_MAX_CANDS];
  uint64_t measured_at;          /* Unix time */
};

/* Where a rank's budget came from: enum dep_tune_how (proto.h). */

/* The library's default budget (cuops_sm_budget's, sm_budget.h; xworld: the world of a job
 * whose ranks span nodes, 0 for one on a node, whose keys the table measures) and the
 * largest it accepts. */
uint32_t tune_default_ctas(uint32_t sms, uint32_t ranks_per_gpu, uint32_t xworld);
uint32_t tune_most_ctas(uint32_t sms, uint32_t ranks_per_gpu);
/*
 * The budgets worth timing for a key: the default, half and 1.5 and 2
 * times it, and the most, each at most the most, one per distinct grid
 * (dep__kernel_grid: world * budget / world CTAs, or the budget where
 * that is fewer than the world).  The default is first.  Returns
 * how many (1..TUNE_MAX_CANDS).
 */
unsigned tune_candidates(const struct tune_key *k, uint32_t out[TUNE_MAX_CANDS]);
/* The choice among e's measured candidates (TUNE_WORSE_MAX, TUNE_GAIN_MIN): a budget. */
uint32_t tune_choose(const struct tune_entry *e);

/* The entry's file name: "tune-<16 hex digits of the key's hash>.tune". */
void tune_entry_name(const struct tune_key *k, char *out, size_t len);
/* An entry file's bytes: TUNE_FILE_LEN of them into out. */
#define TUNE_FILE_LEN 432u
void tune_encode(const struct tune_entry *e, uint8_t out[TUNE_FILE_LEN]);
/* Check an entry file's bytes: 0 with *e filled, or DEP_ERR_PROTOCOL and why. */
int tune_decode(const uint8_t *f, size_t len, struct tune_entry *e, char *why, size_t whylen);
bool tune_key_equal(const struct tune_key *a, const struct tune_key *b);

/* The measurement: time every candidate of e (e->key, e->n_cands,
 * e->cands[].ctas filled) into e->cands[].ns.  0 or DEP_ERR_* and why. */
struct tune_measure {
  int (*run)(void *arg, struct tune_entry *e, char *why, size_t whylen);
  void *arg;
};

/*
 * The table: in memory, backed by one file per entry in dir ("" for none:
 * entries live until the daemon stops).  tune_open reads every entry file
 * there: those of build and driver are kept, stale and damaged ones removed
 * (logged).  The table is the caller's; tune_close frees it.
 */
struct tune_table;
int tune_open(const char *dir, int32_t driver, const char *build, struct tune_table **out,
              char *why, size_t whylen);
void tune_close(struct tune_table *t);
size_t tune_count(const struct tune_table *t);

/* The entry for k, or NULL. */
const struct tune_entry *tune_lookup(const struct tune_table *t, const struct tune_key *k);
/*
 * Measure k now with m: time its candidates, choose, keep the entry and
 * store its file (atomically, by rename; a store that fails is logged, the
 * entry kept in memory).  0 with *out (may be NULL) the entry, or the
 * measurement's error.
 */
int tune_measure_key(struct tune_table *t, const struct tune_key *k, const struct tune_measure *m,
                     const struct tune_entry **out, char *why, size_t whylen);
/* Keep an entry measured elsewhere (the child's figures), its choice made here. */
int tune_put(struct tune_table *t, struct tune_entry *e);

/*
 * The queue of keys waiting for a measurement: a key is queued once (a key
 * already queued, measured or failed is not), at most TUNE_QUEUE_MAX.
 * `place` is the job's placement the measurement repeats: the device of
 * each rank, by rank; `uid` the job's owner.  true when it was queued now.
 */
#define TUNE_QUEUE_MAX 16u
bool tune_queue(struct tune_table *t, const struct tune_key *k, const uint8_t (*place)[16],
                uint32_t uid);
/* The oldest queued key, its placement and owner (false when none), taken off the queue. */
bool tune_dequeue(struct tune_table *t, struct tune_key *k, uint8_t (*place)[16], uint32_t *uid);
bool tune_queued(const struct tune_table *t, const struct tune_key *k);
/* Remember that k's measurement failed: it is not queued again until the daemon restarts. */
void tune_mark_failed(struct tune_table *t, const struct tune_key *k);
bool tune_failed(const struct tune_table *t, const struct tune_key *k);

#endif /* DEP_TUNE_H */
