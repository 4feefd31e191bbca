/*
 * job_elastic.c — elastic jobs (DESIGN §14): a job whose ranks attached
 * with DEP_ATTACH_ELASTIC is not ended by a rank that dies or detaches.
 * The daemons mask the rank instead: its bit in the live mask (slab.h) of
 * every local rank's slab, then a new epoch, and the job, the gone rank's
 * slab and its exchange region stay.  The job table is job.c's; what the
 * files share is job_internal.h.
 *
 * How the daemons agree.  Each rank's changes are counted: gen[r] starts
 * at 0 and goes up by one each time rank r leaves (gen odd: masked) or
 * comes back (even: live).  Only the daemon holding a rank makes its
 * changes, and it tells every other daemon of the job (JOB_MASK: rank,
 * gen, why); a daemon takes a JOB_MASK whose gen is above the one it holds
 * for that rank and ignores the rest.  A lost node's ranks (its peer link
 * dropped, or its part of the job ended) are masked by every daemon left,
 * each taking the next odd count on its own: they all reach the same one.
 * The mask is then a function of the counts (bit r = gen[r] odd) and so is
 * the epoch, the sum of the counts over the world: every daemon that has
 * seen the same changes writes the same mask and the same epoch, in
 * whatever order the messages came, and the epoch of a later mask is
 * always larger.
 */
#include "job.h"
#include "job_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "peer.h"
#include "pool.h"
#include "proto.h"
#include "slab.h"
#include "testhooks.h"

/* One change of the job's mask, as JOB_EVENTS_OK reports it. */
struct elastic_event {
  uint64_t at_ns;  /* uv_hrtime() */
  uint32_t rank, why, pid;
  uint64_t epoch;
};

struct job_elastic {
  struct dep_slab_layout l; /* where the mask and the slots are: the same in every local slab */
  uint64_t epoch;     /* the sum of gen[] */
  uint32_t masked;    /* ranks whose gen is odd */
  uint32_t n_events;  /* recorded so far; the newest DEP_JOB_EVENTS_KEPT are kept */
  struct elastic_event events[DEP_JOB_EVENTS_KEPT];
  uint64_t *join;     /* per world rank: its join word (slab.h), in the same allocation */
  uint32_t *gen;      /* per world rank: its changes (above), likewise */
};

bool elastic_new(struct job *j) {
  struct dep_slab_layout l;
  char why[256];
  /* The shape was checked before the job was made (lend_check). */
  if (dep__slab_layout_nodes(&j->shape, j->world_size, j->local_world_size, j->chunk_rows, &l,
                             why, sizeof why) != 0)
    return false;
  struct job_elastic *e =
      calloc(1, sizeof *e + (sizeof(uint64_t) + sizeof(uint32_t)) * j->world_size);
  if (e == NULL)
    return false;
  e->l = l;
  e->join = (uint64_t *)(e + 1);
  e->gen = (uint32_t *)(e->join + j->world_size);
  j->elastic = e;
  return true;
}

void elastic_free(struct job *j) {
  free(j->elastic);
  j->elastic = NULL;
}

bool elastic_masked(const struct job *j, uint32_t rank) {
  return j->elastic != NULL && rank < j->world_size && j->elastic->gen[rank] % 2 == 1;
}

/*
 * Write the mask into the slab of every local rank of j, the gone ones'
 * included (a rank that comes back finds it there): the join words and the
 * bits first, then the epoch, each write ending in a release fence
 * (pool.h), so that a rank that reads the epoch with acquire and then the
 * rest sees this mask or a later one.
 */
static void elastic_write(struct job *j) {
  const struct job_elastic *e = j->elastic;
  uint64_t words[DEP_SLAB_MASK_WORDS(DEP_MAX_WORLD)];
  const uint64_t n = DEP_SLAB_MASK_WORDS(j->world_size);
  memset(words, 0, sizeof words);
  for (uint32_t r = 0; r < j->world_size; r++)
    if (e->gen[r] % 2 == 1)
      words[r / 64u] |= DEP_SLAB_MASK_BIT(r);
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    const struct job_rank *q = &j->ranks[i];
    if (q->arena == NULL)
      continue;
    char why[256] = "";
    const uint64_t at = q->offset + e->l.mask_off;
    int rc = pool_block_write(q->arena, q->offset + dep_slab_mask_join(&e->l, 0), e->join,
                              sizeof(uint64_t) * j->world_size, why, sizeof why);
    if (rc == 0)
      rc = pool_block_write(q->arena, at + sizeof(uint64_t), words, n * sizeof(uint64_t), why,
                            sizeof why);
    if (rc == 0)
      rc = pool_block_write(q->arena, at, &e->epoch, sizeof e->epoch, why, sizeof why);
    if (rc != 0)
      log_warnx("job %s: cannot write the live mask (epoch %llu) into rank %u's slab: %s", j->id,
                (unsigned long long)e->epoch, q->rank, why);
  }
}

/* Take count gen for rank (above the one held); false when it is not news. */
static bool elastic_take(struct job *j, uint32_t rank, uint32_t gen, uint32_t why, uint32_t pid) {
  struct job_elastic *e = j->elastic;
  if (rank >= j->world_size || gen <= e->gen[rank])
    return false;
  const bool was = e->gen[rank] % 2 == 1, is = gen % 2 == 1;
  e->epoch += gen - e->gen[rank];
  e->gen[rank] = gen;
  e->masked += (uint32_t)is - (uint32_t)was;
  e->events[e->n_events % DEP_JOB_EVENTS_KEPT] =
      (struct elastic_event){uv_hrtime(), rank, why, pid, e->epoch};
  e->n_events++;
  return true;
}

/* The next count of rank that masks it (it is live), or 0 when it is masked already. */
static uint32_t elastic_next_gone(const struct job *j, uint32_t rank) {
  const uint32_t g = j->elastic->gen[rank];
  return g % 2 == 1 ? 0 : g + 1;
}

void elastic_leave(struct job *j, const struct job_rank *r, uint32_t how) {
  const uint32_t gen = elastic_next_gone(j, r->rank);
  if (gen == 0 || !elastic_take(j, r->rank, gen, how, (uint32_t)r->pid))
    return;
  elastic_write(j);
  log_notice("job %s: rank %u (pid %d) %s; it is masked (epoch %llu, %u of %u ranks masked) and "
             "the job goes on; its memory is kept for a process that attaches as rank %u",
             j->id, r->rank, (int)r->pid, proto_job_event_name(how),
             (unsigned long long)j->elastic->epoch, j->elastic->masked, j->world_size, r->rank);
  if (!j->multinode)
    return;
  struct dep_peer_msg m = {.type = DEP_PEER_JOB_MASK};
  snprintf(m.u.mask.job_id, sizeof m.u.mask.job_id, "%s", j->id);
  m.u.mask.owner_uid = (uint32_t)j->owner_uid;
  m.u.mask.rank = r->rank;
  m.u.mask.gen = gen;
  m.u.mask.why = how;
  m.u.mask.epoch = j->elastic->epoch;
  job_send_peers(&m);
}

void elastic_node_lost(struct job *j, const struct dep_peer_membership *x) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < x->n_ranks; i++) {
    const uint32_t rank = x->ranks[i];
    if (rank < j->world_size) {
      const uint32_t gen = elastic_next_gone(j, rank);
      n += gen != 0 && elastic_take(j, rank, gen, DEP_SLAB_GONE_NODE, 0);
    }
  }
  if (n == 0)
    return;
  elastic_write(j);
  log_notice("job %s: the %u rank(s) of a node that is gone are masked (epoch %llu, %u of %u "
             "ranks masked); the job goes on", j->id, n, (unsigned long long)j->elastic->epoch,
             j->elastic->masked, j->world_size);
}

void elastic_on_mask(struct job *j, int k, const struct dep_peer_membership *x,
                     const struct dep_peer_job_mask *m) {
  /* Only the node holding a rank changes it: a JOB_MASK about a rank its
   * sender does not hold is refused (logged), whatever its count. */
  bool holds = false;
  for (uint32_t i = 0; x != NULL && i < x->n_ranks; i++)
    holds |= x->ranks[i] == m->rank;
  if (!holds || m->rank >= j->world_size) {
    log_warnx("job %s: node %s sent a mask change of rank %u, which it does not hold; ignored",
              j->id, peer_name(k), m->rank);
    return;
  }
  if (!elastic_take(j, m->rank, m->gen, m->why, 0))
    return;
  elastic_write(j);
  log_notice("job %s: node %s says rank %u %s; epoch %llu here (%llu there), %u of %u ranks "
             "masked", j->id, peer_name(k), m->rank, proto_job_event_name(m->why),
             (unsigned long long)j->elastic->epoch, (unsigned long long)m->epoch,
             j->elastic->masked, j->world_size);
}

void elastic_status(const struct job *j, struct dep_status_job *o) {
  o->flags = j->flags;
  if (j->elastic == NULL)
    return;
  o->masked = j->elastic->masked;
  o->epoch = j->elastic->epoch;
  static uint8_t set[DEP_MAX_WORLD];
  for (uint32_t r = 0; r < j->world_size; r++)
    set[r] = j->elastic->gen[r] % 2 == 1;
  ranks_fmt(set, j->world_size, o->mask, sizeof o->mask);
}

void elastic_events(const struct job *j, struct dep_msg_job_events *m) {
  const struct job_elastic *e = j->elastic;
  if (e == NULL)
    return;
  const uint32_t kept = e->n_events < DEP_JOB_EVENTS_KEPT ? e->n_events : DEP_JOB_EVENTS_KEPT;
  for (uint32_t i = e->n_events - kept; i < e->n_events; i++) {
    if (m->n == DEP_JOB_EVENTS_MAX) {
      m->left_out++;
      continue;
    }
    const struct elastic_event *v = &e->events[i % DEP_JOB_EVENTS_KEPT];
    struct dep_msg_job_event *o = &m->ev[m->n++];
    memset(o, 0, sizeof *o);
    snprintf(o->job_id, sizeof o->job_id, "%s", j->id);
    o->age_ms = v->at_ns > j->created_ns ? (v->at_ns - j->created_ns) / 1000000u : 0;
    o->rank = v->rank;
    o->why = v->why;
    o->pid = v->pid;
    o->epoch = v->epoch;
  }
}

/* Zero bytes [off, off + len) of local rank q's slab, a piece at a time. */
static int elastic_zero(const struct job_rank *q, uint64_t off, uint64_t len, char *why,
                        size_t whylen) {
  static const uint8_t zero[64 * 1024];
  while (len > 0) {
    const size_t n = len < sizeof zero ? (size_t)len : sizeof zero;
    int rc = pool_block_write(q->arena, q->offset + off, zero, n, why, whylen);
    if (rc != 0)
      return rc;
    off += n;
    len -= n;
  }
  return 0;
}

int elastic_scrub(struct job *j, const struct job_rank *slot, char *why, size_t whylen) {
  const struct dep_slab_layout l = j->elastic->l;
  const uint64_t mask_end = l.mask_off + DEP_SLAB_MASK_AREA_BYTES(j->world_size);
  int rc;
  /* Its own slab: the error and abort words and every slot (what its peers
   * posted before it left), the rest of the control area after the mask,
   * and its private area (the library's counters and scratch, as a new
   * job's slab has them).  The mask stays: it is the job's now.  Its data
   * blocks keep the job's own bytes, which a receiver reads only after a
   * slot of a later call says they are in. */
  rc = elastic_zero(slot, 0, l.mask_off, why, whylen);
  if (rc == 0)
    rc = elastic_zero(slot, mask_end, l.data_off - mask_end, why, whylen);
  if (rc == 0)
    rc = elastic_zero(slot, l.priv_off, l.priv_bytes, why, whylen);
  /* In every other local slab, the slots this rank posted to before it left. */
  for (uint32_t i = 0; rc == 0 && i < j->local_world_size; i++) {
    const struct job_rank *q = &j->ranks[i];
    if (q == slot || q->arena == NULL)
      continue;
    for (unsigned parity = 0; rc == 0 && parity < 2; parity++)
      rc = elastic_zero(q, dep_slab_ctrl_slot(&l, parity, slot->rank), DEP_SLAB_CTRL_SLOT, why,
                        whylen);
  }
  return rc;
}

/*
 * The largest call any local rank of j but `slot` has posted (the flags of
 * the slots in their slabs: a rank posts to every rank, itself included, at
 * every call: kernels/host_ops.h), into *seq.  0, or DEP_ERR_* with why.
 */
static int elastic_posted(struct job *j, const struct job_rank *slot, uint64_t *seq, char *why,
                          size_t whylen) {
  const struct dep_slab_layout *l = &j->elastic->l;
  const uint64_t first = dep_slab_ctrl_slot(l, 0, 0), bytes = l->mask_off - first;
  uint64_t *slots = malloc(bytes);
  if (slots == NULL) {
    snprintf(why, whylen, "out of memory for %llu bytes of slots", (unsigned long long)bytes);
    return DEP_ERR_NO_MEMORY;
  }
  *seq = 0;
  int rc = 0;
  for (uint32_t i = 0; rc == 0 && i < j->local_world_size; i++) {
    const struct job_rank *q = &j->ranks[i];
    if (q == slot || q->conn == NULL || q->arena == NULL)
      continue;
    rc = pool_block_read(q->arena, q->offset + first, slots, bytes, why, whylen);
    /* The flag is each slot's first word (kabi.h struct ops_slot). */
    for (uint64_t k = 0; rc == 0 && k < bytes / DEP_SLAB_CTRL_SLOT; k++) {
      const uint64_t flag = slots[k * (DEP_SLAB_CTRL_SLOT / sizeof(uint64_t))];
      *seq = flag > *seq ? flag : *seq;
    }
  }
  free(slots);
  return rc;
}

/* Calls ahead of the survivors' newest that a rank that comes back joins at:
 * room for the calls they make while the daemon writes the epoch. */
#define ELASTIC_JOIN_AHEAD 8u

int elastic_join(struct job *j, const struct job_rank *slot, pid_t pid, char *why,
                 size_t whylen) {
  struct job_elastic *e = j->elastic;
  const uint32_t rank = slot->rank;
  uint64_t before = 0, after = 0;
  int rc = elastic_posted(j, slot, &before, why, whylen);
  if (rc != 0)
    return rc;
  const uint64_t at = before + ELASTIC_JOIN_AHEAD;
  e->join[rank] = at;
  (void)elastic_take(j, rank, e->gen[rank] + 1, DEP_JOB_EVENT_REJOINED, (uint32_t)pid);
  elastic_write(j);
  /* A survivor starts call `at` only once every rank has posted at - 1 to
   * it; none has, after the epoch went out, so each will see it first. */
  rc = elastic_posted(j, slot, &after, why, whylen);
  static int overtaken; /* rejoins the test hook has made overtaken so far */
  if (rc == 0 && overtaken < testhook_value(TESTHOOK_JOIN_OVERTAKEN)) {
    overtaken++;
    after = at;
  }
  if (rc == 0 && after + 1 < at) {
    log_notice("job %s: pid %d is rank %u again, from call %llu (the survivors had posted call "
               "%llu; epoch %llu, %u of %u ranks masked)", j->id, (int)pid, rank,
               (unsigned long long)at, (unsigned long long)before,
               (unsigned long long)e->epoch, e->masked, j->world_size);
    return 0;
  }
  /* The survivors ran past it (or could not be read): masked again, as it was. */
  (void)elastic_take(j, rank, e->gen[rank] + 1, DEP_SLAB_GONE_DETACHED, (uint32_t)pid);
  elastic_write(j);
  if (rc == 0) {
    snprintf(why, whylen, "the job's calls reached call %llu while rank %u was brought back "
             "from call %llu; attach again", (unsigned long long)after, rank,
             (unsigned long long)at);
    rc = DEP_ERR_STATE;
  }
  return rc;
}
