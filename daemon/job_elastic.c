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
 *
 * A rank that comes back (elastic_join) is made live from a join call
 * above every call its node's ranks have posted.  A daemon reads only its
 * own slabs, so in a job across nodes each daemon checks its own ranks:
 * the holder tells the others the even count with the join call (JOB_MASK,
 * gen even, join) and writes it into its own slabs, and each of them
 * writes it into its slabs meanwhile and answers (JOB_JOINED) whether its
 * ranks had all stayed short of the join call's predecessor once it was
 * there.  The holder answers the process's ATTACH only when every daemon
 * of the job said so (a node lost meanwhile needs no answer: its ranks are
 * masked), and otherwise, or after limits.attach_timeout_ms, masks the
 * rank again everywhere with the next (odd) count and refuses the ATTACH:
 * the process may try again.
 *
 * A split (DESIGN §14).  A daemon cannot tell a dead node from one it is
 * cut off from, so while a link is down both sides mask the other's ranks
 * and go on: the job runs in two parts.  When the link comes back, each
 * daemon sends the other, for each elastic job it runs across nodes, its
 * view (JOB_HELD: the ranks live in its mask, and which of them it holds)
 * and keeps what it sent; both then hold the same two views and decide
 * alike, whatever came first.  The views show a split when a rank one side
 * holds live is masked in the other's.  The part with more live ranks goes
 * on; on a tie, the part whose view holds the lowest rank that the two
 * views disagree on (between two nodes: the part with the job's lowest
 * live rank).  The other daemon ends its part (elastic_cut): its ranks'
 * calls fail with DEP_ERR_PEER, its peers hear JOB_END, and it takes no
 * further change of the job.  With more nodes the same rule runs on each
 * link that comes back, between the two views it carries; a third node that
 * saw both parts masks the ended one's ranks on its JOB_END.  Nothing is
 * waited for: each side decides on the other's JOB_HELD, and a link that
 * drops again before it comes leaves both parts going on, as before, until
 * the next time it comes up.
 */
#include "job.h"
#include "job_internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lend.h"
#include "log.h"
#include "peer.h"
#include "pool.h"
#include "proto.h"
#include "slab.h"
#include "testhooks.h"
#include "xfer.h"
#include "xring.h"

/* One change of the job's mask, as JOB_EVENTS_OK reports it. */
struct elastic_event {
  uint64_t at_ns;  /* uv_hrtime() */
  uint32_t rank, why, pid;
  uint64_t epoch;
};

/* A rejoin across nodes that waits for the other daemons' answers (one per job at a time). */
struct elastic_pending {
  bool on;
  uint32_t local_rank, rank, gen; /* the slot taken, its rank and the (even) count proposed */
  uint64_t at, before;            /* the join call; the holder's ranks' newest posted call */
  uint64_t need;                  /* bit k: peer k has not answered */
  int pid;
  char took[96];                  /* this node's phases (elastic_took), for the log */
  uint64_t done_ns;               /* uv_hrtime() when this node's own phases were done */
};

/* Calls ahead of the survivors' newest that a rank that comes back joins at:
 * room for the calls they make while the daemons write the epoch.  A job
 * whose ranks ran past it doubles it for the next attempt, up to the most:
 * the survivors' calls per epoch write are the job's (a GPU's low-latency
 * calls take microseconds, a training step's milliseconds). */
#define ELASTIC_JOIN_AHEAD 8u
#define ELASTIC_JOIN_AHEAD_MAX 65536u

struct job_elastic {
  struct dep_slab_layout l; /* where the mask and the slots are: the same in every local slab */
  struct elastic_pending pending;
  uint64_t epoch;     /* the sum of gen[] */
  uint32_t masked;    /* ranks whose gen is odd */
  uint32_t n_events;  /* recorded so far; the newest DEP_JOB_EVENTS_KEPT are kept */
  struct elastic_event events[DEP_JOB_EVENTS_KEPT];
  uint64_t *join;     /* per world rank: its join word (slab.h), in the same allocation */
  uint32_t *gen;      /* per world rank: its changes (above), likewise */
  uint32_t ahead;     /* calls past the survivors' newest that a rank comes back at (below) */
  bool cut;           /* this node's part lost a split and ended (elastic_cut) */
  uint64_t told;      /* bit k: peer k has our JOB_HELD since its link came up */
  uint64_t settled;   /* bit k: the views of that link's return were compared */
  uint8_t *sent;      /* per peer: the live set our JOB_HELD said (DEP_PEER_RANK_BYTES), or NULL */
  uint64_t scrub_ns;  /* the last elastic_scrub's time, for its rejoin's log line */
};

/* Milliseconds since t0 (uv_hrtime()), for the log lines that say where a change's time went:
 * on cuda each batch of slab words waits for a GPU time slice (pool.h pool_batch). */
static double ms_since(uint64_t t0) { return (double)(uv_hrtime() - t0) / 1e6; }

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
  e->ahead = ELASTIC_JOIN_AHEAD;
  e->join = (uint64_t *)(e + 1);
  e->gen = (uint32_t *)(e->join + j->world_size);
  j->elastic = e;
  return true;
}

void elastic_free(struct job *j) {
  if (j->elastic != NULL)
    free(j->elastic->sent);
  free(j->elastic);
  j->elastic = NULL;
}

bool elastic_masked(const struct job *j, uint32_t rank) {
  return j->elastic != NULL && rank < j->world_size && j->elastic->gen[rank] % 2 == 1;
}

/* The words of j's mask as elastic_mask_io writes them; they outlive its batch. */
struct elastic_words {
  uint64_t bits[DEP_SLAB_MASK_WORDS(DEP_MAX_WORLD)];
  uint64_t epoch;
};

/*
 * The copies that write the mask into the slab of every local rank of j,
 * the gone ones' included (a rank that comes back finds it there), into io
 * (room for 3 a local rank), from w: in each slab the join words and the
 * bits first, then the epoch, and a batch's copies land in order (pool.h
 * pool_batch), so that a rank that reads the epoch with acquire and then
 * the rest sees this mask or a later one.  Returns how many.
 */
static size_t elastic_mask_io(const struct job *j, struct elastic_words *w, struct pool_io *io) {
  const struct job_elastic *e = j->elastic;
  const uint64_t n = DEP_SLAB_MASK_WORDS(j->world_size);
  memset(w, 0, sizeof *w);
  w->epoch = e->epoch;
  /* A part that ended (elastic_cut) masks nothing: its ranks' calls wait for
   * the other part's ranks, which never answer, and fail on the abort words. */
  for (uint32_t r = 0; !e->cut && r < j->world_size; r++)
    if (e->gen[r] % 2 == 1)
      w->bits[r / 64u] |= DEP_SLAB_MASK_BIT(r);
  size_t k = 0;
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    const struct job_rank *q = &j->ranks[i];
    if (q->arena == NULL)
      continue;
    const uint64_t at = q->offset + e->l.mask_off;
    io[k++] = (struct pool_io){q->arena, q->offset + dep_slab_mask_join(&e->l, 0), e->join,
                               sizeof(uint64_t) * j->world_size, false};
    io[k++] = (struct pool_io){q->arena, at + sizeof(uint64_t), w->bits, n * sizeof(uint64_t),
                               false};
    io[k++] = (struct pool_io){q->arena, at, &w->epoch, sizeof w->epoch, false};
  }
  return k;
}

/* Write j's mask into its local slabs (elastic_mask_io), in one batch; returns the
 * milliseconds it took. */
static double elastic_write(struct job *j) {
  const uint64_t t0 = uv_hrtime();
  struct elastic_words w;
  struct pool_io io[3 * DEP_MAX_LOCAL_RANKS];
  const size_t k = elastic_mask_io(j, &w, io);
  char why[256] = "";
  if (k > 0 && pool_batch(io, k, why, sizeof why) != 0)
    log_warnx("job %s: cannot write the live mask (epoch %llu) into the slabs of its %u local "
              "ranks: %s", j->id, (unsigned long long)w.epoch, j->local_world_size, why);
  return ms_since(t0);
}

/* Take count gen for rank (above the one held); false when it is not news. */
static bool elastic_take(struct job *j, uint32_t rank, uint32_t gen, uint32_t why, uint32_t pid) {
  struct job_elastic *e = j->elastic;
  if (e->cut || rank >= j->world_size || gen <= e->gen[rank])
    return false; /* an ended part takes no change: its mask is gone */
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

/* Tell every peer of j that rank changed to count gen (JOB_MASK; join: an even count's). */
static void elastic_tell(const struct job *j, uint32_t rank, uint32_t gen, uint32_t why,
                         uint64_t join) {
  if (!j->multinode)
    return;
  struct dep_peer_msg m = {.type = DEP_PEER_JOB_MASK};
  snprintf(m.u.mask.job_id, sizeof m.u.mask.job_id, "%s", j->id);
  m.u.mask.owner_uid = (uint32_t)j->owner_uid;
  m.u.mask.rank = rank;
  m.u.mask.gen = gen;
  m.u.mask.why = why;
  m.u.mask.epoch = j->elastic->epoch;
  m.u.mask.join = join;
  job_send_peers(&m);
}

void elastic_leave(struct job *j, const struct job_rank *r, uint32_t how) {
  struct job_elastic *e = j->elastic;
  if (e->pending.on && e->pending.rank == r->rank) {
    /* The process that was taking the rank's place is gone before its daemons agreed:
     * masking it again (below, everywhere) ends that rejoin; late answers are stale. */
    e->pending.on = false;
    uv_timer_stop(&j->timer);
  }
  const uint32_t gen = elastic_next_gone(j, r->rank);
  if (gen == 0 || !elastic_take(j, r->rank, gen, how, (uint32_t)r->pid))
    return;
  const double wrote = elastic_write(j);
  elastic_tell(j, r->rank, gen, how, 0);
  log_notice("job %s: rank %u (pid %d) %s; it is masked (epoch %llu, %u of %u ranks masked; "
             "write %.2f ms) and the job goes on; its memory is kept for a process that attaches "
             "as rank %u", j->id, r->rank, (int)r->pid, proto_job_event_name(how),
             (unsigned long long)e->epoch, e->masked, j->world_size, wrote, r->rank);
}

static void elastic_join_end(struct job *j, int code, const char *why);

void elastic_node_lost(struct job *j, int k, const struct dep_peer_membership *x) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < x->n_ranks; i++) {
    const uint32_t rank = x->ranks[i];
    if (rank < j->world_size) {
      const uint32_t gen = elastic_next_gone(j, rank);
      n += gen != 0 && elastic_take(j, rank, gen, DEP_SLAB_GONE_NODE, 0);
    }
  }
  if (n > 0) {
    const double wrote = elastic_write(j);
    log_notice("job %s: the %u rank(s) of a node that is gone are masked (epoch %llu, %u of %u "
               "ranks masked; write %.2f ms); the job goes on", j->id, n,
               (unsigned long long)j->elastic->epoch, j->elastic->masked, j->world_size, wrote);
  }
  /* A rejoin waiting for that node's answer needs none now: its ranks are masked, so
   * none of them can run past the join call. */
  struct elastic_pending *p = &j->elastic->pending;
  if (p->on && (p->need & job_peer_bit(k)) != 0) {
    p->need &= ~job_peer_bit(k);
    if (p->need == 0)
      elastic_join_end(j, 0, NULL);
  }
}

static int elastic_posted(struct job *j, const struct job_rank *slot, bool write, uint64_t *seq,
                          char *why, size_t whylen);
static bool elastic_overtaken(uint64_t after, uint64_t at);

/* Write the mask that brings m's rank back into this node's slabs and answer peer k's
 * JOB_MASK m: whether every local rank is still short of call m->join - 1 once it is there
 * (JOB_JOINED).  Returns the milliseconds the write and read took (one batch). */
static double elastic_answer(struct job *j, int k, const struct dep_peer_job_mask *m) {
  struct dep_peer_msg a = {.type = DEP_PEER_JOB_JOINED};
  snprintf(a.u.joined.job_id, sizeof a.u.joined.job_id, "%s", j->id);
  a.u.joined.owner_uid = (uint32_t)j->owner_uid;
  a.u.joined.rank = m->rank;
  a.u.joined.gen = m->gen;
  char why[256] = "";
  uint64_t after = 0;
  const uint64_t t0 = uv_hrtime();
  const int rc = elastic_posted(j, NULL, true, &after, why, sizeof why);
  const double read = ms_since(t0);
  if (rc != 0)
    log_warnx("job %s: cannot write the live mask (epoch %llu) and read this node's slots to "
              "answer node %s's rejoin of rank %u: %s", j->id,
              (unsigned long long)j->elastic->epoch, peer_name(k), m->rank, why);
  a.u.joined.ok = rc == 0 && !elastic_overtaken(after, m->join);
  a.u.joined.posted = after;
  if (!a.u.joined.ok && rc == 0)
    log_notice("job %s: this node's ranks had posted call %llu when node %s brought rank %u back "
               "from call %llu: too late, it is masked again", j->id, (unsigned long long)after,
               peer_name(k), m->rank, (unsigned long long)m->join);
  (void)peer_send(k, &a);
  return read;
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
  struct job_elastic *e = j->elastic;
  const bool back = m->gen % 2 == 0;
  /* A return's join call goes into the slabs with it (elastic_write), when it is news. */
  if (back && m->gen > e->gen[m->rank])
    e->join[m->rank] = m->join;
  if (!elastic_take(j, m->rank, m->gen, m->why, 0))
    return;
  /* Answered before the line is logged: the holder's process waits for it. */
  const double took = back ? elastic_answer(j, k, m) : elastic_write(j);
  log_notice("job %s: node %s says rank %u %s%s; epoch %llu here (%llu there), %u of %u ranks "
             "masked (write%s %.2f ms)", j->id, peer_name(k), m->rank,
             proto_job_event_name(m->why), back ? " (from its join call on)" : "",
             (unsigned long long)e->epoch, (unsigned long long)m->epoch, e->masked,
             j->world_size, back ? " and read" : "", took);
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

/*
 * A job across nodes: the ring and exchange region of the rank that left
 * (xring.h, slab.h), which the route between nodes kept for it (masking
 * drops none of its routes, here or on the other nodes).  The ring stays
 * as it is, head and tail included (the proxy reads them: the new process
 * pushes from the head on), but only once the proxy has taken every
 * descriptor the gone process pushed: one taken later would send its old
 * call's slot over the new process's.  Its exchange region's slots, marks
 * and credits go back to zero, as a new job's are (lend.c), so that the
 * join call starts from nothing: the other nodes' ranks sent it nothing
 * while it was masked, and their own words about it (their in slot and
 * marks from it, their credit from it) name calls before the join call,
 * which no reader takes for a later call's (slab.h: DEP_SLAB_CHAN_AT).
 * Its ring may be lent again (XRING_LEND).
 */
static int elastic_scrub_xchg(struct job *j, const struct job_rank *slot, char *why,
                              size_t whylen) {
  const struct dep_slab_layout *l = &j->elastic->l;
  struct lend_xchg *x = &j->xchg[slot - j->ranks];
  if (x->region == NULL) {
    snprintf(why, whylen, "rank %u has no exchange region to other nodes", slot->rank);
    return DEP_ERR_STATE;
  }
  struct dep_xring *ring = x->region->map;
  const int32_t failed = atomic_load_explicit(&ring->failed, memory_order_acquire);
  if (failed != 0) {
    snprintf(why, whylen, "the proxy stopped moving rank %u's blocks to other nodes (%s): the "
             "job cannot go on between nodes; start it again", slot->rank,
             dep_strerror(failed));
    return DEP_ERR_STATE;
  }
  const uint64_t head = atomic_load_explicit(&ring->head, memory_order_acquire);
  const uint64_t tail = atomic_load_explicit(&ring->tail, memory_order_acquire);
  if (head != tail) {
    snprintf(why, whylen, "the proxy is still moving %llu of the last blocks rank %u's process "
             "pushed to other nodes; attach again", (unsigned long long)(head - tail),
             slot->rank);
    return DEP_ERR_STATE;
  }
  memset(dep_xring_xchg(ring) + l->in_slot_off, 0, l->in_off - l->in_slot_off);
  x->lent = false;
  return 0;
}

int elastic_scrub(struct job *j, const struct job_rank *slot, char *why, size_t whylen) {
  if (j->elastic->cut) {
    snprintf(why, whylen, "this node's part of the job ended when a split of it was settled "
             "for the other part (deepepctl status: partitioned); it cannot be joined: start "
             "the job again");
    return DEP_ERR_PEER;
  }
  const struct dep_slab_layout l = j->elastic->l;
  const uint64_t mask_end = l.mask_off + DEP_SLAB_MASK_AREA_BYTES(j->world_size);
  const uint64_t t0 = uv_hrtime();
  /* Its own slab: the error and abort words and every slot (what its peers
   * posted before it left), the rest of the control area after the mask,
   * and its private area (the library's counters and scratch, as a new
   * job's slab has them).  The mask stays: it is the job's now.  Its data
   * blocks keep the job's own bytes, which a receiver reads only after a
   * slot of a later call says they are in.  In every other local slab, the
   * slots this rank posted to before it left.  All zeros, in one batch. */
  struct pool_io io[3 + 2 * DEP_MAX_LOCAL_RANKS];
  size_t k = 0;
  io[k++] = (struct pool_io){slot->arena, slot->offset, NULL, l.mask_off, false};
  io[k++] = (struct pool_io){slot->arena, slot->offset + mask_end, NULL, l.data_off - mask_end,
                             false};
  io[k++] = (struct pool_io){slot->arena, slot->offset + l.priv_off, NULL, l.priv_bytes, false};
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    const struct job_rank *q = &j->ranks[i];
    if (q == slot || q->arena == NULL)
      continue;
    for (unsigned parity = 0; parity < 2; parity++)
      io[k++] = (struct pool_io){q->arena, q->offset + dep_slab_ctrl_slot(&l, parity, slot->rank),
                                 NULL, DEP_SLAB_CTRL_SLOT, false};
  }
  int rc = pool_batch(io, k, why, whylen);
  j->elastic->scrub_ns = uv_hrtime() - t0;
  if (rc == 0 && j->xchg != NULL)
    rc = elastic_scrub_xchg(j, slot, why, whylen);
  return rc;
}

/*
 * The largest call any local rank of j but `slot` has posted (the flags of
 * the slots in their slabs: a rank posts to every rank, itself included, at
 * every call: kernels/host_ops.h), into *seq; with write, read once j's
 * mask is written (elastic_mask_io), in the same batch: one wait for the
 * GPU on cuda, and the read lands after the epoch.  0, or DEP_ERR_* with
 * why (the mask may not have been written).
 */
static int elastic_posted(struct job *j, const struct job_rank *slot, bool write, uint64_t *seq,
                          char *why, size_t whylen) {
  const struct dep_slab_layout *l = &j->elastic->l;
  const uint64_t first = dep_slab_ctrl_slot(l, 0, 0), bytes = l->mask_off - first;
  uint8_t *slots = malloc(bytes * j->local_world_size);
  if (slots == NULL) {
    snprintf(why, whylen, "out of memory for %llu bytes of slots",
             (unsigned long long)(bytes * j->local_world_size));
    return DEP_ERR_NO_MEMORY;
  }
  struct elastic_words w;
  struct pool_io io[4 * DEP_MAX_LOCAL_RANKS];
  const size_t k = write ? elastic_mask_io(j, &w, io) : 0;
  size_t n = 0;
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    const struct job_rank *q = &j->ranks[i];
    if (q == slot || q->conn == NULL || q->arena == NULL)
      continue;
    io[k + n] = (struct pool_io){q->arena, q->offset + first, slots + n * bytes, bytes, true};
    n++;
  }
  *seq = 0;
  int rc = k + n > 0 ? pool_batch(io, k + n, why, whylen) : 0;
  /* The flag is each slot's first word (kabi.h struct ops_slot). */
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const uint8_t *at = slots + i * bytes;
    for (uint64_t s = 0; s < bytes / DEP_SLAB_CTRL_SLOT; s++) {
      uint64_t flag;
      memcpy(&flag, at + s * DEP_SLAB_CTRL_SLOT, sizeof flag);
      *seq = flag > *seq ? flag : *seq;
    }
  }
  free(slots);
  return rc;
}

/* A rejoin was overtaken: the next attempt leaves the survivors twice the calls. */
static void elastic_widen(struct job_elastic *e) {
  e->ahead = e->ahead * 2 > ELASTIC_JOIN_AHEAD_MAX ? ELASTIC_JOIN_AHEAD_MAX : e->ahead * 2;
}

/* Whether the ranks that had posted call `after` (read once the join call was in their
 * slabs) may have started call `at` before they saw it: they ran past the join call. */
static bool elastic_overtaken(uint64_t after, uint64_t at) {
  static int made; /* answers the test hook has made overtaken so far */
  if (made < testhook_value(TESTHOOK_JOIN_OVERTAKEN)) {
    made++;
    return true;
  }
  return after + 1 >= at;
}

/* Rank `rank` masked again, as it was (its join call went out too late), everywhere. */
static void elastic_undo(struct job *j, uint32_t rank, int pid) {
  const uint32_t gen = j->elastic->gen[rank] + 1;
  (void)elastic_take(j, rank, gen, DEP_SLAB_GONE_DETACHED, (uint32_t)pid);
  elastic_write(j);
  elastic_tell(j, rank, gen, DEP_SLAB_GONE_DETACHED, 0);
}

/* took: where this node's time went (elastic_join), and the wait for the peers' answers. */
static void elastic_log_back(const struct job *j, int pid, uint32_t rank, uint64_t at,
                             uint64_t before, const char *took) {
  log_notice("job %s: pid %d is rank %u again, from call %llu (the survivors had posted call "
             "%llu; epoch %llu, %u of %u ranks masked; %s)", j->id, pid, rank,
             (unsigned long long)at, (unsigned long long)before,
             (unsigned long long)j->elastic->epoch, j->elastic->masked, j->world_size, took);
}

/* A rejoin's phases on this node, in milliseconds, for its log line or refusal. */
static void elastic_took(char *out, size_t len, uint64_t scrub_ns, double before, double after) {
  snprintf(out, len, "scrub %.2f ms, read %.2f ms, write and read again %.2f ms",
           (double)scrub_ns / 1e6, before, after);
}

/* The peers that must answer a rejoin of j: each one up that holds ranks of it. */
static uint64_t elastic_peers(const struct job *j) {
  uint64_t need = 0;
  for (int k = 0; j->multinode && k < peer_count(); k++)
    if (peer_is_up(k) && job_membership(j, k) != NULL)
      need |= job_peer_bit(k);
  return need;
}

/* The rejoin of j that waited for its peers ends: the process is answered (job.c). */
static void elastic_join_end(struct job *j, int code, const char *why) {
  struct elastic_pending p = j->elastic->pending;
  j->elastic->pending.on = false;
  uv_timer_stop(&j->timer);
  if (code == 0) {
    char took[sizeof p.took + 32];
    snprintf(took, sizeof took, "%s, peers %.2f ms", p.took, ms_since(p.done_ns));
    elastic_log_back(j, p.pid, p.rank, p.at, p.before, took);
  }
  job_rejoined(j, p.local_rank, code, why);
}

/* The bound of a rejoin's wait for its peers' answers (limits.attach_timeout_ms). */
static void elastic_join_timeout(uv_timer_t *t) {
  struct job *j = t->data;
  const struct elastic_pending *p = &j->elastic->pending;
  if (!p->on)
    return;
  char who[200] = "";
  size_t o = 0;
  for (int k = 0; k < peer_count(); k++) {
    if ((p->need & job_peer_bit(k)) == 0)
      continue;
    int n = snprintf(who + o, sizeof who - o, "%s%s", o ? ", " : "", peer_name(k));
    if (n > 0 && (size_t)n < sizeof who - o)
      o += (size_t)n;
  }
  char why[400];
  snprintf(why, sizeof why, "node(s) %s did not say within %u ms (limits.attach_timeout_ms) "
           "whether their ranks were short of call %llu, rank %u's join call; attach again, "
           "and see deepepctl peers on both nodes", who, j->timeout_ms,
           (unsigned long long)p->at, p->rank);
  elastic_join_end(j, DEP_ERR_TIMEOUT, why);
}

void elastic_on_joined(struct job *j, int k, const struct dep_peer_job_joined *m) {
  struct elastic_pending *p = &j->elastic->pending;
  const uint64_t bit = job_peer_bit(k);
  if (!p->on || m->rank != p->rank || m->gen != p->gen || (p->need & bit) == 0)
    return; /* an answer to a rejoin that has ended (or a repeat): nothing waits for it */
  if (!m->ok) {
    char why[400];
    elastic_widen(j->elastic);
    snprintf(why, sizeof why, "the job's calls on node %s reached call %llu while rank %u was "
             "brought back from call %llu; attach again (the next attempt joins %u calls "
             "ahead; this one: %s, peers %.2f ms)", peer_name(k), (unsigned long long)m->posted,
             p->rank, (unsigned long long)p->at, j->elastic->ahead, p->took,
             ms_since(p->done_ns));
    elastic_join_end(j, DEP_ERR_STATE, why);
    return;
  }
  p->need &= ~bit;
  if (p->need == 0)
    elastic_join_end(j, 0, NULL);
}

int elastic_join(struct job *j, const struct job_rank *slot, pid_t pid, bool *asked, char *why,
                 size_t whylen) {
  struct job_elastic *e = j->elastic;
  const uint32_t rank = slot->rank;
  uint64_t before = 0, after = 0;
  *asked = false;
  if (e->pending.on) {
    snprintf(why, whylen, "rank %u is being brought back (the daemons of the job are agreeing "
             "on its join call); attach again once it is in", e->pending.rank);
    return DEP_ERR_STATE;
  }
  uint64_t t0 = uv_hrtime();
  int rc = elastic_posted(j, slot, false, &before, why, whylen);
  if (rc != 0)
    return rc;
  const double read_before = ms_since(t0);
  const uint64_t at = before + e->ahead;
  const uint32_t gen = e->gen[rank] + 1;
  e->join[rank] = at;
  (void)elastic_take(j, rank, gen, DEP_JOB_EVENT_REJOINED, (uint32_t)pid);
  /* The other nodes write it into their slabs and check their own ranks
   * (JOB_JOINED) while this one does the same with its own: each node's
   * check covers only its ranks and reads them after its own write, so
   * neither needs the other's done first, and an answer is taken only once
   * this returns (the loop's thread). */
  const uint64_t need = elastic_peers(j);
  if (need != 0)
    elastic_tell(j, rank, gen, DEP_JOB_EVENT_REJOINED, at);
  /* The mask, then the slots read again: a survivor starts call `at` only
   * once every rank has posted at - 1 to it; none has, after the epoch went
   * out, so each will see it first. */
  t0 = uv_hrtime();
  rc = elastic_posted(j, slot, true, &after, why, whylen);
  const uint64_t done_ns = uv_hrtime(); /* the peers' time is what is waited for past this */
  char took[sizeof e->pending.took];
  elastic_took(took, sizeof took, e->scrub_ns, read_before, ms_since(t0));
  if (rc == 0 && !elastic_overtaken(after, at)) {
    if (need == 0) {
      elastic_log_back(j, (int)pid, rank, at, before, took);
      return 0;
    }
    e->pending = (struct elastic_pending){.on = true, .local_rank = (uint32_t)(slot - j->ranks),
                                          .rank = rank, .gen = gen, .at = at, .before = before,
                                          .need = need, .pid = (int)pid, .done_ns = done_ns};
    memcpy(e->pending.took, took, sizeof took);
    *asked = true;
    uv_timer_start(&j->timer, elastic_join_timeout, j->timeout_ms, 0);
    return 0;
  }
  /* The survivors ran past it (or could not be read): masked again, as it was. */
  elastic_undo(j, rank, (int)pid);
  if (rc == 0) {
    elastic_widen(e);
    snprintf(why, whylen, "the job's calls reached call %llu while rank %u was brought back "
             "from call %llu; attach again (the next attempt joins %u calls ahead; this one: "
             "%s)", (unsigned long long)after, rank, (unsigned long long)at, e->ahead, took);
    rc = DEP_ERR_STATE;
  }
  return rc;
}

/* ---- a split settled when the link comes back (the banner) --------------- */

static bool bit_of(const uint8_t *set, uint32_t r) { return (set[r / 8u] >> (r % 8u)) & 1u; }

static uint32_t set_count(const uint8_t *set, uint32_t world) {
  uint32_t n = 0;
  for (uint32_t r = 0; r < world; r++)
    n += bit_of(set, r);
  return n;
}

/* The lowest rank in set, or world when it is empty. */
static uint32_t set_lowest(const uint8_t *set, uint32_t world) {
  uint32_t r = 0;
  while (r < world && !bit_of(set, r))
    r++;
  return r;
}

/* Whether world rank r is one of this node's ranks of j. */
static bool elastic_holds(const struct job *j, uint32_t r) {
  for (uint32_t i = 0; i < j->local_world_size; i++)
    if (j->ranks[i].rank == r)
      return true;
  return false;
}

/* Record one event of j's history that changes no rank's count. */
static void elastic_note(struct job *j, uint32_t rank, uint32_t why) {
  struct job_elastic *e = j->elastic;
  e->events[e->n_events % DEP_JOB_EVENTS_KEPT] =
      (struct elastic_event){uv_hrtime(), rank, why, 0, e->epoch};
  e->n_events++;
}

void elastic_held_tell(struct job *j, int k) {
  struct job_elastic *e = j->elastic;
  if (e->cut || !j->multinode || k < 0 || k >= peer_count())
    return;
  if (e->sent == NULL && (e->sent = calloc((size_t)peer_count(), DEP_PEER_RANK_BYTES)) == NULL) {
    log_warnx("job %s: out of memory for its view to send node %s; a split of the job is not "
              "settled on this link's return", j->id, peer_name(k));
    return;
  }
  static struct dep_peer_msg m; /* large (two sets); the loop is the only caller */
  memset(&m, 0, sizeof m);
  m.type = DEP_PEER_JOB_HELD;
  struct dep_peer_job_held *h = &m.u.held;
  snprintf(h->job_id, sizeof h->job_id, "%s", j->id);
  h->owner_uid = (uint32_t)j->owner_uid;
  h->world_size = j->world_size;
  bool some = false;
  for (uint32_t r = 0; r < j->world_size; r++) {
    if (e->gen[r] % 2 == 1)
      continue;
    h->live[r / 8u] |= (uint8_t)(1u << (r % 8u));
    if (elastic_holds(j, r)) {
      h->held[r / 8u] |= (uint8_t)(1u << (r % 8u));
      some = true;
    }
  }
  if (!some)
    return; /* every rank of ours is masked: no part of the job runs here to keep */
  memcpy(e->sent + (size_t)k * DEP_PEER_RANK_BYTES, h->live, DEP_PEER_RANK_BYTES);
  e->told |= job_peer_bit(k);
  e->settled &= ~job_peer_bit(k);
  (void)peer_send(k, &m);
}

void elastic_peer_down(struct job *j, int k) {
  if (j->elastic != NULL)
    j->elastic->told &= ~job_peer_bit(k);
}

/*
 * This node's part of j lost the split with peer k: it ends.  Its mask is
 * cleared at a new epoch, so that its ranks' next calls wait for the
 * winner's ranks (which never answer: they are masked there), and the
 * abort words say that this node was cut off (DEP_SLAB_GONE_CUT, DEP_ERR_PEER)
 * naming this node's rank `self`: a rank live in every view this node's ranks may still
 * hold, so that a wait of any call fails on them at once, one begun under
 * the old mask too (a wait for a rank masked in the call is no failure).
 * A call that reaches the other nodes fails likewise (the route failed).
 * The peers hear JOB_END, so that a node that saw both parts masks this
 * one's ranks; and nothing changes the job here again.
 */
static void elastic_cut(struct job *j, int k, uint32_t winner, uint32_t self, uint32_t theirs,
                        uint32_t ours) {
  struct job_elastic *e = j->elastic;
  if (e->pending.on) {
    e->pending.on = false;
    uv_timer_stop(&j->timer);
    job_rejoined(j, e->pending.local_rank, DEP_ERR_PEER,
                 "the job split while this rank was brought back, and this node's part ended");
  }
  e->cut = true;
  e->epoch++;
  elastic_note(j, winner, DEP_JOB_EVENT_PARTITIONED);
  elastic_write(j);
  char msg[DEP_MSG_TEXT_MAX];
  snprintf(msg, sizeof msg,
           "job %s: this node was cut off from node %s while the elastic job ran, and both went "
           "on, each masking the other's ranks; now that the link is back, the part with rank %u "
           "(%u live ranks there, %u here) goes on without this node, and this node's ranks of "
           "the job fail with DEP_ERR_PEER: end them (detach); the job keeps them masked, and a "
           "lost node's ranks cannot rejoin, so start the job again to run on this node",
           j->id, peer_name(k), winner, theirs, ours);
  log_warnx("%s", msg);
  /* pid carries the winner's rank (slab.h DEP_SLAB_GONE_CUT): the ranks are told that this
   * node lost, and with whom the job went on, not that a peer is gone. */
  struct job_rank gone = {.rank = self, .pid = (pid_t)winner};
  lend_tell_gone(j, &gone, DEP_SLAB_GONE_CUT);
  xfer_job_fail(j, DEP_ERR_PEER);
  job_tell_peers(j, 0, DEP_PEER_NO_RANK, false, msg);
}

void elastic_on_held(struct job *j, int k, const struct dep_peer_job_held *m) {
  struct job_elastic *e = j->elastic;
  const uint64_t bit = job_peer_bit(k);
  if (e->cut || (e->settled & bit) != 0)
    return; /* this part ended, or this return was settled: a repeat changes nothing */
  if (m->world_size != j->world_size) {
    log_warnx("job %s: node %s says it runs a job of this id over %u ranks, this node over %u; "
              "its view is ignored", j->id, peer_name(k), m->world_size, j->world_size);
    return;
  }
  for (uint32_t r = 0; r < j->world_size; r++) {
    if (bit_of(m->held, r) && elastic_holds(j, r)) {
      log_warnx("job %s: node %s says it holds rank %u, which this node holds; its view is "
                "ignored", j->id, peer_name(k), r);
      return;
    }
  }
  if ((e->told & bit) == 0)
    elastic_held_tell(j, k); /* ours goes now; what it says is what we compare */
  if ((e->told & bit) == 0)
    return; /* nothing of ours runs, or no memory: said */
  e->settled |= bit;
  const uint8_t *ours = e->sent + (size_t)k * DEP_PEER_RANK_BYTES;
  /* A split: a rank one side holds live is masked on the other.  Both sides
   * read the same two views (ours as sent), so both find the same. */
  bool split = false;
  uint8_t diff[DEP_PEER_RANK_BYTES];
  for (uint32_t r = 0; r < j->world_size; r++) {
    split |= (bit_of(m->held, r) && !bit_of(ours, r)) ||
             (elastic_holds(j, r) && bit_of(ours, r) && !bit_of(m->live, r));
    if (r % 8u == 0)
      diff[r / 8u] = (uint8_t)(ours[r / 8u] ^ m->live[r / 8u]);
  }
  if (!split)
    return;
  const uint32_t n_ours = set_count(ours, j->world_size);
  const uint32_t n_theirs = set_count(m->live, j->world_size);
  const uint32_t low = set_lowest(diff, j->world_size);
  const bool won = n_ours > n_theirs || (n_ours == n_theirs && bit_of(ours, low));
  const uint32_t winner = set_lowest(won ? ours : m->live, j->world_size);
  if (!won) {
    uint32_t self = j->world_size;
    for (uint32_t r = 0; r < j->world_size && self == j->world_size; r++)
      if (bit_of(ours, r) && elastic_holds(j, r))
        self = r; /* there is one: a view is sent only with one (elastic_held_tell) */
    elastic_cut(j, k, winner, self, n_theirs, n_ours);
    return;
  }
  elastic_note(j, winner, DEP_JOB_EVENT_PARTITIONED);
  log_warnx("job %s: node %s was cut off from this node while the elastic job ran, and both "
            "went on, each masking the other's ranks; now that the link is back, this part "
            "(with rank %u, %u live ranks; node %s's part %u) goes on, with node %s's ranks "
            "still masked, and node %s's ranks of the job fail there", j->id, peer_name(k),
            winner, n_ours, peer_name(k), n_theirs, peer_name(k), peer_name(k));
}
