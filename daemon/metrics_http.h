/*
 * metrics_http.h — metrics.listen (DESIGN §10): the Prometheus exposition
 * `deepepctl metrics` prints (render/ctl_view.c renders both), served over
 * plain HTTP for a scraper.  Off unless metrics.listen is set.
 *
 * GET /metrics only (a query string is ignored); any other path is 404,
 * any other method 405.  One request per connection (Connection: close),
 * its request line and headers at most METRICS_HTTP_REQ_MAX bytes (431
 * past that), the whole exchange within METRICS_HTTP_IDLE_MS, at most
 * METRICS_HTTP_CONNS connections at once: one more closes, of those still
 * waiting for their request, the oldest of the address holding the most,
 * so idle connections cannot deny a scraper its slot.
 * Everything runs on the loop without blocking it: libuv's non-blocking
 * TCP, and an exposition rendered in memory.  There is no authentication,
 * and a scrape shows every job's figures, as root's `deepepctl metrics`
 * would: bind it to loopback or a monitoring network.
 */
#ifndef DEP_DAEMON_METRICS_HTTP_H
#define DEP_DAEMON_METRICS_HTTP_H

#include <uv.h>

#include "config.h"

#define METRICS_HTTP_REQ_MAX 4096
#define METRICS_HTTP_IDLE_MS 5000
#define METRICS_HTTP_CONNS 16

/* Listen on cfg->metrics_listen (nothing when it is ""): 0, or -1 logged at
 * priority err (the address cannot be bound: the start fails). */
int metrics_http_init(uv_loop_t *loop, const struct config *cfg);
/* Stop listening and close every connection. */
void metrics_http_fini(void);

#endif /* DEP_DAEMON_METRICS_HTTP_H */
