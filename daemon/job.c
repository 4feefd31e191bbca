/*
 * job.c — the job table and the node-local attach rendezvous: a job's
 * creation, its ranks' ATTACH and DETACH, the timeout, lending its arenas
 * and answering every rank at once, its teardown, and what status shows.
 * Jobs are few (limits.max_jobs), so a singly linked list searched by id
 * is plenty and easy to hold in one's head.
 *
 * What spans nodes is elsewhere: the peers' MEMBERSHIP records, the
 * gathering across nodes and the peer events in job_members.c; the
 * failures remembered for a multi-node job's late ranks in job_failed.c.
 * What the three share is job_internal.h.
 */
#include "job.h"
#include "job_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "conn.h"
#include "deepepd.h"
#include "devices.h"
#include "lend.h"
#include "log.h"
#include "peer.h"
#include "proto.h"
#include "xfer.h"
#include "shape.h"
#include "slab.h"

static uv_loop_t *job_loop;
struct job *job_list;
static uint32_t job_n;
const struct config *job_cfg;

void job_init(uv_loop_t *loop, const struct config *cfg) {
  job_loop = loop;
  job_cfg = cfg;
  lend_init(loop, cfg);
  peer_set_events(&job_peer_events);
}

uint32_t job_count(void) { return job_n; }

struct job *job_find(const char *id) {
  for (struct job *j = job_list; j != NULL; j = j->next)
    if (strcmp(j->id, id) == 0)
      return j;
  return NULL;
}

static uint64_t job_age_ms(const struct job *j) {
  return (uv_hrtime() - j->created_ns) / 1000000u;
}

static void job_free(uv_handle_t *h) { free(h->data); }

/* The attach timer is closed: close the fill timer, and the job goes with it. */
static void job_timer_closed(uv_handle_t *h) {
  struct job *j = h->data;
  uv_close((uv_handle_t *)&j->fill_timer, job_free);
}

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
  /* The peers forget our part of it (when stopping, the dropped links say it). */
  if (j->multinode && !deepepd.stopping)
    job_tell_peers(j, 0, DEP_PEER_NO_RANK, false, why);
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    struct job_rank *r = &j->ranks[i];
    if (r->conn != NULL)
      r->conn->job = NULL;
    r->conn = NULL;
  }
  j->attached = 0;
  xfer_job_end(j); /* the proxy lets go of its slabs before they go back */
  lend_release(j, deepepd.stopping);
  elastic_free(j);
  log_info("job %s: removed (%s) after %llu ms", j->id, why,
           (unsigned long long)job_age_ms(j));
  uv_timer_stop(&j->timer);
  uv_timer_stop(&j->fill_timer);
  uv_close((uv_handle_t *)&j->timer, job_timer_closed);
}

/* Free one local rank's slot; the job goes when its last rank does. */
static void job_remove_rank(struct job *j, uint32_t local_rank, bool detached) {
  struct job_rank *r = &j->ranks[local_rank];
  if (r->conn == NULL)
    return;
  log_info("job %s: rank %u (local %u, pid %d) %s (%u of %u local ranks left)", j->id, r->rank,
           local_rank, (int)r->pid, detached ? "detached" : "disconnected", j->attached - 1,
           j->local_world_size);
  /* An elastic job goes on without it (job_elastic.c): masked, not aborted, and its
   * slot keeps its rank and slab for a process that comes back as that rank. */
  const bool masks = j->ready && !deepepd.stopping && j->elastic != NULL;
  if (masks)
    elastic_leave(j, r, detached ? DEP_SLAB_GONE_DETACHED : DEP_SLAB_GONE_DIED);
  else if (j->ready && !deepepd.stopping)
    lend_tell_gone(j, r, detached ? DEP_SLAB_GONE_DETACHED : DEP_SLAB_GONE_DIED);
  if (j->multinode && !deepepd.stopping && !masks) {
    char msg[DEP_MSG_TEXT_MAX];
    if (j->ready) {
      /* The other nodes' ranks are told as the local ones are. */
      snprintf(msg, sizeof msg, "job %s: rank %u (pid %d) %s on a peer node", j->id, r->rank,
               (int)r->pid, detached ? "detached" : "disconnected");
      job_tell_peers(j, DEP_ERR_PEER, r->rank, detached, msg);
    } else if (j->announced && j->attached > 1) {
      /* Our MEMBERSHIP no longer holds: the peers forget it until we send it again. */
      job_tell_peers(j, 0, DEP_PEER_NO_RANK, false, "a local rank left while it gathered");
      j->announced = false;
      j->accepted = 0;
    }
    if (!j->ready && j->lent && j->attached > 1) {
      /* No rank was sent the arenas yet; the rank that takes the free slot
       * may use another device, so they are lent again when all are here. */
      lend_release(j, false);
      j->lent = false;
    }
  }
  r->conn->job = NULL;
  /* The arena stays with the job: peers still map it, so it goes back to
   * the pool only when the last rank is gone (lend_release). */
  const struct job_rank was = *r;
  memset(r, 0, sizeof *r);
  r->arena = was.arena;
  if (masks) {
    r->rank = was.rank;
    r->offset = was.offset;
    memcpy(r->device_uuid, was.device_uuid, sizeof r->device_uuid);
  }
  j->attached--;
  if (j->attached == 0)
    job_destroy(j, "no ranks left");
}

/* Fail every rank still waiting for the rendezvous, then tear the job down;
 * a multi-node job's failure is remembered for its late ranks, as on node
 * `where` (NULL: this one) for `reason`. */
void job_fail_from(struct job *j, int code, const char *msg, const char *where,
                   const char *reason) {
  if (j->multinode && !j->ready)
    job_remember_failure((uint32_t)j->owner_uid, j->id, code, where, reason, j);
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    struct job_rank *r = &j->ranks[i];
    if (r->conn != NULL && r->waiting) {
      r->waiting = false;
      conn_send_error(r->conn, r->request_id, code, "%s", msg);
    }
  }
  job_destroy(j, dep_strerror(code));
}

/* Fail every rank still waiting for the rendezvous, then tear the job down. */
void job_fail(struct job *j, int code, const char *msg) {
  job_fail_from(j, code, msg, NULL, msg);
}

static void job_on_timeout(uv_timer_t *t) {
  struct job *j = t->data;
  if (j->multinode) {
    job_timeout_multinode(j);
    return;
  }
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

/* Lend j its arenas unless they are; false after failing the job (everywhere). */
bool job_lend(struct job *j) {
  if (j->lent)
    return true;
  /* Room for "job <id>: " in front, within one ERROR message. */
  char why[DEP_MSG_TEXT_MAX - DEP_JOB_ID_MAX - 8] = "";
  int rc = lend_arenas(j, why, sizeof why);
  if (rc != 0) {
    char msg[DEP_MSG_TEXT_MAX];
    snprintf(msg, sizeof msg, "job %s: %s", j->id, why[0] ? why : dep_strerror(rc));
    log_warnx("%s", msg);
    if (j->multinode)
      job_tell_peers(j, rc, DEP_PEER_NO_RANK, false, msg);
    job_fail(j, rc, msg);
    return false;
  }
  j->lent = true;
  return true;
}

static void job_answer_waiting(struct job *j);

/* Every rank is here: lend memory (unless it was) and make j ready; false after failing it. */
static bool job_make_ready(struct job *j) {
  uv_timer_stop(&j->timer);
  if (!job_lend(j))
    return false;
  j->ready = true;
  j->ready_ns = uv_hrtime();
  log_info("job %s: all %u local ranks attached after %llu ms", j->id, j->local_world_size,
           (unsigned long long)job_age_ms(j));
  return true;
}

/* Every rank is here: lend memory (unless it was) and answer them all. */
void job_complete(struct job *j) {
  if (job_make_ready(j))
    job_answer_waiting(j);
}

/* How often a job waiting for its exchange regions (job_complete_filled) asks. */
#define JOB_FILL_POLL_MS 1

static void job_on_fill_poll(uv_timer_t *t) {
  struct job *j = t->data;
  const uint64_t now = uv_hrtime();
  const bool filled = xfer_job_filled(j);
  /* Bounded by the job's attach deadline, which its first rank's own wait outlasts
   * (client/attach.c attach_timeout). */
  if (!filled && (now - j->created_ns) / 1000000u < j->timeout_ms)
    return;
  if (!filled)
    log_warnx("job %s: its exchange regions were still being mapped in after %llu ms; its "
              "ranks are answered now, and its first calls will map the rest", j->id,
              (unsigned long long)((now - j->filling_ns) / 1000000u));
  uv_timer_stop(&j->fill_timer);
  job_answer_waiting(j);
}

void job_complete_filled(struct job *j) {
  if (!job_make_ready(j))
    return;
  if (xfer_job_filled(j)) {
    job_answer_waiting(j);
    return;
  }
  j->filling_ns = uv_hrtime();
  uv_timer_start(&j->fill_timer, job_on_fill_poll, JOB_FILL_POLL_MS, JOB_FILL_POLL_MS);
}

/* Answer every local rank of the ready job j whose ATTACH waits: its arenas, then ATTACH_OK. */
static void job_answer_waiting(struct job *j) {
  struct dep_msg_attach_ok ok = {
      .slab_bytes = j->slab_bytes,
      .local_world_size = j->local_world_size,
      .num_fds = 0,
      .op_timeout_ms = job_cfg->op_timeout_ms,
      .kernel_warmup = job_cfg->kernel_warmup ? 1 : 0,
      .chunk_rows = j->chunk_rows,
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

static void job_seat(struct job *j, struct conn *c, uint32_t request_id,
                     const struct dep_attach_args *a);
static bool job_mismatch(const struct job *j, const struct dep_attach_args *a, char *msg,
                         size_t len);

/*
 * A process attaches to the running elastic job j with the id of a rank
 * that left it (DESIGN §14): it takes that rank's slot and memory, scrubbed
 * (elastic_scrub), and is answered with the same SLAB frames and
 * ATTACH_OK the job's ranks had; no survivor re-attaches and nothing is
 * made.  The arguments must be the job's (shape, local ranks, flags, uid:
 * checked before), and the rank one of this node's that is masked, on the
 * device its memory is on.  Its bit is cleared with a join call above
 * every call the survivors have posted (elastic_join, slab.h), so that it
 * joins their calls at a boundary they all reach.  In a job across nodes
 * the other daemons must agree on that call first (job_elastic.c): the
 * process takes the slot at once and its ATTACH waits for them
 * (job_rejoined); its exchange region and ring are the rank's, kept by the
 * route between nodes.  A rank of a node that is lost cannot come back:
 * nothing holds its memory.
 */
static void job_rejoin(struct job *j, struct conn *c, uint32_t request_id,
                       const struct dep_attach_args *a) {
  char msg[DEP_MSG_TEXT_MAX];
  struct job_rank *slot = &j->ranks[a->local_rank];
  if (job_mismatch(j, a, msg, sizeof msg)) {
    conn_send_error(c, request_id, DEP_ERR_MISMATCH, "%s", msg);
    return;
  }
  bool here = false;
  for (uint32_t i = 0; i < j->local_world_size; i++)
    here |= j->ranks[i].rank == a->rank;
  const int holder = here ? -1 : member_holder(j, a->rank);
  if (!here && holder >= 0) {
    conn_send_error(c, request_id, DEP_ERR_MISMATCH,
                    "rank %u of job %s is held by node %s; a rank rejoins only on the node that "
                    "held it: attach there", a->rank, j->id, peer_name(holder));
    return;
  }
  if (!here && j->multinode && elastic_masked(j, a->rank)) {
    conn_send_error(c, request_id, DEP_ERR_STATE,
                    "rank %u of job %s was held by a node that is lost (its peer link dropped "
                    "or its part of the job ended): a lost node's ranks cannot come back, since "
                    "nothing holds their memory; the job goes on without them, or start it "
                    "again to have them", a->rank, j->id);
    return;
  }
  if (slot->conn != NULL) {
    conn_send_error(c, request_id, DEP_ERR_EXISTS,
                    "local rank %u of job %s is attached by pid %d; only a rank that left the "
                    "job can be taken", a->local_rank, j->id, (int)slot->pid);
    return;
  }
  if (slot->rank != a->rank || !elastic_masked(j, a->rank)) {
    conn_send_error(c, request_id, DEP_ERR_MISMATCH,
                    "local rank %u of job %s is rank %u, not %u; attach with the rank and local "
                    "rank that left", a->local_rank, j->id, slot->rank, a->rank);
    return;
  }
  if (memcmp(slot->device_uuid, a->device_uuid, sizeof slot->device_uuid) != 0) {
    conn_send_error(c, request_id, DEP_ERR_MISMATCH,
                    "rank %u of job %s has its memory on another device than this process "
                    "gives; attach from the GPU the rank used", a->rank, j->id);
    return;
  }
  char why[DEP_MSG_TEXT_MAX - DEP_JOB_ID_MAX - 64] = "";
  bool asked = false;
  int rc = elastic_scrub(j, slot, why, sizeof why);
  if (rc == 0)
    rc = elastic_join(j, slot, c->pid, &asked, why, sizeof why);
  if (rc != 0) {
    log_warnx("job %s: pid %d cannot take rank %u: %s", j->id, (int)c->pid, a->rank, why);
    conn_send_error(c, request_id, rc, "job %s: rank %u cannot be taken: %s", j->id, a->rank,
                    why);
    return;
  }
  job_seat(j, c, request_id, a);
  if (!asked)
    job_answer_waiting(j);
}

void job_rejoined(struct job *j, uint32_t local_rank, int code, const char *why) {
  struct job_rank *r = &j->ranks[local_rank];
  if (r->conn == NULL || !r->waiting)
    return;
  if (code == 0) {
    job_answer_waiting(j);
    return;
  }
  log_warnx("job %s: pid %d cannot take rank %u: %s", j->id, (int)r->pid, r->rank, why);
  r->waiting = false;
  conn_send_error(r->conn, r->request_id, code, "job %s: rank %u cannot be taken: %s", j->id,
                  r->rank, why);
  /* Masked again everywhere (elastic_leave), its slot kept for the next try. */
  job_remove_rank(j, local_rank, true);
}

/* The job's chunk as lend_check chose it; under auto, a job that streams says so, once. */
static void job_set_chunk(struct job *j, const struct lend_fit *f) {
  const double mib = 1024.0 * 1024.0;
  j->chunk_rows = f->chunk_rows;
  j->chunk_auto = f->by_auto;
  j->chunk_whole_bytes = f->whole_bytes;
  j->chunk_pool_bytes = f->pool_bytes;
  j->chunk_xnode = f->xnode;
  if (f->xnode)
    log_info("job %s streams in chunks of %u rows (stream_chunk_rows: auto): a job across "
             "nodes on the host backend streams; %.1f MiB a rank", j->id, f->chunk_rows,
             (double)(f->slab_bytes + f->host_bytes) / (1024.0 * 1024.0));
  else if (f->by_auto && f->chunk_rows != 0)
    log_info("job %s streams in chunks of %u rows (stream_chunk_rows: auto): its whole blocks "
             "need %.1f MiB a rank, more than a device's pool of %.1f MiB holds for %u of its %u "
             "local ranks; streamed, %.1f MiB a rank",
             j->id, f->chunk_rows, (double)f->whole_bytes / mib, (double)f->pool_bytes / mib,
             f->here, j->local_world_size, (double)(f->slab_bytes + f->host_bytes) / mib);
}

static struct job *job_create(struct conn *c, const struct dep_attach_args *a,
                              const struct lend_fit *f) {
  struct job *j = calloc(1, sizeof *j + sizeof(struct job_rank) * a->local_world_size);
  if (j == NULL)
    return NULL;
  snprintf(j->id, sizeof j->id, "%s", a->job_id);
  j->owner_uid = c->uid;
  j->world_size = a->world_size;
  j->local_world_size = a->local_world_size;
  j->shape = a->shape;
  j->flags = a->flags;
  if ((j->flags & DEP_ATTACH_ELASTIC) && !elastic_new(j)) {
    free(j);
    return NULL;
  }
  j->multinode = lend_spans_nodes(a);
  j->created_ns = uv_hrtime();
  uv_timer_init(job_loop, &j->timer);
  j->timer.data = j;
  uv_timer_init(job_loop, &j->fill_timer);
  j->fill_timer.data = j;
  j->timeout_ms = job_cfg->attach_timeout_ms;
  uv_timer_start(&j->timer, job_on_timeout, j->timeout_ms, 0);
  j->next = job_list;
  job_list = j;
  job_n++;
  log_info("job %s: created by uid %u (world_size %u, %u local ranks)", j->id,
           (unsigned)j->owner_uid, j->world_size, j->local_world_size);
  job_set_chunk(j, f);
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
  } else if (j->flags != a->flags) {
    field = "flags (DEP_ATTACH_ELASTIC, elastic=True)";
    have = j->flags;
    gives = a->flags;
  } else if (!dep__shape_diff(&j->shape, j->world_size, &a->shape, a->world_size, &field, &have,
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
  if (j == NULL) {
    job_refuse_first(c, a, code, msg);
    return;
  }
  if (j->ready || j->dead || j->owner_uid != c->uid || j->attached == 0)
    return;
  char all[DEP_MSG_TEXT_MAX];
  snprintf(all, sizeof all, "job %s cannot start: its rank %u (local %u, pid %d) was refused: "
           "%.300s", j->id, a->rank, a->local_rank, (int)c->pid, msg);
  /* Its ranks on the other nodes wait for it too: they are told (JOB_FAIL),
   * and the refused rank's process has heard it, should it try again. */
  if (!j->multinode) {
    log_warnx("%s", all);
    job_fail(j, code, all);
    return;
  }
  job_fail_everywhere(j, code, all);
  struct job_failed *f = failed_find((uint32_t)c->uid, a->job_id);
  struct proc_id p;
  if (f != NULL && proc_identify(c->pid, &p) == 0)
    failed_tell(f, &p, JOB_TOLD_ANY);
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

/* A new job for the first rank's ATTACH, or NULL after the refusal has been sent: a
 * draining daemon starts none, and the daemon's and the uid's job limits hold. */
static struct job *job_start_for(struct conn *c, uint32_t request_id,
                                 const struct dep_attach_args *a, const struct lend_fit *f) {
  char msg[DEP_MSG_TEXT_MAX];
  if (deepepd.draining) {
    job_refuse(NULL, c, request_id, a, DEP_ERR_STATE,
               "deepepd is draining (deepepctl drain): it starts no new job until "
               "`deepepctl drain --cancel`; running jobs go on");
    return NULL;
  }
  if (job_n >= job_cfg->max_jobs) {
    snprintf(msg, sizeof msg,
             "deepepd already holds %u jobs (limits.max_jobs); wait for one to end or raise "
             "the limit",
             job_n);
    job_refuse(NULL, c, request_id, a, DEP_ERR_LIMIT, msg);
    return NULL;
  }
  uint32_t mine = job_count_of(c->uid);
  if (mine >= job_cfg->max_jobs_per_uid) {
    log_warnx("job %s: uid %u (pid %d) already holds %u jobs (limits.max_jobs_per_uid); "
              "refused", a->job_id, (unsigned)c->uid, (int)c->pid, mine);
    snprintf(msg, sizeof msg,
             "uid %u already holds %u jobs (limits.max_jobs_per_uid %u); wait for one to end, "
             "or ask the administrator to raise the limit",
             (unsigned)c->uid, mine, job_cfg->max_jobs_per_uid);
    job_refuse(NULL, c, request_id, a, DEP_ERR_LIMIT, msg);
    return NULL;
  }
  struct job *j = job_create(c, a, f);
  if (j == NULL) {
    job_refuse(NULL, c, request_id, a, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
    return NULL;
  }
  j->slab_bytes = f->slab_bytes; /* the layout's size; the stride once lent */
  j->host_bytes = f->host_bytes;
  return j;
}

/* Whether a later rank may join job j (else its refusal has been sent): the job is still
 * gathering its ranks, the rank's arguments match the first rank's, and neither its local
 * rank nor its rank is taken. */
static bool job_may_join(struct job *j, struct conn *c, uint32_t request_id,
                         const struct dep_attach_args *a, bool created) {
  char msg[DEP_MSG_TEXT_MAX];
  if (!created) {
    if (j->ready) {
      conn_send_error(c, request_id, DEP_ERR_STATE,
                      "job %s has already started (all %u local ranks attached); a rank cannot "
                      "join a running job: restart the whole job, or use a new job id",
                      j->id, j->local_world_size);
      return false;
    }
    if (job_mismatch(j, a, msg, sizeof msg)) {
      job_refuse(j, c, request_id, a, DEP_ERR_MISMATCH, msg);
      return false;
    }
  }
  const struct job_rank *slot = &j->ranks[a->local_rank];
  if (slot->conn != NULL) {
    snprintf(msg, sizeof msg, "local rank %u of job %s is already attached by pid %d",
             a->local_rank, j->id, (int)slot->pid);
    job_refuse(j, c, request_id, a, DEP_ERR_EXISTS, msg);
    return false;
  }
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    if (j->ranks[i].conn != NULL && j->ranks[i].rank == a->rank) {
      snprintf(msg, sizeof msg, "rank %u of job %s is already attached by pid %d (local rank %u)",
               a->rank, j->id, (int)j->ranks[i].pid, i);
      job_refuse(j, c, request_id, a, DEP_ERR_EXISTS, msg);
      return false;
    }
  }
  return true;
}

/* The rank takes its slot in j; its ATTACH waits there until the job is complete. */
static void job_seat(struct job *j, struct conn *c, uint32_t request_id,
                     const struct dep_attach_args *a) {
  struct job_rank *slot = &j->ranks[a->local_rank];
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
}

/* How many of j's ranks, local rank `but` aside, are seated on device uuid. */
static uint32_t job_seated_on(const struct job *j, const uint8_t *uuid, uint32_t but) {
  uint32_t n = 0;
  for (uint32_t k = 0; k < j->local_world_size; k++)
    n += k != but && j->ranks[k].conn != NULL && memcmp(j->ranks[k].device_uuid, uuid, 16) == 0;
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
  if (job_refuse_late(c, request_id, a))
    return;
  struct job *j = job_find(a->job_id);
  char why[DEP_MSG_TEXT_MAX - DEP_JOB_ID_MAX - 8] = "";
  char msg[DEP_MSG_TEXT_MAX];
  /* The job's chunk is chosen once, for its first rank here: a later one takes it. */
  struct lend_fit fit;
  int rc = lend_check(a, j != NULL ? j->chunk_rows : job_cfg->stream_chunk_rows,
                      j != NULL ? job_seated_on(j, a->device_uuid, a->local_rank) : 0, &fit, why,
                      sizeof why);
  if (rc != 0) {
    snprintf(msg, sizeof msg, "job %s: %s", a->job_id, why);
    job_refuse(j, c, request_id, a, rc, msg);
    return;
  }
  if (j == NULL ? member_taken(a->job_id, c->uid) : j->owner_uid != c->uid) {
    job_refuse_taken(c, request_id, a->job_id, j);
    return;
  }
  const bool created = j == NULL;
  if (!created && j->ready && j->elastic != NULL) {
    job_rejoin(j, c, request_id, a);
    return;
  }
  if (created && (j = job_start_for(c, request_id, a, &fit)) == NULL)
    return;
  if (!job_may_join(j, c, request_id, a, created))
    return;
  job_seat(j, c, request_id, a);
  if (j->multinode)
    job_progress(j);
  else if (j->attached == j->local_world_size)
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
    o->host_bytes = j->host_bytes;
    o->chunk_rows = j->chunk_rows;
    elastic_status(j, o);
  }
  return 0;
}

struct job *job_lookup(const char *id) { return job_find(id); }

void job_fill_nodes(struct dep_msg_job_nodes *m, uid_t viewer_uid) {
  m->n = 0;
  bool all = viewer_uid == 0 || viewer_uid == getuid();
  for (struct job *j = job_list; j != NULL && m->n < DEP_JOB_NODES_MAX; j = j->next) {
    if (!j->multinode || (!all && j->owner_uid != viewer_uid))
      continue;
    struct dep_msg_job_node *o = &m->jobs[m->n++];
    memset(o, 0, sizeof *o);
    snprintf(o->job_id, sizeof o->job_id, "%s", j->id);
    o->world_size = j->world_size;
    o->local_ranks = j->attached;
    o->remote_ranks = job_remote_ranks(j, &o->nodes);
    o->nodes++;
    xfer_job_stats(j, o);
  }
}

void job_fill_events(struct dep_msg_job_events *m, uid_t viewer_uid) {
  m->n = 0;
  m->left_out = 0;
  bool all = viewer_uid == 0 || viewer_uid == getuid();
  for (struct job *j = job_list; j != NULL; j = j->next)
    if (all || j->owner_uid == viewer_uid)
      elastic_events(j, m);
}

void job_fini(void) {
  while (job_list != NULL)
    job_destroy(job_list, "the daemon is stopping");
  lend_fini();
  job_members_fini();
}
