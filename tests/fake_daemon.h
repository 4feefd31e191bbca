/*
 * fake_daemon.h — a scripted stand-in for deepepd (fake_daemon.c) and a
 * bound-but-silent socket, for tests of what a real daemon never does.
 */
#ifndef DEP_FAKE_DAEMON_H
#define DEP_FAKE_DAEMON_H

#include <stddef.h>
#include <sys/types.h>

enum fake_script {
  FAKE_BAD_REQUEST_ID,  /* HELLO answered with another request id */
  FAKE_VERSION_ERROR,   /* HELLO answered with ERROR{VERSION} */
  FAKE_SHUTDOWN,        /* STATUS answered with a SHUTDOWN notice, then EOF */
  FAKE_WRONG_TYPE,      /* STATUS answered with DETACH_OK */
  FAKE_SILENT_ATTACH,   /* ATTACH never answered */
  FAKE_ATTACH_FDS,      /* ATTACH_OK with two fds, then DETACH_OK */
  FAKE_ATTACH_FDS_LIE,  /* ATTACH_OK announcing one fd, carrying two */
  FAKE_ATTACH_UNMAP,    /* as FAKE_ATTACH_FDS; exits 6 if DETACH comes while the client
                           still maps the slabs (fake_daemon_wait) */
  FAKE_REFUSE,          /* ERROR with request id 0 on accept, then close: "not allowed" */
  FAKE_OTHER_VERSION,   /* HELLO answered with ERROR{VERSION} under a header of another version */
  FAKE_UNKNOWN_REPLY,   /* STATUS answered with a frame of a type no build knows */
  FAKE_CUDA_SILENT,     /* HELLO_OK saying backend "cuda"; exits 7 if any request follows */
};

/* How many connections FAKE_REFUSE refuses before it exits. */
#define FAKE_REFUSALS 20

/* A Unix stream socket bound to path, not listening (asserts on failure). */
int fake_daemon_bind(const char *path);

/* A fake daemon serving one script in a child, in a temporary directory of its own. */
struct fake_daemon {
  char dir[200];  /* made by fake_daemon_start, removed by fake_daemon_stop or _wait */
  char sock[256]; /* dir/fake.sock */
  pid_t pid;
};

/* Serve `script` on f->sock, in a fresh directory, in a child. */
void fake_daemon_start(struct fake_daemon *f, enum fake_script script);

/* Kill and reap the fake daemon, and remove its directory. */
void fake_daemon_stop(struct fake_daemon *f);
/* Wait for it to end by itself (after the client closed) and remove its
 * directory; its exit status. */
int fake_daemon_wait(struct fake_daemon *f);

#endif
