/*
 * notify.c — sd_notify without libsystemd.  systemd (Type=notify) passes a
 * Unix datagram socket in $NOTIFY_SOCKET: a path, or an abstract name
 * written with a leading '@'.  Failures are logged and otherwise ignored:
 * the daemon works the same when nobody listens.
 */
#include "notify.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static int notify_fd = -1;
static struct sockaddr_un notify_addr;
static socklen_t notify_addrlen;
static unsigned notify_readies;  /* READY=1 sent, counted */
static bool notify_is_ready;     /* ... and no RELOADING=1 or STOPPING=1 since */

unsigned notify_ready_count(void) { return notify_is_ready ? notify_readies : 0; }

void notify_init(void) {
  const char *path = getenv("NOTIFY_SOCKET");
  if (path == NULL || path[0] == '\0')
    return;
  size_t len = strlen(path);
  if ((path[0] != '/' && path[0] != '@') || len >= sizeof notify_addr.sun_path) {
    log_warnx("NOTIFY_SOCKET=%s is not a socket path or abstract name; not notifying systemd",
              path);
    return;
  }
  memset(&notify_addr, 0, sizeof notify_addr);
  notify_addr.sun_family = AF_UNIX;
  memcpy(notify_addr.sun_path, path, len);
  if (path[0] == '@')
    notify_addr.sun_path[0] = '\0'; /* abstract namespace: the name is not NUL-terminated */
  notify_addrlen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + (path[0] == '/'));
  notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (notify_fd < 0)
    log_warn("notify: socket");
}

void notify_fini(void) {
  if (notify_fd >= 0)
    close(notify_fd);
  notify_fd = -1;
}

void notify_send(const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (n < 0)
    return;
  if ((size_t)n >= sizeof msg)
    n = (int)sizeof msg - 1;
  log_debug("notify: %s", msg);
  if (strncmp(msg, "READY=1", 7) == 0) {
    notify_is_ready = true;
    notify_readies++;
  } else if (strncmp(msg, "RELOADING=1", 11) == 0 || strncmp(msg, "STOPPING=1", 10) == 0) {
    notify_is_ready = false;
  }
  if (notify_fd < 0)
    return;
  ssize_t w;
  do {
    w = sendto(notify_fd, msg, (size_t)n, MSG_NOSIGNAL, (struct sockaddr *)&notify_addr,
               notify_addrlen);
  } while (w < 0 && errno == EINTR);
  if (w < 0)
    log_warn("notify: sending \"%s\" to NOTIFY_SOCKET", msg);
}
