/*
 * job.c — the job table and the node-local attach rendezvous.  Jobs are few
 * (limits.max_jobs), so a singly linked list searched by id is plenty and
 * easy to hold in one's head.
 */
#include "job.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "conn.h"
#include "deepepd.h"
#include "devices.h"
#include "lend.h"
#include "log.h"
#include "proto.h"
#include "shape.h"

static uv_loop_t *job_loop;
static struct job *job_list;
static uint32_t job_n;
static const struct config *job_cfg;

void job_init(uv_loop_t *loop, const struct config *cfg) {
  job_loop = loop;
  job_cfg = cfg;
  lend_init(loop, cfg);
}

uint32_t job_count(void) { return job_n; }

static struct job *job_find(const char *id) {
  for (struct job *j = job_list; j != NULL; j = j->next)
    if (strcmp(j->id, id) == 0)
      return j;
  return NULL;
}

static uint64_t job_age_ms(const struct job *j) {
  return (uv_hrtime() - j->created_ns) / 1000000u;
}

static void job_free(uv_handle_t *h) { free(h->data); }

static void job_destroy(struct job *j, const char *why) {
  if (j->dead)
    return;
  j->dead = true;
  for (struct job **pp = &job_list; *pp != NULL; pp = &(*pp)->next) {
    if (*pp == j) {
      *pp = j->next;
      break;
    }
  }
  job_n--;
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    struct job_rank *r = &j->ranks[i];
    if (r->conn != NULL)
      r->conn->job = NULL;
    r->conn = NULL;
  }
  j->attached = 0;
  lend_release(j, deepepd.stopping);
  log_info("job %s: removed (%s) after %llu ms", j->id, why,
           (unsigned long long)job_age_ms(j));
  uv_timer_stop(&j->timer);
  uv_close((uv_handle_t *)&j->timer, job_free);
}

/* Free one local rank's slot; the job goes when its last rank does. */
static void job_remove_rank(struct job *j, uint32_t local_rank, bool detached) {
  struct job_rank *r = &j->ranks[local_rank];
  if (r->conn == NULL)
    return;
  log_info("job %s: rank %u (local %u, pid %d) %s (%u of %u local ranks left)", j->id, r->rank,
           local_rank, (int)r->pid, detached ? "detached" : "disconnected", j->attached - 1,
           j->local_world_size);
  if (j->ready && !deepepd.stopping)
    lend_tell_gone(j, r, detached);
  r->conn->job = NULL;
  /* The arena stays with the job: peers still map it, so it goes back to
   * the pool only when the last rank is gone (lend_release). */
  struct pool_block *arena = r->arena;
  memset(r, 0, sizeof *r);
  r->arena = arena;
  j->attached--;
  if (j->attached == 0)
    job_destroy(j, "no ranks left");
}

/* Fail every rank still waiting for the rendezvous, then tear the job down. */
static void job_fail(struct job *j, int code, const char *msg) {
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    struct job_rank *r = &j->ranks[i];
    if (r->conn != NULL && r->waiting) {
      r->waiting = false;
      conn_send_error(r->conn, r->request_id, code, "%s", msg);
    }
  }
  job_destroy(j, dep_strerror(code));
}

static void job_on_timeout(uv_timer_t *t) {
  struct job *j = t->data;
  char missing[256];
  size_t off = 0;
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    if (j->ranks[i].conn != NULL)
      continue;
    int n = snprintf(missing + off, sizeof missing - off, "%s%u", off ? "," : "", i);
    if (n < 0 || (size_t)n >= sizeof missing - off - 4) {
      snprintf(missing + off, sizeof missing - off, ",...");
      break;
    }
    off += (size_t)n;
  }
  char msg[DEP_MSG_TEXT_MAX];
  snprintf(msg, sizeof msg,
           "job %s: %u of %u local ranks attached after %u ms; missing local ranks %s "
           "(start every local rank, or raise limits.attach_timeout_ms)",
           j->id, j->attached, j->local_world_size, j->timeout_ms, missing);
  log_warnx("%s", msg);
  job_fail(j, DEP_ERR_TIMEOUT, msg);
}

/* Every local rank is here: lend memory and answer them all. */
static void job_complete(struct job *j) {
  uv_timer_stop(&j->timer);
  /* Room for "job <id>: " in front, within one ERROR message. */
  char why[DEP_MSG_TEXT_MAX - DEP_JOB_ID_MAX - 8] = "";
  int rc = lend_arenas(j, why, sizeof why);
  if (rc != 0) {
    char msg[DEP_MSG_TEXT_MAX];
    snprintf(msg, sizeof msg, "job %s: %s", j->id, why[0] ? why : dep_strerror(rc));
    log_warnx("%s", msg);
    job_fail(j, rc, msg);
    return;
  }
  j->ready = true;
  log_info("job %s: all %u local ranks attached after %llu ms", j->id, j->local_world_size,
           (unsigned long long)job_age_ms(j));
  struct dep_msg_attach_ok ok = {
      .slab_bytes = j->slab_bytes,
      .local_world_size = j->local_world_size,
      .num_fds = 0,
      .op_timeout_ms = job_cfg->op_timeout_ms,
      .kernel_warmup = job_cfg->kernel_warmup ? 1 : 0,
  };
  snprintf(ok.backend, sizeof ok.backend, "%s", devices_backend_name());
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    struct job_rank *r = &j->ranks[i];
    if (r->conn == NULL || !r->waiting)
      continue;
    r->waiting = false;
    /* Every rank maps every local rank's slab: the reply is one SLAB frame
     * per arena, then ATTACH_OK.  A rank whose queue overflows is dropped
     * by conn_send, which ends its part in the job. */
    if (lend_send(j, r->conn, r->request_id) == 0)
      conn_send(r->conn, DEP_MSG_ATTACH_OK, r->request_id, &ok, NULL, 0);
  }
}

static struct job *job_create(struct conn *c, const struct dep_attach_args *a) {
  struct job *j = calloc(1, sizeof *j + sizeof(struct job_rank) * a->local_world_size);
  if (j == NULL)
    return NULL;
  snprintf(j->id, sizeof j->id, "%s", a->job_id);
  j->owner_uid = c->uid;
  j->world_size = a->world_size;
  j->local_world_size = a->local_world_size;
  j->shape = a->shape;
  j->created_ns = uv_hrtime();
  uv_timer_init(job_loop, &j->timer);
  j->timer.data = j;
  j->timeout_ms = job_cfg->attach_timeout_ms;
  uv_timer_start(&j->timer, job_on_timeout, j->timeout_ms, 0);
  j->next = job_list;
  job_list = j;
  job_n++;
  log_info("job %s: created by uid %u (world_size %u, %u local ranks)", j->id,
           (unsigned)j->owner_uid, j->world_size, j->local_world_size);
  return j;
}

/* The first field in which a joining rank disagrees with the job, or false.
 * The shape (shape.h) is compared as one definition, every field of it. */
static bool job_mismatch(const struct job *j, const struct dep_attach_args *a, char *msg,
                         size_t len) {
  const char *field = NULL;
  uint64_t have = 0, gives = 0;
  if (j->local_world_size != a->local_world_size) {
    field = "local_world_size";
    have = j->local_world_size;
    gives = a->local_world_size;
  } else if (!dep_shape_diff(&j->shape, j->world_size, &a->shape, a->world_size, &field, &have,
                             &gives)) {
    return false;
  }
  snprintf(msg, len,
           "job %s: this rank gives %s %llu but the ranks already attached give %llu; every "
           "rank of a job must pass the same values",
           j->id, field, (unsigned long long)gives, (unsigned long long)have);
  return true;
}

/*
 * Refuse an ATTACH: answer it, and when it names a job of the caller's uid
 * that is still gathering its ranks, fail that job at once for every rank
 * waiting in it, with the same reason (DESIGN §5): a job with a refused
 * rank can never start, and its other ranks must not wait out
 * limits.attach_timeout_ms to learn it.  A running job and another uid's
 * job are left alone (nobody can fail a job they could not join).
 */
static void job_refuse(struct job *j, struct conn *c, uint32_t request_id,
                       const struct dep_attach_args *a, int code, const char *msg) {
  conn_send_error(c, request_id, code, "%s", msg);
  if (j == NULL || j->ready || j->dead || j->owner_uid != c->uid || j->attached == 0)
    return;
  char all[DEP_MSG_TEXT_MAX];
  snprintf(all, sizeof all, "job %s cannot start: its rank %u (local %u, pid %d) was refused: "
           "%.300s", j->id, a->rank, a->local_rank, (int)c->pid, msg);
  log_warnx("%s", all);
  job_fail(j, code, all);
}

void job_refuse_attach(struct conn *c, uint32_t request_id, const struct dep_attach_args *a,
                       int code, const char *msg) {
  struct job *j = proto_check_job_id(a->job_id, NULL, 0) == 0 ? job_find(a->job_id) : NULL;
  job_refuse(j, c, request_id, a, code, msg);
}

/* Live jobs of one uid (a job still gathering its ranks holds its id too). */
static uint32_t job_count_of(uid_t uid) {
  uint32_t n = 0;
  for (struct job *j = job_list; j != NULL; j = j->next)
    n += j->owner_uid == uid;
  return n;
}

void job_attach(struct conn *c, uint32_t request_id, const struct dep_attach_args *a) {
  if (c->job != NULL) {
    conn_send_error(c, request_id, DEP_ERR_STATE,
                    "this connection is already attached to job %s as local rank %u; DETACH "
                    "first or open another connection",
                    c->job->id, c->job_local_rank);
    return;
  }
  struct job *j = job_find(a->job_id);
  char why[DEP_MSG_TEXT_MAX - DEP_JOB_ID_MAX - 8] = "";
  char msg[DEP_MSG_TEXT_MAX];
  uint64_t slab_bytes = 0;
  int rc = lend_check(a, &slab_bytes, why, sizeof why);
  if (rc != 0) {
    snprintf(msg, sizeof msg, "job %s: %s", a->job_id, why);
    job_refuse(j, c, request_id, a, rc, msg);
    return;
  }
  if (j == NULL) {
    if (deepepd.draining) {
      conn_send_error(c, request_id, DEP_ERR_STATE,
                      "deepepd is draining (deepepctl drain): it starts no new job until "
                      "`deepepctl drain --cancel`; running jobs go on");
      return;
    }
    if (job_n >= job_cfg->max_jobs) {
      conn_send_error(c, request_id, DEP_ERR_LIMIT,
                      "deepepd already holds %u jobs (limits.max_jobs); wait for one to end or "
                      "raise the limit",
                      job_n);
      return;
    }
    uint32_t mine = job_count_of(c->uid);
    if (mine >= job_cfg->max_jobs_per_uid) {
      log_warnx("job %s: uid %u (pid %d) already holds %u jobs (limits.max_jobs_per_uid); "
                "refused", a->job_id, (unsigned)c->uid, (int)c->pid, mine);
      conn_send_error(c, request_id, DEP_ERR_LIMIT,
                      "uid %u already holds %u jobs (limits.max_jobs_per_uid %u); wait for one "
                      "to end, or ask the administrator to raise the limit",
                      (unsigned)c->uid, mine, job_cfg->max_jobs_per_uid);
      return;
    }
    j = job_create(c, a);
    if (j == NULL) {
      conn_send_error(c, request_id, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
      return;
    }
    j->slab_bytes = slab_bytes; /* the layout's size; the stride once lent */
  } else {
    /* Another user learns that the id is taken, and nothing else about the job. */
    if (j->owner_uid != c->uid) {
      log_warnx("job %s: uid %u (pid %d) tried to join a job of uid %u; refused", j->id,
                (unsigned)c->uid, (int)c->pid, (unsigned)j->owner_uid);
      conn_send_error(c, request_id, DEP_ERR_PERMISSION,
                      "job %s belongs to another user; choose a job id of your own", a->job_id);
      return;
    }
    if (j->ready) {
      conn_send_error(c, request_id, DEP_ERR_STATE,
                      "job %s has already started (all %u local ranks attached); a rank cannot "
                      "join a running job: restart the whole job, or use a new job id",
                      j->id, j->local_world_size);
      return;
    }
    if (job_mismatch(j, a, msg, sizeof msg)) {
      job_refuse(j, c, request_id, a, DEP_ERR_MISMATCH, msg);
      return;
    }
  }
  struct job_rank *slot = &j->ranks[a->local_rank];
  if (slot->conn != NULL) {
    snprintf(msg, sizeof msg, "local rank %u of job %s is already attached by pid %d",
             a->local_rank, j->id, (int)slot->pid);
    job_refuse(j, c, request_id, a, DEP_ERR_EXISTS, msg);
    return;
  }
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    if (j->ranks[i].conn != NULL && j->ranks[i].rank == a->rank) {
      snprintf(msg, sizeof msg, "rank %u of job %s is already attached by pid %d (local rank %u)",
               a->rank, j->id, (int)j->ranks[i].pid, i);
      job_refuse(j, c, request_id, a, DEP_ERR_EXISTS, msg);
      return;
    }
  }
  slot->conn = c;
  slot->rank = a->rank;
  slot->pid = c->pid;
  /* Who it is, now rather than when the last rank arrives: the rendezvous
   * completes without a look at /proc. */
  if (proc_identify(c->pid, &slot->proc) != 0)
    slot->proc = (struct proc_id){0};
  slot->request_id = request_id;
  slot->waiting = true;
  memcpy(slot->device_uuid, a->device_uuid, sizeof slot->device_uuid);
  c->job = j;
  c->job_local_rank = a->local_rank;
  j->attached++;
  log_info("job %s: rank %u (local %u, pid %d) attached (%u of %u local ranks)", j->id, a->rank,
           a->local_rank, (int)c->pid, j->attached, j->local_world_size);
  if (j->attached == j->local_world_size)
    job_complete(j);
}

void job_detach(struct conn *c, uint32_t request_id) {
  struct job *j = c->job;
  if (j == NULL) {
    conn_send_error(c, request_id, DEP_ERR_STATE, "this connection is not attached to a job");
    return;
  }
  struct job_rank *r = &j->ranks[c->job_local_rank];
  if (r->waiting) {
    /* Its ATTACH is still waiting: that request ends here, with an answer. */
    r->waiting = false;
    conn_send_error(c, r->request_id, DEP_ERR_STATE,
                    "ATTACH to job %s was cancelled by DETACH before every local rank arrived",
                    j->id);
  }
  job_remove_rank(j, c->job_local_rank, true);
  conn_send(c, DEP_MSG_DETACH_OK, request_id, NULL, NULL, 0);
}

void job_conn_closed(struct conn *c) {
  if (c->job != NULL)
    job_remove_rank(c->job, c->job_local_rank, false);
}

int job_fill_status(struct dep_status *st, uid_t viewer_uid, uint32_t max_jobs) {
  st->jobs = NULL;
  st->num_jobs = 0;
  if (job_n == 0 || max_jobs == 0)
    return 0;
  st->jobs = calloc(job_n, sizeof *st->jobs);
  if (st->jobs == NULL)
    return DEP_ERR_NO_MEMORY;
  bool all = viewer_uid == 0 || viewer_uid == getuid();
  for (struct job *j = job_list; j != NULL && st->num_jobs < max_jobs; j = j->next) {
    if (!all && j->owner_uid != viewer_uid)
      continue;
    struct dep_status_job *o = &st->jobs[st->num_jobs++];
    snprintf(o->job_id, sizeof o->job_id, "%s", j->id);
    o->owner_uid = (uint32_t)j->owner_uid;
    o->ranks_attached = j->attached;
    o->ranks_expected = j->local_world_size;
    o->world_size = j->world_size;
    o->slab_bytes = j->slab_bytes;
    o->age_ms = job_age_ms(j);
  }
  return 0;
}

void job_fini(void) {
  while (job_list != NULL)
    job_destroy(job_list, "the daemon is stopping");
  lend_fini();
}
