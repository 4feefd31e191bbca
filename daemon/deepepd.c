/*
 * deepepd.c — signals and the daemon's life cycle.  uv_signal turns the
 * signals into loop callbacks, so shutdown and reload run between requests
 * and never inside one.
 */
#include "deepepd.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "held.h"
#include "job.h"
#include "log.h"
#include "notify.h"

/* How long clients get to read their SHUTDOWN notice before they are closed. */
#define DEEPEPD_FLUSH_MS 1000

struct deepepd deepepd = {.backend_override = -1, .log_level_override = -1};

static uv_signal_t sig_term, sig_int, sig_hup;
static uv_timer_t stop_timer;
static bool handles_open;
static const struct deepepd_stop_ops *stop_ops;

uint64_t deepepd_uptime_ms(void) { return (uv_hrtime() - deepepd.start_ns) / 1000000u; }

const char *deepepd_state_name(void) {
  if (deepepd.stopping)
    return "stopping";
  if (deepepd.starting || deepepd.warming)
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
            stop_ops->clients(), DEEPEPD_FLUSH_MS);
  deepepd_finish();
}

void deepepd_shutdown(const char *why) {
  if (deepepd.stopping) {
    log_notice("%s again: stopping at once", why);
    deepepd_finish();
    return;
  }
  deepepd.stopping = true;
  log_notice("%s: shutting down (%u client(s) connected)", why, stop_ops->clients());
  notify_send("STOPPING=1");
  /* What the running jobs' ranks hold, for the daemon started next: they
   * keep computing on it (DESIGN §13). */
  held_save();
  stop_ops->stop_accepting();
  uv_timer_start(&stop_timer, deepepd_on_stop_timer, DEEPEPD_FLUSH_MS, 0);
  stop_ops->close_clients(deepepd_finish);
}

/* Apply the keys that may change while running: those config_keys.c's table marks live. */
static void deepepd_apply_live(struct config *run, const struct config *n) {
  config_copy_live(run, n);
  log_set_level((int)run->log_level);
}

/* ---- reload: the file is read on a worker thread and applied on the loop thread ---- */

/* Whom to tell when a reload ends. */
struct reload_waiter {
  deepepd_reload_done *done; /* NULL for SIGHUP: nobody waits */
  void *arg;
  struct reload_waiter *next;
};

/*
 * One reading of the file.  The worker thread fills cfg, rc, err and
 * accounts and touches nothing else; the loop thread reads them once the
 * worker is done (deepepd_reload_after).
 */
struct reload_run {
  uv_work_t work;
  char path[PATH_MAX];
  struct config cfg;               /* what the file says, over the defaults */
  int rc;                          /* config_load_file's */
  char err[DEP_MSG_TEXT_MAX - 64]; /* why it was refused */
  char accounts[DEP_MSG_TEXT_MAX]; /* users and groups it names that this host lacks */
  struct reload_waiter *waiters;
};

static struct reload_run *reload_running; /* being read; NULL when none is */
static bool reload_again;                 /* another was asked for meanwhile */
static struct reload_waiter *reload_next; /* the waiters of that one, in order */

static void deepepd_reload_begin(struct reload_waiter *w);

/* Tell every waiter of a list how its reload ended, and free the list. */
static void deepepd_reload_tell(struct reload_waiter *w, int rc,
                                const struct dep_msg_reload_ok *r) {
  while (w != NULL) {
    struct reload_waiter *next = w->next;
    if (w->done != NULL)
      w->done(w->arg, rc, r);
    free(w);
    w = next;
  }
}

/* The same for an end that changed nothing: msg alone, no key in either list. */
static void deepepd_reload_tell_msg(struct reload_waiter *w, int rc, const char *msg) {
  struct dep_msg_reload_ok r;
  memset(&r, 0, sizeof r);
  snprintf(r.message, sizeof r.message, "%s", msg);
  deepepd_reload_tell(w, rc, &r);
}

/*
 * Whether RELOADING=1 went out, so that READY=1 ends the reload.  Neither is
 * sent before the start's own READY=1 (it waits for the pools, the kernel
 * warm-up and the peers: a reload meanwhile must not announce readiness
 * early), nor once the daemon stops.
 */
static bool reload_notified;

/* The end of a reload for systemd (Type=notify-reload), which saw RELOADING=1 at its start. */
static void deepepd_reload_notify_ready(void) {
  if (!reload_notified || deepepd.stopping)
    return;
  reload_notified = false;
  notify_send("READY=1");
  notify_send("STATUS=listening on %s", deepepd.cfg.socket_path);
}

/* On a worker thread: only the run's own fields and functions that keep to their arguments. */
static void deepepd_reload_work(uv_work_t *req) {
  struct reload_run *run = req->data;
  config_defaults(&run->cfg);
  run->rc = config_load_file(&run->cfg, run->path, run->err, sizeof run->err);
  if (run->rc == 0)
    config_check_accounts(&run->cfg, CONFIG_ACCOUNTS_ALL, run->accounts, sizeof run->accounts);
}

/* Append to a reply's text, cut at its end (the log lines carry the whole). */
static void deepepd_msg_add(char *msg, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void deepepd_msg_add(char *msg, size_t len, const char *fmt, ...) {
  size_t used = strnlen(msg, len);
  if (used + 1 >= len)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg + used, len - used, fmt, ap);
  va_end(ap);
}

/* Apply what a run read into r: its message says what happened, its lists which keys changed.
 * 0 or DEP_ERR_*. */
static int deepepd_reload_apply(struct reload_run *run, int status, struct dep_msg_reload_ok *r) {
  char *msg = r->message;
  const size_t len = sizeof r->message;
  memset(r, 0, sizeof *r);
  if (deepepd.stopping) {
    snprintf(msg, len, "deepepd is stopping; nothing reloaded");
    return DEP_ERR_STATE;
  }
  if (status != 0 || run->rc != 0) {
    int rc = run->rc != 0 ? run->rc : DEP_ERR_INTERNAL;
    msg[0] = '\0';
    if (status != 0)
      deepepd_msg_add(msg, len, "%s: the reading did not run: %s", run->path,
                      uv_strerror(status));
    else
      deepepd_msg_add(msg, len, "%s", run->err);
    deepepd_msg_add(msg, len, "; keeping the running configuration");
    log_errx("reload: %s", msg);
    return rc;
  }
  struct config *n = &run->cfg;
  deepepd_apply_overrides(n);
  char restart[256], changes[1024], told[200];
  size_t k = config_diff_restart(&deepepd.cfg, n, restart, sizeof restart);
  size_t changed = config_diff_live(&deepepd.cfg, n, changes, sizeof changes);
  config_diff_live(&deepepd.cfg, n, told, sizeof told); /* the reply's shorter list */
  /* Every key fits (tests/check_config_reload.c holds the table to DEP_RELOAD_KEYS_MAX). */
  size_t na = config_diff_names(&deepepd.cfg, n, true, r->applied[0], sizeof r->applied[0],
                                DEP_RELOAD_KEYS_MAX);
  size_t nr = config_diff_names(&deepepd.cfg, n, false, r->restart[0], sizeof r->restart[0],
                                DEP_RELOAD_KEYS_MAX);
  r->n_applied = (uint32_t)(na < DEP_RELOAD_KEYS_MAX ? na : DEP_RELOAD_KEYS_MAX);
  r->n_restart = (uint32_t)(nr < DEP_RELOAD_KEYS_MAX ? nr : DEP_RELOAD_KEYS_MAX);
  deepepd_apply_live(&deepepd.cfg, n);
  if (strcmp(run->path, deepepd.config_path) != 0)
    snprintf(deepepd.config_path, sizeof deepepd.config_path, "%s", run->path);
  log_notice("reload: applied %s: %s", run->path, changed > 0 ? changes : "no live key changed");
  if (k > 0)
    log_warnx("reload: needs restart: %s (still running with the old values)", restart);
  if (run->accounts[0] != '\0')
    log_warnx("reload: %s", run->accounts);
  msg[0] = '\0';
  deepepd_msg_add(msg, len, "applied %.120s: %s; ", run->path,
                  changed > 0 ? told : "no live key changed");
  if (k > 0)
    deepepd_msg_add(msg, len, "needs restart (still running with the old values): %s", restart);
  else
    deepepd_msg_add(msg, len, "nothing needs a restart");
  if (run->accounts[0] != '\0')
    deepepd_msg_add(msg, len, "; %s", run->accounts);
  return 0;
}

/* On the loop thread once the worker is done: apply, answer, then start the one asked for
 * meanwhile. */
static void deepepd_reload_after(uv_work_t *req, int status) {
  struct reload_run *run = req->data;
  struct dep_msg_reload_ok r;
  int rc = deepepd_reload_apply(run, status, &r);
  reload_running = NULL;
  deepepd_reload_notify_ready();
  deepepd_reload_tell(run->waiters, rc, &r);
  free(run);
  if (reload_again) {
    struct reload_waiter *w = reload_next;
    reload_again = false;
    reload_next = NULL;
    deepepd_reload_begin(w);
  }
}

/* Start reading the file for waiters w, or queue them behind the reading under way. */
static void deepepd_reload_begin(struct reload_waiter *w) {
  char msg[DEP_MSG_TEXT_MAX];
  if (deepepd.stopping) {
    deepepd_reload_tell_msg(w, DEP_ERR_STATE, "deepepd is stopping; nothing reloaded");
    return;
  }
  if (reload_running != NULL) {
    struct reload_waiter **tail = &reload_next;
    while (*tail != NULL)
      tail = &(*tail)->next;
    *tail = w;
    reload_again = true;
    log_info("reload: %s is being read; this reload follows, reading it again",
             reload_running->path);
    return;
  }
  /* systemd (Type=notify-reload) wants the time the reload began with it. */
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  if (notify_ready_count() > 0) { /* ready, and not already reloading */
    notify_send("RELOADING=1\nMONOTONIC_USEC=%llu", (unsigned long long)ts.tv_sec * 1000000ull +
                                                        (unsigned long long)ts.tv_nsec / 1000u);
    reload_notified = true;
  }
  const char *path = deepepd.config_path;
  if (path[0] == '\0' && access(DEEPEPD_DEFAULT_CONFIG, F_OK) == 0)
    path = DEEPEPD_DEFAULT_CONFIG;
  if (path[0] == '\0') {
    snprintf(msg, sizeof msg,
             "running on the built-in defaults and there is no %s; nothing to reload",
             DEEPEPD_DEFAULT_CONFIG);
    log_notice("reload: %s", msg);
    deepepd_reload_notify_ready();
    deepepd_reload_tell_msg(w, 0, msg);
    return;
  }
  struct reload_run *run = calloc(1, sizeof *run);
  int rc = DEP_ERR_NO_MEMORY;
  if (run != NULL) {
    snprintf(run->path, sizeof run->path, "%s", path);
    run->waiters = w;
    run->work.data = run;
    rc = uv_queue_work(deepepd.loop, &run->work, deepepd_reload_work, deepepd_reload_after);
    if (rc == 0) {
      reload_running = run;
      return;
    }
    msg[0] = '\0';
    deepepd_msg_add(msg, sizeof msg, "cannot start reading %s: %s; keeping the running "
                    "configuration", path, uv_strerror(rc));
    rc = DEP_ERR_INTERNAL;
    free(run);
  } else {
    snprintf(msg, sizeof msg, "out of memory; keeping the running configuration");
  }
  log_errx("reload: %s", msg);
  deepepd_reload_notify_ready();
  deepepd_reload_tell_msg(w, rc, msg);
}

void deepepd_reload(deepepd_reload_done *done, void *arg) {
  struct reload_waiter *w = calloc(1, sizeof *w);
  if (w == NULL) {
    static const struct dep_msg_reload_ok oom = {
        .message = "out of memory; keeping the running configuration"};
    log_errx("reload: %s", oom.message);
    if (done != NULL)
      done(arg, DEP_ERR_NO_MEMORY, &oom);
    return;
  }
  w->done = done;
  w->arg = arg;
  deepepd_reload_begin(w);
}

static void deepepd_on_signal(uv_signal_t *h, int signum) {
  if (signum == SIGHUP) {
    log_info("SIGHUP: reloading the configuration");
    deepepd_reload(NULL, NULL); /* it logs what it did */
  } else {
    deepepd_shutdown(signum == SIGTERM ? "SIGTERM" : "SIGINT");
  }
}

int deepepd_init(uv_loop_t *loop, const struct deepepd_stop_ops *stop) {
  deepepd.loop = loop;
  stop_ops = stop;
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
