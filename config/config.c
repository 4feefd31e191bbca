/*
 * config.c — deepepd.yaml into struct config (DESIGN §9).
 *
 * One table below names every key: its type, its range, where it lands in
 * the struct and whether it may change without a restart.  The loader, its
 * error messages ("known: ...") and config_diff_restart all read that table,
 * so they cannot disagree.  The YAML is loaded with libyaml's document API
 * and walked against the table; the first problem stops the walk with
 * "FILE:LINE:COLUMN: what is wrong".  Everything is written into a copy, and
 * the caller's struct changes only when the whole file checked out.
 */
#include "config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

#include "config_value.h"
#include "deepep.h"

/* CUDA VMM maps memory in 2 MiB granules; pool.chunk_size (the size the pool is
 * preallocated in), pool.max_allocation (the largest allocation an arena is made of)
 * and the pool sizes are whole numbers of them. */
#define CHUNK_GRANULE (2 * MiB)
#define DEFAULT_PORT 7470
/* A config file is a page of text; anything this big is a mistake (or an attack). */
#define CONFIG_FILE_MAX (1024 * 1024)
/* %YAML and %TAG lines before the document (check_shape); a config file needs none. */
#define CONFIG_MAX_DIRECTIVES 16

enum kind {
  K_SECTION, /* a mapping of further keys */
  K_BOOL,
  K_UINT,    /* decimal integer, min..max, stored in .size bytes */
  K_SIZE,    /* bytes, or a number with KiB/MiB/GiB/TiB, min..max */
  K_MODE,    /* octal file mode */
  K_RATIO,   /* a real number, dmin..dmax */
  K_STR,     /* a string shorter than .size */
  K_NAMES,   /* list of user/group names (or ids) */
  K_DEVICES, /* list of GPU UUIDs */
  K_PEERS,   /* list of {host, port} */
  K_ENUM,    /* one of .names, stored as int */
};

struct name_value {
  const char *name;
  int value;
};

/* Flags on strings. */
#define F_NONEMPTY 1u /* "" is not allowed */
#define F_SUNPATH 2u  /* the length limit is sun_path's: say so */
#define F_TOKEN 4u    /* a name: no spaces */
/* Flag on sizes. */
#define F_GRANULE 8u  /* a whole number of CHUNK_GRANULE (allocation sizes) */
#define F_ZERO_AUTO 16u /* K_SIZE: 0 is allowed too, and means "the daemon chooses" */
#define F_ABSPATH 32u /* K_STR: "" or an absolute path (the daemon's cwd is no place to rely on) */
#define F_LISTEN 64u  /* K_STR: "" or "ADDRESS:PORT" (config_listen_split) */

struct key {
  const char *name;
  enum kind kind;
  size_t off, size;               /* where the value lands (relative to the base) and its size */
  size_t count_off;               /* lists: where the entry count lives */
  size_t entry;                   /* lists: size of one entry */
  uint64_t min, max;              /* K_UINT, K_SIZE, K_MODE */
  double dmin, dmax;              /* K_RATIO */
  unsigned flags;                 /* K_STR, list entries and K_SIZE */
  bool live;                      /* may change on SIGHUP without a restart */
  const struct key *sub;          /* K_SECTION (and K_PEERS: the keys of one peer) */
  const struct name_value *names; /* K_ENUM, ended by a NULL name */
  const char *expected;           /* K_ENUM: the choices, for messages */
};

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
     .flags = F_GRANULE | F_ZERO_AUTO, .live = true},
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
     .flags = F_ZERO_AUTO, .live = true},
    {.name = NULL}};

static const struct key root_keys[] = {
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

void config_defaults(struct config *c) {
  memset(c, 0, sizeof *c);
  snprintf(c->socket_path, sizeof c->socket_path, "%s", DEP_DEFAULT_SOCKET);
  c->socket_mode = 0660;
  c->allow_any_user = false;
  c->backend = CONFIG_BACKEND_AUTO;
  c->pool_size_per_device = 8 * GiB;
  c->pool_chunk_size = 64 * MiB;
  c->pool_max_allocation = 0; /* the daemon chooses (job.c) */
  c->host_pool_size = 1 * GiB;
  c->preallocation = true;
  c->buffer_cache_enabled = true;
  c->kernel_warmup = true;
  snprintf(c->kernel_cache_dir, sizeof c->kernel_cache_dir, "%s", CONFIG_DEFAULT_KERNEL_CACHE_DIR);
  c->warn_first_call_ratio = 3.0;
  c->connection_pool_size = 24;
  c->listen_port = DEFAULT_PORT;
  c->peer_insecure = false;
  c->peer_wait_ms = 10000;
  c->transport = CONFIG_TRANSPORT_AUTO;
  c->max_clients = 1024;
  c->max_jobs = 64;
  c->attach_timeout_ms = 30000;
  c->op_timeout_ms = 10000;
  c->client_queue_bytes = 4 * MiB;
  c->hello_timeout_ms = 5000;
  c->reserved_clients = 8;
  c->max_clients_per_uid = 256;
  c->max_jobs_per_uid = 16;
  c->memory_per_uid = 0;
  c->log_level = CONFIG_LOG_INFO;
}

static const char *name_of(const struct name_value *t, int value) {
  for (; t->name != NULL; t++)
    if (t->value == value)
      return t->name;
  return "unknown";
}

const char *config_backend_name(enum config_backend b) { return name_of(backend_names, (int)b); }

const char *config_transport_name(enum config_transport t) {
  return t == CONFIG_TRANSPORT_DEFAULT ? "default" : name_of(transport_names, (int)t);
}

enum config_transport config_peer_transport(const struct config *c, const struct config_peer *p) {
  return p->transport != CONFIG_TRANSPORT_DEFAULT ? p->transport : c->transport;
}

const char *config_log_level_name(enum config_log_level l) {
  return name_of(log_level_names, (int)l);
}

int config_listen_split(const char *s, char *host, size_t hostlen, uint16_t *port, char *why,
                        size_t whylen) {
  static const char form[] = "write ADDRESS:PORT with a numeric address, e.g. 127.0.0.1:9464, "
                             "[::1]:9464, or 0.0.0.0:9464 for every interface";
  const char *colon, *h = s;
  size_t hlen;
  int family = AF_INET;
  if (s[0] == '[') {
    const char *end = strchr(s, ']');
    if (end == NULL || end[1] != ':') {
      snprintf(why, whylen, "'%s' has no ']:PORT' after its IPv6 address; %s", s, form);
      return -1;
    }
    h = s + 1;
    hlen = (size_t)(end - h);
    colon = end + 1;
    family = AF_INET6;
  } else {
    colon = strrchr(s, ':');
    if (colon == NULL) {
      snprintf(why, whylen, "'%s' is not ADDRESS:PORT; %s", s, form);
      return -1;
    }
    hlen = (size_t)(colon - s);
    if (memchr(s, ':', hlen) != NULL) {
      snprintf(why, whylen, "'%s': an IPv6 address goes in brackets ([::1]:9464)", s);
      return -1;
    }
  }
  char addr[64];
  unsigned char bin[sizeof(struct in6_addr)];
  if (hlen == 0 || hlen >= sizeof addr || hlen >= hostlen) {
    snprintf(why, whylen, "'%s' has %s address; %s", s, hlen == 0 ? "no" : "too long an", form);
    return -1;
  }
  memcpy(addr, h, hlen);
  addr[hlen] = '\0';
  if (inet_pton(family, addr, bin) != 1) {
    snprintf(why, whylen, "'%s' is not a numeric %s address (a host name is not resolved "
             "here); %s", addr, family == AF_INET ? "IPv4" : "IPv6", form);
    return -1;
  }
  const char *p = colon + 1;
  unsigned long v = 0;
  size_t digits = 0;
  for (; *p >= '0' && *p <= '9' && digits < 6; p++, digits++)
    v = v * 10 + (unsigned long)(*p - '0');
  if (digits == 0 || *p != '\0' || v < 1 || v > 65535) {
    snprintf(why, whylen, "the port of '%s' must be a number from 1 to 65535", s);
    return -1;
  }
  memcpy(host, addr, hlen + 1);
  *port = (uint16_t)v;
  return 0;
}

/* ---- loading -------------------------------------------------------------- */

struct loader {
  yaml_document_t *doc;
  const char *name; /* the file, for messages */
  char *err;
  size_t errlen;
  /* The pool sizes are checked against each other after the walk; these say where each was set. */
  const yaml_node_t *pool_size_node, *chunk_node, *host_node;
};

static size_t line_of(yaml_mark_t m) { return m.line + 1; }

/* Write "FILE:LINE:COLUMN: message" and return DEP_ERR_CONFIG. */
static int fail(struct loader *L, yaml_mark_t m, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(struct loader *L, yaml_mark_t m, const char *fmt, ...) {
  if (L->err != NULL && L->errlen > 0) {
    int n = snprintf(L->err, L->errlen, "%s:%zu:%zu: ", L->name, m.line + 1, m.column + 1);
    if (n >= 0 && (size_t)n < L->errlen) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(L->err + n, L->errlen - (size_t)n, fmt, ap);
      va_end(ap);
    }
  }
  return DEP_ERR_CONFIG;
}

/* Text from the file, made safe to print on one line: at most 40 bytes, odd bytes as '?'. */
static const char *shown(const unsigned char *s, size_t n, char *buf, size_t len) {
  size_t lim = len > 5 ? len - 5 : 0, o = 0;
  for (size_t i = 0; i < n && o < lim && o < 40; i++)
    buf[o++] = (s[i] >= 0x20 && s[i] < 0x7f) || s[i] >= 0x80 ? (char)s[i] : '?';
  if (o < n && lim > 0)
    o += (size_t)snprintf(buf + o, len - o, "...");
  buf[o < len ? o : len - 1] = '\0';
  return buf;
}

/* Key paths ("pool.chunk_size", "peers[2].host") for messages; a long one is cut, never overrun. */
static void path_join(char *out, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void path_join(char *out, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out, len, fmt, ap);
  va_end(ap);
}

static bool is_null(const yaml_node_t *n) {
  if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
    return false;
  const char *s = (const char *)n->data.scalar.value;
  size_t len = n->data.scalar.length;
  return len == 0 || (len == 1 && s[0] == '~') ||
         (len == 4 && (!strcmp(s, "null") || !strcmp(s, "Null") || !strcmp(s, "NULL")));
}

/* What a node is, for "got ..." in messages. */
static const char *what(const yaml_node_t *n, char *buf, size_t len) {
  if (n->type == YAML_MAPPING_NODE)
    return "a mapping";
  if (n->type == YAML_SEQUENCE_NODE)
    return "a list";
  if (n->type != YAML_SCALAR_NODE || is_null(n))
    return "an empty value";
  char t[64];
  snprintf(buf, len, "'%s'", shown(n->data.scalar.value, n->data.scalar.length, t, sizeof t));
  return buf;
}

static int wrong_type(struct loader *L, const yaml_node_t *v, const char *expected,
                      const char *path) {
  char buf[80];
  return fail(L, v->start_mark, "expected %s for '%s', got %s", expected, path,
              what(v, buf, sizeof buf));
}

/* Integer members are uint16_t, uint32_t or uint64_t; the table gives the size, the range fits it.
 */
static void put_uint(void *p, size_t size, uint64_t v) {
  uint16_t v16 = (uint16_t)v;
  uint32_t v32 = (uint32_t)v;
  memcpy(p, size == 8 ? (void *)&v : size == 4 ? (void *)&v32 : (void *)&v16, size);
}

static uint64_t get_uint(const void *p, size_t size) {
  uint16_t v16 = 0;
  uint32_t v32 = 0;
  uint64_t v64 = 0;
  memcpy(size == 8 ? (void *)&v64 : size == 4 ? (void *)&v32 : (void *)&v16, p, size);
  return size == 8 ? v64 : size == 4 ? v32 : v16;
}

/* A string value into dst (size bytes, NUL included), checked against the flags. */
static int take_string(struct loader *L, const yaml_node_t *v, const char *path, unsigned flags,
                       char *dst, size_t size) {
  if (v->type != YAML_SCALAR_NODE)
    return wrong_type(L, v, "a string", path);
  const char *s = is_null(v) ? "" : (const char *)v->data.scalar.value;
  size_t n = is_null(v) ? 0 : v->data.scalar.length;
  if (n == 0 && (flags & F_NONEMPTY))
    return fail(L, v->start_mark, "'%s' must not be empty", path);
  if (n > 0 && s[0] != '/' && (flags & F_ABSPATH))
    return fail(L, v->start_mark, "'%s' must be an absolute path (or \"\" for none)", path);
  if (n >= size) {
    if (flags & F_SUNPATH)
      return fail(L, v->start_mark,
                  "'%s' is %zu bytes; a Unix socket path must be shorter than %zu bytes "
                  "(sun_path): pick a shorter directory",
                  path, n, size);
    return fail(L, v->start_mark, "'%s' is too long (%zu bytes, at most %zu)", path, n, size - 1);
  }
  for (size_t i = 0; i < n; i++) {
    unsigned char ch = (unsigned char)s[i];
    if (ch < 0x20 || ch == 0x7f)
      return fail(L, v->start_mark, "'%s' must not contain control characters", path);
    if (ch == ' ' && (flags & F_TOKEN))
      return fail(L, v->start_mark, "'%s' must not contain spaces", path);
  }
  memcpy(dst, s, n);
  dst[n] = '\0';
  if (n > 0 && (flags & F_LISTEN)) {
    char host[64], why[200];
    uint16_t port;
    if (config_listen_split(dst, host, sizeof host, &port, why, sizeof why) != 0)
      return fail(L, v->start_mark, "'%s': %s", path, why);
  }
  return 0;
}

static int apply_mapping(struct loader *L, const yaml_node_t *m, const struct key *table,
                         char *base, const char *path);

/* A list of strings (users, groups, devices) replacing the one in the struct. */
static int take_list(struct loader *L, const struct key *k, const yaml_node_t *v, char *base,
                     const char *path) {
  size_t count = 0;
  if (!is_null(v)) {
    if (v->type != YAML_SEQUENCE_NODE)
      return wrong_type(L, v, k->kind == K_DEVICES ? "a list of GPU UUIDs" : "a list of names",
                        path);
    for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top;
         it++) {
      const yaml_node_t *e = yaml_document_get_node(L->doc, *it);
      if (e == NULL)
        continue;
      char epath[96];
      path_join(epath, sizeof epath, "%s[%zu]", path, count);
      if (count == CONFIG_MAX_LIST)
        return fail(L, e->start_mark, "too many entries in '%s' (at most %d)", path,
                    CONFIG_MAX_LIST);
      if (is_null(e))
        return fail(L, e->start_mark, "'%s' is empty", epath);
      char *dst = base + k->off + count * k->entry;
      int rc = take_string(L, e, epath, F_NONEMPTY | F_TOKEN, dst, k->entry);
      if (rc != 0)
        return rc;
      if (k->kind == K_DEVICES && !config_value_gpu_uuid(dst))
        return fail(L, e->start_mark,
                    "'%s' is not a GPU UUID (like GPU-5fa1c2e0-1b2c-3d4e-5f60-718293a4b5c6; "
                    "`nvidia-smi -L` lists them)",
                    epath);
      count++;
    }
  }
  memcpy(base + k->count_off, &count, sizeof count);
  return 0;
}

/* peers: a list of {host, port} mappings replacing the one in the struct. */
static int take_peers(struct loader *L, const struct key *k, const yaml_node_t *v, char *base,
                      const char *path) {
  size_t count = 0;
  if (!is_null(v)) {
    if (v->type != YAML_SEQUENCE_NODE)
      return wrong_type(L, v, "a list of {host, port} mappings", path);
    for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top;
         it++) {
      const yaml_node_t *e = yaml_document_get_node(L->doc, *it);
      if (e == NULL)
        continue;
      char epath[96];
      path_join(epath, sizeof epath, "%s[%zu]", path, count);
      if (count == CONFIG_MAX_LIST)
        return fail(L, e->start_mark, "too many entries in '%s' (at most %d)", path,
                    CONFIG_MAX_LIST);
      if (e->type != YAML_MAPPING_NODE)
        return wrong_type(L, e, "a mapping {host, port}", epath);
      struct config_peer *p = (struct config_peer *)(void *)(base + k->off) + count;
      memset(p, 0, sizeof *p);
      p->port = DEFAULT_PORT;
      int rc = apply_mapping(L, e, k->sub, (char *)p, epath);
      if (rc != 0)
        return rc;
      if (p->host[0] == '\0')
        return fail(L, e->start_mark, "'%s' needs a 'host'", epath);
      count++;
    }
  }
  memcpy(base + k->count_off, &count, sizeof count);
  return 0;
}

/* One value for one known key. */
static int apply_value(struct loader *L, const struct key *k, const yaml_node_t *v, char *base,
                       const char *path) {
  char *dst = base + k->off;
  switch (k->kind) {
  case K_SECTION:
    return apply_mapping(L, v, k->sub, base, path);
  case K_NAMES:
  case K_DEVICES:
    return take_list(L, k, v, base, path);
  case K_PEERS:
    return take_peers(L, k, v, base, path);
  case K_STR:
    return take_string(L, v, path, k->flags, dst, k->size);
  default:
    break;
  }

  /* The rest are single scalars. */
  const char *s = (const char *)(v->type == YAML_SCALAR_NODE ? v->data.scalar.value : NULL);
  size_t n = s != NULL ? v->data.scalar.length : 0;
  bool scalar = s != NULL && !is_null(v) && strlen(s) == n;
  const unsigned char *raw = scalar ? v->data.scalar.value : NULL;
  char a[48], b[48], got[48];
  switch (k->kind) {
  case K_BOOL: {
    bool x;
    if (!scalar || config_value_bool(s, n, &x) != CONFIG_VALUE_OK)
      return wrong_type(L, v, "a boolean (true/false)", path);
    memcpy(dst, &x, sizeof x);
    return 0;
  }
  case K_UINT: {
    int64_t x = 0;
    int rc = scalar ? config_value_int(s, n, &x) : CONFIG_VALUE_BAD;
    if (rc == CONFIG_VALUE_BAD)
      return wrong_type(L, v, "a decimal integer", path);
    if (rc != CONFIG_VALUE_OK || x < (int64_t)k->min || x > (int64_t)k->max)
      return fail(L, v->start_mark, "'%s' must be between %" PRIu64 " and %" PRIu64 ", got %s",
                  path, k->min, k->max, shown(raw, n, got, sizeof got));
    put_uint(dst, k->size, (uint64_t)x);
    return 0;
  }
  case K_SIZE: {
    uint64_t x = 0;
    size_t unit_at = 0;
    int rc = scalar ? config_value_size(s, n, &x, &unit_at) : CONFIG_VALUE_BAD;
    if (rc == CONFIG_VALUE_BAD)
      return wrong_type(L, v, "a size (bytes, or a number with KiB, MiB, GiB or TiB)", path);
    if (rc == CONFIG_VALUE_UNIT)
      return fail(L, v->start_mark, "unknown size unit '%s' in '%s' (use B, KiB, MiB, GiB or TiB)",
                  shown(raw + unit_at, n - unit_at, got, sizeof got), path);
    if (rc == CONFIG_VALUE_FRACTION) {
      /* The same size in a smaller unit, when it is a whole number of bytes; plain bytes
       * below 1 KiB, since "N bytes" is not a spelling the parser takes. */
      if (x % KiB == 0)
        config_value_size_text(x, a, sizeof a);
      else
        snprintf(a, sizeof a, "%" PRIu64, x);
      return fail(L, v->start_mark,
                  "'%s' must be a whole number of bytes or of KiB, MiB, GiB or TiB, got %s%s%s",
                  path, shown(raw, n, got, sizeof got), x != 0 ? "; write " : "",
                  x != 0 ? a : "");
    }
    const bool auto_ok = (k->flags & F_ZERO_AUTO) && rc == CONFIG_VALUE_OK && x == 0;
    if (!auto_ok && (rc != CONFIG_VALUE_OK || x < k->min || x > k->max))
      return fail(L, v->start_mark, "'%s' must be %sbetween %s and %s, got %s", path,
                  (k->flags & F_ZERO_AUTO) ? "0 (the daemon chooses) or " : "",
                  config_value_size_text(k->min, a, sizeof a),
                  config_value_size_text(k->max, b, sizeof b), shown(raw, n, got, sizeof got));
    if ((k->flags & F_GRANULE) && x % CHUNK_GRANULE != 0)
      return fail(L, v->start_mark,
                  "'%s' must be a multiple of 2 MiB (the CUDA VMM granularity), got %s", path,
                  config_value_size_text(x, a, sizeof a));
    if (k->off == offsetof(struct config, pool_chunk_size)) {
      L->chunk_node = v;
    } else if (k->off == offsetof(struct config, pool_size_per_device)) {
      L->pool_size_node = v;
    } else if (k->off == offsetof(struct config, host_pool_size)) {
      L->host_node = v;
    }
    put_uint(dst, k->size, x);
    return 0;
  }
  case K_MODE: {
    uint64_t x = 0;
    int rc = scalar ? config_value_mode(s, n, &x) : CONFIG_VALUE_BAD;
    if (rc == CONFIG_VALUE_BAD)
      return wrong_type(L, v, "a file mode in octal (like 0660)", path);
    if (rc != CONFIG_VALUE_OK || x > k->max)
      return fail(L, v->start_mark, "'%s' must be at most 0%" PRIo64 ", got %s", path, k->max,
                  shown(raw, n, got, sizeof got));
    put_uint(dst, k->size, x);
    return 0;
  }
  case K_RATIO: {
    double x = 0;
    int rc = scalar ? config_value_ratio(s, n, &x) : CONFIG_VALUE_BAD;
    if (rc == CONFIG_VALUE_BAD)
      return wrong_type(L, v, "a number", path);
    if (rc != CONFIG_VALUE_OK || x < k->dmin || x > k->dmax)
      return fail(L, v->start_mark, "'%s' must be between %.1f and %g, got %s", path, k->dmin,
                  k->dmax, shown(raw, n, got, sizeof got));
    memcpy(dst, &x, sizeof x);
    return 0;
  }
  case K_ENUM:
    for (const struct name_value *t = k->names; scalar && t->name != NULL; t++)
      if (strlen(t->name) == n && strncasecmp(s, t->name, n) == 0) {
        memcpy(dst, &t->value, sizeof t->value);
        return 0;
      }
    return wrong_type(L, v, k->expected, path);
  default:
    return fail(L, v->start_mark, "internal error: key '%s' has no type", path);
  }
}

/*
 * Keys earlier versions documented but never acted on (a key that is parsed
 * and ignored is a defect, DESIGN §9): a file that still sets one is told
 * so precisely.  They come back when what they configure exists.
 */
static const char *retired_key(const char *name, size_t n) {
  static const struct {
    const char *name, *why;
  } retired[] = {
      {NULL, NULL}, /* none now: adaptive_optimization came back with its tuning table */
  };
  for (size_t i = 0; retired[i].name != NULL; i++)
    if (strlen(retired[i].name) == n && memcmp(retired[i].name, name, n) == 0)
      return retired[i].why;
  return NULL;
}

/* The names of a table's keys, for "unknown key" messages. */
static void known_keys(const struct key *table, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (const struct key *k = table; k->name != NULL && o < len; k++) {
    int n = snprintf(buf + o, len - o, "%s%s", k == table ? "" : ", ", k->name);
    if (n < 0)
      break;
    o += (size_t)n;
  }
}

/* A mapping of keys from `table` over the values at `base`; null leaves everything as it was. */
static int apply_mapping(struct loader *L, const yaml_node_t *m, const struct key *table,
                         char *base, const char *path) {
  if (is_null(m))
    return 0;
  if (m->type != YAML_MAPPING_NODE)
    return wrong_type(L, m, "a mapping of keys", path);
  for (yaml_node_pair_t *p = m->data.mapping.pairs.start; p < m->data.mapping.pairs.top; p++) {
    const yaml_node_t *kn = yaml_document_get_node(L->doc, p->key);
    const yaml_node_t *vn = yaml_document_get_node(L->doc, p->value);
    if (kn == NULL || vn == NULL)
      continue;
    char t[64], known[400], full[128];
    if (kn->type != YAML_SCALAR_NODE)
      return fail(L, kn->start_mark, "a key must be a plain name, not %s",
                  kn->type == YAML_MAPPING_NODE ? "a mapping" : "a list");
    const char *name = (const char *)kn->data.scalar.value;
    size_t nlen = kn->data.scalar.length;
    const struct key *k = table;
    while (k->name != NULL && !(strlen(k->name) == nlen && memcmp(k->name, name, nlen) == 0))
      k++;
    if (k->name == NULL) {
      const char *gone = path[0] == '\0' ? retired_key(name, nlen) : NULL;
      if (gone != NULL)
        return fail(L, kn->start_mark, "'%s' was removed: %s; delete this line",
                    shown(kn->data.scalar.value, nlen, t, sizeof t), gone);
      known_keys(table, known, sizeof known);
      if (path[0] == '\0')
        return fail(L, kn->start_mark, "unknown key '%s' at the top level (known: %s)",
                    shown(kn->data.scalar.value, nlen, t, sizeof t), known);
      return fail(L, kn->start_mark, "unknown key '%s' in '%s' (known: %s)",
                  shown(kn->data.scalar.value, nlen, t, sizeof t), path, known);
    }
    path_join(full, sizeof full, "%s%s%s", path, path[0] != '\0' ? "." : "", k->name);
    /* Every earlier key here was a known one, so this loop is short. */
    for (yaml_node_pair_t *q = m->data.mapping.pairs.start; q < p; q++) {
      const yaml_node_t *qk = yaml_document_get_node(L->doc, q->key);
      if (qk != NULL && qk->type == YAML_SCALAR_NODE && qk->data.scalar.length == nlen &&
          memcmp(qk->data.scalar.value, name, nlen) == 0)
        return fail(L, kn->start_mark, "duplicate key '%s' (first at line %zu)", full,
                    line_of(qk->start_mark));
    }
    int rc = apply_value(L, k, vn, base, full);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* The pool sizes against each other, blaming the value the file set (the first one it did). */
static int check_pool(struct loader *L, const struct config *c, yaml_mark_t fallback) {
  char a[48], b[48];
  uint64_t chunk = c->pool_chunk_size;
  const yaml_node_t *cn = L->chunk_node;
  if (chunk == 0 || chunk % CHUNK_GRANULE != 0)
    return fail(L, cn != NULL ? cn->start_mark : fallback,
                "'pool.chunk_size' must be a multiple of 2 MiB (the CUDA VMM granularity)");
  const struct {
    const char *name;
    uint64_t v;
    const yaml_node_t *node;
  } sizes[] = {{"pool.size_per_device", c->pool_size_per_device, L->pool_size_node},
               {"pool.host_size", c->host_pool_size, L->host_node}};
  for (int i = 0; i < 2; i++) {
    const yaml_node_t *blame = sizes[i].node != NULL ? sizes[i].node : cn;
    if (sizes[i].v < chunk || sizes[i].v % chunk != 0)
      return fail(L, blame != NULL ? blame->start_mark : fallback,
                  "'%s' (%s) must be a whole number of chunks of 'pool.chunk_size' (%s)",
                  sizes[i].name, config_value_size_text(sizes[i].v, a, sizeof a),
                  config_value_size_text(chunk, b, sizeof b));
  }
  return 0;
}

/* Line and column of a byte offset, for reader errors that carry only an offset. */
static yaml_mark_t mark_at(const char *data, size_t len, size_t off) {
  yaml_mark_t m = {0, 0, 0};
  for (size_t i = 0; i < off && i < len; i++) {
    if (data[i] == '\n') {
      m.line++;
      m.column = 0;
    } else {
      m.column++;
    }
  }
  return m;
}

static int syntax_error(struct loader *L, const yaml_parser_t *p, const char *data, size_t len) {
  if (p->error == YAML_MEMORY_ERROR) {
    if (L->err != NULL && L->errlen > 0)
      snprintf(L->err, L->errlen, "%s: out of memory while reading the YAML", L->name);
    return DEP_ERR_NO_MEMORY;
  }
  const char *problem = p->problem != NULL ? p->problem : "malformed YAML";
  if (p->error == YAML_READER_ERROR)
    return fail(L, mark_at(data, len, p->problem_offset), "YAML syntax error: %s", problem);
  if (p->context != NULL)
    return fail(L, p->problem_mark, "YAML syntax error: %s (%s at line %zu)", problem, p->context,
                line_of(p->context_mark));
  return fail(L, p->problem_mark, "YAML syntax error: %s", problem);
}

/*
 * The YAML's shape within CONFIG_MAX_DEPTH, CONFIG_MAX_TOKENS and CONFIG_MAX_DIRECTIVES,
 * checked on libyaml's token stream before anything loads the document.  libyaml's scanner
 * spends, on every token, time in proportion to the flow nesting ([ and { open at once), and its
 * parser and loader, on every %TAG directive and anchor, time in proportion to those already
 * seen: quadratic, so that a file of a few hundred KB could take it a minute.  The token bound
 * caps all three; directives cost enough to need a lower one of their own.  The scanner hands
 * out tokens with a lookahead of at most 1024 characters (a possible simple key's), so this pass
 * stops at the first token past a bound having paid for a few thousand at most.  Tokens count the depth as the document has it: a block mapping or list is opened by
 * its start token and closed by BLOCK_END, except a list at its key's own column ("key:\n- a"),
 * which has no tokens of its own and ends at the next key or at its mapping's end.  A syntax
 * error ends the pass; the loader then reports it as it does any other.
 */
static int check_shape(struct loader *L, const char *data, size_t len) {
  enum { BLOCK_MAPPING = 1, BLOCK_LIST, LIST_AT_KEY, FLOW };
  unsigned char open[CONFIG_MAX_DEPTH];
  size_t depth = 0, tokens = 0, directives = 0;
  yaml_parser_t p;
  if (!yaml_parser_initialize(&p)) {
    if (L->err != NULL && L->errlen > 0)
      snprintf(L->err, L->errlen, "%s: out of memory", L->name);
    return DEP_ERR_NO_MEMORY;
  }
  yaml_parser_set_input_string(&p, (const unsigned char *)data, len);
  int rc = 0;
  for (;;) {
    yaml_token_t t;
    if (!yaml_parser_scan(&p, &t))
      break;
    const yaml_token_type_t type = t.type;
    const yaml_mark_t at = t.start_mark;
    yaml_token_delete(&t);
    if (type == YAML_STREAM_END_TOKEN)
      break;
    if (++tokens > CONFIG_MAX_TOKENS) {
      rc = fail(L, at, "more than %d YAML tokens (keys, values, brackets); a deepepd config "
                "has a few hundred", CONFIG_MAX_TOKENS);
      break;
    }
    if ((type == YAML_TAG_DIRECTIVE_TOKEN || type == YAML_VERSION_DIRECTIVE_TOKEN) &&
        ++directives > CONFIG_MAX_DIRECTIVES) {
      rc = fail(L, at, "more than %d %%YAML and %%TAG directives", CONFIG_MAX_DIRECTIVES);
      break;
    }
    if (depth > 0 && open[depth - 1] == LIST_AT_KEY &&
        (type == YAML_KEY_TOKEN || type == YAML_VALUE_TOKEN || type == YAML_BLOCK_END_TOKEN))
      depth--;
    int opens = 0;
    switch (type) {
    case YAML_BLOCK_MAPPING_START_TOKEN:
      opens = BLOCK_MAPPING;
      break;
    case YAML_BLOCK_SEQUENCE_START_TOKEN:
      opens = BLOCK_LIST;
      break;
    case YAML_BLOCK_ENTRY_TOKEN:
      if (depth > 0 && open[depth - 1] == BLOCK_MAPPING)
        opens = LIST_AT_KEY;
      break;
    case YAML_FLOW_SEQUENCE_START_TOKEN:
    case YAML_FLOW_MAPPING_START_TOKEN:
      opens = FLOW;
      break;
    case YAML_BLOCK_END_TOKEN:
    case YAML_FLOW_SEQUENCE_END_TOKEN:
    case YAML_FLOW_MAPPING_END_TOKEN:
      if (depth > 0)
        depth--;
      break;
    default:
      break;
    }
    if (opens != 0) {
      if (depth == CONFIG_MAX_DEPTH) {
        rc = fail(L, at, "nesting deeper than %d levels of lists and mappings (a deepepd "
                  "config needs 3)", CONFIG_MAX_DEPTH);
        break;
      }
      open[depth++] = (unsigned char)opens;
    }
  }
  yaml_parser_delete(&p);
  return rc;
}

int config_load_buffer(struct config *c, const char *name, const char *data, size_t len, char *err,
                       size_t errlen) {
  struct loader L = {.name = name != NULL ? name : "<config>", .err = err, .errlen = errlen};
  if (err != NULL && errlen > 0)
    err[0] = '\0';
  if (c == NULL || (data == NULL && len > 0)) {
    if (err != NULL && errlen > 0)
      snprintf(err, errlen, "%s: no config struct or no data given", L.name);
    return DEP_ERR_INVALID;
  }
  struct config *copy = malloc(sizeof *copy);
  if (copy == NULL) {
    if (err != NULL && errlen > 0)
      snprintf(err, errlen, "%s: out of memory", L.name);
    return DEP_ERR_NO_MEMORY;
  }
  memcpy(copy, c, sizeof *copy);

  yaml_parser_t parser;
  yaml_document_t doc;
  int rc = check_shape(&L, data != NULL ? data : "", len);
  if (rc != 0) {
    free(copy);
    return rc;
  }
  if (!yaml_parser_initialize(&parser)) {
    free(copy);
    if (err != NULL && errlen > 0)
      snprintf(err, errlen, "%s: out of memory", L.name);
    return DEP_ERR_NO_MEMORY;
  }
  yaml_parser_set_input_string(&parser, (const unsigned char *)(data != NULL ? data : ""), len);
  if (!yaml_parser_load(&parser, &doc)) {
    rc = syntax_error(&L, &parser, data, len);
    goto out_parser;
  }
  L.doc = &doc;
  yaml_mark_t start = {0, 0, 0};
  const yaml_node_t *root = yaml_document_get_root_node(&doc);
  if (root != NULL && !is_null(root)) {
    start = root->start_mark;
    char buf[80];
    if (root->type != YAML_MAPPING_NODE)
      rc = fail(&L, root->start_mark,
                "the top level must be a mapping of keys (like 'socket:'), got %s",
                what(root, buf, sizeof buf));
    else
      rc = apply_mapping(&L, root, root_keys, (char *)copy, "");
  }
  if (rc == 0)
    rc = check_pool(&L, copy, start);
  if (rc == 0) {
    /* A second document would be ignored silently by the loader; say so instead. */
    yaml_document_t next;
    if (!yaml_parser_load(&parser, &next)) {
      rc = syntax_error(&L, &parser, data, len);
    } else {
      const yaml_node_t *r2 = yaml_document_get_root_node(&next);
      if (r2 != NULL)
        rc = fail(&L, r2->start_mark,
                  "a config file holds one YAML document; remove this second one");
      yaml_document_delete(&next);
    }
  }
  yaml_document_delete(&doc);
out_parser:
  yaml_parser_delete(&parser);
  if (rc == 0)
    memcpy(c, copy, sizeof *c);
  free(copy);
  return rc;
}

int config_load_file(struct config *c, const char *path, char *err, size_t errlen) {
  if (c == NULL || path == NULL) {
    if (err != NULL && errlen > 0)
      snprintf(err, errlen, "config: no config struct or no path given");
    return DEP_ERR_INVALID;
  }
  struct stat st;
  char *buf = NULL;
  size_t n = 0;
  const char *why = NULL;
  int fd = -1;
  /* The type is checked before open(2) too: opening a FIFO waits for a writer, which would
   * hold a reload (and a shutdown waiting for it) for ever; fstat checks the file opened. */
  if (stat(path, &st) != 0)
    why = strerror(errno);
  else if (S_ISDIR(st.st_mode))
    why = strerror(EISDIR);
  else if (!S_ISREG(st.st_mode))
    why = "not a regular file"; /* a FIFO or a device could block, or never end */
  else if ((fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY)) < 0 || fstat(fd, &st) != 0)
    why = strerror(errno);
  else if (!S_ISREG(st.st_mode))
    why = "not a regular file";
  else if (st.st_size > CONFIG_FILE_MAX)
    why = "larger than 1 MiB; is this the config file?";
  else if ((buf = malloc((size_t)st.st_size + 1)) == NULL)
    why = strerror(ENOMEM);
  /* Up to the size stat gave: an editor that rewrites the file in place is caught by the next
   * reload. */
  while (why == NULL && n < (size_t)st.st_size) {
    ssize_t r = read(fd, buf + n, (size_t)st.st_size - n);
    if (r == 0)
      break;
    if (r < 0 && errno != EINTR)
      why = strerror(errno);
    else if (r > 0)
      n += (size_t)r;
  }
  if (fd >= 0)
    close(fd);
  int rc = DEP_ERR_CONFIG;
  if (why != NULL) {
    if (err != NULL && errlen > 0)
      snprintf(err, errlen, "%s: cannot read: %s", path, why);
  } else {
    rc = config_load_buffer(c, path, buf, n, err, errlen);
  }
  free(buf);
  return rc;
}

/* ---- reload ------------------------------------------------------------------ */

static bool same_strings(const char *a, const char *b, size_t size) {
  return strncmp(a, b, size) == 0;
}

static bool same_value(const struct key *k, const char *a, const char *b) {
  switch (k->kind) {
  case K_STR:
    return same_strings(a + k->off, b + k->off, k->size);
  case K_NAMES:
  case K_DEVICES:
  case K_PEERS: {
    size_t na, nb;
    memcpy(&na, a + k->count_off, sizeof na);
    memcpy(&nb, b + k->count_off, sizeof nb);
    if (na != nb)
      return false;
    if (na > CONFIG_MAX_LIST)
      na = CONFIG_MAX_LIST;
    for (size_t i = 0; i < na; i++) {
      const char *ea = a + k->off + i * k->entry, *eb = b + k->off + i * k->entry;
      if (k->kind != K_PEERS ? !same_strings(ea, eb, k->entry)
                             : !same_value(&k->sub[0], ea, eb) || !same_value(&k->sub[1], ea, eb))
        return false;
    }
    return true;
  }
  case K_RATIO: {
    double x, y;
    memcpy(&x, a + k->off, sizeof x);
    memcpy(&y, b + k->off, sizeof y);
    return x == y;
  }
  case K_BOOL:
    return memcmp(a + k->off, b + k->off, sizeof(bool)) == 0;
  case K_ENUM:
    return memcmp(a + k->off, b + k->off, sizeof(int)) == 0;
  default:
    return get_uint(a + k->off, k->size) == get_uint(b + k->off, k->size);
  }
}

/* A value as a message shows it ("512 MiB", "info", "[alice, bob]"); lists are cut with "...". */
static const char *value_text(const struct key *k, const char *base, char *buf, size_t len) {
  const char *p = base + k->off;
  buf[0] = '\0';
  switch (k->kind) {
  case K_BOOL: {
    bool x;
    memcpy(&x, p, sizeof x);
    snprintf(buf, len, "%s", x ? "true" : "false");
    break;
  }
  case K_SIZE: {
    uint64_t x = get_uint(p, k->size);
    if (x == 0)
      snprintf(buf, len, "0");
    else
      config_value_size_text(x, buf, len);
    break;
  }
  case K_MODE:
    snprintf(buf, len, "0%" PRIo64, get_uint(p, k->size));
    break;
  case K_RATIO: {
    double x;
    memcpy(&x, p, sizeof x);
    snprintf(buf, len, "%g", x);
    break;
  }
  case K_STR:
    snprintf(buf, len, "%s", p[0] != '\0' ? p : "\"\"");
    break;
  case K_ENUM: {
    int x;
    memcpy(&x, p, sizeof x);
    snprintf(buf, len, "%s", name_of(k->names, x));
    break;
  }
  case K_NAMES:
  case K_DEVICES:
  case K_PEERS: {
    size_t n, o = 1;
    memcpy(&n, base + k->count_off, sizeof n);
    snprintf(buf, len, "[");
    for (size_t i = 0; i < n && i < CONFIG_MAX_LIST && o + 5 < len; i++) {
      const char *e = p + i * k->entry;
      char one[300];
      if (k->kind == K_PEERS) {
        const struct config_peer *peer = (const struct config_peer *)(const void *)e;
        if (peer->transport != CONFIG_TRANSPORT_DEFAULT)
          snprintf(one, sizeof one, "%s:%u (%s)", peer->host, (unsigned)peer->port,
                   config_transport_name(peer->transport));
        else
          snprintf(one, sizeof one, "%s:%u", peer->host, (unsigned)peer->port);
      } else {
        snprintf(one, sizeof one, "%s", e);
      }
      const char *sep = i > 0 ? ", " : "";
      if (o + strlen(sep) + strlen(one) + 5 >= len) {
        o += (size_t)snprintf(buf + o, len - o, "%s...", sep);
        break;
      }
      o += (size_t)snprintf(buf + o, len - o, "%s%s", sep, one);
    }
    if (o + 1 < len)
      snprintf(buf + o, len - o, "]");
    break;
  }
  default:
    snprintf(buf, len, "%" PRIu64, get_uint(p, k->size));
    break;
  }
  return buf;
}

/* Add ", entry" to a list in out[len]; an entry that does not fit leaves "..." in its place
 * (room for which is always kept), and nothing follows it. */
static void append_entry(char *out, size_t len, bool first, const char *entry) {
  size_t used = strlen(out);
  if (used >= 3 && strcmp(out + used - 3, "...") == 0)
    return;
  const char *sep = first ? "" : ", ";
  if (used + strlen(sep) + strlen(entry) + 5 < len)
    snprintf(out + used, len - used, "%s%s", sep, entry);
  else if (used + strlen(sep) + 3 < len)
    snprintf(out + used, len - used, "%s...", sep);
}

/*
 * The keys of a table (and its sections) whose values differ between a and b: the live ones as
 * "key old -> new", or the others by name.
 */
static void diff_table(const struct key *table, const char *prefix, const char *a, const char *b,
                       bool live, char *out, size_t len, size_t *count) {
  for (const struct key *k = table; k->name != NULL; k++) {
    char full[64];
    path_join(full, sizeof full, "%s%s%s", prefix, prefix[0] != '\0' ? "." : "", k->name);
    if (k->kind == K_SECTION) {
      diff_table(k->sub, full, a, b, live, out, len, count);
      continue;
    }
    if (k->live != live || same_value(k, a, b))
      continue;
    if (out != NULL && len > 0 && live) {
      char was[160], now[160], entry[400];
      snprintf(entry, sizeof entry, "%s %s -> %s", full, value_text(k, a, was, sizeof was),
               value_text(k, b, now, sizeof now));
      append_entry(out, len, *count == 0, entry);
    } else if (out != NULL && len > 0) {
      size_t used = strlen(out);
      if (used < len)
        snprintf(out + used, len - used, "%s%s", *count > 0 ? ", " : "", full);
    }
    (*count)++;
  }
}

size_t config_diff_restart(const struct config *old_c, const struct config *new_c,
                           char *restart_keys, size_t len) {
  size_t count = 0;
  if (restart_keys != NULL && len > 0)
    restart_keys[0] = '\0';
  if (old_c == NULL || new_c == NULL)
    return 0;
  diff_table(root_keys, "", (const char *)old_c, (const char *)new_c, false, restart_keys, len,
             &count);
  return count;
}

size_t config_diff_live(const struct config *old_c, const struct config *new_c, char *changes,
                        size_t len) {
  size_t count = 0;
  if (changes != NULL && len > 0)
    changes[0] = '\0';
  if (old_c == NULL || new_c == NULL)
    return 0;
  diff_table(root_keys, "", (const char *)old_c, (const char *)new_c, true, changes, len, &count);
  return count;
}

static void copy_live(const struct key *table, char *dst, const char *src) {
  for (const struct key *k = table; k->name != NULL; k++) {
    if (k->kind == K_SECTION) {
      copy_live(k->sub, dst, src);
      continue;
    }
    if (!k->live)
      continue;
    memcpy(dst + k->off, src + k->off, k->size);
    if (k->kind == K_NAMES || k->kind == K_DEVICES || k->kind == K_PEERS)
      memcpy(dst + k->count_off, src + k->count_off, sizeof(size_t));
  }
}

void config_copy_live(struct config *dst, const struct config *src) {
  copy_live(root_keys, (char *)dst, (const char *)src);
}

/* ---- accounts ---------------------------------------------------------------- */

/* 1 when the user (or group) exists or `name` is a numeric id, 0 when there is no such
 * account, else a negative errno: the lookup itself failed. */
static int account_exists(const char *name, bool group) {
  if (name[0] != '\0' && strspn(name, "0123456789") == strlen(name))
    return 1;
  int rc = ERANGE;
  bool found = false;
  /* A group with many members needs a large buffer: grow it as the lookup asks. */
  for (size_t size = 16384; rc == ERANGE && size <= 16u << 20; size *= 2) {
    char *buf = malloc(size);
    if (buf == NULL)
      return -ENOMEM;
    if (group) {
      struct group gr, *res = NULL;
      rc = getgrnam_r(name, &gr, buf, size, &res);
      found = rc == 0 && res != NULL;
    } else {
      struct passwd pw, *res = NULL;
      rc = getpwnam_r(name, &pw, buf, size, &res);
      found = rc == 0 && res != NULL;
    }
    free(buf);
  }
  if (found)
    return 1;
  /* getpwnam(3): these mean "not found" too. */
  if (rc == 0 || rc == ENOENT || rc == ESRCH || rc == EBADF || rc == EPERM)
    return 0;
  return -rc;
}

/* Look up one name of key `path`; a missing one is added to the problems. */
static void check_account(const char *path, const char *verb, const char *name, bool group,
                          char *out, size_t len, size_t *count) {
  int rc = account_exists(name, group);
  if (rc == 1)
    return;
  char entry[400];
  if (rc == 0)
    snprintf(entry, sizeof entry, "'%s' %s '%s': no such %s on this host (getent %s lists them)",
             path, verb, name, group ? "group" : "user", group ? "group" : "passwd");
  else
    snprintf(entry, sizeof entry, "'%s' %s '%s': cannot look it up: %s", path, verb, name,
             strerror(-rc));
  if (out != NULL && len > 0) {
    size_t used = strlen(out);
    if (used < len)
      snprintf(out + used, len - used, "%s%s", *count > 0 ? "; " : "", entry);
  }
  (*count)++;
}

size_t config_check_accounts(const struct config *c, unsigned which, char *problems,
                             size_t len) {
  size_t count = 0;
  if (problems != NULL && len > 0)
    problems[0] = '\0';
  if (c == NULL)
    return 0;
  if ((which & CONFIG_ACCOUNTS_SOCKET) && c->socket_group[0] != '\0')
    check_account("socket.group", "is", c->socket_group, true, problems, len, &count);
  if (which & CONFIG_ACCOUNTS_ALLOW) {
    for (size_t i = 0; i < c->n_allow_users && i < CONFIG_MAX_LIST; i++)
      check_account("allow.users", "lists", c->allow_users[i], false, problems, len, &count);
    for (size_t i = 0; i < c->n_allow_groups && i < CONFIG_MAX_LIST; i++)
      check_account("allow.groups", "lists", c->allow_groups[i], true, problems, len, &count);
  }
  return count;
}
