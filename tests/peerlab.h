/*
 * peerlab.h — what the peer suites (check_peers.c, check_peer_strangers.c,
 * check_peer_data.c) share: their ports, keys and YAML, `deepepctl peers`
 * polled for a state, a lone daemon whose peer never comes, and clients
 * that open the peer port from 127.0.0.<n> and say HELLO.
 */
#ifndef DEP_TEST_PEERLAB_H
#define DEP_TEST_PEERLAB_H

#include <netinet/in.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "testutil.h"

/* The key the HELLO clients and the handshake tests authenticate with (32 bytes). */
extern const uint8_t key_a[];

/* Ports of this test process's daemons: apart from other runs' (fork mode, pids differ). */
/* Below the kernel's range for outbound ports (32768..60999 by default), so
 * that a connection of another test cannot hold the port, and above
 * check_multinode's (4000 + 8 * (pid % 2000)). */
int port_base(void);

void write_key(const char *dir, const char *name, char *path, size_t len);

/* The YAML of a daemon listening on addr:port with peers[] = (paddr, pport). */
void peer_yaml(char *buf, size_t len, const char *addr, int port, const char *paddr,
               int pport, const char *key);

/* `deepepctl peers --json` on sock (prefixed by `pre`, e.g. "ip netns exec X"), into out. */
int ctl_peers_json(const char *pre, const char *sock, char *out, size_t len);

/* Wait up to ms for sock's peers to show `want` (a JSON fragment). */
bool wait_peers(const char *pre, const char *sock, const char *want, int ms, char *out,
                size_t len);

bool log_has(const struct tu_daemon *d, const char *s);

/* A daemon in a fresh dir with a key, listening on 127.0.0.1 at port_base()
 * for a peer on the next port that never comes. */
struct lone {
  struct tu_daemon d;
  char dir[256];
  int port;              /* its peer port */
  struct sockaddr_in sa; /* ... as an address */
};

void lone_daemon_start(struct lone *l);

/* The daemon still answers on its socket; then stop it and remove its dir. */
void lone_daemon_stop(struct lone *l);

/* A socket bound to 127.0.0.<from> (any port), connecting to 127.0.0.1:port
 * (blocking unless nonblock): the fd, or -1.  Linux routes all of 127/8 to
 * lo, so 127.0.0.2 and up are addresses no daemon of these tests lists. */
int connect_from(int from, int port, bool nonblock);

/* A peer daemon's first frame on fd: HELLO as `node`, listening on listen_port. 0 or -1. */
int send_hello(int fd, const char *node, int listen_port);

/* Whether the daemon on port answers a HELLO from 127.0.0.<from> (as node,
 * listening on listen_port) with a HELLO of its own, as it does a peer it
 * knows until AUTH; the connection stays open in *out. */
bool hello_answered(int from, int port, const char *node, int listen_port, int *out);

/* Wait (up to 5 s: its peer's host resolves meanwhile) until the daemon on
 * port answers a HELLO from its peer's address; that connection's fd. */
int hello_until_answered(int port, const char *node, int listen_port);

#endif /* DEP_TEST_PEERLAB_H */
