/*
 * kcache.h — the daemon's kernel cache (DESIGN §6, §9 kernel_cache_dir).
 * Where the library's fatbin has only PTX for a GPU, every trainer process
 * would have the driver compile it at each start (1.6 s per process on an
 * H200 with the driver's own cache cold); instead the daemon compiles it
 * once per node, keeps the cubin in kernel_cache_dir across restarts and
 * lends it to each trainer at attach (KERNELS, proto.h).
 *
 * An entry is one file per key (architecture, driver version, build id of
 * the fatbin), named for its key and holding a header that states the key
 * again, the cubin's length and a BLAKE2b checksum of both: a file that
 * differs from its name's key, is cut short, altered, or that the driver
 * refuses is rebuilt.  The compile and the driver's check are handed in
 * (struct kcache_jit), so that the cache's logic runs without a GPU.
 */
#ifndef DEP_KCACHE_H
#define DEP_KCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kimage.h"

struct kcache_key {
  uint32_t arch;                 /* compute capability major * 10 + minor */
  int32_t driver;                /* cuDriverGetVersion */
  char build[KIMAGE_ID_LEN + 1]; /* the fatbin's build id */
};

/* The compile and the check, with the driver (kcheck.c) or a test's fake. */
struct kcache_jit {
  /* Compile the image for k's architecture into a cubin: *out malloc'd.  0 or DEP_ERR_*. */
  int (*compile)(void *arg, const struct kcache_key *k, const uint8_t *image, size_t len,
                 uint8_t **out, size_t *out_len, char *why, size_t whylen);
  /* Whether the driver loads this cubin with every kernel in it.  0 or DEP_ERR_*. */
  int (*verify)(void *arg, const uint8_t *cubin, size_t len, char *why, size_t whylen);
  void *arg;
};

/* How an entry came to be. */
enum kcache_how {
  KCACHE_HIT,     /* read from the cache, checked */
  KCACHE_BUILT,   /* none there: compiled and stored */
  KCACHE_REBUILT, /* one there was corrupt, of another key or refused: compiled and stored */
  KCACHE_NOSTORE, /* compiled, but there is no cache directory (kernel_cache_dir "") */
};

struct kcache_entry {
  struct kcache_key key;
  int fd;            /* a sealed memfd of the cubin: what clients are lent; -1 for none */
  uint64_t bytes;
  enum kcache_how how;
  double compile_ms; /* the compile's time, 0 for a hit */
  char why[256];     /* for KCACHE_REBUILT: what was wrong with the old entry */
};

/* An entry file's header: magic, version, key, cubin length, checksum. */
#define KCACHE_HDR_LEN 128
/* The largest entry read back (a cubin of these kernels is well under 1 MiB). */
#define KCACHE_MAX_FILE (64u << 20)

/*
 * Check (and make, if missing: one level, mode 0755) the cache directory:
 * a directory, owned by uid `self` or root, writable by no group or other
 * user (whoever can write there can put code into every trainer of the
 * node), writable by this process.  0 or DEP_ERR_CONFIG with why saying
 * what to do.
 */
int kcache_check_dir(const char *dir, uid_t self, char *why, size_t whylen);

/* The entry's file name for a key: "sm_90-drv13000-<16 digits of the build>.kcache". */
void kcache_entry_name(const struct kcache_key *k, char *out, size_t len);

/* An entry file's bytes for a cubin (malloc'd into *out).  0 or DEP_ERR_NO_MEMORY. */
int kcache_encode(const struct kcache_key *k, const uint8_t *cubin, size_t len, uint8_t **out,
                  size_t *out_len);
/* Check an entry file's bytes against key k: the cubin's place in it, or DEP_ERR_* and why. */
int kcache_decode(const struct kcache_key *k, const uint8_t *file, size_t len,
                  const uint8_t **cubin, size_t *cubin_len, char *why, size_t whylen);

/*
 * The cubin for key k: read from dir and checked, or compiled from img
 * (and stored there: atomically, by rename), with other keys' entries of
 * the same architecture removed as stale.  dir "" compiles without
 * storing.  Fills *out (its fd is the caller's: kcache_entry_close).  A
 * compile or check that fails is an error (DEP_ERR_CUDA and why); a store
 * that fails is logged, the entry still lent.
 */
int kcache_get(const char *dir, const struct kcache_key *k, const struct kimage *img,
               const struct kcache_jit *jit, struct kcache_entry *out, char *why, size_t whylen);
void kcache_entry_close(struct kcache_entry *e);

/* "hit", "built", "rebuilt", "compiled (not stored)". */
const char *kcache_how_name(enum kcache_how h);

#endif /* DEP_KCACHE_H */
