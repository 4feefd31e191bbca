/*
 * link.c — framed links: framing on the way in, a bounded queue of frames
 * on the way out, and the rule that a far end that breaks the framing is
 * dropped with a log line while the daemon and every other link carry on.
 * What a frame means is the owner's business (link.h's ops).
 */
#include "link.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fdpass.h"

/* One encoded frame waiting to be written, with the fds that ride on it. */
struct link_out {
  struct link_out *next;
  uint8_t *data;
  size_t len;
  size_t off; /* bytes written so far: the fds went with the first */
  int nfds;
  int fds[];
};

/* Frames handled per readable event, so one busy link cannot starve others. */
#define LINK_READ_BUDGET 16
/* At most this much unread input is discarded before closing (see link_drain). */
#define LINK_DRAIN_MAX (256u * 1024u)
/* Room for the fds a link that takes none may still be sent, to close them. */
#define LINK_STRAY_FDS 4

static void link_on_poll(uv_poll_t *h, int status, int events);

static void link_name(const struct link *l, char *buf, size_t len) {
  l->ops->describe(l, buf, len);
}

int link_init(struct link *l, uv_loop_t *loop, int fd, const struct link_ops *ops, void *user) {
  memset(l, 0, sizeof *l);
  l->fd = fd;
  l->ops = ops;
  l->user = user;
  int rc = uv_poll_init(loop, &l->poll, fd);
  if (rc != 0) {
    char who[128];
    link_name(l, who, sizeof who);
    log_warnx("%s: uv_poll_init: %s", who, uv_strerror(rc));
    return DEP_ERR_IO;
  }
  l->poll.data = l;
  l->events = UV_READABLE;
  uv_poll_start(&l->poll, l->events, link_on_poll);
  return 0;
}

bool link_open(const struct link *l) { return !l->closed && !l->finishing; }

static void link_out_free(struct link_out *o) {
  fdpass_close_all(o->fds, o->nfds);
  free(o->data);
  free(o);
}

static void link_set_events(struct link *l, int events) {
  if (l->closed || events == l->events)
    return;
  l->events = events;
  if (events == 0)
    uv_poll_stop(&l->poll);
  else
    uv_poll_start(&l->poll, events, link_on_poll);
}

/*
 * Write what the socket takes now.  Returns 0 (maybe with frames left) or a
 * negative DEP_ERR_* when the far end is gone.  sendmsg without fds is a
 * plain send on any stream socket.
 */
static int link_flush(struct link *l) {
  while (l->out_head != NULL) {
    struct link_out *o = l->out_head;
    bool first = o->off == 0;
    ssize_t n = fdpass_send(l->fd, o->data + o->off, o->len - o->off, first ? o->fds : NULL,
                            first ? o->nfds : 0);
    if (n < 0)
      return (int)n;
    o->off += (size_t)n;
    if (o->off < o->len)
      return 0; /* the socket is full: wait for POLLOUT */
    l->out_head = o->next;
    if (l->out_head == NULL)
      l->out_tail = NULL;
    l->out_bytes -= o->len;
    link_out_free(o);
  }
  return 0;
}

/* After a flush: watch for room when frames wait, close a finished link. */
static void link_after_flush(struct link *l) {
  if (l->closed)
    return;
  if (l->finishing && l->out_head == NULL) {
    link_close(l, "closed after its last frame");
    return;
  }
  int want = l->finishing ? 0 : UV_READABLE;
  if (l->out_head != NULL)
    want |= UV_WRITABLE;
  link_set_events(l, want);
}

/* Queue the encoded frame in b (taken over: freed here whatever happens)
 * with copies of fds, and write what the socket takes now. */
static int link_queue(struct link *l, uint16_t type, struct proto_buf *b, const int *fds,
                      int nfds) {
  char who[128];
  struct link_limits lim;
  l->ops->limits(l, &lim);
  if (l->out_bytes + b->len > lim.queue_bytes) {
    proto_buf_free(b);
    link_drop(l, "does not read its replies: its output queue would pass %u bytes (%s)",
              lim.queue_bytes, lim.queue_key);
    return DEP_ERR_LIMIT;
  }
  struct link_out *o = calloc(1, sizeof *o + sizeof(int) * (size_t)nfds);
  if (o == NULL) {
    proto_buf_free(b);
    return DEP_ERR_NO_MEMORY;
  }
  o->data = b->data;
  o->len = b->len;
  proto_buf_init(b);
  for (int i = 0; i < nfds; i++) {
    /* The queue keeps its own copies: the caller may close its fds at once. */
    o->fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
    if (o->fds[i] < 0) {
      link_name(l, who, sizeof who);
      log_warn("%s: duplicating fd %d for a %s frame", who, fds[i], proto_type_name(type));
      o->nfds = i;
      link_out_free(o);
      return DEP_ERR_IO;
    }
    o->nfds = i + 1;
  }
  bool was_empty = l->out_head == NULL;
  if (l->out_tail != NULL)
    l->out_tail->next = o;
  else
    l->out_head = o;
  l->out_tail = o;
  l->out_bytes += o->len;
  if (was_empty) {
    /* Write at once: most frames fit the socket buffer, saving a loop turn. */
    int rc = link_flush(l);
    if (rc != 0) {
      link_close(l, "the peer went away while we wrote to it");
      return rc;
    }
  }
  link_after_flush(l);
  return 0;
}

int link_send(struct link *l, uint16_t type, uint32_t request_id, const void *msg,
              const int *fds, int nfds) {
  if (l->closed)
    return DEP_ERR_DAEMON_GONE;
  if (nfds < 0 || nfds > DEP_PROTO_MAX_FDS || (nfds > 0 && !l->ops->sends_fds))
    return DEP_ERR_INVALID;
  struct proto_buf b;
  proto_buf_init(&b);
  int rc = proto_frame_encode(&b, type, nfds > 0 ? DEP_FRAME_F_FDS : 0, request_id, msg);
  if (rc != 0) {
    char who[128];
    proto_buf_free(&b);
    link_name(l, who, sizeof who);
    log_warnx("%s: cannot encode a %s frame: %s", who, proto_type_name(type), dep_strerror(rc));
    return rc;
  }
  return link_queue(l, type, &b, fds, nfds);
}

int link_vsend_error(struct link *l, uint32_t request_id, int code, const char *fmt,
                     va_list ap) {
  struct dep_msg_error e = {.code = code};
  vsnprintf(e.message, sizeof e.message, fmt, ap);
  return link_send(l, DEP_MSG_ERROR, request_id, &e, NULL, 0);
}

/*
 * Read and discard what the far end already sent (bounded), so that
 * closing does not turn our last frame into a reset on its side: a socket
 * closed with unread input resets its peer (Unix and TCP alike).
 */
static void link_drain(struct link *l) {
  uint8_t buf[4096];
  size_t total = 0;
  while (total < LINK_DRAIN_MAX) {
    int fds[DEP_PROTO_MAX_FDS];
    int nfds = 0;
    ssize_t n = fdpass_recv(l->fd, buf, sizeof buf, fds, DEP_PROTO_MAX_FDS, &nfds);
    fdpass_close_all(fds, nfds);
    if (n <= 0)
      break;
    total += (size_t)n;
  }
}

static void link_on_closed(uv_handle_t *h) {
  struct link *l = h->data;
  while (l->out_head != NULL) {
    struct link_out *o = l->out_head;
    l->out_head = o->next;
    link_out_free(o);
  }
  l->out_tail = NULL;
  l->out_bytes = 0;
  close(l->fd);
  l->fd = -1;
  free(l->body);
  l->body = NULL;
  fdpass_close_all(l->in_fds, l->in_nfds);
  l->in_nfds = 0;
  l->ops->on_close(l); /* last: the owner may free l */
}

/* Close now; with `ours`, the socket is the link's alone: flush and drain it first. */
static void link_close_now(struct link *l, const char *why, bool ours) {
  if (l->closed)
    return;
  char who[128];
  link_name(l, who, sizeof who);
  log_debug("%s: %s", who, why);
  if (ours) {
    (void)link_flush(l); /* best effort: an ERROR explaining the close, a SHUTDOWN notice */
    link_drain(l);
  }
  l->closed = true;
  if (l->ops->on_closing != NULL)
    l->ops->on_closing(l);
  uv_poll_stop(&l->poll);
  uv_close((uv_handle_t *)&l->poll, link_on_closed);
}

void link_close(struct link *l, const char *why) { link_close_now(l, why, true); }

void link_hand_off(struct link *l, const char *why) { link_close_now(l, why, false); }

void link_finish(struct link *l) {
  if (l->closed)
    return;
  l->finishing = true;
  link_after_flush(l);
}

void link_vdrop(struct link *l, const char *fmt, va_list ap) {
  if (l->closed)
    return;
  char why[DEP_MSG_TEXT_MAX], who[128];
  vsnprintf(why, sizeof why, fmt, ap);
  if (l->ops->on_drop != NULL) {
    l->ops->on_drop(l, why);
  } else {
    link_name(l, who, sizeof who);
    log_warnx("%s: dropped: %s", who, why);
  }
  link_close(l, "dropped");
}

void link_drop(struct link *l, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  link_vdrop(l, fmt, ap);
  va_end(ap);
}

void link_fail(struct link *l, uint32_t request_id, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  link_vsend_error(l, request_id, code, fmt, ap);
  va_end(ap);
  va_start(ap, fmt);
  link_vdrop(l, fmt, ap);
  va_end(ap);
}

const char *link_version_advice(uint32_t theirs) {
  return theirs > DEP_PROTO_VERSION
             ? "upgrade this deepepd: it is the older end"
             : "upgrade the older end (libdeepep-client, deepepctl or the peer's deepepd)";
}

/*
 * Refuse a frame of a protocol version this build does not speak, and
 * drop the link.  Where the owner asks, the ERROR goes out under the far
 * end's own version number: the header and the ERROR body are the same in
 * every version (proto.h), and a client that checks the version of what it
 * reads, as every release so far does, reads the reason rather than "bad
 * version".
 */
static void link_refuse_version(struct link *l) {
  struct dep_msg_error e = {.code = DEP_ERR_VERSION};
  snprintf(e.message, sizeof e.message,
           "this deepepd (%s) speaks protocol versions %u..%u; your frame is of version %u: %s",
           DEP_VERSION_STRING, (unsigned)DEP_PROTO_MIN_VERSION, (unsigned)DEP_PROTO_VERSION,
           (unsigned)l->h.version, link_version_advice(l->h.version));
  if (!l->ops->refuses_in_their_version) {
    link_fail(l, l->h.request_id, DEP_ERR_VERSION, "%s", e.message);
    return;
  }
  struct proto_buf b;
  proto_buf_init(&b);
  if (proto_frame_encode(&b, DEP_MSG_ERROR, 0, l->h.request_id, &e) == 0) {
    struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC,
                              .version = l->h.version,
                              .type = DEP_MSG_ERROR,
                              .request_id = l->h.request_id,
                              .body_len = (uint32_t)(b.len - DEP_PROTO_HDR_LEN)};
    proto_hdr_encode(&h, b.data);
    (void)link_queue(l, DEP_MSG_ERROR, &b, NULL, 0);
  }
  proto_buf_free(&b);
  link_drop(l, "%s", e.message);
}

/*
 * A whole header arrived: check it before anything is allocated for the
 * body.  A frame of a type this build does not know is read whole and
 * handed on like any other: its owner answers or ignores it (link.h).
 */
static bool link_got_header(struct link *l) {
  char why[256];
  struct link_limits lim;
  l->ops->limits(l, &lim);
  int rc = proto_hdr_decode(l->hdr, lim.max_body, &l->h, why, sizeof why);
  if (rc == DEP_ERR_VERSION) {
    link_refuse_version(l);
    return false;
  }
  if (rc != 0 && rc != DEP_ERR_UNSUPPORTED) {
    link_fail(l, l->h.request_id, rc, "%s", why);
    return false;
  }
  if (l->h.body_len > 0) {
    l->body = malloc(l->h.body_len);
    if (l->body == NULL) {
      link_fail(l, l->h.request_id, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
      return false;
    }
  }
  l->body_got = 0;
  return true;
}

static void link_dispatch(struct link *l) {
  struct dep_frame_hdr h = l->h;
  uint8_t *body = l->body;
  int fds[DEP_PROTO_MAX_FDS];
  int nfds = l->in_nfds;
  memcpy(fds, l->in_fds, sizeof(int) * (size_t)nfds);
  l->body = NULL;
  l->hdr_got = 0;
  l->body_got = 0;
  l->in_nfds = 0;
  bool flagged = (h.flags & DEP_FRAME_F_FDS) != 0;
  if (flagged && !l->ops->takes_fds)
    link_fail(l, h.request_id, DEP_ERR_PROTOCOL,
              "%s frame claims to carry file descriptors; %s never send any",
              proto_type_name(h.type), l->ops->kind);
  else if (flagged && nfds == 0)
    link_fail(l, h.request_id, DEP_ERR_PROTOCOL,
              "%s frame claims to carry file descriptors and none came with it",
              proto_type_name(h.type));
  else if (!flagged && nfds > 0)
    link_fail(l, h.request_id, DEP_ERR_PROTOCOL,
              "%d file descriptor(s) came with a %s frame that does not carry any", nfds,
              proto_type_name(h.type));
  else
    l->ops->on_frame(l, &h, body, h.body_len, fds, nfds);
  fdpass_close_all(fds, nfds); /* those the handler did not keep (-1) */
  free(body);
}

/* One recvmsg into dst; fds go to the frame being read, or drop a link that takes none. */
static ssize_t link_recv(struct link *l, void *dst, size_t want) {
  if (l->ops->takes_fds)
    return fdpass_recv(l->fd, dst, want, l->in_fds, DEP_PROTO_MAX_FDS, &l->in_nfds);
  int fds[LINK_STRAY_FDS];
  int nfds = 0;
  ssize_t n = fdpass_recv(l->fd, dst, want, fds, LINK_STRAY_FDS, &nfds);
  if (nfds > 0) {
    fdpass_close_all(fds, nfds);
    link_drop(l, "sent %d file descriptor(s); %s never send any", nfds, l->ops->kind);
    return DEP_ERR_PROTOCOL;
  }
  if (n == DEP_ERR_PROTOCOL)
    link_drop(l, "sent unexpected ancillary data; %s never send any", l->ops->kind);
  return n;
}

static void link_read(struct link *l) {
  for (int budget = LINK_READ_BUDGET; budget > 0 && link_open(l); budget--) {
    bool in_hdr = l->hdr_got < DEP_PROTO_HDR_LEN;
    uint8_t *dst = in_hdr ? l->hdr + l->hdr_got : l->body + l->body_got;
    size_t want = in_hdr ? DEP_PROTO_HDR_LEN - l->hdr_got : l->h.body_len - l->body_got;
    ssize_t n = link_recv(l, dst, want);
    if (n == DEP_ERR_PROTOCOL) {
      /* link_recv dropped a link that takes no fds; fdpass closed what came. */
      link_drop(l, "sent ancillary data that is not file descriptors, or too many of them");
      return;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return;
      link_close(l, errno == ECONNRESET ? "connection reset" : "read error");
      return;
    }
    if (n == 0) {
      if (l->hdr_got > 0 && in_hdr)
        link_drop(l, "closed the connection in the middle of a frame header (%zu of %d bytes)",
                  l->hdr_got, DEP_PROTO_HDR_LEN);
      else if (!in_hdr)
        link_drop(l, "closed the connection in the middle of a %s frame body (%zu of %u bytes)",
                  proto_type_name(l->h.type), l->body_got, l->h.body_len);
      else
        link_close(l, "disconnected");
      return;
    }
    if (in_hdr) {
      l->hdr_got += (size_t)n;
      if (l->hdr_got < DEP_PROTO_HDR_LEN)
        continue;
      if (!link_got_header(l))
        return;
    } else {
      l->body_got += (size_t)n;
    }
    if (l->body_got == l->h.body_len)
      link_dispatch(l);
  }
}

static void link_on_poll(uv_poll_t *h, int status, int events) {
  struct link *l = h->data;
  if (l->closed)
    return;
  if (status < 0) {
    link_close(l, uv_strerror(status));
    return;
  }
  if ((events & UV_WRITABLE) != 0) {
    if (link_flush(l) != 0) {
      link_close(l, "the peer went away while we wrote to it");
      return;
    }
  }
  if ((events & UV_READABLE) != 0)
    link_read(l);
  link_after_flush(l);
}
