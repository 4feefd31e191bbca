/*
 * config_reload.c — what a SIGHUP's new deepepd.yaml changes (config.h):
 * the keys that need a restart, the live ones that changed, and copying
 * the live ones over, all by walking the key table (config_keys.h).
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "config_keys.h"

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
    return config__get_uint(a + k->off, k->size) == config__get_uint(b + k->off, k->size);
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
    uint64_t x = config__get_uint(p, k->size);
    if (x == 0)
      snprintf(buf, len, "0");
    else
      config_value_size_text(x, buf, len);
    break;
  }
  case K_MODE:
    snprintf(buf, len, "0%" PRIo64, config__get_uint(p, k->size));
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
    snprintf(buf, len, "%s", config__name_of(k->names, x));
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
    snprintf(buf, len, "%" PRIu64, config__get_uint(p, k->size));
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

/* Where a diff goes: a message's text, the keys' names, or both (NULL: not wanted). */
struct diff_out {
  bool live;            /* the live keys, or those that need a restart */
  char *text;           /* live: "key old -> new" joined by ", "; else the names so joined */
  size_t len;
  char *names;          /* max names of name_size bytes each, in the table's order */
  size_t name_size, max;
  size_t count;         /* keys that differ, whether or not they fitted */
};

/* The keys of a table (and its sections) whose values differ between a and b, into o. */
static void diff_table(const struct key *table, const char *prefix, const char *a, const char *b,
                       struct diff_out *o) {
  for (const struct key *k = table; k->name != NULL; k++) {
    char full[64];
    config__path_join(full, sizeof full, "%s%s%s", prefix, prefix[0] != '\0' ? "." : "", k->name);
    if (k->kind == K_SECTION) {
      diff_table(k->sub, full, a, b, o);
      continue;
    }
    if (k->live != o->live || same_value(k, a, b))
      continue;
    if (o->text != NULL && o->len > 0 && o->live) {
      char was[160], now[160], entry[400];
      snprintf(entry, sizeof entry, "%s %s -> %s", full, value_text(k, a, was, sizeof was),
               value_text(k, b, now, sizeof now));
      append_entry(o->text, o->len, o->count == 0, entry);
    } else if (o->text != NULL && o->len > 0) {
      size_t used = strlen(o->text);
      if (used < o->len)
        snprintf(o->text + used, o->len - used, "%s%s", o->count > 0 ? ", " : "", full);
    }
    if (o->names != NULL && o->count < o->max)
      snprintf(o->names + o->count * o->name_size, o->name_size, "%s", full);
    o->count++;
  }
}

/* The keys of one kind (live, or needing a restart) whose values differ, into o: how many. */
static size_t diff_kind(const struct config *old_c, const struct config *new_c,
                        struct diff_out *o) {
  if (o->text != NULL && o->len > 0)
    o->text[0] = '\0';
  if (old_c == NULL || new_c == NULL)
    return 0;
  diff_table(config__root_keys, "", (const char *)old_c, (const char *)new_c, o);
  return o->count;
}

size_t config_diff_restart(const struct config *old_c, const struct config *new_c,
                           char *restart_keys, size_t len) {
  struct diff_out o = {.live = false, .text = restart_keys, .len = len};
  return diff_kind(old_c, new_c, &o);
}

size_t config_diff_live(const struct config *old_c, const struct config *new_c, char *changes,
                        size_t len) {
  struct diff_out o = {.live = true, .text = changes, .len = len};
  return diff_kind(old_c, new_c, &o);
}

size_t config_diff_names(const struct config *old_c, const struct config *new_c, bool live,
                         char *names, size_t name_size, size_t max) {
  struct diff_out o = {.live = live, .names = name_size > 0 ? names : NULL,
                       .name_size = name_size, .max = max};
  return diff_kind(old_c, new_c, &o);
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
  copy_live(config__root_keys, (char *)dst, (const char *)src);
}
