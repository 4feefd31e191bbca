/*
 * check_ctl_render.c — suite ctl_render: deepepctl's output tables as
 * ctl_out_render prints them, without a daemon: long strings whole, a value
 * a row lacks as "-" in text and null in JSON, and `deepepctl metrics` over
 * a stats page (counts and bytes as exact integers, the data paths'
 * traffic per peer and job, the quantiles of no steady call).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctl.h"
#include "ctl_view.h"
#include "ctlrun.h"
#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "slab.h"
#include "stats_page.h"
#include "statsranks.h"
#include "testutil.h"
#include "xring.h"

/* ---- the text renderer ---------------------------------------------------------- */

/* What ctl_out_render prints for doc, malloc'd. */
static char *render_text(const struct ctl_doc *doc) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(ctl_out_render(f, doc, false), 0);
  fclose(f);
  return buf;
}

/* A reload's answer names every key that needs a restart, a drain's every job left and a peer's
 * last error the whole reason: the text shows each string whole, as JSON does, never cut to a
 * column width (it once cut them at 127 bytes: "needs restart ...: so"). */
START_TEST(text_output_shows_long_strings_whole) {
  char longs[DEP_MSG_TEXT_MAX];
  memset(longs, 'k', sizeof longs - 2);
  memcpy(longs + sizeof longs - 12, "socket.mode", 11);
  longs[sizeof longs - 1] = '\0';
  static const struct ctl_col fields[] = {{"result", "reload", CTL_STR, 0}};
  const struct ctl_val vals[] = {{.s = longs}};
  static const struct ctl_col cols[] = {{"address", "PEER", CTL_STR, 0},
                                        {"conns_up", "CONNS", CTL_UINT, 0},
                                        {"conns_total", "", CTL_UINT, CTL_COL_JOIN},
                                        {"last_error", "LAST ERROR", CTL_STR, 0}};
  const struct ctl_val cells[] = {{.s = "10.0.0.2:7470"}, {.u = 3}, {.u = 24}, {.s = longs},
                                  {.s = "b\x01z"},         {.u = 0}, {.u = 24}, {.s = ""}};
  const struct ctl_table tables[] = {{"peers", "no peers", cols, 4, 2, cells, 0}};
  const struct ctl_doc doc = {fields, vals, 1, tables, 1};
  char *out = render_text(&doc);
  char want[DEP_MSG_TEXT_MAX + 32];
  dw_sfmt(want, sizeof want, "reload: %s\n", longs);
  ck_assert_msg(starts(out, want), "the field is not whole:\n%s", out);
  dw_sfmt(want, sizeof want, "  10.0.0.2:7470   3/24  %s\n", longs);
  ck_assert_msg(strstr(out, want) != NULL, "the cell is not whole:\n%s", out);
  /* Control bytes stay out of the terminal; an empty string is "-". */
  ck_assert_msg(strstr(out, "  b?z             0/24  -\n") != NULL, "%s", out);
  free(out);
}
END_TEST

/* A value a row does not have is "-" in text, whatever its kind, and null in JSON (it once kept
 * the number, 0, which reads as a measurement). */
START_TEST(a_value_a_row_lacks_is_a_dash_in_text_and_null_in_json) {
  static const struct ctl_col cols[] = {{"rank", "RANK", CTL_UINT, 0},
                                        {"ratio", "RATIO", CTL_MILLI, 0}};
  const struct ctl_val cells[] = {{.u = 0, .none = true}, {.u = 0, .none = true},
                                  {.u = 0}, {.u = 1500}};
  const struct ctl_table tables[] = {{"rows", "none", cols, 2, 2, cells, 0}};
  const struct ctl_doc doc = {NULL, NULL, 0, tables, 1};
  char *out = render_text(&doc);
  ck_assert_str_eq(out, "\nrows:\n  RANK  RATIO\n     -      -\n     0   1.50\n");
  free(out);
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ck_assert_int_eq(ctl_out_render(f, &doc, true), 0);
  fclose(f);
  ck_assert_str_eq(buf, "{\"rows\":[{\"rank\":null,\"ratio\":null},{\"rank\":0,\"ratio\":1.500}]}\n");
  free(buf);
}
END_TEST

/* A list (reload's keys) is an array of its values in JSON, empty or not, and a table the text
 * leaves to a field's words is not in the text at all. */
START_TEST(a_list_is_an_array_of_values_in_json_and_may_stay_out_of_the_text) {
  static const struct ctl_col fields[] = {{"message", "reload", CTL_STR, 0}};
  const struct ctl_val vals[] = {{.s = "applied f: log_level info -> debug"}};
  static const struct ctl_col key = {"key", "KEY", CTL_STR, 0};
  const struct ctl_val keys[] = {{.s = "log_level"}, {.s = "limits.max_clients"}};
  const struct ctl_table tables[] = {
      {"applied", "", &key, 1, 2, keys, CTL_TABLE_LIST | CTL_TABLE_NOTEXT},
      {"restart", "", &key, 1, 0, keys, CTL_TABLE_LIST | CTL_TABLE_NOTEXT}};
  const struct ctl_doc doc = {fields, vals, 1, tables, 2};
  char *out = render_text(&doc);
  ck_assert_str_eq(out, "reload: applied f: log_level info -> debug\n");
  free(out);
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ck_assert_int_eq(ctl_out_render(f, &doc, true), 0);
  fclose(f);
  ck_assert_str_eq(buf, "{\"message\":\"applied f: log_level info -> debug\","
                        "\"applied\":[\"log_level\",\"limits.max_clients\"],\"restart\":[]}\n");
  free(buf);
}
END_TEST

/* The exposition of one node (a device, a peer, a rank of job j that ran dispatches) whose
 * figures are too large for a double's 9 significant digits, or have fractions of seconds. */
static char *render_metrics(void) {
  struct dep_status_device dev = {.uuid = "00000000-0000-0000-0000-000000000000",
                                  .pool_total_bytes = 1073741824ull,
                                  .pool_used_bytes = 15700000001ull};
  struct dep_status st = {.state = "ready", .uptime_ms = 4710, .num_devices = 1,
                          .devices = &dev};
  struct dep_msg_stats_rank rank = {.job_id = "j"};
  struct dep_msg_stats_op *o = &rank.ops[DEP_STATS_OP_DISPATCH];
  o->calls = 123456789012ull;
  o->bytes = 15700000001ull;
  o->first_ns = 1500;
  o->steady_calls = 3;
  o->steady_sum_ns = 12345678901234ull;
  o->median_ns = o->p99_ns = 2000000000;
  /* One combine, so far: no steady call, no quantile. */
  rank.ops[DEP_STATS_OP_COMBINE].calls = 1;
  rank.ops[DEP_STATS_OP_COMBINE].first_ns = 5000;
  struct ctl_stats s = {.ranks = &rank, .n = 1};
  struct dep_msg_peer_info peer = {.address = "10.0.0.2:7470", .state = "up",
                                   .transport = "tcp", .bytes_out = 15700000001ull,
                                   .data_out = 4, .data_in = 3,
                                   .data_bytes_out = 107374182400ull, .data_bytes_in = 7,
                                   .data_frames_out = 1600, .data_frames_in = 9,
                                   .rdma_blocks_out = 21, .rdma_writes_out = 84,
                                   .rdma_posts_out = 3, .rdma_bytes_out = 107374182401ull};
  struct dep_msg_peers pm = {.n_peers = 1, .peers = &peer, .proxy_threads = 2,
                             .proxy_busy_us = 1500001, .nic_bytes = 8};
  static struct dep_msg_job_nodes jn = {
      .n = 1, .jobs = {{.job_id = "xj", .bytes_out = 11, .bytes_in = 12, .frames_out = 13,
                        .frames_in = 14, .ring_peak = 5, .ring_entries = 1024}}};
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(ctl_view_metrics(f, &st, &s, &pm, &jn), 0);
  fclose(f);
  return buf;
}

/* Counters and byte gauges are the integers they are, and seconds exact decimals: %.9g once
 * printed 1073741824 bytes as 1.07374182e+09 (1073741820) and rounded 15.7 GB likewise. */
START_TEST(metrics_print_counts_and_bytes_as_exact_integers) {
  char *out = render_metrics();
  static const char *const want[] = {
      "deepep_pool_bytes{device=\"00000000-0000-0000-0000-000000000000\",kind=\"total\"} "
      "1073741824\n",
      "deepep_pool_bytes{device=\"00000000-0000-0000-0000-000000000000\",kind=\"used\"} "
      "15700000001\n",
      "deepep_peer_sent_bytes_total{peer=\"10.0.0.2:7470\",transport=\"tcp\"} 15700000001\n",
      "\ndeepep_daemon_uptime_seconds 4.71\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\"} 123456789012\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\"} 15700000001\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\"} 0.0000015\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\",quantile=\"0.5\"} 2\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\"} 12345.678901234\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(out, want[i]) != NULL, "no \"%s\" in:\n%.3000s", want[i], out);
  free(out);
}
END_TEST

/* A summary's quantiles over no observation are NaN, as Prometheus's own clients print them;
 * they were 0, which reads as a call that took no time. */
START_TEST(metrics_quantiles_of_no_steady_call_are_nan) {
  char *out = render_metrics();
  static const char *const want[] = {
      "op=\"combine\",device=\"00000000-0000-0000-0000-000000000000\",quantile=\"0.5\"} NaN\n",
      "op=\"combine\",device=\"00000000-0000-0000-0000-000000000000\",quantile=\"0.99\"} NaN\n",
      "deepep_op_latency_seconds_count{ep_job=\"j\",rank=\"0\",op=\"combine\","
      "device=\"00000000-0000-0000-0000-000000000000\"} 0\n",
      "deepep_op_first_call_seconds{ep_job=\"j\",rank=\"0\",op=\"combine\","
      "device=\"00000000-0000-0000-0000-000000000000\"} 0.000005\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(out, want[i]) != NULL, "no \"%s\" in:\n%.3000s", want[i], out);
  free(out);
}
END_TEST

/* The data path is in the exposition as deepepctl peers and status show it: per peer its
 * connections, bytes and frames each way and what went to the peer as RDMA writes; its proxy
 * threads; per job that spans nodes its traffic and its rings' fullest.  It once had the
 * control link's bytes alone, then the TCP data connections' and no RDMA write. */
START_TEST(metrics_show_the_data_paths_traffic_per_peer_and_job) {
  char *out = render_metrics();
  static const char *const want[] = {
      "deepep_peer_data_connections{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"out\"} 4\n",
      "deepep_peer_data_connections{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"in\"} 3\n",
      "deepep_peer_data_bytes_total{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"out\"} "
      "107374182400\n",
      "deepep_peer_data_bytes_total{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"in\"} 7\n",
      "deepep_peer_data_frames_total{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"out\"} "
      "1600\n",
      "deepep_peer_data_frames_total{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"in\"} 9\n",
      "\ndeepep_peer_rdma_blocks_total{peer=\"10.0.0.2:7470\",transport=\"tcp\"} 21\n",
      "\ndeepep_peer_rdma_writes_total{peer=\"10.0.0.2:7470\",transport=\"tcp\"} 84\n",
      "\ndeepep_peer_rdma_posts_total{peer=\"10.0.0.2:7470\",transport=\"tcp\"} 3\n",
      "\ndeepep_peer_rdma_bytes_total{peer=\"10.0.0.2:7470\",transport=\"tcp\"} 107374182401\n",
      "\ndeepep_proxy_threads 2\n",
      "\ndeepep_proxy_busy_seconds_total 1.500001\n",
      "\ndeepep_rdma_registered_bytes 8\n",
      "\ndeepep_job_data_bytes_total{ep_job=\"xj\",direction=\"out\"} 11\n",
      "\ndeepep_job_data_bytes_total{ep_job=\"xj\",direction=\"in\"} 12\n",
      "\ndeepep_job_data_blocks_total{ep_job=\"xj\",direction=\"out\"} 13\n",
      "\ndeepep_job_data_blocks_total{ep_job=\"xj\",direction=\"in\"} 14\n",
      "\ndeepep_job_ring_peak_descriptors{ep_job=\"xj\"} 5\n",
      "\ndeepep_job_ring_entries{ep_job=\"xj\"} 1024\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(out, want[i]) != NULL, "no \"%s\" in:\n%.3000s", want[i], out);
  free(out);
}
END_TEST

Suite *ctl_render_suite(void);
Suite *ctl_render_suite(void) {
  Suite *s = suite_create("ctl_render");
  TCase *local = tcase_create("local");
  tcase_add_test(local, text_output_shows_long_strings_whole);
  tcase_add_test(local, a_value_a_row_lacks_is_a_dash_in_text_and_null_in_json);
  tcase_add_test(local, a_list_is_an_array_of_values_in_json_and_may_stay_out_of_the_text);
  tcase_add_test(local, metrics_print_counts_and_bytes_as_exact_integers);
  tcase_add_test(local, metrics_show_the_data_paths_traffic_per_peer_and_job);
  tcase_add_test(local, metrics_quantiles_of_no_steady_call_are_nan);
  tcase_set_timeout(local, 30);
  suite_add_tcase(s, local);
  return s;
}
