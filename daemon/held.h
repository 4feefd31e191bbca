/*
 * held.h — the held file: what this daemon has lent that live processes may
 * still hold, kept beside the socket (SOCKET.held) so that a daemon started
 * after this one stops — by SIGTERM or by SIGKILL — charges that memory to
 * its pools and to its users from the start (DESIGN §13).  It is rewritten
 * (write a temporary file, rename) whenever what is lent or held changes,
 * coalesced to once per loop turn, and once more when the daemon stops.
 *
 * One line per block, region or ghost (pool.h):
 *   UUID BYTES UID N PID:START ... (N holders; UUID as 32 hex digits)
 * The file is trusted only when it belongs to deepepd's own user and nobody
 * else may write it; every field is checked, and a bad line is skipped
 * with a warning.
 */
#ifndef DEP_DAEMON_HELD_H
#define DEP_DAEMON_HELD_H

#include <uv.h>

#include "config.h"

/* The file's path for a socket path: "SOCKET.held". */
void held_path(const char *socket_path, char *out, size_t len);

/*
 * Before the pools are made: read the file a previous daemon left (if
 * any) and preload its live entries into the pools (pool_preload_ghost).
 * Never fails the start: problems are logged.
 */
void held_load(const char *socket_path);

/* Start writing the file for this socket whenever held_changed() is called. */
void held_init(uv_loop_t *loop, const char *socket_path);
void held_fini(void);
/* What is lent or held changed: rewrite the file on this loop turn. */
void held_changed(void);
/* Write it now, and never again (the daemon is stopping: what it then lets
 * go of is still held by the ranks, as this last write says). */
void held_save(void);

#endif /* DEP_DAEMON_HELD_H */
