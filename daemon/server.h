/*
 * server.h — deepepd's listening socket: made safely (refuse when a live
 * daemon answers, reclaim a stale socket file, fail loudly on a path that
 * does not fit), then accept, identify the peer with SO_PEERCRED and admit
 * it only if the allow-list says so.
 */
#ifndef DEP_DAEMON_SERVER_H
#define DEP_DAEMON_SERVER_H

#include <stdbool.h>
#include <sys/types.h>
#include <uv.h>

#include "config.h"

/* Make the socket at cfg->socket_path and start accepting.  0 or -1 (logged). */
int server_init(uv_loop_t *loop, const struct config *cfg);
/* Stop accepting, close the socket and remove its file (if it is still ours). */
void server_fini(void);

/*
 * Whether a peer of this uid/gid may use the daemon under cfg: root, the
 * daemon's own uid, allow.any_user, allow.users (names or numbers),
 * allow.groups (the peer's gid or any supplementary group of its user).
 */
bool server_peer_allowed(const struct config *cfg, uid_t uid, gid_t gid);

#endif /* DEP_DAEMON_SERVER_H */
