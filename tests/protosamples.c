/*
 * protosamples.c — the proto suites' sample messages (protosamples.h).
 */
#include "protosamples.h"

#include <check.h>
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "corpus_seeds.h"
#include "peer_proto.h"
#include "proto.h"

struct dep_status *sample_status(uint32_t ndev, uint32_t njob) {
  struct dep_status *st = calloc(1, sizeof *st);
  ck_assert_ptr_nonnull(st);
  snprintf(st->version, sizeof st->version, "0.1.0");
  st->proto_version = DEP_PROTO_VERSION;
  st->pid = 4242;
  st->uptime_ms = 0x0123456789ABCDEFull;
  snprintf(st->backend, sizeof st->backend, "host");
  st->num_clients = 17;
  st->num_devices = ndev;
  st->num_jobs = njob;
  if (ndev)
    st->devices = calloc(ndev, sizeof *st->devices);
  if (njob)
    st->jobs = calloc(njob, sizeof *st->jobs);
  for (uint32_t i = 0; i < ndev; i++) {
    struct dep_status_device *d = &st->devices[i];
    snprintf(d->uuid, sizeof d->uuid, "%08x-0000-4000-8000-%012x", i, i * 7u);
    snprintf(d->name, sizeof d->name, "NVIDIA H200 #%u", i);
    snprintf(d->backend, sizeof d->backend, "cuda");
    d->pool_total_bytes = (uint64_t)i << 33;
    d->pool_used_bytes = i * 3u;
    d->pool_cached_bytes = UINT64_MAX - i;
  }
  for (uint32_t i = 0; i < njob; i++) {
    struct dep_status_job *j = &st->jobs[i];
    snprintf(j->job_id, sizeof j->job_id, "job-%u.train:%u", i, i * 11u);
    j->owner_uid = 1000 + i;
    j->ranks_attached = i % 8;
    j->ranks_expected = 8;
    j->world_size = 64;
    j->slab_bytes = (uint64_t)(i + 1) << 30;
    j->age_ms = 1000ull * i;
  }
  return st;
}

struct dep_attach_args sample_attach(void) {
  struct dep_attach_args a;
  memset(&a, 0, sizeof a);
  a.size = sizeof a;
  snprintf(a.job_id, sizeof a.job_id, "llama-moe.run_7:step-3");
  a.rank = 13;
  a.world_size = 64;
  a.local_rank = 5;
  a.local_world_size = 8;
  for (int i = 0; i < 16; i++)
    a.device_uuid[i] = (uint8_t)(0xF0 + i);
  a.shape.max_tokens_per_rank = 4096;
  a.shape.hidden = 7168;
  a.shape.num_experts = 256;
  a.shape.topk = 8;
  a.shape.dtype = DEP_DTYPE_FP8_E4M3;
  a.shape.max_ll_tokens_per_rank = 128;
  return a;
}

struct dep_msg_error s_err = {.code = DEP_ERR_MISMATCH, .message = "ranks disagree"};

struct dep_msg_hello s_hello = {.version = 1, .pid = 77, .name = "deepepctl 0.1.0"};

struct dep_msg_hello_ok s_hello_ok = {.version = 1, .daemon_version = "0.1.0",
                                      .backend = "cuda"};

struct dep_msg_attach_ok s_attach_ok = {.slab_bytes = 1ull << 34, .local_world_size = 8,
                                        .num_fds = 3, .backend = "host",
                                        .op_timeout_ms = 10000, .kernel_warmup = 1,
                                        .chunk_rows = 64};

struct dep_msg_slab s_slab = {.chunk_bytes = 64ull << 20,
                              .n_chunks = 17,
                              .n_ranks = 2,
                              .ranks = {{3, 11, 0}, {5, 13, 1ull << 30}},
                              .device_uuid = {0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7,
                                              8, 9, 10, 11, 12}};

struct dep_attach_args s_attach;

struct dep_msg_reload_ok s_reload_ok = {
    .message = "applied /etc/deepepd/deepepd.yaml: log_level info -> debug; needs restart (still "
               "running with the old values): socket.path, pool.chunk_size",
    .n_applied = 1,
    .applied = {"log_level"},
    .n_restart = 2,
    .restart = {"socket.path", "pool.chunk_size"}};

int samples(struct sample *out, struct dep_status **st) {
  s_attach = sample_attach();
  *st = sample_status(2, 3);
  int n = 0;
  out[n++] = (struct sample){DEP_MSG_ERROR, &s_err};
  out[n++] = (struct sample){DEP_MSG_HELLO, &s_hello};
  out[n++] = (struct sample){DEP_MSG_HELLO_OK, &s_hello_ok};
  out[n++] = (struct sample){DEP_MSG_STATUS_OK, *st};
  out[n++] = (struct sample){DEP_MSG_ATTACH, &s_attach};
  out[n++] = (struct sample){DEP_MSG_ATTACH_OK, &s_attach_ok};
  out[n++] = (struct sample){DEP_MSG_SLAB, &s_slab};
  out[n++] = (struct sample){DEP_MSG_RELOAD_OK, &s_reload_ok};
  return n;
}
