/*
 * opsworld.c — the world of rank processes and the scenario data that
 * check_ops.c runs (see opsworld.h).
 */
#include "opsworld.h"

#include <check.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- random inputs ---------------------------------------------------------- */

uint64_t ow_seed;
static uint64_t ow_rng;

void ow_seed_init(uint64_t salt) {
  const char *e = getenv("DEP_TEST_SEED");
  ow_seed = e != NULL ? strtoull(e, NULL, 0)
                   : (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid() << 16;
  ow_rng = ow_seed + salt * 0x1234567ull;
}

uint64_t ow_rnd(void) { /* splitmix64 */
  uint64_t z = (ow_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint32_t ow_below(uint32_t n) { return n ? (uint32_t)(ow_rnd() % n) : 0; }
float ow_unif(void) { return (float)(ow_rnd() >> 40) / (float)(1u << 24); } /* [0, 1) */

/* A bf16 in [-1, 1) * 2^e that is never one of the poison patterns. */
static uint16_t rand_bf16(int e) {
  uint16_t b = host_ops_float_to_bf16(ldexpf(ow_unif() * 2.0f - 1.0f, e));
  return b == 0xA5A5 || b == 0x5A5A ? 0x3f80 : b;
}

/* ---- a world of ranks: shared slabs, one process per rank ------------------ */


void ow_world_open(struct ow_world *w, const struct dep_job_shape *s, uint32_t n,
                   uint32_t chunk) {
  char why[256];
  memset(w, 0, sizeof *w);
  w->n = n;
  w->chunk = chunk;
  ck_assert_msg(dep__slab_layout_nodes(s, n, n, chunk, &w->lay, why, sizeof why) == 0, "%s", why);
  w->slab_bytes = dep_round_up(w->lay.total_bytes, 4096);
  w->map_bytes = w->slab_bytes * n;
  int fd = memfd_create("check-ops-slabs", MFD_CLOEXEC);
  ck_assert_msg(fd >= 0, "memfd_create: %s", strerror(errno));
  ck_assert_int_eq(ftruncate(fd, (off_t)w->map_bytes), 0);
  w->map = mmap(NULL, w->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert(w->map != MAP_FAILED);
  close(fd);
  for (uint32_t r = 0; r < n; r++)
    w->slabs[r] = w->map + r * w->slab_bytes;
  w->msg = mmap(NULL, (size_t)n * OW_MSG, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                -1, 0);
  ck_assert(w->msg != MAP_FAILED);
}

void ow_world_close(struct ow_world *w) {
  munmap(w->map, w->map_bytes);
  munmap(w->msg, (size_t)w->n * OW_MSG);
}

int ow_fail(char *msg, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, OW_MSG, fmt, ap);
  va_end(ap);
  return 1;
}


/* Fork one process per rank, each with its own ctx on the shared slabs. */
static void run_ranks(struct ow_world *w, const struct dep_job_shape *s, ow_rank_fn fn, void *arg,
                      const char *what) {
  pid_t pid[OW_MAXW];
  for (uint32_t r = 0; r < w->n; r++) {
    pid[r] = fork();
    ck_assert(pid[r] >= 0);
    if (pid[r] == 0) {
      struct ops_ctx c;
      char why[256];
      char *msg = w->msg + (size_t)r * OW_MSG;
      if (host_ops_init_nodes(&c, s, w->n, r, w->slabs, NULL, w->chunk, OW_TIMEOUT_MS, why,
                              sizeof why) != 0)
        _exit(ow_fail(msg, "host_ops_init: %s", why));
      int rc = fn(&c, arg, msg);
      host_ops_fini(&c);
      _exit(rc ? 1 : 0);
    }
  }
  /* Reap ranks as they end; once one fails its peers would only wait out
   * their timeout for it, so stop them (our own children, by pid). */
  int st[OW_MAXW], done[OW_MAXW] = {0}, left = (int)w->n, failed = 0;
  time_t deadline = time(NULL) + 100;
  while (left > 0) {
    int progressed = 0;
    for (uint32_t r = 0; r < w->n; r++) {
      if (done[r] || waitpid(pid[r], &st[r], WNOHANG) == 0)
        continue;
      done[r] = 1, left--, progressed = 1;
      if (!WIFEXITED(st[r]) || WEXITSTATUS(st[r]) != 0)
        failed++;
    }
    if (left > 0 && (failed > 0 || time(NULL) > deadline)) {
      for (uint32_t r = 0; r < w->n; r++)
        if (!done[r])
          kill(pid[r], SIGKILL);
    } else if (!progressed) {
      usleep(500);
    }
  }
  char report[OW_FAILS_LEN] = "";
  size_t len = 0;
  for (uint32_t r = 0; r < w->n && len < sizeof report; r++) {
    if (WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0)
      continue;
    len += (size_t)snprintf(report + len, sizeof report - len, "\n  rank %u (%s): %s", r,
                            WIFSIGNALED(st[r]) ? strsignal(WTERMSIG(st[r])) : "failed",
                            w->msg[r * OW_MSG] ? w->msg + (size_t)r * OW_MSG : "(stopped)");
  }
  OW_ASSERT_NONE_FAILED(what, failed, report);
}

void ow_run_ranks_chunked(const struct dep_job_shape *s, uint32_t n, uint32_t chunk, ow_rank_fn fn,
                          void *arg, const char *what) {
  struct ow_world w;
  ow_world_open(&w, s, n, chunk);
  run_ranks(&w, s, fn, arg, what);
  ow_world_close(&w);
}

void ow_run_ranks(const struct dep_job_shape *s, uint32_t n, ow_rank_fn fn, void *arg,
                  const char *what) {
  ow_run_ranks_chunked(s, n, 0, fn, arg, what);
}

/* ---- scenarios: inputs and the oracle's expectations ------------------------- */

static const char *const pattern_name[] = {"random", "duplicates", "one-rank", "all -1",
                                          "one-expert"};
static const char *const tokens_name[] = {"max", "zero", "one", "mixed"};



static int64_t pick_expert(const struct ow_case *d) {
  uint32_t E = d->sc.experts;
  switch (d->sc.pattern) {
  case P_RANDOM: return ow_below(8) == 0 ? -1 : (int64_t)ow_below(E);
  case P_DUP: return ow_below(6) == 0 ? -1 : (int64_t)ow_below(E < 3 ? E : 3);
  case P_ONE_RANK: return (int64_t)((d->sc.world - 1) * d->le + ow_below(d->le));
  case P_NONE: return -1;
  default: return E / 2; /* P_ONE_EXPERT: every k the same expert */
  }
}

void ow_case_make(struct ow_case *d, const struct ow_scenario *sc, int fp8) {
  memset(d, 0, sizeof *d);
  d->sc = *sc;
  d->sc.fp8 = fp8;
  struct dep_job_shape s = {sc->max_tokens, sc->hidden, sc->experts, sc->topk, DEP_DTYPE_BF16,
                            sc->max_ll};
  d->shape = s;
  d->le = sc->experts / sc->world;
  struct dep_slab_layout lay;
  char why[256];
  ck_assert_msg(dep__slab_layout(&s, sc->world, &lay, why, sizeof why) == 0, "%s", why);
  d->max_ll = lay.max_ll_tokens; /* sc->max_ll, or the default when it is 0 */
  d->rows_ll = sc->world * d->max_ll;
  snprintf(d->desc, sizeof d->desc, "world %u hidden %u topk %u experts %u max_tokens %u max_ll %u"
           " routing %s tokens %s %s fp8 %d", sc->world, sc->hidden, sc->topk, sc->experts,
           sc->max_tokens, sc->max_ll, pattern_name[sc->pattern], tokens_name[sc->tokens],
           sc->itype == DEP_INDEX_I64 ? "int64" : "int32", fp8);
  uint32_t h = sc->hidden, K = sc->topk, W = sc->world;
  for (uint32_t r = 0; r < W; r++) {
    uint32_t n = sc->tokens == T_MAX ? sc->max_tokens : sc->tokens == T_ZERO ? 0
               : sc->tokens == T_ONE ? 1 : r == 0 ? 0 : r == W - 1 ? sc->max_tokens
               : ow_below(sc->max_tokens + 1);
    uint16_t *x = malloc(((size_t)n * h + 1) * 2);
    int64_t *idx = malloc(((size_t)n * K + 1) * 8);
    float *w = malloc(((size_t)n * K + 1) * 4);
    d->idx[r] = malloc(((size_t)n * K + 1) * 8);
    ck_assert(x && idx && w && d->idx[r]);
    /* Each 128-channel group its own magnitude, now and then all zero, so
     * that FP8 scales cover the 1e-4 floor as well as large values. */
    for (uint32_t t = 0; t < n; t++)
      for (uint32_t g = 0; g < h / 128; g++) {
        int zero = ow_below(16) == 0, e = (int)ow_below(21) - 14;
        for (uint32_t c = 0; c < 128; c++)
          x[(size_t)t * h + g * 128 + c] = zero ? 0 : rand_bf16(e);
      }
    for (size_t i = 0; i < (size_t)n * K; i++) {
      idx[i] = pick_expert(d);
      w[i] = 0.01f + ow_unif();
      if (sc->itype == DEP_INDEX_I64)
        ((int64_t *)d->idx[r])[i] = idx[i];
      else
        ((int32_t *)d->idx[r])[i] = (int32_t)idx[i];
    }
    d->in[r] = (struct ref_rank_in){.num_tokens = n, .x = x, .topk_idx = idx, .topk_weights = w};
    d->in_ll[r] = d->in[r];
    d->in_ll[r].num_tokens = n < d->max_ll ? n : d->max_ll;
  }
  ck_assert_int_eq(ref_dispatch(&d->shape, W, d->in, d->disp), 0);
  for (uint32_t r = 0; r < W; r++) {
    size_t n = (size_t)d->disp[r].num_recv * h;
    d->cx[r] = malloc((n + 1) * 2);
    ck_assert(d->cx[r]);
    for (size_t i = 0; i < n; i++)
      d->cx[r][i] = rand_bf16(2);
  }
  ck_assert_int_eq(ref_combine(&d->shape, W, d->in, d->disp, (const uint16_t *const *)d->cx,
                               d->comb), 0);
  ck_assert_int_eq(ref_ll_dispatch(&d->shape, W, d->max_ll, d->in_ll, fp8, d->ll), 0);
  for (uint32_t r = 0; r < W; r++) {
    size_t n = (size_t)d->le * d->rows_ll * h;
    d->lx[r] = malloc(n * 2);
    ck_assert(d->lx[r]);
    for (size_t i = 0; i < n; i++) {
      size_t row = i / h;
      int valid = (int64_t)(row % d->rows_ll) < d->ll[r].count[row / d->rows_ll];
      d->lx[r][i] = valid ? rand_bf16(1) : 0x7fc0; /* NaN: poisons any sum that reads it */
    }
  }
  ck_assert_int_eq(ref_ll_combine(&d->shape, W, d->in_ll, d->ll, (const uint16_t *const *)d->lx,
                                  d->llc), 0);
}

void ow_case_free(struct ow_case *d) {
  uint32_t W = d->sc.world;
  for (uint32_t r = 0; r < W; r++) {
    free((void *)d->in[r].x);
    free((void *)d->in[r].topk_idx);
    free((void *)d->in[r].topk_weights);
    free(d->idx[r]);
    free(d->cx[r]);
    free(d->lx[r]);
  }
  ref_dispatch_free(d->disp, W);
  ref_sum_free(d->comb, W);
  ref_ll_free(d->ll, W);
  ref_sum_free(d->llc, W);
}

void ow_case_mask(struct ow_case *d, const uint8_t *masked) {
  const uint32_t W = d->sc.world;
  memcpy(d->masked, masked, W);
  struct ref_rank_in m[OW_MAXW], mll[OW_MAXW];
  ck_assert_int_eq(ref_mask(&d->shape, W, d->in, masked, m), 0);
  ck_assert_int_eq(ref_mask(&d->shape, W, d->in_ll, masked, mll), 0);
  ref_dispatch_free(d->disp, W);
  ref_sum_free(d->comb, W);
  ref_ll_free(d->ll, W);
  ref_sum_free(d->llc, W);
  /* Fewer rows than before: cx and lx hold enough (a masked dispatch receives no more). */
  ck_assert_int_eq(ref_dispatch(&d->shape, W, m, d->disp), 0);
  ck_assert_int_eq(ref_combine(&d->shape, W, m, d->disp, (const uint16_t *const *)d->cx,
                               d->comb), 0);
  ck_assert_int_eq(ref_ll_dispatch(&d->shape, W, d->max_ll, mll, d->sc.fp8, d->ll), 0);
  ck_assert_int_eq(ref_ll_combine(&d->shape, W, mll, d->ll, (const uint16_t *const *)d->lx,
                                  d->llc), 0);
  ref_mask_free(m, W);
  ref_mask_free(mll, W);
}

/* ---- one rank's calls, each checked against the oracle ---------------------- */


void ow_outs_alloc(struct ow_outs *o, const struct ow_case *d) {
  uint32_t W = d->sc.world, h = d->sc.hidden, K = d->sc.topk, mt = d->sc.max_tokens;
  memset(o, 0, sizeof *o);
  o->rows_tp = (size_t)W * mt;
  o->n_lx = (size_t)d->le * d->rows_ll * h;
  o->n_ls = (size_t)d->le * d->rows_ll * (h / 128);
  o->tpr = malloc(W * 4);
  o->tpe = malloc(d->sc.experts * 4);
  o->tir = malloc((size_t)mt * W);
  o->rx = malloc(o->rows_tp * h * 2);
  o->ridx = malloc(o->rows_tp * K * 4);
  o->rw = malloc(o->rows_tp * K * 4);
  o->cnt = malloc(d->le * 4);
  o->out = malloc((size_t)mt * h * 2);
  o->lx = malloc(o->n_lx * 2);
  o->lscales = malloc(o->n_ls * 4);
  o->lcnt = malloc(d->le * 4);
  o->lout = malloc((size_t)d->max_ll * h * 2);
  o->lsrc = malloc((size_t)d->le * d->rows_ll * 4);
  o->lrange = malloc((size_t)d->le * W * 8);
  host_ops_handle_init(&o->h);
}

void ow_outs_free(struct ow_outs *o) {
  free(o->tpr), free(o->tpe), free(o->tir), free(o->rx), free(o->ridx), free(o->rw);
  free(o->cnt), free(o->out), free(o->lx), free(o->lscales), free(o->lcnt), free(o->lout);
  free(o->lsrc), free(o->lrange);
  host_ops_handle_fini(&o->h);
}

uint64_t ow_fnv(uint64_t hsh, const void *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    hsh = (hsh ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
  return hsh;
}

long ow_unpoisoned(const void *p, size_t n, uint8_t poison) {
  for (size_t i = 0; i < n; i++)
    if (((const uint8_t *)p)[i] != poison)
      return (long)i;
  return -1;
}

int ow_check_ll_info(const struct ow_case *d, uint32_t r, const int32_t *src,
                     const int64_t *range, char *msg) {
  const struct ref_ll_out *e = &d->ll[r];
  const uint32_t W = d->sc.world, rows = d->rows_ll;
  for (uint32_t l = 0; l < d->le; l++) {
    const struct ref_origin *from = e->from + (size_t)l * rows;
    for (uint32_t i = 0; i < rows; i++) {
      const int32_t want = (int32_t)i < e->count[l] ? (int32_t)from[i].token : -1;
      if (src[(size_t)l * rows + i] != want)
        return ow_fail(msg, "rank %u: ll_handle_info: src_info of expert %u row %u is %d, want "
                       "%d (count %d) [%s]", r, l, i, src[(size_t)l * rows + i], want,
                       e->count[l], d->desc);
    }
    uint32_t begin = 0;
    for (uint32_t s = 0; s < W; s++) {
      uint32_t n = 0;
      for (int32_t i = 0; i < e->count[l]; i++)
        n += from[i].rank == s;
      for (uint32_t i = begin; i < begin + n; i++)
        if (from[i].rank != s)
          return ow_fail(msg, "rank %u: the oracle's rows of expert %u from rank %u are not "
                         "contiguous (row %u is rank %u's) [%s]", r, l, s, i, from[i].rank,
                         d->desc);
      const int64_t got = range[(size_t)l * W + s];
      if (DEP_LL_RANGE_BEGIN(got) != begin || DEP_LL_RANGE_COUNT(got) != n)
        return ow_fail(msg, "rank %u: ll_handle_info: layout_range of expert %u, source %u is "
                       "(begin %u, count %u), want (%u, %u) [%s]", r, l, s,
                       DEP_LL_RANGE_BEGIN(got), DEP_LL_RANGE_COUNT(got), begin, n, d->desc);
      begin += n;
    }
  }
  return 0;
}

int ow_check_sum(const uint16_t *got, const struct ref_sum *want, uint32_t ntok, uint32_t h,
                     const char *op, const char *desc, char *msg) {
  for (size_t i = 0; i < (size_t)ntok * h; i++) {
    double g = ref_bf16_value(got[i]), v = want->val[i];
    double tol = ldexp(fabs(v), -8) + ldexp(want->mag[i], -16);
    if (!(fabs(g - v) <= tol))
      return ow_fail(msg, "%s: token %zu channel %zu: got %.9g (0x%04x), want %.9g +- %.3g [%s]",
                     op, i / h, i % h, g, got[i], v, tol, desc);
  }
  return 0;
}

void ow_want_combine(const struct ow_case *d, uint32_t o, const uint16_t *b0,
                     const uint16_t *b1, uint16_t *want, float *acc) {
  const uint32_t h = d->sc.hidden;
  for (uint32_t t = 0; t < d->in[o].num_tokens; t++) {
    for (uint32_t c = 0; c < h; c++)
      acc[c] = (b0 ? host_ops_bf16_to_float(b0[(size_t)t * h + c]) : 0.0f) +
               (b1 ? host_ops_bf16_to_float(b1[(size_t)t * h + c]) : 0.0f);
    for (uint32_t r = 0; r < d->sc.world; r++)
      for (uint32_t i = 0; i < d->disp[r].num_recv; i++)
        if (d->disp[r].from[i].rank == o && d->disp[r].from[i].token == t)
          for (uint32_t c = 0; c < h; c++)
            acc[c] += host_ops_bf16_to_float(d->cx[r][(size_t)i * h + c]);
    for (uint32_t c = 0; c < h; c++)
      want[(size_t)t * h + c] = host_ops_float_to_bf16(acc[c]);
  }
}


/* ---- calls the suites share (check_ops.c, check_ops_ext.c) ---------------- */

const struct ow_scenario ow_small = {2, 128, 2, 4, 4, 4, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};

void ow_run_small(ow_rank_fn fn, const char *what) {
  ow_seed_init(0);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &ow_small, 0);
  ow_run_ranks(&d->shape, ow_small.world, fn, d, what);
  ow_case_free(d);
  free(d);
}

struct ow_rank0 *ow_rank0_open(const struct ow_scenario *sc, uint32_t timeout_ms) {
  return ow_rank0_open_chunked(sc, 0, timeout_ms);
}

struct ow_rank0 *ow_rank0_open_chunked(const struct ow_scenario *sc, uint32_t chunk,
                                       uint32_t timeout_ms) {
  struct ow_rank0 *r = malloc(sizeof *r);
  ck_assert_ptr_nonnull(r);
  ow_seed_init(0);
  ow_case_make(&r->d, sc, 0);
  ow_world_open(&r->w, &r->d.shape, sc->world, chunk);
  char why[256] = "";
  ck_assert_msg(host_ops_init_nodes(&r->c, &r->d.shape, sc->world, 0, r->w.slabs, NULL, chunk,
                                    timeout_ms, why, sizeof why) == 0,
                "host_ops_init: %s", why);
  ow_outs_alloc(&r->o, &r->d);
  return r;
}

void ow_rank0_close(struct ow_rank0 *r) {
  ow_outs_free(&r->o);
  host_ops_fini(&r->c);
  ow_world_close(&r->w);
  ow_case_free(&r->d);
  free(r);
}


int ow_dispatch(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o,
                       struct dep_handle *h) {
  const struct ref_rank_in *in = &d->in[c->rank];
  struct dep_dispatch_args da = {.size = sizeof(struct dep_dispatch_args), .x = in->x,
                                 .topk_idx = d->idx[c->rank], .index_type = d->sc.itype,
                                 .topk_weights = in->topk_weights,
                                 .num_tokens = in->num_tokens, .recv_x = o->rx, .recv_topk_idx = o->ridx, .recv_topk_weights = o->rw, .recv_count_per_expert = o->cnt, .num_recv = &o->num_recv};
  return host_ops_dispatch(c, &da, h);
}

int ow_ll_dispatch(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o, int fp8) {
  const struct ref_rank_in *in = &d->in_ll[c->rank];
  struct dep_ll_dispatch_args la = {sizeof(struct dep_ll_dispatch_args), in->x, d->idx[c->rank],
                                    d->sc.itype, in->num_tokens, fp8,
                                    o->lx, o->lscales, o->lcnt, 0, NULL};
  return host_ops_ll_dispatch(c, &la, &o->h);
}

int ow_all_zero(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != 0)
      return 0;
  return 1;
}

int ow_round_tp(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o, uint8_t pz,
                    uint64_t *dig, char *msg) {
  const uint32_t r = c->rank, h = d->sc.hidden, K = d->sc.topk, W = d->sc.world;
  const struct ref_rank_in *in = &d->in[r];
  const struct ref_dispatch_out *e = &d->disp[r];
  memset(o->rx, pz, o->rows_tp * h * 2);
  memset(o->ridx, pz, o->rows_tp * K * 4);
  memset(o->rw, pz, o->rows_tp * K * 4);
  memset(o->cnt, pz, d->le * 4);
  memset(&o->num_recv, pz, 4);
  struct dep_dispatch_args da = {.size = sizeof(struct dep_dispatch_args), .x = in->x,
                                 .topk_idx = d->idx[r], .index_type = d->sc.itype,
                                 .topk_weights = in->topk_weights, .num_tokens = in->num_tokens,
                                 .recv_x = o->rx, .recv_topk_idx = o->ridx, .recv_topk_weights = o->rw, .recv_count_per_expert = o->cnt, .num_recv = &o->num_recv};
  int rc = host_ops_dispatch(c, &da, &o->h);
  if (rc != 0)
    return ow_fail(msg, "dispatch returned %s: %s [%s]", dep_errname(rc), c->why, d->desc);
  if (o->num_recv != e->num_recv)
    return ow_fail(msg, "dispatch: num_recv %u, want %u [%s]", o->num_recv, e->num_recv, d->desc);
  for (uint32_t i = 0; i < e->num_recv; i++) {
    if (memcmp(o->rx + (size_t)i * h, e->x + (size_t)i * h, h * 2) != 0)
      return ow_fail(msg, "dispatch: recv_x row %u is not token %u of rank %u [%s]", i,
                   e->from[i].token, e->from[i].rank, d->desc);
    for (uint32_t k = 0; k < K; k++) {
      size_t j = (size_t)i * K + k;
      if (o->ridx[j] != e->topk_idx[j] || memcmp(&o->rw[j], &e->topk_weights[j], 4) != 0)
        return ow_fail(msg, "dispatch: row %u k %u: id %d weight %g, want %d %g [%s]", i, k,
                     o->ridx[j], o->rw[j], e->topk_idx[j], e->topk_weights[j], d->desc);
    }
  }
  for (uint32_t l = 0; l < d->le; l++)
    if (o->cnt[l] != e->count[l])
      return ow_fail(msg, "dispatch: recv_count_per_expert[%u] %d, want %d [%s]", l, o->cnt[l],
                   e->count[l], d->desc);
  size_t n = e->num_recv, rest = o->rows_tp - n;
  if (ow_unpoisoned(o->rx + n * h, rest * h * 2, pz) >= 0 ||
      ow_unpoisoned(o->ridx + n * K, rest * K * 4, pz) >= 0 ||
      ow_unpoisoned(o->rw + n * K, rest * K * 4, pz) >= 0)
    return ow_fail(msg, "dispatch: wrote past num_recv %zu [%s]", n, d->desc);
  *dig = ow_fnv(*dig, o->rx, n * h * 2);

  memset(o->out, pz, (size_t)d->sc.max_tokens * h * 2);
  struct dep_combine_args ca = {.size = sizeof(struct dep_combine_args), .x = d->cx[r],
                                .out = o->out};
  rc = host_ops_combine(c, &ca, &o->h);
  if (rc != 0)
    return ow_fail(msg, "combine returned %s: %s [%s]", dep_errname(rc), c->why, d->desc);
  if (ow_check_sum(o->out, &d->comb[r], in->num_tokens, h, "combine", d->desc, msg))
    return 1;
  if (ow_unpoisoned(o->out + (size_t)in->num_tokens * h,
                 (size_t)(d->sc.max_tokens - in->num_tokens) * h * 2, pz) >= 0)
    return ow_fail(msg, "combine: wrote past num_tokens %u [%s]", in->num_tokens, d->desc);
  *dig = ow_fnv(*dig, o->out, (size_t)in->num_tokens * h * 2);
  (void)W;
  return 0;
}

/* A call that must succeed; otherwise the rank fails with the call's message. */
#define CALL(expr, op)                                                                      \
  do {                                                                                      \
    int rc_ = (expr);                                                                       \
    if (rc_ != 0)                                                                           \
      return ow_fail(msg, "%s returned %s: %s [%s]", op, dep_errname(rc_), c->why, d->desc); \
  } while (0)

int ow_round_ll(struct ops_ctx *c, const struct ow_case *d, struct ow_outs *o, uint8_t pz,
                uint64_t *dig, char *msg) {
  const uint32_t r = c->rank, h = d->sc.hidden, G = h / 128, rows = d->rows_ll;
  const struct ref_rank_in *in = &d->in_ll[r];
  const struct ref_ll_out *e = &d->ll[r];
  const int fp8 = d->sc.fp8;
  const size_t es = fp8 ? 1 : 2;
  memset(o->lx, pz, o->n_lx * es);
  memset(o->lscales, pz, o->n_ls * 4);
  memset(o->lcnt, pz, d->le * 4);
  struct dep_ll_dispatch_args la = {sizeof(struct dep_ll_dispatch_args), in->x, d->idx[r],
                                    d->sc.itype, in->num_tokens, fp8, o->lx,
                                    fp8 ? o->lscales : NULL, o->lcnt, 0, NULL};
  CALL(host_ops_ll_dispatch(c, &la, &o->h), "ll_dispatch");
  /* Where each row came from, as DeepEP's handle says it (dep_ll_handle_info). */
  memset(o->lsrc, pz, (size_t)d->le * rows * 4);
  memset(o->lrange, pz, (size_t)d->le * d->sc.world * 8);
  struct dep_ll_handle_info_args ia = {sizeof ia, o->lsrc, o->lrange};
  CALL(host_ops_ll_handle_info(c, &ia, &o->h), "ll_handle_info");
  if (ow_check_ll_info(d, r, o->lsrc, o->lrange, msg))
    return 1;
  for (uint32_t l = 0; l < d->le; l++) {
    if (o->lcnt[l] != e->count[l])
      return ow_fail(msg, "ll_dispatch: recv_count[%u] %d, want %d [%s]", l, o->lcnt[l],
                   e->count[l], d->desc);
    for (uint32_t i = 0; i < rows; i++) {
      size_t row = (size_t)l * rows + i;
      int valid = (int32_t)i < e->count[l];
      const void *got = (const uint8_t *)o->lx + row * h * es;
      if (!valid) {
        if (ow_unpoisoned(got, h * es, pz) >= 0 ||
            (fp8 && ow_unpoisoned(o->lscales + row * G, G * 4, pz) >= 0))
          return ow_fail(msg, "ll_dispatch: expert %u row %u past recv_count written [%s]", l, i,
                       d->desc);
        continue;
      }
      if (fp8) {
        long bad = -1;
        for (size_t ch = 0; ch < h && bad < 0; ch++)
          if (((const uint8_t *)got)[ch] != e->x8[row * h + ch])
            bad = (long)ch;
        if (bad >= 0)
          return ow_fail(msg, "ll_dispatch: expert %u row %u (rank %u token %u) channel %ld: e4m3 "
                       "0x%02x, want 0x%02x [%s]", l, i, e->from[row].rank, e->from[row].token,
                       bad, ((const uint8_t *)got)[bad], e->x8[row * h + bad], d->desc);
        if (memcmp(o->lscales + row * G, e->scales + row * G, G * 4) != 0)
          return ow_fail(msg, "ll_dispatch: expert %u row %u: scales differ [%s]", l, i, d->desc);
      } else if (memcmp(got, e->x + row * h, h * 2) != 0) {
        return ow_fail(msg, "ll_dispatch: expert %u row %u is not token %u of rank %u [%s]", l, i,
                     e->from[row].token, e->from[row].rank, d->desc);
      }
    }
  }
  *dig = ow_fnv(*dig, o->lcnt, d->le * 4);

  memset(o->lout, pz, (size_t)d->max_ll * h * 2);
  struct dep_ll_combine_args lc = {sizeof(struct dep_ll_combine_args), d->lx[r], d->idx[r],
                                   d->sc.itype, in->topk_weights, o->lout, 0, NULL};
  CALL(host_ops_ll_combine(c, &lc, &o->h), "ll_combine");
  if (ow_check_sum(o->lout, &d->llc[r], in->num_tokens, h, "ll_combine", d->desc, msg))
    return 1;
  if (ow_unpoisoned(o->lout + (size_t)in->num_tokens * h,
                 (size_t)(d->max_ll - in->num_tokens) * h * 2, pz) >= 0)
    return ow_fail(msg, "ll_combine: wrote past num_tokens %u [%s]", in->num_tokens, d->desc);
  *dig = ow_fnv(*dig, o->lout, (size_t)in->num_tokens * h * 2);
  return 0;
}
