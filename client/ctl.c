/*
 * ctl.c — deepepctl, the operator's view of deepepd: global options, the
 * table of subcommands (one file each, ctl_<name>.c) and the helpers they
 * share.  Exit codes: 0 success, 1 failure, 2 usage error; with --json a
 * failure is a JSON object on stdout as well as an exit code.
 */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include "client_internal.h"
#include "ctl.h"
#include "proto.h"

static int ctl_help(struct ctl *ctl, int argc, char **argv);

static const struct ctl_cmd ctl_cmds[] = {
    {"status", ctl_status,
     "show the daemon's state, version, uptime, backend, devices, clients and jobs", NULL},
    {"reload", ctl_reload, "re-read deepepd's configuration (as SIGHUP); root or its user only",
     NULL},
    {"drain", ctl_drain, "take no new jobs, running ones finish; root or its user only",
     "--cancel\taccept new jobs again\n"
     "--wait\tthen wait until no job is left\n"
     "--timeout S\twith --wait: give up after S seconds (exit 1)"},
    {"peers", ctl_peers,
     "the peer daemons: state, connections up, round trip, bytes, reconnects, last error", NULL},
    {"clients", ctl_clients, "the connections: pid, uid, name, job, rank, device, attached since",
     NULL},
    {"stats", ctl_stats,
     "per job, rank and op: calls, first call, median, p99, GB/s, errors: stats [JOB]", NULL},
    {"metrics", ctl_metrics, "the stats, pools and peers in the Prometheus text format", NULL},
    {"doctor", ctl_doctor,
     "check connections, kernels, allocation and load balance; exit 1 if one fails", NULL},
    {"genkey", ctl_genkey, "write a new peer key to FILE (mode 0600), or to stdout: genkey [FILE]",
     NULL},
    {"version", ctl_version, "deepepctl's version and protocol, and the daemon's if one answers",
     NULL},
    {"size", ctl_size, "what a job of a shape is lent per rank, before it starts (no daemon asked)",
     "--world N\tranks in the job (8)\n"
     "--ranks-per-node N\tits ranks on each node (the world, at most 64)\n"
     "--tokens N\tmax_tokens_per_rank (4096)\n"
     "--hidden N\thidden (7168)\n"
     "--experts N\tnum_experts (256)\n"
     "--topk N\ttopk (8)\n"
     "--ll-tokens N\tmax_ll_tokens_per_rank (0: the default)\n"
     "--fp8\tthe job's dtype is fp8_e4m3\n"
     "--chunk-rows N\ta stream_chunk_rows (0: whole blocks; auto's choice: deepepctl status)"},
    {"help", ctl_help, "show this help", NULL},
};
#define CTL_NCMDS (sizeof ctl_cmds / sizeof ctl_cmds[0])

static const struct option ctl_longopts[] = {
    CTL_COMMON_LONGOPTS,
    {NULL, 0, NULL, 0},
};

/* The synopsis: the help's first line, and all a usage error shows of the help. */
#define CTL_USAGE_LINE "usage: deepepctl [-s SOCKET] [--json] COMMAND [OPTIONS]\n"

static void ctl_usage(FILE *f) {
  fprintf(f,
          CTL_USAGE_LINE
          "       deepepctl -h | -V\n"
          "\n"
          "Show and control deepepd, the node's warm MoE dispatch/combine daemon.\n"
          "\n"
          "options:\n"
          "  -s, --socket SOCKET  the daemon's socket (default: $" DEP_SOCKET_ENV
          ", else " DEP_DEFAULT_SOCKET ")\n"
          "  -j, --json           print one JSON object instead of text, errors too\n"
          "  -V, --version        print deepepctl's version and protocol version\n"
          "  -h, --help           show this help\n"
          "\n"
          "commands:\n");
  for (size_t i = 0; i < CTL_NCMDS; i++) {
    fprintf(f, "  %-8s  %s\n", ctl_cmds[i].name, ctl_cmds[i].help);
    /* A command's own options, one "--name ARG\twhat" line each. */
    for (const char *p = ctl_cmds[i].options; p != NULL && *p != '\0';) {
      size_t line = strcspn(p, "\n");
      size_t name = strcspn(p, "\t");
      if (name > line)
        name = line;
      const char *what = name < line ? p + name + 1 : p + line;
      fprintf(f, "    %-14.*s  %.*s\n", (int)name, p, (int)(p + line - what), what);
      p += line + (p[line] == '\n');
    }
  }
  fprintf(f, "\nexit status: 0 success, 1 failure, 2 usage error; see deepepctl(1).\n");
}

static int ctl_vfail(const struct ctl *ctl, int code, const char *fmt, va_list ap) {
  char msg[CLIENT_ERRMSG_MAX + 128];
  vsnprintf(msg, sizeof msg, fmt, ap);
  /* With --json the error is the answer, on stdout where a script reads it. */
  ctl_out_error(ctl->json ? stdout : stderr, code, msg, ctl->json);
  fflush(ctl->json ? stdout : stderr);
  return CTL_EXIT_FAIL;
}

int ctl_fail(const struct ctl *ctl, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = ctl_vfail(ctl, code, fmt, ap);
  va_end(ap);
  return rc;
}

int ctl_fail_client(const struct ctl *ctl, dep_client_t *c, int code, const char *what) {
  int rc = what != NULL ? ctl_fail(ctl, code, "%s: %s", what, dep_errmsg(c))
                        : ctl_fail(ctl, code, "%s", dep_errmsg(c));
  dep_client_free(c);
  return rc;
}

int ctl_usage_error(const struct ctl *ctl, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (ctl->json) {
    ctl_vfail(ctl, DEP_ERR_INVALID, fmt, ap);
  } else {
    /* What was wrong and where to read more: the whole help would bury the message. */
    fputs("deepepctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs("\n" CTL_USAGE_LINE "see deepepctl --help\n", stderr);
  }
  va_end(ap);
  return CTL_EXIT_USAGE;
}

void ctl_getopt_begin(void) {
  opterr = 0;
  optind = 0; /* GNU getopt: full re-initialisation for another argv */
}

int ctl_common_option(struct ctl *ctl, int ch, char **argv) {
  switch (ch) {
  case 's':
    if (optarg[0] == '\0')
      return ctl_usage_error(ctl, "-s needs a socket path, not an empty string");
    /* A path no socket can have is a malformed option argument (exit 2), as an empty one is. */
    if (strlen(optarg) >= sizeof((struct sockaddr_un *)NULL)->sun_path)
      return ctl_usage_error(ctl, "-s %s: %zu bytes, longer than the %zu a Unix socket path may "
                                  "have", optarg, strlen(optarg),
                             sizeof((struct sockaddr_un *)NULL)->sun_path - 1);
    ctl->socket = optarg;
    return -1;
  case 'j':
    ctl->json = true;
    return -1;
  case 'h':
    ctl->help = true;
    return -1;
  case 'V':
    ctl->version = true;
    return -1;
  case ':':
    return ctl_usage_error(ctl, "option %s needs an argument", argv[optind - 1]);
  default:
    if (optopt != 0)
      return ctl_usage_error(ctl, "unknown option -%c", optopt);
    return ctl_usage_error(ctl, "unknown option %s", argv[optind - 1]);
  }
}

int ctl_common_end(struct ctl *ctl) {
  if (ctl->help) {
    ctl_usage(stdout);
    return ctl_finish_output(CTL_EXIT_OK);
  }
  if (ctl->version)
    return ctl_version_show(ctl, false);
  return -1;
}

/*
 * Options are parsed twice: before the command (getopt stops at it, so a
 * command's own options cannot be mistaken for global ones), and after it,
 * so `deepepctl status --json` works too.  Returns -1 to go on.
 */
static int ctl_options(struct ctl *ctl, int argc, char **argv, bool stop_at_command) {
  ctl_getopt_begin();
  int ch;
  while ((ch = getopt_long(argc, argv, stop_at_command ? "+" CTL_COMMON_SHORTOPTS
                                                       : CTL_COMMON_SHORTOPTS,
                           ctl_longopts, NULL)) != -1) {
    int rc = ctl_common_option(ctl, ch, argv);
    if (rc >= 0)
      return rc;
  }
  return ctl_common_end(ctl);
}

int ctl_sub_options(struct ctl *ctl, int argc, char **argv) {
  return ctl_sub_options_args(ctl, argc, argv, 0);
}

int ctl_sub_options_args(struct ctl *ctl, int argc, char **argv, int max_args) {
  int rc = ctl_options(ctl, argc, argv, false);
  if (rc >= 0)
    return rc;
  if (argc - optind > max_args)
    return ctl_usage_error(ctl, max_args == 0 ? "%s takes no argument \"%s\""
                                              : "%s takes at most one argument, not \"%s\" too",
                           argv[0], argv[optind + max_args]);
  return -1;
}

/*
 * Whether --json is anywhere on the line, so that a usage error found
 * before getopt reaches it (`deepepctl bogus --json`) is still JSON.  The
 * same getopt_long as the real parse, over the whole line and ignoring
 * errors, so that -s's argument and abbreviations count as they will there.
 */
static bool ctl_json_anywhere(int argc, char **argv) {
  /* On a copy: getopt_long moves the arguments it passes over. */
  char **copy = malloc(((size_t)argc + 1) * sizeof *copy);
  if (copy == NULL)
    return false;
  memcpy(copy, argv, ((size_t)argc + 1) * sizeof *copy);
  bool json = false;
  ctl_getopt_begin();
  int ch;
  while ((ch = getopt_long(argc, copy, CTL_COMMON_SHORTOPTS, ctl_longopts, NULL)) != -1)
    json |= ch == 'j';
  free(copy);
  return json;
}

int ctl_dep_connect(const struct ctl *ctl, dep_client_t *c) {
  client_set_name(c, "deepepctl " DEP_VERSION_STRING);
  client_set_hello_timeout(c, CTL_HELLO_TIMEOUT_MS);
  int rc = dep_connect(c, ctl->socket);
  /* The library's text ("reconnect with dep_connect") is advice to a program. */
  if (rc == DEP_ERR_TIMEOUT)
    return client_seterr(c, rc,
                         "deepepd at %s accepted the connection but did not answer within %d s: "
                         "it may be hung; check `systemctl status deepepd` and its log "
                         "(`journalctl -u deepepd`)",
                         c->socket_path, CTL_HELLO_TIMEOUT_MS / 1000);
  return rc;
}

dep_client_t *ctl_connect(const struct ctl *ctl) {
  dep_client_t *c = NULL;
  int rc = dep_client_new(&c);
  if (rc != 0) {
    ctl_fail(ctl, rc, "%s", dep_strerror(rc));
    return NULL;
  }
  rc = ctl_dep_connect(ctl, c);
  if (rc != 0) {
    ctl_fail_client(ctl, c, rc, NULL);
    return NULL;
  }
  return c;
}

int ctl_finish_output(int code) {
  if (fflush(stdout) != 0 || ferror(stdout)) {
    /* stdout is what failed, so this one goes to stderr even with --json. */
    fprintf(stderr, "deepepctl: cannot write the output: %s\n", strerror(errno));
    return CTL_EXIT_FAIL;
  }
  return code;
}

static int ctl_help(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  ctl_usage(stdout);
  return ctl_finish_output(CTL_EXIT_OK);
}

int main(int argc, char **argv) {
  struct ctl ctl = {.socket = NULL, .json = false};
  ctl.json = ctl_json_anywhere(argc, argv);
  int rc = ctl_options(&ctl, argc, argv, true);
  if (rc >= 0)
    return rc;
  if (optind >= argc)
    return ctl_usage_error(&ctl, "no command given");
  const char *name = argv[optind];
  for (size_t i = 0; i < CTL_NCMDS; i++)
    if (strcmp(name, ctl_cmds[i].name) == 0)
      return ctl_cmds[i].run(&ctl, argc - optind, argv + optind);
  return ctl_usage_error(&ctl, "unknown command \"%s\"", name);
}
