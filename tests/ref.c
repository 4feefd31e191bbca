/*
 * ref.c — the reference oracle (see ref.h).  Loops are written in the
 * order the design states the semantics, with linear searches instead of
 * clever indexing, so that a reader can check each function against
 * DESIGN §6 line by line.
 */
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

double ref_bf16_value(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

double ref_e4m3_value(uint8_t code) {
  int e = (code >> 3) & 15, m = code & 7;
  double v;
  if ((code & 0x7f) == 0x7f)
    v = NAN;
  else if (e == 0)
    v = ldexp(m, -9);
  else
    v = ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -v : v;
}

uint8_t ref_e4m3(float v) {
  uint8_t sign = signbit(v) ? 0x80 : 0;
  if (isnan(v))
    return sign | 0x7f;
  double a = fabs((double)v);
  if (a >= 448.0)
    return sign | 0x7e;
  int best = 0;
  double bestd = INFINITY;
  for (int c = 0; c <= 0x7e; c++) {
    double d = fabs(ref_e4m3_value((uint8_t)c) - a);
    if (d < bestd || (d == bestd && c % 2 == 0)) {
      best = c;
      bestd = d;
    }
  }
  return sign | (uint8_t)best;
}

static uint32_t owner(const struct dep_job_shape *s, uint32_t world, int64_t e) {
  return (uint32_t)(e / (s->num_experts / world));
}

/* Does token t of this rank select any expert on rank r? */
static int goes_to(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
                   uint32_t t, uint32_t r) {
  for (uint32_t k = 0; k < s->topk; k++) {
    int64_t e = in->topk_idx[(size_t)t * s->topk + k];
    if (e >= 0 && owner(s, world, e) == r)
      return 1;
  }
  return 0;
}

void ref_layout(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
                int32_t *tokens_per_rank, int32_t *tokens_per_expert, uint8_t *token_in_rank) {
  for (uint32_t r = 0; r < world; r++)
    tokens_per_rank[r] = 0;
  for (uint32_t e = 0; e < s->num_experts; e++)
    tokens_per_expert[e] = 0;
  for (uint32_t t = 0; t < in->num_tokens; t++) {
    for (uint32_t k = 0; k < s->topk; k++) {
      int64_t e = in->topk_idx[(size_t)t * s->topk + k];
      if (e >= 0)
        tokens_per_expert[e]++;
    }
    for (uint32_t r = 0; r < world; r++) {
      token_in_rank[(size_t)t * world + r] = (uint8_t)goes_to(s, world, in, t, r);
      tokens_per_rank[r] += goes_to(s, world, in, t, r);
    }
  }
}

int ref_dispatch(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
                 struct ref_dispatch_out *out) {
  uint32_t h = s->hidden, K = s->topk, le = s->num_experts / world;
  for (uint32_t r = 0; r < world; r++) {
    struct ref_dispatch_out *o = &out[r];
    memset(o, 0, sizeof *o);
    size_t cap = 0;
    for (uint32_t src = 0; src < world; src++)
      cap += in[src].num_tokens;
    o->from = calloc(cap + 1, sizeof *o->from);
    o->x = calloc(cap * h + 1, sizeof *o->x);
    o->topk_idx = calloc(cap * K + 1, sizeof *o->topk_idx);
    o->topk_weights = calloc(cap * K + 1, sizeof *o->topk_weights);
    o->count = calloc(le, sizeof *o->count);
    if (!o->from || !o->x || !o->topk_idx || !o->topk_weights || !o->count)
      return -1;
    const int fp8 = in[0].x8 != NULL;
    if (fp8) {
      o->x8 = calloc(cap * h + 1, 1);
      o->scales = calloc(cap * (h / 128) + 1, sizeof *o->scales);
      if (!o->x8 || !o->scales)
        return -1;
    }
    /* Sources ascending, then tokens ascending. */
    for (uint32_t src = 0; src < world; src++) {
      for (uint32_t t = 0; t < in[src].num_tokens; t++) {
        if (!goes_to(s, world, &in[src], t, r))
          continue;
        uint32_t i = o->num_recv++;
        o->from[i].rank = src;
        o->from[i].token = t;
        memcpy(o->x + (size_t)i * h, in[src].x + (size_t)t * h, h * sizeof *o->x);
        if (fp8) {
          memcpy(o->x8 + (size_t)i * h, in[src].x8 + (size_t)t * h, h);
          memcpy(o->scales + (size_t)i * (h / 128), in[src].scales + (size_t)t * (h / 128),
                 (h / 128) * sizeof *o->scales);
        }
        for (uint32_t k = 0; k < K; k++) {
          int64_t e = in[src].topk_idx[(size_t)t * K + k];
          if (e >= 0 && owner(s, world, e) == r) {
            o->topk_idx[(size_t)i * K + k] = (int32_t)(e % le);
            o->topk_weights[(size_t)i * K + k] = in[src].topk_weights[(size_t)t * K + k];
            o->count[e % le]++;
          } else {
            o->topk_idx[(size_t)i * K + k] = -1;
            o->topk_weights[(size_t)i * K + k] = 0.0f;
          }
        }
      }
    }
  }
  return 0;
}

void ref_dispatch_free(struct ref_dispatch_out *out, uint32_t world) {
  for (uint32_t r = 0; r < world; r++) {
    free(out[r].from);
    free(out[r].x);
    free(out[r].topk_idx);
    free(out[r].topk_weights);
    free(out[r].count);
    free(out[r].x8);
    free(out[r].scales);
    memset(&out[r], 0, sizeof out[r]);
  }
}

void ref_align_counts(int32_t *count, uint32_t n, uint32_t alignment) {
  if (alignment <= 1)
    return;
  for (uint32_t l = 0; l < n; l++)
    count[l] = (int32_t)((count[l] + alignment - 1) / alignment * alignment);
}

static int sum_alloc(struct ref_sum *o, size_t n) {
  o->val = calloc(n + 1, sizeof *o->val);
  o->mag = calloc(n + 1, sizeof *o->mag);
  return o->val && o->mag ? 0 : -1;
}

void ref_sum_free(struct ref_sum *out, uint32_t world) {
  for (uint32_t r = 0; r < world; r++) {
    free(out[r].val);
    free(out[r].mag);
    out[r].val = out[r].mag = NULL;
  }
}

int ref_combine(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
                const struct ref_dispatch_out *disp, const uint16_t *const *cx,
                struct ref_sum *out) {
  uint32_t h = s->hidden;
  for (uint32_t o = 0; o < world; o++) {
    if (sum_alloc(&out[o], (size_t)in[o].num_tokens * h) != 0)
      return -1;
    for (uint32_t t = 0; t < in[o].num_tokens; t++) {
      /* Every rank that received (o, t) sends back the vector at that row. */
      for (uint32_t r = 0; r < world; r++) {
        for (uint32_t i = 0; i < disp[r].num_recv; i++) {
          if (disp[r].from[i].rank != o || disp[r].from[i].token != t)
            continue;
          for (uint32_t c = 0; c < h; c++) {
            double v = ref_bf16_value(cx[r][(size_t)i * h + c]);
            out[o].val[(size_t)t * h + c] += v;
            out[o].mag[(size_t)t * h + c] += fabs(v);
          }
        }
      }
    }
  }
  return 0;
}

int ref_combine_weights(const struct dep_job_shape *s, uint32_t world,
                        const struct ref_rank_in *in, const struct ref_dispatch_out *disp,
                        const float *const *cw, struct ref_sum *out) {
  uint32_t K = s->topk;
  for (uint32_t o = 0; o < world; o++) {
    if (sum_alloc(&out[o], (size_t)in[o].num_tokens * K) != 0)
      return -1;
    for (uint32_t t = 0; t < in[o].num_tokens; t++)
      for (uint32_t r = 0; r < world; r++)
        for (uint32_t i = 0; i < disp[r].num_recv; i++) {
          if (disp[r].from[i].rank != o || disp[r].from[i].token != t)
            continue;
          for (uint32_t k = 0; k < K; k++) {
            double v = cw[r][(size_t)i * K + k];
            out[o].val[(size_t)t * K + k] += v;
            out[o].mag[(size_t)t * K + k] += fabs(v);
          }
        }
  }
  return 0;
}

int ref_ll_dispatch(const struct dep_job_shape *s, uint32_t world, uint32_t max_ll,
                    const struct ref_rank_in *in, int fp8, struct ref_ll_out *out) {
  uint32_t h = s->hidden, K = s->topk, le = s->num_experts / world, rows = world * max_ll;
  for (uint32_t r = 0; r < world; r++) {
    struct ref_ll_out *o = &out[r];
    memset(o, 0, sizeof *o);
    o->rows = rows;
    size_t n = (size_t)le * rows;
    o->count = calloc(le, sizeof *o->count);
    o->from = calloc(n, sizeof *o->from);
    o->x = calloc(n * h, sizeof *o->x);
    if (fp8) {
      o->x8 = calloc(n * h, 1);
      o->scales = calloc(n * (h / 128), sizeof *o->scales);
    }
    if (!o->count || !o->from || !o->x || (fp8 && (!o->x8 || !o->scales)))
      return -1;
    for (uint32_t l = 0; l < le; l++) {
      uint32_t e = r * le + l;
      for (uint32_t src = 0; src < world; src++) {
        for (uint32_t t = 0; t < in[src].num_tokens; t++) {
          int selects = 0;
          for (uint32_t k = 0; k < K; k++)
            selects |= in[src].topk_idx[(size_t)t * K + k] == (int64_t)e;
          if (!selects)
            continue;
          size_t row = (size_t)l * rows + (size_t)o->count[l]++;
          o->from[row].rank = src;
          o->from[row].token = t;
          const uint16_t *xt = in[src].x + (size_t)t * h;
          memcpy(o->x + row * h, xt, h * sizeof *xt);
          if (!fp8)
            continue;
          for (uint32_t g = 0; g < h / 128; g++) {
            float amax = 0.0f;
            for (uint32_t c = g * 128; c < (g + 1) * 128; c++)
              amax = fmaxf(amax, fabsf((float)ref_bf16_value(xt[c])));
            float scale = fmaxf(amax, 1e-4f) / 448.0f;
            o->scales[row * (h / 128) + g] = scale;
            for (uint32_t c = g * 128; c < (g + 1) * 128; c++)
              o->x8[row * h + c] = ref_e4m3((float)ref_bf16_value(xt[c]) / scale);
          }
        }
      }
    }
  }
  return 0;
}

void ref_ll_free(struct ref_ll_out *out, uint32_t world) {
  for (uint32_t r = 0; r < world; r++) {
    free(out[r].count);
    free(out[r].from);
    free(out[r].x);
    free(out[r].x8);
    free(out[r].scales);
    memset(&out[r], 0, sizeof out[r]);
  }
}

int ref_ll_combine(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
                   const struct ref_ll_out *ll, const uint16_t *const *lx, struct ref_sum *out) {
  uint32_t h = s->hidden, K = s->topk, le = s->num_experts / world;
  for (uint32_t o = 0; o < world; o++) {
    if (sum_alloc(&out[o], (size_t)in[o].num_tokens * h) != 0)
      return -1;
    for (uint32_t t = 0; t < in[o].num_tokens; t++) {
      for (uint32_t k = 0; k < K; k++) {
        int64_t e = in[o].topk_idx[(size_t)t * K + k];
        if (e < 0)
          continue;
        uint32_t r = owner(s, world, e), l = (uint32_t)(e % le);
        /* The row of expert e that holds (o, t). */
        for (int32_t i = 0; i < ll[r].count[l]; i++) {
          size_t row = (size_t)l * ll[r].rows + (size_t)i;
          if (ll[r].from[row].rank != o || ll[r].from[row].token != t)
            continue;
          double w = in[o].topk_weights[(size_t)t * K + k];
          for (uint32_t c = 0; c < h; c++) {
            double v = w * ref_bf16_value(lx[r][row * h + c]);
            out[o].val[(size_t)t * h + c] += v;
            out[o].mag[(size_t)t * h + c] += fabs(v);
          }
        }
      }
    }
  }
  return 0;
}

int ref_mask(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
             const uint8_t *masked, struct ref_rank_in *out) {
  for (uint32_t r = 0; r < world; r++) {
    out[r] = in[r];
    if (masked[r])
      out[r].num_tokens = 0; /* a masked rank sends nothing */
    size_t n = (size_t)in[r].num_tokens * s->topk;
    int64_t *idx = malloc((n + 1) * sizeof *idx);
    out[r].topk_idx = idx;
    if (idx == NULL)
      return -1;
    for (size_t i = 0; i < n; i++) {
      int64_t e = in[r].topk_idx[i];
      idx[i] = e >= 0 && masked[owner(s, world, e)] ? -1 : e;
    }
  }
  return 0;
}

void ref_mask_free(struct ref_rank_in *out, uint32_t world) {
  for (uint32_t r = 0; r < world; r++) {
    free((void *)out[r].topk_idx);
    out[r].topk_idx = NULL;
  }
}
