/*
 * sm_budget.h — a rank's SM budget: how many CTAs each communicating kernel
 * of the rank launches (kabi.h, "SM budget", says how the kernels use it).
 * The library computes it at dep_attach (client/cuda_attach.c) and the
 * daemon's tuner (daemon/tune.c) times budgets around the same default and
 * within the same ceiling, so the rule is here, where both reach it.
 */
#ifndef DEP_SM_BUDGET_H
#define DEP_SM_BUDGET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Overrides the SM budget (CTAs per communicating kernel) of every rank. */
#define CUOPS_CTAS_ENV "DEEPEP_KERNEL_CTAS"

/*
 * The SM budget of one rank: CTAs per communicating kernel, the GPU's sms
 * shared out among the `sharing` ranks of the job on it, at most
 * CUOPS_MAX_CTAS, and in a job whose xworld ranks span nodes (0: a job on
 * one node) at most dep__xnode_budget's; or env (the value of
 * $DEEPEP_KERNEL_CTAS; NULL or "" for none), from 1 to what keeps every
 * rank resident at once.  0 with *out, or DEP_ERR_INVALID with why saying
 * the bounds.
 */
int cuops_sm_budget(int sms, uint32_t sharing, uint32_t xworld, const char *env, uint32_t *out,
                    char *why, size_t whylen);
/*
 * The default budget of a rank of a job of `world` ranks that span nodes:
 * `budget` (the single-node default), at most CUOPS_XNODE_PARTS * world.
 * Every CTA of such a job's kernels stores to, fences and polls host memory
 * (the exchange region) across the GPU's bus, so more of them is more
 * traffic on that one bus, not more bandwidth: a call between two daemons
 * ran several times slower at the single-node default than at two parts
 * (BENCHMARKS.md, "The SM budget between nodes"), and its rows within the
 * node are a small part of it.
 * $DEEPEP_KERNEL_CTAS still sets any budget.
 */
uint32_t dep__xnode_budget(uint32_t budget, uint32_t world);
/* The largest budget of a rank that keeps every one of the `sharing` ranks resident. */
uint32_t cuops_most_ctas(int sms, uint32_t sharing);
/* ... where an SM holds per_sm CTAs of the kernels at once (dep__ctas_per_sm). */
uint32_t dep__fit_ctas(int sms, uint32_t sharing, uint32_t per_sm);

/*
 * The dynamic shared memory a communicating kernel's CTA is launched with
 * in a job of `world` ranks and num_experts experts (kabi.h "Shared
 * memory"): the receive's per-source state, and for the low-latency
 * dispatch (ll) its per-expert counts and offsets after it.  The one rule
 * for the launch, the opt-in above 48 KiB and the residency below.
 */
uint32_t dep__kernel_shmem(uint32_t world, uint32_t num_experts, bool ll);
/*
 * CTAs of one kernel an SM of sm_bytes shared memory holds at once, each
 * holding cta_bytes (its static and dynamic shared memory and what the
 * GPU reserves a CTA): at most CUOPS_CTAS_PER_SM (the registers'
 * __launch_bounds__), 0 where not even one fits.
 */
uint32_t dep__ctas_per_sm(uint64_t cta_bytes, uint64_t sm_bytes);

/*
 * The grid of a communicating kernel of a rank with `budget` CTAs in a job
 * of `world` ranks (kabi.h "SM budget"): *parts, the units a destination's
 * rows are split into, max(1, budget / world), and the CTAs, world * parts
 * or budget where that is fewer (a world larger than the budget: each CTA
 * sends several units in turn).  Never more CTAs than the budget, nor
 * than units.
 */
uint32_t dep__kernel_grid(uint32_t budget, uint32_t world, uint32_t *parts);

#endif /* DEP_SM_BUDGET_H */
