/*
 * kimage.h — the kernels' image as nvcc built it (a fatbin of SASS for some
 * architectures and PTX for others, kernels/ops.cu), and what it holds for
 * one GPU.  The library and the daemon link the same image object from one
 * build (Makefile: fatbin_blob.o), so they agree on it by construction; its
 * build id (the fatbin's SHA-256) names it in the daemon's kernel cache and
 * lets the library tell a cached compile of its own kernels from another
 * build's.
 */
#ifndef DEP_KIMAGE_H
#define DEP_KIMAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KIMAGE_ID_LEN 64 /* hex digits of the build id */

struct kimage {
  const uint8_t *data;
  size_t len;
  const char *id; /* KIMAGE_ID_LEN hex digits */
};

/* The image embedded in this build; false (and *out zero) where it was built without nvcc. */
bool kimage_embedded(struct kimage *out);

/* What an image holds for a GPU of compute capability major.minor. */
enum kimage_fit {
  KIMAGE_SASS,     /* machine code the driver loads as it is */
  KIMAGE_PTX_ONLY, /* PTX alone: the driver compiles it at every load (1.6 s on an H200) */
  KIMAGE_NONE,     /* neither: the GPU cannot run these kernels */
  KIMAGE_UNKNOWN,  /* not a fatbin this parser reads: the driver decides */
};

/*
 * Read the fatbin's entries (kind, architecture) and say what it holds for
 * major.minor.  SASS of sm_MN runs on major M and minor >= N (the driver's
 * binary compatibility within a major version); PTX of compute_MN is
 * compiled for any GPU at or above M.N.  Reads only within len.
 */
enum kimage_fit kimage_fit(const uint8_t *data, size_t len, int major, int minor);

/* "SASS", "PTX only", "no code", "unrecognised image". */
const char *kimage_fit_name(enum kimage_fit f);

#endif /* DEP_KIMAGE_H */
