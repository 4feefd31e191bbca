/*
 * config_keys.c — the table of every key of deepepd.yaml (config_keys.h):
 * its type, its range, where it lands in struct config and whether it may
 * change without a restart; and the names of the enumerated values.
 */
#include "config_keys.h"
#include "shape.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define AT(f) .off = offsetof(struct config, f), .size = sizeof(((struct config *)0)->f)
#define LIST(f, n)                                                                                 \
  AT(f), .count_off = offsetof(struct config, n), .entry = sizeof(((struct config *)0)->f[0])
#define PEER_AT(f)                                                                                 \
  .off = offsetof(struct config_peer, f), .size = sizeof(((struct config_peer *)0)->f)

_Static_assert(sizeof(enum config_backend) == sizeof(int), "enums are stored as int");
_Static_assert(sizeof(enum config_log_level) == sizeof(int), "enums are stored as int");
_Static_assert(sizeof(enum config_transport) == sizeof(int), "enums are stored as int");

/* The tables read best one key to a line. */
/* clang-format off */
static const struct name_value backend_names[] = {
    {"auto", CONFIG_BACKEND_AUTO}, {"cuda", CONFIG_BACKEND_CUDA}, {"host", CONFIG_BACKEND_HOST},
    {NULL, 0}};

static const struct name_value transport_names[] = {
    {"auto", CONFIG_TRANSPORT_AUTO}, {"rdma", CONFIG_TRANSPORT_RDMA}, {"tcp", CONFIG_TRANSPORT_TCP},
    {NULL, 0}};

static const struct name_value log_level_names[] = {
    {"err", CONFIG_LOG_ERR}, {"warning", CONFIG_LOG_WARNING}, {"notice", CONFIG_LOG_NOTICE},
    {"info", CONFIG_LOG_INFO}, {"debug", CONFIG_LOG_DEBUG},
    /* Spellings people type; config_log_level_name gives the ones above. */
    {"error", CONFIG_LOG_ERR}, {"warn", CONFIG_LOG_WARNING},
    {NULL, 0}};

static const struct key socket_keys[] = {
    {.name = "path", .kind = K_STR, AT(socket_path), .flags = F_NONEMPTY | F_SUNPATH},
    {.name = "mode", .kind = K_MODE, AT(socket_mode), .max = 0777},
    {.name = "group", .kind = K_STR, AT(socket_group), .flags = F_TOKEN},
    {.name = NULL}};

static const struct key allow_keys[] = {
    {.name = "users", .kind = K_NAMES, LIST(allow_users, n_allow_users), .live = true},
    {.name = "groups", .kind = K_NAMES, LIST(allow_groups, n_allow_groups), .live = true},
    {.name = "any_user", .kind = K_BOOL, AT(allow_any_user), .live = true},
    {.name = NULL}};

static const struct key pool_keys[] = {
    {.name = "size_per_device", .kind = K_SIZE, AT(pool_size_per_device), .min = CHUNK_GRANULE, .max = 64 * TiB},
    {.name = "chunk_size", .kind = K_SIZE, AT(pool_chunk_size), .min = CHUNK_GRANULE, .max = 64 * TiB,
     .flags = F_GRANULE},
    /* Live: read when a job's arenas are made, so it applies from the next job on. */
    {.name = "max_allocation", .kind = K_SIZE, AT(pool_max_allocation), .min = CHUNK_GRANULE, .max = 64 * TiB,
     .flags = F_GRANULE | F_ZERO_AUTO, .zero = "the daemon chooses", .live = true},
    {.name = "host_size", .kind = K_SIZE, AT(host_pool_size), .min = CHUNK_GRANULE, .max = 64 * TiB},
    {.name = NULL}};

static const struct key listen_keys[] = {
    {.name = "address", .kind = K_STR, AT(listen_address), .flags = F_TOKEN},
    {.name = "port", .kind = K_UINT, AT(listen_port), .min = 1, .max = 65535},
    {.name = NULL}};

static const struct key metrics_keys[] = {
    {.name = "listen", .kind = K_STR, AT(metrics_listen), .flags = F_LISTEN},
    {.name = NULL}};

static const struct key peer_keys[] = {
    {.name = "host", .kind = K_STR, PEER_AT(host), .flags = F_NONEMPTY | F_TOKEN},
    {.name = "port", .kind = K_UINT, PEER_AT(port), .min = 1, .max = 65535},
    {.name = "transport", .kind = K_ENUM, PEER_AT(transport), .names = transport_names,
     .expected = "one of auto, rdma, tcp"},
    {.name = NULL}};

static const struct key limits_keys[] = {
    {.name = "max_clients", .kind = K_UINT, AT(max_clients), .min = 1, .max = 65536, .live = true},
    {.name = "max_jobs", .kind = K_UINT, AT(max_jobs), .min = 1, .max = 4096, .live = true},
    {.name = "attach_timeout_ms", .kind = K_UINT, AT(attach_timeout_ms), .min = 1, .max = 3600000, .live = true},
    {.name = "op_timeout_ms", .kind = K_UINT, AT(op_timeout_ms), .min = 1, .max = 3600000, .live = true},
    {.name = "client_queue_bytes", .kind = K_SIZE, AT(client_queue_bytes), .min = 64 * KiB, .max = GiB, .live = true},
    {.name = "hello_timeout_ms", .kind = K_UINT, AT(hello_timeout_ms), .min = 1, .max = 600000, .live = true},
    {.name = "reserved_clients", .kind = K_UINT, AT(reserved_clients), .min = 0, .max = 1024, .live = true},
    {.name = "max_clients_per_uid", .kind = K_UINT, AT(max_clients_per_uid), .min = 1, .max = 65536, .live = true},
    {.name = "max_jobs_per_uid", .kind = K_UINT, AT(max_jobs_per_uid), .min = 1, .max = 4096, .live = true},
    /* 0: no bound per uid beyond the pool's own */
    {.name = "memory_per_uid", .kind = K_SIZE, AT(memory_per_uid), .min = CHUNK_GRANULE, .max = 64 * TiB,
     .flags = F_ZERO_AUTO, .zero = "no bound per user", .live = true},
    {.name = NULL}};

const struct key config__root_keys[] = {
    {.name = "socket", .kind = K_SECTION, .sub = socket_keys},
    {.name = "allow", .kind = K_SECTION, .sub = allow_keys},
    {.name = "backend", .kind = K_ENUM, AT(backend), .names = backend_names,
     .expected = "one of auto, cuda, host"},
    {.name = "devices", .kind = K_DEVICES, LIST(devices, n_devices)},
    {.name = "pool", .kind = K_SECTION, .sub = pool_keys},
    {.name = "preallocation", .kind = K_BOOL, AT(preallocation)},
    {.name = "buffer_cache_enabled", .kind = K_BOOL, AT(buffer_cache_enabled)},
    {.name = "kernel_warmup", .kind = K_BOOL, AT(kernel_warmup), .live = true},
    {.name = "kernel_cache_dir", .kind = K_STR, AT(kernel_cache_dir), .flags = F_ABSPATH},
    {.name = "adaptive_optimization", .kind = K_BOOL, AT(adaptive_optimization), .live = true},
    {.name = "warn_first_call_ratio", .kind = K_RATIO, AT(warn_first_call_ratio), .dmin = 1.0, .dmax = 100.0,
     .live = true},
    {.name = "connection_pool_size", .kind = K_UINT, AT(connection_pool_size), .min = 1, .max = 1024},
    {.name = "proxy_threads", .kind = K_UINT, AT(proxy_threads), .min = 0, .max = 64},
    {.name = "stream_chunk_rows", .kind = K_UINT, AT(stream_chunk_rows), .min = 0,
     .max = DEP_SHAPE_MAX_TOKENS},
    {.name = "listen", .kind = K_SECTION, .sub = listen_keys},
    {.name = "peers", .kind = K_PEERS, LIST(peers, n_peers), .sub = peer_keys},
    {.name = "peer_key_file", .kind = K_STR, AT(peer_key_file)},
    {.name = "peer_insecure", .kind = K_BOOL, AT(peer_insecure)},
    {.name = "peer_wait_ms", .kind = K_UINT, AT(peer_wait_ms), .min = 0, .max = 3600000},
    {.name = "transport", .kind = K_ENUM, AT(transport), .names = transport_names,
     .expected = "one of auto, rdma, tcp"},
    {.name = "metrics", .kind = K_SECTION, .sub = metrics_keys},
    {.name = "limits", .kind = K_SECTION, .sub = limits_keys},
    {.name = "log_level", .kind = K_ENUM, AT(log_level), .names = log_level_names,
     .expected = "one of err, warning, notice, info, debug", .live = true},
    {.name = NULL}};
/* clang-format on */

const char *config__name_of(const struct name_value *t, int value) {
  for (; t->name != NULL; t++)
    if (t->value == value)
      return t->name;
  return "unknown";
}

const char *config_backend_name(enum config_backend b) { return config__name_of(backend_names, (int)b); }

const char *config_transport_name(enum config_transport t) {
  return t == CONFIG_TRANSPORT_DEFAULT ? "default" : config__name_of(transport_names, (int)t);
}

enum config_transport config_peer_transport(const struct config *c, const struct config_peer *p) {
  return p->transport != CONFIG_TRANSPORT_DEFAULT ? p->transport : c->transport;
}

const char *config_log_level_name(enum config_log_level l) {
  return config__name_of(log_level_names, (int)l);
}

void config__path_join(char *out, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out, len, fmt, ap);
  va_end(ap);
}

void config__put_uint(void *p, size_t size, uint64_t v) {
  uint16_t v16 = (uint16_t)v;
  uint32_t v32 = (uint32_t)v;
  memcpy(p, size == 8 ? (void *)&v : size == 4 ? (void *)&v32 : (void *)&v16, size);
}

uint64_t config__get_uint(const void *p, size_t size) {
  uint16_t v16 = 0;
  uint32_t v32 = 0;
  uint64_t v64 = 0;
  memcpy(size == 8 ? (void *)&v64 : size == 4 ? (void *)&v32 : (void *)&v16, p, size);
  return size == 8 ? v64 : size == 4 ? v32 : v16;
}

/* A string value into dst (size bytes, NUL included), checked against the flags. */
