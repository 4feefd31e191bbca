/*
 * proc.c — process identity from /proc/PID/stat (proc.h).
 */
#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
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

static bool proc_ino_listed(uint64_t ino, const uint64_t *inos, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    if (inos[i] == ino)
      return true;
  return false;
}

/* The process's open fds: 1 one is such a file, 0 none, -1 unreadable. */
static int proc_fds_hold(pid_t pid, uint64_t dev, const uint64_t *inos, uint32_t n) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL)
    return -1;
  int found = 0;
  struct dirent *e;
  while (found == 0 && (e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    struct stat st;
    /* fstatat follows the magic link to the open file itself. */
    if (fstatat(dirfd(d), e->d_name, &st, 0) == 0 && (uint64_t)st.st_dev == dev &&
        proc_ino_listed((uint64_t)st.st_ino, inos, n))
      found = 1;
  }
  closedir(d);
  return found;
}

/* The process's mappings: /proc/PID/maps lines "addr perms off MAJ:MIN INODE path". */
static int proc_maps_hold(pid_t pid, uint64_t dev, const uint64_t *inos, uint32_t n) {
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
  FILE *f = fopen(path, "re");
  if (f == NULL)
    return -1;
  int found = 0;
  while (found == 0 && fgets(line, sizeof line, f) != NULL) {
    unsigned maj, min;
    unsigned long long ino;
    if (sscanf(line, "%*s %*s %*s %x:%x %llu", &maj, &min, &ino) == 3 && ino != 0 &&
        makedev(maj, min) == dev && proc_ino_listed(ino, inos, n))
      found = 1;
    /* A line longer than the buffer: skip its rest. */
    while (strchr(line, '\n') == NULL && fgets(line, sizeof line, f) != NULL)
      ;
  }
  fclose(f);
  return found;
}

int proc_holds_file(const struct proc_id *p, uint64_t dev, const uint64_t *inos, uint32_t n) {
  if (!proc_alive(p))
    return 0;
  int fds = proc_fds_hold(p->pid, dev, inos, n);
  if (fds != 0)
    return fds;
  int maps = proc_maps_hold(p->pid, dev, inos, n);
  /* Still the same process (its pid was not reused while we read)? */
  return maps == 0 && !proc_alive(p) ? 0 : maps;
}
