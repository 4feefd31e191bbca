/*
 * warm.c — the host backend's warm-up on a thread of the library's
 * (warm.h).
 */
#include "warm.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "pages.h"

/* Add [p, p + len) to the list, joined to the last region where it follows on;
 * false where the list is full (the region is not listed). */
static bool warm_add(struct warm *w, uint8_t *p, uint64_t len) {
  struct warm_region *last = w->n > 0 ? &w->r[w->n - 1] : NULL;
  if (last != NULL && last->p + last->len == p) {
    last->len += len;
    return true;
  }
  if (w->n == WARM_MAX_REGIONS)
    return false;
  w->r[w->n++] = (struct warm_region){p, len};
  return true;
}

/*
 * What the host operations touch (kernels/host_ops_internal.h): in this
 * rank's slab the control area (error words, slots, the live mask) and
 * the block of each source on this node; a source on another node posts
 * to the exchange region instead, and the private area after the data is
 * the cuda library's alone.  In a local peer's slab, its control area
 * (its error words, this rank's slots) and this rank's block of each
 * parity.
 */
int warm_regions(struct dep_client *c) {
  const struct ops_ctx *o = &c->ops;
  const struct dep_slab_layout *l = &o->lay;
  struct warm *w = &c->warm;
  uint8_t *own = o->slabs[o->rank];
  bool ok = true;
  uint32_t local = 0;
  w->n = 0;
  ok &= warm_add(w, own, l->data_off);
  for (unsigned parity = 0; parity < 2; parity++)
    for (uint32_t src = 0; src < o->world; src++)
      if (o->slabs[src] != NULL)
        ok &= warm_add(w, own + dep_slab_block(l, parity, src), l->block_bytes);
  for (uint32_t r = 0; r < o->world; r++) {
    uint8_t *s = o->slabs[r];
    local += s != NULL;
    if (s == NULL || r == o->rank)
      continue;
    ok &= warm_add(w, s, l->data_off);
    for (unsigned parity = 0; parity < 2; parity++)
      ok &= warm_add(w, s + dep_slab_block(l, parity, o->rank), l->block_bytes);
  }
  if (o->xchg != NULL)
    ok &= warm_add(w, o->xchg, l->xchg_bytes);
  if (ok)
    return 0;
  w->n = 0;
  return client_seterr(c, DEP_ERR_INTERNAL, "dep_attach: the warm-up's %u local slabs overrun "
                       "its list of %u regions (a node has at most %u ranks); this is a bug, "
                       "please report it", local, WARM_MAX_REGIONS, DEP_MAX_LOCAL_RANKS);
}

/* A test's hold (WARM_TEST_HOLD_ENV): true once released, false if the attachment ends first. */
static bool warm_held(struct warm *w) {
  struct pollfd p[2] = {{.fd = w->hold, .events = POLLIN}, {.fd = w->wake[0], .events = POLLIN}};
  for (;;) {
    p[0].revents = p[1].revents = 0;
    int n = poll(p, 2, -1);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 || p[1].revents != 0)
      return false;
    if (p[0].revents != 0)
      return true;
  }
}

/* Map the regions in from the cursor on, a piece at a time, until done or stopped. */
static void warm_run(struct warm *w) {
  const double t0 = client_clock_ms();
  for (; w->at < w->n; w->at++, w->off = 0)
    for (; w->off < w->r[w->at].len; w->off += WARM_PIECE_BYTES) {
      if (atomic_load_explicit(&w->stop, memory_order_relaxed)) {
        w->ms += client_clock_ms() - t0;
        return;
      }
      const uint64_t left = w->r[w->at].len - w->off;
      dep__pages_populate(w->r[w->at].p + w->off, left < WARM_PIECE_BYTES ? left : WARM_PIECE_BYTES);
    }
  w->ms += client_clock_ms() - t0;
  w->done = true;
}

/*
 * The thread is detached, so a process that exits attached (without
 * dep_detach or a call) leaves no finished thread unjoined; warm_end waits
 * for `finished` instead of a join.  Its last touch of *w is that store: the
 * wake after it names the word's address only (a private futex's key is
 * the address, whatever became of the memory).
 */
static void *warm_main(void *arg) {
  struct warm *w = arg;
  /* Below every other thread of the node: the rank's own attach, its peers' and the
   * daemon's answers go first.  A caller that wants the pages before the thread is
   * done maps the rest itself, at its own priority (warm_end). */
  (void)setpriority(PRIO_PROCESS, (id_t)gettid(), WARM_NICE);
  if (w->hold < 0 || warm_held(w))
    warm_run(w);
  _Atomic uint32_t *finished = &w->finished;
  atomic_store_explicit(finished, 1, memory_order_release);
  (void)syscall(SYS_futex, finished, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
  return NULL;
}

/* Until the thread has stored `finished` (warm_main). */
static void warm_join(struct warm *w) {
  while (atomic_load_explicit(&w->finished, memory_order_acquire) == 0)
    (void)syscall(SYS_futex, &w->finished, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
}

int warm_hold(struct dep_client *c) {
  c->warm.hold = -1;
  const char *e = getenv(WARM_TEST_HOLD_ENV);
  if (e == NULL || e[0] == '\0')
    return 0;
  char *end = NULL;
  errno = 0;
  long v = strtol(e, &end, 10);
  if (e[0] < '0' || e[0] > '9' || errno != 0 || *end != '\0' || v > 65535 ||
      fcntl((int)v, F_GETFD) < 0)
    return client_seterr(c, DEP_ERR_INVALID, "dep_attach: $" WARM_TEST_HOLD_ENV "=\"%s\" is not "
                         "an open file descriptor (a test hook); unset it", e);
  c->warm.hold = (int)v;
  return 0;
}

/* The finished warm-up's time, where dep_attach_times and the daemon's stats read it. */
static void warm_account(struct dep_client *c) {
  const struct warm *w = &c->warm;
  if (!w->done)
    return;
  c->times.warmup_ms = w->ms;
  if (c->stats.page != NULL)
    __atomic_store_n(&c->stats.page->attach_warmup_ns, (uint64_t)(w->ms * 1e6), __ATOMIC_RELAXED);
}

static void warm_close(struct warm *w) {
  for (int i = 0; i < 2; i++) {
    if (w->wake[i] >= 0)
      close(w->wake[i]);
    w->wake[i] = -1;
  }
}

int warm_start(struct dep_client *c) {
  struct warm *w = &c->warm;
  int rc = warm_regions(c);
  if (rc != 0)
    return rc;
  atomic_store(&w->stop, 0);
  atomic_store(&w->finished, 0);
  w->done = false;
  w->ms = 0;
  w->at = 0;
  w->off = 0;
  w->wake[0] = w->wake[1] = -1;
  if (w->hold >= 0 && pipe2(w->wake, O_CLOEXEC) != 0)
    w->hold = -1; /* no pipe to end a test's hold with: the warm-up is not held */
  /* The thread takes no signal of the caller's: they go to the caller's threads. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int err = pthread_create(&w->thread, NULL, warm_main, w);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (err == 0) {
    (void)pthread_setname_np(w->thread, WARM_THREAD_NAME); /* named before dep_attach returns */
    pthread_detach(w->thread); /* after the name: a joinable thread's handle stays valid */
    w->running = true;
    w->pid = getpid();
    return 0;
  }
  /* No thread to be had: the warm-up runs here, as it did before it had one. */
  warm_close(w);
  warm_run(w);
  warm_account(c);
  return 0;
}

/*
 * Stop the thread (a test's hold ends too) and wait for its end; then, unless the
 * attachment is ending, map what it had not yet mapped here, at the
 * caller's priority rather than the thread's.  Forget it.
 */
static void warm_end(struct dep_client *c, bool ending) {
  struct warm *w = &c->warm;
  if (!w->running)
    return;
  atomic_store_explicit(&w->stop, 1, memory_order_relaxed);
  if (w->wake[1] >= 0)
    close(w->wake[1]); /* a held thread's poll sees the pipe hang up */
  w->wake[1] = -1;
  const bool ours = w->pid == getpid();
  if (ours)
    warm_join(w);
  warm_close(w);
  w->running = false;
  if (!ours) {
    w->done = false; /* a forked child: the thread was its parent's */
    return;
  }
  if (!ending && !w->done) {
    atomic_store_explicit(&w->stop, 0, memory_order_relaxed);
    warm_run(w);
  }
  warm_account(c);
}

void warm_wait(struct dep_client *c) { warm_end(c, false); }

void warm_stop(struct dep_client *c) { warm_end(c, true); }
