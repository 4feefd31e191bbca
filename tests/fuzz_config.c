/*
 * fuzz_config.c — libFuzzer harness for the config loader: any bytes as a
 * deepepd.yaml.  Besides "no crash, no leak, no UB" (ASan/UBSan), it checks
 * the loader's promises: a refused input leaves the struct untouched and says
 * where; an accepted one holds only values the documentation allows.
 *   make fuzz FUZZ_SECONDS=30    (seeds in tests/corpus/config/)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "deepep.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Not require(): these checks are the point of the harness and must survive NDEBUG. */
#define require(x)                                                                                 \
  do {                                                                                             \
    if (!(x)) {                                                                                    \
      fprintf(stderr, "fuzz_config: %s:%d: broken promise: %s\n", __FILE__, __LINE__, #x);         \
      abort();                                                                                     \
    }                                                                                              \
  } while (0)

static void check_string(const char *s, size_t size) { require(memchr(s, '\0', size) != NULL); }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static struct config c, before;
  char err[512];
  config_defaults(&c);
  memcpy(&before, &c, sizeof c);
  int rc = config_load_buffer(&c, "f.yaml", (const char *)data, size, err, sizeof err);
  if (rc != 0) {
    require(rc == DEP_ERR_CONFIG || rc == DEP_ERR_NO_MEMORY);
    require(memcmp(&c, &before, sizeof c) == 0);
    require(strncmp(err, "f.yaml:", 7) == 0 && strchr(err, '\n') == NULL);
    return 0;
  }
  check_string(c.socket_path, sizeof c.socket_path);
  require(c.socket_path[0] != '\0');
  require(c.socket_mode <= 0777);
  check_string(c.socket_group, sizeof c.socket_group);
  require(c.n_allow_users <= CONFIG_MAX_LIST && c.n_allow_groups <= CONFIG_MAX_LIST);
  for (size_t i = 0; i < c.n_allow_users; i++)
    check_string(c.allow_users[i], sizeof c.allow_users[i]);
  for (size_t i = 0; i < c.n_allow_groups; i++)
    check_string(c.allow_groups[i], sizeof c.allow_groups[i]);
  require(c.backend <= CONFIG_BACKEND_HOST);
  require(c.n_devices <= CONFIG_MAX_LIST);
  for (size_t i = 0; i < c.n_devices; i++)
    check_string(c.devices[i], sizeof c.devices[i]);
  require(c.pool_chunk_size % (2u << 20) == 0 && c.pool_chunk_size > 0);
  require(c.pool_size_per_device % c.pool_chunk_size == 0 &&
          c.pool_size_per_device >= c.pool_chunk_size);
  require(c.host_pool_size % c.pool_chunk_size == 0 && c.host_pool_size >= c.pool_chunk_size);
  require(c.connection_pool_size >= 1 && c.connection_pool_size <= 1024);
  check_string(c.listen_address, sizeof c.listen_address);
  require(c.listen_port >= 1);
  require(c.n_peers <= CONFIG_MAX_LIST);
  for (size_t i = 0; i < c.n_peers; i++) {
    check_string(c.peers[i].host, sizeof c.peers[i].host);
    require(c.peers[i].host[0] != '\0' && c.peers[i].port >= 1);
  }
  check_string(c.peer_key_file, sizeof c.peer_key_file);
  require(c.max_clients >= 1 && c.max_clients <= 65536);
  require(c.max_jobs >= 1 && c.max_jobs <= 4096);
  require(c.attach_timeout_ms >= 1 && c.attach_timeout_ms <= 3600000);
  require(c.op_timeout_ms >= 1 && c.op_timeout_ms <= 3600000);
  require(c.client_queue_bytes >= (64u << 10) && c.client_queue_bytes <= (1u << 30));
  require(c.log_level >= CONFIG_LOG_ERR && c.log_level <= CONFIG_LOG_DEBUG);
  char keys[256];
  size_t n = config_diff_restart(&before, &c, keys, sizeof keys);
  require((n == 0) == (keys[0] == '\0'));
  return 0;
}
