/*
 * configtest.c — the configuration suites' loader (configtest.h).
 */
#include "configtest.h"

#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

char ct_err[1024];

int ct_load(struct config *c, const char *yaml) {
  return config_load_buffer(c, "t.yaml", yaml, strlen(yaml), ct_err, sizeof ct_err);
}

void ct_load_ok(struct config *c, const char *yaml) {
  config_defaults(c);
  int rc = ct_load(c, yaml);
  ck_assert_msg(rc == 0, "refused (%d): %s\n--- yaml:\n%s", rc, ct_err, yaml);
}

char *ct_read_text(const char *path) {
  FILE *f = fopen(path, "r");
  ck_assert_msg(f != NULL, "%s: %s (run the tests from the repository root)", path,
                strerror(errno));
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  return buf;
}

/* A string field that must hold a terminated string equal to want. */
#define ck_field_str(a, b, f)                                                                      \
  do {                                                                                             \
    ck_assert_msg(memchr((a)->f, '\0', sizeof(a)->f) != NULL, #f " was never set");                \
    ck_assert_msg(strcmp((a)->f, (b)->f) == 0, #f ": '%s', want '%s'", (a)->f, (b)->f);            \
  } while (0)
/* Bools by their byte: garbage such as 0xa5 would otherwise read as "true". */
#define ck_field_bool(a, b, f)                                                                     \
  do {                                                                                             \
    unsigned char raw_;                                                                            \
    memcpy(&raw_, &(a)->f, 1);                                                                     \
    ck_assert_msg(raw_ == ((b)->f ? 1 : 0), #f ": byte 0x%02x, want %d", raw_, (b)->f ? 1 : 0);    \
  } while (0)
#define ck_field(a, b, f)                                                                          \
  ck_assert_msg((a)->f == (b)->f, #f ": %llu, want %llu", (unsigned long long)(a)->f,              \
                (unsigned long long)(b)->f)

/* Every field, one by one (padding bytes may differ, so no memcmp). */
void ct_assert_same_config(const struct config *a, const struct config *b) {
  ck_field_str(a, b, socket_path);
  ck_field(a, b, socket_mode);
  ck_field_str(a, b, socket_group);
  ck_field(a, b, n_allow_users);
  for (size_t i = 0; i < b->n_allow_users; i++)
    ck_field_str(a, b, allow_users[i]);
  ck_field(a, b, n_allow_groups);
  for (size_t i = 0; i < b->n_allow_groups; i++)
    ck_field_str(a, b, allow_groups[i]);
  ck_field_bool(a, b, allow_any_user);
  ck_field(a, b, backend);
  ck_field(a, b, n_devices);
  for (size_t i = 0; i < b->n_devices; i++)
    ck_field_str(a, b, devices[i]);
  ck_field(a, b, pool_size_per_device);
  ck_field(a, b, pool_chunk_size);
  ck_field(a, b, pool_max_allocation);
  ck_field(a, b, host_pool_size);
  ck_field_bool(a, b, preallocation);
  ck_field_bool(a, b, buffer_cache_enabled);
  ck_field_bool(a, b, kernel_warmup);
  ck_field_str(a, b, kernel_cache_dir);
  ck_field_bool(a, b, adaptive_optimization);
  ck_assert_msg(a->warn_first_call_ratio == b->warn_first_call_ratio,
                "warn_first_call_ratio: %g, want %g", a->warn_first_call_ratio,
                b->warn_first_call_ratio);
  ck_field(a, b, connection_pool_size);
  ck_field_str(a, b, listen_address);
  ck_field(a, b, listen_port);
  ck_field_str(a, b, metrics_listen);
  ck_field(a, b, n_peers);
  for (size_t i = 0; i < b->n_peers; i++) {
    ck_field_str(a, b, peers[i].host);
    ck_field(a, b, peers[i].port);
  }
  ck_field_str(a, b, peer_key_file);
  ck_field_bool(a, b, peer_insecure);
  ck_field(a, b, peer_wait_ms);
  ck_field(a, b, max_clients);
  ck_field(a, b, max_jobs);
  ck_field(a, b, attach_timeout_ms);
  ck_field(a, b, op_timeout_ms);
  ck_field(a, b, client_queue_bytes);
  ck_field(a, b, log_level);
}
