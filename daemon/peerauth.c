/*
 * peerauth.c — the peer handshake without sockets (peerauth.h): reading
 * and checking peer_key_file, the HELLO with its random challenge, and the
 * AUTH MAC computed and verified with libsodium, and the data connections'
 * proof of the same key.
 */
#include "peerauth.h"

#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The context the MAC starts with: a key used elsewhere never answers here. */
static const char peerauth_context[] = "deepepd peer auth v1";

int peerauth_key_load(const char *path, uint8_t *key, size_t cap, size_t *len, char *why,
                      size_t whylen) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    snprintf(why, whylen, "peer_key_file %s: cannot open: %s", path, strerror(errno));
    return DEP_ERR_CONFIG;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    snprintf(why, whylen, "peer_key_file %s: not a regular file", path);
    close(fd);
    return DEP_ERR_CONFIG;
  }
  if ((st.st_mode & 077) != 0) {
    snprintf(why, whylen,
             "peer_key_file %s has mode %04o: group or others may read it; the key must be "
             "readable by deepepd only: chmod 600 %s",
             path, (unsigned)(st.st_mode & 07777), path);
    close(fd);
    return DEP_ERR_PERMISSION;
  }
  uint8_t buf[PEERAUTH_KEY_MAX + 2];
  size_t got = 0;
  for (;;) {
    ssize_t n = read(fd, buf + got, sizeof buf - got);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0) {
      snprintf(why, whylen, "peer_key_file %s: cannot read: %s", path, strerror(errno));
      close(fd);
      return DEP_ERR_CONFIG;
    }
    if (n == 0 || (got += (size_t)n) == sizeof buf)
      break;
  }
  close(fd);
  if (got > 0 && buf[got - 1] == '\n')
    got--;
  if (got < PEERAUTH_KEY_MIN || got > PEERAUTH_KEY_MAX || got > cap) {
    snprintf(why, whylen,
             "peer_key_file %s holds %s%zu bytes of key; it needs %d to %d (deepepctl genkey "
             "FILE writes one)",
             path, got > PEERAUTH_KEY_MAX ? "more than " : "", got > PEERAUTH_KEY_MAX ? PEERAUTH_KEY_MAX : got,
             PEERAUTH_KEY_MIN, PEERAUTH_KEY_MAX);
    sodium_memzero(buf, sizeof buf);
    return DEP_ERR_CONFIG;
  }
  memcpy(key, buf, got);
  *len = got;
  sodium_memzero(buf, sizeof buf);
  return 0;
}

int peerauth_hello(struct peerauth_hs *hs, const char *node, const char *listen_address,
                   uint16_t listen_port, struct proto_buf *out) {
  struct dep_peer_msg m = {.type = DEP_PEER_HELLO};
  m.u.hello.version = DEP_PEER_VERSION;
  snprintf(m.u.hello.node, sizeof m.u.hello.node, "%s", node);
  snprintf(m.u.hello.listen_address, sizeof m.u.hello.listen_address, "%s", listen_address);
  m.u.hello.listen_port = listen_port;
  randombytes_buf(m.u.hello.challenge, sizeof m.u.hello.challenge);
  size_t start = out->len;
  int rc = peer_proto_encode(out, &m);
  if (rc != 0)
    return rc;
  hs->mine_len = out->len - start;
  memcpy(hs->mine, out->data + start, hs->mine_len);
  return 0;
}

int peerauth_take(struct peerauth_hs *hs, const uint8_t *msg, size_t len) {
  if (len > sizeof hs->theirs)
    return DEP_ERR_PROTOCOL;
  memcpy(hs->theirs, msg, len);
  hs->theirs_len = len;
  return 0;
}

/* MAC(context, role of the sender, sender's HELLO, receiver's HELLO). */
static void peerauth_mac_of(const struct peerauth_hs *hs, bool sender_connected,
                            const uint8_t *sender, size_t slen, const uint8_t *receiver,
                            size_t rlen, uint8_t mac[DEP_PEER_MAC_LEN]) {
  crypto_auth_hmacsha512256_state st;
  uint8_t role = sender_connected ? 'C' : 'A';
  uint8_t l[4];
  crypto_auth_hmacsha512256_init(&st, hs->key, hs->keylen);
  crypto_auth_hmacsha512256_update(&st, (const uint8_t *)peerauth_context,
                                   sizeof peerauth_context - 1);
  crypto_auth_hmacsha512256_update(&st, &role, 1);
  for (int i = 0; i < 4; i++)
    l[i] = (uint8_t)(slen >> (8 * i));
  crypto_auth_hmacsha512256_update(&st, l, 4);
  crypto_auth_hmacsha512256_update(&st, sender, slen);
  for (int i = 0; i < 4; i++)
    l[i] = (uint8_t)(rlen >> (8 * i));
  crypto_auth_hmacsha512256_update(&st, l, 4);
  crypto_auth_hmacsha512256_update(&st, receiver, rlen);
  crypto_auth_hmacsha512256_final(&st, mac);
  sodium_memzero(&st, sizeof st);
}

void peerauth_mac(const struct peerauth_hs *hs, uint8_t mac[DEP_PEER_MAC_LEN]) {
  peerauth_mac_of(hs, hs->connector, hs->mine, hs->mine_len, hs->theirs, hs->theirs_len, mac);
}

bool peerauth_check(const struct peerauth_hs *hs, const uint8_t mac[DEP_PEER_MAC_LEN]) {
  uint8_t want[DEP_PEER_MAC_LEN];
  peerauth_mac_of(hs, !hs->connector, hs->theirs, hs->theirs_len, hs->mine, hs->mine_len, want);
  bool ok = crypto_verify_32(want, mac) == 0;
  sodium_memzero(want, sizeof want);
  return ok;
}

/* The contexts of the data connections' derived key and of its proofs. */
static const char peerauth_data_context[] = "deepepd data connection key v1";
static const char peerauth_proof_context[] = "deepepd data connection proof v1";
static const char peerauth_rdma_context[] = "deepepd rdma data queue pair proof v1";
static const char peerauth_qp_context[] = "deepepd rdma link queue pair proof v1";

/* A length-prefixed string into an HMAC. */
static void mac_str(crypto_auth_hmacsha512256_state *st, const char *s) {
  size_t n = strnlen(s, DEP_PEER_NODE_MAX);
  uint8_t l[2] = {(uint8_t)n, (uint8_t)(n >> 8)};
  crypto_auth_hmacsha512256_update(st, l, 2);
  crypto_auth_hmacsha512256_update(st, (const uint8_t *)s, n);
}

void peerauth_data_key(const uint8_t *key, size_t keylen, const char *opener,
                       const char *acceptor, uint8_t out[DEP_PEER_MAC_LEN]) {
  crypto_auth_hmacsha512256_state st;
  crypto_auth_hmacsha512256_init(&st, key, keylen);
  crypto_auth_hmacsha512256_update(&st, (const uint8_t *)peerauth_data_context,
                                   sizeof peerauth_data_context - 1);
  mac_str(&st, opener);
  mac_str(&st, acceptor);
  crypto_auth_hmacsha512256_final(&st, out);
  sodium_memzero(&st, sizeof st);
}

void peerauth_data_mac(const uint8_t dkey[DEP_PEER_MAC_LEN],
                       const uint8_t nonce[DEP_PEER_CHALLENGE_LEN],
                       const uint8_t token[DEP_PEER_TOKEN_LEN], uint8_t mac[DEP_PEER_MAC_LEN]) {
  crypto_auth_hmacsha512256_state st;
  crypto_auth_hmacsha512256_init(&st, dkey, DEP_PEER_MAC_LEN);
  crypto_auth_hmacsha512256_update(&st, (const uint8_t *)peerauth_proof_context,
                                   sizeof peerauth_proof_context - 1);
  crypto_auth_hmacsha512256_update(&st, nonce, DEP_PEER_CHALLENGE_LEN);
  crypto_auth_hmacsha512256_update(&st, token, DEP_PEER_TOKEN_LEN);
  crypto_auth_hmacsha512256_final(&st, mac);
  sodium_memzero(&st, sizeof st);
}

bool peerauth_data_check(const uint8_t dkey[DEP_PEER_MAC_LEN],
                         const uint8_t nonce[DEP_PEER_CHALLENGE_LEN],
                         const uint8_t token[DEP_PEER_TOKEN_LEN],
                         const uint8_t mac[DEP_PEER_MAC_LEN]) {
  uint8_t want[DEP_PEER_MAC_LEN];
  peerauth_data_mac(dkey, nonce, token, want);
  bool ok = crypto_verify_32(want, mac) == 0;
  sodium_memzero(want, sizeof want);
  return ok;
}

void peerauth_rdma_proof(const uint8_t dkey[DEP_PEER_MAC_LEN], uint32_t version,
                         const uint8_t token[DEP_PEER_TOKEN_LEN],
                         uint8_t proof[DEP_XFER_RDMA_PROOF_LEN]) {
  crypto_auth_hmacsha512256_state st;
  uint8_t mac[DEP_PEER_MAC_LEN];
  const uint8_t v[4] = {(uint8_t)version, (uint8_t)(version >> 8), (uint8_t)(version >> 16),
                        (uint8_t)(version >> 24)};
  crypto_auth_hmacsha512256_init(&st, dkey, DEP_PEER_MAC_LEN);
  crypto_auth_hmacsha512256_update(&st, (const uint8_t *)peerauth_rdma_context,
                                   sizeof peerauth_rdma_context - 1);
  crypto_auth_hmacsha512256_update(&st, v, sizeof v);
  crypto_auth_hmacsha512256_update(&st, token, DEP_PEER_TOKEN_LEN);
  crypto_auth_hmacsha512256_final(&st, mac);
  memcpy(proof, mac, DEP_XFER_RDMA_PROOF_LEN);
  sodium_memzero(&st, sizeof st);
  sodium_memzero(mac, sizeof mac);
}

bool peerauth_rdma_check(const uint8_t dkey[DEP_PEER_MAC_LEN], uint32_t version,
                         const uint8_t token[DEP_PEER_TOKEN_LEN],
                         const uint8_t proof[DEP_XFER_RDMA_PROOF_LEN]) {
  uint8_t want[DEP_XFER_RDMA_PROOF_LEN];
  peerauth_rdma_proof(dkey, version, token, want);
  bool ok = sodium_memcmp(want, proof, sizeof want) == 0;
  sodium_memzero(want, sizeof want);
  return ok;
}

void peerauth_qp_proof(const uint8_t dkey[DEP_PEER_MAC_LEN],
                       const uint8_t token[DEP_PEER_TOKEN_LEN], uint64_t mbox_addr,
                       uint32_t mbox_rkey,
                       uint8_t proof[DEP_PEER_QP_PROOF_LEN]) {
  crypto_auth_hmacsha512256_state st;
  uint8_t mac[DEP_PEER_MAC_LEN], mbox[12];
  for (int i = 0; i < 8; i++)
    mbox[i] = (uint8_t)(mbox_addr >> (8 * i));
  for (int i = 0; i < 4; i++)
    mbox[8 + i] = (uint8_t)(mbox_rkey >> (8 * i));
  crypto_auth_hmacsha512256_init(&st, dkey, DEP_PEER_MAC_LEN);
  crypto_auth_hmacsha512256_update(&st, (const uint8_t *)peerauth_qp_context,
                                   sizeof peerauth_qp_context - 1);
  crypto_auth_hmacsha512256_update(&st, token, DEP_PEER_TOKEN_LEN);
  crypto_auth_hmacsha512256_update(&st, mbox, sizeof mbox);
  crypto_auth_hmacsha512256_final(&st, mac);
  memcpy(proof, mac, DEP_PEER_QP_PROOF_LEN);
  sodium_memzero(&st, sizeof st);
  sodium_memzero(mac, sizeof mac);
}

bool peerauth_qp_check(const uint8_t dkey[DEP_PEER_MAC_LEN],
                       const uint8_t token[DEP_PEER_TOKEN_LEN], uint64_t mbox_addr,
                       uint32_t mbox_rkey,
                       const uint8_t proof[DEP_PEER_QP_PROOF_LEN]) {
  uint8_t want[DEP_PEER_QP_PROOF_LEN];
  peerauth_qp_proof(dkey, token, mbox_addr, mbox_rkey, want);
  bool ok = sodium_memcmp(want, proof, sizeof want) == 0;
  sodium_memzero(want, sizeof want);
  return ok;
}
