/*
 * rank.c — one rank of a multi-node job for the Soft-RoCE scenarios
 * (tests/rdma/job2.sh): connect to deepepd, attach, say how it went, then
 * hold the job until stdin closes (or exit at once with "-").  Compiled by
 * the scenario against the build's libdeepep-client.
 *
 *   rank SOCKET JOB RANK WORLD LOCAL_RANK LOCAL_WORLD [-]
 *
 * Prints "attached in X ms" or "attach: DEP_ERR_...: message" and exits 0
 * or 1 accordingly.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "deepep.h"

int main(int argc, char **argv) {
  if (argc < 7) {
    fprintf(stderr, "usage: rank SOCKET JOB RANK WORLD LOCAL_RANK LOCAL_WORLD [-]\n");
    return 2;
  }
  struct dep_attach_args a = {
      .size = sizeof a,
      .rank = (uint32_t)atoi(argv[3]),
      .world_size = (uint32_t)atoi(argv[4]),
      .local_rank = (uint32_t)atoi(argv[5]),
      .local_world_size = (uint32_t)atoi(argv[6]),
      .shape = {.max_tokens_per_rank = 64, .hidden = 256, .num_experts = 8, .topk = 2,
                .dtype = DEP_DTYPE_BF16},
  };
  snprintf(a.job_id, sizeof a.job_id, "%s", argv[2]);
  dep_client_t *c = NULL;
  if (dep_client_new(&c) != 0 || dep_connect(c, argv[1]) != 0) {
    printf("connect: %s\n", c != NULL ? dep_errmsg(c) : "out of memory");
    return 1;
  }
  int rc = dep_attach(c, &a);
  if (rc != 0) {
    printf("attach: %s: %s\n", dep_errname(rc), dep_errmsg(c));
    return 1;
  }
  struct dep_attach_info info = {.size = sizeof info};
  dep_attach_info(c, &info);
  printf("attached in %.2f ms\n", info.attach_ms);
  fflush(stdout);
  if (argc < 8 || strcmp(argv[7], "-") != 0) {
    char b[64];
    while (read(0, b, sizeof b) > 0)
      ;
  }
  dep_client_free(c);
  return 0;
}
