/*
 * handshake.c — the peer benchmark as a peer: from inside a node's network
 * namespace, posing as that node's daemon (its address, its listen port, the
 * shared key), it opens connections to the other node's deepepd and runs
 * the authenticated handshake (peerauth.c, the daemon's own code: HELLO,
 * AUTH with the HMAC, AUTH_OK) on each, all at once as the daemon's pool
 * does, so that TCP connect plus handshake is timed without the daemon's
 * retry tick.  Then it times KEEPALIVE round trips through the far daemon's
 * loop: one peer message each way, what a membership exchange costs on a
 * link that is already up.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../benchlib.h"
#include "peer_proto.h"
#include "peerauth.h"
#include "peers.h"
#include "proto.h"

#define HS_MAX_CONNS 64
#define HS_MAX_PINGS 1000
#define HS_TIMEOUT_MS 10000

struct hs_conn {
  int fd;
  bool connected, verified, acked;
  struct peerauth_hs hs;
  uint8_t buf[2 * (DEP_PROTO_HDR_LEN + DEP_PEER_HELLO_MAX) + 1024];
  size_t len;
  uint64_t pong; /* the stamp of the last KEEPALIVE answer */
};

/* What the child sends back. */
struct hs_result {
  int rc;
  char why[1024];
  double up_ms;
  double rtt_ms[HS_MAX_PINGS];
};

static uint8_t hs_key[PEERAUTH_KEY_MAX];
static size_t hs_keylen;
static const char *hs_self; /* the address we pose as: the HELLO's listen_address */

/* Send one peer message (already encoded in m) as a PEER frame; 0 or -1. */
static int send_peer(int fd, const struct proto_buf *m) {
  struct proto_buf f;
  proto_buf_init(&f);
  struct dep_msg_opaque o = {.data = m->data, .len = m->len};
  int rc = proto_frame_encode(&f, DEP_MSG_PEER, 0, 0, &o);
  size_t off = 0;
  while (rc == 0 && off < f.len) {
    ssize_t n = send(fd, f.data + off, f.len - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += (size_t)n;
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      struct pollfd p = {.fd = fd, .events = POLLOUT};
      poll(&p, 1, 100);
    } else {
      rc = -1;
    }
  }
  proto_buf_free(&f);
  return rc;
}

static int send_msg(int fd, const struct dep_peer_msg *m) {
  struct proto_buf b;
  proto_buf_init(&b);
  int rc = peer_proto_encode(&b, m);
  if (rc == 0)
    rc = send_peer(fd, &b);
  proto_buf_free(&b);
  return rc;
}

/* One peer message from the far end; 0, or -1 with why. */
static int on_msg(struct hs_conn *c, const uint8_t *body, size_t len, char *why, size_t wl) {
  struct dep_peer_msg m;
  char w[256];
  if (peer_proto_decode(body, len, &m, w, sizeof w) != 0) {
    snprintf(why, wl, "a peer message that does not decode: %s", w);
    return -1;
  }
  switch (m.type) {
  case DEP_PEER_HELLO: {
    peerauth_take(&c->hs, body, len);
    struct dep_peer_msg a = {.type = DEP_PEER_AUTH};
    peerauth_mac(&c->hs, a.u.auth.mac);
    return send_msg(c->fd, &a);
  }
  case DEP_PEER_AUTH:
    if (!peerauth_check(&c->hs, m.u.auth.mac)) {
      snprintf(why, wl, "the daemon's AUTH does not verify (another key?)");
      return -1;
    }
    c->verified = true;
    return send_msg(c->fd, &(struct dep_peer_msg){.type = DEP_PEER_AUTH_OK});
  case DEP_PEER_AUTH_OK:
    c->acked = true;
    return 0;
  case DEP_PEER_ERROR:
  case DEP_PEER_CLOSE:
    snprintf(why, wl, "the daemon refused: %s", m.u.error.message);
    return -1;
  case DEP_PEER_KEEPALIVE:
    if (m.u.keepalive.reply == 0) { /* the daemon's own ping: answer it */
      m.u.keepalive.reply = 1;
      return send_msg(c->fd, &m);
    }
    c->pong = m.u.keepalive.stamp;
    return 0;
  default:
    return 0;
  }
}

/* Read what is there and handle every whole frame; 0, or -1 with why. */
static int on_readable(struct hs_conn *c, char *why, size_t wl) {
  ssize_t n = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, 0);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
    snprintf(why, wl, "the daemon closed the connection%s%s", n < 0 ? ": " : "",
             n < 0 ? strerror(errno) : "");
    return -1;
  }
  if (n > 0)
    c->len += (size_t)n;
  while (c->len >= DEP_PROTO_HDR_LEN) {
    struct dep_frame_hdr h;
    char w[256];
    if (proto_hdr_decode(c->buf, sizeof c->buf - DEP_PROTO_HDR_LEN, &h, w, sizeof w) != 0) {
      snprintf(why, wl, "a bad frame from the daemon: %s", w);
      return -1;
    }
    size_t whole = DEP_PROTO_HDR_LEN + h.body_len;
    if (c->len < whole)
      break;
    if (h.type == DEP_MSG_PEER && on_msg(c, c->buf + DEP_PROTO_HDR_LEN, h.body_len, why, wl) != 0)
      return -1;
    memmove(c->buf, c->buf + whole, c->len - whole);
    c->len -= whole;
  }
  return 0;
}

static bool all_up(const struct hs_conn *c, int n) {
  for (int i = 0; i < n; i++)
    if (!c[i].verified || !c[i].acked)
      return false;
  return true;
}

/* Wait for events on the connections not up (or on c[0] alone: one = true). */
static int pump(struct hs_conn *c, int n, bool one, double deadline, char *why, size_t wl) {
  struct pollfd p[HS_MAX_CONNS];
  for (int i = 0; i < n; i++) {
    bool skip = one ? i > 0 : c[i].verified && c[i].acked;
    p[i] = (struct pollfd){.fd = skip ? -1 : c[i].fd, .events = c[i].connected ? POLLIN : POLLOUT};
  }
  int left = (int)(deadline - bench_now_ms());
  if (left <= 0) {
    snprintf(why, wl, "no answer within %d ms", HS_TIMEOUT_MS);
    return -1;
  }
  if (poll(p, (nfds_t)n, left) < 0 && errno != EINTR) {
    snprintf(why, wl, "poll: %s", strerror(errno));
    return -1;
  }
  for (int i = 0; i < n; i++) {
    if (p[i].fd < 0 || p[i].revents == 0)
      continue;
    if (!c[i].connected) {
      int err = 0;
      socklen_t el = sizeof err;
      getsockopt(c[i].fd, SOL_SOCKET, SO_ERROR, &err, &el);
      if (err != 0) {
        snprintf(why, wl, "connect: %s", strerror(err));
        return -1;
      }
      c[i].connected = true;
      /* The connector speaks first, as the daemon's own slots do. */
      struct proto_buf b;
      proto_buf_init(&b);
      int rc = peerauth_hello(&c[i].hs, "bench-peers", hs_self, PEER_PORT, &b);
      if (rc == 0)
        rc = send_peer(c[i].fd, &b);
      proto_buf_free(&b);
      if (rc != 0) {
        snprintf(why, wl, "cannot send HELLO: %s", dep_strerror(rc));
        return -1;
      }
      continue;
    }
    if (on_readable(&c[i], why, wl) != 0)
      return -1;
  }
  return 0;
}

static void hs_child(const char *key_path, const char *self_addr, const char *target, int conns,
                     int pings, struct hs_result *r) {
  if (sodium_init() < 0) {
    snprintf(r->why, sizeof r->why, "libsodium failed to initialise");
    return;
  }
  if (peerauth_key_load(key_path, hs_key, sizeof hs_key, &hs_keylen, r->why, sizeof r->why) != 0)
    return;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(PEER_PORT)};
  inet_pton(AF_INET, target, &sa.sin_addr);
  static struct hs_conn c[HS_MAX_CONNS];
  memset(c, 0, sizeof c);
  double t0 = bench_now_ms(), deadline = t0 + HS_TIMEOUT_MS;
  for (int i = 0; i < conns; i++) {
    c[i].hs = (struct peerauth_hs){.connector = true, .key = hs_key, .keylen = hs_keylen};
    c[i].fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(c[i].fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(c[i].fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno != EINPROGRESS) {
      snprintf(r->why, sizeof r->why, "connect to %s: %s", target, strerror(errno));
      return;
    }
  }
  hs_self = self_addr;
  while (!all_up(c, conns))
    if (pump(c, conns, false, deadline, r->why, sizeof r->why) != 0)
      return;
  r->up_ms = bench_now_ms() - t0;
  for (int k = 0; k < pings; k++) {
    struct dep_peer_msg m = {.type = DEP_PEER_KEEPALIVE};
    double t = bench_now_ms();
    m.u.keepalive.stamp = (uint64_t)(t * 1000.0);
    if (send_msg(c[0].fd, &m) != 0) {
      snprintf(r->why, sizeof r->why, "send KEEPALIVE: %s", strerror(errno));
      return;
    }
    while (c[0].pong != m.u.keepalive.stamp)
      if (pump(c, 1, true, bench_now_ms() + HS_TIMEOUT_MS, r->why, sizeof r->why) != 0)
        return;
    r->rtt_ms[k] = bench_now_ms() - t;
  }
  for (int i = 0; i < conns; i++)
    close(c[i].fd);
  r->rc = 0;
}

int handshake_measure(const char *ns, const char *key_path, const char *self_addr,
                      const char *target, int conns, int pings, double *up_ms, double *rtt_ms,
                      char *why, size_t whylen) {
  if (conns < 1 || conns > HS_MAX_CONNS || pings < 0 || pings > HS_MAX_PINGS) {
    snprintf(why, whylen, "%d connections, %d pings: out of range", conns, pings);
    return -1;
  }
  int p[2];
  if (pipe(p) != 0) {
    snprintf(why, whylen, "pipe: %s", strerror(errno));
    return -1;
  }
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    /* A child of its own: it enters the node's namespace, and exits with _exit
     * (never the parent's atexit, which would tear the nodes down). */
    static struct hs_result r;
    r.rc = -1;
    char path[64];
    snprintf(path, sizeof path, "/run/netns/%s", ns);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET) != 0)
      snprintf(r.why, sizeof r.why, "cannot enter %s: %s", path, strerror(errno));
    else
      hs_child(key_path, self_addr, target, conns, pings, &r);
    size_t off = 0;
    while (off < sizeof r) {
      ssize_t n = write(p[1], (char *)&r + off, sizeof r - off);
      if (n <= 0)
        _exit(1);
      off += (size_t)n;
    }
    _exit(0);
  }
  close(p[1]);
  static struct hs_result r;
  memset(&r, 0, sizeof r);
  size_t off = 0;
  while (pid > 0 && off < sizeof r) {
    ssize_t n = read(p[0], (char *)&r + off, sizeof r - off);
    if (n <= 0)
      break;
    off += (size_t)n;
  }
  close(p[0]);
  if (pid > 0)
    waitpid(pid, NULL, 0);
  if (off != sizeof r) {
    snprintf(why, whylen, "the handshake process died");
    return -1;
  }
  if (r.rc != 0) {
    snprintf(why, whylen, "%s", r.why);
    return -1;
  }
  *up_ms = r.up_ms;
  if (pings > 0)
    memcpy(rtt_ms, r.rtt_ms, sizeof *rtt_ms * (size_t)pings);
  return 0;
}
