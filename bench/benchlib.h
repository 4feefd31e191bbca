/*
 * benchlib.h — what every benchmark in bench/ shares: a monotonic clock in
 * milliseconds, sorting samples for medians and percentiles, and placing
 * ranks on GPUs (-g).  Linked into each bench program by the Makefile.
 */
#ifndef DEP_BENCHLIB_H
#define DEP_BENCHLIB_H

#include <stddef.h>

/* CLOCK_MONOTONIC in milliseconds (same clock in every process of the machine). */
double bench_now_ms(void);

/* Sort n samples ascending (for medians and percentiles). */
void bench_sort(double *v, size_t n);

/*
 * How many GPUs the ranks spread over for `-g want` (0: every visible GPU),
 * with rank r on GPU r % that many.  The driver is asked in a child process,
 * so that the caller, which forks rank processes that use CUDA, never
 * initialises it.  Returns the count (>= 1), or -1 with why (no driver,
 * fewer GPUs visible than asked for).
 */
int bench_gpus(int want, char *why, size_t len);

/* The GPU ordinal of rank r when ranks spread over ngpus GPUs. */
int bench_gpu_of_rank(int r, int ngpus);

#endif
