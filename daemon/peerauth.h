/*
 * peerauth.h — the peer handshake's pure logic (DESIGN §7), no sockets:
 * reading and checking peer_key_file, and one end's side of the mutual
 * challenge-response that peer.c runs on every link before anything else
 * is said.  The wire messages are proto/peer_proto.h.
 */
#ifndef DEP_DAEMON_PEERAUTH_H
#define DEP_DAEMON_PEERAUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "peer_proto.h"
#include "proto.h"
#include "xring.h"

/* The longest key read from peer_key_file, and the shortest accepted. */
#define PEERAUTH_KEY_MAX 4096
#define PEERAUTH_KEY_MIN 32

/*
 * Read a key file: a regular file that group and others cannot read, its
 * bytes less one trailing newline, PEERAUTH_KEY_MIN..PEERAUTH_KEY_MAX of
 * them.  Returns 0, or DEP_ERR_PERMISSION / DEP_ERR_CONFIG with why set.
 */
int peerauth_key_load(const char *path, uint8_t *key, size_t cap, size_t *len, char *why,
                      size_t whylen);

/*
 * One end's side of the handshake: it writes its HELLO, takes the far
 * end's, answers with AUTH and checks the far end's AUTH.  The MAC
 * (HMAC-SHA-512/256, libsodium) covers a context string, the role of the
 * sender (connector or acceptor) and both HELLOs as sent, the sender's
 * first: so it binds both challenges, both names and addresses, and the
 * direction.  libsodium must be initialised (sodium_init) first.
 */
struct peerauth_hs {
  bool connector;       /* this end opened the connection */
  const uint8_t *key;
  size_t keylen;
  uint8_t mine[DEP_PEER_HELLO_MAX];
  size_t mine_len;
  uint8_t theirs[DEP_PEER_HELLO_MAX];
  size_t theirs_len;
};
/* Encode our HELLO (a fresh random challenge) into out and keep a copy. 0 or DEP_ERR_*. */
int peerauth_hello(struct peerauth_hs *hs, const char *node, const char *listen_address,
                   uint16_t listen_port, struct proto_buf *out);
/* Keep the far end's HELLO message (already decoded, so well-formed). */
int peerauth_take(struct peerauth_hs *hs, const uint8_t *msg, size_t len);
/* Our AUTH for this connection. */
void peerauth_mac(const struct peerauth_hs *hs, uint8_t mac[DEP_PEER_MAC_LEN]);
/* Whether the far end's AUTH is the right one (constant time). */
bool peerauth_check(const struct peerauth_hs *hs, const uint8_t mac[DEP_PEER_MAC_LEN]);

/*
 * The data connections' proof (proto/xring.h, daemon/xfer.h).  Each end
 * derives, with the key, one key per direction between two nodes: a MAC
 * over a context of its own, the opener's node name and the acceptor's
 * (each as HELLO carried it), so that a proof made for one direction or
 * one pair of nodes answers no other.  The opener proves it holds that
 * key with a MAC over the acceptor's fresh nonce and the DATA_OFFER's
 * token: a proof answers one connection's challenge only.  Threads hold
 * the derived key, never peer_key_file's.
 */
void peerauth_data_key(const uint8_t *key, size_t keylen, const char *opener,
                       const char *acceptor, uint8_t out[DEP_PEER_MAC_LEN]);
void peerauth_data_mac(const uint8_t dkey[DEP_PEER_MAC_LEN],
                       const uint8_t nonce[DEP_PEER_CHALLENGE_LEN],
                       const uint8_t token[DEP_PEER_TOKEN_LEN], uint8_t mac[DEP_PEER_MAC_LEN]);
/* Whether mac is the opener's proof for nonce and token (constant time). */
bool peerauth_data_check(const uint8_t dkey[DEP_PEER_MAC_LEN],
                         const uint8_t nonce[DEP_PEER_CHALLENGE_LEN],
                         const uint8_t token[DEP_PEER_TOKEN_LEN],
                         const uint8_t mac[DEP_PEER_MAC_LEN]);

/*
 * The proof that opens an RDMA data queue pair (xring.h's
 * dep_xfer_rdma_req): with the same derived key, a MAC over its own
 * context, the data stream's version and the DATA_OFFER's token, which is
 * the accepting end's fresh nonce, cut to DEP_XFER_RDMA_PROOF_LEN bytes.
 */
void peerauth_rdma_proof(const uint8_t dkey[DEP_PEER_MAC_LEN], uint32_t version,
                         const uint8_t token[DEP_PEER_TOKEN_LEN],
                         uint8_t proof[DEP_XFER_RDMA_PROOF_LEN]);
/* Whether proof is the opener's for version and token (constant time). */
bool peerauth_rdma_check(const uint8_t dkey[DEP_PEER_MAC_LEN], uint32_t version,
                         const uint8_t token[DEP_PEER_TOKEN_LEN],
                         const uint8_t proof[DEP_XFER_RDMA_PROOF_LEN]);

/*
 * The proof that opens a link's RDMA queue pair (peer_proto.h's
 * dep_peer_qp_req): with the key derived for the link's direction (as
 * for the data connections), a MAC over its own context, XPORT's whole
 * token and the connecting end's mailbox, cut to DEP_PEER_QP_PROOF_LEN.
 */
void peerauth_qp_proof(const uint8_t dkey[DEP_PEER_MAC_LEN],
                       const uint8_t token[DEP_PEER_TOKEN_LEN], uint64_t mbox_addr,
                       uint32_t mbox_rkey,
                       uint8_t proof[DEP_PEER_QP_PROOF_LEN]);
/* Whether proof is the connecting end's for token and mailbox (constant time). */
bool peerauth_qp_check(const uint8_t dkey[DEP_PEER_MAC_LEN],
                       const uint8_t token[DEP_PEER_TOKEN_LEN], uint64_t mbox_addr,
                       uint32_t mbox_rkey,
                       const uint8_t proof[DEP_PEER_QP_PROOF_LEN]);

#endif /* DEP_DAEMON_PEERAUTH_H */
