/*
 * check_xfer.c — the TCP data path's checks and its hold on a job's
 * exchange regions (daemon/xfer.c, xfer_internal.h), in process: a route
 * of a 4-rank job with ranks 0 and 1 here and 2 and 3 on peer 0, its
 * exchange regions plain memory.  A frame's header goes on the wire as the
 * codec's fixed form, the bytes the raw struct had, and a header cut short
 * or malformed is refused whole; it is checked against the
 * job before any byte of it may be written (a peer daemon is untrusted
 * input), and names exactly the in block and slot of its source in its
 * destination's region; a route that threads still send from or receive
 * into outlives its job's end until they are done, and a receive the peer
 * stalls is cut rather than waited out; a batch of credits and taken
 * words goes on the peer's control lane, data never does.  Across two real daemons: the
 * proxy serves its rings fairly, so a rank that keeps its ring full holds
 * up another job's calls by a bounded time, never past the op timeout.
 */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "codec.h"
#include "daemonwire.h"
#include "deepep.h"
#include "job.h"
#include "kabi.h"
#include "log.h"
#include "nodes.h"
#include "slab.h"
#include "xfer_internal.h"
#include "xring.h"

/* A route as xfer_job_start makes it, listed in X->routes. */
struct xf {
  struct job *job;
  struct xfer_route *r;
  uint8_t *region[2];
};

static void xf_make(struct xf *f, const char *id) {
  memset(X, 0, sizeof *X);
  pthread_rwlock_init(&X->lock, NULL);
  pthread_mutex_init(&X->routes_mu, NULL);
  pthread_cond_init(&X->routes_cv, NULL);
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    for (int i = 0; i < XFER_CONNS_MAX; i++)
      X->peers[k].in_fds[i] = -1;
  X->active = true;
  f->job = calloc(1, sizeof *f->job + 2 * sizeof(struct job_rank));
  f->r = xfer__route_new(4);
  ck_assert_ptr_nonnull(f->job);
  ck_assert_ptr_nonnull(f->r);
  struct xfer_route *r = f->r;
  snprintf(r->id, sizeof r->id, "%s", id);
  r->job = f->job;
  r->local_world = 2;
  struct dep_job_shape shape = {.max_tokens_per_rank = 16, .hidden = 256, .num_experts = 8,
                                .topk = 2, .dtype = DEP_DTYPE_BF16, .max_ll_tokens_per_rank = 16};
  r->hidden = shape.hidden;
  r->topk = shape.topk;
  r->experts = shape.num_experts;
  char why[256];
  ck_assert_msg(dep__slab_layout_nodes(&shape, 4, 2, 0, &r->lay, why, sizeof why) == 0, "%s", why);
  for (uint32_t g = 0; g < 4; g++) {
    r->peer_of[g] = g < 2 ? -1 : 0;
    r->local_of[g] = g < 2 ? (int16_t)g : -1;
    r->remote_of[g] = g < 2 ? 0 : g - 2;
  }
  for (uint32_t i = 0; i < 2; i++) {
    r->rank_of[i] = i;
    f->region[i] = calloc(1, r->lay.xchg_bytes);
    ck_assert_ptr_nonnull(f->region[i]);
    r->xchg[i] = f->region[i];
  }
  X->routes = r;
}

/* End the job if it has not (its route goes) and free what xf_make made. */
static void xf_free(struct xf *f) {
  xfer_job_end(f->job);
  for (int i = 0; i < 2; i++)
    free(f->region[i]);
  free(f->job);
}

static struct dep_xfer_hdr xf_hdr(const char *id, uint32_t src, uint32_t dest, uint32_t parity,
                                  uint64_t bytes) {
  struct dep_xfer_hdr h = {.magic = DEP_XFER_MAGIC, .src = src, .dest = dest, .parity = parity,
                           .seq = 1, .bytes = bytes};
  snprintf(h.job_id, sizeof h.job_id, "%s", id);
  return h;
}

static int xf_target(int k, const struct dep_xfer_hdr *h, struct xfer_target *t) {
  struct xfer_route *r;
  char why[256] = "";
  return xfer__frame_target(k, h, &r, t, why, sizeof why);
}

/* A frame of kind: a chunk of rows from row0, or a credit of row0 rows taken. */
static struct dep_xfer_hdr xf_kind(uint32_t src, uint32_t dest, uint32_t kind, uint32_t row0,
                                   uint64_t bytes) {
  struct dep_xfer_hdr h = xf_hdr("xf", src, dest, 1, bytes);
  h.kind = kind;
  h.row0 = row0;
  return h;
}

START_TEST(a_frame_names_the_in_block_and_slot_of_its_source_in_its_destination) {
  struct xf f;
  xf_make(&f, "xf");
  const struct dep_slab_layout *l = &f.r->lay;
  for (uint32_t src = 2; src < 4; src++)
    for (uint32_t dest = 0; dest < 2; dest++)
      for (uint32_t par = 0; par < 2; par++) {
        struct dep_xfer_hdr h = xf_hdr("xf", src, dest, par, l->xblock_bytes);
        struct xfer_target t;
        ck_assert_int_eq(xf_target(0, &h, &t), 0);
        ck_assert_ptr_eq(t.payload, f.region[dest] + dep_slab_in_block(l, par, src - 2));
        ck_assert_ptr_eq(t.slot, f.region[dest] + dep_slab_in_slot(l, par, src - 2));
        ck_assert_ptr_null(t.mark);
        ck_assert_ptr_null(t.credit);
        ck_assert_uint_le(t.payload + h.bytes - f.region[dest], l->xchg_bytes);
      }
  xf_free(&f);
}
END_TEST

/* A node channel's chunk from rank 2 (xring.h): its table, then two rows of
 * row_bytes, each a pattern byte, then ids and weights as the rank wrote them
 * (global ids; experts 2 a rank). */
static size_t xf_node(const struct dep_slab_layout *l, uint8_t *buf,
                      const struct dep_xfer_node_dest *ent, uint32_t n_dest,
                      const int32_t ids[2][2]) {
  const struct dep_xfer_node head = {.n_dest = n_dest, .rows = 2};
  memcpy(buf, &head, sizeof head);
  memcpy(buf + DEP_XFER_NODE_BYTES(0), ent, n_dest * sizeof *ent);
  const float w[2][2] = {{0.25f, 0.75f}, {0.5f, 0.125f}};
  for (int k = 0; k < 2; k++) {
    uint8_t *row = buf + DEP_XFER_NODE_BYTES(n_dest) + k * l->row_bytes;
    memset(row, 0xa0 + k, l->row_bytes);
    memcpy(row + DEP_SLAB_IDS_OFF(256), ids[k], sizeof ids[k]);
    memcpy(row + DEP_SLAB_WEIGHTS_OFF(256, 2), w[k], sizeof w[k]);
  }
  return DEP_XFER_NODE_BYTES(n_dest) + 2 * l->row_bytes;
}

/*
 * A node channel's chunk is written into each of its destinations' in
 * channels from its source at that destination's own rows, ids and
 * weights remapped for it (its experts local, -1 and 0 elsewhere; an id of
 * a rank on another node takes no row), then each destination's chunk
 * counts its rows; a table whose counts the rows' ids do not give, a
 * destination not held here, or an id past the experts is refused with
 * nothing written.
 */
START_TEST(a_node_chunk_fans_out_remapped_and_a_table_that_does_not_fit_writes_nothing) {
  struct xf f;
  xf_make(&f, "xf");
  const struct dep_slab_layout *l = &f.r->lay;
  static uint8_t buf[1 << 16];
  const int32_t ids[2][2] = {{1, 2}, {0, 7}}; /* rank 0 and 1; rank 0 and rank 3 (remote) */
  const struct dep_xfer_node_dest ent[2] = {{.dest = 0, .start = 3, .count = 2},
                                            {.dest = 1, .start = 0, .count = 1}};
  struct dep_xfer_hdr h = xf_kind(2, 0, DEP_XRING_NODE, 0, xf_node(l, buf, ent, 2, ids));
  h.seq = 9;
  struct xfer_target t;
  ck_assert_int_eq(xf_target(0, &h, &t), 0);
  ck_assert(t.node);
  char why[256] = "";
  ck_assert_msg(xfer__node_fanout(f.r, &h, buf, why, sizeof why) == 0, "%s", why);
  /* Rank 0: both rows at its rows 3 and 4; rank 1: the first at its row 0. */
  const struct {
    uint32_t dest, j, k;
    int32_t id[2];
    float w[2];
  } want[] = {{0, 3, 0, {1, -1}, {0.25f, 0.0f}},
              {0, 4, 1, {0, -1}, {0.5f, 0.0f}},
              {1, 0, 0, {-1, 0}, {0.0f, 0.75f}}};
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const uint8_t *row = f.region[want[i].dest] + dep_slab_in_block(l, 1, 0) +
                         (uint64_t)want[i].j * l->row_bytes;
    ck_assert_uint_eq(row[0], 0xa0 + want[i].k);
    ck_assert_uint_eq(row[DEP_SLAB_IDS_OFF(256) - 1], 0xa0 + want[i].k);
    ck_assert_int_eq(memcmp(row + DEP_SLAB_IDS_OFF(256), want[i].id, sizeof want[i].id), 0);
    ck_assert_int_eq(memcmp(row + DEP_SLAB_WEIGHTS_OFF(256, 2), want[i].w, sizeof want[i].w), 0);
  }
  ck_assert_uint_eq(*(const uint64_t *)(f.region[0] + dep_slab_in_mark(l, 1, 0, 0)),
                    DEP_SLAB_CHAN_AT(9, 2));
  ck_assert_uint_eq(*(const uint64_t *)(f.region[1] + dep_slab_in_mark(l, 1, 0, 0)),
                    DEP_SLAB_CHAN_AT(9, 1));
  /* A second frame of the same call adds to the count. */
  ck_assert_int_eq(xfer__node_fanout(f.r, &h, buf, why, sizeof why), 0);
  ck_assert_uint_eq(*(const uint64_t *)(f.region[1] + dep_slab_in_mark(l, 1, 0, 0)),
                    DEP_SLAB_CHAN_AT(9, 2));
  memset(f.region[0], 0, l->xchg_bytes);
  memset(f.region[1], 0, l->xchg_bytes);
  const int32_t past[2][2] = {{1, 2}, {0, 8}};
  const struct dep_xfer_node_dest bad[][2] = {
      {{.dest = 0, .start = 0, .count = 2}, {.dest = 1, .start = 0, .count = 2}}, /* 1 row */
      {{.dest = 0, .start = 0, .count = 2}, {.dest = 2, .start = 0, .count = 1}}, /* remote */
      {{.dest = 0, .start = 15, .count = 2}, {.dest = 1, .start = 0, .count = 1}}, /* past 16 */
      {{.dest = 0, .start = 0, .count = 2}, {.dest = 1, .start = 0, .count = 1}}, /* id 8 */
  };
  for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
    h.bytes = xf_node(l, buf, bad[b], 2, b == 3 ? past : ids);
    why[0] = '\0';
    ck_assert_int_eq(xfer__node_fanout(f.r, &h, buf, why, sizeof why), DEP_ERR_PROTOCOL);
    ck_assert_msg(strstr(why, "node channel") != NULL, "%s", why);
    for (int i = 0; i < 2; i++)
      for (uint64_t o = 0; o < l->xchg_bytes; o++)
        ck_assert_msg(f.region[i][o] == 0, "table %zu wrote byte %llu of rank %d's region", b,
                      (unsigned long long)o, i);
  }
  /* A frame larger than its table and a chunk's rows is refused at its header. */
  h.bytes = DEP_XFER_NODE_BYTES(2) + (uint64_t)l->chunk_rows * l->row_bytes + 1;
  ck_assert_int_eq(xf_target(0, &h, &t), DEP_ERR_PROTOCOL);
  xf_free(&f);
}
END_TEST

START_TEST(a_frame_the_job_does_not_allow_is_refused_before_a_byte_is_written) {
  struct xf f;
  xf_make(&f, "xf");
  const uint64_t bb = f.r->lay.xblock_bytes, rb = f.r->lay.row_bytes;
  const uint32_t ch = f.r->lay.chunk_rows, mt = f.r->lay.max_tokens;
  const uint32_t C = DEP_XRING_CHUNK, S = DEP_XRING_SLOT, K = DEP_XRING_CREDIT;
  const struct {
    int peer;
    struct dep_xfer_hdr h;
    int rc;
    const char *what;
  } cases[] = {
      {0, xf_hdr("xf", 2, 1, 1, bb), 0, "a frame the job allows"},
      {1, xf_hdr("xf", 2, 1, 1, bb), DEP_ERR_PROTOCOL, "a source the sending peer does not hold"},
      {0, xf_hdr("xf", 0, 1, 1, bb), DEP_ERR_PROTOCOL, "a source held here"},
      {0, xf_hdr("xf", 2, 3, 1, bb), DEP_ERR_PROTOCOL, "a destination not held here"},
      {0, xf_hdr("xf", 4, 1, 1, bb), DEP_ERR_PROTOCOL, "a source past the world"},
      {0, xf_hdr("xf", 2, 9, 1, bb), DEP_ERR_PROTOCOL, "a destination past the world"},
      {0, xf_hdr("xf", 2, 1, 2, bb), DEP_ERR_PROTOCOL, "parity 2"},
      {0, xf_hdr("xf", 2, 1, 1, bb + 1), DEP_ERR_PROTOCOL, "more bytes than a block"},
      {0, xf_hdr("other", 2, 1, 1, bb), DEP_ERR_STATE, "a job not here (yet)"},
      {0, xf_kind(2, 1, C | S, 0, ch * rb), 0, "a whole chunk with the slot"},
      {0, xf_kind(2, 1, S, 0, 0), 0, "the slot alone"},
      {0, xf_kind(2, 1, K, mt, 0), 0, "a credit for every row"},
      {0, xf_kind(2, 1, 8, 0, 0), DEP_ERR_PROTOCOL, "a kind not known"},
      {0, xf_kind(2, 1, C | K, 0, rb), DEP_ERR_PROTOCOL, "a chunk and a credit at once"},
      {0, xf_kind(2, 1, C, 0, 0), DEP_ERR_PROTOCOL, "a chunk of no rows"},
      {0, xf_kind(2, 1, C, 0, rb + 1), DEP_ERR_PROTOCOL, "a chunk of part of a row"},
      {0, xf_kind(2, 1, C, 0, (ch + 1) * rb), DEP_ERR_PROTOCOL, "more rows than a chunk"},
      {0, xf_kind(2, 1, C, 1, rb), DEP_ERR_PROTOCOL, "a chunk that starts mid-chunk"},
      {0, xf_kind(2, 1, C, mt, rb), DEP_ERR_PROTOCOL, "rows past the call's"},
      {0, xf_kind(2, 1, S, 0, rb), DEP_ERR_PROTOCOL, "a slot alone with rows"},
      {0, xf_kind(2, 1, K, mt + 1, 0), DEP_ERR_PROTOCOL, "a credit past the call's rows"},
      {0, xf_kind(2, 1, K, 0, rb), DEP_ERR_PROTOCOL, "a credit with bytes"},
      {0, xf_kind(2, 1, DEP_XRING_TAKEN, 0, 0), 0, "a taken word"},
      {0, xf_kind(2, 1, DEP_XRING_TAKEN, 0, rb), DEP_ERR_PROTOCOL, "a taken word with bytes"},
      {0, xf_kind(2, 1, DEP_XRING_TAKEN, 1, 0), DEP_ERR_PROTOCOL, "a taken word with a row"},
      {0, xf_kind(2, 1, DEP_XRING_TAKEN | C, 0, rb), DEP_ERR_PROTOCOL,
       "a chunk and a taken word at once"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct xfer_target t;
    int rc = xf_target(cases[i].peer, &cases[i].h, &t);
    ck_assert_msg(rc == cases[i].rc, "%s: %d, want %d", cases[i].what, rc, cases[i].rc);
    if (rc != 0)
      ck_assert_msg(t.payload == NULL && t.slot == NULL && t.mark == NULL && t.credit == NULL,
                    "%s: a target was named", cases[i].what);
  }
  /* A failed route and an ended job: their bytes have no reader. */
  struct dep_xfer_hdr h = xf_hdr("xf", 2, 1, 1, bb);
  struct xfer_target t;
  atomic_store(&f.r->failed, DEP_ERR_PEER);
  ck_assert_int_eq(xf_target(0, &h, &t), DEP_ERR_NOT_FOUND);
  atomic_store(&f.r->failed, 0);
  xfer_job_end(f.job);
  ck_assert_int_eq(xf_target(0, &h, &t), DEP_ERR_NOT_FOUND);
  xf_free(&f);
}
END_TEST

START_TEST(a_frame_is_published_fields_first_and_the_flag_last) {
  struct xf f;
  xf_make(&f, "xf");
  struct dep_xfer_hdr h = xf_hdr("xf", 3, 0, 1, 0);
  const uint64_t flag = 7;
  memcpy(h.slot, &flag, sizeof flag);
  memset(h.slot + 8, 0xab, sizeof h.slot - 8);
  struct xfer_target t;
  ck_assert_int_eq(xf_target(0, &h, &t), 0);
  struct ops_slot *in = (struct ops_slot *)t.slot;
  atomic_store(&in->credit, 5); /* the reader's own word: no frame writes it */
  xfer__frame_publish(&t, &h);
  ck_assert_int_eq(memcmp(t.slot, h.slot, offsetof(struct ops_slot, tail)), 0);
  ck_assert_uint_eq(atomic_load(&in->credit), 5);
  xf_free(&f);
}
END_TEST

/* A chunk lands at its ring rows, its mark says which call's rows up to
 * where are in; a credit is the destination's out slot's, and the largest
 * of two that cross stands, as of two taken words. */
START_TEST(a_chunk_lands_at_its_ring_rows_and_a_credit_only_grows) {
  struct xf f;
  xf_make(&f, "xf");
  const struct dep_slab_layout *l = &f.r->lay;
  struct dep_xfer_hdr h = xf_kind(3, 0, DEP_XRING_CHUNK, 0, 3 * l->row_bytes);
  h.seq = 9;
  struct xfer_target t;
  ck_assert_int_eq(xf_target(0, &h, &t), 0);
  ck_assert_ptr_eq(t.payload, f.region[0] + dep_slab_in_block(l, 1, 1));
  ck_assert_ptr_null(t.slot);
  xfer__frame_publish(&t, &h);
  const _Atomic uint64_t *mark =
      (const _Atomic uint64_t *)(f.region[0] + dep_slab_in_mark(l, 1, 1, 0));
  ck_assert_uint_eq(atomic_load(mark), DEP_SLAB_CHAN_AT(9, 3));

  struct dep_xfer_hdr c = xf_kind(2, 1, DEP_XRING_CREDIT, 7, 0);
  c.seq = 9;
  ck_assert_int_eq(xf_target(0, &c, &t), 0);
  ck_assert_ptr_eq((uint8_t *)t.credit, f.region[1] + dep_slab_out_slot(l, 1, 0) +
                                            offsetof(struct ops_slot, credit));
  xfer__frame_publish(&t, &c);
  ck_assert_uint_eq(atomic_load(t.credit), DEP_SLAB_CHAN_AT(9, 7));
  c.row0 = 4; /* an earlier credit, come later on another connection */
  ck_assert_int_eq(xf_target(0, &c, &t), 0);
  xfer__frame_publish(&t, &c);
  ck_assert_uint_eq(atomic_load(t.credit), DEP_SLAB_CHAN_AT(9, 7));

  /* A taken word (split calls, host_ops.h): the call, into the out slot's taken word of the
   * parity; a smaller one come later leaves it. */
  struct dep_xfer_hdr k = xf_kind(2, 1, DEP_XRING_TAKEN, 0, 0);
  k.seq = 11;
  ck_assert_int_eq(xf_target(0, &k, &t), 0);
  ck_assert_ptr_eq((uint8_t *)t.credit, f.region[1] + dep_slab_out_slot(l, 1, 0) +
                                            offsetof(struct ops_slot, taken));
  ck_assert_ptr_null(t.payload);
  ck_assert_ptr_null(t.slot);
  xfer__frame_publish(&t, &k);
  ck_assert_uint_eq(atomic_load(t.credit), 11);
  k.seq = 9;
  ck_assert_int_eq(xf_target(0, &k, &t), 0);
  xfer__frame_publish(&t, &k);
  ck_assert_uint_eq(atomic_load(t.credit), 11);
  xf_free(&f);
}
END_TEST

/* A header with a distinct value in every field and a slot image of a pattern. */
static struct dep_xfer_hdr xf_every_field(void) {
  struct dep_xfer_hdr h = xf_hdr("moe-run.7", 0x01020304u, 0x05060708u, 1, 0x1112131415161718ull);
  h.seq = 0x2122232425262728ull;
  h.kind = DEP_XRING_CHUNK | DEP_XRING_SLOT;
  h.row0 = 0x31323334u;
  for (size_t i = 0; i < sizeof h.slot; i++)
    h.slot[i] = (uint8_t)(0x80 + i);
  return h;
}

/*
 * The frame header goes through the codec (xring.c's field table), and
 * its wire bytes are the ones the old code sent, the raw struct: each
 * field, read back from the encoding at the struct member's offset, is
 * that member, little-endian, the job id NUL-padded as the zeroed struct
 * held it, and the whole encoding is the struct's bytes (this host is
 * little-endian: xring.h).  The offsets are spelled out, as the layout
 * xring.h documents.  It decodes back to the same header.
 */
START_TEST(a_frame_header_encodes_to_the_bytes_the_raw_struct_had) {
  const struct dep_xfer_hdr h = xf_every_field();
  struct proto_buf b = {0};
  ck_assert_int_eq(dep__xfer_hdr_encode(&b, &h), 0);
  ck_assert_uint_eq(b.len, DEP_XFER_HDR_WIRE);
  ck_assert_uint_eq(sizeof h, DEP_XFER_HDR_WIRE);
  const struct {
    size_t wire, member, size;
    const char *name;
  } fields[] = {
      {0, offsetof(struct dep_xfer_hdr, magic), 4, "magic"},
      {4, offsetof(struct dep_xfer_hdr, src), 4, "src"},
      {8, offsetof(struct dep_xfer_hdr, dest), 4, "dest"},
      {12, offsetof(struct dep_xfer_hdr, parity), 4, "parity"},
      {16, offsetof(struct dep_xfer_hdr, seq), 8, "seq"},
      {24, offsetof(struct dep_xfer_hdr, bytes), 8, "bytes"},
      {32, offsetof(struct dep_xfer_hdr, kind), 4, "kind"},
      {36, offsetof(struct dep_xfer_hdr, row0), 4, "row0"},
      {40, offsetof(struct dep_xfer_hdr, job_id), DEP_JOB_ID_MAX, "job_id"},
      {104, offsetof(struct dep_xfer_hdr, slot), DEP_SLAB_CTRL_SLOT, "slot"},
  };
  size_t covered = 0;
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    ck_assert_msg(fields[i].wire == fields[i].member, "%s: at %zu on the wire, %zu in the struct",
                  fields[i].name, fields[i].wire, fields[i].member);
    ck_assert_msg(memcmp(b.data + fields[i].wire, (const uint8_t *)&h + fields[i].member,
                         fields[i].size) == 0, "%s differs from the raw struct's bytes",
                  fields[i].name);
    covered += fields[i].size;
  }
  ck_assert_uint_eq(covered, DEP_XFER_HDR_WIRE);
  /* The integers little-endian, whatever this host's order. */
  ck_assert_uint_eq(codec_get_u32(b.data + 0), DEP_XFER_MAGIC);
  ck_assert_uint_eq(codec_get_u32(b.data + 4), 0x01020304u);
  ck_assert_uint_eq(b.data[4], 0x04);
  ck_assert_uint_eq(codec_get_u64(b.data + 16), 0x2122232425262728ull);
  ck_assert_uint_eq(b.data[16], 0x28);
  ck_assert_uint_eq(codec_get_u64(b.data + 24), 0x1112131415161718ull);
  ck_assert_uint_eq(codec_get_u32(b.data + 36), 0x31323334u);
  ck_assert_str_eq((const char *)b.data + 40, "moe-run.7");
  for (size_t i = 40 + strlen("moe-run.7"); i < 104; i++)
    ck_assert_msg(b.data[i] == 0, "the job id is not NUL-padded at byte %zu", i);
  ck_assert_int_eq(memcmp(b.data, &h, sizeof h), 0);

  struct dep_xfer_hdr back;
  char why[256] = "";
  ck_assert_msg(dep__xfer_hdr_decode(b.data, b.len, &back, why, sizeof why) == 0, "%s", why);
  ck_assert_int_eq(memcmp(&back, &h, sizeof h), 0);
  proto_buf_free(&b);
}
END_TEST

/*
 * What a peer sends as a frame header is checked before the receiver acts
 * on any field: a header cut short or one byte long, another magic, a job
 * id without its NUL or with bytes after it, each is refused saying why,
 * and leaves nothing decoded.  The encoder refuses to write a header the
 * decoder would refuse, leaving the buffer as it was.
 */
START_TEST(a_truncated_or_malformed_frame_header_is_refused) {
  const struct dep_xfer_hdr h = xf_every_field();
  struct proto_buf b = {0};
  ck_assert_int_eq(dep__xfer_hdr_encode(&b, &h), 0);
  uint8_t wire[DEP_XFER_HDR_WIRE + 1];
  memcpy(wire, b.data, DEP_XFER_HDR_WIRE);
  wire[DEP_XFER_HDR_WIRE] = 0;
  struct dep_xfer_hdr got;
  char why[256];
  for (size_t n = 0; n <= DEP_XFER_HDR_WIRE + 1; n++) {
    if (n == DEP_XFER_HDR_WIRE)
      continue;
    why[0] = '\0';
    ck_assert_msg(dep__xfer_hdr_decode(wire, n, &got, why, sizeof why) == DEP_ERR_PROTOCOL,
                  "a header of %zu bytes was taken", n);
    ck_assert_msg(strstr(why, "bytes, not") != NULL, "%zu bytes: %s", n, why);
  }
  const size_t id_at = offsetof(struct dep_xfer_hdr, job_id);
  const struct {
    size_t at;
    uint8_t byte;
    const char *why;
  } bad[] = {
      {0, 0x45, "not a deepepd's data stream"},         /* the magic's first byte */
      {3, 0x00, "not a deepepd's data stream"},         /* and its last */
      {id_at + strlen("moe-run.7") + 1, 'x', "job id"}, /* a byte after the NUL */
      {id_at + DEP_JOB_ID_MAX - 1, 'x', "job id"},      /* the last, after it too */
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    uint8_t w[DEP_XFER_HDR_WIRE];
    memcpy(w, wire, sizeof w);
    w[bad[i].at] = bad[i].byte;
    memset(&got, 0x55, sizeof got);
    why[0] = '\0';
    ck_assert_msg(dep__xfer_hdr_decode(w, sizeof w, &got, why, sizeof why) == DEP_ERR_PROTOCOL,
                  "byte %zu set to %#x was taken", bad[i].at, bad[i].byte);
    ck_assert_msg(strstr(why, bad[i].why) != NULL, "byte %zu: %s", bad[i].at, why);
    const struct dep_xfer_hdr zero = {0};
    ck_assert_msg(memcmp(&got, &zero, sizeof got) == 0, "byte %zu: a refused header was kept",
                  bad[i].at);
  }
  /* A job id of every byte, no NUL: the old receiver cut it to 63 bytes. */
  uint8_t w[DEP_XFER_HDR_WIRE];
  memcpy(w, wire, sizeof w);
  memset(w + id_at, 'a', DEP_JOB_ID_MAX);
  ck_assert_int_eq(dep__xfer_hdr_decode(w, sizeof w, &got, why, sizeof why), DEP_ERR_PROTOCOL);

  struct dep_xfer_hdr x = h;
  memset(x.job_id, 'a', sizeof x.job_id);
  ck_assert_int_eq(dep__xfer_hdr_encode(&b, &x), DEP_ERR_INVALID);
  x = h;
  x.magic = 0;
  ck_assert_int_eq(dep__xfer_hdr_encode(&b, &x), DEP_ERR_INVALID);
  ck_assert_uint_eq(b.len, DEP_XFER_HDR_WIRE);
  proto_buf_free(&b);
}
END_TEST

/* A thread using the route's regions: it holds the route, sleeps or reads
 * fd until it ends, then gives the route back. */
struct xf_user {
  struct xfer_route *r;
  int ms; /* > 0: sleep this long; else read fd */
  int fd;
  _Atomic int64_t put_ms;
};

static int64_t xf_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void *xf_user_main(void *arg) {
  struct xf_user *u = arg;
  if (u->ms > 0) {
    struct timespec ts = {u->ms / 1000, (long)(u->ms % 1000) * 1000000l};
    nanosleep(&ts, NULL);
  } else {
    char c;
    (void)read(u->fd, &c, 1); /* until the far end is cut */
  }
  atomic_store(&u->put_ms, xf_now_ms());
  xfer__route_put(u->r);
  return NULL;
}

START_TEST(a_job_ends_only_once_its_sends_and_receives_are_done) {
  struct xf f;
  xf_make(&f, "xf");
  struct xf_user u = {.r = f.r, .ms = 300};
  atomic_fetch_add(&f.r->users, 1); /* as batch_ref or a receiver does, lock held */
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, xf_user_main, &u), 0);
  xfer_job_end(f.job);
  const int64_t ended = xf_now_ms();
  pthread_join(t, NULL);
  ck_assert_msg(ended >= atomic_load(&u.put_ms),
                "the job's route went %lld ms before its last user gave it back",
                (long long)(atomic_load(&u.put_ms) - ended));
  ck_assert_ptr_null(X->routes);
  xf_free(&f);
}
END_TEST

START_TEST(a_receive_the_peer_stalls_at_the_job_end_is_cut_not_waited_out) {
  struct xf f;
  xf_make(&f, "xf");
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  X->peers[0].in_fds[0] = sv[0]; /* the inbound connection from peer 0 the receiver reads */
  struct xf_user u = {.r = f.r, .fd = sv[0]};
  atomic_fetch_add(&f.r->users, 1);
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, xf_user_main, &u), 0);
  const int64_t t0 = xf_now_ms();
  xfer_job_end(f.job); /* sv[1] never sends: the peer stalls */
  const int64_t took = xf_now_ms() - t0;
  pthread_join(t, NULL);
  ck_assert_msg(took >= 2000 && took < 5000, "the job's end took %lld ms", (long long)took);
  close(sv[0]);
  close(sv[1]);
  xf_free(&f);
}
END_TEST

/* A data connection's or the control lane's far end (a socketpair's): the bytes read until
 * the near end closes. */
struct xf_sink {
  int fd;
  size_t got;
  pthread_t th;
};

static void *xf_sink_main(void *arg) {
  struct xf_sink *k = arg;
  uint8_t buf[65536];
  for (ssize_t n; (n = read(k->fd, buf, sizeof buf)) != 0;)
    if (n > 0)
      k->got += (size_t)n;
    else if (errno != EINTR)
      break;
  return NULL;
}

/* A batch of `frames` frames of `each` bytes (marks at their starts), in its buf. */
static void xf_batch(struct xfer_batch *b, uint32_t frames, size_t each) {
  memset(b, 0, sizeof *b);
  b->len = b->cap = b->bytes = frames * each;
  b->buf = calloc(1, b->len);
  b->seg = calloc(1, sizeof *b->seg);
  b->mark = calloc(frames, sizeof *b->mark);
  ck_assert(b->buf != NULL && b->seg != NULL && b->mark != NULL);
  b->seg[0] = (struct xfer_seg){.off = 0, .len = b->len};
  b->n_seg = b->cap_seg = 1;
  for (uint32_t i = 0; i < frames; i++)
    b->mark[i] = i * each;
  b->n_mark = b->cap_mark = frames;
}

/*
 * A peer has two data connections and its control lane (out[2]), each a
 * socketpair drained by a thread.  A data batch large enough to split goes
 * on both data connections and not a byte on the lane; a batch of credits
 * (ctl) goes on the lane alone, so no credit waits behind data queued on a
 * data connection; with the lane closed it goes on a data connection.
 * Structural: every byte is counted where it arrived, nothing is timed.
 */
START_TEST(a_credit_batch_goes_on_the_control_lane_and_data_never_does) {
  memset(X, 0, sizeof *X);
  pthread_rwlock_init(&X->lock, NULL);
  X->active = true;
  X->data_conns = 2;
  X->conns = 3;
  struct xfer_peer *xp = &X->peers[0];
  struct xf_sink sink[3];
  for (int i = 0; i < 3; i++) {
    int sv[2];
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    pthread_mutex_init(&xp->out[i].mu, NULL);
    xp->out[i].fd = sv[0];
    sink[i] = (struct xf_sink){.fd = sv[1]};
    ck_assert_int_eq(pthread_create(&sink[i].th, NULL, xf_sink_main, &sink[i]), 0);
  }
  struct xfer_batch data, ctl;
  xf_batch(&data, 4, 128u << 10); /* 512 KiB: above the split's threshold, in 4 frames */
  xf_batch(&ctl, 3, DEP_XFER_HDR_WIRE);
  ck_assert_int_eq(xfer__batch_send(0, &data, 4, false), 0);
  ck_assert_int_eq(xfer__batch_send(0, &ctl, 3, true), 0);
  const int lane = xp->out[2].fd;
  xp->out[2].fd = -1; /* the lane is gone: the credits go on a data connection */
  ck_assert_int_eq(xfer__batch_send(0, &ctl, 3, true), 0);
  close(lane);
  for (int i = 0; i < 2; i++)
    close(xp->out[i].fd);
  for (int i = 0; i < 3; i++) {
    pthread_join(sink[i].th, NULL);
    close(sink[i].fd);
  }
  ck_assert_msg(sink[2].got == ctl.bytes, "the control lane carried %zu bytes; the credits "
                "were %zu, the data %zu", sink[2].got, ctl.bytes, data.bytes);
  ck_assert_msg(sink[0].got + sink[1].got == data.bytes + ctl.bytes && sink[0].got > 0 &&
                    sink[1].got > 0,
                "the data connections carried %zu and %zu bytes; the data was %zu, split over "
                "both, and the credits sent with the lane gone %zu",
                sink[0].got, sink[1].got, data.bytes, ctl.bytes);
  ck_assert_uint_eq(atomic_load(&xp->bytes_out), data.bytes + 2 * ctl.bytes);
  xfer__batch_free(&data);
  xfer__batch_free(&ctl);
  for (int i = 0; i < 3; i++)
    pthread_mutex_destroy(&xp->out[i].mu);
}
END_TEST

/* proxy_threads 0: one thread per served device; a daemon without devices (the host backend)
 * one per XFER_CPUS_PER_PROXY CPUs it may run on, at least one, at most XFER_HOST_PROXY_MAX. */
START_TEST(the_default_proxy_threads_follow_the_devices_or_else_the_cpus) {
  ck_assert_uint_eq(xfer_proxy_threads_default(8, 2), 8); /* devices, whatever the CPUs */
  ck_assert_uint_eq(xfer_proxy_threads_default(1, 64), 1);
  ck_assert_uint_eq(xfer_proxy_threads_default(200, 16), CONFIG_MAX_PROXY_THREADS);
  ck_assert_uint_eq(xfer_proxy_threads_default(0, 0), 1);
  ck_assert_uint_eq(xfer_proxy_threads_default(0, 2), 1);
  ck_assert_uint_eq(xfer_proxy_threads_default(0, XFER_CPUS_PER_PROXY * 2 - 1), 1);
  ck_assert_uint_eq(xfer_proxy_threads_default(0, XFER_CPUS_PER_PROXY * 2), 2);
  ck_assert_uint_eq(xfer_proxy_threads_default(0, XFER_CPUS_PER_PROXY * 4), 4);
  ck_assert_uint_eq(xfer_proxy_threads_default(0, 4096), XFER_HOST_PROXY_MAX);
}
END_TEST

Suite *xfer_suite(void);
Suite *xfer_suite(void) {
  Suite *s = suite_create("xfer");
  TCase *t = tcase_create("frames");
  tcase_add_test(t, a_frame_names_the_in_block_and_slot_of_its_source_in_its_destination);
  tcase_add_test(t, a_chunk_lands_at_its_ring_rows_and_a_credit_only_grows);
  tcase_add_test(t, a_node_chunk_fans_out_remapped_and_a_table_that_does_not_fit_writes_nothing);
  tcase_add_test(t, a_frame_the_job_does_not_allow_is_refused_before_a_byte_is_written);
  tcase_add_test(t, a_frame_is_published_fields_first_and_the_flag_last);
  tcase_add_test(t, a_frame_header_encodes_to_the_bytes_the_raw_struct_had);
  tcase_add_test(t, a_truncated_or_malformed_frame_header_is_refused);
  tcase_add_test(t, a_job_ends_only_once_its_sends_and_receives_are_done);
  tcase_add_test(t, a_receive_the_peer_stalls_at_the_job_end_is_cut_not_waited_out);
  tcase_add_test(t, a_credit_batch_goes_on_the_control_lane_and_data_never_does);
  tcase_add_test(t, the_default_proxy_threads_follow_the_devices_or_else_the_cpus);
  tcase_set_timeout(t, 20);
  suite_add_tcase(s, t);
  return s;
}
