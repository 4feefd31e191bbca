/*
 * ctlrun.c — running deepepctl for the ctl suites (ctlrun.h).
 */
#include "ctlrun.h"

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctl.h"
#include "ctl_view.h"
#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "slab.h"
#include "stats_page.h"
#include "statsranks.h"
#include "testutil.h"
#include "xring.h"

/* Start deepepctl with args (NULL-terminated), as uid when uid >= 0. */
void ctl_spawn_as(struct ctl_proc *p, int uid, const char *const *args) {
  memset(p, 0, sizeof *p);
  tu_tmpdir(p->dir, sizeof p->dir);
  char fout[256], ferr[256];
  dw_sfmt(fout, sizeof fout, "%s/out", p->dir);
  dw_sfmt(ferr, sizeof ferr, "%s/err", p->dir);
  const char *argv[16] = {"deepepctl"};
  int n = 1;
  for (; args[n - 1] != NULL; n++) {
    ck_assert_int_lt(n, 15);
    argv[n] = args[n - 1];
  }
  argv[n] = NULL;
  /* Another uid runs a copy it can reach (tu_otheruid). */
  struct tu_otheruid other = {.fd = {-1, -1}};
  if (uid >= 0)
    ck_assert_msg(tu_otheruid_prepare(&other, "deepepctl") == 0,
                  "cannot copy deepepctl for uid %d: %s", uid, strerror(errno));
  p->pid = fork();
  ck_assert_int_ge(p->pid, 0);
  if (p->pid == 0) {
    if (uid >= 0)
      tu_otheruid_child(&other);
    int o = open(fout, O_WRONLY | O_CREAT | O_TRUNC, 0666);
    int e = open(ferr, O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (o < 0 || e < 0)
      _exit(126);
    dup2(o, 1);
    dup2(e, 2);
    if (uid >= 0 && (setgroups(0, NULL) != 0 || setgid((gid_t)uid) != 0 ||
                     setuid((uid_t)uid) != 0))
      _exit(125);
    unsetenv(DEP_SOCKET_ENV);
    execv(uid >= 0 ? other.path : tu_bin("deepepctl"), (char *const *)argv);
    _exit(127);
  }
  if (uid >= 0)
    tu_otheruid_done(&other);
}

void ctl_spawn(struct ctl_proc *p, const char *const *args) { ctl_spawn_as(p, -1, args); }

/* Whether it is still running (reaping it if not). */
bool ctl_running(struct ctl_proc *p) {
  if (!p->reaped && waitpid(p->pid, &p->status, WNOHANG) == p->pid)
    p->reaped = true;
  return !p->reaped;
}

/* Wait (up to timeout_ms) for it to exit; its exit code, outputs malloc'd. */
int ctl_reap(struct ctl_proc *p, int timeout_ms, char **out, char **err) {
  int64_t deadline = dw_now_ms() + timeout_ms;
  while (ctl_running(p) && dw_now_ms() < deadline)
    dw_sleep_ms(10);
  if (!p->reaped) {
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &p->status, 0);
    ck_abort_msg("deepepctl did not exit within %d ms", timeout_ms);
  }
  char path[256];
  dw_sfmt(path, sizeof path, "%s/out", p->dir);
  *out = dw_slurp(path);
  dw_sfmt(path, sizeof path, "%s/err", p->dir);
  *err = dw_slurp(path);
  tu_rmtree(p->dir);
  ck_assert_msg(WIFEXITED(p->status), "deepepctl did not exit normally (status 0x%x)",
                p->status);
  return WEXITSTATUS(p->status);
}

/* Run deepepctl with args to the end (10 s at most). */
int ctl_run(const char *const *args, char **out, char **err) {
  struct ctl_proc p;
  ctl_spawn(&p, args);
  return ctl_reap(&p, 10000, out, err);
}

/* Whether s begins with prefix. */
bool starts(const char *s, const char *prefix) {
  return strncmp(s, prefix, strlen(prefix)) == 0;
}
