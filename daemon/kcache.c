/*
 * kcache.c — the kernel cache's entries on disk, their checks, and the
 * sealed memfd each is lent as (kcache.h).
 *
 * Entry file (little-endian):
 *   offset size field
 *        0    8 magic "DEPKCUB1"
 *        8    4 format version (1)
 *       12    4 arch
 *       16    4 driver version
 *       20    4 reserved, zero
 *       24   64 build id (hex digits)
 *       88    8 cubin length
 *       96   32 BLAKE2b-256 of bytes 0..95 and the cubin
 *      128    - the cubin
 */
#include "kcache.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "deepep.h"
#include "log.h"

#define KCACHE_MAGIC "DEPKCUB1"
#define KCACHE_FORMAT 1
#define KCACHE_SUM_OFF 96
#define KCACHE_SUM_LEN 32

int kcache_check_dir(const char *dir, uid_t self, char *why, size_t whylen) {
  struct stat st;
  if (stat(dir, &st) != 0 && errno == ENOENT) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
      snprintf(why, whylen, "kernel_cache_dir %s cannot be made: %s; make it (owned by deepepd's "
               "user, mode 0755) or set kernel_cache_dir to a directory that exists", dir,
               strerror(errno));
      return DEP_ERR_CONFIG;
    }
    log_info("kernel cache: made %s", dir);
  }
  if (stat(dir, &st) != 0) {
    snprintf(why, whylen, "kernel_cache_dir %s: %s; set kernel_cache_dir to a directory deepepd "
             "can write, or \"\" for no cache", dir, strerror(errno));
    return DEP_ERR_CONFIG;
  }
  if (!S_ISDIR(st.st_mode)) {
    snprintf(why, whylen, "kernel_cache_dir %s is not a directory; set it to one", dir);
    return DEP_ERR_CONFIG;
  }
  if (st.st_uid != self && st.st_uid != 0) {
    snprintf(why, whylen, "kernel_cache_dir %s is owned by uid %u, neither deepepd's user (uid "
             "%u) nor root, and its owner could put code into every trainer of this node; "
             "chown %u %s", dir, (unsigned)st.st_uid, (unsigned)self, (unsigned)self, dir);
    return DEP_ERR_CONFIG;
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    snprintf(why, whylen, "kernel_cache_dir %s is writable by %s (mode %04o), who could put code "
             "into every trainer of this node; chmod go-w %s", dir,
             (st.st_mode & S_IWOTH) ? "every user" : "its group", (unsigned)(st.st_mode & 07777),
             dir);
    return DEP_ERR_CONFIG;
  }
  if (access(dir, W_OK | X_OK) != 0) {
    snprintf(why, whylen, "kernel_cache_dir %s is not writable by deepepd (uid %u): %s; chown it "
             "to deepepd's user", dir, (unsigned)self, strerror(errno));
    return DEP_ERR_CONFIG;
  }
  return 0;
}

void kcache_entry_name(const struct kcache_key *k, char *out, size_t len) {
  snprintf(out, len, "sm_%u-drv%d-%.16s.kcache", (unsigned)k->arch, (int)k->driver, k->build);
}

static void kcache_sum(const uint8_t *hdr, const uint8_t *cubin, size_t len,
                       uint8_t sum[KCACHE_SUM_LEN]) {
  crypto_generichash_state st;
  crypto_generichash_init(&st, NULL, 0, KCACHE_SUM_LEN);
  crypto_generichash_update(&st, hdr, KCACHE_SUM_OFF);
  crypto_generichash_update(&st, cubin, len);
  crypto_generichash_final(&st, sum, KCACHE_SUM_LEN);
}

int kcache_encode(const struct kcache_key *k, const uint8_t *cubin, size_t len, uint8_t **out,
                  size_t *out_len) {
  uint8_t *f = calloc(1, KCACHE_HDR_LEN + len);
  if (f == NULL)
    return DEP_ERR_NO_MEMORY;
  memcpy(f, KCACHE_MAGIC, 8);
  codec_put_u32(f + 8, KCACHE_FORMAT);
  codec_put_u32(f + 12, k->arch);
  codec_put_u32(f + 16, (uint32_t)k->driver);
  memcpy(f + 24, k->build, KIMAGE_ID_LEN);
  codec_put_u64(f + 88, len);
  memcpy(f + KCACHE_HDR_LEN, cubin, len);
  kcache_sum(f, cubin, len, f + KCACHE_SUM_OFF);
  *out = f;
  *out_len = KCACHE_HDR_LEN + len;
  return 0;
}

int kcache_decode(const struct kcache_key *k, const uint8_t *f, size_t len,
                  const uint8_t **cubin, size_t *cubin_len, char *why, size_t whylen) {
  if (len < KCACHE_HDR_LEN || memcmp(f, KCACHE_MAGIC, 8) != 0) {
    snprintf(why, whylen, "not a kernel cache entry (%zu bytes, no header)", len);
    return DEP_ERR_PROTOCOL;
  }
  if (codec_get_u32(f + 8) != KCACHE_FORMAT) {
    snprintf(why, whylen, "entry format %u, this deepepd writes %u", codec_get_u32(f + 8),
             KCACHE_FORMAT);
    return DEP_ERR_PROTOCOL;
  }
  uint32_t arch = codec_get_u32(f + 12);
  int32_t driver = (int32_t)codec_get_u32(f + 16);
  if (arch != k->arch || driver != k->driver || memcmp(f + 24, k->build, KIMAGE_ID_LEN) != 0) {
    snprintf(why, whylen, "entry of sm_%u, driver %d, build %.16s, not the sm_%u, driver %d, "
             "build %.16s its name says", (unsigned)arch, (int)driver, (const char *)f + 24,
             (unsigned)k->arch, (int)k->driver, k->build);
    return DEP_ERR_PROTOCOL;
  }
  uint64_t n = codec_get_u64(f + 88);
  if (n == 0 || n != len - KCACHE_HDR_LEN) {
    snprintf(why, whylen, "entry says its cubin is %llu bytes, the file holds %zu",
             (unsigned long long)n, len - KCACHE_HDR_LEN);
    return DEP_ERR_PROTOCOL;
  }
  uint8_t sum[KCACHE_SUM_LEN];
  kcache_sum(f, f + KCACHE_HDR_LEN, (size_t)n, sum);
  if (sodium_memcmp(sum, f + KCACHE_SUM_OFF, KCACHE_SUM_LEN) != 0) {
    snprintf(why, whylen, "checksum mismatch (the file was altered or damaged)");
    return DEP_ERR_PROTOCOL;
  }
  *cubin = f + KCACHE_HDR_LEN;
  *cubin_len = (size_t)n;
  return 0;
}

/* Read a whole entry file: 0, ENOENT (none there), or another errno with why. */
static int kcache_read(const char *path, uint8_t **out, size_t *out_len, char *why,
                       size_t whylen) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    int e = errno;
    snprintf(why, whylen, "cannot open it: %s", strerror(e));
    return e;
  }
  struct stat st;
  int e = 0;
  uint8_t *buf = NULL;
  if (fstat(fd, &st) != 0) {
    e = errno;
    snprintf(why, whylen, "fstat: %s", strerror(e));
  } else if (!S_ISREG(st.st_mode) || st.st_size > (off_t)KCACHE_MAX_FILE) {
    e = EINVAL;
    snprintf(why, whylen, "not a regular file of at most %u bytes", KCACHE_MAX_FILE);
  } else if ((buf = malloc((size_t)st.st_size + 1)) == NULL) {
    e = ENOMEM;
    snprintf(why, whylen, "out of memory");
  } else {
    size_t got = 0;
    while (got < (size_t)st.st_size) {
      ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
      if (r < 0 && errno == EINTR)
        continue;
      if (r <= 0) {
        e = r < 0 ? errno : EIO;
        snprintf(why, whylen, "read: %s", r < 0 ? strerror(e) : "short read");
        break;
      }
      got += (size_t)r;
    }
    *out_len = got;
  }
  close(fd);
  if (e != 0) {
    free(buf);
    return e;
  }
  *out = buf;
  return 0;
}

static int write_all(int fd, const uint8_t *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Store an entry: a temporary file beside it, written, synced, renamed over. */
static int kcache_store(const char *dir, const char *name, const uint8_t *f, size_t len,
                        char *why, size_t whylen) {
  char tmp[4096], path[4096];
  snprintf(tmp, sizeof tmp, "%s/.%s.XXXXXX", dir, name);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  int fd = mkostemp(tmp, O_CLOEXEC);
  if (fd < 0) {
    snprintf(why, whylen, "cannot make a file in %.200s: %s", dir, strerror(errno));
    return -1;
  }
  int rc = write_all(fd, f, len) != 0 || fchmod(fd, 0644) != 0 || fsync(fd) != 0 ? -1 : 0;
  if (rc != 0)
    snprintf(why, whylen, "cannot write %.200s: %s", tmp, strerror(errno));
  if (close(fd) != 0 && rc == 0) {
    snprintf(why, whylen, "cannot write %.200s: %s", tmp, strerror(errno));
    rc = -1;
  }
  if (rc == 0 && rename(tmp, path) != 0) {
    snprintf(why, whylen, "cannot rename %.200s into place: %s", tmp, strerror(errno));
    rc = -1;
  }
  if (rc != 0)
    unlink(tmp);
  return rc;
}

/* Remove the entries of k's architecture under other keys (another driver or build). */
static void kcache_remove_stale(const char *dir, const struct kcache_key *k, const char *keep) {
  DIR *d = opendir(dir);
  if (d == NULL)
    return;
  char prefix[32];
  snprintf(prefix, sizeof prefix, "sm_%u-", (unsigned)k->arch);
  const size_t pl = strlen(prefix), sl = strlen(".kcache");
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    size_t n = strlen(e->d_name);
    if (n <= pl + sl || strncmp(e->d_name, prefix, pl) != 0 ||
        strcmp(e->d_name + n - sl, ".kcache") != 0 || strcmp(e->d_name, keep) == 0)
      continue;
    if (unlinkat(dirfd(d), e->d_name, 0) == 0)
      log_info("kernel cache: removed %s/%s, an entry of another driver or build", dir,
               e->d_name);
    else
      log_warn("kernel cache: cannot remove the stale entry %s/%s", dir, e->d_name);
  }
  closedir(d);
}

/* A sealed memfd holding the cubin: clients can map it, nobody can change it. */
static int kcache_memfd(const struct kcache_key *k, const uint8_t *cubin, size_t len, char *why,
                        size_t whylen) {
  char name[32];
  snprintf(name, sizeof name, "deepepd-kernels-sm_%u", (unsigned)k->arch);
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    snprintf(why, whylen, "memfd_create: %s", strerror(errno));
    return -1;
  }
  if (write_all(fd, cubin, len) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
    snprintf(why, whylen, "filling the cubin's memfd: %s", strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int kcache_get(const char *dir, const struct kcache_key *k, const struct kimage *img,
               const struct kcache_jit *jit, struct kcache_entry *out, char *why, size_t whylen) {
  memset(out, 0, sizeof *out);
  out->key = *k;
  out->fd = -1;
  if (sodium_init() < 0) {
    snprintf(why, whylen, "libsodium cannot start (sodium_init)");
    return DEP_ERR_INTERNAL;
  }
  char name[128], path[4096], bad[200] = "";
  kcache_entry_name(k, name, sizeof name);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  uint8_t *file = NULL, *made = NULL;
  size_t flen = 0, clen = 0;
  const uint8_t *cubin = NULL;
  out->how = dir[0] == '\0' ? KCACHE_NOSTORE : KCACHE_BUILT;
  if (dir[0] != '\0') {
    int e = kcache_read(path, &file, &flen, bad, sizeof bad);
    if (e == 0 && kcache_decode(k, file, flen, &cubin, &clen, bad, sizeof bad) == 0 &&
        jit->verify(jit->arg, cubin, clen, bad, sizeof bad) == 0) {
      out->how = KCACHE_HIT;
    } else if (e != ENOENT) {
      out->how = KCACHE_REBUILT;
      snprintf(out->why, sizeof out->why, "%s", bad);
      log_warnx("kernel cache: %s: %s; compiling it again", path, bad);
      cubin = NULL;
    }
  }
  int rc = 0;
  if (cubin == NULL) {
    double t0 = now_ms();
    rc = jit->compile(jit->arg, k, img->data, img->len, &made, &clen, why, whylen);
    out->compile_ms = now_ms() - t0;
    if (rc == 0 && (rc = jit->verify(jit->arg, made, clen, why, whylen)) != 0) {
      char m[200];
      snprintf(m, sizeof m, "%s", why);
      snprintf(why, whylen, "the driver refuses its own compile of the kernels: %s", m);
    }
    if (rc != 0)
      goto out;
    cubin = made;
    uint8_t *enc = NULL;
    size_t elen = 0;
    char sw[300] = "";
    if (dir[0] != '\0') {
      if (kcache_encode(k, made, clen, &enc, &elen) != 0)
        snprintf(sw, sizeof sw, "out of memory");
      if (enc == NULL || kcache_store(dir, name, enc, elen, sw, sizeof sw) != 0)
        log_warnx("kernel cache: cannot store %s: %s; lent from memory, compiled again at the "
                  "next start", path, sw);
      free(enc);
    }
  }
  if (dir[0] != '\0')
    kcache_remove_stale(dir, k, name);
  out->bytes = clen;
  if ((out->fd = kcache_memfd(k, cubin, clen, why, whylen)) < 0)
    rc = DEP_ERR_INTERNAL;
out:
  free(file);
  free(made);
  return rc;
}

void kcache_entry_close(struct kcache_entry *e) {
  if (e->fd >= 0)
    close(e->fd);
  e->fd = -1;
}

const char *kcache_how_name(enum kcache_how h) {
  switch (h) {
  case KCACHE_HIT:
    return "hit";
  case KCACHE_BUILT:
    return "built";
  case KCACHE_REBUILT:
    return "rebuilt";
  default:
    return "compiled (not stored)";
  }
}
