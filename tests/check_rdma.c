/*
 * check_rdma.c — the daemon's seam to libibverbs and librdmacm
 * (daemon/rdmadrv.c): where rdma-core is installed it loads and resolves
 * every entry point the RDMA transport needs, and the probe lists zero or
 * more devices without failing; where a library is absent (played by
 * $DEEPEPD_LIBIBVERBS / $DEEPEPD_LIBRDMACM naming a file that does not
 * exist) the seam says so, and a real daemon still starts, says why once
 * (peers configured or not) and answers STATUS.  The daemon links neither library.  An RDMA queue
 * pair's request, a data queue pair's or a link's, proves the peer key
 * (peerauth_rdma_proof, peerauth_qp_proof): the proof holds for its own
 * key, direction, token and version or mailbox only.
 *
 * Each test runs in its own forked process, so each loads the seam afresh
 * with the environment it set.
 */
#include <check.h>
#include <dlfcn.h>
#include <sodium.h>
#include <sys/types.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "daemonwire.h"
#include "dlload.h"
#include "nicreg.h"
#include "peerauth.h"
#include "rdmadrv.h"
#include "testutil.h"

#define ABSENT_IBVERBS "/nonexistent/deepepd-test/libibverbs.so.1"
#define ABSENT_RDMACM "/nonexistent/deepepd-test/librdmacm.so.1"

/* Whether rdma-core's runtime libraries are on this machine (CI installs them). */
static bool have_rdma_core(const char *test) {
  const char *libs[] = {"libibverbs.so.1", "librdmacm.so.1"};
  for (size_t i = 0; i < 2; i++) {
    void *h = dlopen(libs[i], RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
      tu_skip(test, "%s is not installed here (make deps installs it)", libs[i]);
      return false;
    }
    dlclose(h);
  }
  return true;
}

/* How often needle occurs in haystack. */
static int count_of(const char *haystack, const char *needle) {
  int n = 0;
  for (const char *p = haystack; (p = strstr(p, needle)) != NULL; p += strlen(needle))
    n++;
  return n;
}

START_TEST(test_seam_loads_and_resolves_every_entry_point) {
  if (!have_rdma_core(__func__))
    return;
  char why[256] = "";
  const struct rdmadrv *rd = rdmadrv_load(why, sizeof why);
  ck_assert_msg(rd != NULL, "rdmadrv_load: %s", why);
#define CHECK_ROW(part, field, sym)                                                    \
  ck_assert_msg(rd->part.field != NULL, "%s is not resolved", #sym);
#define CHECK_IBV(field, sym, ver, ret, params) CHECK_ROW(ibv, field, sym)
#define CHECK_CM(field, sym, ver, ret, params) CHECK_ROW(cm, field, sym)
  RDMADRV_IBV(CHECK_IBV)
  RDMADRV_CM(CHECK_CM)
  /* A second load is the same table. */
  ck_assert_ptr_eq(rdmadrv_load(NULL, 0), rd);
}
END_TEST

START_TEST(test_probe_lists_zero_or_more_devices_without_failing) {
  if (!have_rdma_core(__func__))
    return;
  const struct rdmadrv *rd = rdmadrv_load(NULL, 0);
  ck_assert_ptr_nonnull(rd);
  char text[256] = "";
  int n = rdmadrv_probe(text, sizeof text);
  ck_assert_int_ge(n, 0);
  ck_assert_msg(text[0] != '\0', "the probe gives status no text");
  int listed = -1;
  struct ibv_device **list = rd->ibv.get_device_list(&listed);
  if (list != NULL) {
    ck_assert_int_le(n, listed); /* it counts the devices it could open */
    if (listed == 0)
      ck_assert_str_eq(text, "no RDMA devices");
    rd->ibv.free_device_list(list);
  } else {
    ck_assert_int_eq(n, 0);
  }
  /* The probe runs once: the same answer again. */
  char again[256] = "";
  ck_assert_int_eq(rdmadrv_probe(again, sizeof again), n);
  ck_assert_str_eq(again, text);
}
END_TEST

START_TEST(test_absent_libibverbs_is_reported_cleanly) {
  ck_assert_int_eq(setenv(RDMADRV_ENV_IBVERBS, ABSENT_IBVERBS, 1), 0);
  char why[256] = "";
  ck_assert_ptr_null(rdmadrv_load(why, sizeof why));
  ck_assert_msg(strstr(why, ABSENT_IBVERBS) != NULL && strstr(why, "not found") != NULL &&
                    strstr(why, RDMADRV_ENV_IBVERBS) != NULL,
                "why: %s", why);
  char text[256] = "";
  ck_assert_int_eq(rdmadrv_probe(text, sizeof text), 0);
  ck_assert_str_eq(text, why);
}
END_TEST

START_TEST(test_absent_librdmacm_is_reported_cleanly) {
  if (!have_rdma_core(__func__))
    return;
  ck_assert_int_eq(setenv(RDMADRV_ENV_RDMACM, ABSENT_RDMACM, 1), 0);
  char why[256] = "";
  ck_assert_ptr_null(rdmadrv_load(why, sizeof why));
  ck_assert_msg(strstr(why, ABSENT_RDMACM) != NULL && strstr(why, RDMADRV_ENV_RDMACM) != NULL,
                "why: %s", why);
  ck_assert_int_eq(rdmadrv_probe(NULL, 0), 0);
}
END_TEST

START_TEST(test_daemon_without_libibverbs_starts_says_why_once_and_serves_status) {
  ck_assert_int_eq(setenv(RDMADRV_ENV_IBVERBS, ABSENT_IBVERBS, 1), 0);
  struct tu_daemon d;
  dw_start(&d, NULL); /* the daemon inherits the environment */
  char state[32];
  ck_assert_ptr_nonnull(tu_daemon_state(d.sock, state, sizeof state));
  ck_assert_str_ne(state, "starting");
  /* A reload is a second chance to repeat it. */
  int fd = dw_client(&d);
  struct dep_msg_reload_ok out;
  dw_reload(fd, 10, &out);
  close(fd);
  ck_assert(dw_log_has(&d, "peer daemons will use TCP", 2000));
  char *log = tu_daemon_log(&d);
  ck_assert_msg(count_of(log, "peer daemons will use TCP") == 1 &&
                    count_of(log, ABSENT_IBVERBS) == 1,
                "the reason is not logged exactly once:\n%s", log);
  ck_assert_msg(count_of(log, "<6>rdma: " ABSENT_IBVERBS) == 1, "not at info:\n%s", log);
  free(log);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_daemon_logs_the_rdma_devices_or_why_there_are_none) {
  if (!have_rdma_core(__func__))
    return;
  ck_assert_int_eq(unsetenv(RDMADRV_ENV_IBVERBS), 0);
  ck_assert_int_eq(unsetenv(RDMADRV_ENV_RDMACM), 0);
  struct tu_daemon d;
  dw_start(&d, NULL);
  char text[256];
  int n = rdmadrv_probe(text, sizeof text); /* what this machine has, as the daemon sees it */
  char *log = tu_daemon_log(&d);
  if (n == 0)
    ck_assert_msg(count_of(log, "peer daemons will use TCP") == 1, "log:\n%s", log);
  else
    ck_assert_msg(count_of(log, "node GUID") >= n && strstr(log, "will use TCP") == NULL,
                  "%d devices (%s); log:\n%s", n, text, log);
  free(log);
  dw_stop_ok(&d);
}
END_TEST

/*
 * A daemon with a peer (transport auto) where RDMA cannot be had: the reason
 * and "use TCP" are logged once at start.  The peer is a port nobody serves;
 * it is only there so that the RDMA transport tries to open, as it does on a
 * real node.
 */
#define PEER_YAML "peers: [{host: 127.0.0.1, port: 1}]\npeer_insecure: true\n"

static void expect_tcp_said_once(const char *why) {
  struct tu_daemon d;
  dw_start(&d, PEER_YAML);
  ck_assert(dw_log_has(&d, "peer daemons will use TCP", 2000));
  char *log = tu_daemon_log(&d);
  ck_assert_msg(count_of(log, "use TCP") == 1 && count_of(log, why) == 1,
                "not said exactly once ('%s'):\n%s", why, log);
  free(log);
  dw_stop_ok(&d);
}

START_TEST(test_daemon_with_peers_says_once_that_they_use_tcp) {
  /* No libibverbs (played by a path that does not exist). */
  ck_assert_int_eq(setenv(RDMADRV_ENV_IBVERBS, ABSENT_IBVERBS, 1), 0);
  expect_tcp_said_once(ABSENT_IBVERBS);
  /* rdma-core installed, no device: what a machine without a NIC logs (the
   * probe's reason, and the connection manager's "no RDMA devices" before). */
  ck_assert_int_eq(unsetenv(RDMADRV_ENV_IBVERBS), 0);
  char why[256];
  if (rdmadrv_load(why, sizeof why) == NULL) {
    tu_skip_part(__func__, "rdma-core cannot be loaded here (%s; make deps installs it)", why);
    return;
  }
  if (rdmadrv_probe(why, sizeof why) > 0) {
    tu_skip_part(__func__, "this machine has an RDMA device (%s): the no-device part needs "
                           "one without", why);
    return;
  }
  expect_tcp_said_once(why);
}
END_TEST

START_TEST(test_daemon_links_neither_libibverbs_nor_librdmacm) {
  char cmd[1024];
  dw_sfmt(cmd, sizeof cmd, "ldd '%s' 2>&1", tu_bin("deepepd"));
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  char all[16384] = "";
  size_t len = fread(all, 1, sizeof all - 1, p);
  all[len] = '\0';
  int st = pclose(p);
  ck_assert_msg(st == 0 && strstr(all, "libc.so") != NULL, "ldd failed:\n%s", all);
  ck_assert_msg(strstr(all, "libibverbs") == NULL && strstr(all, "librdmacm") == NULL,
                "deepepd links rdma-core (it must dlopen it):\n%s", all);
}
END_TEST

/* ---- exchange regions as the NIC sees them (nicreg.h) ------------------------ */

START_TEST(test_a_window_names_a_registered_exchange_region_and_no_other) {
  /* A registered region: its window is its address and key, for writers from its first byte. */
  static uint8_t region[8192];
  struct ibv_mr mr = {.rkey = 0x33};
  struct dep_peer_window w = nicreg_window(5, region, sizeof region, &mr);
  ck_assert_uint_eq(w.rank_index, 5);
  ck_assert_uint_eq(w.slab_off, 0);
  ck_assert_uint_eq(w.len, sizeof region);
  ck_assert_uint_eq(w.addr, (uint64_t)(uintptr_t)region);
  ck_assert_uint_eq(w.rkey, 0x33);
  /* One that could not be registered: no key and no address, so no peer writes into it. */
  w = nicreg_window(1, region, sizeof region, NULL);
  ck_assert_uint_eq(w.rank_index, 1);
  ck_assert_uint_eq(w.len, sizeof region);
  ck_assert_uint_eq(w.rkey, 0);
  ck_assert_uint_eq(w.addr, 0);
}
END_TEST

/* ---- the proof that opens a data queue pair (peerauth.h) ------------------------ */

START_TEST(test_a_data_queue_pair_proof_holds_for_its_key_direction_and_token_only) {
  ck_assert_int_ge(sodium_init(), 0);
  uint8_t key[PEERAUTH_KEY_MIN], other[PEERAUTH_KEY_MIN];
  memset(key, 0x5a, sizeof key);
  memset(other, 0x5a, sizeof other);
  other[7] ^= 1; /* a peer_key_file that differs in one bit */
  /* node-b opens a queue pair into node-a: the key both derive for that direction. */
  uint8_t dkey[DEP_PEER_MAC_LEN], back[DEP_PEER_MAC_LEN], nokey[DEP_PEER_MAC_LEN],
      insecure[DEP_PEER_MAC_LEN];
  peerauth_data_key(key, sizeof key, "node-b", "node-a", dkey);
  peerauth_data_key(key, sizeof key, "node-a", "node-b", back);
  peerauth_data_key(other, sizeof other, "node-b", "node-a", nokey);
  peerauth_data_key(key, 0, "node-b", "node-a", insecure);
  uint8_t tok[DEP_PEER_TOKEN_LEN], tok2[DEP_PEER_TOKEN_LEN];
  randombytes_buf(tok, sizeof tok);
  memcpy(tok2, tok, sizeof tok2);
  tok2[DEP_PEER_TOKEN_LEN - 1] ^= 0x80; /* another offer's token (nonce), one bit apart */
  uint8_t proof[DEP_XFER_RDMA_PROOF_LEN], p[DEP_XFER_RDMA_PROOF_LEN];
  peerauth_rdma_proof(dkey, DEP_XFER_VERSION, tok, proof);
  /* The opener's own proof holds, and the accepting end makes the same. */
  ck_assert(peerauth_rdma_check(dkey, DEP_XFER_VERSION, tok, proof));
  /* Made without the key: refused. */
  peerauth_rdma_proof(nokey, DEP_XFER_VERSION, tok, p);
  ck_assert_msg(!peerauth_rdma_check(dkey, DEP_XFER_VERSION, tok, p),
                "a proof made with another peer_key_file was taken");
  peerauth_rdma_proof(insecure, DEP_XFER_VERSION, tok, p);
  ck_assert_msg(!peerauth_rdma_check(dkey, DEP_XFER_VERSION, tok, p),
                "a proof made with an empty key was taken");
  /* Made for the other direction (the key the acceptor itself would open with): refused. */
  peerauth_rdma_proof(back, DEP_XFER_VERSION, tok, p);
  ck_assert_msg(!peerauth_rdma_check(dkey, DEP_XFER_VERSION, tok, p),
                "a proof for the other direction was taken");
  /* Replayed against another offer's token, the nonce it answers: refused. */
  ck_assert_msg(!peerauth_rdma_check(dkey, DEP_XFER_VERSION, tok2, proof),
                "a proof seen for one token was taken for another");
  /* Of another data stream version: refused. */
  ck_assert_msg(!peerauth_rdma_check(dkey, DEP_XFER_VERSION + 1, tok, proof),
                "a proof made for another version was taken");
  /* Any one bit of it wrong: refused. */
  for (size_t i = 0; i < sizeof proof; i++) {
    memcpy(p, proof, sizeof p);
    p[i] ^= 1;
    ck_assert_msg(!peerauth_rdma_check(dkey, DEP_XFER_VERSION, tok, p), "byte %zu flipped: taken",
                  i);
  }
  /* It is not the TCP data connections' proof of the same token: a proof
   * seen on one kind of connection answers the other kind never. */
  uint8_t mac[DEP_PEER_MAC_LEN];
  peerauth_data_mac(dkey, tok, tok, mac);
  ck_assert_msg(!peerauth_rdma_check(dkey, DEP_XFER_VERSION, tok, mac),
                "a TCP data connection's proof was taken for a queue pair");
}
END_TEST

START_TEST(test_a_link_queue_pair_proof_holds_for_its_key_direction_token_and_mailbox_only) {
  ck_assert_int_ge(sodium_init(), 0);
  uint8_t key[PEERAUTH_KEY_MIN], other[PEERAUTH_KEY_MIN];
  memset(key, 0x3c, sizeof key);
  memcpy(other, key, sizeof other);
  other[0] ^= 1;
  uint8_t dkey[DEP_PEER_MAC_LEN], back[DEP_PEER_MAC_LEN], nokey[DEP_PEER_MAC_LEN];
  peerauth_data_key(key, sizeof key, "node-b", "node-a", dkey);
  peerauth_data_key(key, sizeof key, "node-a", "node-b", back);
  peerauth_data_key(other, sizeof other, "node-b", "node-a", nokey);
  uint8_t tok[DEP_PEER_TOKEN_LEN], tok2[DEP_PEER_TOKEN_LEN];
  randombytes_buf(tok, sizeof tok);
  memcpy(tok2, tok, sizeof tok2);
  /* Another offer whose token's first bytes, all the request names, are the same. */
  tok2[DEP_PEER_TOKEN_LEN - 1] ^= 1;
  const uint64_t mbox = 0x7f0012345000ull;
  const uint32_t rkey = 0x1234;
  uint8_t proof[DEP_PEER_QP_PROOF_LEN], p[DEP_PEER_QP_PROOF_LEN];
  peerauth_qp_proof(dkey, tok, mbox, rkey, proof);
  ck_assert(peerauth_qp_check(dkey, tok, mbox, rkey, proof));
  peerauth_qp_proof(nokey, tok, mbox, rkey, p);
  ck_assert_msg(!peerauth_qp_check(dkey, tok, mbox, rkey, p), "a proof without the key was taken");
  peerauth_qp_proof(back, tok, mbox, rkey, p);
  ck_assert_msg(!peerauth_qp_check(dkey, tok, mbox, rkey, p),
                "a proof for the other direction was taken");
  ck_assert_msg(!peerauth_qp_check(dkey, tok2, mbox, rkey, proof),
                "a proof for one offer was taken for another with the same first bytes");
  /* The same proof with another mailbox (someone else's, to be written to): refused. */
  ck_assert_msg(!peerauth_qp_check(dkey, tok, mbox + 64, rkey, proof), "another mailbox was taken");
  ck_assert_msg(!peerauth_qp_check(dkey, tok, mbox, rkey ^ 1, proof), "another rkey was taken");
  for (size_t i = 0; i < sizeof proof; i++) {
    memcpy(p, proof, sizeof p);
    p[i] ^= 0x40;
    ck_assert_msg(!peerauth_qp_check(dkey, tok, mbox, rkey, p), "byte %zu flipped: taken", i);
  }
  /* Not a data queue pair's proof of the same token, nor the other way round. */
  uint8_t dp[DEP_XFER_RDMA_PROOF_LEN];
  peerauth_rdma_proof(dkey, DEP_XFER_VERSION, tok, dp);
  memset(p, 0, sizeof p);
  memcpy(p, dp, sizeof dp);
  ck_assert_msg(!peerauth_qp_check(dkey, tok, mbox, rkey, p),
                "a data queue pair's proof was taken");
  ck_assert_msg(!peerauth_rdma_check(dkey, DEP_XFER_VERSION, tok, proof),
                "a link's proof was taken for a data queue pair");
}
END_TEST

/* ---- the shared loader (proto/dlload.h), which cudadrv.c and rdmadrv.c both use ---- */

/* libc stands for a library: it is there wherever the tests run, and lacks what we name. */
#define LIBC "libc.so.6"

START_TEST(test_loader_names_the_missing_symbol_and_leaves_nothing_behind) {
  void *(*m)(size_t) = NULL, *(*opt)(void) = NULL, *(*gone)(void) = NULL;
  void *h = NULL;
  char why[256] = "";
  /* Every row there (an optional one absent): loaded, the optional one NULL. */
  struct dep_dlsym ok[] = {{.name = "malloc", .at = &m},
                           {.name = "deepep_no_such_symbol", .at = &opt, .optional = true}};
  ck_assert_int_eq(dep__dl_load(LIBC, ok, 2, &h, why, sizeof why), DEP_DL_OK);
  ck_assert_ptr_nonnull(h);
  ck_assert_ptr_nonnull(m);
  ck_assert_ptr_null(opt);
  /* A required row absent: its name in the message, and the rows resolved before it NULL. */
  struct dep_dlsym missing[] = {{.name = "malloc", .at = &m},
                                {.name = "deepep_no_such_symbol", .at = &gone}};
  ck_assert_int_eq(dep__dl_load(LIBC, missing, 2, &h, why, sizeof why), DEP_DL_NO_SYMBOL);
  ck_assert_str_eq(why, LIBC " lacks deepep_no_such_symbol");
  ck_assert_ptr_null(m);
  /* At a version the library does not have: the version is named too. */
  struct dep_dlsym versioned[] = {{.name = "malloc", .version = "DEEPEP_NO_SUCH_1.0", .at = &m}};
  ck_assert_int_eq(dep__dl_load(LIBC, versioned, 1, &h, why, sizeof why), DEP_DL_NO_SYMBOL);
  ck_assert_str_eq(why, LIBC " lacks malloc@DEEPEP_NO_SUCH_1.0");
  /* No library: dlerror's words, which name it. */
  ck_assert_int_eq(dep__dl_load(ABSENT_IBVERBS, ok, 2, &h, why, sizeof why), DEP_DL_NO_LIBRARY);
  ck_assert_msg(strstr(why, ABSENT_IBVERBS) != NULL, "why: %s", why);
}
END_TEST

/* Through the seam itself: a libibverbs without the verbs says which entry point it lacks,
 * at which version, and what to suspect. */
START_TEST(test_a_libibverbs_without_an_entry_point_is_named_with_it) {
  ck_assert_int_eq(setenv(RDMADRV_ENV_IBVERBS, LIBC, 1), 0);
  char why[256] = "";
  ck_assert_ptr_null(rdmadrv_load(why, sizeof why));
  ck_assert_str_eq(why, LIBC " lacks ibv_get_device_list@IBVERBS_1.1 (rdma-core too old?)");
}
END_TEST

Suite *rdma_suite(void);
Suite *rdma_suite(void) {
  Suite *s = suite_create("rdma");
  TCase *seam = tcase_create("seam");
  tcase_add_test(seam, test_seam_loads_and_resolves_every_entry_point);
  tcase_add_test(seam, test_probe_lists_zero_or_more_devices_without_failing);
  tcase_add_test(seam, test_absent_libibverbs_is_reported_cleanly);
  tcase_add_test(seam, test_absent_librdmacm_is_reported_cleanly);
  tcase_add_test(seam, test_loader_names_the_missing_symbol_and_leaves_nothing_behind);
  tcase_add_test(seam, test_a_libibverbs_without_an_entry_point_is_named_with_it);
  suite_add_tcase(s, seam);
  TCase *daemon = tcase_create("daemon");
  tcase_set_timeout(daemon, 60);
  tcase_add_test(daemon, test_daemon_without_libibverbs_starts_says_why_once_and_serves_status);
  tcase_add_test(daemon, test_daemon_logs_the_rdma_devices_or_why_there_are_none);
  tcase_add_test(daemon, test_daemon_with_peers_says_once_that_they_use_tcp);
  tcase_add_test(daemon, test_daemon_links_neither_libibverbs_nor_librdmacm);
  TCase *nic = tcase_create("nicreg");
  suite_add_tcase(s, nic);
  tcase_add_test(nic, test_a_window_names_a_registered_exchange_region_and_no_other);
  TCase *proof = tcase_create("proof");
  suite_add_tcase(s, proof);
  tcase_add_test(proof, test_a_data_queue_pair_proof_holds_for_its_key_direction_and_token_only);
  tcase_add_test(proof,
                 test_a_link_queue_pair_proof_holds_for_its_key_direction_token_and_mailbox_only);
  suite_add_tcase(s, daemon);
  return s;
}
