/*
 * autotune.h — adaptive_optimization in the running daemon (DESIGN §6, §9):
 * the tuning table of tune.h kept in kernel_cache_dir, the answer to each
 * rank's TUNE at attach, and the measurements, which run in a child
 * process (tunechild.c) only while the daemon has no job at all and never
 * longer than AUTOTUNE_TIMEOUT_MS; a job that asks for its budget while one
 * runs ends it (its key is measured again at the next idle moment), so a
 * measurement never shares the GPU with a job's calls.
 *
 * Jobs of the daemon's own children (the warm-up's, the measurement's) are
 * answered and never queued.  With adaptive_optimization off every rank is
 * told the default (and nothing is measured), so deepepctl stats still says
 * which budget each rank runs with and why.
 */
#ifndef DEP_AUTOTUNE_H
#define DEP_AUTOTUNE_H

#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "proto.h"

struct conn;

/* The measurement child's option: deepepd --tune-child SOCKET ARGS... (tunechild.c). */
#define AUTOTUNE_CHILD_OPT "tune-child"
/* Its jobs' ids begin so. */
#define AUTOTUNE_JOB_PREFIX "deepepd-tune-"
/* How long one key's measurement may take before it is killed (and counted failed). */
#define AUTOTUNE_TIMEOUT_MS 60000
/* How often the daemon looks whether it is idle with a key waiting. */
#define AUTOTUNE_IDLE_CHECK_MS 1000

/*
 * Open the table (kernel_cache_dir; entries of another build or driver are
 * removed as stale, damaged ones as damaged) and start the idle check.
 * Once the pools are made.  0, or DEP_ERR_* logged (the daemon then answers
 * every TUNE with the default).
 */
int autotune_start(uv_loop_t *loop, const struct config *cfg);
/* Kill a running measurement, close the handles, free the table. */
void autotune_fini(void);

/* TUNE from connection c (replies itself). */
void autotune_request(struct conn *c, uint32_t request_id, const struct dep_msg_tune *m);

/* The child's main (tunechild.c): its exit status. */
int autotune_child_main(const char *socket, int argc, char **argv);

#endif /* DEP_AUTOTUNE_H */
