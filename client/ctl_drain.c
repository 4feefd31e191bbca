/*
 * ctl_drain.c — `deepepctl drain`: ask deepepd to take no new jobs while
 * the running ones (and ranks still joining a job that is gathering) go on,
 * as before maintenance; `--cancel` takes jobs again; `--wait` then polls
 * STATUS until no job is left, or `--timeout` passes.  Only root and
 * deepepd's own user may drain it.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client_internal.h"
#include "ctl.h"

/* How often --wait asks again: a job's end is seen within this. */
#define DRAIN_POLL_MS 200
/* The longest --timeout, a year: beyond it, leave --timeout out. */
#define DRAIN_TIMEOUT_MAX_S (366.0 * 86400.0)

enum { DRAIN_OPT_CANCEL = 256, DRAIN_OPT_WAIT, DRAIN_OPT_TIMEOUT };

static const struct option drain_longopts[] = {
    CTL_COMMON_LONGOPTS,
    {"cancel", no_argument, NULL, DRAIN_OPT_CANCEL},
    {"wait", no_argument, NULL, DRAIN_OPT_WAIT},
    {"timeout", required_argument, NULL, DRAIN_OPT_TIMEOUT},
    {NULL, 0, NULL, 0},
};

struct drain_opts {
  bool cancel;
  bool wait;
  double timeout_s; /* < 0: wait for ever */
};

static int64_t drain_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void drain_sleep_ms(int64_t ms) {
  struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static int drain_parse(struct ctl *ctl, int argc, char **argv, struct drain_opts *o) {
  o->cancel = false;
  o->wait = false;
  o->timeout_s = -1;
  bool timeout = false;
  ctl_getopt_begin();
  int ch;
  while ((ch = getopt_long(argc, argv, CTL_COMMON_SHORTOPTS, drain_longopts, NULL)) != -1) {
    switch (ch) {
    case DRAIN_OPT_CANCEL:
      o->cancel = true;
      break;
    case DRAIN_OPT_WAIT:
      o->wait = true;
      break;
    case DRAIN_OPT_TIMEOUT: {
      char *end = NULL;
      errno = 0;
      double s = strtod(optarg, &end);
      if (end == optarg || *end != '\0' || errno != 0 || !isfinite(s) || s < 0 ||
          s > DRAIN_TIMEOUT_MAX_S)
        return ctl_usage_error(ctl,
                               "--timeout needs a number of seconds from 0 to %.0f, not \"%s\"",
                               DRAIN_TIMEOUT_MAX_S, optarg);
      o->timeout_s = s;
      timeout = true;
      break;
    }
    default: {
      int rc = ctl_common_option(ctl, ch, argv);
      if (rc >= 0)
        return rc;
    }
    }
  }
  int rc = ctl_common_end(ctl);
  if (rc >= 0)
    return rc;
  if (optind < argc)
    return ctl_usage_error(ctl, "drain takes no argument \"%s\"", argv[optind]);
  if (o->cancel && (o->wait || timeout))
    return ctl_usage_error(ctl, "drain --cancel takes neither --wait nor --timeout");
  if (timeout && !o->wait)
    return ctl_usage_error(ctl, "--timeout goes with --wait");
  return -1;
}

/* "job-a (ranks 2/2), job-b (ranks 1/2)" for the jobs still running. */
static void drain_job_list(char *buf, size_t len, const struct dep_status *st) {
  size_t used = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < st->num_jobs && used < len; i++) {
    const struct dep_status_job *j = &st->jobs[i];
    int n = snprintf(buf + used, len - used, "%s%s (ranks %u/%u)", i > 0 ? ", " : "", j->job_id,
                     j->ranks_attached, j->ranks_expected);
    if (n < 0)
      break;
    used += (size_t)n;
  }
}

/*
 * Poll STATUS on c until the daemon holds no job, the deadline passes or
 * the drain is lifted under us (new jobs could then keep it busy for
 * ever).  Returns -1 when no job is left, else the exit code after
 * reporting why; c is freed either way once it fails.
 */
static int drain_wait(const struct ctl *ctl, dep_client_t *c, const struct drain_opts *o,
                      int64_t start) {
  int64_t deadline = o->timeout_s < 0 ? -1 : start + (int64_t)llround(o->timeout_s * 1000.0);
  for (;;) {
    struct dep_status *st = NULL;
    int rc = dep_status(c, &st);
    if (rc != 0)
      return ctl_fail_client(ctl, c, rc, "drain --wait");
    if (st->num_jobs == 0) {
      dep_status_free(st);
      return -1;
    }
    char jobs[CLIENT_ERRMSG_MAX];
    drain_job_list(jobs, sizeof jobs, st);
    /* "starting" outranks "draining" in the state's name; only "ready" means
     * the drain is off. */
    if (strcmp(st->state, "ready") == 0) {
      rc = ctl_fail(ctl, DEP_ERR_STATE,
                    "drain --wait: deepepd takes new jobs again (the drain was cancelled); "
                    "%u job(s) running: %s",
                    st->num_jobs, jobs);
      dep_status_free(st);
      dep_client_free(c);
      return rc;
    }
    int64_t now = drain_now_ms();
    if (deadline >= 0 && now >= deadline) {
      rc = ctl_fail(ctl, DEP_ERR_TIMEOUT,
                    "drain --wait: %u job(s) still running after %g s: %s; deepepd stays "
                    "draining (`deepepctl drain --cancel` takes new jobs again)",
                    st->num_jobs, o->timeout_s, jobs);
      dep_status_free(st);
      dep_client_free(c);
      return rc;
    }
    dep_status_free(st);
    drain_sleep_ms(deadline >= 0 && deadline - now < DRAIN_POLL_MS ? deadline - now
                                                                   : DRAIN_POLL_MS);
  }
}

int ctl_drain(struct ctl *ctl, int argc, char **argv) {
  struct drain_opts o;
  int rc = drain_parse(ctl, argc, argv, &o);
  if (rc >= 0)
    return rc;
  int64_t start = drain_now_ms();
  dep_client_t *c = ctl_connect(ctl);
  if (c == NULL)
    return CTL_EXIT_FAIL;
  struct dep_msg_drain req = {.drain = o.cancel ? 0 : 1};
  struct dep_msg_text m;
  rc = ctl_ask(c, DEP_MSG_DRAIN, &req, DEP_MSG_DRAIN_OK, ctl_decode_text, &m);
  if (rc != 0)
    return ctl_fail_client(ctl, c, rc, "drain");
  if (o.wait) {
    rc = drain_wait(ctl, c, &o, start);
    if (rc >= 0)
      return rc;
  }
  dep_client_free(c);
  static const struct ctl_col cols[] = {
      {"result", "drain", CTL_STR, 0},
      {"waited_ms", "waited", CTL_MS, 0},
  };
  const struct ctl_val vals[] = {{.s = m.text}, {.u = (uint64_t)(drain_now_ms() - start)}};
  const struct ctl_doc doc = {cols, vals, o.wait ? 2 : 1, NULL, 0};
  ctl_out_render(stdout, &doc, ctl->json);
  return ctl_finish_output(CTL_EXIT_OK);
}
