/*
 * log.c — stderr logging with syslog priority prefixes, and a time stamp
 * where nothing else adds one.  Each message is formatted into one buffer
 * and written with one write(2), so lines from a crash or a concurrent
 * writer never interleave mid-line.
 */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int log_level = LOG_PRIO_INFO;
/* stderr is the journal's stream, which stamps every entry itself. */
static bool log_journal;

/*
 * Whether stderr is the stream that systemd named in $JOURNAL_STREAM
 * ("DEVICE:INODE").  The variable alone is not enough: it is inherited by
 * a process whose stderr was sent elsewhere (a shell started from a
 * service, "deepepd 2>file").
 */
static bool log_stderr_is_journal(void) {
  const char *js = getenv("JOURNAL_STREAM");
  unsigned long long dev, ino;
  char extra;
  if (js == NULL || sscanf(js, "%llu:%llu%c", &dev, &ino, &extra) != 2)
    return false;
  struct stat st;
  return fstat(STDERR_FILENO, &st) == 0 && (unsigned long long)st.st_dev == dev &&
         (unsigned long long)st.st_ino == ino;
}

void log_init(int level) {
  log_set_level(level);
  log_journal = log_stderr_is_journal();
  tzset(); /* localtime_r needs it done once */
}

void log_fini(void) {}

void log_set_level(int level) {
  if (level < LOG_PRIO_CRIT)
    level = LOG_PRIO_CRIT;
  if (level > LOG_PRIO_DEBUG)
    level = LOG_PRIO_DEBUG;
  log_level = level;
}

static void log_vemit(int prio, int errnum, const char *fmt, va_list ap) {
  if (prio > log_level)
    return;
  char line[2048];
  int n;
  if (log_journal) {
    n = snprintf(line, sizeof line, "<%d>", prio);
  } else {
    struct timespec ts;
    struct tm tm;
    char when[32];
    clock_gettime(CLOCK_REALTIME, &ts);
    localtime_r(&ts.tv_sec, &tm);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    n = snprintf(line, sizeof line, "%s.%03ld <%d>", when, ts.tv_nsec / 1000000L, prio);
  }
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

const char *log_escape(const char *in, size_t n, char *out, size_t outlen) {
  static const char hex[] = "0123456789abcdef";
  size_t o = 0;
  if (out == NULL || outlen == 0)
    return out;
  for (size_t i = 0; in != NULL && i < n; i++) {
    unsigned char ch = (unsigned char)in[i];
    bool plain = ch >= 0x20 && ch < 0x7f && ch != '\\';
    if (o + (plain ? 1 : 4) >= outlen)
      break;
    if (plain) {
      out[o++] = (char)ch;
    } else {
      out[o++] = '\\';
      out[o++] = 'x';
      out[o++] = hex[ch >> 4];
      out[o++] = hex[ch & 15];
    }
  }
  out[o] = '\0';
  return out;
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

noreturn void fatalx(const char *fmt, ...) {
  LOG_BODY(LOG_PRIO_CRIT, 0);
  exit(1);
}
