/*
 * check_peer_data.c — suite peer_data: a fake authenticated peer (the test
 * holds the key) against a real daemon: a data connection must prove the
 * peer key, bytes right behind its HELLO reach the data path, an unknown
 * type leaves the link up, a stream outside the version window is refused
 * naming both, a frame header with a malformed job id drops its data
 * connection, and a flood of data offers starts a bounded number of
 * threads.  The helpers it shares with check_peers.c are peerlab.c's.
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
#include <stddef.h>
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
  /* A frame of its own per call: a test's connector thread reads its link while the main
   * thread reads another (a shared static frame was a data race). */
  struct dw_frame *f = malloc(sizeof *f);
  ck_assert_ptr_nonnull(f);
  int rc = -1;
  if (dw_recv_frame(fd, f, ms) == 0 && f->h.type == DEP_MSG_PEER) {
    if (raw != NULL) {
      memcpy(raw, f->body, f->h.body_len);
      *rawlen = f->h.body_len;
    }
    rc = peer_proto_decode(f->body, f->h.body_len, m, NULL, 0) == 0 ? 0 : -1;
  }
  free(f);
  return rc;
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

static void fp_take_link(struct fp *f);

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
  fp_take_link(f);
}

/* Take the daemon's next connection to the fake as its link, answer its
 * handshake, and read on until it offers a data connection (into tok). */
static void fp_take_link(struct fp *f) {
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
  const int had = f->ntok;
  fp_pump(f, 10000, had + 1);
  ck_assert_msg(f->ntok > had, "the daemon offered no data connection");
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
  const int before = tu_threads(f.d.pid, NULL);
  ck_assert_int_gt(before, 0);
  enum { N = 3000 };
  struct dep_peer_msg m = {.type = DEP_PEER_DATA_OFFER};
  int most = before;
  for (int i = 0; i < N; i++) {
    randombytes_buf(m.u.data_offer.token, sizeof m.u.data_offer.token);
    fp_send(f.link, &m);
    if (i % 100 == 0) {
      int n = tu_threads(f.d.pid, NULL);
      most = n > most ? n : most;
    }
  }
  /* The connectors wait up to seconds for the challenge that the test's
   * listener never sends: look for two seconds, while they would live. */
  for (int64_t until = dw_now_ms() + 2000; dw_now_ms() < until;) {
    fp_pump(&f, 20, 9); /* keep-alives answered */
    int n = tu_threads(f.d.pid, NULL);
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

/*
 * A frame header is decoded whole before the receiver acts on a field
 * (xring.h, the codec): on a proven data connection, a header of a job
 * that does not run here is dropped and the connection kept, and then one
 * whose job id has no NUL (its 64 bytes all 'a') is refused as not a
 * deepepd's stream, and the connection dropped, saying why.  Before, the
 * receiver cut such a job id to 63 bytes, took the frame for one of a job
 * that ended here and went on reading the stream.  The link is answered
 * meanwhile (fp_answer), so that no peer-down closes the connection for
 * another reason.
 */
START_TEST(a_frame_header_whose_job_id_has_no_nul_drops_the_data_connection) {
  struct fp f;
  fp_start(&f);
  struct fp_answerer ans = {.f = &f};
  atomic_init(&ans.stop, false);
  ck_assert_int_eq(pthread_create(&ans.th, NULL, fp_answer, &ans), 0);
  uint8_t dkey[DEP_PEER_MAC_LEN], nonce[DEP_XFER_NONCE_LEN], mac[DEP_XFER_MAC_LEN];
  peerauth_data_key(f.key, f.keylen, "fakepeer", f.dnode, dkey);
  int fd = fp_data_open(&f, f.tok[0], nonce);
  ck_assert_int_ge(fd, 0);
  peerauth_data_mac(dkey, nonce, f.tok[0], mac);
  ck_assert_msg(fp_data_prove(fd, mac), "the peer's own proof was refused");

  struct dep_xfer_hdr h = {.magic = DEP_XFER_MAGIC, .src = 1, .dest = 0, .job_id = "nojob"};
  struct proto_buf b;
  proto_buf_init(&b);
  ck_assert_int_eq(dep__xfer_hdr_encode(&b, &h), 0);
  ck_assert_int_eq(dw_send_all(fd, b.data, b.len), 0);
  ck_assert_msg(dw_log_has(&f.d, "frame(s) of jobs that do not run here dropped", 10000),
                "a well-formed frame of a job not here was not dropped as one");
  memset(b.data + offsetof(struct dep_xfer_hdr, job_id), 'a', DEP_JOB_ID_MAX);
  ck_assert_int_eq(dw_send_all(fd, b.data, b.len), 0);
  proto_buf_free(&b);
  /* 10 s: a ceiling for the receiver to read 168 bytes and close. */
  struct timeval tv = {.tv_sec = 10};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  uint8_t byte;
  const ssize_t n = recv(fd, &byte, 1, 0);
  const int err = errno;
  atomic_store(&ans.stop, true);
  pthread_join(ans.th, NULL);
  ck_assert_msg(n == 0, "the data connection was kept after a job id without its NUL (recv %zd: "
                "%s)", n, n < 0 ? strerror(err) : "bytes");
  ck_assert_msg(dw_log_has(&f.d, "inbound data connection dropped: a frame whose job id is not "
                "a string", 5000), "the refusal was not said");
  close(fd);
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

/*
 * A data connection that names an offer the daemon withdrew when the
 * peer's links went down (a connector under way across the loss, as when
 * one of two daemons started together stalled past PEER_DEAD_MS) is closed
 * without a challenge and said as such, not taken for a stranger's; one
 * that names a token never offered is refused and said as before.  Before,
 * the first was refused as a token "this daemon did not offer", counted
 * with the source's failed authentications.
 */
START_TEST(a_data_connection_naming_an_offer_withdrawn_with_the_links_is_closed_not_refused) {
  struct fp f;
  fp_start(&f);
  /* The peer's only link goes: the daemon takes the peer for down. */
  close(f.link);
  f.link = -1;
  ck_assert_msg(dw_log_has(&f.d, "connection 0 lost", 10000), "the daemon kept the link");
  uint8_t nonce[DEP_XFER_NONCE_LEN];
  ck_assert_msg(fp_data_open(&f, f.tok[0], nonce) < 0, "a withdrawn offer opened a connection");
  ck_assert_msg(!log_has(&f.d, "did not offer"), "refused as a stranger's token");
  ck_assert_msg(dw_log_has(&f.d, "was withdrawn when the links to it went down", 10000),
                "the withdrawn offer's connection is not said");
  uint8_t never[DEP_PEER_TOKEN_LEN];
  randombytes_buf(never, sizeof never);
  ck_assert_msg(fp_data_open(&f, never, nonce) < 0, "a token never offered was taken");
  ck_assert_msg(dw_log_has(&f.d, "with a token this daemon did not offer it", 10000),
                "a token never offered is not refused as one");
  fp_stop(&f);
}
END_TEST

/* Offer the daemon a data connection with a fresh token (o's, kept for the accept). */
static void fp_offer(struct fp *f, struct dep_peer_msg *o) {
  randombytes_buf(o->u.data_offer.token, sizeof o->u.data_offer.token);
  fp_send(f->link, o);
}

/* The next connection the daemon opens to the fake (within 10 s, a ceiling
 * for a loaded machine), which must be a data connection naming token. */
static int fp_data_accept(struct fp *f, const uint8_t *token) {
  struct pollfd pf = {.fd = f->lfd, .events = POLLIN};
  ck_assert_msg(poll(&pf, 1, 10000) == 1, "the daemon opened no data connection");
  int fd = accept(f->lfd, NULL, NULL);
  ck_assert_int_ge(fd, 0);
  struct dep_peer_msg m;
  ck_assert_int_eq(fp_recv(fd, &m, 5000, NULL, NULL), 0);
  ck_assert_uint_eq(m.type, DEP_PEER_DATA_HELLO);
  ck_assert_msg(memcmp(m.u.data_hello.token, token, DEP_PEER_TOKEN_LEN) == 0,
                "the data connection names another offer");
  return fd;
}

/*
 * An offer the peer makes once it is back after its links went down gets a
 * connector at once, although the one for its offer of before still waits
 * for its challenge (the peer, stalled, has not answered it): the older
 * generation's connectors count apart.  Before, the new offer was ignored
 * ("DATA_OFFER(s) ignored": as many connections were being opened as the
 * peer may have), and stood unused at the peer until it expired
 * (XFER_OFFER_MS), 10 s without the data connection.
 */
START_TEST(an_offer_made_after_the_peer_came_back_is_not_ignored_behind_an_older_connector) {
  struct fp f;
  fp_start(&f);
  struct dep_peer_msg o = {.type = DEP_PEER_DATA_OFFER};
  fp_offer(&f, &o);
  const int before = fp_data_accept(&f, o.u.data_offer.token); /* left unanswered */
  close(f.link);
  fp_take_link(&f); /* the daemon's next connection: its link again */
  fp_offer(&f, &o);
  /* The link answered meanwhile, so that it is not dropped as dead. */
  struct fp_answerer ans = {.f = &f};
  atomic_init(&ans.stop, false);
  ck_assert_int_eq(pthread_create(&ans.th, NULL, fp_answer, &ans), 0);
  const int after = fp_data_accept(&f, o.u.data_offer.token);
  atomic_store(&ans.stop, true);
  pthread_join(ans.th, NULL);
  ck_assert_msg(!log_has(&f.d, "DATA_OFFER(s) ignored"), "an offer was ignored");
  close(after);
  close(before);
  fp_stop(&f);
}
END_TEST

/* Wait until the daemon has handled everything the fake sent on its link
 * before: a keep-alive's answer comes after them (answering its own
 * keep-alives meanwhile). */
static void fp_sync(struct fp *f) {
  struct dep_peer_msg m = {.type = DEP_PEER_KEEPALIVE};
  m.u.keepalive.stamp = 0x5eed;
  fp_send(f->link, &m);
  for (;;) {
    ck_assert_int_eq(fp_recv(f->link, &m, 10000, NULL, NULL), 0);
    if (m.type == DEP_PEER_KEEPALIVE && m.u.keepalive.reply && m.u.keepalive.stamp == 0x5eed)
      return;
    if (m.type == DEP_PEER_KEEPALIVE && !m.u.keepalive.reply) {
      m.u.keepalive.reply = 1;
      fp_send(f->link, &m);
    }
  }
}

/*
 * An offer that comes while as many connectors to the peer are under way
 * as it may have data connections (one, here) is dialled as soon as one
 * of them finishes: the peer counts it as pending until it expires
 * (XFER_OFFER_MS) and offers no other meanwhile.  Before, it was ignored
 * ("DATA_OFFER(s) ignored"), and the data connection was missing for 10
 * s: two daemons stalled together at start re-offered as their first
 * offers expired, while the connectors for those still waited.
 */
START_TEST(an_offer_past_the_connectors_under_way_is_dialled_when_one_finishes) {
  struct fp f;
  fp_start(&f);
  struct dep_peer_msg o = {.type = DEP_PEER_DATA_OFFER};
  fp_offer(&f, &o);
  const int first = fp_data_accept(&f, o.u.data_offer.token); /* left unanswered */
  fp_offer(&f, &o);
  fp_sync(&f); /* the second offer came while the first's connector waits */
  struct fp_answerer ans = {.f = &f};
  atomic_init(&ans.stop, false);
  ck_assert_int_eq(pthread_create(&ans.th, NULL, fp_answer, &ans), 0);
  close(first); /* its connector finishes, without a challenge */
  const int second = fp_data_accept(&f, o.u.data_offer.token);
  atomic_store(&ans.stop, true);
  pthread_join(ans.th, NULL);
  ck_assert_msg(!log_has(&f.d, "DATA_OFFER(s) ignored"), "the offer was ignored");
  close(second);
  fp_stop(&f);
}
END_TEST

Suite *peer_data_suite(void);
Suite *peer_data_suite(void) {
  Suite *s = suite_create("peer_data");
  TCase *tc = tcase_create("data");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, a_data_connection_must_prove_the_peer_key_not_just_name_a_token);
  tcase_add_test(tc, bytes_right_behind_a_data_hello_reach_the_data_path);
  tcase_add_test(tc, an_unknown_type_from_an_authenticated_peer_leaves_the_link_up);
  tcase_add_test(tc, a_data_stream_outside_the_version_window_is_refused_naming_both);
  tcase_add_test(tc, a_frame_header_whose_job_id_has_no_nul_drops_the_data_connection);
  tcase_add_test(tc, a_flood_of_data_offers_starts_a_bounded_number_of_threads);
  tcase_add_test(tc, a_data_connection_naming_an_offer_withdrawn_with_the_links_is_closed_not_refused);
  tcase_add_test(tc, an_offer_made_after_the_peer_came_back_is_not_ignored_behind_an_older_connector);
  tcase_add_test(tc, an_offer_past_the_connectors_under_way_is_dialled_when_one_finishes);
  suite_add_tcase(s, tc);
  return s;
}
