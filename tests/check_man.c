/*
 * check_man.c — the man pages as a reader meets them, in the checkout
 * (`man -l man/deepepctl.1`) and installed (`man dep_status`).  Each page
 * carries deepep.h's version in its .TH line, never a placeholder; the
 * deepepctl status example says what deepepctl prints now (its fields, the
 * version and the protocol); deepep(3)'s synopsis renders as C and names
 * every public function and function-like macro of deepep.h, each of which
 * make install gives a man3 page; an example a paragraph introduces with
 * ':' is indented with that paragraph; and the pages pass make lint-man
 * (mandoc -T lint and man -l with warnings: the Makefile says which mandoc
 * notes it accepts).
 *
 * The pages are read from man/ in the current directory (the runner starts
 * in the repository root).
 */
#include <check.h>
#include <ctype.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "testutil.h"

/* A whole file (malloc'd); fails the test if it cannot be read. */
static char *read_all(const char *path) {
  char cmd[600];
  dw_sfmt(cmd, sizeof cmd, "cat '%s'", path);
  int st;
  char *s = tu_sh_out(cmd, &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "cannot read %s",
                path);
  return s;
}

/* Whether a program is on the PATH; if not, the test is skipped, saying why. */
static bool have(const char *test, const char *prog, const char *package) {
  char cmd[200];
  dw_sfmt(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", prog);
  if (system(cmd) == 0)
    return true;
  tu_skip(test, "%s is not installed (Debian package %s; make deps installs it)", prog, package);
  return false;
}

/* The pages in man/: a glob the caller frees. */
static void pages(glob_t *g) {
  ck_assert_msg(glob("man/*.[1-8]", 0, NULL, g) == 0 && g->gl_pathc >= 4,
                "no man pages in man/ (run from the repository root)");
}

/* A page as `man -l` renders it for a reader, 100 columns, plain text. */
static char *render(const char *page) {
  char cmd[600];
  /* man-db renders for a pipe as plain text (no overstrikes). */
  dw_sfmt(cmd, sizeof cmd, "MANWIDTH=100 man -l '%s' 2>/dev/null", page);
  int st;
  char *out = tu_sh_out(cmd, &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0 && out[0] != '\0', "man -l %s failed",
                page);
  return out;
}

START_TEST(pages_carry_the_version_of_deepep_h_and_no_placeholder) {
  glob_t g;
  pages(&g);
  char want[64];
  dw_sfmt(want, sizeof want, "\"deepepd %s\"", DEP_VERSION_STRING);
  for (size_t i = 0; i < g.gl_pathc; i++) {
    char *src = read_all(g.gl_pathv[i]);
    ck_assert_msg(strstr(src, "@VERSION@") == NULL, "%s has the @VERSION@ placeholder",
                  g.gl_pathv[i]);
    const char *th = strstr(src, "\n.TH ");
    ck_assert_msg(th != NULL, "%s has no .TH line", g.gl_pathv[i]);
    size_t len = strcspn(th + 1, "\n");
    ck_assert_msg(memmem(th + 1, len, want, strlen(want)) != NULL,
                  "%s's .TH line is not at deepep.h's version (%s): %.*s", g.gl_pathv[i], want,
                  (int)len, th + 1);
    free(src);
  }
  globfree(&g);
}
END_TEST

START_TEST(pages_render_with_the_version_for_a_reader_of_the_checkout) {
  if (!have(__func__, "man", "man-db"))
    return;
  glob_t g;
  pages(&g);
  char want[64];
  dw_sfmt(want, sizeof want, "deepepd %s", DEP_VERSION_STRING);
  for (size_t i = 0; i < g.gl_pathc; i++) {
    char *out = render(g.gl_pathv[i]);
    ck_assert_msg(strstr(out, want) != NULL && strstr(out, "@VERSION@") == NULL,
                  "man -l %s does not show %s:\n%.2000s", g.gl_pathv[i], want, out);
    free(out);
  }
  globfree(&g);
}
END_TEST

/* The "label:" of each line of a block up to its first blank line, joined by ','. */
static void labels(const char *block, char *out, size_t len) {
  size_t o = 0;
  out[0] = '\0';
  for (const char *l = block; *l != '\0' && *l != '\n'; l = strchr(l, '\n') + 1) {
    size_t n = strcspn(l, ":\n");
    o += (size_t)snprintf(out + o, len - o, "%.*s,", (int)n, l);
    if (o >= len || strchr(l, '\n') == NULL)
      break;
  }
}

/* The words of the line after "devices:", single-spaced. */
static void device_header(const char *text, char *out, size_t len) {
  const char *d = strstr(text, "devices:\n");
  ck_assert_ptr_nonnull(d);
  d += strlen("devices:\n");
  size_t o = 0;
  out[0] = '\0';
  for (const char *p = d; *p != '\0' && *p != '\n' && o + 2 < len; p++)
    if (!isspace((unsigned char)*p) || (o > 0 && out[o - 1] != ' '))
      out[o++] = isspace((unsigned char)*p) ? ' ' : *p;
  out[o] = '\0';
}

START_TEST(deepepctl_status_example_is_what_deepepctl_prints_now) {
  char *src = read_all("man/deepepctl.1");
  const char *ex = strstr(src, "\n$ deepepctl status\n");
  ck_assert_msg(ex != NULL, "deepepctl(1) has no `$ deepepctl status` example");
  ex += strlen("\n$ deepepctl status\n");
  char line[64];
  dw_sfmt(line, sizeof line, "\nversion:  %s\n", DEP_VERSION_STRING);
  ck_assert_msg(strncmp(ex, line + 1, strlen(line + 1)) == 0,
                "the example's version is not deepep.h's %s:\n%.200s", DEP_VERSION_STRING, ex);
  dw_sfmt(line, sizeof line, "\nprotocol: %d\n", DEP_PROTO_VERSION);
  const char *blank = strstr(ex, "\n\n");
  const char *proto = strstr(ex, line);
  ck_assert_msg(proto != NULL && proto < blank, "the example's protocol is not %d:\n%.200s",
                DEP_PROTO_VERSION, ex);
  /* Its fields and device columns, in order, against a real daemon's. */
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  char cmd[600];
  dw_sfmt(cmd, sizeof cmd, "'%s' -s '%s' status 2>&1", tu_bin("deepepctl"), d.sock);
  int st;
  char *real = tu_sh_out(cmd, &st);
  tu_daemon_stop(&d);
  tu_daemon_cleanup(&d);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "deepepctl status: %s", real);
  char want[256], got[256];
  labels(real, want, sizeof want);
  labels(ex, got, sizeof got);
  ck_assert_msg(strcmp(want, got) == 0, "the example's fields are %s; deepepctl prints %s", got,
                want);
  device_header(real, want, sizeof want);
  device_header(ex, got, sizeof got);
  ck_assert_msg(strcmp(want, got) == 0, "the example's device columns are '%s'; deepepctl "
                "prints '%s'", got, want);
  free(real);
  free(src);
}
END_TEST

/*
 * The public names of deepep.h: its DEP_EXPORT functions and its
 * function-like dep_ macros, in out[] (each malloc'd); their count.
 */
static int public_names(char *out[], int max) {
  char *h = read_all("include/deepep.h");
  int n = 0;
  for (const char *l = h; l != NULL; l = strchr(l, '\n'), l = l ? l + 1 : NULL) {
    const char *name = NULL;
    if (strncmp(l, "DEP_EXPORT ", 11) == 0) {
      const char *paren = strchr(l, '(');
      const char *eol = strchr(l, '\n');
      if (paren == NULL || (eol != NULL && paren > eol))
        continue;
      name = paren;
      while (name > l && (isalnum((unsigned char)name[-1]) || name[-1] == '_'))
        name--;
    } else if (strncmp(l, "#define dep_", 12) == 0) {
      name = l + 8;
    }
    if (name == NULL)
      continue;
    size_t len = strspn(name, "abcdefghijklmnopqrstuvwxyz0123456789_");
    if (name[len] != '(' || strncmp(name, "dep_", 4) != 0)
      continue;
    ck_assert_int_lt(n, max);
    out[n++] = strndup(name, len);
  }
  free(h);
  ck_assert_msg(n > 10, "found only %d public names in include/deepep.h", n);
  return n;
}

START_TEST(deepep_3_synopsis_renders_as_c_and_names_every_public_name) {
  if (!have(__func__, "man", "man-db"))
    return;
  char *out = render("man/deepep.3");
  const char *syn = strstr(out, "\nSYNOPSIS\n"), *end = syn ? strstr(syn, "\nDESCRIPTION\n") : NULL;
  ck_assert_msg(syn != NULL && end != NULL, "no SYNOPSIS then DESCRIPTION:\n%.2000s", out);
  char *s = strndup(syn, (size_t)(end - syn));
  /* A comment keeps its spaces (the dep_status line once ran its comment together). */
  for (const char *c = strstr(s, "/*"); c != NULL; c = strstr(c + 2, "/*")) {
    const char *e = strstr(c, "*/");
    ck_assert_msg(c[2] == ' ' && e != NULL && e[-1] == ' ' && memchr(c, ' ', (size_t)(e - c)),
                  "a comment in the synopsis lost its spaces:\n%s", s);
  }
  char *names[64];
  int n = public_names(names, 64);
  for (int i = 0; i < n; i++) {
    char call[80];
    dw_sfmt(call, sizeof call, "%s(", names[i]);
    const char *at = s;
    while ((at = strstr(at + 1, call)) != NULL && at[-1] != ' ' && at[-1] != '*')
      ;
    ck_assert_msg(at != NULL, "deepep(3)'s synopsis does not show %s:\n%s", names[i], s);
    free(names[i]);
  }
  free(s);
  free(out);
}
END_TEST

START_TEST(install_gives_every_public_name_a_man3_page) {
  char dir[256], cmd[1200];
  /* The build's own install, with all taken as made: make check and make
   * asan run the suite after all; a build of the test binary alone (as a
   * developer may make it) has no library to install. */
  const char *build = getenv("DEP_BUILD") ? getenv("DEP_BUILD") : "build";
  dw_sfmt(cmd, sizeof cmd, "test -e '%s/libdeepep-client.so.%s'", build, DEP_VERSION_STRING);
  if (system(cmd) != 0) {
    tu_skip(__func__, "%s has no libdeepep-client.so.%s to install: make all first", build,
            DEP_VERSION_STRING);
    return;
  }
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(cmd, sizeof cmd, "make -s -o all install DESTDIR='%s/stage' PREFIX=/usr BUILD='%s' 2>&1",
          dir, build);
  int st;
  char *out = tu_sh_out(cmd, &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "make install: %.2000s", out);
  free(out);
  char *names[64];
  int n = public_names(names, 64);
  bool man = system("command -v man >/dev/null 2>&1") == 0;
  for (int i = 0; i < n; i++) {
    char path[600];
    dw_sfmt(path, sizeof path, "%s/stage/usr/share/man/man3/%s.3", dir, names[i]);
    char *page = read_all(path);
    ck_assert_msg(strcmp(page, ".so man3/deepep.3\n") == 0, "%s is not a link to deepep(3): %s",
                  path, page);
    free(page);
    if (man) { /* as `man dep_status` finds and shows it */
      dw_sfmt(cmd, sizeof cmd, "MANPATH='%s/stage/usr/share/man' MANWIDTH=100 man 3 %s 2>&1",
              dir, names[i]);
      out = tu_sh_out(cmd, &st);
      ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0 && strstr(out, "libdeepep-client") &&
                        strstr(out, names[i]),
                    "man 3 %s: %.2000s", names[i], out);
      free(out);
    }
    free(names[i]);
  }
  if (!man)
    tu_skip_part(__func__, "man is not installed (Debian package man-db): the links were not "
                           "rendered");
  tu_rmtree(dir);
}
END_TEST

START_TEST(an_example_is_indented_with_the_paragraph_that_introduces_it) {
  if (!have(__func__, "man", "man-db"))
    return;
  glob_t g;
  pages(&g);
  for (size_t i = 0; i < g.gl_pathc; i++) {
    char *out = render(g.gl_pathv[i]);
    /* A line ending in ':', a blank line, then the example: not to the left of its paragraph. */
    for (char *l = out; (l = strstr(l, ":\n\n")) != NULL; l += 3) {
      const char *bol = l;
      while (bol > out && bol[-1] != '\n')
        bol--;
      const char *ex = l + 3;
      size_t intro = strspn(bol, " "), exind = strspn(ex, " ");
      if (ex[exind] == '\n' || ex[exind] == '\0')
        continue;
      ck_assert_msg(exind >= intro, "%s: the example after \"%.*s\" is indented %zu, its "
                    "paragraph %zu:\n%.*s", g.gl_pathv[i], (int)(l + 1 - bol - intro), bol + intro,
                    exind, intro, 200, ex);
    }
    free(out);
  }
  globfree(&g);
}
END_TEST

START_TEST(pages_pass_make_lint_man) {
  if (!have(__func__, "mandoc", "mandoc") || !have(__func__, "man", "man-db"))
    return;
  int st;
  char *out = tu_sh_out("make -s lint-man 2>&1", &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "make lint-man:\n%.2000s", out);
  free(out);
}
END_TEST

Suite *man_suite(void);
Suite *man_suite(void) {
  Suite *s = suite_create("man");
  TCase *src = tcase_create("pages");
  tcase_set_timeout(src, 60); /* man and mandoc over every page, a make install */
  tcase_add_test(src, pages_carry_the_version_of_deepep_h_and_no_placeholder);
  tcase_add_test(src, pages_render_with_the_version_for_a_reader_of_the_checkout);
  tcase_add_test(src, deepepctl_status_example_is_what_deepepctl_prints_now);
  tcase_add_test(src, deepep_3_synopsis_renders_as_c_and_names_every_public_name);
  tcase_add_test(src, install_gives_every_public_name_a_man3_page);
  tcase_add_test(src, an_example_is_indented_with_the_paragraph_that_introduces_it);
  tcase_add_test(src, pages_pass_make_lint_man);
  suite_add_tcase(s, src);
  return s;
}
