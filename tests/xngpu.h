/*
 * xngpu.h — rank processes of one job on the cuda backend over daemons that
 * share this machine's GPU (xngpu.c says how they are placed and budgeted).
 */
#ifndef DEP_TESTS_XNGPU_H
#define DEP_TESTS_XNGPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cudaranks.h"
#include "nodes.h"
#include "opsworld.h"

int xg_run(const struct nodes *ns, const uint32_t *split, const char *job,
           const struct ow_case *d, cr_rank_body fn, void *arg, bool wait_all, char *fails,
           size_t len);
/* The same with every rank's SM budget ctas (xg_run's is 16). */
int xg_run_ctas(const struct nodes *ns, const uint32_t *split, const char *job,
                const struct ow_case *d, cr_rank_body fn, void *arg, bool wait_all,
                const char *ctas, char *fails, size_t len);

#endif
