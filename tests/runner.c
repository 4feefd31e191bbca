/*
 * runner.c — the one test runner: every suite, fork mode, TAP output on
 * stdout when DEP_TAP=1, a summary otherwise.
 *
 *   DEP_TEST_TAGS=gpu     run only tests tagged gpu (make check-gpu)
 *   DEP_TEST_SKIP=slow    exclude tests with these tags (comma or space)
 *   CK_RUN_SUITE / CK_RUN_CASE  Check's own filters still work
 *
 * Each test runs in its own process with a timeout (CK_DEFAULT_TIMEOUT,
 * raised per test case where a test needs longer).
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>

#include "suites.h"

#define DECLARE(name) Suite *name##_suite(void);
DEP_TEST_SUITES(DECLARE)
#undef DECLARE

int main(void) {
  SRunner *sr = NULL;
#define ADD(name)                              \
  if (sr == NULL)                              \
    sr = srunner_create(name##_suite());       \
  else                                         \
    srunner_add_suite(sr, name##_suite());
  DEP_TEST_SUITES(ADD)
#undef ADD
  srunner_set_fork_status(sr, CK_FORK);
  const char *tap = getenv("DEP_TAP");
  if (tap != NULL && tap[0] == '1')
    srunner_set_tap(sr, "-");
  srunner_run_tagged(sr, NULL, NULL, getenv("DEP_TEST_TAGS"), getenv("DEP_TEST_SKIP"),
                     tap != NULL && tap[0] == '1' ? CK_SILENT : CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
