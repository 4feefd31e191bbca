/*
 * config.c — deepepd.yaml into struct config (DESIGN §9).
 *
 * One table names every key (config_keys.c): its type, its range, where it
 * lands in the struct and whether it may change without a restart.  The
 * loader here, its error messages ("known: ...") and the reload's
 * comparisons (config_reload.c) all read that table, so they cannot
 * disagree.  The YAML is loaded with libyaml's document API
 * and walked against the table; the first problem stops the walk with
 * "FILE:LINE:COLUMN: what is wrong".  Everything is written into a copy, and
 * the caller's struct changes only when the whole file checked out.
 */
#include "config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

#include "config_keys.h"
#include "config_value.h"
#include "deepep.h"

/* A config file is a page of text; anything this big is a mistake (or an attack). */
#define CONFIG_FILE_MAX (1024 * 1024)
/* %YAML and %TAG lines before the document (check_shape); a config file needs none. */
#define CONFIG_MAX_DIRECTIVES 16

void config_defaults(struct config *c) {
  memset(c, 0, sizeof *c);
  config__defaults(config__root_keys, (char *)c);
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
  /* So are the peers against the key: where peers and listen.address were set. */
  const yaml_node_t *peers_node, *listen_node;
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
/* Whether two valid GPU UUIDs (config_value_gpu_uuid) name one GPU: GPU- is optional, and
 * hex digits are compared in either case. */
static bool same_gpu(const char *a, const char *b) {
  if (strncmp(a, "GPU-", 4) == 0)
    a += 4;
  if (strncmp(b, "GPU-", 4) == 0)
    b += 4;
  return strcasecmp(a, b) == 0;
}

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
      config__path_join(epath, sizeof epath, "%s[%zu]", path, count);
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
      /* One GPU named twice (with and without GPU-, in either case) would be served twice. */
      for (size_t j = 0; k->kind == K_DEVICES && j < count; j++)
        if (same_gpu(base + k->off + j * k->entry, dst))
          return fail(L, e->start_mark, "'%s' names the GPU of '%s[%zu]' again; list each once",
                      epath, path, j);
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
      config__path_join(epath, sizeof epath, "%s[%zu]", path, count);
      if (count == CONFIG_MAX_LIST)
        return fail(L, e->start_mark, "too many entries in '%s' (at most %d)", path,
                    CONFIG_MAX_LIST);
      if (e->type != YAML_MAPPING_NODE)
        return wrong_type(L, e, "a mapping {host, port}", epath);
      struct config_peer *p = (struct config_peer *)(void *)(base + k->off) + count;
      memset(p, 0, sizeof *p);
      config__defaults(k->sub, (char *)p);
      int rc = apply_mapping(L, e, k->sub, (char *)p, epath);
      if (rc != 0)
        return rc;
      if (p->host[0] == '\0')
        return fail(L, e->start_mark, "'%s' needs a 'host'", epath);
      /* The same daemon twice would get two sets of links, and its connections one entry. */
      for (size_t j = 0; j < count; j++) {
        const struct config_peer *q = (const struct config_peer *)(void *)(base + k->off) + j;
        if (q->port == p->port && strcasecmp(q->host, p->host) == 0)
          return fail(L, e->start_mark, "'%s' repeats '%s[%zu]' (%s port %u); list each peer once",
                      epath, path, j, p->host, (unsigned)p->port);
      }
      count++;
    }
  }
  memcpy(base + k->count_off, &count, sizeof count);
  return 0;
}

/* A scalar value as the typed keys read it: s and n its text (s NULL when the node is not
 * a scalar), ok whether it is a plain scalar (not null, no NUL inside), raw its bytes for
 * quoting in messages (NULL unless ok). */
struct scalar {
  const char *s;
  size_t n;
  bool ok;
  const unsigned char *raw;
};

static struct scalar scalar_of(const yaml_node_t *v) {
  struct scalar sc;
  sc.s = (const char *)(v->type == YAML_SCALAR_NODE ? v->data.scalar.value : NULL);
  sc.n = sc.s != NULL ? v->data.scalar.length : 0;
  sc.ok = sc.s != NULL && !is_null(v) && strlen(sc.s) == sc.n;
  sc.raw = sc.ok ? v->data.scalar.value : NULL;
  return sc;
}

static int take_bool(struct loader *L, const yaml_node_t *v, const struct scalar *sc,
                     const char *path, char *dst) {
  bool x;
  if (!sc->ok || config_value_bool(sc->s, sc->n, &x) != CONFIG_VALUE_OK)
    return wrong_type(L, v, "a boolean (true/false)", path);
  memcpy(dst, &x, sizeof x);
  return 0;
}

static int take_uint(struct loader *L, const struct key *k, const yaml_node_t *v,
                     const struct scalar *sc, const char *path, char *dst) {
  char got[48];
  int64_t x = 0;
  const bool word = (k->flags & F_AUTO) != 0; /* auto is a value too */
  if (sc->ok && config__is_auto(k, sc->s, sc->n)) {
    config__put_uint(dst, k->size, config__auto(k));
    return 0;
  }
  int rc = sc->ok ? config_value_int(sc->s, sc->n, &x) : CONFIG_VALUE_BAD;
  if (rc == CONFIG_VALUE_BAD)
    return wrong_type(L, v, word ? "auto or a decimal integer" : "a decimal integer", path);
  if (rc != CONFIG_VALUE_OK || x < (int64_t)k->min || x > (int64_t)k->max)
    return fail(L, v->start_mark, "'%s' must be %sbetween %" PRIu64 " and %" PRIu64 ", got %s",
                path, word ? "auto or " : "", k->min, k->max,
                shown(sc->raw, sc->n, got, sizeof got));
  config__put_uint(dst, k->size, (uint64_t)x);
  return 0;
}

/* A size: its own step, since its messages suggest the spelling to use (a fraction of a
 * unit, a unit it does not know), say what 0 means where a key takes 0, and the nodes of
 * the pool's sizes are kept for the checks across keys. */
static int take_size(struct loader *L, const struct key *k, const yaml_node_t *v,
                     const struct scalar *sc, const char *path, char *dst) {
  char a[48], b[48], got[48];
  uint64_t x = 0;
  size_t unit_at = 0;
  int rc = sc->ok ? config_value_size(sc->s, sc->n, &x, &unit_at) : CONFIG_VALUE_BAD;
  if (rc == CONFIG_VALUE_BAD)
    return wrong_type(L, v, "a size (bytes, or a number with KiB, MiB, GiB or TiB)", path);
  if (rc == CONFIG_VALUE_UNIT)
    return fail(L, v->start_mark, "unknown size unit '%s' in '%s' (use B, KiB, MiB, GiB or TiB)",
                shown(sc->raw + unit_at, sc->n - unit_at, got, sizeof got), path);
  if (rc == CONFIG_VALUE_FRACTION) {
    /* The same size in a smaller unit, when it is a whole number of bytes; plain bytes
     * below 1 KiB, since "N bytes" is not a spelling the parser takes. */
    if (x % KiB == 0)
      config_value_size_text(x, a, sizeof a);
    else
      snprintf(a, sizeof a, "%" PRIu64, x);
    return fail(L, v->start_mark,
                "'%s' must be a whole number of bytes or of KiB, MiB, GiB or TiB, got %s%s%s",
                path, shown(sc->raw, sc->n, got, sizeof got), x != 0 ? "; write " : "",
                x != 0 ? a : "");
  }
  const bool auto_ok = (k->flags & F_ZERO_AUTO) && rc == CONFIG_VALUE_OK && x == 0;
  /* What 0 means for this key, said beside the range ("0 (no bound per user) or ..."). */
  const char *zero = (k->flags & F_ZERO_AUTO) ? (k->zero != NULL ? k->zero : "off") : NULL;
  if (!auto_ok && (rc != CONFIG_VALUE_OK || x < k->min || x > k->max))
    return fail(L, v->start_mark, "'%s' must be %s%s%sbetween %s and %s, got %s", path,
                zero != NULL ? "0 (" : "", zero != NULL ? zero : "", zero != NULL ? ") or " : "",
                config_value_size_text(k->min, a, sizeof a),
                config_value_size_text(k->max, b, sizeof b),
                shown(sc->raw, sc->n, got, sizeof got));
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
  config__put_uint(dst, k->size, x);
  return 0;
}

static int take_mode(struct loader *L, const struct key *k, const yaml_node_t *v,
                     const struct scalar *sc, const char *path, char *dst) {
  char got[48];
  uint64_t x = 0;
  int rc = sc->ok ? config_value_mode(sc->s, sc->n, &x) : CONFIG_VALUE_BAD;
  if (rc == CONFIG_VALUE_BAD)
    return wrong_type(L, v, "a file mode in octal (like 0660)", path);
  if (rc != CONFIG_VALUE_OK || x > k->max)
    return fail(L, v->start_mark, "'%s' must be at most 0%" PRIo64 ", got %s", path, k->max,
                shown(sc->raw, sc->n, got, sizeof got));
  config__put_uint(dst, k->size, x);
  return 0;
}

static int take_ratio(struct loader *L, const struct key *k, const yaml_node_t *v,
                      const struct scalar *sc, const char *path, char *dst) {
  char got[48];
  double x = 0;
  int rc = sc->ok ? config_value_ratio(sc->s, sc->n, &x) : CONFIG_VALUE_BAD;
  if (rc == CONFIG_VALUE_BAD)
    return wrong_type(L, v, "a number", path);
  if (rc != CONFIG_VALUE_OK || x < k->dmin || x > k->dmax)
    return fail(L, v->start_mark, "'%s' must be between %.1f and %g, got %s", path, k->dmin,
                k->dmax, shown(sc->raw, sc->n, got, sizeof got));
  memcpy(dst, &x, sizeof x);
  return 0;
}

static int take_enum(struct loader *L, const struct key *k, const yaml_node_t *v,
                     const struct scalar *sc, const char *path, char *dst) {
  for (const struct name_value *t = k->names; sc->ok && t->name != NULL; t++)
    if (strlen(t->name) == sc->n && strncasecmp(sc->s, t->name, sc->n) == 0) {
      memcpy(dst, &t->value, sizeof t->value);
      return 0;
    }
  return wrong_type(L, v, k->expected, path);
}

/* One value for one known key: the structured kinds (a section, a list, the peers, a
 * string) by their own readers, the rest as one scalar each, by the reader of its kind. */
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
    L->peers_node = v;
    return take_peers(L, k, v, base, path);
  case K_STR:
    if (strcmp(path, "listen.address") == 0)
      L->listen_node = v;
    return take_string(L, v, path, k->flags, dst, k->size);
  default:
    break;
  }

  const struct scalar sc = scalar_of(v);
  switch (k->kind) {
  case K_BOOL:
    return take_bool(L, v, &sc, path, dst);
  case K_UINT:
    return take_uint(L, k, v, &sc, path, dst);
  case K_SIZE:
    return take_size(L, k, v, &sc, path, dst);
  case K_MODE:
    return take_mode(L, k, v, &sc, path, dst);
  case K_RATIO:
    return take_ratio(L, k, v, &sc, path, dst);
  case K_ENUM:
    return take_enum(L, k, v, &sc, path, dst);
  default:
    return fail(L, v->start_mark, "internal error: key '%s' has no type", path);
  }
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
      known_keys(table, known, sizeof known);
      if (path[0] == '\0')
        return fail(L, kn->start_mark, "unknown key '%s' at the top level (known: %s)",
                    shown(kn->data.scalar.value, nlen, t, sizeof t), known);
      return fail(L, kn->start_mark, "unknown key '%s' in '%s' (known: %s)",
                  shown(kn->data.scalar.value, nlen, t, sizeof t), path, known);
    }
    config__path_join(full, sizeof full, "%s%s%s", path, path[0] != '\0' ? "." : "", k->name);
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

/* Peers or a listener need a key, or peer_insecure for tests: a file without either is one the
 * daemon cannot start with, so it is refused here, where --check-config and a reload see it too,
 * blaming the key that asked for peers. */
static int check_peer_auth(struct loader *L, const struct config *c, yaml_mark_t fallback) {
  bool peers = c->n_peers > 0, listener = c->listen_address[0] != '\0';
  if ((!peers && !listener) || c->peer_key_file[0] != '\0' || c->peer_insecure)
    return 0;
  const yaml_node_t *blame = peers ? L->peers_node : L->listen_node;
  return fail(L, blame != NULL ? blame->start_mark : fallback,
              "'%s' is set but 'peer_key_file' is not: peers could not authenticate; write a key "
              "(deepepctl genkey /etc/deepepd/peer.key) and set peer_key_file to it on every "
              "node, or, for tests on one machine only, set peer_insecure: true",
              peers ? "peers" : "listen.address");
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
      rc = apply_mapping(&L, root, config__root_keys, (char *)copy, "");
  }
  if (rc == 0)
    rc = check_pool(&L, copy, start);
  if (rc == 0)
    rc = check_peer_auth(&L, copy, start);
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
