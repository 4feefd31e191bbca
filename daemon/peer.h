/*
 * peer.h — deepepd's peer daemons (DESIGN §7): a TCP listener on
 * listen.address:listen.port, connection_pool_size links to every entry of
 * `peers`, each mutually authenticated with the key in peer_key_file
 * before anything else is said, kept warm with keep-alives and reopened
 * with exponential backoff and jitter when it drops.  Everything runs on
 * the loop thread.  The peer protocol is proto/peer_proto.h; the key and
 * the handshake's MAC are peerauth.h.
 *
 * A connection is accepted only from a configured peer: its source
 * address must be one that the entry's host resolves to (else it is
 * closed at accept), and the listen_port in its HELLO the entry's port.
 * Each such address has its own share of the places for connections still
 * authenticating, so a flood from elsewhere cannot keep a peer out.  The address comes from the
 * kernel, not from anything the far end wrote, and the port tells apart
 * several daemons of one host (and the port is covered by the MAC); host
 * names are not compared, since nodes often share one (containers, tests)
 * and many clusters have none in DNS.
 */
#ifndef DEP_DAEMON_PEER_H
#define DEP_DAEMON_PEER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "config.h"
#include "peer_proto.h"
#include "proto.h"

/* Keep-alive: each end asks this often on an idle-or-not link... */
#define PEER_KEEPALIVE_MS 1000
/* ...and drops a link on which nothing came for this long (a dead peer). */
#define PEER_DEAD_MS 5000
/* A connect or a handshake that takes longer than this is given up. */
#define PEER_HANDSHAKE_MS 5000
/* After authenticating, a link settles its transport (an RDMA connection) within this. */
#define PEER_TRANSPORT_MS 10000
/* Reconnect backoff: the first wait, doubling up to the last, each with jitter. */
#define PEER_BACKOFF_MIN_MS 100
#define PEER_BACKOFF_MAX_MS 30000

/*
 * Start the peer layer with its configuration (copied: these keys need a
 * restart): read and check the key, open the listener, start connecting.
 * Returns 0, or -1 after logging why deepepd cannot start (a key file that
 * others can read, too short or unreadable; peers or a listener with no
 * key and no peer_insecure; a listener that cannot bind).
 */
int peer_init(uv_loop_t *loop, const struct config *cfg);
/* Tell every peer we are stopping (CLOSE), close every link and the listener. */
void peer_fini(void);

/*
 * Call done once, on the loop, as soon as every configured peer is up or
 * peer_wait_ms after peer_init passed: missing is NULL, or names the peers
 * still not up ("10.0.0.2:7470 (backoff: connection refused)").  Until
 * then STATUS= says which are missing.  At once with no peers.
 */
typedef void peer_ready_fn(const char *missing);
void peer_wait(peer_ready_fn *done);

/*
 * What the peer layer tells the job table (job.c hands these in): a peer
 * numbered 0..peer_count()-1 came up (its first authenticated link, either
 * direction) or went down (its last one closed), and a job message
 * (MEMBERSHIP, MEMBERSHIP_OK, JOB_FAIL, JOB_END) arrived from an
 * authenticated peer.
 */
struct peer_events {
  void (*up)(int peer);
  void (*down)(int peer);
  void (*job_msg)(int peer, const struct dep_peer_msg *m);
};
void peer_set_events(const struct peer_events *ev);

/*
 * What the peer layer hands the data path between nodes (xfer.c registers
 * these in xfer_init, so peer.c calls nothing above it), each on the loop
 * thread: `up`, peer k came up, before the job table hears it (so its
 * DATA_OFFERs go on the link ahead of the jobs' MEMBERSHIP); `down`, its
 * last link closed, after the job table failed or told its jobs (whose
 * routes go before their data connections); `accept`, an inbound connection from peer k said DATA_HELLO with
 * token: whether the token is one offered to k (PEER_TOKEN_TAKEN: fd is then
 * the data path's; else the caller closes it); `offer`, peer k's DATA_OFFER; `tick`, the
 * layer's periodic tick; `fill`, the data path's part of a PEERS record (its
 * proxy threads, and each of m->n_peers peers' data connections and
 * traffic).  Before any are registered a DATA_HELLO is refused and the rest
 * are not called.
 */
/*
 * What a DATA_HELLO's token is to the data path (peer_data_ops.accept):
 * one offered to that peer and open (the connection is taken); one offered
 * to it that expired unused or was withdrawn when its links all went down
 * (its connector was under way while one end stalled or lost the links:
 * closed, not refused, as the offers made since stand); or one never
 * offered to it, or spent (refused, and counted with the source's
 * refusals).
 */
enum peer_token { PEER_TOKEN_TAKEN, PEER_TOKEN_STALE, PEER_TOKEN_UNKNOWN };

struct peer_data_ops {
  void (*up)(int peer);
  void (*down)(int peer);
  enum peer_token (*accept)(int peer, const uint8_t token[DEP_PEER_TOKEN_LEN], int fd);
  void (*offer)(int peer, const struct dep_peer_data_offer *o);
  void (*tick)(void);
  void (*fill)(struct dep_msg_peers *m);
};
void peer_set_data_ops(const struct peer_data_ops *ops);

/* Configured peers, and whether peer k has an authenticated link now. */
int peer_count(void);
bool peer_is_up(int peer);
/* Where to open a data connection to peer k (its address, its listen
 * port): 0, or -1 when its host has not resolved. */
int peer_data_address(int peer, struct sockaddr_storage *out, socklen_t *len);
/* "host:port" for messages, as configured: fixed from peer_init on, so any
 * thread may call it (a proxy's, a receiver's).  What a peer says its node
 * is shows in `deepepctl peers` only, once one of its links authenticated. */
const char *peer_name(int peer);
/* The key that proves a data connection between us and peer k, for the
 * direction in which `we_open` (peerauth_data_key: peer_key_file's, our
 * node's and its node's names as the HELLOs said them); the loop's, for a
 * thread to keep a copy of.  peer_insecure: an empty key. */
void peer_data_key(int peer, bool we_open, uint8_t out[DEP_PEER_MAC_LEN]);
/* Send m to peer k on one of its authenticated links: 0, or DEP_ERR_STATE
 * when none is up (or the link's queue refused it). */
int peer_send(int peer, const struct dep_peer_msg *m);

/* Fill m (PEERS_OK) with every peer; allocates m->peers (proto_peers_free). */
int peer_fill(struct dep_msg_peers *m);

#endif /* DEP_DAEMON_PEER_H */
