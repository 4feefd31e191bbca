/*
 * cudarounds.c — one round of every operation against the oracle on the
 * cuda backend (cudarounds.h).
 */
#include "cudarounds.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "deepep.h"
#include "host_ops.h"

/* ---- what the kernels must give -------------------------------------------------- */

/* The host backend's float32 sums in its order, rounded once: bit for bit. */
void cr_want_combine(const struct ow_case *d, uint32_t o, uint16_t *want, float *acc) {
  ow_want_combine(d, o, NULL, NULL, want, acc);
}

void cr_want_ll_combine(const struct ow_case *d, uint32_t o, uint16_t *want, float *acc) {
  const uint32_t h = d->sc.hidden, K = d->sc.topk;
  const struct ref_rank_in *in = &d->in_ll[o];
  for (uint32_t t = 0; t < in->num_tokens; t++) {
    memset(acc, 0, h * sizeof *acc);
    for (uint32_t j = 0; j < K; j++) {
      int64_t e = in->topk_idx[(size_t)t * K + j];
      if (e < 0)
        continue;
      uint32_t r = (uint32_t)(e / d->le), l = (uint32_t)(e % d->le);
      for (int32_t i = 0; i < d->ll[r].count[l]; i++) {
        size_t row = (size_t)l * d->rows_ll + (size_t)i;
        if (d->ll[r].from[row].rank != o || d->ll[r].from[row].token != t)
          continue;
        float w = in->topk_weights[(size_t)t * K + j];
        for (uint32_t c = 0; c < h; c++)
          acc[c] += w * host_ops_bf16_to_float(d->lx[r][row * h + c]);
      }
    }
    for (uint32_t c = 0; c < h; c++)
      want[(size_t)t * h + c] = host_ops_float_to_bf16(acc[c]);
  }
}

/* A summed output: within the oracle's bound, then bit for bit, then untouched past n. */
int cr_check_sum(struct rk *k, const struct ow_case *d, const struct ref_sum *ref,
                     const uint16_t *want, uint32_t n, uint32_t cap, uint8_t pz, const char *op) {
  const uint16_t *got = (const uint16_t *)k->host;
  const size_t h = d->sc.hidden;
  if (ow_check_sum(got, ref, n, (uint32_t)h, op, d->desc, k->msg))
    return 1;
  for (size_t i = 0; i < n * h; i++)
    if (got[i] != want[i])
      return ow_fail(k->msg, "%s: token %zu channel %zu: 0x%04x, the host's float32 order gives "
                     "0x%04x [%s]", op, i / h, i % h, got[i], want[i], d->desc);
  if (ow_unpoisoned(got + n * h, (cap - n) * h * 2, pz) >= 0)
    return ow_fail(k->msg, "%s: wrote past num_tokens %u [%s]", op, n, d->desc);
  return 0;
}

/* ---- one round: layout, dispatch, combine, LL bf16 (and FP8) ------------------------------ */

int cr_round_tp(struct rk *k, const struct ow_case *d, uint8_t pz, uint64_t *dig) {
  const uint32_t r = k->rank, h = k->h_, K = k->K, W = k->W, n = d->in[r].num_tokens;
  const struct ref_rank_in *in = &d->in[r];
  const struct ref_dispatch_out *e = &d->disp[r];
  int32_t tpr[OW_MAXW], *tpe = malloc(k->E * 4);
  uint8_t *tir = malloc((size_t)n * W + 1);
  ref_layout(&d->shape, W, in, tpr, tpe, tir);
  int bad = cr_poison(k, B_TPR, pz) || cr_poison(k, B_TPE, pz) || cr_poison(k, B_TIR, pz);
  struct dep_layout_args la = {sizeof(struct dep_layout_args), CR_DEV(k, B_IDX), d->sc.itype, n,
                               CR_DEV(k, B_TPR), CR_DEV(k, B_TPE),
                               CR_DEV(k, B_TIR)};
  int rc = bad ? 0 : dep_layout(k->c, &la, k->s);
  bad = bad || rc != 0 || cr_get(k, B_TPR) || memcmp(k->host, tpr, W * 4) != 0 ||
        cr_get(k, B_TPE) || memcmp(k->host, tpe, k->E * 4) != 0 || cr_get(k, B_TIR) ||
        memcmp(k->host, tir, (size_t)n * W) != 0 ||
        ow_unpoisoned(k->host + (size_t)n * W, (size_t)(k->mt - n) * W, pz) >= 0;
  free(tpe);
  free(tir);
  if (bad)
    return k->msg[0] ? 1 : ow_fail(k->msg, "layout: %s, outputs differ from the oracle [%s]",
                                   rc ? dep_errmsg(k->c) : "ok", d->desc);

  if (cr_poison(k, B_RX, pz) || cr_poison(k, B_RIDX, pz) || cr_poison(k, B_RW, pz) || cr_poison(k, B_CNT, pz))
    return 1;
  uint32_t nrecv = 0xdeadbeef;
  struct dep_dispatch_args da = {.size = sizeof(struct dep_dispatch_args), .x = CR_DEV(k, B_X),
                                 .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                 .topk_weights = CR_DEV(k, B_W), .num_tokens = n,
                                 .recv_x = CR_DEV(k, B_RX), .recv_topk_idx = CR_DEV(k, B_RIDX), .recv_topk_weights = CR_DEV(k, B_RW), .recv_count_per_expert = CR_DEV(k, B_CNT), .num_recv = &nrecv};
  CALL(k, dep_dispatch(k->c, &da, k->h, k->s), "dep_dispatch");
  if (nrecv != e->num_recv)
    return ow_fail(k->msg, "dispatch: num_recv %u, want %u [%s]", nrecv, e->num_recv, d->desc);
  size_t rows = k->sz[B_RX] / (h * 2);
  if (cr_get(k, B_RX))
    return 1;
  if (memcmp(k->host, e->x, (size_t)nrecv * h * 2) != 0)
    return ow_fail(k->msg, "dispatch: recv_x differs from the oracle [%s]", d->desc);
  if (ow_unpoisoned(k->host + (size_t)nrecv * h * 2, (rows - nrecv) * h * 2, pz) >= 0)
    return ow_fail(k->msg, "dispatch: recv_x written past num_recv [%s]", d->desc);
  *dig = ow_fnv(*dig, k->host, (size_t)nrecv * h * 2);
  if (cr_get(k, B_RIDX) || memcmp(k->host, e->topk_idx, (size_t)nrecv * K * 4) != 0 ||
      ow_unpoisoned(k->host + (size_t)nrecv * K * 4, (rows - nrecv) * K * 4, pz) >= 0)
    return ow_fail(k->msg, "dispatch: recv_topk_idx differs [%s]", d->desc);
  if (cr_get(k, B_RW) || memcmp(k->host, e->topk_weights, (size_t)nrecv * K * 4) != 0)
    return ow_fail(k->msg, "dispatch: recv_topk_weights differ [%s]", d->desc);
  if (cr_get(k, B_CNT) || memcmp(k->host, e->count, k->le * 4) != 0)
    return ow_fail(k->msg, "dispatch: recv_count_per_expert differs [%s]", d->desc);

  if (cr_poison(k, B_OUT, pz))
    return 1;
  struct dep_combine_args ca = {.size = sizeof(struct dep_combine_args), .x = CR_DEV(k, B_CX),
                                .out = CR_DEV(k, B_OUT)};
  CALL(k, dep_combine(k->c, &ca, k->h, k->s), "dep_combine");
  uint16_t *want = malloc(((size_t)n * h + 1) * 2);
  float *acc = malloc(h * 4);
  cr_want_combine(d, r, want, acc);
  rc = cr_get(k, B_OUT) || cr_check_sum(k, d, &d->comb[r], want, n, k->mt, pz, "combine");
  free(want);
  free(acc);
  *dig = ow_fnv(*dig, k->host, (size_t)n * h * 2);
  return rc;
}

int cr_round_ll(struct rk *k, const struct ow_case *d, int fp8, uint8_t pz, uint64_t *dig) {
  const uint32_t r = k->rank, h = k->h_, G = h / 128, rows = k->rows;
  const struct ref_rank_in *in = &d->in_ll[r];
  const struct ref_ll_out *e = &d->ll[r];
  const size_t es = fp8 ? 1 : 2;
  if (cr_poison(k, B_LRX, pz) || cr_poison(k, B_LSC, pz) || cr_poison(k, B_LCNT, pz) || cr_poison(k, B_LOUT, pz) ||
      cr_poison(k, B_LSRC, pz) || cr_poison(k, B_LRANGE, pz))
    return 1;
  struct dep_ll_dispatch_args la = {sizeof(struct dep_ll_dispatch_args), CR_DEV(k, B_X),
                                    CR_DEV(k, B_IDX), d->sc.itype, in->num_tokens, fp8,
                                    CR_DEV(k, B_LRX), fp8 ? CR_DEV(k, B_LSC) : NULL, CR_DEV(k, B_LCNT), 0, NULL};
  struct dep_ll_combine_args lc = {sizeof(struct dep_ll_combine_args), CR_DEV(k, B_LX),
                                   CR_DEV(k, B_IDX), d->sc.itype, CR_DEV(k, B_W),
                                   CR_DEV(k, B_LOUT), 0, NULL};
  /* Back to back with no synchronisation between them, as a graph would run them. */
  CALL(k, dep_ll_dispatch(k->c, &la, k->h, k->s), "dep_ll_dispatch");
  CALL(k, dep_ll_combine(k->c, &lc, k->h, k->s), "dep_ll_combine");
  /* Where each row came from, read from the handle behind them on the same stream. */
  struct dep_ll_handle_info_args ia = {sizeof ia, CR_DEV(k, B_LSRC), CR_DEV(k, B_LRANGE)};
  CALL(k, dep_ll_handle_info(k->c, &ia, k->h, k->s), "dep_ll_handle_info");
  int32_t *src = malloc(k->sz[B_LSRC] + 4);
  if (src == NULL)
    return ow_fail(k->msg, "out of memory");
  int bad = cr_get(k, B_LSRC);
  if (!bad)
    memcpy(src, k->host, k->sz[B_LSRC]);
  bad = bad || cr_get(k, B_LRANGE) || ow_check_ll_info(d, r, src, (const int64_t *)k->host,
                                                       k->msg);
  free(src);
  if (bad)
    return 1;
  if (cr_get(k, B_LCNT))
    return 1;
  if (memcmp(k->host, e->count, k->le * 4) != 0)
    return ow_fail(k->msg, "ll_dispatch%s: recv_count differs [%s]", fp8 ? " fp8" : "", d->desc);
  if (cr_get(k, B_LRX))
    return 1;
  for (uint32_t l = 0; l < k->le; l++)
    for (uint32_t i = 0; i < rows; i++) {
      size_t row = (size_t)l * rows + i;
      const uint8_t *got = k->host + row * h * es;
      if ((int32_t)i >= e->count[l]) {
        if (ow_unpoisoned(got, h * es, pz) >= 0)
          return ow_fail(k->msg, "ll_dispatch: expert %u row %u past recv_count written [%s]", l,
                         i, d->desc);
      } else if (memcmp(got, fp8 ? (const void *)(e->x8 + row * h) : (const void *)(e->x + row * h),
                        h * es) != 0) {
        return ow_fail(k->msg, "ll_dispatch%s: expert %u row %u (rank %u token %u) differs [%s]",
                       fp8 ? " fp8" : "", l, i, e->from[row].rank, e->from[row].token, d->desc);
      }
    }
  for (uint32_t l = 0; l < k->le; l++) /* valid rows only: the rest holds this round's poison */
    *dig = ow_fnv(*dig, k->host + (size_t)l * rows * h * es, (size_t)e->count[l] * h * es);
  if (fp8) {
    if (cr_get(k, B_LSC))
      return 1;
    for (uint32_t l = 0; l < k->le; l++)
      for (int32_t i = 0; i < e->count[l]; i++) {
        size_t row = (size_t)l * rows + (size_t)i;
        if (memcmp(k->host + row * G * 4, e->scales + row * G, G * 4) != 0)
          return ow_fail(k->msg, "ll_dispatch fp8: expert %u row %d: scales differ [%s]", l, i,
                         d->desc);
      }
  }
  uint16_t *want = malloc(((size_t)in->num_tokens * h + 1) * 2);
  float *acc = malloc(h * 4);
  cr_want_ll_combine(d, r, want, acc);
  int rc = cr_get(k, B_LOUT) ||
           cr_check_sum(k, d, &d->llc[r], want, in->num_tokens, k->maxll, pz, "ll_combine");
  free(want);
  free(acc);
  *dig = ow_fnv(*dig, k->host, (size_t)in->num_tokens * h * 2);
  return rc;
}

int cr_upload(struct rk *k, const struct ow_case *d) {
  const uint32_t r = k->rank, n = d->in[r].num_tokens, h = k->h_, K = k->K;
  return cr_put(k, B_X, d->in[r].x, (size_t)n * h * 2) ||
         cr_put(k, B_IDX, d->idx[r], (size_t)n * K * (d->sc.itype == DEP_INDEX_I64 ? 8 : 4)) ||
         cr_put(k, B_W, d->in[r].topk_weights, (size_t)n * K * 4) ||
         cr_put(k, B_CX, d->cx[r], (size_t)d->disp[r].num_recv * h * 2) ||
         cr_put(k, B_LX, d->lx[r], k->sz[B_LX]);
}

/* Rounds over cases of one shape (arg: struct cr_rounds): each round every
 * op; a case seen again (under another poison) must give bit-identical
 * outputs. */
int cr_body_rounds(struct rk *k, void *arg) {
  const struct cr_rounds *a = arg;
  uint64_t first[16] = {0};
  for (int round = 0; round < a->nrounds; round++) {
    const struct ow_case *d = &a->cases[round % a->ncases];
    uint8_t pz = (round / a->ncases) & 1 ? 0x5A : 0xA5;
    uint64_t dig = 0;
    int rc = cr_upload(k, d) || cr_round_tp(k, d, pz, &dig) || cr_round_ll(k, d, 0, pz, &dig) ||
             (d->sc.fp8 && cr_round_ll(k, d, 1, pz, &dig));
    if (rc) {
      /* A call with no tokens reports what the kernels recorded, if anything. */
      struct dep_layout_args z = {sizeof(struct dep_layout_args), NULL, DEP_INDEX_I64, 0,
                                  CR_DEV(k, B_TPR), CR_DEV(k, B_TPE), NULL};
      int zr = dep_layout(k->c, &z, k->s);
      size_t l = strlen(k->msg);
      snprintf(k->msg + l, OW_MSG - l, " (round %d)%s%s", round, zr ? "; the GPU recorded: " : "",
               zr ? dep_errmsg(k->c) : "");
      return 1;
    }
    if (round < a->ncases)
      first[round % 16] = dig;
    else if (dig != first[round % a->ncases % 16])
      return ow_fail(k->msg, "round %d repeats round %d's inputs but its outputs differ [%s]",
                     round, round % a->ncases, d->desc);
  }
  return 0;
}

int cr_body_late(struct rk *k, void *arg) {
  const struct cr_late *l = arg;
  uint64_t dig = 0;
  if (cr_upload(k, l->d))
    return 1;
  for (int round = 0; round < 4; round++) {
    if (k->rank == l->late)
      usleep(30000);
    if (cr_round_tp(k, l->d, round & 1 ? 0x5A : 0xA5, &dig))
      return 1;
  }
  return 0;
}

int cr_body_peer_dies(struct rk *k, void *arg) {
  const struct cr_peer_dies *p = arg;
  const struct ow_case *d = p->d;
  uint64_t dig = 0;
  if (cr_upload(k, d) || cr_round_tp(k, d, 0xA5, &dig))
    return 1;
  if (k->rank == 1) {
    usleep(300000);
    *p->exit_at = cr_ms_now();
    _exit(0);
  }
  uint32_t nrecv = 0;
  struct dep_dispatch_args da = {.size = sizeof da, .x = CR_DEV(k, B_X),
                                 .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                 .topk_weights = CR_DEV(k, B_W),
                                 .num_tokens = d->in[0].num_tokens, .recv_x = CR_DEV(k, B_RX),
                                 .recv_topk_idx = CR_DEV(k, B_RIDX),
                                 .recv_topk_weights = CR_DEV(k, B_RW),
                                 .recv_count_per_expert = CR_DEV(k, B_CNT), .num_recv = &nrecv};
  const int rc = dep_dispatch(k->c, &da, k->h, k->s);
  const uint64_t now = cr_ms_now();
  if (rc != DEP_ERR_PEER)
    return ow_fail(k->msg, "rank 0: dep_dispatch returned %s (%s), expected DEP_ERR_PEER",
                   dep_errname(rc), dep_errmsg(k->c));
  for (int i = 0; i < 2; i++)
    if (p->must[i] != NULL && strstr(dep_errmsg(k->c), p->must[i]) == NULL)
      return ow_fail(k->msg, "rank 0: the message does not say \"%s\": %s", p->must[i],
                     dep_errmsg(k->c));
  if (*p->exit_at == 0 || now - *p->exit_at > p->bound_ms)
    return ow_fail(k->msg, "rank 0: DEP_ERR_PEER %llu ms after rank 1's exit",
                   (unsigned long long)(now - *p->exit_at));
  printf("%s: DEP_ERR_PEER %llu ms after the peer's exit: %s\n", p->tag,
         (unsigned long long)(now - *p->exit_at), dep_errmsg(k->c));
  fflush(stdout); /* a rank process ends with _exit */
  return 0;
}
