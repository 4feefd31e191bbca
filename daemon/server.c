/*
 * server.c — the listening socket.  A raw socket watched with uv_poll, not
 * uv_pipe: replies carry fds through our own sendmsg (STYLE.md), and the
 * checks before bind() need the socket path in our hands anyway.
 */
#include "server.h"

#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "conn.h"
#include "deepepd.h"
#include "log.h"

/* Accepts per readable event: a connection storm cannot starve clients. */
#define SERVER_ACCEPT_BUDGET 64
/* How long accepting pauses when the process is out of fds. */
#define SERVER_EMFILE_PAUSE_MS 1000
#define SERVER_NSS_BUF 16384
#define SERVER_MAX_GROUPS 1024

static uv_loop_t *server_loop;
static int server_fd = -1;
static uv_poll_t server_poll;
static uv_timer_t server_pause;
static bool server_handles; /* poll and timer initialised */
static char server_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static dev_t server_dev;
static ino_t server_ino;

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

static bool server_group_listed(const struct config *cfg, uid_t uid, gid_t gid) {
  if (cfg->n_allow_groups == 0)
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
  for (size_t i = 0; i < cfg->n_allow_groups; i++) {
    gid_t want;
    if (!server_resolve_group(cfg->allow_groups[i], &want))
      continue;
    if (want == gid)
      return true;
    for (int k = 0; k < ng; k++)
      if (groups[k] == want)
        return true;
  }
  return false;
}

bool server_peer_allowed(const struct config *cfg, uid_t uid, gid_t gid) {
  if (uid == 0 || uid == getuid() || cfg->allow_any_user)
    return true;
  return server_user_listed(cfg, uid) || server_group_listed(cfg, uid, gid);
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
              "uid %u is not allowed by deepepd (allow.users / allow.groups in %s)",
              (unsigned)cred.uid,
              deepepd.config_path[0] ? deepepd.config_path : DEEPEPD_DEFAULT_CONFIG);
    return;
  }
  if (conn_count() > cfg->max_clients) {
    conn_fail(c, 0, DEP_ERR_LIMIT,
              "deepepd already serves %u clients (limits.max_clients); try again later or "
              "raise the limit",
              cfg->max_clients);
    return;
  }
}

static void server_on_readable(uv_poll_t *h, int status, int events);

static void server_on_resume(uv_timer_t *t) {
  if (server_fd < 0)
    return;
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

/*
 * What is at the path now: nothing (0), a stale socket we removed (0), or a
 * live daemon / something that is not a socket (-1, logged).
 */
static int server_probe(const char *path, const struct sockaddr_un *sa) {
  struct stat st;
  if (lstat(path, &st) != 0) {
    if (errno == ENOENT)
      return 0;
    log_warn("cannot inspect the socket path %s", path);
    return -1;
  }
  if (!S_ISSOCK(st.st_mode)) {
    log_errx("%s exists and is not a socket; refusing to replace it (remove it or choose "
             "another socket.path)",
             path);
    return -1;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    log_warn("socket");
    return -1;
  }
  /* Non-blocking: a live daemon with a full backlog answers EAGAIN, not a hang. */
  int rc = connect(fd, (const struct sockaddr *)sa, sizeof *sa);
  int err = errno;
  if (rc == 0 || err == EAGAIN || err == EINPROGRESS) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    char who[64] = "";
    if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid > 0)
      snprintf(who, sizeof who, " (pid %d)", (int)cred.pid);
    close(fd);
    log_errx("another deepepd is already listening on %s%s; stop it first (systemctl stop "
             "deepepd) or choose another socket.path",
             path, who);
    return -1;
  }
  close(fd);
  if (err != ECONNREFUSED) {
    errno = err;
    log_warn("cannot tell whether a daemon listens on %s", path);
    return -1;
  }
  if (unlink(path) != 0 && errno != ENOENT) {
    log_warn("cannot remove the stale socket %s", path);
    return -1;
  }
  log_notice("removed the stale socket %s (nobody was listening on it)", path);
  return 0;
}

static int server_set_access(const char *path, const struct config *cfg) {
  if (chmod(path, (mode_t)cfg->socket_mode) != 0) {
    log_warn("chmod %04o %s", (unsigned)cfg->socket_mode, path);
    return -1;
  }
  if (cfg->socket_group[0] != '\0') {
    gid_t gid;
    if (!server_resolve_group(cfg->socket_group, &gid)) {
      log_errx("socket.group %s: no such group", cfg->socket_group);
      return -1;
    }
    if (chown(path, (uid_t)-1, gid) != 0) {
      log_warn("chown %s to group %s", path, cfg->socket_group);
      return -1;
    }
  }
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
  if (server_probe(path, &sa) != 0)
    return -1;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    log_warn("socket");
    return -1;
  }
  /* Nobody can connect before listen(), so the mode is set in between. */
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    if (errno == EADDRINUSE)
      log_errx("another process created %s while deepepd was starting; is another deepepd "
               "starting?", path);
    else
      log_warn("bind %s", path);
    close(fd);
    return -1;
  }
  struct stat st;
  if (stat(path, &st) != 0 || server_set_access(path, cfg) != 0 || listen(fd, SOMAXCONN) != 0) {
    log_warn("cannot set up the socket %s", path);
    close(fd);
    unlink(path);
    return -1;
  }
  server_dev = st.st_dev;
  server_ino = st.st_ino;
  memcpy(server_path, path, len + 1);
  server_fd = fd;
  uv_poll_init(loop, &server_poll, fd);
  uv_timer_init(loop, &server_pause);
  server_handles = true;
  uv_poll_start(&server_poll, UV_READABLE, server_on_readable);
  log_info("listening on %s (mode %04o%s%s)", path, (unsigned)cfg->socket_mode,
           cfg->socket_group[0] ? ", group " : "", cfg->socket_group);
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
  /* Remove the file only if it is still ours: a successor may have made its own. */
  struct stat st;
  if (lstat(server_path, &st) == 0 && st.st_dev == server_dev && st.st_ino == server_ino) {
    if (unlink(server_path) != 0)
      log_warn("cannot remove the socket %s", server_path);
  }
  log_info("stopped listening on %s", server_path);
}
