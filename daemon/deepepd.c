/*
 * deepepd.c — signals and the daemon's life cycle.  uv_signal turns the
 * signals into loop callbacks, so shutdown and reload run between requests
 * and never inside one.
 */
#include "deepepd.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "conn.h"
#include "held.h"
#include "job.h"
#include "log.h"
#include "notify.h"
#include "server.h"

/* How long clients get to read their SHUTDOWN notice before they are closed. */
#define DEEPEPD_FLUSH_MS 1000

struct deepepd deepepd = {.backend_override = -1, .log_level_override = -1};

static uv_signal_t sig_term, sig_int, sig_hup;
static uv_timer_t stop_timer;
static bool handles_open;

uint64_t deepepd_uptime_ms(void) { return (uv_hrtime() - deepepd.start_ns) / 1000000u; }

const char *deepepd_state_name(void) {
  if (deepepd.stopping)
    return "stopping";
  if (deepepd.starting)
    return "starting";
  return deepepd.draining ? "draining" : "ready";
}

void deepepd_apply_overrides(struct config *c) {
  if (deepepd.socket_override[0] != '\0')
    snprintf(c->socket_path, sizeof c->socket_path, "%s", deepepd.socket_override);
  if (deepepd.backend_override >= 0)
    c->backend = (enum config_backend)deepepd.backend_override;
  if (deepepd.log_level_override >= 0)
    c->log_level = (enum config_log_level)deepepd.log_level_override;
}

/* Every client is gone, or the flush time is up: end the loop. */
static void deepepd_finish(void) {
  uv_timer_stop(&stop_timer);
  log_info("stopped");
  uv_stop(deepepd.loop);
}

static void deepepd_on_stop_timer(uv_timer_t *t) {
  log_warnx("shutdown: %u client(s) did not take their SHUTDOWN notice within %d ms; closing "
            "them",
            conn_count(), DEEPEPD_FLUSH_MS);
  deepepd_finish();
}

void deepepd_shutdown(const char *why) {
  if (deepepd.stopping) {
    log_notice("%s again: stopping at once", why);
    deepepd_finish();
    return;
  }
  deepepd.stopping = true;
  log_notice("%s: shutting down (%u client(s) connected)", why, conn_count());
  notify_send("STOPPING=1");
  /* What the running jobs' ranks hold, for the daemon started next: they
   * keep computing on it (DESIGN §13). */
  held_save();
  server_fini();
  uv_timer_start(&stop_timer, deepepd_on_stop_timer, DEEPEPD_FLUSH_MS, 0);
  conn_shutdown_all(deepepd_finish);
}

/* Copy the keys that may change while running (those config.c marks live). */
static void deepepd_apply_live(struct config *run, const struct config *n) {
  run->n_allow_users = n->n_allow_users;
  memcpy(run->allow_users, n->allow_users, sizeof run->allow_users);
  run->n_allow_groups = n->n_allow_groups;
  memcpy(run->allow_groups, n->allow_groups, sizeof run->allow_groups);
  run->allow_any_user = n->allow_any_user;
  run->pool_max_allocation = n->pool_max_allocation; /* the next job's arenas are split by it */
  run->kernel_warmup = n->kernel_warmup;
  run->adaptive_optimization = n->adaptive_optimization;
  run->warn_first_call_ratio = n->warn_first_call_ratio;
  run->max_clients = n->max_clients;
  run->max_jobs = n->max_jobs;
  run->attach_timeout_ms = n->attach_timeout_ms;
  run->op_timeout_ms = n->op_timeout_ms;
  run->client_queue_bytes = n->client_queue_bytes;
  run->hello_timeout_ms = n->hello_timeout_ms;
  run->reserved_clients = n->reserved_clients;
  run->max_clients_per_uid = n->max_clients_per_uid;
  run->max_jobs_per_uid = n->max_jobs_per_uid;
  run->memory_per_uid = n->memory_per_uid;
  run->log_level = n->log_level;
  log_set_level((int)run->log_level);
}

int deepepd_reload(char *msg, size_t len) {
  if (deepepd.stopping) {
    snprintf(msg, len, "deepepd is stopping; nothing reloaded");
    return DEP_ERR_STATE;
  }
  /* systemd (Type=notify-reload) wants the time the reload began with it. */
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  notify_send("RELOADING=1\nMONOTONIC_USEC=%llu",
              (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000u);
  const char *path = deepepd.config_path;
  if (path[0] == '\0' && access(DEEPEPD_DEFAULT_CONFIG, F_OK) == 0)
    path = DEEPEPD_DEFAULT_CONFIG;
  int rc = 0;
  struct config *n = malloc(sizeof *n);
  if (n == NULL) {
    rc = DEP_ERR_NO_MEMORY;
    snprintf(msg, len, "out of memory; keeping the running configuration");
    log_errx("reload: %s", msg);
  } else if (path[0] == '\0') {
    snprintf(msg, len, "running on the built-in defaults and there is no %s; nothing to reload",
             DEEPEPD_DEFAULT_CONFIG);
    log_notice("reload: %s", msg);
  } else {
    char err[DEP_MSG_TEXT_MAX - 64];
    config_defaults(n);
    if (config_load_file(n, path, err, sizeof err) != 0) {
      rc = DEP_ERR_CONFIG;
      snprintf(msg, len, "%s; keeping the running configuration", err);
      log_errx("reload: %s", msg);
    } else {
      deepepd_apply_overrides(n);
      char keys[256];
      size_t k = config_diff_restart(&deepepd.cfg, n, keys, sizeof keys);
      deepepd_apply_live(&deepepd.cfg, n);
      if (path != deepepd.config_path)
        snprintf(deepepd.config_path, sizeof deepepd.config_path, "%s", path);
      log_notice("reload: applied %s (log_level %s)", path,
                 config_log_level_name(deepepd.cfg.log_level));
      if (k > 0)
        log_warnx("reload: needs restart: %s (still running with the old values)", keys);
      snprintf(msg, len, "applied %.200s; %s%s", path,
               k > 0 ? "needs restart (still running with the old values): " : "nothing needs a restart",
               k > 0 ? keys : "");
    }
  }
  free(n);
  notify_send("READY=1");
  notify_send("STATUS=listening on %s", deepepd.cfg.socket_path);
  return rc;
}

static void deepepd_on_signal(uv_signal_t *h, int signum) {
  if (signum == SIGHUP) {
    log_info("SIGHUP: reloading the configuration");
    char msg[DEP_MSG_TEXT_MAX];
    deepepd_reload(msg, sizeof msg); /* it logs what it did */
  } else {
    deepepd_shutdown(signum == SIGTERM ? "SIGTERM" : "SIGINT");
  }
}

int deepepd_init(uv_loop_t *loop) {
  deepepd.loop = loop;
  deepepd.start_ns = uv_hrtime();
  uv_signal_init(loop, &sig_term);
  uv_signal_init(loop, &sig_int);
  uv_signal_init(loop, &sig_hup);
  uv_timer_init(loop, &stop_timer);
  handles_open = true;
  int rc = uv_signal_start(&sig_term, deepepd_on_signal, SIGTERM);
  if (rc == 0)
    rc = uv_signal_start(&sig_int, deepepd_on_signal, SIGINT);
  if (rc == 0)
    rc = uv_signal_start(&sig_hup, deepepd_on_signal, SIGHUP);
  if (rc != 0) {
    log_errx("cannot watch signals: %s", uv_strerror(rc));
    return -1;
  }
  return 0;
}

void deepepd_fini(void) {
  if (!handles_open)
    return;
  uv_close((uv_handle_t *)&sig_term, NULL);
  uv_close((uv_handle_t *)&sig_int, NULL);
  uv_close((uv_handle_t *)&sig_hup, NULL);
  uv_close((uv_handle_t *)&stop_timer, NULL);
  handles_open = false;
}
