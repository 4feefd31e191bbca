/*
 * nodes.h — several real daemons on 127.0.0.1 that are each other's peers
 * (one node each, told apart by port), for the multi-node suites.
 */
#ifndef DEP_TEST_NODES_H
#define DEP_TEST_NODES_H

#include <stdbool.h>

#include "testutil.h"

#define NODES_MAX 3

/* Two network namespaces joined by a veth pair (root only). */
struct netns {
  char ns[2][32];
  bool made[2];
};

struct nodes {
  int n;
  char dir[256], key[300];
  int port[NODES_MAX];
  struct tu_daemon d[NODES_MAX];
  char yaml[NODES_MAX][2048];
  struct netns net;           /* nodes_config_netns: node i in net.ns[i], at 10.77.0.(i+1) */
  bool in_netns;
};

/* n daemons on 127.0.0.1, each listing the others, with a short attach timeout. */
void nodes_config(struct nodes *ns, int n, int attach_timeout_ms);
/* The same with more of limits (", op_timeout_ms: 3000") and more keys (extra, whole lines). */
void nodes_config_with(struct nodes *ns, int n, int attach_timeout_ms, const char *limits,
                       const char *extra);
/* Two nodes in two network namespaces joined by a veth (nodes_link_down cuts it):
 * NULL, or why not (not root, no namespaces), with nothing made. */
const char *nodes_config_netns(struct nodes *ns, int attach_timeout_ms, const char *limits,
                               const char *extra);
void node_start(struct nodes *ns, int i);
/* Whether node i sees every other node up (deepepctl peers --json). */
bool node_sees_all(const struct nodes *ns, int i);
void nodes_wait_up(const struct nodes *ns);
/* nodes_config, then nodes_start_all: every daemon started and seeing the others. */
void nodes_start(struct nodes *ns, int n, int attach_timeout_ms);
void nodes_start_all(struct nodes *ns);
void nodes_stop(struct nodes *ns);

/* Run a shell command quietly: its exit status. */
int nodes_sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Two namespaces, 10.77.0.1/24 and 10.77.0.2/24 on the two ends of a veth
 * (dv<pid>a in the first, dv<pid>b in the second): NULL, or why not. */
const char *netns_up(struct netns *n);
void netns_down(struct netns *n);

#endif /* DEP_TEST_NODES_H */
