/*
 * testhooks.c — the $DEEPEPD_TEST_* faults, read once at start (see
 * testhooks.h).  Every hook is a count of things to break on purpose.
 */
#include "testhooks.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

extern char **environ;

/* One row per hook, in enum testhook's order: its variable and what it does. */
static const struct testhook_row {
  const char *env;
  const char *what;
} testhook_rows[TESTHOOK_N_] = {
    [TESTHOOK_DATA_DROPS] = {TESTHOOK_DATA_DROPS_ENV,
                             "the first N inbound data connections are closed once acknowledged, "
                             "as when the network cuts one while the peer link stays up"},
    [TESTHOOK_RDMA_BAD_PROOFS] = {TESTHOOK_RDMA_BAD_PROOFS_ENV,
                                  "the first N link and N data RDMA queue pairs are each first "
                                  "requested with a wrong proof, then with the right one"},
    [TESTHOOK_JOIN_OVERTAKEN] = {TESTHOOK_JOIN_OVERTAKEN_ENV,
                                 "the first N rejoins of an elastic job find the survivors' calls "
                                 "past the join call once the epoch is out, as a busy job might"},
    [TESTHOOK_XCHG_FILL_HOLD_FD] = {TESTHOOK_XCHG_FILL_HOLD_FD_ENV,
                                    "a new job's exchange regions are mapped into this daemon "
                                    "only once descriptor N (inherited) is readable or closed, "
                                    "or the job ends"},
    [TESTHOOK_CPUS] = {TESTHOOK_CPUS_ENV,
                       "the daemon counts N CPUs as its own, whatever its affinity, as on a "
                       "larger machine (the proxy threads' default follows them)"},
    [TESTHOOK_AWAKE_US] = {TESTHOOK_AWAKE_US_ENV,
                           "the data path stays awake N us after its work, as where the daemon "
                           "serves GPUs: proxy threads look for work and receivers for their "
                           "connection's next frame, on any backend"},
};

/* Each hook's value, set by testhooks_init. */
static int testhook_values[TESTHOOK_N_];

/* s as a count from 0 to INT_MAX into *out: false when it is not one. */
static bool testhooks_parse(const char *s, int *out) {
  if (s[0] < '0' || s[0] > '9') /* no sign, no space: strtol would take them */
    return false;
  errno = 0;
  char *end;
  long v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v > INT_MAX)
    return false;
  *out = (int)v;
  return true;
}

/* A $DEEPEPD_TEST_* in the environment that names no hook: said, so that a misspelt
 * hook is not a test that quietly runs without its fault. */
static void testhooks_warn_unknown(void) {
  char names[256] = "";
  for (int h = 0, used = 0; h < TESTHOOK_N_ && used >= 0 && (size_t)used < sizeof names; h++)
    used += snprintf(names + used, sizeof names - (size_t)used, "%s$%s", h > 0 ? ", " : "",
                     testhook_rows[h].env);
  const size_t plen = strlen(TESTHOOKS_PREFIX);
  for (char **e = environ; *e != NULL; e++) {
    if (strncmp(*e, TESTHOOKS_PREFIX, plen) != 0)
      continue;
    const char *eq = strchr(*e, '=');
    size_t nlen = eq != NULL ? (size_t)(eq - *e) : strlen(*e);
    bool known = false;
    for (int h = 0; h < TESTHOOK_N_; h++)
      known |= strlen(testhook_rows[h].env) == nlen && strncmp(*e, testhook_rows[h].env, nlen) == 0;
    if (!known)
      log_warnx("test hooks: $%.*s is no test hook of this daemon and is ignored (the hooks: %s)",
                (int)nlen, *e, names);
  }
}

int testhooks_init(void) {
  char on[512] = "";
  size_t used = 0;
  for (int h = 0; h < TESTHOOK_N_; h++) {
    testhook_values[h] = 0;
    const char *s = getenv(testhook_rows[h].env);
    if (s == NULL || s[0] == '\0')
      continue;
    int v;
    if (!testhooks_parse(s, &v)) {
      log_warnx("test hooks: $%s=\"%s\" is ignored: not a whole number from 0 to %d "
                "(unset it, or set how many times to break: %s)",
                testhook_rows[h].env, s, INT_MAX, testhook_rows[h].what);
      continue;
    }
    testhook_values[h] = v;
    if (v > 0 && used < sizeof on) {
      int n = snprintf(on + used, sizeof on - used, "%s$%s=%d (%s)", used > 0 ? "; " : "",
                       testhook_rows[h].env, v, testhook_rows[h].what);
      used += n > 0 ? (size_t)n : 0;
    }
  }
  testhooks_warn_unknown();
  if (on[0] != '\0')
    log_warnx("test hooks: test faults are on, this daemon breaks its own connections on "
              "purpose: %s; unset $" TESTHOOKS_PREFIX "* outside tests", on);
  return 0;
}

void testhooks_fini(void) {
  memset(testhook_values, 0, sizeof testhook_values);
}

int testhook_value(enum testhook h) {
  return h >= 0 && h < TESTHOOK_N_ ? testhook_values[h] : 0;
}
