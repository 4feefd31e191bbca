/*
 * xnjob.h — a job whose rank processes run on several real daemons
 * (nodes.h), each rank on the public API running xn_round (xnround.h):
 * where each rank goes, its processes forked and reaped, what each
 * reports, and the job layouts the suites of jobs across nodes share
 * (check_xnode.c, check_xnode_faults.c).  Prefix xn_.
 */
#ifndef DEP_XNJOB_H
#define DEP_XNJOB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "nodes.h"
#include "opsworld.h"
#include "xnround.h"

#define XN_OP_TIMEOUT_MS 4000

struct xn_run;
/* A rank's whole run in place of xn_round's rounds (xn_run.body): 0, a DEP_ERR_* or 1 (a
 * wrong result), res->msg saying which. */
typedef int xn_body_fn(dep_client_t *c, const struct xn_run *run, uint32_t rank,
                       struct xn_result *res);

struct xn_run {
  const struct ow_case *d;
  uint32_t rounds;           /* rounds of layout, dispatch, combine, LL dispatch, LL combine */
  bool alternate_fp8;        /* LL dispatch's FP8 on in odd rounds */
  bool modes;                /* each round also runs xn_round_modes */
  bool until_error;          /* fault tests: go on until a call fails, then make one more
                                call and time dep_detach (xn_result) */
  const char *rejoin;        /* ... then, once the test sets res->go, dep_connect and
                                dep_attach again in the same process to this job and run
                                `rounds` rounds of it (xn_result.rejoin_rc) */
  uid_t uid;                 /* 0: the test's own; else the ranks run as it (root only) */
  uint32_t slow_ms;          /* > 0: rank slow_rank sleeps this long before each round, so
                                that the others' calls outrun it (a credit test) */
  uint32_t slow_rank;
  xn_body_fn *body;          /* non-NULL: each rank runs it once instead of the rounds */
  void *arg;                 /* ... with this (memory the test shares with the ranks) */
};

/* Where each global rank runs: node, local rank, and the node's rank count. */
struct xn_place {
  uint32_t node[OW_MAXW], local[OW_MAXW], lws[OW_MAXW];
};

struct xn_layout {
  struct ow_scenario sc;
  int nodes;
  uint32_t split[NODES_MAX];
};

/* Jobs over two or three nodes, each run across them and on one node (check_xnode.c). */
extern const struct xn_layout xn_layouts[];
extern const int xn_nlayouts;

/* A case of scenario sc (FP8 dispatch as fp8) in memory of its own; xn_case_free frees both. */
struct ow_case *xn_case_new(const struct ow_scenario *sc, int fp8);
void xn_case_free(struct ow_case *d);
/* n nodes (nodes_config_with: attach_timeout_ms, extra) whose limits.op_timeout_ms is
 * op_timeout_ms, started and seeing each other. */
void xn_nodes_start(struct nodes *ns, int n, int attach_timeout_ms, int op_timeout_ms,
                    const char *extra);

/* Spread ranks over nodes in blocks: split[i] ranks on node i. */
void xn_place(struct xn_place *p, const uint32_t *split, int nodes);
/* Fork every rank; returns their pids (results in res[]). */
void xn_spawn(const struct nodes *ns, const struct xn_place *p, const char *job,
              const struct xn_run *run, struct xn_result *res, pid_t *pids);
/* Fork the ranks placed on node (every rank: -1); pids[] of the others untouched. */
void xn_spawn_node(const struct nodes *ns, const struct xn_place *p, const char *job,
                   const struct xn_run *run, struct xn_result *res, pid_t *pids, int node);
/* Wait for every rank, killing all after timeout_ms; true when all exited 0. */
bool xn_reap(pid_t *pids, uint32_t n, int timeout_ms);
/* Wait, at most ceiling_ms (a bound for a loaded machine, not a timing), until rank g of a
 * running job has made `rounds` rounds, and fail the test if it did not. */
void xn_await_rounds(const struct xn_result *res, uint32_t g, uint32_t rounds, int ceiling_ms);
/* n results in memory shared with the rank processes, zeroed (munmap when done). */
struct xn_result *xn_results(uint32_t n);
/* Run the job placed as p (nodes of ns) and fail the test with every failing rank's message. */
void xn_run_job(const struct nodes *ns, const struct xn_place *p, const char *job,
                const struct xn_run *run, struct xn_result *res);

/* deepepctl's output on node i (status or peers, --json) into out. */
void xn_ctl_json_at(const struct nodes *ns, int i, const char *what, char *out, size_t len);
/* The same on node 0. */
void xn_ctl_json(const struct nodes *ns, const char *what, char *out, size_t len);

#endif /* DEP_XNJOB_H */
