/*
 * codec.c — the little-endian field codec (codec.h).
 */
#include "codec.h"

#include <string.h>

#include "grow.h"

uint8_t *codec_grow(struct proto_buf *b, size_t n) {
  if (n > SIZE_MAX - b->len || DEP_GROW(b->data, b->cap, b->len + n, 256) != 0)
    return NULL;
  uint8_t *p = b->data + b->len;
  b->len += n;
  return p;
}

/* ---- body writer: errors are sticky so encoders read straight through ---- */

void codec_w_init(struct codec_w *w, struct proto_buf *b) {
  w->b = b;
  w->start = b->len;
  w->err = 0;
}

static uint8_t *codec_w_space(struct codec_w *w, size_t n) {
  if (w->err)
    return NULL;
  uint8_t *p = codec_grow(w->b, n);
  if (p == NULL)
    w->err = DEP_ERR_NO_MEMORY;
  return p;
}

void codec_w_u8(struct codec_w *w, uint8_t v) { codec_w_bytes(w, &v, 1); }

void codec_w_u16(struct codec_w *w, uint16_t v) {
  uint8_t *p = codec_w_space(w, 2);
  if (p)
    codec_put_u16(p, v);
}

void codec_w_u32(struct codec_w *w, uint32_t v) {
  uint8_t *p = codec_w_space(w, 4);
  if (p)
    codec_put_u32(p, v);
}

void codec_w_u64(struct codec_w *w, uint64_t v) {
  uint8_t *p = codec_w_space(w, 8);
  if (p)
    codec_put_u64(p, v);
}

void codec_w_bytes(struct codec_w *w, const void *src, size_t n) {
  uint8_t *p = codec_w_space(w, n);
  if (p && n)
    memcpy(p, src, n);
}

/* A string from a fixed char array of `size` bytes; it must hold its NUL,
 * and its length must fit what the decoder accepts (size - 1). */
void codec_w_str(struct codec_w *w, const char *s, size_t size) {
  if (w->err)
    return;
  size_t n = strnlen(s, size);
  if (n >= size || n > UINT16_MAX) {
    w->err = DEP_ERR_INVALID;
    return;
  }
  uint8_t *p = codec_w_space(w, 2 + n);
  if (p) {
    codec_put_u16(p, (uint16_t)n);
    memcpy(p + 2, s, n);
  }
}

/* A string in the whole of a fixed array of `size` bytes, NUL-padded (CODEC_FSTR). */
static void codec_w_fstr(struct codec_w *w, const char *s, size_t size) {
  if (w->err)
    return;
  size_t n = strnlen(s, size);
  if (n >= size) {
    w->err = DEP_ERR_INVALID;
    return;
  }
  uint8_t *p = codec_w_space(w, size);
  if (p) {
    memcpy(p, s, n);
    memset(p + n, 0, size - n);
  }
}

int codec_w_finish(struct codec_w *w) {
  if (w->err)
    w->b->len = w->start;
  return w->err;
}

/* ---- body reader: also sticky; any failure is DEP_ERR_PROTOCOL ----------- */

const uint8_t *codec_r_take(struct codec_r *r, size_t n) {
  if (r->bad || r->left < n) {
    r->bad = true;
    return NULL;
  }
  const uint8_t *p = r->p;
  r->p += n;
  r->left -= n;
  return p;
}

uint8_t codec_r_u8(struct codec_r *r) {
  const uint8_t *p = codec_r_take(r, 1);
  return p ? p[0] : 0;
}

uint16_t codec_r_u16(struct codec_r *r) {
  const uint8_t *p = codec_r_take(r, 2);
  return p ? codec_get_u16(p) : 0;
}

uint32_t codec_r_u32(struct codec_r *r) {
  const uint8_t *p = codec_r_take(r, 4);
  return p ? codec_get_u32(p) : 0;
}

uint64_t codec_r_u64(struct codec_r *r) {
  const uint8_t *p = codec_r_take(r, 8);
  return p ? codec_get_u64(p) : 0;
}

int32_t codec_r_i32(struct codec_r *r) {
  /* Two's complement reinterpretation without implementation-defined casts. */
  uint32_t u = codec_r_u32(r);
  return u <= INT32_MAX ? (int32_t)u : -(int32_t)(UINT32_MAX - u) - 1;
}

void codec_r_bytes(struct codec_r *r, void *dst, size_t n) {
  const uint8_t *p = codec_r_take(r, n);
  if (p)
    memcpy(dst, p, n);
}

/* A string into dst[size]: at most size - 1 bytes, no embedded NUL. */
void codec_r_str(struct codec_r *r, char *dst, size_t size) {
  dst[0] = '\0';
  const uint8_t *lp = codec_r_take(r, 2);
  if (lp == NULL)
    return;
  size_t n = codec_get_u16(lp);
  if (n >= size) {
    r->bad = true;
    return;
  }
  const uint8_t *s = codec_r_take(r, n);
  if (s == NULL)
    return;
  if (memchr(s, '\0', n) != NULL) {
    r->bad = true;
    return;
  }
  memcpy(dst, s, n);
  dst[n] = '\0';
}

/* A string from a fixed array of `size` bytes (CODEC_FSTR): a NUL in it,
 * and nothing but NULs after the first. */
static void codec_r_fstr(struct codec_r *r, char *dst, size_t size) {
  dst[0] = '\0';
  const uint8_t *s = codec_r_take(r, size);
  if (s == NULL)
    return;
  const size_t n = strnlen((const char *)s, size);
  bool padded = n < size;
  for (size_t i = n; i < size; i++)
    padded = padded && s[i] == 0;
  if (!padded) {
    r->bad = true;
    return;
  }
  memcpy(dst, s, size);
}

/* The body must be read exactly: trailing bytes are as wrong as missing ones. */
int codec_r_finish(const struct codec_r *r) {
  return (r->bad || r->left != 0) ? DEP_ERR_PROTOCOL : 0;
}

void codec_r_init(struct codec_r *r, const uint8_t *p, size_t len) {
  r->p = p;
  r->left = len;
  r->bad = false;
}


/* ---- field tables (codec.h) ----------------------------------------------- */

void codec_w_rec(struct codec_w *w, const struct codec_field *f, size_t n, const void *rec) {
  const uint8_t *base = rec;
  for (size_t i = 0; i < n && !w->err; i++) {
    const void *at = base + f[i].off;
    uint8_t u8;
    uint16_t u16;
    uint32_t u32;
    uint64_t u64;
    switch (f[i].kind) {
    case CODEC_KIND_U8:
      memcpy(&u8, at, 1);
      codec_w_u8(w, u8);
      break;
    case CODEC_KIND_U16:
      memcpy(&u16, at, 2);
      codec_w_u16(w, u16);
      break;
    case CODEC_KIND_U32:
    case CODEC_KIND_I32: /* the same four bytes: an int32_t goes as the uint32_t of its bits */
      memcpy(&u32, at, 4);
      codec_w_u32(w, u32);
      break;
    case CODEC_KIND_U64:
      memcpy(&u64, at, 8);
      codec_w_u64(w, u64);
      break;
    case CODEC_KIND_STR:
      codec_w_str(w, at, f[i].size);
      break;
    case CODEC_KIND_BYTES:
      codec_w_bytes(w, at, f[i].size);
      break;
    case CODEC_KIND_FSTR:
      codec_w_fstr(w, at, f[i].size);
      break;
    default:
      w->err = DEP_ERR_INTERNAL;
    }
  }
}

void codec_r_rec(struct codec_r *r, const struct codec_field *f, size_t n, void *rec) {
  uint8_t *base = rec;
  for (size_t i = 0; i < n && !r->bad; i++) {
    void *at = base + f[i].off;
    uint8_t u8;
    uint16_t u16;
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    switch (f[i].kind) {
    case CODEC_KIND_U8:
      u8 = codec_r_u8(r);
      memcpy(at, &u8, 1);
      break;
    case CODEC_KIND_U16:
      u16 = codec_r_u16(r);
      memcpy(at, &u16, 2);
      break;
    case CODEC_KIND_U32:
      u32 = codec_r_u32(r);
      memcpy(at, &u32, 4);
      break;
    case CODEC_KIND_I32:
      i32 = codec_r_i32(r);
      memcpy(at, &i32, 4);
      break;
    case CODEC_KIND_U64:
      u64 = codec_r_u64(r);
      memcpy(at, &u64, 8);
      break;
    case CODEC_KIND_STR:
      codec_r_str(r, at, f[i].size);
      break;
    case CODEC_KIND_BYTES:
      codec_r_bytes(r, at, f[i].size);
      break;
    case CODEC_KIND_FSTR:
      codec_r_fstr(r, at, f[i].size);
      break;
    default:
      r->bad = true;
    }
  }
}

size_t codec_rec_min(const struct codec_field *f, size_t n) {
  static const uint8_t width[] = {[CODEC_KIND_U8] = 1, [CODEC_KIND_U16] = 2,
                                  [CODEC_KIND_U32] = 4, [CODEC_KIND_U64] = 8,
                                  [CODEC_KIND_I32] = 4, [CODEC_KIND_STR] = 2};
  size_t bytes = 0;
  for (size_t i = 0; i < n; i++)
    bytes += f[i].kind == CODEC_KIND_BYTES || f[i].kind == CODEC_KIND_FSTR ? f[i].size
             : f[i].kind < sizeof width ? width[f[i].kind] : 0;
  return bytes;
}

int codec_body_encode(struct proto_buf *b, const struct codec_body *d, const void *rec) {
  if (d->enc_ok != NULL && !d->enc_ok(rec))
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_rec(&w, d->f, d->n, rec);
  return codec_w_finish(&w);
}

int codec_body_decode(const uint8_t *p, size_t len, const struct codec_body *d, void *rec) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(rec, 0, d->size);
  codec_r_rec(&r, d->f, d->n, rec);
  int rc = codec_r_finish(&r);
  if (rc == 0 && d->dec_ok != NULL && !d->dec_ok(rec))
    rc = DEP_ERR_PROTOCOL;
  return rc;
}

void codec_w_list(struct codec_w *w, uint32_t n, uint32_t left_out, const struct codec_field *f,
                  size_t nf, const void *recs, size_t stride) {
  codec_w_u32(w, n);
  codec_w_u32(w, left_out);
  for (uint32_t i = 0; i < n && !w->err; i++)
    codec_w_rec(w, f, nf, (const uint8_t *)recs + (size_t)i * stride);
}

void codec_r_list_head(struct codec_r *r, uint32_t max, const struct codec_field *f, size_t nf,
                       uint32_t *n, uint32_t *left_out) {
  *n = codec_r_u32(r);
  *left_out = codec_r_u32(r);
  if (!r->bad && (*n > max || *n > r->left / codec_rec_min(f, nf)))
    r->bad = true;
}
