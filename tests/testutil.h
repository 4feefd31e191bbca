/*
 * testutil.h — helpers shared by the test suites: where the built binaries
 * are, and a real deepepd on a temporary socket.
 */
#ifndef DEP_TESTUTIL_H
#define DEP_TESTUTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* $DEP_BUILD/<name> (the Makefile sets DEP_BUILD), else build/<name>. */
const char *tu_bin(const char *name);

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
 * limits, allow lists...).  Waits until the socket accepts connections (up
 * to 10 s).  Returns 0, or -1 with the daemon's log copied to stderr.
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

/* Connect a raw Unix socket to path; returns the fd or -1. */
int tu_connect_raw(const char *path);

/* Whether this machine has a usable CUDA GPU (libcuda loads and reports a device). */
bool tu_have_gpu(void);

#endif
