/*
 * fdpass.h — moving bytes and file descriptors over a Unix stream socket
 * with sendmsg/recvmsg and SCM_RIGHTS.  libuv's uv_write2 cannot send
 * arbitrary fds, so both ends use these on a raw socket.
 *
 * Ownership rules:
 *  - Sending never takes ownership: the kernel duplicates the fds into the
 *    message, and the caller closes its own copies when it likes.
 *  - Receiving hands ownership to the caller: every fd stored in fds[] is
 *    open, close-on-exec (MSG_CMSG_CLOEXEC), and must be closed by the
 *    caller.  When the ancillary data was truncated (MSG_CTRUNC) or was
 *    not SCM_RIGHTS, every fd that did arrive is closed before returning
 *    DEP_ERR_PROTOCOL, so nothing leaks on a hostile peer.
 *  - fds ride on the first byte of a frame: the sender passes them with the
 *    first sendmsg of the frame, and the receiver collects them from
 *    whichever recvmsg returns that byte.
 */
#ifndef DEP_FDPASS_H
#define DEP_FDPASS_H

#include <stddef.h>
#include <sys/types.h>

/*
 * Send len bytes (and nfds fds with the first chunk).  Retries on EINTR.
 * On a non-blocking socket returns the bytes written so far when the socket
 * would block (the fds went with the first byte written).  Returns the
 * number of bytes written (>= 0) or a negative DEP_ERR_* (DEP_ERR_DAEMON_GONE
 * on EPIPE/ECONNRESET, DEP_ERR_IO otherwise; errno kept).
 */
ssize_t fdpass_send(int sock, const void *buf, size_t len, const int *fds, int nfds);

/*
 * Receive up to len bytes with one recvmsg.  Received fds are appended to
 * fds[*nfds..maxfds); *nfds is advanced.  More fds than room is
 * DEP_ERR_PROTOCOL (all closed).  Returns bytes read (0 on orderly EOF),
 * DEP_ERR_IO with errno EAGAIN when a non-blocking socket has nothing, or a
 * negative DEP_ERR_*.
 */
ssize_t fdpass_recv(int sock, void *buf, size_t len, int *fds, int maxfds, int *nfds);

/* Close fds[0..n) and set each to -1. */
void fdpass_close_all(int *fds, int n);

#endif /* DEP_FDPASS_H */
