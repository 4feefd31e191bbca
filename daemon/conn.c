/*
 * conn.c — client connections: a framed link per accepted socket, the
 * client's identity and HELLO deadline, and the counts (total and per uid)
 * that admission checks.  The link reads and writes frames; what a frame
 * asks for, and what a departing client means, is for the ops conn_init
 * was given (control.c's, which tell the job table too).
 */
#include "conn.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "deepepd.h"

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
static const struct conn_ops *conn_ops;
static struct conn *conn_list;
static uint32_t conn_n_open;
static uint64_t conn_serial;
static void (*conn_on_all_closed)(void);
static struct conn_uid *conn_uids[CONN_UID_BUCKETS];
/* Connections whose HELLO deadline runs, oldest first, and the timer for the oldest. */
static struct conn *conn_hello_head, *conn_hello_tail;
static uv_timer_t conn_hello_timer;
static bool conn_timer_open;

void conn_init(uv_loop_t *loop, const struct conn_ops *ops) {
  conn_loop = loop;
  conn_ops = ops;
  uv_timer_init(loop, &conn_hello_timer);
  conn_timer_open = true;
}

uint32_t conn_count(void) { return conn_n_open; }

struct conn *conn_first(void) { return conn_list; }

struct conn *conn_find(uint64_t id) {
  for (struct conn *c = conn_list; c != NULL; c = c->next)
    if (c->id == id && !c->link.closed)
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


/* ---- the link's ops: how a client connection frames, names and ends ---- */

static void conn_limits(const struct link *l, struct link_limits *out) {
  *out = (struct link_limits){.max_body = DEP_PROTO_MAX_BODY,
                              .queue_bytes = deepepd.cfg.client_queue_bytes,
                              .queue_key = "limits.client_queue_bytes"};
}

static void conn_describe(const struct link *l, char *buf, size_t len) {
  const struct conn *c = l->user;
  snprintf(buf, len, "client %llu (pid %d uid %u%s%s)", (unsigned long long)c->id, (int)c->pid,
           (unsigned)c->uid, c->name[0] ? " " : "", c->name);
}

static void conn_on_frame(struct link *l, const struct dep_frame_hdr *h, const uint8_t *body,
                          size_t len, int *fds, int nfds) {
  conn_ops->frame(l->user, h, body, len);
}

/* The link closed: out of the list, the counts and the HELLO deadline, at once. */
static void conn_on_closing(struct link *l) {
  struct conn *c = l->user;
  if (c->prev != NULL)
    c->prev->next = c->next;
  else
    conn_list = c->next;
  if (c->next != NULL)
    c->next->prev = c->prev;
  c->prev = c->next = NULL;
  conn_n_open--;
  conn_uid_remove(c->uid);
  conn_hello_unlist(c);
  conn_ops->closing(c);
  if (conn_n_open == 0 && conn_on_all_closed != NULL) {
    void (*cb)(void) = conn_on_all_closed;
    conn_on_all_closed = NULL;
    cb();
  }
}

/* The socket is closed: the layer above hears of it and the memory goes. */
static void conn_on_close(struct link *l) {
  struct conn *c = l->user;
  conn_ops->closed(c);
  free(c);
}

/* Clients are sent fds (the arenas' chunks) and never send any. */
static const struct link_ops conn_link_ops = {
    .kind = "clients",
    .sends_fds = true,
    .takes_fds = false,
    .refuses_in_their_version = true,
    .limits = conn_limits,
    .describe = conn_describe,
    .on_frame = conn_on_frame,
    .on_closing = conn_on_closing,
    .on_close = conn_on_close,
};

struct conn *conn_create(int fd, const struct ucred *cred) {
  struct conn *c = calloc(1, sizeof *c);
  if (c == NULL || !conn_uid_add(cred->uid)) {
    log_warnx("client pid %d uid %u: out of memory; closing its connection", (int)cred->pid,
              (unsigned)cred->uid);
    free(c);
    close(fd);
    return NULL;
  }
  c->id = ++conn_serial;
  c->pid = cred->pid;
  c->uid = cred->uid;
  c->gid = cred->gid;
  if (link_init(&c->link, conn_loop, fd, &conn_link_ops, c) != 0) {
    conn_uid_remove(c->uid);
    close(fd);
    free(c);
    return NULL;
  }
  c->next = conn_list;
  if (conn_list != NULL)
    conn_list->prev = c;
  conn_list = c;
  conn_n_open++;
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

bool conn_open(const struct conn *c) { return link_open(&c->link); }

int conn_send(struct conn *c, uint16_t type, uint32_t request_id, const void *msg,
              const int *fds, int nfds) {
  return link_send(&c->link, type, request_id, msg, fds, nfds);
}

int conn_send_error(struct conn *c, uint32_t request_id, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = link_vsend_error(&c->link, request_id, code, fmt, ap);
  va_end(ap);
  return rc;
}

void conn_close(struct conn *c, const char *why) { link_close(&c->link, why); }

void conn_fail(struct conn *c, uint32_t request_id, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  link_vsend_error(&c->link, request_id, code, fmt, ap);
  va_end(ap);
  va_start(ap, fmt);
  link_vdrop(&c->link, fmt, ap);
  va_end(ap);
}

void conn_shutdown_all(void (*on_all_closed)(void)) {
  conn_on_all_closed = on_all_closed;
  struct conn *next;
  for (struct conn *c = conn_list; c != NULL; c = next) {
    next = c->next;
    conn_send(c, DEP_MSG_SHUTDOWN, 0, NULL, NULL, 0);
    link_finish(&c->link); /* read nothing more; close once the notice is out */
  }
  if (conn_n_open == 0 && conn_on_all_closed != NULL) {
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
