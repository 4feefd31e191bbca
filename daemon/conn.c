/*
 * conn.c — client connections: framing on the way in, a bounded queue of
 * frames on the way out, and the rule that a misbehaving client is dropped
 * with a log line while the daemon and every other client carry on.
 */
#include "conn.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "control.h"
#include "deepepd.h"
#include "fdpass.h"
#include "job.h"

/* One encoded frame waiting to be written, with the fds that ride on it. */
struct conn_out {
  struct conn_out *next;
  uint8_t *data;
  size_t len;
  size_t off;  /* bytes written so far: the fds went with the first */
  int nfds;
  int fds[];
};

/* Frames handled per readable event, so one busy client cannot starve others. */
#define CONN_READ_BUDGET 16
/* At most this much unread input is discarded before closing (see conn_drain). */
#define CONN_DRAIN_MAX (256u * 1024u)

/* Open connections per uid: a small chained hash, an entry per uid connected now. */
#define CONN_UID_BUCKETS 64
struct conn_uid {
  struct conn_uid *next;
  uid_t uid;
  uint32_t n;
};

/* The HELLO deadline is looked at at least this often, so a reload that
 * shortens limits.hello_timeout_ms applies within it. */
#define CONN_HELLO_SWEEP_MAX_MS 1000

static uv_loop_t *conn_loop;
static struct conn *conn_list;
static uint32_t conn_open;
static uint64_t conn_serial;
static void (*conn_on_all_closed)(void);
static struct conn_uid *conn_uids[CONN_UID_BUCKETS];
/* Connections whose HELLO deadline runs, oldest first, and the timer for the oldest. */
static struct conn *conn_hello_head, *conn_hello_tail;
static uv_timer_t conn_hello_timer;
static bool conn_timer_open;

static void conn_on_poll(uv_poll_t *h, int status, int events);

void conn_init(uv_loop_t *loop) {
  conn_loop = loop;
  uv_timer_init(loop, &conn_hello_timer);
  conn_timer_open = true;
}

uint32_t conn_count(void) { return conn_open; }

struct conn *conn_find(uint64_t id) {
  for (struct conn *c = conn_list; c != NULL; c = c->next)
    if (c->id == id && !c->closed)
      return c;
  return NULL;
}

static struct conn_uid **conn_uid_slot(uid_t uid) {
  struct conn_uid **pp = &conn_uids[(unsigned)uid % CONN_UID_BUCKETS];
  while (*pp != NULL && (*pp)->uid != uid)
    pp = &(*pp)->next;
  return pp;
}

uint32_t conn_count_uid(uid_t uid) {
  struct conn_uid *e = *conn_uid_slot(uid);
  return e != NULL ? e->n : 0;
}

static bool conn_uid_add(uid_t uid) {
  struct conn_uid **pp = conn_uid_slot(uid);
  if (*pp == NULL) {
    *pp = calloc(1, sizeof **pp);
    if (*pp == NULL)
      return false;
    (*pp)->uid = uid;
  }
  (*pp)->n++;
  return true;
}

static void conn_uid_remove(uid_t uid) {
  struct conn_uid **pp = conn_uid_slot(uid), *e = *pp;
  if (e != NULL && --e->n == 0) {
    *pp = e->next;
    free(e);
  }
}

static void conn_hello_unlist(struct conn *c) {
  if (!c->hello_waiting)
    return;
  if (c->hello_prev != NULL)
    c->hello_prev->hello_next = c->hello_next;
  else
    conn_hello_head = c->hello_next;
  if (c->hello_next != NULL)
    c->hello_next->hello_prev = c->hello_prev;
  else
    conn_hello_tail = c->hello_prev;
  c->hello_prev = c->hello_next = NULL;
  c->hello_waiting = false;
}

static void conn_hello_sweep(uv_timer_t *t);

/* Wake when the oldest waiting connection's HELLO is due (or sooner). */
static void conn_hello_arm(void) {
  if (conn_hello_head == NULL) {
    uv_timer_stop(&conn_hello_timer);
    return;
  }
  uint64_t due = conn_hello_head->connected_ms + deepepd.cfg.hello_timeout_ms;
  uint64_t now = uv_now(conn_loop);
  uint64_t wait = due > now ? due - now : 0;
  if (wait > CONN_HELLO_SWEEP_MAX_MS)
    wait = CONN_HELLO_SWEEP_MAX_MS;
  uv_timer_start(&conn_hello_timer, conn_hello_sweep, wait, 0);
}

/*
 * Close the connections that are past their HELLO deadline.  Those that
 * said HELLO meanwhile (control.c marks them) leave the list here, so the
 * sweep costs O(1) per connection however many there are.
 */
static void conn_hello_sweep(uv_timer_t *t) {
  uint32_t limit = deepepd.cfg.hello_timeout_ms;
  uint64_t now = uv_now(conn_loop);
  unsigned closed = 0;
  struct conn *c;
  while ((c = conn_hello_head) != NULL &&
         (c->hello_done || now - c->connected_ms >= limit)) {
    conn_hello_unlist(c);
    if (c->hello_done)
      continue;
    conn_send_error(c, 0, DEP_ERR_TIMEOUT,
                    "no HELLO within %u ms of connecting (limits.hello_timeout_ms); closing",
                    limit);
    conn_close(c, "sent no HELLO in time (limits.hello_timeout_ms)");
    closed++;
  }
  if (closed > 0)
    log_info("closed %u connection(s) that sent no HELLO within %u ms (limits.hello_timeout_ms)",
             closed, limit);
  conn_hello_arm();
}

struct conn *conn_create(int fd, const struct ucred *cred) {
  struct conn *c = calloc(1, sizeof *c);
  if (c == NULL || !conn_uid_add(cred->uid)) {
    log_warnx("client pid %d uid %u: out of memory; closing its connection", (int)cred->pid,
              (unsigned)cred->uid);
    free(c);
    close(fd);
    return NULL;
  }
  c->fd = fd;
  c->id = ++conn_serial;
  c->pid = cred->pid;
  c->uid = cred->uid;
  c->gid = cred->gid;
  int rc = uv_poll_init(conn_loop, &c->poll, fd);
  if (rc != 0) {
    log_warnx("client pid %d: uv_poll_init: %s", (int)c->pid, uv_strerror(rc));
    conn_uid_remove(c->uid);
    close(fd);
    free(c);
    return NULL;
  }
  c->poll.data = c;
  c->events = UV_READABLE;
  uv_poll_start(&c->poll, c->events, conn_on_poll);
  c->next = conn_list;
  if (conn_list != NULL)
    conn_list->prev = c;
  conn_list = c;
  conn_open++;
  c->connected_ms = uv_now(conn_loop);
  c->hello_waiting = true;
  c->hello_prev = conn_hello_tail;
  if (conn_hello_tail != NULL)
    conn_hello_tail->hello_next = c;
  else
    conn_hello_head = c;
  conn_hello_tail = c;
  if (conn_hello_head == c)
    conn_hello_arm();
  log_debug("client %llu: connected (pid %d uid %u gid %u)", (unsigned long long)c->id,
            (int)c->pid, (unsigned)c->uid, (unsigned)c->gid);
  return c;
}

static void conn_out_free(struct conn_out *o) {
  fdpass_close_all(o->fds, o->nfds);
  free(o->data);
  free(o);
}

static void conn_set_events(struct conn *c, int events) {
  if (c->closed || events == c->events)
    return;
  c->events = events;
  if (events == 0)
    uv_poll_stop(&c->poll);
  else
    uv_poll_start(&c->poll, events, conn_on_poll);
}

/*
 * Write what the socket takes now.  Returns 0 (maybe with frames left) or a
 * negative DEP_ERR_* when the peer is gone.
 */
static int conn_flush(struct conn *c) {
  while (c->out_head != NULL) {
    struct conn_out *o = c->out_head;
    bool first = o->off == 0;
    ssize_t n = fdpass_send(c->fd, o->data + o->off, o->len - o->off, first ? o->fds : NULL,
                            first ? o->nfds : 0);
    if (n < 0)
      return (int)n;
    o->off += (size_t)n;
    if (o->off < o->len)
      return 0; /* the socket is full: wait for POLLOUT */
    c->out_head = o->next;
    if (c->out_head == NULL)
      c->out_tail = NULL;
    c->out_bytes -= o->len;
    conn_out_free(o);
  }
  return 0;
}

/* After a flush: watch for room when frames wait, close a finished closer. */
static void conn_after_flush(struct conn *c) {
  if (c->closed)
    return;
  if (c->closing && c->out_head == NULL) {
    conn_close(c, "closed after its last frame");
    return;
  }
  int want = c->closing ? 0 : UV_READABLE;
  if (c->out_head != NULL)
    want |= UV_WRITABLE;
  conn_set_events(c, want);
}

int conn_send(struct conn *c, uint16_t type, uint32_t request_id, const void *msg,
              const int *fds, int nfds) {
  if (c->closed)
    return DEP_ERR_DAEMON_GONE;
  if (nfds < 0 || nfds > DEP_PROTO_MAX_FDS)
    return DEP_ERR_INVALID;
  struct proto_buf b;
  proto_buf_init(&b);
  int rc = proto_frame_encode(&b, type, nfds > 0 ? DEP_FRAME_F_FDS : 0, request_id, msg);
  if (rc != 0) {
    proto_buf_free(&b);
    log_warnx("client %llu: cannot encode a %s frame: %s", (unsigned long long)c->id,
              proto_type_name(type), dep_strerror(rc));
    return rc;
  }
  uint32_t limit = deepepd.cfg.client_queue_bytes;
  if (c->out_bytes + b.len > limit) {
    proto_buf_free(&b);
    conn_drop(c, "does not read its replies: its output queue would pass %u bytes "
                 "(limits.client_queue_bytes)", limit);
    return DEP_ERR_LIMIT;
  }
  struct conn_out *o = calloc(1, sizeof *o + sizeof(int) * (size_t)nfds);
  if (o == NULL) {
    proto_buf_free(&b);
    return DEP_ERR_NO_MEMORY;
  }
  o->data = b.data;
  o->len = b.len;
  for (int i = 0; i < nfds; i++) {
    /* The queue keeps its own copies: the caller may close its fds at once. */
    o->fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
    if (o->fds[i] < 0) {
      log_warn("client %llu: duplicating fd %d for a %s frame", (unsigned long long)c->id,
               fds[i], proto_type_name(type));
      o->nfds = i;
      conn_out_free(o);
      return DEP_ERR_IO;
    }
    o->nfds = i + 1;
  }
  bool was_empty = c->out_head == NULL;
  if (c->out_tail != NULL)
    c->out_tail->next = o;
  else
    c->out_head = o;
  c->out_tail = o;
  c->out_bytes += o->len;
  if (was_empty) {
    /* Write at once: most replies fit the socket buffer, saving a loop turn. */
    rc = conn_flush(c);
    if (rc != 0) {
      conn_close(c, "the peer went away while we wrote to it");
      return rc;
    }
  }
  conn_after_flush(c);
  return 0;
}

static int conn_vsend_error(struct conn *c, uint32_t request_id, int code, const char *fmt,
                            va_list ap) {
  struct dep_msg_error e = {.code = code};
  vsnprintf(e.message, sizeof e.message, fmt, ap);
  return conn_send(c, DEP_MSG_ERROR, request_id, &e, NULL, 0);
}

int conn_send_error(struct conn *c, uint32_t request_id, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = conn_vsend_error(c, request_id, code, fmt, ap);
  va_end(ap);
  return rc;
}

/*
 * Read and discard what the peer already sent (bounded), so that closing
 * does not turn our last frame into ECONNRESET on its side: a Unix socket
 * closed with unread input resets its peer.
 */
static void conn_drain(struct conn *c) {
  uint8_t buf[4096];
  size_t total = 0;
  while (total < CONN_DRAIN_MAX) {
    int fds[DEP_PROTO_MAX_FDS];
    int nfds = 0;
    ssize_t n = fdpass_recv(c->fd, buf, sizeof buf, fds, DEP_PROTO_MAX_FDS, &nfds);
    fdpass_close_all(fds, nfds);
    if (n <= 0)
      break;
    total += (size_t)n;
  }
}

static void conn_on_closed(uv_handle_t *h) {
  struct conn *c = h->data;
  job_conn_closed(c);
  while (c->out_head != NULL) {
    struct conn_out *o = c->out_head;
    c->out_head = o->next;
    conn_out_free(o);
  }
  close(c->fd);
  free(c->body);
  free(c);
}

void conn_close(struct conn *c, const char *why) {
  if (c->closed)
    return;
  log_debug("client %llu (pid %d uid %u): %s", (unsigned long long)c->id, (int)c->pid,
            (unsigned)c->uid, why);
  (void)conn_flush(c); /* best effort: an ERROR explaining the close, a SHUTDOWN notice */
  conn_drain(c);
  c->closed = true;
  if (c->prev != NULL)
    c->prev->next = c->next;
  else
    conn_list = c->next;
  if (c->next != NULL)
    c->next->prev = c->prev;
  c->prev = c->next = NULL;
  conn_open--;
  conn_uid_remove(c->uid);
  conn_hello_unlist(c);
  control_conn_closed(c);
  uv_poll_stop(&c->poll);
  uv_close((uv_handle_t *)&c->poll, conn_on_closed);
  if (conn_open == 0 && conn_on_all_closed != NULL) {
    void (*cb)(void) = conn_on_all_closed;
    conn_on_all_closed = NULL;
    cb();
  }
}

static void conn_vdrop(struct conn *c, const char *fmt, va_list ap) {
  if (c->closed)
    return;
  char why[DEP_MSG_TEXT_MAX];
  vsnprintf(why, sizeof why, fmt, ap);
  log_warnx("client %llu (pid %d uid %u%s%s): dropped: %s", (unsigned long long)c->id,
            (int)c->pid, (unsigned)c->uid, c->name[0] ? " " : "", c->name, why);
  conn_close(c, "dropped");
}

void conn_drop(struct conn *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  conn_vdrop(c, fmt, ap);
  va_end(ap);
}

void conn_fail(struct conn *c, uint32_t request_id, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  conn_vsend_error(c, request_id, code, fmt, ap);
  va_end(ap);
  va_start(ap, fmt);
  conn_vdrop(c, fmt, ap);
  va_end(ap);
}

/* A whole header arrived: check it before anything is allocated for the body. */
static bool conn_got_header(struct conn *c) {
  char why[256];
  int rc = proto_hdr_decode(c->hdr, DEP_PROTO_MAX_BODY, &c->h, why, sizeof why);
  if (rc != 0) {
    conn_fail(c, c->h.request_id, rc, "%s", why);
    return false;
  }
  if (c->h.body_len > 0) {
    c->body = malloc(c->h.body_len);
    if (c->body == NULL) {
      conn_fail(c, c->h.request_id, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
      return false;
    }
  }
  c->body_got = 0;
  return true;
}

static void conn_dispatch(struct conn *c) {
  struct dep_frame_hdr h = c->h;
  uint8_t *body = c->body;
  c->body = NULL;
  c->hdr_got = 0;
  c->body_got = 0;
  if ((h.flags & DEP_FRAME_F_FDS) != 0)
    conn_fail(c, h.request_id, DEP_ERR_PROTOCOL,
              "%s frame claims to carry file descriptors; clients never send any",
              proto_type_name(h.type));
  else
    control_handle(c, &h, body, h.body_len);
  free(body);
}

static void conn_read(struct conn *c) {
  for (int budget = CONN_READ_BUDGET; budget > 0 && !c->closed && !c->closing; budget--) {
    bool in_hdr = c->hdr_got < DEP_PROTO_HDR_LEN;
    uint8_t *dst = in_hdr ? c->hdr + c->hdr_got : c->body + c->body_got;
    size_t want = in_hdr ? DEP_PROTO_HDR_LEN - c->hdr_got : c->h.body_len - c->body_got;
    int fds[4];
    int nfds = 0;
    ssize_t n = fdpass_recv(c->fd, dst, want, fds, 4, &nfds);
    if (nfds > 0) {
      fdpass_close_all(fds, nfds);
      conn_drop(c, "sent %d file descriptor(s); clients never send any", nfds);
      return;
    }
    if (n == DEP_ERR_PROTOCOL) {
      conn_drop(c, "sent unexpected ancillary data; clients never send any");
      return;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return;
      conn_close(c, errno == ECONNRESET ? "connection reset" : "read error");
      return;
    }
    if (n == 0) {
      if (c->hdr_got > 0 && in_hdr)
        conn_drop(c, "closed the connection in the middle of a frame header (%zu of %d bytes)",
                  c->hdr_got, DEP_PROTO_HDR_LEN);
      else if (!in_hdr)
        conn_drop(c, "closed the connection in the middle of a %s frame body "
                     "(%zu of %u bytes)", proto_type_name(c->h.type), c->body_got,
                  c->h.body_len);
      else
        conn_close(c, "disconnected");
      return;
    }
    if (in_hdr) {
      c->hdr_got += (size_t)n;
      if (c->hdr_got < DEP_PROTO_HDR_LEN)
        continue;
      if (!conn_got_header(c))
        return;
    } else {
      c->body_got += (size_t)n;
    }
    if (c->body_got == c->h.body_len)
      conn_dispatch(c);
  }
}

static void conn_on_poll(uv_poll_t *h, int status, int events) {
  struct conn *c = h->data;
  if (c->closed)
    return;
  if (status < 0) {
    conn_close(c, uv_strerror(status));
    return;
  }
  if ((events & UV_WRITABLE) != 0) {
    if (conn_flush(c) != 0) {
      conn_close(c, "the peer went away while we wrote to it");
      return;
    }
  }
  if ((events & UV_READABLE) != 0)
    conn_read(c);
  conn_after_flush(c);
}

void conn_shutdown_all(void (*on_all_closed)(void)) {
  conn_on_all_closed = on_all_closed;
  struct conn *next;
  for (struct conn *c = conn_list; c != NULL; c = next) {
    next = c->next;
    c->closing = true;
    conn_send(c, DEP_MSG_SHUTDOWN, 0, NULL, NULL, 0);
    conn_after_flush(c);
  }
  if (conn_open == 0 && conn_on_all_closed != NULL) {
    conn_on_all_closed = NULL;
    on_all_closed();
  }
}

void conn_fini(void) {
  conn_on_all_closed = NULL;
  while (conn_list != NULL)
    conn_close(conn_list, "the daemon is stopping");
  if (conn_timer_open) {
    uv_close((uv_handle_t *)&conn_hello_timer, NULL);
    conn_timer_open = false;
  }
}
