/*
 * ccuda.h — what a header read both by C11 (the daemon, the library) and
 * by CUDA C++ (the kernels, kernels/ops.cu) needs, so that a contract they
 * share (slab.h, xring.h, kabi.h) is written once for both.
 *
 *   DEP_STATIC_ASSERT  _Static_assert in C, static_assert in C++.
 *   DEP_ATOMIC(t)      _Atomic t in C; t in C++, where the kernels reach
 *                      such a word only through their own ordered loads
 *                      and stores (kernels/ops_dev.cuh).  Both have the
 *                      size and alignment of t on every target we build
 *                      for, so one struct definition lays out alike.
 */
#ifndef DEP_CCUDA_H
#define DEP_CCUDA_H

#ifdef __cplusplus
#define DEP_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#define DEP_ATOMIC(t) t
#else
#include <stdatomic.h>
#define DEP_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#define DEP_ATOMIC(t) _Atomic t
#endif

#endif /* DEP_CCUDA_H */
