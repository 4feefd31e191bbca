/*
 * notify.h — the systemd readiness protocol (sd_notify), spoken directly:
 * one datagram per state change to $NOTIFY_SOCKET.  No libsystemd, so the
 * daemon builds and runs the same outside systemd, where this does nothing.
 */
#ifndef DEP_DAEMON_NOTIFY_H
#define DEP_DAEMON_NOTIFY_H

#include "log.h"

/* Read $NOTIFY_SOCKET and open the datagram socket (a no-op without it). */
void notify_init(void);
void notify_fini(void);
/* Send one state line such as "READY=1" or "STATUS=listening on ...". */
void notify_send(const char *fmt, ...) LOG_PRINTF(1, 2);
/* How many times READY=1 was sent (a reload sends it again), 0 while not
 * ready (before the first, after RELOADING=1 or STOPPING=1 until the next). */
unsigned notify_ready_count(void);

#endif /* DEP_DAEMON_NOTIFY_H */
