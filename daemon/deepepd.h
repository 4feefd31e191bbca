/*
 * deepepd.h — the daemon's process-wide state (the running configuration,
 * where it came from, the command-line overrides) and its life cycle:
 * signals, shutdown and reload.
 */
#ifndef DEP_DAEMON_DEEPEPD_H
#define DEP_DAEMON_DEEPEPD_H

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "proto.h"

/* The configuration file read when -c is not given (and it exists). */
#define DEEPEPD_DEFAULT_CONFIG DEP_SYSCONFDIR "/deepepd/deepepd.yaml"

struct deepepd {
  uv_loop_t *loop;
  struct config cfg;            /* the running configuration */
  char config_path[PATH_MAX];   /* the file it came from; "" for the built-in defaults */
  /* command-line overrides, applied again after every reload */
  char socket_override[CONFIG_PATH_MAX]; /* "" for none */
  int backend_override;         /* -1 or an enum config_backend */
  int log_level_override;       /* -1 or an enum config_log_level */
  uint64_t start_ns;            /* uv_hrtime() at start */
  bool starting;                /* the device pools are being made */
  bool warming;                 /* ... then the kernel warm-up runs (warmup.h): STATUS says
                                   "starting" and READY=1 waits, but ATTACH is served */
  bool draining;                /* deepepctl drain: no new jobs */
  bool stopping;
};

extern struct deepepd deepepd;

/* Apply the command-line overrides to a configuration. */
void deepepd_apply_overrides(struct config *c);

/*
 * What shutdown asks of the layers above this one (main hands them in, so
 * that the life cycle calls nothing above it): `clients`, how many client
 * connections are open; `stop_accepting`, stop accepting and remove the
 * socket; `close_clients`, send every client its SHUTDOWN notice and call
 * `done` once the last one has gone (at once when there are none).
 */
struct deepepd_stop_ops {
  uint32_t (*clients)(void);
  void (*stop_accepting)(void);
  void (*close_clients)(void (*done)(void));
};

/* Watch SIGTERM, SIGINT (shutdown) and SIGHUP (reload); stop (kept, not
 * copied) is how shutdown reaches the server and the clients.  0 or -1. */
int deepepd_init(uv_loop_t *loop, const struct deepepd_stop_ops *stop);
void deepepd_fini(void);

/*
 * Stop: STOPPING=1, stop accepting and remove the socket, send every client
 * a SHUTDOWN notice, flush (bounded) and close them, then end the loop.
 */
void deepepd_shutdown(const char *why);
/*
 * How a reload ended: rc 0 or DEP_ERR_*; r's message says which live keys
 * changed and what needs a restart, or why nothing was applied, and its
 * lists name the keys applied and those that need a restart (both empty
 * when rc is not 0).  r lives only for the call.
 */
typedef void deepepd_reload_done(void *arg, int rc, const struct dep_msg_reload_ok *r);

/*
 * Re-read the configuration file and apply what can change live (SIGHUP,
 * RELOAD).  The file is read and checked on a libuv worker thread, so the
 * loop goes on serving meanwhile; what it says is applied on the loop
 * thread.  `done` (NULL: nobody waits) runs once, on the loop thread: when
 * the reload is applied or refused, or before deepepd_reload returns when
 * none can start (stopping, out of memory).  A reload asked for while
 * another is being read waits for it and then reads the file afresh (the
 * file may have changed since); every one asked for meanwhile shares that
 * second reading's outcome.
 */
void deepepd_reload(deepepd_reload_done *done, void *arg);

uint64_t deepepd_uptime_ms(void);

/* What STATUS reports as the daemon's state: "starting", "ready",
 * "draining" or "stopping" (deepep.h, struct dep_status). */
const char *deepepd_state_name(void);

#endif /* DEP_DAEMON_DEEPEPD_H */
