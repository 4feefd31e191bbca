/*
 * check_cuda_ops_mask.c — suite cuda_ops's masks case (check_cuda_ops.c
 * makes the suite and adds it): masked ranks on the cuda backend
 * (deepep.h "Masked ranks", kabi.h): one rank of the job is gone before its
 * first call (it attaches, then detaches), masked in every other rank's
 * own mask (dep_mask_update) or by its bit in the live mask (written into
 * each rank's slab as the daemon writes it: the bits, then the epoch), and
 * every other rank's outputs of every operation match the oracle with it
 * masked (ref_mask), bf16 and FP8.  Tagged "gpu" and run as check_cuda_ops.c
 * says: each test skips, saying why, unless DEP_TEST_BACKEND=cuda and a GPU
 * is present.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_cuda_ops.h"
#include "cudadrv.h"
#include "cudaranks.h"
#include "cudarounds.h"
#include "deepep.h"
#include "opsworld.h"
#include "slab.h"

struct mask_arg {
  const struct ow_case *d;
  uint32_t masked; /* the rank that is gone */
  int by_live;     /* masked by its live bit, else by every rank's own mask */
};

/* This rank's slab (device memory): its live mask's bit for rank r, then the epoch, as the
 * daemon writes them. */
static int write_live_bit(struct rk *k, const struct ow_case *d, uint32_t r) {
  struct dep_attach_info info = {.size = sizeof info};
  int rc = dep_attach_info(k->c, &info);
  if (rc != 0)
    return ow_fail(k->msg, "rank %u: dep_attach_info: %s", k->rank, dep_errmsg(k->c));
  struct dep_slab_layout lay;
  char why[256];
  if (dep__slab_layout(&d->shape, d->sc.world, &lay, why, sizeof why) != 0)
    return ow_fail(k->msg, "rank %u: layout: %s", k->rank, why);
  const CUdeviceptr slab = (CUdeviceptr)(uintptr_t)info.slabs[info.local_rank];
  const uint64_t bits = DEP_SLAB_MASK_BIT(r), epoch = 1;
  return cr_put_at(k, slab + dep_slab_mask_word(&lay, r), &bits, sizeof bits) ||
         cr_put_at(k, slab + dep_slab_mask_epoch(&lay), &epoch, sizeof epoch);
}

static int body_masked(struct rk *k, void *arg) {
  const struct mask_arg *m = arg;
  const struct ow_case *d = m->d;
  if (k->rank == m->masked)
    return 0; /* gone before its first call: it detaches */
  if (m->by_live) {
    if (write_live_bit(k, d, m->masked))
      return 1;
  } else {
    CALL(k, dep_mask_update(k->c, m->masked, 1), "dep_mask_update");
  }
  int32_t q[OW_MAXW];
  uint64_t epoch = 0;
  CALL(k, dep_mask_query(k->c, q, d->sc.world, &epoch), "dep_mask_query");
  for (uint32_t r = 0; r < d->sc.world; r++)
    if (q[r] != (r == m->masked))
      return ow_fail(k->msg, "rank %u: dep_mask_query says rank %u is%s masked [%s]", k->rank, r,
                     q[r] ? "" : " not", d->desc);
  if (epoch != (m->by_live ? 1u : 0u))
    return ow_fail(k->msg, "rank %u: dep_mask_query's epoch %llu [%s]", k->rank,
                   (unsigned long long)epoch, d->desc);
  uint64_t dig = 0;
  for (int round = 0; round < 2; round++) {
    const uint8_t pz = round ? 0x5A : 0xA5;
    if (cr_upload(k, d) || cr_round_tp(k, d, pz, &dig) || cr_round_ll(k, d, 0, pz, &dig) ||
        (d->sc.fp8 && cr_round_ll(k, d, 1, pz, &dig)))
      return 1;
  }
  return 0;
}

static const struct {
  struct ow_scenario sc;
  uint32_t masked;
  int by_live;
} mask_cases[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {{4, 2048, 4, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 1}, 3, 0},
  {{4, 128, 2, 8, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I32, 0}, 1, 1},
  {{8, 7168, 8, 32, 16, 8, P_RANDOM, T_MAX, DEP_INDEX_I32, 1}, 5, 1},
  {{8, 128, 8, 64, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I64, 1}, 0, 0},
};

/* The survivors' every output matches the oracle with the gone rank masked; on the old
 * kernels they waited for it (DEP_ERR_PEER once it detached, or DEP_ERR_TIMEOUT). */
START_TEST(a_masked_rank_is_skipped_and_the_rest_match_the_masked_oracle) {
  CR_NEEDS_GPU();
  ow_seed_init(500 + (uint64_t)_i);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &mask_cases[_i].sc, mask_cases[_i].sc.fp8);
  uint8_t masked[OW_MAXW] = {0};
  masked[mask_cases[_i].masked] = 1;
  ow_case_mask(d, masked);
  struct mask_arg a = {d, mask_cases[_i].masked, mask_cases[_i].by_live};
  struct cr_world w;
  cr_world_start(&w, NULL);
  char job[32];
  snprintf(job, sizeof job, "mask-%d", _i);
  cr_run_procs(&w, job, &d->shape, d->sc.world, body_masked, &a, d->desc);
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

TCase *cuda_ops_mask_tcase(void) {
  TCase *t = tcase_create("masks");
  tcase_set_tags(t, "gpu");
  tcase_set_timeout(t, 240);
  tcase_add_loop_test(t, a_masked_rank_is_skipped_and_the_rest_match_the_masked_oracle, 0,
                      (int)(sizeof mask_cases / sizeof mask_cases[0]));
  return t;
}
