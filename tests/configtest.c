/*
 * configtest.c — the configuration suites' loader (configtest.h).
 */
#include "configtest.h"

#include <check.h>
#include <string.h>

char ct_err[1024];

int ct_load(struct config *c, const char *yaml) {
  return config_load_buffer(c, "t.yaml", yaml, strlen(yaml), ct_err, sizeof ct_err);
}

void ct_load_ok(struct config *c, const char *yaml) {
  config_defaults(c);
  int rc = ct_load(c, yaml);
  ck_assert_msg(rc == 0, "refused (%d): %s\n--- yaml:\n%s", rc, ct_err, yaml);
}
