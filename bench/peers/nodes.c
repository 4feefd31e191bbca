/*
 * nodes.c — the peer benchmark's two "nodes": two network namespaces joined
 * by a veth pair (10.78.0.1 and 10.78.0.2), a shared peer key, one deepepd
 * in each (host backend), started with setns + exec so that nothing but the
 * daemon itself is timed, and the PEERS polls that say when their pools are
 * up.  Everything it makes is undone at exit and on SIGINT/SIGTERM.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../benchlib.h"
#include "client_internal.h"
#include "peers.h"

extern char **environ;

/* What the cleanup needs, also from a signal handler: set up before any is installed. */
static struct nodes *live;
static int ns_fd[NODES] = {-1, -1};
static char cleanup_cmd[1024]; /* ip netns delete ...; rm -rf DIR */

void die(const char *fmt, ...) {
  va_list ap;
  fflush(stdout);
  fprintf(stderr, "peers: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  if (live != NULL)
    for (int i = 0; i < NODES; i++)
      if (live->log[i][0] != '\0')
        fprintf(stderr, "peers: node %d's daemon log: %s\n", i, live->log[i]);
  exit(1);
}

/* A shell command, its output discarded; its exit status. */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
  char cmd[768], quiet[840];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  snprintf(quiet, sizeof quiet, "%s >/dev/null 2>&1", cmd);
  return system(quiet);
}

/* Only async-signal-safe calls: kill, fork, execve, waitpid, _exit. */
static void cleanup_run(void) {
  if (live == NULL)
    return;
  for (int i = 0; i < NODES; i++)
    if (live->pid[i] > 0) {
      kill(live->pid[i], SIGKILL);
      waitpid(live->pid[i], NULL, 0);
      live->pid[i] = 0;
    }
  pid_t p = fork();
  if (p == 0) {
    char *const argv[] = {"sh", "-c", cleanup_cmd, NULL};
    execve("/bin/sh", argv, environ);
    _exit(127);
  }
  if (p > 0)
    waitpid(p, NULL, 0);
  live = NULL;
}

void nodes_cleanup(void) { cleanup_run(); }

static void on_signal(int sig) {
  cleanup_run();
  _exit(128 + sig);
}

/* The key both daemons share: 32 random bytes as hex, mode 0600 (as deepepctl genkey). */
static void write_key(const char *path) {
  uint8_t raw[32];
  if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw)
    die("getrandom: %s", strerror(errno));
  char hex[2 * sizeof raw + 2];
  for (size_t i = 0; i < sizeof raw; i++)
    snprintf(hex + 2 * i, 3, "%02x", raw[i]);
  strcat(hex, "\n");
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 || write(fd, hex, strlen(hex)) != (ssize_t)strlen(hex) || close(fd) != 0)
    die("cannot write the key %s: %s", path, strerror(errno));
}

const char *nodes_setup(struct nodes *n, const char *deepepd, int pool_size,
                        uint64_t host_pool_bytes, const char *transport, bool keep) {
  memset(n, 0, sizeof *n);
  if (geteuid() != 0)
    return "not root: network namespaces need CAP_SYS_ADMIN (run it as root)";
  if (sh("ip netns list") != 0)
    return "ip netns is not available (install iproute2)";
  if (access(deepepd, X_OK) != 0)
    die("no deepepd at %s (build it, or name it with -D)", deepepd);
  snprintf(n->deepepd, sizeof n->deepepd, "%s", deepepd);
  n->pool_size = pool_size;
  n->host_pool_bytes = host_pool_bytes;
  snprintf(n->want_transport, sizeof n->want_transport, "%s", transport);
  snprintf(n->dir, sizeof n->dir, "/tmp/dep-bench-peers-XXXXXX");
  if (mkdtemp(n->dir) == NULL)
    die("mkdtemp: %s", strerror(errno));
  int pid = (int)getpid();
  for (int i = 0; i < NODES; i++) {
    snprintf(n->ns[i], sizeof n->ns[i], "dbp%d_%d", pid, i);
    snprintf(n->addr[i], sizeof n->addr[i], "10.78.0.%d", i + 1);
  }
  snprintf(cleanup_cmd, sizeof cleanup_cmd, "ip netns delete %s; ip netns delete %s; %s%s",
           n->ns[0], n->ns[1], keep ? "" : "rm -rf ", keep ? "" : n->dir);
  live = n;
  atexit(nodes_cleanup);
  struct sigaction sa = {.sa_handler = on_signal};
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  for (int i = 0; i < NODES; i++) {
    if (sh("ip netns add %s", n->ns[i]) != 0)
      return "ip netns add failed (no network namespaces here?)";
    sh("ip -n %s link set lo up", n->ns[i]);
  }
  if (sh("ip link add dbp%da netns %s type veth peer name dbp%db netns %s", pid, n->ns[0], pid,
         n->ns[1]) != 0)
    return "ip link add type veth failed (no veth here?)";
  for (int i = 0; i < NODES; i++) {
    if (sh("ip -n %s addr add %s/24 dev dbp%d%c", n->ns[i], n->addr[i], pid, "ab"[i]) != 0 ||
        sh("ip -n %s link set dbp%d%c up", n->ns[i], pid, "ab"[i]) != 0)
      return "cannot configure the veth pair";
    char path[64];
    snprintf(path, sizeof path, "/run/netns/%s", n->ns[i]);
    if ((ns_fd[i] = open(path, O_RDONLY | O_CLOEXEC)) < 0)
      die("open %s: %s", path, strerror(errno));
  }
  snprintf(n->key, sizeof n->key, "%s/peer.key", n->dir);
  write_key(n->key);
  return NULL;
}

/* Node i's configuration for start number gen: fresh socket, held file and log. */
static void write_config(struct nodes *n, int i, const char *path) {
  int other = 1 - i;
  FILE *f = fopen(path, "w");
  if (f == NULL)
    die("cannot write %s: %s", path, strerror(errno));
  /* preallocation off: a fresh daemon makes memory when a job needs it, as
   * a job without a daemon would; the warm daemons keep each job shape's
   * arena (buffer_cache_enabled) from its first job on. */
  fprintf(f,
          "socket: {path: %s}\n"
          "backend: host\n"
          "preallocation: false\n"
          "pool: {host_size: %lluMiB}\n"
          "connection_pool_size: %d\n"
          "listen: {address: %s, port: %d}\n"
          "peers: [{host: %s, port: %d}]\n"
          "peer_key_file: %s\n"
          "peer_wait_ms: 0\n"
          "log_level: warning\n"
          "limits: {attach_timeout_ms: 20000}\n",
          n->sock[i], (unsigned long long)(n->host_pool_bytes >> 20), n->pool_size, n->addr[i],
          PEER_PORT, n->addr[other], PEER_PORT, n->key);
  if (n->want_transport[0] != '\0')
    fprintf(f, "transport: %s\n", n->want_transport);
  if (fclose(f) != 0)
    die("cannot write %s", path);
}

double nodes_start(struct nodes *n) {
  char conf[NODES][320];
  /* A copy: the names are written into the same struct as the directory, which
   * snprintf's restrict forbids (gcc says so under the sanitizers' -O1). */
  char dir[sizeof n->dir];
  memcpy(dir, n->dir, sizeof dir);
  for (int i = 0; i < NODES; i++) {
    snprintf(n->sock[i], sizeof n->sock[i], "%s/g%d-n%d.sock", dir, n->gen, i);
    snprintf(n->log[i], sizeof n->log[i], "%s/g%d-n%d.log", dir, n->gen, i);
    snprintf(conf[i], sizeof conf[i], "%s/g%d-n%d.yaml", dir, n->gen, i);
    write_config(n, i, conf[i]);
  }
  n->gen++;
  fflush(stdout);
  double t0 = bench_now_ms();
  for (int i = 0; i < NODES; i++) {
    pid_t pid = fork();
    if (pid < 0)
      die("fork: %s", strerror(errno));
    if (pid == 0) {
      int log = open(n->log[i], O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
      int null = open("/dev/null", O_RDWR | O_CLOEXEC);
      if (log < 0 || null < 0 || setns(ns_fd[i], CLONE_NEWNET) != 0)
        _exit(126);
      dup2(null, STDIN_FILENO);
      dup2(null, STDOUT_FILENO);
      dup2(log, STDERR_FILENO);
      execl(n->deepepd, "deepepd", "-c", conf[i], (char *)NULL);
      _exit(127);
    }
    n->pid[i] = pid;
  }
  return t0;
}

/* PEERS of an open client: whether its one peer is up with every connection both ways. */
static int peers_all_up(dep_client_t *c, int pool_size, bool *up, char *transport) {
  struct client_frame f;
  int rc = client_request(c, DEP_MSG_PEERS, NULL, DEP_MSG_PEERS_OK, 5000, &f);
  if (rc != 0)
    return rc;
  struct dep_msg_peers m = {0};
  rc = proto_decode_peers(f.body, f.hdr.body_len, &m);
  client_frame_release(&f);
  if (rc != 0)
    return rc;
  const struct dep_msg_peer_info *p = m.n_peers == 1 ? &m.peers[0] : NULL;
  *up = p != NULL && strcmp(p->state, "up") == 0 && p->conns_up == (uint32_t)pool_size &&
        p->conns_total == (uint32_t)pool_size && p->inbound_up == (uint32_t)pool_size;
  if (p != NULL && transport != NULL)
    snprintf(transport, sizeof p->transport, "%s", p->transport);
  proto_peers_free(&m);
  return 0;
}

static void check_alive(struct nodes *n, int i) {
  int st;
  if (n->pid[i] > 0 && waitpid(n->pid[i], &st, WNOHANG) == n->pid[i]) {
    n->pid[i] = 0;
    die("node %d's deepepd exited (status %d)", i, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  }
}

void nodes_wait_up(struct nodes *n, double t0, double *sock_ms, double *up_ms, int timeout_ms) {
  dep_client_t *c[NODES] = {NULL};
  bool connected[NODES] = {false}, up[NODES] = {false};
  for (int i = 0; i < NODES; i++)
    if (dep_client_new(&c[i]) != 0)
      die("out of memory");
  const struct timespec tick = {.tv_nsec = 500 * 1000}; /* 0.5 ms between polls */
  while (!up[0] || !up[1]) {
    for (int i = 0; i < NODES; i++) {
      if (up[i])
        continue;
      check_alive(n, i);
      if (!connected[i] && dep_connect(c[i], n->sock[i]) == 0) {
        connected[i] = true;
        sock_ms[i] = bench_now_ms() - t0;
      }
      if (connected[i]) {
        int rc = peers_all_up(c[i], n->pool_size, &up[i], i == 0 ? n->transport : NULL);
        if (rc != 0)
          die("PEERS on node %d: %s (%s)", i, dep_errmsg(c[i]), dep_strerror(rc));
        if (up[i])
          up_ms[i] = bench_now_ms() - t0;
      }
    }
    if (bench_now_ms() - t0 > timeout_ms)
      die("the peers were not all up after %d ms (deepepctl -s %s peers)", timeout_ms,
          n->sock[up[0] ? 1 : 0]);
    nanosleep(&tick, NULL);
  }
  for (int i = 0; i < NODES; i++)
    dep_client_free(c[i]);
}

void nodes_quiesce(struct nodes *n, int i) {
  dep_client_t *c;
  bool up = false;
  if (dep_client_new(&c) != 0)
    die("out of memory");
  int rc = dep_connect(c, n->sock[i]);
  if (rc == 0)
    rc = peers_all_up(c, n->pool_size, &up, NULL);
  if (rc != 0)
    die("node %d: %s (%s)", i, dep_errmsg(c), dep_strerror(rc));
  dep_client_free(c);
}

void nodes_stop(struct nodes *n) {
  for (int i = 0; i < NODES; i++)
    if (n->pid[i] > 0)
      kill(n->pid[i], SIGTERM);
  for (int i = 0; i < NODES; i++) {
    if (n->pid[i] <= 0)
      continue;
    int st = 0;
    double t0 = bench_now_ms();
    while (waitpid(n->pid[i], &st, WNOHANG) == 0) {
      if (bench_now_ms() - t0 > 10000) {
        kill(n->pid[i], SIGKILL);
        waitpid(n->pid[i], &st, 0);
        break;
      }
      const struct timespec ms = {.tv_nsec = 1000 * 1000};
      nanosleep(&ms, NULL);
    }
    n->pid[i] = 0;
  }
}
