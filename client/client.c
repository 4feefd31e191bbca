/*
 * client.c — libdeepep-client's connection to deepepd: connect and HELLO,
 * one request and exactly one reply at a time over a blocking Unix socket,
 * and the control requests built on that (status, attach, detach).
 *
 * Every failure leaves a message on the handle (dep_errmsg) that says what
 * failed and what to do.  A failure that leaves the byte stream in an
 * unknown state (the daemon gone, a malformed frame, a reply that never
 * came) closes the connection; the handle itself stays valid, so the
 * caller can dep_connect again or dep_client_free it.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "deepep.h"
#include "fdpass.h"
#include "proto.h"

#ifndef DEP_SYSCONFDIR
#define DEP_SYSCONFDIR "/etc"
#endif

/* What HELLO says after the program's name: the library and its version. */
#define CLIENT_LIBRARY_NAME "libdeepep-client " DEP_VERSION_STRING
#define CLIENT_GONE_MSG                                                                  \
  "deepepd closed the connection (daemon stopped or restarted); reconnect with dep_connect"

/* ---- small helpers -------------------------------------------------------- */

static int64_t client_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int client_seterr(dep_client_t *c, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->errmsg, sizeof c->errmsg, fmt, ap);
  va_end(ap);
  return code;
}

int client_size_check(dep_client_t *c, const char *op, const char *type, uint32_t size,
                      size_t ours, size_t first) {
  if (size >= first && size <= CLIENT_SIZE_MAX)
    return 0;
  return c ? client_seterr(c, DEP_ERR_INVALID, "%s: the size of struct %s is %u%s; set .size = "
                           "sizeof(struct %s) (%zu with this deepep.h) before the call", op,
                           type, size, size > CLIENT_SIZE_MAX ? ", not a sizeof (over 4096)" : "",
                           type, ours)
           : DEP_ERR_INVALID;
}

int client_args_take(dep_client_t *c, const char *op, const char *type, const void *a,
                     size_t ours, size_t first, void *out) {
  memset(out, 0, ours);
  if (a == NULL)
    return c ? client_seterr(c, DEP_ERR_INVALID, "%s: struct %s pointer is NULL", op, type)
             : DEP_ERR_INVALID;
  uint32_t size;
  memcpy(&size, a, sizeof size);
  int rc = client_size_check(c, op, type, size, ours, first);
  if (rc != 0)
    return rc;
  for (size_t i = ours; i < size; i++)
    if (((const uint8_t *)a)[i] != 0)
      return c ? client_seterr(c, DEP_ERR_UNSUPPORTED, "%s: struct %s of %u bytes sets fields "
                               "this library (%s, %zu bytes) does not know; use a newer "
                               "libdeepep-client", op, type, size, DEP_VERSION_STRING, ours)
               : DEP_ERR_UNSUPPORTED;
  memcpy(out, a, size < ours ? size : ours);
  return 0;
}

void client_args_give(void *out, void *ours, size_t ours_size) {
  uint32_t size;
  memcpy(&size, ours, sizeof size); /* the caller's, as client_args_take copied it */
  if (size > ours_size)
    size = (uint32_t)ours_size;
  memcpy(ours, &size, sizeof size);
  memcpy(out, ours, size);
}

void client_disconnect(dep_client_t *c) {
  client_unmap(c);
  if (c->fd >= 0)
    close(c->fd);
  c->fd = -1;
  c->attached = false;
  c->job_id[0] = '\0';
  memset(&c->hello, 0, sizeof c->hello);
  memset(&c->attach_ok, 0, sizeof c->attach_ok);
}

/* A failure after which the stream cannot be trusted: record it, close. */
int client_fail(dep_client_t *c, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->errmsg, sizeof c->errmsg, fmt, ap);
  va_end(ap);
  client_disconnect(c);
  return code;
}

static int client_gone(dep_client_t *c) {
  return client_fail(c, DEP_ERR_DAEMON_GONE, "%s", CLIENT_GONE_MSG);
}

void client_frame_init(struct client_frame *f) {
  memset(&f->hdr, 0, sizeof f->hdr);
  f->body = NULL;
  f->nfds = 0;
  for (int i = 0; i < DEP_PROTO_MAX_FDS; i++)
    f->fds[i] = -1;
}

void client_frame_release(struct client_frame *f) {
  free(f->body);
  f->body = NULL;
  fdpass_close_all(f->fds, f->nfds);
  f->nfds = 0;
}

void client_set_name(dep_client_t *c, const char *name) {
  if (c != NULL && name != NULL)
    snprintf(c->name, sizeof c->name, "%s", name);
}

void client_set_hello_timeout(dep_client_t *c, int timeout_ms) {
  if (c != NULL && timeout_ms >= 0)
    c->hello_timeout_ms = timeout_ms;
}

/* ---- framing -------------------------------------------------------------- */

/* What the request in flight is, for messages. */
struct client_wait {
  const char *what;  /* request type name */
  int timeout_ms;    /* < 0: no limit */
  int64_t deadline;  /* monotonic ms, or -1 */
};

static int client_wait_readable(dep_client_t *c, const struct client_wait *w) {
  for (;;) {
    int wait = -1;
    if (w->deadline >= 0) {
      int64_t left = w->deadline - client_now_ms();
      if (left <= 0)
        return client_fail(c, DEP_ERR_TIMEOUT,
                           "no reply from deepepd to %s within %d ms; the connection was "
                           "closed, reconnect with dep_connect",
                           w->what, w->timeout_ms);
      wait = left > INT_MAX ? INT_MAX : (int)left;
    }
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    int n = poll(&p, 1, wait);
    if (n > 0)
      return 0; /* readable, hung up or in error: the read says which */
    if (n < 0 && errno != EINTR)
      return client_fail(c, DEP_ERR_IO, "waiting for deepepd's reply to %s: %s", w->what,
                         strerror(errno));
  }
}

/* Read exactly len bytes of one frame, collecting any fds into f. */
static int client_read_exact(dep_client_t *c, void *buf, size_t len, struct client_frame *f,
                             const struct client_wait *w) {
  size_t got = 0;
  while (got < len) {
    int rc = client_wait_readable(c, w);
    if (rc != 0)
      return rc;
    ssize_t n = fdpass_recv(c->fd, (uint8_t *)buf + got, len - got, f->fds, DEP_PROTO_MAX_FDS,
                            &f->nfds);
    if (n == 0 || n == DEP_ERR_DAEMON_GONE)
      return client_gone(c);
    if (n == DEP_ERR_PROTOCOL)
      return client_fail(c, DEP_ERR_PROTOCOL,
                         "deepepd sent malformed or too many file descriptors with its "
                         "reply to %s",
                         w->what);
    if (n < 0)
      return client_fail(c, (int)n, "reading deepepd's reply to %s: %s", w->what,
                         strerror(errno));
    got += (size_t)n;
  }
  return 0;
}

/*
 * Whether a header proto_hdr_decode refused with hdr_rc is still one to
 * read whole: an ERROR of another protocol version (its header and body
 * are the same in every version, proto.h: a deepepd that does not speak
 * ours says why in it), or a frame of a type this library does not know
 * (a newer deepepd's), whose body is read so that the reason given is
 * that, not a broken stream.
 */
static bool client_frame_readable(int hdr_rc, const struct dep_frame_hdr *h) {
  if (h->magic != DEP_PROTO_MAGIC || h->body_len > DEP_PROTO_MAX_BODY ||
      (h->flags & ~DEP_FRAME_F_KNOWN) != 0)
    return false;
  return hdr_rc == DEP_ERR_UNSUPPORTED || (hdr_rc == DEP_ERR_VERSION && h->type == DEP_MSG_ERROR);
}

/*
 * Read one whole frame.  The header is checked (magic, version, type,
 * flags, length) before the body is allocated.  On failure the frame holds
 * nothing and the connection is closed.
 */
static int client_read_frame(dep_client_t *c, struct client_frame *f,
                             const struct client_wait *w) {
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  char why[256] = "";
  client_frame_init(f);
  int rc = client_read_exact(c, hdr, sizeof hdr, f, w);
  int hdr_rc = 0;
  if (rc == 0) {
    hdr_rc = proto_hdr_decode(hdr, DEP_PROTO_MAX_BODY, &f->hdr, why, sizeof why);
    if (hdr_rc != 0 && !client_frame_readable(hdr_rc, &f->hdr))
      rc = client_fail(c, hdr_rc, "bad frame from deepepd in reply to %s: %s", w->what, why);
  }
  if (rc == 0 && f->hdr.body_len > 0) {
    f->body = malloc(f->hdr.body_len);
    if (f->body == NULL)
      rc = client_fail(c, DEP_ERR_NO_MEMORY, "out of memory for a %u-byte reply to %s",
                       f->hdr.body_len, w->what);
    else
      rc = client_read_exact(c, f->body, f->hdr.body_len, f, w);
  }
  if (rc == 0 && f->nfds > 0 && (f->hdr.flags & DEP_FRAME_F_FDS) == 0)
    rc = client_fail(c, DEP_ERR_PROTOCOL,
                     "deepepd sent %d file descriptors on a %s frame not flagged to carry any",
                     f->nfds, proto_type_name(f->hdr.type));
  if (rc == 0 && hdr_rc == DEP_ERR_UNSUPPORTED)
    /* A reply this library cannot read fails the request it answers; the
     * connection goes with it, since what else that reply would have
     * brought (more records, fds) cannot be told apart from the next. */
    rc = client_fail(c, DEP_ERR_PROTOCOL,
                     "deepepd answered %s with message type %u, which this libdeepep-client "
                     "(protocol %u) does not know: use a libdeepep-client that matches deepepd",
                     w->what, (unsigned)f->hdr.type, (unsigned)DEP_PROTO_VERSION);
  if (rc != 0)
    client_frame_release(f);
  return rc;
}

/* Decode an ERROR frame (and release it) into the handle's message. */
static int client_error_reply(dep_client_t *c, struct client_frame *f, const char *what) {
  struct dep_msg_error e;
  int rc = proto_decode_error(f->body, f->hdr.body_len, &e);
  client_frame_release(f);
  if (rc != 0)
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd sent a malformed ERROR in reply to %s",
                       what);
  /* Codes added by a newer daemon pass through unchanged: the numbers never
   * change meaning, and the message still explains them. */
  return client_seterr(c, e.code, "%s", e.message[0] != '\0' ? e.message : dep_strerror(e.code));
}

/*
 * A frame the daemon sent unasked (request id 0): the SHUTDOWN notice, or
 * an ERROR saying why it is closing this connection (a user it does not
 * allow, limits.max_clients reached).  Either way the connection is over;
 * the ERROR's code and message are worth more than "connection closed".
 */
static int client_notice(dep_client_t *c, struct client_frame *f) {
  uint16_t type = f->hdr.type;
  if (type == DEP_MSG_ERROR && f->hdr.request_id == 0) {
    int rc = client_error_reply(c, f, "this connection");
    if (c->fd >= 0)
      client_disconnect(c);
    return rc;
  }
  client_frame_release(f);
  if (type == DEP_MSG_SHUTDOWN)
    return client_gone(c);
  return client_fail(c, DEP_ERR_PROTOCOL, "deepepd sent an unsolicited %s frame",
                     proto_type_name(type));
}

static bool client_is_notice(const struct dep_frame_hdr *h) {
  return h->type == DEP_MSG_SHUTDOWN || (h->type == DEP_MSG_ERROR && h->request_id == 0);
}

/*
 * Take a notice already waiting on the socket.  Looking before each request
 * turns "daemon restarted while we were idle" into DAEMON_GONE up front,
 * and after a failed write it recovers the daemon's reason for closing.
 */
static int client_check_notice(dep_client_t *c) {
  struct pollfd p = {.fd = c->fd, .events = POLLIN};
  int n;
  do {
    n = poll(&p, 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n <= 0)
    return 0;
  struct client_wait w = {.what = "a notice", .timeout_ms = 1000,
                          .deadline = client_now_ms() + 1000};
  struct client_frame f;
  int rc = client_read_frame(c, &f, &w);
  if (rc != 0)
    return rc;
  return client_notice(c, &f);
}

static int client_send_all(dep_client_t *c, const uint8_t *p, size_t len, const char *what) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = fdpass_send(c->fd, p + done, len - done, NULL, 0);
    if (n == DEP_ERR_DAEMON_GONE) {
      int rc = client_check_notice(c);
      return rc != 0 ? rc : client_gone(c);
    }
    if (n < 0)
      return client_fail(c, (int)n, "sending %s to deepepd: %s", what, strerror(errno));
    done += (size_t)n;
  }
  return 0;
}

int client_send_request(dep_client_t *c, uint16_t type, const void *msg, uint32_t *id_out) {
  const char *what = proto_type_name(type);
  if (c->fd < 0)
    return client_seterr(c, DEP_ERR_STATE, "not connected to deepepd; call dep_connect first");
  int rc = client_check_notice(c);
  if (rc != 0)
    return rc;
  uint32_t id = c->next_request++;
  if (c->next_request == 0)
    c->next_request = 1;
  proto_buf_reset(&c->tx);
  rc = proto_frame_encode(&c->tx, type, 0, id, msg);
  if (rc != 0)
    return client_seterr(c, rc, "cannot encode the %s request: %s", what, dep_strerror(rc));
  rc = client_send_all(c, c->tx.data, c->tx.len, what);
  if (rc != 0)
    return rc;
  *id_out = id;
  return 0;
}

int client_read_reply(dep_client_t *c, uint32_t id, const char *what, uint16_t ok_type,
                      uint16_t part_type, int timeout_ms, int64_t deadline,
                      struct client_frame *reply) {
  client_frame_init(reply);
  struct client_wait w = {.what = what, .timeout_ms = timeout_ms, .deadline = deadline};
  int rc = client_read_frame(c, reply, &w);
  if (rc != 0)
    return rc;
  const struct dep_frame_hdr *h = &reply->hdr;
  if (client_is_notice(h))
    return client_notice(c, reply);
  if (h->request_id != id) {
    uint32_t got = h->request_id;
    client_frame_release(reply);
    return client_fail(c, DEP_ERR_PROTOCOL,
                       "deepepd's reply to %s carries request id %u, expected %u", what, got, id);
  }
  if (h->type == DEP_MSG_ERROR)
    return client_error_reply(c, reply, what);
  if (h->type != ok_type && (part_type == 0 || h->type != part_type)) {
    uint16_t got = h->type;
    client_frame_release(reply);
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd answered %s with %s, expected %s", what,
                       proto_type_name(got), proto_type_name(ok_type));
  }
  return 0;
}

int64_t client_deadline(int timeout_ms) {
  return timeout_ms < 0 ? -1 : client_now_ms() + timeout_ms;
}

int client_lend_map(dep_client_t *c, uint16_t type, uint16_t ok_type, uint32_t version,
                    uint32_t bytes, uint64_t map_bytes, void **map, char *why, size_t whylen) {
  char saved[CLIENT_ERRMSG_MAX];
  snprintf(saved, sizeof saved, "%s", c->errmsg);
  struct client_frame f;
  int rc = client_request(c, type, NULL, ok_type, CLIENT_REQUEST_TIMEOUT_MS, &f);
  if (rc != 0) {
    snprintf(why, whylen, "%.200s", c->errmsg);
    snprintf(c->errmsg, sizeof c->errmsg, "%s", saved);
    return rc;
  }
  struct dep_msg_lend_ok ok;
  struct stat st;
  void *p = MAP_FAILED;
  if (proto_decode_lend_ok(f.body, f.hdr.body_len, &ok) == 0 && f.nfds == 1 &&
      ok.version == version && ok.bytes == bytes && fstat(f.fds[0], &st) == 0 &&
      (uint64_t)st.st_size == map_bytes)
    p = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f.fds[0], 0);
  client_frame_release(&f); /* closes the fd: the mapping stays */
  if (p == MAP_FAILED) {
    snprintf(why, whylen, "deepepd lent a %s of another version or size (a daemon of another "
             "build?)", proto_type_name(type));
    return DEP_ERR_VERSION;
  }
  *map = p;
  return 0;
}

int client_request(dep_client_t *c, uint16_t type, const void *msg, uint16_t ok_type,
                   int timeout_ms, struct client_frame *reply) {
  uint32_t id = 0;
  client_frame_init(reply);
  int rc = client_send_request(c, type, msg, &id);
  if (rc != 0)
    return rc;
  return client_read_reply(c, id, proto_type_name(type), ok_type, 0, timeout_ms,
                           client_deadline(timeout_ms), reply);
}

/* ---- handle ----------------------------------------------------------------- */

/* The last component of a path. */
static const char *client_basename(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash != NULL ? slash + 1 : path;
}

/*
 * The program this process runs, from its command line: argv[0]'s last component, or for a
 * Python interpreter the script it runs (its last component), "-m MODULE" for a module, or
 * "python3 -c" for a command, so that deepepctl clients tells one trainer from another (every
 * Python rank would otherwise be the interpreter).  Interpreter options before the script are
 * passed over; -W and -X take the next argument when none is attached.  "" when the command
 * line cannot be read.
 */
static void client_program(char *out, size_t len) {
  out[0] = '\0';
  char cmd[4096];
  int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return;
  ssize_t n = read(fd, cmd, sizeof cmd - 1);
  close(fd);
  if (n <= 0)
    return;
  cmd[n] = '\0'; /* arguments are NUL-separated; a cut one ends here */
  const char *argv[64];
  int argc = 0;
  for (char *p = cmd; p < cmd + n && argc < 64; p += strlen(p) + 1)
    argv[argc++] = p;
  const char *prog = client_basename(argv[0]);
  if (strncmp(prog, "python", 6) == 0) {
    for (int i = 1; i < argc; i++) {
      const char *a = argv[i];
      if (strcmp(a, "-m") == 0 && i + 1 < argc) {
        snprintf(out, len, "-m %s", argv[i + 1]);
        return;
      }
      if (strcmp(a, "-c") == 0) {
        snprintf(out, len, "%s -c", prog);
        return;
      }
      if ((strcmp(a, "-W") == 0 || strcmp(a, "-X") == 0) && i + 1 < argc) {
        i++;
        continue;
      }
      if (a[0] == '-' && strcmp(a, "-") != 0)
        continue;
      snprintf(out, len, "%s", client_basename(a));
      return;
    }
  }
  snprintf(out, len, "%s", prog);
}

/* HELLO's name: "PROGRAM (libdeepep-client VERSION)", the program cut to leave the library's
 * name whole; the library's alone when the program is not known. */
static void client_default_name(char *out, size_t len) {
  char prog[CLIENT_NAME_MAX];
  client_program(prog, sizeof prog);
  if (prog[0] == '\0') {
    snprintf(out, len, "%s", CLIENT_LIBRARY_NAME);
    return;
  }
  int room = (int)len - (int)sizeof " (" CLIENT_LIBRARY_NAME ")";
  snprintf(out, len, "%.*s (%s)", room > 0 ? room : 0, prog, CLIENT_LIBRARY_NAME);
}

DEP_EXPORT int dep_client_new(dep_client_t **out) {
  if (out == NULL)
    return DEP_ERR_INVALID;
  *out = NULL;
  dep_client_t *c = calloc(1, sizeof *c);
  if (c == NULL)
    return DEP_ERR_NO_MEMORY;
  c->fd = -1;
  c->primary.dev = -1;
  c->next_request = 1;
  client_default_name(c->name, sizeof c->name);
  proto_buf_init(&c->tx);
  *out = c;
  return DEP_OK;
}

DEP_EXPORT void dep_client_free(dep_client_t *c) {
  if (c == NULL)
    return;
  /* An orderly DETACH lets the daemon log a clean leave; closing the socket
   * alone would also release the rank, so a failure here changes nothing.
   * As in dep_detach, the slabs go first: once the daemon hears DETACH it
   * may scrub the memory and lend it to another job. */
  if (c->fd >= 0 && c->attached) {
    client_unmap(c);
    struct client_frame f;
    if (client_request(c, DEP_MSG_DETACH, NULL, DEP_MSG_DETACH_OK, CLIENT_FREE_DETACH_TIMEOUT_MS,
                       &f) == 0)
      client_frame_release(&f);
  }
  client_disconnect(c);
  mem_cuda_unbind(&c->primary); /* after the slabs and kernels it held are gone */
  proto_buf_free(&c->tx);
  free(c);
}

DEP_EXPORT const char *dep_errmsg(const dep_client_t *c) {
  if (c == NULL)
    return "no handle (NULL dep_client_t)";
  return c->errmsg;
}

/* ---- connect ------------------------------------------------------------------ */

static int client_connect_error(dep_client_t *c, int err, const char *path, const char *from) {
  /* Linux answers connect(2) on a file that is not a socket with ECONNREFUSED
   * (or EACCES where the file is not writable), which would read as a stale
   * socket or a missing group: look at what the path is before saying so. */
  struct stat sb;
  if (err != ENOENT && err != ENOTDIR && stat(path, &sb) == 0 && !S_ISSOCK(sb.st_mode)) {
    mode_t m = sb.st_mode;
    const char *kind = S_ISREG(m)    ? "a regular file"
                       : S_ISDIR(m)  ? "a directory"
                       : S_ISFIFO(m) ? "a FIFO"
                       : S_ISCHR(m)  ? "a character device"
                       : S_ISBLK(m)  ? "a block device"
                                     : "some other kind of file";
    return client_seterr(c, DEP_ERR_NO_DAEMON,
                         "%s%s is not a socket: it is %s, so no deepepd listens there; give "
                         "the path of deepepd's socket (socket.path in " DEP_SYSCONFDIR
                         "/deepepd/deepepd.yaml, default " DEP_DEFAULT_SOCKET ")",
                         path, from, kind);
  }
  switch (err) {
  case ENOENT:
  case ENOTDIR:
    return client_seterr(c, DEP_ERR_NO_DAEMON,
                         "deepepd not running: no socket at %s%s; start it with `systemctl "
                         "start deepepd` or `deepepd -s %s`",
                         path, from, path);
  case ECONNREFUSED:
    return client_seterr(c, DEP_ERR_NO_DAEMON,
                         "deepepd not running: stale socket at %s%s (no daemon listening); "
                         "start it with `systemctl start deepepd` or `deepepd -s %s`",
                         path, from, path);
  case EACCES:
  case EPERM:
    return client_seterr(c, DEP_ERR_PERMISSION,
                         "permission denied connecting to deepepd at %s%s; ask an "
                         "administrator to add your user to the socket's group (socket.group "
                         "in " DEP_SYSCONFDIR "/deepepd/deepepd.yaml)",
                         path, from);
  case EAGAIN:
    return client_seterr(c, DEP_ERR_LIMIT,
                         "deepepd at %s%s is not accepting connections (listen queue full); "
                         "retry later",
                         path, from);
  default:
    return client_seterr(c, DEP_ERR_IO, "cannot connect to deepepd at %s%s: %s", path, from,
                         strerror(err));
  }
}

/* connect(2) interrupted by a signal keeps going in the background. */
static int client_connect_finish(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLOUT};
  int n;
  do {
    n = poll(&p, 1, CLIENT_REQUEST_TIMEOUT_MS);
  } while (n < 0 && errno == EINTR);
  if (n <= 0)
    return n == 0 ? ETIMEDOUT : errno;
  int err = 0;
  socklen_t len = sizeof err;
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
    return errno;
  return err;
}

static int client_hello(dep_client_t *c) {
  struct dep_msg_hello hello = {.version = DEP_PROTO_VERSION, .pid = (uint32_t)getpid()};
  snprintf(hello.name, sizeof hello.name, "%s", c->name);
  struct client_frame f;
  int timeout_ms = c->hello_timeout_ms > 0 ? c->hello_timeout_ms : CLIENT_REQUEST_TIMEOUT_MS;
  int rc = client_request(c, DEP_MSG_HELLO, &hello, DEP_MSG_HELLO_OK, timeout_ms, &f);
  if (rc != 0) {
    client_disconnect(c); /* a refused HELLO leaves nothing to talk over */
    return rc;
  }
  struct dep_msg_hello_ok ok;
  rc = proto_decode_hello_ok(f.body, f.hdr.body_len, &ok);
  client_frame_release(&f);
  if (rc != 0)
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd sent a malformed HELLO_OK");
  if (!proto_version_known(ok.version))
    return client_fail(c, DEP_ERR_VERSION,
                       "deepepd speaks protocol version %u; this libdeepep-client speaks versions "
                       "%u..%u: upgrade whichever is older",
                       ok.version, (unsigned)DEP_PROTO_MIN_VERSION, (unsigned)DEP_PROTO_VERSION);
  c->hello = ok;
  return 0;
}

DEP_EXPORT int dep_connect(dep_client_t *c, const char *socket_path) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  /* Connecting again replaces the old connection (and any attach on it). */
  client_disconnect(c);
  const char *path = socket_path;
  const char *from = "";
  if (path == NULL) {
    path = secure_getenv(DEP_SOCKET_ENV);
    if (path != NULL && path[0] != '\0')
      from = " (from $" DEP_SOCKET_ENV ")";
    else
      path = DEP_DEFAULT_SOCKET;
  }
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t len = strlen(path);
  if (len == 0)
    return client_seterr(c, DEP_ERR_INVALID, "empty socket path%s", from);
  if (len >= sizeof sa.sun_path)
    return client_seterr(c, DEP_ERR_INVALID,
                         "socket path%s is %zu bytes, longer than the %zu a Unix socket "
                         "allows: %s",
                         from, len, sizeof sa.sun_path - 1, path);
  memcpy(sa.sun_path, path, len + 1);
  snprintf(c->socket_path, sizeof c->socket_path, "%s", path);

  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return client_seterr(c, errno == EMFILE || errno == ENFILE || errno == ENOMEM
                                ? DEP_ERR_LIMIT
                                : DEP_ERR_IO,
                         "cannot create a socket to reach deepepd: %s", strerror(errno));
  int err = 0;
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
    err = errno == EINTR ? client_connect_finish(fd) : errno;
  if (err != 0) {
    close(fd);
    return client_connect_error(c, err, path, from);
  }
  c->fd = fd;
  return client_hello(c);
}

/* ---- status ------------------------------------------------------------------- */

/*
 * The reply decoded into the library's structs, then laid out in the
 * caller's (deepep.h: dep_status learns the caller's sizes): the top
 * struct and each element allocated at the caller's size, filled as far
 * as both hold, the rest zero.
 */
static int status_relayout(struct dep_status *lib, uint32_t size, uint32_t device_size,
                           uint32_t job_size, struct dep_status **out) {
  const size_t top = size > sizeof *lib ? size : sizeof *lib;
  uint8_t *st = calloc(1, top);
  uint8_t *dev = lib->num_devices ? calloc(lib->num_devices, device_size) : NULL;
  uint8_t *job = lib->num_jobs ? calloc(lib->num_jobs, job_size) : NULL;
  if (st == NULL || (lib->num_devices && dev == NULL) || (lib->num_jobs && job == NULL)) {
    free(st);
    free(dev);
    free(job);
    return DEP_ERR_NO_MEMORY;
  }
  const size_t dn = device_size < sizeof *lib->devices ? device_size : sizeof *lib->devices;
  const size_t jn = job_size < sizeof *lib->jobs ? job_size : sizeof *lib->jobs;
  for (uint32_t i = 0; i < lib->num_devices; i++)
    memcpy(dev + (size_t)i * device_size, &lib->devices[i], dn);
  for (uint32_t i = 0; i < lib->num_jobs; i++)
    memcpy(job + (size_t)i * job_size, &lib->jobs[i], jn);
  free(lib->devices);
  free(lib->jobs);
  lib->devices = (struct dep_status_device *)(void *)dev;
  lib->jobs = (struct dep_status_job *)(void *)job;
  lib->size = size < sizeof *lib ? size : (uint32_t)sizeof *lib;
  lib->device_size = (uint32_t)dn;
  lib->job_size = (uint32_t)jn;
  memcpy(st, lib, sizeof *lib); /* st holds at least ours; the caller reads its prefix */
  *out = (struct dep_status *)(void *)st;
  return 0;
}

DEP_EXPORT int dep_status_sized(dep_client_t *c, struct dep_status **out, uint32_t size,
                                uint32_t device_size, uint32_t job_size) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  if (out == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "dep_status: out must not be NULL");
  *out = NULL;
  const char *op = "dep_status";
  int rc = client_size_check(c, op, "dep_status", size, sizeof(struct dep_status),
                             CLIENT_FIRST_LAYOUT(struct dep_status, jobs));
  if (rc == 0)
    rc = client_size_check(c, op, "dep_status_device", device_size,
                           sizeof(struct dep_status_device),
                           CLIENT_FIRST_LAYOUT(struct dep_status_device, pool_held_bytes));
  if (rc == 0)
    rc = client_size_check(c, op, "dep_status_job", job_size, sizeof(struct dep_status_job),
                           CLIENT_FIRST_LAYOUT(struct dep_status_job, age_ms));
  if (rc != 0)
    return rc;
  struct client_frame f;
  rc = client_request(c, DEP_MSG_STATUS, NULL, DEP_MSG_STATUS_OK, CLIENT_REQUEST_TIMEOUT_MS, &f);
  if (rc != 0)
    return rc;
  struct dep_status *st = calloc(1, sizeof *st);
  if (st == NULL) {
    client_frame_release(&f);
    return client_seterr(c, DEP_ERR_NO_MEMORY, "out of memory for the status reply");
  }
  rc = proto_decode_status(f.body, f.hdr.body_len, st);
  client_frame_release(&f);
  if (rc != 0) {
    dep_status_free(st); /* the decoder left no arrays behind */
    if (rc == DEP_ERR_NO_MEMORY)
      return client_seterr(c, rc, "out of memory decoding the status reply");
    return client_seterr(c, DEP_ERR_PROTOCOL, "deepepd sent a malformed STATUS_OK");
  }
  rc = status_relayout(st, size, device_size, job_size, out);
  if (rc != 0) {
    dep_status_free(st);
    return client_seterr(c, rc, "out of memory for the status reply");
  }
  free(st); /* its arrays are the result's now */
  return DEP_OK;
}

