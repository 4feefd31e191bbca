/*
 * peer_internal.h — what the files of the peer layer share, private to
 * them: the connection, slot and peer records and the layer's state.
 * peer.c runs the links (the handshake, frames, the wait for readiness)
 * and answers the queries of peer.h; peer_tick.c is the layer's clock
 * (retries, keep-alives, timeouts, the loop's stalls); peerconn.c opens
 * the links (resolving, connecting with backoff, accepting, the
 * listener); peerxport.c settles
 * an authenticated link's transport (TCP, or an RDMA queue pair), calling
 * peer.c only through P->core; peerstate.c defines the layer's state.  All
 * of it runs on the loop thread.
 */
#ifndef DEP_DAEMON_PEER_INTERNAL_H
#define DEP_DAEMON_PEER_INTERNAL_H

#include <netinet/in.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <uv.h>

#include "link.h"
#include "peer.h"
#include "peerauth.h"
#include "rdmaxp.h"

#define PEER_MAX_ADDRS 8

/*
 * Why an inbound connection was refused before it authenticated: the log
 * counts refusals per source address and kind, and says each kind from a
 * source once, then a count per interval (peerconn_refused).
 */
enum peer_refusal {
  PEER_REFUSED_PROTOCOL, /* broke the framing, the handshake's order or its version */
  PEER_REFUSED_ADDRESS,  /* its source address is no configured peer's */
  PEER_REFUSED_BUSY,     /* its address's places for unauthenticated connections were all taken */
  PEER_REFUSED_EVICTED,  /* still unauthenticated when a newer connection from its address needed the place */
  PEER_REFUSED_TIMEOUT,  /* did not authenticate within PEER_HANDSHAKE_MS */
  PEER_REFUSED_UNLISTED, /* says a listen port that no configured peer at its address has */
  PEER_REFUSED_AUTH,     /* failed authentication */
  PEER_REFUSED_TOKEN,    /* named a data connection's token not offered to its peer */
  PEER_REFUSAL_KINDS
};

/* A link is up once it authenticated and settled its transport (peer_proto.h XPORT). */
enum peer_slot_state { SLOT_CONNECTING, SLOT_AUTHENTICATING, SLOT_TRANSPORT, SLOT_UP, SLOT_BACKOFF };

struct peer;

/* One connection, outbound (in a slot) or inbound (in the inbound list). */
struct peer_conn {
  struct link link;      /* once linked; link.user points here */
  uv_poll_t cpoll;       /* outbound, while the connect is under way */
  int fd;
  struct peer *peer;     /* outbound: always; inbound: once identified */
  int slot;              /* outbound slot, -1 inbound */
  bool linked;           /* link_init ran: the link owns fd */
  bool cpoll_closing;    /* the connect's poll is being closed */
  bool up;               /* authenticated both ways, transport settled */
  bool got_hello, sent_auth, verified, acked;
  bool authed;           /* verified and acked: the transport is being settled */
  bool rdma;             /* settled on an RDMA queue pair (else TCP) */
  bool handed_off;       /* a data connection: its socket is xfer's now */
  enum peer_refusal refusal; /* inbound: why, should it be dropped before authenticating */
  struct rdmaxp_qp *qp;  /* the link's queue pair, offered, connecting or up */
  uint64_t authed_ms;
  struct peerauth_hs hs;
  char from[INET6_ADDRSTRLEN + 8]; /* inbound: the source address, for log lines */
  struct sockaddr_storage src;
  /* What its HELLO said its node is (escaped): the peer's name shows it only
   * once this connection has authenticated (peer__take_node). */
  char node[DEP_PEER_NODE_MAX];
  uint64_t opened_ms, last_rx_ms, last_tx_ms;
  uint64_t last_ping_ms;      /* our last KEEPALIVE: each side pings on its own clock, so that
                                 both measure the round trip (replies are traffic, not pings) */
  char err[DEP_MSG_TEXT_MAX]; /* why it is closing, for the slot's last error */
  struct peer_conn *next;     /* inbound list */
};

struct peer_slot {
  struct peer_conn *conn;
  enum peer_slot_state state;
  uint64_t backoff_ms; /* the next wait's base */
  uint64_t retry_at_ms;
  bool awaits_address; /* connects as soon as the peer's host resolves */
};

struct peer {
  char host[256];
  uint16_t port;
  /* "host:port", from the configuration: set by peer_init and never written
   * again, so that any thread may read it (peer_name). */
  char name[272];
  char node[DEP_PEER_NODE_MAX]; /* what an authenticated link's HELLO said (the loop's) */
  struct peer_slot *slots;
  struct sockaddr_storage addrs[PEER_MAX_ADDRS];
  int naddrs;
  bool resolving;
  uint64_t resolved_ms;
  uv_getaddrinfo_t gai;
  char last_error[DEP_MSG_TEXT_MAX];
  uint64_t reconnects, bytes_in, bytes_out, rtt_us;
  uint64_t rdma_rtt_us;          /* the last queue-pair keep-alive's round trip */
  enum config_transport transport; /* auto, rdma or tcp: its own or the daemon's */
  bool said_tcp;                 /* auto fell back to TCP: said once */
  uint32_t inbound_up;
  bool linked_up; /* some link up, as last told to the job table */
  bool was_up; /* every slot up at the last look, for one log line per change */
};

/* Sources whose refusals are counted apart; the rest share one count. */
#define PEER_REFUSAL_SOURCES 32
/* Refusals from one source are said in one line per this interval. */
#define PEER_REFUSAL_LOG_MS 10000

/* The refusals of one source address in the current interval. */
struct peer_refusals {
  bool used;
  struct sockaddr_storage addr; /* port zero: sources are told apart by address only */
  uint64_t since_ms;            /* the interval's start */
  uint32_t said;                /* a bit per kind already said in a line of its own */
  uint32_t count[PEER_REFUSAL_KINDS]; /* since since_ms, not yet said */
};

/* The peer layer's state: the loop's alone. */
struct peer_layer {
  uv_loop_t *loop;
  bool active;
  bool stopping;
  uint32_t pool_size;
  uint32_t wait_ms;
  char listen_address[256];
  uint16_t listen_port;
  char node[DEP_PEER_NODE_MAX];
  uint8_t key[PEERAUTH_KEY_MAX];
  size_t keylen;
  bool authenticated; /* a key is in use (else peer_insecure) */
  size_t n;
  struct peer peers[CONFIG_MAX_LIST];
  struct peer_conn *inbound;
  int listen_fd;
  uv_poll_t listen_poll;
  bool listening;
  uint64_t accept_paused_until;
  struct peer_refusals refusals[PEER_REFUSAL_SOURCES];
  struct peer_refusals refusals_other; /* sources past the table, counted together */
  uv_timer_t tick;
  uint64_t start_ms;
  uint64_t last_tick_ms;         /* when the tick last ran (start_ms before): a late one is said */
  uint64_t resumed_ms;           /* the end of the loop's last stall: its links' silences and
                                    waits count from there, not from before it (peer_on_tick) */
  peer_ready_fn *ready_cb;
  char status[DEP_MSG_TEXT_MAX]; /* the last STATUS= sent while waiting */
  const struct peer_events *ev;
  const struct peer_data_ops *data; /* NULL until xfer_init registers it */
  const struct peer_core *core;     /* peer.c's, set by peer_init */
};
extern struct peer_layer peer__layer; /* peerstate.c */
/* Each file's handle on it. */
static struct peer_layer *const P = &peer__layer;

static inline uint64_t now_ms(void) { return uv_now(P->loop); }

/* Copy src into dst[size], cut to fit (log lines and messages only). */
static inline void cut(char *dst, size_t size, const char *src) {
  size_t n = strnlen(src, size - 1);
  memcpy(dst, src, n);
  dst[n] = '\0';
}

/* ---- peer.c ---- */

/* The link operations of every peer connection. */
extern const struct link_ops peer__link_ops;
/* Send m on c: 0, or what link_send said. */
int peer__send(struct peer_conn *c, const struct dep_peer_msg *m);
/* Our HELLO on c. */
int peer__send_hello(struct peer_conn *c);
/* Tell the far end why (best effort), remember it, log it and drop the link. */
void peer__refuse(struct peer_conn *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* c authenticated: its HELLO's node name may now be shown as its peer's. */
void peer__take_node(struct peer_conn *c);
/* Whether every slot of p is up. */
bool peer__all_up(const struct peer *p);
/* Tell the job table when p gains its first link or loses its last. */
void peer__note_links(struct peer *p);
/* Call the peer_wait callback once every peer is up or the wait is over. */
void peer__check_ready(void);

/* ---- peer_tick.c ---- */

/* Start the layer's clock (peer_init, once the peers are set up; its timer is made when the
 * layer becomes active); close it (peer_fini). */
void peer__tick_start(void);
void peer__tick_stop(void);
/* A KEEPALIVE came on c: a request is echoed as a reply (m becomes it); a
 * reply gives the round trip. */
void peer__on_keepalive(struct peer_conn *c, struct dep_peer_msg *m);

/*
 * What peerxport.c asks of peer.c, through P->core (peer_init sets it), so
 * that the transport's half calls nothing of the file above it: the
 * peer__ functions of those names.
 */
struct peer_core {
  int (*send)(struct peer_conn *c, const struct dep_peer_msg *m);
  void (*refuse)(struct peer_conn *c, int code, const char *fmt, ...)
      __attribute__((format(printf, 3, 4)));
  bool (*all_up)(const struct peer *p);
  void (*note_links)(struct peer *p);
  void (*check_ready)(void);
};

/* ---- peerconn.c ---- */

/* Whether x and y are the same IPv4 or IPv6 address (ports aside). */
bool peerconn_same_address(const struct sockaddr_storage *x, const struct sockaddr_storage *y);
/*
 * An inbound connection from src was refused before it authenticated, for
 * kind (why: the daemon's own words, never the far end's): the first of a
 * kind from a source is logged at once, the rest counted and logged in one
 * line per source every PEER_REFUSAL_LOG_MS (peerconn_refusals_tick).
 */
void peerconn_refused(const struct sockaddr_storage *src, enum peer_refusal kind, const char *why);
/* Log the counts of the sources whose interval ended (all: every count, at stop). */
void peerconn_refusals_tick(uint64_t now, bool all);

/* Slot i of p failed or was lost (why): wait, with jitter, then try again. */
void peerconn_backoff(struct peer *p, int i, const char *why);
/* Open slot i of p: resolve its host first if need be. */
void peerconn_connect(struct peer *p, int i);
/* c's connect ended (why: NULL, or how it failed or timed out). */
void peerconn_connect_done(struct peer_conn *c, const char *why);
/* Resolve p's host (again); its waiting slots connect when it answers. */
void peerconn_resolve(struct peer *p);
/* Open the listener on listen.address: 0, or -1 after logging why. */
int peerconn_listen(void);
/* The listener is readable: accept what waits (uv_poll callback). */
void peerconn_on_accept(uv_poll_t *h, int status, int events);
/* deepepd is stopping: say so on c if it is up, and close it. */
void peerconn_close_for_stop(struct peer_conn *c);

/* ---- peerxport.c ---- */

/* The RDMA transport's events for the links' queue pairs. */
extern const struct rdmaxp_events peerxport_events;
/* c's handshake may be complete: once both ends are, settle its transport. */
void peerxport_begin(struct peer_conn *c);
/* The connecting end: the acceptor's XPORT; the acceptor: the connector's XPORT_NAK. */
void peerxport_on_xport(struct peer_conn *c, const struct dep_peer_xport *x);
void peerxport_on_nak(struct peer_conn *c, const struct dep_peer_error *nak);
/* A frame past the handshake came on c before it is up: where that proves
 * its queue pair connected, c is settled now. */
void peerxport_proven(struct peer_conn *c);

#endif /* DEP_DAEMON_PEER_INTERNAL_H */
