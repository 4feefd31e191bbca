/*
 * proto.h — the deepepd control protocol (DESIGN §8), one definition shared
 * by the daemon, libdeepep-client and deepepctl.
 *
 * A frame is a fixed 24-byte little-endian header followed by `body_len`
 * bytes of body.  File descriptors ride as SCM_RIGHTS ancillary data on the
 * frame that carries DEP_FRAME_F_FDS (see fdpass.h for who closes them).
 *
 *   offset size field
 *        0    4 magic       DEP_PROTO_MAGIC ("DEP1" little-endian)
 *        4    2 version     DEP_PROTO_VERSION
 *        6    2 type        enum dep_msg_type
 *        8    4 flags       DEP_FRAME_F_*
 *       12    4 request_id  echoed in the reply
 *       16    4 body_len    <= DEP_PROTO_MAX_BODY, checked before allocating
 *       20    4 reserved    must be zero
 *
 * Checks happen in this order, each with its own error: magic, version,
 * type, flags, body length, reserved, then the body's fields.  A bad magic,
 * flags, length or reserved field closes the connection: the stream can no
 * longer be trusted to be in step.  A version outside the window below is
 * DEP_ERR_VERSION and closes it too, after an ERROR the far end can read.
 * A type this build does not know, in a header right in every other way,
 * is DEP_ERR_UNSUPPORTED: the frame is whole (its length was checked), so
 * its body is read and skipped, the request is answered ERROR
 * {DEP_ERR_UNSUPPORTED, ...} with its request id, and the connection stays
 * (DESIGN §8): a newer library or deepepctl can try a new request on an
 * older daemon and carry on.  Every request gets exactly one reply: the
 * request's *_OK type with data, or DEP_MSG_ERROR {code, message}.
 *
 * Bodies are encoded field by field in little-endian order (never by
 * copying a C struct), strings as u16 length + bytes (no NUL on the wire).
 *
 * The header's layout and the ERROR body {i32 code, str message} are the
 * same in every version and stay so: that is what lets either end refuse a
 * version it does not speak with a message the other can read (deepepd
 * answers a client's frame of another version with an ERROR whose header
 * carries that version, and the library reads an ERROR of any version).
 *
 * Version history (the only one: DEP_PROTO_VERSION is the last entry):
 *   1  initial: HELLO, ERROR, STATUS, ATTACH, DETACH, SHUTDOWN notice;
 *      the ATTACH reply is one SLAB frame per device the job's local ranks
 *      use (the arena holding their slabs, its chunk fds riding on it)
 *      followed by ATTACH_OK, all with the request's id; RELOAD re-reads
 *      the configuration as SIGHUP does.
 *   2  a slab ends in its rank's private area (slab.h), which holds the
 *      cuda library's operation memory: the same messages, another slab.
 *   3  STATUS_OK carries the daemon's state after its backend, and each
 *      device's held bytes; DRAIN; the slab's abort words (slab.h).  Added
 *      since, without a bump (new types only): PEERS and PEERS_OK
 *      (deepepctl peers); PEER, the carrier of the peer protocol between
 *      daemons (peer_proto.h); JOB_NODES and JOB_NODES_OK (deepepctl
 *      status: the nodes of multi-node jobs, beside STATUS_OK's job
 *      records, left as they are).
 *   4  PEERS_OK carries the RDMA device (or why none) and the bytes
 *      registered with it, and per peer the configured transport, the
 *      links on RDMA queue pairs and their keep-alive's round trip.  Added
 *      since, without a bump (new types only): STATS_LEND and STATS_LEND_OK
 *      (a rank's stats page, stats_page.h), STATS, STATS_RANK and STATS_OK
 *      (deepepctl stats, metrics, doctor; STATS_OK's pools appended before
 *      any release carried it), CLIENTS and CLIENTS_OK
 *      (deepepctl clients); KERNELS and KERNELS_OK (the daemon's kernel
 *      cache: a cubin compiled on this node from the library's PTX, lent
 *      as a sealed memfd).
 *   5  PEERS_OK carries the proxy threads and their busy time, and per
 *      peer the data path's connections and traffic; JOB_NODES_OK per job
 *      its traffic and its rings' fullest.  XRING_LEND and XRING_LEND_OK
 *      (a rank's ring to the proxy, xring.h).  STATS_RANK ends with the SM
 *      budget the rank was given and where it came from (before any
 *      release carried 5); TUNE and TUNE_OK (adaptive_optimization: a
 *      rank's SM budget from the daemon's tuning table).
 *   6  A slab has no outbox (slab.h): a rank's bytes for and from other
 *      nodes are in its exchange region, which XRING_LEND_OK's memfd holds
 *      after the ring (xring.h version 2).
 *   7  A slab's private area is as large as its carving (slab.h
 *      dep__slab_priv), no longer a formula of its own: slab sizes differ.
 *      ATTACH_OK carries the job's chunk_rows, which the slab's layout
 *      depends on (streaming channels, slab.h).
 * Bump the version only when an existing message's layout changes; add
 * new message types otherwise.
 */
#ifndef DEP_PROTO_H
#define DEP_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepep.h"

#define DEP_PROTO_MAGIC 0x31504544u /* "DEP1" */
/* The version this build speaks (the history above says what each one
 * changed), and the oldest it answers: the compatibility window.  Today the
 * window is this one version: each bump so far changed a layout (a slab,
 * a reply) that this build no longer writes or reads, so a library or
 * deepepctl of another version is refused at HELLO with the window named,
 * and told to upgrade whichever end is older.  Widening it means keeping
 * the older layouts' codecs for connections that said an older version. */
#define DEP_PROTO_VERSION 7
#define DEP_PROTO_MIN_VERSION 7
#define DEP_PROTO_HDR_LEN 24
#define DEP_PROTO_MAX_BODY (256u * 1024u)
/* Linux accepts at most 253 fds in one SCM_RIGHTS message. */
#define DEP_PROTO_MAX_FDS 250

#define DEP_FRAME_F_FDS 0x1u /* SCM_RIGHTS fds accompany this frame */
#define DEP_FRAME_F_KNOWN (DEP_FRAME_F_FDS)

enum dep_msg_type {
  DEP_MSG_ERROR = 1,     /* reply: struct dep_msg_error */
  DEP_MSG_HELLO = 2,     /* request: struct dep_msg_hello */
  DEP_MSG_HELLO_OK = 3,  /* reply: struct dep_msg_hello_ok */
  DEP_MSG_STATUS = 4,    /* request: empty body */
  DEP_MSG_STATUS_OK = 5, /* reply: struct dep_status */
  DEP_MSG_ATTACH = 6,    /* request: struct dep_attach_args */
  DEP_MSG_ATTACH_OK = 7, /* reply: struct dep_msg_attach_ok */
  DEP_MSG_DETACH = 8,    /* request: empty body */
  DEP_MSG_DETACH_OK = 9, /* reply: empty body */
  DEP_MSG_SHUTDOWN = 10, /* notice from the daemon, request_id 0: it is stopping */
  DEP_MSG_SLAB = 11,     /* part of the ATTACH reply: struct dep_msg_slab + its chunk fds */
  DEP_MSG_RELOAD = 12,   /* request: empty body; root or the daemon's own user only */
  DEP_MSG_RELOAD_OK = 13, /* reply: struct dep_msg_text, what was applied and what needs a restart */
  DEP_MSG_DRAIN = 14,    /* request: struct dep_msg_drain; root or the daemon's own user only */
  DEP_MSG_DRAIN_OK = 15, /* reply: struct dep_msg_text, the state now and the jobs still running */
  DEP_MSG_PEERS = 16,    /* request: empty body */
  DEP_MSG_PEERS_OK = 17, /* reply: struct dep_msg_peers */
  DEP_MSG_PEER = 18,     /* between daemons only: struct dep_msg_opaque, one peer_proto.h message */
  DEP_MSG_JOB_NODES = 19,    /* request: empty body */
  DEP_MSG_JOB_NODES_OK = 20, /* reply: struct dep_msg_job_nodes */
  DEP_MSG_STATS_LEND = 21,    /* request: empty body; a rank of a running job asks for its stats page */
  DEP_MSG_STATS_LEND_OK = 22, /* reply: struct dep_msg_lend_ok, the page's memfd riding on it */
  DEP_MSG_STATS = 23,         /* request: struct dep_msg_stats_req */
  DEP_MSG_STATS_RANK = 24,    /* part of the STATS reply: struct dep_msg_stats_rank, one per rank */
  DEP_MSG_STATS_OK = 25,      /* reply: struct dep_msg_stats_ok, after the ranks */
  DEP_MSG_CLIENTS = 26,       /* request: empty body */
  DEP_MSG_CLIENTS_OK = 27,    /* reply: struct dep_msg_clients */
  DEP_MSG_KERNELS = 28,       /* request: struct dep_msg_kernels */
  DEP_MSG_KERNELS_OK = 29,    /* reply: struct dep_msg_kernels_ok + the cubin's fd */
  DEP_MSG_XRING_LEND = 30,    /* request: empty body; a rank of a job that spans nodes asks for its ring */
  DEP_MSG_XRING_LEND_OK = 31, /* reply: struct dep_msg_lend_ok, the ring's memfd riding on it */
  DEP_MSG_TUNE = 32,          /* request: struct dep_msg_tune; an attached rank asks its SM budget */
  DEP_MSG_TUNE_OK = 33,       /* reply: struct dep_msg_tune_ok */
  DEP_MSG_TYPE_MAX_
};

struct dep_frame_hdr {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t flags;
  uint32_t request_id;
  uint32_t body_len;
};

#define DEP_MSG_TEXT_MAX 512 /* error messages, names */

struct dep_msg_error {
  int32_t code; /* a DEP_ERR_* value */
  char message[DEP_MSG_TEXT_MAX];
};

/* A reply that is one line of text for the operator. */
struct dep_msg_text {
  char text[DEP_MSG_TEXT_MAX];
};

/* DRAIN: 1 stops new jobs (running ones finish), 0 accepts them again. */
struct dep_msg_drain {
  uint32_t drain;
};

struct dep_msg_hello {
  uint32_t version;      /* the sender's protocol version */
  uint32_t pid;          /* informational only: identity comes from SO_PEERCRED */
  char name[64];         /* "libdeepep-client 0.1.0", "deepepctl 0.1.0" */
};

struct dep_msg_hello_ok {
  uint32_t version;      /* the version this connection speaks */
  char daemon_version[32];
  char backend[8];
};

/* What a rank learns when its job's local rendezvous completes. */
struct dep_msg_attach_ok {
  uint64_t slab_bytes;        /* per local rank: the stride between slabs in an arena */
  uint32_t local_world_size;
  uint32_t num_fds;           /* fds riding on this frame (0: they came on SLAB frames) */
  char backend[8];
  uint32_t op_timeout_ms;     /* the bound on every wait inside an operation */
  uint32_t kernel_warmup;     /* 1: run every kernel once before dep_attach returns */
  uint32_t chunk_rows;        /* the job's streaming chunk (slab.h; 0: whole blocks) */
};

/*
 * One allocation of a job on one device (an arena): n_chunks fds ride on
 * the frame, in mapping order, and it holds the slabs of n_ranks local
 * ranks, each at its offset.  One arena per device keeps the number of
 * handles every rank imports small: import and set-access costs grow with
 * the handle count across processes (BENCHMARKS.md, vmm_map).
 */
struct dep_msg_slab_rank {
  uint32_t local_rank;
  uint32_t rank;
  uint64_t offset;            /* of this rank's slab in the arena */
};

struct dep_msg_slab {
  uint64_t chunk_bytes;
  uint32_t n_chunks;          /* 1..DEP_PROTO_MAX_FDS, equal to the fds received */
  uint8_t device_uuid[16];
  uint32_t n_ranks;           /* 1..DEP_MAX_LOCAL_RANKS */
  struct dep_msg_slab_rank ranks[DEP_MAX_LOCAL_RANKS];
};

/* A body passed through as bytes (DEP_MSG_PEER: peer_proto.h encodes it). */
struct dep_msg_opaque {
  const uint8_t *data;
  size_t len;
};

/* PEERS_OK: the peer daemons this one is configured with, and how each is. */
#define DEP_PEERS_MAX 64 /* config.h's CONFIG_MAX_LIST */
struct dep_msg_peer_info {
  char address[272];    /* "host:port" as configured */
  char node[64];        /* the far end's host name from its HELLO; "" before one came */
  char state[16];       /* "connecting", "authenticating", "up", "backoff" */
  char transport[8];    /* what its links settled on: "rdma", "tcp", "mixed"; "" while none is up */
  char wanted[8];       /* the configured transport: "auto", "rdma", "tcp" */
  char last_error[DEP_MSG_TEXT_MAX]; /* why the last connection failed; "" for none */
  uint32_t conns_up;    /* outbound connections authenticated and up */
  uint32_t conns_total; /* connection_pool_size */
  uint32_t inbound_up;  /* authenticated connections the far end opened to us */
  uint32_t qps_up;      /* of the outbound ones, those on a connected RDMA queue pair */
  uint64_t reconnects;  /* connections lost or failed and tried again */
  uint64_t bytes_in, bytes_out;
  uint64_t rtt_us;      /* round trip of the last keepalive answered; 0 before one */
  uint64_t backoff_ms;  /* the wait before the next attempt (state backoff) */
  uint64_t rdma_rtt_us; /* round trip of the last queue-pair keep-alive; 0 before one */
  /* The data path of jobs that span nodes (daemon/xfer.h): its connections
   * each way, and what moved on them since the daemon started. */
  uint32_t data_out, data_in;
  uint64_t data_bytes_out, data_bytes_in, data_frames_out, data_frames_in;
};

struct dep_msg_peers {
  char node[64];             /* this daemon's host name */
  char listen[272];          /* "address:port" it listens on, "" for none */
  uint32_t auth;             /* 1: peer_key_file in use; 0: peer_insecure */
  char rdma[DEP_MSG_TEXT_MAX]; /* the RDMA device peer links use ("rxe0"), or "none: " and why */
  uint64_t nic_bytes;        /* exchange regions registered with that device */
  uint32_t proxy_threads;    /* the data path's proxy threads running (0 until a job needs them) */
  uint64_t proxy_busy_us;    /* time they spent moving blocks (not polling), summed */
  uint32_t n_peers;          /* 0..DEP_PEERS_MAX */
  struct dep_msg_peer_info *peers; /* n_peers; the decoder allocates: proto_peers_free */
};

/* JOB_NODES_OK: for each multi-node job the viewer may see, the ranks and
 * nodes the peers reported (a record apart from STATUS_OK's jobs, whose
 * layout and public struct stay as they are). */
#define DEP_JOB_NODES_MAX 256
struct dep_msg_job_node {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t world_size;
  uint32_t local_ranks;   /* attached here */
  uint32_t remote_ranks;  /* reported by peers */
  uint32_t nodes;         /* this one and the peers that reported */
  /* The job's traffic through this daemon's proxy (daemon/xfer.h): blocks
   * sent to and received from other nodes, and its rings' fullest
   * (descriptors waiting at a sweep) of ring_entries. */
  uint64_t bytes_out, bytes_in, frames_out, frames_in;
  uint32_t ring_peak, ring_entries;
};
struct dep_msg_job_nodes {
  uint32_t n;             /* 0..DEP_JOB_NODES_MAX */
  struct dep_msg_job_node jobs[DEP_JOB_NODES_MAX];
};

/* STATS_LEND_OK (the rank's stats page, stats_page.h) and XRING_LEND_OK (its
 * ring to the daemon's proxy, xring.h): a sealed memfd rides on the frame. */
struct dep_msg_lend_ok {
  uint32_t version;  /* of the layout the daemon wrote into it (DEP_STATS_VERSION, DEP_XRING_VERSION) */
  uint32_t bytes;    /* the memfd's size (DEP_STATS_PAGE_BYTES, DEP_XRING_BYTES) */
};

/* STATS: the ranks of one job ("" for every job the asker may see). */
struct dep_msg_stats_req {
  char job_id[DEP_JOB_ID_MAX];
};

/* One op of one rank, as the daemon folded its calls (daemon/stats.c). */
struct dep_msg_stats_op {
  uint64_t calls;          /* calls that ran, the first included */
  uint64_t first_ns;       /* the first call's time; 0 before one */
  uint64_t steady_calls;   /* the calls after the first, which the histogram holds */
  uint64_t median_ns, p99_ns; /* of those; 0 before one */
  uint64_t steady_sum_ns;
  uint64_t bytes;          /* summed over the calls that ran (stats_page.h dep_stats_bytes) */
  uint64_t errors;         /* calls that failed, timeouts included, or were refused */
  uint64_t timeouts;
};

#define DEP_STATS_WIRE_OPS 5      /* DEP_STATS_NOPS, which proto_stats.c holds it to */
#define DEP_STATS_WIRE_LAYOUTS 16 /* DEP_STATS_LAYOUT_RING, likewise */
struct dep_msg_stats_rank {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t rank, local_rank, world, pid, uid;
  uint8_t device_uuid[16];
  uint32_t finished;       /* 1: the job has ended; these are its last figures */
  uint32_t cuda;           /* 1: times are the kernels' own, on the GPU's timer */
  uint64_t age_ms;         /* since the page was lent (the rank's attach) */
  uint64_t ended_ms;       /* since the job ended (finished only) */
  uint32_t attached;       /* 1: the attach times below were written */
  uint64_t attach_total_ns, attach_wait_ns, attach_map_ns, attach_setup_ns, attach_warmup_ns;
  uint64_t dropped;        /* calls overwritten in the ring before the daemon read them */
  struct dep_msg_stats_op ops[DEP_STATS_WIRE_OPS];
  uint64_t layouts;        /* layouts made */
  uint32_t n_recent;       /* 0..DEP_STATS_WIRE_LAYOUTS recent layouts, newest first */
  uint32_t recent_world;   /* 0..DEP_MAX_LOCAL_RANKS tokens per layout */
  uint32_t recent[DEP_STATS_WIRE_LAYOUTS][DEP_MAX_LOCAL_RANKS]; /* tokens sent to each rank */
  uint32_t kernel_ctas;    /* the SM budget the rank was given at attach (TUNE_OK); 0: none */
  uint32_t ctas_how;       /* where it came from (TUNE_OK's how); 0: the rank did not ask */
};

#define DEP_STATS_WIRE_POOLS 64 /* devices: config's CONFIG_MAX_LIST */
struct dep_msg_stats_ok {
  uint32_t ranks;          /* STATS_RANK frames before this one */
  uint32_t finished_jobs;  /* ended jobs whose figures are kept now */
  uint32_t keep_jobs;      /* at most this many are kept ... */
  uint32_t keep_s;         /* ... each for this long after it ended */
  uint32_t warn_ratio_milli; /* warn_first_call_ratio x 1000 */
  uint64_t warnings;       /* first-call warnings logged since the daemon started */
  char largest_job[DEP_JOB_ID_MAX]; /* the largest arena lent since the daemon started */
  uint8_t largest_uuid[16];         /* ... on this device */
  uint64_t largest_bytes;           /* ... of this many bytes (0: none yet) */
  /* What each served device's pool has made now (doctor's device-memory check: the rest of
   * its budget is what it may still take from the GPU). */
  uint32_t n_pools;                 /* 0..DEP_STATS_WIRE_POOLS */
  struct dep_msg_stats_pool {
    uint8_t uuid[16];
    uint64_t made_bytes;            /* <= the budget, STATUS's pool_total_bytes */
  } pools[DEP_STATS_WIRE_POOLS];
};

/* CLIENTS_OK: the connections the asker may see, one record each. */
#define DEP_CLIENTS_MAX 1024
struct dep_msg_client {
  uint32_t pid, uid;
  char name[64];           /* from its HELLO, escaped */
  char job_id[DEP_JOB_ID_MAX]; /* "" when it is no rank */
  uint32_t rank, local_rank;
  uint32_t attached;       /* 1: its job's rendezvous completed */
  uint8_t device_uuid[16];
  uint64_t connected_ms;   /* since it connected */
  uint64_t attached_ms;    /* since its job's rendezvous completed (attached only) */
};
struct dep_msg_clients {
  uint32_t n;              /* 0..DEP_CLIENTS_MAX */
  uint32_t left_out;       /* connections beyond DEP_CLIENTS_MAX, not listed */
  struct dep_msg_client *clients; /* the decoder allocates: proto_clients_free */
};

/*
 * KERNELS: a library whose kernels have only PTX for its GPU asks for the
 * daemon's compile of them (DESIGN §6, the kernel cache).  KERNELS_OK
 * describes the cubin that rides on it as one fd (a sealed memfd of `bytes`
 * bytes); the library uses it only where arch, driver and build id are its
 * own, else it loads its own image.  Where the daemon has none for that GPU
 * it answers DEP_ERR_NOT_FOUND saying why.
 */
struct dep_msg_kernels {
  uint8_t device_uuid[16];
};

struct dep_msg_kernels_ok {
  uint32_t arch;          /* compute capability major * 10 + minor */
  int32_t driver;         /* cuDriverGetVersion of the daemon that compiled it */
  char build[65];         /* the fatbin's build id it was compiled from (64 hex digits) */
  uint64_t bytes;         /* of the cubin, 1..DEP_KERNELS_MAX_BYTES */
};
#define DEP_KERNELS_MAX_BYTES (256ull << 20)

/*
 * TUNE: an attached rank of a job whose operations run here (cuda) asks,
 * before it launches anything, for the SM budget its communicating kernels
 * use (adaptive_optimization, daemon/tune.h).  It says its GPU's SMs and
 * the budget $DEEPEP_KERNEL_CTAS sets (0: unset), which wins over the
 * daemon's and is recorded as the rank's (deepepctl stats).  TUNE_OK: the
 * budget (0: the library's own default) and where it came from.
 */
struct dep_msg_tune {
  uint32_t sms;           /* 1..DEP_TUNE_MAX_SMS */
  uint32_t env_ctas;      /* 0, or the rank's $DEEPEP_KERNEL_CTAS */
};
struct dep_msg_tune_ok {
  uint32_t ctas;          /* 0: the library's default */
  uint32_t how;           /* 1..DEP_TUNE_HOW_MAX */
};
#define DEP_TUNE_MAX_SMS 1024u
enum dep_tune_how {
  DEP_TUNE_HOW_NONE = 0,     /* not asked: the host backend, or a job spanning nodes */
  DEP_TUNE_HOW_DEFAULT = 1,  /* the library's default: adaptive_optimization is off */
  DEP_TUNE_HOW_PENDING = 2,  /* the default; the key is queued for measurement */
  DEP_TUNE_HOW_MEASURED = 3, /* the table's, chosen by measurement (may equal the default) */
  DEP_TUNE_HOW_ENV = 4,      /* the rank's $DEEPEP_KERNEL_CTAS */
  DEP_TUNE_HOW_FAILED = 5,   /* the default; measuring the key failed (the daemon's log says why) */
};
#define DEP_TUNE_HOW_MAX 5u
/* "default", "default-measuring", "measured", "env", "default-failed"; "-" for none. */
const char *proto_tune_how_name(uint32_t how);

/* ---- header ---- */

/* Write a header into out[DEP_PROTO_HDR_LEN]. */
void proto_hdr_encode(const struct dep_frame_hdr *h, uint8_t out[DEP_PROTO_HDR_LEN]);
/*
 * Parse and check a header: magic, version, type, flags, body length
 * against max_body, reserved.  Returns 0; DEP_ERR_PROTOCOL (the stream is
 * broken: close it); DEP_ERR_VERSION (a version outside
 * DEP_PROTO_MIN_VERSION..DEP_PROTO_VERSION; the rest of the header may be
 * wrong too); or DEP_ERR_UNSUPPORTED (a type this build does not know, in
 * a header right in every other way: the frame is whole and may be
 * skipped).  *h is filled in every case; on error `why` (if not NULL,
 * `whylen` bytes) says what was wrong.
 */
int proto_hdr_decode(const uint8_t in[DEP_PROTO_HDR_LEN], uint32_t max_body,
                     struct dep_frame_hdr *h, char *why, size_t whylen);

/* ---- bodies ----
 * Encoders append to a growable buffer and return 0 or DEP_ERR_NO_MEMORY /
 * DEP_ERR_INVALID (a value that cannot be represented).  Decoders read
 * exactly `len` bytes: a short or long body, a bad string, or an
 * out-of-range field is DEP_ERR_PROTOCOL.  Decoders never allocate except
 * proto_decode_status (free with dep_status_free()).
 */
struct proto_buf {
  uint8_t *data;
  size_t len;
  size_t cap;
};

void proto_buf_init(struct proto_buf *b);
void proto_buf_free(struct proto_buf *b);
void proto_buf_reset(struct proto_buf *b);

/*
 * Encode a whole frame (header + body) into b: the common path.  The body
 * encoder is chosen by type; `msg` points to the matching struct (NULL for
 * empty bodies).
 */
int proto_frame_encode(struct proto_buf *b, uint16_t type, uint32_t flags,
                       uint32_t request_id, const void *msg);
/* Decode a body of the given type into `msg` (the matching struct); PEERS_OK
 * and CLIENTS_OK, which allocate, only through proto_decode_peers and
 * proto_decode_clients, and JOB_NODES_OK, which is large, only through
 * proto_decode_job_nodes. */
int proto_body_decode(uint16_t type, const uint8_t *body, size_t len, void *msg);
/* Room for any body proto_body_decode decodes: one member per struct it
 * fills (keep in step with its switch; the fuzz harness decodes every type
 * into one of these). */
union dep_msg_body {
  struct dep_msg_error error;
  struct dep_msg_hello hello;
  struct dep_msg_hello_ok hello_ok;
  struct dep_status status;
  struct dep_attach_args attach;
  struct dep_msg_attach_ok attach_ok;
  struct dep_msg_slab slab;
  struct dep_msg_text text;
  struct dep_msg_drain drain;
  struct dep_msg_opaque opaque;
  struct dep_msg_kernels kernels;
  struct dep_msg_kernels_ok kernels_ok;
  struct dep_msg_tune tune;
  struct dep_msg_tune_ok tune_ok;
  struct dep_msg_lend_ok lend_ok; /* STATS_LEND_OK, XRING_LEND_OK */
  struct dep_msg_stats_req stats_req;
  struct dep_msg_stats_rank stats_rank;
  struct dep_msg_stats_ok stats_ok;
};

/* The per-type codecs proto_frame_encode / proto_body_decode dispatch to,
 * by the file that holds them.  proto.c: the bodies every connection uses. */
int proto_encode_error(struct proto_buf *b, const struct dep_msg_error *m);
int proto_decode_error(const uint8_t *p, size_t len, struct dep_msg_error *m);
int proto_encode_hello(struct proto_buf *b, const struct dep_msg_hello *m);
int proto_decode_hello(const uint8_t *p, size_t len, struct dep_msg_hello *m);
int proto_encode_hello_ok(struct proto_buf *b, const struct dep_msg_hello_ok *m);
int proto_decode_hello_ok(const uint8_t *p, size_t len, struct dep_msg_hello_ok *m);
int proto_encode_opaque(struct proto_buf *b, const struct dep_msg_opaque *m);
/* m->data points into p: valid as long as p is. */
int proto_decode_opaque(const uint8_t *p, size_t len, struct dep_msg_opaque *m);

/* proto_rank.c: what a rank's library asks of its daemon. */
int proto_encode_attach(struct proto_buf *b, const struct dep_attach_args *m);
int proto_decode_attach(const uint8_t *p, size_t len, struct dep_attach_args *m);
int proto_encode_attach_ok(struct proto_buf *b, const struct dep_msg_attach_ok *m);
int proto_decode_attach_ok(const uint8_t *p, size_t len, struct dep_msg_attach_ok *m);
int proto_encode_slab(struct proto_buf *b, const struct dep_msg_slab *m);
int proto_decode_slab(const uint8_t *p, size_t len, struct dep_msg_slab *m);
int proto_encode_kernels(struct proto_buf *b, const struct dep_msg_kernels *m);
int proto_decode_kernels(const uint8_t *p, size_t len, struct dep_msg_kernels *m);
int proto_encode_kernels_ok(struct proto_buf *b, const struct dep_msg_kernels_ok *m);
int proto_decode_kernels_ok(const uint8_t *p, size_t len, struct dep_msg_kernels_ok *m);
int proto_encode_tune(struct proto_buf *b, const struct dep_msg_tune *m);
int proto_decode_tune(const uint8_t *p, size_t len, struct dep_msg_tune *m);
int proto_encode_tune_ok(struct proto_buf *b, const struct dep_msg_tune_ok *m);
int proto_decode_tune_ok(const uint8_t *p, size_t len, struct dep_msg_tune_ok *m);

/* proto_ctl.c: what deepepctl asks about the daemon itself. */
int proto_encode_status(struct proto_buf *b, const struct dep_status *m);
int proto_decode_status(const uint8_t *p, size_t len, struct dep_status *m);
int proto_encode_text(struct proto_buf *b, const struct dep_msg_text *m);
int proto_decode_text(const uint8_t *p, size_t len, struct dep_msg_text *m);
int proto_encode_drain(struct proto_buf *b, const struct dep_msg_drain *m);
int proto_decode_drain(const uint8_t *p, size_t len, struct dep_msg_drain *m);
int proto_encode_peers(struct proto_buf *b, const struct dep_msg_peers *m);
/* Allocates m->peers (NULL when none): free with proto_peers_free. */
int proto_decode_peers(const uint8_t *p, size_t len, struct dep_msg_peers *m);
void proto_peers_free(struct dep_msg_peers *m);
int proto_encode_job_nodes(struct proto_buf *b, const struct dep_msg_job_nodes *m);
int proto_decode_job_nodes(const uint8_t *p, size_t len, struct dep_msg_job_nodes *m);

/* proto_stats.c: the stats and clients messages. */
int proto_encode_lend_ok(struct proto_buf *b, const struct dep_msg_lend_ok *m);
int proto_decode_lend_ok(const uint8_t *p, size_t len, struct dep_msg_lend_ok *m);
int proto_encode_stats_req(struct proto_buf *b, const struct dep_msg_stats_req *m);
int proto_decode_stats_req(const uint8_t *p, size_t len, struct dep_msg_stats_req *m);
int proto_encode_stats_rank(struct proto_buf *b, const struct dep_msg_stats_rank *m);
int proto_decode_stats_rank(const uint8_t *p, size_t len, struct dep_msg_stats_rank *m);
int proto_encode_stats_ok(struct proto_buf *b, const struct dep_msg_stats_ok *m);
int proto_decode_stats_ok(const uint8_t *p, size_t len, struct dep_msg_stats_ok *m);
int proto_encode_clients(struct proto_buf *b, const struct dep_msg_clients *m);
/* Allocates m->clients (NULL when none): free with proto_clients_free. */
int proto_decode_clients(const uint8_t *p, size_t len, struct dep_msg_clients *m);
void proto_clients_free(struct dep_msg_clients *m);

/* The name of a message type for logs ("ATTACH"), or "UNKNOWN". */
const char *proto_type_name(uint16_t type);
/* Whether this build knows the type (1..DEP_MSG_TYPE_MAX_ - 1). */
static inline bool proto_type_known(uint16_t type) {
  return type > 0 && type < DEP_MSG_TYPE_MAX_;
}
/* Whether this build speaks protocol version v: DEP_PROTO_MIN_VERSION..DEP_PROTO_VERSION. */
static inline bool proto_version_known(uint32_t v) {
  return v >= DEP_PROTO_MIN_VERSION && v <= DEP_PROTO_VERSION;
}

/*
 * proto_rank.c: field validation shared by both ends: a job id of 1..63 characters from
 * [A-Za-z0-9._:-]; attach args within DEP_MAX_* and the shape limits of
 * deepep.h.  Returns 0 or DEP_ERR_INVALID with a message naming the field.
 */
int proto_check_job_id(const char *id, char *why, size_t whylen);
int proto_check_attach(const struct dep_attach_args *a, char *why, size_t whylen);

#endif /* DEP_PROTO_H */
