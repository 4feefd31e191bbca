/*
 * peer_proto.c — the peer protocol codec (peer_proto.h): each message's body
 * one field table (codec.h) driving its encoder and its bounds-checked
 * decoder, little-endian, and the checks of its values shared by both.
 * A peer is untrusted input until it has authenticated, so the decoder
 * reads nothing past `len`, allocates nothing and accepts only exact
 * lengths.
 */
#include "peer_proto.h"
#include "codec.h"
#include "slab.h"
#include "why.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* ---- fields ---------------------------------------------------------------- */

/* Each type's body, one table in wire order (after the 8-byte header), for
 * its encoder and its decoder, named in DEP_PEER_MAP (peer_proto.h);
 * MEMBERSHIP, whose body holds counted arrays, is written out below with
 * its window record's table.  The value checks are beside, in peer_check. */
#define MSG_F(kind, m) CODEC_##kind(struct dep_peer_msg, u.m)
static const struct codec_field hello_f[] = {
    MSG_F(U32, hello.version),      MSG_F(STR, hello.node), MSG_F(STR, hello.listen_address),
    MSG_F(U16, hello.listen_port),  MSG_F(BYTES, hello.challenge),
};
static const struct codec_field auth_f[] = {MSG_F(BYTES, auth.mac)};
static const struct codec_field error_f[] = {MSG_F(I32, error.code), MSG_F(STR, error.message)};
static const struct codec_field keepalive_f[] = {
    MSG_F(U32, keepalive.reply), /* 0 or 1 */
    MSG_F(U64, keepalive.stamp),
};
static const struct codec_field xport_f[] = {
    MSG_F(U32, xport.kind),      MSG_F(BYTES, xport.token), MSG_F(U64, xport.mbox_addr),
    MSG_F(U32, xport.mbox_rkey), MSG_F(U32, xport.mbox_len), MSG_F(STR, xport.reason),
};
static const struct codec_field data_offer_f[] = {MSG_F(BYTES, data_offer.token)};
static const struct codec_field data_hello_f[] = {
    MSG_F(BYTES, data_hello.token),
    MSG_F(U16, data_hello.listen_port),
};
static const struct codec_field nak_f[] = {MSG_F(I32, nak.code), MSG_F(STR, nak.message)};
static const struct codec_field job_f[] = {
    MSG_F(STR, job.job_id),   MSG_F(U32, job.owner_uid), MSG_F(U32, job.rank),
    MSG_F(U32, job.detached), MSG_F(I32, job.code),      MSG_F(STR, job.message),
};
static const struct codec_field membership_ok_f[] = {
    MSG_F(STR, job.job_id),
    MSG_F(U32, job.owner_uid),
};
static const struct codec_field job_mask_f[] = {
    MSG_F(STR, mask.job_id), MSG_F(U32, mask.owner_uid), MSG_F(U32, mask.rank),
    MSG_F(U32, mask.gen),    MSG_F(U32, mask.why),       MSG_F(U64, mask.epoch),
    MSG_F(U64, mask.join),
};
static const struct codec_field job_joined_f[] = {
    MSG_F(STR, joined.job_id), MSG_F(U32, joined.owner_uid), MSG_F(U32, joined.rank),
    MSG_F(U32, joined.gen),    MSG_F(U32, joined.ok),        MSG_F(U64, joined.posted),
};
static const struct codec_field job_held_f[] = {
    MSG_F(STR, held.job_id),     MSG_F(U32, held.owner_uid), MSG_F(U32, held.world_size),
    MSG_F(BYTES, held.live),     MSG_F(BYTES, held.held),
};
#undef MSG_F

/* The numbers run 1.. without a gap (the decoder's range check). */
#define COUNT_(...) +1
_Static_assert(0 DEP_PEER_MAP(COUNT_) == DEP_PEER_TYPE_MAX_ - 1,
               "DEP_PEER_MAP: message numbers run 1..DEP_PEER_TYPE_MAX_ - 1 without a gap");
#undef COUNT_

/* Each type's table and name, from DEP_PEER_MAP: an EMPTY body has no
 * fields; MEMBERSHIP's (OWN) codec is below. */
#define BODY_TABLE(table) table, CODEC_NFIELDS(table)
#define BODY_EMPTY(table) NULL, 0
#define BODY_OWN(table) NULL, 0
static const struct {
  const struct codec_field *f;
  size_t n;
  const char *name;
} peer_body[DEP_PEER_TYPE_MAX_] = {
#define ROW_(NAME, number, body, table) [DEP_PEER_##NAME] = {BODY_##body(table), #NAME},
    DEP_PEER_MAP(ROW_)
#undef ROW_
};
#undef BODY_TABLE
#undef BODY_EMPTY
#undef BODY_OWN

static const struct codec_field window_f[] = {
    CODEC_U32(struct dep_peer_window, rank_index), CODEC_U64(struct dep_peer_window, slab_off),
    CODEC_U64(struct dep_peer_window, len),        CODEC_U64(struct dep_peer_window, addr),
    CODEC_U32(struct dep_peer_window, rkey),
};

/* The checks of a fixed body's values, both ends: false (and why) where m
 * cannot be sent or was not sent by a deepepd. */
static bool peer_check(const struct dep_peer_msg *m, char *why, size_t whylen) {
  switch (m->type) {
  case DEP_PEER_ERROR:
  case DEP_PEER_CLOSE:
    if (m->u.error.code > 0 || (m->type == DEP_PEER_ERROR && m->u.error.code == 0)) {
      why_set(why, whylen, "peer %s carries code %d, which is not an error code",
              peer_proto_type_name(m->type), (int)m->u.error.code);
      return false;
    }
    return true;
  case DEP_PEER_KEEPALIVE:
    if (m->u.keepalive.reply > 1) {
      why_set(why, whylen, "peer KEEPALIVE reply %u is not 0 or 1",
              (unsigned)m->u.keepalive.reply);
      return false;
    }
    return true;
  case DEP_PEER_XPORT:
    if (m->u.xport.kind > DEP_PEER_XPORT_RDMA) {
      why_set(why, whylen, "peer XPORT kind %u is neither tcp (0) nor rdma (1)",
              (unsigned)m->u.xport.kind);
      return false;
    }
    return true;
  case DEP_PEER_XPORT_NAK:
    if (m->u.nak.code >= 0) {
      why_set(why, whylen, "peer XPORT_NAK carries code %d, which is not an error code",
              (int)m->u.nak.code);
      return false;
    }
    return true;
  case DEP_PEER_JOB_FAIL:
  case DEP_PEER_JOB_END: {
    const struct dep_peer_job_event *x = &m->u.job;
    if ((m->type == DEP_PEER_JOB_FAIL) != (x->code < 0) || x->code > 0 || x->detached > 1) {
      why_set(why, whylen, "peer %s carries code %d, detached %u", peer_proto_type_name(m->type),
              (int)x->code, (unsigned)x->detached);
      return false;
    }
    return true;
  }
  case DEP_PEER_JOB_MASK: {
    /* A change that masks comes with an odd count and no join call, a
     * return with an even one above 0 and its join call (job_elastic.c); a
     * rank past any world is refused here, a rank past the job's own world
     * by the receiver. */
    const struct dep_peer_job_mask *x = &m->u.mask;
    const bool leave = x->gen % 2 == 1 && x->join == 0 && x->why <= DEP_SLAB_GONE_NODE;
    const bool back = x->gen % 2 == 0 && x->gen > 0 && x->join > 0 &&
                      x->why == DEP_JOB_EVENT_REJOINED;
    if (x->rank >= DEP_MAX_WORLD || !(leave || back)) {
      why_set(why, whylen, "peer JOB_MASK of rank %u carries gen %u, why %u, join %llu",
              (unsigned)x->rank, (unsigned)x->gen, (unsigned)x->why,
              (unsigned long long)x->join);
      return false;
    }
    return true;
  }
  case DEP_PEER_JOB_JOINED: {
    const struct dep_peer_job_joined *x = &m->u.joined;
    if (x->rank >= DEP_MAX_WORLD || x->gen % 2 == 1 || x->gen == 0 || x->ok > 1) {
      why_set(why, whylen, "peer JOB_JOINED of rank %u carries gen %u, ok %u", (unsigned)x->rank,
              (unsigned)x->gen, (unsigned)x->ok);
      return false;
    }
    return true;
  }
  case DEP_PEER_JOB_HELD: {
    /* A view over a world of 1..DEP_MAX_WORLD ranks, nothing past it, and
     * at least one rank that the sender holds and finds live: a daemon
     * whose ranks of the job are all gone holds no part of it. */
    const struct dep_peer_job_held *x = &m->u.held;
    bool ok = x->world_size >= 1 && x->world_size <= DEP_MAX_WORLD, some = false;
    for (uint32_t r = 0; ok && r < DEP_MAX_WORLD; r++) {
      const bool live = (x->live[r / 8] >> (r % 8)) & 1u, held = (x->held[r / 8] >> (r % 8)) & 1u;
      ok = !((live || held) && r >= x->world_size) && !(held && !live);
      some |= held;
    }
    if (!ok || !some) {
      why_set(why, whylen, "peer JOB_HELD over a world of %u ranks names a rank past it, "
              "holds a rank it finds masked, or holds none", (unsigned)x->world_size);
      return false;
    }
    return true;
  }
  default:
    return true;
  }
}

/* ---- messages ------------------------------------------------------------ */

static void membership_encode(struct codec_w *w, const struct dep_peer_membership *x) {
  if (x->n_ranks > DEP_MAX_LOCAL_RANKS || x->n_ranks != x->local_world_size ||
      x->n_windows > DEP_PEER_WINDOWS_MAX)
    w->err = DEP_ERR_INVALID;
  codec_w_str(w, x->job_id, sizeof x->job_id);
  codec_w_u32(w, x->owner_uid);
  codec_w_u16(w, DEP_SHAPE_NFIELDS);
  for (unsigned f = 0; f < DEP_SHAPE_NFIELDS; f++)
    codec_w_u32(w, dep__shape_raw(&x->sw.shape, x->sw.world_size, f));
  codec_w_u32(w, x->chunk_rows);
  codec_w_u32(w, x->flags);
  codec_w_u32(w, x->local_world_size);
  codec_w_u32(w, x->n_ranks);
  for (uint32_t i = 0; i < x->n_ranks && w->err == 0; i++)
    codec_w_u32(w, x->ranks[i]);
  codec_w_u16(w, (uint16_t)x->n_windows);
  for (uint32_t i = 0; i < x->n_windows && w->err == 0; i++) {
    const struct dep_peer_window *v = &x->windows[i];
    if (v->rank_index >= x->n_ranks || v->len == 0)
      w->err = DEP_ERR_INVALID;
    codec_w_rec(w, window_f, CODEC_NFIELDS(window_f), v);
  }
}

int peer_proto_encode(struct proto_buf *b, const struct dep_peer_msg *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  if (m->type == 0 || m->type >= DEP_PEER_TYPE_MAX_ || !peer_check(m, NULL, 0))
    return DEP_ERR_INVALID;
  codec_w_u32(&w, DEP_PEER_MAGIC);
  codec_w_u16(&w, DEP_PEER_VERSION);
  codec_w_u16(&w, m->type);
  if (m->type == DEP_PEER_MEMBERSHIP)
    membership_encode(&w, &m->u.membership);
  else
    codec_w_rec(&w, peer_body[m->type].f, peer_body[m->type].n, m);
  return codec_w_finish(&w);
}

/* 0, or DEP_ERR_PROTOCOL with why. */
static int membership_decode(struct codec_r *r, struct dep_peer_membership *x, char *why,
                             size_t whylen) {
  codec_r_str(r, x->job_id, sizeof x->job_id);
  x->owner_uid = codec_r_u32(r);
  unsigned nfields = codec_r_u16(r);
  if (!r->bad && nfields != DEP_SHAPE_NFIELDS) {
    why_set(why, whylen,
            "peer MEMBERSHIP carries a shape of %u fields, this deepepd knows %u: run the same "
            "deepepd version on every node",
            nfields, (unsigned)DEP_SHAPE_NFIELDS);
    return DEP_ERR_PROTOCOL;
  }
  for (unsigned f = 0; f < DEP_SHAPE_NFIELDS && !r->bad; f++) {
    uint32_t v = codec_r_u32(r);
    memcpy((uint8_t *)&x->sw + dep__shape_fields[f].off, &v, sizeof v);
  }
  x->chunk_rows = codec_r_u32(r);
  x->flags = codec_r_u32(r);
  x->local_world_size = codec_r_u32(r);
  x->n_ranks = codec_r_u32(r);
  if (!r->bad && (x->n_ranks > DEP_MAX_LOCAL_RANKS || x->n_ranks != x->local_world_size)) {
    why_set(why, whylen, "peer MEMBERSHIP holds %u ranks for local_world_size %u (at most %u)",
            (unsigned)x->n_ranks, (unsigned)x->local_world_size, DEP_MAX_LOCAL_RANKS);
    return DEP_ERR_PROTOCOL;
  }
  for (uint32_t i = 0; i < x->n_ranks && !r->bad; i++)
    x->ranks[i] = codec_r_u32(r);
  x->n_windows = codec_r_u16(r);
  if (!r->bad && x->n_windows > DEP_PEER_WINDOWS_MAX) {
    why_set(why, whylen, "peer MEMBERSHIP carries %u windows (at most %d)",
            (unsigned)x->n_windows, DEP_PEER_WINDOWS_MAX);
    return DEP_ERR_PROTOCOL;
  }
  for (uint32_t i = 0; i < x->n_windows && !r->bad; i++) {
    struct dep_peer_window *v = &x->windows[i];
    codec_r_rec(r, window_f, CODEC_NFIELDS(window_f), v);
    if (!r->bad && (v->rank_index >= x->n_ranks || v->len == 0 ||
                    v->slab_off + v->len < v->slab_off || v->addr + v->len < v->addr)) {
      why_set(why, whylen,
              "peer MEMBERSHIP window %u (rank index %u of %u, offset %llu, %llu bytes) is "
              "out of range",
              (unsigned)i, (unsigned)v->rank_index, (unsigned)x->n_ranks,
              (unsigned long long)v->slab_off, (unsigned long long)v->len);
      return DEP_ERR_PROTOCOL;
    }
  }
  return 0;
}

int peer_proto_decode(const uint8_t *p, size_t len, struct dep_peer_msg *m, char *why,
                    size_t whylen) {
  memset(m, 0, sizeof *m);
  struct codec_r r;
  codec_r_init(&r, p, len);
  if (len < DEP_PEER_HDR_LEN) {
    why_set(why, whylen, "peer message of %zu bytes is shorter than its %d-byte header", len,
            DEP_PEER_HDR_LEN);
    return DEP_ERR_PROTOCOL;
  }
  uint32_t magic = codec_r_u32(&r);
  uint16_t version = codec_r_u16(&r);
  m->type = codec_r_u16(&r);
  if (magic != DEP_PEER_MAGIC) {
    why_set(why, whylen, "bad peer message magic 0x%08x (expected 0x%08x)", magic,
            DEP_PEER_MAGIC);
    return DEP_ERR_PROTOCOL;
  }
  if (version < DEP_PEER_MIN_VERSION || version > DEP_PEER_VERSION) {
    why_set(why, whylen,
            "the peer speaks peer protocol version %u; this deepepd speaks versions %u..%u: run "
            "the same deepepd version on every node (upgrade the older)",
            (unsigned)version, (unsigned)DEP_PEER_MIN_VERSION, (unsigned)DEP_PEER_VERSION);
    return DEP_ERR_VERSION;
  }
  if (m->type == 0 || m->type >= DEP_PEER_TYPE_MAX_) {
    why_set(why, whylen, "unknown peer message type %u (known: 1..%u)", (unsigned)m->type,
            (unsigned)(DEP_PEER_TYPE_MAX_ - 1));
    return DEP_ERR_UNSUPPORTED;
  }
  if (m->type == DEP_PEER_MEMBERSHIP) {
    int rc = membership_decode(&r, &m->u.membership, why, whylen);
    if (rc != 0)
      return rc;
  } else {
    codec_r_rec(&r, peer_body[m->type].f, peer_body[m->type].n, m);
    if (!r.bad && !peer_check(m, why, whylen))
      return DEP_ERR_PROTOCOL;
  }
  if (r.bad || r.left != 0) {
    why_set(why, whylen, "malformed peer %s message (%zu bytes)", peer_proto_type_name(m->type), len);
    return DEP_ERR_PROTOCOL;
  }
  return 0;
}

const char *peer_proto_type_name(uint16_t type) {
  return type > 0 && type < DEP_PEER_TYPE_MAX_ ? peer_body[type].name : "UNKNOWN";
}
