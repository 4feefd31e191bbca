/*
 * statsranks.c — the stats suites' rank processes and Prometheus parser
 * (statsranks.h).
 */
#include "statsranks.h"

#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "stats_page.h"

const struct dep_job_shape st_shape = {.max_tokens_per_rank = ST_TOKENS,
                                              .hidden = ST_HIDDEN,
                                              .num_experts = ST_EXPERTS,
                                              .topk = ST_TOPK,
                                              .max_ll_tokens_per_rank = ST_LL,
                                              .dtype = DEP_DTYPE_BF16};

static int st_rank_run(dep_client_t *c, const struct st_plan *p, char *msg, size_t len) {
  const struct dep_job_shape *s = &p->shape;
  const uint32_t T = s->max_tokens_per_rank, H = s->hidden, K = s->topk, E = s->num_experts;
  const uint32_t L = s->max_ll_tokens_per_rank, le = E / ST_W;
  uint16_t *x = calloc((size_t)T * H, 2), *rx = calloc((size_t)ST_W * T * H, 2);
  uint16_t *out = calloc((size_t)T * H, 2);
  uint16_t *lrx = calloc((size_t)le * ST_W * L * H, 2);
  int64_t *idx = calloc((size_t)T * K, 8);
  float *w = calloc((size_t)T * K, 4), *rw = calloc((size_t)ST_W * T * K, 4);
  int32_t *ridx = calloc((size_t)ST_W * T * K, 4), *cnt = calloc(E, 4), *lcnt = calloc(E, 4);
  int32_t tpr[ST_W], *tpe = calloc(E, 4);
  uint8_t *tir = calloc((size_t)T * ST_W, 1);
  for (uint32_t t = 0; t < T; t++)
    for (uint32_t k = 0; k < K; k++) {
      idx[(size_t)t * K + k] = p->to_rank0 ? (int64_t)k % le : (int64_t)((t + k * le) % E);
      w[(size_t)t * K + k] = 0.5f;
    }
  dep_handle_t *h = NULL;
  int rc = dep_handle_new(c, &h);
#define ST_CALL(what, expr)                                                      \
  if (rc == 0 && (rc = (expr)) != 0)                                             \
    snprintf(msg, len, "%s: %s: %s", what, dep_errname(rc), dep_errmsg(c));
  for (uint32_t i = 0; i < p->layouts && rc == 0; i++) {
    struct dep_layout_args a = {sizeof(struct dep_layout_args), idx, DEP_INDEX_I64, T, tpr, tpe,
                                tir};
    ST_CALL("dep_layout", dep_layout(c, &a, NULL));
  }
  for (uint32_t i = 0; i < p->pairs && rc == 0; i++) {
    uint32_t n = i == 0 ? (p->first_tokens != 0 ? p->first_tokens : T)
                        : (p->tokens != 0 ? p->tokens : T), nr = 0;
    struct dep_dispatch_args d = {.size = sizeof(struct dep_dispatch_args), .x = x, .topk_idx = idx,
                                  .index_type = DEP_INDEX_I64, .topk_weights = w, .num_tokens = n,
                                  .recv_x = rx, .recv_topk_idx = ridx, .recv_topk_weights = rw,
                                  .recv_count_per_expert = cnt, .num_recv = &nr};
    ST_CALL("dep_dispatch", dep_dispatch(c, &d, h, NULL));
    struct dep_combine_args cb = {.size = sizeof(struct dep_combine_args), .x = rx, .out = out};
    ST_CALL("dep_combine", dep_combine(c, &cb, h, NULL));
  }
  for (uint32_t i = 0; i < p->ll_pairs && rc == 0; i++) {
    struct dep_ll_dispatch_args d = {sizeof(struct dep_ll_dispatch_args), x, idx, DEP_INDEX_I64, L,
                                     0, lrx, NULL, lcnt, 0, NULL};
    ST_CALL("dep_ll_dispatch", dep_ll_dispatch(c, &d, h, NULL));
    struct dep_ll_combine_args cb = {sizeof(struct dep_ll_combine_args), lrx, idx, DEP_INDEX_I64, w,
                                     out, 0, NULL};
    ST_CALL("dep_ll_combine", dep_ll_combine(c, &cb, h, NULL));
  }
  for (uint32_t i = 0; i < p->bad && rc == 0; i++) {
    uint32_t nr = 0;
    struct dep_dispatch_args d = {.size = sizeof(struct dep_dispatch_args), .x = x, .topk_idx = idx,
                                  .index_type = DEP_INDEX_I64, .topk_weights = w,
                                  .num_tokens = T + 1, .recv_x = rx, .recv_topk_idx = ridx,
                                  .recv_topk_weights = rw, .recv_count_per_expert = cnt,
                                  .num_recv = &nr};
    if (dep_dispatch(c, &d, h, NULL) != DEP_ERR_INVALID) {
      snprintf(msg, len, "a dispatch of %u tokens (bound %u) was not DEP_ERR_INVALID", T + 1, T);
      rc = DEP_ERR_INTERNAL;
    }
  }
#undef ST_CALL
  dep_handle_free(h);
  free(x), free(rx), free(out), free(lrx), free(idx), free(w), free(rw), free(ridx), free(cnt);
  free(lcnt), free(tpe), free(tir);
  return rc;
}

/* A rank: attach rank `rank` of job, run the plan, report "ok" or the failure, wait for the
 * word, detach. */
static void st_spawn(struct st_rank *r, const struct tu_daemon *d, const char *job,
                     uint32_t rank, const struct st_plan *plan) {
  dw_child_fork(&r->proc);
  if (r->proc.pid == 0) {
    struct st_plan p = *plan;
    if (p.shape.hidden == 0)
      p.shape = st_shape;
    struct dep_attach_args a = {.size = sizeof a,
                                .rank = rank, .world_size = ST_W, .local_rank = rank,
                                .local_world_size = ST_W, .shape = p.shape};
    snprintf(a.job_id, sizeof a.job_id, "%s", job);
    char msg[400] = "ok";
    dep_client_t *c = NULL;
    int rc = dep_client_new(&c);
    if (rc == 0 && (rc = dep_connect(c, d->sock)) == 0 && (rc = dep_attach(c, &a)) != 0)
      snprintf(msg, sizeof msg, "dep_attach: %s", dep_errmsg(c));
    if (rc == 0)
      rc = st_rank_run(c, &p, msg, sizeof msg);
    if (write(r->proc.rep, msg, strlen(msg) + 1) < 0)
      _exit(3);
    char g;
    if (read(r->proc.go, &g, 1) != 1)
      _exit(0);
    if (rc == 0)
      dep_detach(c);
    dep_client_free(c);
    _exit(rc == 0 ? 0 : 1);
  }
}

/* The rank ran its plan. */
static void st_ran(struct st_rank *r) {
  char msg[400] = "";
  ssize_t n = read(r->proc.rep, msg, sizeof msg - 1);
  ck_assert_msg(n > 0, "rank pid %d exited before reporting", (int)r->proc.pid);
  ck_assert_msg(strcmp(msg, "ok") == 0, "rank pid %d: %s", (int)r->proc.pid, msg);
}

static void st_finish(struct st_rank *r, bool kill9) {
  if (kill9)
    kill(r->proc.pid, SIGKILL);
  else
    ck_assert_int_eq(write(r->proc.go, "g", 1), 1);
  int st = 0;
  ck_assert_int_eq(waitpid(r->proc.pid, &st, 0), r->proc.pid);
  if (!kill9)
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank pid %d: status 0x%x",
                  (int)r->proc.pid, st);
  close(r->proc.rep);
  close(r->proc.go);
}

void st_job_start(struct st_rank r[ST_W], const struct tu_daemon *d, const char *job,
                  const struct st_plan *plan) {
  for (uint32_t i = 0; i < ST_W; i++)
    st_spawn(&r[i], d, job, i, plan);
  for (uint32_t i = 0; i < ST_W; i++)
    st_ran(&r[i]);
}

void st_job_end(struct st_rank r[ST_W], bool kill9) {
  for (uint32_t i = 0; i < ST_W; i++)
    st_finish(&r[i], kill9);
}

/* A Prometheus parser's reading of the file: the families and samples it found, or why not. */
static const char st_parse_py[] =
    "import sys\n"
    "from prometheus_client.parser import text_string_to_metric_families\n"
    "fams = {f.name: f for f in text_string_to_metric_families(open(sys.argv[1]).read())}\n"
    "seen = set()\n"
    "for f in fams.values():\n"
    "    for s in f.samples:\n"
    "        key = (s.name, tuple(sorted(s.labels.items())))\n"
    "        assert key not in seen, ('a series named twice', key)\n"
    "        seen.add(key)\n"
    "calls = [s for s in fams['deepep_op_calls'].samples if s.labels['op'] == 'dispatch']\n"
    "assert len(calls) == 2, calls\n"
    "assert all(s.value == 10 for s in calls), calls\n"
    "assert all(set(s.labels) == {'ep_job', 'rank', 'op', 'device'} for s in calls), calls\n"
    "lat = fams['deepep_op_latency_seconds']\n"
    "assert lat.type == 'summary', lat.type\n"
    "q = [s for s in lat.samples if s.labels.get('quantile') == '0.5']\n"
    "assert q and all(s.value > 0 for s in q), lat.samples\n"
    "assert fams['deepep_pool_bytes'].type == 'gauge'\n"
    "assert fams['deepep_daemon_up'].samples[0].value == 1\n"
    "print('parsed', len(fams), 'families')\n";

int st_prometheus_parse(const char *dir, const char *name, const char *text, char **said) {
  char prom[300], py[300], res[300], cmd[1200];
  dw_sfmt(prom, sizeof prom, "%s/%s", dir, name);
  dw_sfmt(py, sizeof py, "%s/parse.py", dir);
  dw_sfmt(res, sizeof res, "%s/parse.out", dir);
  ck_assert_int_eq(tu_write_file(prom, text), 0);
  ck_assert_int_eq(tu_write_file(py, st_parse_py), 0);
  dw_sfmt(cmd, sizeof cmd, "/usr/bin/python3 %s %s > %s 2>&1", py, prom, res);
  int rc = system(cmd);
  *said = dw_slurp(res);
  return rc;
}

int st_ctl(const char *dir, char **out, const char *const *args) {
  return dw_run_ctl(NULL, dir, out, args);
}

/* STATS for job: its ranks' records into out[] (by rank), their count returned. */
uint32_t st_fetch(const struct tu_daemon *d, const char *job,
                  struct dep_msg_stats_rank out[ST_W], struct dep_msg_stats_ok *ok) {
  int fd = dw_client(d);
  struct dep_msg_stats_req req;
  memset(&req, 0, sizeof req);
  snprintf(req.job_id, sizeof req.job_id, "%s", job);
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_STATS, 7, &req), 0);
  struct dw_frame *f = dw_frame_new();
  uint32_t n = 0;
  for (;;) {
    ck_assert_int_eq(dw_recv_frame(fd, f, 5000), 0);
    ck_assert_uint_eq(f->h.request_id, 7);
    if (f->h.type == DEP_MSG_STATS_OK) {
      ck_assert_int_eq(proto_decode_stats_ok(f->body, f->h.body_len, ok), 0);
      break;
    }
    ck_assert_msg(f->h.type == DEP_MSG_STATS_RANK, "got %s", proto_type_name(f->h.type));
    struct dep_msg_stats_rank r;
    ck_assert_int_eq(proto_decode_stats_rank(f->body, f->h.body_len, &r), 0);
    ck_assert_str_eq(r.job_id, job);
    ck_assert_uint_lt(r.rank, ST_W);
    /* The tokens of a job of ST_W ranks, kept here so that out[] owns nothing. */
    static uint32_t tokens[ST_W][ST_W];
    const uint32_t world = r.tokens_world;
    ck_assert_uint_le(world, ST_W);
    if (world > 0)
      memcpy(tokens[r.rank], r.tokens, world * sizeof r.tokens[0]);
    proto_stats_rank_free(&r);
    out[r.rank] = r;
    out[r.rank].tokens_world = world;
    out[r.rank].tokens = tokens[r.rank];
    n++;
  }
  ck_assert_uint_eq(ok->ranks, n);
  free(f);
  close(fd);
  return n;
}

void st_expect_op(const struct dep_msg_stats_rank *r, unsigned op, uint64_t calls,
                  uint64_t errors, uint64_t bytes) {
  const struct dep_msg_stats_op *o = &r->ops[op];
  ck_assert_msg(o->calls == calls && o->errors == errors && o->timeouts == 0,
                "rank %u %s: %llu calls %llu errors %llu timeouts, want %llu and %llu and 0",
                r->rank, dep__stats_op_name(op), (unsigned long long)o->calls,
                (unsigned long long)o->errors, (unsigned long long)o->timeouts,
                (unsigned long long)calls, (unsigned long long)errors);
  ck_assert_uint_eq(o->bytes, bytes);
  if (calls > 0) {
    ck_assert_uint_gt(o->first_ns, 0);
    ck_assert_uint_eq(o->steady_calls, calls - 1);
  }
  if (calls > 1) {
    ck_assert_uint_gt(o->median_ns, 0);
    ck_assert_uint_ge(o->p99_ns, o->median_ns);
  }
}
