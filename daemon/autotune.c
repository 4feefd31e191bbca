/*
 * autotune.c — the tuning table in the running daemon (autotune.h): TUNE's
 * answer, the queue of keys met at attach, and the measurement child run
 * when the daemon is idle.
 */
#include "autotune.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "conn.h"
#include "cudadrv.h"
#include "deepepd.h"
#include "devices.h"
#include "job.h"
#include "kcache.h"
#include "kimage.h"
#include "log.h"
#include "pool.h"
#include "shape.h"
#include "stats.h"
#include "tune.h"
#include "uuid.h"
#include "warmup.h"

static struct {
  uv_loop_t *loop;
  const struct config *cfg;
  struct tune_table *table;
  uv_timer_t idle;         /* the idle check */
  bool idle_open;
  /* the measurement running, if any */
  uv_process_t proc;
  uv_pipe_t out;           /* its stdout: one "cand" line per candidate */
  uv_timer_t limit;        /* AUTOTUNE_TIMEOUT_MS */
  bool running, open, timed_out, yielded;
  struct tune_key key;
  uint8_t place[DEP_MAX_LOCAL_RANKS][16];
  uint32_t uid;            /* the owner of the job that queued the key */
  char buf[4096];
  size_t len;
  uint64_t t0;
} at;

/* ---- TUNE --------------------------------------------------------------------------- */

/* The daemon's own SM count for the pool's GPU, or 0 where it has none (the host backend). */
static uint32_t autotune_sms(const struct pool *p) {
  if (p->dev.ordinal < 0)
    return 0;
  const struct cudadrv *cu = cudadrv_load(NULL, 0);
  CUdevice d;
  int sms = 0;
  if (cu == NULL || cu->cuDeviceGet(&d, p->dev.ordinal) != CUDA_SUCCESS ||
      cu->cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d) != CUDA_SUCCESS)
    return 0;
  return sms > 0 ? (uint32_t)sms : 0;
}

static bool autotune_own_job(const struct job *j) {
  return strncmp(j->id, AUTOTUNE_JOB_PREFIX, strlen(AUTOTUNE_JOB_PREFIX)) == 0 ||
         strncmp(j->id, WARMUP_JOB_PREFIX, strlen(WARMUP_JOB_PREFIX)) == 0;
}

static void autotune_kill(void) {
  if (at.running)
    uv_process_kill(&at.proc, SIGKILL);
}

void autotune_request(struct conn *c, uint32_t request_id, const struct dep_msg_tune *m) {
  const struct job *j = c->job;
  if (j == NULL || !j->ready) {
    conn_send_error(c, request_id, DEP_ERR_STATE, "TUNE is asked by a rank of an attached job, "
                    "after its ATTACH reply; attach first");
    return;
  }
  const struct job_rank *r = &j->ranks[c->job_local_rank];
  char why[DEP_MSG_TEXT_MAX] = "";
  struct pool *p = devices_find(r->device_uuid, why, sizeof why);
  if (p == NULL) {
    conn_send_error(c, request_id, DEP_ERR_NOT_FOUND, "%s", why);
    return;
  }
  const uint32_t own = autotune_sms(p);
  if (own != 0 && own != m->sms) {
    conn_send_error(c, request_id, DEP_ERR_INVALID, "TUNE says GPU %s has %u SMs; it has %u",
                    p->dev.uuid_str, m->sms, own);
    return;
  }
  struct tune_key k = {.sms = m->sms, .world = j->world_size, .shape = j->shape};
  snprintf(k.gpu, sizeof k.gpu, "%s", p->dev.name);
  for (uint32_t i = 0; i < j->local_world_size; i++)
    k.ranks_per_gpu += memcmp(j->ranks[i].device_uuid, r->device_uuid, 16) == 0;
  struct kimage img;
  if (kimage_embedded(&img))
    snprintf(k.build, sizeof k.build, "%s", img.id);
  const struct cudadrv *cu = own != 0 ? cudadrv_load(NULL, 0) : NULL;
  if (cu != NULL)
    cu->cuDriverGetVersion(&k.driver);

  struct dep_msg_tune_ok ok = {.ctas = 0, .how = DEP_TUNE_HOW_DEFAULT};
  /* The table's entries are measured on one node; a job across nodes runs the
   * library's default for it (dep__xnode_budget), whatever an entry of its key says. */
  const bool spans = j->world_size != j->local_world_size;
  const struct tune_entry *e = at.table != NULL ? tune_lookup(at.table, &k) : NULL;
  const bool mine = autotune_own_job(j);
  if (m->env_ctas != 0) {
    ok.how = DEP_TUNE_HOW_ENV;
    ok.ctas = m->env_ctas;
  } else if (!at.cfg->adaptive_optimization || at.table == NULL || spans) {
    ok.how = DEP_TUNE_HOW_DEFAULT;
  } else if (e != NULL) {
    ok.how = DEP_TUNE_HOW_MEASURED;
    ok.ctas = e->ctas;
  } else if (own == 0) {
    ok.how = DEP_TUNE_HOW_DEFAULT; /* no GPU here to measure on (the host backend) */
  } else if (tune_failed(at.table, &k)) {
    ok.how = DEP_TUNE_HOW_FAILED;
  } else {
    ok.how = DEP_TUNE_HOW_PENDING;
  }
  /* A key met for the first time is measured when the daemon is next idle;
   * only jobs whose operations run here (one node) can be repeated. */
  if (at.cfg->adaptive_optimization && at.table != NULL && !mine && e == NULL &&
      !spans && own != 0) {
    uint8_t place[DEP_MAX_LOCAL_RANKS][16];
    for (uint32_t i = 0; i < j->local_world_size; i++)
      memcpy(place[j->ranks[i].rank], j->ranks[i].device_uuid, 16);
    if (tune_queue(at.table, &k, (const uint8_t(*)[16])place, (uint32_t)j->owner_uid))
      log_info("tuning: job %s: %s, %u rank(s) per GPU of %u: measured when deepepd is next "
               "idle", j->id, k.gpu, k.ranks_per_gpu, k.world);
  }
  /* A job's calls never share the GPU with a measurement: it yields, and runs again later. */
  if (!mine && at.running && !at.yielded) {
    log_info("tuning: job %s is starting; the measurement stops and runs again when deepepd "
             "is idle", j->id);
    at.yielded = true;
    autotune_kill();
  }
  c->tune_ctas = ok.ctas != 0 ? ok.ctas
                               : tune_default_ctas(k.sms, k.ranks_per_gpu, spans ? k.world : 0);
  c->tune_how = ok.how;
  stats_tuned(c);
  conn_send(c, DEP_MSG_TUNE_OK, request_id, &ok, NULL, 0);
}

/* ---- the measurement ---------------------------------------------------------------- */

static void autotune_closed(uv_handle_t *h) { (void)h; }

static void autotune_close_child(void) {
  if (!at.open)
    return;
  uv_close((uv_handle_t *)&at.proc, autotune_closed);
  uv_close((uv_handle_t *)&at.out, autotune_closed);
  uv_close((uv_handle_t *)&at.limit, autotune_closed);
  at.open = false;
}

static void autotune_alloc(uv_handle_t *h, size_t want, uv_buf_t *b) {
  (void)h;
  (void)want;
  size_t room = sizeof at.buf - 1 - at.len;
  *b = uv_buf_init(at.buf + at.len, (unsigned)room);
}

static void autotune_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b) {
  (void)b;
  if (n > 0)
    at.len += (size_t)n;
  else if (n < 0 || at.len >= sizeof at.buf - 1)
    uv_read_stop(s);
}

/* The child's lines into e's candidates: every candidate timed, or false. */
static bool autotune_parse(struct tune_entry *e, char *why, size_t whylen) {
  at.buf[at.len] = '\0';
  uint32_t seen = 0;
  for (char *line = strtok(at.buf, "\n"); line != NULL; line = strtok(NULL, "\n")) {
    unsigned ctas, ns[TUNE_NOPS];
    if (sscanf(line, "cand %u %u %u %u %u", &ctas, &ns[0], &ns[1], &ns[2], &ns[3]) != 5)
      continue;
    for (uint32_t i = 0; i < e->n_cands; i++)
      if (e->cands[i].ctas == ctas) {
        memcpy(e->cands[i].ns, ns, sizeof ns);
        seen |= 1u << i;
      }
  }
  if (seen == (1u << e->n_cands) - 1)
    return true;
  snprintf(why, whylen, "the measurement reported %d of %u candidates", __builtin_popcount(seen),
           e->n_cands);
  return false;
}

static void autotune_exited(uv_process_t *p, int64_t status, int sig) {
  (void)p;
  at.running = false;
  uv_timer_stop(&at.limit);
  const struct tune_key *k = &at.key;
  struct tune_entry e = {.key = *k};
  uint32_t c[TUNE_MAX_CANDS];
  e.n_cands = tune_candidates(k, c);
  for (uint32_t i = 0; i < e.n_cands; i++)
    e.cands[i].ctas = c[i];
  char why[256] = "";
  const unsigned long long ms = (uv_hrtime() - at.t0) / 1000000u;
  if (at.yielded) {
    tune_queue(at.table, k, (const uint8_t(*)[16])at.place, at.uid); /* again, when idle */
  } else if (at.timed_out || status != 0 || sig != 0 || !autotune_parse(&e, why, sizeof why)) {
    if (why[0] == '\0')
      snprintf(why, sizeof why, "%s", at.timed_out ? "it did not end in time" : "it failed");
    log_warnx("tuning: measuring %s, %u rank(s) per GPU of %u failed after %llu ms (%s; its "
              "lines above say more): jobs of that key keep the default budget until deepepd "
              "restarts", k->gpu, k->ranks_per_gpu, k->world, ms, why);
    tune_mark_failed(at.table, k);
  } else if (tune_put(at.table, &e) == 0) {
    char line[512];
    int o = 0;
    for (uint32_t i = 0; i < e.n_cands && o < (int)sizeof line; i++)
      o += snprintf(line + o, sizeof line - (size_t)o, "%s%u: %.1f/%.1f/%.1f/%.1f", i ? "; " : "",
                    e.cands[i].ctas, e.cands[i].ns[0] / 1e3, e.cands[i].ns[1] / 1e3,
                    e.cands[i].ns[2] / 1e3, e.cands[i].ns[3] / 1e3);
    log_info("tuning: %s, %u rank(s) per GPU of %u, %u tokens x %u hidden: %u CTAs per rank "
             "(default %u), measured in %llu ms (CTAs: dispatch/combine/ll_dispatch/ll_combine "
             "us: %s)", k->gpu, k->ranks_per_gpu, k->world, k->shape.max_tokens_per_rank,
             k->shape.hidden, e.ctas, e.default_ctas, ms, line);
  }
  /* What the child's jobs used goes back as if never lent (as the warm-up's), unless the
   * job that queued the key is deepepd's own user's: then the child was lent that user's
   * cached arena of the shape, and it stays cached for the user's next job. */
  for (size_t i = 0; i < devices_count() && at.uid != (uint32_t)geteuid(); i++)
    pool_forget(devices_at(i), geteuid(), dep__shape_key(&k->shape, k->world));
  autotune_close_child();
}

static void autotune_timeout(uv_timer_t *t) {
  (void)t;
  at.timed_out = true;
  autotune_kill();
}

/* Start the child for the next queued key. */
static void autotune_run(const struct tune_key *k, const uint8_t (*place)[16], uint32_t uid) {
  char num[9][16], cands[TUNE_MAX_CANDS * 8] = "", uuids[DEP_MAX_LOCAL_RANKS][37];
  uint32_t c[TUNE_MAX_CANDS];
  unsigned n = tune_candidates(k, c);
  for (unsigned i = 0; i < n; i++)
    snprintf(cands + strlen(cands), sizeof cands - strlen(cands), "%s%u", i ? "," : "", c[i]);
  const struct dep_job_shape *s = &k->shape;
  const uint32_t v[8] = {k->world, s->max_tokens_per_rank, s->hidden, s->num_experts, s->topk,
                         s->dtype, s->max_ll_tokens_per_rank, k->ranks_per_gpu};
  char *args[4 + 8 + 1 + DEP_MAX_LOCAL_RANKS + 1] = {"deepepd", "--" AUTOTUNE_CHILD_OPT,
                                                    (char *)at.cfg->socket_path};
  int a = 3;
  for (int i = 0; i < 8; i++) {
    snprintf(num[i], sizeof num[i], "%u", v[i]);
    args[a++] = num[i];
  }
  args[a++] = cands;
  for (uint32_t r = 0; r < k->world; r++) {
    dep__uuid_str(place[r], uuids[r]);
    args[a++] = uuids[r];
  }
  args[a] = NULL;
  memset(at.buf, 0, sizeof at.buf);
  at.len = 0;
  at.key = *k;
  at.uid = uid;
  memcpy(at.place, place, (size_t)k->world * 16);
  at.timed_out = at.yielded = false;
  uv_pipe_init(at.loop, &at.out, 0);
  uv_stdio_container_t io[3] = {{.flags = UV_IGNORE},
                                {.flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE,
                                 .data.stream = (uv_stream_t *)&at.out},
                                {.flags = UV_INHERIT_FD, .data.fd = 2}};
  uv_process_options_t o = {.exit_cb = autotune_exited, .file = "/proc/self/exe", .args = args,
                            .stdio_count = 3, .stdio = io};
  at.t0 = uv_hrtime();
  int rc = uv_spawn(at.loop, &at.proc, &o);
  if (rc != 0) {
    log_errx("tuning: cannot start the measurement's process: %s", uv_strerror(rc));
    uv_close((uv_handle_t *)&at.proc, autotune_closed);
    uv_close((uv_handle_t *)&at.out, autotune_closed);
    tune_mark_failed(at.table, k);
    return;
  }
  uv_read_start((uv_stream_t *)&at.out, autotune_alloc, autotune_read);
  uv_timer_init(at.loop, &at.limit);
  uv_timer_start(&at.limit, autotune_timeout, AUTOTUNE_TIMEOUT_MS, 0);
  at.running = at.open = true;
  log_info("tuning: process %d measures %s, %u rank(s) per GPU of %u, %u tokens x %u hidden: "
           "CTAs %s", at.proc.pid, k->gpu, k->ranks_per_gpu, k->world, s->max_tokens_per_rank,
           s->hidden, cands);
}

/* Idle (no job at all, nothing starting or stopping) with a key waiting: measure it. */
static void autotune_on_idle(uv_timer_t *t) {
  (void)t;
  if (at.running || at.open || deepepd.starting || deepepd.warming || deepepd.stopping ||
      deepepd.draining || job_count() != 0 || !at.cfg->adaptive_optimization)
    return;
  struct tune_key k;
  uint8_t place[DEP_MAX_LOCAL_RANKS][16];
  uint32_t uid = 0;
  if (tune_dequeue(at.table, &k, place, &uid))
    autotune_run(&k, (const uint8_t(*)[16])place, uid);
}

int autotune_start(uv_loop_t *loop, const struct config *cfg) {
  at.loop = loop;
  at.cfg = cfg;
  char why[512] = "";
  const char *dir = cfg->kernel_cache_dir;
  int32_t driver = 0;
  const struct cudadrv *cu = strcmp(devices_backend_name(), "cuda") == 0 ? cudadrv_load(NULL, 0)
                                                                         : NULL;
  if (cu != NULL)
    cu->cuDriverGetVersion(&driver);
  struct kimage img;
  const char *build = kimage_embedded(&img) ? img.id : "";
  int rc = dir[0] != '\0' ? kcache_check_dir(dir, geteuid(), why, sizeof why) : 0;
  if (rc == 0)
    rc = tune_open(dir, driver, build, &at.table, why, sizeof why);
  if (rc != 0) {
    log_errx("tuning table: %s; every rank is given the default budget", why);
    return rc;
  }
  if (cfg->adaptive_optimization)
    log_info("tuning table: %zu entr%s in %s", tune_count(at.table),
             tune_count(at.table) == 1 ? "y" : "ies", dir[0] ? dir : "memory (no kernel_cache_dir)");
  uv_timer_init(loop, &at.idle);
  uv_timer_start(&at.idle, autotune_on_idle, AUTOTUNE_IDLE_CHECK_MS, AUTOTUNE_IDLE_CHECK_MS);
  uv_unref((uv_handle_t *)&at.idle);
  at.idle_open = true;
  return 0;
}

void autotune_fini(void) {
  autotune_kill();
  at.running = false;
  autotune_close_child();
  if (at.idle_open)
    uv_close((uv_handle_t *)&at.idle, autotune_closed);
  at.idle_open = false;
  tune_close(at.table);
  at.table = NULL;
}
