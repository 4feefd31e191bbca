/*
 * codec.c — the little-endian field codec (codec.h).
 */
#include "codec.h"

#include <stdlib.h>
#include <string.h>

uint8_t *codec_grow(struct proto_buf *b, size_t n) {
  if (n > SIZE_MAX - b->len)
    return NULL;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n) {
      if (cap > SIZE_MAX / 2)
        return NULL;
      cap *= 2;
    }
    uint8_t *d = realloc(b->data, cap);
    if (d == NULL)
      return NULL;
    b->data = d;
    b->cap = cap;
  }
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

void codec_w_i32(struct codec_w *w, int32_t v) { codec_w_u32(w, (uint32_t)v); }

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

/* The body must be read exactly: trailing bytes are as wrong as missing ones. */
int codec_r_finish(const struct codec_r *r) {
  return (r->bad || r->left != 0) ? DEP_ERR_PROTOCOL : 0;
}

void codec_r_init(struct codec_r *r, const uint8_t *p, size_t len) {
  r->p = p;
  r->left = len;
  r->bad = false;
}

