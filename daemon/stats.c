/*
 * stats.c — the per-rank stats pages (stats.h, proto/stats_page.h): lent at
 * attach, read every DEP_STATS_POLL_MS on the loop, folded into histograms
 * here, the first-call check, the kept figures of ended jobs, the STATS and
 * CLIENTS replies and systemd's STATUS= summary.
 *
 * A page is another process's memory: the daemon maps it read-only once its
 * header is written, takes a ring entry only when its sequence number is
 * the one expected, and bounds every count and index it reads from it.  A
 * fold's work is bounded whatever the page holds (stats_fold_calls), and a
 * page that breaks the ring's rule (stats_page.h) is read no more.  The
 * memfd is sealed against resizing, so a rank cannot truncate it under the
 * daemon's mapping (which would make the daemon's reads fault).
 */
#include "stats.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "conn.h"
#include "deepepd.h"
#include "devices.h"
#include "job.h"
#include "log.h"
#include "notify.h"
#include "stats_page.h"

/* What the daemon keeps of one op of one rank. */
struct stats_op {
  uint64_t calls, first_ns, steady_calls, steady_sum_ns, bytes, errors, timeouts;
  uint32_t hist[DEP_STATS_BUCKETS];
  bool checked; /* the first-call check has run (once the median is known) */
};

struct stats_rank {
  uint32_t rank, local_rank, pid, uid;
  uint8_t device_uuid[16];
  uint64_t lent_ms;
  struct dep_stats_page *page; /* mapped read-only; NULL once the job ended */
  size_t page_bytes;           /* dep_stats_page_bytes(world) */
  uint32_t world;              /* the job's, which sizes the page's layout entries */
  uint64_t last_seq;           /* the newest call folded */
  uint64_t last_layout;        /* the newest layout folded */
  uint64_t dropped;
  struct stats_op ops[DEP_STATS_NOPS];
  uint64_t rejected[DEP_STATS_NOPS];
  uint32_t attached, cuda;
  uint64_t attach_ns[5];       /* total, wait, map, setup, warmup */
  /* The newest layout that ran: its tokens to each rank of the job (tokens_world of world;
   * 0 before one).  scratch is where a layout is read before it is known whole. */
  uint32_t tokens_world;
  uint32_t *tokens, *scratch;
  uint32_t tune_ctas, tune_how; /* the SM budget it was given at attach (autotune.c) */
};

struct stats_job {
  char id[DEP_JOB_ID_MAX];
  const struct job *job;       /* the live job (compared, never followed, once it may be gone) */
  uint64_t created_ns;
  uint32_t owner_uid, world, local_world_size;
  bool finished;
  uint64_t ended_ms;
  struct stats_rank *ranks[DEP_MAX_LOCAL_RANKS]; /* by local rank; NULL: not lent */
  struct stats_job *next;
};

static const struct config *stats_cfg;
static uv_loop_t *stats_loop;
static uv_timer_t stats_timer;
static bool stats_timer_open;
static struct stats_job *stats_jobs;
static uint64_t stats_warnings;
static char stats_largest_job[DEP_JOB_ID_MAX];
static uint8_t stats_largest_uuid[16];
static uint64_t stats_largest_bytes;
static char stats_status_line[256];
static unsigned stats_status_ready; /* notify_ready_count() the line was last sent under */

static uint64_t stats_now_ms(void) { return uv_now(stats_loop); }

/* ---- folding a page ------------------------------------------------------- */

static void stats_rank_unmap(struct stats_rank *r) {
  if (r->page != NULL)
    munmap(r->page, r->page_bytes);
  r->page = NULL;
}

static void stats_note(struct stats_rank *r, unsigned op, uint64_t ns, int status,
                       uint64_t bytes) {
  struct stats_op *o = &r->ops[op];
  o->calls++;
  if (status == DEP_ERR_TIMEOUT)
    o->timeouts++;
  if (status != 0) {
    o->errors++;
    return; /* a failed call's time is its failure's, not the op's */
  }
  o->bytes += bytes;
  if (o->first_ns == 0) {
    o->first_ns = ns > 0 ? ns : 1;
    return;
  }
  o->steady_calls++;
  o->steady_sum_ns += ns;
  o->hist[dep__stats_bucket(ns)]++;
}

/*
 * Whether seq may stand in slot `slot` of a ring of `ring` entries: 0 (empty),
 * or a call number that belongs there and that no process reaches
 * (DEP_STATS_SEQ_LIMIT).  An honest writer stores nothing else, even while
 * it laps the ring; a page that holds anything else is garbage, and the
 * daemon stops reading it (stats_reject) rather than search it for sense.
 */
static bool stats_seq_fits(uint64_t seq, uint32_t slot, uint32_t ring) {
  return seq == 0 || (seq % ring == slot && seq < DEP_STATS_SEQ_LIMIT);
}

/*
 * The rank's page broke the ring's rule: log it once, keep the figures
 * folded so far, and let the page go, so that whatever the rank writes
 * there from now on costs the daemon nothing (DESIGN §11).
 */
static void stats_reject(const struct stats_job *sj, struct stats_rank *r, const char *ring,
                         uint32_t slot, uint64_t seq) {
  log_warnx("job %s rank %u (pid %u): its stats page holds %s[%u] = %llu, a number that "
            "entry cannot hold; deepepd reads the page no more and keeps the rank's figures "
            "as they were (only libdeepep-client may write a stats page)",
            sj->id, r->rank, r->pid, ring, slot, (unsigned long long)seq);
  stats_rank_unmap(r);
}

/*
 * Take ring entry seq % DEP_STATS_RING if it holds call `seq`: true when
 * taken; else false, with the seq the entry held (the last one read) in
 * *held.
 */
static bool stats_take_call(struct stats_rank *r, uint64_t seq, uint64_t *held) {
  const struct dep_stats_call *e = &r->page->calls[seq % DEP_STATS_RING];
  uint64_t s1 = __atomic_load_n(&e->seq, __ATOMIC_ACQUIRE);
  *held = s1;
  if (s1 != seq)
    return false;
  struct dep_stats_call copy;
  copy.bytes = __atomic_load_n(&e->bytes, __ATOMIC_RELAXED);
  copy.ns = __atomic_load_n(&e->ns, __ATOMIC_RELAXED);
  copy.op = __atomic_load_n(&e->op, __ATOMIC_RELAXED);
  copy.status = __atomic_load_n(&e->status, __ATOMIC_RELAXED);
  atomic_thread_fence(memory_order_acquire);
  *held = __atomic_load_n(&e->seq, __ATOMIC_RELAXED);
  if (*held != seq)
    return false; /* overwritten while it was read: the writer lapped the ring */
  /* Only the communicating ops have a seq; anything else is a bad entry, counted as dropped. */
  if (copy.op != DEP_STATS_OP_LAYOUT && copy.op < DEP_STATS_NOPS)
    stats_note(r, copy.op, copy.ns, copy.status, copy.bytes);
  else
    r->dropped++;
  return true;
}

/*
 * The writer lapped the ring (more than DEP_STATS_RING calls since the last
 * read): skip to half a ring behind its newest entry, so the entries read
 * next are not the ones it overwrites next, and count the calls skipped.
 * One pass over the ring; false when an entry breaks the ring's rule (the
 * page is rejected then).
 */
static bool stats_catch_up(const struct stats_job *sj, struct stats_rank *r) {
  uint64_t newest = 0;
  for (uint32_t i = 0; i < DEP_STATS_RING; i++) {
    uint64_t s = __atomic_load_n(&r->page->calls[i].seq, __ATOMIC_ACQUIRE);
    if (!stats_seq_fits(s, i, DEP_STATS_RING)) {
      stats_reject(sj, r, "calls", i, s);
      return false;
    }
    newest = s > newest ? s : newest;
  }
  if (newest <= r->last_seq || newest - r->last_seq <= DEP_STATS_RING / 2)
    return true;
  uint64_t from = newest - DEP_STATS_RING / 2;
  r->dropped += from - r->last_seq;
  r->last_seq = from;
  return true;
}

/*
 * The calls written since the last fold, in order.  Whatever the page
 * holds, this looks at no more than DEP_STATS_RING entries for calls to
 * take and passes over the ring at most once more to catch up: a writer
 * that laps the ring again within one fold is caught up with at the next.
 */
static void stats_fold_calls(const struct stats_job *sj, struct stats_rank *r) {
  bool caught_up = false;
  for (uint32_t i = 0; i < DEP_STATS_RING; i++) {
    uint64_t want = r->last_seq + 1, held = 0;
    if (stats_take_call(r, want, &held)) {
      r->last_seq = want;
      continue;
    }
    if (!stats_seq_fits(held, (uint32_t)(want % DEP_STATS_RING), DEP_STATS_RING)) {
      stats_reject(sj, r, "calls", (uint32_t)(want % DEP_STATS_RING), held);
      return;
    }
    /* Not there: none newer yet (an empty entry, or the last lap's), or the writer lapped
     * the ring (a newer lap's). */
    if (held <= want || caught_up)
      return;
    caught_up = true;
    if (!stats_catch_up(sj, r))
      return;
  }
}

/*
 * Copy layout entry e, which says layout n, into the rank's newest: its counts into scratch
 * first, kept only when the entry still says n after the copy (else the rank rewrote it
 * meanwhile, and a newer layout is there to read at the next fold).  At most the job's world
 * of counts, whatever the entry's own world says.
 */
static void stats_take_tokens(struct stats_rank *r, struct dep_stats_layout *e, uint64_t n) {
  uint32_t world = __atomic_load_n(&e->world, __ATOMIC_RELAXED);
  if (world > r->world)
    world = r->world;
  memcpy(r->scratch, dep_stats_layout_tokens(e), (size_t)world * sizeof *r->scratch);
  atomic_thread_fence(memory_order_acquire);
  if (__atomic_load_n(&e->n, __ATOMIC_RELAXED) != n)
    return;
  uint32_t *t = r->tokens;
  r->tokens = r->scratch;
  r->scratch = t;
  r->tokens_world = world;
}

/* The layouts written since the last fold: one pass over their ring; false when an entry
 * breaks the ring's rule (the page is rejected then). */
static bool stats_fold_layouts(const struct stats_job *sj, struct stats_rank *r) {
  struct fresh {
    uint64_t n;
    uint32_t ns, slot;
    int32_t status;
  } fresh[DEP_STATS_LAYOUT_RING];
  uint32_t n = 0;
  uint64_t newest = r->last_layout;
  for (uint32_t i = 0; i < DEP_STATS_LAYOUT_RING; i++) {
    const struct dep_stats_layout *e = dep_stats_layout_at(r->page, r->world, i);
    uint64_t s1 = __atomic_load_n(&e->n, __ATOMIC_ACQUIRE);
    if (!stats_seq_fits(s1, i, DEP_STATS_LAYOUT_RING)) {
      stats_reject(sj, r, "layouts", i, s1);
      return false;
    }
    if (s1 <= r->last_layout)
      continue;
    struct fresh c = {.n = s1, .slot = i};
    c.ns = __atomic_load_n(&e->ns, __ATOMIC_RELAXED);
    c.status = __atomic_load_n(&e->status, __ATOMIC_RELAXED);
    atomic_thread_fence(memory_order_acquire);
    if (__atomic_load_n(&e->n, __ATOMIC_RELAXED) != s1)
      continue;
    fresh[n++] = c;
    newest = s1 > newest ? s1 : newest;
  }
  /* Oldest first, so that the first layout is the one timed as first. */
  for (uint32_t i = 1; i < n; i++)
    for (uint32_t k = i; k > 0 && fresh[k - 1].n > fresh[k].n; k--) {
      struct fresh t = fresh[k];
      fresh[k] = fresh[k - 1];
      fresh[k - 1] = t;
    }
  uint64_t expect = r->last_layout + 1;
  for (uint32_t i = 0; i < n; i++) {
    if (fresh[i].n > expect)
      r->dropped += fresh[i].n - expect;
    expect = fresh[i].n + 1;
    stats_note(r, DEP_STATS_OP_LAYOUT, fresh[i].ns, fresh[i].status, 0);
  }
  /* The counts of the newest that ran: what the load-balance figures read. */
  for (uint32_t i = n; i-- > 0;)
    if (fresh[i].status == 0) {
      stats_take_tokens(r, dep_stats_layout_at(r->page, r->world, fresh[i].slot), fresh[i].n);
      break;
    }
  r->last_layout = newest;
  return true;
}

static void stats_check_first(const struct stats_job *sj, struct stats_rank *r) {
  const double ratio = stats_cfg->warn_first_call_ratio;
  for (unsigned op = 0; op < DEP_STATS_NOPS; op++) {
    struct stats_op *o = &r->ops[op];
    if (o->checked || o->first_ns == 0 || o->steady_calls < STATS_WARN_MIN_STEADY)
      continue;
    o->checked = true;
    uint64_t med = dep__stats_quantile(o->hist, o->steady_calls, 0.5);
    if (med == 0 || (double)o->first_ns <= ratio * (double)med)
      continue;
    stats_warnings++;
    log_warnx("job %s rank %u: the first %s took %.3f ms, %.1f x its steady median of %.3f ms "
              "(warn_first_call_ratio %g); check that kernel_warmup is on and that the job's "
              "buffers were touched before it (on the host backend a call right after "
              "dep_attach also finishes the library's warm-up; deepepctl stats %s)",
              sj->id, r->rank, dep__stats_op_name(op), (double)o->first_ns / 1e6,
              (double)o->first_ns / (double)med, (double)med / 1e6, ratio, sj->id);
  }
}

static void stats_fold(struct stats_job *sj, struct stats_rank *r) {
  if (r->page == NULL)
    return;
  const struct dep_stats_page *p = r->page;
  if (!r->attached && __atomic_load_n(&p->attached, __ATOMIC_ACQUIRE) == 1) {
    r->attached = 1;
    r->cuda = __atomic_load_n(&p->backend_cuda, __ATOMIC_RELAXED) != 0;
    r->attach_ns[0] = __atomic_load_n(&p->attach_total_ns, __ATOMIC_RELAXED);
    r->attach_ns[1] = __atomic_load_n(&p->attach_wait_ns, __ATOMIC_RELAXED);
    r->attach_ns[2] = __atomic_load_n(&p->attach_map_ns, __ATOMIC_RELAXED);
    r->attach_ns[3] = __atomic_load_n(&p->attach_setup_ns, __ATOMIC_RELAXED);
    r->attach_ns[4] = __atomic_load_n(&p->attach_warmup_ns, __ATOMIC_RELAXED);
  }
  for (unsigned op = 0; op < DEP_STATS_NOPS; op++)
    r->rejected[op] = __atomic_load_n(&p->rejected[op], __ATOMIC_RELAXED);
  if (stats_fold_layouts(sj, r))
    stats_fold_calls(sj, r);
  stats_check_first(sj, r);
}

/* ---- jobs that end --------------------------------------------------------- */

static void stats_rank_free(struct stats_rank *r) {
  if (r == NULL)
    return;
  stats_rank_unmap(r);
  free(r->tokens);
  free(r->scratch);
  free(r);
}

static void stats_job_free(struct stats_job *sj) {
  for (uint32_t i = 0; i < DEP_MAX_LOCAL_RANKS; i++)
    stats_rank_free(sj->ranks[i]);
  free(sj);
}

/* Whether the job sj describes is still in the job table. */
static bool stats_job_alive(const struct stats_job *sj) {
  const struct job *j = job_lookup(sj->id);
  return j != NULL && j == sj->job && j->created_ns == sj->created_ns && !j->dead;
}

/* Fold a last time and let the pages go: the figures are all that is kept. */
static void stats_job_end(struct stats_job *sj) {
  for (uint32_t i = 0; i < DEP_MAX_LOCAL_RANKS; i++) {
    if (sj->ranks[i] == NULL)
      continue;
    stats_fold(sj, sj->ranks[i]);
    stats_rank_unmap(sj->ranks[i]);
  }
  sj->finished = true;
  sj->job = NULL;
  sj->ended_ms = stats_now_ms();
}

/* Drop ended jobs past STATS_KEEP_S, and the oldest beyond STATS_KEEP_JOBS. */
static void stats_prune(void) {
  uint32_t kept = 0;
  uint64_t now = stats_now_ms();
  /* Newest first in the list: count from the head. */
  for (struct stats_job **pp = &stats_jobs; *pp != NULL;) {
    struct stats_job *sj = *pp;
    if (sj->finished && (++kept > STATS_KEEP_JOBS || now - sj->ended_ms > STATS_KEEP_S * 1000ull)) {
      *pp = sj->next;
      stats_job_free(sj);
      continue;
    }
    pp = &sj->next;
  }
}

/* ---- systemd's STATUS= -------------------------------------------------------- */

/* The line as it reads for this many jobs, ranks and warnings. */
static void stats_status(char *line, size_t len, uint32_t jobs, uint32_t ranks,
                         uint64_t warnings) {
  snprintf(line, len, "%s on %s: %u job(s), %u rank(s) reporting, %llu first-call warning(s)",
           deepepd_state_name(), deepepd.cfg.socket_path, jobs, ranks,
           (unsigned long long)warnings);
}

/*
 * After READY=1 (main.c's own STATUS= then says what the start found, e.g.
 * the peers missing), the summary goes out once it says something that the
 * idle daemon's would not, and then whenever it changes.
 */
static void stats_notify(void) {
  unsigned ready = notify_ready_count();
  if (ready == 0 || deepepd.stopping)
    return;
  if (ready != stats_status_ready) {
    stats_status_ready = ready;
    stats_status(stats_status_line, sizeof stats_status_line, 0, 0, 0);
  }
  uint32_t ranks = 0;
  for (struct stats_job *sj = stats_jobs; sj != NULL; sj = sj->next) {
    if (sj->finished)
      continue;
    for (uint32_t i = 0; i < sj->local_world_size; i++)
      ranks += sj->ranks[i] != NULL;
  }
  char line[sizeof stats_status_line];
  stats_status(line, sizeof line, job_count(), ranks, stats_warnings);
  if (strcmp(line, stats_status_line) == 0)
    return;
  snprintf(stats_status_line, sizeof stats_status_line, "%s", line);
  notify_send("STATUS=%s", line);
}

static void stats_on_timer(uv_timer_t *t) {
  (void)t;
  for (struct stats_job *sj = stats_jobs; sj != NULL; sj = sj->next) {
    if (sj->finished)
      continue;
    if (!stats_job_alive(sj)) {
      stats_job_end(sj);
      continue;
    }
    for (uint32_t i = 0; i < sj->local_world_size; i++)
      if (sj->ranks[i] != NULL)
        stats_fold(sj, sj->ranks[i]);
  }
  stats_prune();
  stats_notify();
}

/* ---- STATS_LEND ------------------------------------------------------------- */

static struct stats_job *stats_job_of(const struct job *j) {
  for (struct stats_job *sj = stats_jobs; sj != NULL; sj = sj->next)
    if (!sj->finished && sj->job == j && sj->created_ns == j->created_ns)
      return sj;
  struct stats_job *sj = calloc(1, sizeof *sj);
  if (sj == NULL)
    return NULL;
  snprintf(sj->id, sizeof sj->id, "%s", j->id);
  sj->job = j;
  sj->created_ns = j->created_ns;
  sj->owner_uid = (uint32_t)j->owner_uid;
  sj->world = j->world_size;
  sj->local_world_size = j->local_world_size;
  sj->next = stats_jobs;
  stats_jobs = sj;
  return sj;
}

/* The arena this job was lent on the rank's device: its local ranks there x the stride. */
static void stats_note_arena(const struct job *j, const uint8_t *uuid) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < j->local_world_size; i++)
    n += memcmp(j->ranks[i].device_uuid, uuid, 16) == 0;
  uint64_t bytes = n * j->slab_bytes;
  if (bytes <= stats_largest_bytes)
    return;
  stats_largest_bytes = bytes;
  snprintf(stats_largest_job, sizeof stats_largest_job, "%s", j->id);
  memcpy(stats_largest_uuid, uuid, 16);
}

/* A sealed memfd of one page of `bytes` (dep_stats_page_bytes of the job's world), its header
 * written, mapped read-only here. */
static int stats_make_page(const struct job *j, uint32_t local_rank, size_t bytes, int *fd_out,
                           struct dep_stats_page **map_out) {
  int fd = memfd_create("deepepd-stats", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return -1;
  struct dep_stats_page *w = MAP_FAILED;
  if (ftruncate(fd, (off_t)bytes) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
      (w = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
          MAP_FAILED) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  w->magic = DEP_STATS_MAGIC;
  w->version = DEP_STATS_VERSION;
  w->bytes = (uint32_t)bytes;
  w->world = j->world_size;
  w->rank = j->ranks[local_rank].rank;
  w->local_rank = local_rank;
  /* From here the daemon only reads it: a stray write of ours cannot race the rank's. */
  if (mprotect(w, bytes, PROT_READ) != 0) {
    int e = errno;
    munmap(w, bytes);
    close(fd);
    errno = e;
    return -1;
  }
  *fd_out = fd;
  *map_out = w;
  return 0;
}

/* Let go of the pages of jobs that ended (the timer does this too, every tick). */
static void stats_sweep(void) {
  for (struct stats_job *sj = stats_jobs; sj != NULL; sj = sj->next)
    if (!sj->finished && !stats_job_alive(sj))
      stats_job_end(sj);
  stats_prune();
}

void stats_lend(struct conn *c, uint32_t request_id) {
  const struct job *j = c->job;
  /* A job that ended since the last tick gives its pages back before a new one is made,
   * so that jobs in quick succession hold no more pages than the ranks running. */
  stats_sweep();
  if (j == NULL || !j->ready) {
    conn_send_error(c, request_id, DEP_ERR_STATE,
                    "STATS_LEND: this connection is no rank of a running job; attach first");
    return;
  }
  struct stats_job *sj = stats_job_of(j);
  if (sj == NULL) {
    conn_send_error(c, request_id, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
    return;
  }
  uint32_t lr = c->job_local_rank;
  /* A process that took the place of a rank that left an elastic job (job.c) gets a page of
   * its own: the one there was its predecessor's. */
  if (lr < DEP_MAX_LOCAL_RANKS && sj->ranks[lr] != NULL && j->elastic != NULL &&
      sj->ranks[lr]->pid != (uint32_t)c->pid) {
    stats_rank_free(sj->ranks[lr]);
    sj->ranks[lr] = NULL;
  }
  if (lr >= DEP_MAX_LOCAL_RANKS || sj->ranks[lr] != NULL) {
    conn_send_error(c, request_id, DEP_ERR_STATE,
                    "STATS_LEND: local rank %u of job %s already has its stats page", lr, j->id);
    return;
  }
  struct stats_rank *r = calloc(1, sizeof *r);
  int fd = -1;
  if (r != NULL) {
    r->world = j->world_size;
    r->page_bytes = dep_stats_page_bytes(r->world);
    r->tokens = calloc(r->world, sizeof *r->tokens);
    r->scratch = calloc(r->world, sizeof *r->scratch);
  }
  if (r == NULL || r->tokens == NULL || r->scratch == NULL ||
      stats_make_page(j, lr, r->page_bytes, &fd, &r->page) != 0) {
    int e = errno;
    stats_rank_free(r);
    log_warnx("job %s: cannot make local rank %u's stats page: %s; the rank runs without stats",
              j->id, lr, strerror(e));
    conn_send_error(c, request_id, DEP_ERR_NO_MEMORY,
                    "deepepd cannot make a stats page (%s); the rank runs without one",
                    strerror(e));
    return;
  }
  r->rank = j->ranks[lr].rank;
  r->local_rank = lr;
  r->pid = (uint32_t)c->pid;
  r->uid = (uint32_t)c->uid;
  memcpy(r->device_uuid, j->ranks[lr].device_uuid, 16);
  r->lent_ms = stats_now_ms();
  r->tune_ctas = c->tune_ctas; /* TUNE came before: the budget is chosen before any launch */
  r->tune_how = c->tune_how;
  sj->ranks[lr] = r;
  stats_note_arena(j, r->device_uuid);
  struct dep_msg_lend_ok ok = {.version = DEP_STATS_VERSION, .bytes = (uint32_t)r->page_bytes};
  conn_send(c, DEP_MSG_STATS_LEND_OK, request_id, &ok, &fd, 1);
  close(fd); /* conn_send sends its own duplicate */
}

void stats_tuned(const struct conn *c) {
  const struct job *j = c->job;
  for (struct stats_job *sj = stats_jobs; sj != NULL && j != NULL; sj = sj->next)
    if (!sj->finished && sj->job == j && sj->created_ns == j->created_ns &&
        c->job_local_rank < DEP_MAX_LOCAL_RANKS && sj->ranks[c->job_local_rank] != NULL) {
      sj->ranks[c->job_local_rank]->tune_ctas = c->tune_ctas;
      sj->ranks[c->job_local_rank]->tune_how = c->tune_how;
    }
}

/* ---- STATS ----------------------------------------------------------------------- */

static bool stats_may_see(uid_t viewer, uint32_t owner) {
  return viewer == 0 || viewer == getuid() || (uint32_t)viewer == owner;
}

static void stats_fill_rank(const struct stats_job *sj, const struct stats_rank *r,
                            struct dep_msg_stats_rank *m) {
  memset(m, 0, sizeof *m);
  snprintf(m->job_id, sizeof m->job_id, "%s", sj->id);
  m->rank = r->rank;
  m->local_rank = r->local_rank;
  m->world = sj->world;
  m->pid = r->pid;
  m->uid = r->uid;
  memcpy(m->device_uuid, r->device_uuid, 16);
  m->finished = sj->finished;
  m->cuda = r->cuda;
  uint64_t now = stats_now_ms();
  m->age_ms = now - r->lent_ms;
  m->ended_ms = sj->finished ? now - sj->ended_ms : 0;
  m->attached = r->attached;
  m->attach_total_ns = r->attach_ns[0];
  m->attach_wait_ns = r->attach_ns[1];
  m->attach_map_ns = r->attach_ns[2];
  m->attach_setup_ns = r->attach_ns[3];
  m->attach_warmup_ns = r->attach_ns[4];
  m->dropped = r->dropped;
  for (unsigned op = 0; op < DEP_STATS_NOPS; op++) {
    const struct stats_op *o = &r->ops[op];
    struct dep_msg_stats_op *w = &m->ops[op];
    w->calls = o->calls;
    w->first_ns = o->first_ns;
    w->steady_calls = o->steady_calls;
    w->median_ns = dep__stats_quantile(o->hist, o->steady_calls, 0.5);
    w->p99_ns = dep__stats_quantile(o->hist, o->steady_calls, 0.99);
    w->steady_sum_ns = o->steady_sum_ns;
    w->bytes = o->bytes;
    w->errors = o->errors + r->rejected[op];
    w->timeouts = o->timeouts;
  }
  m->layouts = r->last_layout;
  m->tokens_world = r->tokens_world;
  m->tokens = r->tokens_world > 0 ? r->tokens : NULL; /* the daemon's own: sent, never freed */
  m->kernel_ctas = r->tune_ctas;
  m->ctas_how = r->tune_how;
}

/* STATS_OK's figures but the count of ranks: what every answer ends with. */
static void stats_fill_ok(struct dep_msg_stats_ok *ok) {
  memset(ok, 0, sizeof *ok);
  ok->keep_jobs = STATS_KEEP_JOBS;
  ok->keep_s = STATS_KEEP_S;
  ok->warn_ratio_milli = (uint32_t)(stats_cfg->warn_first_call_ratio * 1000.0 + 0.5);
  ok->largest_bytes = stats_largest_bytes;
  snprintf(ok->largest_job, sizeof ok->largest_job, "%s", stats_largest_job);
  memcpy(ok->largest_uuid, stats_largest_uuid, 16);
  ok->warnings = stats_warnings;
  for (struct stats_job *sj = stats_jobs; sj != NULL; sj = sj->next)
    ok->finished_jobs += sj->finished;
  /* The pools are the devices' worker's while they are made: read them once they are done. */
  for (size_t i = 0; !deepepd.starting && i < devices_count() && i < DEP_STATS_WIRE_POOLS; i++) {
    const struct pool *p = devices_at(i);
    memcpy(ok->pools[i].uuid, p->dev.uuid, sizeof ok->pools[i].uuid);
    ok->pools[i].made_bytes = p->made_bytes;
    ok->n_pools = (uint32_t)i + 1;
  }
}

/* Fresh figures: what the ranks of a running job wrote since the last tick counts too. */
static void stats_refresh(struct stats_job *sj) {
  if (!sj->finished && stats_job_alive(sj))
    for (uint32_t i = 0; i < sj->local_world_size; i++)
      if (sj->ranks[i] != NULL)
        stats_fold(sj, sj->ranks[i]);
}

void stats_reply(struct conn *c, uint32_t request_id, const struct dep_msg_stats_req *req) {
  if (req->job_id[0] != '\0') {
    char why[DEP_MSG_TEXT_MAX];
    if (proto_check_job_id(req->job_id, why, sizeof why) != 0) {
      conn_send_error(c, request_id, DEP_ERR_INVALID, "STATS: %s", why);
      return;
    }
  }
  struct dep_msg_stats_rank *m = malloc(sizeof *m);
  if (m == NULL) {
    conn_send_error(c, request_id, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
    return;
  }
  struct dep_msg_stats_ok ok;
  bool found = false;
  uint32_t ranks = 0, left_out = 0;
  /* The counts of every rank of every job kept could pass what the connection may queue (the
   * reply is queued whole before the loop writes it): they take a quarter of it at most (the
   * frames' other fields and whatever else waits for the client take the rest), the newest
   * jobs' first, and the ranks past it go without theirs, said in STATS_OK. */
  uint64_t budget = deepepd.cfg.client_queue_bytes / 4;
  for (struct stats_job *sj = stats_jobs; sj != NULL; sj = sj->next) {
    if (!stats_may_see(c->uid, sj->owner_uid) ||
        (req->job_id[0] != '\0' && strcmp(req->job_id, sj->id) != 0))
      continue;
    found = true;
    stats_refresh(sj);
    for (uint32_t i = 0; i < sj->local_world_size; i++) {
      if (sj->ranks[i] == NULL)
        continue;
      stats_fill_rank(sj, sj->ranks[i], m);
      uint64_t need = (uint64_t)m->tokens_world * sizeof *m->tokens;
      if (need > budget) {
        m->tokens_world = 0;
        m->tokens = NULL;
        left_out++;
      } else {
        budget -= need;
      }
      if (conn_send(c, DEP_MSG_STATS_RANK, request_id, m, NULL, 0) != 0) {
        free(m);
        return; /* the connection is closed: its queue was full */
      }
      ranks++;
    }
  }
  free(m);
  if (req->job_id[0] != '\0' && !found) {
    conn_send_error(c, request_id, DEP_ERR_NOT_FOUND,
                    "no stats for job \"%s\": it is not running here, or ended more than %u s "
                    "ago, or is not yours; deepepctl stats lists the jobs that have them",
                    req->job_id, STATS_KEEP_S);
    return;
  }
  stats_fill_ok(&ok);
  ok.ranks = ranks;
  ok.tokens_left_out = left_out;
  conn_send(c, DEP_MSG_STATS_OK, request_id, &ok, NULL, 0);
}

int stats_snapshot(struct dep_msg_stats_rank **ranks, uint32_t *n, struct dep_msg_stats_ok *ok) {
  uint32_t count = 0;
  for (struct stats_job *sj = stats_jobs; sj != NULL; sj = sj->next)
    for (uint32_t i = 0; i < sj->local_world_size; i++)
      count += sj->ranks[i] != NULL;
  struct dep_msg_stats_rank *m = calloc((size_t)count + 1, sizeof *m);
  if (m == NULL)
    return DEP_ERR_NO_MEMORY;
  uint32_t k = 0;
  for (struct stats_job *sj = stats_jobs; sj != NULL; sj = sj->next) {
    stats_refresh(sj);
    for (uint32_t i = 0; i < sj->local_world_size && k < count; i++)
      if (sj->ranks[i] != NULL)
        stats_fill_rank(sj, sj->ranks[i], &m[k++]);
  }
  stats_fill_ok(ok);
  ok->ranks = k;
  *ranks = m;
  *n = k;
  return 0;
}

/* ---- CLIENTS ---------------------------------------------------------------------- */

void stats_clients(struct conn *c, uint32_t request_id) {
  struct dep_msg_clients m = {0};
  m.clients = calloc(DEP_CLIENTS_MAX, sizeof *m.clients);
  if (m.clients == NULL) {
    conn_send_error(c, request_id, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
    return;
  }
  uint64_t now_ns = uv_hrtime(), now_ms = stats_now_ms();
  for (struct conn *x = conn_first(); x != NULL; x = x->next) {
    if (!conn_open(x) || !stats_may_see(c->uid, (uint32_t)x->uid))
      continue;
    if (m.n == DEP_CLIENTS_MAX) {
      m.left_out++;
      continue;
    }
    struct dep_msg_client *e = &m.clients[m.n++];
    e->pid = (uint32_t)x->pid;
    e->uid = (uint32_t)x->uid;
    snprintf(e->name, sizeof e->name, "%s", x->name);
    e->connected_ms = now_ms - x->connected_ms;
    const struct job *j = x->job;
    if (j == NULL || x->job_local_rank >= j->local_world_size)
      continue;
    snprintf(e->job_id, sizeof e->job_id, "%s", j->id);
    e->rank = j->ranks[x->job_local_rank].rank;
    e->local_rank = x->job_local_rank;
    memcpy(e->device_uuid, j->ranks[x->job_local_rank].device_uuid, 16);
    e->attached = j->ready;
    e->attached_ms = j->ready && now_ns > j->ready_ns ? (now_ns - j->ready_ns) / 1000000u : 0;
  }
  conn_send(c, DEP_MSG_CLIENTS_OK, request_id, &m, NULL, 0);
  free(m.clients);
}

/* ---- init / fini ------------------------------------------------------------------ */

void stats_init(uv_loop_t *loop, const struct config *cfg) {
  stats_cfg = cfg;
  stats_loop = loop;
  uv_timer_init(loop, &stats_timer);
  uv_timer_start(&stats_timer, stats_on_timer, DEP_STATS_POLL_MS, DEP_STATS_POLL_MS);
  uv_unref((uv_handle_t *)&stats_timer);
  stats_timer_open = true;
}

void stats_fini(void) {
  if (stats_timer_open) {
    uv_close((uv_handle_t *)&stats_timer, NULL);
    stats_timer_open = false;
  }
  while (stats_jobs != NULL) {
    struct stats_job *sj = stats_jobs;
    stats_jobs = sj->next;
    stats_job_free(sj);
  }
}
