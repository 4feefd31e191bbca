/*
 * runner.c — the one test runner: every suite, fork mode, and a summary that
 * tells passes, skips, failures and errors apart (TAP on stdout instead when
 * DEP_TAP=1).
 *
 *   DEP_TEST_TAGS=gpu     run only tests tagged gpu (make check-gpu)
 *   DEP_TEST_SKIP=slow    exclude tests with these tags (comma or space)
 *   CK_RUN_SUITE / CK_RUN_CASE  Check's own filters still work
 *   CK_VERBOSITY=verbose  print every test's result line, not only failures
 *
 * Each test runs in its own process with a timeout (CK_DEFAULT_TIMEOUT,
 * raised per test case where a test needs longer).
 *
 * Check knows only passes, failures and errors, so a test that cannot run
 * here (no GPU, not root) would count as a pass.  Such a test calls tu_skip
 * (testutil.h), which appends a line to the file named by $DEP_SKIP_RECORD;
 * the runner sets that variable, has Check log one line per test run to a
 * file of its own (the log names suite, case, test and iteration), and
 * after the run pairs the two in the order the tests ran: a passing run of a
 * test takes that test's next skip line.  (A skip line does not know its
 * loop iteration, so a loop test whose runs skip only some of the time is
 * counted right but may have a skip shown against the wrong run.)  Skips
 * are not failures: the exit status is that of the failures and errors alone.
 */
#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "suites.h"
#include "testutil.h"

#define DECLARE(name) Suite *name##_suite(void);
DEP_TEST_SUITES(DECLARE)
#undef DECLARE

/* One test run, from a line of Check's log "file:line:K:case:test:iter: msg". */
struct result {
  char *suite, *file, *tcase, *test, *msg;
  int line, iter;
  char kind;               /* 'P', 'F' or 'E' */
  const char *skip;        /* why the whole test was skipped, or NULL */
  const char *part;        /* why a part of it was skipped, or NULL (the last one) */
};

/* One line of $DEP_SKIP_RECORD: "test\tskip|part\twhy". */
struct skip {
  char *test, *why;
  bool whole;
};

struct run {
  struct result *res;
  size_t nres;
  struct skip *skips;
  size_t nskips;
};

static void *xrealloc(void *p, size_t n) {
  p = realloc(p, n);
  if (p == NULL) {
    perror("runner");
    exit(EXIT_FAILURE);
  }
  return p;
}

static char *xstrdup(const char *s) {
  return strcpy(xrealloc(NULL, strlen(s) + 1), s);
}

/* Split off the text up to the next ':' (NULL when there is none). */
static char *field(char **p) {
  char *s = *p, *c = strchr(s, ':');
  if (c == NULL)
    return NULL;
  *c = '\0';
  *p = c + 1;
  return s;
}

static bool all_digits(const char *s) {
  if (*s == '\0')
    return false;
  for (; *s != '\0'; s++)
    if (*s < '0' || *s > '9')
      return false;
  return true;
}

/* Parse a result line in place into *r; false when the line is not one. */
static bool parse_result(char *s, const char *suite, struct result *r) {
  char *file = field(&s), *line = file ? field(&s) : NULL, *kind = line ? field(&s) : NULL;
  char *tcase = kind ? field(&s) : NULL, *test = tcase ? field(&s) : NULL;
  char *iter = test ? field(&s) : NULL;
  if (iter == NULL || !all_digits(line) || !all_digits(iter) || strlen(kind) != 1 ||
      strchr("PFE", kind[0]) == NULL || s[0] != ' ')
    return false;
  *r = (struct result){.suite = xstrdup(suite), .file = xstrdup(file), .tcase = xstrdup(tcase),
                       .test = xstrdup(test), .msg = xstrdup(s + 1), .line = atoi(line),
                       .iter = atoi(iter), .kind = kind[0]};
  return true;
}

/* Read Check's log: "Running suite NAME" lines, then a result line per test run. */
static void read_log(const char *path, struct run *run) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return;
  char *buf = NULL, suite[256] = "";
  size_t cap = 0;
  ssize_t n;
  while ((n = getline(&buf, &cap, f)) > 0) {
    if (buf[n - 1] == '\n')
      buf[--n] = '\0';
    if (strncmp(buf, "Running suite ", 14) == 0) {
      snprintf(suite, sizeof suite, "%s", buf + 14);
      continue;
    }
    if (strcmp(buf, "Results for all suites run:") == 0)
      break;
    char *copy = xstrdup(buf);
    struct result r;
    if (parse_result(copy, suite, &r)) {
      run->res = xrealloc(run->res, (run->nres + 1) * sizeof *run->res);
      run->res[run->nres++] = r;
    } else if (run->nres > 0) {
      /* A message of several lines: the rest of the last result's. */
      struct result *last = &run->res[run->nres - 1];
      size_t len = strlen(last->msg);
      last->msg = xrealloc(last->msg, len + strlen(buf) + 2);
      sprintf(last->msg + len, "\n%s", buf);
    }
    free(copy);
  }
  free(buf);
  fclose(f);
}

static void read_skips(const char *path, struct run *run) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return;
  char *buf = NULL;
  size_t cap = 0;
  ssize_t n;
  while ((n = getline(&buf, &cap, f)) > 0) {
    if (buf[n - 1] == '\n')
      buf[--n] = '\0';
    char *kind = strchr(buf, '\t'), *why = kind ? strchr(kind + 1, '\t') : NULL;
    if (why == NULL)
      continue;
    *kind++ = '\0';
    *why++ = '\0';
    run->skips = xrealloc(run->skips, (run->nskips + 1) * sizeof *run->skips);
    run->skips[run->nskips++] =
        (struct skip){.test = xstrdup(buf), .why = xstrdup(why), .whole = strcmp(kind, "skip") == 0};
  }
  free(buf);
  fclose(f);
}

/*
 * Give each test run the skip lines it wrote: the next lines in the file
 * with its test's name, up to and including one whole skip (a loop test's
 * runs each take their own).  A skip line of a run that then failed stays
 * with it and is not reported: the failure is.
 */
static void pair_skips(struct run *run) {
  size_t next = 0;
  for (size_t i = 0; i < run->nres && next < run->nskips; i++) {
    struct result *r = &run->res[i];
    while (next < run->nskips && strcmp(run->skips[next].test, r->test) == 0) {
      const struct skip *s = &run->skips[next++];
      if (r->kind == 'P' && s->whole)
        r->skip = s->why;
      else if (r->kind == 'P')
        r->part = s->why;
      if (s->whole)
        break;
    }
  }
  for (; next < run->nskips; next++)
    fprintf(stderr, "runner: a skip of %s (%s) matched no test run of that name\n",
            run->skips[next].test, run->skips[next].why);
}

static void print_tap(const struct run *run) {
  for (size_t i = 0; i < run->nres; i++) {
    const struct result *r = &run->res[i];
    if (r->skip != NULL) {
      printf("ok %zu - %s:%s:%s # SKIP %s\n", i + 1, r->file, r->tcase, r->test, r->skip);
      continue;
    }
    printf("%s %zu - %s:%s:%s: %s\n", r->kind == 'P' ? "ok" : "not ok", i + 1, r->file, r->tcase,
           r->test, r->msg);
    if (r->part != NULL) /* a diagnostic, not a directive: the test did run */
      printf("# %s:%s:%s: a part not run: %s\n", r->file, r->tcase, r->test, r->part);
  }
  printf("1..%zu\n", run->nres);
}

static const char *skip_why(const struct result *r) {
  return r->skip != NULL ? r->skip : r->part;
}

/* Whether two runs are of one test, skipped alike for one reason (a loop test's iterations). */
static bool same_skip(const struct result *a, const struct result *b) {
  return (a->skip != NULL) == (b->skip != NULL) && skip_why(b) != NULL &&
         strcmp(skip_why(a), skip_why(b)) == 0 && strcmp(a->suite, b->suite) == 0 &&
         strcmp(a->tcase, b->tcase) == 0 && strcmp(a->test, b->test) == 0;
}

/* The skipped runs, one line per test and reason. */
static void print_skips(const struct run *run, size_t skipped, size_t parts) {
  if (skipped + parts == 0)
    return;
  if (parts > 0)
    printf("Skipped (%zu, and %zu in part):\n", skipped, parts);
  else
    printf("Skipped (%zu):\n", skipped);
  for (size_t i = 0, j; i < run->nres; i = j) {
    const struct result *r = &run->res[i];
    for (j = i + 1; j < run->nres && skip_why(r) != NULL && same_skip(r, &run->res[j]); j++)
      ;
    if (skip_why(r) == NULL)
      continue;
    printf("  %s/%s/%s", r->suite, r->tcase, r->test);
    if (j - i > 1)
      printf(" (%zu runs)", j - i);
    printf("%s: %s\n", r->skip != NULL ? "" : " (in part)", skip_why(r));
  }
}

/* The failures come after the skips, next to the counts: a CI log's tail then shows them. */
static void print_summary(const struct run *run, int ntests, bool verbose) {
  size_t passed = 0, skipped = 0, parts = 0, failures = 0, errors = 0;
  for (size_t i = 0; i < run->nres; i++) {
    const struct result *r = &run->res[i];
    if (r->kind == 'F')
      failures++;
    else if (r->kind == 'E')
      errors++;
    else if (r->skip != NULL)
      skipped++;
    else
      passed++, parts += r->part != NULL;
  }
  print_skips(run, skipped, parts);
  for (size_t i = 0; i < run->nres; i++) {
    const struct result *r = &run->res[i];
    if (verbose || r->kind != 'P')
      printf("%s:%d:%c:%s:%s:%d: %s\n", r->file, r->line, r->kind, r->tcase, r->test, r->iter,
             r->msg);
  }
  if (run->nres != (size_t)ntests)
    printf("runner: Check ran %d tests but its log shows %zu: the counts below are the log's\n",
           ntests, run->nres);
  printf("Checks: %zu, Passed: %zu, Skipped: %zu, Failures: %zu, Errors: %zu\n", run->nres, passed,
         skipped, failures, errors);
}

static void run_free(struct run *run) {
  for (size_t i = 0; i < run->nres; i++) {
    struct result *r = &run->res[i];
    free(r->suite), free(r->file), free(r->tcase), free(r->test), free(r->msg);
  }
  for (size_t i = 0; i < run->nskips; i++)
    free(run->skips[i].test), free(run->skips[i].why);
  free(run->res);
  free(run->skips);
}

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

  char dir[200], log[256], skips[256];
  tu_tmpdir(dir, sizeof dir);
  snprintf(log, sizeof log, "%s/check.log", dir);
  snprintf(skips, sizeof skips, "%s/skips", dir);
  setenv(TU_SKIPS_ENV, skips, 1);
  srunner_set_log(sr, log);

  srunner_run_tagged(sr, NULL, NULL, getenv("DEP_TEST_TAGS"), getenv("DEP_TEST_SKIP"), CK_SILENT);
  int ntests = srunner_ntests_run(sr);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr); /* closes the log */

  struct run run = {0};
  read_log(log, &run);
  read_skips(skips, &run);
  pair_skips(&run);
  const char *tap = getenv("DEP_TAP"), *verbosity = getenv("CK_VERBOSITY");
  if (tap != NULL && tap[0] == '1')
    print_tap(&run);
  else
    print_summary(&run, ntests, verbosity != NULL && strcmp(verbosity, "verbose") == 0);
  fflush(stdout);
  run_free(&run);
  tu_rmtree(dir);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
