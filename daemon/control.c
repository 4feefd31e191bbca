/*
 * control.c — request handlers.  Checks run in the order the protocol
 * promises: the header was checked by the link (link.c); here the connection state
 * (HELLO first), then the body, then its fields.  A client that breaks the
 * protocol gets an ERROR and is dropped; one that asks for something it may
 * not have, or for a request type this deepepd does not know, gets an ERROR
 * and keeps its connection.
 */
#include "control.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "autotune.h"
#include "conn.h"
#include "deepepd.h"
#include "devices.h"
#include "job.h"
#include "kcheck.h"
#include "log.h"
#include "peer.h"
#include "stats.h"
#include "xfer.h"

/*
 * A STATUS body must fit DEP_PROTO_MAX_BODY: a job entry takes at most
 * 2 + 63 + 4 * 4 + 2 * 8 bytes, so this many always fit with room to spare.
 */
#define CONTROL_STATUS_MAX_JOBS 2048u

static void control_hello(struct conn *c, const struct dep_frame_hdr *h,
                          const union dep_msg_body *body) {
  const struct dep_msg_hello m = body->hello;
  /* The name reaches log lines and the error below: escaped first, whatever the path. */
  char name[4 * sizeof m.name];
  log_escape(m.name, strnlen(m.name, sizeof m.name), name, sizeof name);
  if (!proto_version_known(m.version)) {
    conn_fail(c, h->request_id, DEP_ERR_VERSION,
              "protocol version mismatch: the client (%s) speaks version %u; this deepepd (%s) "
              "speaks protocol versions %u..%u: %s",
              name[0] ? name : "unnamed", m.version, DEP_VERSION_STRING,
              (unsigned)DEP_PROTO_MIN_VERSION, (unsigned)DEP_PROTO_VERSION,
              link_version_advice(m.version));
    return;
  }
  if (c->hello_done) {
    conn_send_error(c, h->request_id, DEP_ERR_STATE, "HELLO was already sent on this connection");
    return;
  }
  c->hello_done = true;
  /* The name only ever reaches log lines: kept escaped (cut to fit). */
  log_escape(m.name, strnlen(m.name, sizeof m.name), c->name, sizeof c->name);
  log_debug("client %llu (pid %d uid %u): HELLO from \"%s\"", (unsigned long long)c->id,
            (int)c->pid, (unsigned)c->uid, c->name);
  struct dep_msg_hello_ok ok = {.version = DEP_PROTO_VERSION};
  snprintf(ok.daemon_version, sizeof ok.daemon_version, "%s", DEP_VERSION_STRING);
  snprintf(ok.backend, sizeof ok.backend, "%s", devices_backend_name());
  conn_send(c, DEP_MSG_HELLO_OK, h->request_id, &ok, NULL, 0);
}

int control_fill_status(struct dep_status *st, uid_t viewer) {
  memset(st, 0, sizeof *st);
  snprintf(st->version, sizeof st->version, "%s", DEP_VERSION_STRING);
  st->proto_version = DEP_PROTO_VERSION;
  st->pid = (uint32_t)getpid();
  st->uptime_ms = deepepd_uptime_ms();
  snprintf(st->backend, sizeof st->backend, "%s", devices_backend_name());
  snprintf(st->state, sizeof st->state, "%s", deepepd_state_name());
  st->num_clients = conn_count();
  int rc = devices_fill_status(st);
  if (rc == 0)
    rc = job_fill_status(st, viewer, CONTROL_STATUS_MAX_JOBS);
  return rc;
}

static void control_status(struct conn *c, const struct dep_frame_hdr *h,
                           const union dep_msg_body *body) {
  struct dep_status st;
  int rc = control_fill_status(&st, c->uid);
  if (rc == 0)
    conn_send(c, DEP_MSG_STATUS_OK, h->request_id, &st, NULL, 0);
  else
    conn_send_error(c, h->request_id, rc, "cannot build the status: %s", dep_strerror(rc));
  free(st.devices);
  free(st.jobs);
}

/*
 * ATTACH requests that arrive while the pools are being made wait here, at
 * most one per connection, in the order they came, until
 * control_attach_resume hands them to job_attach (or fails them).
 */
struct control_parked {
  struct control_parked *next;
  struct conn *conn;
  uint32_t request_id;
  struct dep_attach_args args;
};
static struct control_parked *control_parked_head;

static void control_attach_park(struct conn *c, uint32_t request_id,
                                const struct dep_attach_args *a) {
  struct control_parked **pp = &control_parked_head;
  for (; *pp != NULL; pp = &(*pp)->next) {
    if ((*pp)->conn == c) {
      conn_send_error(c, request_id, DEP_ERR_STATE,
                      "an ATTACH already waits on this connection for the device pools to be "
                      "made");
      return;
    }
  }
  struct control_parked *p = malloc(sizeof *p);
  if (p == NULL) {
    conn_send_error(c, request_id, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
    return;
  }
  *p = (struct control_parked){.conn = c, .request_id = request_id, .args = *a};
  *pp = p;
  log_info("job %s: rank %u (local %u, pid %d) waits for the device pools to be made", a->job_id,
           a->rank, a->local_rank, (int)c->pid);
}

void control_attach_resume(int rc, const char *why) {
  struct control_parked *p;
  /* One at a time from the head: a reply that closes another parked
   * connection takes that one out of the list (control_conn_closed). */
  while ((p = control_parked_head) != NULL) {
    control_parked_head = p->next;
    if (rc == 0)
      job_attach(p->conn, p->request_id, &p->args);
    else
      conn_send_error(p->conn, p->request_id, rc, "job %s: %s", p->args.job_id, why);
    free(p);
  }
}

/* Take c's parked ATTACH out of the list: true (its request id in *request_id) if it had one. */
static bool control_unpark(struct conn *c, uint32_t *request_id) {
  for (struct control_parked **pp = &control_parked_head; *pp != NULL; pp = &(*pp)->next) {
    if ((*pp)->conn == c) {
      struct control_parked *p = *pp;
      *pp = p->next;
      if (request_id != NULL)
        *request_id = p->request_id;
      free(p);
      return true;
    }
  }
  return false;
}

void control_conn_closed(struct conn *c) { (void)control_unpark(c, NULL); }

const struct conn_ops control_conn_ops = {
    .frame = control_handle,
    .closing = control_conn_closed,
    .closed = job_conn_closed,
};

static void control_attach(struct conn *c, const struct dep_frame_hdr *h,
                           const union dep_msg_body *body) {
  struct dep_attach_args a = body->attach;
  char why[DEP_MSG_TEXT_MAX];
  int rc = proto_check_attach(&a, why, sizeof why);
  if (rc != 0) {
    char msg[DEP_MSG_TEXT_MAX];
    snprintf(msg, sizeof msg, "ATTACH: %.480s", why);
    job_refuse_attach(c, h->request_id, &a, rc, msg); /* fails the job it names, if gathering */
    return;
  }
  if (deepepd.starting)
    control_attach_park(c, h->request_id, &a);
  else
    job_attach(c, h->request_id, &a);
}

/* Whether c may run an operator request (reload, drain): root or deepepd's own user. */
static bool control_operator(struct conn *c, const struct dep_frame_hdr *h, const char *what) {
  if (c->uid == 0 || c->uid == geteuid())
    return true;
  log_warnx("%s refused: uid %u (pid %d) is neither root nor deepepd's user", what,
            (unsigned)c->uid, (int)c->pid);
  conn_send_error(c, h->request_id, DEP_ERR_PERMISSION,
                  "only root or deepepd's own user may %s it (you are uid %u)", what,
                  (unsigned)c->uid);
  return false;
}

/*
 * A RELOAD's answer comes once the file has been read on a worker thread,
 * and its client may be gone by then: conn.c frees a closed connection in
 * its close callback.  So the waiter keeps the connection's serial id and
 * looks it up again (conn_find).
 */
struct control_reload_wait {
  uint64_t conn_id;
  uint32_t request_id;
};

static void control_reload_done(void *arg, int rc, const struct dep_msg_reload_ok *r) {
  struct control_reload_wait *w = arg;
  struct conn *c = conn_find(w->conn_id);
  if (c == NULL || !conn_open(c)) {
    log_debug("client %llu left before its RELOAD was answered", (unsigned long long)w->conn_id);
  } else if (rc != 0) {
    conn_send_error(c, w->request_id, rc, "%s", r->message);
  } else {
    conn_send(c, DEP_MSG_RELOAD_OK, w->request_id, r, NULL, 0);
  }
  free(w);
}

/* RELOAD: as SIGHUP, for root and the daemon's own user only; answered once it is done. */
static void control_reload(struct conn *c, const struct dep_frame_hdr *h,
                           const union dep_msg_body *body) {
  log_info("reload requested by uid %u (pid %d)", (unsigned)c->uid, (int)c->pid);
  struct control_reload_wait *w = malloc(sizeof *w);
  if (w == NULL) {
    conn_send_error(c, h->request_id, DEP_ERR_NO_MEMORY,
                    "out of memory; keeping the running configuration");
    return;
  }
  w->conn_id = c->id;
  w->request_id = h->request_id;
  deepepd_reload(control_reload_done, w);
}

/* DRAIN: stop taking new jobs (running ones finish), or take them again. */
static void control_drain(struct conn *c, const struct dep_frame_hdr *h,
                          const union dep_msg_body *body) {
  const struct dep_msg_drain m = body->drain;
  if (deepepd.draining != (m.drain != 0))
    log_notice("%s by uid %u (pid %d): %s; %u job(s) running", m.drain ? "drain" : "resume",
               (unsigned)c->uid, (int)c->pid,
               m.drain ? "no new jobs until resumed" : "new jobs are accepted again", job_count());
  deepepd.draining = m.drain != 0;
  struct dep_msg_text t;
  snprintf(t.text, sizeof t.text, "%s; %u job(s) running",
           m.drain ? "draining: new jobs are refused" : "accepting new jobs", job_count());
  conn_send(c, DEP_MSG_DRAIN_OK, h->request_id, &t, NULL, 0);
}

/* PEERS: each configured peer daemon and its connections (deepepctl peers). */
static void control_peers(struct conn *c, const struct dep_frame_hdr *h,
                          const union dep_msg_body *body) {
  struct dep_msg_peers m;
  int rc = peer_fill(&m);
  if (rc == 0)
    conn_send(c, DEP_MSG_PEERS_OK, h->request_id, &m, NULL, 0);
  else
    conn_send_error(c, h->request_id, rc, "cannot list the peers: %s", dep_strerror(rc));
  proto_peers_free(&m);
}

/* JOB_NODES: the nodes of the multi-node jobs c may see (deepepctl status). */
static void control_job_nodes(struct conn *c, const struct dep_frame_hdr *h,
                              const union dep_msg_body *body) {
  struct dep_msg_job_nodes *m = calloc(1, sizeof *m);
  if (m == NULL) {
    conn_send_error(c, h->request_id, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
    return;
  }
  job_fill_nodes(m, c->uid);
  conn_send(c, DEP_MSG_JOB_NODES_OK, h->request_id, m, NULL, 0);
  free(m);
}

/* JOB_EVENTS: the histories of the elastic jobs c may see (deepepctl status). */
static void control_job_events(struct conn *c, const struct dep_frame_hdr *h,
                               const union dep_msg_body *body) {
  struct dep_msg_job_events *m = calloc(1, sizeof *m);
  if (m == NULL) {
    conn_send_error(c, h->request_id, DEP_ERR_NO_MEMORY, "deepepd is out of memory");
    return;
  }
  job_fill_events(m, c->uid);
  conn_send(c, DEP_MSG_JOB_EVENTS_OK, h->request_id, m, NULL, 0);
  free(m);
}

/* XRING_LEND: a rank of a running job that spans nodes asks for its ring (xfer.c). */
static void control_xring_lend(struct conn *c, const struct dep_frame_hdr *h,
                               const union dep_msg_body *body) {
  xfer_lend_ring(c, h->request_id);
}

/* STATS_LEND: a rank of a running job asks for its stats page (stats.c). */
static void control_stats_lend(struct conn *c, const struct dep_frame_hdr *h,
                               const union dep_msg_body *body) {
  stats_lend(c, h->request_id);
}

/* STATS: the per-rank figures of the jobs c may see (deepepctl stats, metrics, doctor). */
static void control_stats(struct conn *c, const struct dep_frame_hdr *h,
                          const union dep_msg_body *body) {
  stats_reply(c, h->request_id, &body->stats_req);
}

/* CLIENTS: the connections c may see (deepepctl clients). */
static void control_clients(struct conn *c, const struct dep_frame_hdr *h,
                            const union dep_msg_body *body) {
  stats_clients(c, h->request_id);
}

/* KERNELS: the daemon's compile of the library's kernels for a GPU, as a sealed memfd. */
static void control_kernels(struct conn *c, const struct dep_frame_hdr *h,
                            const union dep_msg_body *body) {
  const struct dep_msg_kernels m = body->kernels;
  struct dep_msg_kernels_ok ok;
  char why[DEP_MSG_TEXT_MAX];
  int fd = -1;
  int rc = DEP_ERR_NOT_FOUND;
  /* The check writes its table off the loop until the pools are done. */
  if (deepepd.starting)
    snprintf(why, sizeof why, "deepepd is still making its pools and checking its kernels");
  else
    rc = kcheck_lend(m.device_uuid, &ok, &fd, why, sizeof why);
  if (rc == 0)
    conn_send(c, DEP_MSG_KERNELS_OK, h->request_id, &ok, &fd, 1);
  else
    conn_send_error(c, h->request_id, rc, "%s", why);
}

/* TUNE: an attached rank's SM budget (adaptive_optimization, autotune.h). */
static void control_tune(struct conn *c, const struct dep_frame_hdr *h,
                         const union dep_msg_body *body) {
  autotune_request(c, h->request_id, &body->tune);
}

static void control_detach(struct conn *c, const struct dep_frame_hdr *h,
                           const union dep_msg_body *body) {
  /* An ATTACH still waiting for the pools ends here, as one waiting for
   * the other ranks does (job_detach). */
  uint32_t parked;
  if (control_unpark(c, &parked)) {
    conn_send_error(c, parked, DEP_ERR_STATE,
                    "ATTACH was cancelled by DETACH while deepepd was making its device pools");
    conn_send(c, DEP_MSG_DETACH_OK, h->request_id, NULL, NULL, 0);
    return;
  }
  job_detach(c, h->request_id);
}

void control_handle(struct conn *c, const struct dep_frame_hdr *h, const uint8_t *body,
                    size_t len) {
  if (!conn_open(c))
    return;
  if (!c->hello_done && h->type != DEP_MSG_HELLO) {
    conn_fail(c, h->request_id, DEP_ERR_STATE, "the first message must be HELLO, not %s",
              proto_type_name(h->type));
    return;
  }
  if (!proto_type_known(h->type)) {
    /* A newer library's or deepepctl's request (DESIGN §8): its body was
     * read whole, so the connection stays in step and stays open. */
    conn_send_error(c, h->request_id, DEP_ERR_UNSUPPORTED,
                    "this deepepd (protocol %u, version %s) does not know request type %u; "
                    "upgrade deepepd or use a matching client",
                    (unsigned)DEP_PROTO_VERSION, DEP_VERSION_STRING, (unsigned)h->type);
    return;
  }
  const enum dep_msg_from from = proto_type_from(h->type);
  if (from != DEP_MSG_FROM_CLIENT && from != DEP_MSG_FROM_OPERATOR) {
    /* Replies and notices travel from the daemon only. */
    conn_fail(c, h->request_id, DEP_ERR_PROTOCOL, "clients may not send %s frames",
              proto_type_name(h->type));
    return;
  }
  /* The body, then who asks, then the request itself. */
  union dep_msg_body m;
  if (proto_type_empty(h->type)) {
    if (len != 0) {
      conn_fail(c, h->request_id, DEP_ERR_PROTOCOL, "%s carries no body, got %zu bytes",
                proto_type_name(h->type), len);
      return;
    }
  } else {
    int rc = proto_body_decode(h->type, body, len, &m);
    if (rc != 0) {
      conn_fail(c, h->request_id, rc, "malformed %s body (%zu bytes)", proto_type_name(h->type),
                len);
      return;
    }
  }
  /* One case per request of DEP_MSG_MAP (proto.h), to control_<name>; an
   * operator's request after control_operator, with its name as the verb. */
  switch (h->type) {
#define CASE_CLIENT(NAME, name)                                                                   \
  case DEP_MSG_##NAME:                                                                           \
    control_##name(c, h, &m);                                                                    \
    break;
#define CASE_OPERATOR(NAME, name)                                                                 \
  case DEP_MSG_##NAME:                                                                           \
    if (control_operator(c, h, #name))                                                           \
      control_##name(c, h, &m);                                                                  \
    break;
#define CASE_DAEMON(NAME, name)
#define CASE_PEER(NAME, name)
#define CASE_(NAME, name, number, body, from) CASE_##from(NAME, name)
    DEP_MSG_MAP(CASE_)
#undef CASE_
#undef CASE_CLIENT
#undef CASE_OPERATOR
#undef CASE_DAEMON
#undef CASE_PEER
  default:
    break; /* not a request: refused above */
  }
}
