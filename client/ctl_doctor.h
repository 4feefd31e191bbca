/*
 * ctl_doctor.h — what `deepepctl doctor` concludes from what it found
 * (ctl_doctor_judge.c), apart from how it finds it (ctl_doctor.c: the
 * daemon's answers and the driver's).  Each judge takes the figures a GPU
 * or the daemon gave and adds its finding, OK / WARN / FAIL with what to
 * do, to a check: so that the decisions are tested on machines without a
 * GPU (tests/check_doctor.c) with the very values a GPU would give, some of
 * which (a compute mode, MPS) cannot be set on a shared GPU at all.
 */
#ifndef DEP_CTL_DOCTOR_H
#define DEP_CTL_DOCTOR_H

#include <stdbool.h>
#include <stdint.h>

#include "kimage.h"
#include "proto.h"

#define DOCTOR_TEXT 1024

/* A check starts as SKIP and each finding raises it: SKIP stays only where nothing applied. */
enum doctor_result { DOCTOR_SKIP = 0, DOCTOR_OK, DOCTOR_WARN, DOCTOR_FAIL };

struct doctor_check {
  const char *name;
  enum doctor_result result;
  char detail[DOCTOR_TEXT]; /* what was found, "; "-separated */
  char action[DOCTOR_TEXT]; /* what to do, for WARN and FAIL */
};

/* "SKIP", "OK", "WARN", "FAIL". */
const char *doctor_result_name(enum doctor_result r);

/* A finding: raises the check's result to r and adds what was found. */
void doctor_note(struct doctor_check *k, enum doctor_result r, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* What to do about it. */
void doctor_do(struct doctor_check *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- kernels: what serves one GPU's kernels ------------------------------------------ */

struct doctor_kernels_in {
  const char *gpu;          /* its UUID, as the daemon names it */
  int arch;                 /* major * 10 + minor; 0 where the driver did not say */
  enum kimage_fit fit;      /* what the library's fatbin holds for it */
  const char *build;        /* the library's build id */
  /* The daemon's answer to KERNELS, asked only where fit is not SASS or NONE: 0 (it lends a
   * compile: lent_*), DEP_ERR_NOT_FOUND (it has none: why), else it did not say (why). */
  int lend_rc;
  const char *lend_why;
  const struct dep_msg_kernels_ok *lent;
};

/* Whether the daemon must be asked what it lends (fit neither SASS nor NONE). */
bool doctor_kernels_ask(enum kimage_fit fit);
void doctor_judge_kernels(struct doctor_check *k, const struct doctor_kernels_in *in);

/* ---- allocation: a GPU's compute mode, and MPS where ranks share it ------------------- */

/* CU_DEVICE_ATTRIBUTE_COMPUTE_MODE's values. */
#define DOCTOR_MODE_DEFAULT 0
#define DOCTOR_MODE_PROHIBITED 2
#define DOCTOR_MODE_EXCLUSIVE_PROCESS 3

/*
 * The job (into job, DEP_JOB_ID_MAX bytes) of which ranks in more than one
 * process use the GPU uuid, or false: those ranks need MPS to run at once.
 */
bool doctor_shared_gpu(const struct dep_msg_clients *m, const uint8_t uuid[16], char *job);

/* One GPU's compute mode and MPS (mps: contexts made there are MPS clients); shared_job, the
 * job whose ranks share it in several processes, or NULL. */
void doctor_judge_mode(struct doctor_check *k, const char *gpu, int mode, bool mps,
                       const char *shared_job);

/* ---- memory: a GPU's free memory against its pool --------------------------------------- */

struct doctor_memory_in {
  const char *gpu;
  uint64_t budget;          /* the pool's budget (pool.size_per_device) */
  uint64_t made;            /* what it has made of it */
  uint64_t busy;            /* of that, lent to running jobs or held by gone processes */
  uint64_t free_b, total_b; /* the GPU's free and total memory, as the driver says */
  uint64_t largest;         /* the largest arena lent on this GPU since the daemon started, or 0 */
  const char *largest_job;
  bool largest_running;     /* that job still runs: its arena is made and lent */
};

void doctor_judge_memory(struct doctor_check *k, const struct doctor_memory_in *in);

/* ---- connections: TCP's restart after idle, where peers' data goes over TCP --------------- */

/* Where this node reads it (the daemon's network namespace where deepepctl runs beside it). */
#define DOCTOR_SSAI_PATH "/proc/sys/net/ipv4/tcp_slow_start_after_idle"

/* ssai: DOCTOR_SSAI_PATH's value (-1: unreadable); tcp_peers: peers up over TCP (or mixed). */
void doctor_judge_tcp_idle(struct doctor_check *k, int ssai, uint32_t tcp_peers);

#endif /* DEP_CTL_DOCTOR_H */
