/*
 * testhooks.h — the faults the project's tests ask a daemon for through
 * $DEEPEPD_TEST_* (a connection closed on purpose, a handshake sent wrong),
 * read and checked in one place when the daemon starts, and handed to the
 * modules that act on them.  A daemon started with any logs it at warning
 * level, so that none runs in production unnoticed.
 */
#ifndef DEP_DAEMON_TESTHOOKS_H
#define DEP_DAEMON_TESTHOOKS_H

/* The variables' names, for the modules' log lines; what each does is
 * testhooks.c's table. */
#define TESTHOOKS_PREFIX "DEEPEPD_TEST_"
#define TESTHOOK_DATA_DROPS_ENV TESTHOOKS_PREFIX "DATA_DROPS"
#define TESTHOOK_RDMA_BAD_PROOFS_ENV TESTHOOKS_PREFIX "RDMA_BAD_PROOFS"
#define TESTHOOK_JOIN_OVERTAKEN_ENV TESTHOOKS_PREFIX "JOIN_OVERTAKEN"
#define TESTHOOK_XCHG_FILL_HOLD_FD_ENV TESTHOOKS_PREFIX "XCHG_FILL_HOLD_FD"
#define TESTHOOK_CPUS_ENV TESTHOOKS_PREFIX "CPUS"
#define TESTHOOK_AWAKE_US_ENV TESTHOOKS_PREFIX "AWAKE_US"

enum testhook {
  TESTHOOK_DATA_DROPS,      /* inbound data connections closed once acknowledged (xfer_conn.c) */
  TESTHOOK_RDMA_BAD_PROOFS, /* RDMA queue pairs first dialled with a wrong proof (rdmaxp_cm.c,
                               xfer_rdma.c) */
  TESTHOOK_JOIN_OVERTAKEN,  /* rejoins whose survivors ran past the join call (job_elastic.c) */
  TESTHOOK_XCHG_FILL_HOLD_FD, /* a descriptor the exchange regions' populate waits on (xfer.c) */
  TESTHOOK_CPUS,             /* the CPUs the daemon counts as its own (xfer_proxy.c) */
  TESTHOOK_AWAKE_US,         /* the data path's awake windows on any backend (xfer_proxy.c) */
  TESTHOOK_N_
};

/*
 * Read every $DEEPEPD_TEST_* once: a value that is not a whole number from
 * 0 to INT_MAX is ignored (the hook stays off) with a warning naming it, as
 * is a variable of that prefix that names no hook; one warning lists the
 * hooks that are on.  Call it before the modules that read the hooks start.
 */
int testhooks_init(void);

/* The hooks off again (after testhooks_init, for a module table's stop). */
void testhooks_fini(void);

/* Hook h's count: 0 when it is off. */
int testhook_value(enum testhook h);

#endif
