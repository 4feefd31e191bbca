/*
 * codec.h — the little-endian field codec every wire format of the project
 * uses (the control protocol, proto*.c; the peer protocol, peer_proto.c;
 * the data stream's frame header, xring.c): fixed-width integers,
 * length-prefixed strings (u16 length + bytes, no NUL), strings NUL-padded
 * to a fixed size and raw bytes, written into a growable buffer and read
 * from a body of known length.  Errors are sticky on both sides, so an encoder or a
 * decoder reads straight through and checks once at the end: a writer that
 * failed rolls the buffer back to where it started (codec_w_finish); a
 * reader that ran short, or was not read exactly to its end, is
 * DEP_ERR_PROTOCOL (codec_r_finish).  Never by copying a C struct, so the
 * wire does not depend on the compiler's layout or the host's byte order.
 */
#ifndef DEP_CODEC_H
#define DEP_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto.h"

static inline void codec_put_u16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}

static inline void codec_put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static inline void codec_put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint16_t codec_get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static inline uint32_t codec_get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
         ((uint32_t)p[3] << 24);
}

static inline uint64_t codec_get_u64(const uint8_t *p) {
  return (uint64_t)codec_get_u32(p) | ((uint64_t)codec_get_u32(p + 4) << 32);
}

/* Make room for n more bytes at the end of b and return where they go, or NULL. */
uint8_t *codec_grow(struct proto_buf *b, size_t n);

struct codec_w {
  struct proto_buf *b;
  size_t start; /* b->len on entry: a failed encode is rolled back to it */
  int err;      /* the first failure (DEP_ERR_NO_MEMORY, DEP_ERR_INVALID), sticky */
};

void codec_w_init(struct codec_w *w, struct proto_buf *b);
void codec_w_u8(struct codec_w *w, uint8_t v);
void codec_w_u16(struct codec_w *w, uint16_t v);
void codec_w_u32(struct codec_w *w, uint32_t v);
void codec_w_u64(struct codec_w *w, uint64_t v);
void codec_w_bytes(struct codec_w *w, const void *src, size_t n);
/* A string from a fixed char array of `size` bytes: it must hold its NUL,
 * and its length must fit what the decoder accepts (size - 1). */
void codec_w_str(struct codec_w *w, const char *s, size_t size);
/* 0, or the first failure after rolling the buffer back. */
int codec_w_finish(struct codec_w *w);

struct codec_r {
  const uint8_t *p;
  size_t left;
  bool bad;     /* sticky: any short read, bad string or caller's check */
};

void codec_r_init(struct codec_r *r, const uint8_t *p, size_t len);
/* The next n bytes, or NULL (and bad) when fewer are left. */
const uint8_t *codec_r_take(struct codec_r *r, size_t n);
uint8_t codec_r_u8(struct codec_r *r);
uint16_t codec_r_u16(struct codec_r *r);
uint32_t codec_r_u32(struct codec_r *r);
uint64_t codec_r_u64(struct codec_r *r);
int32_t codec_r_i32(struct codec_r *r);
void codec_r_bytes(struct codec_r *r, void *dst, size_t n);
/* A string into dst[size]: at most size - 1 bytes, no embedded NUL. */
void codec_r_str(struct codec_r *r, char *dst, size_t size);
/* 0, or DEP_ERR_PROTOCOL when the body was bad or not read exactly. */
int codec_r_finish(const struct codec_r *r);

/*
 * Field tables: a record's fields once, in wire order, driving both its
 * encoder and its decoder (and the smallest encoding, which bounds a
 * count before anything is allocated).  Each entry names a member of the
 * record's C struct (a nested one too: shape.hidden); CODEC_U32(type, member) and the others check at
 * compile time that the member has the field's width (a string is a char
 * array of the decoder's size, holding its NUL).
 */
enum codec_kind { CODEC_KIND_U8 = 1, CODEC_KIND_U16, CODEC_KIND_U32, CODEC_KIND_U64,
                  CODEC_KIND_I32, CODEC_KIND_STR, CODEC_KIND_BYTES, CODEC_KIND_FSTR };

struct codec_field {
  uint8_t kind;  /* enum codec_kind */
  uint16_t size; /* the member's size (a string's array; the bytes of a BYTES field) */
  uint32_t off;  /* offsetof the member */
};

/* 0, and a compile error where cond is false (a static assertion usable in
 * an initializer). */
#define CODEC_CHECK(cond) (0 * sizeof(struct { _Static_assert(cond, "codec: a field's member has the wrong width"); int codec_x; }))
#define CODEC_MEMBER_SIZE(type, m) sizeof(((type *)0)->m)
#define CODEC_FIELD(kind, width, type, m)                                                   \
  {(kind), (uint16_t)CODEC_MEMBER_SIZE(type, m),                                          \
   (uint32_t)(offsetof(type, m) + CODEC_CHECK((width) == 0 || CODEC_MEMBER_SIZE(type, m) == (width)))}
#define CODEC_U8(type, m) CODEC_FIELD(CODEC_KIND_U8, 1, type, m)
#define CODEC_U16(type, m) CODEC_FIELD(CODEC_KIND_U16, 2, type, m)
#define CODEC_U32(type, m) CODEC_FIELD(CODEC_KIND_U32, 4, type, m)
#define CODEC_U64(type, m) CODEC_FIELD(CODEC_KIND_U64, 8, type, m)
#define CODEC_I32(type, m) CODEC_FIELD(CODEC_KIND_I32, 4, type, m)
#define CODEC_STR(type, m) CODEC_FIELD(CODEC_KIND_STR, 0, type, m)
/* A fixed array of raw bytes, all of it on the wire. */
#define CODEC_BYTES(type, m) CODEC_FIELD(CODEC_KIND_BYTES, 0, type, m)
/* A string in the whole of its fixed char array, NUL-padded: all of the
 * array on the wire, for records of a fixed wire size (xring.h's frame
 * header).  The reader refuses an array without a NUL, or with anything
 * but NULs after its first, so that each string has one encoding. */
#define CODEC_FSTR(type, m) CODEC_FIELD(CODEC_KIND_FSTR, 0, type, m)
#define CODEC_NFIELDS(table) (sizeof(table) / sizeof((table)[0]))

/* Write rec's fields in the table's order. */
void codec_w_rec(struct codec_w *w, const struct codec_field *f, size_t n, const void *rec);
/* Read them into rec (strings NUL-terminated; nothing past a failure is read). */
void codec_r_rec(struct codec_r *r, const struct codec_field *f, size_t n, void *rec);
/* The bytes of the smallest encoding of such a record (strings empty). */
size_t codec_rec_min(const struct codec_field *f, size_t n);

/*
 * A counted list, the body of every listing reply: u32 n, u32 left_out
 * (records the sender had no room for), then n records of table f.
 * codec_w_list writes it from n records `stride` bytes apart;
 * codec_r_list_head reads its two counts and fails (r->bad) where n is past
 * max or past what the bytes left could hold; the caller then reads the n
 * records with codec_r_rec, checking each as it needs.
 */
void codec_w_list(struct codec_w *w, uint32_t n, uint32_t left_out, const struct codec_field *f,
                  size_t nf, const void *recs, size_t stride);
void codec_r_list_head(struct codec_r *r, uint32_t max, const struct codec_field *f, size_t nf,
                       uint32_t *n, uint32_t *left_out);

/*
 * A body that is one field table and nothing more, with the checks of its
 * values each side makes (NULL: none).  The encoder refuses a record
 * enc_ok rejects (DEP_ERR_INVALID) before writing a byte; the decoder
 * zeroes the record, reads it exactly and refuses one dec_ok rejects
 * (DEP_ERR_PROTOCOL).
 */
struct codec_body {
  const struct codec_field *f;
  size_t n;
  size_t size; /* of the record */
  bool (*enc_ok)(const void *rec);
  bool (*dec_ok)(const void *rec);
};
int codec_body_encode(struct proto_buf *b, const struct codec_body *d, const void *rec);
int codec_body_decode(const uint8_t *p, size_t len, const struct codec_body *d, void *rec);
/* proto_encode_<body> and proto_decode_<body> (proto.h's DEP_MSG_BODIES)
 * of a body that is the field table `fields` of a `type`. */
#define CODEC_BODY(body, type, fields, enc_ok, dec_ok)                                           \
  static const struct codec_body body##_body = {(fields), CODEC_NFIELDS(fields), sizeof(type),  \
                                                (enc_ok), (dec_ok)};                             \
  int proto_encode_##body(struct proto_buf *b, const type *m) {                                  \
    return codec_body_encode(b, &body##_body, m);                                                \
  }                                                                                              \
  int proto_decode_##body(const uint8_t *p, size_t len, type *m) {                               \
    return codec_body_decode(p, len, &body##_body, m);                                           \
  }

#endif /* DEP_CODEC_H */
