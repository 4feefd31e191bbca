/*
 * metrics_http.c — metrics.listen (metrics_http.h): a listener of plain
 * HTTP on the loop that answers GET /metrics with ctl_view.c's exposition
 * of this daemon's records, gathered as STATUS, STATS and PEERS would give
 * them to root.
 *
 * A connection reads into a fixed buffer until the blank line that ends
 * the headers, answers once, and closes after the answer is written; its
 * timer closes it whatever it is doing once METRICS_HTTP_IDLE_MS have
 * passed since it was accepted, so a client that sends slowly or never
 * reads its answer holds one slot for a bounded time only.
 */
#include "metrics_http.h"

#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control.h"
#include "ctl_view.h"
#include "job.h"
#include "log.h"
#include "peer.h"
#include "stats.h"

struct mh_conn {
  uv_tcp_t tcp;
  uv_timer_t timer;
  uv_write_t wr;
  char req[METRICS_HTTP_REQ_MAX];
  size_t len;
  char *reply; /* status line, headers and body, malloc'd */
  struct sockaddr_storage from; /* the peer's address; its port is not compared */
  bool answered, closing;
  int open_handles; /* freed when both handles have closed */
  struct mh_conn *next;
};

static struct {
  uv_loop_t *loop;
  uv_tcp_t listener;
  bool listening;
  struct mh_conn *conns; /* newest first */
  unsigned n_conns;       /* those not closing: the slots taken */
  bool said_full;
  char where[CONFIG_LISTEN_MAX];
  uv_tcp_t drop; /* a connection refused for want of memory, while it closes */
  bool drop_busy;
} M;

static void mh_on_dropped(uv_handle_t *h) {
  (void)h;
  M.drop_busy = false;
}

static void mh_on_closed(uv_handle_t *h) {
  struct mh_conn *c = h->data;
  if (--c->open_handles > 0)
    return;
  for (struct mh_conn **pp = &M.conns; *pp != NULL; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  free(c->reply);
  free(c);
}

static void mh_close(struct mh_conn *c) {
  if (c->closing)
    return;
  c->closing = true;
  M.n_conns--;
  uv_close((uv_handle_t *)&c->tcp, mh_on_closed);
  uv_close((uv_handle_t *)&c->timer, mh_on_closed);
}

static void mh_on_timeout(uv_timer_t *t) {
  struct mh_conn *c = t->data;
  log_debug("metrics: a client at %s took more than %d ms; closed", M.where,
            METRICS_HTTP_IDLE_MS);
  mh_close(c);
}

static void mh_on_written(uv_write_t *w, int status) {
  (void)status; /* written or not, the answer is all this connection gets */
  mh_close(w->data);
}

/* The exposition, rendered in memory: a malloc'd string in *body, or NULL. */
static char *mh_render(size_t *len) {
  char *body = NULL;
  FILE *f = open_memstream(&body, len);
  if (f == NULL)
    return NULL;
  struct dep_status st = {0};
  struct ctl_stats s = {0};
  struct dep_msg_peers pm = {0};
  struct dep_msg_job_nodes *jn = calloc(1, sizeof *jn);
  int rc = jn != NULL ? control_fill_status(&st, 0) : DEP_ERR_NO_MEMORY;
  if (rc == 0)
    rc = stats_snapshot(&s.ranks, &s.n, &s.ok);
  if (rc == 0)
    rc = peer_fill(&pm);
  if (rc == 0) {
    job_fill_nodes(jn, 0);
    rc = ctl_view_metrics(f, &st, &s, &pm, jn);
  }
  free(jn);
  free(st.devices);
  free(st.jobs);
  free(s.ranks);
  proto_peers_free(&pm);
  if (fclose(f) != 0 || rc != 0) {
    free(body);
    return NULL;
  }
  return body;
}

/* Answer with one status, and the body (text) the status calls for. */
static void mh_reply(struct mh_conn *c, int code, const char *reason, const char *extra_header,
                     const char *type, const char *body, size_t body_len) {
  c->answered = true;
  uv_read_stop((uv_stream_t *)&c->tcp);
  char head[320];
  int n = snprintf(head, sizeof head,
                   "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                   "Connection: close\r\n\r\n",
                   code, reason, type, body_len, extra_header);
  c->reply = malloc((size_t)n + body_len);
  if (c->reply == NULL) {
    mh_close(c);
    return;
  }
  memcpy(c->reply, head, (size_t)n);
  memcpy(c->reply + n, body, body_len);
  uv_buf_t b = uv_buf_init(c->reply, (unsigned)((size_t)n + body_len));
  c->wr.data = c;
  if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &b, 1, mh_on_written) != 0)
    mh_close(c);
}

static void mh_reply_text(struct mh_conn *c, int code, const char *reason,
                          const char *extra_header, const char *text) {
  mh_reply(c, code, reason, extra_header, "text/plain; charset=utf-8", text, strlen(text));
}

/* The request line of a complete request: "METHOD TARGET HTTP/1.x". */
static void mh_answer(struct mh_conn *c) {
  char *eol = memchr(c->req, '\n', c->len);
  size_t n = (size_t)(eol - c->req);
  if (n > 0 && c->req[n - 1] == '\r')
    n--;
  c->req[n] = '\0';
  char *sp1 = strchr(c->req, ' ');
  char *sp2 = sp1 != NULL ? strchr(sp1 + 1, ' ') : NULL;
  if (sp1 == NULL || sp2 == NULL || strncmp(sp2 + 1, "HTTP/1.", 7) != 0) {
    mh_reply_text(c, 400, "Bad Request", "", "deepepd: not an HTTP/1 request line\n");
    return;
  }
  *sp1 = '\0';
  *sp2 = '\0';
  const char *target = sp1 + 1;
  size_t path_len = strcspn(target, "?");
  if (strcmp(c->req, "GET") != 0) {
    mh_reply_text(c, 405, "Method Not Allowed", "Allow: GET\r\n",
                  "deepepd: only GET /metrics is served here\n");
    return;
  }
  if (path_len != strlen("/metrics") || strncmp(target, "/metrics", path_len) != 0) {
    mh_reply_text(c, 404, "Not Found", "", "deepepd: only GET /metrics is served here\n");
    return;
  }
  size_t len = 0;
  char *body = mh_render(&len);
  if (body == NULL) {
    mh_reply_text(c, 500, "Internal Server Error", "",
                  "deepepd: out of memory while rendering the metrics\n");
    return;
  }
  mh_reply(c, 200, "OK", "", CTL_VIEW_METRICS_TYPE, body, len);
  free(body);
}

static void mh_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *b) {
  (void)suggested;
  struct mh_conn *c = h->data;
  /* One byte kept back, so that a full buffer is told from a request that fits. */
  *b = uv_buf_init(c->req + c->len, (unsigned)(sizeof c->req - 1 - c->len));
}

/* Whether the headers have ended: a blank line, CRLF or bare LF. */
static bool mh_complete(const struct mh_conn *c) {
  for (size_t i = 1; i < c->len; i++)
    if (c->req[i] == '\n' && (c->req[i - 1] == '\n' ||
                              (i >= 2 && c->req[i - 1] == '\r' && c->req[i - 2] == '\n')))
      return true;
  return false;
}

static void mh_on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *b) {
  (void)b;
  struct mh_conn *c = s->data;
  if (c->answered || c->closing)
    return;
  if (nread < 0) {
    mh_close(c); /* gone (or an error) before a whole request */
    return;
  }
  c->len += (size_t)nread;
  if (mh_complete(c)) {
    mh_answer(c);
    return;
  }
  if (c->len >= sizeof c->req - 1)
    mh_reply_text(c, 431, "Request Header Fields Too Large", "",
                  "deepepd: the request is larger than 4096 bytes\n");
}

/* Whether a and b come from the same address, whatever their ports. */
static bool mh_same_source(const struct mh_conn *a, const struct mh_conn *b) {
  if (a->from.ss_family != b->from.ss_family)
    return false;
  if (a->from.ss_family == AF_INET)
    return ((const struct sockaddr_in *)&a->from)->sin_addr.s_addr ==
           ((const struct sockaddr_in *)&b->from)->sin_addr.s_addr;
  return memcmp(&((const struct sockaddr_in6 *)&a->from)->sin6_addr,
                &((const struct sockaddr_in6 *)&b->from)->sin6_addr, sizeof(struct in6_addr)) == 0;
}

/* The connection to close when one more than METRICS_HTTP_CONNS are open: among those still
 * waiting for a whole request, the oldest of the address holding the most of them.  Closing
 * the newest instead let any client that opened the slots and sent nothing deny every scrape;
 * closing the oldest of the busiest address means such a client evicts its own connections
 * first, while a scraper, whose request follows its connect, is answered before it is the
 * oldest.  The newest connection has sent nothing yet, so there is always one. */
static struct mh_conn *mh_victim(void) {
  struct mh_conn *victim = NULL;
  unsigned victim_n = 0;
  for (struct mh_conn *c = M.conns; c != NULL; c = c->next) {
    if (c->answered || c->closing)
      continue;
    unsigned n = 0;
    for (struct mh_conn *o = M.conns; o != NULL; o = o->next)
      n += !o->answered && !o->closing && mh_same_source(c, o);
    if (n >= victim_n) { /* >=: the list is newest first, so a tie goes to the older */
      victim = c;
      victim_n = n;
    }
  }
  return victim;
}

static void mh_on_connection(uv_stream_t *server, int status) {
  if (status != 0) {
    log_warnx("metrics: accept on %s: %s", M.where, uv_strerror(status));
    return;
  }
  struct mh_conn *c = calloc(1, sizeof *c);
  if (c == NULL) {
    /* Accept it into the spare handle and close it: a connection left unaccepted would stop
     * libuv from accepting any other. */
    if (!M.drop_busy && uv_tcp_init(M.loop, &M.drop) == 0) {
      M.drop_busy = true;
      uv_accept(server, (uv_stream_t *)&M.drop);
      uv_close((uv_handle_t *)&M.drop, mh_on_dropped);
    }
    log_warnx("metrics: out of memory; a scrape on %s was refused", M.where);
    return;
  }
  uv_tcp_init(M.loop, &c->tcp);
  uv_timer_init(M.loop, &c->timer);
  c->tcp.data = c;
  c->timer.data = c;
  c->open_handles = 2;
  c->next = M.conns;
  M.conns = c;
  M.n_conns++;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
    mh_close(c);
    return;
  }
  int len = sizeof c->from;
  if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&c->from, &len) != 0) {
    mh_close(c);
    return;
  }
  if (M.n_conns > METRICS_HTTP_CONNS) {
    if (!M.said_full)
      log_warnx("metrics: more than %d connections at once on %s; closing the one that has "
                "waited longest for its request, from the address holding the most (said once)",
                METRICS_HTTP_CONNS, M.where);
    M.said_full = true;
    struct mh_conn *victim = mh_victim();
    mh_close(victim);
    if (victim == c)
      return;
  }
  uv_timer_start(&c->timer, mh_on_timeout, METRICS_HTTP_IDLE_MS, 0);
  if (uv_read_start((uv_stream_t *)&c->tcp, mh_alloc, mh_on_read) != 0)
    mh_close(c);
}

int metrics_http_init(uv_loop_t *loop, const struct config *cfg) {
  memset(&M, 0, sizeof M);
  M.loop = loop;
  if (cfg->metrics_listen[0] == '\0')
    return 0;
  snprintf(M.where, sizeof M.where, "%s", cfg->metrics_listen);
  char host[64], why[200];
  uint16_t port = 0;
  if (config_listen_split(cfg->metrics_listen, host, sizeof host, &port, why, sizeof why) != 0) {
    log_errx("metrics.listen: %s", why); /* the config check let it through: say so anyway */
    return -1;
  }
  struct sockaddr_storage sa;
  int rc = strchr(host, ':') != NULL ? uv_ip6_addr(host, port, (struct sockaddr_in6 *)&sa)
                                     : uv_ip4_addr(host, port, (struct sockaddr_in *)&sa);
  if (rc == 0)
    rc = uv_tcp_init(loop, &M.listener);
  if (rc != 0) {
    log_errx("metrics.listen %s: %s", M.where, uv_strerror(rc));
    return -1;
  }
  M.listening = true;
  /* libuv reports a bind's EADDRINUSE at listen: both are the same failure to the operator. */
  rc = uv_tcp_bind(&M.listener, (const struct sockaddr *)&sa, 0);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&M.listener, METRICS_HTTP_CONNS, mh_on_connection);
  if (rc != 0) {
    log_errx("metrics.listen %s: cannot listen there: %s; choose another port or address, "
             "or leave metrics.listen empty to serve no metrics over HTTP",
             M.where, uv_strerror(rc));
    metrics_http_fini();
    return -1;
  }
  log_info("metrics: serving the Prometheus exposition at http://%s/metrics", M.where);
  return 0;
}

void metrics_http_fini(void) {
  if (M.listening) {
    uv_close((uv_handle_t *)&M.listener, NULL);
    M.listening = false;
  }
  for (struct mh_conn *c = M.conns; c != NULL; c = c->next)
    mh_close(c);
}
