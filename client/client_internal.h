/*
 * client_internal.h — the handle of libdeepep-client and the request/reply
 * machinery its files share (client.c today; the slab mapping that attach
 * grows into later).  Nothing declared here is exported from the shared
 * library: the build hides every symbol that is not DEP_EXPORT, and the
 * version script keeps only dep_*.  deepepctl links the static archive and
 * may use client_set_name() and client_set_hello_timeout().
 */
#ifndef DEP_CLIENT_INTERNAL_H
#define DEP_CLIENT_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "cuda_ops.h"
#include "deepep.h"
#include "host_ops.h"
#include "mem.h"
#include "proto.h"
#include "slab.h"
#include "statrec.h"
#include "warm.h"
#include "watch.h"

#define CLIENT_ERRMSG_MAX 1024
#define CLIENT_NAME_MAX 64
#define CLIENT_SOCKET_MAX 108 /* sizeof(sun_path) */

/* How long an ordinary request (HELLO, STATUS, DETACH) may wait for its reply. */
#define CLIENT_REQUEST_TIMEOUT_MS 30000
/* ATTACH waits for the other local ranks; the daemon bounds that wait with
 * its own limits.attach_timeout_ms and answers DEP_ERR_TIMEOUT.  The client
 * waits that long plus a margin, so a daemon that never answers cannot hang
 * the trainer.  $DEEPEPD_ATTACH_TIMEOUT_MS overrides the default. */
#define CLIENT_ATTACH_TIMEOUT_ENV "DEEPEPD_ATTACH_TIMEOUT_MS"
#define CLIENT_ATTACH_TIMEOUT_DEFAULT_MS 120000
#define CLIENT_ATTACH_MARGIN_MS 2000
/* Time dep_client_free gives an orderly DETACH before it just closes. */
#define CLIENT_FREE_DETACH_TIMEOUT_MS 2000

struct dep_client {
  int fd;                         /* connected socket, -1 when not connected */
  uint32_t next_request;          /* request ids count from 1; 0 marks daemon notices */
  char name[CLIENT_NAME_MAX];     /* what HELLO calls this client */
  char socket_path[CLIENT_SOCKET_MAX];
  int hello_timeout_ms;           /* 0: CLIENT_REQUEST_TIMEOUT_MS (client_set_hello_timeout) */
  struct dep_msg_hello_ok hello;  /* the daemon's answer to our HELLO */
  bool attached;
  /* This attachment's number, unique in the process: a dispatch stamps its
   * handle with it, and a combine refuses a handle another one filled. */
  uint64_t attach_id;
  char job_id[DEP_JOB_ID_MAX];    /* the job while attached */
  struct dep_msg_attach_ok attach_ok; /* the last ATTACH_OK */
  struct dep_attach_args args;    /* what this rank attached with */
  struct dep_slab_layout layout;  /* of every slab of the job */
  struct mem_map arenas[DEP_MAX_LOCAL_RANKS]; /* the job's arenas (one per device), mapped */
  uint32_t n_arenas;
  uint32_t ranks_on_dev;          /* local ranks of the job on this rank's device */
  uint8_t *slabs[DEP_MAX_LOCAL_RANKS];      /* every local rank's slab, by local rank */
  uint32_t ranks[DEP_MAX_LOCAL_RANKS];      /* global rank of each local rank */
  bool cuda;                      /* slabs are GPU memory */
  int cuda_dev;                   /* this rank's CUDA device ordinal */
  struct mem_ctx_ref primary;     /* the primary context this handle holds (mem.h) */
  struct dep_attach_times times;  /* how long dep_attach took, and where the time went */
  struct ops_ctx ops;             /* dispatch/combine state (the job's shape and slabs) */
  struct cuops_state cuops;       /* cuda backend: kernels, error record (cuda_attach.c) */
  void *lent_kernels;             /* the daemon's cubin, mapped from KERNELS until loaded */
  size_t lent_kernels_bytes;
  struct statrec stats;           /* the stats page the daemon lent this rank (statrec.h) */
  struct dep_xring *xring;        /* a job that spans nodes: the ring to the daemon's proxy */
  char xring_why[256];            /* ... or why this rank has none (operations refuse) */
  struct watch watch;             /* ... and the thread that fails its waits when the daemon
                                     goes (watch.h) */
  struct warm warm;               /* the host warm-up's thread (warm.h) */
  struct proto_buf tx;            /* reused for every request */
  char errmsg[CLIENT_ERRMSG_MAX]; /* the last failure on this handle */
};

/*
 * One frame as received: the checked header, its body (malloc'd, body_len
 * bytes, NULL when empty) and the fds that rode on it.  The fds belong to
 * whoever holds the frame; a consumer that keeps one sets its slot to -1,
 * and client_frame_release() closes the rest.
 */
struct client_frame {
  struct dep_frame_hdr hdr;
  uint8_t *body;
  int fds[DEP_PROTO_MAX_FDS];
  int nfds;
};

void client_frame_init(struct client_frame *f);
/* Free the body and close every fd still in the frame. */
void client_frame_release(struct client_frame *f);

/* Record a failure on the handle and return `code` (printf-style message). */
/* CLOCK_MONOTONIC in milliseconds: the attach's and the warm-up's times (attach.c). */
double client_clock_ms(void);
int client_seterr(dep_client_t *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/*
 * Structs grow (deepep.h): the one check of a caller's struct size and its
 * copy.  client_size_check: `size` (the caller's sizeof of struct `type`)
 * must reach `first`, the struct's first layout (CLIENT_FIRST_LAYOUT of its
 * last field then), else DEP_ERR_INVALID naming the fix; c may be NULL (no
 * message).  client_args_take: that check on the size `a` begins with, then
 * the caller's bytes copied into `out` (`ours` bytes, zeroed first, so
 * fields an older caller lacks read as 0); a larger struct whose bytes past
 * ours are not all zero is DEP_ERR_UNSUPPORTED.  client_args_give: an
 * output taken so copied back, as much as both structs hold, with `size`
 * set to those bytes.
 *
 * A size above CLIENT_SIZE_MAX is DEP_ERR_INVALID too: no struct of deepep.h
 * comes near it (dep_attach_info, the largest, is 808 bytes), so such a size
 * is an unset or corrupt field, and reading that far past the caller's
 * struct for the zero check would fault rather than fail.  deepep.h states
 * the number.
 */
#define CLIENT_SIZE_MAX 4096u
#define CLIENT_FIRST_LAYOUT(type, last) (offsetof(type, last) + sizeof(((type *)0)->last))
#define CLIENT_TAKE(c, op, type, last, a, out)                                            \
  client_args_take((c), (op), #type, (a), sizeof(struct type),                            \
                   CLIENT_FIRST_LAYOUT(struct type, last), (out))
int client_size_check(dep_client_t *c, const char *op, const char *type, uint32_t size,
                      size_t ours, size_t first);
int client_args_take(dep_client_t *c, const char *op, const char *type, const void *a,
                     size_t ours, size_t first, void *out);
void client_args_give(void *out, void *ours, size_t ours_size);

/* Close the socket and forget attach state; the handle stays reusable. */
void client_disconnect(dep_client_t *c);
/* Whether an attached handle's operations run here: its job is on this node
 * alone, or the daemon lent it a ring to its proxy (attach.c); else they
 * refuse, saying xring_why. */
bool client_ops_here(const dep_client_t *c);
/* Unmap every slab and forget the attachment (attach.c). */
void client_unmap(dep_client_t *c);
/* A failure after which the stream cannot be trusted: record it, close. */
int client_fail(dep_client_t *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Send a request; its id comes back in *id. */
int client_send_request(dep_client_t *c, uint16_t type, const void *msg, uint32_t *id);
/*
 * Read the next reply frame to request `id`: ok_type, or part_type (a part
 * of a multi-frame reply, 0 for none), or an ERROR (its code returned).
 */
int client_read_reply(dep_client_t *c, uint32_t id, const char *what, uint16_t ok_type,
                      uint16_t part_type, int timeout_ms, int64_t deadline,
                      struct client_frame *reply);
/* The monotonic deadline timeout_ms from now (-1 for none). */
int64_t client_deadline(int timeout_ms);

/*
 * Send one request and wait (at most timeout_ms, < 0 for ever) for its one
 * reply.  Returns 0 with the reply of type ok_type in *reply (release it),
 * the daemon's code for an ERROR reply (message in dep_errmsg), or
 * DEP_ERR_DAEMON_GONE / PROTOCOL / TIMEOUT / IO, after which the
 * connection is closed because the stream can no longer be trusted.
 */
int client_request(dep_client_t *c, uint16_t type, const void *msg, uint16_t ok_type,
                   int timeout_ms, struct client_frame *reply);

/*
 * Ask for a memfd the daemon lends (STATS_LEND, XRING_LEND: a LEND_OK reply
 * with its fd) and map all `map_bytes` of it shared, read-write.  0 with
 * *map set, or DEP_ERR_* with why: the daemon's refusal, or a memfd of
 * another version or size than `version`, `bytes` (what the reply says)
 * and `map_bytes` (the memfd's own size: an XRING_LEND memfd holds the
 * exchange region after the ring) — a daemon of another build.  The
 * handle's last message (dep_errmsg) is left as it was.
 */
int client_lend_map(dep_client_t *c, uint16_t type, uint16_t ok_type, uint32_t version,
                    uint32_t bytes, uint64_t map_bytes, void **map, char *why, size_t whylen);

/* The name sent in HELLO (deepepctl calls itself "deepepctl 0.1.0"). */
void client_set_name(dep_client_t *c, const char *name);
/* How long dep_connect waits for HELLO's reply (0: the library's default).
 * A program keeps the default; deepepctl, whose operator wants to hear of a
 * hung daemon in seconds, sets a shorter one. */
void client_set_hello_timeout(dep_client_t *c, int timeout_ms);

#endif /* DEP_CLIENT_INTERNAL_H */
