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
 *   8  The exchange region of a job that spans nodes holds channels and
 *      their chunks' marks (slab.h), and its ring version 3 descriptors
 *      (xring.h); a low-latency handle keeps each row's source token, so
 *      the private area's warm-up handle is larger: a library of 7 would
 *      address other layouts.  STATUS_OK's job record carries host_bytes.
 *      STATS_RANK carries the tokens of the rank's newest layout to every
 *      rank of its job, a count per rank of a world of up to DEP_MAX_WORLD;
 *      before, the newest 16 layouts' counts to ranks 0..63 alone.
 *      STATS_OK says how many ranks' counts the reply left out.  Its
 *      stats page is sized by the job's world (stats_page.h version 2), and
 *      STATS_LEND_OK's bytes say so.
 *      RELOAD_OK is structured: the message, the
 *      live keys applied and the keys that need a restart, by name (it was
 *      one string).  PEERS_OK carries per peer what went to it as RDMA
 *      writes: blocks, writes, posts and bytes.
 *   9  A slab's control area ends in the live mask (slab.h: an epoch word
 *      and a bit per rank), which the daemon writes for elastic jobs: the
 *      data blocks of large worlds may start a page later; after the bits,
 *      a join word per rank.  ATTACH ends
 *      in the job's flags (DEP_ATTACH_ELASTIC); STATUS_OK's job record in
 *      its flags, masked ranks, epoch and mask; JOB_EVENTS and
 *      JOB_EVENTS_OK (an elastic job's history: who left, when, why; who
 *      came back).  JOB_NODES_OK's job record ends in payload_out (the rows
 *      its proxy sent: one crossing per destination node, xring.h version 4).
 *      The private area's cuda scratch (kabi.h cuops_world_carve) holds a streamed
 *      call's counts of the chunks it sends to other nodes (chan_sent): a
 *      slab may be a page larger.
 *  10  STATUS_OK's job record ends in its chunk_rows (stream_chunk_rows, or
 *      the daemon's choice under auto; 0: whole blocks).
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
#define DEP_PROTO_VERSION 10
#define DEP_PROTO_MIN_VERSION 10
#define DEP_PROTO_HDR_LEN 24
#define DEP_PROTO_MAX_BODY (256u * 1024u)
/* Linux accepts at most 253 fds in one SCM_RIGHTS message. */
#define DEP_PROTO_MAX_FDS 250

#define DEP_FRAME_F_FDS 0x1u /* SCM_RIGHTS fds accompany this frame */
#define DEP_FRAME_F_KNOWN (DEP_FRAME_F_FDS)

/*
 * Every message type, one line each: X(NAME, name, number, body, from).
 *   NAME    DEP_MSG_<NAME>, and the type's name in logs ("ATTACH")
 *   name    the same in lower case: a request's handler is control_<name>
 *           (control.c); an operator request's verb in its refusal
 *   number  its type on the wire: never reused, never renumbered; the
 *           numbers run 1.. without a gap (proto_type_known)
 *   body    its body's codec, proto_encode_<body> / proto_decode_<body>, a
 *           line of DEP_MSG_BODIES below; `empty` for no body
 *   from    who may send it: CLIENT (a library or deepepctl: a request
 *           control.c answers), OPERATOR (a request of root or deepepd's
 *           own user only), DAEMON (a reply or a notice: a client that sends
 *           one is dropped), PEER (between daemons, on a peer link only)
 * The type enum, the names, both codec dispatches (proto.c), the body
 * union and the daemon's request dispatch (control.c) are made from it: a
 * new message is one line here and its handler (and, for a new body, its
 * codec and a line of DEP_MSG_BODIES).
 */
#define DEP_MSG_MAP(X)                                                                            \
  X(ERROR, error, 1, error, DAEMON)                /* a reply: the request failed */             \
  X(HELLO, hello, 2, hello, CLIENT)                /* the first message of a connection */       \
  X(HELLO_OK, hello_ok, 3, hello_ok, DAEMON)                                                      \
  X(STATUS, status, 4, empty, CLIENT)                                                            \
  X(STATUS_OK, status_ok, 5, status, DAEMON)       /* struct dep_status */                       \
  X(ATTACH, attach, 6, attach, CLIENT)             /* struct dep_attach_args */                  \
  X(ATTACH_OK, attach_ok, 7, attach_ok, DAEMON)                                                   \
  X(DETACH, detach, 8, empty, CLIENT)                                                            \
  X(DETACH_OK, detach_ok, 9, empty, DAEMON)                                                      \
  X(SHUTDOWN, shutdown, 10, empty, DAEMON)         /* a notice, request_id 0: it is stopping */  \
  X(SLAB, slab, 11, slab, DAEMON)                  /* part of the ATTACH reply, + chunk fds */   \
  X(RELOAD, reload, 12, empty, OPERATOR)                                                         \
  X(RELOAD_OK, reload_ok, 13, reload_ok, DAEMON)   /* what was applied, what needs a restart */  \
  X(DRAIN, drain, 14, drain, OPERATOR)                                                           \
  X(DRAIN_OK, drain_ok, 15, text, DAEMON)          /* the state now, the jobs still running */   \
  X(PEERS, peers, 16, empty, CLIENT)                                                             \
  X(PEERS_OK, peers_ok, 17, peers, DAEMON)                                                       \
  X(PEER, peer, 18, opaque, PEER)                  /* one peer_proto.h message */                \
  X(JOB_NODES, job_nodes, 19, empty, CLIENT)                                                     \
  X(JOB_NODES_OK, job_nodes_ok, 20, job_nodes, DAEMON)                                           \
  X(STATS_LEND, stats_lend, 21, empty, CLIENT)     /* a rank of a running job: its stats page */ \
  X(STATS_LEND_OK, stats_lend_ok, 22, lend_ok, DAEMON) /* the page's memfd riding on it */       \
  X(STATS, stats, 23, stats_req, CLIENT)                                                         \
  X(STATS_RANK, stats_rank, 24, stats_rank, DAEMON) /* part of the STATS reply, one per rank */  \
  X(STATS_OK, stats_ok, 25, stats_ok, DAEMON)      /* after the ranks */                         \
  X(CLIENTS, clients, 26, empty, CLIENT)                                                         \
  X(CLIENTS_OK, clients_ok, 27, clients, DAEMON)                                                 \
  X(KERNELS, kernels, 28, kernels, CLIENT)                                                       \
  X(KERNELS_OK, kernels_ok, 29, kernels_ok, DAEMON) /* + the cubin's fd */                       \
  X(XRING_LEND, xring_lend, 30, empty, CLIENT)     /* a rank of a job across nodes: its ring */  \
  X(XRING_LEND_OK, xring_lend_ok, 31, lend_ok, DAEMON) /* the ring's memfd riding on it */       \
  X(TUNE, tune, 32, tune, CLIENT)                  /* an attached rank asks its SM budget */     \
  X(TUNE_OK, tune_ok, 33, tune_ok, DAEMON)                                                       \
  X(JOB_EVENTS, job_events, 34, empty, CLIENT)                                                   \
  X(JOB_EVENTS_OK, job_events_ok, 35, job_events, DAEMON) /* elastic jobs' histories */

enum dep_msg_type {
#define DEP_MSG_ENUM_(NAME, name, number, body, from) DEP_MSG_##NAME = number,
  DEP_MSG_MAP(DEP_MSG_ENUM_)
#undef DEP_MSG_ENUM_
  DEP_MSG_TYPE_MAX_
};

/* Who may send a message type (DEP_MSG_MAP's last column). */
enum dep_msg_from { DEP_MSG_FROM_CLIENT = 1, DEP_MSG_FROM_OPERATOR, DEP_MSG_FROM_DAEMON, DEP_MSG_FROM_PEER };

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

/*
 * RELOAD_OK: what a reload did.  The keys by their dotted names ("limits.max_clients"), in the
 * file's order; the test of config's key table (tests/check_config_reload.c) holds every key
 * deepepd.yaml has within these bounds, so no list is ever cut.
 */
#define DEP_RELOAD_KEYS_MAX 64 /* names in one list */
#define DEP_RELOAD_KEY_MAX 48  /* a key's dotted name and its NUL */
struct dep_msg_reload_ok {
  char message[DEP_MSG_TEXT_MAX]; /* for people: the file, the changes, what needs a restart */
  uint32_t n_applied;             /* 0..DEP_RELOAD_KEYS_MAX */
  char applied[DEP_RELOAD_KEYS_MAX][DEP_RELOAD_KEY_MAX]; /* live keys changed, now in effect */
  uint32_t n_restart;             /* 0..DEP_RELOAD_KEYS_MAX */
  char restart[DEP_RELOAD_KEYS_MAX][DEP_RELOAD_KEY_MAX]; /* keys changed that need a restart */
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
  /* ... and what went to the peer as RDMA writes since the daemon started (xfer_rdma.h):
   * descriptors, work requests, posts (chains of them) and bytes.  Outbound only: a write
   * lands without the far daemon taking part. */
  uint64_t rdma_blocks_out, rdma_writes_out, rdma_posts_out, rdma_bytes_out;
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
  /* Of bytes_out, the rows its blocks and chunks carried: no frame header,
   * no node channel's table (xring.h), no slot or credit. */
  uint64_t payload_out;
};
struct dep_msg_job_nodes {
  uint32_t n;             /* 0..DEP_JOB_NODES_MAX */
  struct dep_msg_job_node jobs[DEP_JOB_NODES_MAX];
};

/*
 * JOB_EVENTS_OK: the history of each elastic job the viewer may see
 * (DESIGN §14), oldest first within a job: each rank that left it (why:
 * slab.h's DEP_SLAB_GONE_DIED, DETACHED or NODE) and each that came back
 * (DEP_JOB_EVENT_REJOINED), with the epoch of the live mask it made.  A
 * job keeps its newest DEP_JOB_EVENTS_KEPT events; a reply holds at most
 * DEP_JOB_EVENTS_MAX, and says how many it left out.  DEP_JOB_EVENT_PARTITIONED:
 * the job had gone on in two parts while a peer link was down, and when it
 * came back one part was kept (daemon/job_elastic.c); its rank is the lowest
 * live rank of the part that goes on, on both sides.
 */
#define DEP_JOB_EVENT_REJOINED 4u
#define DEP_JOB_EVENT_PARTITIONED 5u
#define DEP_JOB_EVENTS_KEPT 32u
#define DEP_JOB_EVENTS_MAX 1024u
struct dep_msg_job_event {
  char job_id[DEP_JOB_ID_MAX];
  uint64_t age_ms;        /* the job's age when it happened */
  uint32_t rank;          /* the global rank */
  uint32_t why;           /* DEP_SLAB_GONE_DIED / DETACHED / NODE, DEP_JOB_EVENT_REJOINED,
                             DEP_JOB_EVENT_PARTITIONED */
  uint32_t pid;           /* its process, where this node held it (0: another node's) */
  uint64_t epoch;         /* the live mask's epoch it made here */
};
struct dep_msg_job_events {
  uint32_t n;             /* 0..DEP_JOB_EVENTS_MAX */
  uint32_t left_out;      /* events past DEP_JOB_EVENTS_MAX, not in this reply */
  struct dep_msg_job_event ev[DEP_JOB_EVENTS_MAX];
};
/* An event's why as a word for people and JSON ("died", "detached", "node lost", "rejoined",
 * "partitioned"). */
const char *proto_job_event_name(uint32_t why);

/* STATS_LEND_OK (the rank's stats page, stats_page.h) and XRING_LEND_OK (its
 * ring to the daemon's proxy, xring.h): a sealed memfd rides on the frame. */
struct dep_msg_lend_ok {
  uint32_t version;  /* of the layout the daemon wrote into it (DEP_STATS_VERSION, DEP_XRING_VERSION) */
  uint32_t bytes;    /* the memfd's size (dep_stats_page_bytes(world), DEP_XRING_BYTES) */
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
  /* The newest layout that ran: the tokens this rank sends to each rank of its job.  Decoded,
   * tokens is allocated (proto_stats_rank_free); in the daemon's own records it points into
   * the daemon's figures. */
  uint32_t tokens_world;   /* 0..DEP_MAX_WORLD counts; 0 before a layout ran */
  uint32_t *tokens;        /* [tokens_world]; NULL when tokens_world is 0 */
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
  /* Ranks whose tokens (STATS_RANK's tokens_world 0) this reply left out: their counts did not
   * fit the quarter of limits.client_queue_bytes a reply's counts may take.  Asking for one job
   * gets them while that job's fit. */
  uint32_t tokens_left_out;
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
 * those DEP_MSG_BODIES says do.
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
/*
 * Every body, one line each: X(body, type, decoded).
 *   body     its codec: proto_encode_<body> and proto_decode_<body>, in the
 *            file its comment names
 *   type     the C struct it encodes from and decodes into
 *   decoded  UNION: proto_body_decode decodes it into union dep_msg_body
 *            (STATUS_OK's allocates: free devices and jobs; STATS_RANK's:
 *            proto_stats_rank_free); OWN: only its
 *            own decoder does, because it allocates (PEERS_OK, CLIENTS_OK:
 *            proto_peers_free, proto_clients_free) or is too large for the
 *            union (JOB_NODES_OK); proto_body_decode refuses it
 */
#define DEP_MSG_BODIES(X)                                                                         \
  X(error, struct dep_msg_error, UNION)          /* proto.c: code < 0 */                         \
  X(hello, struct dep_msg_hello, UNION)          /* proto.c */                                   \
  X(hello_ok, struct dep_msg_hello_ok, UNION)    /* proto.c */                                   \
  X(opaque, struct dep_msg_opaque, UNION)        /* proto.c: data points into the body */        \
  X(attach, struct dep_attach_args, UNION)       /* proto_rank.c */                              \
  X(attach_ok, struct dep_msg_attach_ok, UNION)  /* proto_rank.c */                              \
  X(slab, struct dep_msg_slab, UNION)            /* proto_rank.c */                              \
  X(kernels, struct dep_msg_kernels, UNION)      /* proto_rank.c */                              \
  X(kernels_ok, struct dep_msg_kernels_ok, UNION) /* proto_rank.c */                             \
  X(tune, struct dep_msg_tune, UNION)            /* proto_rank.c */                              \
  X(tune_ok, struct dep_msg_tune_ok, UNION)      /* proto_rank.c */                              \
  X(status, struct dep_status, UNION)            /* proto_ctl.c: allocates */                    \
  X(text, struct dep_msg_text, UNION)            /* proto_ctl.c */                               \
  X(reload_ok, struct dep_msg_reload_ok, UNION)  /* proto_ctl.c */                               \
  X(drain, struct dep_msg_drain, UNION)          /* proto_ctl.c */                               \
  X(peers, struct dep_msg_peers, OWN)            /* proto_ctl.c: allocates */                    \
  X(job_nodes, struct dep_msg_job_nodes, OWN)    /* proto_ctl.c: large */                        \
  X(job_events, struct dep_msg_job_events, OWN)  /* proto_ctl.c: large */                        \
  X(lend_ok, struct dep_msg_lend_ok, UNION)      /* proto_stats.c */                             \
  X(stats_req, struct dep_msg_stats_req, UNION)  /* proto_stats.c */                             \
  X(stats_rank, struct dep_msg_stats_rank, UNION) /* proto_stats.c: allocates */                 \
  X(stats_ok, struct dep_msg_stats_ok, UNION)    /* proto_stats.c */                             \
  X(clients, struct dep_msg_clients, OWN)        /* proto_stats.c: allocates */

/* Decode a body of the given type into `msg`, the member of union
 * dep_msg_body its body names; an empty body must be empty.  A body
 * DEP_MSG_BODIES marks OWN is refused (DEP_ERR_PROTOCOL): its callers use
 * its own decoder. */
int proto_body_decode(uint16_t type, const uint8_t *body, size_t len, void *msg);

/* Room for any body proto_body_decode decodes: a member per UNION body,
 * named as the body (the fuzz harness decodes every type into one). */
#define DEP_MSG_UNION_MEMBER_UNION(body, type) type body;
#define DEP_MSG_UNION_MEMBER_OWN(body, type)
#define DEP_MSG_UNION_MEMBER_(body, type, decoded) DEP_MSG_UNION_MEMBER_##decoded(body, type)
union dep_msg_body {
  DEP_MSG_BODIES(DEP_MSG_UNION_MEMBER_)
};
#undef DEP_MSG_UNION_MEMBER_

/* The codecs proto_frame_encode and proto_body_decode dispatch to, one pair
 * per body.  Decoders of OWN bodies that allocate: free with proto_peers_free
 * and proto_clients_free (records NULL when none, and after a failure). */
#define DEP_MSG_CODEC_DECL_(body, type, decoded)                                                  \
  int proto_encode_##body(struct proto_buf *b, const type *m);                                    \
  int proto_decode_##body(const uint8_t *p, size_t len, type *m);
DEP_MSG_BODIES(DEP_MSG_CODEC_DECL_)
#undef DEP_MSG_CODEC_DECL_
void proto_peers_free(struct dep_msg_peers *m);
void proto_clients_free(struct dep_msg_clients *m);
/* Free what proto_decode_stats_rank allocated (tokens); NULL and 0 after. */
void proto_stats_rank_free(struct dep_msg_stats_rank *m);

/* Who may send a message type; 0 for a type this build does not know. */
enum dep_msg_from proto_type_from(uint16_t type);
/* Whether a message type's body is empty (false for a type this build does not know). */
bool proto_type_empty(uint16_t type);

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
