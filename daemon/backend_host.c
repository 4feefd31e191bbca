/*
 * backend_host.c — the host backend: pool chunks are memfd shared memory,
 * passed to clients as the memfd itself.  It is what runs where there is no
 * GPU (CI, laptops) and must behave exactly like the cuda backend.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "uuid.h"

static int host_probe(struct backend_dev *devs, int max, char *why, size_t whylen) {
  if (max < 1) {
    snprintf(why, whylen, "no room for the host device");
    return DEP_ERR_INTERNAL;
  }
  memset(&devs[0], 0, sizeof devs[0]);
  dep__uuid_str(devs[0].uuid, devs[0].uuid_str); /* all zero */
  snprintf(devs[0].name, sizeof devs[0].name, "host");
  devs[0].ordinal = -1;
  devs[0].granularity = (uint64_t)sysconf(_SC_PAGESIZE);
  return 1;
}

static int host_chunk_create(struct backend_dev *d, uint64_t bytes, struct chunk_mem *out,
                             char *why, size_t whylen) {
  (void)d;
  memset(out, 0, sizeof *out);
  int fd = memfd_create("deepepd-chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    snprintf(why, whylen, "memfd_create: %s", strerror(errno));
    return DEP_ERR_NO_MEMORY;
  }
  if (ftruncate(fd, (off_t)bytes) != 0) {
    snprintf(why, whylen, "ftruncate memfd to %llu bytes: %s", (unsigned long long)bytes,
             strerror(errno));
    close(fd);
    return DEP_ERR_NO_MEMORY;
  }
  /* Sealed so that a client cannot shrink the file under the daemon's
   * mapping (which would turn the next scrub into SIGBUS) or grow it. */
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    snprintf(why, whylen, "sealing memfd: %s", strerror(errno));
    close(fd);
    return DEP_ERR_INTERNAL;
  }
  /* MAP_POPULATE makes the pages now, at pool creation, not at first touch
   * in a trainer's first call. */
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    snprintf(why, whylen, "mmap %llu bytes: %s", (unsigned long long)bytes, strerror(errno));
    close(fd);
    return DEP_ERR_NO_MEMORY;
  }
  out->fd = fd;
  out->bytes = bytes;
  out->host_ptr = p;
  struct stat st;
  if (fstat(fd, &st) == 0) {
    out->file_dev = (uint64_t)st.st_dev;
    out->file_ino = (uint64_t)st.st_ino;
  }
  return 0;
}

static void host_chunk_destroy(struct backend_dev *d, struct chunk_mem *m) {
  (void)d;
  if (m->host_ptr != NULL)
    munmap(m->host_ptr, m->bytes);
  if (m->fd >= 0)
    close(m->fd);
  m->host_ptr = NULL;
  m->fd = -1;
}

static int host_chunk_scrub(struct backend_dev *d, struct chunk_mem *m, char *why, size_t whylen) {
  (void)d;
  (void)why;
  (void)whylen;
  memset(m->host_ptr, 0, m->bytes);
  return 0;
}

static int host_chunk_batch(struct backend_dev *d, const struct chunk_io *io, size_t n,
                            char *why, size_t whylen) {
  (void)d;
  (void)why;
  (void)whylen;
  for (size_t i = 0; i < n; i++) {
    uint8_t *at = (uint8_t *)io[i].m->host_ptr + io[i].off;
    if (!io[i].read) {
      if (io[i].buf != NULL)
        memcpy(at, io[i].buf, io[i].len);
      else
        memset(at, 0, io[i].len);
      /* The readers are other processes polling with acquire loads: each
       * copy is out before the next (the epoch after the mask). */
      atomic_thread_fence(memory_order_release);
    } else {
      /* After the caller's own stores (the writers' release stores pair with it). */
      atomic_thread_fence(memory_order_seq_cst);
      memcpy(io[i].buf, at, io[i].len);
    }
  }
  return 0;
}

static void host_release_dev(struct backend_dev *d) { (void)d; }

const struct backend_ops backend_host_ops = {
    .name = "host",
    .cuts_only_when_set = true,
    .probe = host_probe,
    .chunk_create = host_chunk_create,
    .chunk_destroy = host_chunk_destroy,
    .chunk_scrub = host_chunk_scrub,
    .chunk_batch = host_chunk_batch,
    .batch_bytes = SIZE_MAX, /* nothing is staged */
    .release_dev = host_release_dev,
};
