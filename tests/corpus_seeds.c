/*
 * corpus_seeds.c — the fixed messages the fuzz seeds are encoded from
 * (corpus_seeds.h).  Every value is a constant or a fixed byte pattern (no
 * random challenge, token or nonce), so the bytes depend only on the
 * encoders.  One seed per message type of proto.h and of peer_proto.h, a
 * few second ones where a field picks another path through the decoder
 * (XPORT over TCP, a STATUS_OK with no records), and one unknown type per
 * protocol.  Built with -DDEP_CORPUS_SEEDS_MAIN it is `make corpus`: it
 * writes each seed under the folder it is given.
 */
#include "corpus_seeds.h"

#include <stdio.h>
#include <string.h>

#include "codec.h"
#include "peer_proto.h"
#include "stats_page.h"
#include "xring.h"

/* The job, node and device every message that names one names. */
#define SEED_JOB "moe-run.7"
#define SEED_UID 1000u
static const uint8_t seed_uuid[16] = {0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07,
                                      0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f};
/* A shape every check accepts: 16 ranks, 8 on each of two nodes. */
static const struct dep_job_shape seed_shape = {
    .max_tokens_per_rank = 128,
    .hidden = 4096,
    .num_experts = 64,
    .topk = 8,
    .dtype = DEP_DTYPE_BF16,
    .max_ll_tokens_per_rank = 0,
};

/* Fill n bytes with first, first+1, ...: a pattern, not random. */
static void pattern(uint8_t *p, size_t n, uint8_t first) {
  for (size_t i = 0; i < n; i++)
    p[i] = (uint8_t)(first + i);
}

/* Control frames carry request id 1 (a reply echoes it), except SHUTDOWN's 0. */
static int frame(struct proto_buf *b, uint16_t type, uint32_t flags, const void *msg) {
  return proto_frame_encode(b, type, flags, type == DEP_MSG_SHUTDOWN ? 0 : 1, msg);
}

/* ---- control protocol (proto.h) ---- */

static int f_error(struct proto_buf *b) {
  struct dep_msg_error m = {.code = DEP_ERR_MISMATCH,
                            .message = "job " SEED_JOB ": rank 3 disagrees on hidden"};
  return frame(b, DEP_MSG_ERROR, 0, &m);
}
static int f_hello(struct proto_buf *b) {
  struct dep_msg_hello m = {.version = DEP_PROTO_VERSION, .pid = 1234,
                            .name = "libdeepep-client 0.1.0"};
  return frame(b, DEP_MSG_HELLO, 0, &m);
}
static int f_hello_ok(struct proto_buf *b) {
  struct dep_msg_hello_ok m = {.version = DEP_PROTO_VERSION, .daemon_version = "0.1.0",
                               .backend = "cuda"};
  return frame(b, DEP_MSG_HELLO_OK, 0, &m);
}
static int f_status(struct proto_buf *b) { return frame(b, DEP_MSG_STATUS, 0, NULL); }
static int f_status_ok(struct proto_buf *b) {
  struct dep_status_device d = {.uuid = "00010203-0405-0607-0809-0a0b0c0d0e0f",
                                .name = "NVIDIA H100 80GB HBM3",
                                .backend = "cuda",
                                .pool_total_bytes = 8ull << 30,
                                .pool_used_bytes = 4ull << 30,
                                .pool_cached_bytes = 1ull << 30,
                                .pool_held_bytes = 0};
  struct dep_status_job j = {.job_id = SEED_JOB, .owner_uid = SEED_UID, .ranks_attached = 8,
                             .ranks_expected = 8, .world_size = 16,
                             .slab_bytes = 512ull << 20, .age_ms = 60000, .chunk_rows = 64};
  struct dep_status m = {.size = sizeof m, .device_size = sizeof d, .job_size = sizeof j,
                         .version = "0.1.0", .state = "ready",
                         .proto_version = DEP_PROTO_VERSION, .pid = 99, .uptime_ms = 123456,
                         .backend = "cuda", .num_clients = 8, .num_devices = 1, .num_jobs = 1,
                         .devices = &d, .jobs = &j};
  return frame(b, DEP_MSG_STATUS_OK, 0, &m);
}
static int f_status_ok_empty(struct proto_buf *b) {
  struct dep_status m = {.size = sizeof m, .device_size = sizeof(struct dep_status_device),
                         .job_size = sizeof(struct dep_status_job), .version = "0.1.0",
                         .state = "starting", .proto_version = DEP_PROTO_VERSION, .pid = 99,
                         .backend = "host"};
  return frame(b, DEP_MSG_STATUS_OK, 0, &m);
}
static int f_attach(struct proto_buf *b) {
  struct dep_attach_args m = {.size = sizeof m, .job_id = SEED_JOB, .rank = 11,
                              .world_size = 16, .local_rank = 3, .local_world_size = 8,
                              .shape = seed_shape};
  memcpy(m.device_uuid, seed_uuid, sizeof m.device_uuid);
  return frame(b, DEP_MSG_ATTACH, 0, &m);
}
static int f_attach_ok(struct proto_buf *b) {
  struct dep_msg_attach_ok m = {.slab_bytes = 512ull << 20, .local_world_size = 8,
                                .num_fds = 0, .backend = "cuda", .op_timeout_ms = 30000,
                                .kernel_warmup = 1, .chunk_rows = 32};
  return frame(b, DEP_MSG_ATTACH_OK, 0, &m);
}
static int f_detach(struct proto_buf *b) { return frame(b, DEP_MSG_DETACH, 0, NULL); }
static int f_detach_ok(struct proto_buf *b) { return frame(b, DEP_MSG_DETACH_OK, 0, NULL); }
static int f_shutdown(struct proto_buf *b) { return frame(b, DEP_MSG_SHUTDOWN, 0, NULL); }
static int f_slab(struct proto_buf *b) {
  struct dep_msg_slab m = {.chunk_bytes = 64ull << 20, .n_chunks = 16, .n_ranks = 2};
  memcpy(m.device_uuid, seed_uuid, sizeof m.device_uuid);
  m.ranks[0] = (struct dep_msg_slab_rank){.local_rank = 0, .rank = 8, .offset = 0};
  m.ranks[1] = (struct dep_msg_slab_rank){.local_rank = 1, .rank = 9, .offset = 512ull << 20};
  return frame(b, DEP_MSG_SLAB, DEP_FRAME_F_FDS, &m);
}
static int f_reload(struct proto_buf *b) { return frame(b, DEP_MSG_RELOAD, 0, NULL); }
static int f_reload_ok(struct proto_buf *b) {
  static struct dep_msg_reload_ok m = {
      .message = "applied /etc/deepepd/deepepd.yaml: log_level info -> debug; needs restart "
                 "(still running with the old values): socket.path",
      .n_applied = 1, .applied = {"log_level"}, .n_restart = 1, .restart = {"socket.path"}};
  return frame(b, DEP_MSG_RELOAD_OK, 0, &m);
}
static int f_drain(struct proto_buf *b) {
  struct dep_msg_drain m = {.drain = 1};
  return frame(b, DEP_MSG_DRAIN, 0, &m);
}
static int f_drain_ok(struct proto_buf *b) {
  struct dep_msg_text m = {.text = "draining; 1 job running: " SEED_JOB};
  return frame(b, DEP_MSG_DRAIN_OK, 0, &m);
}
static int f_peers(struct proto_buf *b) { return frame(b, DEP_MSG_PEERS, 0, NULL); }

/* PEERS_OK's message, in frame/ as a frame and in peer/ as a bare body. */
static void seed_peers(struct dep_msg_peers *m, struct dep_msg_peer_info *p) {
  *p = (struct dep_msg_peer_info){
      .address = "10.0.0.2:7470", .node = "node02", .state = "up", .transport = "rdma",
      .wanted = "auto", .last_error = "", .conns_up = 2, .conns_total = 2, .inbound_up = 2,
      .qps_up = 2, .reconnects = 1, .bytes_in = 4096, .bytes_out = 8192, .rtt_us = 85,
      .backoff_ms = 0, .rdma_rtt_us = 12, .data_out = 1, .data_in = 1,
      .data_bytes_out = 1u << 20, .data_bytes_in = 2u << 20, .data_frames_out = 16,
      .data_frames_in = 32, .rdma_blocks_out = 64, .rdma_writes_out = 200, .rdma_posts_out = 20,
      .rdma_bytes_out = 3u << 20};
  *m = (struct dep_msg_peers){.node = "node01", .listen = "10.0.0.1:7470", .auth = 1,
                              .rdma = "mlx5_0", .nic_bytes = 1ull << 30, .proxy_threads = 1,
                              .proxy_busy_us = 5000, .n_peers = 1, .peers = p};
}
static int f_peers_ok(struct proto_buf *b) {
  struct dep_msg_peers m;
  struct dep_msg_peer_info p;
  seed_peers(&m, &p);
  return frame(b, DEP_MSG_PEERS_OK, 0, &m);
}
static int p_peers_ok_body(struct proto_buf *b) {
  struct dep_msg_peers m;
  struct dep_msg_peer_info p;
  seed_peers(&m, &p);
  return proto_encode_peers(b, &m);
}

static int p_keepalive(struct proto_buf *b);
/* PEER carries one peer message: the KEEPALIVE seed's. */
static int f_peer(struct proto_buf *b) {
  struct proto_buf inner;
  proto_buf_init(&inner);
  int rc = p_keepalive(&inner);
  if (rc == 0) {
    struct dep_msg_opaque m = {.data = inner.data, .len = inner.len};
    rc = frame(b, DEP_MSG_PEER, 0, &m);
  }
  proto_buf_free(&inner);
  return rc;
}
static int f_job_nodes(struct proto_buf *b) { return frame(b, DEP_MSG_JOB_NODES, 0, NULL); }
static int f_job_nodes_ok(struct proto_buf *b) {
  /* Static: the struct holds DEP_JOB_NODES_MAX records. */
  static struct dep_msg_job_nodes m;
  memset(&m, 0, sizeof m);
  m.n = 1;
  m.jobs[0] = (struct dep_msg_job_node){.job_id = SEED_JOB, .world_size = 16,
                                        .local_ranks = 8, .remote_ranks = 8, .nodes = 2,
                                        .bytes_out = 1u << 20, .bytes_in = 2u << 20,
                                        .frames_out = 16, .frames_in = 32, .ring_peak = 3,
                                        .ring_entries = 256};
  return frame(b, DEP_MSG_JOB_NODES_OK, 0, &m);
}
static int f_job_events(struct proto_buf *b) { return frame(b, DEP_MSG_JOB_EVENTS, 0, NULL); }
static int f_job_events_ok(struct proto_buf *b) {
  /* Static: the struct holds DEP_JOB_EVENTS_MAX records. */
  static struct dep_msg_job_events m;
  memset(&m, 0, sizeof m);
  m.n = 2;
  m.ev[0] = (struct dep_msg_job_event){.job_id = SEED_JOB, .age_ms = 1500, .rank = 3,
                                       .why = DEP_SLAB_GONE_DIED, .pid = 4242, .epoch = 1};
  m.ev[1] = (struct dep_msg_job_event){.job_id = SEED_JOB, .age_ms = 2500, .rank = 3,
                                       .why = DEP_JOB_EVENT_REJOINED, .pid = 4343, .epoch = 2};
  return frame(b, DEP_MSG_JOB_EVENTS_OK, 0, &m);
}
static int f_stats_lend(struct proto_buf *b) { return frame(b, DEP_MSG_STATS_LEND, 0, NULL); }
static int f_stats_lend_ok(struct proto_buf *b) {
  struct dep_msg_lend_ok m = {.version = DEP_STATS_VERSION,
                              .bytes = (uint32_t)dep_stats_page_bytes(16)};
  return frame(b, DEP_MSG_STATS_LEND_OK, DEP_FRAME_F_FDS, &m);
}
static int f_stats(struct proto_buf *b) {
  struct dep_msg_stats_req m = {.job_id = SEED_JOB};
  return frame(b, DEP_MSG_STATS, 0, &m);
}
static int f_stats_rank(struct proto_buf *b) {
  static struct dep_msg_stats_rank m;
  memset(&m, 0, sizeof m);
  strcpy(m.job_id, SEED_JOB);
  m.rank = 11, m.local_rank = 3, m.world = 16, m.pid = 4321, m.uid = SEED_UID;
  memcpy(m.device_uuid, seed_uuid, sizeof m.device_uuid);
  m.finished = 0, m.cuda = 1, m.age_ms = 60000, m.ended_ms = 0, m.attached = 1;
  m.attach_total_ns = 900000, m.attach_wait_ns = 500000, m.attach_map_ns = 200000;
  m.attach_setup_ns = 150000, m.attach_warmup_ns = 50000, m.dropped = 0;
  for (unsigned i = 0; i < DEP_STATS_WIRE_OPS; i++)
    m.ops[i] = (struct dep_msg_stats_op){.calls = 10 + i, .first_ns = 2000000,
                                         .steady_calls = 9 + i, .median_ns = 80000,
                                         .p99_ns = 120000, .steady_sum_ns = 720000 + i,
                                         .bytes = 1u << 20, .errors = 0, .timeouts = 0};
  static uint32_t tokens[16];
  for (unsigned r = 0; r < 16; r++)
    tokens[r] = 100 + r;
  m.layouts = 3, m.tokens_world = 16, m.tokens = tokens;
  m.kernel_ctas = 24, m.ctas_how = DEP_TUNE_HOW_MEASURED;
  return frame(b, DEP_MSG_STATS_RANK, 0, &m);
}
static int f_stats_ok(struct proto_buf *b) {
  static struct dep_msg_stats_ok m;
  memset(&m, 0, sizeof m);
  m.ranks = 1, m.finished_jobs = 0, m.keep_jobs = 16, m.keep_s = 600;
  m.warn_ratio_milli = 10000, m.warnings = 1;
  strcpy(m.largest_job, SEED_JOB);
  memcpy(m.largest_uuid, seed_uuid, sizeof m.largest_uuid);
  m.largest_bytes = 4ull << 30, m.n_pools = 1;
  memcpy(m.pools[0].uuid, seed_uuid, sizeof m.pools[0].uuid);
  m.pools[0].made_bytes = 8ull << 30;
  return frame(b, DEP_MSG_STATS_OK, 0, &m);
}
static int f_clients(struct proto_buf *b) { return frame(b, DEP_MSG_CLIENTS, 0, NULL); }
static int f_clients_ok(struct proto_buf *b) {
  struct dep_msg_client c = {.pid = 4321, .uid = SEED_UID, .name = "libdeepep-client 0.1.0",
                             .job_id = SEED_JOB, .rank = 11, .local_rank = 3, .attached = 1,
                             .connected_ms = 61000, .attached_ms = 60000};
  memcpy(c.device_uuid, seed_uuid, sizeof c.device_uuid);
  struct dep_msg_clients m = {.n = 1, .left_out = 0, .clients = &c};
  return frame(b, DEP_MSG_CLIENTS_OK, 0, &m);
}
static int f_kernels(struct proto_buf *b) {
  struct dep_msg_kernels m;
  memcpy(m.device_uuid, seed_uuid, sizeof m.device_uuid);
  return frame(b, DEP_MSG_KERNELS, 0, &m);
}
static int f_kernels_ok(struct proto_buf *b) {
  struct dep_msg_kernels_ok m = {
      .arch = 90, .driver = 12040,
      .build = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
      .bytes = 1u << 20};
  return frame(b, DEP_MSG_KERNELS_OK, DEP_FRAME_F_FDS, &m);
}
static int f_xring_lend(struct proto_buf *b) { return frame(b, DEP_MSG_XRING_LEND, 0, NULL); }
static int f_xring_lend_ok(struct proto_buf *b) {
  struct dep_msg_lend_ok m = {.version = DEP_XRING_VERSION, .bytes = (uint32_t)DEP_XRING_BYTES};
  return frame(b, DEP_MSG_XRING_LEND_OK, DEP_FRAME_F_FDS, &m);
}
static int f_tune(struct proto_buf *b) {
  struct dep_msg_tune m = {.sms = 132, .env_ctas = 0};
  return frame(b, DEP_MSG_TUNE, 0, &m);
}
static int f_tune_ok(struct proto_buf *b) {
  struct dep_msg_tune_ok m = {.ctas = 24, .how = DEP_TUNE_HOW_MEASURED};
  return frame(b, DEP_MSG_TUNE_OK, 0, &m);
}
/* A header right in every way but its type, one past the last this build
 * knows by a margin, with 11 pattern bytes of body. */
static int f_unknown_type(struct proto_buf *b) {
  uint8_t body[11];
  pattern(body, sizeof body, 1);
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_TYPE_MAX_ + 5, .flags = 0, .request_id = 77,
                            .body_len = sizeof body};
  uint8_t *p = codec_grow(b, DEP_PROTO_HDR_LEN + sizeof body);
  if (p == NULL)
    return DEP_ERR_NO_MEMORY;
  proto_hdr_encode(&h, p);
  memcpy(p + DEP_PROTO_HDR_LEN, body, sizeof body);
  return 0;
}

/* ---- peer protocol (peer_proto.h) ---- */

static int peer(struct proto_buf *b, const struct dep_peer_msg *m) {
  return peer_proto_encode(b, m);
}
static int p_hello(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_HELLO};
  m.u.hello = (struct dep_peer_hello){.version = DEP_PEER_VERSION, .node = "node01",
                                      .listen_address = "10.0.0.1", .listen_port = 7470};
  memset(m.u.hello.challenge, 0x42, sizeof m.u.hello.challenge);
  return peer(b, &m);
}
static int p_auth(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_AUTH};
  memset(m.u.auth.mac, 0x17, sizeof m.u.auth.mac);
  return peer(b, &m);
}
static int p_auth_ok(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_AUTH_OK};
  return peer(b, &m);
}
static int p_error(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_ERROR};
  m.u.error = (struct dep_peer_error){.code = DEP_ERR_PERMISSION,
                                      .message = "not a configured peer"};
  return peer(b, &m);
}
static int p_keepalive(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_KEEPALIVE};
  m.u.keepalive = (struct dep_peer_keepalive){.reply = 1, .stamp = 123456789};
  return peer(b, &m);
}
static int p_close(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_CLOSE};
  m.u.error = (struct dep_peer_error){.code = 0, .message = "stopping"};
  return peer(b, &m);
}
static int p_membership(struct proto_buf *b) {
  static struct dep_peer_msg m;
  memset(&m, 0, sizeof m);
  m.type = DEP_PEER_MEMBERSHIP;
  struct dep_peer_membership *x = &m.u.membership;
  strcpy(x->job_id, SEED_JOB);
  x->owner_uid = SEED_UID;
  x->sw = (struct dep_shape_world){.shape = seed_shape, .world_size = 16};
  x->local_world_size = 2, x->n_ranks = 2;
  x->ranks[0] = 8, x->ranks[1] = 9;
  x->n_windows = 2;
  for (uint32_t i = 0; i < 2; i++)
    x->windows[i] = (struct dep_peer_window){.rank_index = i, .slab_off = 0,
                                             .len = 64ull << 20,
                                             .addr = 0x7f0000000000ull + (i << 26),
                                             .rkey = 0x1234 + i};
  return peer(b, &m);
}
static int p_job_fail(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_JOB_FAIL};
  m.u.job = (struct dep_peer_job_event){.job_id = SEED_JOB, .owner_uid = SEED_UID, .rank = 3,
                                        .detached = 0, .code = DEP_ERR_PEER,
                                        .message = "rank 3 disconnected on a peer"};
  return peer(b, &m);
}
static int p_job_end(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_JOB_END};
  m.u.job = (struct dep_peer_job_event){.job_id = SEED_JOB, .owner_uid = SEED_UID,
                                        .rank = DEP_PEER_NO_RANK, .detached = 0, .code = 0,
                                        .message = "no ranks left"};
  return peer(b, &m);
}
static int p_xport(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_XPORT};
  m.u.xport = (struct dep_peer_xport){.kind = DEP_PEER_XPORT_RDMA, .mbox_addr = 0x7f0000001000ull,
                                      .mbox_rkey = 0x1234, .mbox_len = 64};
  pattern(m.u.xport.token, sizeof m.u.xport.token, 0);
  return peer(b, &m);
}
static int p_xport_tcp(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_XPORT};
  m.u.xport = (struct dep_peer_xport){.kind = DEP_PEER_XPORT_TCP,
                                      .reason = "transport is tcp in the configuration"};
  return peer(b, &m);
}
static int p_xport_nak(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_XPORT_NAK};
  m.u.nak = (struct dep_peer_error){.code = DEP_ERR_UNSUPPORTED, .message = "no RDMA devices"};
  return peer(b, &m);
}
static int p_data_offer(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_DATA_OFFER};
  pattern(m.u.data_offer.token, sizeof m.u.data_offer.token, 0x20);
  return peer(b, &m);
}
static int p_data_hello(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_DATA_HELLO};
  pattern(m.u.data_hello.token, sizeof m.u.data_hello.token, 0x20);
  m.u.data_hello.listen_port = 7471;
  return peer(b, &m);
}
static int p_membership_ok(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_MEMBERSHIP_OK};
  m.u.job = (struct dep_peer_job_event){.job_id = SEED_JOB, .owner_uid = SEED_UID};
  return peer(b, &m);
}
static int p_job_mask(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_JOB_MASK};
  m.u.mask = (struct dep_peer_job_mask){.job_id = SEED_JOB, .owner_uid = SEED_UID, .rank = 3,
                                        .gen = 1, .why = DEP_SLAB_GONE_DIED, .epoch = 1};
  return peer(b, &m);
}
static int p_job_mask_back(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_JOB_MASK};
  m.u.mask = (struct dep_peer_job_mask){.job_id = SEED_JOB, .owner_uid = SEED_UID, .rank = 3,
                                        .gen = 2, .why = DEP_JOB_EVENT_REJOINED, .epoch = 2,
                                        .join = 9};
  return peer(b, &m);
}
static int p_job_joined(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_JOB_JOINED};
  m.u.joined = (struct dep_peer_job_joined){.job_id = SEED_JOB, .owner_uid = SEED_UID,
                                            .rank = 3, .gen = 2, .ok = 1, .posted = 1};
  return peer(b, &m);
}
static int p_job_held(struct proto_buf *b) {
  struct dep_peer_msg m = {.type = DEP_PEER_JOB_HELD};
  m.u.held = (struct dep_peer_job_held){.job_id = SEED_JOB, .owner_uid = SEED_UID,
                                        .world_size = 4, .live = {0x3}, .held = {0x3}};
  return peer(b, &m);
}
/* The KEEPALIVE seed with its type set past the last this build knows: the
 * header's magic and version are the encoder's own. */
static int p_unknown_type(struct proto_buf *b) {
  size_t start = b->len;
  int rc = p_keepalive(b);
  if (rc != 0)
    return rc;
  codec_put_u16(b->data + start + 6, DEP_PEER_TYPE_MAX_ + 5);
  return 0;
}

/* ---- the data stream (xring.h) ---- */

/* A chunk's frame header with the slot image: every field set. */
static int x_hdr(struct proto_buf *b) {
  struct dep_xfer_hdr h = {.magic = DEP_XFER_MAGIC, .src = 9, .dest = 2, .parity = 1, .seq = 77,
                           .bytes = 3 * 8192, .kind = DEP_XRING_CHUNK | DEP_XRING_SLOT,
                           .row0 = 0, .job_id = SEED_JOB};
  pattern(h.slot, sizeof h.slot, 0x40);
  return dep__xfer_hdr_encode(b, &h);
}

const struct corpus_seed corpus_seeds[] = {
    {"frame", "error", CORPUS_FRAME, f_error},
    {"frame", "hello", CORPUS_FRAME, f_hello},
    {"frame", "hello_ok", CORPUS_FRAME, f_hello_ok},
    {"frame", "status", CORPUS_FRAME, f_status},
    {"frame", "status_ok", CORPUS_FRAME, f_status_ok},
    {"frame", "status_ok_empty", CORPUS_FRAME, f_status_ok_empty},
    {"frame", "attach", CORPUS_FRAME, f_attach},
    {"frame", "attach_ok", CORPUS_FRAME, f_attach_ok},
    {"frame", "detach", CORPUS_FRAME, f_detach},
    {"frame", "detach_ok", CORPUS_FRAME, f_detach_ok},
    {"frame", "shutdown", CORPUS_FRAME, f_shutdown},
    {"frame", "slab", CORPUS_FRAME, f_slab},
    {"frame", "reload", CORPUS_FRAME, f_reload},
    {"frame", "reload_ok", CORPUS_FRAME, f_reload_ok},
    {"frame", "drain", CORPUS_FRAME, f_drain},
    {"frame", "drain_ok", CORPUS_FRAME, f_drain_ok},
    {"frame", "peers", CORPUS_FRAME, f_peers},
    {"frame", "peers_ok", CORPUS_FRAME, f_peers_ok},
    {"frame", "peer", CORPUS_FRAME, f_peer},
    {"frame", "job_nodes", CORPUS_FRAME, f_job_nodes},
    {"frame", "job_nodes_ok", CORPUS_FRAME, f_job_nodes_ok},
    {"frame", "job_events", CORPUS_FRAME, f_job_events},
    {"frame", "job_events_ok", CORPUS_FRAME, f_job_events_ok},
    {"frame", "stats_lend", CORPUS_FRAME, f_stats_lend},
    {"frame", "stats_lend_ok", CORPUS_FRAME, f_stats_lend_ok},
    {"frame", "stats", CORPUS_FRAME, f_stats},
    {"frame", "stats_rank", CORPUS_FRAME, f_stats_rank},
    {"frame", "stats_ok", CORPUS_FRAME, f_stats_ok},
    {"frame", "clients", CORPUS_FRAME, f_clients},
    {"frame", "clients_ok", CORPUS_FRAME, f_clients_ok},
    {"frame", "kernels", CORPUS_FRAME, f_kernels},
    {"frame", "kernels_ok", CORPUS_FRAME, f_kernels_ok},
    {"frame", "xring_lend", CORPUS_FRAME, f_xring_lend},
    {"frame", "xring_lend_ok", CORPUS_FRAME, f_xring_lend_ok},
    {"frame", "tune", CORPUS_FRAME, f_tune},
    {"frame", "tune_ok", CORPUS_FRAME, f_tune_ok},
    {"frame", "unknown_type", CORPUS_FRAME, f_unknown_type},
    {"frame", "xfer_hdr", CORPUS_XFER_HDR, x_hdr},
    {"peer", "hello", CORPUS_PEER, p_hello},
    {"peer", "auth", CORPUS_PEER, p_auth},
    {"peer", "auth_ok", CORPUS_PEER, p_auth_ok},
    {"peer", "error", CORPUS_PEER, p_error},
    {"peer", "keepalive", CORPUS_PEER, p_keepalive},
    {"peer", "close", CORPUS_PEER, p_close},
    {"peer", "membership", CORPUS_PEER, p_membership},
    {"peer", "job_fail", CORPUS_PEER, p_job_fail},
    {"peer", "job_end", CORPUS_PEER, p_job_end},
    {"peer", "xport", CORPUS_PEER, p_xport},
    {"peer", "xport_tcp", CORPUS_PEER, p_xport_tcp},
    {"peer", "xport_nak", CORPUS_PEER, p_xport_nak},
    {"peer", "data_offer", CORPUS_PEER, p_data_offer},
    {"peer", "data_hello", CORPUS_PEER, p_data_hello},
    {"peer", "membership_ok", CORPUS_PEER, p_membership_ok},
    {"peer", "job_mask", CORPUS_PEER, p_job_mask},
    {"peer", "job_mask_back", CORPUS_PEER, p_job_mask_back},
    {"peer", "job_joined", CORPUS_PEER, p_job_joined},
    {"peer", "job_held", CORPUS_PEER, p_job_held},
    {"peer", "unknown_type", CORPUS_PEER, p_unknown_type},
    {"peer", "peers_ok", CORPUS_PEERS_BODY, p_peers_ok_body},
};
const size_t corpus_nseeds = sizeof corpus_seeds / sizeof corpus_seeds[0];

int corpus_seed_is_unknown_type(const char *name) {
  return strncmp(name, "unknown_type", strlen("unknown_type")) == 0;
}

#ifdef DEP_CORPUS_SEEDS_MAIN
/* make corpus: write every seed under argv[1] (tests/corpus). */
int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s CORPUS_DIR (tests/corpus)\n", argv[0]);
    return 2;
  }
  struct proto_buf b;
  proto_buf_init(&b);
  for (size_t i = 0; i < corpus_nseeds; i++) {
    const struct corpus_seed *s = &corpus_seeds[i];
    proto_buf_reset(&b);
    int rc = s->build(&b);
    if (rc != 0) {
      fprintf(stderr, "corpus: %s/%s does not encode: %s\n", s->dir, s->name, dep_strerror(rc));
      return 1;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/%s", argv[1], s->dir, s->name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(b.data, 1, b.len, f) != b.len || fclose(f) != 0) {
      perror(path);
      return 1;
    }
  }
  proto_buf_free(&b);
  printf("corpus: wrote %zu seeds under %s\n", corpus_nseeds, argv[1]);
  return 0;
}
#endif
