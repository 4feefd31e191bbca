/*
 * xfer_proxy.c — the proxy threads of the data path between nodes (xfer.h,
 * xfer_internal.h): each sweeps the rings of the routes of xfer.c in
 * deficit round robin, takes their descriptors and sends what they name,
 * as RDMA writes through xfer_rdma.c or as frames gathered into batches
 * per peer (its credits and taken words first, then its data) for the TCP
 * data connections (xfer_send.c, xfer_conn.c).
 */
#include "xfer.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "devices.h"
#include "grow.h"
#include "kabi.h"
#include "log.h"
#include "peer.h"
#include "slab.h"
#include "xfer_internal.h"
#include "xfer_rdma.h"
#include "xring.h"

/* A sweep's frames for one peer go out in one send, up to this many bytes. */
#define XFER_BATCH_BYTES (4u << 20)
/*
 * The bytes a ring may send in its turn of a proxy thread's round robin
 * (deficit round robin, sweep): as much as one batch, so that a ring alone
 * still fills a batch per sweep, while a ring that is never empty takes no
 * more than this before every other ring of the thread has had its turn.
 */
#define XFER_QUANTUM XFER_BATCH_BYTES
/*
 * A payload shorter than this is copied into its batch beside its header;
 * a longer one is sent from its out block in place (its own iovec).  Below
 * a page the copy costs about what a segment of its own does (the
 * kernel's per-iovec work, and more sendmsg calls: a batch of many small
 * frames would need several of IOV_MAX iovecs each), and copying keeps a
 * run of empty and small frames with their headers in one iovec, as the
 * batch was before; above it the copy grows with the bytes and the
 * iovec's cost does not.
 */
#define XFER_COPY_MAX 4096u

/*
 * A proxy thread's batches: for each peer, one of its data frames
 * (blocks, chunks: PX_LANE_DATA) and, sent before it on the peer's
 * control lane, one of its credit and taken frames (PX_LANE_CTL).  A
 * credit is what a sender on the peer's node waits for before it writes
 * more, and a taken word what a split call's sender waits for: queued
 * behind the sweep's data frames (a rank pushes a chunk's credit right
 * after the chunks of its own that it wrote meanwhile), it would reach the
 * peer only after them.  Such words only grow and the largest stands
 * (xfer__frame_publish), so they may pass the data frames of the same
 * sweep.
 */
enum px_lane { PX_LANE_DATA, PX_LANE_CTL, PX_LANES };
#define XFER_BATCH_AT(lane, peer) ((int)(lane) * CONFIG_MAX_LIST + (peer))
#define XFER_BATCHES (PX_LANES * CONFIG_MAX_LIST)

/* The lane a descriptor's frame goes on: credits and taken words the control lane. */
static inline enum px_lane lane_of(uint32_t kind) {
  return kind == DEP_XRING_CREDIT || kind == DEP_XRING_TAKEN ? PX_LANE_CTL : PX_LANE_DATA;
}

/* A proxy thread with nothing to do keeps looking (yielding) for
 * X->spin_ns after its last work (xfer_internal.h) before it sleeps in
 * steps of XFER_NAP_NS. */
#define XFER_NAP_NS 20000l

/* ---- the proxy threads -------------------------------------------------------- */

bool xfer__batch_room(struct xfer_batch *b, size_t n) {
  return DEP_GROW(b->buf, b->cap, b->len + n, 1u << 16) == 0;
}

void xfer__batch_reset(struct xfer_batch *b) {
  for (uint32_t i = 0; i < b->n_seg; i++)
    if (b->seg[i].held != NULL)
      xfer__route_put(b->seg[i].held);
  b->n_seg = b->n_mark = 0;
  b->len = b->bytes = 0;
}

void xfer__batch_free(struct xfer_batch *b) {
  xfer__batch_reset(b);
  free(b->buf);
  free(b->seg);
  free(b->mark);
  b->buf = NULL;
  b->seg = NULL;
  b->mark = NULL;
  b->cap = b->cap_seg = b->cap_mark = 0;
}

/* Room in b for `copy` more bytes in buf and two more segments (one
 * frame), so that a frame is appended whole or not at all; false when out
 * of memory. */
static bool batch_reserve(struct xfer_batch *b, size_t copy) {
  return xfer__batch_room(b, copy) && DEP_GROW(b->mark, b->cap_mark, b->n_mark + 1, 64) == 0 &&
         DEP_GROW(b->seg, b->cap_seg, b->n_seg + 2, 64) == 0;
}

/* Count the n bytes written at the end of the batch's buf (b->len on)
 * into one segment with the bytes copied just before. */
static void batch_took(struct xfer_batch *b, size_t n) {
  struct xfer_seg *last = b->n_seg > 0 ? &b->seg[b->n_seg - 1] : NULL;
  if (last == NULL || last->ext != NULL) {
    b->seg[b->n_seg++] = (struct xfer_seg){.off = b->len};
    last = &b->seg[b->n_seg - 1];
  }
  b->len += n;
  last->len += n;
  b->bytes += n;
}

/* Append n bytes copied into the batch's buf (reserved), in one segment
 * with the bytes copied just before. */
static void batch_copy(struct xfer_batch *b, const void *src, size_t n) {
  memcpy(b->buf + b->len, src, n);
  batch_took(b, n);
}

/* Append frame header h's wire form (xring.h; room reserved) as
 * batch_copy does: 0, or the encoder's error with the batch as it was. */
static int batch_hdr(struct xfer_batch *b, const struct dep_xfer_hdr *h) {
  /* The codec appends to a proto_buf: the batch's buf, len and cap are one. */
  struct proto_buf pb = {.data = b->buf, .len = b->len, .cap = b->cap};
  const int rc = dep__xfer_hdr_encode(&pb, h);
  b->buf = pb.data;
  b->cap = pb.cap;
  if (rc == 0)
    batch_took(b, pb.len - b->len);
  return rc;
}

/* Append n bytes sent in place from an exchange region of route r, which
 * the segment holds until the batch is reset (reserved). */
static void batch_ref(struct xfer_batch *b, const uint8_t *src, size_t n, struct xfer_route *r) {
  atomic_fetch_add_explicit(&r->users, 1, memory_order_relaxed);
  b->seg[b->n_seg++] = (struct xfer_seg){.ext = src, .len = n, .held = r};
  b->bytes += n;
}

/*
 * What descriptor d of local rank lr's ring in route r names in its
 * exchange region (xfer_src), checked against the job's layout: true, or
 * false with why.
 */
static bool desc_source(const struct xfer_route *r, uint32_t lr, const struct dep_xring_desc *d,
                        struct xfer_src *s, char *why, size_t len) {
  const struct dep_slab_layout *l = &r->lay;
  const int peer = d->dest < r->world ? r->peer_of[d->dest] : -1;
  const char *wrong = NULL;
  memset(s, 0, sizeof *s);
  if (peer < 0 || d->parity > 1 || !xfer__kind_known(d->kind))
    wrong = "a remote rank, parity 0 or 1 and a known kind";
  else if (d->kind == DEP_XRING_BLOCK && d->bytes > l->xblock_bytes)
    wrong = "a block's bytes";
  else if ((d->kind == DEP_XRING_CREDIT || d->kind == DEP_XRING_TAKEN) &&
           (d->bytes != 0 || d->row0 != 0))
    wrong = "a credit or taken word without bytes";
  else if (d->kind == DEP_XRING_NODE)
    wrong = xfer__chunk_wrong(l, DEP_XRING_CHUNK, d->row0, d->bytes) != NULL
                ? "whole rows of a node channel's chunk"
                : NULL;
  else if (d->kind != DEP_XRING_BLOCK && d->kind != DEP_XRING_CREDIT &&
           d->kind != DEP_XRING_TAKEN)
    wrong = xfer__chunk_wrong(l, d->kind, d->row0, d->bytes) != NULL ? "whole rows of a chunk"
                                                                      : NULL;
  if (wrong != NULL) {
    snprintf(why, len, "a descriptor for rank %u (kind %u, parity %u, row %u, %llu bytes) that "
             "the job's layout does not allow (%s, up to %llu bytes)", d->dest, d->kind,
             d->parity, d->row0, (unsigned long long)d->bytes, wrong,
             (unsigned long long)l->xblock_bytes);
    return false;
  }
  const uint32_t ri = r->remote_of[d->dest];
  const uint8_t *x = r->xchg[lr];
  if (d->kind == DEP_XRING_CREDIT || d->kind == DEP_XRING_TAKEN) {
    s->credit = x + dep_slab_in_slot(l, d->parity, ri) +
                (d->kind == DEP_XRING_CREDIT ? offsetof(struct ops_slot, credit)
                                             : offsetof(struct ops_slot, taken));
    return true;
  }
  s->payload = x + dep_slab_out_block(l, d->parity, ri);
  if (d->kind & (DEP_XRING_CHUNK | DEP_XRING_NODE)) {
    s->at = (uint64_t)(d->row0 % l->chan_rows) * l->row_bytes;
    s->payload += s->at;
    s->chunk = d->row0 / l->chunk_rows;
    s->mark = d->kind == DEP_XRING_NODE ? NULL : x + dep_slab_out_mark(l, d->parity, ri, s->chunk);
  }
  if (d->kind == DEP_XRING_BLOCK || (d->kind & DEP_XRING_SLOT)) {
    /* The rank wrote the slot before the descriptor (the ring's head, read
     * with acquire) and leaves it until the call after next. */
    s->slot = x + dep_slab_out_slot(l, d->parity, ri);
    uint64_t flag = atomic_load_explicit((const _Atomic uint64_t *)s->slot, memory_order_relaxed);
    if (flag != d->seq) {
      snprintf(why, len, "a descriptor of call %llu whose slot image holds call %llu",
               (unsigned long long)d->seq, (unsigned long long)flag);
      return false;
    }
  }
  return true;
}

/*
 * A node channel's chunk (descriptor d of local rank lr's ring in route r,
 * xring.h): its table, from the node's ranks' out mark words at the
 * chunk, into *t (n_dest entries of dep_xfer_node_dest after its head):
 * true, or false with why when a word holds more rows than the chunk.
 */
static bool node_table(const struct xfer_route *r, uint32_t lr, const struct dep_xring_desc *d,
                       uint8_t *t, uint32_t *n_dest, char *why, size_t len) {
  const struct dep_slab_layout *l = &r->lay;
  const int peer = r->peer_of[d->dest];
  const uint32_t rows = (uint32_t)(d->bytes / l->row_bytes);
  uint32_t n = 0;
  for (uint32_t g = 0; g < r->world; g++) {
    if (r->peer_of[g] != peer)
      continue;
    const uint64_t w = atomic_load_explicit(
        (const _Atomic uint64_t *)(r->xchg[lr] + dep_slab_out_mark(l, d->parity, r->remote_of[g],
                                                                   d->row0 / l->chunk_rows)),
        memory_order_relaxed);
    const struct dep_xfer_node_dest e = {.dest = g, .start = (uint32_t)(w >> 32),
                                         .count = (uint32_t)w};
    if (e.count == 0)
      continue;
    if (e.count > rows || n == DEP_MAX_LOCAL_RANKS) {
      snprintf(why, len, "a node channel's chunk of %u rows whose table gives rank %u %u rows",
               rows, g, e.count);
      return false;
    }
    memcpy(t + DEP_XFER_NODE_BYTES(n++), &e, sizeof e);
  }
  const struct dep_xfer_node head = {.n_dest = n, .rows = rows};
  memcpy(t, &head, sizeof head);
  *n_dest = n;
  return true;
}

/* The entries of node table ent (n of them) that a node channel's row
 * names by its ids: a bit per entry.  An id of no expert, or of a rank the
 * table leaves out, names none (the far daemon's checks say what is wrong
 * with such a row: xfer__node_fanout). */
static uint64_t row_entries(const struct xfer_route *r, const uint8_t *row,
                            const struct dep_xfer_node_dest *ent, uint32_t n) {
  const uint32_t le = r->experts / r->world;
  uint64_t hit = 0;
  for (uint32_t i = 0; i < r->topk; i++) {
    int32_t id;
    memcpy(&id, row + DEP_SLAB_IDS_OFF(r->hidden) + 4u * i, sizeof id);
    if (id < 0 || (uint32_t)id >= r->experts)
      continue;
    for (uint32_t e = 0; e < n; e++)
      if (ent[e].dest == (uint32_t)id / le)
        hit |= 1ull << e;
  }
  return hit;
}

/* What node_rdma did with a node channel's chunk. */
enum px_node {
  PX_NODE_SENT,   /* all of it is queued as RDMA writes (and counted) */
  PX_NODE_TCP,    /* none of it: it goes as a frame */
  PX_NODE_LATER,  /* the staging had no chunk free for (the rest of) it */
  PX_NODE_BAD,    /* its header did not encode (why) */
  PX_NODE_LOST    /* the staging went with part of it across: the route failed (said) */
};

/* Count a NODE frame's piece of tab bytes of table and n of rows, queued
 * as RDMA writes (its ready word too), in route r's counters. */
static void node_counted(struct xfer_route *r, uint64_t tab, uint64_t n) {
  atomic_fetch_add_explicit(&r->bytes_out, DEP_XFER_HDR_WIRE + tab + n + sizeof(uint64_t),
                            memory_order_relaxed);
  atomic_fetch_add_explicit(&r->payload_out, n, memory_order_relaxed);
  atomic_fetch_add_explicit(&r->frames_out, 1, memory_order_relaxed);
}

/* Header h (rows from its row0) with table (tab bytes) and rows (n bytes)
 * into the far daemon's staging: xfer_rdma_node's answer, or -1 with why
 * when the header does not encode. */
static int node_piece(struct xfer_route *r, int peer, const struct dep_xfer_hdr *h,
                      const uint8_t *table, uint64_t tab, const uint8_t *rows, uint64_t n,
                      char *why, size_t len) {
  struct proto_buf pb = {0};
  const int rc = dep__xfer_hdr_encode(&pb, h);
  int out = -1;
  if (rc != 0)
    snprintf(why, len, "a frame header that does not encode (%s)", dep_strerror(rc));
  else
    out = (int)xfer_rdma_node(r->rdma, peer, pb.data, table, tab, rows, n);
  free(pb.data);
  return out;
}

/*
 * A node channel's chunk of local rank lr's ring (header h, its table of
 * n_dest entries, rows at `rows`, payload bytes) into the staging of the
 * far daemon by RDMA writes, which fans it out there (xfer_rdma.h).  A
 * chunk larger than a staging chunk goes in pieces of whole rows, each
 * with its own table (each entry's rows of the piece, from where the
 * pieces before it left that entry's stream); how far it got is kept in
 * r->part[lr] while it waits for the staging's credit.
 */
static enum px_node node_rdma(struct xfer_route *r, uint32_t lr, int peer,
                              const struct dep_xfer_hdr *h, const uint8_t *table,
                              uint32_t n_dest, const uint8_t *rows, uint64_t payload,
                              char *why, size_t len) {
  const uint64_t rb = r->lay.row_bytes, tab = DEP_XFER_NODE_BYTES(n_dest);
  const uint32_t total = (uint32_t)(payload / rb);
  struct xfer_node_part *pt = &r->part[lr];
  if (pt->rows == 0 && tab + payload <= xfer_rdma_node_room()) {
    const int rc = node_piece(r, peer, h, table, tab, rows, payload, why, len);
    if (rc == XFER_RDMA_NODE_QUEUED)
      node_counted(r, tab, payload);
    return rc < 0 ? PX_NODE_BAD
           : rc == XFER_RDMA_NODE_QUEUED ? PX_NODE_SENT
           : rc == XFER_RDMA_NODE_WAIT  ? PX_NODE_LATER
                                         : PX_NODE_TCP;
  }
  const uint64_t room = xfer_rdma_node_room();
  const uint32_t per = room > tab ? (uint32_t)((room - tab) / rb) : 0;
  if (per == 0)
    return PX_NODE_TCP; /* not a row fits beside its table: never in pieces */
  struct dep_xfer_node_dest ent[DEP_MAX_LOCAL_RANKS];
  for (uint32_t i = 0; i < n_dest; i++)
    memcpy(&ent[i], table + DEP_XFER_NODE_BYTES(i), sizeof ent[i]);
  uint8_t piece[DEP_XFER_NODE_BYTES(DEP_MAX_LOCAL_RANKS)];
  while (pt->rows < total) {
    const uint32_t m = total - pt->rows < per ? total - pt->rows : per;
    const uint8_t *at = rows + (uint64_t)pt->rows * rb;
    uint32_t count[DEP_MAX_LOCAL_RANKS] = {0}, n = 0;
    for (uint32_t k = 0; k < m; k++) {
      const uint64_t hit = row_entries(r, at + (uint64_t)k * rb, ent, n_dest);
      for (uint32_t e = 0; e < n_dest; e++)
        count[e] += (uint32_t)(hit >> e & 1);
    }
    for (uint32_t e = 0; e < n_dest; e++) {
      if (count[e] == 0)
        continue;
      const struct dep_xfer_node_dest pe = {.dest = ent[e].dest,
                                            .start = ent[e].start + pt->sent[e],
                                            .count = count[e]};
      memcpy(piece + DEP_XFER_NODE_BYTES(n++), &pe, sizeof pe);
    }
    const struct dep_xfer_node head = {.n_dest = n, .rows = m};
    memcpy(piece, &head, sizeof head);
    struct dep_xfer_hdr ph = *h;
    ph.row0 = h->row0 + pt->rows;
    ph.bytes = DEP_XFER_NODE_BYTES(n) + (uint64_t)m * rb;
    const int rc = node_piece(r, peer, &ph, piece, DEP_XFER_NODE_BYTES(n), at,
                              (uint64_t)m * rb, why, len);
    if (rc == XFER_RDMA_NODE_WAIT)
      return PX_NODE_LATER;
    if (rc != XFER_RDMA_NODE_QUEUED) {
      if (rc == XFER_RDMA_NODE_TCP && pt->rows == 0)
        return PX_NODE_TCP; /* none of it went: all of it goes as one frame */
      const uint32_t went = pt->rows;
      memset(pt, 0, sizeof *pt);
      if (rc < 0)
        return PX_NODE_BAD;
      if (!atomic_exchange(&r->said, true))
        log_warnx("job %s: local rank %u: %u of a node channel's chunk of %u rows went into the "
                  "staging of node %s, which went before the rest could; the job fails", r->id,
                  lr, went, total, peer_name(peer));
      xfer__route_fail(r, DEP_ERR_PEER);
      return PX_NODE_LOST;
    }
    node_counted(r, DEP_XFER_NODE_BYTES(n), (uint64_t)m * rb);
    for (uint32_t e = 0; e < n_dest; e++)
      pt->sent[e] += count[e];
    pt->rows += m;
  }
  memset(pt, 0, sizeof *pt);
  return PX_NODE_SENT;
}

/* What take_desc did with a descriptor. */
enum px_take {
  PX_TAKEN, /* queued as RDMA writes or into a batch */
  PX_LATER, /* left in the ring: the staging it goes into has no chunk free */
  PX_BAD    /* the descriptor was bad: the route is failed, and said why */
};

/*
 * Take one descriptor of local rank lr's ring in route r into the batch of
 * the peer holding its destination, or into RDMA writes: what it names in
 * the exchange region (desc_source), read in place.
 */
static enum px_take take_desc(struct xfer_route *r, uint32_t lr, const struct dep_xring_desc *d,
                              struct xfer_batch *batches, uint64_t *frames) {
  char why[256] = "";
  struct xfer_src s;
  if (!desc_source(r, lr, d, &s, why, sizeof why))
    goto bad;
  const int peer = r->peer_of[d->dest];
  const uint64_t payload = s.payload != NULL ? d->bytes : 0;
  /* A node channel's chunk is the far daemon's to fan out: into its
   * staging (below), never straight into a rank's exchange region. */
  if (d->kind != DEP_XRING_NODE &&
      xfer_rdma_take(r->rdma, peer, r->mr[lr], r->rank_of[lr], d, &s)) {
    /* queued as RDMA writes (xfer_rdma.h) */
    atomic_fetch_add_explicit(&r->bytes_out, (s.slot ? DEP_SLAB_CTRL_SLOT : 0) + payload +
                                                 (s.mark || s.credit ? sizeof(uint64_t) : 0),
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&r->payload_out, payload, memory_order_relaxed);
    atomic_fetch_add_explicit(&r->frames_out, 1, memory_order_relaxed);
    return PX_TAKEN;
  }
  /* The header, then the payload: copied in below XFER_COPY_MAX, else sent
   * from the out block in place, which the rank leaves alone until the
   * destination has it (a block until the call after next: the destination
   * sends this rank the next call's block only once it has all of this
   * one's; a chunk until the destination's credit covers it). */
  const int into = XFER_BATCH_AT(lane_of(d->kind), peer);
  struct xfer_batch *b = &batches[into];
  uint8_t table[DEP_XFER_NODE_BYTES(DEP_MAX_LOCAL_RANKS)];
  uint32_t n_dest = 0;
  if (d->kind == DEP_XRING_NODE && !node_table(r, lr, d, table, &n_dest, why, sizeof why))
    goto bad;
  const uint64_t tab = d->kind == DEP_XRING_NODE ? DEP_XFER_NODE_BYTES(n_dest) : 0;
  struct dep_xfer_hdr h = {.magic = DEP_XFER_MAGIC, .src = r->rank_of[lr], .dest = d->dest,
                           .parity = d->parity, .seq = d->seq, .bytes = tab + payload,
                           .kind = d->kind, .row0 = d->row0};
  snprintf(h.job_id, sizeof h.job_id, "%s", r->id);
  /* The words the far end takes (those before the tail); the rest, others write meanwhile. */
  if (s.slot != NULL)
    memcpy(h.slot, s.slot, offsetof(struct ops_slot, tail));
  if (s.credit != NULL) {
    /* The word as it is now: a credit or taken word only grows, and any later one is
     * as true. */
    const uint64_t w = atomic_load_explicit((const _Atomic uint64_t *)s.credit,
                                            memory_order_acquire);
    h.seq = d->kind == DEP_XRING_TAKEN ? w : w >> DEP_SLAB_CHAN_SHIFT;
    h.row0 = d->kind == DEP_XRING_TAKEN ? 0 : (uint32_t)(w & ((1u << DEP_SLAB_CHAN_SHIFT) - 1u));
  }
  if (d->kind == DEP_XRING_NODE && r->rdma != NULL) {
    const enum px_node nr =
        node_rdma(r, lr, peer, &h, table, n_dest, s.payload, payload, why, sizeof why);
    if (nr == PX_NODE_BAD)
      goto bad;
    if (nr != PX_NODE_TCP)
      return nr == PX_NODE_SENT ? PX_TAKEN : nr == PX_NODE_LATER ? PX_LATER : PX_BAD;
  }
  /* A streamed node channel's chunk is copied whatever its size: the rank
   * writes its place again once the ring's tail is past it (xring.h),
   * before its credits could tell it the rows are across. */
  const bool copy = payload < XFER_COPY_MAX ||
                    (d->kind == DEP_XRING_NODE && r->lay.chan_rows < r->lay.max_tokens);
  if (!batch_reserve(b, DEP_XFER_HDR_WIRE + tab + (copy ? payload : 0))) {
    snprintf(why, sizeof why, "out of memory for a batch of %llu bytes",
             (unsigned long long)(b->bytes + DEP_XFER_HDR_WIRE + tab + payload));
    goto bad;
  }
  const size_t at = b->bytes;
  const int rc = batch_hdr(b, &h);
  if (rc != 0) {
    snprintf(why, sizeof why, "a frame header that does not encode (%s)", dep_strerror(rc));
    goto bad;
  }
  b->mark[b->n_mark++] = at;
  if (tab > 0)
    batch_copy(b, table, tab);
  if (copy && payload > 0)
    batch_copy(b, s.payload, payload);
  else if (!copy)
    batch_ref(b, s.payload, payload, r);
  frames[into]++;
  atomic_fetch_add_explicit(&r->bytes_out, DEP_XFER_HDR_WIRE + tab + payload,
                            memory_order_relaxed);
  atomic_fetch_add_explicit(&r->payload_out, payload, memory_order_relaxed);
  atomic_fetch_add_explicit(&r->frames_out, 1, memory_order_relaxed);
  return PX_TAKEN;
bad:
  if (!atomic_exchange(&r->said, true))
    log_warnx("job %s: local rank %u's ring holds %s; the job fails", r->id, lr, why);
  xfer__route_fail(r, DEP_ERR_PROTOCOL);
  return PX_BAD;
}

/*
 * A proxy thread's place in its round robin over the rings it serves (its
 * own, on its stack): the ring its next sweep visits first, by its route's
 * serial and its local rank, and whether that ring is part-way through its
 * turn (a batch filled during it: it goes on with what is left of its
 * quantum, not a new one).  Rings come in the order of the route list
 * (newest route first, serials falling), then by local rank.
 */
struct px_cursor {
  uint64_t serial;
  uint32_t lr;
  bool resume;
};

/* Whether ring lr of route r comes at or after the cursor in the round. */
static bool at_or_after(const struct xfer_route *r, uint32_t lr, const struct px_cursor *c) {
  return r->serial < c->serial || (r->serial == c->serial && lr >= c->lr);
}

/* What a descriptor costs of its ring's deficit: the bytes it puts on the
 * wire.  One the layout does not allow costs nothing, so that take_desc
 * sees it (and fails the job) at once. */
static uint64_t desc_cost(const struct xfer_route *r, const struct dep_xring_desc *d) {
  return d->bytes > r->lay.xblock_bytes || d->kind == DEP_XRING_CREDIT ||
                 d->kind == DEP_XRING_TAKEN
             ? 0
             : DEP_XFER_HDR_WIRE + d->bytes;
}

enum px_turn {
  PX_DRAINED,  /* the ring had nothing more (as its head read at the start of the turn) */
  PX_SHORT,    /* its next descriptor costs more than its deficit: it waits for its next turn */
  PX_WAITS,    /* its next descriptor waits for a chunk of a peer's staging (xfer_rdma.h):
                   the ring waits, bounded by its calls' timeout, as for a full ring */
  PX_FULL,     /* a peer's batch filled: the sweep ends */
  PX_FAILED    /* the ring was bad: its job is failed */
};

/*
 * One turn of local rank lr's ring in route r (deficit round robin by
 * bytes): the ring's deficit grows by XFER_QUANTUM unless the turn goes on
 * from the last sweep (fresh false), and descriptors are taken while the
 * next one's cost fits in it.  A ring found empty keeps no deficit: a rank
 * cannot save up turns by pausing.  *taken counts the descriptors taken.
 */
static enum px_turn ring_turn(struct xfer_route *r, uint32_t lr, bool fresh,
                              struct xfer_batch *batches, uint64_t *frames, uint64_t *taken) {
  struct dep_xring *ring = r->ring[lr];
  uint64_t tail = atomic_load_explicit(&ring->tail, memory_order_relaxed);
  uint64_t head = atomic_load_explicit(&ring->head, memory_order_acquire);
  /*
   * A head behind the tail is a rank that pushed from a stale head: a
   * process that took the rank back and counted its pushes from its own
   * start rather than from the ring's head (xring.h).  A stale head that
   * lands exactly on the tail cannot be told from an empty ring, and one
   * that passes it from a store the proxy did not see cannot be told from
   * pushes: the descriptors written meanwhile went into places the proxy
   * had taken, and the calls waiting for them time out.  Only the client
   * prevents it: the process that takes a rank back pushes from the head
   * the ring holds (cuda_attach.c), which the daemon keeps equal to the
   * tail across the change (job_elastic.c elastic_scrub_xchg).
   */
  if (head - tail > DEP_XRING_ENTRIES) {
    if (!atomic_exchange(&r->said, true)) {
      if ((int64_t)(head - tail) < 0)
        log_warnx("job %s: local rank %u's ring has its head (%llu) behind its tail (%llu): "
                  "the rank pushed from a stale head; the job fails", r->id, lr,
                  (unsigned long long)head, (unsigned long long)tail);
      else
        log_warnx("job %s: local rank %u's ring says %llu descriptors are waiting, more than it "
                  "holds; the job fails", r->id, lr, (unsigned long long)(head - tail));
    }
    xfer__route_fail(r, DEP_ERR_PROTOCOL);
    return PX_FAILED;
  }
  if (head - tail > atomic_load_explicit(&r->ring_peak, memory_order_relaxed))
    atomic_store_explicit(&r->ring_peak, (uint32_t)(head - tail), memory_order_relaxed);
  if (tail == head) {
    r->deficit[lr] = 0;
    return PX_DRAINED;
  }
  if (fresh)
    r->deficit[lr] += XFER_QUANTUM;
  while (tail != head) {
    struct dep_xring_desc d = ring->desc[tail % DEP_XRING_ENTRIES];
    const uint64_t cost = desc_cost(r, &d);
    if (cost > r->deficit[lr])
      return PX_SHORT;
    const enum px_take took = take_desc(r, lr, &d, batches, frames);
    if (took == PX_BAD)
      return PX_FAILED;
    if (took == PX_LATER)
      return PX_WAITS;
    r->deficit[lr] -= cost;
    tail++;
    (*taken)++;
    atomic_store_explicit(&ring->tail, tail, memory_order_release);
    if (batches[r->peer_of[d.dest]].bytes >= XFER_BATCH_BYTES)
      return PX_FULL;
  }
  r->deficit[lr] = 0;
  return PX_DRAINED;
}

/*
 * One sweep over the rings thread `self` serves: at most one turn of each
 * (ring_turn), in round-robin order from the cursor, until a peer's batch
 * is full.  The next sweep starts where this one stopped; one that went
 * all the way round starts a ring later than this one did, so that no ring
 * is always last in the batches.  A ring with work waiting thus has its
 * turn in every round, however full the others keep theirs: what goes
 * ahead of it is at most a quantum and one block of each other ring.
 * Returns the descriptors taken; *more says whether a ring was left with
 * work waiting (the thread sweeps again at once).
 */
static uint64_t sweep(uint32_t self, struct px_cursor *cur, struct xfer_batch *batches,
                      uint64_t *frames, bool *more) {
  uint64_t taken = 0;
  bool full = false;
  uint32_t visited = 0;
  struct px_cursor next = {.serial = cur->serial, .lr = cur->lr}; /* a new turn for all */
  *more = false;
  pthread_rwlock_rdlock(&X->lock);
  /* The first pass takes the rings at or after the cursor, the second
   * (after wrapping round) those before it. */
  for (int pass = 0; pass < 2 && !full; pass++) {
    for (struct xfer_route *r = X->routes; r != NULL && !full; r = r->next) {
      for (uint32_t lr = self; lr < r->local_world && !full; lr += X->nthreads) {
        if (at_or_after(r, lr, cur) != (pass == 0) || atomic_load(&r->failed) != 0 ||
            r->ring[lr] == NULL)
          continue;
        const bool fresh = !(cur->resume && r->serial == cur->serial && lr == cur->lr);
        enum px_turn t = ring_turn(r, lr, fresh, batches, frames, &taken);
        /* After a whole round, the next sweep starts at the second ring of this one. */
        if (++visited == 2)
          next = (struct px_cursor){.serial = r->serial, .lr = lr};
        if (t == PX_SHORT || t == PX_WAITS)
          *more = true;
        if (t == PX_FULL) {
          /* The ring goes on with what is left of its quantum; with nothing
           * left, the next ring has the next turn. */
          full = *more = true;
          next = r->deficit[lr] > 0
                     ? (struct px_cursor){.serial = r->serial, .lr = lr, .resume = true}
                     : (struct px_cursor){.serial = r->serial, .lr = lr + 1};
        }
      }
    }
  }
  if (visited > 0)
    *cur = next;
  /* The node channels' chunks the peers wrote into our staging: fanned out,
   * and their credits queued with the sweep's writes. */
  taken += xfer_rdma_stage_poll(xfer__stage_take);
  /* The sweep's RDMA writes go before the lock does, so that no route ends
   * with writes of it still waiting in a chain. */
  uint64_t lost = xfer_rdma_flush();
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    if (lost >> k & 1)
      xfer__routes_fail_peer(k, "RDMA writes of its blocks were lost on the way to node");
  pthread_rwlock_unlock(&X->lock);
  return taken;
}

/* Send and empty every peer k's batch of `lane`, except to a peer lost[k], whose
 * earlier batch of this sweep found no connection; a failed send marks its peer lost. */
static void send_batches(struct xfer_batch *batches, uint64_t *frames, enum px_lane lane,
                         bool *lost) {
  for (int k = 0; k < CONFIG_MAX_LIST; k++) {
    const int at = XFER_BATCH_AT(lane, k);
    struct xfer_batch *b = &batches[at];
    if (b->n_seg == 0)
      continue;
    if (!lost[k])
      lost[k] = xfer__batch_send(k, b, frames[at], lane == PX_LANE_CTL) != 0;
    xfer__batch_reset(b);
    frames[at] = 0;
  }
}

static void *proxy_main(void *arg) {
  uint32_t self = (uint32_t)(uintptr_t)arg;
  char name[16];
  snprintf(name, sizeof name, "deepepd-px%u", self);
  prctl(PR_SET_NAME, name);
  prctl(PR_SET_TIMERSLACK, 1000ul); /* naps of XFER_NAP_NS, not the default 50 us more */
  struct xfer_batch batches[XFER_BATCHES] = {{0}};
  uint64_t frames[XFER_BATCHES] = {0};
  struct px_cursor cur = {.serial = UINT64_MAX}; /* the newest route's first ring */
  uint64_t last_work = 0;
  while (!atomic_load(&X->stop)) {
    bool more;
    uint64_t t0 = mono_ns();
    uint64_t taken = sweep(self, &cur, batches, frames, &more);
    /* Every peer's credits and taken words first, then the data; a peer whose
     * credits found no connection (its routes are failed) is not waited for again. */
    bool lost[CONFIG_MAX_LIST] = {false};
    send_batches(batches, frames, PX_LANE_CTL, lost);
    send_batches(batches, frames, PX_LANE_DATA, lost);
    uint64_t now = mono_ns();
    if (taken > 0 || more) {
      atomic_fetch_add_explicit(&X->busy_ns, now - t0, memory_order_relaxed);
      last_work = now;
      continue;
    }
    uint64_t seen = atomic_load(&X->routes_added);
    pthread_rwlock_rdlock(&X->lock);
    bool none = X->routes == NULL;
    pthread_rwlock_unlock(&X->lock);
    if (none) {
      xfer__routes_wait(seen, now + 100000000ull);
    } else if (now - last_work < X->spin_ns) {
      sched_yield();
    } else {
      struct timespec ts = {0, XFER_NAP_NS};
      nanosleep(&ts, NULL);
    }
  }
  for (int i = 0; i < XFER_BATCHES; i++)
    xfer__batch_free(&batches[i]);
  xfer_rdma_thread_end();
  return NULL;
}

void xfer_proxy_stats(uint32_t *threads, uint64_t *busy_us) {
  *threads = X->active ? X->started : 0;
  *busy_us = X->active ? atomic_load(&X->busy_ns) / 1000u : 0;
}

uint32_t xfer_proxy_threads_default(size_t gpus, uint32_t cpus) {
  if (gpus > 0)
    return gpus < CONFIG_MAX_PROXY_THREADS ? (uint32_t)gpus : CONFIG_MAX_PROXY_THREADS;
  const uint32_t n = cpus / XFER_CPUS_PER_PROXY;
  return n < 1 ? 1 : n > XFER_HOST_PROXY_MAX ? XFER_HOST_PROXY_MAX : n;
}

uint32_t xfer_usable_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0)
    return 1;
  const int n = CPU_COUNT(&set);
  return n > 0 ? (uint32_t)n : 1;
}

int xfer__start_threads(void) {
  const size_t gpus = devices_gpus();
  /* A GPU daemon's windows, or the host backend's; $DEEPEPD_TEST_AWAKE_US gives the host
   * backend windows of its own, so that the tests run the looking receivers there. */
  const uint64_t awake = gpus > 0 ? XFER_SPIN_GPU_NS : X->test_awake_ns;
  X->spin_ns = awake > 0 ? awake : XFER_SPIN_HOST_NS;
  atomic_store_explicit(&X->rx_spin_ns, awake, memory_order_relaxed);
  X->nthreads = X->cfg->proxy_threads
                    ? X->cfg->proxy_threads
                    : xfer_proxy_threads_default(gpus, X->test_cpus ? X->test_cpus
                                                                    : xfer_usable_cpus());
  if (X->nthreads > CONFIG_MAX_PROXY_THREADS)
    X->nthreads = CONFIG_MAX_PROXY_THREADS;
  for (uint32_t i = 0; i < X->nthreads; i++) {
    int rc = pthread_create(&X->threads[i], NULL, proxy_main, (void *)(uintptr_t)i);
    if (rc != 0) {
      log_errx("cannot start proxy thread %u of %u: %s", i, X->nthreads, strerror(rc));
      X->nthreads = X->started;
      return X->started > 0 ? 0 : -1;
    }
    X->started++;
  }
  log_info("data path between nodes: %u proxy thread(s), %u data connection(s) each way to "
           "each peer and one for credits; proxy threads look for work %llu us after their "
           "last, receivers for a frame %llu us after their last", X->nthreads, X->data_conns,
           (unsigned long long)(X->spin_ns / 1000), (unsigned long long)(awake / 1000));
  return 0;
}

