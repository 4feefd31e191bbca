/*
 * clienttest.h — what the client suites share (check_client.c,
 * check_client_daemon.c): a client handle, one connected to a daemon (which
 * the other suites use too) and a valid attach.  Prefix cl_.
 */
#ifndef DEP_CLIENTTEST_H
#define DEP_CLIENTTEST_H

#include <stdint.h>

#include "deepep.h"

/* A new client handle; the test fails if the library gives none. */
dep_client_t *cl_new_client(void);
/* A new client handle connected to the daemon at sock; the test fails,
 * with the library's message, if it does not connect. */
dep_client_t *cl_connect(const char *sock);
/* A valid attach for rank `rank` of a two-rank, one-node job. */
struct dep_attach_args cl_attach_args(const char *job, uint32_t rank);

#endif /* DEP_CLIENTTEST_H */
