/*
 * peers.c — warm peer connections and multi-node attach (issue 13's
 * benchmark): two deepepd "nodes" in two network namespaces joined by a
 * veth pair, each configured with the other as its peer and a shared
 * peer_key_file, measured in one run:
 *
 *   1. connections up: from starting both daemons to every one of the
 *      connection_pool_size connections up on both sides, outbound and
 *      inbound (the daemons' PEERS answers, polled every 0.5 ms);
 *   2. warm multi-node attach: a job of 4 ranks, 2 on each node (host
 *      backend), each rank a process in its node's namespace; the clock
 *      runs from releasing all 4 at once to the last one's dep_attach
 *      returning with its slabs mapped (bench/attach's attach-to-ready),
 *      for many job starts (a new job id each) on the same daemons;
 *   3. the same job on one node: its 4 ranks on one daemon (the same world
 *      size, shape and slabs per rank: "the same job"), and 2 ranks of a
 *      job of world 2 on one daemon (the same local ranks, smaller slabs);
 *      the three kinds interleave round by round (their order rotating), so
 *      each round's difference multi - single is paired under the same load;
 *   4. the cold path, what a job start pays with no warm state: fresh
 *      daemons each time (start both, wait for the connections, attach the
 *      job, whose memory is made then), and the parts timed apart: TCP
 *      connect + the HMAC handshake (the benchmark poses as node 0's daemon,
 *      with the daemon's own peerauth.c, and opens the pool's connections to
 *      node 1's daemon at once), one peer message's round trip through the
 *      far daemon's loop (what exchanging membership costs on a link that is
 *      up), and RDMA registration of the job's memory where a device exists.
 *
 *   peers [-i ROUNDS] [-c COLD] [-P POOL] [-p PAUSE_MS] [-T TRANSPORT]
 *         [-D DEEPEPD] [-K] [-t TOKENS] [-H HIDDEN] [-k TOPK] [-e EXPERTS]
 *   peers --reg-gb N [-r REPS]
 *
 * --reg-gb: only ibv_reg_mr / ibv_dereg_mr of N GiB of host memory (mmap,
 * every page touched) on the first RDMA device, through the daemon's seam
 * (daemon/rdmadrv.h), REPS times (default 5); exit 77 without a device.
 *
 * Needs root (network namespaces); without it, or without ip netns or
 * veth, it says why and exits 77.  The links run on the transport the
 * daemons choose (-T sets their `transport`), printed as PEERS reports it:
 * TCP on veth without an RDMA device (and rdma cannot serve here: the nodes
 * are namespaces of one kernel, whose Soft-RoCE devices carry no traffic
 * between them).  Before the first cold start one start is made and thrown
 * away (page cache, ARP).  Rounds are PAUSE_MS apart (default 50), after a
 * PEERS request to each daemon has come back: the daemon scrubs a job's
 * memory on its loop when the job ends, and the next job should not wait
 * for that.  Times are median, p10 and p90 (linear interpolation).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "benchlib.h"
#include "peers/peers.h"
#include "slab.h"
#include "xring.h"

#define MAX_ROUNDS 200
#define MAX_COLD 100
#define PINGS 10
#define LOCAL_MAX 4 /* node 0 holds at most the 4 ranks of the one-node job */

enum kind { MULTI, SINGLE4, SINGLE2, KINDS };
/* Where the slowest rank's attach went (dep_attach_times). */
enum part { PART_CONNECT, PART_WAIT, PART_MAP, PARTS };
static const char *const kind_name[KINDS] = {"2-node job, 2+2 ranks", "1-node job, 4 ranks",
                                             "1-node job, 2 ranks"};

struct opts {
  int rounds, cold, pool, pause_ms, reg_reps;
  bool keep; /* -K: keep the scratch directory (configs, daemon logs) */
  const char *transport; /* -T: the daemons' `transport` ("": their default, auto) */
  double reg_gb;
  char deepepd[512];
  struct dep_job_shape shape;
};

/* ---- statistics and the report ------------------------------------------------- */

/* The q-quantile of v[n] (sorted in place), linear between the closest ranks. */
static double quantile(double *v, int n, double q) {
  bench_sort(v, (size_t)n);
  double x = q * (n - 1);
  int i = (int)x;
  return i + 1 < n ? v[i] + (x - i) * (v[i + 1] - v[i]) : v[n - 1];
}

static double median(const double *v, int n) {
  double c[MAX_ROUNDS * LOCAL_MAX];
  memcpy(c, v, sizeof *v * (size_t)n);
  return quantile(c, n, 0.5);
}

static void row(const char *what, const double *v, int n) {
  double c[MAX_ROUNDS * PINGS];
  memcpy(c, v, sizeof *v * (size_t)n);
  printf("%-62s %5d %10.3f %10.3f %10.3f\n", what, n, quantile(c, n, 0.5), quantile(c, n, 0.1),
         quantile(c, n, 0.9));
}

static void header(void) {
  printf("%-62s %5s %10s %10s %10s\n", "what", "n", "median_ms", "p10_ms", "p90_ms");
}

/* The first line of `path` that starts with key, after it (trimmed); "?" when none. */
static void file_field(const char *path, const char *key, char *out, size_t len) {
  snprintf(out, len, "?");
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return;
  char line[512];
  while (fgets(line, sizeof line, f) != NULL) {
    if (strncmp(line, key, strlen(key)) != 0)
      continue;
    char *v = line + strlen(key);
    while (*v == ' ' || *v == '\t' || *v == ':' || *v == '=' || *v == '"')
      v++;
    v[strcspn(v, "\"\n")] = '\0';
    snprintf(out, len, "%s", v);
    break;
  }
  fclose(f);
}

static void print_machine(void) {
  char host[64] = "?", cpu[128], mem[64], os[128], date[32];
  struct utsname u;
  gethostname(host, sizeof host);
  host[sizeof host - 1] = '\0';
  file_field("/proc/cpuinfo", "model name", cpu, sizeof cpu);
  file_field("/proc/meminfo", "MemTotal", mem, sizeof mem);
  file_field("/etc/os-release", "PRETTY_NAME", os, sizeof os);
  uname(&u);
  time_t now = time(NULL);
  struct tm tm;
  strftime(date, sizeof date, "%Y-%m-%d %H:%M", localtime_r(&now, &tm));
  char load[64] = "?";
  FILE *f = fopen("/proc/loadavg", "r");
  if (f != NULL && fgets(load, sizeof load, f) != NULL)
    load[strcspn(load, " ")] = '\0'; /* the 1-minute figure */
  if (f != NULL)
    fclose(f);
  printf("# machine: %s, %ld CPUs (%s), %.1f GiB memory, %s, Linux %s; %s, load average %s\n",
         host, sysconf(_SC_NPROCESSORS_ONLN), cpu, atof(mem) / (1 << 20), os, u.release, date,
         load);
}

/* ---- --reg-gb ------------------------------------------------------------------- */

static int reg_mode(const struct opts *o) {
  uint64_t bytes = (uint64_t)(o->reg_gb * (double)(1ull << 30));
  bytes = (bytes + 4095) & ~(uint64_t)4095;
  double reg[MAX_ROUNDS], dereg[MAX_ROUNDS];
  char dev[64] = "", why[512];
  printf("# bench/peers --reg-gb %g: ibv_reg_mr / ibv_dereg_mr of %.3f GiB of host memory "
         "(mmap, every page touched), %d repetitions, through daemon/rdmadrv.h\n",
         o->reg_gb, (double)bytes / (1 << 30), o->reg_reps);
  print_machine();
  fflush(stdout);
  if (reg_measure(bytes, o->reg_reps, reg, dereg, dev, sizeof dev, why, sizeof why) != 0) {
    printf("# %s: registration not measured\n", why);
    return 77;
  }
  printf("# device: %s\n", dev);
  header();
  row("ibv_reg_mr", reg, o->reg_reps);
  row("ibv_dereg_mr", dereg, o->reg_reps);
  double gib = (double)bytes / (1 << 30);
  printf("# per GiB: ibv_reg_mr %.1f ms, ibv_dereg_mr %.1f ms (medians)\n",
         median(reg, o->reg_reps) / gib, median(dereg, o->reg_reps) / gib);
  return 0;
}

/* ---- the jobs -------------------------------------------------------------------- */

struct world {
  struct nodes n;
  struct rank_proc node0[LOCAL_MAX], node1[2];
  struct dep_job_shape shape;
  int seq; /* jobs so far: a new id each */
};

/* One job of kind k on the running daemons; its time, each rank's times in rt, and the
 * time its ranks took to detach in *detach_ms. */
static double run_job(struct world *w, enum kind k, struct rank_time *rt, double *detach_ms) {
  struct rank_proc *rp[LOCAL_MAX];
  struct rank_cmd cmd[LOCAL_MAX];
  int n = k == SINGLE2 ? 2 : 4;
  memset(cmd, 0, sizeof cmd);
  char id[DEP_JOB_ID_MAX];
  snprintf(id, sizeof id, "bench-peers-%d-%d-%d", (int)getpid(), (int)k, w->seq++);
  for (int i = 0; i < n; i++) {
    bool remote = k == MULTI && i >= 2;
    rp[i] = remote ? &w->node1[i - 2] : &w->node0[i];
    snprintf(cmd[i].sock, sizeof cmd[i].sock, "%s", w->n.sock[remote ? 1 : 0]);
    snprintf(cmd[i].job_id, sizeof cmd[i].job_id, "%s", id);
    cmd[i].rank = (uint32_t)i;
    cmd[i].world_size = (uint32_t)n;
    cmd[i].local_rank = (uint32_t)(k == MULTI ? i % 2 : i);
    cmd[i].local_world_size = k == MULTI ? 2 : (uint32_t)n;
    cmd[i].shape = w->shape;
  }
  return ranks_round(rp, cmd, n, rt, detach_ms);
}

/* After a job: each daemon it used has finished with it (its scrub included: a PEERS
 * request is answered after what came before it), then the pause.  Returns the time
 * until the daemons answered. */
static double settle(struct world *w, enum kind k, int pause_ms) {
  double t = bench_now_ms();
  nodes_quiesce(&w->n, 0);
  if (k == MULTI)
    nodes_quiesce(&w->n, 1);
  double busy = bench_now_ms() - t;
  struct timespec ps = {.tv_sec = pause_ms / 1000, .tv_nsec = (pause_ms % 1000) * 1000000L};
  nanosleep(&ps, NULL);
  return busy;
}

static double max2(const double *v) { return v[0] > v[1] ? v[0] : v[1]; }

static void usage(void) {
  fprintf(stderr,
          "usage: peers [-i ROUNDS] [-c COLD] [-P POOL] [-p PAUSE_MS] [-T TRANSPORT]\n"
          "             [-D DEEPEPD] [-K] [-t TOKENS] [-H HIDDEN] [-k TOPK] [-e EXPERTS]\n"
          "       peers --reg-gb N [-r REPS]\n"
          "  -i  warm rounds of each job kind (default 20)   -c  cold starts (default 10)\n"
          "  -P  connection_pool_size of both daemons (default 4)\n"
          "  -p  pause between jobs in ms (default 50)\n"
          "  -T  the daemons' transport: auto, tcp or rdma (default: unset, the daemon's auto)\n"
          "  -D  the deepepd binary (default: deepepd beside this program's directory)\n"
          "  -K  keep the scratch directory (configs, daemon logs) and print its path\n"
          "  shape: -t 4096 tokens, -H 7168, -k 8, -e 256\n"
          "  --reg-gb N  only RDMA registration of N GiB (default 1), REPS times (default 5)\n"
          "root only (network namespaces); exit 77 where it cannot run\n");
  exit(2);
}

static void parse(int argc, char **argv, struct opts *o) {
  static const struct option lo[] = {{"reg-gb", optional_argument, NULL, 'G'},
                                     {"help", no_argument, NULL, 'h'},
                                     {NULL, 0, NULL, 0}};
  int opt;
  while ((opt = getopt_long(argc, argv, "i:c:P:p:D:T:t:H:k:e:r:Kh", lo, NULL)) != -1) {
    switch (opt) {
    case 'i': o->rounds = atoi(optarg); break;
    case 'c': o->cold = atoi(optarg); break;
    case 'P': o->pool = atoi(optarg); break;
    case 'p': o->pause_ms = atoi(optarg); break;
    case 'D': snprintf(o->deepepd, sizeof o->deepepd, "%s", optarg); break;
    case 't': o->shape.max_tokens_per_rank = (uint32_t)atoi(optarg); break;
    case 'H': o->shape.hidden = (uint32_t)atoi(optarg); break;
    case 'k': o->shape.topk = (uint32_t)atoi(optarg); break;
    case 'e': o->shape.num_experts = (uint32_t)atoi(optarg); break;
    case 'r': o->reg_reps = atoi(optarg); break;
    case 'K': o->keep = true; break;
    case 'T': o->transport = optarg; break;
    case 'G':
      o->reg_gb = 1;
      if (optarg != NULL)
        o->reg_gb = atof(optarg);
      else if (optind < argc && argv[optind][0] != '-')
        o->reg_gb = atof(argv[optind++]);
      if (!(o->reg_gb > 0))
        usage();
      break;
    default: usage();
    }
  }
  if (strcmp(o->transport, "") != 0 && strcmp(o->transport, "auto") != 0 &&
      strcmp(o->transport, "tcp") != 0 && strcmp(o->transport, "rdma") != 0)
    usage();
  if (optind != argc || o->rounds < 1 || o->rounds > MAX_ROUNDS || o->cold < 0 ||
      o->cold > MAX_COLD || o->pool < 1 || o->pool > 64 || o->pause_ms < 0 || o->reg_reps < 1 ||
      o->reg_reps > MAX_ROUNDS)
    usage();
  if (o->deepepd[0] == '\0') {
    /* build/bench/peers -> build/deepepd */
    char self[400];
    ssize_t l = readlink("/proc/self/exe", self, sizeof self - 1);
    self[l > 0 ? l : 0] = '\0';
    char *slash = strrchr(self, '/');
    if (slash != NULL)
      *slash = '\0';
    snprintf(o->deepepd, sizeof o->deepepd, "%s/../deepepd", self);
  }
}

int main(int argc, char **argv) {
  struct opts o = {.rounds = 20, .cold = 10, .pool = 4, .pause_ms = 50, .reg_reps = 5,
                   .transport = "",
                   .shape = {.max_tokens_per_rank = 4096, .hidden = 7168, .num_experts = 256,
                             .topk = 8, .dtype = DEP_DTYPE_BF16}};
  parse(argc, argv, &o);
  if (o.reg_gb > 0)
    return reg_mode(&o);

  struct dep_slab_layout l4, l2, lx;
  char why[512];
  if (dep__slab_layout(&o.shape, 4, &l4, why, sizeof why) != 0 ||
      dep__slab_layout(&o.shape, 2, &l2, why, sizeof why) != 0 ||
      dep__slab_layout_nodes(&o.shape, 4, 2, 0, &lx, why, sizeof why) != 0)
    die("%s", why);
  uint64_t slab4 = dep_round_up(l4.total_bytes, 2u << 20);
  uint64_t slab2 = dep_round_up(l2.total_bytes, 2u << 20);
  /* Node 0 keeps every kind's arena cached at once (2 + 4 slabs of world 4, 2 of world 2),
   * beside the 2-node job's exchange regions, one a rank (ring first: xring.h), which are
   * pool memory too: without them a job's arena was evicted and made again every round. */
  uint64_t xchg = dep_round_up(DEP_XRING_BYTES + lx.xchg_bytes, 2u << 20);
  uint64_t pool = dep_round_up(6 * slab4 + 2 * slab2 + 2 * xchg + (64u << 20), 64u << 20);

  static struct world w;
  w.shape = o.shape;
  const char *skip = nodes_setup(&w.n, o.deepepd, o.pool, pool, o.transport, o.keep);
  if (skip != NULL) {
    fprintf(stderr, "peers: %s; skipped\n", skip);
    return 77;
  }
  printf("# bench/peers: 2 nodes = 2 network namespaces joined by a veth pair (%s, %s), one "
         "deepepd each (host backend), connection_pool_size %d, peer_key_file "
         "(HMAC-SHA-512/256)\n", w.n.addr[0], w.n.addr[1], o.pool);
  print_machine();
  printf("# job: 4 ranks, shape %u tokens x %u hidden x top-%u x %u experts; slab %.1f MiB "
         "(world 4), %.1f MiB (world 2); deepepd %s\n", o.shape.max_tokens_per_rank,
         o.shape.hidden, o.shape.topk, o.shape.num_experts, (double)slab4 / (1 << 20),
         (double)slab2 / (1 << 20), o.deepepd);
  if (o.keep)
    printf("# scratch directory (kept): %s\n", w.n.dir);
  printf("# %d warm rounds of each kind, interleaved, %d ms apart; %d cold starts (after one "
         "thrown away); median, p10, p90\n", o.rounds, o.pause_ms, o.cold);
  fflush(stdout);

  for (int i = 0; i < LOCAL_MAX; i++)
    rank_spawn(&w.node0[i], w.n.ns[0]);
  for (int i = 0; i < 2; i++)
    rank_spawn(&w.node1[i], w.n.ns[1]);

  /* ---- cold: fresh daemons for every job start ---- */
  static double sock_ms[MAX_COLD + 1], up_ms[MAX_COLD + 1], cold_total[MAX_COLD],
      cold_attach[MAX_COLD];
  double s[NODES], u[NODES], detach;
  struct rank_time rt[LOCAL_MAX];
  double t0 = nodes_start(&w.n);
  nodes_wait_up(&w.n, t0, s, u, 30000);
  nodes_stop(&w.n);
  for (int c = 0; c < o.cold; c++) {
    t0 = nodes_start(&w.n);
    nodes_wait_up(&w.n, t0, s, u, 30000);
    double released = bench_now_ms() - t0;
    cold_attach[c] = run_job(&w, MULTI, rt, &detach);
    cold_total[c] = released + cold_attach[c];
    sock_ms[c] = max2(s);
    up_ms[c] = max2(u);
    nodes_stop(&w.n);
  }

  /* ---- warm: one pair of daemons for every job start ---- */
  t0 = nodes_start(&w.n);
  nodes_wait_up(&w.n, t0, s, u, 30000);
  sock_ms[o.cold] = max2(s);
  up_ms[o.cold] = max2(u);
  double first[KINDS];
  for (int k = 0; k < KINDS; k++) { /* each kind's first job makes its arena */
    first[k] = run_job(&w, (enum kind)k, rt, &detach);
    settle(&w, (enum kind)k, o.pause_ms);
  }
  static double warm[KINDS][MAX_ROUNDS], per_rank[MAX_ROUNDS * LOCAL_MAX];
  static double diff4[MAX_ROUNDS], diff2[MAX_ROUNDS], ended[MAX_ROUNDS];
  static double parts[KINDS][PARTS][MAX_ROUNDS];
  for (int r = 0; r < o.rounds; r++) {
    for (int j = 0; j < KINDS; j++) {
      enum kind k = (enum kind)((r + j) % KINDS);
      warm[k][r] = run_job(&w, k, rt, &detach);
      double busy = settle(&w, k, o.pause_ms);
      int slow = 0;
      for (int i = 0; i < (k == SINGLE2 ? 2 : 4); i++) {
        slow = rt[i].ready_ms > rt[slow].ready_ms ? i : slow;
        if (k == MULTI)
          per_rank[4 * r + i] = rt[i].ready_ms;
      }
      parts[k][PART_CONNECT][r] = rt[slow].ready_ms - rt[slow].attach_ms;
      parts[k][PART_WAIT][r] = rt[slow].wait_ms;
      parts[k][PART_MAP][r] = rt[slow].map_ms;
      if (k == MULTI)
        ended[r] = detach + busy;
    }
    diff4[r] = warm[MULTI][r] - warm[SINGLE4][r];
    diff2[r] = warm[MULTI][r] - warm[SINGLE2][r];
  }

  /* ---- the cold path's parts, against node 1's warm daemon ---- */
  static double hs_pool[MAX_ROUNDS], hs_one[MAX_ROUNDS], rtt[MAX_ROUNDS * PINGS];
  for (int r = 0; r < o.rounds; r++) {
    if (handshake_measure(w.n.ns[0], w.n.key, w.n.addr[0], w.n.addr[1], o.pool, PINGS,
                          &hs_pool[r], rtt + PINGS * r, why, sizeof why) != 0 ||
        handshake_measure(w.n.ns[0], w.n.key, w.n.addr[0], w.n.addr[1], 1, 0, &hs_one[r], NULL,
                          why, sizeof why) != 0)
      die("handshake with node 1's deepepd: %s", why);
  }
  nodes_stop(&w.n);
  for (int i = 0; i < LOCAL_MAX; i++)
    rank_stop(&w.node0[i]);
  for (int i = 0; i < 2; i++)
    rank_stop(&w.node1[i]);

  /* RDMA registration of one node's memory for the job: its 2 slabs. */
  int reps = 3;
  double reg[3], dereg[3];
  char dev[64] = "", rwhy[512];
  int reg_rc = reg_measure(2 * slab4, reps, reg, dereg, dev, sizeof dev, rwhy, sizeof rwhy);

  /* ---- the report ---- */
  char what[128];
  header();
  row("start both daemons -> both control sockets answer", sock_ms, o.cold + 1);
  snprintf(what, sizeof what, "start both daemons -> %d/%d connections up, both ways", o.pool,
           o.pool);
  row(what, up_ms, o.cold + 1);
  snprintf(what, sizeof what, "  alone: %d TCP connects + HMAC handshakes, at once", o.pool);
  row(what, hs_pool, o.rounds);
  row("  alone: 1 TCP connect + HMAC handshake", hs_one, o.rounds);
  row("  a peer message's round trip through the far daemon", rtt, o.rounds * PINGS);
  for (int k = 0; k < KINDS; k++) {
    snprintf(what, sizeof what, "warm: %s, attach to ready", kind_name[k]);
    row(what, warm[k], o.rounds);
  }
  row("warm: 2-node job, each rank's attach to ready", per_rank, 4 * o.rounds);
  row("warm: 2-node minus 1-node job (4 ranks), paired by round", diff4, o.rounds);
  row("warm: 2-node minus 1-node job (2 ranks), paired by round", diff2, o.rounds);
  row("warm: 2-node job's end: detach until both daemons answer again", ended, o.rounds);
  if (o.cold > 0) {
    row("cold: fresh daemons -> job ready (start, connections, attach)", cold_total, o.cold);
    row("cold:   of which the attach (each node's arena made then)", cold_attach, o.cold);
  }
  if (reg_rc == 0) {
    snprintf(what, sizeof what, "ibv_reg_mr of one node's job memory (%.0f MiB) on %s",
             (double)(2 * slab4) / (1 << 20), dev);
    row(what, reg, reps);
  } else {
    printf("# %s: registration not measured (bench/peers --reg-gb N where a device is)\n",
           rwhy);
  }
  printf("# where the slowest rank's warm attach went, medians in ms (dep_attach_times): "
         "release to dep_attach called (wake, connect, HELLO) / wait (ATTACH sent to the reply "
         "in: the rendezvous) / map\n");
  for (int k = 0; k < KINDS; k++)
    printf("#   %-24s %8.3f %8.3f %8.3f\n", kind_name[k], median(parts[k][PART_CONNECT], o.rounds),
           median(parts[k][PART_WAIT], o.rounds), median(parts[k][PART_MAP], o.rounds));
  printf("# transport of the peer links (PEERS): %s (configured: %s)\n", w.n.transport,
         o.transport[0] ? o.transport : "the default");
  printf("# first job of each kind on the warm daemons (its arena made): 2-node %.3f ms, 1-node "
         "4 ranks %.3f ms, 1-node 2 ranks %.3f ms\n", first[MULTI], first[SINGLE4],
         first[SINGLE2]);
  double d4 = median(diff4, o.rounds), d2 = median(diff2, o.rounds);
  printf("# target: a warm 2-node attach within 1 ms of the same job's 1-node attach (4 ranks): "
         "%+.3f ms (median of paired differences): %s; against 2 ranks on one node: %+.3f ms\n",
         d4, d4 <= 1.0 ? "met" : "NOT met", d2);
  if (o.cold > 0) {
    double cm = median(cold_total, o.cold), wm = median(warm[MULTI], o.rounds);
    double up = median(up_ms, o.cold + 1);
    printf("# cold / warm: %.3f ms / %.3f ms = %.0fx; without making memory (connections up "
           "from a start, %.3f ms, then a warm attach: the sum of the medians) %.0fx\n", cm, wm,
           cm / wm, up, (up + wm) / wm);
  }
  return 0;
}
