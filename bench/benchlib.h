/*
 * benchlib.h — what every benchmark in bench/ shares: a monotonic clock in
 * milliseconds and sorting samples for medians and percentiles.  Linked
 * into each bench program by the Makefile.
 */
#ifndef DEP_BENCHLIB_H
#define DEP_BENCHLIB_H

#include <stddef.h>

/* CLOCK_MONOTONIC in milliseconds (same clock in every process of the machine). */
double bench_now_ms(void);

/* Sort n samples ascending (for medians and percentiles). */
void bench_sort(double *v, size_t n);

#endif
