/*
 * xnround.c — one round of every operation, against the oracle (xnround.h).
 */
#include "xnround.h"

#include <stdio.h>
#include <stdlib.h>
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

/* The FP8 payload of token t of rank s: byte i, and the scale of group g. */
static uint8_t xn_e4m3(uint32_t s, uint32_t t, uint32_t i) {
  return (uint8_t)(s * 131u + t * 31u + i * 7u + (i >> 5));
}
static float xn_scale(uint32_t s, uint32_t t, uint32_t g) {
  return (float)(s * 1000u + t * 10u + g + 1u);
}

/* A failing check of xn_round_modes: say what (with the case) and free hd. */
#define XFAIL(...)                                                                            \
  do {                                                                                        \
    char what_[OW_MSG - 220];                                                                 \
    snprintf(what_, sizeof what_, __VA_ARGS__);                                               \
    snprintf(res->msg, sizeof res->msg, "%s [%s]", what_, d->desc);                           \
    rc = 1;                                                                                   \
    goto out;                                                                                 \
  } while (0)
#define XCALLH(expr, what)                                                                    \
  do {                                                                                        \
    if ((rc = (expr)) != 0) {                                                                 \
      res->fail_ms = xn_mono_ms();                                                            \
      snprintf(res->msg, sizeof res->msg, "%s: %s: %s [%s]", what, dep_errname(rc),           \
               dep_errmsg(c), d->desc);                                                       \
      goto out;                                                                               \
    }                                                                                         \
  } while (0)

int xn_round_modes(dep_client_t *c, const struct ow_case *d, uint32_t r, struct ow_outs *o,
                   struct xn_result *res) {
  const uint32_t h = d->sc.hidden, K = d->sc.topk, G = h / 128;
  const struct ref_rank_in *in = &d->in[r];
  const struct ref_dispatch_out *want = &d->disp[r];
  const uint32_t n = in->num_tokens;
  uint8_t *x8 = malloc((size_t)n * h + 1), *rx8 = malloc(o->rows_tp * h + 1);
  float *xs = malloc(((size_t)n * G + 1) * sizeof *xs);
  float *rxs = malloc((o->rows_tp * G + 1) * sizeof *rxs);
  float *ow = malloc(((size_t)n * K + 1) * sizeof *ow);
  dep_handle_t *hd = NULL;
  int rc = 0;
  if (x8 == NULL || rx8 == NULL || xs == NULL || rxs == NULL || ow == NULL)
    XFAIL("out of memory");
  for (uint32_t t = 0; t < n; t++) {
    for (uint32_t i = 0; i < h; i++)
      x8[(size_t)t * h + i] = xn_e4m3(r, t, i);
    for (uint32_t g = 0; g < G; g++)
      xs[(size_t)t * G + g] = xn_scale(r, t, g);
  }
  XCALLH(dep_handle_new(c, &hd), "handle");

  /* FP8: every row is its origin's bytes and scales; ids and weights the oracle's. */
  struct dep_dispatch_args da = {.size = sizeof da, .x = x8, .x_scales = xs, .use_fp8 = 1,
                                 .topk_idx = d->idx[r], .index_type = d->sc.itype,
                                 .topk_weights = in->topk_weights, .num_tokens = n,
                                 .recv_x = rx8, .recv_x_scales = rxs, .recv_topk_idx = o->ridx,
                                 .recv_topk_weights = o->rw, .recv_count_per_expert = o->cnt,
                                 .num_recv = &o->num_recv};
  XCALLH(dep_dispatch(c, &da, hd, NULL), "dispatch (fp8)");
  if (o->num_recv != want->num_recv)
    XFAIL("dispatch (fp8): num_recv %u, want %u", o->num_recv, want->num_recv);
  for (uint32_t i = 0; i < want->num_recv; i++) {
    const struct ref_origin f = want->from[i];
    for (uint32_t b = 0; b < h; b++)
      if (rx8[(size_t)i * h + b] != xn_e4m3(f.rank, f.token, b))
        XFAIL("dispatch (fp8): row %u byte %u is not rank %u token %u's", i, b, f.rank, f.token);
    for (uint32_t g = 0; g < G; g++)
      if (rxs[(size_t)i * G + g] != xn_scale(f.rank, f.token, g))
        XFAIL("dispatch (fp8): row %u scale %u is not rank %u token %u's", i, g, f.rank,
              f.token);
  }
  if (memcmp(o->ridx, want->topk_idx, (size_t)want->num_recv * K * 4) != 0 ||
      memcmp(o->rw, want->topk_weights, (size_t)want->num_recv * K * 4) != 0 ||
      memcmp(o->cnt, want->count, d->le * 4) != 0)
    XFAIL("dispatch (fp8): recv_topk_idx, recv_topk_weights or the counts differ from the "
          "oracle's");

  /* Cached, bf16: the oracle's rows, bit for bit, on the FP8 dispatch's routing. */
  struct dep_dispatch_args ca = {.size = sizeof ca, .x = in->x, .num_tokens = n, .cached = 1,
                                 .recv_x = o->rx, .num_recv = &o->num_recv};
  o->num_recv = 0;
  XCALLH(dep_dispatch(c, &ca, hd, NULL), "dispatch (cached)");
  if (o->num_recv != want->num_recv ||
      memcmp(o->rx, want->x, (size_t)want->num_recv * h * 2) != 0)
    XFAIL("dispatch (cached): %u rows, want %u, or their bytes differ from the oracle's",
          o->num_recv, want->num_recv);

  /* Weighted: the vectors' sums as the oracle's; each weight comes back from
   * the one rank that owns its expert, plus zeros from the others: exact. */
  struct dep_combine_args wa = {.size = sizeof wa, .x = d->cx[r], .topk_weights = o->rw,
                                .out = o->out, .out_topk_weights = ow};
  XCALLH(dep_combine(c, &wa, hd, NULL), "combine (weighted)");
  if (ow_check_sum(o->out, &d->comb[r], n, h, "combine (weighted)", d->desc, res->msg)) {
    rc = 1;
    goto out;
  }
  for (size_t i = 0; i < (size_t)n * K; i++) {
    /* An expert of a rank the oracle masks sends no weight back (deepep.h). */
    const int64_t e = in->topk_idx[i];
    float w = e >= 0 && !d->masked[e / d->le] ? in->topk_weights[i] : 0.0f;
    if (ow[i] != w)
      XFAIL("combine (weighted): token %zu weight %zu is %g, want %g", i / K, i % K,
            (double)ow[i], (double)w);
  }
  res->digest = ow_fnv(res->digest, ow, (size_t)n * K * 4);
out:
  dep_handle_free(hd);
  free(x8), free(rx8), free(xs), free(rxs), free(ow);
  return rc;
}

const struct xn_step xn_split_modes[XN_SPLIT_MODES][XN_SPLIT_STEPS] = {
  {{'d', 0, DEP_LL_SEND}, {'d', 1, DEP_LL_SEND}, {'d', 0, DEP_LL_RECV}, {'c', 0, DEP_LL_SEND},
   {'d', 1, DEP_LL_RECV}, {'c', 1, DEP_LL_SEND}, {'c', 0, DEP_LL_RECV}, {'c', 1, DEP_LL_RECV}},
  {{'d', 0, DEP_LL_SEND}, {'d', 1, DEP_LL_SEND}, {'d', 0, DEP_LL_RECV}, {'d', 1, DEP_LL_RECV},
   {'c', 0, DEP_LL_SEND}, {'c', 1, DEP_LL_SEND}, {'c', 0, DEP_LL_RECV}, {'c', 1, DEP_LL_RECV}},
};

int xn_ll_rows_differ(const struct ow_case *d, uint32_t r, const struct ow_outs *o) {
  const struct ref_ll_out *e = &d->ll[r];
  const size_t hs = d->sc.hidden;
  for (uint32_t l = 0; l < d->le; l++)
    if (o->lcnt[l] != e->count[l] ||
        memcmp((const uint16_t *)o->lx + (size_t)l * d->rows_ll * hs,
               e->x + (size_t)l * d->rows_ll * hs, (size_t)e->count[l] * hs * 2) != 0)
      return (int)l;
  return -1;
}

/* Step i of interleaving mode on rank r's micro-batch of case d, checked where it receives. */
static int xn_split_step(dep_client_t *c, const struct ow_case *d, uint32_t r, struct ow_outs *o,
                         dep_handle_t *h, const struct xn_step *st, int mode, int i,
                         struct xn_result *res) {
  const struct ref_rank_in *il = &d->in_ll[r];
  int rc;
  if (st->op == 'd') {
    struct dep_ll_dispatch_args a = {.size = sizeof a, .x = il->x, .topk_idx = d->idx[r],
                                     .index_type = d->sc.itype, .num_tokens = il->num_tokens,
                                     .recv_x = o->lx, .recv_count = o->lcnt,
                                     .phases = st->phase};
    rc = dep_ll_dispatch(c, &a, h, NULL);
  } else {
    struct dep_ll_combine_args a = {.size = sizeof a, .x = d->lx[r], .topk_idx = d->idx[r],
                                    .index_type = d->sc.itype, .topk_weights = il->topk_weights,
                                    .out = o->lout, .phases = st->phase};
    rc = dep_ll_combine(c, &a, h, NULL);
  }
  const char *what = st->op == 'd' ? "dispatch" : "combine";
  const char *half = st->phase == DEP_LL_SEND ? "send" : "receive";
  if (rc != 0) {
    res->fail_ms = xn_mono_ms();
    snprintf(res->msg, sizeof res->msg, "split calls, interleaving %d, step %d (%s %s of "
             "micro-batch %c): %s: %s [%s]", mode, i + 1, what, half, 'A' + st->mb,
             dep_errname(rc), dep_errmsg(c), d->desc);
    return rc;
  }
  if (st->phase != DEP_LL_RECV)
    return 0;
  if (st->op == 'c')
    return ow_check_sum(o->lout, &d->llc[r], il->num_tokens, d->sc.hidden, "split ll_combine",
                        d->desc, res->msg);
  const int l = xn_ll_rows_differ(d, r, o);
  if (l >= 0)
    return ow_fail(res->msg, "split calls, interleaving %d, step %d (dispatch receive of "
                   "micro-batch %c): expert %d's rows are not the oracle's [%s]", mode, i + 1,
                   'A' + st->mb, l, d->desc);
  return 0;
}

int xn_round_split(dep_client_t *c, const struct ow_case *a, const struct ow_case *b, uint32_t r,
                   struct ow_outs o[2], xn_split_hook *hook, void *arg, struct xn_result *res) {
  const struct ow_case *d[2] = {a, b};
  dep_handle_t *h[2] = {NULL, NULL};
  int rc = 0;
  for (int i = 0; rc == 0 && i < 2; i++)
    if ((rc = dep_handle_new(c, &h[i])) != 0)
      snprintf(res->msg, sizeof res->msg, "dep_handle_new: %s: %s", dep_errname(rc),
               dep_errmsg(c));
  for (int mode = 0; rc == 0 && mode < XN_SPLIT_MODES; mode++) {
    for (int i = 0; i < 2; i++) { /* each receive writes its outputs anew */
      memset(o[i].lx, 0xA5, o[i].n_lx * 2);
      memset(o[i].lcnt, 0xA5, d[i]->le * sizeof *o[i].lcnt);
      memset(o[i].lout, 0xA5, (size_t)d[i]->max_ll * d[i]->sc.hidden * 2);
    }
    for (int i = 0; rc == 0 && i < XN_SPLIT_STEPS; i++) {
      const struct xn_step *st = &xn_split_modes[mode][i];
      if (hook != NULL && mode == 0)
        hook(r, i, 0, arg);
      rc = xn_split_step(c, d[st->mb], r, &o[st->mb], h[st->mb], st, mode, i, res);
      if (rc == 0 && hook != NULL && mode == 0)
        hook(r, i, 1, arg);
    }
  }
  for (int i = 0; i < 2; i++)
    dep_handle_free(h[i]);
  return rc;
}
