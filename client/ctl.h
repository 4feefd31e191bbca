/*
 * ctl.h — what the files of deepepctl share: the command table entry, the
 * global options, one request to the daemon and its decoded reply
 * (ctl_ask), and the output table that renders the same records as
 * aligned text or as JSON (render/ctl_out.h, which deepepd links too).
 */
#ifndef DEP_CTL_H
#define DEP_CTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ctl_out.h"
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
/*
 * Ask the daemon one thing: send a request of `type` (body req, or NULL for
 * none), wait for its reply of ok_type and decode it into out.  0, or the
 * DEP_ERR_* code with the message in dep_errmsg(c): the daemon's refusal, a
 * broken connection, or "deepepd sent a malformed <ok_type>".  A decoder
 * that allocates leaves out for its free function either way.
 */
typedef int (*ctl_decode_fn)(const uint8_t *p, size_t len, void *out);
int ctl_ask(dep_client_t *c, uint16_t type, const void *req, uint16_t ok_type,
            ctl_decode_fn decode, void *out);
/* The replies deepepctl decodes: ctl_decode_<body> is proto_decode_<body>
 * with its out as void *, the shape ctl_ask calls. */
#define CTL_REPLY_BODIES(X) X(reload_ok) X(text) X(peers) X(job_nodes) X(job_events) X(clients) \
  X(kernels_ok)
#define CTL_DECODE_DECL_(body) int ctl_decode_##body(const uint8_t *p, size_t len, void *out);
CTL_REPLY_BODIES(CTL_DECODE_DECL_)
#undef CTL_DECODE_DECL_
/* Flush stdout and turn a write error into CTL_EXIT_FAIL. */
int ctl_finish_output(int code);

#endif /* DEP_CTL_H */
