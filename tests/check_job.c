/*
 * check_job.c — the daemon's job table as ranks meet in it: the ATTACH
 * rendezvous (nobody hears back until every local rank of the job has
 * come), the conflicts a job refuses (another shape, a rank taken twice,
 * a job already running), the attach timeout, and DETACH and closes that
 * remove ranks and then the job.  Every test starts the real deepepd and
 * speaks the protocol on raw sockets (daemonwire.h), checking the slabs
 * and fds of the reply itself rather than trusting the client library.
 */
#include <check.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "testutil.h"

/* Wait (up to 3 s) for the job to disappear from STATUS: closes are asynchronous. */
static bool job_gone(int fd, const char *id) {
  for (int i = 0; i < 300; i++) {
    if (!dw_job_listed(fd, id, NULL, NULL))
      return true;
    dw_sleep_ms(10);
  }
  return false;
}

/* Wait (up to 3 s) until STATUS shows n ranks of the job attached. */
static bool wait_attached(int fd, const char *id, uint32_t n) {
  for (int i = 0; i < 300; i++) {
    uint32_t at = 0;
    if (dw_job_listed(fd, id, &at, NULL) && at == n)
      return true;
    dw_sleep_ms(10);
  }
  return false;
}

/*
 * The ATTACH reply: SLAB frames (one arena per device, its chunk fds riding
 * on it, naming the local ranks whose slabs it holds), then ATTACH_OK.  On
 * the host backend there is one device, so one arena holds every slab.
 */
static void expect_attach_ok(int fd, uint32_t req, uint32_t lws) {
  bool seen[DEP_MAX_LOCAL_RANKS] = {false};
  int fds[DEP_PROTO_MAX_FDS];
  int nfds = 0;
  struct dw_frame *sf = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame_fds(fd, sf, 5000, fds, &nfds), 0);
  ck_assert_str_eq(proto_type_name(sf->h.type), "SLAB");
  ck_assert_uint_eq(sf->h.request_id, req);
  struct dep_msg_slab m;
  ck_assert_int_eq(proto_decode_slab(sf->body, sf->h.body_len, &m), 0);
  ck_assert_uint_eq(m.n_ranks, lws);
  for (uint32_t i = 0; i < m.n_ranks; i++) {
    ck_assert_uint_lt(m.ranks[i].local_rank, lws);
    ck_assert(!seen[m.ranks[i].local_rank]);
    seen[m.ranks[i].local_rank] = true;
    ck_assert_uint_lt(m.ranks[i].offset, m.chunk_bytes * m.n_chunks);
  }
  ck_assert_int_eq((int)m.n_chunks, nfds);
  for (int k = 0; k < nfds; k++) {
    struct stat sb;
    ck_assert_int_eq(fstat(fds[k], &sb), 0);
    ck_assert_uint_eq((uint64_t)sb.st_size, m.chunk_bytes);
    close(fds[k]);
  }
  free(sf);
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "ATTACH_OK");
  ck_assert_uint_eq(f->h.request_id, req);
  struct dep_msg_attach_ok ok;
  ck_assert_int_eq(proto_decode_attach_ok(f->body, f->h.body_len, &ok), 0);
  ck_assert_uint_eq(ok.local_world_size, lws);
  ck_assert_uint_eq(ok.num_fds, 0);
  ck_assert_str_eq(ok.backend, "host");
  ck_assert_uint_eq(ok.op_timeout_ms, 10000); /* limits.op_timeout_ms, default */
  free(f);
}

START_TEST(test_attach_rendezvous) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int obs = dw_client(&d);
  int fds[4];
  for (uint32_t i = 0; i < 4; i++)
    fds[i] = dw_client(&d);
  for (uint32_t i = 0; i < 3; i++) {
    struct dep_attach_args a = dw_job_args("train-1", i, 4);
    dw_attach(fds[i], &a, 20 + i);
  }
  /* Three of four: nobody hears anything yet. */
  for (uint32_t i = 0; i < 3; i++)
    dw_expect_silence(fds[i], 150);
  uint32_t at = 0, ex = 0;
  ck_assert(dw_job_listed(obs, "train-1", &at, &ex));
  ck_assert_uint_eq(at, 3);
  ck_assert_uint_eq(ex, 4);
  struct dep_attach_args a = dw_job_args("train-1", 3, 4);
  dw_attach(fds[3], &a, 23);
  for (uint32_t i = 0; i < 4; i++)
    expect_attach_ok(fds[i], 20 + i, 4);
  ck_assert(dw_job_listed(obs, "train-1", &at, &ex));
  ck_assert_uint_eq(at, 4);
  ck_assert_uint_eq(ex, 4);
  /* A running job takes no newcomers; a connection attaches once. */
  int late = dw_client(&d);
  dw_attach(late, &a, 30);
  dw_expect_error(late, DEP_ERR_STATE, NULL, 0);
  struct dep_attach_args other = dw_job_args("train-2", 0, 2);
  dw_attach(fds[0], &other, 31);
  dw_expect_error(fds[0], DEP_ERR_STATE, NULL, 0);
  /* DETACH frees the rank; closing the rest removes the job. */
  ck_assert_int_eq(dw_send_frame(fds[0], DEP_MSG_DETACH, 32, NULL), 0);
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fds[0], f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "DETACH_OK");
  free(f);
  ck_assert(dw_job_listed(obs, "train-1", &at, NULL));
  ck_assert_uint_eq(at, 3);
  for (uint32_t i = 1; i < 4; i++)
    close(fds[i]);
  ck_assert(job_gone(obs, "train-1"));
  ck_assert(dw_log_has(&d, "job train-1: removed (no ranks left)", 3000));
  close(fds[0]);
  close(late);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_attach_conflicts) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int r0 = dw_client(&d), x = dw_client(&d), obs = dw_client(&d);
  char msg[DEP_MSG_TEXT_MAX];
  struct dep_attach_args a = dw_job_args("job-c", 0, 4);
  dw_attach(r0, &a, 1);
  /* A different shape. */
  struct dep_attach_args b = dw_job_args("job-c", 1, 4);
  b.shape.hidden = 2048;
  dw_attach(x, &b, 2);
  dw_expect_error(x, DEP_ERR_MISMATCH, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "hidden 2048") && strstr(msg, "give 1024"), "said: %s", msg);
  b = dw_job_args("job-c", 1, 8);
  b.world_size = 8;
  dw_attach(x, &b, 3);
  dw_expect_error(x, DEP_ERR_MISMATCH, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "world_size 8"), "said: %s", msg);
  /* The same local rank twice, the same global rank twice. */
  b = dw_job_args("job-c", 0, 4);
  dw_attach(x, &b, 4);
  dw_expect_error(x, DEP_ERR_EXISTS, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "local rank 0 of job job-c is already attached by pid"), "said: %s",
                msg);
  b = dw_job_args("job-c", 2, 4);
  b.rank = 0;
  dw_attach(x, &b, 5);
  dw_expect_error(x, DEP_ERR_EXISTS, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "rank 0 of job job-c is already attached"), "said: %s", msg);
  /* Fields out of range are refused before the job table sees them. */
  b = dw_job_args("job-c", 5, 4);
  dw_attach(x, &b, 6);
  dw_expect_error(x, DEP_ERR_INVALID, NULL, 0);
  /* None of that disturbed the waiting rank or the job. */
  dw_expect_silence(r0, 50);
  ck_assert(wait_attached(obs, "job-c", 1));
  /* A rank that leaves while others wait frees its slot for a successor. */
  b = dw_job_args("job-c", 1, 4);
  dw_attach(x, &b, 7);
  ck_assert(wait_attached(obs, "job-c", 2));
  close(x);
  ck_assert(wait_attached(obs, "job-c", 1));
  int y = dw_client(&d);
  dw_attach(y, &b, 8);
  ck_assert(wait_attached(obs, "job-c", 2));
  dw_expect_silence(y, 50);
  /* Closing every rank removes the job. */
  close(y);
  close(r0);
  ck_assert(job_gone(obs, "job-c"));
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_attach_timeout) {
  struct tu_daemon d;
  dw_start(&d, "limits:\n  attach_timeout_ms: 300\n");
  int r0 = dw_client(&d), r1 = dw_client(&d), obs = dw_client(&d);
  struct dep_attach_args a = dw_job_args("slow-job", 0, 4);
  dw_attach(r0, &a, 1);
  a = dw_job_args("slow-job", 1, 4);
  dw_attach(r1, &a, 2);
  int64_t t0 = dw_now_ms();
  char msg[DEP_MSG_TEXT_MAX];
  dw_expect_error(r0, DEP_ERR_TIMEOUT, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "2 of 4 local ranks attached after 300 ms; missing local ranks 2,3"),
                "said: %s", msg);
  dw_expect_error(r1, DEP_ERR_TIMEOUT, NULL, 0);
  ck_assert_int_lt(dw_now_ms() - t0, 2000);
  ck_assert(!dw_job_listed(obs, "slow-job", NULL, NULL));
  /* The connections stay usable: the job can be tried again. */
  a = dw_job_args("slow-job", 0, 1);
  dw_attach(r0, &a, 3);
  expect_attach_ok(r0, 3, 1);
  close(r0);
  close(r1);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

Suite *job_suite(void);
Suite *job_suite(void) {
  Suite *s = suite_create("job");
  TCase *tc = tcase_create("attach");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_attach_rendezvous);
  tcase_add_test(tc, test_attach_conflicts);
  tcase_add_test(tc, test_attach_timeout);
  suite_add_tcase(s, tc);
  return s;
}
