/*
 * link.h — one framed link of deepepd: a non-blocking stream socket (Unix
 * for clients, TCP for peer daemons later) watched with uv_poll, an input
 * side that reads a frame header and then a body whose size was checked
 * first, and a bounded output queue of encoded frames.
 *
 * The link knows the framing (proto.h's header, its ERROR record) and
 * nothing of what the frames mean: its owner hands in a table of ops at
 * creation — what to do with a whole frame, what to do when the link goes,
 * how to name it in log lines, the limits to apply — and a user pointer.
 * The limits are asked for each time they are applied, so a reload that
 * changes them takes effect at once.
 *
 * File descriptors ride as SCM_RIGHTS only on a Unix socket, so passing
 * them is a capability the owner turns on: a link that may send fds, a
 * link that may receive them.  A link that may not receive fds drops a peer
 * that sends any (and closes them).
 *
 * Closing is deferred: link_close() only marks the link, stops its poll and
 * hands it to uv_close; ops->on_close runs once, from the close callback,
 * and the owner may free the link's memory there.  So any code may close a
 * link (even one it is iterating over, even from inside its on_frame)
 * without pulling state out from under its caller.
 */
#ifndef DEP_DAEMON_LINK_H
#define DEP_DAEMON_LINK_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "log.h"
#include "proto.h"

struct link;
struct link_out;

/* The limits in force, asked for whenever they are applied. */
struct link_limits {
  uint32_t max_body;     /* a header promising more is refused before anything is allocated */
  uint32_t queue_bytes;  /* a link whose output queue would pass this is dropped */
  const char *queue_key; /* the setting queue_bytes comes from, named in the log line */
};

struct link_ops {
  /* What the far ends are, in the plural, for log lines: "clients", "peers". */
  const char *kind;
  /* Frames sent may carry fds (a Unix socket only). */
  bool sends_fds;
  /* The far end may send fds with a frame; otherwise any fd received drops the link. */
  bool takes_fds;
  /* A frame of a protocol version outside this build's window is refused
   * with an ERROR under that version (the far end reads it as an answer to
   * its request: clients); otherwise under this build's (a peer daemon
   * expects no ERROR frame, and its own version check names both). */
  bool refuses_in_their_version;
  /* Fill *out with the limits in force now. */
  void (*limits)(const struct link *l, struct link_limits *out);
  /* Write the link's name for log lines, e.g. "client 3 (pid 10 uid 1000)". */
  void (*describe)(const struct link *l, char *buf, size_t len);
  /*
   * A whole frame whose header was checked; body is h->body_len bytes (NULL
   * when empty) and is freed on return.  Its type may be one this build
   * does not know (!proto_type_known: a newer far end's): the owner
   * answers or ignores it, and the link stays in step either way.  fds[0..nfds) came with it (only on a link that
   * takes fds): the handler may keep any by setting its entry to -1; the
   * rest are closed on return.
   */
  void (*on_frame)(struct link *l, const struct dep_frame_hdr *h, const uint8_t *body,
                   size_t len, int *fds, int nfds);
  /* Optional: link_close ran (now, synchronously); nothing more is read or sent. */
  void (*on_closing)(struct link *l);
  /* Once, from the close callback, after the socket is closed: the owner may free l. */
  void (*on_close)(struct link *l);
  /* Optional: say why the link is being dropped, in place of link_drop's own
   * warning line (an owner that rate-limits what strangers cause, say). */
  void (*on_drop)(struct link *l, const char *why);
};

struct link {
  uv_poll_t poll; /* watches fd; poll.data points back here */
  int fd;
  const struct link_ops *ops;
  void *user;     /* the owner's, untouched by the link */
  int events;     /* what the poll watches now */
  bool finishing; /* read nothing more; close once the queue is flushed */
  bool closed;    /* link_close ran: ignore everything, wait for the callback */

  /* input: header first, then a body of the size the header promised */
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  size_t hdr_got;
  struct dep_frame_hdr h;
  uint8_t *body;
  size_t body_got;
  int in_fds[DEP_PROTO_MAX_FDS]; /* fds that came with the frame being read */
  int in_nfds;

  /* output: frames waiting for the socket, bounded by the limits' queue_bytes */
  struct link_out *out_head, *out_tail;
  size_t out_bytes;
};

/*
 * Take over a connected, non-blocking stream socket and start reading.
 * Returns 0, or a negative DEP_ERR_* with fd left open and no callback to
 * come.
 */
int link_init(struct link *l, uv_loop_t *loop, int fd, const struct link_ops *ops, void *user);

/* Whether frames may still be sent and received: not closed, not finishing. */
bool link_open(const struct link *l);

/*
 * Queue one frame.  `fds` (may be NULL; only on a link that sends fds) are
 * duplicated, so the caller keeps its own; they ride on the frame's first
 * byte.  A link whose queue would pass the limit is dropped with a log
 * line.  Returns 0 or a negative DEP_ERR_*.
 */
int link_send(struct link *l, uint16_t type, uint32_t request_id, const void *msg,
              const int *fds, int nfds);
/* Send DEP_MSG_ERROR {code, printf-style message}. */
int link_vsend_error(struct link *l, uint32_t request_id, int code, const char *fmt,
                     va_list ap);

/* What to tell a far end of protocol version theirs, outside this build's
 * window (proto.h): which end to upgrade. */
const char *link_version_advice(uint32_t theirs);

/* Log why (a warning naming the link, or ops->on_drop) and close, after a best-effort flush. */
void link_drop(struct link *l, const char *fmt, ...) LOG_PRINTF(2, 3);
void link_vdrop(struct link *l, const char *fmt, va_list ap);
/* Send an ERROR and then drop the link with the same reason. */
void link_fail(struct link *l, uint32_t request_id, int code, const char *fmt, ...)
    LOG_PRINTF(4, 5);
/*
 * Close now (debug log only): flush what the socket takes, discard unread
 * input (so the close does not reset the far end), stop.  ops->on_closing
 * runs before this returns, ops->on_close from the close callback.
 */
void link_close(struct link *l, const char *why);
/* Close now, leaving the socket as it is: its connection goes on through a
 * dup of the fd that someone else holds (a data connection, xfer.h), so
 * nothing is flushed to it and nothing unread is taken from it. */
void link_hand_off(struct link *l, const char *why);
/* Stop reading and close once what is queued has been written. */
void link_finish(struct link *l);

#endif /* DEP_DAEMON_LINK_H */
