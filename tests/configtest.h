/*
 * configtest.h — what the configuration suites share (check_config.c,
 * check_config_defaults.c, check_config_bounds.c, check_config_reload.c): a YAML text loaded as the
 * file "t.yaml", the loader's message when it refuses one, and two device
 * UUIDs in the spellings a file may use.  Prefix ct_.
 */
#ifndef DEP_CONFIGTEST_H
#define DEP_CONFIGTEST_H

#include "config.h"

#define CT_UUID1 "GPU-5fa1c2e0-1b2c-3d4e-5f60-718293a4b5c6"
#define CT_UUID2 "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"

/* The message of the last ct_load that refused its text. */
extern char ct_err[1024];

/* Load yaml over *c as the file "t.yaml": 0, or the loader's error with ct_err saying why. */
int ct_load(struct config *c, const char *yaml);
/* Defaults, then the text; the test fails with the loader's message if it is refused. */
void ct_load_ok(struct config *c, const char *yaml);
/* A text file of the repository (tests run from its root), whole, in a static buffer that the
 * next call reuses; the test fails when it cannot be read. */
char *ct_read_text(const char *path);
/* Every field of a equal to b's, one by one (padding bytes may differ, so no memcmp). */
void ct_assert_same_config(const struct config *a, const struct config *b);

#endif /* DEP_CONFIGTEST_H */
