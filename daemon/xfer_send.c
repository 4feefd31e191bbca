/*
 * xfer_send.c — the proxy threads' send of a batch to a peer (xfer.h,
 * xfer_internal.h): whole on one of the peer's TCP data connections of
 * xfer_conn.c, round robin, or a large one cut at frame boundaries and
 * sent on all of them at once (sendmsg, the larger payloads from their out
 * blocks in place).
 *
 * A batch of credits and taken words goes on the peer's control lane, the
 * last of its connections (out[X->data_conns]), which carries nothing
 * else: on a data connection it would wait behind the unsent data of
 * earlier batches (up to TCP_NOTSENT_LOWAT of it), behind another proxy
 * thread's batch holding the connection, and at the far end behind the
 * receiver's writing of the frames ahead of it; on the lane its only
 * queue is other credits.  A lane not open (yet, or dropped) sends it on
 * a data connection as before.  A connection opened takes the first free
 * place (xfer_dial.c), so the lane is the last to open and a data
 * connection cut is replaced before the lane takes anything from the data.
 */
#include "xfer.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "log.h"
#include "peer.h"
#include "xfer_internal.h"

/* The iovecs one sendmsg takes at most (IOV_MAX is 1024; more gains nothing
 * on a batch of at most XFER_BATCH_BYTES). */
#define XFER_IOV 64
/*
 * A batch of at least this many bytes is cut at frame boundaries into one
 * part per open data connection of its peer, sent on all of them at once
 * (frames are independent: each names its job, ranks, parity and call,
 * and a receiver thread per connection writes its own); a smaller one
 * goes whole on one connection.  Below it, the wire time a second
 * connection could save is about what its extra sendmsg and the far
 * end's extra receiver wake-up cost; the low-latency calls' batches are
 * mostly smaller.
 */
#define XFER_SPLIT_MIN (256u << 10)

/* Bytes [from, to) of a batch, on its way out on data connection conn. */
struct xfer_part {
  uint32_t conn;
  size_t from, to;
  uint32_t seg;  /* the first segment not sent whole */
  size_t done;   /* of it, sent */
  size_t left;   /* of the part, still to send */
  int err;       /* 0, or the errno its connection failed with */
};

static void part_init(struct xfer_part *p, const struct xfer_batch *b, uint32_t conn,
                      size_t from, size_t to) {
  *p = (struct xfer_part){.conn = conn, .from = from, .to = to, .left = to - from};
  size_t at = 0;
  while (p->seg < b->n_seg && at + b->seg[p->seg].len <= from)
    at += b->seg[p->seg++].len;
  p->done = from - at;
}

/* One sendmsg of what is left of part p on fd (headers and copied payloads
 * from the batch's buf, the larger payloads from their out blocks in
 * place): bytes sent, or -1 with errno (EAGAIN: the socket is full). */
static ssize_t part_send(int fd, const struct xfer_batch *b, struct xfer_part *p) {
  struct iovec iov[XFER_IOV];
  int n = 0;
  size_t room = p->left;
  for (uint32_t k = p->seg; k < b->n_seg && n < XFER_IOV && room > 0; k++, n++) {
    const struct xfer_seg *g = &b->seg[k];
    const uint8_t *base = g->ext != NULL ? g->ext : b->buf + g->off;
    const size_t skip = k == p->seg ? p->done : 0;
    const size_t len = g->len - skip < room ? g->len - skip : room;
    iov[n] = (struct iovec){.iov_base = (void *)(base + skip), .iov_len = len};
    room -= len;
  }
  struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
  ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (w <= 0)
    return w < 0 ? -1 : (errno = EAGAIN, -1);
  p->left -= (size_t)w;
  for (size_t adv = (size_t)w; adv > 0;) {
    const size_t rest = b->seg[p->seg].len - p->done;
    if (adv < rest) {
      p->done += adv;
      break;
    }
    adv -= rest;
    p->seg++;
    p->done = 0;
  }
  return w;
}

/*
 * Send parts[0..n) of batch b at once, each on its own connection of peer
 * xp (the caller holds those connections' mutexes): each socket is filled
 * until it would block, then all wait together, at most XFER_IO_MS for
 * any progress.  A part whose connection fails has err set.
 */
static void parts_send(struct xfer_peer *xp, const struct xfer_batch *b, struct xfer_part *parts,
                       uint32_t n) {
  for (;;) {
    struct pollfd pf[XFER_CONNS_MAX];
    uint32_t waiting[XFER_CONNS_MAX], nw = 0;
    for (uint32_t i = 0; i < n; i++) {
      struct xfer_part *p = &parts[i];
      const int fd = xp->out[p->conn].fd;
      while (p->left > 0 && p->err == 0) {
        if (part_send(fd, b, p) >= 0)
          continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
          p->err = errno != 0 ? errno : EIO;
        break;
      }
      if (p->left > 0 && p->err == 0) {
        pf[nw] = (struct pollfd){.fd = fd, .events = POLLOUT};
        waiting[nw++] = i;
      }
    }
    if (nw == 0)
      return;
    int r = poll(pf, nw, XFER_IO_MS);
    if (r == 0 || (r < 0 && errno != EINTR)) {
      const int err = r == 0 ? ETIMEDOUT : errno;
      for (uint32_t j = 0; j < nw; j++)
        parts[waiting[j]].err = err;
      return;
    }
  }
}


/* Close the connection of each part that failed (its mutex held), saying why. */
static void parts_close_failed(int k, struct xfer_peer *xp, const struct xfer_part *parts,
                               uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    if (parts[i].err == 0)
      continue;
    log_warnx("peer %s: data connection %u dropped while sending (%s)", peer_name(k),
              parts[i].conn, strerror(parts[i].err));
    xfer__out_close(xp, parts[i].conn);
  }
}

/*
 * Send bytes [from, to) of batch b to peer k whole on one of its data
 * connections (round robin), another one if that fails.  A peer with none
 * waits for one up to XFER_CONNECT_MS (it is being opened).  0, or -1.
 */
static int send_whole(int k, struct xfer_batch *b, size_t from, size_t to) {
  struct xfer_peer *xp = &X->peers[k];
  uint64_t deadline = mono_ns() + (uint64_t)XFER_CONNECT_MS * 1000000ull;
  for (;;) {
    uint32_t start = atomic_fetch_add(&xp->next, 1);
    for (uint32_t t = 0; t < X->data_conns; t++) {
      uint32_t i = (start + t) % X->data_conns;
      pthread_mutex_lock(&xp->out[i].mu);
      if (xp->out[i].fd < 0) {
        pthread_mutex_unlock(&xp->out[i].mu);
        continue;
      }
      struct xfer_part part;
      part_init(&part, b, i, from, to);
      parts_send(xp, b, &part, 1);
      parts_close_failed(k, xp, &part, 1);
      pthread_mutex_unlock(&xp->out[i].mu);
      if (part.err == 0)
        return 0;
    }
    if (atomic_load(&X->stop) || mono_ns() > deadline)
      return -1;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}

/*
 * Send a batch of at least XFER_SPLIT_MIN bytes in one part per open data
 * connection of peer k at once, cut at the frame marks nearest equal
 * shares; a part whose connection fails goes again whole on another
 * (send_whole).  Returns 0, -1 (a part could not be sent), or 1: fewer
 * than two connections are open, nothing was sent.
 */
static int send_split(int k, struct xfer_batch *b) {
  struct xfer_peer *xp = &X->peers[k];
  uint32_t open[XFER_CONNS_MAX], n_open = 0;
  for (uint32_t i = 0; i < X->data_conns; i++) { /* in order: no two senders wait on each other */
    pthread_mutex_lock(&xp->out[i].mu);
    if (xp->out[i].fd >= 0)
      open[n_open++] = i;
    else
      pthread_mutex_unlock(&xp->out[i].mu);
  }
  struct xfer_part parts[XFER_CONNS_MAX];
  uint32_t n = 0;
  size_t from = 0;
  for (uint32_t m = 0; n_open >= 2 && n + 1 < n_open; n++) {
    const size_t share = b->bytes * (n + 1) / n_open; /* this part ends at the first mark past it */
    while (m < b->n_mark && b->mark[m] <= share)
      m++;
    if (m == b->n_mark)
      break;
    part_init(&parts[n], b, open[n], from, b->mark[m]);
    from = b->mark[m];
  }
  if (n_open >= 2 && from < b->bytes) {
    part_init(&parts[n], b, open[n], from, b->bytes);
    n++;
  }
  if (n >= 2) {
    parts_send(xp, b, parts, n);
    parts_close_failed(k, xp, parts, n);
  }
  for (uint32_t i = 0; i < n_open; i++)
    pthread_mutex_unlock(&xp->out[open[i]].mu);
  if (n < 2)
    return 1; /* no mark to cut at, or one connection: nothing went */
  int rc = 0;
  for (uint32_t i = 0; i < n && rc == 0; i++)
    if (parts[i].err != 0)
      rc = send_whole(k, b, parts[i].from, parts[i].to);
  return rc;
}

/*
 * Send a batch of credits and taken words to peer k whole on its control
 * lane: 0, or 1 when the lane is not open or failed (nothing of the batch
 * is lost: a part that failed is sent again whole elsewhere, and a word
 * received twice is harmless, the largest standing).
 */
static int send_ctl(int k, struct xfer_batch *b) {
  struct xfer_peer *xp = &X->peers[k];
  struct xfer_out *o = &xp->out[X->data_conns];
  pthread_mutex_lock(&o->mu);
  if (o->fd < 0) {
    pthread_mutex_unlock(&o->mu);
    return 1;
  }
  struct xfer_part part;
  part_init(&part, b, X->data_conns, 0, b->bytes);
  parts_send(xp, b, &part, 1);
  parts_close_failed(k, xp, &part, 1);
  pthread_mutex_unlock(&o->mu);
  return part.err == 0 ? 0 : 1;
}

/*
 * Send batch b (frames of them) to peer k: credits and taken words (ctl)
 * on its control lane; data split over its open data connections at once
 * when it is large, else whole on one.  0, or -1 with every route that
 * sends to k failed.
 */
int xfer__batch_send(int k, struct xfer_batch *b, uint64_t frames, bool ctl) {
  struct xfer_peer *xp = &X->peers[k];
  int rc = 1;
  if (ctl)
    rc = send_ctl(k, b);
  else if (b->bytes >= XFER_SPLIT_MIN && X->data_conns > 1 && b->n_mark > 1)
    rc = send_split(k, b);
  if (rc == 1)
    rc = send_whole(k, b, 0, b->bytes);
  if (rc == 0) {
    atomic_fetch_add(&xp->bytes_out, b->bytes);
    atomic_fetch_add(&xp->frames_out, frames);
    return 0;
  }
  pthread_rwlock_rdlock(&X->lock);
  xfer__routes_fail_peer(k, "no data connection takes its blocks to node");
  pthread_rwlock_unlock(&X->lock);
  return -1;
}

