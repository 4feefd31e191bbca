/*
 * server.h — deepepd's listening socket: made safely (refuse when a live
 * daemon answers HELLO on it, replace a stale one, make a missing
 * directory, fail loudly on a path that does not fit), then accept,
 * identify the peer with SO_PEERCRED and admit it only if the allow-list
 * and the connection limits (total, reserved, per uid, fds) say so.
 */
#ifndef DEP_DAEMON_SERVER_H
#define DEP_DAEMON_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "config.h"

/*
 * Raise RLIMIT_NOFILE's soft limit to the hard one, make the socket at
 * cfg->socket_path (and its directory, when that alone is missing) and
 * start accepting.  0 or -1 (logged at priority err).
 */
int server_init(uv_loop_t *loop, const struct config *cfg);
/* Stop accepting, close the socket and remove its file (if it is still ours). */
void server_fini(void);

/*
 * Whether a peer of this uid/gid may use the daemon under cfg: root, the
 * daemon's own uid, allow.any_user, allow.users (names or numbers),
 * allow.groups (the peer's gid or any supplementary group of its user).
 */
bool server_peer_allowed(const struct config *cfg, uid_t uid, gid_t gid);

/* The connection limits in force: cfg's, clamped to what the fds allow. */
struct server_limits {
  uint32_t max_clients;       /* limits.max_clients, or fewer */
  uint32_t reserved_clients;  /* limits.reserved_clients, or fewer */
  bool clamped;               /* cfg's did not fit RLIMIT_NOFILE */
  uint64_t nofile;            /* RLIMIT_NOFILE's soft limit */
  uint64_t fds_kept;          /* of it, kept for the daemon, its pools and passed fds */
};

/*
 * Compute them from cfg (at every admission, so a reload applies at once);
 * a clamp, or its end, is logged when it changes.
 */
void server_client_limits(const struct config *cfg, struct server_limits *out);

#endif /* DEP_DAEMON_SERVER_H */
