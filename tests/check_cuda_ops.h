/*
 * check_cuda_ops.h — suite cuda_ops (check_cuda_ops.c) is made of more than
 * one file: the cases that live in files of their own, for cuda_ops_suite
 * to add in their place.
 */
#ifndef DEP_CHECK_CUDA_OPS_H
#define DEP_CHECK_CUDA_OPS_H

#include <check.h>
#include <stdint.h>

#include "cudaranks.h"
#include "opsworld.h"
#include "ref.h"

/* The faults case, tagged gpu (check_cuda_ops_faults.c). */
TCase *cuda_ops_faults_tcase(void);
/* The masks case, tagged gpu (check_cuda_ops_mask.c). */
TCase *cuda_ops_mask_tcase(void);
/* The split case, tagged gpu (check_cuda_ops_split.c). */
TCase *cuda_ops_split_tcase(void);
/* The stream case, tagged gpu, and the stream_lend case, which needs no GPU
 * (check_cuda_ops_stream.c). */
TCase *cuda_ops_stream_tcase(void);
TCase *cuda_ops_stream_lend_tcase(void);
/* The stream_budget case, tagged gpu: streams on a budget below the world
 * (check_cuda_ops_stream.c). */
TCase *cuda_ops_stream_budget_tcase(void);

/* A case with FP8 inputs (any bytes, with scales) and their oracle beside the bf16 ones
 * (check_cuda_ops.c), for the throughput extensions' rounds (ext_gpu_body: FP8 dispatch,
 * num_worst_tokens, expert_alignment, cached mode, a weighted combine, a rank body). */
struct ext_gpu {
  struct ow_case d;
  uint8_t *x8[OW_MAXW];
  float *scales[OW_MAXW];
  struct ref_dispatch_out disp8[OW_MAXW];
  uint32_t align[OW_MAXW];
};
void ext_gpu_make(struct ext_gpu *e, const struct ow_scenario *sc);
void ext_gpu_free(struct ext_gpu *e);
int ext_gpu_body(struct rk *k, void *arg);

#endif
