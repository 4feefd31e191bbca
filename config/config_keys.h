/*
 * config_keys.h — the key table of deepepd.yaml, private to config/: the
 * kinds of value, the table's entries and the helpers that read and write
 * a value where an entry says it lands.  The loader (config.c) and the
 * reload's comparisons (config_reload.c) and config_defaults() all walk
 * config__root_keys, so they cannot disagree about a key or its default.
 */
#ifndef DEP_CONFIG_KEYS_H
#define DEP_CONFIG_KEYS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "config_value.h"

/* CUDA VMM maps memory in 2 MiB granules; pool.chunk_size (the size the pool is
 * preallocated in), pool.max_allocation (the largest allocation an arena is made of)
 * and the pool sizes are whole numbers of them. */
#define CHUNK_GRANULE (2 * MiB)

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
#define F_ZERO_AUTO 16u /* K_SIZE: 0 is allowed too, meaning what .zero says */
#define F_ABSPATH 32u /* K_STR: "" or an absolute path (the daemon's cwd is no place to rely on) */
#define F_LISTEN 64u  /* K_STR: "" or "ADDRESS:PORT" (config_listen_split) */
#define F_AUTO 128u   /* K_UINT: the word auto too, stored as the largest value of .size
                         bytes (config__auto), which .max stays below */

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
  const char *zero;               /* F_ZERO_AUTO: what 0 means, for messages ("no bound") */
  /* The default, spelled as the shipped deepepd.yaml writes it ("8GiB", "0660", "auto"; "" an
   * empty string, "[]" an empty list), read by the value parsers the file's text goes through.
   * NULL: none of its own (the value stays zero; what zero means is the key's, e.g. a peer's
   * transport left out is the top-level one).  Computed values (proxy_threads' 0:
   * xfer_proxy_threads_default) are the code's, not the table's. */
  const char *dflt;
};

/* Every key of the file, in the order of the shipped default file (config_keys.c). */
extern const struct key config__root_keys[];

/*
 * Write the default of every key of table (and of its sections) at base: config_defaults() with
 * config__root_keys over a zeroed struct config, and a peer entry with its keys.  A default the
 * parsers refuse would leave zero; tests/check_config.c loads the table's defaults as a file to
 * hold each one to the loader's rules.
 */
void config__defaults(const struct key *table, char *base);

/* The name of value in t, or "unknown". */
const char *config__name_of(const struct name_value *t, int value);
/* Key paths ("pool.chunk_size", "peers[2].host") for messages; a long one is cut, never overrun. */
void config__path_join(char *out, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Integer members are uint16_t, uint32_t or uint64_t; the table gives the size, the range fits it. */
void config__put_uint(void *p, size_t size, uint64_t v);
uint64_t config__get_uint(const void *p, size_t size);
/* What an F_AUTO key stores for auto: the largest value of its size (CONFIG_CHUNK_ROWS_AUTO for
 * stream_chunk_rows). */
uint64_t config__auto(const struct key *k);
/* Whether an F_AUTO key's text (n bytes, not NUL-ended) is the word auto, in any case. */
bool config__is_auto(const struct key *k, const char *s, size_t n);

#endif /* DEP_CONFIG_KEYS_H */
