/*
 * sm_budget.c — a rank's SM budget (sm_budget.h).
 */
#include "sm_budget.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "deepep.h"
#include "kabi.h"

/*
 * CTAs one communicating kernel of this rank may use (kabi.h: the SM
 * budget): the GPU's SMs shared out among the job's ranks on it, at most
 * CUOPS_MAX_CTAS, so that every rank's kernel is resident at once and a
 * lone rank leaves most of its GPU to the trainer's compute.
 */
uint32_t cuops_most_ctas(int sms, uint32_t sharing) {
  return dep__fit_ctas(sms, sharing, CUOPS_CTAS_PER_SM);
}

uint32_t dep__fit_ctas(int sms, uint32_t sharing, uint32_t per_sm) {
  sms = sms < 1 ? 1 : sms;
  sharing = sharing < 1 ? 1 : sharing;
  per_sm = per_sm < 1 ? 1 : per_sm > CUOPS_CTAS_PER_SM ? CUOPS_CTAS_PER_SM : per_sm;
  const uint32_t most = per_sm * (uint32_t)sms / sharing;
  return most < 1 ? 1 : most;
}

uint32_t dep__kernel_shmem(uint32_t world, uint32_t num_experts, bool ll) {
  return CUOPS_SHM_SRC(world) + (ll ? CUOPS_LL_SHMEM(num_experts) : 0u);
}

uint32_t dep__ctas_per_sm(uint64_t cta_bytes, uint64_t sm_bytes) {
  const uint64_t n = cta_bytes == 0 ? CUOPS_CTAS_PER_SM : sm_bytes / cta_bytes;
  return n > CUOPS_CTAS_PER_SM ? CUOPS_CTAS_PER_SM : (uint32_t)n;
}

int cuops_sm_budget(int sms, uint32_t sharing, uint32_t xworld, const char *env, uint32_t *out,
                    char *why, size_t whylen) {
  sms = sms < 1 ? 1 : sms;
  sharing = sharing < 1 ? 1 : sharing;
  const uint32_t budget = (uint32_t)sms / sharing;
  *out = budget > CUOPS_MAX_CTAS ? CUOPS_MAX_CTAS : budget < 1 ? 1 : budget;
  if (xworld != 0)
    *out = dep__xnode_budget(*out, xworld);
  /* The operator's override; at most what keeps every rank on this GPU
   * resident at once (CUOPS_CTAS_PER_SM each SM, shared out). */
  if (env == NULL || env[0] == '\0')
    return 0;
  const uint32_t most = cuops_most_ctas(sms, sharing);
  char *end = NULL;
  errno = 0;
  unsigned long v = strtoul(env, &end, 10);
  if (env[0] < '0' || env[0] > '9' || errno != 0 || *end != '\0' || v < 1 || v > most) {
    snprintf(why, whylen, "$" CUOPS_CTAS_ENV "=\"%s\" must be a number of CTAs from 1 to %u (%d "
             "SMs, %u ranks of the job on this GPU); fix or unset it", env, most, sms, sharing);
    return DEP_ERR_INVALID;
  }
  *out = (uint32_t)v;
  return 0;
}

uint32_t dep__xnode_budget(uint32_t budget, uint32_t world) {
  const uint64_t cap = (uint64_t)CUOPS_XNODE_PARTS * (world < 1 ? 1 : world);
  return budget > cap ? (uint32_t)cap : budget < 1 ? 1 : budget;
}

uint32_t dep__kernel_grid(uint32_t budget, uint32_t world, uint32_t *parts) {
  budget = budget < 1 ? 1 : budget;
  world = world < 1 ? 1 : world;
  *parts = budget / world < 1 ? 1 : budget / world;
  const uint64_t units = (uint64_t)world * *parts;
  return units < budget ? (uint32_t)units : budget;
}
