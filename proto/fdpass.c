/*
 * fdpass.c — bytes and file descriptors over a Unix stream socket with
 * sendmsg/recvmsg and SCM_RIGHTS (fdpass.h states who closes what).  The
 * receiver never lets an fd escape on an error path: whatever the kernel
 * installed is closed before a malformed message is reported.
 */
#include "fdpass.h"

#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "deepep.h"
#include "proto.h"

static ssize_t map_errno(int e) {
  if (e == EPIPE || e == ECONNRESET)
    return DEP_ERR_DAEMON_GONE;
  return DEP_ERR_IO;
}

ssize_t fdpass_send(int sock, const void *buf, size_t len, const int *fds, int nfds) {
  if (nfds < 0 || nfds > DEP_PROTO_MAX_FDS || (nfds > 0 && fds == NULL) ||
      (len > 0 && buf == NULL)) {
    errno = EINVAL;
    return DEP_ERR_INVALID;
  }
  /* fds need at least one byte to ride on: a stream socket drops ancillary
   * data sent with an empty payload. */
  if (nfds > 0 && len == 0) {
    errno = EINVAL;
    return DEP_ERR_INVALID;
  }
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * DEP_PROTO_MAX_FDS)];
  } ctl;
  const char *p = buf;
  size_t done = 0;
  bool fds_sent = nfds == 0;
  while (done < len) {
    struct iovec iov = {.iov_base = (void *)(p + done), .iov_len = len - done};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (!fds_sent) {
      memset(&ctl, 0, sizeof ctl);
      msg.msg_control = ctl.buf;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
      struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
      memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return (ssize_t)done; /* the caller waits for POLLOUT and sends the rest */
      return map_errno(errno);
    }
    fds_sent = true; /* the kernel attaches them to the first byte written */
    done += (size_t)n;
  }
  return (ssize_t)done;
}

ssize_t fdpass_recv(int sock, void *buf, size_t len, int *fds, int maxfds, int *nfds) {
  if (nfds == NULL || *nfds < 0 || maxfds < *nfds || (maxfds > 0 && fds == NULL) ||
      (len > 0 && buf == NULL)) {
    errno = EINVAL;
    return DEP_ERR_INVALID;
  }
  int room = maxfds - *nfds;
  if (room > DEP_PROTO_MAX_FDS)
    room = DEP_PROTO_MAX_FDS;
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * DEP_PROTO_MAX_FDS)];
  } ctl;
  struct iovec iov = {.iov_base = buf, .iov_len = len};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  /* The control buffer is sized by the caller's room, so a peer sending
   * more fds than we accept trips MSG_CTRUNC instead of filling our table. */
  if (room > 0) {
    msg.msg_control = ctl.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)room);
  }
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0)
    return map_errno(errno);

  /* Collect every fd that arrived, whatever else is wrong, so that an error
   * path can close them all. */
  int got[DEP_PROTO_MAX_FDS + 8];
  int ngot = 0;
  bool bad = (msg.msg_flags & MSG_CTRUNC) != 0;
  for (struct cmsghdr *c = msg.msg_controllen ? CMSG_FIRSTHDR(&msg) : NULL; c != NULL;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
      bad = true;
      continue;
    }
    size_t cnt = c->cmsg_len > CMSG_LEN(0) ? (c->cmsg_len - CMSG_LEN(0)) / sizeof(int) : 0;
    const unsigned char *data = CMSG_DATA(c);
    for (size_t i = 0; i < cnt; i++) {
      int fd;
      memcpy(&fd, data + i * sizeof(int), sizeof fd);
      if (ngot < (int)(sizeof got / sizeof got[0]))
        got[ngot++] = fd;
      else
        close(fd); /* cannot happen with our buffer size; never leak anyway */
    }
  }
  if (ngot > room)
    bad = true;
  if (bad) {
    int saved = errno;
    fdpass_close_all(got, ngot);
    errno = saved;
    return DEP_ERR_PROTOCOL;
  }
  if (ngot > 0)
    memcpy(fds + *nfds, got, sizeof(int) * (size_t)ngot);
  *nfds += ngot;
  return n;
}

void fdpass_close_all(int *fds, int n) {
  for (int i = 0; i < n; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
}
