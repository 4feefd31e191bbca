/*
 * clienttest.c — what the client suites share (clienttest.h).
 */
#include "clienttest.h"

#include <check.h>
#include <stdio.h>
#include <string.h>

dep_client_t *cl_new_client(void) {
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), DEP_OK);
  ck_assert_ptr_nonnull(c);
  return c;
}

dep_client_t *cl_connect(const char *sock) {
  dep_client_t *c = cl_new_client();
  int rc = dep_connect(c, sock);
  ck_assert_msg(rc == 0, "dep_connect(%s): %s: %s", sock, dep_errname(rc), dep_errmsg(c));
  return c;
}

/* A valid attach for rank `rank` of a two-rank, one-node job. */
struct dep_attach_args cl_attach_args(const char *job, uint32_t rank) {
  struct dep_attach_args a;
  memset(&a, 0, sizeof a);
  a.size = sizeof a;
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  a.rank = rank;
  a.world_size = 2;
  a.local_rank = rank;
  a.local_world_size = 2;
  a.shape = (struct dep_job_shape){.max_tokens_per_rank = 128, .hidden = 256,
                                   .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};
  return a;
}
