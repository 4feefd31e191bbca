/*
 * warm.h — the host backend's warm-up (kernel_warmup): the pages of the
 * slabs that this rank's calls touch, mapped into the process so that its
 * first call takes no page fault per 4 KiB it touches.
 *
 * It runs on a thread of the library's, started at the end of dep_attach,
 * so that the attach returns in milliseconds: a trainer builds its model
 * between the attach and its first call, and the pages are mapped
 * meanwhile.  The thread runs at the lowest priority (WARM_NICE), so that
 * on a busy node it delays no rank's attach nor the daemon's answers.  The
 * rank's first call (any operation, client/ops.c's ops_ready) and
 * dep_attach_times stop it and map what it had not yet mapped themselves,
 * at their own priority, so a first call still runs at steady speed; a
 * caller that calls at once waits what the attach used to.  The thread
 * only maps pages in (pages.h: no byte changes) from a list of regions it
 * is handed at its start; it runs with every signal blocked.  The attachment's end (client_unmap: dep_detach,
 * dep_connect again, dep_client_free, a failed request) stops and joins it
 * first thing, before any mapping goes; it stops between pieces of
 * WARM_PIECE_BYTES.  A child forked while it runs has no such thread: its
 * handle forgets it (and maps its pages as its calls touch them: a fork
 * does not copy a shared mapping's page tables).  Where no thread can be
 * had the warm-up runs in dep_attach, as it did before.
 */
#ifndef DEP_CLIENT_WARM_H
#define DEP_CLIENT_WARM_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "deepep.h"

struct dep_client;

/* The regions a rank's calls touch where `local` slabs are mapped (its own
 * among them), as warm_regions lists them before any two that follow on
 * are joined: its own slab's control area and the block of each local
 * source in each of two parities, each peer's control area and this rank's
 * block of each parity there, and its exchange region. */
#define WARM_REGIONS(local) (1u + 2u * (local) + 3u * ((local) - 1u) + 1u)
/* The most a rank can list: a job has at most DEP_MAX_LOCAL_RANKS ranks on a node. */
#define WARM_MAX_REGIONS WARM_REGIONS(DEP_MAX_LOCAL_RANKS)
/* The warm-up maps each region in pieces of this size, checking between
 * them whether the attachment is ending. */
#define WARM_PIECE_BYTES (1ull << 20)
/* The thread's nice value: the lowest priority there is.  An unprivileged
 * thread cannot raise it again, which is why a caller that waits maps the
 * rest itself instead of waiting on the thread. */
#define WARM_NICE 19

/* The thread's name (top -H, /proc/PID/task/TID/comm): under 16 bytes. */
#define WARM_THREAD_NAME "deepep-warmup"

/* A test's hold on the warm-up: the thread waits, before it maps anything,
 * until this descriptor (inherited by the rank) is readable or closed, or the
 * attachment ends.  The project's tests use it to act while the warm-up has
 * not run, with no timing; unset, the warm-up starts at once. */
#define WARM_TEST_HOLD_ENV "DEEPEP_TEST_WARMUP_HOLD_FD"

struct warm_region {
  uint8_t *p;
  uint64_t len;
};

struct warm {
  bool running;        /* a thread was started for this attachment */
  pid_t pid;           /* ... by this process (a forked child has none to join) */
  pthread_t thread;
  int hold;            /* $DEEPEP_TEST_WARMUP_HOLD_FD, or -1 */
  int wake[2];         /* with a hold: closing wake[1] ends the thread's wait */
  _Atomic int stop;    /* the attachment is ending: map no more */
  _Atomic uint32_t finished; /* the thread touches *this no more (it is detached) */
  bool done;           /* every region is mapped (read once `finished`) */
  double ms;           /* ... which took this long, thread and caller together */
  uint32_t at;         /* the cursor: the region being mapped ... */
  uint64_t off;        /* ... and the offset in it */
  uint32_t n;
  struct warm_region r[WARM_MAX_REGIONS];
};

/* The regions c's calls touch (above), from its operations' context, into
 * c->warm: 0, or DEP_ERR_INTERNAL with c's message set where they overrun
 * WARM_MAX_REGIONS (more slabs mapped than a node has ranks: a bug). */
int warm_regions(struct dep_client *c);

/* Read $DEEPEP_TEST_WARMUP_HOLD_FD for the next attach: 0, or DEP_ERR_INVALID
 * (not an open descriptor) with the handle's message set. */
int warm_hold(struct dep_client *c);
/* Start the warm-up of c's current attachment, on its thread; where no thread
 * can be had it runs here.  0, or warm_regions's failure (nothing started). */
int warm_start(struct dep_client *c);
/* Finish the warm-up (if any): stop the thread and map the rest here; forget
 * it.  Its time goes to c->times.warmup_ms and the stats page.  Safe to call
 * again. */
void warm_wait(struct dep_client *c);
/* Stop the warm-up (if any) where it is, join it and forget it. */
void warm_stop(struct dep_client *c);

#endif /* DEP_CLIENT_WARM_H */
