/*
 * statsranks.h — the rank processes of the stats suites (check_stats.c,
 * check_stats_forged.c, check_metrics.c): a job of ST_W local ranks on a real deepepd of the host
 * backend, each a process that attaches, runs a plan of calls, reports, and
 * waits for the test's word to detach; and a Prometheus parser's reading of
 * the exposition of such a job.  Prefix st_.
 */
#ifndef DEP_STATSRANKS_H
#define DEP_STATSRANKS_H

#include <stdbool.h>
#include <stdint.h>

#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "testutil.h"

#define ST_W 2u
#define ST_HIDDEN 256u
#define ST_EXPERTS 8u
#define ST_TOPK 2u
#define ST_TOKENS 64u
#define ST_LL 16u
/* The job's shape, unless a plan names its own. */
extern const struct dep_job_shape st_shape;

/* What each rank does, in this order. */
struct st_plan {
  uint32_t layouts;   /* layouts of ST_TOKENS tokens */
  uint32_t pairs;     /* dispatch + combine of `tokens` tokens */
  uint32_t ll_pairs;  /* ll_dispatch + ll_combine of ST_LL tokens */
  uint32_t bad;       /* dispatches refused (num_tokens over the job's bound) */
  uint32_t tokens;    /* tokens per dispatch after the first (0: the job's bound) */
  uint32_t first_tokens; /* tokens of the first dispatch (0: the job's bound) */
  bool to_rank0;      /* every token selects experts of rank 0 only */
  struct dep_job_shape shape; /* zero: st_shape */
};

/* A rank process and its pipes. */
struct st_rank {
  struct dw_child proc;
};

/*
 * Job `job` on d: ST_W rank processes, each attaching, running the plan and
 * waiting for the word to detach; returns once every one ran its plan (the
 * test fails with a rank's message otherwise).
 */
void st_job_start(struct st_rank r[ST_W], const struct tu_daemon *d, const char *job,
                  const struct st_plan *plan);
/* The job's end: the word given (each rank detaches and must exit 0), or SIGKILL. */
void st_job_end(struct st_rank r[ST_W], bool kill9);

/* STATS for job on d: its ranks' records into out[] (by rank), their count returned. */
uint32_t st_fetch(const struct tu_daemon *d, const char *job,
                  struct dep_msg_stats_rank out[ST_W], struct dep_msg_stats_ok *ok);
/* Rank r's figures of op: calls, errors and bytes exactly, none timed out, and times where
 * calls ran. */
void st_expect_op(const struct dep_msg_stats_rank *r, unsigned op, uint64_t calls,
                  uint64_t errors, uint64_t bytes);

/* Run this build's deepepctl with args (DW_ARGS) to its end: its exit code, its stdout in *out
 * (malloc'd). */
int st_ctl(const char *dir, char **out, const char *const *args);

/*
 * Write text (an exposition of a job of ST_W ranks that each ran 10
 * dispatch + combine pairs) to dir/name and have a real Prometheus parser
 * (python3-prometheus-client) read it, checking the families, samples and
 * labels deepepd gives such a job: the parser's exit status (0: it read
 * it so), what it said in *said (malloc'd).
 */
int st_prometheus_parse(const char *dir, const char *name, const char *text, char **said);

#endif
