/*
 * protosamples.h — valid messages of the control protocol, every field set,
 * for the proto suites (check_proto.c, check_proto_fuzz.c) to encode, cut
 * and mangle.
 */
#ifndef DEP_TEST_PROTOSAMPLES_H
#define DEP_TEST_PROTOSAMPLES_H

#include <stdint.h>

#include "proto.h"

/* A STATUS_OK body of ndev devices and njob jobs, every field set (free with
 * dep_status_free). */
struct dep_status *sample_status(uint32_t ndev, uint32_t njob);

/* An ATTACH whose every field is set and valid. */
struct dep_attach_args sample_attach(void);

/* One valid message of every body-carrying type, for the rejection tests. */
struct sample {
  uint16_t type;
  const void *msg;
};

/* The samples themselves (s_attach is set by samples). */
extern struct dep_msg_error s_err;
extern struct dep_msg_hello s_hello;
extern struct dep_msg_hello_ok s_hello_ok;
extern struct dep_msg_attach_ok s_attach_ok;
extern struct dep_msg_slab s_slab;
extern struct dep_attach_args s_attach;
extern struct dep_msg_reload_ok s_reload_ok;

/* Fill out with one sample of every body-carrying type, *st the STATUS_OK
 * one's body (the caller frees it); their count. */
int samples(struct sample *out, struct dep_status **st);

#endif /* DEP_TEST_PROTOSAMPLES_H */
