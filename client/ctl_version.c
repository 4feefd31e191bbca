/*
 * ctl_version.c — `deepepctl version` and `deepepctl -V`: deepepctl's own
 * version and protocol, and for `version` the daemon's as its HELLO
 * answers them.  A daemon that does not answer is part of the answer, not
 * a failure: the exit status is 0 and the daemon's record is empty (null
 * in JSON), saying why.
 */
#include <stdio.h>

#include "client_internal.h"
#include "ctl.h"

/* The JSON keys are an interface: deepepctl(1) lists them; never rename. */
static const struct ctl_col version_fields[] = {
    {"version", "deepepctl", CTL_STR, 0},
    {"proto_version", "protocol", CTL_UINT, 0},
};
#define VERSION_NFIELDS (sizeof version_fields / sizeof version_fields[0])

static const struct ctl_col daemon_cols[] = {
    {"version", "VERSION", CTL_STR, 0},
    {"proto_version", "PROTOCOL", CTL_UINT, 0},
    {"backend", "BACKEND", CTL_STR, 0},
};
#define DAEMON_NCOLS (sizeof daemon_cols / sizeof daemon_cols[0])

int ctl_version_show(const struct ctl *ctl, bool ask_daemon) {
  const struct ctl_val fields[VERSION_NFIELDS] = {{.s = DEP_VERSION_STRING},
                                                  {.u = DEP_PROTO_VERSION}};
  struct ctl_val row[DAEMON_NCOLS] = {{.s = NULL}};
  char why[CLIENT_ERRMSG_MAX] = "";
  struct ctl_table daemon = {"daemon", why, daemon_cols, DAEMON_NCOLS, 0, row, CTL_TABLE_ONE};
  dep_client_t *c = NULL;
  if (ask_daemon) {
    int rc = dep_client_new(&c);
    if (rc == 0) {
      rc = ctl_dep_connect(ctl, c);
    }
    if (rc == 0) {
      /* HELLO_OK says it all; c stays open until the row is rendered. */
      row[0].s = c->hello.daemon_version;
      row[1].u = c->hello.version;
      row[2].s = c->hello.backend;
      daemon.nrows = 1;
    } else {
      /* The library's message names the path and what to do. */
      snprintf(why, sizeof why, "%s", c != NULL ? dep_errmsg(c) : dep_strerror(rc));
    }
  }
  const struct ctl_doc doc = {version_fields, fields, VERSION_NFIELDS, &daemon,
                              ask_daemon ? 1 : 0};
  int rc = ctl_out_render(stdout, &doc, ctl->json);
  dep_client_free(c);
  if (rc != 0)
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  return ctl_finish_output(CTL_EXIT_OK);
}

int ctl_version(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  return ctl_version_show(ctl, true);
}
