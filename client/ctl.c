/*
 * ctl.c — deepepctl, the operator's view of deepepd: global options, the
 * table of subcommands (one file each, ctl_<name>.c) and the helpers they
 * share.  Exit codes: 0 success, 1 failure, 2 usage error.
 */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "client_internal.h"
#include "ctl.h"
#include "proto.h"

static int ctl_help(struct ctl *ctl, int argc, char **argv);
static int ctl_version(struct ctl *ctl, int argc, char **argv);

static const struct ctl_cmd ctl_cmds[] = {
    {"status", ctl_status, "show version, uptime, backend, devices, clients and jobs"},
    {"reload", ctl_reload, "re-read deepepd's configuration (as SIGHUP); root or its user only"},
    {"version", ctl_version, "print deepepctl's version and protocol version"},
    {"help", ctl_help, "show this help"},
};
#define CTL_NCMDS (sizeof ctl_cmds / sizeof ctl_cmds[0])

static const struct option ctl_longopts[] = {
    {"socket", required_argument, NULL, 's'},
    {"json", no_argument, NULL, 'j'},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

static void ctl_usage(FILE *f) {
  fprintf(f,
          "usage: deepepctl [-s SOCKET] [--json] COMMAND\n"
          "\n"
          "Show and control deepepd, the node's warm MoE dispatch/combine daemon.\n"
          "\n"
          "options:\n"
          "  -s, --socket SOCKET  the daemon's socket (default: $" DEP_SOCKET_ENV
          ", else " DEP_DEFAULT_SOCKET ")\n"
          "  -j, --json           print one JSON object instead of text\n"
          "  -h, --help           show this help\n"
          "\n"
          "commands:\n");
  for (size_t i = 0; i < CTL_NCMDS; i++)
    fprintf(f, "  %-8s %s\n", ctl_cmds[i].name, ctl_cmds[i].help);
  fprintf(f, "\nexit status: 0 success, 1 failure, 2 usage error; see deepepctl(1).\n");
}

int ctl_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("deepepctl: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return CTL_EXIT_FAIL;
}

static int ctl_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int ctl_usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("deepepctl: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\n\n", stderr);
  va_end(ap);
  ctl_usage(stderr);
  return CTL_EXIT_USAGE;
}

/*
 * Options are parsed twice: before the command (getopt stops at it, so a
 * future command's own options cannot be mistaken for global ones), and
 * after it, so `deepepctl status --json` works too.  Returns -1 to go on.
 */
static int ctl_options(struct ctl *ctl, int argc, char **argv, bool stop_at_command) {
  opterr = 0;
  optind = 0; /* GNU getopt: full re-initialisation for a second argv */
  int ch;
  while ((ch = getopt_long(argc, argv, stop_at_command ? "+:s:jh" : ":s:jh", ctl_longopts,
                           NULL)) != -1) {
    switch (ch) {
    case 's':
      if (optarg[0] == '\0')
        return ctl_usage_error("-s needs a socket path, not an empty string");
      ctl->socket = optarg;
      break;
    case 'j':
      ctl->json = true;
      break;
    case 'h':
      ctl_usage(stdout);
      return ctl_finish_output(CTL_EXIT_OK);
    case ':':
      return ctl_usage_error("option %s needs an argument", argv[optind - 1]);
    default:
      if (optopt != 0)
        return ctl_usage_error("unknown option -%c", optopt);
      return ctl_usage_error("unknown option %s", argv[optind - 1]);
    }
  }
  return -1;
}

int ctl_sub_options(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_options(ctl, argc, argv, false);
  if (rc >= 0)
    return rc;
  if (optind < argc)
    return ctl_usage_error("%s takes no argument \"%s\"", argv[0], argv[optind]);
  return -1;
}

dep_client_t *ctl_connect(const struct ctl *ctl) {
  dep_client_t *c = NULL;
  int rc = dep_client_new(&c);
  if (rc != 0) {
    ctl_fail("%s", dep_strerror(rc));
    return NULL;
  }
  client_set_name(c, "deepepctl " DEP_VERSION_STRING);
  if (dep_connect(c, ctl->socket) != 0) {
    ctl_fail("%s", dep_errmsg(c));
    dep_client_free(c);
    return NULL;
  }
  return c;
}

int ctl_finish_output(int code) {
  if (fflush(stdout) != 0 || ferror(stdout)) {
    ctl_fail("cannot write the output: %s", strerror(errno));
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

static int ctl_version(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  static const struct ctl_col cols[] = {
      {"version", "deepepctl", CTL_STR, 0},
      {"proto_version", "protocol", CTL_UINT, 0},
  };
  const struct ctl_val vals[] = {{.s = DEP_VERSION_STRING}, {.u = DEP_PROTO_VERSION}};
  const struct ctl_doc doc = {cols, vals, 2, NULL, 0};
  ctl_out_render(stdout, &doc, ctl->json);
  return ctl_finish_output(CTL_EXIT_OK);
}

int main(int argc, char **argv) {
  struct ctl ctl = {.socket = NULL, .json = false};
  int rc = ctl_options(&ctl, argc, argv, true);
  if (rc >= 0)
    return rc;
  if (optind >= argc)
    return ctl_usage_error("no command given");
  const char *name = argv[optind];
  for (size_t i = 0; i < CTL_NCMDS; i++)
    if (strcmp(name, ctl_cmds[i].name) == 0)
      return ctl_cmds[i].run(&ctl, argc - optind, argv + optind);
  return ctl_usage_error("unknown command \"%s\"", name);
}
