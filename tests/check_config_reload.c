/*
 * check_config_reload.c — what a reload of the configuration does with a
 * file (config/config_reload.c): the live keys need no restart, each
 * restart key is named, several are listed together, a reload copies
 * every live key and no other, and each changed live key is named with
 * both values; short buffers are cut and the counts stay right.  Each
 * changed key is named alone too (RELOAD_OK's lists), and every key of the
 * table fits those lists whole.
 */
#include <check.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "config_keys.h"
#include "configtest.h"
#include "proto.h"

START_TEST(live_keys_need_no_restart) {
  struct config a, b;
  char keys[512];
  config_defaults(&a);
  ct_load_ok(&b,
          "allow:\n  users: [alice]\n  groups: [gpu]\n  any_user: true\n"
          "kernel_warmup: false\n"
          "limits:\n  max_clients: 5\n  max_jobs: 5\n  attach_timeout_ms: 5\n  op_timeout_ms: 5\n"
          "  client_queue_bytes: 1MiB\nlog_level: debug\npool:\n  max_allocation: 256MiB\n");
  ck_assert_uint_eq(b.pool_max_allocation, 256ull << 20);
  ck_assert_uint_eq(config_diff_restart(&a, &b, keys, sizeof keys), 0);
  ck_assert_str_eq(keys, "");
  ck_assert_uint_eq(config_diff_restart(&a, &a, keys, sizeof keys), 0);
}
END_TEST

/* pool.max_allocation is read as each job's arenas are made: a reload changes it for the next
 * job, and only its section neighbours that the pool was built from need a restart. */
START_TEST(max_allocation_is_live_beside_restart_keys) {
  struct config a, b;
  char keys[512];
  config_defaults(&a);
  ct_load_ok(&b, "pool:\n  max_allocation: 1GiB\n");
  ck_assert_uint_ne(b.pool_max_allocation, a.pool_max_allocation);
  ck_assert_uint_eq(config_diff_restart(&a, &b, keys, sizeof keys), 0);
  ck_assert_str_eq(keys, "");
  ct_load_ok(&b, "pool:\n  chunk_size: 32MiB\n  max_allocation: 2MiB\n  host_size: 2GiB\n");
  ck_assert_uint_eq(config_diff_restart(&a, &b, keys, sizeof keys), 2);
  ck_assert_str_eq(keys, "pool.chunk_size, pool.host_size");
}
END_TEST

static const struct {
  const char *yaml, *key;
} restart_changes[] = {
    {"socket:\n  path: /tmp/other.sock\n", "socket.path"},
    {"socket:\n  mode: 0600\n", "socket.mode"},
    {"socket:\n  group: gpu\n", "socket.group"},
    {"backend: host\n", "backend"},
    {"devices: [" CT_UUID1 "]\n", "devices"},
    {"pool:\n  size_per_device: 4GiB\n", "pool.size_per_device"},
    {"pool:\n  chunk_size: 32MiB\n", "pool.chunk_size"},
    {"pool:\n  host_size: 2GiB\n", "pool.host_size"},
    {"preallocation: false\n", "preallocation"},
    {"buffer_cache_enabled: false\n", "buffer_cache_enabled"},
    {"connection_pool_size: 8\n", "connection_pool_size"},
    {"listen:\n  address: 10.0.0.1\n", "listen.address"},
    {"listen:\n  port: 7471\n", "listen.port"},
    {"peers: [{host: b}]\n", "peers"},
    {"peer_key_file: /etc/k\n", "peer_key_file"},
    {"peer_insecure: false\n", "peer_insecure"},
    {"peer_wait_ms: 5\n", "peer_wait_ms"},
    {"transport: tcp\n", "transport"},
    {"metrics:\n  listen: 127.0.0.1:9464\n", "metrics.listen"},
};

START_TEST(restart_keys_are_named) {
  struct config a, b;
  char keys[512];
  /* From a file with peer_insecure set, so that peers or a listener alone are a valid change
   * (without a key or it, a file with them is refused). */
  ct_load_ok(&a, "peer_insecure: true\n");
  b = a;
  int rc = ct_load(&b, restart_changes[_i].yaml);
  ck_assert_msg(rc == 0, "refused (%d): %s", rc, ct_err);
  ck_assert_uint_eq(config_diff_restart(&a, &b, keys, sizeof keys), 1);
  ck_assert_str_eq(keys, restart_changes[_i].key);
}
END_TEST

START_TEST(restart_keys_are_listed_together) {
  struct config a, b;
  char keys[512], small[10];
  ct_load_ok(&a, "peers: [{host: b, port: 1}]\npeer_insecure: true\n");
  ct_load_ok(&b, "peers: [{host: b, port: 2}]\nsocket:\n  path: /x.sock\npool:\n  chunk_size: 2MiB\n"
              "log_level: debug\npeer_insecure: true\n");
  ck_assert_uint_eq(config_diff_restart(&a, &b, keys, sizeof keys), 3);
  ck_assert_str_eq(keys, "socket.path, pool.chunk_size, peers");
  /* A short buffer is cut, terminated, and the count stays right. */
  ck_assert_uint_eq(config_diff_restart(&a, &b, small, sizeof small), 3);
  ck_assert_str_eq(small, "socket.pa");
  ck_assert_uint_eq(config_diff_restart(&a, &b, NULL, 0), 3);
}
END_TEST

/* A file that sets every key, live or not, away from its default. */
static const char every_key_changed[] =
    "socket:\n  path: /tmp/o.sock\n  mode: 0600\n  group: gpu\n"
    "allow:\n  users: [alice, bob]\n  groups: [trainers]\n  any_user: true\n"
    "backend: host\ndevices: [" CT_UUID1 "]\n"
    "pool:\n  size_per_device: 4GiB\n  chunk_size: 32MiB\n  max_allocation: 256MiB\n"
    "  host_size: 2GiB\n"
    "preallocation: false\nbuffer_cache_enabled: false\nkernel_warmup: false\n"
    "connection_pool_size: 8\nlisten:\n  address: 10.0.0.1\n  port: 7471\n"
    "peers: [{host: b}]\npeer_key_file: /etc/k\npeer_insecure: true\npeer_wait_ms: 5\n"
    "limits:\n  max_clients: 512\n  max_jobs: 5\n  attach_timeout_ms: 5\n  op_timeout_ms: 6\n"
    "  client_queue_bytes: 1MiB\n  hello_timeout_ms: 7\n  reserved_clients: 9\n"
    "  max_clients_per_uid: 10\n  max_jobs_per_uid: 11\n  memory_per_uid: 2GiB\n"
    "log_level: debug\n";

START_TEST(a_reload_copies_every_live_key_and_no_other) {
  struct config running, file, defaults;
  config_defaults(&running);
  config_defaults(&defaults);
  ct_load_ok(&file, every_key_changed);
  config_copy_live(&running, &file);
  char keys[1024];
  /* Every live key now has the file's value... */
  ck_assert_uint_eq(config_diff_live(&running, &file, keys, sizeof keys), 0);
  /* ...and every other key is as it was: all 17 still differ from the file. */
  ck_assert_uint_eq(config_diff_restart(&running, &defaults, keys, sizeof keys), 0);
  ck_assert_uint_eq(config_diff_restart(&running, &file, keys, sizeof keys), 17);
  ck_assert_uint_eq(running.n_allow_users, 2);
  ck_assert_str_eq(running.allow_users[1], "bob");
  ck_assert_uint_eq(running.memory_per_uid, 2ull << 30);
  ck_assert_int_eq(running.log_level, CONFIG_LOG_DEBUG);
  ck_assert_str_eq(running.socket_path, defaults.socket_path);
}
END_TEST

START_TEST(changed_live_keys_are_named_with_both_values) {
  struct config a, b;
  char changes[2048];
  config_defaults(&a);
  ct_load_ok(&b, "limits:\n  max_clients: 512\nlog_level: debug\nsocket:\n  mode: 0600\n");
  ck_assert_uint_eq(config_diff_live(&a, &b, changes, sizeof changes), 2);
  ck_assert_str_eq(changes, "limits.max_clients 1024 -> 512, log_level info -> debug");
  ck_assert_uint_eq(config_diff_live(&a, &a, changes, sizeof changes), 0);
  ck_assert_str_eq(changes, "");
  /* Every live key, each in its own spelling. */
  ct_load_ok(&b, every_key_changed);
  ck_assert_uint_eq(config_diff_live(&a, &b, changes, sizeof changes), 16);
  ck_assert_str_eq(changes,
                   "allow.users [] -> [alice, bob], allow.groups [] -> [trainers], "
                   "allow.any_user false -> true, pool.max_allocation 0 -> 256 MiB, "
                   "kernel_warmup true -> false, limits.max_clients 1024 -> 512, "
                   "limits.max_jobs 64 -> 5, limits.attach_timeout_ms 30000 -> 5, "
                   "limits.op_timeout_ms 10000 -> 6, limits.client_queue_bytes 4 MiB -> 1 MiB, "
                   "limits.hello_timeout_ms 5000 -> 7, limits.reserved_clients 8 -> 9, "
                   "limits.max_clients_per_uid 256 -> 10, limits.max_jobs_per_uid 16 -> 11, "
                   "limits.memory_per_uid 0 -> 2 GiB, log_level info -> debug");
  /* A short buffer is cut after a whole entry, says so, and the count stays right. */
  char small[60];
  ck_assert_uint_eq(config_diff_live(&a, &b, small, sizeof small), 16);
  ck_assert_str_eq(small, "allow.users [] -> [alice, bob], ...");
  ck_assert_uint_eq(config_diff_live(&a, &b, NULL, 0), 16);
}
END_TEST

/* RELOAD_OK's lists: each changed key by its name alone, in the file's order; a short list
 * keeps the first and the count stays right. */
START_TEST(changed_keys_are_named_one_by_one) {
  struct config a, b;
  char names[DEP_RELOAD_KEYS_MAX][DEP_RELOAD_KEY_MAX];
  config_defaults(&a);
  ct_load_ok(&b, "limits:\n  max_clients: 512\nlog_level: debug\nsocket:\n  mode: 0600\n"
                 "pool:\n  chunk_size: 32MiB\n");
  ck_assert_uint_eq(config_diff_names(&a, &b, true, names[0], sizeof names[0],
                                      DEP_RELOAD_KEYS_MAX), 2);
  ck_assert_str_eq(names[0], "limits.max_clients");
  ck_assert_str_eq(names[1], "log_level");
  ck_assert_uint_eq(config_diff_names(&a, &b, false, names[0], sizeof names[0],
                                      DEP_RELOAD_KEYS_MAX), 2);
  ck_assert_str_eq(names[0], "socket.mode");
  ck_assert_str_eq(names[1], "pool.chunk_size");
  ck_assert_uint_eq(config_diff_names(&a, &a, true, names[0], sizeof names[0],
                                      DEP_RELOAD_KEYS_MAX), 0);
  /* The same keys as the messages count, live and not. */
  ct_load_ok(&b, every_key_changed);
  ck_assert_uint_eq(config_diff_names(&a, &b, true, names[0], sizeof names[0],
                                      DEP_RELOAD_KEYS_MAX), 16);
  ck_assert_str_eq(names[15], "log_level");
  ck_assert_uint_eq(config_diff_names(&a, &b, false, names[0], sizeof names[0],
                                      DEP_RELOAD_KEYS_MAX), 17);
  ck_assert_str_eq(names[0], "socket.path");
  strcpy(names[1], "untouched");
  ck_assert_uint_eq(config_diff_names(&a, &b, false, names[0], sizeof names[0], 1), 17);
  ck_assert_str_eq(names[0], "socket.path");
  ck_assert_str_eq(names[1], "untouched");
}
END_TEST

/* The keys of a table and its sections: how many, and the longest dotted name. */
static void count_keys(const struct key *table, const char *prefix, size_t *n, size_t *longest,
                       char *which, size_t len) {
  for (const struct key *k = table; k->name != NULL; k++) {
    char full[128];
    snprintf(full, sizeof full, "%s%s%s", prefix, prefix[0] != '\0' ? "." : "", k->name);
    if (k->kind == K_SECTION) {
      count_keys(k->sub, full, n, longest, which, len);
      continue;
    }
    (*n)++;
    if (strlen(full) > *longest) {
      *longest = strlen(full);
      snprintf(which, len, "%s", full);
    }
  }
}

/* RELOAD_OK names a key in DEP_RELOAD_KEY_MAX bytes and at most DEP_RELOAD_KEYS_MAX of them in a
 * list: every key of deepepd.yaml fits, so the daemon never cuts a name or a list. */
START_TEST(every_key_fits_a_reload_answer) {
  size_t n = 0, longest = 0;
  char which[128] = "";
  count_keys(config__root_keys, "", &n, &longest, which, sizeof which);
  ck_assert_uint_gt(n, 20); /* the walk found the table */
  ck_assert_msg(n <= DEP_RELOAD_KEYS_MAX, "%zu keys; RELOAD_OK lists %d", n, DEP_RELOAD_KEYS_MAX);
  ck_assert_msg(longest < DEP_RELOAD_KEY_MAX, "%s: %zu bytes; RELOAD_OK names %d with the NUL",
                which, longest, DEP_RELOAD_KEY_MAX);
}
END_TEST

Suite *config_reload_suite(void);
Suite *config_reload_suite(void) {
  Suite *s = suite_create("config_reload");
  TCase *t = tcase_create("reload");
  tcase_add_test(t, a_reload_copies_every_live_key_and_no_other);
  tcase_add_test(t, changed_live_keys_are_named_with_both_values);
  tcase_add_test(t, live_keys_need_no_restart);
  tcase_add_test(t, max_allocation_is_live_beside_restart_keys);
  tcase_add_loop_test(t, restart_keys_are_named, 0,
                      (int)(sizeof restart_changes / sizeof restart_changes[0]));
  tcase_add_test(t, restart_keys_are_listed_together);
  tcase_add_test(t, changed_keys_are_named_one_by_one);
  tcase_add_test(t, every_key_fits_a_reload_answer);
  suite_add_tcase(s, t);
  return s;
}
