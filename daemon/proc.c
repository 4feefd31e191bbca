/*
 * proc.c — process identity from /proc/PID/stat (proc.h).
 */
#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int proc_identify(pid_t pid, struct proc_id *out) {
  char path[64], buf[1024];
  if (pid <= 0)
    return -1;
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -1;
  ssize_t n;
  do {
    n = read(fd, buf, sizeof buf - 1);
  } while (n < 0 && errno == EINTR);
  close(fd);
  if (n <= 0)
    return -1;
  buf[n] = '\0';
  /* The command name (field 2) may hold spaces and parentheses: fields are
   * counted from the last ')'.  After it: state (3), ... starttime (22). */
  char *p = strrchr(buf, ')');
  if (p == NULL)
    return -1;
  p++;
  for (int field = 3; field < 22; field++) {
    p = strchr(p + 1, ' ');
    if (p == NULL)
      return -1;
  }
  char *end;
  errno = 0;
  unsigned long long start = strtoull(p + 1, &end, 10);
  if (errno != 0 || end == p + 1)
    return -1;
  /* A zombie has exited: what it held is released. */
  const char *state = strrchr(buf, ')') + 2;
  if (*state == 'Z' || *state == 'X')
    return -1;
  out->pid = pid;
  out->start = start;
  return 0;
}

bool proc_alive(const struct proc_id *p) {
  struct proc_id now;
  return proc_identify(p->pid, &now) == 0 && now.start == p->start;
}
