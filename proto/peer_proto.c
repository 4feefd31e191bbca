/*
 * peer_proto.c — the peer protocol codec (peer_proto.h): one encoder and one
 * bounds-checked decoder per message, byte by byte in little-endian order.
 * A peer is untrusted input until it has authenticated, so the decoder
 * reads nothing past `len`, allocates nothing and accepts only exact
 * lengths.
 */
#include "peer_proto.h"
#include "codec.h"
#include "why.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* ---- messages ------------------------------------------------------------ */

int peer_proto_encode(struct proto_buf *b, const struct dep_peer_msg *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  if (m->type == 0 || m->type >= DEP_PEER_TYPE_MAX_)
    return DEP_ERR_INVALID;
  codec_w_u32(&w, DEP_PEER_MAGIC);
  codec_w_u16(&w, DEP_PEER_VERSION);
  codec_w_u16(&w, m->type);
  switch (m->type) {
  case DEP_PEER_HELLO:
    codec_w_u32(&w, m->u.hello.version);
    codec_w_str(&w, m->u.hello.node, sizeof m->u.hello.node);
    codec_w_str(&w, m->u.hello.listen_address, sizeof m->u.hello.listen_address);
    codec_w_u16(&w, m->u.hello.listen_port);
    codec_w_bytes(&w, m->u.hello.challenge, DEP_PEER_CHALLENGE_LEN);
    break;
  case DEP_PEER_AUTH:
    codec_w_bytes(&w, m->u.auth.mac, DEP_PEER_MAC_LEN);
    break;
  case DEP_PEER_AUTH_OK:
    break;
  case DEP_PEER_ERROR:
  case DEP_PEER_CLOSE:
    if (m->u.error.code > 0 || (m->type == DEP_PEER_ERROR && m->u.error.code == 0))
      w.err = DEP_ERR_INVALID;
    codec_w_u32(&w, (uint32_t)m->u.error.code);
    codec_w_str(&w, m->u.error.message, sizeof m->u.error.message);
    break;
  case DEP_PEER_KEEPALIVE:
    if (m->u.keepalive.reply > 1)
      w.err = DEP_ERR_INVALID;
    codec_w_u32(&w, m->u.keepalive.reply);
    codec_w_u64(&w, m->u.keepalive.stamp);
    break;
  case DEP_PEER_MEMBERSHIP: {
    const struct dep_peer_membership *x = &m->u.membership;
    if (x->n_ranks > DEP_MAX_LOCAL_RANKS || x->n_ranks != x->local_world_size)
      w.err = DEP_ERR_INVALID;
    codec_w_str(&w, x->job_id, sizeof x->job_id);
    codec_w_u32(&w, x->owner_uid);
    codec_w_u16(&w, DEP_SHAPE_NFIELDS);
    for (unsigned f = 0; f < DEP_SHAPE_NFIELDS; f++)
      codec_w_u32(&w, dep__shape_raw(&x->sw.shape, x->sw.world_size, f));
    codec_w_u32(&w, x->local_world_size);
    codec_w_u32(&w, x->n_ranks);
    for (uint32_t i = 0; i < x->n_ranks && w.err == 0; i++)
      codec_w_u32(&w, x->ranks[i]);
    codec_w_u16(&w, (uint16_t)x->n_windows);
    if (x->n_windows > DEP_PEER_WINDOWS_MAX)
      w.err = DEP_ERR_INVALID;
    for (uint32_t i = 0; i < x->n_windows && w.err == 0; i++) {
      const struct dep_peer_window *v = &x->windows[i];
      if (v->rank_index >= x->n_ranks || v->len == 0)
        w.err = DEP_ERR_INVALID;
      codec_w_u32(&w, v->rank_index);
      codec_w_u64(&w, v->slab_off);
      codec_w_u64(&w, v->len);
      codec_w_u64(&w, v->addr);
      codec_w_u32(&w, v->rkey);
    }
    break;
  }
  case DEP_PEER_XPORT: {
    const struct dep_peer_xport *x = &m->u.xport;
    if (x->kind > DEP_PEER_XPORT_RDMA)
      w.err = DEP_ERR_INVALID;
    codec_w_u32(&w, x->kind);
    codec_w_bytes(&w, x->token, DEP_PEER_TOKEN_LEN);
    codec_w_u64(&w, x->mbox_addr);
    codec_w_u32(&w, x->mbox_rkey);
    codec_w_u32(&w, x->mbox_len);
    codec_w_str(&w, x->reason, sizeof x->reason);
    break;
  }
  case DEP_PEER_DATA_OFFER:
    codec_w_bytes(&w, m->u.data_offer.token, DEP_PEER_TOKEN_LEN);
    break;
  case DEP_PEER_DATA_HELLO:
    codec_w_bytes(&w, m->u.data_hello.token, DEP_PEER_TOKEN_LEN);
    codec_w_u16(&w, m->u.data_hello.listen_port);
    break;
  case DEP_PEER_XPORT_NAK:
    if (m->u.nak.code >= 0)
      w.err = DEP_ERR_INVALID;
    codec_w_u32(&w, (uint32_t)m->u.nak.code);
    codec_w_str(&w, m->u.nak.message, sizeof m->u.nak.message);
    break;
  case DEP_PEER_JOB_FAIL:
  case DEP_PEER_JOB_END: {
    const struct dep_peer_job_event *x = &m->u.job;
    if ((m->type == DEP_PEER_JOB_FAIL) != (x->code < 0) || x->code > 0 || x->detached > 1)
      w.err = DEP_ERR_INVALID;
    codec_w_str(&w, x->job_id, sizeof x->job_id);
    codec_w_u32(&w, x->owner_uid);
    codec_w_u32(&w, x->rank);
    codec_w_u32(&w, x->detached);
    codec_w_u32(&w, (uint32_t)x->code);
    codec_w_str(&w, x->message, sizeof x->message);
    break;
  }
  }
  if (w.err != 0)
    b->len = w.start;
  return w.err;
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
  if (version != DEP_PEER_VERSION) {
    why_set(why, whylen,
            "the peer speaks peer protocol version %u, this deepepd speaks %u: run the same "
            "deepepd version on every node",
            (unsigned)version, (unsigned)DEP_PEER_VERSION);
    return DEP_ERR_VERSION;
  }
  if (m->type == 0 || m->type >= DEP_PEER_TYPE_MAX_) {
    why_set(why, whylen, "unknown peer message type %u (known: 1..%u)", (unsigned)m->type,
            (unsigned)(DEP_PEER_TYPE_MAX_ - 1));
    return DEP_ERR_UNSUPPORTED;
  }
  switch (m->type) {
  case DEP_PEER_HELLO:
    m->u.hello.version = codec_r_u32(&r);
    codec_r_str(&r, m->u.hello.node, sizeof m->u.hello.node);
    codec_r_str(&r, m->u.hello.listen_address, sizeof m->u.hello.listen_address);
    m->u.hello.listen_port = codec_r_u16(&r);
    codec_r_bytes(&r, m->u.hello.challenge, DEP_PEER_CHALLENGE_LEN);
    break;
  case DEP_PEER_AUTH:
    codec_r_bytes(&r, m->u.auth.mac, DEP_PEER_MAC_LEN);
    break;
  case DEP_PEER_AUTH_OK:
    break;
  case DEP_PEER_ERROR:
  case DEP_PEER_CLOSE:
    m->u.error.code = codec_r_i32(&r);
    codec_r_str(&r, m->u.error.message, sizeof m->u.error.message);
    if (!r.bad && (m->u.error.code > 0 || (m->type == DEP_PEER_ERROR && m->u.error.code == 0))) {
      why_set(why, whylen, "peer %s carries code %d, which is not an error code",
              peer_proto_type_name(m->type), (int)m->u.error.code);
      return DEP_ERR_PROTOCOL;
    }
    break;
  case DEP_PEER_KEEPALIVE:
    m->u.keepalive.reply = codec_r_u32(&r);
    m->u.keepalive.stamp = codec_r_u64(&r);
    if (!r.bad && m->u.keepalive.reply > 1) {
      why_set(why, whylen, "peer KEEPALIVE reply %u is not 0 or 1",
              (unsigned)m->u.keepalive.reply);
      return DEP_ERR_PROTOCOL;
    }
    break;
  case DEP_PEER_MEMBERSHIP: {
    struct dep_peer_membership *x = &m->u.membership;
    codec_r_str(&r, x->job_id, sizeof x->job_id);
    x->owner_uid = codec_r_u32(&r);
    unsigned nfields = codec_r_u16(&r);
    if (!r.bad && nfields != DEP_SHAPE_NFIELDS) {
      why_set(why, whylen,
              "peer MEMBERSHIP carries a shape of %u fields, this deepepd knows %u: run the same "
              "deepepd version on every node",
              nfields, (unsigned)DEP_SHAPE_NFIELDS);
      return DEP_ERR_PROTOCOL;
    }
    for (unsigned f = 0; f < DEP_SHAPE_NFIELDS && !r.bad; f++) {
      uint32_t v = codec_r_u32(&r);
      memcpy((uint8_t *)&x->sw + dep__shape_fields[f].off, &v, sizeof v);
    }
    x->local_world_size = codec_r_u32(&r);
    x->n_ranks = codec_r_u32(&r);
    if (!r.bad && (x->n_ranks > DEP_MAX_LOCAL_RANKS || x->n_ranks != x->local_world_size)) {
      why_set(why, whylen, "peer MEMBERSHIP holds %u ranks for local_world_size %u (at most %u)",
              (unsigned)x->n_ranks, (unsigned)x->local_world_size, DEP_MAX_LOCAL_RANKS);
      return DEP_ERR_PROTOCOL;
    }
    for (uint32_t i = 0; i < x->n_ranks && !r.bad; i++)
      x->ranks[i] = codec_r_u32(&r);
    x->n_windows = codec_r_u16(&r);
    if (!r.bad && x->n_windows > DEP_PEER_WINDOWS_MAX) {
      why_set(why, whylen, "peer MEMBERSHIP carries %u windows (at most %d)",
              (unsigned)x->n_windows, DEP_PEER_WINDOWS_MAX);
      return DEP_ERR_PROTOCOL;
    }
    for (uint32_t i = 0; i < x->n_windows && !r.bad; i++) {
      struct dep_peer_window *v = &x->windows[i];
      v->rank_index = codec_r_u32(&r);
      v->slab_off = codec_r_u64(&r);
      v->len = codec_r_u64(&r);
      v->addr = codec_r_u64(&r);
      v->rkey = codec_r_u32(&r);
      if (!r.bad && (v->rank_index >= x->n_ranks || v->len == 0 ||
                     v->slab_off + v->len < v->slab_off || v->addr + v->len < v->addr)) {
        why_set(why, whylen,
                "peer MEMBERSHIP window %u (rank index %u of %u, offset %llu, %llu bytes) is "
                "out of range",
                (unsigned)i, (unsigned)v->rank_index, (unsigned)x->n_ranks,
                (unsigned long long)v->slab_off, (unsigned long long)v->len);
        return DEP_ERR_PROTOCOL;
      }
    }
    break;
  }
  case DEP_PEER_XPORT: {
    struct dep_peer_xport *x = &m->u.xport;
    x->kind = codec_r_u32(&r);
    codec_r_bytes(&r, x->token, DEP_PEER_TOKEN_LEN);
    x->mbox_addr = codec_r_u64(&r);
    x->mbox_rkey = codec_r_u32(&r);
    x->mbox_len = codec_r_u32(&r);
    codec_r_str(&r, x->reason, sizeof x->reason);
    if (!r.bad && x->kind > DEP_PEER_XPORT_RDMA) {
      why_set(why, whylen, "peer XPORT kind %u is neither tcp (0) nor rdma (1)",
              (unsigned)x->kind);
      return DEP_ERR_PROTOCOL;
    }
    break;
  }
  case DEP_PEER_DATA_OFFER:
    codec_r_bytes(&r, m->u.data_offer.token, DEP_PEER_TOKEN_LEN);
    break;
  case DEP_PEER_DATA_HELLO:
    codec_r_bytes(&r, m->u.data_hello.token, DEP_PEER_TOKEN_LEN);
    m->u.data_hello.listen_port = codec_r_u16(&r);
    break;
  case DEP_PEER_XPORT_NAK:
    m->u.nak.code = codec_r_i32(&r);
    codec_r_str(&r, m->u.nak.message, sizeof m->u.nak.message);
    if (!r.bad && m->u.nak.code >= 0) {
      why_set(why, whylen, "peer XPORT_NAK carries code %d, which is not an error code",
              (int)m->u.nak.code);
      return DEP_ERR_PROTOCOL;
    }
    break;
  case DEP_PEER_JOB_FAIL:
  case DEP_PEER_JOB_END: {
    struct dep_peer_job_event *x = &m->u.job;
    codec_r_str(&r, x->job_id, sizeof x->job_id);
    x->owner_uid = codec_r_u32(&r);
    x->rank = codec_r_u32(&r);
    x->detached = codec_r_u32(&r);
    x->code = codec_r_i32(&r);
    codec_r_str(&r, x->message, sizeof x->message);
    if (!r.bad && ((m->type == DEP_PEER_JOB_FAIL) != (x->code < 0) || x->code > 0 ||
                   x->detached > 1)) {
      why_set(why, whylen, "peer %s carries code %d, detached %u", peer_proto_type_name(m->type),
              (int)x->code, (unsigned)x->detached);
      return DEP_ERR_PROTOCOL;
    }
    break;
  }
  }
  if (r.bad || r.left != 0) {
    why_set(why, whylen, "malformed peer %s message (%zu bytes)", peer_proto_type_name(m->type), len);
    return DEP_ERR_PROTOCOL;
  }
  return 0;
}

const char *peer_proto_type_name(uint16_t type) {
  static const char *const names[DEP_PEER_TYPE_MAX_] = {
      [DEP_PEER_HELLO] = "HELLO",         [DEP_PEER_AUTH] = "AUTH",
      [DEP_PEER_AUTH_OK] = "AUTH_OK",     [DEP_PEER_ERROR] = "ERROR",
      [DEP_PEER_KEEPALIVE] = "KEEPALIVE", [DEP_PEER_CLOSE] = "CLOSE",
      [DEP_PEER_MEMBERSHIP] = "MEMBERSHIP", [DEP_PEER_JOB_FAIL] = "JOB_FAIL",
      [DEP_PEER_JOB_END] = "JOB_END",     [DEP_PEER_XPORT] = "XPORT",
      [DEP_PEER_XPORT_NAK] = "XPORT_NAK", [DEP_PEER_DATA_OFFER] = "DATA_OFFER",
      [DEP_PEER_DATA_HELLO] = "DATA_HELLO",
  };
  return type < DEP_PEER_TYPE_MAX_ && names[type] != NULL ? names[type] : "UNKNOWN";
}
