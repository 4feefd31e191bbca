/*
 * kimage.c — the embedded kernels' image and what it holds (kimage.h).
 *
 * A fatbin, as nvcc -fatbin writes it: a 16-byte header {u32 magic
 * 0xBA55ED50, u16 version, u16 header size, u64 size of the entries}, then
 * entries, each a header {u16 kind (1 PTX, 2 ELF/SASS), u16 version, u32
 * header size, u64 payload size, ..., u32 architecture at byte 28 (90 for
 * sm_90)} followed by its payload.  The format is the toolkit's own
 * (fatbinary.h names these fields); only the fields above are read.
 */
#include "kimage.h"

#include <string.h>

#include "codec.h"

#define FATBIN_MAGIC 0xBA55ED50u
#define FATBIN_KIND_PTX 1
#define FATBIN_KIND_ELF 2

#ifdef DEP_HAVE_FATBIN
extern const unsigned char dep__fatbin[], dep__fatbin_end[];
extern const char dep__fatbin_id[];
#endif

bool kimage_embedded(struct kimage *out) {
  memset(out, 0, sizeof *out);
#ifdef DEP_HAVE_FATBIN
  out->data = dep__fatbin;
  out->len = (size_t)(dep__fatbin_end - dep__fatbin);
  out->id = dep__fatbin_id;
  return true;
#else
  return false;
#endif
}

enum kimage_fit kimage_fit(const uint8_t *p, size_t len, int major, int minor) {
  if (len < 16 || codec_get_u32(p) != FATBIN_MAGIC)
    return KIMAGE_UNKNOWN;
  uint64_t hs = codec_get_u16(p + 6), size = codec_get_u64(p + 8);
  if (hs < 16 || hs > len || size > len - hs)
    return KIMAGE_UNKNOWN;
  const int want = major * 10 + minor;
  bool ptx = false;
  for (uint64_t off = hs, end = hs + size; off < end;) {
    if (end - off < 32)
      return KIMAGE_UNKNOWN;
    const uint8_t *e = p + off;
    uint64_t ehs = codec_get_u32(e + 4), payload = codec_get_u64(e + 8);
    int kind = (int)codec_get_u16(e), arch = (int)codec_get_u32(e + 28);
    if (ehs < 32 || ehs > end - off || payload > end - off - ehs)
      return KIMAGE_UNKNOWN;
    if (kind == FATBIN_KIND_ELF && arch / 10 == major && arch % 10 <= minor)
      return KIMAGE_SASS;
    if (kind == FATBIN_KIND_PTX && arch <= want)
      ptx = true;
    off += ehs + payload;
  }
  return ptx ? KIMAGE_PTX_ONLY : KIMAGE_NONE;
}

const char *kimage_fit_name(enum kimage_fit f) {
  switch (f) {
  case KIMAGE_SASS:
    return "SASS";
  case KIMAGE_PTX_ONLY:
    return "PTX only";
  case KIMAGE_NONE:
    return "no code";
  default:
    return "unrecognised image";
  }
}
