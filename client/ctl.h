/*
 * ctl.h — what the files of deepepctl share: the command table entry, the
 * global options, and the output table that renders the same records as
 * aligned text or as JSON (ctl_out.c).
 */
#ifndef DEP_CTL_H
#define DEP_CTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "deepep.h"

/* Exit codes (deepepctl(1) documents them). */
#define CTL_EXIT_OK 0
#define CTL_EXIT_FAIL 1
#define CTL_EXIT_USAGE 2

/* Options that every command understands. */
struct ctl {
  const char *socket; /* -s SOCKET; NULL: $DEEPEPD_SOCKET, else the default */
  bool json;          /* --json: answers and errors as JSON on stdout */
  bool help;          /* -h seen: acted on once every option is read */
  bool version;       /* -V seen: likewise, so that a later --json still counts */
};

/* One subcommand: argv[0] is its name; returns an exit code. */
struct ctl_cmd {
  const char *name;
  int (*run)(struct ctl *ctl, int argc, char **argv);
  const char *help;
  const char *options; /* its own options, "--name ARG\twhat it does" lines; or NULL */
};

int ctl_status(struct ctl *ctl, int argc, char **argv);
int ctl_reload(struct ctl *ctl, int argc, char **argv);
int ctl_drain(struct ctl *ctl, int argc, char **argv);
int ctl_version(struct ctl *ctl, int argc, char **argv);
int ctl_size(struct ctl *ctl, int argc, char **argv);
int ctl_peers(struct ctl *ctl, int argc, char **argv);
int ctl_clients(struct ctl *ctl, int argc, char **argv);
int ctl_stats(struct ctl *ctl, int argc, char **argv);
int ctl_metrics(struct ctl *ctl, int argc, char **argv);
int ctl_doctor(struct ctl *ctl, int argc, char **argv);
int ctl_genkey(struct ctl *ctl, int argc, char **argv);
/* deepepctl's version and protocol (-V), and the daemon's when ask_daemon. */
int ctl_version_show(const struct ctl *ctl, bool ask_daemon);

/*
 * The options every command takes, for a command that parses options of
 * its own: put CTL_COMMON_LONGOPTS in its getopt_long table and
 * CTL_COMMON_SHORTOPTS in its short ones, call ctl_getopt_begin() first,
 * hand every option it does not know to ctl_common_option() and, after the
 * loop, call ctl_common_end().  Each returns -1 to go on, or the exit code
 * to leave with.
 */
#define CTL_COMMON_SHORTOPTS ":s:jhV"
#define CTL_COMMON_LONGOPTS                                                    \
  {"socket", required_argument, NULL, 's'}, {"json", no_argument, NULL, 'j'},  \
  {"help", no_argument, NULL, 'h'}, {"version", no_argument, NULL, 'V'}
void ctl_getopt_begin(void);
int ctl_common_option(struct ctl *ctl, int ch, char **argv);
int ctl_common_end(struct ctl *ctl);

/* Parse a subcommand's own options (-s, --json, -h, -V) when it has no
 * others and takes no argument.  Returns -1 to go on, or the exit code. */
int ctl_sub_options(struct ctl *ctl, int argc, char **argv);
/* The same for a command that takes up to max_args arguments: they are
 * argv[optind..argc) once it returns -1. */
int ctl_sub_options_args(struct ctl *ctl, int argc, char **argv, int max_args);

/* Report a failure with its DEP_ERR_* code: "deepepctl: <message>" on
 * stderr, or with --json {"error": {...}} on stdout.  Returns CTL_EXIT_FAIL. */
int ctl_fail(const struct ctl *ctl, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The same for the last failure on c, after "what: " when what is not NULL;
 * frees c.  Returns CTL_EXIT_FAIL. */
int ctl_fail_client(const struct ctl *ctl, dep_client_t *c, int code, const char *what);
/* A usage error: the message, the one-line usage and "see deepepctl --help"
 * on stderr (with --json, the error object on stdout, code DEP_ERR_INVALID).
 * Returns CTL_EXIT_USAGE. */
int ctl_usage_error(const struct ctl *ctl, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/*
 * A daemon that accepts but does not answer HELLO within this is taken as
 * hung: an operator at a shell wants to know in seconds, not after the
 * library's 30 s meant for trainers (deepepd itself gives a HELLO a second
 * when it asks whether a daemon is alive).
 */
#define CTL_HELLO_TIMEOUT_MS 5000
/* dep_connect(c, ctl->socket) as deepepctl: its name in HELLO, the wait above,
 * and on a timeout a message saying what to check.  0 or a DEP_ERR_* code,
 * the message in dep_errmsg(c). */
int ctl_dep_connect(const struct ctl *ctl, dep_client_t *c);
/* A new handle connected to the daemon, or NULL after reporting why. */
dep_client_t *ctl_connect(const struct ctl *ctl);
/* Flush stdout and turn a write error into CTL_EXIT_FAIL. */
int ctl_finish_output(int code);

/* ---- the output table (ctl_out.c) ---------------------------------------- */

enum ctl_kind {
  CTL_STR,   /* text */
  CTL_UINT,  /* a plain number */
  CTL_BYTES, /* a byte count: "1.5 GiB" in text, a number in JSON */
  CTL_MS,    /* a duration in ms: "3h 02m 11s" in text, a number in JSON */
  CTL_NS,    /* a duration in ns: "12.3 us" in text, a number of ns in JSON */
  CTL_MILLI, /* a real number held x 1000: "1.25" in text, 1.250 in JSON */
  CTL_BOOL,  /* u != 0: "yes" or "no" in text, true or false in JSON */
  CTL_UINTS, /* u numbers at list: an array in JSON; in text only their count ("1024 values"),
                so a column of them is one for JSON (CTL_COL_NOTEXT) */
};

/* In text, show this column as "/value" after the previous one ("1/2"). */
#define CTL_COL_JOIN 0x1u
/* Only in JSON (and metrics): too much for the text table. */
#define CTL_COL_NOTEXT 0x2u
/* A label of every metric of its table (ctl_out_metrics), named by its key; job and instance,
 * the names Prometheus keeps for its own, become ep_job and ep_instance. */
#define CTL_COL_LABEL 0x4u

struct ctl_col {
  const char *key;   /* JSON key: stable, documented in deepepctl(1) */
  const char *label; /* text label or column heading */
  enum ctl_kind kind;
  unsigned flags;
};

struct ctl_val {
  const char *s; /* CTL_STR */
  uint64_t u;    /* the numeric kinds; CTL_UINTS: how many */
  const uint32_t *list; /* CTL_UINTS */
  bool none;     /* no such value for this row: "-" in text, null in JSON, NaN in metrics */
};

/* A table of at most one row: in JSON an object, or null without a row. */
#define CTL_TABLE_ONE 0x1u

struct ctl_table {
  const char *key;   /* JSON key of the array; text section title */
  const char *empty; /* text shown for no rows, e.g. "no jobs" */
  const struct ctl_col *cols;
  size_t ncols;
  size_t nrows;
  const struct ctl_val *cells; /* nrows * ncols, row by row */
  unsigned flags;              /* CTL_TABLE_* */
};

/* One answer: summary fields, then tables. */
struct ctl_doc {
  const struct ctl_col *fields;
  const struct ctl_val *values;
  size_t nfields;
  const struct ctl_table *tables;
  size_t ntables;
};

/*
 * The Prometheus text exposition of tables (deepepctl metrics): a column
 * of a table that is also a metric, by the column's index.  Samples of one
 * family are printed together, after its HELP and TYPE, with the table's
 * CTL_COL_LABEL columns as labels, in the order the metrics are listed.
 */
struct ctl_metric {
  size_t col;         /* the column the value comes from */
  const char *family; /* "deepep_op_latency_seconds": HELP and TYPE name it */
  const char *suffix; /* after the family in the sample's name ("_sum"), or "" */
  const char *type;   /* counter, gauge or summary */
  const char *help;
  unsigned decimals;  /* the value is in units of 10^-decimals of the family's (9: ns to s) */
  const char *extra;  /* one more label ("quantile=\"0.5\""), or NULL */
};
struct ctl_mtable {
  const struct ctl_table *table;
  const struct ctl_metric *metrics;
  size_t nmetrics;
};
int ctl_out_metrics(FILE *f, const struct ctl_mtable *t, size_t n);

/* Render d as text or as one JSON object, to f.  Returns 0 or -1 (ENOMEM). */
int ctl_out_render(FILE *f, const struct ctl_doc *d, bool json);
/* A failure as "deepepctl: message" or as one JSON object,
 * {"error": {"code": n, "name": "DEP_ERR_...", "message": string}}. */
void ctl_out_error(FILE *f, int code, const char *message, bool json);

/* Human units, exposed for the tests of the renderer through deepepctl. */
void ctl_out_bytes(char *buf, size_t len, uint64_t bytes);
void ctl_out_duration(char *buf, size_t len, uint64_t ms);

#endif /* DEP_CTL_H */
