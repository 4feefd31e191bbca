/*
 * config_keys.c — the table of every key of deepepd.yaml (config_keys.h):
 * its type, its range, its default, where it lands in struct config and
 * whether it may change without a restart; and the names of the enumerated
 * values.  config_defaults() applies the defaults of this table and no other
 * list; the shipped deepepd.yaml, deepepd.yaml(5) and docs/configuration.md's table are held
 * to it by tests/check_config.c.
 */
#include "config_keys.h"
#include "deepep.h"
#include "shape.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

/* listen.port, and a peer's port left out: a peer listens where this daemon would. */
#define PEER_PORT "7470"

#define AT(f) .off = offsetof(struct config, f), .size = sizeof(((struct config *)0)->f)
#define LIST(f, n)                                                                                 \
  AT(f), .count_off = offsetof(struct config, n), .entry = sizeof(((struct config *)0)->f[0])
#define PEER_AT(f)                                                                                 \
  .off = offsetof(struct config_peer, f), .size = sizeof(((struct config_peer *)0)->f)

_Static_assert(sizeof(enum config_backend) == sizeof(int), "enums are stored as int");
_Static_assert(sizeof(((struct config *)0)->stream_chunk_rows) == 4 &&
                   CONFIG_CHUNK_ROWS_AUTO == UINT32_MAX && DEP_SHAPE_MAX_TOKENS < UINT32_MAX,
               "stream_chunk_rows' auto is the largest u32, which no number of rows reaches");
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
    {.name = "path", .kind = K_STR, AT(socket_path), .flags = F_NONEMPTY | F_SUNPATH,
     .dflt = DEP_DEFAULT_SOCKET},
    {.name = "mode", .kind = K_MODE, AT(socket_mode), .max = 0777, .dflt = "0660"},
    {.name = "group", .kind = K_STR, AT(socket_group), .flags = F_TOKEN, .dflt = ""},
    {.name = NULL}};

static const struct key allow_keys[] = {
    {.name = "users", .kind = K_NAMES, LIST(allow_users, n_allow_users), .live = true, .dflt = "[]"},
    {.name = "groups", .kind = K_NAMES, LIST(allow_groups, n_allow_groups), .live = true, .dflt = "[]"},
    {.name = "any_user", .kind = K_BOOL, AT(allow_any_user), .live = true, .dflt = "false"},
    {.name = NULL}};

static const struct key pool_keys[] = {
    {.name = "size_per_device", .kind = K_SIZE, AT(pool_size_per_device), .min = CHUNK_GRANULE, .max = 64 * TiB,
     .dflt = "8GiB"},
    {.name = "chunk_size", .kind = K_SIZE, AT(pool_chunk_size), .min = CHUNK_GRANULE, .max = 64 * TiB,
     .flags = F_GRANULE, .dflt = "64MiB"},
    /* Live: read when a job's arenas are made, so it applies from the next job on. */
    {.name = "max_allocation", .kind = K_SIZE, AT(pool_max_allocation), .min = CHUNK_GRANULE, .max = 64 * TiB,
     .flags = F_GRANULE | F_ZERO_AUTO, .zero = "the daemon chooses", .live = true, .dflt = "0"},
    {.name = "host_size", .kind = K_SIZE, AT(host_pool_size), .min = CHUNK_GRANULE, .max = 64 * TiB,
     .dflt = "1GiB"},
    {.name = NULL}};

static const struct key listen_keys[] = {
    {.name = "address", .kind = K_STR, AT(listen_address), .flags = F_TOKEN, .dflt = ""},
    {.name = "port", .kind = K_UINT, AT(listen_port), .min = 1, .max = 65535, .dflt = PEER_PORT},
    {.name = NULL}};

static const struct key metrics_keys[] = {
    {.name = "listen", .kind = K_STR, AT(metrics_listen), .flags = F_LISTEN, .dflt = ""},
    {.name = NULL}};

/* A peer's host has no default (it is required), and its transport left out is the top-level
 * one (CONFIG_TRANSPORT_DEFAULT, zero), so neither has a .dflt. */
static const struct key peer_keys[] = {
    {.name = "host", .kind = K_STR, PEER_AT(host), .flags = F_NONEMPTY | F_TOKEN},
    {.name = "port", .kind = K_UINT, PEER_AT(port), .min = 1, .max = 65535, .dflt = PEER_PORT},
    {.name = "transport", .kind = K_ENUM, PEER_AT(transport), .names = transport_names,
     .expected = "one of auto, rdma, tcp"},
    {.name = NULL}};

static const struct key limits_keys[] = {
    {.name = "max_clients", .kind = K_UINT, AT(max_clients), .min = 1, .max = 65536, .live = true,
     .dflt = "1024"},
    {.name = "max_jobs", .kind = K_UINT, AT(max_jobs), .min = 1, .max = 4096, .live = true, .dflt = "64"},
    {.name = "attach_timeout_ms", .kind = K_UINT, AT(attach_timeout_ms), .min = 1, .max = 3600000, .live = true,
     .dflt = "30000"},
    {.name = "op_timeout_ms", .kind = K_UINT, AT(op_timeout_ms), .min = 1, .max = 3600000, .live = true,
     .dflt = "10000"},
    {.name = "client_queue_bytes", .kind = K_SIZE, AT(client_queue_bytes), .min = 64 * KiB, .max = GiB, .live = true,
     .dflt = "4MiB"},
    {.name = "hello_timeout_ms", .kind = K_UINT, AT(hello_timeout_ms), .min = 1, .max = 600000, .live = true,
     .dflt = "5000"},
    {.name = "reserved_clients", .kind = K_UINT, AT(reserved_clients), .min = 0, .max = 1024, .live = true,
     .dflt = "8"},
    {.name = "max_clients_per_uid", .kind = K_UINT, AT(max_clients_per_uid), .min = 1, .max = 65536, .live = true,
     .dflt = "256"},
    {.name = "max_jobs_per_uid", .kind = K_UINT, AT(max_jobs_per_uid), .min = 1, .max = 4096, .live = true,
     .dflt = "16"},
    /* 0: no bound per uid beyond the pool's own */
    {.name = "memory_per_uid", .kind = K_SIZE, AT(memory_per_uid), .min = CHUNK_GRANULE, .max = 64 * TiB,
     .flags = F_ZERO_AUTO, .zero = "no bound per user", .live = true, .dflt = "0"},
    {.name = NULL}};

const struct key config__root_keys[] = {
    {.name = "socket", .kind = K_SECTION, .sub = socket_keys},
    {.name = "allow", .kind = K_SECTION, .sub = allow_keys},
    {.name = "backend", .kind = K_ENUM, AT(backend), .names = backend_names,
     .expected = "one of auto, cuda, host", .dflt = "auto"},
    {.name = "devices", .kind = K_DEVICES, LIST(devices, n_devices), .dflt = "[]"},
    {.name = "pool", .kind = K_SECTION, .sub = pool_keys},
    {.name = "preallocation", .kind = K_BOOL, AT(preallocation), .dflt = "true"},
    {.name = "buffer_cache_enabled", .kind = K_BOOL, AT(buffer_cache_enabled), .dflt = "true"},
    {.name = "kernel_warmup", .kind = K_BOOL, AT(kernel_warmup), .live = true, .dflt = "true"},
    {.name = "kernel_cache_dir", .kind = K_STR, AT(kernel_cache_dir), .flags = F_ABSPATH,
     .dflt = CONFIG_DEFAULT_KERNEL_CACHE_DIR},
    {.name = "adaptive_optimization", .kind = K_BOOL, AT(adaptive_optimization), .live = true,
     .dflt = "false"},
    {.name = "warn_first_call_ratio", .kind = K_RATIO, AT(warn_first_call_ratio), .dmin = 1.0, .dmax = 100.0,
     .live = true, .dflt = "3"},
    {.name = "connection_pool_size", .kind = K_UINT, AT(connection_pool_size), .min = 1, .max = 1024,
     .dflt = "24"},
    {.name = "proxy_threads", .kind = K_UINT, AT(proxy_threads), .min = 0,
     .max = CONFIG_MAX_PROXY_THREADS, .dflt = "0"},
    {.name = "stream_chunk_rows", .kind = K_UINT, AT(stream_chunk_rows), .min = 0,
     .max = DEP_SHAPE_MAX_TOKENS, .flags = F_AUTO, .dflt = "auto"},
    {.name = "listen", .kind = K_SECTION, .sub = listen_keys},
    {.name = "peers", .kind = K_PEERS, LIST(peers, n_peers), .sub = peer_keys, .dflt = "[]"},
    {.name = "peer_key_file", .kind = K_STR, AT(peer_key_file), .dflt = ""},
    {.name = "peer_insecure", .kind = K_BOOL, AT(peer_insecure), .dflt = "false"},
    {.name = "peer_wait_ms", .kind = K_UINT, AT(peer_wait_ms), .min = 0, .max = 3600000, .dflt = "10000"},
    {.name = "transport", .kind = K_ENUM, AT(transport), .names = transport_names,
     .expected = "one of auto, rdma, tcp", .dflt = "auto"},
    {.name = "metrics", .kind = K_SECTION, .sub = metrics_keys},
    {.name = "limits", .kind = K_SECTION, .sub = limits_keys},
    {.name = "log_level", .kind = K_ENUM, AT(log_level), .names = log_level_names,
     .expected = "one of err, warning, notice, info, debug", .live = true, .dflt = "info"},
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

uint64_t config__auto(const struct key *k) {
  return k->size == 8 ? UINT64_MAX : k->size == 4 ? UINT32_MAX : UINT16_MAX;
}

bool config__is_auto(const struct key *k, const char *s, size_t n) {
  return (k->flags & F_AUTO) && s != NULL && n == 4 && strncasecmp(s, "auto", 4) == 0;
}

void config__defaults(const struct key *table, char *base) {
  for (const struct key *k = table; k->name != NULL; k++) {
    char *dst = base + k->off;
    const char *d = k->dflt;
    size_t n = d != NULL ? strlen(d) : 0;
    uint64_t u = 0;
    int64_t i = 0;
    size_t unit_at;
    if (k->kind == K_SECTION) {
      config__defaults(k->sub, base);
      continue;
    }
    if (d == NULL)
      continue;
    switch (k->kind) {
    case K_BOOL: {
      bool x = false;
      config_value_bool(d, n, &x);
      memcpy(dst, &x, sizeof x);
      break;
    }
    case K_UINT:
      if (config__is_auto(k, d, n))
        config__put_uint(dst, k->size, config__auto(k));
      else if (config_value_int(d, n, &i) == CONFIG_VALUE_OK)
        config__put_uint(dst, k->size, (uint64_t)i);
      break;
    case K_SIZE:
      if (config_value_size(d, n, &u, &unit_at) == CONFIG_VALUE_OK)
        config__put_uint(dst, k->size, u);
      break;
    case K_MODE:
      if (config_value_mode(d, n, &u) == CONFIG_VALUE_OK)
        config__put_uint(dst, k->size, u);
      break;
    case K_RATIO: {
      double x = 0;
      config_value_ratio(d, n, &x);
      memcpy(dst, &x, sizeof x);
      break;
    }
    case K_STR:
      snprintf(dst, k->size, "%s", d);
      break;
    case K_ENUM:
      for (const struct name_value *t = k->names; t->name != NULL; t++)
        if (strcmp(t->name, d) == 0) {
          memcpy(dst, &t->value, sizeof t->value);
          break;
        }
      break;
    case K_NAMES:
    case K_DEVICES:
    case K_PEERS: {
      size_t none = 0; /* "[]": a list's only default */
      memcpy(base + k->count_off, &none, sizeof none);
      break;
    }
    default:
      break;
    }
  }
}
