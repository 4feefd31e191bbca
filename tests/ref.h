/*
 * ref.h — the reference oracle for the MoE operations (DESIGN §6): whole-
 * world pure functions that, given every rank's inputs, compute every
 * rank's expected outputs.  Written as plainly as possible, with no slabs,
 * no protocol and float64 sums: it defines correctness, and the tests hold
 * the host backend (and later the CUDA kernels) against it.
 *
 * Moves (dispatch rows, ids, weights, counts, FP8 bytes and scales) are
 * exact and compare bit for bit; sums come as float64 with the sum of the
 * terms' magnitudes, so a caller can bound a float32-accumulated result.
 */
#ifndef DEP_REF_H
#define DEP_REF_H

#include <stdint.h>

#include "deepep.h"

/* One rank's inputs to a call. */
struct ref_rank_in {
  uint32_t num_tokens;
  const uint16_t *x;          /* bf16 [num_tokens, hidden] */
  const int64_t *topk_idx;    /* [num_tokens, topk], -1 = none */
  const float *topk_weights;  /* [num_tokens, topk] */
  /* Throughput FP8 (optional): e4m3 bytes [num_tokens, hidden] and their
   * float32 scales [num_tokens, hidden / 128], moved as they are. */
  const uint8_t *x8;
  const float *scales;
};

/* Where a received row came from. */
struct ref_origin {
  uint32_t rank, token;
};

/* Layout of one rank's topk_idx: outputs sized [world], [num_experts], [num_tokens * world]. */
void ref_layout(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
                int32_t *tokens_per_rank, int32_t *tokens_per_expert, uint8_t *token_in_rank);

/* What one rank receives from a throughput dispatch. */
struct ref_dispatch_out {
  uint32_t num_recv;
  struct ref_origin *from;    /* [num_recv] */
  uint16_t *x;                /* [num_recv, hidden] */
  int32_t *topk_idx;          /* [num_recv, topk] local ids, -1 elsewhere */
  float *topk_weights;        /* [num_recv, topk], 0 elsewhere */
  int32_t *count;             /* [local experts] */
  uint8_t *x8;                /* with the inputs' x8: [num_recv, hidden] */
  float *scales;              /* with the inputs' x8: [num_recv, hidden / 128] */
};

/* A float64 sum per element and the sum of its terms' magnitudes. */
struct ref_sum {
  double *val, *mag;          /* [num_tokens, hidden] each */
};

/* in[world] -> out[world].  0, or -1 when out of memory. */
int ref_dispatch(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
                 struct ref_dispatch_out *out);
void ref_dispatch_free(struct ref_dispatch_out *out, uint32_t world);

/* Combine: rank r sends back cx[r] ([disp[r].num_recv, hidden]); out[o] for each origin. */
int ref_combine(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
                const struct ref_dispatch_out *disp, const uint16_t *const *cx,
                struct ref_sum *out);
void ref_sum_free(struct ref_sum *out, uint32_t world);

/* Combine of weights: rank r sends back cw[r] ([disp[r].num_recv, topk]); out[o] is
 * [in[o].num_tokens, topk], each the sum over the ranks that received the token. */
int ref_combine_weights(const struct dep_job_shape *s, uint32_t world,
                        const struct ref_rank_in *in, const struct ref_dispatch_out *disp,
                        const float *const *cw, struct ref_sum *out);

/* DeepEP's expert_alignment: each count rounded up to a multiple of it (0, 1: as they are). */
void ref_align_counts(int32_t *count, uint32_t n, uint32_t alignment);

/* What one rank receives from a low-latency dispatch: rows = world * max_ll per local expert. */
struct ref_ll_out {
  uint32_t rows;
  int32_t *count;             /* [local experts] */
  struct ref_origin *from;    /* [local experts, rows] (valid ones only meaningful) */
  uint16_t *x;                /* bf16 [local experts, rows, hidden] */
  uint8_t *x8;                /* fp8: e4m3 [local experts, rows, hidden] */
  float *scales;              /* fp8: [local experts, rows, hidden / 128] */
};

int ref_ll_dispatch(const struct dep_job_shape *s, uint32_t world, uint32_t max_ll,
                    const struct ref_rank_in *in, int fp8, struct ref_ll_out *out);
void ref_ll_free(struct ref_ll_out *out, uint32_t world);

/* LL combine: rank r's expert outputs lx[r] ([local experts, rows, hidden]). */
int ref_ll_combine(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
                   const struct ref_ll_out *ll, const uint16_t *const *lx, struct ref_sum *out);

/*
 * Masked ranks (deepep.h): every operation with the ranks r where
 * masked[r] is nonzero masked is the same computation on these inputs:
 * each masked rank's experts removed from every top-k (-1), a masked
 * rank's tokens none.  out[r] is in[r] with its own topk_idx (freed by
 * ref_mask_free).  0, or -1 when out of memory.
 */
int ref_mask(const struct dep_job_shape *s, uint32_t world, const struct ref_rank_in *in,
             const uint8_t *masked, struct ref_rank_in *out);
void ref_mask_free(struct ref_rank_in *out, uint32_t world);

/* e4m3 by brute force: the nearest of all finite codes, ties to the even
 * code, saturating to +-448; NaN -> 0x7f (with the sign bit). */
uint8_t ref_e4m3(float v);
double ref_e4m3_value(uint8_t code);
double ref_bf16_value(uint16_t b);

#endif /* DEP_REF_H */
