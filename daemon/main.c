/*
 * main.c — deepepd's command line and the order in which its modules start
 * and stop.  No daemonizing: systemd runs it in the foreground
 * (Type=notify) and collects stderr.
 */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "config.h"
#include "conn.h"
#include "control.h"
#include "deepep.h"
#include "deepepd.h"
#include "devices.h"
#include "autotune.h"
#include "held.h"
#include "job.h"
#include "log.h"
#include "metrics_http.h"
#include "notify.h"
#include "peer.h"
#include "pool.h"
#include "proto.h"
#include "rdmadrv.h"
#include "server.h"
#include "warmup.h"
#include "stats.h"
#include "testhooks.h"
#include "xfer.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: deepepd [-c FILE] [-s SOCKET] [--backend auto|cuda|host] [--log-level LEVEL]\n"
          "       deepepd --check-config FILE\n"
          "\n"
          "  -c, --config FILE     configuration file (default " DEEPEPD_DEFAULT_CONFIG
          " if it exists,\n"
          "                        else the built-in defaults)\n"
          "  -s, --socket PATH     listen on PATH instead of socket.path\n"
          "      --backend B       auto, cuda or host, instead of the configured backend\n"
          "      --log-level L     err, warning, notice, info or debug\n"
          "      --check-config F  validate F (and that the users and groups it names exist)\n"
          "                        and exit (0: valid, 1: not)\n"
          "  -h, --help            this text\n"
          "  -V, --version         print the version and exit\n");
}

static int parse_backend(const char *s) {
  for (int b = CONFIG_BACKEND_AUTO; b <= CONFIG_BACKEND_HOST; b++)
    if (strcmp(s, config_backend_name((enum config_backend)b)) == 0)
      return b;
  return -1;
}

static int parse_log_level(const char *s) {
  for (int l = CONFIG_LOG_ERR; l <= CONFIG_LOG_DEBUG; l++)
    if (strcmp(s, config_log_level_name((enum config_log_level)l)) == 0)
      return l;
  return -1;
}

/* --check-config: the file parses and every user and group it names exists here. */
static int check_config(const char *path) {
  static struct config c;
  char err[2048];
  config_defaults(&c);
  if (config_load_file(&c, path, err, sizeof err) != 0) {
    fprintf(stderr, "%s\n", err);
    return 1;
  }
  if (config_check_accounts(&c, CONFIG_ACCOUNTS_ALL, err, sizeof err) > 0) {
    fprintf(stderr, "%s: %s\n", path, err);
    return 1;
  }
  printf("%s: ok\n", path);
  return 0;
}

/* Load the configuration deepepd runs with.  0 or -1 (logged). */
static int load_config(const char *cli_path) {
  struct config *c = &deepepd.cfg;
  config_defaults(c);
  const char *path = cli_path;
  if (path == NULL && access(DEEPEPD_DEFAULT_CONFIG, F_OK) == 0)
    path = DEEPEPD_DEFAULT_CONFIG;
  if (path != NULL) {
    char err[1024];
    if (config_load_file(c, path, err, sizeof err) != 0) {
      log_errx("%s", err);
      return -1;
    }
    /* The socket's group is needed to start; an allow entry that names nobody admits nobody,
     * which the daemon can run with but should say. */
    if (config_check_accounts(c, CONFIG_ACCOUNTS_SOCKET, err, sizeof err) > 0) {
      log_errx("%s: %s", path, err);
      return -1;
    }
    if (config_check_accounts(c, CONFIG_ACCOUNTS_ALLOW, err, sizeof err) > 0)
      log_warnx("%s: %s", path, err);
    snprintf(deepepd.config_path, sizeof deepepd.config_path, "%s", path);
  }
  deepepd_apply_overrides(c);
  log_set_level((int)c->log_level);
  if (path != NULL)
    log_info("configuration: %s", path);
  else
    log_info("configuration: built-in defaults (no %s)", DEEPEPD_DEFAULT_CONFIG);
  return 0;
}

static uint64_t main_pools_start_ns;
static bool main_pools_failed;

/* The pools are made and the peers up (missing NULL) or waited for long enough: ready. */
static void main_on_peers(const char *missing) {
  if (deepepd.stopping)
    return;
  notify_send("READY=1");
  if (missing != NULL)
    notify_send("STATUS=listening on %s; peers missing: %s", deepepd.cfg.socket_path, missing);
  else
    notify_send("STATUS=listening on %s", deepepd.cfg.socket_path);
}

/* The kernel warm-up is over: a failure stops the daemon (its child said why), else the peers. */
static void main_on_warmup(int rc, const char *why) {
  deepepd.warming = false;
  if (deepepd.stopping)
    return;
  if (rc != 0) {
    log_errx("%s", why);
    main_pools_failed = true;
    deepepd_shutdown("the kernel warm-up failed");
    return;
  }
  /* READY=1 also waits for the peer daemons, at most peer_wait_ms (peer.c). */
  peer_wait(main_on_peers);
}

/* With kernel_warmup on cuda, a child runs every kernel on each GPU before READY=1 (warmup.h). */
static void main_warmup(void) {
  static char uuids[64][37];
  size_t n = 0;
  for (size_t i = 0; i < devices_count() && n < 64; i++)
    snprintf(uuids[n++], sizeof uuids[0], "%s", devices_at(i)->dev.uuid_str);
  bool cuda = strcmp(devices_backend_name(), "cuda") == 0;
  if (cuda && deepepd.cfg.kernel_warmup && n > 0) {
    deepepd.warming = true;
    notify_send("STATUS=running every kernel once on %zu GPU(s)", n);
    if (warmup_start(deepepd.loop, deepepd.cfg.socket_path, uuids, n, main_on_warmup) == 0)
      return;
    main_on_warmup(DEP_ERR_INTERNAL, "the kernel warm-up could not start (see above); set "
                   "kernel_warmup: false to start without it");
    return;
  }
  main_on_warmup(0, NULL);
}

/*
 * The device pools are made (rc 0) or could not be: on the loop thread.
 * Only now is the daemon ready: READY=1 only once the pools are warm
 * (DESIGN §10), and the ATTACH requests that came meanwhile go on.
 */
static void main_on_pools(int rc, const char *why) {
  deepepd.starting = false;
  if (deepepd.stopping) { /* a stop while they were made: not a failure of the start */
    if (rc != 0)
      log_info("devices: %s", why);
    control_attach_resume(DEP_ERR_DAEMON_GONE, "deepepd is stopping");
    return;
  }
  if (rc != 0) {
    log_errx("devices: %s", why);
    main_pools_failed = true;
    char msg[DEP_MSG_TEXT_MAX];
    snprintf(msg, sizeof msg, "deepepd could not make its device pools (%s) and is stopping", why);
    control_attach_resume(rc, msg);
    deepepd_shutdown("the device pools could not be made");
    return;
  }
  log_info("device pools ready in %llu ms",
           (unsigned long long)((uv_hrtime() - main_pools_start_ns) / 1000000u));
  control_attach_resume(0, NULL);
  autotune_start(deepepd.loop, &deepepd.cfg); /* without it, every rank gets the default */
  main_warmup();
}

/* How shutdown reaches the server and its clients (deepepd.h). */
static const struct deepepd_stop_ops main_stop_ops = {
    .clients = conn_count,
    .stop_accepting = server_fini,
    .close_clients = conn_shutdown_all,
};

/* ---- the modules, in the order they start ------------------------------------ */

/*
 * Each module's start as the table calls it: with the loop and the running
 * configuration, 0 or -1 (said).  A module whose own start takes other
 * arguments, or cannot fail, gets its adapter here.
 */
static int main_deepepd_init(uv_loop_t *loop, const struct config *cfg) {
  return deepepd_init(loop, &main_stop_ops);
}

static int main_conn_init(uv_loop_t *loop, const struct config *cfg) {
  conn_init(loop, &control_conn_ops);
  return 0;
}

static int main_stats_init(uv_loop_t *loop, const struct config *cfg) {
  stats_init(loop, cfg);
  return 0;
}

static int main_server_init(uv_loop_t *loop, const struct config *cfg) {
  /* STATUS says "starting" until the pools are made. */
  deepepd.starting = true;
  return server_init(loop, cfg) == 0 ? 0 : -1;
}

/* metrics.listen, once the socket is ours: an address that cannot be bound fails the start. */
static int main_metrics_init(uv_loop_t *loop, const struct config *cfg) {
  return metrics_http_init(loop, cfg) == 0 ? 0 : -1;
}

/* The peers connect while the pools are made; READY=1 waits for both. */
static int main_peer_init(uv_loop_t *loop, const struct config *cfg) {
  return peer_init(loop, cfg) == 0 ? 0 : -1;
}

/* What an earlier daemon's ranks still hold, before the pools that it is charged to. */
static int main_held_init(uv_loop_t *loop, const struct config *cfg) {
  notify_send("STATUS=making device pools");
  held_load(cfg->socket_path);
  held_init(loop, cfg->socket_path);
  return 0;
}

/* The pools are made after the socket is claimed (a second daemon must not
 * allocate a whole pool before learning it cannot run), off the loop: the
 * loop runs at once, so STATUS is answered while they are made (seconds for
 * a large pool) and ATTACH waits for them (main_on_pools). */
static int main_devices_init(uv_loop_t *loop, const struct config *cfg) {
  rdmadrv_probe_log(); /* once: the RDMA devices, or why peers will use TCP */
  main_pools_start_ns = uv_hrtime();
  return devices_init(loop, cfg, main_on_pools) == 0 ? 0 : -1;
}

static int main_job_init(uv_loop_t *loop, const struct config *cfg) {
  job_init(loop, cfg);
  return 0;
}

/* The data path between nodes: its threads start with the first job that spans nodes. */
static int main_xfer_init(uv_loop_t *loop, const struct config *cfg) {
  return xfer_init(cfg) == 0 ? 0 : -1;
}

/* First of all, so that every module below finds its test faults read and
 * a daemon running with any says so before it does anything else.  In the
 * table rather than in main: --check-config and the daemon's own children
 * (warm-up, tuning), which inherit the environment, neither act on the
 * hooks nor repeat the warning. */
static int main_testhooks_init(uv_loop_t *loop, const struct config *cfg) {
  (void)loop;
  (void)cfg;
  return testhooks_init();
}

/*
 * deepepd's modules in the order they start; they stop in the reverse, so
 * that what a module uses is there until it stops: the proxy threads (xfer)
 * stop before the slabs they read go back (job), every slab before its pool
 * (devices), the data path's RDMA before the device it was made on (peer),
 * and the socket (server) goes last but for the signals and the test hooks.
 * A module whose start fails is stopped too (each fini is safe after its
 * init failed partway), then those before it; each module stops once.  The warm-up and
 * the tuning start later, once the pools are made (main_on_pools): they have
 * no start here, and stop in their place.  There is no reload column: every
 * module reads the running configuration, which a reload rewrites in place
 * (deepepd_apply_live), at each use.
 */
static const struct main_module {
  const char *name;
  int (*init)(uv_loop_t *loop, const struct config *cfg); /* NULL: started later */
  void (*fini)(void);
} main_modules[] = {
    {"test hooks", main_testhooks_init, testhooks_fini},
    {"signals", main_deepepd_init, deepepd_fini},
    {"connections", main_conn_init, conn_fini},
    {"stats", main_stats_init, stats_fini},
    {"socket", main_server_init, server_fini},
    {"metrics", main_metrics_init, metrics_http_fini},
    {"peers", main_peer_init, peer_fini},
    {"held memory", main_held_init, held_fini},
    {"tuning", NULL, autotune_fini},
    {"kernel warm-up", NULL, warmup_fini},
    {"devices", main_devices_init, devices_fini},
    {"jobs", main_job_init, job_fini},
    {"data path", main_xfer_init, xfer_fini},
};
#define MAIN_NMODULES (sizeof main_modules / sizeof main_modules[0])

/* Start the modules in order: true when every one started.  *n is how many
 * main_stop must stop: those that started, and one whose start failed. */
static bool main_start(uv_loop_t *loop, size_t *n) {
  for (size_t i = 0; i < MAIN_NMODULES; i++) {
    *n = i + 1;
    if (main_modules[i].init != NULL && main_modules[i].init(loop, &deepepd.cfg) != 0) {
      log_debug("start: %s failed; stopping what started", main_modules[i].name);
      return false;
    }
  }
  return true;
}

/* Stop the first n modules, the last first. */
static void main_stop(size_t n) {
  while (n > 0)
    main_modules[--n].fini();
}

/* What the command line asked for: each NULL where its option was not given. */
struct main_args {
  const char *config_path;   /* -c */
  const char *check_path;    /* --check-config */
  const char *warmup_socket; /* the warm-up's child */
  const char *tune_socket;   /* the autotune's child */
};

/* The options, into m and deepepd's overrides: -1 to go on, else the status to exit with
 * (0 after --help or --version, 2 for a malformed option, as deepepd(8) says). */
static int main_parse(int argc, char **argv, struct main_args *m) {
  enum { OPT_BACKEND = 256, OPT_LOG_LEVEL, OPT_CHECK, OPT_WARMUP, OPT_TUNE };
  static const struct option opts[] = {
      {"config", required_argument, NULL, 'c'},
      {"socket", required_argument, NULL, 's'},
      {"backend", required_argument, NULL, OPT_BACKEND},
      {"log-level", required_argument, NULL, OPT_LOG_LEVEL},
      {"check-config", required_argument, NULL, OPT_CHECK},
      {WARMUP_CHILD_OPT, required_argument, NULL, OPT_WARMUP}, /* the daemon's own child */
      {AUTOTUNE_CHILD_OPT, required_argument, NULL, OPT_TUNE},  /* and its other one */
      {"help", no_argument, NULL, 'h'},
      {"version", no_argument, NULL, 'V'},
      {NULL, 0, NULL, 0}};
  int o;
  while ((o = getopt_long(argc, argv, "c:s:hV", opts, NULL)) != -1) {
    switch (o) {
    case 'c':
      m->config_path = optarg;
      break;
    case 's':
      /* An empty override would quietly mean "no override": the default socket. */
      if (optarg[0] == '\0') {
        fprintf(stderr, "deepepd: -s/--socket needs a path; leave it out to use socket.path\n");
        return 2;
      }
      if (strlen(optarg) >= CONFIG_PATH_MAX) {
        /* A malformed option argument, as an empty one is: status 2 (deepepd(8)). */
        fprintf(stderr, "deepepd: -s/--socket: socket path too long (%zu bytes, max %d, "
                "the size of sun_path): %s\n", strlen(optarg), CONFIG_PATH_MAX - 1, optarg);
        return 2;
      }
      snprintf(deepepd.socket_override, sizeof deepepd.socket_override, "%s", optarg);
      break;
    case OPT_BACKEND:
      if ((deepepd.backend_override = parse_backend(optarg)) < 0) {
        fprintf(stderr, "deepepd: --backend %s: use auto, cuda or host\n", optarg);
        return 2;
      }
      break;
    case OPT_LOG_LEVEL:
      if ((deepepd.log_level_override = parse_log_level(optarg)) < 0) {
        fprintf(stderr, "deepepd: --log-level %s: use err, warning, notice, info or debug\n",
                optarg);
        return 2;
      }
      break;
    case OPT_CHECK:
      m->check_path = optarg;
      break;
    case OPT_WARMUP:
      m->warmup_socket = optarg;
      break;
    case OPT_TUNE:
      m->tune_socket = optarg;
      break;
    case 'h':
      usage(stdout);
      return 0;
    case 'V':
      printf("deepepd %s (protocol %d)\n", DEP_VERSION_STRING, DEP_PROTO_VERSION);
      return 0;
    default:
      usage(stderr);
      return 2;
    }
  }
  return -1;
}

/* The daemon itself: the configuration loaded, the modules started in order, the loop
 * run until a stop, and everything undone in reverse; returns the exit status. */
static int main_serve(const char *config_path) {
  /* Replies go out with MSG_NOSIGNAL; this covers anything else that writes. */
  signal(SIGPIPE, SIG_IGN);
  log_init(deepepd.log_level_override >= 0 ? deepepd.log_level_override : LOG_PRIO_INFO);
  if (load_config(config_path) != 0)
    return 1;
  log_info("deepepd %s (protocol %d) starting, pid %d", DEP_VERSION_STRING, DEP_PROTO_VERSION,
           (int)getpid());
  notify_init();
  notify_send("STATUS=starting");

  int status = 1;
  uv_loop_t loop;
  int rc = uv_loop_init(&loop);
  if (rc != 0) {
    log_errx("uv_loop_init: %s", uv_strerror(rc));
    notify_fini();
    log_fini();
    return status;
  }
  size_t started = 0;
  bool ran = main_start(&loop, &started);
  if (ran)
    uv_run(&loop, UV_RUN_DEFAULT);
  else
    deepepd.stopping = true; /* pools whose making began end as in a stop (main_on_pools) */
  /* Stopped while the pools were being made: the thread making them gives up
   * before its next block, and is waited for. */
  pool_stop_making();
  while (devices_pending())
    uv_run(&loop, UV_RUN_ONCE);
  if (ran)
    status = main_pools_failed ? 1 : 0;
  main_stop(started);
  /* Let every close callback run, so nothing is left allocated. */
  uv_run(&loop, UV_RUN_DEFAULT);
  rc = uv_loop_close(&loop);
  if (rc != 0)
    log_warnx("uv_loop_close: %s (a handle was left open)", uv_strerror(rc));
  notify_fini();
  log_fini();
  return status;
}

int main(int argc, char **argv) {
  struct main_args m = {0};
  int status = main_parse(argc, argv, &m);
  if (status >= 0)
    return status;
  if (m.warmup_socket != NULL) { /* the start-up warm-up's child (warmup.h): GPU UUIDs follow */
    log_init(LOG_PRIO_INFO);
    return warmup_child_main(m.warmup_socket, argc - optind, argv + optind);
  }
  if (m.tune_socket != NULL) { /* adaptive_optimization's measurement (autotune.h) */
    log_init(LOG_PRIO_INFO);
    return autotune_child_main(m.tune_socket, argc - optind, argv + optind);
  }
  if (optind < argc) {
    fprintf(stderr, "deepepd: unexpected argument: %s\n", argv[optind]);
    usage(stderr);
    return 2;
  }
  if (m.check_path != NULL)
    return check_config(m.check_path);
  return main_serve(m.config_path);
}
