/*
 * check_peers.c — the peer layer (daemon/peer.c, proto/peer_proto.c): the
 * codec and the handshake without sockets, the key file's rules, then real
 * daemons: two on 127.0.0.1 with different ports, and the same two in two
 * network namespaces joined by a veth pair (root only).
 */
#include <arpa/inet.h>
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemonwire.h"
#include "peer.h"
#include "peerauth.h"
#include "peer_proto.h"
#include "proto.h"
#include "rdmadrv.h"
#include "nodes.h"
#include "opsworld.h"
#include "testutil.h"
#include "xring.h"
#include "xnjob.h"

/* Linux's, which glibc's netinet/in.h does not name. */
#ifndef IP_BIND_ADDRESS_NO_PORT
#define IP_BIND_ADDRESS_NO_PORT 24
#endif

/* ---- codec ---------------------------------------------------------------- */

static void sample_msgs(struct dep_peer_msg m[6]) {
  memset(m, 0, 6 * sizeof m[0]);
  m[0].type = DEP_PEER_HELLO;
  m[0].u.hello.version = DEP_PEER_VERSION;
  snprintf(m[0].u.hello.node, sizeof m[0].u.hello.node, "node01");
  snprintf(m[0].u.hello.listen_address, sizeof m[0].u.hello.listen_address, "10.0.0.1");
  m[0].u.hello.listen_port = 7470;
  memset(m[0].u.hello.challenge, 0xab, sizeof m[0].u.hello.challenge);
  m[1].type = DEP_PEER_AUTH;
  memset(m[1].u.auth.mac, 0x5a, sizeof m[1].u.auth.mac);
  m[2].type = DEP_PEER_AUTH_OK;
  m[3].type = DEP_PEER_ERROR;
  m[3].u.error.code = DEP_ERR_PERMISSION;
  snprintf(m[3].u.error.message, sizeof m[3].u.error.message, "not a configured peer");
  m[4].type = DEP_PEER_KEEPALIVE;
  m[4].u.keepalive.reply = 1;
  m[4].u.keepalive.stamp = 0x0102030405060708ull;
  m[5].type = DEP_PEER_CLOSE;
  snprintf(m[5].u.error.message, sizeof m[5].u.error.message, "stopping");
}

START_TEST(every_peer_message_round_trips) {
  struct dep_peer_msg m[6];
  sample_msgs(m);
  for (int i = 0; i < 6; i++) {
    struct proto_buf b;
    proto_buf_init(&b);
    ck_assert_int_eq(peer_proto_encode(&b, &m[i]), 0);
    struct dep_peer_msg out;
    char why[256];
    ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), 0);
    ck_assert_uint_eq(out.type, m[i].type);
    ck_assert_mem_eq(&out.u, &m[i].u, sizeof out.u);
    proto_buf_free(&b);
  }
}
END_TEST

START_TEST(a_truncated_or_overlong_peer_message_is_refused) {
  struct dep_peer_msg m[6];
  sample_msgs(m);
  for (int i = 0; i < 6; i++) {
    struct proto_buf b;
    proto_buf_init(&b);
    ck_assert_int_eq(peer_proto_encode(&b, &m[i]), 0);
    struct dep_peer_msg out;
    for (size_t n = 0; n < b.len; n++)
      ck_assert_msg(peer_proto_decode(b.data, n, &out, NULL, 0) != 0, "%s cut to %zu bytes",
                    peer_proto_type_name(m[i].type), n);
    uint8_t longer[1024];
    memcpy(longer, b.data, b.len);
    longer[b.len] = 0;
    ck_assert_int_eq(peer_proto_decode(longer, b.len + 1, &out, NULL, 0), DEP_ERR_PROTOCOL);
    proto_buf_free(&b);
  }
}
END_TEST

START_TEST(magic_version_and_type_are_checked_in_that_order) {
  struct dep_peer_msg m = {.type = DEP_PEER_AUTH_OK}, out;
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(peer_proto_encode(&b, &m), 0);
  char why[256];
  b.data[6] = 99; /* a type from a newer daemon */
  ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), DEP_ERR_UNSUPPORTED);
  ck_assert_uint_eq(out.type, 99);
  b.data[4] = DEP_PEER_MIN_VERSION; /* the window's oldest is spoken */
  ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), DEP_ERR_UNSUPPORTED);
  b.data[4] = DEP_PEER_MIN_VERSION - 1; /* one below the window is not */
  ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), DEP_ERR_VERSION);
  b.data[4] = DEP_PEER_VERSION + 1; /* nor one above */
  ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), DEP_ERR_VERSION);
  char v[64];
  snprintf(v, sizeof v, "version %d; this deepepd speaks versions %d..%d", DEP_PEER_VERSION + 1,
           DEP_PEER_MIN_VERSION, DEP_PEER_VERSION);
  ck_assert_msg(strstr(why, v) != NULL, "why: %s", why);
  b.data[0] ^= 1; /* not the peer protocol at all */
  ck_assert_int_eq(peer_proto_decode(b.data, b.len, &out, why, sizeof why), DEP_ERR_PROTOCOL);
  ck_assert_ptr_nonnull(strstr(why, "magic"));
  proto_buf_free(&b);
  /* Encoders refuse what decoders would: a non-negative ERROR code, a bad reply flag. */
  struct dep_peer_msg e = {.type = DEP_PEER_ERROR};
  ck_assert_int_eq(peer_proto_encode(&b, &e), DEP_ERR_INVALID);
  struct dep_peer_msg k = {.type = DEP_PEER_KEEPALIVE, .u.keepalive.reply = 2};
  ck_assert_int_eq(peer_proto_encode(&b, &k), DEP_ERR_INVALID);
  ck_assert_uint_eq(b.len, 0);
  proto_buf_free(&b);
}
END_TEST

START_TEST(peers_ok_round_trips_and_a_cut_one_is_refused) {
  struct dep_msg_peer_info info[2];
  memset(info, 0, sizeof info);
  snprintf(info[0].address, sizeof info[0].address, "10.0.0.2:7470");
  snprintf(info[0].state, sizeof info[0].state, "up");
  info[0].conns_up = info[0].conns_total = 24;
  info[0].rtt_us = 123;
  snprintf(info[1].address, sizeof info[1].address, "10.0.0.3:7470");
  snprintf(info[1].state, sizeof info[1].state, "backoff");
  snprintf(info[1].last_error, sizeof info[1].last_error, "connection refused");
  info[1].backoff_ms = 800;
  struct dep_msg_peers m = {.auth = 1, .n_peers = 2, .peers = info};
  snprintf(m.node, sizeof m.node, "node01");
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(proto_encode_peers(&b, &m), 0);
  struct dep_msg_peers out;
  ck_assert_int_eq(proto_decode_peers(b.data, b.len, &out), 0);
  ck_assert_uint_eq(out.n_peers, 2);
  ck_assert_str_eq(out.peers[1].last_error, "connection refused");
  ck_assert_uint_eq(out.peers[0].rtt_us, 123);
  ck_assert_uint_eq(out.peers[1].backoff_ms, 800);
  proto_peers_free(&out);
  for (size_t n = 0; n < b.len; n++) {
    ck_assert_int_ne(proto_decode_peers(b.data, n, &out), 0);
    ck_assert_ptr_null(out.peers);
  }
  proto_buf_free(&b);
}
END_TEST

/* ---- the handshake, without sockets --------------------------------------- */

static const uint8_t key_a[] = "0123456789abcdef0123456789abcdef";
static const uint8_t key_b[] = "0123456789abcdef0123456789abcdeX";

/* Both ends' HELLOs exchanged: c is the connector, a the acceptor. */
static void hs_pair(struct peerauth_hs *c, const uint8_t *ck, struct peerauth_hs *a, const uint8_t *ak) {
  memset(c, 0, sizeof *c);
  memset(a, 0, sizeof *a);
  c->connector = true;
  c->key = ck;
  c->keylen = 32;
  a->key = ak;
  a->keylen = 32;
  struct proto_buf bc, ba;
  proto_buf_init(&bc);
  proto_buf_init(&ba);
  ck_assert_int_eq(peerauth_hello(c, "node01", "10.0.0.1", 7470, &bc), 0);
  ck_assert_int_eq(peerauth_hello(a, "node02", "10.0.0.2", 7470, &ba), 0);
  ck_assert_int_eq(peerauth_take(c, ba.data, ba.len), 0);
  ck_assert_int_eq(peerauth_take(a, bc.data, bc.len), 0);
  proto_buf_free(&bc);
  proto_buf_free(&ba);
}

START_TEST(the_same_key_authenticates_both_ways) {
  struct peerauth_hs c, a;
  hs_pair(&c, key_a, &a, key_a);
  uint8_t mc[DEP_PEER_MAC_LEN], ma[DEP_PEER_MAC_LEN];
  peerauth_mac(&c, mc);
  peerauth_mac(&a, ma);
  ck_assert(peerauth_check(&a, mc));
  ck_assert(peerauth_check(&c, ma));
  /* The two directions' answers differ, so neither can stand for the other. */
  ck_assert(memcmp(mc, ma, sizeof mc) != 0);
}
END_TEST

START_TEST(a_wrong_key_fails_authentication) {
  struct peerauth_hs c, a;
  hs_pair(&c, key_b, &a, key_a);
  uint8_t mc[DEP_PEER_MAC_LEN], ma[DEP_PEER_MAC_LEN];
  peerauth_mac(&c, mc);
  peerauth_mac(&a, ma);
  ck_assert(!peerauth_check(&a, mc));
  ck_assert(!peerauth_check(&c, ma));
}
END_TEST

START_TEST(a_reflected_answer_fails) {
  struct peerauth_hs c, a;
  hs_pair(&c, key_a, &a, key_a);
  uint8_t ma[DEP_PEER_MAC_LEN];
  peerauth_mac(&a, ma);
  /* The acceptor's own answer sent back to it. */
  ck_assert(!peerauth_check(&a, ma));
  /* An acceptor made to echo the connector's HELLO as its own still answers as acceptor. */
  struct peerauth_hs mirror = a;
  memcpy(mirror.mine, c.mine, c.mine_len);
  mirror.mine_len = c.mine_len;
  memcpy(mirror.theirs, c.theirs, c.theirs_len);
  mirror.theirs_len = c.theirs_len;
  uint8_t mm[DEP_PEER_MAC_LEN];
  peerauth_mac(&mirror, mm);
  ck_assert(!peerauth_check(&a, mm));
}
END_TEST

START_TEST(a_replayed_answer_fails) {
  struct peerauth_hs c1, a1, c2, a2;
  hs_pair(&c1, key_a, &a1, key_a);
  uint8_t old[DEP_PEER_MAC_LEN];
  peerauth_mac(&c1, old);
  ck_assert(peerauth_check(&a1, old));
  /* A new connection has new challenges: yesterday's answer does not fit. */
  hs_pair(&c2, key_a, &a2, key_a);
  ck_assert(!peerauth_check(&a2, old));
}
END_TEST

/* ---- the key file ------------------------------------------------------------ */

START_TEST(the_key_file_must_be_private_and_long_enough) {
  char dir[256], path[300], why[512];
  tu_tmpdir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/key", dir);
  uint8_t key[PEERAUTH_KEY_MAX];
  size_t len = 0;
  ck_assert_int_eq(tu_write_file(path, "0123456789abcdef0123456789abcdef\n"), 0);
  chmod(path, 0644);
  ck_assert_int_eq(peerauth_key_load(path, key, sizeof key, &len, why, sizeof why),
                   DEP_ERR_PERMISSION);
  ck_assert_ptr_nonnull(strstr(why, "chmod 600"));
  chmod(path, 0600);
  ck_assert_int_eq(peerauth_key_load(path, key, sizeof key, &len, why, sizeof why), 0);
  ck_assert_uint_eq(len, 32); /* the trailing newline is not part of the key */
  ck_assert_int_eq(tu_write_file(path, "too short\n"), 0);
  chmod(path, 0600);
  ck_assert_int_eq(peerauth_key_load(path, key, sizeof key, &len, why, sizeof why), DEP_ERR_CONFIG);
  ck_assert_ptr_nonnull(strstr(why, "deepepctl genkey"));
  tu_rmtree(dir);
}
END_TEST

/* ---- real daemons ------------------------------------------------------------ */

/* Ports of this test process's daemons: apart from other runs' (fork mode, pids differ). */
/* Below the kernel's range for outbound ports (32768..60999 by default), so
 * that a connection of another test cannot hold the port, and above
 * check_multinode's (4000 + 8 * (pid % 2000)). */
static int port_base(void) { return 20000 + (int)(getpid() % 1500) * 8; }

static void write_key(const char *dir, const char *name, char *path, size_t len) {
  snprintf(path, len, "%s/%s", dir, name);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "%s genkey %s 2>/dev/null", tu_bin("deepepctl"), path);
  ck_assert_int_eq(system(cmd), 0);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0600);
}

/* The YAML of a daemon listening on addr:port with peers[] = (paddr, pport). */
static void peer_yaml(char *buf, size_t len, const char *addr, int port, const char *paddr,
                      int pport, const char *key) {
  snprintf(buf, len,
           "connection_pool_size: 3\nlisten: {address: %s, port: %d}\n"
           "peers: [{host: %s, port: %d}]\npeer_key_file: %s\npeer_wait_ms: 2000\n",
           addr, port, paddr, pport, key);
}

/* `deepepctl peers --json` on sock (prefixed by `pre`, e.g. "ip netns exec X"), into out. */
static int ctl_peers_json(const char *pre, const char *sock, char *out, size_t len) {
  char cmd[700];
  snprintf(cmd, sizeof cmd, "%s %s -s %s peers --json", pre, tu_bin("deepepctl"), sock);
  FILE *f = popen(cmd, "r");
  if (f == NULL)
    return -1;
  size_t n = fread(out, 1, len - 1, f);
  out[n] = '\0';
  return pclose(f);
}

/* Wait up to ms for sock's peers to show `want` (a JSON fragment). */
static bool wait_peers(const char *pre, const char *sock, const char *want, int ms, char *out,
                       size_t len) {
  for (int t = 0; t < ms; t += 100) {
    if (ctl_peers_json(pre, sock, out, len) == 0 && strstr(out, want) != NULL)
      return true;
    usleep(100 * 1000);
  }
  return false;
}

static bool log_has(const struct tu_daemon *d, const char *s) {
  char *log = tu_daemon_log(d);
  bool has = log != NULL && strstr(log, s) != NULL;
  free(log);
  return has;
}

START_TEST(two_daemons_bring_their_pools_up) {
  struct tu_daemon a, b;
  char dir[256], key[300], ya[1024], yb[1024], out[8192];
  tu_tmpdir(dir, sizeof dir);
  write_key(dir, "key", key, sizeof key);
  int pa = port_base(), pb = pa + 1;
  peer_yaml(ya, sizeof ya, "127.0.0.1", pa, "127.0.0.1", pb, key);
  peer_yaml(yb, sizeof yb, "127.0.0.1", pb, "127.0.0.1", pa, key);
  ck_assert_int_eq(tu_daemon_start(&a, ya), 0);
  ck_assert_int_eq(tu_daemon_start(&b, yb), 0);
  /* No RDMA device here: auto settles every link on TCP. */
  const char *up = "\"state\":\"up\",\"transport\":\"tcp\",\"wanted\":\"auto\",\"conns_up\":3,"
                   "\"conns_total\":3,\"qps_up\":0,\"inbound_up\":3";
  ck_assert_msg(wait_peers("", a.sock, up, 5000, out, sizeof out), "a: %s", out);
  ck_assert_msg(wait_peers("", b.sock, up, 5000, out, sizeof out), "b: %s", out);
  ck_assert_ptr_nonnull(strstr(out, "\"auth\":\"peer_key_file\""));
  /* Keep-alives answered: a round trip is measured. */
  bool rtt = false;
  for (int t = 0; t < 3000 && !rtt; t += 100) {
    rtt = ctl_peers_json("", b.sock, out, sizeof out) == 0 && strstr(out, "\"rtt_us\":0,") == NULL;
    if (!rtt)
      usleep(100 * 1000);
  }
  ck_assert_msg(rtt, "no round trip measured: %s", out);

  /* Kill a, start it again: b backs off, then reconnects. */
  kill(a.pid, SIGKILL);
  waitpid(a.pid, NULL, 0);
  ck_assert_msg(wait_peers("", b.sock, "\"state\":\"backoff\"", 3000, out, sizeof out), "%s",
                out);
  ck_assert_ptr_null(strstr(out, "\"last_error\":null"));
  ck_assert_int_eq(tu_daemon_start_in(&a, a.dir, ya), 0);
  ck_assert_msg(wait_peers("", b.sock, up, 8000, out, sizeof out), "after restart: %s", out);
  ck_assert_ptr_null(strstr(out, "\"reconnects\":0,"));
  tu_daemon_stop(&a);
  tu_daemon_stop(&b);
  tu_daemon_cleanup(&a);
  tu_daemon_cleanup(&b);
  tu_rmtree(dir);
}
END_TEST

/* The longest backoff sock's first peer waits out ("backoff_ms" of peers --json), or -1. */
static long peer_backoff_ms(const char *sock) {
  char out[8192];
  if (ctl_peers_json("", sock, out, sizeof out) != 0)
    return -1;
  const char *p = strstr(out, "\"backoff_ms\":");
  return p != NULL ? strtol(p + strlen("\"backoff_ms\":"), NULL, 10) : -1;
}

/*
 * A peer down at start that comes up later is up on both ends at once: the
 * end that waited in a backoff (doubling to 30 s) tries again as soon as the
 * peer reaches it, rather than at the end of that backoff, during which it
 * would tell the peer no job's membership.
 */
START_TEST(a_peer_that_comes_up_late_is_up_on_both_ends_at_once) {
  struct tu_daemon a, b;
  char dir[256], key[300], ya[1024], yb[1024], out[8192];
  tu_tmpdir(dir, sizeof dir);
  write_key(dir, "key", key, sizeof key);
  int pa = port_base() + 2, pb = pa + 1;
  peer_yaml(ya, sizeof ya, "127.0.0.1", pa, "127.0.0.1", pb, key);
  peer_yaml(yb, sizeof yb, "127.0.0.1", pb, "127.0.0.1", pa, key);
  ck_assert_int_eq(tu_daemon_start(&a, ya), 0);
  /* a has backed off long enough that a connection waits 8 s more. */
  long wait = -1;
  for (int t = 0; t < 40000 && (wait = peer_backoff_ms(a.sock)) < 8000; t += 100)
    usleep(100 * 1000);
  ck_assert_msg(wait >= 8000, "a's backoff never reached 8 s (%ld ms)", wait);
  ck_assert_int_eq(tu_daemon_start(&b, yb), 0);
  ck_assert_msg(wait_peers("", b.sock, "\"state\":\"up\"", 5000, out, sizeof out), "b: %s", out);
  ck_assert_msg(wait_peers("", a.sock, "\"state\":\"up\"", 2500, out, sizeof out),
                "a still backs off after b is up: %s", out);
  tu_daemon_stop(&a);
  tu_daemon_stop(&b);
  tu_daemon_cleanup(&a);
  tu_daemon_cleanup(&b);
  tu_rmtree(dir);
}
END_TEST

START_TEST(a_wrong_key_and_an_unlisted_peer_are_refused_and_logged) {
  struct tu_daemon a, b, c;
  char dir[256], key[300], key2[300], ya[1024], yb[1024], yc[1024], out[8192];
  tu_tmpdir(dir, sizeof dir);
  write_key(dir, "key", key, sizeof key);
  write_key(dir, "key2", key2, sizeof key2);
  int pa = port_base(), pb = pa + 1, pc = pa + 2;
  /* a and b are a pair; b holds another key; c lists a, but a does not list c. */
  peer_yaml(ya, sizeof ya, "127.0.0.1", pa, "127.0.0.1", pb, key);
  peer_yaml(yb, sizeof yb, "127.0.0.1", pb, "127.0.0.1", pa, key2);
  peer_yaml(yc, sizeof yc, "127.0.0.1", pc, "127.0.0.1", pa, key);
  ck_assert_int_eq(tu_daemon_start(&a, ya), 0);
  ck_assert_int_eq(tu_daemon_start(&b, yb), 0);
  ck_assert_int_eq(tu_daemon_start(&c, yc), 0);
  ck_assert_msg(wait_peers("", b.sock, "authentication failed", 5000, out, sizeof out), "%s",
                out);
  ck_assert_msg(wait_peers("", c.sock, "is not in this daemon's peers", 5000, out, sizeof out),
                "%s", out);
  ck_assert(log_has(&a, "authentication failed"));
  ck_assert(log_has(&a, "is not in this daemon's peers"));
  /* Nothing else is affected: a still answers its clients. */
  char state[32];
  ck_assert_ptr_nonnull(tu_daemon_state(a.sock, state, sizeof state));
  ck_assert_int_eq(ctl_peers_json("", a.sock, out, sizeof out), 0);
  ck_assert_ptr_nonnull(strstr(out, "\"conns_up\":0"));
  tu_daemon_stop(&a);
  tu_daemon_stop(&b);
  tu_daemon_stop(&c);
  tu_daemon_cleanup(&a);
  tu_daemon_cleanup(&b);
  tu_daemon_cleanup(&c);
  tu_rmtree(dir);
}
END_TEST

/* A daemon in a fresh dir with a key, listening on 127.0.0.1 at port_base()
 * for a peer on the next port that never comes. */
struct lone {
  struct tu_daemon d;
  char dir[256];
  int port;              /* its peer port */
  struct sockaddr_in sa; /* ... as an address */
};

static void lone_daemon_start(struct lone *l) {
  char key[300], ya[1024];
  tu_tmpdir(l->dir, sizeof l->dir);
  write_key(l->dir, "key", key, sizeof key);
  l->port = port_base();
  peer_yaml(ya, sizeof ya, "127.0.0.1", l->port, "127.0.0.1", l->port + 1, key);
  ck_assert_int_eq(tu_daemon_start(&l->d, ya), 0);
  l->sa = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons((uint16_t)l->port)};
  inet_pton(AF_INET, "127.0.0.1", &l->sa.sin_addr);
}

/* The daemon still answers on its socket; then stop it and remove its dir. */
static void lone_daemon_stop(struct lone *l) {
  char state[32];
  ck_assert_ptr_nonnull(tu_daemon_state(l->d.sock, state, sizeof state));
  tu_daemon_stop(&l->d);
  tu_daemon_cleanup(&l->d);
  tu_rmtree(l->dir);
}

START_TEST(random_bytes_on_the_peer_port_are_dropped) {
  struct lone l;
  lone_daemon_start(&l);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&l.sa, sizeof l.sa), 0);
  uint8_t junk[512];
  for (size_t i = 0; i < sizeof junk; i++)
    junk[i] = (uint8_t)(i * 131 + 7);
  ck_assert_int_eq(write(fd, junk, sizeof junk), (ssize_t)sizeof junk);
  /* The daemon answers with an ERROR frame at most and closes. */
  uint8_t buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) {
  }
  ck_assert_int_le(n, 0);
  close(fd);
  ck_assert(log_has(&l.d, "bad frame magic"));
  lone_daemon_stop(&l);
}
END_TEST

/* Connections that never authenticate are bounded (256 at once, all from
 * the one peer's address here): past that they are closed at once, counted
 * with the refusals of their address, and the daemon carries on. */
START_TEST(a_flood_of_silent_connections_is_bounded) {
  struct lone l;
  lone_daemon_start(&l);
  enum { N = 300 };
  static int fds[N];
  for (int i = 0; i < N; i++) {
    fds[i] = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(fds[i], 0);
    ck_assert_int_eq(connect(fds[i], (struct sockaddr *)&l.sa, sizeof l.sa), 0);
  }
  bool logged = false;
  for (int i = 0; i < 300 && !(logged = log_has(&l.d, "connections from its address (its share "
                                                           "of places) are still authenticating"));
       i++)
    usleep(10000);
  ck_assert(logged);
  /* The last ones were closed by the daemon: reading them ends at once. */
  struct timeval tv = {.tv_sec = 2};
  setsockopt(fds[N - 1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  uint8_t b;
  ck_assert_int_eq(read(fds[N - 1], &b, 1), 0);
  for (int i = 0; i < N; i++)
    close(fds[i]);
  lone_daemon_stop(&l);
}
END_TEST

/* ---- strangers on the peer port ------------------------------------------------ */

/* A socket bound to 127.0.0.<from> (any port), connecting to 127.0.0.1:port
 * (blocking unless nonblock): the fd, or -1.  Linux routes all of 127/8 to
 * lo, so 127.0.0.2 and up are addresses no daemon of these tests lists. */
static int connect_from(int from, int port, bool nonblock) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0);
  if (fd < 0)
    return -1;
  int one = 1;
  /* The port is picked at connect, per destination: a flood does not run out of them. */
  (void)setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
  struct sockaddr_in me = {.sin_family = AF_INET};
  struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  char a[32];
  snprintf(a, sizeof a, "127.0.0.%d", from);
  inet_pton(AF_INET, a, &me.sin_addr);
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (bind(fd, (struct sockaddr *)&me, sizeof me) != 0 ||
      (connect(fd, (struct sockaddr *)&to, sizeof to) != 0 && errno != EINPROGRESS)) {
    close(fd);
    return -1;
  }
  return fd;
}

/* A peer daemon's first frame on fd: HELLO as `node`, listening on listen_port. 0 or -1. */
static int send_hello(int fd, const char *node, int listen_port) {
  struct peerauth_hs hs = {.connector = true, .key = key_a, .keylen = 32};
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(peerauth_hello(&hs, node, "127.0.0.1", (uint16_t)listen_port, &b), 0);
  struct dep_msg_opaque o = {.data = b.data, .len = b.len};
  int rc = dw_send_frame(fd, DEP_MSG_PEER, 0, &o);
  proto_buf_free(&b);
  return rc;
}

/* Whether the daemon on port answers a HELLO from 127.0.0.<from> (as node,
 * listening on listen_port) with a HELLO of its own, as it does a peer it
 * knows until AUTH; the connection stays open in *out. */
static bool hello_answered(int from, int port, const char *node, int listen_port, int *out) {
  int fd = connect_from(from, port, false);
  if (fd < 0)
    return false;
  bool ok = false;
  struct dw_frame *f = dw_frame_new();
  struct dep_peer_msg m;
  if (send_hello(fd, node, listen_port) == 0 && dw_recv_frame(fd, f, 2000) == 0 &&
      f->h.type == DEP_MSG_PEER)
    ok = peer_proto_decode(f->body, f->h.body_len, &m, NULL, 0) == 0 && m.type == DEP_PEER_HELLO;
  free(f);
  if (ok)
    *out = fd;
  else
    close(fd);
  return ok;
}

/* Wait (up to 5 s: its peer's host resolves meanwhile) until the daemon on
 * port answers a HELLO from its peer's address; that connection's fd. */
static int hello_until_answered(int port, const char *node, int listen_port) {
  int fd = -1;
  for (int t = 0; t < 5000; t += 100) {
    if (hello_answered(1, port, node, listen_port, &fd))
      return fd;
    dw_sleep_ms(100);
  }
  ck_abort_msg("the daemon on port %d never answered a HELLO from its peer's address", port);
  return -1;
}

/* lone_daemon_start, then wait until it answers a HELLO from its peer's
 * address (as "node-x" on the next port): its peer's host has resolved. */
static void lone_daemon_start_resolved(struct lone *l) {
  lone_daemon_start(l);
  close(hello_until_answered(l->port, "node-x", l->port + 1));
}

static int count_lines(const char *s) {
  int n = 0;
  for (; s != NULL && *s != '\0'; s++)
    n += *s == '\n';
  return n;
}

static int log_lines(const struct tu_daemon *d) {
  char *log = tu_daemon_log(d);
  int n = count_lines(log);
  free(log);
  return n;
}

/*
 * Nothing a connection says before it authenticates is shown or used: a
 * HELLO from the peer's own address and port, naming itself "EVIL-NODE", is
 * answered (the daemon takes it for its peer until AUTH), yet neither
 * `deepepctl peers`, nor the error a rank of a job across the two nodes
 * gets, nor the log, shows that name.
 */
START_TEST(an_unauthenticated_hello_does_not_rename_the_peer) {
  char dir[256], key[300], y[1024], out[8192];
  tu_tmpdir(dir, sizeof dir);
  write_key(dir, "key", key, sizeof key);
  int pa = port_base(), pb = pa + 1;
  peer_yaml(y, sizeof y, "127.0.0.1", pa, "127.0.0.1", pb, key);
  snprintf(y + strlen(y), sizeof y - strlen(y), "limits: {attach_timeout_ms: 1000}\n");
  struct tu_daemon a;
  ck_assert_int_eq(tu_daemon_start(&a, y), 0);
  int evil = hello_until_answered(pa, "EVIL-NODE", pb);
  ck_assert_int_eq(ctl_peers_json("", a.sock, out, sizeof out), 0);
  ck_assert_msg(strstr(out, "EVIL") == NULL,
                "deepepctl peers shows what an unauthenticated connection said: %s", out);
  /* A rank of a job over two nodes: its timeout names the peer that is not up. */
  int fd = dw_client(&a);
  struct dep_attach_args args = dw_job_args("evil-hello", 0, 1);
  args.world_size = 2;
  dw_attach(fd, &args, 1);
  char msg[DEP_MSG_TEXT_MAX], want[64];
  dw_expect_error(fd, DEP_ERR_TIMEOUT, msg, sizeof msg);
  snprintf(want, sizeof want, "not up: 127.0.0.1:%d", pb);
  ck_assert_msg(strstr(msg, want) != NULL, "%s", msg);
  ck_assert_msg(strstr(msg, "EVIL") == NULL,
                "a rank is told what an unauthenticated connection said: %s", msg);
  close(fd);
  close(evil);
  ck_assert(!log_has(&a, "EVIL"));
  tu_daemon_stop(&a);
  tu_daemon_cleanup(&a);
  tu_rmtree(dir);
}
END_TEST

/* A HELLO from the peer's address saying peer protocol version v in its
 * header, or in its body's version field (in_body): the ERROR the daemon
 * answers (its message in msg), or -1 when none comes. */
static int hello_version_refusal(int port, int listen_port, uint16_t v, bool in_body, char *msg,
                                 size_t len) {
  int fd = connect_from(1, port, false);
  if (fd < 0)
    return -1;
  struct peerauth_hs hs = {.connector = true, .key = key_a, .keylen = 32};
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(peerauth_hello(&hs, "oldnode", "127.0.0.1", (uint16_t)listen_port, &b), 0);
  size_t at = in_body ? DEP_PEER_HDR_LEN : 4; /* HELLO's u32 version, or the header's u16 */
  b.data[at] = (uint8_t)v;
  b.data[at + 1] = (uint8_t)(v >> 8);
  struct dep_msg_opaque o = {.data = b.data, .len = b.len};
  int code = -1;
  struct dw_frame *f = dw_frame_new();
  struct dep_peer_msg m;
  if (dw_send_frame(fd, DEP_MSG_PEER, 0, &o) == 0 && dw_recv_frame(fd, f, 2000) == 0 &&
      f->h.type == DEP_MSG_PEER &&
      peer_proto_decode(f->body, f->h.body_len, &m, NULL, 0) == 0 && m.type == DEP_PEER_ERROR) {
    code = m.u.error.code;
    snprintf(msg, len, "%s", m.u.error.message);
    dw_expect_eof(fd);
  }
  free(f);
  proto_buf_free(&b);
  close(fd);
  return code;
}

/* A peer below or above the peer protocol's window is refused at its
 * HELLO with the window and its own version named. */
START_TEST(a_peer_outside_the_version_window_is_told_both) {
  struct lone l;
  lone_daemon_start(&l);
  int pa = l.port;
  const uint16_t outside[] = {DEP_PEER_MIN_VERSION - 1, DEP_PEER_VERSION + 1};
  for (int i = 0; i < 4; i++) {
    char msg[DEP_MSG_TEXT_MAX] = "", want[96];
    int code = -1;
    /* 5 s: the daemon resolves its peer's host (which admits the address) meanwhile. */
    for (int t = 0; t < 5000 && code != DEP_ERR_VERSION; t += 100) {
      code = hello_version_refusal(pa, pa + 1, outside[i % 2], i >= 2, msg, sizeof msg);
      if (code != DEP_ERR_VERSION)
        dw_sleep_ms(100);
    }
    ck_assert_msg(code == DEP_ERR_VERSION, "HELLO of version %u: code %d, \"%s\"",
                  (unsigned)outside[i % 2], code, msg);
    dw_sfmt(want, sizeof want, "peer protocol version %u;", (unsigned)outside[i % 2]);
    ck_assert_msg(strstr(msg, want) != NULL, "\"%s\" lacks \"%s\"", msg, want);
    dw_sfmt(want, sizeof want, "speaks versions %d..%d", DEP_PEER_MIN_VERSION, DEP_PEER_VERSION);
    ck_assert_msg(strstr(msg, want) != NULL, "\"%s\" lacks \"%s\"", msg, want);
  }
  lone_daemon_stop(&l);
}
END_TEST

/*
 * Refusals are counted per source address, not logged one by one: 2000
 * HELLOs from the peer's address naming a listen port no peer has (each
 * with a 63-character node name), 500 from an address that is no peer's,
 * and 20 connections that never speak make a few lines, and the name the
 * far end chose is never logged.
 */
START_TEST(refused_connections_are_logged_as_counts_per_source) {
  struct lone l;
  lone_daemon_start_resolved(&l);
  int pa = l.port;
  int before = log_lines(&l.d);
  char name[64];
  memset(name, 'Z', 63);
  name[63] = '\0';
  memcpy(name, "flood-", 6);
  for (int round = 0; round < 25; round++) {
    int fds[100];
    for (int i = 0; i < 100; i++) {
      fds[i] = connect_from(round < 20 ? 1 : 2, pa, false);
      if (fds[i] >= 0)
        (void)send_hello(fds[i], name, pa + 7); /* the far end may have closed it: refused */
    }
    for (int i = 0; i < 100; i++)
      if (fds[i] >= 0)
        close(fds[i]);
  }
  /* Twenty that never speak: the daemon closes them after its handshake timeout. */
  int idle[20];
  for (int i = 0; i < 20; i++)
    ck_assert_int_ge(idle[i] = connect_from(1, pa, false), 0);
  for (int i = 0; i < 20; i++) {
    struct timeval tv = {.tv_sec = 20}; /* four times the handshake timeout */
    setsockopt(idle[i], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    uint8_t b;
    ssize_t n = read(idle[i], &b, 1);
    ck_assert_msg(n == 0 || (n < 0 && errno == ECONNRESET), "idle connection %d: read %zd (%s)",
                  i, n, n < 0 ? strerror(errno) : "data");
    close(idle[i]);
  }
  /* Each kind of refusal said once per source (7 kinds, 2 sources), a count
   * per source per 10 s for the at most 30 s this takes (3 each), and 4
   * for anything else the daemon says meanwhile; the old code said one
   * line per connection (over 2000). */
  const int most = 2 * (7 + 3) + 4;
  int lines = log_lines(&l.d) - before;
  ck_assert_msg(lines <= most, "%d log lines for 2520 refused connections", lines);
  /* The count of the first interval (10 s) comes in one line. */
  ck_assert(dw_log_has(&l.d, "more connections from 127.0.0.1 in the last", 20000));
  lines = log_lines(&l.d) - before;
  char *log = tu_daemon_log(&l.d);
  ck_assert_msg(lines <= most, "%d log lines for the refusals:\n%s", lines, log);
  ck_assert_msg(strstr(log, "ZZZZZZZZ") == NULL, "the far end's node name is logged:\n%s", log);
  free(log);
  ck_assert(log_has(&l.d, "not a configured peer's listen port"));
  ck_assert(log_has(&l.d, "from 127.0.0.2: not the address of a configured peer"));
  lone_daemon_stop(&l);
}
END_TEST

/*
 * Idle connections from a peer's own address cannot hold its places: with
 * its share full (256, its one peer's), a new connection from it is
 * refused while the idle ones are younger than a second, and then takes
 * the place of the oldest, which the daemon closes (the old code kept them
 * all for its whole handshake timeout).
 */
START_TEST(idle_connections_from_a_peers_address_give_way_to_newer_ones) {
  struct lone l;
  lone_daemon_start_resolved(&l);
  int pa = l.port;
  static int fds[256];
  for (int i = 0; i < 256; i++)
    ck_assert_int_ge(fds[i] = connect_from(1, pa, false), 0);
  /* A newcomer speaking as the peer is answered once an idle one gave way:
   * 20 s is four times the handshake timeout. */
  int fd = -1;
  bool answered = false;
  for (int64_t t0 = dw_now_ms(); !answered && dw_now_ms() - t0 < 20000;)
    if (!(answered = hello_answered(1, pa, "node-x", pa + 1, &fd)))
      dw_sleep_ms(100);
  ck_assert_msg(answered, "no new connection from the peer's address was taken");
  ck_assert(dw_log_has(&l.d, "when a newer connection needed its place", 5000));
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fds[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  uint8_t b;
  ck_assert_int_le(read(fds[0], &b, 1), 0); /* the oldest was closed */
  close(fd);
  for (int i = 0; i < 256; i++)
    close(fds[i]);
  lone_daemon_stop(&l);
}
END_TEST

/*
 * A process that holds per_port connections to each of ports[] on
 * 127.0.0.1, from 127.0.0.2 .. 127.0.0.9 (addresses no daemon lists), and
 * opens a new one for each that is closed, until it is killed (or its
 * parent dies).  *opened (shared memory) counts what it opened.  Returns
 * once the first ones are open.
 */
static pid_t flood_start(const int *ports, int nports, int per_port, uint64_t *opened) {
  int p[2];
  ck_assert_int_eq(pipe(p), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(p[0]);
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    int n = nports * per_port;
    struct pollfd *pf = calloc((size_t)n, sizeof *pf);
    for (int i = 0; i < n; i++) {
      pf[i].fd = connect_from(2 + i % 8, ports[i % nports], true);
      pf[i].events = POLLIN;
      __atomic_add_fetch(opened, 1, __ATOMIC_RELAXED);
    }
    (void)write(p[1], "x", 1);
    close(p[1]);
    for (;;) {
      (void)poll(pf, (nfds_t)n, 100);
      bool reopened = false;
      for (int i = 0; i < n; i++) {
        if (pf[i].fd >= 0 && pf[i].revents == 0)
          continue;
        if (pf[i].fd >= 0) {
          char b[256];
          ssize_t k = recv(pf[i].fd, b, sizeof b, MSG_DONTWAIT);
          if (k > 0 || (k < 0 && errno == EAGAIN))
            continue; /* the daemon said something: still open */
          close(pf[i].fd);
        }
        pf[i].fd = connect_from(2 + i % 8, ports[i % nports], true);
        __atomic_add_fetch(opened, 1, __ATOMIC_RELAXED);
        reopened = true;
      }
      if (reopened)
        usleep(1000); /* a daemon that is down refuses at once: no spinning on it */
    }
  }
  close(p[1]);
  char c;
  ck_assert_int_eq(read(p[0], &c, 1), 1);
  close(p[0]);
  return pid;
}

/*
 * A flood of connections from addresses that are no configured peer's does
 * not keep the peers from linking again: 300 idle connections to each
 * daemon's peer port, each one the daemon closes opened again at once
 * (with 256 places for connections still authenticating, shared by all,
 * the old code let them hold every place, and a restarted daemon's peers
 * stayed down for the whole flood).  One daemon is killed and started
 * again during the flood; the links come back and a job over the two
 * nodes attaches and runs.
 */
START_TEST(a_flood_from_strangers_does_not_keep_a_restarted_peer_out) {
  ow_seed_init(91);
  const struct xn_layout *L = &xn_layouts[0];
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &L->sc, L->sc.fp8);
  struct nodes ns;
  nodes_config(&ns, 2, 20000);
  nodes_start_all(&ns);
  uint64_t *opened = mmap(NULL, sizeof *opened, PROT_READ | PROT_WRITE,
                          MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert(opened != MAP_FAILED);
  *opened = 0;
  pid_t flood = flood_start(ns.port, 2, 300, opened);
  /* In full swing first: every connection refused and opened again ten times over. */
  for (int64_t t0 = dw_now_ms(); __atomic_load_n(opened, __ATOMIC_RELAXED) < 10 * 600 &&
                                 dw_now_ms() - t0 < 20000;)
    dw_sleep_ms(10);
  kill(ns.d[1].pid, SIGKILL);
  waitpid(ns.d[1].pid, NULL, 0);
  node_start(&ns, 1);
  /* Without the flood they are back within 3 s; ten times that on a loaded machine. */
  bool up = false;
  for (int64_t t0 = dw_now_ms(); dw_now_ms() - t0 < 30000;) {
    if ((up = node_sees_all(&ns, 0) && node_sees_all(&ns, 1)))
      break;
    dw_sleep_ms(100);
  }
  if (!up) {
    char out[8192];
    xn_ctl_json_at(&ns, 1, "peers", out, sizeof out);
    kill(flood, SIGKILL);
    waitpid(flood, NULL, 0);
    ck_abort_msg("the peers did not link again within 30 s of a restart under a flood of %llu "
                 "connections: %s", (unsigned long long)*opened, out);
  }
  struct xn_place spread;
  memset(&spread, 0, sizeof spread);
  xn_place(&spread, L->split, L->nodes);
  struct xn_result *res = xn_results(L->sc.world);
  struct xn_run run = {.d = d, .rounds = 2};
  xn_run_job(&ns, &spread, "under-flood", &run, res);
  kill(flood, SIGKILL);
  waitpid(flood, NULL, 0);
  printf("peers: linked again and ran a job across 2 nodes under a flood of %llu connections\n",
         (unsigned long long)*opened);
  munmap(res, L->sc.world * sizeof *res);
  munmap(opened, sizeof *opened);
  nodes_stop(&ns);
  ow_case_free(d);
  free(d);
}
END_TEST

/* Start deepepd with yaml in dir/sub and expect it to refuse to start (exit non-zero). */
static void expect_refused_start(struct tu_daemon *d, const char *dir, const char *sub,
                                 const char *yaml) {
  char path[300];
  snprintf(path, sizeof path, "%s/%s", dir, sub);
  ck_assert_int_eq(mkdir(path, 0700), 0);
  struct tu_daemon_opts o = {.wait = TU_WAIT_NONE};
  ck_assert_int_eq(tu_daemon_start_opts(d, path, yaml, &o), 0);
  int st = tu_daemon_wait_exit(d, 10000);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0);
}

START_TEST(a_daemon_refuses_to_start_with_a_readable_key_or_none) {
  char dir[256], key[300], y[1024];
  tu_tmpdir(dir, sizeof dir);
  write_key(dir, "key", key, sizeof key);
  chmod(key, 0640);
  int pa = port_base();
  peer_yaml(y, sizeof y, "127.0.0.1", pa, "127.0.0.1", pa + 1, key);
  struct tu_daemon a;
  expect_refused_start(&a, dir, "a", y);
  ck_assert(log_has(&a, "chmod 600"));
  /* No key at all, with peers: refused unless peer_insecure. */
  snprintf(y, sizeof y, "listen: {address: 127.0.0.1, port: %d}\n", pa);
  expect_refused_start(&a, dir, "b", y);
  ck_assert(log_has(&a, "peer_insecure"));
  tu_rmtree(dir);
}
END_TEST

START_TEST(the_transport_is_chosen_per_peer_and_rdma_is_never_silently_tcp) {
  char dir[256], key[300], ya[1024], yb[1024], out[8192];
  tu_tmpdir(dir, sizeof dir);
  write_key(dir, "key", key, sizeof key);
  int pa = port_base(), pb = pa + 1;
  /* a names tcp for b; b says nothing (auto): both settle on TCP, and say what was wanted. */
  snprintf(ya, sizeof ya,
           "connection_pool_size: 2\nlisten: {address: 127.0.0.1, port: %d}\n"
           "peers: [{host: 127.0.0.1, port: %d, transport: tcp}]\npeer_key_file: %s\n",
           pa, pb, key);
  peer_yaml(yb, sizeof yb, "127.0.0.1", pb, "127.0.0.1", pa, key);
  struct tu_daemon a, b;
  ck_assert_int_eq(tu_daemon_start(&a, ya), 0);
  ck_assert_int_eq(tu_daemon_start(&b, yb), 0);
  ck_assert_msg(wait_peers("", a.sock, "\"transport\":\"tcp\",\"wanted\":\"tcp\",\"conns_up\":2",
                           5000, out, sizeof out), "a: %s", out);
  ck_assert_msg(wait_peers("", b.sock, "\"transport\":\"tcp\",\"wanted\":\"auto\",\"conns_up\":3",
                           5000, out, sizeof out), "b: %s", out);
  tu_daemon_stop(&a);
  tu_daemon_stop(&b);
  tu_daemon_cleanup(&a);
  tu_daemon_cleanup(&b);
  /* transport: rdma where no RDMA device can be had: deepepd does not start, and says why,
   * rather than carrying a job over TCP that its operator asked to keep off it. */
  if (rdmadrv_probe(NULL, 0) > 0) {
    tu_skip_part(__func__, "this machine has an RDMA device: the refusal needs one without");
  } else {
    char y[1024];
    snprintf(y, sizeof y, "transport: rdma\nlisten: {address: 127.0.0.1, port: %d}\n"
             "peers: [{host: 127.0.0.1, port: %d}]\npeer_key_file: %s\n", pa, pb, key);
    expect_refused_start(&a, dir, "r", y);
    ck_assert_msg(log_has(&a, "transport: rdma, but") && log_has(&a, "transport: auto"),
                  "the log does not say why");
    /* The same for one peer that asks for rdma of its own. */
    snprintf(y, sizeof y, "listen: {address: 127.0.0.1, port: %d}\n"
             "peers: [{host: 127.0.0.1, port: %d, transport: rdma}]\npeer_key_file: %s\n",
             pa, pb, key);
    expect_refused_start(&a, dir, "p", y);
    ck_assert(log_has(&a, "transport: rdma, but"));
  }
  tu_rmtree(dir);
}
END_TEST

/* ---- a fake authenticated peer (the test holds the key) ------------------------ */

/*
 * A real daemon whose one peer is this test: the test listens on the
 * peer's port, takes the daemon's link and answers its handshake with the
 * shared key (peerauth.h), as a peer daemon would, so that it speaks as an
 * authenticated peer: it reads the DATA_OFFERs the daemon makes and may
 * send its own, and opens data connections by hand.
 */
struct fp {
  struct tu_daemon d;
  char dir[256];
  int dport, fport;            /* the daemon's listen port, the fake peer's */
  int lfd, link;               /* the fake's listener; the daemon's link to it */
  uint8_t key[PEERAUTH_KEY_MAX];
  size_t keylen;
  char dnode[DEP_PEER_NODE_MAX]; /* the daemon's node, from its HELLO */
  uint8_t tok[8][DEP_PEER_TOKEN_LEN];
  int ntok;
};

/* One peer message as a PEER frame on fd. */
static void fp_send(int fd, const struct dep_peer_msg *m) {
  struct proto_buf inner, frame;
  proto_buf_init(&inner);
  proto_buf_init(&frame);
  ck_assert_int_eq(peer_proto_encode(&inner, m), 0);
  struct dep_msg_opaque o = {.data = inner.data, .len = inner.len};
  ck_assert_int_eq(proto_frame_encode(&frame, DEP_MSG_PEER, 0, 0, &o), 0);
  ck_assert_int_eq(dw_send_all(fd, frame.data, frame.len), 0);
  proto_buf_free(&inner);
  proto_buf_free(&frame);
}

/* The next peer message on fd within ms (its raw bytes in raw when not NULL): 0, or -1. */
static int fp_recv(int fd, struct dep_peer_msg *m, int ms, uint8_t *raw, size_t *rawlen) {
  static struct dw_frame f;
  if (dw_recv_frame(fd, &f, ms) != 0 || f.h.type != DEP_MSG_PEER)
    return -1;
  if (raw != NULL) {
    memcpy(raw, f.body, f.h.body_len);
    *rawlen = f.h.body_len;
  }
  return peer_proto_decode(f.body, f.h.body_len, m, NULL, 0) == 0 ? 0 : -1;
}

/* Read the daemon's link for ms, answering its keep-alives and keeping the
 * tokens it offers, until it has offered `want`. */
static void fp_pump(struct fp *f, int ms, int want) {
  const int64_t until = dw_now_ms() + ms;
  struct dep_peer_msg m;
  while (f->ntok < want && dw_now_ms() < until) {
    struct pollfd pf = {.fd = f->link, .events = POLLIN};
    if (poll(&pf, 1, 50) != 1)
      continue;
    ck_assert_int_eq(fp_recv(f->link, &m, 2000, NULL, NULL), 0);
    if (m.type == DEP_PEER_KEEPALIVE && m.u.keepalive.reply == 0) {
      m.u.keepalive.reply = 1;
      fp_send(f->link, &m);
    } else if (m.type == DEP_PEER_DATA_OFFER && f->ntok < 8) {
      memcpy(f->tok[f->ntok++], m.u.data_offer.token, DEP_PEER_TOKEN_LEN);
    }
  }
}

/* Start the daemon with the test as its one peer, and bring the link up. */
static void fp_start(struct fp *f) {
  memset(f, 0, sizeof *f);
  tu_tmpdir(f->dir, sizeof f->dir);
  char key[300], y[1024], why[256];
  write_key(f->dir, "key", key, sizeof key);
  ck_assert_int_eq(peerauth_key_load(key, f->key, sizeof f->key, &f->keylen, why, sizeof why), 0);
  f->dport = port_base() + 4;
  f->fport = f->dport + 1;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)f->fport)};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  f->lfd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(f->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  ck_assert_int_eq(bind(f->lfd, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(f->lfd, 4096), 0);
  snprintf(y, sizeof y,
           "connection_pool_size: 1\nlisten: {address: 127.0.0.1, port: %d}\n"
           "peers: [{host: 127.0.0.1, port: %d, transport: tcp}]\npeer_key_file: %s\n"
           "peer_wait_ms: 0\n", f->dport, f->fport, key);
  ck_assert_int_eq(tu_daemon_start(&f->d, y), 0);
  struct pollfd pf = {.fd = f->lfd, .events = POLLIN};
  ck_assert_int_eq(poll(&pf, 1, 10000), 1);
  f->link = accept(f->lfd, NULL, NULL);
  ck_assert_int_ge(f->link, 0);
  /* The acceptor's side of the handshake (peer.c): HELLO, AUTH, AUTH_OK, then XPORT tcp. */
  struct peerauth_hs hs = {.connector = false, .key = f->key, .keylen = f->keylen};
  struct dep_peer_msg m;
  uint8_t raw[DEP_PEER_HELLO_MAX];
  size_t rawlen = 0;
  ck_assert_int_eq(fp_recv(f->link, &m, 5000, raw, &rawlen), 0);
  ck_assert_uint_eq(m.type, DEP_PEER_HELLO);
  snprintf(f->dnode, sizeof f->dnode, "%s", m.u.hello.node);
  ck_assert_int_eq(peerauth_take(&hs, raw, rawlen), 0);
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(peerauth_hello(&hs, "fakepeer", "127.0.0.1", (uint16_t)f->fport, &b), 0);
  struct dep_msg_opaque o = {.data = b.data, .len = b.len};
  struct proto_buf frame;
  proto_buf_init(&frame);
  ck_assert_int_eq(proto_frame_encode(&frame, DEP_MSG_PEER, 0, 0, &o), 0);
  ck_assert_int_eq(dw_send_all(f->link, frame.data, frame.len), 0);
  proto_buf_free(&frame);
  proto_buf_free(&b);
  struct dep_peer_msg auth = {.type = DEP_PEER_AUTH};
  peerauth_mac(&hs, auth.u.auth.mac);
  fp_send(f->link, &auth);
  bool verified = false, acked = false;
  while (!verified || !acked) {
    ck_assert_int_eq(fp_recv(f->link, &m, 5000, NULL, NULL), 0);
    if (m.type == DEP_PEER_AUTH) {
      ck_assert(peerauth_check(&hs, m.u.auth.mac));
      verified = true;
      fp_send(f->link, &(struct dep_peer_msg){.type = DEP_PEER_AUTH_OK});
    } else {
      ck_assert_uint_eq(m.type, DEP_PEER_AUTH_OK);
      acked = true;
    }
  }
  struct dep_peer_msg x = {.type = DEP_PEER_XPORT};
  x.u.xport.kind = DEP_PEER_XPORT_TCP;
  snprintf(x.u.xport.reason, sizeof x.u.xport.reason, "transport: tcp here");
  fp_send(f->link, &x);
  /* The link is up: the daemon offers its data connection. */
  fp_pump(f, 10000, 1);
  ck_assert_msg(f->ntok >= 1, "the daemon offered no data connection");
}

static void fp_stop(struct fp *f) {
  char state[32];
  ck_assert_ptr_nonnull(tu_daemon_state(f->d.sock, state, sizeof state));
  tu_daemon_stop(&f->d);
  tu_daemon_cleanup(&f->d);
  close(f->link);
  close(f->lfd);
  tu_rmtree(f->dir);
}

/* Open a data connection to the daemon naming token as the fake peer
 * (DATA_HELLO), and read its challenge's nonce: the fd, or -1 when no
 * challenge of this data stream version comes. */
static int fp_data_open(const struct fp *f, const uint8_t *token,
                        uint8_t nonce[DEP_XFER_NONCE_LEN]) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)f->dport)};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  struct dep_peer_msg m = {.type = DEP_PEER_DATA_HELLO};
  memcpy(m.u.data_hello.token, token, DEP_PEER_TOKEN_LEN);
  m.u.data_hello.listen_port = (uint16_t)f->fport;
  fp_send(fd, &m);
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct dep_xfer_challenge ch;
  if (recv(fd, &ch, sizeof ch, MSG_WAITALL) != (ssize_t)sizeof ch || ch.magic != DEP_XFER_MAGIC ||
      ch.version != DEP_XFER_VERSION) {
    close(fd);
    return -1;
  }
  memcpy(nonce, ch.nonce, DEP_XFER_NONCE_LEN);
  return fd;
}

/* Answer a challenge with mac: whether the daemon acknowledges the
 * connection (else it closes it). */
static bool fp_data_prove(int fd, const uint8_t mac[DEP_XFER_MAC_LEN]) {
  ck_assert_int_eq(dw_send_all(fd, mac, DEP_XFER_MAC_LEN), 0);
  struct dep_xfer_ack ack;
  return recv(fd, &ack, sizeof ack, MSG_WAITALL) == (ssize_t)sizeof ack &&
         ack.magic == DEP_XFER_MAGIC && ack.version == DEP_XFER_VERSION;
}

/* The fake's link, answered from a thread of its own while a test does
 * something else: the daemon takes a link it hears nothing on for
 * PEER_DEAD_MS for a dead peer, and its offers with it. */
struct fp_answerer {
  struct fp *f;
  atomic_bool stop;
  pthread_t th;
};

static void *fp_answer(void *arg) {
  struct fp_answerer *a = arg;
  struct dep_peer_msg m;
  while (!atomic_load(&a->stop)) {
    struct pollfd pf = {.fd = a->f->link, .events = POLLIN};
    if (poll(&pf, 1, 50) != 1)
      continue;
    if (fp_recv(a->f->link, &m, 2000, NULL, NULL) != 0)
      break;
    if (m.type == DEP_PEER_KEEPALIVE && m.u.keepalive.reply == 0) {
      m.u.keepalive.reply = 1;
      fp_send(a->f->link, &m);
    }
  }
  return NULL;
}

/*
 * A data connection is opened by holding the key, not by having seen a
 * token: one that names a token the daemon offered but answers the
 * challenge without the key, or with a proof made for another
 * connection's challenge, is refused (and said), and the offer stays for
 * the peer that proves the key; once spent, the token opens nothing.
 * The peer's first connection only takes a challenge and a proof an
 * observer could see, and goes: the daemon waits XFER_CONNECT_MS for a
 * proof, which the refused connections in between may outlast on a loaded
 * machine, so the peer proves on a connection of its own afterwards.  The
 * link is answered meanwhile (fp_answer): a loaded machine may take longer
 * than PEER_DEAD_MS over the connections, and a link taken for dead takes
 * the offer with it.
 */
START_TEST(a_data_connection_must_prove_the_peer_key_not_just_name_a_token) {
  struct fp f;
  fp_start(&f);
  const uint8_t *tok = f.tok[0];
  struct fp_answerer ans = {.f = &f};
  atomic_init(&ans.stop, false);
  ck_assert_int_eq(pthread_create(&ans.th, NULL, fp_answer, &ans), 0);
  uint8_t dkey[DEP_PEER_MAC_LEN], n1[DEP_XFER_NONCE_LEN], n2[DEP_XFER_NONCE_LEN],
      n3[DEP_XFER_NONCE_LEN], mac1[DEP_XFER_MAC_LEN], wrong[DEP_XFER_MAC_LEN];
  peerauth_data_key(f.key, f.keylen, "fakepeer", f.dnode, dkey);
  /* A connection of the peer's takes a challenge; its proof is seen. */
  int c1 = fp_data_open(&f, tok, n1);
  ck_assert_msg(c1 >= 0, "no challenge: the token alone opened the data connection");
  peerauth_data_mac(dkey, n1, tok, mac1);
  close(c1);
  /* One that saw the token but has no key. */
  int c2 = fp_data_open(&f, tok, n2);
  ck_assert_int_ge(c2, 0);
  memset(wrong, 0x5a, sizeof wrong);
  ck_assert_msg(!fp_data_prove(c2, wrong), "a proof without the key was taken");
  /* One that replays the proof seen on the peer's connection. */
  int c3 = fp_data_open(&f, tok, n3);
  ck_assert_int_ge(c3, 0);
  ck_assert(memcmp(n1, n3, sizeof n1) != 0);
  ck_assert_msg(!fp_data_prove(c3, mac1), "a proof made for another challenge was taken");
  /* A proof made with the key for the wrong direction (as if the daemon opened it). */
  uint8_t back[DEP_PEER_MAC_LEN], mback[DEP_XFER_MAC_LEN], n4[DEP_XFER_NONCE_LEN];
  peerauth_data_key(f.key, f.keylen, f.dnode, "fakepeer", back);
  int c4 = fp_data_open(&f, tok, n4);
  ck_assert_int_ge(c4, 0);
  peerauth_data_mac(back, n4, tok, mback);
  ck_assert_msg(!fp_data_prove(c4, mback), "a proof for the other direction was taken");
  /* The offer is still the peer's: its proof opens the connection. */
  c1 = fp_data_open(&f, tok, n1);
  ck_assert_int_ge(c1, 0);
  peerauth_data_mac(dkey, n1, tok, mac1);
  const bool proven = fp_data_prove(c1, mac1);
  atomic_store(&ans.stop, true);
  pthread_join(ans.th, NULL);
  ck_assert_msg(proven, "the peer's own proof was refused");
  char out[8192];
  ck_assert_msg(wait_peers("", f.d.sock, "\"data_in\":1", 5000, out, sizeof out), "%s", out);
  ck_assert(log_has(&f.d, "did not prove the peer key are refused"));
  /* Spent: the token opens nothing more, whatever proof comes. */
  uint8_t n5[DEP_XFER_NONCE_LEN];
  ck_assert_int_lt(fp_data_open(&f, tok, n5), 0);
  close(c1);
  close(c2);
  close(c3);
  close(c4);
  fp_stop(&f);
}
END_TEST

/*
 * The socket of a data connection is the data path's from the DATA_HELLO
 * on: what the peer sends right behind that frame is the receiver's to
 * read, not the peer link's to discard as it closes.  Here a proof (a
 * wrong one) rides in the same write as the DATA_HELLO, so it is in the
 * socket before the link closes: the receiver must read it as the proof
 * and refuse it.  Before, the closing link drained it, and the receiver
 * waited XFER_CONNECT_MS for a proof that never came (under load, a real
 * peer's proof could be eaten the same way and its connection refused).
 */
START_TEST(bytes_right_behind_a_data_hello_reach_the_data_path) {
  struct fp f;
  fp_start(&f);
  struct proto_buf b;
  proto_buf_init(&b);
  struct dep_peer_msg m = {.type = DEP_PEER_DATA_HELLO};
  memcpy(m.u.data_hello.token, f.tok[0], DEP_PEER_TOKEN_LEN);
  m.u.data_hello.listen_port = (uint16_t)f.fport;
  struct proto_buf inner;
  proto_buf_init(&inner);
  ck_assert_int_eq(peer_proto_encode(&inner, &m), 0);
  struct dep_msg_opaque o = {.data = inner.data, .len = inner.len};
  ck_assert_int_eq(proto_frame_encode(&b, DEP_MSG_PEER, 0, 0, &o), 0);
  uint8_t out[1024];
  ck_assert_uint_le(b.len + DEP_XFER_MAC_LEN, sizeof out);
  memcpy(out, b.data, b.len);
  memset(out + b.len, 0x5a, DEP_XFER_MAC_LEN); /* a proof without the key */
  const size_t n = b.len + DEP_XFER_MAC_LEN;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)f.dport)};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(dw_send_all(fd, out, n), 0);
  proto_buf_free(&inner);
  proto_buf_free(&b);
  /* The challenge, then the refusal of that proof: no acknowledgement. */
  struct timeval tv = {.tv_sec = 10}; /* a ceiling: the old code's wait was 3 s */
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct dep_xfer_challenge ch;
  ck_assert_int_eq(recv(fd, &ch, sizeof ch, MSG_WAITALL), (ssize_t)sizeof ch);
  ck_assert_uint_eq(ch.magic, DEP_XFER_MAGIC);
  struct dep_xfer_ack ack;
  ck_assert_int_le(recv(fd, &ack, sizeof ack, MSG_WAITALL), 0);
  ck_assert_msg(dw_log_has(&f.d, "did not prove the peer key are refused", 5000),
                "the proof sent behind the DATA_HELLO was not read as one");
  ck_assert_msg(!log_has(&f.d, "no proof of the peer key came"),
                "the proof sent behind the DATA_HELLO was discarded");
  close(fd);
  fp_stop(&f);
}
END_TEST

/* The next message of type want on the fake's link within 5 s (a ceiling
 * for replies the daemon sends at once), answering keep-alives meanwhile;
 * -1 when none comes or the link closes. */
static int fp_expect(struct fp *f, uint16_t want, struct dep_peer_msg *m) {
  const int64_t until = dw_now_ms() + 5000;
  while (dw_now_ms() < until) {
    struct pollfd pf = {.fd = f->link, .events = POLLIN};
    if (poll(&pf, 1, 50) != 1)
      continue;
    if (fp_recv(f->link, m, 2000, NULL, NULL) != 0)
      return -1;
    if (m->type == want)
      return 0;
    if (m->type == DEP_PEER_KEEPALIVE && m->u.keepalive.reply == 0) {
      m->u.keepalive.reply = 1;
      fp_send(f->link, m);
    }
  }
  return -1;
}

/*
 * DESIGN §8, the peer protocol's rule: what an authenticated peer sends
 * that this deepepd does not know (a peer message type, or a control
 * frame type around it) leaves the link up: the peer message is answered
 * ERROR UNSUPPORTED, the frame ignored, each logged (at a bounded rate),
 * and the next known message is served on the same link.
 */
START_TEST(an_unknown_type_from_an_authenticated_peer_leaves_the_link_up) {
  struct fp f;
  fp_start(&f);
  /* A peer message of a type from a newer daemon, with a body. */
  struct proto_buf inner, frame;
  proto_buf_init(&inner);
  proto_buf_init(&frame);
  struct dep_peer_msg k = {.type = DEP_PEER_KEEPALIVE, .u.keepalive = {.reply = 1, .stamp = 1}};
  ck_assert_int_eq(peer_proto_encode(&inner, &k), 0);
  inner.data[6] = DEP_PEER_TYPE_MAX_ + 5;
  struct dep_msg_opaque o = {.data = inner.data, .len = inner.len};
  ck_assert_int_eq(proto_frame_encode(&frame, DEP_MSG_PEER, 0, 0, &o), 0);
  ck_assert_int_eq(dw_send_all(f.link, frame.data, frame.len), 0);
  struct dep_peer_msg m;
  ck_assert_msg(fp_expect(&f, DEP_PEER_ERROR, &m) == 0, "no ERROR for an unknown peer type");
  ck_assert_int_eq(m.u.error.code, DEP_ERR_UNSUPPORTED);
  /* A control frame of a type from a newer daemon around it: ignored. */
  frame.data[6] = (uint8_t)(DEP_MSG_TYPE_MAX_ + 5);
  frame.data[7] = 0;
  ck_assert_int_eq(dw_send_all(f.link, frame.data, frame.len), 0);
  proto_buf_free(&inner);
  proto_buf_free(&frame);
  /* The link still serves what it knows: a keep-alive is answered with its stamp. */
  struct dep_peer_msg ask = {.type = DEP_PEER_KEEPALIVE, .u.keepalive = {.stamp = 424242}};
  fp_send(f.link, &ask);
  bool answered = false;
  while (!answered && fp_expect(&f, DEP_PEER_KEEPALIVE, &m) == 0)
    answered = m.u.keepalive.reply == 1 && m.u.keepalive.stamp == 424242;
  ck_assert_msg(answered, "the keep-alive after the unknown frames was not answered");
  char out[8192];
  ck_assert_msg(wait_peers("", f.d.sock, "\"state\":\"up\"", 5000, out, sizeof out), "%s", out);
  ck_assert_msg(strstr(out, "\"reconnects\":0") != NULL, "the link was dropped: %s", out);
  ck_assert(log_has(&f.d, "sent peer message type"));
  ck_assert(log_has(&f.d, "which this deepepd does not know"));
  fp_stop(&f);
}
END_TEST

/* The daemon's threads now (/proc/PID/task). */
static int task_count(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL)
    return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

/*
 * An authenticated peer that sends thousands of DATA_OFFERs makes no more
 * threads here than the data connections it may have (one, with
 * connection_pool_size 1): each offer started a connector thread, which
 * waited seconds for a listener that never answers.  The excess is said
 * (at most every few seconds), and the link stays up.
 */
START_TEST(a_flood_of_data_offers_starts_a_bounded_number_of_threads) {
  struct fp f;
  fp_start(&f);
  const int before = task_count(f.d.pid);
  ck_assert_int_gt(before, 0);
  enum { N = 3000 };
  struct dep_peer_msg m = {.type = DEP_PEER_DATA_OFFER};
  int most = before;
  for (int i = 0; i < N; i++) {
    randombytes_buf(m.u.data_offer.token, sizeof m.u.data_offer.token);
    fp_send(f.link, &m);
    if (i % 100 == 0) {
      int n = task_count(f.d.pid);
      most = n > most ? n : most;
    }
  }
  /* The connectors wait up to seconds for the challenge that the test's
   * listener never sends: look for two seconds, while they would live. */
  for (int64_t until = dw_now_ms() + 2000; dw_now_ms() < until;) {
    fp_pump(&f, 20, 9); /* keep-alives answered */
    int n = task_count(f.d.pid);
    most = n > most ? n : most;
  }
  /* One connector thread at most, and a few for the loop's thread pool
   * (libuv starts 4 on first use) that the flood may happen to start. */
  ck_assert_msg(most <= before + 1 + 4, "%d threads with the flood, %d before it", most, before);
  ck_assert_msg(dw_log_has(&f.d, "DATA_OFFER(s) ignored", 5000), "the excess is not said");
  char out[8192];
  ck_assert_msg(wait_peers("", f.d.sock, "\"state\":\"up\"", 2000, out, sizeof out), "%s", out);
  fp_stop(&f);
}
END_TEST

/* The data stream's window (xring.h): a listener whose challenge is of a
 * version below or above it is refused by the opening daemon, which names
 * the window and the listener's version. */
START_TEST(a_data_stream_outside_the_version_window_is_refused_naming_both) {
  struct fp f;
  fp_start(&f);
  const uint32_t outside[] = {DEP_XFER_MIN_VERSION - 1, DEP_XFER_VERSION + 1};
  for (int i = 0; i < 2; i++) {
    struct dep_peer_msg m = {.type = DEP_PEER_DATA_OFFER};
    randombytes_buf(m.u.data_offer.token, sizeof m.u.data_offer.token);
    fp_send(f.link, &m);
    /* 10 s: a ceiling for the daemon's connector to reach the test's listener. */
    struct pollfd pf = {.fd = f.lfd, .events = POLLIN};
    ck_assert_int_eq(poll(&pf, 1, 10000), 1);
    int fd = accept(f.lfd, NULL, NULL);
    ck_assert_int_ge(fd, 0);
    struct dw_frame *fr = dw_frame_new();
    ck_assert_int_eq(dw_recv_frame(fd, fr, 5000), 0); /* its DATA_HELLO */
    free(fr);
    struct dep_xfer_challenge ch = {.magic = DEP_XFER_MAGIC, .version = outside[i]};
    ck_assert_int_eq(dw_send_all(fd, &ch, sizeof ch), 0);
    char want[128];
    dw_sfmt(want, sizeof want, "the peer speaks data stream version %u; this deepepd speaks "
            "versions %d..%d", (unsigned)outside[i], DEP_XFER_MIN_VERSION, DEP_XFER_VERSION);
    ck_assert_msg(dw_log_has(&f.d, want, 10000), "not logged: %s", want);
    close(fd);
  }
  fp_stop(&f);
}
END_TEST

/* ---- two network namespaces joined by a veth pair (root) ---------------------- */

/* Start deepepd in namespace ns with config conf (its stderr to log); its pid. */
static pid_t ns_daemon(const char *ns, const char *conf, const char *log) {
  pid_t pid = fork();
  if (pid == 0) {
    freopen(log, "a", stderr);
    execlp("ip", "ip", "netns", "exec", ns, tu_bin("deepepd"), "-c", conf, "--backend", "host",
           (char *)NULL);
    _exit(127);
  }
  return pid;
}

START_TEST(two_daemons_in_two_network_namespaces_come_up) {
  struct netns n;
  const char *why = netns_up(&n);
  if (why != NULL) {
    netns_down(&n);
    tu_skip("two_daemons_in_two_network_namespaces_come_up", "%s", why);
    return;
  }
  char dir[256], key[300], conf[2][320], sock[2][320], log[2][320], y[1024], out[8192];
  tu_tmpdir(dir, sizeof dir);
  write_key(dir, "key", key, sizeof key);
  pid_t pid[2];
  for (int i = 0; i < 2; i++) {
    snprintf(conf[i], sizeof conf[i], "%s/%d.yaml", dir, i);
    snprintf(sock[i], sizeof sock[i], "%s/%d.sock", dir, i);
    snprintf(log[i], sizeof log[i], "%s/%d.log", dir, i);
    int o = snprintf(y, sizeof y, "socket: {path: %s}\npool: {host_size: 64MiB}\n", sock[i]);
    char addr[32], paddr[32];
    snprintf(addr, sizeof addr, "10.77.0.%d", i + 1);
    snprintf(paddr, sizeof paddr, "10.77.0.%d", 2 - i);
    peer_yaml(y + o, sizeof y - (size_t)o, addr, 7470, paddr, 7470, key);
    ck_assert_int_eq(tu_write_file(conf[i], y), 0);
    pid[i] = ns_daemon(n.ns[i], conf[i], log[i]);
  }
  const char *up = "\"state\":\"up\",\"transport\":\"tcp\",\"wanted\":\"auto\",\"conns_up\":3,"
                   "\"conns_total\":3";
  bool ok0 = wait_peers("", sock[0], up, 8000, out, sizeof out);
  char out1[8192];
  bool ok1 = wait_peers("", sock[1], up, 3000, out1, sizeof out1);
  for (int i = 0; i < 2; i++) {
    kill(pid[i], SIGTERM);
    waitpid(pid[i], NULL, 0);
  }
  netns_down(&n);
  tu_rmtree(dir);
  ck_assert_msg(ok0, "ns0: %s", out);
  ck_assert_msg(ok1, "ns1: %s", out1);
}
END_TEST

Suite *peers_suite(void);
Suite *peers_suite(void) {
  Suite *s = suite_create("peers");
  TCase *tc = tcase_create("codec");
  tcase_add_test(tc, every_peer_message_round_trips);
  tcase_add_test(tc, a_truncated_or_overlong_peer_message_is_refused);
  tcase_add_test(tc, magic_version_and_type_are_checked_in_that_order);
  tcase_add_test(tc, peers_ok_round_trips_and_a_cut_one_is_refused);
  suite_add_tcase(s, tc);
  tc = tcase_create("handshake");
  tcase_add_test(tc, the_same_key_authenticates_both_ways);
  tcase_add_test(tc, a_wrong_key_fails_authentication);
  tcase_add_test(tc, a_reflected_answer_fails);
  tcase_add_test(tc, a_replayed_answer_fails);
  tcase_add_test(tc, the_key_file_must_be_private_and_long_enough);
  suite_add_tcase(s, tc);
  tc = tcase_create("daemons");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, two_daemons_bring_their_pools_up);
  tcase_add_test(tc, a_wrong_key_and_an_unlisted_peer_are_refused_and_logged);
  tcase_add_test(tc, random_bytes_on_the_peer_port_are_dropped);
  tcase_add_test(tc, a_flood_of_silent_connections_is_bounded);
  tcase_add_test(tc, a_daemon_refuses_to_start_with_a_readable_key_or_none);
  tcase_add_test(tc, the_transport_is_chosen_per_peer_and_rdma_is_never_silently_tcp);
  tcase_add_test(tc, two_daemons_in_two_network_namespaces_come_up);
  tcase_add_test(tc, an_unauthenticated_hello_does_not_rename_the_peer);
  tcase_add_test(tc, a_peer_outside_the_version_window_is_told_both);
  suite_add_tcase(s, tc);
  tc = tcase_create("strangers");
  /* Handshake timeouts waited out, a count's interval, a restart and a job under a flood. */
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, refused_connections_are_logged_as_counts_per_source);
  tcase_add_test(tc, idle_connections_from_a_peers_address_give_way_to_newer_ones);
  tcase_add_test(tc, a_flood_from_strangers_does_not_keep_a_restarted_peer_out);
  suite_add_tcase(s, tc);
  tc = tcase_create("data");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, a_data_connection_must_prove_the_peer_key_not_just_name_a_token);
  tcase_add_test(tc, bytes_right_behind_a_data_hello_reach_the_data_path);
  tcase_add_test(tc, an_unknown_type_from_an_authenticated_peer_leaves_the_link_up);
  tcase_add_test(tc, a_data_stream_outside_the_version_window_is_refused_naming_both);
  tcase_add_test(tc, a_flood_of_data_offers_starts_a_bounded_number_of_threads);
  suite_add_tcase(s, tc);
  tc = tcase_create("late");
  tcase_set_timeout(tc, 90); /* a backoff grown to seconds */
  tcase_add_test(tc, a_peer_that_comes_up_late_is_up_on_both_ends_at_once);
  suite_add_tcase(s, tc);
  return s;
}
