/*
 * server.c — the listening socket.  A raw socket watched with uv_poll, not
 * uv_pipe: replies carry fds through our own sendmsg (STYLE.md), and the
 * checks before bind() need the socket path in our hands anyway.
 *
 * Admission: the allow-list, then limits.max_clients (root and deepepd's
 * own user may go limits.reserved_clients past it, so that status always
 * works), then limits.max_clients_per_uid (the same reserve on top).  Both
 * totals are clamped to what RLIMIT_NOFILE leaves room for, and when
 * accept() still runs out of fds, a spare one is given up to tell the
 * waiting client so rather than leave it hanging.
 */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "conn.h"
#include "deepepd.h"
#include "devices.h"
#include "log.h"
#include "proto.h"

/* Accepts per readable event: a connection storm cannot starve clients. */
#define SERVER_ACCEPT_BUDGET 64
/* How long accepting pauses when the process is out of fds and has no spare. */
#define SERVER_EMFILE_PAUSE_MS 1000
/* How often, at most, the refusals for want of fds are logged. */
#define SERVER_REFUSE_LOG_MS 1000
#define SERVER_NSS_BUF 16384
#define SERVER_MAX_GROUPS 1024
/* How long a daemon already on the socket has to answer the probe's HELLO. */
#define SERVER_PROBE_MS 1000
/*
 * File descriptors kept for the daemon itself when max_clients is clamped:
 * stdio, the loop's own (epoll, its signal pipe and async eventfd), the
 * listening socket and the spare, the notify socket, the files it reads
 * (configuration, /proc), the CUDA driver's device files (a few per GPU).
 * Beside these, the pools' fds (devices_fd_count) and one frame's worth of
 * fds duplicated into an output queue (DEP_PROTO_MAX_FDS) are kept.
 */
#define SERVER_FD_OWN 64
/* Linux's PF_EXITING in /proc/PID/stat's flags: the process is being torn down. */
#define SERVER_PF_EXITING 0x4u

static uv_loop_t *server_loop;
static int server_fd = -1;
static int server_spare = -1; /* /dev/null: given up to accept and refuse when out of fds */
static uv_poll_t server_poll;
static uv_timer_t server_pause;
static bool server_handles; /* poll and timer initialised */
static char server_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static dev_t server_dev;
static ino_t server_ino;
static uint64_t server_nofile = 1024; /* RLIMIT_NOFILE's soft limit, as raised at start */
static struct server_limits server_logged; /* the clamp last logged (clamped false: none) */
static unsigned server_refused;            /* refused for want of fds since the last log line */
static uint64_t server_refused_log_ms;

static uint64_t server_now_ms(void) { return uv_hrtime() / 1000000u; }

/* A decimal id, or false when s is a name. */
static bool server_parse_id(const char *s, unsigned long *out) {
  if (s[0] < '0' || s[0] > '9')
    return false;
  char *end;
  errno = 0;
  unsigned long v = strtoul(s, &end, 10);
  if (errno != 0 || *end != '\0' || v > (unsigned long)(uid_t)-1 - 1)
    return false;
  *out = v;
  return true;
}

static bool server_user_listed(const struct config *cfg, uid_t uid) {
  char buf[SERVER_NSS_BUF];
  for (size_t i = 0; i < cfg->n_allow_users; i++) {
    unsigned long id;
    if (server_parse_id(cfg->allow_users[i], &id)) {
      if ((uid_t)id == uid)
        return true;
      continue;
    }
    struct passwd pw, *res = NULL;
    if (getpwnam_r(cfg->allow_users[i], &pw, buf, sizeof buf, &res) == 0 && res != NULL &&
        res->pw_uid == uid)
      return true;
  }
  return false;
}

static bool server_resolve_group(const char *name, gid_t *gid) {
  unsigned long id;
  if (server_parse_id(name, &id)) {
    *gid = (gid_t)id;
    return true;
  }
  char buf[SERVER_NSS_BUF];
  struct group gr, *res = NULL;
  if (getgrnam_r(name, &gr, buf, sizeof buf, &res) != 0 || res == NULL)
    return false;
  *gid = res->gr_gid;
  return true;
}

/* Whether gid, or one of the user's groups, is the group named name. */
static bool server_in_group(const char *name, gid_t gid, const gid_t *groups, int ng) {
  gid_t want;
  if (!server_resolve_group(name, &want))
    return false;
  if (want == gid)
    return true;
  for (int k = 0; k < ng; k++)
    if (groups[k] == want)
      return true;
  return false;
}

/*
 * Whether the peer is in a group that admits it: one of allow.groups, or
 * socket.group, the group the socket is made for (docs/operating.md, sysusers snippet:
 * its members may connect without being listed again).
 */
static bool server_group_listed(const struct config *cfg, uid_t uid, gid_t gid) {
  if (cfg->n_allow_groups == 0 && cfg->socket_group[0] == '\0')
    return false;
  /* The peer's supplementary groups come from its user's entry: SO_PEERCRED
   * reports only the primary gid. */
  static gid_t groups[SERVER_MAX_GROUPS];
  int ng = 0;
  char buf[SERVER_NSS_BUF];
  struct passwd pw, *res = NULL;
  if (getpwuid_r(uid, &pw, buf, sizeof buf, &res) == 0 && res != NULL) {
    ng = SERVER_MAX_GROUPS;
    if (getgrouplist(res->pw_name, res->pw_gid, groups, &ng) < 0)
      ng = SERVER_MAX_GROUPS; /* truncated: check the first ones */
  }
  if (cfg->socket_group[0] != '\0' && server_in_group(cfg->socket_group, gid, groups, ng))
    return true;
  for (size_t i = 0; i < cfg->n_allow_groups; i++)
    if (server_in_group(cfg->allow_groups[i], gid, groups, ng))
      return true;
  return false;
}

bool server_peer_allowed(const struct config *cfg, uid_t uid, gid_t gid) {
  if (uid == 0 || uid == getuid() || cfg->allow_any_user)
    return true;
  return server_user_listed(cfg, uid) || server_group_listed(cfg, uid, gid);
}

/* Raise RLIMIT_NOFILE's soft limit to the hard one: the clients and pools need fds. */
static void server_raise_nofile(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    log_warnx("getrlimit RLIMIT_NOFILE: %s", strerror(errno));
    return;
  }
  if (rl.rlim_cur < rl.rlim_max) {
    rlim_t was = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) == 0) {
      log_info("raised RLIMIT_NOFILE from %llu to its hard limit %llu", (unsigned long long)was,
               (unsigned long long)rl.rlim_max);
    } else {
      log_warnx("cannot raise RLIMIT_NOFILE from %llu to %llu: %s", (unsigned long long)was,
                (unsigned long long)rl.rlim_max, strerror(errno));
      rl.rlim_cur = was;
    }
  }
  server_nofile = (uint64_t)rl.rlim_cur;
}

void server_client_limits(const struct config *cfg, struct server_limits *out) {
  uint64_t keep = SERVER_FD_OWN + DEP_PROTO_MAX_FDS + devices_fd_count(cfg);
  uint64_t room = server_nofile > keep ? server_nofile - keep : 0;
  *out = (struct server_limits){.max_clients = cfg->max_clients,
                                .reserved_clients = cfg->reserved_clients,
                                .nofile = server_nofile,
                                .fds_kept = keep};
  if ((uint64_t)cfg->max_clients + cfg->reserved_clients > room) {
    out->clamped = true;
    if (out->reserved_clients > room / 2)
      out->reserved_clients = (uint32_t)(room / 2);
    out->max_clients = room > out->reserved_clients ? (uint32_t)(room - out->reserved_clients) : 1;
  }
  struct server_limits *l = &server_logged;
  if (out->clamped && (!l->clamped || l->max_clients != out->max_clients ||
                       l->reserved_clients != out->reserved_clients))
    log_warnx("limits.max_clients clamped to %u (+ %u reserved; configured %u + %u): "
              "RLIMIT_NOFILE is %llu and %llu fds are kept for the daemon, its pools and the fds "
              "a reply passes; raise LimitNOFILE= (systemd) or ulimit -n",
              out->max_clients, out->reserved_clients, cfg->max_clients, cfg->reserved_clients,
              (unsigned long long)server_nofile, (unsigned long long)keep);
  else if (!out->clamped && l->clamped)
    log_info("limits.max_clients %u (+ %u reserved) fit RLIMIT_NOFILE %llu again",
             cfg->max_clients, cfg->reserved_clients, (unsigned long long)server_nofile);
  *l = *out;
}

static void server_admit(int fd) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    log_warn("accept: SO_PEERCRED; closing the connection");
    close(fd);
    return;
  }
  struct conn *c = conn_create(fd, &cred);
  if (c == NULL)
    return;
  const struct config *cfg = &deepepd.cfg;
  if (!server_peer_allowed(cfg, cred.uid, cred.gid)) {
    conn_fail(c, 0, DEP_ERR_PERMISSION,
              "uid %u is not allowed by deepepd (allow.users, allow.groups or socket.group in %s)",
              (unsigned)cred.uid,
              deepepd.config_path[0] ? deepepd.config_path : DEEPEPD_DEFAULT_CONFIG);
    return;
  }
  struct server_limits lim;
  server_client_limits(cfg, &lim);
  /* Root and deepepd's own user may use the reserve, so that status always works. */
  bool privileged = cred.uid == 0 || cred.uid == getuid();
  uint32_t reserve = privileged ? lim.reserved_clients : 0;
  uint32_t total = conn_count();
  if (total > lim.max_clients + reserve) {
    if (privileged)
      conn_fail(c, 0, DEP_ERR_LIMIT,
                "deepepd already serves %u clients: limits.max_clients (%u) and the %u "
                "limits.reserved_clients kept for root and deepepd's user are all taken",
                total - 1, lim.max_clients, lim.reserved_clients);
    else if (lim.clamped)
      conn_fail(c, 0, DEP_ERR_LIMIT,
                "deepepd already serves %u clients, as many as its file descriptors allow "
                "(limits.max_clients %u, clamped by RLIMIT_NOFILE %llu); try again later",
                total - 1, cfg->max_clients, (unsigned long long)lim.nofile);
    else
      conn_fail(c, 0, DEP_ERR_LIMIT,
                "deepepd already serves %u clients (limits.max_clients); try again later or "
                "raise the limit",
                cfg->max_clients);
    return;
  }
  uint32_t mine = conn_count_uid(cred.uid);
  if (mine > cfg->max_clients_per_uid + reserve) {
    conn_fail(c, 0, DEP_ERR_LIMIT,
              "uid %u already has %u connections to deepepd (limits.max_clients_per_uid %u); "
              "close some or raise the limit",
              (unsigned)cred.uid, mine - 1, cfg->max_clients_per_uid);
    return;
  }
}

/*
 * Tell a connection we cannot serve why, and close it: one ERROR frame, which
 * a fresh socket's buffer always takes, then the unread input is dropped so
 * that the close does not reset the peer.
 */
static void server_refuse(int fd, int code, const char *msg) {
  struct dep_msg_error e = {.code = code};
  snprintf(e.message, sizeof e.message, "%s", msg);
  struct proto_buf b;
  proto_buf_init(&b);
  if (proto_frame_encode(&b, DEP_MSG_ERROR, 0, 0, &e) == 0)
    (void)send(fd, b.data, b.len, MSG_NOSIGNAL | MSG_DONTWAIT);
  proto_buf_free(&b);
  char buf[4096];
  for (int i = 0; i < 16 && recv(fd, buf, sizeof buf, MSG_DONTWAIT) > 0; i++)
    ;
  close(fd);
}

/*
 * Out of fds: give up the spare to accept the connection waiting first and
 * refuse it with DEP_ERR_LIMIT, rather than leave it hanging in the backlog
 * (as nginx and libuv do).  1 refused one, 0 nobody waits, -1 no spare.
 */
static int server_refuse_one(void) {
  if (server_spare < 0)
    return -1;
  close(server_spare);
  server_spare = -1;
  int fd = accept4(server_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
  int err = errno;
  if (fd >= 0) {
    char msg[DEP_MSG_TEXT_MAX];
    snprintf(msg, sizeof msg,
             "deepepd is out of file descriptors (RLIMIT_NOFILE %llu, %u clients); try again "
             "later, or raise its LimitNOFILE=",
             (unsigned long long)server_nofile, conn_count());
    server_refuse(fd, DEP_ERR_LIMIT, msg);
    server_refused++;
    uint64_t now = server_now_ms();
    if (now - server_refused_log_ms >= SERVER_REFUSE_LOG_MS) {
      log_warnx("accept: out of file descriptors (RLIMIT_NOFILE %llu, %u clients): refused %u "
                "connection(s) with DEP_ERR_LIMIT",
                (unsigned long long)server_nofile, conn_count(), server_refused);
      server_refused = 0;
      server_refused_log_ms = now;
    }
  }
  server_spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd >= 0)
    return 1;
  errno = err;
  return err == EAGAIN || err == EWOULDBLOCK ? 0 : -1;
}

static void server_on_readable(uv_poll_t *h, int status, int events);

static void server_on_resume(uv_timer_t *t) {
  if (server_fd < 0)
    return;
  if (server_spare < 0)
    server_spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
  log_info("accept: resuming new connections");
  uv_poll_start(&server_poll, UV_READABLE, server_on_readable);
}

static void server_on_readable(uv_poll_t *h, int status, int events) {
  if (status < 0) {
    log_warnx("listening socket: %s", uv_strerror(status));
    return;
  }
  for (int i = 0; i < SERVER_ACCEPT_BUDGET; i++) {
    int fd = accept4(server_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      server_admit(fd);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED)
      continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return;
    if (errno == EMFILE || errno == ENFILE) {
      int r = server_refuse_one();
      if (r > 0)
        continue;
      if (r == 0)
        return;
    }
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      /* Level-triggered polling would spin on the waiting connection: pause. */
      log_warn("accept: pausing new connections for %d ms", SERVER_EMFILE_PAUSE_MS);
      uv_poll_stop(&server_poll);
      uv_timer_start(&server_pause, server_on_resume, SERVER_EMFILE_PAUSE_MS, 0);
      return;
    }
    log_warn("accept");
    return;
  }
}

/* Whether process pid is gone or on its way out (a SIGKILL being carried out). */
static bool server_pid_dead(pid_t pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT || errno == ESRCH;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0)
    return true; /* it went between open and read */
  buf[n] = '\0';
  /* "pid (comm) state ppid pgrp session tty_nr tpgid flags ...": comm may hold anything. */
  const char *p = strrchr(buf, ')');
  char state;
  unsigned long flags;
  if (p == NULL || sscanf(p + 1, " %c %*d %*d %*d %*d %*d %lu", &state, &flags) != 2)
    return false;
  return state == 'Z' || state == 'X' || (flags & SERVER_PF_EXITING) != 0;
}

/*
 * Say HELLO on a connected socket and wait until the deadline for the first
 * bytes of an answer (HELLO_OK, or an ERROR such as a refusal: any answer
 * means a live daemon).  1 answered, 0 closed without answering, -1 silent.
 */
static int server_probe_hello(int fd, uint64_t deadline_ms) {
  struct dep_msg_hello h = {.version = DEP_PROTO_VERSION, .pid = (uint32_t)getpid()};
  snprintf(h.name, sizeof h.name, "deepepd %s (start-up probe)", DEP_VERSION_STRING);
  struct proto_buf b;
  proto_buf_init(&b);
  ssize_t sent = -1;
  if (proto_frame_encode(&b, DEP_MSG_HELLO, 0, 1, &h) == 0)
    sent = send(fd, b.data, b.len, MSG_NOSIGNAL | MSG_DONTWAIT);
  proto_buf_free(&b);
  if (sent < 0 && errno != EAGAIN)
    return 0;
  for (;;) {
    uint64_t now = server_now_ms();
    if (now >= deadline_ms)
      return -1;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int r = poll(&pfd, 1, (int)(deadline_ms - now));
    if (r < 0 && errno != EINTR)
      return -1;
    if (r <= 0)
      continue;
    uint8_t byte;
    ssize_t n = recv(fd, &byte, 1, MSG_DONTWAIT);
    if (n > 0)
      return 1;
    if (n == 0 || (errno != EAGAIN && errno != EINTR))
      return 0;
  }
}

/*
 * What is at the path now: nothing (0), a stale socket we removed (0), or a
 * live daemon / something that is not a socket (-1, logged).  A daemon is
 * live when it answers a HELLO: a SIGKILLed one's socket accepts until the
 * kernel has torn the process down, which takes a while for a large one.
 */
static int server_probe(const char *path, const struct sockaddr_un *sa) {
  struct stat st;
  if (lstat(path, &st) != 0) {
    if (errno == ENOENT)
      return 0;
    log_errx("cannot inspect the socket path %s: %s", path, strerror(errno));
    return -1;
  }
  if (!S_ISSOCK(st.st_mode)) {
    log_errx("%s exists and is not a socket; refusing to replace it (remove it or choose "
             "another socket.path)",
             path);
    return -1;
  }
  uint64_t deadline = server_now_ms() + SERVER_PROBE_MS;
  int fd;
  for (;;) {
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      log_errx("cannot probe the socket %s: socket: %s", path, strerror(errno));
      return -1;
    }
    /* Non-blocking: a full backlog answers EAGAIN, not a hang. */
    if (connect(fd, (const struct sockaddr *)sa, sizeof *sa) == 0)
      break;
    int err = errno;
    close(fd);
    if (err == ECONNREFUSED) {
      if (unlink(path) != 0 && errno != ENOENT) {
        log_errx("cannot remove the stale socket %s: %s", path, strerror(errno));
        return -1;
      }
      log_notice("removed the stale socket %s (nobody was listening on it)", path);
      return 0;
    }
    if (err != EAGAIN) {
      log_errx("cannot tell whether a daemon listens on %s: %s", path, strerror(err));
      return -1;
    }
    if (server_now_ms() >= deadline) {
      log_errx("another deepepd is already listening on %s (its backlog stays full); stop it "
               "first (systemctl stop deepepd) or choose another socket.path",
               path);
      return -1;
    }
    poll(NULL, 0, 20);
  }
  struct ucred cred = {.pid = 0};
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    cred.pid = 0;
  int answer = server_probe_hello(fd, deadline);
  close(fd);
  char who[64] = "";
  if (cred.pid > 0)
    snprintf(who, sizeof who, " (pid %d)", (int)cred.pid);
  if (answer > 0) {
    log_errx("another deepepd is already listening on %s%s; stop it first (systemctl stop "
             "deepepd) or choose another socket.path",
             path, who);
    return -1;
  }
  /* Silent: dead (or dying) only if its process is; a live one may be stuck. */
  if (answer < 0 && cred.pid > 0 && !server_pid_dead(cred.pid)) {
    log_errx("process %d holds %s and accepts connections but did not answer HELLO within %d "
             "ms; if it is a hung deepepd, stop it (kill %d), or choose another socket.path",
             (int)cred.pid, path, SERVER_PROBE_MS, (int)cred.pid);
    return -1;
  }
  if (unlink(path) != 0 && errno != ENOENT) {
    log_errx("cannot remove the stale socket %s: %s", path, strerror(errno));
    return -1;
  }
  log_notice("replaced the stale socket %s: its daemon%s %s", path, who,
             answer == 0 ? "closed the connection without answering HELLO"
                         : "is gone and never answered HELLO");
  return 0;
}

static int server_set_access(const char *path, const struct config *cfg) {
  if (chmod(path, (mode_t)cfg->socket_mode) != 0) {
    log_errx("cannot set up the socket %s: chmod %04o: %s", path, (unsigned)cfg->socket_mode,
             strerror(errno));
    return -1;
  }
  if (cfg->socket_group[0] != '\0') {
    gid_t gid;
    if (!server_resolve_group(cfg->socket_group, &gid)) {
      log_errx("cannot set up the socket %s: socket.group %s: no such group", path,
               cfg->socket_group);
      return -1;
    }
    if (chown(path, (uid_t)-1, gid) != 0) {
      log_errx("cannot set up the socket %s: chown to group %s: %s", path, cfg->socket_group,
               strerror(errno));
      return -1;
    }
  }
  return 0;
}

/* What to do when the socket's directory may not be written. */
static const char *server_access_hint(int err) {
  if (err == EACCES || err == EPERM || err == EROFS)
    return "; run deepepd as root or as its service (systemctl start deepepd), or pass a "
           "socket path you may write (-s PATH or socket.path)";
  return "";
}

/*
 * Make the socket's directory when it is missing: its last component only,
 * mode 0755, as the tmpfiles snippet does for /run/deepepd under systemd.
 */
static int server_make_dir(const char *path) {
  char dir[sizeof server_path];
  const char *slash = strrchr(path, '/');
  if (slash == NULL || slash == path)
    return 0; /* in the working directory, or in / */
  size_t n = (size_t)(slash - path);
  memcpy(dir, path, n);
  dir[n] = '\0';
  struct stat st;
  if (stat(dir, &st) == 0) {
    if (S_ISDIR(st.st_mode))
      return 0;
    log_errx("cannot make the socket %s: %s is not a directory", path, dir);
    return -1;
  }
  if (errno != ENOENT) {
    log_errx("cannot make the socket %s: %s: %s", path, dir, strerror(errno));
    return -1;
  }
  if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
    int err = errno;
    if (err == ENOENT)
      log_errx("cannot make the socket %s: mkdir %s: its parent does not exist either; make "
               "it (mkdir -p %s) or choose another socket.path",
               path, dir, dir);
    else
      log_errx("cannot make the socket %s: mkdir %s: %s%s", path, dir, strerror(err),
               server_access_hint(err));
    return -1;
  }
  /* The umask may have narrowed it; clients must reach the socket. */
  if (chmod(dir, 0755) != 0)
    log_warnx("chmod 0755 %s: %s", dir, strerror(errno));
  log_notice("made the socket's directory %s (mode 0755)", dir);
  return 0;
}

int server_init(uv_loop_t *loop, const struct config *cfg) {
  server_loop = loop;
  const char *path = cfg->socket_path;
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t len = strlen(path);
  if (len == 0) {
    log_errx("socket.path is empty");
    return -1;
  }
  if (len >= sizeof sa.sun_path) {
    log_errx("socket path too long (%zu bytes, max %zu): %s", len, sizeof sa.sun_path - 1, path);
    return -1;
  }
  memcpy(sa.sun_path, path, len);
  server_raise_nofile();
  if (server_make_dir(path) != 0 || server_probe(path, &sa) != 0)
    return -1;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    log_errx("cannot make the socket %s: socket: %s", path, strerror(errno));
    return -1;
  }
  /* Nobody can connect before listen(), so the mode is set in between. */
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    int err = errno;
    if (err == EADDRINUSE)
      log_errx("another process created %s while deepepd was starting; is another deepepd "
               "starting?", path);
    else
      log_errx("cannot bind the socket %s: %s%s", path, strerror(err), server_access_hint(err));
    close(fd);
    return -1;
  }
  struct stat st;
  if (stat(path, &st) != 0) {
    log_errx("cannot set up the socket %s: stat: %s", path, strerror(errno));
    close(fd);
    unlink(path);
    return -1;
  }
  int ok = server_set_access(path, cfg);
  if (ok == 0 && listen(fd, SOMAXCONN) != 0) {
    log_errx("cannot set up the socket %s: listen: %s", path, strerror(errno));
    ok = -1;
  }
  if (ok != 0) {
    close(fd);
    unlink(path);
    return -1;
  }
  server_dev = st.st_dev;
  server_ino = st.st_ino;
  memcpy(server_path, path, len + 1);
  server_fd = fd;
  server_spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
  uv_poll_init(loop, &server_poll, fd);
  uv_timer_init(loop, &server_pause);
  server_handles = true;
  uv_poll_start(&server_poll, UV_READABLE, server_on_readable);
  log_info("listening on %s (mode %04o%s%s)", path, (unsigned)cfg->socket_mode,
           cfg->socket_group[0] ? ", group " : "", cfg->socket_group);
  struct server_limits lim;
  server_client_limits(cfg, &lim); /* logs a clamp */
  return 0;
}

void server_fini(void) {
  if (server_handles) {
    uv_close((uv_handle_t *)&server_poll, NULL);
    uv_close((uv_handle_t *)&server_pause, NULL);
    server_handles = false;
  }
  if (server_fd < 0)
    return;
  close(server_fd);
  server_fd = -1;
  if (server_spare >= 0)
    close(server_spare);
  server_spare = -1;
  /* Remove the file only if it is still ours: a successor may have made its own. */
  struct stat st;
  if (lstat(server_path, &st) == 0 && st.st_dev == server_dev && st.st_ino == server_ino) {
    if (unlink(server_path) != 0)
      log_warn("cannot remove the socket %s", server_path);
  }
  log_info("stopped listening on %s", server_path);
}
