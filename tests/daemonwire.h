/*
 * daemonwire.h — helpers shared by the suites that talk to a real deepepd
 * (check_daemon.c and check_job.c first): speaking the control protocol by
 * hand on a raw socket (frames, deadlines, the replies a test expects),
 * running the real deepepd and deepepctl, child processes with a pipe each
 * way, and this process's open fds.  Prefix dw_ (as testutil's tu_).
 * Every helper fails the calling test on what it cannot handle, so a test
 * reads as the conversation it checks.
 */
#ifndef DEP_DAEMONWIRE_H
#define DEP_DAEMONWIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepep.h"
#include "proto.h"
#include "testutil.h"

/* One frame as read off the socket: its header and its body. */
struct dw_frame {
  struct dep_frame_hdr h;
  uint8_t body[DEP_PROTO_MAX_BODY];
};

/* snprintf that fails the test rather than truncate a path or a message. */
void dw_sfmt(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* CLOCK_MONOTONIC in milliseconds, and a sleep of ms milliseconds. */
int64_t dw_now_ms(void);
void dw_sleep_ms(int ms);

/* Send all len bytes (no SIGPIPE); 0 or -1. */
int dw_send_all(int fd, const void *buf, size_t len);

/* Encode and send one frame (msg NULL for a bodiless type); 0 or -1. */
int dw_send_frame(int fd, uint16_t type, uint32_t req, const void *msg);

/* One frame within timeout_ms: 0, -1 EOF, -2 timeout, -3 bad header. */
int dw_recv_frame(int fd, struct dw_frame *f, int timeout_ms);

/* As dw_recv_frame, collecting the fds that ride on the frame in fds[*nfds]. */
int dw_recv_frame_fds(int fd, struct dw_frame *f, int timeout_ms, int *fds, int *nfds);

/* A frame buffer on the heap (frames are too big for a test's stack); free() it. */
struct dw_frame *dw_frame_new(void);

/* Expect an ERROR frame with this code; its message goes to msg (may be NULL). */
void dw_expect_error(int fd, int code, char *msg, size_t len);
/* Expect the reply to ATTACH request req within 5 s: SLAB frames (their fds
 * closed here), then ATTACH_OK, decoded into ok when it is not NULL; an
 * ERROR instead fails the test with its code and message. */
void dw_expect_attach_ok(int fd, uint32_t req, struct dep_msg_attach_ok *ok);

/* The peer sends nothing more and closes (a pending reply would be a failure). */
void dw_expect_eof(int fd);

/* Nothing arrives within ms (the connection stays open). */
void dw_expect_silence(int fd, int ms);

/* Send HELLO speaking this protocol version; expect its HELLO_OK. */
void dw_hello_as(int fd, uint32_t version);
void dw_expect_hello_ok(int fd);

/* A connected, greeted client of d. */
int dw_client(const struct tu_daemon *d);

/* STATUS_OK for request req, decoded (dep_status_free it); dw_status asks first. */
struct dep_status *dw_recv_status(int fd, uint32_t req);
struct dep_status *dw_status(int fd);
/* Send RELOAD on fd (request req), expect RELOAD_OK, and return it in *out. */
void dw_reload(int fd, uint32_t req, struct dep_msg_reload_ok *out);

/* Whether a fresh STATUS lists the job; *attached / *expected filled when non-NULL. */
bool dw_job_listed(int fd, const char *id, uint32_t *attached, uint32_t *expected);

/* Wait (up to timeout_ms) for the daemon's log to contain needle. */
bool dw_log_has(const struct tu_daemon *d, const char *needle, int timeout_ms);

/* tu_daemon_start that fails the test; SIGTERM that must give exit 0, then cleanup. */
void dw_start(struct tu_daemon *d, const char *extra_yaml);
void dw_stop_ok(struct tu_daemon *d);

/* A daemon started by hand (tu_daemon_start keeps NOTIFY_SOCKET from it) in
 * a fresh directory, on a 64 MiB host pool, sending its sd_notify datagrams
 * to a socket of ours: d->dir/notify, or an abstract one when abstract.
 * Returns that socket; d->pid is the daemon's. */
int dw_start_notifying(struct tu_daemon *d, bool abstract);
/* Wait up to 5 s for a datagram on ns whose first line is want (the whole
 * datagram, or the part before its first newline); the test fails, naming
 * the last one seen, if none comes. */
void dw_expect_notify(int ns, const char *want);

/* Run deepepd with args (NULL-terminated), output to out_path; its wait status. */
int dw_run_deepepd(const char *const args[], const char *out_path);
/* dw_run_deepepd; the test fails unless deepepd exits with status `code`
 * and its output contains `want` (not checked when NULL). */
void dw_deepepd_exits(const char *const args[], const char *out_path, int code, const char *want);

/* A whole (small) file as a string, empty when missing; the caller frees it. */
char *dw_slurp(const char *path);
/* How many fds this process has open now (a count to compare before and after). */
int dw_open_fds(void);

/* Fork a child whose stdout is the file path (made or emptied): 0 in the child (which exits 126
 * when it cannot open it), its pid in the parent. */
pid_t dw_fork_stdout_to(const char *path);
/*
 * Run the deepepctl binary bin (NULL: this build's) with args (at most 10,
 * NULL-terminated) to its end, without $DEEPEPD_SOCKET, its stdout caught
 * in dir/ctl.out and returned in *out (dw_slurp's); its exit code.
 */
int dw_run_ctl(const char *bin, const char *dir, char **out, const char *const *args);
/* dw_run_ctl's args as a literal: DW_ARGS("-s", sock, "status"). */
#define DW_ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

/*
 * A child process and two pipes to it: rep, on which it reports, and go, on
 * which the parent gives its word (or closes it).  dw_child_fork forks: in
 * the child (pid 0) rep is its writing end and go its reading end, in the
 * parent rep the reading end and go the writing end; each side's other ends
 * are closed.
 */
struct dw_child {
  pid_t pid;
  int rep, go;
};
void dw_child_fork(struct dw_child *c);

/* ATTACH arguments for local rank local_rank of a one-node job of lws ranks (a fixed shape). */
struct dep_attach_args dw_job_args(const char *id, uint32_t local_rank, uint32_t lws);

/* Send ATTACH (the reply is the test's to read). */
void dw_attach(int fd, const struct dep_attach_args *a, uint32_t req);

#endif
