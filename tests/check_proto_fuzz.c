/*
 * check_proto_fuzz.c — suite proto_fuzz: what the fuzz harnesses feed the
 * decoders, run as tests.  Random frames (valid ones mangled, and noise)
 * never crash a decoder; every seed of the fuzz corpora (tests/corpus/frame,
 * tests/corpus/peer) decodes at this protocol version as its harness
 * would.  The sample messages it shares with check_proto.c are
 * protosamples.c's.
 */
#include <check.h>
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "corpus_seeds.h"
#include "peer_proto.h"
#include "proto.h"
#include "protosamples.h"
#include "xring.h"

/* ---- random frames ------------------------------------------------------- */

static uint64_t rng_state;

static char fuzz_seed_msg[64];

static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

/* A crash is the failure this test looks for: say which seed reproduces it. */
static void on_crash(int sig) {
  (void)!write(2, fuzz_seed_msg, strlen(fuzz_seed_msg));
  signal(sig, SIG_DFL);
  raise(sig);
}

/* Decode `p` as every body type; whatever decodes must re-encode to the same bytes. */
static void decode_all_types(const uint8_t *p, size_t len, struct proto_buf *b, uint64_t seed) {
  for (uint16_t t = 0; t <= DEP_MSG_TYPE_MAX_; t++) {
    union dep_msg_body m;
    int rc = proto_body_decode(t, p, len, &m);
    ck_assert_msg(rc == 0 || rc == DEP_ERR_PROTOCOL, "seed %llu: type %u gave %d",
                  (unsigned long long)seed, t, rc);
    if (rc != 0)
      continue;
    proto_buf_reset(b);
    ck_assert_msg(proto_frame_encode(b, t, 0, 0, &m) == 0, "seed %llu: re-encode of %s failed",
                  (unsigned long long)seed, proto_type_name(t));
    ck_assert_msg(b->len - DEP_PROTO_HDR_LEN == len &&
                      memcmp(b->data + DEP_PROTO_HDR_LEN, p, len) == 0,
                  "seed %llu: %s did not round-trip", (unsigned long long)seed,
                  proto_type_name(t));
    if (t == DEP_MSG_STATUS_OK) {
      free(m.status.devices);
      free(m.status.jobs);
    }
    if (t == DEP_MSG_STATS_RANK)
      proto_stats_rank_free(&m.stats_rank);
  }
}

START_TEST(random_frames_never_crash_a_decoder) {
  const char *env = getenv("DEP_TEST_SEED");
  uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
  if (seed == 0)
    seed = 1;
  rng_state = seed;
  snprintf(fuzz_seed_msg, sizeof fuzz_seed_msg, "random frames: DEP_TEST_SEED=%llu\n",
           (unsigned long long)seed);
  signal(SIGSEGV, on_crash);
  signal(SIGABRT, on_crash);
  signal(SIGBUS, on_crash);

  struct sample s[8];
  struct dep_status *st;
  int ns = samples(s, &st);
  struct proto_buf valid[8], out;
  for (int i = 0; i < ns; i++) {
    proto_buf_init(&valid[i]);
    ck_assert_int_eq(proto_frame_encode(&valid[i], s[i].type, 0, 1, s[i].msg), 0);
  }
  proto_buf_init(&out);
  uint8_t buf[512];
  for (int iter = 0; iter < 100000; iter++) {
    size_t len;
    if (rng() % 2) { /* a valid frame with a few bytes changed, cut or extended */
      const struct proto_buf *v = &valid[rng() % (uint64_t)ns];
      len = v->len <= sizeof buf ? v->len : sizeof buf;
      memcpy(buf, v->data, len);
      for (int k = (int)(rng() % 4); k >= 0; k--)
        buf[rng() % len] ^= (uint8_t)(1u << (rng() % 8));
      if (rng() % 4 == 0)
        len = (size_t)(rng() % (len + 1));
    } else {
      len = (size_t)(rng() % sizeof buf);
      for (size_t k = 0; k < len; k++)
        buf[k] = (uint8_t)rng();
    }
    struct dep_frame_hdr h;
    char why[256];
    if (len >= DEP_PROTO_HDR_LEN) {
      int rc = proto_hdr_decode(buf, DEP_PROTO_MAX_BODY, &h, why, sizeof why);
      ck_assert_msg(rc == 0 || rc == DEP_ERR_PROTOCOL || rc == DEP_ERR_VERSION ||
                        rc == DEP_ERR_UNSUPPORTED,
                    "seed %llu", (unsigned long long)seed);
      /* A header that may be read on (whole, or whole but of an unknown type) is right. */
      if (rc == 0 || rc == DEP_ERR_UNSUPPORTED)
        ck_assert_msg(h.magic == DEP_PROTO_MAGIC && proto_version_known(h.version) &&
                          h.body_len <= DEP_PROTO_MAX_BODY && h.type > 0 &&
                          proto_type_known(h.type) == (rc == 0),
                      "seed %llu", (unsigned long long)seed);
      decode_all_types(buf + DEP_PROTO_HDR_LEN, len - DEP_PROTO_HDR_LEN, &out, seed);
    }
    decode_all_types(buf, len, &out, seed);
  }
  for (int i = 0; i < ns; i++)
    proto_buf_free(&valid[i]);
  proto_buf_free(&out);
  dep_status_free(st);
  signal(SIGSEGV, SIG_DFL);
  signal(SIGABRT, SIG_DFL);
  signal(SIGBUS, SIG_DFL);
}
END_TEST

/* ---- STATS_RANK's tokens: a count the body says, bounded ---- */

/* Where STATS_RANK's tokens_world is in the body m encodes to: after the fixed fields, the ops
 * and the layouts count, i.e. the body's length less the tokens and the 8-byte tail. */
static size_t tokens_count_at(const struct dep_msg_stats_rank *m, size_t body_len) {
  return body_len - 8 - (size_t)m->tokens_world * 4 - 4;
}

/*
 * STATS_RANK carries a count per rank of a world of up to DEP_MAX_WORLD: its decoder takes the
 * count from the body, so a count past the bound, or past the bytes the body holds, is refused
 * before anything is allocated, and a body that decodes holds exactly its count's tokens.
 * Bodies of the largest world and of small ones, with their count set to random and to edge
 * values, bytes flipped and cut; whatever decodes re-encodes to the same bytes and frees
 * clean (ASan says where it would not).
 */
START_TEST(stats_rank_tokens_are_bounded_by_the_world_and_the_body) {
  const char *env = getenv("DEP_TEST_SEED");
  uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
  rng_state = seed != 0 ? seed : 1;
  uint32_t *tokens = calloc(DEP_MAX_WORLD, sizeof *tokens);
  ck_assert_ptr_nonnull(tokens);
  for (uint32_t k = 0; k < DEP_MAX_WORLD; k++)
    tokens[k] = k * 7u;
  struct proto_buf b, out;
  proto_buf_init(&b);
  proto_buf_init(&out);
  const uint32_t worlds[] = {0, 1, 128, 1024, DEP_MAX_WORLD};
  for (size_t w = 0; w < sizeof worlds / sizeof worlds[0]; w++) {
    struct dep_msg_stats_rank m;
    memset(&m, 0, sizeof m);
    snprintf(m.job_id, sizeof m.job_id, "big");
    m.world = worlds[w];
    m.tokens_world = worlds[w];
    m.tokens = worlds[w] > 0 ? tokens : NULL;
    proto_buf_reset(&b);
    ck_assert_int_eq(proto_encode_stats_rank(&b, &m), 0);
    ck_assert_uint_le(b.len, DEP_PROTO_MAX_BODY);
    const size_t at = tokens_count_at(&m, b.len);
    ck_assert_uint_eq(codec_get_u32(b.data + at), worlds[w]);
    uint8_t *body = malloc(b.len + 64);
    ck_assert_ptr_nonnull(body);
    const uint32_t edges[] = {DEP_MAX_WORLD + 1, UINT32_MAX, UINT32_MAX / 4, worlds[w] + 1,
                              worlds[w] > 0 ? worlds[w] - 1 : 0};
    for (int iter = 0; iter < 2000; iter++) {
      memcpy(body, b.data, b.len);
      size_t len = b.len;
      uint32_t count = iter < 5 ? edges[iter] : (uint32_t)rng();
      if (iter >= 5 && rng() % 2)
        count %= DEP_MAX_WORLD + 2;
      codec_put_u32(body + at, count);
      if (iter >= 5 && rng() % 4 == 0)
        body[rng() % len] ^= (uint8_t)(1u << (rng() % 8));
      if (iter >= 5 && rng() % 4 == 0)
        len = (size_t)(rng() % (len + 1));
      struct dep_msg_stats_rank back;
      int rc = proto_decode_stats_rank(body, len, &back);
      ck_assert_msg(rc == 0 || rc == DEP_ERR_PROTOCOL, "seed %llu: %d",
                    (unsigned long long)seed, rc);
      /* An edge count, the body otherwise whole: only the true count reads the body exactly. */
      if (iter < 5)
        ck_assert_msg(rc == (count == worlds[w] ? 0 : DEP_ERR_PROTOCOL),
                      "world %u, count %u: %s", worlds[w], count, dep_errname(rc));
      if (rc != 0) {
        ck_assert_ptr_null(back.tokens);
        continue;
      }
      ck_assert_uint_le(back.tokens_world, DEP_MAX_WORLD);
      proto_buf_reset(&out);
      ck_assert_int_eq(proto_encode_stats_rank(&out, &back), 0);
      ck_assert_msg(out.len == len && memcmp(out.data, body, len) == 0,
                    "seed %llu: a decoded STATS_RANK did not round-trip",
                    (unsigned long long)seed);
      proto_stats_rank_free(&back);
    }
    free(body);
  }
  proto_buf_free(&b);
  proto_buf_free(&out);
  free(tokens);
}
END_TEST

/* ---- the fuzz seeds (tests/corpus/frame, tests/corpus/peer) ---- */

/* A whole seed file into b (reset first); 0, or -1 when it cannot be read. */
static int read_seed(const char *path, struct proto_buf *b) {
  proto_buf_reset(b);
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return -1;
  uint8_t chunk[4096];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
    uint8_t *p = codec_grow(b, n);
    ck_assert_ptr_nonnull(p);
    memcpy(p, chunk, n);
  }
  int bad = ferror(f);
  fclose(f);
  return bad ? -1 : 0;
}

/* Decode one control frame as its type's decoder does: 0, or the code with why. */
static int decode_frame_seed(const uint8_t *p, size_t len, char *why, size_t whylen) {
  struct dep_frame_hdr h;
  if (len < DEP_PROTO_HDR_LEN) {
    snprintf(why, whylen, "%zu bytes, shorter than a header", len);
    return DEP_ERR_PROTOCOL;
  }
  int rc = proto_hdr_decode(p, DEP_PROTO_MAX_BODY, &h, why, whylen);
  if (rc != 0)
    return rc;
  if (h.body_len != len - DEP_PROTO_HDR_LEN) {
    snprintf(why, whylen, "header says %u body bytes, the file holds %zu", (unsigned)h.body_len,
             len - DEP_PROTO_HDR_LEN);
    return DEP_ERR_PROTOCOL;
  }
  const uint8_t *body = p + DEP_PROTO_HDR_LEN;
  size_t blen = h.body_len;
  /* The three that allocate or are large have decoders of their own
   * (proto_body_decode's comment); the rest go through the dispatch. */
  if (h.type == DEP_MSG_PEERS_OK) {
    struct dep_msg_peers m;
    rc = proto_decode_peers(body, blen, &m);
    if (rc == 0)
      proto_peers_free(&m);
  } else if (h.type == DEP_MSG_CLIENTS_OK) {
    struct dep_msg_clients m;
    rc = proto_decode_clients(body, blen, &m);
    if (rc == 0)
      proto_clients_free(&m);
  } else if (h.type == DEP_MSG_JOB_NODES_OK) {
    struct dep_msg_job_nodes *m = malloc(sizeof *m);
    ck_assert_ptr_nonnull(m);
    rc = proto_decode_job_nodes(body, blen, m);
    free(m);
  } else if (h.type == DEP_MSG_JOB_EVENTS_OK) {
    struct dep_msg_job_events *m = malloc(sizeof *m);
    ck_assert_ptr_nonnull(m);
    rc = proto_decode_job_events(body, blen, m);
    free(m);
  } else {
    union dep_msg_body *m = malloc(sizeof *m);
    ck_assert_ptr_nonnull(m);
    rc = proto_body_decode(h.type, body, blen, m);
    if (rc == 0 && h.type == DEP_MSG_STATUS_OK) {
      free(m->status.devices);
      free(m->status.jobs);
    }
    if (rc == 0 && h.type == DEP_MSG_STATS_RANK)
      proto_stats_rank_free(&m->stats_rank);
    free(m);
  }
  if (rc != 0)
    snprintf(why, whylen, "its %s body does not decode", proto_type_name(h.type));
  return rc;
}

/* Decode one seed as its harness's decoders do; 0, or the code with why. */
static int decode_seed(enum corpus_seed_kind kind, const uint8_t *p, size_t len, char *why,
                       size_t whylen) {
  why[0] = '\0';
  if (kind == CORPUS_FRAME)
    return decode_frame_seed(p, len, why, whylen);
  if (kind == CORPUS_XFER_HDR) {
    struct dep_xfer_hdr h;
    return dep__xfer_hdr_decode(p, len, &h, why, whylen);
  }
  if (kind == CORPUS_PEERS_BODY) {
    struct dep_msg_peers m;
    int rc = proto_decode_peers(p, len, &m);
    if (rc == 0)
      proto_peers_free(&m);
    else
      snprintf(why, whylen, "not a PEERS_OK body");
    return rc;
  }
  struct dep_peer_msg *m = malloc(sizeof *m);
  ck_assert_ptr_nonnull(m);
  int rc = peer_proto_decode(p, len, m, why, whylen);
  free(m);
  return rc;
}

static const struct corpus_seed *seed_named(const char *dir, const char *name) {
  for (size_t i = 0; i < corpus_nseeds; i++)
    if (strcmp(corpus_seeds[i].dir, dir) == 0 && strcmp(corpus_seeds[i].name, name) == 0)
      return &corpus_seeds[i];
  return NULL;
}

/* Append one complaint about a seed to the report (cut short when full). */
static void complain(char *report, size_t cap, const char *dir, const char *name,
                     const char *what, const char *why) {
  size_t used = strlen(report);
  if (used + 1 < cap)
    snprintf(report + used, cap - used, "\n  tests/corpus/%s/%s: %s%s%s", dir, name, what,
             why[0] ? ": " : "", why);
}

/*
 * Every seed libFuzzer starts from must reach a decoder: a seed of another
 * protocol version is refused at the version check, and the harness then
 * explores only the header checks.  So each seed in tests/corpus/frame and
 * tests/corpus/peer decodes at this build's versions (those named
 * unknown_type* are refused as DEP_ERR_UNSUPPORTED, an unknown type in a
 * header right otherwise), each is the bytes its fixed message in
 * corpus_seeds.c encodes to now (`make corpus` writes them anew), and every
 * message type of both protocols has a seed.  Runs from the repository root.
 */
START_TEST(every_fuzz_seed_decodes_at_this_version) {
  static char report[16384];
  report[0] = '\0';
  struct proto_buf file, want;
  proto_buf_init(&file);
  proto_buf_init(&want);
  const char *const dirs[] = {"frame", "peer"};
  bool frame_type_seen[DEP_MSG_TYPE_MAX_] = {false};
  bool peer_type_seen[DEP_PEER_TYPE_MAX_] = {false};
  for (size_t d = 0; d < sizeof dirs / sizeof dirs[0]; d++) {
    char path[512];
    snprintf(path, sizeof path, "tests/corpus/%s", dirs[d]);
    DIR *dp = opendir(path);
    ck_assert_msg(dp != NULL, "no %s in the current directory (run from the root)", path);
    size_t nfiles = 0;
    struct dirent *e;
    while ((e = readdir(dp)) != NULL) {
      if (e->d_name[0] == '.')
        continue;
      nfiles++;
      snprintf(path, sizeof path, "tests/corpus/%s/%s", dirs[d], e->d_name);
      ck_assert_msg(read_seed(path, &file) == 0, "%s cannot be read", path);
      const struct corpus_seed *s = seed_named(dirs[d], e->d_name);
      enum corpus_seed_kind kind = s != NULL ? s->kind
                                   : d == 0  ? CORPUS_FRAME
                                             : CORPUS_PEER;
      char why[512];
      int rc = decode_seed(kind, file.data, file.len, why, sizeof why);
      if (corpus_seed_is_unknown_type(e->d_name)) {
        if (rc != DEP_ERR_UNSUPPORTED) {
          char what[64];
          snprintf(what, sizeof what, "decodes with %s, not DEP_ERR_UNSUPPORTED",
                   rc == 0 ? "success" : dep_errname(rc));
          complain(report, sizeof report, dirs[d], e->d_name, what, why);
        }
      } else if (rc != 0) {
        char what[64];
        snprintf(what, sizeof what, "refused with %s", dep_errname(rc));
        complain(report, sizeof report, dirs[d], e->d_name, what, why);
      } else if (kind == CORPUS_FRAME) {
        frame_type_seen[codec_get_u16(file.data + 6)] = true;
      } else if (kind == CORPUS_PEER) {
        peer_type_seen[codec_get_u16(file.data + 6)] = true;
      }
      if (s == NULL) {
        complain(report, sizeof report, dirs[d], e->d_name,
                 "has no fixed message in tests/corpus_seeds.c (add one, or delete it)", "");
        continue;
      }
      proto_buf_reset(&want);
      rc = s->build(&want);
      ck_assert_msg(rc == 0, "the fixed message of %s does not encode: %s", path,
                    dep_strerror(rc));
      if (want.len != file.len || memcmp(want.data, file.data, file.len) != 0)
        complain(report, sizeof report, dirs[d], e->d_name,
                 "differs from what the encoder writes for its fixed message (make corpus)", "");
    }
    closedir(dp);
    ck_assert_msg(nfiles > 0, "tests/corpus/%s holds no seeds", dirs[d]);
  }
  for (size_t i = 0; i < corpus_nseeds; i++) {
    char path[512];
    snprintf(path, sizeof path, "tests/corpus/%s/%s", corpus_seeds[i].dir, corpus_seeds[i].name);
    if (access(path, F_OK) != 0)
      complain(report, sizeof report, corpus_seeds[i].dir, corpus_seeds[i].name,
               "is missing (make corpus)", "");
  }
  for (uint16_t t = 1; t < DEP_MSG_TYPE_MAX_; t++)
    if (!frame_type_seen[t])
      complain(report, sizeof report, "frame", "", "no seed of type", proto_type_name(t));
  for (uint16_t t = 1; t < DEP_PEER_TYPE_MAX_; t++)
    if (!peer_type_seen[t])
      complain(report, sizeof report, "peer", "", "no seed of type", peer_proto_type_name(t));
  proto_buf_free(&file);
  proto_buf_free(&want);
  /* Check carries at most a few kilobytes of message: the whole list goes to
   * stderr, its start into the failure. */
  if (report[0] != '\0')
    fprintf(stderr, "fuzz seeds the harnesses would not decode as they are:%s\n", report);
  ck_assert_msg(report[0] == '\0',
                "fuzz seeds the harnesses would not decode as they are (all on stderr):%.2500s",
                report);
}
END_TEST

Suite *proto_fuzz_suite(void);
Suite *proto_fuzz_suite(void) {
  Suite *s = suite_create("proto_fuzz");
  TCase *corpus = tcase_create("corpus");
  tcase_add_test(corpus, every_fuzz_seed_decodes_at_this_version);
  suite_add_tcase(s, corpus);

  TCase *rnd = tcase_create("random");
  tcase_set_timeout(rnd, 120); /* 100k frames take seconds under ASan */
  tcase_add_test(rnd, random_frames_never_crash_a_decoder);
  tcase_add_test(rnd, stats_rank_tokens_are_bounded_by_the_world_and_the_body);
  suite_add_tcase(s, rnd);
  return s;
}
