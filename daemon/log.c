/*
 * log.c — stderr logging with syslog priority prefixes.  Each message is
 * formatted into one buffer and written with one write(2), so lines from a
 * crash or a concurrent writer never interleave mid-line.
 */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int log_level = LOG_PRIO_INFO;

void log_init(int level) { log_set_level(level); }

void log_fini(void) {}

void log_set_level(int level) {
  if (level < LOG_PRIO_CRIT)
    level = LOG_PRIO_CRIT;
  if (level > LOG_PRIO_DEBUG)
    level = LOG_PRIO_DEBUG;
  log_level = level;
}

int log_get_level(void) { return log_level; }

static void log_vemit(int prio, int errnum, const char *fmt, va_list ap) {
  if (prio > log_level)
    return;
  char line[2048];
  int n = snprintf(line, sizeof line, "<%d>", prio);
  int m = vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  size_t len = m < 0 ? (size_t)n : (size_t)n + (size_t)m;
  if (len > sizeof line - 1)
    len = sizeof line - 1;
  if (errnum != 0) {
    int k = snprintf(line + len, sizeof line - len, ": %s", strerror(errnum));
    if (k > 0)
      len += (size_t)k;
    if (len > sizeof line - 1)
      len = sizeof line - 1;
  }
  /* A message must stay one journal entry: newlines inside it become spaces. */
  for (size_t i = 0; i < len; i++)
    if (line[i] == '\n')
      line[i] = ' ';
  line[len++] = '\n';
  ssize_t w;
  do {
    w = write(STDERR_FILENO, line, len);
  } while (w < 0 && errno == EINTR);
}

#define LOG_BODY(prio, errnum)          \
  do {                                  \
    va_list ap;                         \
    va_start(ap, fmt);                  \
    log_vemit((prio), (errnum), fmt, ap); \
    va_end(ap);                         \
  } while (0)

void log_warn(const char *fmt, ...) {
  int e = errno;
  LOG_BODY(LOG_PRIO_WARNING, e);
  errno = e;
}
void log_warnx(const char *fmt, ...) { LOG_BODY(LOG_PRIO_WARNING, 0); }
void log_errx(const char *fmt, ...) { LOG_BODY(LOG_PRIO_ERR, 0); }
void log_notice(const char *fmt, ...) { LOG_BODY(LOG_PRIO_NOTICE, 0); }
void log_info(const char *fmt, ...) { LOG_BODY(LOG_PRIO_INFO, 0); }
void log_debug(const char *fmt, ...) { LOG_BODY(LOG_PRIO_DEBUG, 0); }

noreturn void fatal(const char *fmt, ...) {
  int e = errno;
  LOG_BODY(LOG_PRIO_CRIT, e);
  exit(1);
}

noreturn void fatalx(const char *fmt, ...) {
  LOG_BODY(LOG_PRIO_CRIT, 0);
  exit(1);
}
