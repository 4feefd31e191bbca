/*
 * warmup.h — kernel_warmup at start (DESIGN §9, §10): before READY=1 a
 * child process of the daemon attaches, through libdeepep-client, as a job
 * of one rank on each served GPU, so that the library's own attach runs
 * there — its kernels loaded (the daemon's compile where it lends one) and
 * each run once on its private loopback world — and a broken driver or a
 * bad build is found at boot, not at a job's first call.
 *
 * A child, not the daemon: the library's warm-up is reused as it is rather
 * than restated, and a kernel that faults poisons only the CUDA context of
 * the process that ran it, while the daemon's contexts hold every pool.
 */
#ifndef DEP_WARMUP_H
#define DEP_WARMUP_H

#include <uv.h>

/* The child's option: deepepd --warmup-child SOCKET UUID... */
#define WARMUP_CHILD_OPT "warmup-child"
/* Its jobs' ids begin so ("deepepd-warmup-PID-N"). */
#define WARMUP_JOB_PREFIX "deepepd-warmup-"
/* How long the child may take in all before it is killed and the start fails. */
#define WARMUP_TIMEOUT_MS 120000

/* How the warm-up ended, on the loop thread: 0, or DEP_ERR_* and why. */
typedef void warmup_done_fn(int rc, const char *why);

/*
 * Run the child (this very executable) against `socket` for the n GPUs of
 * uuids.  `done` runs once, on the loop thread, after the pools are given
 * back what the child's jobs used (pool_forget: they start as they would
 * have without it).  0, or DEP_ERR_* (logged) when it cannot start.
 */
int warmup_start(uv_loop_t *loop, const char *socket, const char uuids[][37], size_t n,
                 warmup_done_fn *done);
/* Kill a child still running and close its handles (the daemon is stopping). */
void warmup_fini(void);

/* The child's main: attach and detach one job of one rank per GPU.  Its exit status. */
int warmup_child_main(const char *socket, int n, char **uuids);

#endif /* DEP_WARMUP_H */
