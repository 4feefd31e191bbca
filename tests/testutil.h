/*
 * testutil.h — helpers shared by the test suites: where the built binaries
 * are, a real deepepd on a temporary socket, and which GPU each rank of a
 * GPU test uses.
 */
#ifndef DEP_TESTUTIL_H
#define DEP_TESTUTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* $DEP_BUILD/<name> (the Makefile sets DEP_BUILD), else build/<name>. */
const char *tu_bin(const char *name);

/*
 * A program of the build for a child that drops to another uid before it
 * execs it.  The build may sit inside a directory only its owner can enter
 * (a clone in root's 0700 home, or in a mktemp -d), where that uid's exec
 * fails with EACCES and the child exits 127; so the program is copied into
 * a new directory under /tmp (not $TMPDIR, which may be such a directory
 * too), mode 0755, and the copy is removed once the child has exec'd it.
 *
 * Before fork: tu_otheruid_prepare(&u, "deepepctl") (0, or -1 with errno).
 * In the child: tu_otheruid_child(&u), then exec u.path; the pipe's write
 * end u.fd[1] is close-on-exec and must stay open until the exec.
 * In the parent: tu_otheruid_done(&u), which waits until the child has
 * exec'd (or exited) and removes the copy.
 */
struct tu_otheruid {
  char dir[64];
  char path[128];
  int fd[2];
};
int tu_otheruid_prepare(struct tu_otheruid *u, const char *name);
void tu_otheruid_child(struct tu_otheruid *u);
void tu_otheruid_done(struct tu_otheruid *u);

/* A fresh temporary directory under $TMPDIR (0755 so other uids can reach a socket in it). */
void tu_tmpdir(char *out, size_t len);

/* Recursively remove a directory made by tu_tmpdir. */
void tu_rmtree(const char *dir);

/* Write a file; returns 0 or -1. */
int tu_write_file(const char *path, const char *text);

struct tu_daemon {
  pid_t pid;
  char dir[200];   /* temporary directory holding everything below */
  char sock[256];  /* dir/d.sock */
  char conf[256];  /* dir/deepepd.yaml */
  char log[256];   /* dir/deepepd.log: the daemon's stderr */
};

/*
 * Start build/deepepd on a temporary socket with the host backend (or
 * $DEP_TEST_BACKEND).
 * `extra_yaml` (may be NULL) is appended to the generated config (for
 * limits, allow lists...).  Waits until the daemon has started: its STATUS
 * no longer says "starting" (its pools are made), up to 30 s.  Returns 0,
 * or -1 with the daemon's log copied to stderr.
 */
int tu_daemon_start(struct tu_daemon *d, const char *extra_yaml);

/* As tu_daemon_start, but in an existing directory/socket (for restarts). */
int tu_daemon_start_in(struct tu_daemon *d, const char *dir, const char *extra_yaml);

/* SIGTERM, wait (up to 10 s, then SIGKILL); returns the exit status or -1. */
int tu_daemon_stop(struct tu_daemon *d);

/* Remove the temporary directory (after stop). */
void tu_daemon_cleanup(struct tu_daemon *d);

/* Read the daemon's log so far into a malloc'd string (caller frees). */
char *tu_daemon_log(const struct tu_daemon *d);

/* Threads of process pid now (/proc/pid/task), only those named name (their comm) unless it is
 * NULL; -1 when the list cannot be read. */
int tu_threads(pid_t pid, const char *name);
/* A shell command's output (what the command sends to stdout; malloc'd, fails the test on no
 * memory) and, where status is not NULL, its wait status. */
char *tu_sh_out(const char *cmd, int *status);

/* Connect a raw Unix socket to path; returns the fd or -1. */
int tu_connect_raw(const char *path);

/* Whether this machine has a usable CUDA GPU (libcuda loads and reports a device). */
bool tu_have_gpu(void);

/* ---- skips ---------------------------------------------------------------
 *
 * A test that cannot run here (no GPU, not root) says so through these,
 * never with a bare printf: each prints "<test>: skipped: <why>" on stdout
 * and appends "<test>\t<skip|part>\t<why>" to the file named by
 * $DEP_SKIP_RECORD (set by the runner; the tests run in forked children), so
 * the summary counts the test as skipped rather than passed and lists why.
 * `test` is the test's __func__ (its trailing "_fn" is dropped) or name.
 */
#define TU_SKIPS_ENV "DEP_SKIP_RECORD"

/* Skip the whole test: the caller returns right after. */
void tu_skip(const char *test, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Skip one part of a test that goes on and passes or fails on the rest. */
void tu_skip_part(const char *test, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- rank placement on GPUs ($DEP_TEST_GPUS) ---------------------------------
 *
 * DEP_TEST_GPUS says how many GPUs the GPU tests spread their ranks over:
 * unset or 1, every rank on GPU 0; N, rank r on GPU r % N; "all", over every
 * visible GPU.  Asking for more GPUs than are visible is an error, never a
 * quiet fallback.
 */
#define TU_GPUS_MAX 64

/* The placement, resolved against the visible GPUs by tu_gpus_probe. */
struct tu_gpus {
  int n;                            /* GPUs the ranks spread over (>= 1) */
  int visible;                      /* GPUs the driver shows this process */
  bool mps;                         /* contexts on GPU 0 are shared through MPS */
  uint8_t uuid[TU_GPUS_MAX][16];    /* of GPUs 0 .. n-1 */
};

/*
 * Resolve $DEP_TEST_GPUS in a forked child (the test process itself never
 * initialises CUDA: its rank processes could not use it after fork).
 * Returns 1 with *g filled; 0 when there is no usable GPU (libcuda.so.1 or
 * a device missing); -1 when $DEP_TEST_GPUS is malformed or asks for more
 * GPUs than are visible.  `why` says which, in words for a skip or failure.
 */
int tu_gpus_probe(struct tu_gpus *g, char *why, size_t len);

/*
 * The device ordinal of rank `rank` under $DEP_TEST_GPUS: rank % N.  Loads
 * the driver, so call it only in a rank (process or thread).  Returns 0, or
 * -1 with why (no driver, a bad $DEP_TEST_GPUS, too few GPUs visible).
 */
int tu_gpu_for_rank(uint32_t rank, int *ordinal, char *why, size_t len);

/* ---- daemons started a particular way (check_server.c) ------------------ */

enum tu_wait {
  TU_WAIT_READY = 0, /* until STATUS no longer says "starting" (as tu_daemon_start) */
  TU_WAIT_SOCKET,    /* until the socket accepts a connection */
  TU_WAIT_NONE,      /* return once it is forked */
};

struct tu_daemon_opts {
  long nofile;        /* > 0: the daemon's RLIMIT_NOFILE, soft and hard (and it inherits no fd
                         but stdio, so that the fds it holds are its own) */
  long uid;           /* > 0: it runs as this uid and gid (the test must be root) */
  const char *socket; /* its socket path instead of dir/d.sock */
  const char *netns;  /* it runs in this network namespace (ip netns's name; the test is root) */
  bool whole_config;  /* extra_yaml is the whole file: no socket:, backend: or pool: added */
  enum tu_wait wait;
};

/* tu_daemon_start_in with these options (NULL: the defaults). */
int tu_daemon_start_opts(struct tu_daemon *d, const char *dir, const char *extra_yaml,
                         const struct tu_daemon_opts *o);

/* A fresh connection's HELLO and STATUS: the daemon's state into state, or NULL. */
char *tu_daemon_state(const char *sock, char *state, size_t len);

/* Wait up to timeout_ms for the daemon to exit: its wait status, or -1. */
int tu_daemon_wait_exit(struct tu_daemon *d, int timeout_ms);

/*
 * The lowest fd number process pid has free (below 4096), or -1: with
 * RLIMIT_NOFILE at that, it has none left (fds are handed out lowest first).
 */
int tu_lowest_free_fd(pid_t pid);

#endif
