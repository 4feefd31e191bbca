/*
 * check_config.c — the configuration module (DESIGN §9): the shipped file is
 * the defaults, every key lands in the struct, every kind of bad input is
 * refused with "FILE:LINE:COLUMN: what is wrong", and every account a file
 * names exists.  The bounds on the file itself are check_config_bounds.c's,
 * and what a reload copies and which changes need a restart are
 * check_config_reload.c's.  Run from the repository root (make check does).
 */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml.h>

#include "config.h"
#include "config_keys.h"
#include "configtest.h"
#include "deepep.h"
#include "testutil.h"

#define SHIPPED "config/deepepd.yaml"

/* ---- the shipped file ------------------------------------------------------ */

START_TEST(shipped_file_sets_every_key_to_its_default) {
  /* Over garbage: a key missing from the file would leave garbage behind and fail below. */
  struct config *c = malloc(sizeof *c), want;
  memset(c, 0xa5, sizeof *c);
  int rc = config_load_file(c, SHIPPED, ct_err, sizeof ct_err);
  ck_assert_msg(rc == 0, "%s", ct_err);
  config_defaults(&want);
  ct_assert_same_config(c, &want);
  free(c);
}
END_TEST

/* The dotted path of every leaf key of the shipped file ("pool.chunk_size", "peers"). */
static size_t shipped_keys(char keys[][64], size_t max) {
  const char *text = ct_read_text(SHIPPED);
  yaml_parser_t p;
  yaml_document_t d;
  ck_assert(yaml_parser_initialize(&p));
  yaml_parser_set_input_string(&p, (const unsigned char *)text, strlen(text));
  ck_assert(yaml_parser_load(&p, &d));
  yaml_node_t *root = yaml_document_get_root_node(&d);
  ck_assert(root != NULL && root->type == YAML_MAPPING_NODE);
  size_t n = 0;
  for (yaml_node_pair_t *a = root->data.mapping.pairs.start; a < root->data.mapping.pairs.top;
       a++) {
    yaml_node_t *k = yaml_document_get_node(&d, a->key), *v = yaml_document_get_node(&d, a->value);
    if (v->type != YAML_MAPPING_NODE) {
      ck_assert(n < max);
      snprintf(keys[n++], 64, "%s", (char *)k->data.scalar.value);
      continue;
    }
    for (yaml_node_pair_t *b = v->data.mapping.pairs.start; b < v->data.mapping.pairs.top; b++) {
      yaml_node_t *k2 = yaml_document_get_node(&d, b->key);
      ck_assert(n < max);
      snprintf(keys[n++], 64, "%s.%s", (char *)k->data.scalar.value, (char *)k2->data.scalar.value);
    }
  }
  yaml_document_delete(&d);
  yaml_parser_delete(&p);
  return n;
}

START_TEST(shipped_file_has_every_documented_key) {
  char keys[64][64];
  size_t n = shipped_keys(keys, 64);
  ck_assert_uint_eq(n, 40); /* socket 3, allow 3, pool 4, listen 2, metrics 1, limits 10, and 17
                              at the top */
}
END_TEST

/* Every key of the shipped file stands in the text at path as before, the key, after. */
static void assert_documents_every_key(const char *path, const char *before, const char *after) {
  char keys[64][64];
  size_t n = shipped_keys(keys, 64);
  const char *text = ct_read_text(path);
  for (size_t i = 0; i < n; i++) {
    char needle[80];
    snprintf(needle, sizeof needle, "%s%s%s", before, keys[i], after);
    ck_assert_msg(strstr(text, needle) != NULL, "%s has no '%s'", path, needle);
  }
}

START_TEST(configuration_doc_documents_every_key) {
  assert_documents_every_key("docs/configuration.md", "`", "`");
}
END_TEST

START_TEST(man_page_documents_every_key) {
  assert_documents_every_key("man/deepepd.yaml.5", ".B ", "\n");
}
END_TEST

/* Each key has one entry (.TP, then the key in bold) in deepepd.yaml(5): a second one is a copy
 * that the next edit changes in one place only (warn_first_call_ratio once had two). */
START_TEST(man_page_has_one_entry_per_key) {
  char keys[64][64];
  size_t n = shipped_keys(keys, 64);
  const char *text = ct_read_text("man/deepepd.yaml.5");
  for (size_t i = 0; i < n; i++) {
    char needle[80];
    snprintf(needle, sizeof needle, ".TP\n.B %s\n", keys[i]);
    size_t count = 0;
    for (const char *p = strstr(text, needle); p != NULL; p = strstr(p + 1, needle))
      count++;
    ck_assert_msg(count == 1, "man/deepepd.yaml.5 has %zu entries for '%s'", count, keys[i]);
  }
}
END_TEST

START_TEST(empty_documents_give_the_defaults) {
  static const char *const empty[] = {"",    "\n",    "# nothing but a comment\n",
                                      "~\n", "---\n", "--- ~\n...\n"};
  struct config c, want;
  config_defaults(&want);
  for (size_t i = 0; i < sizeof empty / sizeof empty[0]; i++) {
    ct_load_ok(&c, empty[i]);
    ct_assert_same_config(&c, &want);
  }
  /* An empty section keeps its defaults too. */
  ct_load_ok(&c, "pool:\nlimits: ~\nsocket:\n");
  ct_assert_same_config(&c, &want);
}
END_TEST

/* 0, the daemon chooses (480 MiB for an arena peer GPUs map, one allocation on the host: job.c),
 * is the default, a file that does not name the key keeps it, and a file may say it. */
START_TEST(max_allocation_defaults_to_0_the_daemon_chooses) {
  struct config c;
  config_defaults(&c);
  ck_assert_uint_eq(c.pool_max_allocation, 0);
  ct_load_ok(&c, "pool:\n  chunk_size: 32MiB\n");
  ck_assert_uint_eq(c.pool_max_allocation, 0);
  ct_load_ok(&c, "pool:\n  max_allocation: 480MiB\n");
  ck_assert_uint_eq(c.pool_max_allocation, 480ull << 20);
  ct_load_ok(&c, "pool:\n  max_allocation: 0\n");
  ck_assert_uint_eq(c.pool_max_allocation, 0);
}
END_TEST

/* ---- values ---------------------------------------------------------------- */

/* metrics.listen: an IPv4 address or a bracketed IPv6 one, and a port; "" for none. */
START_TEST(metrics_listen_takes_a_numeric_address_and_a_port) {
  static const struct {
    const char *yaml, *host;
    uint16_t port;
  } good[] = {
      {"metrics:\n  listen: 127.0.0.1:9464\n", "127.0.0.1", 9464},
      {"metrics:\n  listen: 0.0.0.0:1\n", "0.0.0.0", 1},
      {"metrics:\n  listen: \"[::1]:65535\"\n", "::1", 65535},
      {"metrics:\n  listen: \"[fe80::1:2]:80\"\n", "fe80::1:2", 80},
  };
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    struct config c;
    ct_load_ok(&c, good[i].yaml);
    char host[64], why[200];
    uint16_t port = 0;
    ck_assert_msg(config_listen_split(c.metrics_listen, host, sizeof host, &port, why,
                                      sizeof why) == 0, "%s: %s", c.metrics_listen, why);
    ck_assert_str_eq(host, good[i].host);
    ck_assert_uint_eq(port, good[i].port);
  }
  struct config c;
  ct_load_ok(&c, "metrics:\n  listen: \"\"\n");
  ck_assert_str_eq(c.metrics_listen, "");
}
END_TEST

START_TEST(every_key_lands_in_the_struct) {
  struct config c;
  ct_load_ok(&c, "socket:\n  path: /tmp/d/x.sock\n  mode: 0600\n  group: gpu\n"
              "allow:\n  users: [alice, \"1001\"]\n  groups: [trainers]\n  any_user: yes\n"
              "backend: host\n"
              "devices: [" CT_UUID1 ", " CT_UUID2 "]\n"
              "pool:\n  size_per_device: 16 GiB\n  chunk_size: 2MiB\n  max_allocation: 6MiB\n"
              "  host_size: 536870912\n"
              "preallocation: off\nbuffer_cache_enabled: No\nkernel_warmup: FALSE\n"
              "adaptive_optimization: yes\n"
              "warn_first_call_ratio: 2.25\n"
              "connection_pool_size: 1024\n"
              "listen:\n  address: 0.0.0.0\n  port: 65535\n"
              "peers:\n  - host: node02\n    port: 7000\n  - {host: 10.0.0.3}\n"
              "peer_key_file: /etc/deepepd/peer.key\n"
              "limits:\n  max_clients: 65536\n  max_jobs: 4096\n  attach_timeout_ms: 3600000\n"
              "  op_timeout_ms: 1\n  client_queue_bytes: 64KiB\n"
              "log_level: debug\n");
  ck_assert_str_eq(c.socket_path, "/tmp/d/x.sock");
  ck_assert_uint_eq(c.socket_mode, 0600);
  ck_assert_str_eq(c.socket_group, "gpu");
  ck_assert_uint_eq(c.n_allow_users, 2);
  ck_assert_str_eq(c.allow_users[0], "alice");
  ck_assert_str_eq(c.allow_users[1], "1001");
  ck_assert_uint_eq(c.n_allow_groups, 1);
  ck_assert_str_eq(c.allow_groups[0], "trainers");
  ck_assert(c.allow_any_user);
  ck_assert_int_eq(c.backend, CONFIG_BACKEND_HOST);
  ck_assert_uint_eq(c.n_devices, 2);
  ck_assert_str_eq(c.devices[0], CT_UUID1);
  ck_assert_str_eq(c.devices[1], CT_UUID2);
  ck_assert_uint_eq(c.pool_size_per_device, 16ull << 30);
  ck_assert_uint_eq(c.pool_chunk_size, 2ull << 20);
  ck_assert_uint_eq(c.pool_max_allocation, 6ull << 20);
  ck_assert_uint_eq(c.host_pool_size, 512ull << 20);
  ck_assert(!c.preallocation);
  ck_assert(!c.buffer_cache_enabled);
  ck_assert(!c.kernel_warmup);
  ck_assert(c.adaptive_optimization);
  ck_assert_double_eq(c.warn_first_call_ratio, 2.25);
  ck_assert_uint_eq(c.connection_pool_size, 1024);
  ck_assert_str_eq(c.listen_address, "0.0.0.0");
  ck_assert_uint_eq(c.listen_port, 65535);
  ck_assert_uint_eq(c.n_peers, 2);
  ck_assert_str_eq(c.peers[0].host, "node02");
  ck_assert_uint_eq(c.peers[0].port, 7000);
  ck_assert_str_eq(c.peers[1].host, "10.0.0.3");
  ck_assert_uint_eq(c.peers[1].port, 7470);
  ck_assert_str_eq(c.peer_key_file, "/etc/deepepd/peer.key");
  ck_assert_uint_eq(c.max_clients, 65536);
  ck_assert_uint_eq(c.max_jobs, 4096);
  ck_assert_uint_eq(c.attach_timeout_ms, 3600000);
  ck_assert_uint_eq(c.op_timeout_ms, 1);
  ck_assert_uint_eq(c.client_queue_bytes, 64u << 10);
  ck_assert_int_eq(c.log_level, CONFIG_LOG_DEBUG);
}
END_TEST

START_TEST(socket_mode_is_octal_however_written) {
  static const char *const forms[] = {"0660", "\"0660\"", "'660'", "660", "0o660"};
  struct config c;
  for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
    char yaml[64];
    snprintf(yaml, sizeof yaml, "socket:\n  mode: %s\n", forms[i]);
    ct_load_ok(&c, yaml);
    ck_assert_msg(c.socket_mode == 0660, "mode %s read as 0%o", forms[i], c.socket_mode);
  }
  ct_load_ok(&c, "socket:\n  mode: 0777\n");
  ck_assert_uint_eq(c.socket_mode, 0777);
}
END_TEST

START_TEST(sizes_and_booleans_in_every_spelling) {
  static const struct {
    const char *text;
    unsigned long long bytes;
  } sizes[] = {{"4194304", 4ull << 20},  {"4MiB", 4ull << 20}, {"4 MiB", 4ull << 20},
               {"4096KiB", 4ull << 20},  {"4mib", 4ull << 20}, {"\"4MiB\"", 4ull << 20},
               {"4194304B", 4ull << 20}, {"1GiB", 1ull << 30}};
  struct config c;
  char yaml[96];
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    snprintf(yaml, sizeof yaml, "limits:\n  client_queue_bytes: %s\n", sizes[i].text);
    ct_load_ok(&c, yaml);
    ck_assert_msg(c.client_queue_bytes == sizes[i].bytes, "%s read as %u", sizes[i].text,
                  c.client_queue_bytes);
  }
  ct_load_ok(&c, "pool:\n  size_per_device: 1TiB\n  chunk_size: 1GiB\n");
  ck_assert_uint_eq(c.pool_size_per_device, 1ull << 40);
  ct_load_ok(&c, "pool:\n  max_allocation: 448 MiB\n");
  ck_assert_uint_eq(c.pool_max_allocation, 448ull << 20);
  ct_load_ok(&c, "pool:\n  max_allocation: 2097152\n");
  ck_assert_uint_eq(c.pool_max_allocation, 2ull << 20);
  ct_load_ok(&c, "pool:\n  max_allocation: 64TiB\n");
  ck_assert_uint_eq(c.pool_max_allocation, 64ull << 40);
  static const char *const yes[] = {"true", "True", "TRUE", "yes", "Yes", "on", "ON"};
  static const char *const no[] = {"false", "False", "no", "NO", "off", "Off"};
  for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
    snprintf(yaml, sizeof yaml, "peer_insecure: %s\n", yes[i]);
    ct_load_ok(&c, yaml);
    ck_assert_msg(c.peer_insecure, "%s read as false", yes[i]);
  }
  for (size_t i = 0; i < sizeof no / sizeof no[0]; i++) {
    snprintf(yaml, sizeof yaml, "preallocation: %s\n", no[i]);
    ct_load_ok(&c, yaml);
    ck_assert_msg(!c.preallocation, "%s read as true", no[i]);
  }
}
END_TEST

START_TEST(the_transport_is_the_daemons_unless_a_peer_names_its_own) {
  struct config c;
  ct_load_ok(&c, "peers: [{host: a}, {host: b, transport: tcp}, {host: c, transport: rdma}]\npeer_insecure: true\n");
  ck_assert_int_eq(c.transport, CONFIG_TRANSPORT_AUTO); /* the default */
  ck_assert_int_eq(c.peers[0].transport, CONFIG_TRANSPORT_DEFAULT);
  ck_assert_int_eq(config_peer_transport(&c, &c.peers[0]), CONFIG_TRANSPORT_AUTO);
  ck_assert_int_eq(config_peer_transport(&c, &c.peers[1]), CONFIG_TRANSPORT_TCP);
  ck_assert_int_eq(config_peer_transport(&c, &c.peers[2]), CONFIG_TRANSPORT_RDMA);
  ct_load_ok(&c, "transport: rdma\npeers: [{host: a}, {host: b, transport: auto}]\npeer_insecure: true\n");
  ck_assert_int_eq(config_peer_transport(&c, &c.peers[0]), CONFIG_TRANSPORT_RDMA);
  ck_assert_int_eq(config_peer_transport(&c, &c.peers[1]), CONFIG_TRANSPORT_AUTO);
}
END_TEST

START_TEST(a_file_changes_only_the_keys_it_names) {
  struct config c, want;
  ct_load_ok(&c, "allow:\n  users: [a, b, c]\nlog_level: debug\n");
  /* A second file over the first (what a reload does): lists are replaced, other keys stay. */
  ck_assert_msg(ct_load(&c, "allow:\n  users: [d]\npool:\n  chunk_size: 4MiB\n") == 0, "%s",
                ct_err);
  config_defaults(&want);
  want.n_allow_users = 1;
  strcpy(want.allow_users[0], "d");
  want.log_level = CONFIG_LOG_DEBUG;
  want.pool_chunk_size = 4u << 20;
  ct_assert_same_config(&c, &want);
  ck_assert_msg(ct_load(&c, "allow:\n  users: []\n") == 0, "%s", ct_err);
  ck_assert_uint_eq(c.n_allow_users, 0);
}
END_TEST

START_TEST(socket_path_limit_is_sun_path) {
  char path[200], yaml[256];
  struct config c;
  memset(path, 'p', sizeof path);
  path[0] = '/';
  path[107] = '\0'; /* 107 bytes + NUL fits sun_path */
  snprintf(yaml, sizeof yaml, "socket:\n  path: %s\n", path);
  ct_load_ok(&c, yaml);
  ck_assert_str_eq(c.socket_path, path);
  path[107] = 'p';
  path[108] = '\0';
  snprintf(yaml, sizeof yaml, "socket:\n  path: %s\n", path);
  ck_assert_int_eq(ct_load(&c, yaml), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err,
                   "t.yaml:2:9: 'socket.path' is 108 bytes; a Unix socket path must be shorter "
                   "than 108 bytes (sun_path): pick a shorter directory");
}
END_TEST

START_TEST(names_of_enums) {
  ck_assert_str_eq(config_backend_name(CONFIG_BACKEND_AUTO), "auto");
  ck_assert_str_eq(config_backend_name(CONFIG_BACKEND_CUDA), "cuda");
  ck_assert_str_eq(config_backend_name(CONFIG_BACKEND_HOST), "host");
  ck_assert_str_eq(config_backend_name((enum config_backend)42), "unknown");
  ck_assert_str_eq(config_log_level_name(CONFIG_LOG_ERR), "err");
  ck_assert_str_eq(config_log_level_name(CONFIG_LOG_WARNING), "warning");
  ck_assert_str_eq(config_log_level_name(CONFIG_LOG_NOTICE), "notice");
  ck_assert_str_eq(config_log_level_name(CONFIG_LOG_INFO), "info");
  ck_assert_str_eq(config_log_level_name(CONFIG_LOG_DEBUG), "debug");
  ck_assert_str_eq(config_transport_name(CONFIG_TRANSPORT_AUTO), "auto");
  ck_assert_str_eq(config_transport_name(CONFIG_TRANSPORT_RDMA), "rdma");
  ck_assert_str_eq(config_transport_name(CONFIG_TRANSPORT_TCP), "tcp");
  ck_assert_str_eq(config_transport_name(CONFIG_TRANSPORT_DEFAULT), "default");
  struct config c;
  ct_load_ok(&c, "log_level: warn\n");
  ck_assert_int_eq(c.log_level, CONFIG_LOG_WARNING);
  ct_load_ok(&c, "log_level: error\n");
  ck_assert_int_eq(c.log_level, CONFIG_LOG_ERR);
}
END_TEST

/* ---- errors: each kind of bad input, with its exact place and message ------------- */

/* One line per case reads better than the column limit here. */
/* clang-format off */
static const struct bad {
  const char *yaml, *message;
} bad_inputs[] = {
    /* unknown keys, at the top and inside sections */
    {"log_level: info\nfoo: 1\n",
     "t.yaml:2:1: unknown key 'foo' at the top level (known: socket, allow, backend, devices, pool, "
     "preallocation, buffer_cache_enabled, kernel_warmup, kernel_cache_dir, adaptive_optimization, "
     "warn_first_call_ratio, connection_pool_size, proxy_threads, "
     "stream_chunk_rows, listen, peers, "
     "peer_key_file, peer_insecure, peer_wait_ms, transport, metrics, limits, log_level)"},
    {"adaptive_optimization: sometimes\n",
     "t.yaml:1:24: expected a boolean (true/false) for 'adaptive_optimization', got 'sometimes'"},
    /* warn_first_call_ratio: a plain number from 1.0 to 100 */
    {"warn_first_call_ratio: nan\n", "t.yaml:1:24: expected a number for 'warn_first_call_ratio', got 'nan'"},
    {"warn_first_call_ratio: 0.99\n", "t.yaml:1:24: 'warn_first_call_ratio' must be between 1.0 and 100, got 0.99"},
    {"warn_first_call_ratio: 100.5\n", "t.yaml:1:24: 'warn_first_call_ratio' must be between 1.0 and 100, got 100.5"},
    {"pool:\n  chunk_size: 64MiB\n  sise_per_device: 8GiB\n",
     "t.yaml:3:3: unknown key 'sise_per_device' in 'pool' (known: size_per_device, chunk_size, max_allocation, "
     "host_size)"},
    {"limits:\n  max_job: 3\n",
     "t.yaml:2:3: unknown key 'max_job' in 'limits' (known: max_clients, max_jobs, attach_timeout_ms, "
     "op_timeout_ms, client_queue_bytes, hello_timeout_ms, reserved_clients, max_clients_per_uid, "
     "max_jobs_per_uid, memory_per_uid)"},
    {"peers:\n  - host: a\n    prot: 1\n", "t.yaml:3:5: unknown key 'prot' in 'peers[0]' (known: host, port, transport)"},
    {"? [a]\n: 1\n", "t.yaml:1:3: a key must be a plain name, not a list"},
    /* wrong types */
    {"preallocation: maybe\n", "t.yaml:1:16: expected a boolean (true/false) for 'preallocation', got 'maybe'"},
    {"kernel_warmup:\n", "t.yaml:1:15: expected a boolean (true/false) for 'kernel_warmup', got an empty value"},
    {"kernel_cache_dir: cache\n", "t.yaml:1:19: 'kernel_cache_dir' must be an absolute path (or \"\" for none)"},
    {"transport: fast\n", "t.yaml:1:12: expected one of auto, rdma, tcp for 'transport', got 'fast'"},
    {"peers: [{host: b, transport: ib}]\n",
     "t.yaml:1:30: expected one of auto, rdma, tcp for 'peers[0].transport', got 'ib'"},
    /* peers or a listener with neither a key nor peer_insecure: the daemon could not start */
    {"peers:\n  - {host: a}\n",
     "t.yaml:2:3: 'peers' is set but 'peer_key_file' is not: peers could not authenticate; write a "
     "key (deepepctl genkey /etc/deepepd/peer.key) and set peer_key_file to it on every node, or, "
     "for tests on one machine only, set peer_insecure: true"},
    {"listen:\n  address: 10.0.0.1\npeer_insecure: false\n",
     "t.yaml:2:12: 'listen.address' is set but 'peer_key_file' is not: peers could not "
     "authenticate; write a key (deepepctl genkey /etc/deepepd/peer.key) and set peer_key_file to "
     "it on every node, or, for tests on one machine only, set peer_insecure: true"},
    /* one peer or GPU listed twice (the port's default and a UUID's spelling do not hide it) */
    {"peers:\n  - {host: a}\n  - {host: A, port: 7470}\n",
     "t.yaml:3:5: 'peers[1]' repeats 'peers[0]' (A port 7470); list each peer once"},
    {"devices:\n  - GPU-5fa1c2e0-1b2c-3d4e-5f60-718293a4b5c6\n"
     "  - 5FA1C2E0-1B2C-3D4E-5F60-718293A4B5C6\n",
     "t.yaml:3:5: 'devices[1]' names the GPU of 'devices[0]' again; list each once"},
    {"allow:\n  any_user: [yes]\n", "t.yaml:2:13: expected a boolean (true/false) for 'allow.any_user', got a list"},
    {"limits:\n  max_jobs: lots\n", "t.yaml:2:13: expected a decimal integer for 'limits.max_jobs', got 'lots'"},
    {"connection_pool_size: 2.5\n",
     "t.yaml:1:23: expected a decimal integer for 'connection_pool_size', got '2.5'"},
    {"connection_pool_size: 010\n",
     "t.yaml:1:23: expected a decimal integer for 'connection_pool_size', got '010'"},
    {"pool:\n  chunk_size: big\n",
     "t.yaml:2:15: expected a size (bytes, or a number with KiB, MiB, GiB or TiB) for 'pool.chunk_size', got 'big'"},
    {"pool:\n  chunk_size: -2MiB\n",
     "t.yaml:2:15: expected a size (bytes, or a number with KiB, MiB, GiB or TiB) for 'pool.chunk_size', got '-2MiB'"},
    {"peer_key_file: [a, b]\n", "t.yaml:1:16: expected a string for 'peer_key_file', got a list"},
    {"socket:\n  group: {a: 1}\n", "t.yaml:2:10: expected a string for 'socket.group', got a mapping"},
    {"allow:\n  users: alice\n", "t.yaml:2:10: expected a list of names for 'allow.users', got 'alice'"},
    {"devices: GPU-0\n", "t.yaml:1:10: expected a list of GPU UUIDs for 'devices', got 'GPU-0'"},
    {"peers: {host: a}\n", "t.yaml:1:8: expected a list of {host, port} mappings for 'peers', got a mapping"},
    {"peers:\n  - node02:7470\n", "t.yaml:2:5: expected a mapping {host, port} for 'peers[0]', got 'node02:7470'"},
    {"pool: 5\n", "t.yaml:1:7: expected a mapping of keys for 'pool', got '5'"},
    {"backend: gpu\n", "t.yaml:1:10: expected one of auto, cuda, host for 'backend', got 'gpu'"},
    {"log_level: loud\n", "t.yaml:1:12: expected one of err, warning, notice, info, debug for 'log_level', got 'loud'"},
    {"socket:\n  mode: rw-rw----\n", "t.yaml:2:9: expected a file mode in octal (like 0660) for 'socket.mode', got 'rw-rw----'"},
    {"socket:\n  mode: 0680\n", "t.yaml:2:9: expected a file mode in octal (like 0660) for 'socket.mode', got '0680'"},
    /* out of range, both ends of each ranged key */
    {"connection_pool_size: 0\n", "t.yaml:1:23: 'connection_pool_size' must be between 1 and 1024, got 0"},
    {"connection_pool_size: 1025\n", "t.yaml:1:23: 'connection_pool_size' must be between 1 and 1024, got 1025"},
    {"limits:\n  max_clients: 0\n", "t.yaml:2:16: 'limits.max_clients' must be between 1 and 65536, got 0"},
    {"limits:\n  max_clients: 65537\n", "t.yaml:2:16: 'limits.max_clients' must be between 1 and 65536, got 65537"},
    {"limits:\n  max_jobs: -1\n", "t.yaml:2:13: 'limits.max_jobs' must be between 1 and 4096, got -1"},
    {"limits:\n  max_jobs: 4097\n", "t.yaml:2:13: 'limits.max_jobs' must be between 1 and 4096, got 4097"},
    {"limits:\n  max_jobs: 99999999999999999999999\n",
     "t.yaml:2:13: 'limits.max_jobs' must be between 1 and 4096, got 99999999999999999999999"},
    {"limits:\n  attach_timeout_ms: 0\n",
     "t.yaml:2:22: 'limits.attach_timeout_ms' must be between 1 and 3600000, got 0"},
    {"limits:\n  attach_timeout_ms: 3600001\n",
     "t.yaml:2:22: 'limits.attach_timeout_ms' must be between 1 and 3600000, got 3600001"},
    {"limits:\n  op_timeout_ms: 0\n", "t.yaml:2:18: 'limits.op_timeout_ms' must be between 1 and 3600000, got 0"},
    {"limits:\n  op_timeout_ms: 3600001\n",
     "t.yaml:2:18: 'limits.op_timeout_ms' must be between 1 and 3600000, got 3600001"},
    {"limits:\n  client_queue_bytes: 65535\n",
     "t.yaml:2:23: 'limits.client_queue_bytes' must be between 64 KiB and 1 GiB, got 65535"},
    {"limits:\n  client_queue_bytes: 1025MiB\n",
     "t.yaml:2:23: 'limits.client_queue_bytes' must be between 64 KiB and 1 GiB, got 1025MiB"},
    {"listen:\n  port: 0\n", "t.yaml:2:9: 'listen.port' must be between 1 and 65535, got 0"},
    {"listen:\n  port: 65536\n", "t.yaml:2:9: 'listen.port' must be between 1 and 65535, got 65536"},
    {"peers:\n  - {host: a, port: 70000}\n", "t.yaml:2:21: 'peers[0].port' must be between 1 and 65535, got 70000"},
    {"socket:\n  mode: 01777\n", "t.yaml:2:9: 'socket.mode' must be at most 0777, got 01777"},
    {"pool:\n  size_per_device: 1MiB\n",
     "t.yaml:2:20: 'pool.size_per_device' must be between 2 MiB and 64 TiB, got 1MiB"},
    {"pool:\n  host_size: 99999999999999999999999999GiB\n",
     "t.yaml:2:14: 'pool.host_size' must be between 2 MiB and 64 TiB, got 99999999999999999999999999GiB"},
    {"pool:\n  max_allocation: 1MiB\n",
     "t.yaml:2:19: 'pool.max_allocation' must be 0 (the daemon chooses) or between 2 MiB and 64 TiB, got 1MiB"},
    {"pool:\n  max_allocation: 65TiB\n",
     "t.yaml:2:19: 'pool.max_allocation' must be 0 (the daemon chooses) or between 2 MiB and 64 TiB, got 65TiB"},
    /* 0 is no bound here, not the daemon's choice: the message says what 0 means for the key */
    {"limits:\n  memory_per_uid: 1MiB\n",
     "t.yaml:2:19: 'limits.memory_per_uid' must be 0 (no bound per user) or between 2 MiB and 64 TiB, got 1MiB"},
    {"pool:\n  max_allocation: lots\n",
     "t.yaml:2:19: expected a size (bytes, or a number with KiB, MiB, GiB or TiB) for 'pool.max_allocation', got 'lots'"},
    /* duplicates name the first occurrence */
    {"log_level: info\npreallocation: true\nlog_level: debug\n", "t.yaml:3:1: duplicate key 'log_level' (first at line 1)"},
    {"pool:\n  chunk_size: 2MiB\n  host_size: 1GiB\n  chunk_size: 4MiB\n",
     "t.yaml:4:3: duplicate key 'pool.chunk_size' (first at line 2)"},
    {"socket: {path: /a, path: /b}\n", "t.yaml:1:20: duplicate key 'socket.path' (first at line 1)"},
    /* sizes and the pool's arithmetic */
    {"pool:\n  host_size: 1GB\n", "t.yaml:2:14: unknown size unit 'GB' in 'pool.host_size' (use B, KiB, MiB, GiB or TiB)"},
    /* sizes are whole numbers: a fraction is named as such, with the same size spelled whole when there is one */
    {"pool:\n  host_size: 1.5GiB\n",
     "t.yaml:2:14: 'pool.host_size' must be a whole number of bytes or of KiB, MiB, GiB or TiB, got 1.5GiB; write 1536 MiB"},
    {"limits:\n  client_queue_bytes: 1.25 MiB\n",
     "t.yaml:2:23: 'limits.client_queue_bytes' must be a whole number of bytes or of KiB, MiB, GiB or TiB, got 1.25 MiB; write 1280 KiB"},
    {"limits:\n  client_queue_bytes: 0.5KiB\n",
     "t.yaml:2:23: 'limits.client_queue_bytes' must be a whole number of bytes or of KiB, MiB, GiB or TiB, got 0.5KiB; write 512"},
    {"pool:\n  host_size: 2.0GiB\n",
     "t.yaml:2:14: 'pool.host_size' must be a whole number of bytes or of KiB, MiB, GiB or TiB, got 2.0GiB; write 2 GiB"},
    {"pool:\n  host_size: 1.3GiB\n",
     "t.yaml:2:14: 'pool.host_size' must be a whole number of bytes or of KiB, MiB, GiB or TiB, got 1.3GiB"},
    {"pool:\n  host_size: 1.5\n",
     "t.yaml:2:14: 'pool.host_size' must be a whole number of bytes or of KiB, MiB, GiB or TiB, got 1.5"},
    {"pool:\n  host_size: 1.5GB\n", "t.yaml:2:14: unknown size unit 'GB' in 'pool.host_size' (use B, KiB, MiB, GiB or TiB)"},
    {"limits:\n  client_queue_bytes: 4 megs\n",
     "t.yaml:2:23: unknown size unit 'megs' in 'limits.client_queue_bytes' (use B, KiB, MiB, GiB or TiB)"},
    {"pool:\n  chunk_size: 3MiB\n",
     "t.yaml:2:15: 'pool.chunk_size' must be a multiple of 2 MiB (the CUDA VMM granularity), got 3 MiB"},
    {"pool:\n  max_allocation: 3MiB\n",
     "t.yaml:2:19: 'pool.max_allocation' must be a multiple of 2 MiB (the CUDA VMM granularity), got 3 MiB"},
    {"pool:\n  chunk_size: 2MiB\n  max_allocation: 511MiB\n",
     "t.yaml:3:19: 'pool.max_allocation' must be a multiple of 2 MiB (the CUDA VMM granularity), got 511 MiB"},
    {"pool:\n  max_allocation: 4194305\n",
     "t.yaml:2:19: 'pool.max_allocation' must be a multiple of 2 MiB (the CUDA VMM granularity), got 4194305 bytes"},
    {"pool:\n  chunk_size: 6MiB\n",
     "t.yaml:2:15: 'pool.size_per_device' (8 GiB) must be a whole number of chunks of 'pool.chunk_size' (6 MiB)"},
    {"pool:\n  size_per_device: 64MiB\n  chunk_size: 128MiB\n",
     "t.yaml:2:20: 'pool.size_per_device' (64 MiB) must be a whole number of chunks of 'pool.chunk_size' (128 MiB)"},
    {"pool:\n  host_size: 100MiB\n",
     "t.yaml:2:14: 'pool.host_size' (100 MiB) must be a whole number of chunks of 'pool.chunk_size' (64 MiB)"},
    /* strings and lists */
    {"socket:\n  path: \"\"\n", "t.yaml:2:9: 'socket.path' must not be empty"},
    {"peer_key_file: \"/var/\\tkey\"\n", "t.yaml:1:16: 'peer_key_file' must not contain control characters"},
    {"peer_key_file: \"a\\0b\"\n", "t.yaml:1:16: 'peer_key_file' must not contain control characters"},
    {"allow:\n  groups: [\"gpu users\"]\n", "t.yaml:2:12: 'allow.groups[0]' must not contain spaces"},
    {"allow:\n  users: [a, ~]\n", "t.yaml:2:14: 'allow.users[1]' is empty"},
    {"devices: [0]\n",
     "t.yaml:1:11: 'devices[0]' is not a GPU UUID (like GPU-5fa1c2e0-1b2c-3d4e-5f60-718293a4b5c6; "
     "`nvidia-smi -L` lists them)"},
    {"peers:\n  - port: 7000\n", "t.yaml:2:5: 'peers[0]' needs a 'host'"},
    {"socket:\n  group: a-group-name-that-goes-on-and-on-and-on-well-past-sixty-four-bytes\n",
     "t.yaml:2:10: 'socket.group' is too long (66 bytes, at most 63)"},
    /* metrics.listen: ADDRESS:PORT, numeric */
    {"metrics:\n  listen: 9464\n",
     "t.yaml:2:11: 'metrics.listen': '9464' is not ADDRESS:PORT; write ADDRESS:PORT with a numeric address, e.g. 127.0.0.1:9464, [::1]:9464, or 0.0.0.0:9464 for every interface"},
    {"metrics:\n  listen: localhost:9464\n",
     "t.yaml:2:11: 'metrics.listen': 'localhost' is not a numeric IPv4 address (a host name is not "
     "resolved here); write ADDRESS:PORT with a numeric address, e.g. 127.0.0.1:9464, [::1]:9464, or 0.0.0.0:9464 for every interface"},
    {"metrics:\n  listen: \":9464\"\n",
     "t.yaml:2:11: 'metrics.listen': ':9464' has no address; write ADDRESS:PORT with a numeric address, e.g. 127.0.0.1:9464, [::1]:9464, or 0.0.0.0:9464 for every interface"},
    {"metrics:\n  listen: 127.0.0.1:0\n",
     "t.yaml:2:11: 'metrics.listen': the port of '127.0.0.1:0' must be a number from 1 to 65535"},
    {"metrics:\n  listen: 127.0.0.1:65536\n",
     "t.yaml:2:11: 'metrics.listen': the port of '127.0.0.1:65536' must be a number from 1 to 65535"},
    {"metrics:\n  listen: 127.0.0.1:http\n",
     "t.yaml:2:11: 'metrics.listen': the port of '127.0.0.1:http' must be a number from 1 to 65535"},
    {"metrics:\n  listen: ::1:9464\n",
     "t.yaml:2:11: 'metrics.listen': '::1:9464': an IPv6 address goes in brackets ([::1]:9464)"},
    {"metrics:\n  listen: \"[::1]9464\"\n",
     "t.yaml:2:11: 'metrics.listen': '[::1]9464' has no ']:PORT' after its IPv6 address; write ADDRESS:PORT with a numeric address, e.g. 127.0.0.1:9464, [::1]:9464, or 0.0.0.0:9464 for every interface"},
    {"metrics:\n  listen: \"[10.0.0.1]:9464\"\n",
     "t.yaml:2:11: 'metrics.listen': '10.0.0.1' is not a numeric IPv6 address (a host name is not "
     "resolved here); write ADDRESS:PORT with a numeric address, e.g. 127.0.0.1:9464, [::1]:9464, or 0.0.0.0:9464 for every interface"},
    {"metrics:\n  listen: 127.0.0.1:9464 \n  port: 1\n",
     "t.yaml:3:3: unknown key 'port' in 'metrics' (known: listen)"},
    /* the document itself */
    {"- a\n- b\n", "t.yaml:1:1: the top level must be a mapping of keys (like 'socket:'), got a list"},
    {"hello\n", "t.yaml:1:1: the top level must be a mapping of keys (like 'socket:'), got 'hello'"},
    {"log_level: info\n---\nlog_level: debug\n",
     "t.yaml:3:1: a config file holds one YAML document; remove this second one"},
    {"log_level: [info\n",
     "t.yaml:2:1: YAML syntax error: did not find expected ',' or ']' (while parsing a flow sequence at line 1)"},
    {"pool:\n  chunk_size: 2MiB\n bad\n",
     "t.yaml:3:2: YAML syntax error: did not find expected key (while parsing a block mapping at line 1)"},
    {"log_level: a: b\n", "t.yaml:1:13: YAML syntax error: mapping values are not allowed in this context"},
    {"log_level: *nope\n", "t.yaml:1:12: YAML syntax error: found undefined alias"},
    {"log_level: info\nbackend: \xff\n", "t.yaml:2:10: YAML syntax error: invalid leading UTF-8 octet"},
};
/* clang-format on */

START_TEST(bad_input_is_refused_with_its_place) {
  const struct bad *b = &bad_inputs[_i];
  struct config c, before;
  config_defaults(&c);
  /* Something not default, to see that a refused file changes nothing. */
  c.max_jobs = 7;
  strcpy(c.socket_group, "before");
  memcpy(&before, &c, sizeof c);
  int rc = ct_load(&c, b->yaml);
  ck_assert_msg(rc == DEP_ERR_CONFIG, "accepted (%d):\n%s", rc, b->yaml);
  ck_assert_str_eq(ct_err, b->message);
  ck_assert_msg(memcmp(&c, &before, sizeof c) == 0, "a refused file changed the struct");
}
END_TEST

START_TEST(a_refused_file_leaves_the_struct_alone) {
  /* The good keys before the bad one must not leak through. */
  struct config c, before;
  config_defaults(&c);
  memcpy(&before, &c, sizeof c);
  ck_assert_int_eq(ct_load(&c, "log_level: debug\nallow:\n  users: [x]\npool:\n  chunk_size: 2MiB\n"
                            "preallocation: maybe\n"),
                   DEP_ERR_CONFIG);
  ck_assert(memcmp(&c, &before, sizeof c) == 0);
}
END_TEST

START_TEST(list_limits) {
  char yaml[4096] = "allow:\n  users:\n";
  for (int i = 0; i < 64; i++)
    snprintf(yaml + strlen(yaml), sizeof yaml - strlen(yaml), "    - u%d\n", i);
  struct config c;
  ct_load_ok(&c, yaml);
  ck_assert_uint_eq(c.n_allow_users, 64);
  ck_assert_str_eq(c.allow_users[63], "u63");
  strcat(yaml, "    - one-too-many\n");
  ck_assert_int_eq(ct_load(&c, yaml), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err, "t.yaml:67:7: too many entries in 'allow.users' (at most 64)");
}
END_TEST

/* ---- files --------------------------------------------------------------------------------- */

START_TEST(files_are_named_in_messages) {
  char dir[256], path[300];
  tu_tmpdir(dir, sizeof dir);
  struct config c;
  config_defaults(&c);

  snprintf(path, sizeof path, "%s/missing.yaml", dir);
  ck_assert_int_eq(config_load_file(&c, path, ct_err, sizeof ct_err), DEP_ERR_CONFIG);
  char want[600];
  snprintf(want, sizeof want, "%s: cannot read: No such file or directory", path);
  ck_assert_str_eq(ct_err, want);

  ck_assert_int_eq(config_load_file(&c, dir, ct_err, sizeof ct_err), DEP_ERR_CONFIG);
  snprintf(want, sizeof want, "%s: cannot read: Is a directory", dir);
  ck_assert_str_eq(ct_err, want);

  snprintf(path, sizeof path, "%s/bad.yaml", dir);
  ck_assert_int_eq(tu_write_file(path, "# a comment\nlimits:\n  max_jobs: 0\n"), 0);
  ck_assert_int_eq(config_load_file(&c, path, ct_err, sizeof ct_err), DEP_ERR_CONFIG);
  snprintf(want, sizeof want, "%s:3:13: 'limits.max_jobs' must be between 1 and 4096, got 0", path);
  ck_assert_str_eq(ct_err, want);

  /* Permissions do not stop root, so this part only means something for other users. */
  if (geteuid() != 0) {
    ck_assert_int_eq(chmod(path, 0), 0);
    ck_assert_int_eq(config_load_file(&c, path, ct_err, sizeof ct_err), DEP_ERR_CONFIG);
    snprintf(want, sizeof want, "%s: cannot read: Permission denied", path);
    ck_assert_str_eq(ct_err, want);
  }

  snprintf(path, sizeof path, "%s/good.yaml", dir);
  ck_assert_int_eq(tu_write_file(path, "limits:\n  max_jobs: 5\n"), 0);
  ck_assert_int_eq(config_load_file(&c, path, ct_err, sizeof ct_err), 0);
  ck_assert_uint_eq(c.max_jobs, 5);
  ck_assert_str_eq(ct_err, "");
  tu_rmtree(dir);
}
END_TEST

START_TEST(short_error_buffers_are_cut_not_overrun) {
  struct config c;
  config_defaults(&c);
  char small[12];
  memset(small, 'x', sizeof small);
  ck_assert_int_eq(config_load_buffer(&c, "t.yaml", "foo: 1\n", 7, small, 8), DEP_ERR_CONFIG);
  ck_assert_str_eq(small, "t.yaml:");
  ck_assert_int_eq(small[8], 'x');
  ck_assert_int_eq(config_load_buffer(&c, "t.yaml", "foo: 1\n", 7, NULL, 0), DEP_ERR_CONFIG);
}
END_TEST

/* deepepd --check-config FILE: exit 0 on the shipped file, non-zero with the message on a bad one.
 */
static int check_config_cli(const char *file, char *out, size_t len) {
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    execl(tu_bin("deepepd"), "deepepd", "--check-config", file, (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  size_t n = 0;
  ssize_t r;
  while (n + 1 < len && (r = read(fds[0], out + n, len - 1 - n)) > 0)
    n += (size_t)r;
  out[n] = '\0';
  close(fds[0]);
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

START_TEST(check_config_option_reports_the_place) {
  char out[4096], dir[256], path[300], want[400];
  ck_assert_msg(access(tu_bin("deepepd"), X_OK) == 0, "%s not built", tu_bin("deepepd"));
  int rc = check_config_cli(SHIPPED, out, sizeof out);
  ck_assert_msg(rc == 0, "deepepd --check-config %s exited %d:\n%s", SHIPPED, rc, out);
  tu_tmpdir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/bad.yaml", dir);
  ck_assert_int_eq(tu_write_file(path, "pool:\n  chunk_size: 3MiB\n"), 0);
  rc = check_config_cli(path, out, sizeof out);
  ck_assert_msg(rc != 0, "deepepd --check-config accepted a bad file:\n%s", out);
  snprintf(want, sizeof want, "%s:2:15: 'pool.chunk_size' must be a multiple of 2 MiB", path);
  ck_assert_msg(strstr(out, want) != NULL, "output lacks \"%s\":\n%s", want, out);
  tu_rmtree(dir);
}
END_TEST

/* ---- accounts: every user and group the file names exists ------------------------------------- */

START_TEST(accounts_that_do_not_exist_are_named_with_their_key) {
  struct config c;
  char why[2048];
  ct_load_ok(&c, "socket:\n  group: no-such-group-4d2\n"
              "allow:\n  users: [root, \"65534\", no-such-user-4d2]\n"
              "  groups: [root, \"4242\", no-such-group-4d3]\n");
  ck_assert_uint_eq(config_check_accounts(&c, CONFIG_ACCOUNTS_ALL, why, sizeof why), 3);
  ck_assert_str_eq(why, "'socket.group' is 'no-such-group-4d2': no such group on this host "
                        "(getent group lists them); 'allow.users' lists 'no-such-user-4d2': no "
                        "such user on this host (getent passwd lists them); 'allow.groups' lists "
                        "'no-such-group-4d3': no such group on this host (getent group lists "
                        "them)");
  ck_assert_uint_eq(config_check_accounts(&c, CONFIG_ACCOUNTS_SOCKET, why, sizeof why), 1);
  ck_assert_str_eq(why, "'socket.group' is 'no-such-group-4d2': no such group on this host "
                        "(getent group lists them)");
  ck_assert_uint_eq(config_check_accounts(&c, CONFIG_ACCOUNTS_ALLOW, NULL, 0), 2);
  /* Names that exist and numeric ids pass; the defaults name nobody. */
  ct_load_ok(&c, "socket:\n  group: root\nallow:\n  users: [root, \"12345\"]\n  groups: [\"0\"]\n");
  ck_assert_uint_eq(config_check_accounts(&c, CONFIG_ACCOUNTS_ALL, why, sizeof why), 0);
  ck_assert_str_eq(why, "");
  config_defaults(&c);
  ck_assert_uint_eq(config_check_accounts(&c, CONFIG_ACCOUNTS_ALL, why, sizeof why), 0);
}
END_TEST

START_TEST(check_config_option_checks_that_accounts_exist) {
  static const struct {
    const char *yaml, *said;
  } cases[] = {
      {"socket:\n  group: no-such-group-4d2\n", "'socket.group' is 'no-such-group-4d2': no such group"},
      {"allow:\n  users: [root, no-such-user-4d2]\n", "'allow.users' lists 'no-such-user-4d2': no such user"},
      {"allow:\n  groups: [no-such-group-4d3]\n", "'allow.groups' lists 'no-such-group-4d3': no such group"},
  };
  char out[4096], dir[256], path[300], want[400];
  tu_tmpdir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/accounts.yaml", dir);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ck_assert_int_eq(tu_write_file(path, cases[i].yaml), 0);
    ck_assert_int_eq(check_config_cli(path, out, sizeof out), 1);
    snprintf(want, sizeof want, "%s: %s", path, cases[i].said);
    ck_assert_msg(strstr(out, want) != NULL, "output lacks \"%s\":\n%s", want, out);
  }
  ck_assert_int_eq(tu_write_file(path, "socket:\n  group: root\nallow:\n  users: [\"4242\"]\n"), 0);
  ck_assert_int_eq(check_config_cli(path, out, sizeof out), 0);
  tu_rmtree(dir);
}
END_TEST

Suite *config_suite(void);
Suite *config_suite(void) {
  Suite *s = suite_create("config");
  TCase *t = tcase_create("shipped");
  tcase_add_test(t, shipped_file_sets_every_key_to_its_default);
  tcase_add_test(t, shipped_file_has_every_documented_key);
  tcase_add_test(t, configuration_doc_documents_every_key);
  tcase_add_test(t, man_page_documents_every_key);
  tcase_add_test(t, man_page_has_one_entry_per_key);
  tcase_add_test(t, empty_documents_give_the_defaults);
  tcase_add_test(t, max_allocation_defaults_to_0_the_daemon_chooses);
  suite_add_tcase(s, t);

  t = tcase_create("values");
  tcase_add_test(t, every_key_lands_in_the_struct);
  tcase_add_test(t, metrics_listen_takes_a_numeric_address_and_a_port);
  tcase_add_test(t, socket_mode_is_octal_however_written);
  tcase_add_test(t, sizes_and_booleans_in_every_spelling);
  tcase_add_test(t, the_transport_is_the_daemons_unless_a_peer_names_its_own);
  tcase_add_test(t, a_file_changes_only_the_keys_it_names);
  tcase_add_test(t, socket_path_limit_is_sun_path);
  tcase_add_test(t, names_of_enums);
  suite_add_tcase(s, t);

  t = tcase_create("errors");
  tcase_add_loop_test(t, bad_input_is_refused_with_its_place, 0,
                      (int)(sizeof bad_inputs / sizeof bad_inputs[0]));
  tcase_add_test(t, a_refused_file_leaves_the_struct_alone);
  tcase_add_test(t, list_limits);
  tcase_add_test(t, files_are_named_in_messages);
  tcase_add_test(t, short_error_buffers_are_cut_not_overrun);
  tcase_add_test(t, check_config_option_reports_the_place);
  suite_add_tcase(s, t);

  t = tcase_create("accounts");
  tcase_add_test(t, accounts_that_do_not_exist_are_named_with_their_key);
  tcase_add_test(t, check_config_option_checks_that_accounts_exist);
  suite_add_tcase(s, t);
  return s;
}
