/*
 * check_tune.c — adaptive_optimization's tuning table (daemon/tune.c) and
 * its answer at attach (daemon/autotune.c): the candidates and the choice,
 * entries keyed by (GPU model, shape, ranks per GPU, world size) with the
 * kernels' build and the driver, their checksum, damaged and stale entries
 * removed, persistence across opens, the queue of keys to measure, and a
 * real daemon giving a job the table's budget (TUNE).  The measurement is
 * a fake here (struct tune_measure): its times depend on the budget and it
 * counts its calls; the real one runs on the GPU (bench/results, BENCHMARKS).
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_internal.h"
#include "clienttest.h"
#include "cudaranks.h"
#include "kabi.h"
#include "kimage.h"
#include "nodes.h"
#include "proto.h"
#include "sm_budget.h"
#include "testutil.h"
#include "tune.h"
#include "xnjob.h"

#define BUILD_A "aaaaaaaaaaaaaaaa1111111111111111aaaaaaaaaaaaaaaa1111111111111111"
#define BUILD_B "bbbbbbbbbbbbbbbb2222222222222222bbbbbbbbbbbbbbbb2222222222222222"

static struct tune_key key_of(uint32_t rpg, uint32_t world) {
  struct tune_key k = {.sms = 132, .ranks_per_gpu = rpg, .world = world, .driver = 13000,
                       .shape = {.max_tokens_per_rank = 4096, .hidden = 7168, .num_experts = 256,
                                 .topk = 8, .dtype = DEP_DTYPE_BF16}};
  snprintf(k.gpu, sizeof k.gpu, "NVIDIA H200");
  snprintf(k.build, sizeof k.build, "%s", BUILD_A);
  return k;
}

/* The fake measurement: throughput ops speed up to 24 CTAs and then level off, the
 * low-latency ones do not care; it counts its calls. */
static int measures;
static int fake_run(void *arg, struct tune_entry *e, char *why, size_t whylen) {
  (void)arg, (void)why, (void)whylen;
  measures++;
  for (uint32_t i = 0; i < e->n_cands; i++) {
    uint32_t c = e->cands[i].ctas < 24 ? e->cands[i].ctas : 24;
    e->cands[i].ns[TUNE_OP_DISPATCH] = 2400000 / c * 10;
    e->cands[i].ns[TUNE_OP_COMBINE] = 2400000 / c * 9;
    e->cands[i].ns[TUNE_OP_LL_DISPATCH] = 150000;
    e->cands[i].ns[TUNE_OP_LL_COMBINE] = 150000;
  }
  return 0;
}
static int failing_run(void *arg, struct tune_entry *e, char *why, size_t whylen) {
  (void)arg, (void)e;
  snprintf(why, whylen, "no GPU");
  return DEP_ERR_CUDA;
}
static const struct tune_measure fake = {fake_run, NULL}, failing = {failing_run, NULL};

START_TEST(the_candidates_are_the_default_and_its_multiples_one_per_grid) {
  uint32_t c[TUNE_MAX_CANDS];
  /* 8 ranks on one 132-SM GPU: default 16 (2 per destination), at most 33 (4 per destination). */
  struct tune_key k = key_of(8, 8);
  ck_assert_uint_eq(tune_candidates(&k, c), 4);
  ck_assert_uint_eq(c[0], 16);
  ck_assert_uint_eq(c[1], 8);
  ck_assert_uint_eq(c[2], 24);
  ck_assert_uint_eq(c[3], 32);
  /* 2 ranks: default 66, at most 132. */
  k = key_of(2, 2);
  ck_assert_uint_eq(tune_candidates(&k, c), 4);
  ck_assert_uint_eq(c[0], 66);
  ck_assert_uint_eq(c[1], 33);
  ck_assert_uint_eq(c[2], 99);
  ck_assert_uint_eq(c[3], 132);
  /* A rank alone on its GPU: the default is the cap, the most two CTAs per SM. */
  k = key_of(1, 4);
  ck_assert_uint_eq(tune_default_ctas(132, 1, 0), 96);
  ck_assert_uint_eq(tune_most_ctas(132, 1), 264);
  ck_assert_uint_eq(tune_candidates(&k, c), 5);
  ck_assert_uint_eq(c[4], 264);
  /* 16 ranks on the GPU, a world of 16: default 8, at most 16, each fewer CTAs than ranks,
   * so each budget is its own grid (kabi.h "SM budget"; when the grid was at least the world,
   * every one of them ran 16 CTAs and only the default was measured). */
  k = key_of(16, 16);
  ck_assert_uint_eq(tune_candidates(&k, c), 4);
  ck_assert_uint_eq(c[0], 8);
  ck_assert_uint_eq(c[1], 4);
  ck_assert_uint_eq(c[2], 12);
  ck_assert_uint_eq(c[3], 16);
}
END_TEST

static struct tune_entry entry_with(uint32_t d, const uint32_t ctas[], const uint32_t ns[][4],
                                    unsigned n) {
  struct tune_entry e = {.key = key_of(8, 8), .default_ctas = d, .n_cands = n};
  for (unsigned i = 0; i < n; i++) {
    e.cands[i].ctas = ctas[i];
    memcpy(e.cands[i].ns, ns[i], sizeof e.cands[i].ns);
  }
  return e;
}

START_TEST(a_budget_is_chosen_only_for_a_real_gain_that_makes_no_op_slower) {
  const uint32_t ctas[3] = {16, 24, 32};
  /* 32 is fastest on average but slows the low-latency dispatch by 10 %: 24 is chosen. */
  const uint32_t a[3][4] = {{1000, 1000, 100, 100}, {900, 900, 100, 100}, {800, 800, 110, 100}};
  struct tune_entry e = entry_with(16, ctas, a, 3);
  ck_assert_uint_eq(tune_choose(&e), 24);
  /* Gains inside the noise (1 % on average) keep the default. */
  const uint32_t b[3][4] = {{1000, 1000, 100, 100}, {980, 980, 100, 100}, {990, 990, 100, 100}};
  e = entry_with(16, ctas, b, 3);
  ck_assert_uint_eq(tune_choose(&e), 16);
  /* The default slowest everywhere: the fastest wins. */
  const uint32_t c[3][4] = {{1000, 1000, 100, 100}, {900, 900, 90, 90}, {800, 800, 80, 80}};
  e = entry_with(16, ctas, c, 3);
  ck_assert_uint_eq(tune_choose(&e), 32);
  /* No figure for the default: nothing to compare against, the default stays. */
  const uint32_t d[3][4] = {{0, 0, 0, 0}, {900, 900, 90, 90}, {800, 800, 80, 80}};
  e = entry_with(16, ctas, d, 3);
  ck_assert_uint_eq(tune_choose(&e), 16);
}
END_TEST

START_TEST(an_entry_is_named_by_its_key_and_round_trips) {
  struct tune_key k = key_of(8, 8);
  char a[64], b[64];
  tune_entry_name(&k, a, sizeof a);
  ck_assert_msg(strncmp(a, "tune-", 5) == 0 && strlen(a) == 5 + 16 + 5, "name %s", a);
  /* Every part of the key names another entry... */
  struct tune_key o[5] = {k, k, k, k, k};
  o[0].ranks_per_gpu = 4;
  o[1].world = 16;
  o[2].shape.hidden = 4096;
  snprintf(o[3].gpu, sizeof o[3].gpu, "NVIDIA B200");
  snprintf(o[4].build, sizeof o[4].build, "%s", BUILD_B);
  for (int i = 0; i < 5; i++) {
    tune_entry_name(&o[i], b, sizeof b);
    ck_assert_msg(strcmp(a, b) != 0, "key %d names the same entry", i);
    ck_assert(!tune_key_equal(&k, &o[i]));
  }
  /* ... but a shape field's default is its value: max_ll_tokens_per_rank 0 is 256 here. */
  struct tune_key ll = k;
  ll.shape.max_ll_tokens_per_rank = 256;
  tune_entry_name(&ll, b, sizeof b);
  ck_assert_str_eq(a, b);
  ck_assert(tune_key_equal(&k, &ll));
  struct tune_entry e = {.key = k, .ctas = 32, .default_ctas = 16, .n_cands = 2,
                         .cands = {{16, {1, 2, 3, 4}}, {32, {5, 6, 7, 8}}}, .measured_at = 99};
  uint8_t f[TUNE_FILE_LEN];
  tune_encode(&e, f);
  struct tune_entry back;
  char why[256] = "";
  ck_assert_int_eq(tune_decode(f, sizeof f, &back, why, sizeof why), 0);
  ck_assert(tune_key_equal(&back.key, &k));
  ck_assert_uint_eq(back.ctas, 32);
  ck_assert_uint_eq(back.default_ctas, 16);
  ck_assert_uint_eq(back.n_cands, 2);
  ck_assert_uint_eq(back.cands[1].ns[3], 8);
  ck_assert_uint_eq(back.measured_at, 99);
}
END_TEST

START_TEST(a_damaged_entry_fails_its_checksum_length_or_bounds) {
  struct tune_entry e = {.key = key_of(8, 8), .ctas = 32, .default_ctas = 16, .n_cands = 1,
                         .cands = {{32, {1, 2, 3, 4}}}};
  uint8_t f[TUNE_FILE_LEN], g[TUNE_FILE_LEN];
  tune_encode(&e, f);
  struct tune_entry back;
  char why[256] = "";
  memcpy(g, f, sizeof g);
  g[181] ^= 1; /* the chosen budget */
  ck_assert_int_eq(tune_decode(g, sizeof g, &back, why, sizeof why), DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "checksum") != NULL, "said: %s", why);
  ck_assert_int_eq(tune_decode(f, sizeof f - 1, &back, why, sizeof why), DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "not a tuning entry") != NULL, "said: %s", why);
  /* A budget no rank could run with (more than two CTAs per SM), however well summed. */
  e.ctas = 34;
  tune_encode(&e, f);
  ck_assert_int_eq(tune_decode(f, sizeof f, &back, why, sizeof why), DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "impossible") != NULL, "said: %s", why);
}
END_TEST

static int files_in(const char *dir) {
  char cmd[400];
  snprintf(cmd, sizeof cmd, "ls %s | grep -c '^tune-.*\\.tune$'", dir);
  FILE *p = popen(cmd, "r");
  int n = -1;
  if (p != NULL && fscanf(p, "%d", &n) != 1)
    n = -1;
  if (p != NULL)
    pclose(p);
  return n;
}

START_TEST(the_table_is_kept_across_opens_and_a_stale_or_damaged_entry_goes) {
  char dir[200], why[256] = "";
  tu_tmpdir(dir, sizeof dir);
  struct tune_table *t = NULL;
  ck_assert_int_eq(tune_open(dir, 13000, BUILD_A, &t, why, sizeof why), 0);
  ck_assert_uint_eq(tune_count(t), 0);
  struct tune_key k = key_of(8, 8);
  const struct tune_entry *e = NULL;
  measures = 0;
  ck_assert_int_eq(tune_measure_key(t, &k, &fake, &e, why, sizeof why), 0);
  ck_assert_int_eq(measures, 1);
  ck_assert_uint_eq(e->ctas, 24); /* the fake's times level off at 24 */
  ck_assert_uint_eq(e->default_ctas, 16);
  ck_assert_ptr_eq(tune_lookup(t, &k), e);
  struct tune_key other = key_of(4, 4);
  ck_assert_ptr_null(tune_lookup(t, &other));
  ck_assert_int_eq(tune_measure_key(t, &other, &failing, NULL, why, sizeof why), DEP_ERR_CUDA);
  ck_assert_ptr_null(tune_lookup(t, &other)); /* a failed measurement stores nothing */
  tune_close(t);
  ck_assert_int_eq(files_in(dir), 1);

  /* A restart: the entry is read back, nothing is measured again. */
  ck_assert_int_eq(tune_open(dir, 13000, BUILD_A, &t, why, sizeof why), 0);
  ck_assert_uint_eq(tune_count(t), 1);
  e = tune_lookup(t, &k);
  ck_assert_ptr_nonnull(e);
  ck_assert_uint_eq(e->ctas, 24);
  ck_assert_int_eq(measures, 1);
  tune_close(t);

  /* Damaged: one byte of the file changed; it is removed when the table is opened. */
  char name[64], path[300];
  tune_entry_name(&k, name, sizeof name);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  int fd = open(path, O_RDWR);
  ck_assert_int_ge(fd, 0);
  uint8_t byte = 0xff;
  ck_assert_int_eq(pwrite(fd, &byte, 1, 200), 1);
  close(fd);
  ck_assert_int_eq(tune_open(dir, 13000, BUILD_A, &t, why, sizeof why), 0);
  ck_assert_uint_eq(tune_count(t), 0);
  ck_assert_int_eq(files_in(dir), 0);
  /* Measured again at its next use, and stored again. */
  ck_assert_int_eq(tune_measure_key(t, &k, &fake, NULL, why, sizeof why), 0);
  ck_assert_int_eq(measures, 2);
  tune_close(t);
  ck_assert_int_eq(files_in(dir), 1);

  /* Stale: another driver, or another build of the kernels, measured other code. */
  ck_assert_int_eq(tune_open(dir, 13010, BUILD_A, &t, why, sizeof why), 0);
  ck_assert_uint_eq(tune_count(t), 0);
  tune_close(t);
  ck_assert_int_eq(files_in(dir), 0);
  tu_rmtree(dir);
}
END_TEST

START_TEST(a_key_is_queued_once_and_a_failed_one_not_again) {
  struct tune_table *t = NULL;
  char why[64];
  ck_assert_int_eq(tune_open("", 13000, BUILD_A, &t, why, sizeof why), 0);
  struct tune_key k = key_of(2, 2), k2;
  uint8_t place[DEP_MAX_LOCAL_RANKS][16] = {{1}, {2}}, got[DEP_MAX_LOCAL_RANKS][16];
  ck_assert(tune_queue(t, &k, (const uint8_t(*)[16])place, 1000));
  ck_assert(!tune_queue(t, &k, (const uint8_t(*)[16])place, 1000));
  ck_assert(tune_queued(t, &k));
  uint32_t uid = 0;
  ck_assert(tune_dequeue(t, &k2, got, &uid));
  ck_assert(tune_key_equal(&k, &k2));
  ck_assert_uint_eq(uid, 1000);
  ck_assert_uint_eq(got[1][0], 2);
  ck_assert(!tune_dequeue(t, &k2, got, &uid));
  tune_mark_failed(t, &k);
  ck_assert(tune_failed(t, &k));
  ck_assert(!tune_queue(t, &k, (const uint8_t(*)[16])place, 1000));
  /* A measured key is not queued either. */
  struct tune_key m = key_of(4, 4);
  ck_assert_int_eq(tune_measure_key(t, &m, &fake, NULL, why, sizeof why), 0);
  ck_assert(!tune_queue(t, &m, (const uint8_t(*)[16])place, 1000));
  tune_close(t);
}
END_TEST

START_TEST(tune_and_its_answer_round_trip_and_bad_values_are_refused) {
  struct proto_buf b;
  proto_buf_init(&b);
  struct dep_msg_tune m = {.sms = 132, .env_ctas = 40}, m2;
  ck_assert_int_eq(proto_encode_tune(&b, &m), 0);
  ck_assert_int_eq(proto_decode_tune(b.data, b.len, &m2), 0);
  ck_assert_uint_eq(m2.sms, 132);
  ck_assert_uint_eq(m2.env_ctas, 40);
  ck_assert_int_eq(proto_decode_tune(b.data, b.len - 1, &m2), DEP_ERR_PROTOCOL);
  proto_buf_reset(&b);
  m.sms = 0; /* a GPU has SMs */
  ck_assert_int_eq(proto_encode_tune(&b, &m), 0);
  ck_assert_int_eq(proto_decode_tune(b.data, b.len, &m2), DEP_ERR_PROTOCOL);
  proto_buf_reset(&b);
  struct dep_msg_tune_ok ok = {.ctas = 32, .how = DEP_TUNE_HOW_MEASURED}, ok2;
  ck_assert_int_eq(proto_encode_tune_ok(&b, &ok), 0);
  ck_assert_int_eq(proto_decode_tune_ok(b.data, b.len, &ok2), 0);
  ck_assert_uint_eq(ok2.ctas, 32);
  ck_assert_uint_eq(ok2.how, DEP_TUNE_HOW_MEASURED);
  ok.how = DEP_TUNE_HOW_MAX + 1;
  ck_assert_int_eq(proto_encode_tune_ok(&b, &ok), DEP_ERR_INVALID);
  ck_assert_str_eq(proto_tune_how_name(DEP_TUNE_HOW_PENDING), "default-measuring");
  ck_assert_str_eq(proto_tune_how_name(DEP_TUNE_HOW_ENV), "env");
  /* STATS_RANK carries the budget and its source to deepepctl. */
  proto_buf_reset(&b);
  static struct dep_msg_stats_rank r, r2;
  snprintf(r.job_id, sizeof r.job_id, "j");
  r.kernel_ctas = 24;
  r.ctas_how = DEP_TUNE_HOW_ENV;
  ck_assert_int_eq(proto_encode_stats_rank(&b, &r), 0);
  ck_assert_int_eq(proto_decode_stats_rank(b.data, b.len, &r2), 0);
  ck_assert_uint_eq(r2.kernel_ctas, 24);
  ck_assert_uint_eq(r2.ctas_how, DEP_TUNE_HOW_ENV);
  proto_buf_free(&b);
}
END_TEST

/* Attach one rank of a one-rank job and ask TUNE as the cuda library does: its answer. */
static int tune_at_attach(const char *sock, uint32_t env, struct dep_msg_tune_ok *ok) {
  dep_client_t *c = NULL;
  struct dep_attach_args a = {.size = sizeof a,
                              .job_id = "tuned", .rank = 0, .world_size = 1, .local_rank = 0,
                              .local_world_size = 1,
                              .shape = {.max_tokens_per_rank = 64, .hidden = 256,
                                        .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16}};
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  if (rc == 0)
    rc = dep_attach(c, &a);
  struct dep_msg_tune m = {.sms = 132, .env_ctas = env};
  struct client_frame f;
  if (rc == 0 && (rc = client_request(c, DEP_MSG_TUNE, &m, DEP_MSG_TUNE_OK, 5000, &f)) == 0) {
    rc = proto_decode_tune_ok(f.body, f.hdr.body_len, ok);
    client_frame_release(&f);
  }
  if (rc == 0)
    rc = dep_detach(c);
  dep_client_free(c);
  return rc;
}

/* deepepctl stats --json's output, malloc'd. */
static char *ctl_stats_json(const char *sock) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "%s -s %s stats --json 2>&1", tu_bin("deepepctl"), sock);
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  size_t cap = 1 << 16, n = 0;
  char *buf = calloc(1, cap);
  while (buf != NULL && n < cap - 1) {
    size_t got = fread(buf + n, 1, cap - 1 - n, p);
    if (got == 0)
      break;
    n += got;
  }
  pclose(p);
  return buf;
}

/*
 * Into the table in dir, the entry a measurement on a host daemon's "GPU"
 * (132 SMs, one rank of the job on it) would have made for a job of world
 * ranks of shape: 144 CTAs chosen over the default's 96.
 */
static void put_host_entry(const char *dir, uint32_t world, const struct dep_job_shape *shape) {
  char why[256] = "";
  struct tune_table *t = NULL;
  struct kimage img;
  const char *build = kimage_embedded(&img) ? img.id : "";
  ck_assert_int_eq(tune_open(dir, 0, build, &t, why, sizeof why), 0);
  struct tune_key k = {.gpu = "host", .sms = 132, .ranks_per_gpu = 1, .world = world,
                       .shape = *shape};
  snprintf(k.build, sizeof k.build, "%s", build);
  struct tune_entry e = {.key = k, .n_cands = 2, .cands = {{96, {1000, 1000, 100, 100}},
                                                           {144, {800, 800, 100, 100}}}};
  ck_assert_int_eq(tune_put(t, &e), 0);
  ck_assert_uint_eq(e.ctas, 144);
  tune_close(t);
}

START_TEST(a_job_is_given_the_tables_budget_at_attach) {
  if (cr_on_cuda()) {
    tu_skip(__func__, "the host daemon's table; on cuda the GPU run measures it");
    return;
  }
  char dir[200], yaml[512];
  tu_tmpdir(dir, sizeof dir);
  chmod(dir, 0755);
  const struct dep_job_shape shape = {.max_tokens_per_rank = 64, .hidden = 256,
                                      .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};
  put_host_entry(dir, 1, &shape);

  struct tu_daemon d;
  snprintf(yaml, sizeof yaml, "kernel_cache_dir: %s\nadaptive_optimization: true\n", dir);
  ck_assert_int_eq(tu_daemon_start(&d, yaml), 0);
  struct dep_msg_tune_ok ok;
  ck_assert_int_eq(tune_at_attach(d.sock, 0, &ok), 0);
  ck_assert_uint_eq(ok.how, DEP_TUNE_HOW_MEASURED);
  ck_assert_uint_eq(ok.ctas, 144);
  /* deepepctl stats says which budget the rank got, and why (the ended job is kept). */
  char *out = ctl_stats_json(d.sock);
  ck_assert_msg(strstr(out, "\"kernel_ctas\":144") != NULL &&
                    strstr(out, "\"kernel_ctas_from\":\"measured\"") != NULL,
                "deepepctl stats --json: %s", out);
  free(out);
  /* The rank's own $DEEPEP_KERNEL_CTAS wins, and is recorded as such. */
  ck_assert_int_eq(tune_at_attach(d.sock, 50, &ok), 0);
  ck_assert_uint_eq(ok.how, DEP_TUNE_HOW_ENV);
  ck_assert_uint_eq(ok.ctas, 50);
  char *log = tu_daemon_log(&d);
  ck_assert_msg(strstr(log, "tuning table: 1 entry") != NULL, "log: %s", log);
  free(log);
  ck_assert_int_eq(tu_daemon_stop(&d), 0);
  tu_daemon_cleanup(&d);

  /* adaptive_optimization off: the default, and said so. */
  snprintf(yaml, sizeof yaml, "kernel_cache_dir: %s\nadaptive_optimization: false\n", dir);
  ck_assert_int_eq(tu_daemon_start(&d, yaml), 0);
  ck_assert_int_eq(tune_at_attach(d.sock, 0, &ok), 0);
  ck_assert_uint_eq(ok.how, DEP_TUNE_HOW_DEFAULT);
  ck_assert_uint_eq(ok.ctas, 0);
  ck_assert_int_eq(tu_daemon_stop(&d), 0);
  tu_daemon_cleanup(&d);
  tu_rmtree(dir);
}
END_TEST

START_TEST(tune_before_attach_is_refused_and_the_connection_kept) {
  if (cr_on_cuda()) {
    tu_skip(__func__, "the host daemon's answer");
    return;
  }
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  dep_client_t *c = cl_connect(d.sock);
  struct dep_msg_tune m = {.sms = 132};
  struct client_frame f;
  ck_assert_int_eq(client_request(c, DEP_MSG_TUNE, &m, DEP_MSG_TUNE_OK, 5000, &f), DEP_ERR_STATE);
  ck_assert_msg(strstr(dep_errmsg(c), "attach first") != NULL, "said: %s", dep_errmsg(c));
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status(c, &st), 0);
  dep_status_free(st);
  dep_client_free(c);
  ck_assert_int_eq(tu_daemon_stop(&d), 0);
  tu_daemon_cleanup(&d);
}
END_TEST

/* What each rank of a job across nodes was answered to TUNE (xspan_rank). */
struct xspan {
  int rc[2];
  struct dep_msg_tune_ok ok[2];
};

static int xspan_rank(dep_client_t *c, const struct xn_run *run, uint32_t rank,
                      struct xn_result *res) {
  struct xspan *x = run->arg;
  struct dep_msg_tune m = {.sms = 132};
  struct client_frame f;
  x->rc[rank] = client_request(c, DEP_MSG_TUNE, &m, DEP_MSG_TUNE_OK, 5000, &f);
  if (x->rc[rank] == 0) {
    x->rc[rank] = proto_decode_tune_ok(f.body, f.hdr.body_len, &x->ok[rank]);
    client_frame_release(&f);
  }
  (void)res;
  return x->rc[rank];
}

/*
 * A job whose ranks span nodes runs the cross-node default budget
 * (dep__xnode_budget: two CTAs a rank of the world), never a budget the
 * table measured on one node for its key: two host daemons, each with an
 * entry of 144 CTAs for the key of a 1+1 job of world 2 (the key holds no
 * node count), answer its ranks "default", and deepepctl stats says 4.
 */
START_TEST(a_job_across_nodes_runs_the_cross_node_default_not_a_one_node_entry) {
  if (cr_on_cuda()) {
    tu_skip(__func__, "the host daemons' answer; on cuda the GPU run takes the budget");
    return;
  }
  ow_seed_init(7100);
  const struct ow_scenario sc = {2, 256, 2, 8, 64, 8, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  struct ow_case *d = xn_case_new(&sc, 0);
  char dir[200], extra[300];
  tu_tmpdir(dir, sizeof dir);
  chmod(dir, 0755);
  put_host_entry(dir, 2, &d->shape);

  snprintf(extra, sizeof extra, "kernel_cache_dir: %s\nadaptive_optimization: true\n", dir);
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, XN_OP_TIMEOUT_MS, extra);
  struct xn_place pl;
  memset(&pl, 0, sizeof pl);
  const uint32_t split[NODES_MAX] = {1, 1};
  xn_place(&pl, split, 2);
  struct xspan *x = mmap(NULL, sizeof *x, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
  ck_assert_ptr_ne(x, MAP_FAILED);
  memset(x, 0, sizeof *x);
  struct xn_result *res = xn_results(2);
  const struct xn_run run = {.d = d, .body = xspan_rank, .arg = x};
  xn_run_job(&ns, &pl, "tune-xspan", &run, res);
  const uint32_t want = dep__xnode_budget(tune_default_ctas(132, 1, 0), 2);
  ck_assert_uint_eq(want, 2 * CUOPS_XNODE_PARTS);
  for (int r = 0; r < 2; r++) {
    ck_assert_int_eq(x->rc[r], 0);
    ck_assert_msg(x->ok[r].how == DEP_TUNE_HOW_DEFAULT && x->ok[r].ctas == 0,
                  "rank %d of a job across nodes was answered %s, %u CTAs: a budget measured "
                  "on one node", r, proto_tune_how_name(x->ok[r].how), x->ok[r].ctas);
    char *out = ctl_stats_json(ns.d[r].sock);
    char ctas[64];
    snprintf(ctas, sizeof ctas, "\"kernel_ctas\":%u,", want);
    ck_assert_msg(strstr(out, ctas) != NULL && strstr(out, "\"kernel_ctas_from\":\"default\"") !=
                  NULL, "node %d: deepepctl stats --json, not %s from default: %s", r, ctas, out);
    free(out);
  }
  nodes_stop(&ns);
  munmap(res, 2 * sizeof *res);
  munmap(x, sizeof *x);
  xn_case_free(d);
  tu_rmtree(dir);
}
END_TEST

Suite *tune_suite(void);
Suite *tune_suite(void) {
  Suite *s = suite_create("tune");
  TCase *tc = tcase_create("table");
  tcase_add_test(tc, the_candidates_are_the_default_and_its_multiples_one_per_grid);
  tcase_add_test(tc, a_budget_is_chosen_only_for_a_real_gain_that_makes_no_op_slower);
  tcase_add_test(tc, an_entry_is_named_by_its_key_and_round_trips);
  tcase_add_test(tc, a_damaged_entry_fails_its_checksum_length_or_bounds);
  tcase_add_test(tc, the_table_is_kept_across_opens_and_a_stale_or_damaged_entry_goes);
  tcase_add_test(tc, a_key_is_queued_once_and_a_failed_one_not_again);
  tcase_add_test(tc, tune_and_its_answer_round_trip_and_bad_values_are_refused);
  tcase_add_test(tc, a_job_is_given_the_tables_budget_at_attach);
  tcase_add_test(tc, tune_before_attach_is_refused_and_the_connection_kept);
  tcase_add_test(tc, a_job_across_nodes_runs_the_cross_node_default_not_a_one_node_entry);
  /* Above Check's 4 s: the table's writes are fsync'd and some tests start a
   * daemon, which under ASan on a loaded 2-core machine took longer (CI). */
  tcase_set_timeout(tc, 30);
  suite_add_tcase(s, tc);
  return s;
}
