/*
 * log.h — the daemon's logging: one line per event on stderr, each with a
 * syslog priority prefix ("<4>") that journald turns into the priority.
 * When stderr is not the journal (no $JOURNAL_STREAM naming it), each line
 * starts with the local time to the millisecond instead:
 * "2026-12-01T13:52:30.123 <4>message".  Only the daemon logs; library code
 * returns errors instead.
 */
#ifndef DEP_DAEMON_LOG_H
#define DEP_DAEMON_LOG_H

#include <stddef.h>
#include <stdnoreturn.h>

/* Syslog priorities, as the prefixes use them. */
enum log_prio { LOG_PRIO_CRIT = 2, LOG_PRIO_ERR = 3, LOG_PRIO_WARNING = 4,
                LOG_PRIO_NOTICE = 5, LOG_PRIO_INFO = 6, LOG_PRIO_DEBUG = 7 };

/* Start logging at `level` (a syslog priority: messages above it are dropped). */
void log_init(int level);
void log_fini(void);
/* Change the level at run time (SIGHUP). */
void log_set_level(int level);

#define LOG_PRINTF(a, b) __attribute__((format(printf, a, b)))

/*
 * Bytes a client sent, made fit for a log line or an error message: every
 * byte outside printable ASCII (control characters, DEL, anything >= 0x80)
 * and the backslash itself become \xNN, so that nothing a client sends can
 * move the cursor, colour a terminal or fake a line, and the escaped text
 * reads back unambiguously.  Reads n bytes of in (NUL included, if within
 * n); writes at most outlen bytes, always terminated, never half an escape.
 * Returns out.
 */
const char *log_escape(const char *in, size_t n, char *out, size_t outlen);

/* A warning with ": strerror(errno)" appended. */
void log_warn(const char *fmt, ...) LOG_PRINTF(1, 2);
/* A warning without errno. */
void log_warnx(const char *fmt, ...) LOG_PRINTF(1, 2);
/* An error the daemon survives (priority err), without errno. */
void log_errx(const char *fmt, ...) LOG_PRINTF(1, 2);
void log_notice(const char *fmt, ...) LOG_PRINTF(1, 2);
void log_info(const char *fmt, ...) LOG_PRINTF(1, 2);
void log_debug(const char *fmt, ...) LOG_PRINTF(1, 2);
/* Log at priority crit and exit(1). */
noreturn void fatalx(const char *fmt, ...) LOG_PRINTF(1, 2);

#endif /* DEP_DAEMON_LOG_H */
