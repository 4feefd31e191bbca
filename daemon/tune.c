/*
 * tune.c — the tuning table (tune.h): its candidates and choice, its entry
 * files and their checks, the in-memory table and the queue of keys waiting
 * for a measurement.
 *
 * Entry file (little-endian, TUNE_FILE_LEN bytes):
 *   offset size field
 *        0    8 magic "DEPTUNE1"
 *        8    4 format version (1)
 *       12    4 driver version
 *       16   64 build id (hex digits)
 *       80   64 GPU model name (NUL-padded)
 *      144    4 SMs
 *      148    4 ranks per GPU
 *      152    4 world size
 *      156   24 shape: max_tokens_per_rank, hidden, num_experts, topk, dtype,
 *               max_ll_tokens_per_rank
 *      180    4 chosen budget (CTAs)
 *      184    4 the default budget
 *      188    4 candidates (1..TUNE_MAX_CANDS)
 *      192    8 measured at (Unix time)
 *      200  160 candidates: budget, then each op's median in ns (5 x u32 each)
 *      360   40 reserved, zero
 *      400   32 BLAKE2b-256 of bytes 0..399
 */
#include "tune.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "grow.h"
#include "log.h"
#include "shape.h"
#include "sm_budget.h"

#define TUNE_MAGIC "DEPTUNE1"
#define TUNE_FORMAT 1u
#define TUNE_SUM_OFF 400u
#define TUNE_SUM_LEN 32u
#define TUNE_CANDS_OFF 200u
#define TUNE_CAND_LEN (4u * (1u + TUNE_NOPS))
_Static_assert(TUNE_CANDS_OFF + TUNE_MAX_CANDS * TUNE_CAND_LEN <= TUNE_SUM_OFF, "entry layout");
_Static_assert(TUNE_SUM_OFF + TUNE_SUM_LEN == TUNE_FILE_LEN, "entry length");

/* ---- candidates and choice ------------------------------------------------- */

uint32_t tune_default_ctas(uint32_t sms, uint32_t ranks_per_gpu, uint32_t xworld) {
  uint32_t b = 1;
  char why[8];
  cuops_sm_budget(sms > 1024 ? 1024 : (int)sms, ranks_per_gpu, xworld, NULL, &b, why, sizeof why);
  return b;
}

uint32_t tune_most_ctas(uint32_t sms, uint32_t ranks_per_gpu) {
  return cuops_most_ctas(sms > 1024 ? 1024 : (int)sms, ranks_per_gpu);
}

/* The CTAs a budget launches (dep__kernel_grid): two budgets of one grid run alike. */
static uint32_t tune_grid(uint32_t ctas, uint32_t world) {
  uint32_t parts;
  return dep__kernel_grid(ctas, world, &parts);
}

unsigned tune_candidates(const struct tune_key *k, uint32_t out[TUNE_MAX_CANDS]) {
  const uint32_t d = tune_default_ctas(k->sms, k->ranks_per_gpu, 0);
  const uint32_t most = tune_most_ctas(k->sms, k->ranks_per_gpu);
  const uint32_t want[] = {d, d / 2, d + d / 2, 2 * d, most};
  unsigned n = 0;
  for (size_t i = 0; i < sizeof want / sizeof want[0] && n < TUNE_MAX_CANDS; i++) {
    uint32_t b = want[i] < 1 ? 1 : want[i] > most ? most : want[i];
    bool dup = false;
    for (unsigned j = 0; j < n; j++)
      dup |= tune_grid(out[j], k->world) == tune_grid(b, k->world);
    if (!dup)
      out[n++] = b;
  }
  return n;
}

uint32_t tune_choose(const struct tune_entry *e) {
  const struct tune_cand *base = NULL;
  for (uint32_t i = 0; i < e->n_cands; i++)
    if (e->cands[i].ctas == e->default_ctas)
      base = &e->cands[i];
  if (base == NULL)
    return e->default_ctas;
  for (unsigned op = 0; op < TUNE_NOPS; op++)
    if (base->ns[op] == 0)
      return e->default_ctas; /* nothing to compare against */
  uint32_t best = e->default_ctas;
  double best_mean = 1.0 - TUNE_GAIN_MIN;
  for (uint32_t i = 0; i < e->n_cands; i++) {
    const struct tune_cand *c = &e->cands[i];
    double sum = 0, worst = 0;
    for (unsigned op = 0; op < TUNE_NOPS; op++) {
      double r = c->ns[op] == 0 ? 1e9 : (double)c->ns[op] / (double)base->ns[op];
      sum += r;
      worst = r > worst ? r : worst;
    }
    double mean = sum / TUNE_NOPS;
    if (worst <= 1.0 + TUNE_WORSE_MAX && mean < best_mean) {
      best = c->ctas;
      best_mean = mean;
    }
  }
  return best;
}

/* ---- entry files -------------------------------------------------------------- */

bool tune_key_equal(const struct tune_key *a, const struct tune_key *b) {
  return strcmp(a->gpu, b->gpu) == 0 && a->sms == b->sms && a->ranks_per_gpu == b->ranks_per_gpu &&
         a->world == b->world && a->driver == b->driver && strcmp(a->build, b->build) == 0 &&
         !dep__shape_diff(&a->shape, a->world, &b->shape, b->world, NULL, NULL, NULL);
}

/* The key's fields as the file holds them (bytes 12..179), for its hash and its name. */
static void tune_key_put(const struct tune_key *k, uint8_t *f) {
  codec_put_u32(f + 12, (uint32_t)k->driver);
  memcpy(f + 16, k->build, strnlen(k->build, KIMAGE_ID_LEN));
  memcpy(f + 80, k->gpu, strnlen(k->gpu, sizeof k->gpu - 1));
  codec_put_u32(f + 144, k->sms);
  codec_put_u32(f + 148, k->ranks_per_gpu);
  codec_put_u32(f + 152, k->world);
  const struct dep_job_shape *s = &k->shape;
  const uint32_t sh[6] = {s->max_tokens_per_rank, s->hidden, s->num_experts, s->topk, s->dtype,
                          s->max_ll_tokens_per_rank};
  for (int i = 0; i < 6; i++)
    codec_put_u32(f + 156 + 4 * i, sh[i]);
}

void tune_entry_name(const struct tune_key *k, char *out, size_t len) {
  /* The shape by its effective values (dep__shape_key), so equal keys share a name. */
  struct tune_key n = *k;
  memset(&n.shape, 0, sizeof n.shape);
  uint8_t f[TUNE_FILE_LEN] = {0}, h[8];
  tune_key_put(&n, f);
  codec_put_u64(f + 156, dep__shape_key(&k->shape, k->world));
  crypto_generichash(h, sizeof h, f, 180, NULL, 0);
  snprintf(out, len, "tune-%016llx.tune", (unsigned long long)codec_get_u64(h));
}

void tune_encode(const struct tune_entry *e, uint8_t f[TUNE_FILE_LEN]) {
  memset(f, 0, TUNE_FILE_LEN);
  memcpy(f, TUNE_MAGIC, 8);
  codec_put_u32(f + 8, TUNE_FORMAT);
  tune_key_put(&e->key, f);
  codec_put_u32(f + 180, e->ctas);
  codec_put_u32(f + 184, e->default_ctas);
  codec_put_u32(f + 188, e->n_cands);
  codec_put_u64(f + 192, e->measured_at);
  for (uint32_t i = 0; i < e->n_cands && i < TUNE_MAX_CANDS; i++) {
    uint8_t *c = f + TUNE_CANDS_OFF + i * TUNE_CAND_LEN;
    codec_put_u32(c, e->cands[i].ctas);
    for (unsigned op = 0; op < TUNE_NOPS; op++)
      codec_put_u32(c + 4 + 4 * op, e->cands[i].ns[op]);
  }
  crypto_generichash(f + TUNE_SUM_OFF, TUNE_SUM_LEN, f, TUNE_SUM_OFF, NULL, 0);
}

int tune_decode(const uint8_t *f, size_t len, struct tune_entry *e, char *why, size_t whylen) {
  memset(e, 0, sizeof *e);
  if (len != TUNE_FILE_LEN || memcmp(f, TUNE_MAGIC, 8) != 0) {
    snprintf(why, whylen, "not a tuning entry (%zu bytes; an entry is %u, beginning %s)", len,
             TUNE_FILE_LEN, TUNE_MAGIC);
    return DEP_ERR_PROTOCOL;
  }
  if (codec_get_u32(f + 8) != TUNE_FORMAT) {
    snprintf(why, whylen, "entry format %u, this deepepd writes %u", codec_get_u32(f + 8),
             TUNE_FORMAT);
    return DEP_ERR_PROTOCOL;
  }
  uint8_t sum[TUNE_SUM_LEN];
  crypto_generichash(sum, sizeof sum, f, TUNE_SUM_OFF, NULL, 0);
  if (sodium_memcmp(sum, f + TUNE_SUM_OFF, TUNE_SUM_LEN) != 0) {
    snprintf(why, whylen, "checksum mismatch (the file was altered or cut)");
    return DEP_ERR_PROTOCOL;
  }
  struct tune_key *k = &e->key;
  k->driver = (int32_t)codec_get_u32(f + 12);
  memcpy(k->build, f + 16, KIMAGE_ID_LEN);
  memcpy(k->gpu, f + 80, sizeof k->gpu - 1);
  k->sms = codec_get_u32(f + 144);
  k->ranks_per_gpu = codec_get_u32(f + 148);
  k->world = codec_get_u32(f + 152);
  uint32_t *sh[6] = {&k->shape.max_tokens_per_rank, &k->shape.hidden, &k->shape.num_experts,
                     &k->shape.topk, &k->shape.dtype, &k->shape.max_ll_tokens_per_rank};
  for (int i = 0; i < 6; i++)
    *sh[i] = codec_get_u32(f + 156 + 4 * i);
  e->ctas = codec_get_u32(f + 180);
  e->default_ctas = codec_get_u32(f + 184);
  e->n_cands = codec_get_u32(f + 188);
  e->measured_at = codec_get_u64(f + 192);
  const uint32_t most = tune_most_ctas(k->sms, k->ranks_per_gpu);
  if (e->n_cands < 1 || e->n_cands > TUNE_MAX_CANDS || e->ctas < 1 || e->ctas > most ||
      k->ranks_per_gpu < 1 || k->world < k->ranks_per_gpu) {
    snprintf(why, whylen, "entry holds impossible values (budget %u of at most %u, %u "
             "candidates, %u ranks per GPU of %u)", e->ctas, most, e->n_cands, k->ranks_per_gpu,
             k->world);
    return DEP_ERR_PROTOCOL;
  }
  for (uint32_t i = 0; i < e->n_cands; i++) {
    const uint8_t *c = f + TUNE_CANDS_OFF + i * TUNE_CAND_LEN;
    e->cands[i].ctas = codec_get_u32(c);
    for (unsigned op = 0; op < TUNE_NOPS; op++)
      e->cands[i].ns[op] = codec_get_u32(c + 4 + 4 * op);
  }
  return 0;
}

/* ---- the table ------------------------------------------------------------------ */

struct tune_slot {
  struct tune_key key;
  uint8_t place[DEP_MAX_LOCAL_RANKS][16];
  uint32_t uid;
};

struct tune_table {
  char dir[256];
  int32_t driver;
  char build[KIMAGE_ID_LEN + 1];
  struct tune_entry *entries;
  size_t n, cap;
  struct tune_slot queue[TUNE_QUEUE_MAX];
  size_t nq;
  struct tune_key failed[TUNE_QUEUE_MAX];
  size_t nfailed;
};

size_t tune_count(const struct tune_table *t) { return t->n; }

const struct tune_entry *tune_lookup(const struct tune_table *t, const struct tune_key *k) {
  for (size_t i = 0; i < t->n; i++)
    if (tune_key_equal(&t->entries[i].key, k))
      return &t->entries[i];
  return NULL;
}

/* Keep e in memory, replacing an entry of its key. */
static int tune_keep(struct tune_table *t, const struct tune_entry *e) {
  for (size_t i = 0; i < t->n; i++)
    if (tune_key_equal(&t->entries[i].key, &e->key)) {
      t->entries[i] = *e;
      return 0;
    }
  if (DEP_GROW(t->entries, t->cap, t->n + 1, 16) != 0)
    return DEP_ERR_NO_MEMORY;
  t->entries[t->n++] = *e;
  return 0;
}

/* Write e's file atomically (a temporary file, then rename); logged when it fails. */
static void tune_store(const struct tune_table *t, const struct tune_entry *e) {
  if (t->dir[0] == '\0')
    return;
  char name[64], path[512], tmp[520];
  tune_entry_name(&e->key, name, sizeof name);
  snprintf(path, sizeof path, "%s/%s", t->dir, name);
  snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
  uint8_t f[TUNE_FILE_LEN];
  tune_encode(e, f);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  bool ok = fd >= 0 && write(fd, f, sizeof f) == (ssize_t)sizeof f && fsync(fd) == 0;
  if (fd >= 0 && close(fd) != 0)
    ok = false;
  if (!ok || rename(tmp, path) != 0) {
    log_warn("tuning table: cannot store %s (the entry is kept until deepepd stops)", path);
    unlink(tmp);
  }
}

/* Read one entry file: kept, or removed when damaged or stale. */
static void tune_load_file(struct tune_table *t, const char *name) {
  char path[512], why[256] = "";
  snprintf(path, sizeof path, "%s/%s", t->dir, name);
  uint8_t f[TUNE_FILE_LEN + 1];
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  ssize_t n = fd >= 0 ? read(fd, f, sizeof f) : -1;
  if (fd >= 0)
    close(fd);
  struct tune_entry e;
  char want[64];
  int rc = n < 0 ? DEP_ERR_PROTOCOL : tune_decode(f, (size_t)n, &e, why, sizeof why);
  if (n < 0)
    snprintf(why, sizeof why, "unreadable: %s", strerror(errno));
  if (rc == 0) {
    tune_entry_name(&e.key, want, sizeof want);
    if (strcmp(want, name) != 0) {
      snprintf(why, sizeof why, "its key is another file's (%s)", want);
      rc = DEP_ERR_PROTOCOL;
    }
  }
  if (rc != 0) {
    log_warnx("tuning table: %s: %s; removed, its key is measured again at its next use", path,
              why);
  } else if (e.key.driver != t->driver || strcmp(e.key.build, t->build) != 0) {
    log_info("tuning table: %s was measured with driver %d and kernels %.16s, these are %d and "
             "%.16s; removed as stale", path, (int)e.key.driver, e.key.build, (int)t->driver,
             t->build);
    rc = DEP_ERR_NOT_FOUND;
  } else if (tune_keep(t, &e) == 0) {
    return;
  }
  unlink(path);
}

int tune_open(const char *dir, int32_t driver, const char *build, struct tune_table **out,
              char *why, size_t whylen) {
  struct tune_table *t = calloc(1, sizeof *t);
  if (t == NULL)
    return DEP_ERR_NO_MEMORY;
  snprintf(t->dir, sizeof t->dir, "%s", dir);
  snprintf(t->build, sizeof t->build, "%s", build);
  t->driver = driver;
  if (dir[0] != '\0') {
    DIR *d = opendir(dir);
    if (d == NULL) {
      snprintf(why, whylen, "kernel_cache_dir %s: %s", dir, strerror(errno));
      free(t);
      return DEP_ERR_CONFIG;
    }
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
      size_t n = strlen(de->d_name);
      if (n > 10 && strncmp(de->d_name, "tune-", 5) == 0 &&
          strcmp(de->d_name + n - 5, ".tune") == 0)
        tune_load_file(t, de->d_name);
    }
    closedir(d);
  }
  *out = t;
  return 0;
}

void tune_close(struct tune_table *t) {
  if (t == NULL)
    return;
  free(t->entries);
  free(t);
}

int tune_put(struct tune_table *t, struct tune_entry *e) {
  e->default_ctas = tune_default_ctas(e->key.sms, e->key.ranks_per_gpu, 0);
  e->ctas = tune_choose(e);
  if (e->measured_at == 0)
    e->measured_at = (uint64_t)time(NULL);
  int rc = tune_keep(t, e);
  if (rc == 0)
    tune_store(t, e);
  return rc;
}

int tune_measure_key(struct tune_table *t, const struct tune_key *k, const struct tune_measure *m,
                     const struct tune_entry **out, char *why, size_t whylen) {
  struct tune_entry e = {.key = *k};
  uint32_t c[TUNE_MAX_CANDS];
  e.n_cands = tune_candidates(k, c);
  for (uint32_t i = 0; i < e.n_cands; i++)
    e.cands[i].ctas = c[i];
  int rc = m->run(m->arg, &e, why, whylen);
  if (rc == 0)
    rc = tune_put(t, &e);
  if (rc != 0)
    return rc;
  if (out != NULL)
    *out = tune_lookup(t, k);
  return 0;
}

/* ---- the queue ------------------------------------------------------------------ */

bool tune_queued(const struct tune_table *t, const struct tune_key *k) {
  for (size_t i = 0; i < t->nq; i++)
    if (tune_key_equal(&t->queue[i].key, k))
      return true;
  return false;
}

bool tune_failed(const struct tune_table *t, const struct tune_key *k) {
  for (size_t i = 0; i < t->nfailed; i++)
    if (tune_key_equal(&t->failed[i], k))
      return true;
  return false;
}

void tune_mark_failed(struct tune_table *t, const struct tune_key *k) {
  if (tune_failed(t, k))
    return;
  if (t->nfailed == TUNE_QUEUE_MAX) /* forget the oldest: it may be tried again */
    memmove(t->failed, t->failed + 1, (TUNE_QUEUE_MAX - 1) * sizeof t->failed[0]), t->nfailed--;
  t->failed[t->nfailed++] = *k;
}

bool tune_queue(struct tune_table *t, const struct tune_key *k, const uint8_t (*place)[16],
                uint32_t uid) {
  if (t->nq == TUNE_QUEUE_MAX || k->world > DEP_MAX_LOCAL_RANKS || tune_lookup(t, k) != NULL ||
      tune_queued(t, k) || tune_failed(t, k))
    return false;
  struct tune_slot *s = &t->queue[t->nq++];
  s->key = *k;
  memcpy(s->place, place, (size_t)k->world * 16);
  s->uid = uid;
  return true;
}

bool tune_dequeue(struct tune_table *t, struct tune_key *k, uint8_t (*place)[16], uint32_t *uid) {
  if (t->nq == 0)
    return false;
  *k = t->queue[0].key;
  *uid = t->queue[0].uid;
  memcpy(place, t->queue[0].place, (size_t)k->world * 16);
  memmove(t->queue, t->queue + 1, (t->nq - 1) * sizeof t->queue[0]);
  t->nq--;
  return true;
}
