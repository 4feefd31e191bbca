/*
 * control.h — deepepd's request handlers: one complete frame in, exactly
 * one reply out (now, or for ATTACH when the job's rendezvous completes).
 */
#ifndef DEP_DAEMON_CONTROL_H
#define DEP_DAEMON_CONTROL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto.h"

struct conn;

/* STATUS_OK's record as viewer (a uid) may see it: its jobs, every device.
 * 0, or DEP_ERR_NO_MEMORY; free st->devices and st->jobs either way. */
int control_fill_status(struct dep_status *st, uid_t viewer);

/* Handle one frame whose header was checked; body is h->body_len bytes. */
void control_handle(struct conn *c, const struct dep_frame_hdr *h, const uint8_t *body,
                    size_t len);

/*
 * The device pools are made (rc 0): hand the ATTACH requests that waited
 * for them to the job table, in the order they came; or they could not be
 * (rc a DEP_ERR_*): fail each with rc and why.
 */
void control_attach_resume(int rc, const char *why);
/* Connection c is closing: forget its waiting ATTACH, if any. */
void control_conn_closed(struct conn *c);

/* What client connections call (conn_init's ops): control_handle for each
 * frame, control_conn_closed as one closes, the job table (job_conn_closed)
 * once its socket is gone. */
extern const struct conn_ops control_conn_ops;

#endif /* DEP_DAEMON_CONTROL_H */
