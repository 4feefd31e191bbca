/*
 * check_peers.c — the peer layer (daemon/peer.c, proto/peer_proto.c): the
 * codec and the handshake without sockets, the key file's rules, then real
 * daemons: two on 127.0.0.1 with different ports, and the same two in two
 * network namespaces joined by a veth pair (root only).  Strangers flooding
 * the peer port are check_peer_strangers.c's suite, a fake authenticated
 * peer on the data path check_peer_data.c's; the lone daemons and HELLO
 * clients the three share are peerlab.c's.
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
#include "peerlab.h"
#include "testutil.h"
#include "xring.h"
#include "xnjob.h"

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

/*
 * A daemon whose peer port another socket holds refuses to start: it exits, saying what holds
 * the port and what to set, where it aborted on a libuv assertion (its stop closed a tick
 * timer that its failed start had not made yet).
 */
START_TEST(a_daemon_whose_peer_port_is_taken_exits_saying_so) {
  char dir[256], key[300], y[1024];
  tu_tmpdir(dir, sizeof dir);
  write_key(dir, "key", key, sizeof key);
  const int pa = port_base();
  int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)pa)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ck_assert_int_ge(s, 0);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(s, 1), 0);
  peer_yaml(y, sizeof y, "127.0.0.1", pa, "127.0.0.1", pa + 1, key);
  struct tu_daemon a;
  expect_refused_start(&a, dir, "a", y);
  ck_assert(log_has(&a, "cannot listen on 127.0.0.1 port"));
  ck_assert(log_has(&a, "Address already in use (another deepepd, or another program, holds "
                        "it: stop it, or set listen.port"));
  close(s);
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
  tcase_add_test(tc, a_daemon_whose_peer_port_is_taken_exits_saying_so);
  tcase_add_test(tc, the_transport_is_chosen_per_peer_and_rdma_is_never_silently_tcp);
  tcase_add_test(tc, two_daemons_in_two_network_namespaces_come_up);
  tcase_add_test(tc, an_unauthenticated_hello_does_not_rename_the_peer);
  tcase_add_test(tc, a_peer_outside_the_version_window_is_told_both);
  suite_add_tcase(s, tc);
  tc = tcase_create("late");
  tcase_set_timeout(tc, 90); /* a backoff grown to seconds */
  tcase_add_test(tc, a_peer_that_comes_up_late_is_up_on_both_ends_at_once);
  suite_add_tcase(s, tc);
  return s;
}
