/*
 * check_cuda_ops.h — suite cuda_ops (check_cuda_ops.c) is made of more than
 * one file: the cases that live in files of their own, for cuda_ops_suite
 * to add in their place.
 */
#ifndef DEP_CHECK_CUDA_OPS_H
#define DEP_CHECK_CUDA_OPS_H

#include <check.h>

/* The faults case, tagged gpu (check_cuda_ops_faults.c). */
TCase *cuda_ops_faults_tcase(void);
/* The masks case, tagged gpu (check_cuda_ops_mask.c). */
TCase *cuda_ops_mask_tcase(void);
/* The split case, tagged gpu (check_cuda_ops_split.c). */
TCase *cuda_ops_split_tcase(void);

#endif
