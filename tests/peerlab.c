/*
 * peerlab.c — the peer suites' shared helpers (peerlab.h).
 */
#include "peerlab.h"

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

const uint8_t key_a[] = "0123456789abcdef0123456789abcdef";

/* Ports of this test process's daemons: apart from other runs' (fork mode, pids differ). */
/* Below the kernel's range for outbound ports (32768..60999 by default), so
 * that a connection of another test cannot hold the port, and above
 * check_multinode's (4000 + 8 * (pid % 2000)). */
int port_base(void) { return 20000 + (int)(getpid() % 1500) * 8; }

void write_key(const char *dir, const char *name, char *path, size_t len) {
  snprintf(path, len, "%s/%s", dir, name);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "%s genkey %s 2>/dev/null", tu_bin("deepepctl"), path);
  ck_assert_int_eq(system(cmd), 0);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0600);
}

/* The YAML of a daemon listening on addr:port with peers[] = (paddr, pport). */
void peer_yaml(char *buf, size_t len, const char *addr, int port, const char *paddr,
               int pport, const char *key) {
  snprintf(buf, len,
           "connection_pool_size: 3\nlisten: {address: %s, port: %d}\n"
           "peers: [{host: %s, port: %d}]\npeer_key_file: %s\npeer_wait_ms: 2000\n",
           addr, port, paddr, pport, key);
}

/* `deepepctl peers --json` on sock (prefixed by `pre`, e.g. "ip netns exec X"), into out. */
int ctl_peers_json(const char *pre, const char *sock, char *out, size_t len) {
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
bool wait_peers(const char *pre, const char *sock, const char *want, int ms, char *out,
                size_t len) {
  for (int t = 0; t < ms; t += 100) {
    if (ctl_peers_json(pre, sock, out, len) == 0 && strstr(out, want) != NULL)
      return true;
    usleep(100 * 1000);
  }
  return false;
}

bool log_has(const struct tu_daemon *d, const char *s) {
  char *log = tu_daemon_log(d);
  bool has = log != NULL && strstr(log, s) != NULL;
  free(log);
  return has;
}

void lone_daemon_start(struct lone *l) {
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
void lone_daemon_stop(struct lone *l) {
  char state[32];
  ck_assert_ptr_nonnull(tu_daemon_state(l->d.sock, state, sizeof state));
  tu_daemon_stop(&l->d);
  tu_daemon_cleanup(&l->d);
  tu_rmtree(l->dir);
}

/* A socket bound to 127.0.0.<from> (any port), connecting to 127.0.0.1:port
 * (blocking unless nonblock): the fd, or -1.  Linux routes all of 127/8 to
 * lo, so 127.0.0.2 and up are addresses no daemon of these tests lists. */
int connect_from(int from, int port, bool nonblock) {
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
int send_hello(int fd, const char *node, int listen_port) {
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
bool hello_answered(int from, int port, const char *node, int listen_port, int *out) {
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
int hello_until_answered(int port, const char *node, int listen_port) {
  int fd = -1;
  for (int t = 0; t < 5000; t += 100) {
    if (hello_answered(1, port, node, listen_port, &fd))
      return fd;
    dw_sleep_ms(100);
  }
  ck_abort_msg("the daemon on port %d never answered a HELLO from its peer's address", port);
  return -1;
}
