/*
 * proc.h — which process is which, across time: a pid and the time the
 * kernel started it (/proc/PID/stat, field 22), so that a pid the kernel
 * has handed to a new process is never taken for the old one.  The pools
 * use it to know whether a process they lent memory to may still hold it.
 */
#ifndef DEP_DAEMON_PROC_H
#define DEP_DAEMON_PROC_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct proc_id {
  pid_t pid;
  uint64_t start; /* clock ticks since boot at which pid started */
};

/* Identify a live process.  0, or -1 when it does not exist (or /proc cannot say). */
int proc_identify(pid_t pid, struct proc_id *out);

/* Whether the process is still alive (the same pid with the same start time). */
bool proc_alive(const struct proc_id *p);

/*
 * Whether live process p holds any of the files with these inode numbers
 * (on dev): as an open fd, or mapped.  1 it does, 0 it does not, -1 it
 * cannot be told (no /proc access): callers then assume it does.
 */
int proc_holds_file(const struct proc_id *p, uint64_t dev, const uint64_t *inos, uint32_t n);

#endif /* DEP_DAEMON_PROC_H */
