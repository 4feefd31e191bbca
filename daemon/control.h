/*
 * control.h — deepepd's request handlers: one complete frame in, exactly
 * one reply out (now, or for ATTACH when the job's rendezvous completes).
 */
#ifndef DEP_DAEMON_CONTROL_H
#define DEP_DAEMON_CONTROL_H

#include <stddef.h>
#include <stdint.h>

#include "proto.h"

struct conn;

/* Handle one frame whose header was checked; body is h->body_len bytes. */
void control_handle(struct conn *c, const struct dep_frame_hdr *h, const uint8_t *body,
                    size_t len);

#endif /* DEP_DAEMON_CONTROL_H */
