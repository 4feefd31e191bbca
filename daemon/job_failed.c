/*
 * job_failed.c — the failures of multi-node jobs a node remembers, so that
 * a late rank of a job that failed while it gathered is answered with the
 * failure at once instead of gathering the id anew (job_refuse_late), and
 * the first rank of such a job refused before the job was made
 * (job_refuse_first).  The job table is job.c's, the peers' records
 * job_members.c's; what they share is job_internal.h.
 */
#include "job.h"
#include "job_internal.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "conn.h"
#include "lend.h"
#include "log.h"
#include "peer.h"
#include "proto.h"

/* ---- failures remembered: a late rank hears them -----------------------
 * A multi-node job that fails while it gathers leaves ranks that have not
 * attached yet, on this node or another.  Each would gather the id anew
 * and wait out limits.attach_timeout_ms for ranks that have already been
 * told and gone.  So a node keeps each such failure it makes or hears of
 * (a JOB_FAIL naming no rank), keyed by (owner uid, id) as the job is, and
 * answers a late rank of that uid and id with it at once.
 *
 * A late rank is told apart from a rank of the job started again under
 * the same id by its process (proc.h): the failure refuses a process that
 * started before this node learned of it (it was part of the attempt that
 * failed) and that has not heard it yet: it was not in the job here when
 * the job failed (waiting, or refused), and this record has not refused it
 * as that rank before.  A process started after, or one that has heard and
 * tries again, gathers the id anew.  A failure applies for
 * limits.attach_timeout_ms; it never fails a job that gathers anew under
 * the id, it only answers the late rank. */

/* Processes a record remembers as told; past that the oldest are forgotten
 * (one of those that attaches again is told again, once). */
#define JOB_FAILED_TOLD 64u

struct job_told {
  struct proc_id proc;
  uint32_t rank;             /* the rank it was refused as late, or JOB_TOLD_ANY */
};

struct job_failed {
  char id[DEP_JOB_ID_MAX];   /* "" when the slot is free */
  uint32_t owner_uid;
  int code;
  uint64_t at_tick;          /* when this node learned of it, in proc.h's unit (clock ticks
                                since boot): processes started before are of that attempt */
  uint64_t until_ns;         /* uv_hrtime() after which it no longer applies */
  char msg[DEP_MSG_TEXT_MAX];
  struct job_told told[JOB_FAILED_TOLD];
  uint32_t n_told;           /* entries written to told[], in turn */
};

static struct job_failed job_failed[JOB_FAILED_MAX];

/* Now in proc.h's unit (process start times); 0 when the clock cannot say,
 * which refuses no process. */
static uint64_t job_boot_ticks(void) {
  struct timespec ts;
  long hz = sysconf(_SC_CLK_TCK);
  if (hz <= 0 || clock_gettime(CLOCK_BOOTTIME, &ts) != 0)
    return 0;
  return (uint64_t)ts.tv_sec * (uint64_t)hz +
         (uint64_t)ts.tv_nsec / (1000000000u / (uint64_t)hz);
}

/* The live record of (uid, id), or NULL. */
struct job_failed *failed_find(uint32_t uid, const char *id) {
  uint64_t now = uv_hrtime();
  for (uint32_t i = 0; i < JOB_FAILED_MAX; i++) {
    struct job_failed *f = &job_failed[i];
    if (f->id[0] != '\0' && f->owner_uid == uid && now < f->until_ns && strcmp(f->id, id) == 0)
      return f;
  }
  return NULL;
}

/* Whether process p heard failure f for global rank `rank` (JOB_TOLD_ANY: for every rank). */
static bool failed_told(const struct job_failed *f, const struct proc_id *p, uint32_t rank) {
  uint32_t n = f->n_told < JOB_FAILED_TOLD ? f->n_told : JOB_FAILED_TOLD;
  for (uint32_t i = 0; i < n; i++) {
    const struct job_told *t = &f->told[i];
    if (t->proc.pid == p->pid && t->proc.start == p->start &&
        (t->rank == JOB_TOLD_ANY || t->rank == rank))
      return true;
  }
  return false;
}

void failed_tell(struct job_failed *f, const struct proc_id *p, uint32_t rank) {
  if (p->pid <= 0 || failed_told(f, p, rank))
    return;
  f->told[f->n_told % JOB_FAILED_TOLD] = (struct job_told){*p, rank};
  f->n_told++;
}

/*
 * Remember that the job (uid, id) failed while it gathered, with the code
 * and reason its ranks were told, on node `where` (NULL: this one); j, when
 * it is the local job that failed, gives the processes told with it.  A
 * record of (uid, id) that still applies takes the newer failure and keeps
 * the processes it told; else a free, outlived or the oldest slot is used.
 */
void job_remember_failure(uint32_t uid, const char *id, int code, const char *where,
                          const char *reason, const struct job *j) {
  struct job_failed *f = failed_find(uid, id);
  if (f == NULL) {
    uint64_t now = uv_hrtime();
    f = &job_failed[0];
    for (uint32_t i = 0; i < JOB_FAILED_MAX; i++) {
      struct job_failed *x = &job_failed[i];
      if (x->id[0] == '\0' || now >= x->until_ns) {
        f = x;
        break;
      }
      if (x->until_ns < f->until_ns)
        f = x;
    }
    memset(f, 0, sizeof *f);
    snprintf(f->id, sizeof f->id, "%s", id);
    f->owner_uid = uid;
  }
  f->code = code;
  f->at_tick = job_boot_ticks();
  f->until_ns = uv_hrtime() + (uint64_t)job_cfg->attach_timeout_ms * 1000000u;
  snprintf(f->msg, sizeof f->msg, "job %s failed on %s%s before this rank attached: %s", id,
           where != NULL ? "node " : "this node", where != NULL ? where : "", reason);
  if (j != NULL)
    for (uint32_t i = 0; i < j->local_world_size; i++)
      if (j->ranks[i].conn != NULL)
        failed_tell(f, &j->ranks[i].proc, JOB_TOLD_ANY);
}

/*
 * A rank of (c's uid, id) that comes after that job failed: answer it with
 * the failure and return true when it is a late rank of the attempt that
 * failed (see above); false, touching nothing, when it may gather anew.
 */
bool job_refuse_late(struct conn *c, uint32_t request_id, const struct dep_attach_args *a) {
  struct job_failed *f = failed_find((uint32_t)c->uid, a->job_id);
  struct proc_id p;
  if (f == NULL || proc_identify(c->pid, &p) != 0 || failed_told(f, &p, a->rank) ||
      p.start >= f->at_tick)
    return false;
  failed_tell(f, &p, a->rank);
  log_info("job %s: rank %u (pid %d) attached after the job failed; told why", a->job_id,
           a->rank, (int)c->pid);
  conn_send_error(c, request_id, f->code, "%s", f->msg);
  return true;
}

/*
 * The first rank of a multi-node job to come here was refused before the
 * job was made (its shape, a limit, a drain): the job cannot start, and
 * its ranks on the other nodes wait for this one (DESIGN §5).  They are
 * told at once (JOB_FAIL under c's uid: it fails that uid's job of the id
 * only), and its later ranks here hear it (job_refuse_late).
 */
void job_refuse_first(struct conn *c, const struct dep_attach_args *a, int code,
                      const char *msg) {
  if (!lend_spans_nodes(a) || proto_check_job_id(a->job_id, NULL, 0) != 0)
    return;
  char all[DEP_MSG_TEXT_MAX];
  snprintf(all, sizeof all, "job %s cannot start: its rank %u (local %u, pid %d) was refused: "
           "%.300s", a->job_id, a->rank, a->local_rank, (int)c->pid, msg);
  log_warnx("%s", all);
  job_remember_failure((uint32_t)c->uid, a->job_id, code, NULL, all, NULL);
  struct job_failed *f = failed_find((uint32_t)c->uid, a->job_id);
  struct proc_id p;
  if (f != NULL && proc_identify(c->pid, &p) == 0)
    failed_tell(f, &p, JOB_TOLD_ANY);
  struct dep_peer_msg m = job_event(a->job_id, (uint32_t)c->uid, code, DEP_PEER_NO_RANK, false,
                                    all);
  job_send_peers(&m);
}
