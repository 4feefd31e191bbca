/*
 * conn.h — one client connection of deepepd: a framed link (link.h) on an
 * accepted Unix socket, which may send fds and takes none, plus what the
 * daemon knows of the client: its SO_PEERCRED identity, whether it said
 * HELLO and its name, the job its rank belongs to.  Each whole frame, and
 * the news that a connection goes, go to the ops the layer above hands to
 * conn_init (control.c's control_conn_ops): conn.c calls nothing above it,
 * so it reads, and tests, alone.
 *
 * A connection that has not said HELLO within limits.hello_timeout_ms is
 * closed: one timer serves them all, since they wait in the order they
 * came.  Open connections are counted in total and per uid (server.c
 * admits against both).
 *
 * Closing is deferred (as the link's is): conn_close() takes the
 * connection out of the counts at once; the job table hears of the
 * departure and the memory is freed in the close callback.  So any code may
 * close a connection (even one it is iterating over) without pulling state
 * out from under its caller.
 */
#ifndef DEP_DAEMON_CONN_H
#define DEP_DAEMON_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <uv.h>

#include "link.h"
#include "log.h"
#include "proto.h"

struct job;

struct conn {
  struct link link;      /* the framed socket; link.user points back here */
  uint64_t id;           /* serial number for log lines */
  pid_t pid;             /* SO_PEERCRED, never from the wire */
  uid_t uid;
  gid_t gid;
  bool hello_done;       /* HELLO accepted: other requests allowed */
  bool hello_waiting;    /* on the list of connections whose HELLO deadline runs */
  char name[64];         /* from HELLO, for logs only */

  /* the job this connection's rank belongs to (job.c owns these fields) */
  struct job *job;
  uint32_t job_local_rank;
  /* the SM budget the rank was given at attach, and why (TUNE: autotune.c) */
  uint32_t tune_ctas, tune_how;

  uint64_t connected_ms; /* uv_now() at accept: the HELLO deadline counts from here */
  struct conn *hello_prev, *hello_next; /* that list, oldest first */

  struct conn *prev, *next;
};

/*
 * What a connection tells the layer above it, each on the loop thread:
 * `frame`, one whole frame whose header was checked (body is h->body_len
 * bytes); `closing`, the connection left the list and the counts (conn_close
 * or the peer hung up), so nothing may be sent to it any more; `closed`, its
 * socket is closed and its memory goes once the call returns.
 */
struct conn_ops {
  void (*frame)(struct conn *c, const struct dep_frame_hdr *h, const uint8_t *body, size_t len);
  void (*closing)(struct conn *c);
  void (*closed)(struct conn *c);
};

/* ops (kept, not copied) serves every connection from now on. */
void conn_init(uv_loop_t *loop, const struct conn_ops *ops);
/* Close every connection now (the callbacks run on the next loop turn). */
void conn_fini(void);

/* Take over an accepted, non-blocking socket.  NULL (fd closed) on failure. */
struct conn *conn_create(int fd, const struct ucred *cred);

/*
 * Queue one frame.  `fds` (may be NULL) are duplicated, so the caller keeps
 * its own; they ride on the frame's first byte.  A connection whose queue
 * would pass limits.client_queue_bytes is closed with a log line.  Returns
 * 0 or a negative DEP_ERR_*.
 */
int conn_send(struct conn *c, uint16_t type, uint32_t request_id, const void *msg,
              const int *fds, int nfds);
/* Reply with DEP_MSG_ERROR {code, printf-style message}. */
int conn_send_error(struct conn *c, uint32_t request_id, int code, const char *fmt, ...)
    LOG_PRINTF(4, 5);

/* Reply with an ERROR and then drop the connection with the same reason. */
void conn_fail(struct conn *c, uint32_t request_id, int code, const char *fmt, ...)
    LOG_PRINTF(4, 5);
/* Close quietly (debug log only): the peer left or the daemon is stopping. */
void conn_close(struct conn *c, const char *why);
/* Whether requests on c are still served: not closed, not being shut down. */
bool conn_open(const struct conn *c);

/* Every connection, newest first, to walk with ->next (skip those !conn_open). */
struct conn *conn_first(void);
/* The open connection with this serial id (conn.id), or NULL once it is closed. */
struct conn *conn_find(uint64_t id);

/* Open connections that are not being closed. */
uint32_t conn_count(void);
/* Of them, those of this uid. */
uint32_t conn_count_uid(uid_t uid);

/*
 * Stop reading from every client and queue a DEP_MSG_SHUTDOWN notice; each
 * connection closes once its queue is flushed.  `on_all_closed` runs when
 * the last one is gone (at once when there are none).
 */
void conn_shutdown_all(void (*on_all_closed)(void));

#endif /* DEP_DAEMON_CONN_H */
