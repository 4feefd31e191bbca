/*
 * peers.h — what the parts of the peer benchmark share (bench/peers.c: the
 * driver and the report; nodes.c: two network namespaces, their daemons and
 * the PEERS polls; ranks.c: rank processes inside the namespaces;
 * handshake.c: the benchmark as a peer, for the handshake and a message's
 * round trip alone; reg.c: RDMA registration through the daemon's seam).
 * The method is described at the top of bench/peers.c.
 */
#ifndef DEP_BENCH_PEERS_H
#define DEP_BENCH_PEERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "deepep.h"

#define NODES 2
#define PEER_PORT 7470

/* Fail the benchmark: the message, then exit(1) (nodes_cleanup runs at exit). */
void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* ---- nodes.c: namespaces and daemons ---------------------------------------- */

struct nodes {
  char dir[256];             /* scratch: key, configs, sockets, logs */
  char deepepd[512];         /* the daemon binary */
  char ns[NODES][32];        /* network namespace names */
  char addr[NODES][16];      /* each node's address on the veth */
  char key[300];             /* peer_key_file */
  int pool_size;             /* connection_pool_size */
  uint64_t host_pool_bytes;  /* pool.host_size of every daemon */
  char want_transport[8];    /* the config's `transport` ("": the daemon's default) */
  pid_t pid[NODES];          /* running daemons (0: none) */
  char sock[NODES][320];     /* their control sockets */
  char log[NODES][320];      /* their stderr */
  int gen;                   /* daemons started so far (fresh paths for each start) */
  char transport[8];         /* what node 0's PEERS says its link to node 1 runs on */
};

/*
 * Two namespaces joined by a veth pair, a key and a scratch directory.
 * Returns NULL, or why it cannot run here (not root, no ip netns, no veth):
 * the caller skips.  nodes_cleanup (also run at exit and on SIGINT/SIGTERM)
 * stops the daemons and removes the namespaces, and the scratch directory
 * unless `keep` (its daemon logs, for a look afterwards).
 */
const char *nodes_setup(struct nodes *n, const char *deepepd, int pool_size,
                        uint64_t host_pool_bytes, const char *transport, bool keep);
void nodes_cleanup(void);

/* Start both daemons (fresh socket and log paths); returns the clock at the start. */
double nodes_start(struct nodes *n);
/*
 * Poll both daemons' PEERS until each shows its peer up with every one of
 * the pool's connections, outbound and inbound.  sock_ms[i]: when daemon i
 * first answered on its control socket; up_ms[i]: when its connections
 * were all up; both from t0, nodes_start's clock.  Dies after timeout_ms.
 */
void nodes_wait_up(struct nodes *n, double t0, double *sock_ms, double *up_ms, int timeout_ms);
/* One PEERS request to daemon i and back: it has handled everything sent before. */
void nodes_quiesce(struct nodes *n, int i);
/* SIGTERM both daemons and wait for them. */
void nodes_stop(struct nodes *n);

/* ---- ranks.c: rank processes ------------------------------------------------- */

/* What one rank does in a round. */
struct rank_cmd {
  char sock[320];
  char job_id[DEP_JOB_ID_MAX];
  uint32_t rank, world_size, local_rank, local_world_size;
  struct dep_job_shape shape;
};

/* A rank process, forked once into its node's namespace, reused every round. */
struct rank_proc {
  pid_t pid;
  int to, from; /* pipes: parent -> rank, rank -> parent */
};

/* What a rank reports of one attach: its time from the release, and dep_attach_times'. */
struct rank_time {
  double ready_ms;    /* from the release to dep_attach returned, slabs mapped */
  double attach_ms;   /* the whole dep_attach, as the library counts it */
  double wait_ms;     /* ATTACH sent until the reply was in: the rendezvous */
  double map_ms;      /* mapping every local slab */
};

/* Fork a rank process into network namespace `ns` (its node's). */
void rank_spawn(struct rank_proc *rp, const char *ns);
/*
 * One job: release the n ranks at once with their commands (the clock
 * starts just before the first is released), wait until each reports
 * ready (dep_attach returned, slabs mapped), then let them detach and wait
 * until each has.  t[i]: rank i's times; *detach_ms: from telling them to
 * detach to the last one done.  Returns the job's time: release to the
 * last rank ready.
 */
double ranks_round(struct rank_proc *const *rp, const struct rank_cmd *cmd, int n,
                   struct rank_time *t, double *detach_ms);
void rank_stop(struct rank_proc *rp);

/* ---- handshake.c: the benchmark as a peer --------------------------------------- */

/*
 * In namespace `ns` (a child process), as the configured peer at
 * self_addr:PEER_PORT, open `conns` connections to target:PEER_PORT at
 * once and run the authenticated handshake on each (peerauth.c, the
 * daemon's own code) against the daemon there; then time `pings`
 * KEEPALIVE round trips through that daemon's loop on the first
 * connection.  Fills up_ms (the first connect to the last link up) and
 * rtt_ms[pings]; 0, or -1 with why.
 */
int handshake_measure(const char *ns, const char *key_path, const char *self_addr,
                      const char *target, int conns, int pings, double *up_ms, double *rtt_ms,
                      char *why, size_t whylen);

/* ---- reg.c: RDMA registration --------------------------------------------------- */

/*
 * ibv_reg_mr / ibv_dereg_mr of `bytes` of host memory (mmap, every page
 * touched) on the first RDMA device, through the daemon's seam
 * (daemon/rdmadrv.h), reps times.  Returns 0 with reg_ms[reps] and
 * dereg_ms[reps] and the device's name, or -1 with why (no libibverbs, no
 * device, a verb that failed, naming it and errno).
 */
int reg_measure(uint64_t bytes, int reps, double *reg_ms, double *dereg_ms, char *dev,
                size_t devlen, char *why, size_t whylen);

#endif
