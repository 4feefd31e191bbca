/*
 * check_readme.c — README.md and docs/ work as written.  The ```c block
 * under "Linking a trainer" is the one definition of the example trainer:
 * it is built here with the section's own commands against the library
 * just built, run with the section's own command against a daemon started
 * as `make run` starts it, and must print the section's ```text block.  The
 * security notes (docs/operating.md and deepepd(8)) must say both what is
 * isolated and what is not, and the unit and the words agree on who
 * deepepd's user is.  The README stays short enough for a newcomer to read
 * (README_MAX_LINES), every relative link in it and in the pages of docs/ leads to a
 * file (and a heading, where it names one) that exists, and every page of
 * docs/ is linked from the README.
 *
 * The trainer runs in a temporary directory laid out as the repository
 * root that the README's commands expect: client/ and build/ (links to the
 * sources and to $DEP_BUILD), trainer.c, and run/deepepd.sock.
 */
#include <check.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemonwire.h"
#include "testutil.h"

/* The README's source-tree commands link the library as built; a sanitized
 * build's library needs the sanitizers' runtimes in the program too. */
#if defined(__SANITIZE_ADDRESS__)
#define EXTRA_LDFLAGS " -fsanitize=address,undefined"
#else
#define EXTRA_LDFLAGS ""
#endif

/*
 * The README is what a newcomer reads first: what deepepd is, the quick
 * start, linking a trainer in C and Python, several nodes, installing,
 * operating, and where to read more.  The reference lives in docs/ and
 * man/; this bound keeps it there (issue 28: the README had grown to 1060
 * lines).
 */
#define README_MAX_LINES 250

/* The operator's notes that the security and unit cases read. */
#define OPERATING_DOC "docs/operating.md"

/* A whole text file (malloc'd); fails the test if it cannot be read. */
static char *read_doc(const char *path) {
  FILE *f = fopen(path, "r");
  ck_assert_msg(f != NULL, "%s: %s (run the tests from the repository root)", path,
                strerror(errno));
  size_t cap = 1 << 16, len = 0, got;
  char *text = malloc(cap);
  ck_assert_ptr_nonnull(text);
  while ((got = fread(text + len, 1, cap - len - 1, f)) > 0) {
    len += got;
    if (cap - len < 4096) {
      cap *= 2;
      text = realloc(text, cap);
      ck_assert_ptr_nonnull(text);
    }
  }
  fclose(f);
  text[len] = '\0';
  return text;
}

/* The text of section "## heading" of the Markdown document named name, up to the next "## "
 * (malloc'd). */
static char *md_section(const char *doc, const char *name, const char *heading) {
  char h[128];
  dw_sfmt(h, sizeof h, "\n## %s\n", heading);
  const char *a = strstr(doc, h);
  ck_assert_msg(a != NULL, "%s has no section \"## %s\"", name, heading);
  a += strlen(h);
  const char *b = strstr(a, "\n## ");
  return strndup(a, b != NULL ? (size_t)(b - a + 1) : strlen(a));
}

/* The body of the nth (from 0) fenced block of language lang in text (malloc'd). */
static char *md_block(const char *text, const char *lang, int nth) {
  char fence[32];
  dw_sfmt(fence, sizeof fence, "```%s\n", lang);
  const char *p = text;
  for (int i = 0;; i++) {
    p = strstr(p, fence);
    ck_assert_msg(p != NULL, "README.md's section has no ```%s block number %d", lang, nth + 1);
    if (i == nth)
      break;
    p += strlen(fence);
  }
  p += strlen(fence);
  const char *end = strstr(p, "\n```\n");
  ck_assert_msg(end != NULL, "README.md: a ```%s block is not closed", lang);
  return strndup(p, (size_t)(end - p + 1));
}

/* Run cmd with sh in dir, stdout to out and stderr to err (err NULL: to out too); the wait status. */
static int sh_in(const char *dir, const char *cmd, const char *out, const char *err) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int efd = err != NULL ? open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644) : fd;
    if (fd < 0 || efd < 0 || chdir(dir) != 0)
      _exit(126);
    dup2(fd, 1);
    dup2(efd, 2);
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
  }
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  return st;
}

/* The README's trainer section, and a directory laid out as the repository root for it. */
struct quick {
  char dir[200];
  char *section;
  pid_t daemon;
};

static void quick_setup(struct quick *q) {
  char *readme = read_doc("README.md");
  q->section = md_section(readme, "README.md", "Linking a trainer");
  free(readme);
  q->daemon = 0;
  tu_tmpdir(q->dir, sizeof q->dir);

  char here[PATH_MAX], build[PATH_MAX], path[512], src[PATH_MAX + 16];
  ck_assert(getcwd(here, sizeof here) != NULL);
  const char *b = getenv("DEP_BUILD");
  ck_assert_msg(realpath(b != NULL && b[0] != '\0' ? b : "build", build) != NULL,
                "no build directory (DEP_BUILD)");
  dw_sfmt(src, sizeof src, "%s/include", here);
  dw_sfmt(path, sizeof path, "%s/include", q->dir);
  ck_assert_int_eq(symlink(src, path), 0);
  dw_sfmt(path, sizeof path, "%s/build", q->dir);
  ck_assert_int_eq(symlink(build, path), 0);
  dw_sfmt(path, sizeof path, "%s/run", q->dir);
  ck_assert_int_eq(mkdir(path, 0755), 0);

  char *code = md_block(q->section, "c", 0);
  dw_sfmt(path, sizeof path, "%s/trainer.c", q->dir);
  ck_assert_int_eq(tu_write_file(path, code), 0);
  free(code);
}

static void quick_teardown(struct quick *q) {
  if (q->daemon > 0) {
    kill(q->daemon, SIGKILL);
    waitpid(q->daemon, NULL, 0);
  }
  free(q->section);
  tu_rmtree(q->dir);
}

/*
 * Start deepepd in q->dir as `make run` does there: host backend, socket
 * run/deepepd.sock.  One thing differs: a 64 MiB pool instead of the
 * built-in 1 GiB (the example's job needs 128 KiB), so that the test does
 * not spend seconds making memory it never uses.
 */
static void quick_daemon_start(struct quick *q) {
  char bin[PATH_MAX], yaml[256], log[256], sock[256];
  ck_assert(realpath(tu_bin("deepepd"), bin) != NULL);
  dw_sfmt(yaml, sizeof yaml, "%s/pool.yaml", q->dir);
  dw_sfmt(log, sizeof log, "%s/deepepd.log", q->dir);
  dw_sfmt(sock, sizeof sock, "%s/run/deepepd.sock", q->dir);
  ck_assert_int_eq(tu_write_file(yaml, "pool:\n  host_size: 64MiB\n"), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0 || chdir(q->dir) != 0)
      _exit(126);
    dup2(fd, 1);
    dup2(fd, 2);
    unsetenv("NOTIFY_SOCKET");
    execl(bin, "deepepd", "-c", "pool.yaml", "--backend", "host", "--socket", "run/deepepd.sock",
          (char *)NULL);
    _exit(127);
  }
  q->daemon = pid;
  for (int i = 0; i < 1000; i++) {
    int fd = tu_connect_raw(sock);
    if (fd >= 0) {
      close(fd);
      return;
    }
    ck_assert_msg(waitpid(pid, NULL, WNOHANG) == 0, "deepepd exited: %s", dw_slurp(log));
    dw_sleep_ms(10);
  }
  ck_abort_msg("deepepd did not listen on %s within 10 s: %s", sock, dw_slurp(log));
}

static void quick_daemon_stop_ok(struct quick *q) {
  int st;
  ck_assert_int_eq(kill(q->daemon, SIGTERM), 0);
  ck_assert_int_eq(waitpid(q->daemon, &st, 0), q->daemon);
  q->daemon = 0;
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "deepepd's SIGTERM status %d", st);
}

/* Every line of the section's first ```sh block, run in order; the last one's stdout (malloc'd). */
static char *run_sh_block(struct quick *q) {
  char *cmds = md_block(q->section, "sh", 0), out[256], err[256], *last = NULL;
  ck_assert_msg(strstr(cmds, "build/libdeepep-client.a") != NULL &&
                    strstr(cmds, "run/deepepd.sock") != NULL,
                "the first ```sh block should build from the source tree and run on the quick "
                "start's socket:\n%s", cmds);
  dw_sfmt(out, sizeof out, "%s/out", q->dir);
  dw_sfmt(err, sizeof err, "%s/err", q->dir);
  for (char *line = strtok(cmds, "\n"); line != NULL; line = strtok(NULL, "\n")) {
    char cmd[1024];
    dw_sfmt(cmd, sizeof cmd, "%s%s", line, strncmp(line, "cc ", 3) == 0 ? EXTRA_LDFLAGS : "");
    int st = sh_in(q->dir, cmd, out, err);
    char *o = dw_slurp(out), *e = dw_slurp(err);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "README's `%s`: status %d\n%s%s", line,
                  st, o, e);
    free(e);
    free(last);
    last = o;
  }
  free(cmds);
  return last;
}

START_TEST(readme_trainer_is_a_whole_program_that_compiles_without_warnings) {
  struct quick q;
  quick_setup(&q);
  char out[256];
  dw_sfmt(out, sizeof out, "%s/cc.out", q.dir);
  int st = sh_in(q.dir,
                 "cc -std=c11 -Wall -Wextra -Wshadow -Werror -pedantic -o strict trainer.c "
                 "-Iinclude build/libdeepep-client.a -ldl -lpthread -lm" EXTRA_LDFLAGS,
                 out, NULL);
  char *o = dw_slurp(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "README's trainer.c:\n%s", o);
  free(o);
  quick_teardown(&q);
}
END_TEST

START_TEST(readme_trainer_runs_as_shown_against_the_quick_start_daemon) {
  struct quick q;
  quick_setup(&q);
  quick_daemon_start(&q);
  char *got = run_sh_block(&q);
  char *want = md_block(q.section, "text", 0);
  ck_assert_msg(strcmp(got, want) == 0, "the trainer printed\n%s\nthe README shows\n%s", got,
                want);
  free(got);
  free(want);
  quick_daemon_stop_ok(&q);
  char log[256];
  dw_sfmt(log, sizeof log, "%s/deepepd.log", q.dir);
  char *text = dw_slurp(log);
  ck_assert_msg(strstr(text, "job example: removed (no ranks left)") != NULL, "deepepd's log:\n%s",
                text);
  free(text);
  quick_teardown(&q);
}
END_TEST

/* Without a daemon the trainer says why in one line, naming the failure once
 * (it printed dep_strerror's "deepepd is not running" before dep_errmsg's
 * "deepepd not running: no socket at ..."), and exits 1. */
START_TEST(readme_trainer_without_a_daemon_says_why_in_one_line) {
  struct quick q;
  quick_setup(&q);
  char out[256], err[256];
  dw_sfmt(out, sizeof out, "%s/out", q.dir);
  dw_sfmt(err, sizeof err, "%s/err", q.dir);
  int st = sh_in(q.dir,
                 "cc -o trainer trainer.c -Iinclude build/libdeepep-client.a -ldl -lpthread "
                 "-lm" EXTRA_LDFLAGS,
                 out, NULL);
  char *o = dw_slurp(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "README's trainer.c:\n%s", o);
  free(o);
  st = sh_in(q.dir, "DEEPEPD_SOCKET=run/deepepd.sock ./trainer", out, err);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d", st);
  o = dw_slurp(out);
  char *e = dw_slurp(err);
  ck_assert_str_eq(o, "");
  const char *want = "trainer: deepepd not running: no socket at run/deepepd.sock";
  ck_assert_msg(strncmp(e, want, strlen(want)) == 0, "it printed: %s", e);
  const char *nl = strchr(e, '\n');
  ck_assert_msg(nl != NULL && nl[1] == '\0', "not one line: %s", e);
  ck_assert_msg(strstr(e, " (DEP_ERR_NO_DAEMON)\n") != NULL, "no code named: %s", e);
  const char *again = strstr(e, "not running");
  ck_assert_msg(strstr(again + 1, "not running") == NULL, "says it twice: %s", e);
  free(o);
  free(e);
  quick_teardown(&q);
}
END_TEST

/* The same-uid caveat is written down where an operator looks: docs/operating.md and
 * deepepd(8). */
START_TEST(security_notes_say_what_is_isolated_and_what_is_not) {
  char *doc = read_doc(OPERATING_DOC), *man = read_doc("man/deepepd.8");
  char *notes = md_section(doc, OPERATING_DOC, "Security notes");
  const char *sec = strstr(man, "\n.SH SECURITY\n");
  ck_assert_msg(sec != NULL, "man/deepepd.8 has no SECURITY section");
  const char *needles[] = {"fresh memory", "scrubbed", "Within one uid", "leftover process",
                           "ptrace"};
  for (size_t i = 0; i < sizeof needles / sizeof needles[0]; i++) {
    ck_assert_msg(strstr(notes, needles[i]) != NULL, OPERATING_DOC "'s security notes lack \"%s\"",
                  needles[i]);
    ck_assert_msg(strstr(sec, needles[i]) != NULL, "deepepd(8)'s SECURITY lacks \"%s\"",
                  needles[i]);
  }
  free(notes);
  free(doc);
  free(man);
}
END_TEST

/* The lines of path that are words of a package name, as a space-separated list
 * (" a b c ", so that a name is found with " name "; malloc'd). */
static char *word_lines(const char *path) {
  char *text = dw_slurp(path);
  char *out = calloc(1, strlen(text) + 2);
  ck_assert(out != NULL);
  strcpy(out, " ");
  for (char *l = strtok(text, "\n"); l != NULL; l = strtok(NULL, "\n")) {
    strcat(out, l);
    strcat(out, " ");
  }
  free(text);
  return out;
}

/* The quick start's two commands install what each needs: `make deps run` (build and run the
 * daemon) asks .ci/install-deps for its run set, which holds none of the test suite's packages;
 * `make deps check` for the check set, which holds both.  Asked with make -n and install-deps
 * --list, so nothing is installed. */
START_TEST(quick_start_installs_what_each_command_needs_and_no_more) {
  char *readme = read_doc("README.md");
  char *qs = md_section(readme, "README.md", "Quick start");
  ck_assert_msg(strstr(qs, "\nmake deps run ") != NULL && strstr(qs, "\nmake deps check ") != NULL,
                "README's Quick start does not give `make deps run` and `make deps check`");
  char dir[200], out[256], cmd[512];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(out, sizeof out, "%s/out", dir);
  const char *goals[] = {"run", "check"};
  for (size_t i = 0; i < 2; i++) {
    dw_sfmt(cmd, sizeof cmd, "make -n deps %s | grep -x './.ci/install-deps %s'", goals[i],
            goals[i]);
    int st = sh_in(".", cmd, out, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "make -n deps %s does not run .ci/install-deps %s: %s", goals[i], goals[i],
                  dw_slurp(out));
  }
  char lists[2][256];
  for (size_t i = 0; i < 2; i++) {
    dw_sfmt(lists[i], sizeof lists[i], "%s/%s.list", dir, goals[i]);
    dw_sfmt(cmd, sizeof cmd, "./.ci/install-deps --list %s", goals[i]);
    int st = sh_in(".", cmd, lists[i], NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "install-deps --list %s failed: %s",
                  goals[i], dw_slurp(lists[i]));
  }
  char *run = word_lines(lists[0]), *check = word_lines(lists[1]);
  /* What running needs; the check set holds all of it too. */
  const char *needed[] = {"build-essential", "pkg-config", "libuv1-dev", "libyaml-dev",
                          "libsodium-dev"};
  for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++) {
    char w[64];
    dw_sfmt(w, sizeof w, " %s ", needed[i]);
    ck_assert_msg(strstr(run, w) != NULL, "make deps run would not install %s", needed[i]);
  }
  for (char *p = run + 1; *p != '\0';) {
    char *sp = strchr(p, ' ');
    char w[80];
    dw_sfmt(w, sizeof w, " %.*s ", (int)(sp - p), p);
    ck_assert_msg(strstr(check, w) != NULL, "the check set lacks%sof the run set", w);
    p = sp + 1;
  }
  /* What only the tests need stays out of the run set. */
  const char *tests_only[] = {"check", "clang", "qemu-system-x86", "python3-torch", "iperf3",
                              "debhelper"};
  for (size_t i = 0; i < sizeof tests_only / sizeof tests_only[0]; i++) {
    char w[64];
    dw_sfmt(w, sizeof w, " %s ", tests_only[i]);
    ck_assert_msg(strstr(run, w) == NULL, "make deps run would install %s, which only the "
                  "tests need", tests_only[i]);
    ck_assert_msg(strstr(check, w) != NULL, "make deps check would not install %s",
                  tests_only[i]);
  }
  free(run);
  free(check);
  free(qs);
  free(readme);
  tu_rmtree(dir);
}
END_TEST

/* Who "deepepd's user" is, as the unit, the sysusers snippet, docs/operating.md and deepepd(8) say it:
 * the unit names no User= (so the daemon runs as root), sysusers makes no user, and both
 * documents say that deepepd's user is root under the unit.  A unit that gains a User= must
 * have its user made by sysusers and the words changed with it, which this case then names. */
START_TEST(unit_and_words_agree_on_deepepds_user) {
  char *unit = dw_slurp("systemd/deepepd.service.in");
  char *sysusers = dw_slurp("systemd/deepepd.sysusers");
  char *doc = read_doc(OPERATING_DOC), *man = read_doc("man/deepepd.8");
  ck_assert_msg(unit[0] != '\0' && sysusers[0] != '\0',
                "no systemd/deepepd.service.in or systemd/deepepd.sysusers");
  ck_assert_msg(strstr(unit, "\nUser=") == NULL && strstr(unit, "\nDynamicUser=") == NULL,
                "deepepd.service names a User=: make sysusers create it and " OPERATING_DOC " and "
                "deepepd(8) say that deepepd's user is that user, then change this case");
  for (const char *l = sysusers; l != NULL; l = strchr(l, '\n'), l = l != NULL ? l + 1 : NULL)
    ck_assert_msg(l[0] != 'u', "deepepd.sysusers makes a user, which the unit does not run as");
  char *service = md_section(doc, OPERATING_DOC, "Running as a service");
  ck_assert_msg(strstr(service, "runs deepepd as root") != NULL &&
                    strstr(service, "\"deepepd's user\"") != NULL &&
                    strstr(service, "is root under the unit") != NULL,
                OPERATING_DOC "'s \"Running as a service\" does not say that deepepd's user is "
                "root under the unit");
  ck_assert_msg(strstr(man, "runs deepepd as root") != NULL &&
                    strstr(man, "is root under the unit") != NULL,
                "deepepd(8) does not say that deepepd's user is root under the unit");
  /* The hardening the words promise is in the unit. */
  ck_assert_msg(strstr(unit, "\nSystemCallFilter=") != NULL,
                "deepepd.service has no SystemCallFilter=");
  ck_assert_msg(strstr(unit, "\nCapabilityBoundingSet=") != NULL,
                "deepepd.service has no CapabilityBoundingSet=");
  free(service);
  free(unit);
  free(sysusers);
  free(doc);
  free(man);
}
END_TEST

/* ---- the README's length and the documents' links ----------------------------------- */

START_TEST(readme_stays_under_its_line_bound) {
  char *readme = read_doc("README.md");
  size_t lines = 0;
  for (const char *p = readme; *p != '\0'; p++)
    lines += *p == '\n';
  ck_assert_msg(lines < README_MAX_LINES,
                "README.md has %zu lines, the bound is under %d: move reference into docs/ or "
                "man/ and link it",
                lines, README_MAX_LINES);
  free(readme);
}
END_TEST

/* GitHub's anchor for a heading's text: lower case, spaces to '-', and every character but
 * letters, digits, '-' and '_' dropped. */
static void md_anchor(const char *heading, size_t n, char *out, size_t len) {
  size_t o = 0;
  for (size_t i = 0; i < n && o + 1 < len; i++) {
    unsigned char ch = (unsigned char)heading[i];
    if (isalnum(ch) || ch == '-' || ch == '_')
      out[o++] = (char)tolower(ch);
    else if (ch == ' ')
      out[o++] = '-';
  }
  out[o] = '\0';
}

/* Whether the Markdown text has a heading (outside fenced blocks) whose anchor is anchor. */
static bool md_has_anchor(const char *text, const char *anchor) {
  bool fenced = false;
  for (const char *l = text; *l != '\0';) {
    const char *nl = strchr(l, '\n');
    size_t n = nl != NULL ? (size_t)(nl - l) : strlen(l);
    if (strncmp(l, "```", 3) == 0)
      fenced = !fenced;
    else if (!fenced && l[0] == '#') {
      const char *h = l + strspn(l, "#");
      h += strspn(h, " ");
      char a[256];
      md_anchor(h, n - (size_t)(h - l), a, sizeof a);
      if (strcmp(a, anchor) == 0)
        return true;
    }
    l += n + (nl != NULL);
  }
  return false;
}

/* Every relative link "[text](target)" of the Markdown file path, outside fenced blocks, leads to
 * a file, and where it names a heading ("file.md#anchor", or "#anchor" in the same file) to that
 * heading.  Links with a scheme (https:, mailto:) are not followed.  The count of links checked
 * goes to *count. */
static void links_resolve(const char *path, size_t *count) {
  char *text = read_doc(path), dir[256];
  const char *slash = strrchr(path, '/');
  dw_sfmt(dir, sizeof dir, "%.*s", slash != NULL ? (int)(slash - path + 1) : 0, path);
  bool fenced = false;
  for (const char *l = text; *l != '\0';) {
    const char *nl = strchr(l, '\n');
    size_t n = nl != NULL ? (size_t)(nl - l) : strlen(l);
    if (strncmp(l, "```", 3) == 0)
      fenced = !fenced;
    for (const char *m = l; !fenced && (m = strstr(m, "](")) != NULL && m < l + n; m += 2) {
      const char *t = m + 2;
      size_t tn = strcspn(t, ") \n");
      char target[512], file[512], anchor[256] = "";
      dw_sfmt(target, sizeof target, "%.*s", (int)tn, t);
      ck_assert_msg(t[tn] == ')', "%s: a link to \"%s\" is not closed on its line", path, target);
      if (strstr(target, "://") != NULL || strncmp(target, "mailto:", 7) == 0)
        continue;
      char *hash = strchr(target, '#');
      if (hash != NULL) {
        dw_sfmt(anchor, sizeof anchor, "%s", hash + 1);
        *hash = '\0';
      }
      if (target[0] == '\0')
        dw_sfmt(file, sizeof file, "%s", path);
      else
        dw_sfmt(file, sizeof file, "%s%s", dir, target);
      struct stat st;
      ck_assert_msg(stat(file, &st) == 0, "%s links to %s, which does not exist (%s)", path, file,
                    strerror(errno));
      if (anchor[0] != '\0') {
        ck_assert_msg(strlen(file) > 3 && strcmp(file + strlen(file) - 3, ".md") == 0,
                      "%s links to a heading of %s, which is not Markdown", path, file);
        char *linked = read_doc(file);
        ck_assert_msg(md_has_anchor(linked, anchor), "%s links to %s#%s, a heading %s lacks",
                      path, file, anchor, file);
        free(linked);
      }
      (*count)++;
    }
    l += n + (nl != NULL);
  }
  free(text);
}

START_TEST(every_relative_link_in_the_readme_and_docs_resolves) {
  glob_t g;
  ck_assert_msg(glob("docs/*.md", 0, NULL, &g) == 0 && g.gl_pathc > 0,
                "no docs/*.md in the current directory (run from the root)");
  size_t links = 0;
  links_resolve("README.md", &links);
  for (size_t i = 0; i < g.gl_pathc; i++)
    links_resolve(g.gl_pathv[i], &links);
  /* The README links every page of docs/ (its "Where to read more"), so that none is out of
   * a newcomer's reach. */
  char *readme = read_doc("README.md");
  for (size_t i = 0; i < g.gl_pathc; i++) {
    char needle[300];
    dw_sfmt(needle, sizeof needle, "](%s)", g.gl_pathv[i]);
    ck_assert_msg(strstr(readme, needle) != NULL, "README.md does not link %s", g.gl_pathv[i]);
  }
  /* The scan found links at all: a parser that sees none passes nothing. */
  ck_assert_msg(links >= g.gl_pathc, "only %zu links found in README.md and docs/", links);
  free(readme);
  globfree(&g);
}
END_TEST

Suite *readme_suite(void);
Suite *readme_suite(void) {
  Suite *s = suite_create("readme");
  TCase *tc = tcase_create("trainer");
  tcase_set_timeout(tc, 60); /* a compiler run, a daemon start */
  tcase_add_test(tc, readme_trainer_is_a_whole_program_that_compiles_without_warnings);
  tcase_add_test(tc, readme_trainer_runs_as_shown_against_the_quick_start_daemon);
  tcase_add_test(tc, readme_trainer_without_a_daemon_says_why_in_one_line);
  suite_add_tcase(s, tc);
  TCase *deps = tcase_create("quickstart");
  tcase_set_timeout(deps, 60); /* two make -n runs over the whole Makefile */
  tcase_add_test(deps, quick_start_installs_what_each_command_needs_and_no_more);
  suite_add_tcase(s, deps);
  TCase *sec = tcase_create("security");
  tcase_add_test(sec, security_notes_say_what_is_isolated_and_what_is_not);
  tcase_add_test(sec, unit_and_words_agree_on_deepepds_user);
  suite_add_tcase(s, sec);
  TCase *docs = tcase_create("docs");
  tcase_add_test(docs, readme_stays_under_its_line_bound);
  tcase_add_test(docs, every_relative_link_in_the_readme_and_docs_resolves);
  suite_add_tcase(s, docs);
  return s;
}
