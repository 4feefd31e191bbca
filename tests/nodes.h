/*
 * nodes.h — several real daemons on 127.0.0.1 that are each other's peers
 * (one node each, told apart by port), for the multi-node suites.
 */
#ifndef DEP_TEST_NODES_H
#define DEP_TEST_NODES_H

#include <stdbool.h>

#include "testutil.h"

#define NODES_MAX 3

struct nodes {
  int n;
  char dir[256], key[300];
  int port[NODES_MAX];
  struct tu_daemon d[NODES_MAX];
  char yaml[NODES_MAX][2048];
};

/* n daemons on 127.0.0.1, each listing the others, with a short attach timeout. */
void nodes_config(struct nodes *ns, int n, int attach_timeout_ms);
/* The same with more of limits (", op_timeout_ms: 3000") and more keys (extra, whole lines). */
void nodes_config_with(struct nodes *ns, int n, int attach_timeout_ms, const char *limits,
                       const char *extra);
void node_start(struct nodes *ns, int i);
/* Whether node i sees every other node up (deepepctl peers --json). */
bool node_sees_all(const struct nodes *ns, int i);
void nodes_wait_up(const struct nodes *ns);
/* nodes_config, then nodes_start_all: every daemon started and seeing the others. */
void nodes_start(struct nodes *ns, int n, int attach_timeout_ms);
void nodes_start_all(struct nodes *ns);
void nodes_stop(struct nodes *ns);

#endif /* DEP_TEST_NODES_H */
