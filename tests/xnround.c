/*
 * xnround.c — one round of every operation, against the oracle (xnround.h).
 */
#include "xnround.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

int64_t xn_mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

#define XCALL(expr, what)                                                                     \
  do {                                                                                        \
    int rc_ = (expr);                                                                         \
    if (rc_ != 0) {                                                                           \
      res->fail_ms = xn_mono_ms();                                                            \
      snprintf(res->msg, sizeof res->msg, "%s: %s: %s [%s]", what, dep_errname(rc_),          \
               dep_errmsg(c), d->desc);                                                       \
      return rc_;                                                                             \
    }                                                                                         \
  } while (0)

/* One round of every operation on rank r, folded into the digest. */
int xn_round(dep_client_t *c, const struct ow_case *d, uint32_t r, int fp8, struct ow_outs *o,
             struct xn_result *res) {
  const uint32_t h = d->sc.hidden, K = d->sc.topk, W = d->sc.world, E = d->sc.experts;
  const struct ref_rank_in *in = &d->in[r];
  uint64_t dig = res->digest;
  struct dep_layout_args la = {.size = sizeof la, .topk_idx = d->idx[r], .index_type = d->sc.itype,
                               .num_tokens = in->num_tokens, .tokens_per_rank = o->tpr,
                               .tokens_per_expert = o->tpe, .token_in_rank = o->tir};
  XCALL(dep_layout(c, &la, NULL), "layout");
  dig = ow_fnv(dig, o->tpr, W * 4);
  dig = ow_fnv(dig, o->tpe, E * 4);
  dig = ow_fnv(dig, o->tir, (size_t)in->num_tokens * W);

  struct dep_dispatch_args da = {.size = sizeof da, .x = in->x, .topk_idx = d->idx[r], .index_type = d->sc.itype,
                                 .topk_weights = in->topk_weights, .num_tokens = in->num_tokens,
                                 .recv_x = o->rx, .recv_topk_idx = o->ridx,
                                 .recv_topk_weights = o->rw, .recv_count_per_expert = o->cnt,
                                 .num_recv = &o->num_recv};
  dep_handle_t *hd = NULL;
  XCALL(dep_handle_new(c, &hd), "handle");
  int rc = dep_dispatch(c, &da, hd, NULL);
  if (rc == 0 && o->num_recv != d->disp[r].num_recv) {
    snprintf(res->msg, sizeof res->msg, "dispatch: num_recv %u, want %u [%s]", o->num_recv,
             d->disp[r].num_recv, d->desc);
    rc = 1;
  }
  if (rc == 0) {
    size_t n = o->num_recv;
    dig = ow_fnv(dig, o->rx, n * h * 2);
    dig = ow_fnv(dig, o->ridx, n * K * 4);
    dig = ow_fnv(dig, o->rw, n * K * 4);
    dig = ow_fnv(dig, o->cnt, d->le * 4);
    struct dep_combine_args ca = {.size = sizeof ca, .x = d->cx[r], .out = o->out};
    rc = dep_combine(c, &ca, hd, NULL);
    if (rc == 0 && ow_check_sum(o->out, &d->comb[r], in->num_tokens, h, "combine", d->desc,
                                res->msg))
      rc = 1;
    dig = ow_fnv(dig, o->out, (size_t)in->num_tokens * h * 2);
  }
  if (rc != 0) {
    if (rc != 1) {
      res->fail_ms = xn_mono_ms();
      snprintf(res->msg, sizeof res->msg, "dispatch/combine: %s: %s [%s]", dep_errname(rc),
               dep_errmsg(c), d->desc);
    }
    dep_handle_free(hd);
    return rc;
  }

  const struct ref_rank_in *il = &d->in_ll[r];
  const struct ref_ll_out *e = &d->ll[r];
  struct dep_ll_dispatch_args lda = {.size = sizeof lda, .x = il->x, .topk_idx = d->idx[r],
                                     .index_type = d->sc.itype, .num_tokens = il->num_tokens,
                                     .use_fp8 = fp8, .recv_x = o->lx,
                                     .recv_scales = fp8 ? o->lscales : NULL,
                                     .recv_count = o->lcnt};
  rc = dep_ll_dispatch(c, &lda, hd, NULL);
  if (rc == 0) {
    const size_t es = fp8 ? 1 : 2, G = h / 128;
    for (uint32_t l = 0; l < d->le && rc == 0; l++) {
      if (o->lcnt[l] != e->count[l]) {
        snprintf(res->msg, sizeof res->msg, "ll_dispatch: recv_count[%u] %d, want %d [%s]", l,
                 o->lcnt[l], e->count[l], d->desc);
        rc = 1;
        break;
      }
      for (int32_t i = 0; i < o->lcnt[l]; i++) {
        size_t row = (size_t)l * d->rows_ll + (size_t)i;
        dig = ow_fnv(dig, (const uint8_t *)o->lx + row * h * es, h * es);
        if (fp8)
          dig = ow_fnv(dig, o->lscales + row * G, G * 4);
      }
    }
    dig = ow_fnv(dig, o->lcnt, d->le * 4);
  }
  if (rc == 0) {
    struct dep_ll_combine_args lca = {.size = sizeof lca, .x = d->lx[r], .topk_idx = d->idx[r],
                                      .index_type = d->sc.itype,
                                      .topk_weights = il->topk_weights, .out = o->lout};
    rc = dep_ll_combine(c, &lca, hd, NULL);
    if (rc == 0 && ow_check_sum(o->lout, &d->llc[r], il->num_tokens, h, "ll_combine", d->desc,
                                res->msg))
      rc = 1;
    dig = ow_fnv(dig, o->lout, (size_t)il->num_tokens * h * 2);
  }
  dep_handle_free(hd);
  if (rc > 1 || rc < 0) {
    res->fail_ms = xn_mono_ms();
    snprintf(res->msg, sizeof res->msg, "ll ops: %s: %s [%s]", dep_errname(rc), dep_errmsg(c),
             d->desc);
  }
  res->digest = dig;
  return rc;
}
