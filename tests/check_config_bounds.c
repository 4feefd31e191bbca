/*
 * check_config_bounds.c — bounds on the configuration file itself
 * (config/config.c): no file keeps libyaml busy.  Nesting past 32 levels
 * is refused where it opens, lists at their key's column end with it, each
 * pathological file (deep nesting, anchors, %TAG lines, lists at depth)
 * is refused in milliseconds with its message, the largest valid file is
 * within the bounds, and a FIFO is refused without waiting for a writer.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "config.h"
#include "configtest.h"
#include "deepep.h"
#include "testutil.h"

/* head, then `open` n times, an x, `close` n times and a newline, on the heap. */
static char *nested(const char *head, const char *open, const char *close, size_t n) {
  size_t len = strlen(head) + n * (strlen(open) + strlen(close)) + 3;
  char *y = malloc(len);
  ck_assert_ptr_nonnull(y);
  char *p = y + sprintf(y, "%s", head);
  for (size_t i = 0; i < n; i++)
    p += sprintf(p, "%s", open);
  *p++ = 'x';
  for (size_t i = 0; i < n; i++)
    p += sprintf(p, "%s", close);
  strcpy(p, "\n");
  return y;
}

static int load_heap(struct config *c, char *yaml) {
  int rc = ct_load(c, yaml);
  free(yaml);
  return rc;
}

/* The root mapping is the first level: 31 lists inside it make 32 and are let through to the
 * type check; one more is refused where it opens, before libyaml loads anything. */
START_TEST(nesting_deeper_than_32_levels_is_refused_where_it_opens) {
  struct config c;
  config_defaults(&c);
  ck_assert_int_eq(load_heap(&c, nested("log_level: ", "[", "]", 31)), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err, "t.yaml:1:12: expected one of err, warning, notice, info, debug for "
                        "'log_level', got a list");
  ck_assert_int_eq(load_heap(&c, nested("log_level: ", "[", "]", 32)), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err, "t.yaml:1:43: nesting deeper than 32 levels of lists and mappings (a "
                        "deepepd config needs 3)");
  ck_assert_int_eq(load_heap(&c, nested("log_level: ", "{a: ", "}", 32)), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err, "t.yaml:1:136: nesting deeper than 32 levels of lists and mappings (a "
                        "deepepd config needs 3)");
  /* Block mappings, by indentation: the 33rd key opens the 33rd level. */
  char block[4096] = "";
  for (int i = 0; i < 33; i++)
    snprintf(block + strlen(block), sizeof block - strlen(block), "%*sk:\n", 2 * i, "");
  ck_assert_int_eq(ct_load(&c, block), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err, "t.yaml:33:65: nesting deeper than 32 levels of lists and mappings (a "
                        "deepepd config needs 3)");
  block[strlen(block) - (2 * 32 + 3)] = '\0'; /* 32 levels: through to the walk */
  ck_assert_int_eq(ct_load(&c, block), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err, "t.yaml:1:1: unknown key 'k' at the top level (known: socket, allow, "
                        "backend, devices, pool, preallocation, buffer_cache_enabled, "
                        "kernel_warmup, kernel_cache_dir, adaptive_optimization, "
                        "warn_first_call_ratio, connection_pool_size, proxy_threads, "
                        "stream_chunk_rows, listen, peers, "
                        "peer_key_file, peer_insecure, peer_wait_ms, transport, metrics, limits, log_level)");
  /* A list at its key's own column is a level too: the root, then a list and a mapping on each
   * "- k:" line; the 16th such line's mapping is the 33rd level. */
  snprintf(block, sizeof block, "k:\n");
  for (int i = 0; i < 16; i++)
    snprintf(block + strlen(block), sizeof block - strlen(block), "%*s- k:\n", 2 * i, "");
  snprintf(block + strlen(block), sizeof block - strlen(block), "%*s- x\n", 2 * 16, "");
  ck_assert_int_eq(ct_load(&c, block), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err, "t.yaml:17:33: nesting deeper than 32 levels of lists and mappings (a "
                        "deepepd config needs 3)");
}
END_TEST

/* Such a list ends at the next key: many of them side by side nest no deeper than one. */
START_TEST(lists_at_their_keys_column_end_with_their_key) {
  char yaml[4096] = "";
  for (int i = 0; i < 40; i++)
    snprintf(yaml + strlen(yaml), sizeof yaml - strlen(yaml), "k%d:\n- a\n- - b\n", i);
  struct config c;
  config_defaults(&c);
  ck_assert_int_eq(ct_load(&c, yaml), DEP_ERR_CONFIG);
  static const char want[] = "t.yaml:1:1: unknown key 'k0' at the top level";
  ck_assert_msg(strncmp(ct_err, want, strlen(want)) == 0, "%s", ct_err);
}
END_TEST

/* Files that kept libyaml busy for seconds to a minute (100 000 nested '[' in 200 KB, a MiB of
 * anchors, of %TAG lines, of list items) are refused at once. */
static char *pathological(int which, size_t *len) {
  const size_t max = 1 << 20;
  char *y = malloc(max + 64);
  ck_assert_ptr_nonnull(y);
  size_t o = 0;
  switch (which) {
  case 0:
    while (o < 200000)
      y[o++] = '[';
    break;
  case 1:
    o += (size_t)sprintf(y, "a:\n");
    for (int i = 0; o < max - 32; i++)
      o += (size_t)sprintf(y + o, "- &a%d x\n", i);
    break;
  case 2:
    for (int i = 0; o < max - 32; i++)
      o += (size_t)sprintf(y + o, "%%TAG !a%d! tag:x:\n", i);
    o += (size_t)sprintf(y + o, "---\na: 1\n");
    break;
  default:
    /* A flat list of 500 000 items (a quarter of a second and 100 MiB for libyaml to load). */
    o += (size_t)sprintf(y, "a: [");
    while (o < max - 8)
      o += (size_t)sprintf(y + o, "a,");
    o += (size_t)sprintf(y + o, "a]\n");
    break;
  }
  y[o] = '\0';
  *len = o;
  return y;
}

static const char *const pathological_errors[] = {
    "t.yaml:1:33: nesting deeper than 32 levels",
    "t.yaml:2731:1: more than 8192 YAML tokens",
    "t.yaml:17:1: more than 16 %YAML and %TAG directives",
    "t.yaml:1:8191: more than 8192 YAML tokens",
};

START_TEST(pathological_files_are_refused_in_milliseconds) {
  size_t len;
  char *y = pathological(_i, &len);
  struct config c;
  config_defaults(&c);
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  int rc = config_load_buffer(&c, "t.yaml", y, len, ct_err, sizeof ct_err);
  clock_gettime(CLOCK_MONOTONIC, &b);
  free(y);
  double ms = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
  ck_assert_int_eq(rc, DEP_ERR_CONFIG);
  ck_assert_msg(strncmp(ct_err, pathological_errors[_i], strlen(pathological_errors[_i])) == 0,
                "said: %s", ct_err);
  /* A few ms on an idle core; the bound leaves room for a busy machine. */
  ck_assert_msg(ms < 500, "refusing it took %.0f ms", ms);
}
END_TEST

/* The bounds are far from any file that can be valid: every key, each list full. */
START_TEST(the_largest_valid_file_is_within_the_bounds) {
  static char yaml[64 * 1024];
  size_t o = (size_t)snprintf(yaml, sizeof yaml,
                              "socket: {path: /tmp/x.sock, mode: 0600, group: \"0\"}\n"
                              "allow:\n  any_user: false\n  users:\n");
  for (int i = 0; i < CONFIG_MAX_LIST; i++)
    o += (size_t)snprintf(yaml + o, sizeof yaml - o, "  - !!str user%d\n", i);
  o += (size_t)snprintf(yaml + o, sizeof yaml - o, "  groups: [");
  for (int i = 0; i < CONFIG_MAX_LIST; i++)
    o += (size_t)snprintf(yaml + o, sizeof yaml - o, "%s!!str g%d", i ? ", " : "", i);
  o += (size_t)snprintf(yaml + o, sizeof yaml - o, "]\ndevices:\n");
  for (int i = 0; i < CONFIG_MAX_LIST; i++)
    o += (size_t)snprintf(yaml + o, sizeof yaml - o,
                          "- GPU-5fa1c2e0-1b2c-3d4e-5f60-7182%08d\n", i);
  o += (size_t)snprintf(yaml + o, sizeof yaml - o, "peers:\n");
  for (int i = 0; i < CONFIG_MAX_LIST; i++)
    o += (size_t)snprintf(yaml + o, sizeof yaml - o, "- host: !!str node%d\n  port: %d\n", i,
                          7000 + i);
  snprintf(yaml + o, sizeof yaml - o,
           "backend: host\npool: {size_per_device: 1GiB, chunk_size: 2MiB, max_allocation: 0, "
           "host_size: 64MiB}\npreallocation: true\nbuffer_cache_enabled: true\n"
           "kernel_warmup: true\n"
           "connection_pool_size: 8\nlisten: {address: \"\", port: 1}\n"
           "peer_key_file: \"\"\npeer_insecure: true\npeer_wait_ms: 0\nlimits: {max_clients: 1, max_jobs: 1, attach_timeout_ms: 1, "
           "op_timeout_ms: 1, client_queue_bytes: 1MiB, hello_timeout_ms: 1, reserved_clients: 0, "
           "max_clients_per_uid: 1, max_jobs_per_uid: 1, memory_per_uid: 0}\nlog_level: info\n");
  struct config c;
  ct_load_ok(&c, yaml);
  ck_assert_uint_eq(c.n_allow_users, CONFIG_MAX_LIST);
  ck_assert_uint_eq(c.n_peers, CONFIG_MAX_LIST);
}
END_TEST

/* open(2) of a FIFO waits for a writer: a reload of one would never end. */
START_TEST(a_fifo_is_refused_without_waiting_for_a_writer) {
  char dir[256], path[300], want[400];
  tu_tmpdir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/fifo.yaml", dir);
  ck_assert_int_eq(mkfifo(path, 0600), 0);
  struct config c;
  config_defaults(&c);
  ck_assert_int_eq(config_load_file(&c, path, ct_err, sizeof ct_err), DEP_ERR_CONFIG);
  snprintf(want, sizeof want, "%s: cannot read: not a regular file", path);
  ck_assert_str_eq(ct_err, want);
  tu_rmtree(dir);
}
END_TEST

Suite *config_bounds_suite(void);
Suite *config_bounds_suite(void) {
  Suite *s = suite_create("config_bounds");
  TCase *t = tcase_create("bounds");
  tcase_add_test(t, nesting_deeper_than_32_levels_is_refused_where_it_opens);
  tcase_add_test(t, lists_at_their_keys_column_end_with_their_key);
  tcase_add_loop_test(t, pathological_files_are_refused_in_milliseconds, 0,
                      (int)(sizeof pathological_errors / sizeof pathological_errors[0]));
  tcase_add_test(t, the_largest_valid_file_is_within_the_bounds);
  tcase_add_test(t, a_fifo_is_refused_without_waiting_for_a_writer);
  suite_add_tcase(s, t);
  return s;
}
