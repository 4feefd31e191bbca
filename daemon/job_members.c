/*
 * job_members.c — the jobs that span nodes (DESIGN §7): the MEMBERSHIP
 * records peers sent (one per job id and peer), our MEMBERSHIP going out
 * and its MEMBERSHIP_OK coming back, JOB_FAIL and JOB_END both ways, the
 * gathering that holds every world rank on exactly one node, its timeout,
 * and what a peer coming up or going down does to the jobs.  The job table
 * itself is job.c's; what both share is job_internal.h.
 */
#include "job.h"
#include "job_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conn.h"
#include "deepepd.h"
#include "lend.h"
#include "log.h"
#include "peer.h"
#include "proto.h"
#include "xfer.h"
#include "shape.h"
#include "slab.h"

/* ---- what peers reported: one record per (job id, peer) ----------------
 * Kept apart from the job table: a peer's MEMBERSHIP often arrives before
 * the first local rank of the job does, and it outlives a local job that
 * failed (its ranks may come back under the same id).  A record goes when
 * its peer says JOB_END or JOB_FAIL, or when the peer goes down.
 *
 * Across nodes a job is its (owner uid, id) (DESIGN §4): a record counts
 * toward the local job of its id only when both are the same uid's.  A
 * record of another uid is held apart: it never joins, completes or fails
 * that job, and what it tells the other uid's ranks is at most that the id
 * is taken (job_attach). */

/* Records at most, from all peers together (member_cap gives each peer its
 * share): an authenticated peer is trusted, but bounded. */
#define JOB_MEMBERS_MAX 4096u

struct job_member {
  struct job_member *next;
  int peer;
  struct dep_peer_membership m;
};

static struct job_member *job_members;

/* Whether record x is of job j: the same id and the same owner. */
static bool member_of(const struct job_member *x, const struct job *j) {
  return x->m.owner_uid == (uint32_t)j->owner_uid && strcmp(x->m.job_id, j->id) == 0;
}

/*
 * The most records one peer may hold here: as many jobs as this node may
 * hold itself (limits.max_jobs, the same on every node of a cluster, bounds
 * the jobs a peer can announce), and never more than its share of
 * JOB_MEMBERS_MAX, so that one peer cannot fill the table for the others.
 */
static uint32_t member_cap(void) {
  uint32_t share = JOB_MEMBERS_MAX / (uint32_t)(peer_count() > 0 ? peer_count() : 1);
  return job_cfg->max_jobs < share ? job_cfg->max_jobs : share;
}

static uint32_t members_of(int peer) {
  uint32_t n = 0;
  for (const struct job_member *x = job_members; x != NULL; x = x->next)
    n += x->peer == peer;
  return n;
}

static struct job_member **member_slot(const char *id, int peer) {
  struct job_member **pp = &job_members;
  for (; *pp != NULL; pp = &(*pp)->next)
    if ((*pp)->peer == peer && strcmp((*pp)->m.job_id, id) == 0)
      break;
  return pp;
}

static void member_drop(const char *id, int peer) {
  struct job_member **pp = member_slot(id, peer);
  struct job_member *x = *pp;
  if (x == NULL)
    return;
  *pp = x->next;
  free(x);
}

/* Whether a peer holds id for another uid than `uid`, and none for uid:
 * the id is taken across nodes. */
bool member_taken(const char *id, uid_t uid) {
  bool other = false;
  for (const struct job_member *x = job_members; x != NULL; x = x->next) {
    if (strcmp(x->m.job_id, id) != 0)
      continue;
    if (x->m.owner_uid == (uint32_t)uid)
      return false;
    other = true;
  }
  return other;
}

int member_holder(const struct job *j, uint32_t rank) {
  for (const struct job_member *x = job_members; x != NULL; x = x->next)
    for (uint32_t i = 0; member_of(x, j) && i < x->m.n_ranks; i++)
      if (x->m.ranks[i] == rank)
        return x->peer;
  return -1;
}

const struct dep_peer_membership *job_membership(const struct job *j, int peer) {
  const struct job_member *x = *member_slot(j->id, peer);
  return x != NULL && member_of(x, j) ? &x->m : NULL;
}

uint32_t job_remote_ranks(const struct job *j, uint32_t *nodes) {
  uint32_t n = 0, k = 0;
  for (const struct job_member *x = job_members; x != NULL; x = x->next) {
    if (!member_of(x, j))
      continue;
    n += x->m.n_ranks;
    k++;
  }
  if (nodes != NULL)
    *nodes = k;
  return n;
}

/* "0-3,8,10-11" into buf (cut with "..." when long) from a bitmap of world ranks. */
void ranks_fmt(const uint8_t *set, uint32_t world, char *buf, size_t len) {
  size_t off = 0;
  buf[0] = '\0';
  for (uint32_t r = 0; r < world; r++) {
    if (!set[r])
      continue;
    uint32_t e = r;
    while (e + 1 < world && set[e + 1])
      e++;
    int n = e > r ? snprintf(buf + off, len - off, "%s%u-%u", off ? "," : "", r, e)
                  : snprintf(buf + off, len - off, "%s%u", off ? "," : "", r);
    if (n < 0 || (size_t)n >= len - off - 4) {
      snprintf(buf + off, len - off, ",...");
      return;
    }
    off += (size_t)n;
    r = e;
  }
}

/* A JOB_FAIL (code < 0) or JOB_END (code 0) about the job (owner, id). */
struct dep_peer_msg job_event(const char *id, uint32_t owner, int code, uint32_t rank,
                              bool detached, const char *msg) {
  struct dep_peer_msg m = {.type = code < 0 ? DEP_PEER_JOB_FAIL : DEP_PEER_JOB_END};
  snprintf(m.u.job.job_id, sizeof m.u.job.job_id, "%s", id);
  m.u.job.owner_uid = owner;
  m.u.job.rank = rank;
  m.u.job.detached = detached ? 1u : 0u;
  m.u.job.code = code;
  snprintf(m.u.job.message, sizeof m.u.job.message, "%s", msg != NULL ? msg : "");
  return m;
}

/* Send m to every peer that is up. */
void job_send_peers(const struct dep_peer_msg *m) {
  for (int k = 0; k < peer_count(); k++)
    if (peer_is_up(k))
      (void)peer_send(k, m);
}

/* Send JOB_FAIL (code < 0) or JOB_END (code 0) about j to every peer that is up. */
void job_tell_peers(const struct job *j, int code, uint32_t rank, bool detached,
                    const char *msg) {
  struct dep_peer_msg m = job_event(j->id, (uint32_t)j->owner_uid, code, rank, detached, msg);
  job_send_peers(&m);
}

_Static_assert(CONFIG_MAX_LIST <= 64, "a job's sets of peers hold a bit per peer");
uint64_t job_peer_bit(int k) { return (uint64_t)1 << (unsigned)k; }

/* The peers holding ranks of j (their records) that have not taken its MEMBERSHIP yet. */
static uint64_t job_unaccepted(const struct job *j) {
  uint64_t need = 0;
  for (const struct job_member *x = job_members; x != NULL; x = x->next)
    if (member_of(x, j))
      need |= job_peer_bit(x->peer);
  return need & ~j->accepted;
}

/* Send our MEMBERSHIP of j to peer k, or to every peer that is up (k < 0):
 * the ranks held here and where peers write into their slabs.  False when
 * the job failed instead. */
static bool job_announce(struct job *j, int k) {
  static struct dep_peer_msg m; /* large (windows); the loop is the only caller */
  memset(&m, 0, sizeof m);
  m.type = DEP_PEER_MEMBERSHIP;
  struct dep_peer_membership *x = &m.u.membership;
  snprintf(x->job_id, sizeof x->job_id, "%s", j->id);
  x->owner_uid = (uint32_t)j->owner_uid;
  x->sw.shape = j->shape;
  x->sw.world_size = j->world_size;
  x->chunk_rows = j->chunk_rows;
  x->flags = j->flags;
  x->local_world_size = j->local_world_size;
  x->n_ranks = j->local_world_size;
  for (uint32_t i = 0; i < j->local_world_size; i++)
    x->ranks[i] = j->ranks[i].rank;
  char why[DEP_MSG_TEXT_MAX - DEP_JOB_ID_MAX - 8] = "";
  int rc = lend_windows(j, x, why, sizeof why);
  if (rc != 0) {
    char msg[DEP_MSG_TEXT_MAX];
    snprintf(msg, sizeof msg, "job %s: %s", j->id, why);
    job_fail_everywhere(j, rc, msg);
    return false;
  }
  xfer_job_expect(j); /* before a peer can complete it and send frames */
  for (int p = 0; p < peer_count(); p++) {
    if ((k < 0 || p == k) && peer_is_up(p)) {
      j->accepted &= ~job_peer_bit(p); /* until it answers this one */
      (void)peer_send(p, &m);
    }
  }
  j->announced = true;
  return true;
}

/* ---- multi-node: who holds which rank -------------------------------- */

/* Per world rank: JOB_NOBODY, JOB_HERE (a local rank attached) or the peer. */
#define JOB_NOBODY (-2)
#define JOB_HERE (-1)
static int16_t job_who[DEP_MAX_WORLD];

/* Fail j on every node: the peers are told (JOB_FAIL), the local ranks answered. */
void job_fail_everywhere(struct job *j, int code, const char *msg) {
  log_warnx("%s", msg);
  job_tell_peers(j, code, DEP_PEER_NO_RANK, false, msg);
  job_fail(j, code, msg);
}

static const char *job_node(int who) { return who == JOB_HERE ? "this node" : peer_name(who); }

/*
 * Whether peer x's ranks of j stream in other chunks than this node's (the
 * channels between nodes mirror each other's rings, slab.h), with the
 * message in msg: the chunk to set on every node, the smaller one (it fits
 * wherever the larger does), and, where this node chose by auto, that it
 * did and why, so that nodes of different pools know which number to write.
 */
static bool job_chunks_differ(const struct job *j, const struct job_member *x, char *msg,
                              size_t len) {
  const uint32_t ours = dep_slab_chan_rows(j->shape.max_tokens_per_rank, j->chunk_rows);
  const uint32_t theirs = dep_slab_chan_rows(j->shape.max_tokens_per_rank, x->m.chunk_rows);
  if (ours == theirs)
    return false;
  const uint32_t set = ours < theirs ? j->chunk_rows : x->m.chunk_rows;
  const double mib = 1024.0 * 1024.0;
  char here[40] = "whole blocks", there[40] = "whole blocks", chose[160] = "";
  if (ours < j->shape.max_tokens_per_rank)
    snprintf(here, sizeof here, "chunks of %u rows", j->chunk_rows);
  if (theirs < j->shape.max_tokens_per_rank)
    snprintf(there, sizeof there, "chunks of %u rows", x->m.chunk_rows);
  if (j->chunk_xnode)
    snprintf(chose, sizeof chose,
             " (this node chose by stream_chunk_rows: auto: a job across nodes on the host "
             "backend streams in chunks of %u rows where they fit its pool)",
             LEND_AUTO_XNODE_HOST_ROWS);
  else if (j->chunk_auto)
    snprintf(chose, sizeof chose,
             " (this node chose by stream_chunk_rows: auto: its pool holds %.1f MiB, whole "
             "blocks need %.1f MiB for each of its %u local ranks)",
             (double)j->chunk_pool_bytes / mib, (double)j->chunk_whole_bytes / mib,
             j->local_world_size);
  snprintf(msg, len,
           "job %s: node %s streams in %s, this node in %s (stream_chunk_rows); set "
           "stream_chunk_rows: %u on every node%s",
           j->id, peer_name(x->peer), there, here, set, chose);
  return true;
}

/*
 * Fill job_who for j from its local ranks and the peers' records of its uid
 * (another uid's are held apart), checking each against the job: the same
 * shape and world, ranks within the world, no rank held twice, no more
 * ranks than world_size.  On a conflict the job fails on every node and
 * false is returned; else *held is the number of world ranks accounted for.
 */
static bool job_gather(struct job *j, uint32_t *held) {
  char msg[DEP_MSG_TEXT_MAX];
  for (uint32_t r = 0; r < j->world_size; r++)
    job_who[r] = JOB_NOBODY;
  uint32_t n = 0, total = j->local_world_size;
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    if (j->ranks[i].conn != NULL) {
      job_who[j->ranks[i].rank] = JOB_HERE;
      n++;
    }
  }
  for (const struct job_member *x = job_members; x != NULL; x = x->next) {
    if (!member_of(x, j))
      continue; /* another uid's job of the same id: held apart */
    const char *field = NULL;
    uint64_t have = 0, gives = 0;
    if (dep__shape_diff(&j->shape, j->world_size, &x->m.sw.shape, x->m.sw.world_size, &field,
                       &have, &gives)) {
      snprintf(msg, sizeof msg,
               "job %s: the ranks on node %s give %s %llu but this node's give %llu; every rank "
               "of a job must pass the same values on every node",
               j->id, peer_name(x->peer), field, (unsigned long long)gives,
               (unsigned long long)have);
      job_fail_everywhere(j, DEP_ERR_MISMATCH, msg);
      return false;
    }
    if (job_chunks_differ(j, x, msg, sizeof msg)) {
      job_fail_everywhere(j, DEP_ERR_MISMATCH, msg);
      return false;
    }
    if (x->m.flags != j->flags) {
      snprintf(msg, sizeof msg,
               "job %s: the ranks on node %s give flags 0x%x (elastic %s) but this node's give "
               "0x%x (elastic %s); every rank of a job must pass the same DEP_ATTACH_ELASTIC on "
               "every node",
               j->id, peer_name(x->peer), x->m.flags,
               (x->m.flags & DEP_ATTACH_ELASTIC) ? "on" : "off", j->flags,
               (j->flags & DEP_ATTACH_ELASTIC) ? "on" : "off");
      job_fail_everywhere(j, DEP_ERR_MISMATCH, msg);
      return false;
    }
    total += x->m.local_world_size;
    if (total > j->world_size) {
      snprintf(msg, sizeof msg,
               "job %s: the nodes hold more ranks than its world_size %u (this node %u, node %s "
               "%u, ...); check local_world_size on every node",
               j->id, j->world_size, j->local_world_size, peer_name(x->peer),
               x->m.local_world_size);
      job_fail_everywhere(j, DEP_ERR_MISMATCH, msg);
      return false;
    }
    for (uint32_t i = 0; i < x->m.n_ranks; i++) {
      uint32_t r = x->m.ranks[i];
      if (r >= j->world_size) {
        snprintf(msg, sizeof msg, "job %s: node %s holds rank %u, beyond world_size %u", j->id,
                 peer_name(x->peer), r, j->world_size);
        job_fail_everywhere(j, DEP_ERR_MISMATCH, msg);
        return false;
      }
      if (job_who[r] != JOB_NOBODY) {
        char first[300];
        snprintf(first, sizeof first, "%s", job_node(job_who[r]));
        snprintf(msg, sizeof msg,
                 "job %s: rank %u is claimed by two nodes, %s and %s; give every rank of a job "
                 "to one node only",
                 j->id, r, first, peer_name(x->peer));
        job_fail_everywhere(j, DEP_ERR_EXISTS, msg);
        return false;
      }
      job_who[r] = (int16_t)x->peer;
      n++;
    }
  }
  *held = n;
  return true;
}

/* Something changed for the gathering multi-node job j (a local rank, a
 * peer's record): announce it when its local ranks are all here, check it,
 * and complete it when every world rank is held. */
void job_progress(struct job *j) {
  if (j->dead || j->ready || !j->multinode)
    return;
  uint32_t held = 0;
  if (!job_gather(j, &held))
    return;
  if (j->attached == j->local_world_size && !j->announced &&
      (!job_lend(j) || !job_announce(j, -1)))
    return;
  /* Every node holding ranks of it must have taken our MEMBERSHIP: one that
   * refuses it fails the job (JOB_FAIL), and that must come while our ranks
   * still wait for their ATTACH, not after they started. */
  if (j->attached == j->local_world_size && held == j->world_size && job_unaccepted(j) == 0) {
    uint32_t nodes = 0;
    (void)job_remote_ranks(j, &nodes);
    log_info("job %s: all %u ranks held on %u node(s)", j->id, j->world_size, 1 + nodes);
    xfer_job_start(j, job_who, job_membership); /* before the replies: a rank asks for its ring next */
    job_complete_filled(j);
  }
}

/* The multi-node job j timed out: name the missing world ranks and the peers. */
void job_timeout_multinode(struct job *j) {
  uint32_t held = 0;
  if (!job_gather(j, &held))
    return;
  static uint8_t missing_set[DEP_MAX_WORLD];
  for (uint32_t r = 0; r < j->world_size; r++)
    missing_set[r] = job_who[r] == JOB_NOBODY;
  char missing[160], up[200] = "", down[200] = "";
  ranks_fmt(missing_set, j->world_size, missing, sizeof missing);
  size_t ou = 0, od = 0;
  for (int k = 0; k < peer_count(); k++) {
    bool is_up = peer_is_up(k);
    char *b = is_up ? up : down;
    size_t *o = is_up ? &ou : &od;
    int n = snprintf(b + *o, sizeof up - *o, "%s%s", *o ? ", " : "", peer_name(k));
    if (n > 0 && (size_t)n < sizeof up - *o)
      *o += (size_t)n;
  }
  char msg[DEP_MSG_TEXT_MAX];
  uint64_t silent = job_unaccepted(j);
  if (held == j->world_size && j->attached == j->local_world_size && silent != 0) {
    /* Every rank is here; a node never said it took our MEMBERSHIP. */
    char quiet[200] = "";
    size_t oq = 0;
    for (int k = 0; k < peer_count(); k++) {
      if (!(silent & job_peer_bit(k)))
        continue;
      int n = snprintf(quiet + oq, sizeof quiet - oq, "%s%s", oq ? ", " : "", peer_name(k));
      if (n > 0 && (size_t)n < sizeof quiet - oq)
        oq += (size_t)n;
    }
    snprintf(msg, sizeof msg,
             "job %s: all %u ranks attached, but after %u ms node(s) %s had not acknowledged "
             "this node's membership of the job (MEMBERSHIP_OK, which a deepepd older than "
             "this one does not send: run the same deepepd version on every node)",
             j->id, j->world_size, j->timeout_ms, quiet);
    job_fail_everywhere(j, DEP_ERR_TIMEOUT, msg);
    return;
  }
  int len = snprintf(msg, sizeof msg,
                     "job %s: %u of %u ranks attached after %u ms (%u of %u here); missing "
                     "global ranks %s; peers up: %s; not up: %s (start every rank on every node, "
                     "or raise limits.attach_timeout_ms)",
                     j->id, held, j->world_size, j->timeout_ms, j->attached, j->local_world_size,
                     missing, up[0] ? up : "none", down[0] ? down : "none");
  if (len >= (int)sizeof msg) /* many ranks or peers: say that the list was cut */
    memcpy(msg + sizeof msg - 4, "...", 4);
  job_fail_everywhere(j, DEP_ERR_TIMEOUT, msg);
}

/*
 * c's uid asked for an id that another uid holds: its job here (j), or,
 * with none here, a peer's record.  It learns that the id is taken and
 * nothing else (not the owner, not the node); the owner's job goes on
 * untouched (DESIGN §4).  The daemon's log names both for the administrator.
 */
void job_refuse_taken(struct conn *c, uint32_t request_id, const char *id,
                      const struct job *j) {
  if (j != NULL) {
    log_warnx("job %s: uid %u (pid %d) tried to join a job of uid %u; refused", id,
              (unsigned)c->uid, (int)c->pid, (unsigned)j->owner_uid);
  } else {
    for (const struct job_member *x = job_members; x != NULL; x = x->next)
      if (strcmp(x->m.job_id, id) == 0)
        log_warnx("job %s: uid %u (pid %d) asked for an id that node %s holds for uid %u; "
                  "refused", id, (unsigned)c->uid, (int)c->pid, peer_name(x->peer),
                  (unsigned)x->m.owner_uid);
  }
  conn_send_error(c, request_id, DEP_ERR_PERMISSION,
                  "job %s belongs to another user; choose a job id of your own (all processes "
                  "of one job run as the same uid number on every node)", id);
}

/* ---- what the peers say ------------------------------------------------- */

/* A peer came up: it learns the membership of every job gathering here, and
 * this node's view of every elastic job running across nodes (a split of
 * one while the link was down is settled: job_elastic.c). */
static void job_on_peer_up(int k) {
  for (struct job *j = job_list; j != NULL; j = j->next) {
    if (j->multinode && !j->ready && !j->dead && j->attached == j->local_world_size)
      job_announce(j, k);
    else if (j->multinode && j->ready && !j->dead && j->elastic != NULL)
      elastic_held_tell(j, k);
  }
}

/* A peer's last link closed: its gathering jobs fail at once, its running
 * ones are told (abort words) that its first rank is gone; its records go. */
static void job_on_peer_down(int k) {
  struct job_member *x = job_members;
  while (x != NULL) {
    struct job_member *next = x->next;
    if (x->peer == k) {
      struct job *j = job_find(x->m.job_id);
      if (j != NULL && !member_of(x, j))
        j = NULL; /* another uid's job of that id: the peer held none of its ranks */
      if (j != NULL && !j->dead && j->multinode && !j->ready) {
        char msg[DEP_MSG_TEXT_MAX];
        snprintf(msg, sizeof msg,
                 "job %s: node %s, which holds %u of its ranks, went down (its peer link "
                 "dropped) while the job gathered its ranks",
                 j->id, peer_name(k), x->m.n_ranks);
        log_warnx("%s", msg);
        job_fail(j, DEP_ERR_PEER, msg);
      } else if (j != NULL && !j->dead && j->multinode && j->ready && j->elastic != NULL) {
        log_warnx("job %s: node %s went down while the elastic job ran: its %u rank(s) are "
                  "masked", j->id, peer_name(k), x->m.n_ranks);
        elastic_node_lost(j, k, &x->m);
      } else if (j != NULL && !j->dead && j->multinode && j->ready && x->m.n_ranks > 0) {
        log_warnx("job %s: node %s went down while the job ran: its ranks are told that rank %u "
                  "is gone", j->id, peer_name(k), x->m.ranks[0]);
        struct job_rank gone = {.rank = x->m.ranks[0]};
        lend_tell_gone(j, &gone, DEP_SLAB_GONE_NODE);
        xfer_job_fail(j, DEP_ERR_PEER);
      }
      member_drop(x->m.job_id, k);
    }
    x = next;
  }
  for (struct job *j = job_list; j != NULL; j = j->next) {
    j->accepted &= ~job_peer_bit(k); /* it forgot our MEMBERSHIP: sent again when it is up */
    elastic_peer_down(j, k);         /* and our view of its elastic jobs, likewise */
  }
}

/*
 * Peer k's MEMBERSHIP cannot be taken here (why): its job can never start,
 * so it fails at once on every node (DESIGN §5), not after
 * limits.attach_timeout_ms.  Every peer that is up is told (JOB_FAIL under
 * the sender's uid: each node fails its job of that uid and id, and no
 * other uid's), the sender with them; the ranks of that job waiting here are
 * answered with the reason; and nothing the sender said of it is kept.
 */
static void job_refuse_membership(int k, const struct dep_peer_membership *in, int code,
                                  const char *why) {
  char msg[DEP_MSG_TEXT_MAX];
  snprintf(msg, sizeof msg, "job %.64s: the ranks on node %s were refused: %.380s", in->job_id,
           peer_name(k), why);
  member_drop(in->job_id, k);
  struct job *j = job_find(in->job_id);
  if (j != NULL && !j->dead && !j->ready && j->multinode &&
      (uint32_t)j->owner_uid == in->owner_uid) {
    job_fail_everywhere(j, code, msg);
    return;
  }
  log_warnx("%s", msg);
  job_remember_failure(in->owner_uid, in->job_id, code, NULL, msg, NULL);
  struct dep_peer_msg m = job_event(in->job_id, in->owner_uid, code, DEP_PEER_NO_RANK, false, msg);
  job_send_peers(&m);
}

/* Why peer k's MEMBERSHIP cannot be taken as a record, with its code; 0 when it can. */
static int job_membership_check(int k, const struct dep_peer_membership *in, char *why,
                                size_t len) {
  int rc = proto_check_job_id(in->job_id, why, len);
  if (rc == 0)
    rc = dep__shape_check(&in->sw.shape, in->sw.world_size, why, len);
  /* Each rank's windows cover its exchange region (slab.h) from its first
   * byte on, in order: what a writer into it will rely on. */
  struct dep_slab_layout l;
  if (rc == 0)
    rc = dep__slab_layout_nodes(&in->sw.shape, in->sw.world_size, in->local_world_size,
                                in->chunk_rows, &l, why, len);
  if (rc != 0)
    return rc;
  if (in->n_windows == 0) {
    /* Every node lends its ranks of a job across nodes an exchange region,
     * whatever the world; a deepepd of the same peer protocol from before
     * that lent none above 64 ranks. */
    snprintf(why, len, "node %s lent no exchange region for them (a deepepd older than this "
             "node's lends none to a world above %u ranks, and this one has %u): run one "
             "deepepd version on every node", peer_name(k), DEP_MAX_LOCAL_RANKS,
             in->sw.world_size);
    return DEP_ERR_UNSUPPORTED;
  }
  for (uint32_t r = 0; r < in->n_ranks; r++) {
    uint64_t at = 0;
    for (uint32_t w = 0; w < in->n_windows; w++) {
      const struct dep_peer_window *v = &in->windows[w];
      if (v->rank_index != r)
        continue;
      if (v->slab_off != at)
        break;
      at += v->len;
    }
    if (at < l.xchg_bytes) {
      snprintf(why, len, "the windows of its rank %u cover %llu of its exchange region's %llu "
               "bytes", (unsigned)in->ranks[r], (unsigned long long)at,
               (unsigned long long)l.xchg_bytes);
      return DEP_ERR_PROTOCOL;
    }
  }
  /* Room for its record: a re-sent MEMBERSHIP replaces the one held. */
  const uint32_t cap = member_cap();
  if (*member_slot(in->job_id, k) == NULL && members_of(k) >= cap) {
    snprintf(why, len, "too many jobs pending from node %s: it holds %u here already "
             "(limits.max_jobs, or its share of %u records among %d peers, whichever is less); "
             "end one of its jobs first, and keep limits.max_jobs the same on every node",
             peer_name(k), cap, JOB_MEMBERS_MAX, peer_count());
    return DEP_ERR_LIMIT;
  }
  return 0;
}

static void job_on_membership(int k, const struct dep_peer_membership *in) {
  char why[DEP_MSG_TEXT_MAX - 64];
  int rc = job_membership_check(k, in, why, sizeof why);
  struct job_member **pp = member_slot(in->job_id, k);
  if (rc == 0 && *pp == NULL) {
    *pp = calloc(1, sizeof **pp);
    if (*pp == NULL) {
      rc = DEP_ERR_NO_MEMORY;
      snprintf(why, sizeof why, "node %s is out of memory for its record", peer_name(k));
    } else {
      (*pp)->peer = k;
    }
  }
  if (rc != 0) {
    job_refuse_membership(k, in, rc, why);
    return;
  }
  (*pp)->m = *in;
  /* Taken: the sender may answer its ranks once every node has said so. */
  struct dep_peer_msg ok = {.type = DEP_PEER_MEMBERSHIP_OK};
  snprintf(ok.u.job.job_id, sizeof ok.u.job.job_id, "%s", in->job_id);
  ok.u.job.owner_uid = in->owner_uid;
  (void)peer_send(k, &ok);
  uint32_t keyed = 0;
  for (uint32_t w = 0; w < in->n_windows; w++)
    keyed += in->windows[w].rkey != 0;
  log_info("job %s: node %s holds %u of its %u ranks (%u window(s), %u registered with its NIC)",
           in->job_id, peer_name(k), in->n_ranks, in->sw.world_size, in->n_windows, keyed);
  struct job *j = job_find(in->job_id);
  if (j != NULL && member_of(*pp, j))
    job_progress(j);
  else if (j != NULL)
    log_warnx("job %s: node %s holds a job of this id for uid %u, this node one for uid %u: "
              "they are two jobs, held apart", j->id, peer_name(k), (unsigned)in->owner_uid,
              (unsigned)j->owner_uid);
}

static void job_on_job_event(int k, uint16_t type, const struct dep_peer_job_event *e) {
  struct job_member **pp = member_slot(e->job_id, k);
  uint32_t first = DEP_PEER_NO_RANK;
  /* The peer's job of that id and uid is over: its record goes, another uid's stays.
   * In a running elastic job, its ranks left with it: they are masked. */
  struct job *ej = job_find(e->job_id);
  if (*pp != NULL && ej != NULL && !ej->dead && ej->ready && ej->elastic != NULL &&
      member_of(*pp, ej))
    elastic_node_lost(ej, k, &(*pp)->m);
  if (*pp != NULL && (*pp)->m.owner_uid == e->owner_uid) {
    if ((*pp)->m.n_ranks > 0)
      first = (*pp)->m.ranks[0];
    member_drop(e->job_id, k);
  }
  if (type == DEP_PEER_JOB_END)
    return;
  struct job *j = job_find(e->job_id);
  char text[4 * DEP_MSG_TEXT_MAX];
  log_escape(e->message, strlen(e->message), text, sizeof text);
  char reason[DEP_MSG_TEXT_MAX];
  snprintf(reason, sizeof reason, "%.380s", text);
  if (j == NULL || j->dead || !j->multinode || (uint32_t)j->owner_uid != e->owner_uid) {
    /* None of its ranks is here yet (or this node holds another uid's job
     * of that id): those that come later hear it (job_refuse_late). */
    if (e->rank == DEP_PEER_NO_RANK) {
      log_info("job %.64s of uid %u failed on node %s before any of its ranks attached here",
               e->job_id, (unsigned)e->owner_uid, peer_name(k));
      job_remember_failure(e->owner_uid, e->job_id, e->code, peer_name(k), reason, NULL);
    }
    return;
  }
  if (!j->ready) {
    char msg[DEP_MSG_TEXT_MAX];
    snprintf(msg, sizeof msg, "job %s failed on node %s: %.380s", j->id, peer_name(k), text);
    log_warnx("%s", msg);
    job_fail_from(j, e->code, msg, peer_name(k), reason);
    return;
  }
  uint32_t rank = e->rank != DEP_PEER_NO_RANK ? e->rank : first;
  if (rank == DEP_PEER_NO_RANK || rank >= j->world_size)
    return;
  /* A rank on another node that detached ended its part cleanly, and its
   * last blocks may still be on their way over a data connection, which
   * this notice (on the peer link) can overtake: only a death fails the
   * waits here at once.  A rank that waits for one that left early times
   * out instead. */
  if (e->detached != 0) {
    log_info("job %s: node %s says rank %u detached (%.380s)", j->id, peer_name(k), rank, text);
    return;
  }
  log_notice("job %s: node %s says rank %u is gone (%.380s)", j->id, peer_name(k), rank, text);
  struct job_rank gone = {.rank = rank};
  lend_tell_gone(j, &gone, DEP_SLAB_GONE_DIED);
  xfer_job_fail(j, DEP_ERR_PEER);
}

/* Peer k took our MEMBERSHIP of (uid, id): the job may complete on that count. */
static void job_on_membership_ok(int k, const struct dep_peer_job_event *e) {
  struct job *j = job_find(e->job_id);
  /* An answer to a MEMBERSHIP since withdrawn (a local rank left) counts for
   * nothing when it comes before we announce again; one still on its way
   * when we do is taken for the new one (a window of one round trip to
   * that peer, in which a refusal could again come after the start). */
  if (j == NULL || j->dead || j->ready || !j->multinode || !j->announced ||
      (uint32_t)j->owner_uid != e->owner_uid)
    return;
  j->accepted |= job_peer_bit(k);
  job_progress(j);
}

/* The running elastic job of (uid, id) that spans nodes, or NULL. */
static struct job *job_elastic_of(const char *id, uint32_t uid) {
  struct job *j = job_find(id);
  if (j == NULL || j->dead || !j->ready || !j->multinode || j->elastic == NULL ||
      (uint32_t)j->owner_uid != uid)
    return NULL;
  return j;
}

/* Peer k's JOB_MASK: a rank it holds of a running elastic job left or came back. */
static void job_on_mask(int k, const struct dep_peer_job_mask *m) {
  struct job *j = job_elastic_of(m->job_id, m->owner_uid);
  if (j != NULL) /* else not a running elastic job of that uid here: nothing to mask */
    elastic_on_mask(j, k, job_membership(j, k), m);
}

/* Peer k's JOB_JOINED: its answer to a rank this node brings back. */
static void job_on_joined(int k, const struct dep_peer_job_joined *m) {
  struct job *j = job_elastic_of(m->job_id, m->owner_uid);
  if (j != NULL)
    elastic_on_joined(j, k, m);
}

/* Peer k's JOB_HELD: its view of an elastic job that runs here too, as its link came up. */
static void job_on_held(int k, const struct dep_peer_job_held *m) {
  struct job *j = job_elastic_of(m->job_id, m->owner_uid);
  if (j != NULL) /* else no running elastic job of that uid here: no split to settle */
    elastic_on_held(j, k, m);
}

static void job_on_peer_msg(int k, const struct dep_peer_msg *m) {
  if (m->type == DEP_PEER_MEMBERSHIP)
    job_on_membership(k, &m->u.membership);
  else if (m->type == DEP_PEER_MEMBERSHIP_OK)
    job_on_membership_ok(k, &m->u.job);
  else if (m->type == DEP_PEER_JOB_FAIL || m->type == DEP_PEER_JOB_END)
    job_on_job_event(k, m->type, &m->u.job);
  else if (m->type == DEP_PEER_JOB_MASK)
    job_on_mask(k, &m->u.mask);
  else if (m->type == DEP_PEER_JOB_JOINED)
    job_on_joined(k, &m->u.joined);
  else if (m->type == DEP_PEER_JOB_HELD)
    job_on_held(k, &m->u.held);
}

const struct peer_events job_peer_events = {
    .up = job_on_peer_up,
    .down = job_on_peer_down,
    .job_msg = job_on_peer_msg,
};

/* Forget every peer's record (the daemon is stopping). */
void job_members_fini(void) {
  while (job_members != NULL)
    member_drop(job_members->m.job_id, job_members->peer);
}
