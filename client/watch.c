/*
 * watch.c — the thread that fails a rank's operations at once when its
 * daemon's connection closes, in a job that spans nodes (watch.h).
 */
#include "watch.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "client_internal.h"

/* The connection's end, as poll reports it: a read end shut, a hang-up, an error. */
#define WATCH_HUP (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)

/*
 * Tell every wait of the job: the proxy's ring failed, and the abort words
 * of this rank's slab, where the operations and the kernels look while
 * they wait (host_ops_daemon_gone, cuda_ops_daemon_gone).  The handle's
 * fields read here do not change while the thread runs: client_unmap
 * joins it before it lets go of any of them.
 */
static void watch_tell(dep_client_t *c) {
  atomic_store_explicit(&c->watch.gone, 1, memory_order_release);
  host_ops_daemon_gone(&c->ops, !c->cuda);
  if (c->cuda)
    cuda_ops_daemon_gone(c);
}

static void *watch_main(void *arg) {
  dep_client_t *c = arg;
  struct pollfd p[2] = {{.fd = c->fd, .events = POLLRDHUP},
                        {.fd = c->watch.wake[0], .events = POLLIN}};
  for (;;) {
    p[0].revents = p[1].revents = 0;
    int n = poll(p, 2, -1);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return NULL; /* ENOMEM: the op timeout stays the bound, as without the thread */
    if (p[1].revents != 0)
      return NULL; /* watch_stop */
    if (p[0].revents & WATCH_HUP) {
      watch_tell(c);
      return NULL;
    }
  }
}

int watch_start(dep_client_t *c) {
  struct watch *w = &c->watch;
  atomic_store(&w->gone, 0);
  if (pipe2(w->wake, O_CLOEXEC) != 0)
    return client_seterr(c, DEP_ERR_LIMIT, "dep_attach: cannot make the pipe of the thread that "
                         "watches deepepd's connection (a job across nodes has one): %s",
                         strerror(errno));
  /* The thread takes no signal of the caller's: they go to the caller's threads. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int err = pthread_create(&w->thread, NULL, watch_main, c);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (err != 0) {
    close(w->wake[0]);
    close(w->wake[1]);
    return client_seterr(c, DEP_ERR_LIMIT, "dep_attach: cannot start the thread that watches "
                         "deepepd's connection (a job across nodes has one): %s", strerror(err));
  }
  w->running = true;
  w->pid = getpid();
  return 0;
}

void watch_stop(dep_client_t *c) {
  struct watch *w = &c->watch;
  if (!w->running)
    return;
  close(w->wake[1]); /* the thread's poll sees the pipe hang up */
  if (w->pid == getpid())
    pthread_join(w->thread, NULL);
  close(w->wake[0]);
  w->running = false;
  atomic_store(&w->gone, 0);
}

bool watch_gone(const dep_client_t *c) {
  return atomic_load_explicit(&c->watch.gone, memory_order_acquire) != 0;
}

bool watch_hung_up(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLRDHUP};
  return fd >= 0 && poll(&p, 1, 0) > 0 && (p.revents & WATCH_HUP) != 0;
}
