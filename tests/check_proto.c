/*
 * check_proto.c — the wire protocol as a specification: every message
 * round-trips, every malformed frame is refused with the right code, random
 * bytes never crash a decoder, attach fields and job ids are checked with
 * messages naming them, and every error code has a name and a description.
 * The job shape's table has its own suite (check_shape.c), and so has fd
 * passing (check_fdpass.c); random frames and the fuzz seeds are
 * check_proto_fuzz.c's.  The sample messages both use are protosamples.c's.
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
#include "grow.h"
#include "peer_proto.h"
#include "proto.h"
#include "protosamples.h"
#include "uuid.h"

/* ---- helpers ------------------------------------------------------------- */

/* Encode a frame, check its header, and return a pointer to its body. */
static const uint8_t *encode_frame(struct proto_buf *b, uint16_t type, const void *msg,
                                   uint32_t *body_len) {
  proto_buf_reset(b);
  ck_assert_int_eq(proto_frame_encode(b, type, 0, 0xA1B2C3D4u, msg), 0);
  ck_assert_uint_ge(b->len, DEP_PROTO_HDR_LEN);
  struct dep_frame_hdr h;
  char why[256] = "";
  ck_assert_int_eq(proto_hdr_decode(b->data, DEP_PROTO_MAX_BODY, &h, why, sizeof why), 0);
  ck_assert_uint_eq(h.magic, DEP_PROTO_MAGIC);
  ck_assert_uint_eq(h.version, DEP_PROTO_VERSION);
  ck_assert_uint_eq(h.type, type);
  ck_assert_uint_eq(h.flags, 0);
  ck_assert_uint_eq(h.request_id, 0xA1B2C3D4u);
  ck_assert_uint_eq(h.body_len, b->len - DEP_PROTO_HDR_LEN);
  *body_len = h.body_len;
  return b->data + DEP_PROTO_HDR_LEN;
}

static void assert_status_eq(const struct dep_status *a, const struct dep_status *b) {
  ck_assert_str_eq(a->version, b->version);
  ck_assert_uint_eq(a->proto_version, b->proto_version);
  ck_assert_uint_eq(a->pid, b->pid);
  ck_assert_uint_eq(a->uptime_ms, b->uptime_ms);
  ck_assert_str_eq(a->backend, b->backend);
  ck_assert_uint_eq(a->num_clients, b->num_clients);
  ck_assert_uint_eq(a->num_devices, b->num_devices);
  ck_assert_uint_eq(a->num_jobs, b->num_jobs);
  for (uint32_t i = 0; i < a->num_devices; i++) {
    ck_assert_str_eq(a->devices[i].uuid, b->devices[i].uuid);
    ck_assert_str_eq(a->devices[i].name, b->devices[i].name);
    ck_assert_str_eq(a->devices[i].backend, b->devices[i].backend);
    ck_assert_uint_eq(a->devices[i].pool_total_bytes, b->devices[i].pool_total_bytes);
    ck_assert_uint_eq(a->devices[i].pool_used_bytes, b->devices[i].pool_used_bytes);
    ck_assert_uint_eq(a->devices[i].pool_cached_bytes, b->devices[i].pool_cached_bytes);
  }
  for (uint32_t i = 0; i < a->num_jobs; i++) {
    ck_assert_str_eq(a->jobs[i].job_id, b->jobs[i].job_id);
    ck_assert_uint_eq(a->jobs[i].owner_uid, b->jobs[i].owner_uid);
    ck_assert_uint_eq(a->jobs[i].ranks_attached, b->jobs[i].ranks_attached);
    ck_assert_uint_eq(a->jobs[i].ranks_expected, b->jobs[i].ranks_expected);
    ck_assert_uint_eq(a->jobs[i].world_size, b->jobs[i].world_size);
    ck_assert_uint_eq(a->jobs[i].slab_bytes, b->jobs[i].slab_bytes);
    ck_assert_uint_eq(a->jobs[i].age_ms, b->jobs[i].age_ms);
  }
}

/* Decoding must fail with `want`; a status that somehow succeeded is freed. */
static void expect_body_rc(uint16_t type, const uint8_t *p, size_t len, int want) {
  union dep_msg_body m;
  int rc = proto_body_decode(type, p, len, &m);
  if (rc == 0 && type == DEP_MSG_STATUS_OK) {
    free(m.status.devices);
    free(m.status.jobs);
  }
  ck_assert_msg(rc == want, "%s body of %zu bytes: got %s, want %s", proto_type_name(type), len,
                dep_errname(rc), dep_errname(want));
}

static void make_hdr(uint8_t out[DEP_PROTO_HDR_LEN], uint16_t version, uint16_t type,
                     uint32_t flags, uint32_t body_len) {
  struct dep_frame_hdr h = {DEP_PROTO_MAGIC, version, type, flags, 9, body_len};
  proto_hdr_encode(&h, out);
}

/* ---- round trips --------------------------------------------------------- */

/* ---- field tables (codec.h) ---------------------------------------------- */

struct every_kind {
  uint8_t a;
  uint16_t b;
  uint32_t c;
  uint64_t d;
  int32_t e;
  char f[8];
  uint8_t g[5];
  struct {
    uint32_t h;
  } in;
  char z[6];
};

static const struct codec_field every_kind_f[] = {
    CODEC_U8(struct every_kind, a),   CODEC_U16(struct every_kind, b),
    CODEC_U32(struct every_kind, c),  CODEC_U64(struct every_kind, d),
    CODEC_I32(struct every_kind, e),  CODEC_STR(struct every_kind, f),
    CODEC_BYTES(struct every_kind, g), CODEC_U32(struct every_kind, in.h),
    CODEC_FSTR(struct every_kind, z),
};

START_TEST(a_field_table_writes_each_kind_in_order_and_reads_it_back) {
  struct every_kind x = {.a = 0xA1, .b = 0xB2C3, .c = 0xC4D5E6F7u, .d = 0x0102030405060708ull,
                         .e = -42, .f = "seven!!", .g = {9, 8, 7, 6, 5}, .in = {.h = 77},
                         .z = "ab"};
  static const uint8_t wire[] = {0xA1, 0xC3, 0xB2, 0xF7, 0xE6, 0xD5, 0xC4, 8, 7, 6, 5, 4, 3,
                                 2, 1, 0xD6, 0xFF, 0xFF, 0xFF, 7, 0, 's', 'e', 'v', 'e', 'n',
                                 '!', '!', 9, 8, 7, 6, 5, 77, 0, 0, 0, 'a', 'b', 0, 0, 0, 0};
  struct proto_buf b = {0};
  struct codec_w w;
  codec_w_init(&w, &b);
  codec_w_rec(&w, every_kind_f, CODEC_NFIELDS(every_kind_f), &x);
  ck_assert_int_eq(codec_w_finish(&w), 0);
  ck_assert_uint_eq(b.len, sizeof wire);
  ck_assert_mem_eq(b.data, wire, sizeof wire);

  struct every_kind y;
  memset(&y, 0x55, sizeof y);
  struct codec_r r;
  codec_r_init(&r, b.data, b.len);
  codec_r_rec(&r, every_kind_f, CODEC_NFIELDS(every_kind_f), &y);
  ck_assert_int_eq(codec_r_finish(&r), 0);
  ck_assert(y.a == x.a && y.b == x.b && y.c == x.c && y.d == x.d && y.e == x.e &&
            y.in.h == x.in.h);
  ck_assert_str_eq(y.f, x.f);
  ck_assert_mem_eq(y.g, x.g, sizeof x.g);
  ck_assert_str_eq(y.z, x.z);

  /* A fixed string must hold its NUL and nothing after it: one encoding per string. */
  uint8_t odd[sizeof wire];
  memcpy(odd, wire, sizeof wire);
  odd[sizeof wire - 1] = 'c';
  codec_r_init(&r, odd, sizeof odd);
  codec_r_rec(&r, every_kind_f, CODEC_NFIELDS(every_kind_f), &y);
  ck_assert_int_eq(codec_r_finish(&r), DEP_ERR_PROTOCOL);
  memset(odd + sizeof wire - sizeof x.z, 'c', sizeof x.z);
  codec_r_init(&r, odd, sizeof odd);
  codec_r_rec(&r, every_kind_f, CODEC_NFIELDS(every_kind_f), &y);
  ck_assert_int_eq(codec_r_finish(&r), DEP_ERR_PROTOCOL);

  /* The smallest encoding is that of a record whose string is empty. */
  struct every_kind z = {0};
  proto_buf_reset(&b);
  codec_w_init(&w, &b);
  codec_w_rec(&w, every_kind_f, CODEC_NFIELDS(every_kind_f), &z);
  ck_assert_int_eq(codec_w_finish(&w), 0);
  ck_assert_uint_eq(codec_rec_min(every_kind_f, CODEC_NFIELDS(every_kind_f)), b.len);

  /* Every truncation is refused, and reading stops at the first short field. */
  proto_buf_reset(&b);
  codec_w_init(&w, &b);
  codec_w_rec(&w, every_kind_f, CODEC_NFIELDS(every_kind_f), &x);
  ck_assert_int_eq(codec_w_finish(&w), 0);
  for (size_t n = 0; n < b.len; n++) {
    codec_r_init(&r, b.data, n);
    codec_r_rec(&r, every_kind_f, CODEC_NFIELDS(every_kind_f), &y);
    ck_assert_msg(codec_r_finish(&r) == DEP_ERR_PROTOCOL, "a body cut to %zu bytes was read", n);
  }

  /* A string that does not fit its member fails the write and leaves the buffer as it was. */
  size_t before = b.len;
  memset(x.z, 'x', sizeof x.z); /* no NUL */
  codec_w_init(&w, &b);
  codec_w_rec(&w, every_kind_f, CODEC_NFIELDS(every_kind_f), &x);
  ck_assert_int_eq(codec_w_finish(&w), DEP_ERR_INVALID);
  ck_assert_uint_eq(b.len, before);
  memset(x.f, 'x', sizeof x.f); /* no NUL */
  codec_w_init(&w, &b);
  codec_w_rec(&w, every_kind_f, CODEC_NFIELDS(every_kind_f), &x);
  ck_assert_int_eq(codec_w_finish(&w), DEP_ERR_INVALID);
  ck_assert_uint_eq(b.len, before);
  proto_buf_free(&b);
}
END_TEST

START_TEST(every_message_type_round_trips) {
  struct proto_buf b;
  proto_buf_init(&b);
  uint32_t len;
  const uint8_t *body;

  body = encode_frame(&b, DEP_MSG_ERROR, &s_err, &len);
  struct dep_msg_error e;
  ck_assert_int_eq(proto_body_decode(DEP_MSG_ERROR, body, len, &e), 0);
  ck_assert_int_eq(e.code, s_err.code);
  ck_assert_str_eq(e.message, s_err.message);

  struct dep_msg_error e_long = {.code = INT32_MIN};
  memset(e_long.message, 'x', sizeof e_long.message - 1);
  body = encode_frame(&b, DEP_MSG_ERROR, &e_long, &len);
  ck_assert_int_eq(proto_body_decode(DEP_MSG_ERROR, body, len, &e), 0);
  ck_assert_int_eq(e.code, INT32_MIN);
  ck_assert_str_eq(e.message, e_long.message);

  body = encode_frame(&b, DEP_MSG_HELLO, &s_hello, &len);
  struct dep_msg_hello h;
  ck_assert_int_eq(proto_body_decode(DEP_MSG_HELLO, body, len, &h), 0);
  ck_assert_uint_eq(h.version, s_hello.version);
  ck_assert_uint_eq(h.pid, s_hello.pid);
  ck_assert_str_eq(h.name, s_hello.name);

  body = encode_frame(&b, DEP_MSG_HELLO_OK, &s_hello_ok, &len);
  struct dep_msg_hello_ok ho;
  ck_assert_int_eq(proto_body_decode(DEP_MSG_HELLO_OK, body, len, &ho), 0);
  ck_assert_uint_eq(ho.version, s_hello_ok.version);
  ck_assert_str_eq(ho.daemon_version, s_hello_ok.daemon_version);
  ck_assert_str_eq(ho.backend, s_hello_ok.backend);

  struct dep_attach_args a = sample_attach(), a2;
  body = encode_frame(&b, DEP_MSG_ATTACH, &a, &len);
  ck_assert_int_eq(proto_body_decode(DEP_MSG_ATTACH, body, len, &a2), 0);
  ck_assert_str_eq(a2.job_id, a.job_id);
  ck_assert_uint_eq(a2.rank, a.rank);
  ck_assert_uint_eq(a2.world_size, a.world_size);
  ck_assert_uint_eq(a2.local_rank, a.local_rank);
  ck_assert_uint_eq(a2.local_world_size, a.local_world_size);
  ck_assert_mem_eq(a2.device_uuid, a.device_uuid, 16);
  ck_assert_uint_eq(a2.shape.max_tokens_per_rank, a.shape.max_tokens_per_rank);
  ck_assert_uint_eq(a2.shape.hidden, a.shape.hidden);
  ck_assert_uint_eq(a2.shape.num_experts, a.shape.num_experts);
  ck_assert_uint_eq(a2.shape.topk, a.shape.topk);
  ck_assert_uint_eq(a2.shape.dtype, a.shape.dtype);
  ck_assert_uint_eq(a2.shape.max_ll_tokens_per_rank, a.shape.max_ll_tokens_per_rank);

  body = encode_frame(&b, DEP_MSG_ATTACH_OK, &s_attach_ok, &len);
  struct dep_msg_attach_ok ao;
  ck_assert_int_eq(proto_body_decode(DEP_MSG_ATTACH_OK, body, len, &ao), 0);
  ck_assert_uint_eq(ao.slab_bytes, s_attach_ok.slab_bytes);
  ck_assert_uint_eq(ao.local_world_size, s_attach_ok.local_world_size);
  ck_assert_uint_eq(ao.num_fds, s_attach_ok.num_fds);
  ck_assert_str_eq(ao.backend, s_attach_ok.backend);
  ck_assert_uint_eq(ao.op_timeout_ms, s_attach_ok.op_timeout_ms);
  ck_assert_uint_eq(ao.kernel_warmup, s_attach_ok.kernel_warmup);

  body = encode_frame(&b, DEP_MSG_SLAB, &s_slab, &len);
  struct dep_msg_slab sl;
  ck_assert_int_eq(proto_body_decode(DEP_MSG_SLAB, body, len, &sl), 0);
  ck_assert_uint_eq(sl.n_ranks, s_slab.n_ranks);
  for (uint32_t i = 0; i < sl.n_ranks; i++) {
    ck_assert_uint_eq(sl.ranks[i].local_rank, s_slab.ranks[i].local_rank);
    ck_assert_uint_eq(sl.ranks[i].rank, s_slab.ranks[i].rank);
    ck_assert_uint_eq(sl.ranks[i].offset, s_slab.ranks[i].offset);
  }
  ck_assert_uint_eq(sl.chunk_bytes, s_slab.chunk_bytes);
  ck_assert_uint_eq(sl.n_chunks, s_slab.n_chunks);
  ck_assert_mem_eq(sl.device_uuid, s_slab.device_uuid, 16);
  struct dep_msg_slab bad = s_slab;
  bad.n_chunks = 0;
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_SLAB, 0, 1, &bad), DEP_ERR_INVALID);
  bad.n_chunks = DEP_PROTO_MAX_FDS + 1;
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_SLAB, 0, 1, &bad), DEP_ERR_INVALID);
  bad = s_slab;
  bad.n_ranks = 0;
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_SLAB, 0, 1, &bad), DEP_ERR_INVALID);
  bad.n_ranks = DEP_MAX_LOCAL_RANKS + 1;
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_SLAB, 0, 1, &bad), DEP_ERR_INVALID);

  /* RELOAD_OK: the message and both lists of keys read back, each name whole. */
  body = encode_frame(&b, DEP_MSG_RELOAD_OK, &s_reload_ok, &len);
  static struct dep_msg_reload_ok ro;
  ck_assert_int_eq(proto_body_decode(DEP_MSG_RELOAD_OK, body, len, &ro), 0);
  ck_assert_str_eq(ro.message, s_reload_ok.message);
  ck_assert_uint_eq(ro.n_applied, 1);
  ck_assert_str_eq(ro.applied[0], "log_level");
  ck_assert_uint_eq(ro.n_restart, 2);
  ck_assert_str_eq(ro.restart[0], "socket.path");
  ck_assert_str_eq(ro.restart[1], "pool.chunk_size");
  /* A list longer than DEP_RELOAD_KEYS_MAX is neither written nor read. */
  ro = s_reload_ok;
  ro.n_restart = DEP_RELOAD_KEYS_MAX + 1;
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_RELOAD_OK, 0, 1, &ro), DEP_ERR_INVALID);
  /* An empty message, DEP_RELOAD_KEYS_MAX + 1 empty names, no restart key: whole but too many. */
  uint8_t many[2 + 4 + 2 * (DEP_RELOAD_KEYS_MAX + 1) + 4] = {0};
  codec_put_u32(many + 2, DEP_RELOAD_KEYS_MAX + 1);
  ck_assert_int_eq(proto_body_decode(DEP_MSG_RELOAD_OK, many, sizeof many, &ro), DEP_ERR_PROTOCOL);
  codec_put_u32(many + 2, DEP_RELOAD_KEYS_MAX);
  ck_assert_int_eq(proto_body_decode(DEP_MSG_RELOAD_OK, many, sizeof many - 2, &ro), 0);

  const uint16_t empty[] = {DEP_MSG_STATUS, DEP_MSG_DETACH, DEP_MSG_DETACH_OK, DEP_MSG_SHUTDOWN,
                            DEP_MSG_RELOAD};
  for (size_t i = 0; i < sizeof empty / sizeof empty[0]; i++) {
    body = encode_frame(&b, empty[i], NULL, &len);
    ck_assert_uint_eq(len, 0);
    ck_assert_int_eq(proto_body_decode(empty[i], body, len, NULL), 0);
  }
  proto_buf_free(&b);
}
END_TEST

START_TEST(status_round_trips_with_0_1_and_many_records) {
  const uint32_t counts[][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {300, 0}, {0, 500}, {700, 900}};
  struct proto_buf b;
  proto_buf_init(&b);
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
    struct dep_status *st = sample_status(counts[i][0], counts[i][1]);
    uint32_t len;
    const uint8_t *body = encode_frame(&b, DEP_MSG_STATUS_OK, st, &len);
    struct dep_status *got = malloc(sizeof *got);
    ck_assert_ptr_nonnull(got);
    ck_assert_int_eq(proto_body_decode(DEP_MSG_STATUS_OK, body, len, got), 0);
    assert_status_eq(st, got);
    if (counts[i][0] == 0)
      ck_assert_ptr_null(got->devices);
    dep_status_free(got);
    dep_status_free(st);
  }
  dep_status_free(NULL);
  proto_buf_free(&b);
}
END_TEST

START_TEST(frames_append_and_failed_encodes_leave_the_buffer_alone) {
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_STATUS, 0, 1, NULL), 0);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_HELLO, 0, 2, &s_hello), 0);
  size_t len = b.len;
  struct dep_frame_hdr h;
  ck_assert_int_eq(proto_hdr_decode(b.data + DEP_PROTO_HDR_LEN, DEP_PROTO_MAX_BODY, &h, NULL, 0),
                   0);
  ck_assert_uint_eq(h.type, DEP_MSG_HELLO);
  ck_assert_uint_eq(h.request_id, 2);
  ck_assert_uint_eq(len, 2 * DEP_PROTO_HDR_LEN + h.body_len);

  /* A name that fills its array has no room for the NUL: not representable. */
  struct dep_msg_hello bad = s_hello;
  memset(bad.name, 'n', sizeof bad.name);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_HELLO, 0, 3, &bad), DEP_ERR_INVALID);
  ck_assert_int_eq(proto_encode_hello(&b, &bad), DEP_ERR_INVALID);
  struct dep_msg_error ok_code = {.code = 0, .message = "not an error"};
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_ERROR, 0, 3, &ok_code), DEP_ERR_INVALID);
  struct dep_msg_attach_ok many = s_attach_ok;
  many.num_fds = DEP_PROTO_MAX_FDS + 1;
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_ATTACH_OK, 0, 3, &many), DEP_ERR_INVALID);
  ck_assert_int_eq(proto_frame_encode(&b, 0, 0, 3, NULL), DEP_ERR_INVALID);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_TYPE_MAX_, 0, 3, NULL), DEP_ERR_INVALID);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_STATUS, 0x80, 3, NULL), DEP_ERR_INVALID);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_HELLO, 0, 3, NULL), DEP_ERR_INVALID);
  struct dep_status nodev = {.num_devices = 2, .devices = NULL};
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_STATUS_OK, 0, 3, &nodev), DEP_ERR_INVALID);
  /* A status too big for one frame is refused rather than cut. */
  struct dep_status *huge = sample_status(4000, 0);
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_STATUS_OK, 0, 3, huge), DEP_ERR_INVALID);
  dep_status_free(huge);
  ck_assert_uint_eq(b.len, len);
  proto_buf_reset(&b);
  ck_assert_uint_eq(b.len, 0);
  proto_buf_free(&b);
  ck_assert_ptr_null(b.data);
}
END_TEST

/* ---- header rejections --------------------------------------------------- */

START_TEST(header_checks_each_field_in_order) {
  uint8_t raw[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h;
  char why[256];

  make_hdr(raw, DEP_PROTO_VERSION, DEP_MSG_HELLO, DEP_FRAME_F_FDS, 100);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, why, sizeof why), 0);
  ck_assert_uint_eq(h.flags, DEP_FRAME_F_FDS);
  ck_assert_uint_eq(h.request_id, 9);

  make_hdr(raw, DEP_PROTO_VERSION + 1, 0xEEEE, 0x80, 0xFFFFFFFF);
  raw[0] ^= 0xFF;
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, why, sizeof why),
                   DEP_ERR_PROTOCOL);
  ck_assert_ptr_nonnull(strstr(why, "magic"));

  make_hdr(raw, DEP_PROTO_VERSION + 1, 0xEEEE, 0x80, 0xFFFFFFFF);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, why, sizeof why),
                   DEP_ERR_VERSION);
  char speaks[64];
  snprintf(speaks, sizeof speaks, "speaks versions %d..%d", DEP_PROTO_MIN_VERSION,
           DEP_PROTO_VERSION);
  char far[32];
  snprintf(far, sizeof far, "version %d", DEP_PROTO_VERSION + 1);
  ck_assert_msg(strstr(why, far) && strstr(why, speaks), "why: %s", why);
  /* The window's both ends are spoken; one past either is not. */
  make_hdr(raw, DEP_PROTO_MIN_VERSION, DEP_MSG_HELLO, 0, 0);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), 0);
  make_hdr(raw, DEP_PROTO_MIN_VERSION - 1, DEP_MSG_HELLO, 0, 0);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), DEP_ERR_VERSION);
  make_hdr(raw, DEP_PROTO_VERSION + 1, DEP_MSG_HELLO, 0, 0);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), DEP_ERR_VERSION);

  /* An unknown type is UNSUPPORTED (the frame may be skipped) only where
   * the rest of the header is right; anything else wrong wins. */
  make_hdr(raw, DEP_PROTO_VERSION, 0xEEEE, 0, 40);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, why, sizeof why),
                   DEP_ERR_UNSUPPORTED);
  ck_assert_msg(strstr(why, "type 61166") != NULL, "why: %s", why);
  ck_assert_uint_eq(h.type, 0xEEEE);
  ck_assert_uint_eq(h.body_len, 40);
  ck_assert_uint_eq(h.request_id, 9);
  make_hdr(raw, DEP_PROTO_VERSION, DEP_MSG_TYPE_MAX_, 0, 0);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), DEP_ERR_UNSUPPORTED);
  make_hdr(raw, DEP_PROTO_VERSION, 0xEEEE, 0x80, 0xFFFFFFFF);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), DEP_ERR_PROTOCOL);
  make_hdr(raw, DEP_PROTO_VERSION, 0xEEEE, 0, DEP_PROTO_MAX_BODY + 1);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), DEP_ERR_PROTOCOL);
  make_hdr(raw, DEP_PROTO_VERSION, 0xEEEE, 0, 0);
  raw[20] = 1;
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), DEP_ERR_PROTOCOL);
  /* Type 0 is never sent: a broken stream, not a newer peer. */
  make_hdr(raw, DEP_PROTO_VERSION, 0, 0, 0);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), DEP_ERR_PROTOCOL);

  make_hdr(raw, DEP_PROTO_VERSION, DEP_MSG_HELLO, 0x80, 0xFFFFFFFF);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, why, sizeof why),
                   DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "flags") != NULL, "why: %s", why);

  make_hdr(raw, DEP_PROTO_VERSION, DEP_MSG_HELLO, 0, DEP_PROTO_MAX_BODY + 1);
  raw[20] = 1;
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, why, sizeof why),
                   DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "262145 bytes") != NULL, "why: %s", why);
  make_hdr(raw, DEP_PROTO_VERSION, DEP_MSG_HELLO, 0, DEP_PROTO_MAX_BODY);
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, NULL, 0), 0);
  /* The caller's limit, not only the protocol's, is enforced. */
  make_hdr(raw, DEP_PROTO_VERSION, DEP_MSG_HELLO, 0, 65);
  ck_assert_int_eq(proto_hdr_decode(raw, 64, &h, NULL, 0), DEP_ERR_PROTOCOL);

  make_hdr(raw, DEP_PROTO_VERSION, DEP_MSG_HELLO, 0, 10);
  raw[23] = 0x01;
  ck_assert_int_eq(proto_hdr_decode(raw, DEP_PROTO_MAX_BODY, &h, why, sizeof why),
                   DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "reserved") != NULL, "why: %s", why);
}
END_TEST

START_TEST(header_is_little_endian_on_the_wire) {
  uint8_t raw[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h = {DEP_PROTO_MAGIC, 1, DEP_MSG_ATTACH, 1, 0x04030201u, 0x0000A0B0u};
  proto_hdr_encode(&h, raw);
  const uint8_t want[DEP_PROTO_HDR_LEN] = {'D', 'E', 'P', '1', 1, 0, 6, 0, 1, 0, 0, 0,
                                           1,   2,   3,   4,   0xB0, 0xA0, 0, 0, 0, 0, 0, 0};
  ck_assert_mem_eq(raw, want, DEP_PROTO_HDR_LEN);
}
END_TEST

/* ---- body rejections ----------------------------------------------------- */

START_TEST(every_truncation_and_extension_of_a_body_is_rejected) {
  struct sample s[8];
  struct dep_status *st;
  int n = samples(s, &st);
  struct proto_buf b;
  proto_buf_init(&b);
  for (int i = 0; i < n; i++) {
    uint32_t len;
    encode_frame(&b, s[i].type, s[i].msg, &len);
    /* Every prefix of the frame that still holds a header: the body is short. */
    for (size_t cut = DEP_PROTO_HDR_LEN; cut < b.len; cut++)
      expect_body_rc(s[i].type, b.data + DEP_PROTO_HDR_LEN, cut - DEP_PROTO_HDR_LEN,
                     DEP_ERR_PROTOCOL);
    /* One trailing byte is as wrong as a missing one. */
    uint8_t *longer = malloc(len + 1);
    memcpy(longer, b.data + DEP_PROTO_HDR_LEN, len);
    longer[len] = 0;
    expect_body_rc(s[i].type, longer, len + 1, DEP_ERR_PROTOCOL);
    free(longer);
  }
  const uint16_t empty[] = {DEP_MSG_STATUS, DEP_MSG_DETACH, DEP_MSG_DETACH_OK, DEP_MSG_SHUTDOWN,
                            DEP_MSG_RELOAD};
  const uint8_t one = 0;
  for (size_t i = 0; i < sizeof empty / sizeof empty[0]; i++)
    expect_body_rc(empty[i], &one, 1, DEP_ERR_PROTOCOL);
  expect_body_rc(0, &one, 0, DEP_ERR_PROTOCOL);
  expect_body_rc(DEP_MSG_TYPE_MAX_, &one, 0, DEP_ERR_PROTOCOL);
  dep_status_free(st);
  proto_buf_free(&b);
}
END_TEST

START_TEST(strings_with_nul_or_too_long_are_rejected) {
  /* HELLO: version, pid, then the name "ab\0d". */
  uint8_t body[8 + 2 + 64] = {1, 0, 0, 0, 5, 0, 0, 0, 4, 0, 'a', 'b', 0, 'd'};
  expect_body_rc(DEP_MSG_HELLO, body, 14, DEP_ERR_PROTOCOL);
  body[12] = 'c';
  expect_body_rc(DEP_MSG_HELLO, body, 14, 0);
  /* 63 bytes fit name[64]; 64 do not. */
  memset(body + 10, 'x', 64);
  body[8] = 63;
  expect_body_rc(DEP_MSG_HELLO, body, 10 + 63, 0);
  body[8] = 64;
  expect_body_rc(DEP_MSG_HELLO, body, 10 + 64, DEP_ERR_PROTOCOL);
  /* A length that runs past the end of the body. */
  body[8] = 0xFF;
  body[9] = 0xFF;
  expect_body_rc(DEP_MSG_HELLO, body, sizeof body, DEP_ERR_PROTOCOL);

  /* ERROR with a non-negative code carries no error. */
  const uint8_t err0[] = {0, 0, 0, 0, 1, 0, 'x'};
  expect_body_rc(DEP_MSG_ERROR, err0, sizeof err0, DEP_ERR_PROTOCOL);
  const uint8_t errneg[] = {0xF4, 0xFF, 0xFF, 0xFF, 1, 0, 'x'};
  struct dep_msg_error e;
  ck_assert_int_eq(proto_decode_error(errneg, sizeof errneg, &e), 0);
  ck_assert_int_eq(e.code, DEP_ERR_MISMATCH);

  /* ATTACH_OK announcing more fds than a frame can carry. */
  /* ..., backend "", op_timeout_ms, kernel_warmup, chunk_rows */
  uint8_t ao[8 + 4 + 4 + 2 + 4 + 4 + 4] = {0};
  ao[12] = 251;
  expect_body_rc(DEP_MSG_ATTACH_OK, ao, sizeof ao, DEP_ERR_PROTOCOL);
  ao[12] = 250;
  expect_body_rc(DEP_MSG_ATTACH_OK, ao, sizeof ao, 0);
}
END_TEST

/* A STATUS_OK prefix with empty strings and the given counts. */
static size_t status_prefix(uint8_t *p, uint32_t ndev, uint32_t njob) {
  memset(p, 0, 40);
  /* version "", proto, pid, uptime, backend "", state "", clients, ndev, njob */
  size_t off = 2 + 4 + 4 + 8 + 2 + 2 + 4;
  for (int i = 0; i < 4; i++) {
    p[off + i] = (uint8_t)(ndev >> (8 * i));
    p[off + 4 + i] = (uint8_t)(njob >> (8 * i));
  }
  return off + 8;
}

START_TEST(status_counts_beyond_the_body_are_rejected_before_allocating) {
  uint8_t body[4096];
  struct dep_status st;
  /* 4 billion devices in a 40-byte body: refused, not allocated (calloc of
   * that size would succeed lazily or fail with NO_MEMORY, not PROTOCOL). */
  size_t n = status_prefix(body, UINT32_MAX, 0);
  ck_assert_int_eq(proto_decode_status(body, n, &st), DEP_ERR_PROTOCOL);
  n = status_prefix(body, 0, UINT32_MAX);
  ck_assert_int_eq(proto_decode_status(body, n, &st), DEP_ERR_PROTOCOL);
  n = status_prefix(body, 0x10000000u, 0x10000000u);
  memset(body + n, 0, 200);
  ck_assert_int_eq(proto_decode_status(body, n + 200, &st), DEP_ERR_PROTOCOL);
  /* One device announced, none present. */
  n = status_prefix(body, 1, 0);
  ck_assert_int_eq(proto_decode_status(body, n, &st), DEP_ERR_PROTOCOL);
  /* Exactly enough bytes for the minimal records decodes. */
  n = status_prefix(body, 3, 2);
  /* A job record: 34 bytes, host_bytes, 18 of the elastic fields and chunk_rows. */
  memset(body + n, 0, 3 * 38 + 2 * 64);
  ck_assert_int_eq(proto_decode_status(body, n + 3 * 38 + 2 * 64, &st), 0);
  ck_assert_uint_eq(st.num_devices, 3);
  ck_assert_uint_eq(st.num_jobs, 2);
  free(st.devices);
  free(st.jobs);
  /* The same counts with a bad string in the last job: everything allocated
   * is freed (ASan's leak check holds us to it) and the struct is clean. */
  body[n + 3 * 38 + 64] = 0xFF;
  ck_assert_int_eq(proto_decode_status(body, n + 3 * 38 + 2 * 64, &st), DEP_ERR_PROTOCOL);
  ck_assert_ptr_null(st.devices);
  ck_assert_ptr_null(st.jobs);
  ck_assert_uint_eq(st.num_devices, 0);
}
END_TEST

/* ---- field checks -------------------------------------------------------- */

#define EXPECT_BAD_ATTACH(field_expr, needle)                                          \
  do {                                                                                 \
    struct dep_attach_args a_ = sample_attach();                                       \
    field_expr;                                                                        \
    char w_[256] = "";                                                                 \
    ck_assert_int_eq(proto_check_attach(&a_, w_, sizeof w_), DEP_ERR_INVALID);        \
    ck_assert_msg(strstr(w_, needle) != NULL, "want \"%s\" in \"%s\"", needle, w_);   \
  } while (0)

START_TEST(attach_fields_are_checked_with_messages_naming_them) {
  struct dep_attach_args a = sample_attach();
  char why[256] = "";
  ck_assert_int_eq(proto_check_attach(&a, why, sizeof why), 0);
  EXPECT_BAD_ATTACH(a_.job_id[0] = 0, "job_id length 0");
  EXPECT_BAD_ATTACH(a_.job_id[2] = '/', "job_id");
  EXPECT_BAD_ATTACH(a_.world_size = 0, "world_size 0 is out of range (allowed 1..4096)");
  EXPECT_BAD_ATTACH(a_.world_size = 4097, "world_size 4097");
  EXPECT_BAD_ATTACH(a_.rank = 64, "rank 64");
  EXPECT_BAD_ATTACH(a_.local_world_size = 0, "local_world_size 0");
  EXPECT_BAD_ATTACH(a_.local_world_size = 65, "local_world_size 65 is out of range (allowed 1..64)");
  EXPECT_BAD_ATTACH((a_.world_size = 4, a_.rank = 0, a_.shape.num_experts = 8,
                     a_.local_world_size = 8, a_.local_rank = 0),
                    "local_world_size 8 exceeds world_size 4");
  EXPECT_BAD_ATTACH(a_.local_rank = 8, "local_rank 8");
  EXPECT_BAD_ATTACH(a_.shape.max_tokens_per_rank = 0, "max_tokens_per_rank 0");
  EXPECT_BAD_ATTACH(a_.shape.max_tokens_per_rank = 65537, "max_tokens_per_rank 65537");
  EXPECT_BAD_ATTACH(a_.shape.hidden = 100, "hidden 100");
  EXPECT_BAD_ATTACH(a_.shape.hidden = 0, "hidden 0");
  EXPECT_BAD_ATTACH(a_.shape.hidden = 200, "hidden 200");
  EXPECT_BAD_ATTACH(a_.shape.hidden = 16384 + 128, "multiple of 128 in 128..16384");
  EXPECT_BAD_ATTACH(a_.shape.topk = 0, "topk 0");
  EXPECT_BAD_ATTACH(a_.shape.topk = 17, "topk 17 is out of range (allowed 1..16)");
  EXPECT_BAD_ATTACH(a_.shape.num_experts = 0, "num_experts 0");
  EXPECT_BAD_ATTACH(a_.shape.num_experts = 65536 + 64, "num_experts 65600");
  EXPECT_BAD_ATTACH(a_.shape.num_experts = 100, "num_experts 100 is not divisible by world_size 64");
  EXPECT_BAD_ATTACH((a_.world_size = 1, a_.rank = 0, a_.local_world_size = 1, a_.local_rank = 0,
                     a_.shape.num_experts = 4),
                    "topk 8 exceeds num_experts 4");
  EXPECT_BAD_ATTACH(a_.shape.max_ll_tokens_per_rank = 4097,
                    "max_ll_tokens_per_rank 4097 exceeds max_tokens_per_rank 4096");
  EXPECT_BAD_ATTACH(a_.shape.dtype = 0, "dtype 0");
  EXPECT_BAD_ATTACH(a_.shape.dtype = 3, "dtype 3");
  /* The limits themselves are allowed. */
  a.world_size = DEP_MAX_WORLD;
  a.rank = DEP_MAX_WORLD - 1;
  a.local_world_size = DEP_MAX_LOCAL_RANKS;
  a.local_rank = DEP_MAX_LOCAL_RANKS - 1;
  a.shape = (struct dep_job_shape){65536, 16384, 65536, 16, DEP_DTYPE_BF16, 65536};
  ck_assert_int_eq(proto_check_attach(&a, why, sizeof why), 0);
  a.shape = (struct dep_job_shape){1, 128, 4096, 1, DEP_DTYPE_BF16, 0};
  ck_assert_int_eq(proto_check_attach(&a, NULL, 0), 0);
}
END_TEST

START_TEST(job_ids_are_1_to_63_safe_characters) {
  char id[80];
  ck_assert_int_eq(proto_check_job_id("a", NULL, 0), 0);
  ck_assert_int_eq(proto_check_job_id("Run-1.2_x:y", NULL, 0), 0);
  memset(id, 'j', 63);
  id[63] = 0;
  ck_assert_int_eq(proto_check_job_id(id, NULL, 0), 0);
  memset(id, 'j', 64);
  id[64] = 0;
  ck_assert_int_eq(proto_check_job_id(id, NULL, 0), DEP_ERR_INVALID);
  const char *bad[] = {"", "a b", "a/b", "ä", "a\n", "$x", "a*"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char why[200] = "";
    ck_assert_msg(proto_check_job_id(bad[i], why, sizeof why) == DEP_ERR_INVALID, "%s", bad[i]);
    ck_assert_ptr_nonnull(strstr(why, "job_id"));
  }
  ck_assert_int_eq(proto_check_job_id(NULL, NULL, 0), DEP_ERR_INVALID);
}
END_TEST

START_TEST(type_names_cover_every_type) {
  ck_assert_str_eq(proto_type_name(DEP_MSG_ATTACH), "ATTACH");
  ck_assert_str_eq(proto_type_name(DEP_MSG_STATUS_OK), "STATUS_OK");
  ck_assert_str_eq(proto_type_name(DEP_MSG_SHUTDOWN), "SHUTDOWN");
  for (uint16_t t = 1; t < DEP_MSG_TYPE_MAX_; t++)
    ck_assert_str_ne(proto_type_name(t), "UNKNOWN");
  ck_assert_str_eq(proto_type_name(0), "UNKNOWN");
  ck_assert_str_eq(proto_type_name(DEP_MSG_TYPE_MAX_), "UNKNOWN");
}
END_TEST

/* ---- error table --------------------------------------------------------- */

START_TEST(every_error_code_has_a_name_and_description) {
#define CHECK_ERR(name, val, desc)                                \
  ck_assert_str_eq(dep_strerror(DEP_ERR_##name), desc);           \
  ck_assert_str_eq(dep_errname(DEP_ERR_##name), "DEP_ERR_" #name);
  DEP_ERRNO_MAP(CHECK_ERR)
#undef CHECK_ERR
  ck_assert_str_eq(dep_strerror(DEP_ERR_TIMEOUT), "timed out");
  ck_assert_str_eq(dep_errname(DEP_ERR_PROTOCOL), "DEP_ERR_PROTOCOL");
  ck_assert_str_eq(dep_errname(DEP_OK), "DEP_ERR_OK");
  ck_assert_str_eq(dep_strerror(-9999), "unknown error");
  ck_assert_str_eq(dep_strerror(5), "unknown error");
  ck_assert_str_eq(dep_errname(-20), "DEP_ERR_UNKNOWN");
  /* Names are distinct, so logs can tell codes apart. */
  for (int a = 0; a >= DEP_ERR_PEER; a--)
    for (int b = a - 1; b >= DEP_ERR_PEER; b--)
      ck_assert_str_ne(dep_errname(a), dep_errname(b));
}
END_TEST

/* The one growable array (proto/grow.h) under the codec's buffers, the data path's batches and
 * the tuning table: from `first`, doubling; nothing moves while it has the room; a size past
 * SIZE_MAX is refused with the array as it was. */
START_TEST(the_growable_array_doubles_and_refuses_what_cannot_fit) {
  uint32_t *a = NULL;
  size_t cap = 0;
  ck_assert_int_eq(DEP_GROW(a, cap, 1, 16), 0);
  ck_assert_uint_eq(cap, 16);
  a[15] = 7;
  uint32_t *was = a;
  ck_assert_int_eq(DEP_GROW(a, cap, 16, 16), 0);
  ck_assert_ptr_eq(a, was);
  ck_assert_int_eq(DEP_GROW(a, cap, 17, 16), 0);
  ck_assert_uint_eq(cap, 32);
  ck_assert_uint_eq(a[15], 7);
  ck_assert_int_eq(DEP_GROW(a, cap, 100, 16), 0);
  ck_assert_uint_eq(cap, 128);
  was = a;
  ck_assert_int_eq(DEP_GROW(a, cap, SIZE_MAX / 2, 16), -1);
  ck_assert_int_eq(DEP_GROW(a, cap, SIZE_MAX, 16), -1);
  ck_assert_ptr_eq(a, was);
  ck_assert_uint_eq(cap, 128);
  ck_assert_uint_eq(a[15], 7);
  free(a);
}
END_TEST

/* A GPU's UUID as every part writes and reads it (proto/uuid.h): lower-case text with its four
 * dashes, read back with or without nvidia-smi's "GPU-" and the dashes; anything but 32 hex
 * digits is refused. */
START_TEST(a_uuid_reads_back_from_its_text_and_nothing_else_is_one) {
  const uint8_t u[16] = {0xde, 0xad, 0xbe, 0xef, 0x01, 0x23, 0x45, 0x67,
                         0x89, 0xab, 0xcd, 0xef, 0x00, 0x10, 0xf0, 0xff};
  char text[DEP_UUID_STR_LEN];
  dep__uuid_str(u, text);
  ck_assert_str_eq(text, "deadbeef-0123-4567-89ab-cdef0010f0ff");
  uint8_t back[16];
  ck_assert_int_eq(dep__uuid_parse(text, back), 0);
  ck_assert_mem_eq(back, u, 16);
  memset(back, 0, sizeof back);
  ck_assert_int_eq(dep__uuid_parse("GPU-DEADBEEF0123456789abcdef0010f0ff", back), 0);
  ck_assert_mem_eq(back, u, 16);
  const uint8_t zero[16] = {0};
  dep__uuid_str(zero, text);
  ck_assert_str_eq(text, "00000000-0000-0000-0000-000000000000");
  const char *bad[] = {"", "GPU-", "deadbeef-0123-4567-89ab-cdef0010f0f",
                       "deadbeef-0123-4567-89ab-cdef0010f0ff00", "deadbeef-0123-4567-89ab-cdef0010f0fg",
                       "d-eadbeef0123456789abcdef0010f0ff", "MIG-deadbeef-0123-4567-89ab-cdef0010f0ff"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_msg(dep__uuid_parse(bad[i], back) == -1, "\"%s\" read as a UUID", bad[i]);
}
END_TEST

Suite *proto_suite(void);
Suite *proto_suite(void) {
  Suite *s = suite_create("proto");
  TCase *tc = tcase_create("codec");
  tcase_add_test(tc, every_message_type_round_trips);
  tcase_add_test(tc, the_growable_array_doubles_and_refuses_what_cannot_fit);
  tcase_add_test(tc, a_field_table_writes_each_kind_in_order_and_reads_it_back);
  tcase_add_test(tc, status_round_trips_with_0_1_and_many_records);
  tcase_add_test(tc, frames_append_and_failed_encodes_leave_the_buffer_alone);
  tcase_add_test(tc, header_checks_each_field_in_order);
  tcase_add_test(tc, header_is_little_endian_on_the_wire);
  tcase_add_test(tc, every_truncation_and_extension_of_a_body_is_rejected);
  tcase_add_test(tc, strings_with_nul_or_too_long_are_rejected);
  tcase_add_test(tc, status_counts_beyond_the_body_are_rejected_before_allocating);
  tcase_add_test(tc, attach_fields_are_checked_with_messages_naming_them);
  tcase_add_test(tc, job_ids_are_1_to_63_safe_characters);
  tcase_add_test(tc, type_names_cover_every_type);
  tcase_add_test(tc, every_error_code_has_a_name_and_description);
  tcase_add_test(tc, a_uuid_reads_back_from_its_text_and_nothing_else_is_one);
  suite_add_tcase(s, tc);
  return s;
}
