/*
 * ctlrun.h — the real deepepctl run by the ctl suites (check_ctl.c,
 * check_ctl_json.c, check_ctl_render.c): started as this or another uid,
 * its stdout and stderr to files, reaped with a ceiling.
 */
#ifndef DEP_TEST_CTLRUN_H
#define DEP_TEST_CTLRUN_H

#include <stdbool.h>
#include <sys/types.h>

/* One deepepctl process, its stdout and stderr going to files in dir. */
struct ctl_proc {
  pid_t pid;
  int status; /* its wait status, once reaped */
  bool reaped;
  char dir[200];
};

/* Start deepepctl with args (NULL-terminated), as uid when uid >= 0. */
void ctl_spawn_as(struct ctl_proc *p, int uid, const char *const *args);

/* ctl_spawn_as as this process's uid. */
void ctl_spawn(struct ctl_proc *p, const char *const *args);

/* Whether it is still running (reaping it if not). */
bool ctl_running(struct ctl_proc *p);

/* Wait (up to timeout_ms) for it to exit; its exit code, outputs malloc'd. */
int ctl_reap(struct ctl_proc *p, int timeout_ms, char **out, char **err);

/* Run deepepctl with args to the end (10 s at most). */
int ctl_run(const char *const *args, char **out, char **err);

/* Whether s begins with prefix. */
bool starts(const char *s, const char *prefix);

#endif /* DEP_TEST_CTLRUN_H */
