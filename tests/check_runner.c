/*
 * check_runner.c — the test runner's report (runner.c): a test that skips
 * through tu_skip is counted and listed as skipped, with its reason, in the
 * summary and as "# SKIP" in TAP; a skip is never a failure, and a failure
 * stays one.
 *
 * The tests run the runner binary on its own hidden test case, "selftest",
 * which exists only while DEP_RUNNER_SELFTEST is set (so a plain run never
 * sees it): two passes, one whole skip, a loop test whose two runs skip,
 * and one test skipped in part; DEP_RUNNER_SELFTEST=fail adds a test that
 * skips a part and then fails.  The failures are listed after the skips,
 * next to the counts, so that the tail of a long log shows them.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemonwire.h"
#include "testutil.h"

#define SELFTEST_ENV "DEP_RUNNER_SELFTEST"

/* ---- the hidden case, run by the runner under test ---------------------- */

START_TEST(selftest_passes) {
  ck_assert_int_eq(1 + 1, 2);
}
END_TEST

START_TEST(selftest_passes_too) {
  ck_assert(true);
}
END_TEST

START_TEST(selftest_skips) {
  tu_skip(__func__, "nothing to run here");
  return;
}
END_TEST

START_TEST(selftest_skips_every_run) {
  tu_skip(__func__, "no run of this loop can run here");
  return;
}
END_TEST

START_TEST(selftest_skips_a_part) {
  tu_skip_part(__func__, "its second half needs what is missing");
  ck_assert(true);
}
END_TEST

START_TEST(selftest_fails_after_a_skipped_part) {
  tu_skip_part(__func__, "a part that is missing");
  ck_abort_msg("the rest fails");
}
END_TEST

/* ---- running the runner ---------------------------------------------------- */

/*
 * Run the runner on the hidden case with DEP_RUNNER_SELFTEST=mode and
 * DEP_TAP=tap (NULL: unset); its stdout in a malloc'd string, its exit code
 * in *code.
 */
static char *run_selftest(const char *mode, const char *tap, int *code) {
  char dir[200], out[256];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(out, sizeof out, "%s/out", dir);
  pid_t pid = dw_fork_stdout_to(out);
  if (pid == 0) {
    setenv(SELFTEST_ENV, mode, 1);
    setenv("CK_RUN_SUITE", "runner", 1);
    setenv("CK_RUN_CASE", "selftest", 1);
    const char *drop[] = {"DEP_TAP", "DEP_TEST_TAGS", "DEP_TEST_SKIP", "CK_VERBOSITY",
                          "CK_INCLUDE_TAGS", "CK_EXCLUDE_TAGS", TU_SKIPS_ENV};
    for (size_t i = 0; i < sizeof drop / sizeof drop[0]; i++)
      unsetenv(drop[i]);
    if (tap != NULL)
      setenv("DEP_TAP", tap, 1);
    execl(tu_bin("check_deepepd"), "check_deepepd", (char *)NULL);
    _exit(127);
  }
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st), "the runner died: status %d", st);
  *code = WEXITSTATUS(st);
  char *text = dw_slurp(out);
  tu_rmtree(dir);
  return text;
}

#define HAS(text, needle) ck_assert_msg(strstr(text, needle) != NULL, "no \"%s\" in:\n%s", needle, text)
#define LACKS(text, needle) \
  ck_assert_msg(strstr(text, needle) == NULL, "\"%s\" should not be in:\n%s", needle, text)

START_TEST(summary_counts_skipped_tests_apart_from_passes) {
  int code;
  char *text = run_selftest("1", NULL, &code);
  ck_assert_msg(code == 0, "the runner exited %d (skips are not failures):\n%s", code, text);
  HAS(text, "Checks: 6, Passed: 3, Skipped: 3, Failures: 0, Errors: 0\n");
  HAS(text, "Skipped (3, and 1 in part):\n");
  HAS(text, "  runner/selftest/selftest_skips: nothing to run here\n");
  HAS(text, "  runner/selftest/selftest_skips_every_run (2 runs): no run of this loop can run here\n");
  HAS(text, "  runner/selftest/selftest_skips_a_part (in part): its second half needs what is missing\n");
  /* The test's own line, as before. */
  HAS(text, "selftest_skips: skipped: nothing to run here\n");
  LACKS(text, "selftest_passes:");
  free(text);
}
END_TEST

START_TEST(tap_marks_skipped_tests_with_a_skip_directive) {
  int code;
  char *text = run_selftest("1", "1", &code);
  ck_assert_msg(code == 0, "the runner exited %d:\n%s", code, text);
  HAS(text, ":selftest:selftest_passes: Passed\n");
  HAS(text, ":selftest:selftest_skips # SKIP nothing to run here\n");
  HAS(text, ":selftest:selftest_skips_every_run # SKIP no run of this loop can run here\n");
  /* A test skipped in part did run: ok, with a diagnostic, not a directive. */
  HAS(text, ":selftest:selftest_skips_a_part: Passed\n# ");
  HAS(text, "a part not run: its second half needs what is missing\n");
  HAS(text, "\n1..6\n");
  int oks = 0, skips = 0;
  for (const char *p = text; (p = strstr(p, "\nok ")) != NULL; p++)
    oks++;
  for (const char *p = text; (p = strstr(p, " # SKIP ")) != NULL; p++)
    skips++;
  ck_assert_int_eq(oks + (strncmp(text, "ok ", 3) == 0), 6);
  ck_assert_int_eq(skips, 3);
  LACKS(text, "not ok");
  free(text);
}
END_TEST

START_TEST(a_failure_after_a_skip_is_a_failure) {
  int code;
  char *text = run_selftest("fail", NULL, &code);
  ck_assert_msg(code == 1, "the runner exited %d with a failing test:\n%s", code, text);
  HAS(text, "Checks: 7, Passed: 3, Skipped: 3, Failures: 1, Errors: 0\n");
  HAS(text, ":F:selftest:selftest_fails_after_a_skipped_part:0: the rest fails\n");
  LACKS(text, "runner/selftest/selftest_fails_after_a_skipped_part");
  /* Below the skip list, next to the counts, where a log's tail shows it. */
  const char *fails = strstr(text, ":F:selftest:");
  const char *skips = strstr(text, "Skipped (");
  ck_assert_msg(fails != NULL && skips != NULL && fails > skips,
                "the failure should follow the skip list:\n%s", text);
  free(text);
}
END_TEST

Suite *runner_suite(void);
Suite *runner_suite(void) {
  Suite *s = suite_create("runner");
  TCase *tc = tcase_create("summary");
  tcase_add_test(tc, summary_counts_skipped_tests_apart_from_passes);
  tcase_add_test(tc, tap_marks_skipped_tests_with_a_skip_directive);
  tcase_add_test(tc, a_failure_after_a_skip_is_a_failure);
  suite_add_tcase(s, tc);
  const char *mode = getenv(SELFTEST_ENV);
  if (mode != NULL && mode[0] != '\0') {
    TCase *st = tcase_create("selftest");
    tcase_add_test(st, selftest_passes);
    tcase_add_test(st, selftest_skips);
    tcase_add_loop_test(st, selftest_skips_every_run, 0, 2);
    tcase_add_test(st, selftest_skips_a_part);
    tcase_add_test(st, selftest_passes_too);
    if (strcmp(mode, "fail") == 0)
      tcase_add_test(st, selftest_fails_after_a_skipped_part);
    suite_add_tcase(s, st);
  }
  return s;
}
