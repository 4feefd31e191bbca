/*
 * cudarounds.h — one round of every operation on one rank of the cuda
 * backend against the oracle (opsworld.h, tests/ref.c): what the GPU
 * suites' rank bodies run (check_cuda_ops.c, and check_xnode.c's job
 * across two daemons on one GPU).  Moves are held bit for bit, sums bit
 * for bit against the host backend's float32 order (and within the
 * oracle's bound); outputs are poisoned first, so an unwritten element or
 * a write past the valid count fails.  Prefix cr_, as cudaranks.h.
 */
#ifndef DEP_CUDAROUNDS_H
#define DEP_CUDAROUNDS_H

#include <stdint.h>

#include "cudaranks.h"
#include "opsworld.h"
#include "ref.h"

/* In a function of (struct rk *k, const struct ow_case *d): a failing call
 * returns its error, with the case, from the body. */
#define CALL(k, expr, op)                                                         \
  do {                                                                            \
    int rc_ = (expr);                                                             \
    if (rc_ != 0)                                                                 \
      return ow_fail((k)->msg, "rank %u: %s returned %s: %s [%s]", (k)->rank, op, \
                     dep_errname(rc_), dep_errmsg((k)->c), d->desc);              \
  } while (0)

/* The host backend's float32 sums in its order, rounded once: bit for bit. */
void cr_want_combine(const struct ow_case *d, uint32_t o, uint16_t *want, float *acc);
void cr_want_ll_combine(const struct ow_case *d, uint32_t o, uint16_t *want, float *acc);
/* A summed output in k->host: within the oracle's bound, then bit for bit, then untouched past n. */
int cr_check_sum(struct rk *k, const struct ow_case *d, const struct ref_sum *ref,
                 const uint16_t *want, uint32_t n, uint32_t cap, uint8_t pz, const char *op);
/* Layout, dispatch and combine of rank k->rank of case d, outputs poisoned
 * with pz, folded into *dig: 0, or 1 with k->msg. */
int cr_round_tp(struct rk *k, const struct ow_case *d, uint8_t pz, uint64_t *dig);
/* Low-latency dispatch (bf16, or FP8) and combine, back to back. */
int cr_round_ll(struct rk *k, const struct ow_case *d, int fp8, uint8_t pz, uint64_t *dig);
/* Rank k->rank's inputs of case d into its device buffers. */
int cr_upload(struct rk *k, const struct ow_case *d);

struct cr_rounds {
  const struct ow_case *cases;
  int ncases, nrounds;
};
int cr_body_rounds(struct rk *k, void *arg);

/* A late receiver: every rank makes four throughput rounds of case d, rank `late` sleeping
 * 30 ms before each (not a synchronisation: the outputs are checked whatever the order), so
 * that its senders fill its channels and wait for its credit. */
struct cr_late {
  const struct ow_case *d;
  uint32_t late;
};
int cr_body_late(struct rk *k, void *arg);

/*
 * A peer that dies mid-call: every rank makes one throughput round of case
 * d, then rank 1's process ends (no detach, no free: as a crash ends it),
 * storing when into *exit_at (shared memory), while rank 0 dispatches its
 * next call, which must fail with DEP_ERR_PEER within bound_ms of that exit
 * (a ceiling far above what the daemons take to tell, far below the op
 * timeout), its message holding each of `must` that is not NULL.  Rank 0
 * prints the time under `tag`.
 */
struct cr_peer_dies {
  const struct ow_case *d;
  uint64_t *exit_at;
  uint64_t bound_ms;
  const char *must[2];
  const char *tag;
};
int cr_body_peer_dies(struct rk *k, void *arg);

#endif /* DEP_CUDAROUNDS_H */
