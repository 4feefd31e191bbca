/*
 * check_metrics.c — metrics.listen (daemon/metrics_http.c) as a
 * specification, through a real deepepd and real rank processes on the
 * host backend: GET /metrics over TCP serves the very exposition
 * `deepepctl metrics` prints, which a real Prometheus parser reads; any
 * other path, method or malformed request gets its HTTP error and the
 * daemon carries on; a request past the header bound and idle scrapers are
 * bounded, while idle connections filling the slots deny no scrape; and a port already taken fails the
 * start, saying what to do; a job id run again names each series once.
 */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemonwire.h"
#include "nodes.h"
#include "statsranks.h"
#include "testutil.h"
#include "xnjob.h"

/* A TCP port free on 127.0.0.1 now (bound to port 0, read, let go). */
static int mt_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
  close(fd);
  return ntohs(sa.sin_port);
}

/* A connection to the listener on 127.0.0.1:port from the loopback address src (any of
 * 127.0.0.0/8 is this host's, so a test can stand for several sources). */
static int mt_tcp_from(const char *src, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in from = {.sin_family = AF_INET};
  ck_assert_int_eq(inet_pton(AF_INET, src, &from.sin_addr), 1);
  ck_assert_msg(bind(fd, (struct sockaddr *)&from, sizeof from) == 0, "bind to %s: %s", src,
                strerror(errno));
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  ck_assert_msg(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0, "connect to port %d: %s",
                port, strerror(errno));
  return fd;
}

static int mt_tcp(int port) {
  return mt_tcp_from("127.0.0.1", port);
}

/* What fd says until it closes, within timeout_ms (malloc'd, NUL-ended); *eof whether it did. */
static char *mt_read_all(int fd, int timeout_ms, bool *eof) {
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  int64_t deadline = dw_now_ms() + timeout_ms;
  *eof = false;
  while (dw_now_ms() < deadline) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, (int)(deadline - dw_now_ms())) <= 0)
      continue;
    if (n + 1 >= cap)
      buf = realloc(buf, cap *= 2);
    ssize_t k = read(fd, buf + n, cap - n - 1);
    if (k <= 0) {
      *eof = true;
      break;
    }
    n += (size_t)k;
  }
  buf[n] = '\0';
  return buf;
}

/* A daemon whose metrics.listen is a port free on 127.0.0.1: that port. */
static int mt_start(struct tu_daemon *d) {
  const int port = mt_free_port();
  char y[200];
  dw_sfmt(y, sizeof y, "metrics:\n  listen: 127.0.0.1:%d\n", port);
  dw_start(d, y);
  return port;
}

/* One HTTP exchange with the daemon's listener: the whole answer. */
static char *mt_http(int port, const char *request) {
  int fd = mt_tcp(port);
  ck_assert_int_eq(dw_send_all(fd, request, strlen(request)), 0);
  bool eof;
  char *got = mt_read_all(fd, 5000, &eof);
  ck_assert_msg(eof, "the listener did not close after answering: %s", got);
  close(fd);
  return got;
}

/* The sample lines' names and labels and the comment lines, values left out, one per line. */
static char *mt_exposition_shape(const char *text) {
  char *out = malloc(strlen(text) + 1), *o = out;
  for (const char *line = text; *line != '\0';) {
    const char *end = strchr(line, '\n');
    size_t len = end != NULL ? (size_t)(end - line) : strlen(line);
    size_t keep = len;
    if (line[0] != '#')
      while (keep > 0 && line[keep - 1] != ' ')
        keep--;
    memcpy(o, line, keep);
    o += keep;
    *o++ = '\n';
    line += len + (end != NULL);
  }
  *o = '\0';
  return out;
}

START_TEST(metrics_listen_serves_deepepctl_s_exposition_over_http) {
  struct tu_daemon d;
  const int port = mt_start(&d);
  char want[120];
  dw_sfmt(want, sizeof want, "metrics: serving the Prometheus exposition at "
          "http://127.0.0.1:%d/metrics", port);
  ck_assert_msg(dw_log_has(&d, want, 0), "%s", tu_daemon_log(&d));
  const struct st_plan plan = {.pairs = 10};
  struct st_rank r[ST_W];
  st_job_start(r, &d, "st-prom", &plan);
  char *got = mt_http(port, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n");
  ck_assert_msg(strncmp(got, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", got);
  ck_assert_msg(strstr(got, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"),
                "%s", got);
  char *body = strstr(got, "\r\n\r\n");
  ck_assert_ptr_nonnull(body);
  body += 4;
  const char *cl = strstr(got, "\r\nContent-Length: ");
  ck_assert_ptr_nonnull(cl);
  ck_assert_uint_eq(strtoul(cl + 18, NULL, 10), strlen(body));
  /* A real Prometheus parser reads it as it reads deepepctl's. */
  char *said = NULL;
  int rc = st_prometheus_parse(d.dir, "scraped.prom", body, &said);
  ck_assert_msg(rc == 0, "the Prometheus parser refused the scrape: %s\n--- scraped:\n%s", said,
                body);
  free(said);
  /* The very exposition deepepctl prints: the same families, samples and labels. */
  char *out = NULL;
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "metrics")), 0);
  char *a = mt_exposition_shape(body), *b = mt_exposition_shape(out);
  ck_assert_msg(strcmp(a, b) == 0, "--- scraped:\n%s\n--- deepepctl metrics:\n%s", body, out);
  free(a), free(b), free(out), free(got);
  /* A query string is the scraper's business. */
  got = mt_http(port, "GET /metrics?name[]=x HTTP/1.0\r\n\r\n");
  ck_assert_msg(strncmp(got, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", got);
  free(got);
  st_job_end(r, false);
  dw_stop_ok(&d);
}
END_TEST

/* The first sample whose name and labels an earlier sample had already (malloc'd), or NULL. */
static char *mt_duplicate_series(const char *text) {
  char *shape = mt_exposition_shape(text);
  char *dup = NULL;
  for (char *line = shape; *line != '\0' && dup == NULL;) {
    char *end = strchr(line, '\n');
    size_t len = (size_t)(end - line);
    for (char *o = shape; o < line && line[0] != '#' && dup == NULL;) {
      char *oend = strchr(o, '\n');
      if ((size_t)(oend - o) == len && memcmp(o, line, len) == 0)
        dup = strndup(line, len);
      o = oend + 1;
    }
    line = end + 1;
  }
  free(shape);
  return dup;
}

/* The samples of family `name` (no suffix) that carry every label of `labels` (`a="x"`
 * pieces; the values here have no comma): how many, and the last one's value in *value. */
static unsigned mt_samples(const char *text, const char *name, const char *const *labels,
                           double *value) {
  unsigned n = 0;
  size_t nl = strlen(name);
  for (const char *line = text; *line != '\0';) {
    const char *end = strchr(line, '\n');
    size_t len = end != NULL ? (size_t)(end - line) : strlen(line);
    const char *close = memchr(line, '}', len);
    if (len > nl && strncmp(line, name, nl) == 0 && line[nl] == '{' && close != NULL) {
      /* ",a=\"x\",b=\"y\",": each label between two commas. */
      char set[600];
      dw_sfmt(set, sizeof set, ",%.*s,", (int)(close - line - nl - 1), line + nl + 1);
      bool match = true;
      for (size_t i = 0; match && labels[i] != NULL; i++) {
        char want[200];
        dw_sfmt(want, sizeof want, ",%s,", labels[i]);
        match = strstr(set, want) != NULL;
      }
      if (match) {
        n++;
        *value = strtod(close + 1, NULL);
      }
    }
    line += len + (end != NULL);
  }
  return n;
}

/* deepepctl's exposition and the listener's name each series once, and the dispatch calls of
 * each rank of job st-again are the `calls` of the run expected. */
static void mt_check_latest_run(const struct tu_daemon *d, int port, double calls) {
  char *out = NULL;
  ck_assert_int_eq(st_ctl(d->dir, &out, DW_ARGS("-s", d->sock, "metrics")), 0);
  char *got = mt_http(port, "GET /metrics HTTP/1.0\r\n\r\n");
  char *body = strstr(got, "\r\n\r\n");
  ck_assert_ptr_nonnull(body);
  const char *texts[] = {out, body + 4};
  for (size_t i = 0; i < 2; i++) {
    char *dup = mt_duplicate_series(texts[i]);
    ck_assert_msg(dup == NULL, "series %s appears twice in:\n%.2000s", dup, texts[i]);
    for (unsigned rank = 0; rank < ST_W; rank++) {
      char rl[40];
      dw_sfmt(rl, sizeof rl, "rank=\"%u\"", rank);
      const char *labels[] = {"ep_job=\"st-again\"", rl, "op=\"dispatch\"", NULL};
      double v = -1;
      ck_assert_msg(mt_samples(texts[i], "deepep_op_calls_total", labels, &v) == 1 && v == calls,
                    "rank %u: want one sample of %g calls in:\n%.2000s", rank, calls,
                    texts[i]);
    }
  }
  /* A real Prometheus parser, made to refuse a series named twice, reads it too. */
  char *said = NULL;
  int rc = st_prometheus_parse(d->dir, "again.prom", out, &said);
  ck_assert_msg(rc == 0, "the Prometheus parser refused it: %.1000s\n--- metrics:\n%.2000s", said,
                out);
  free(said);
  free(got);
  free(out);
}

/* Whether `deepepctl stats --json` shows job st-again with no rank running, within timeout_ms. */
static bool mt_runs_ended(const struct tu_daemon *d, int timeout_ms) {
  int64_t deadline = dw_now_ms() + timeout_ms;
  do {
    char *out = NULL;
    ck_assert_int_eq(st_ctl(d->dir, &out, DW_ARGS("-s", d->sock, "--json", "stats")), 0);
    bool ended = strstr(out, "\"state\":\"running\"") == NULL;
    free(out);
    if (ended)
      return true;
    dw_sleep_ms(50);
  } while (dw_now_ms() < deadline);
  return false;
}

START_TEST(a_job_id_run_again_names_each_series_once) {
  struct tu_daemon d;
  const int port = mt_start(&d);
  struct st_rank r[ST_W];
  /* A first run of job st-again, ended: the daemon keeps its figures. */
  const struct st_plan first = {.pairs = 4};
  st_job_start(r, &d, "st-again", &first);
  st_job_end(r, false);
  /* Run again under the same job id: its series are the ended run's, now the new run's (a
   * counter reset to Prometheus), never both. */
  const struct st_plan again = {.pairs = 10};
  st_job_start(r, &d, "st-again", &again);
  mt_check_latest_run(&d, port, 10);
  /* stats still shows both runs: only the exposition keeps to the latest. */
  char *out = NULL;
  ck_assert_int_eq(st_ctl(d.dir, &out, DW_ARGS("-s", d.sock, "stats", "st-again")), 0);
  ck_assert_msg(strstr(out, "ended") != NULL && strstr(out, "running") != NULL, "%s", out);
  free(out);
  /* Both ended: the one that ended last is the latest.  The daemon notices an end at its next
   * poll of the pages; 10 s is a ceiling for a loaded machine, not a wait. */
  st_job_end(r, false);
  ck_assert_msg(mt_runs_ended(&d, 10000), "the second run still shows as running after 10 s");
  mt_check_latest_run(&d, port, 10);
  dw_stop_ok(&d);
}
END_TEST

/* The number after "key": in JSON text (the first), or -1. */
static double mt_json_number(const char *json, const char *key) {
  char k[80];
  dw_sfmt(k, sizeof k, "\"%s\":", key);
  const char *p = strstr(json, k);
  return p != NULL ? strtod(p + strlen(k), NULL) : -1;
}

/* A job across two daemons over loopback: node 0's exposition has the data path's bytes and
 * frames to and from node 1 as `deepepctl peers` shows them (the metrics once had the control
 * link's bytes alone, a fraction of what the data path moved). */
START_TEST(the_data_paths_traffic_per_peer_is_in_the_metrics_as_peers_shows_it) {
  const struct xn_layout *L = &xn_layouts[0];
  ow_seed_init(5150);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &L->sc, L->sc.fp8);
  struct nodes ns;
  nodes_config_with(&ns, L->nodes, 20000, ", op_timeout_ms: 16000", "");
  nodes_start_all(&ns);
  struct xn_run run = {.d = d, .rounds = 2};
  struct xn_place spread;
  memset(&spread, 0, sizeof spread);
  xn_place(&spread, L->split, L->nodes);
  struct xn_result *res = xn_results(L->sc.world);
  xn_run_job(&ns, &spread, "mt-data", &run, res);
  static char peers[16384];
  xn_ctl_json(&ns, "peers", peers, sizeof peers);
  char *out = NULL;
  ck_assert_int_eq(st_ctl(ns.d[0].dir, &out, DW_ARGS("-s", ns.d[0].sock, "metrics")), 0);
  static const struct {
    const char *key, *family, *direction;
  } pairs[] = {
      {"data_bytes_out", "deepep_peer_data_bytes_total", "out"},
      {"data_bytes_in", "deepep_peer_data_bytes_total", "in"},
      {"data_frames_out", "deepep_peer_data_frames_total", "out"},
      {"data_frames_in", "deepep_peer_data_frames_total", "in"},
  };
  for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
    double want = mt_json_number(peers, pairs[i].key), got = -1;
    ck_assert_msg(want > 0, "peers shows no %s: %s", pairs[i].key, peers);
    char dir[40];
    dw_sfmt(dir, sizeof dir, "direction=\"%s\"", pairs[i].direction);
    const char *labels[] = {dir, NULL};
    ck_assert_msg(mt_samples(out, pairs[i].family, labels, &got) == 1 && got == want,
                  "%s{%s}: want %.0f (peers' %s) in:\n%.3000s", pairs[i].family, dir, want,
                  pairs[i].key, out);
  }
  /* What went as RDMA writes is a series of its own per peer, as peers says it: none here, where
   * the daemons have no RDMA device (tests/rdma/xnode2.sh sees them grow between guests). */
  static const struct {
    const char *key, *family;
  } rdma[] = {
      {"rdma_blocks_out", "deepep_peer_rdma_blocks_total"},
      {"rdma_writes_out", "deepep_peer_rdma_writes_total"},
      {"rdma_posts_out", "deepep_peer_rdma_posts_total"},
      {"rdma_bytes_out", "deepep_peer_rdma_bytes_total"},
  };
  for (size_t i = 0; i < sizeof rdma / sizeof rdma[0]; i++) {
    double want = mt_json_number(peers, rdma[i].key), got = -1;
    ck_assert_msg(want >= 0, "peers shows no %s: %s", rdma[i].key, peers);
    const char *labels[] = {NULL};
    ck_assert_msg(mt_samples(out, rdma[i].family, labels, &got) == 1 && got == want,
                  "%s: want %.0f (peers' %s) in:\n%.3000s", rdma[i].family, want, rdma[i].key,
                  out);
  }
  free(out);
  munmap(res, L->sc.world * sizeof *res);
  nodes_stop(&ns);
  ow_case_free(d);
  free(d);
}
END_TEST

START_TEST(metrics_listen_answers_anything_else_with_an_error_and_carries_on) {
  struct tu_daemon d;
  const int port = mt_start(&d);
  static const struct {
    const char *request, *status;
  } cases[] = {
      {"GET / HTTP/1.1\r\n\r\n", "HTTP/1.1 404 Not Found\r\n"},
      {"GET /metricsx HTTP/1.1\r\n\r\n", "HTTP/1.1 404 Not Found\r\n"},
      {"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", "HTTP/1.1 405 Method Not Allowed\r\n"},
      {"HEAD /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 405 Method Not Allowed\r\n"},
      {"hello\n\n", "HTTP/1.1 400 Bad Request\r\n"},
      {"GET /metrics SPDY/3\r\n\r\n", "HTTP/1.1 400 Bad Request\r\n"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *got = mt_http(port, cases[i].request);
    ck_assert_msg(strncmp(got, cases[i].status, strlen(cases[i].status)) == 0, "%s -> %s",
                  cases[i].request, got);
    if (strstr(cases[i].status, "405") != NULL)
      ck_assert_msg(strstr(got, "\r\nAllow: GET\r\n") != NULL, "%s", got);
    free(got);
  }
  /* Headers past the bound: refused without reading on. */
  char *big = malloc(6000);
  memset(big, 'a', 5999);
  big[5999] = '\0';
  memcpy(big, "GET /metrics HTTP/1.1\r\nX-Long: ", 31);
  int fd = mt_tcp(port);
  ck_assert_int_eq(dw_send_all(fd, big, 5000), 0);
  bool eof;
  char *got = mt_read_all(fd, 5000, &eof);
  ck_assert_msg(strncmp(got, "HTTP/1.1 431 ", 13) == 0, "%s", got);
  free(got);
  close(fd);
  free(big);
  /* A request sent a byte at a time is one request. */
  fd = mt_tcp(port);
  for (const char *p = "GET /metrics HTTP/1.1\n\n"; *p != '\0'; p++) {
    ck_assert_int_eq(dw_send_all(fd, p, 1), 0);
    dw_sleep_ms(2);
  }
  got = mt_read_all(fd, 5000, &eof);
  ck_assert_msg(strncmp(got, "HTTP/1.1 200 OK\r\n", 17) == 0 && eof, "%s", got);
  free(got);
  close(fd);
  /* The control socket never noticed. */
  char state[32];
  ck_assert_ptr_nonnull(tu_daemon_state(d.sock, state, sizeof state));
  ck_assert_str_eq(state, "ready");
  dw_stop_ok(&d);
}
END_TEST

/* Whether fd was closed with nothing said, within timeout_ms. */
static bool mt_closed_unanswered(int fd, int timeout_ms) {
  bool eof;
  char *got = mt_read_all(fd, timeout_ms, &eof);
  bool ok = eof && got[0] == '\0';
  free(got);
  return ok;
}

START_TEST(idle_connections_cannot_deny_a_scrape) {
  struct tu_daemon d;
  const int port = mt_start(&d);
  enum { HELD = 16 }; /* METRICS_HTTP_CONNS */
  int idle[HELD];
  int64_t t0 = dw_now_ms();
  for (int i = 0; i < HELD; i++)
    idle[i] = mt_tcp(port);
  /* Every slot is held by a connection that sent nothing; a scrape still gets through, and the
   * connection that has waited longest is the one closed for it. */
  char *got = mt_http(port, "GET /metrics HTTP/1.1\r\n\r\n");
  ck_assert_msg(strncmp(got, "HTTP/1.1 200 OK\r\n", 17) == 0, "the scrape got '%s'", got);
  free(got);
  ck_assert(dw_log_has(&d, "metrics: more than 16 connections at once", 2000));
  ck_assert_msg(mt_closed_unanswered(idle[0], 8000), "the oldest idle connection");
  close(idle[0]);
  /* The others are closed at the idle bound (5 s from their accept), not before; the ceiling
   * of 8 s leaves a loaded machine 3 s of slack. */
  for (int i = 1; i < HELD; i++) {
    ck_assert_msg(mt_closed_unanswered(idle[i], 8000), "idle connection %d", i);
    int64_t waited = dw_now_ms() - t0;
    ck_assert_msg(waited >= 4500 && waited < 8000, "idle connection %d closed after %lld ms", i,
                  (long long)waited);
    close(idle[i]);
  }
  /* Three times the slots in idle connections, opened at once, deny nothing either. */
  int flood[3 * HELD];
  for (int i = 0; i < 3 * HELD; i++)
    flood[i] = mt_tcp(port);
  got = mt_http(port, "GET /metrics HTTP/1.1\r\n\r\n");
  ck_assert_msg(strncmp(got, "HTTP/1.1 200 OK\r\n", 17) == 0, "the scrape got '%s'", got);
  free(got);
  for (int i = 0; i < 3 * HELD; i++)
    close(flood[i]);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(an_address_holding_the_slots_evicts_its_own_connections_first) {
  struct tu_daemon d;
  const int port = mt_start(&d);
  enum { HELD = 16 }; /* METRICS_HTTP_CONNS */
  /* A scraper's connection, the oldest of all, has not sent its request yet when another
   * address fills every slot and asks for one more. */
  int scraper = mt_tcp_from("127.0.0.1", port);
  int other[HELD];
  for (int i = 0; i < HELD; i++)
    other[i] = mt_tcp_from("127.0.0.2", port);
  /* The slot freed is the other address's oldest (closing the oldest of all would have taken
   * the scraper's)... */
  ck_assert_msg(mt_closed_unanswered(other[0], 8000), "the other address's oldest connection");
  /* ...and the scraper, asking within the idle bound of 5 s from its accept (the steps above
   * take milliseconds), is answered. */
  const char *req = "GET /metrics HTTP/1.1\r\n\r\n";
  ck_assert_int_eq(dw_send_all(scraper, req, strlen(req)), 0);
  bool eof;
  char *got = mt_read_all(scraper, 5000, &eof);
  ck_assert_msg(strncmp(got, "HTTP/1.1 200 OK\r\n", 17) == 0 && eof, "%s", got);
  free(got);
  close(scraper);
  for (int i = 0; i < HELD; i++)
    close(other[i]);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(a_metrics_port_already_taken_fails_the_start) {
  /* Off by default: a daemon of the plain test config serves no metrics. */
  struct tu_daemon d;
  dw_start(&d, NULL);
  ck_assert(!dw_log_has(&d, "metrics: serving", 0));
  dw_stop_ok(&d);
  int taken = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  ck_assert_int_eq(bind(taken, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(taken, 1), 0);
  ck_assert_int_eq(getsockname(taken, (struct sockaddr *)&sa, &len), 0);
  const int port = ntohs(sa.sin_port);
  char y[200], want[200];
  dw_sfmt(y, sizeof y, "metrics:\n  listen: 127.0.0.1:%d\n", port);
  char dir[200];
  tu_tmpdir(dir, sizeof dir);
  struct tu_daemon_opts o = {.wait = TU_WAIT_NONE};
  ck_assert_int_eq(tu_daemon_start_opts(&d, dir, y, &o), 0);
  int st = tu_daemon_wait_exit(&d, 10000);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "status 0x%x", st);
  dw_sfmt(want, sizeof want, "metrics.listen 127.0.0.1:%d: cannot listen there: address already "
          "in use; choose another port or address", port);
  ck_assert_msg(dw_log_has(&d, want, 0), "%s", tu_daemon_log(&d));
  close(taken);
  tu_daemon_cleanup(&d);
  tu_rmtree(dir);
}
END_TEST

Suite *metrics_suite(void);
Suite *metrics_suite(void) {
  Suite *s = suite_create("metrics");
  TCase *t = tcase_create("metrics.listen");
  tcase_set_timeout(t, 60);
  tcase_add_test(t, metrics_listen_serves_deepepctl_s_exposition_over_http);
  tcase_add_test(t, metrics_listen_answers_anything_else_with_an_error_and_carries_on);
  tcase_add_test(t, a_job_id_run_again_names_each_series_once);
  tcase_add_test(t, the_data_paths_traffic_per_peer_is_in_the_metrics_as_peers_shows_it);
  tcase_add_test(t, idle_connections_cannot_deny_a_scrape);
  tcase_add_test(t, an_address_holding_the_slots_evicts_its_own_connections_first);
  tcase_add_test(t, a_metrics_port_already_taken_fails_the_start);
  suite_add_tcase(s, t);
  return s;
}
