/*
 * ep.c — the dispatch/combine benchmark (issue 4), written against the
 * public API only (deepep.h), plus the CUDA driver seam for the caller's
 * own device buffers, streams and events on the cuda backend.
 *
 *   ep -s SOCKET[,SOCKET...] [-S SOCKET_NO_WARMUP] [-n COUNTS] [-m processes,threads] [-g GPUS]
 *      [-c CALLS] [-w WARMUP] [-r COPY_REPS] [-t TOKENS] [-l LL_TOKENS] [-H HIDDEN]
 *      [-e EXPERTS] [-k TOPK] [-x SEED] [-o RAW.csv] [-F] [-G MS] [-I MS] [-p tp,ll,ll8]
 *
 * For each rank count and mode (ranks as processes, or as threads of one
 * process, one client handle and stream each) a fresh world attaches as
 * one job, then times with every rank released together per call:
 *   - the first call of each operation after dep_attach, in this order:
 *     dispatch, combine, ll_dispatch (bf16), ll_combine, ll_dispatch (FP8),
 *     ll_combine (the one after the FP8 dispatch);
 *   - WARMUP untimed pairs, then CALLS timed pairs of each (dispatch then
 *     combine, as a trainer alternates them); median and p99 of the
 *     per-call time, which is the slowest rank's time for that call (-p
 *     names the pairs to time: tp, ll, ll8; the others show first calls);
 *   - a copy ceiling in the same run: every rank copies, at the same time,
 *     as many bytes as it moved in the operation (memcpy on the host
 *     backend, cuMemcpyDtoDAsync on the cuda one); COPY_REPS reps, median.
 * With -g N (cuda) the ranks spread over N GPUs, rank r on GPU r % N (-g 0:
 * every visible GPU), and the ceiling becomes the peer copy: every rank at
 * once copies to every rank (itself included) the bytes the op sent that
 * rank, by cuMemcpyPeerAsync into a buffer on the destination's GPU (or
 * cuMemcpyDtoDAsync on its own GPU), one stream per destination.  Such a
 * run also prints the plain pairwise figure once: 256 MiB from GPU 0 to
 * GPU 1 by cuMemcpyPeerAsync, alone and in both directions at once.
 * With -s naming several sockets, one daemon per node (daemons that are
 * each other's peers: bench/xnode.sh runs them in network namespaces), the
 * ranks spread over the nodes in equal blocks, rank r on node
 * r / (ranks / nodes), and the job spans them (DESIGN §7).  The rows then
 * also say what crossed between nodes: xB/call, the bytes of the busiest
 * direction from one node to another per call (payload as counted below,
 * without deepepd's frame headers); xGB/s, those over the median; and
 * rkxGB/s, the smallest rank's bytes for ranks on other nodes over the
 * median.  The copy ceiling stays the memory copy; the network's ceilings
 * (raw TCP, a ping-pong of the same bytes) are bench/xnode.sh's.
 * With -S, a second world per (ranks, mode) attaches to a daemon whose
 * config says kernel_warmup: false and times only the first calls; -F
 * times only attach and the first calls against -s (where two daemons'
 * pools would not fit at once, run the warm-up-off daemon separately).
 *
 * Bytes moved per call (summed over ranks; every row passes through a
 * slab, the rank's own rows included):
 *   dispatch     rows sent x (2*hidden + 16 + 8*topk): token, source index,
 *                id count, remapped ids and weights (the row of host_ops.h)
 *   combine      vectors sent back (= rows received) x 2*hidden
 *   ll_dispatch  rows sent x (payload + 16 + 4*ids), payload 2*hidden (bf16)
 *                or hidden + 4*hidden/128 (FP8 with scales), ids = the
 *                token's distinct experts on that rank
 *   ll_combine   vectors sent back (one per token and expert) x 2*hidden
 * GB/s = bytes / median time, and per rank (rankGB/s) the smallest rank's
 * own bytes / the same median.  The copy moves the same bytes once (each
 * byte read once and written once); "frac" = op GB/s / copy GB/s.  The
 * operations pass each byte twice (push into the receiver's slab, then the
 * receiver copies it out or reduces it), so two passes at the copy's
 * speed would score 0.5.
 *
 * Timing: on the host backend CLOCK_MONOTONIC from the common release to
 * the rank's return; on cuda, CUDA events on the rank's stream around the
 * call (the GPU reaches the first at once, so host work in the call counts).
 * With -P N, each (ranks, mode) instead runs 2N worlds, alternately with the
 * ranks' stats page off ($DEEPEP_STATS=0) and on, and prints per op the
 * median over the off worlds' calls and over the on worlds' calls, and the
 * difference: what writing the stats page costs a call (issue 15: at most
 * 1 % of a low-latency dispatch).  Alternating keeps drift of the machine
 * out of the difference.
 * Inputs are seeded random bf16 tokens, top-k distinct experts and weights;
 * the first calls' outputs are checked (counts exactly, combines against the
 * known sums) so no figure times a call that did nothing.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "benchlib.h"
#include "ep/ep.h"


const char *const op_name[NOPS] = {"dispatch",    "combine",         "ll_dispatch",
                                   "ll_combine",  "ll_dispatch_fp8", "ll_combine_fp8"};

/*
 * What a run does when an option is not given, per backend (the daemon's,
 * asked before anything runs).  The cuda defaults are one layer of a
 * DeepSeek-V3-sized model (-t/-H/-e/-k) over up to 8 ranks; run on the host
 * backend, where every byte is a memcpy on the CPU, they take minutes on a
 * small machine, so the host defaults are a smaller layer and fewer calls,
 * sized so that a default run against one or two host daemons finishes in
 * well under a minute on 2 cores.  Given options win on either backend.
 */
struct ep_defaults {
  const char *backend;
  const char *counts; /* -n */
  int calls, warm, reps;
  struct dep_job_shape shape;
};
static const struct ep_defaults ep_defaults[] = {
    {.backend = "cuda", .counts = "2,4,8", .calls = 200, .warm = 5, .reps = 20,
     .shape = {.max_tokens_per_rank = 4096, .hidden = 7168, .num_experts = 256, .topk = 8,
               .max_ll_tokens_per_rank = 128}},
    {.backend = "host", .counts = "2,4", .calls = 50, .warm = 3, .reps = 10,
     .shape = {.max_tokens_per_rank = 512, .hidden = 2048, .num_experts = 64, .topk = 8,
               .max_ll_tokens_per_rank = 64}},
};
#define N_DEFAULTS (sizeof ep_defaults / sizeof ep_defaults[0])

static void usage(void) {
  fprintf(stderr,
          "usage: ep -s SOCKET[,SOCKET...] [-S SOCKET_NO_WARMUP] [-n COUNTS] [-m processes,threads]\n"
          "          [-g GPUS]\n"
          "          [-c CALLS] [-w WARMUP] [-r COPY_REPS] [-t TOKENS] [-l LL_TOKENS] [-H HIDDEN]\n"
          "          [-e EXPERTS] [-k TOPK] [-x SEED] [-o RAW.csv] [-F] [-T] [-G MS] [-I MS] [-P N]\n"
          "          [-p PAIRS]\n"
          "  -s  deepepd socket (its backend, host or cuda, is the one benchmarked); several,\n"
          "      comma-separated: one daemon per node, peers of each other, the ranks spread\n"
          "      over them in equal blocks (rank counts divisible by the nodes; no -S)\n"
          "  -S  a second deepepd with kernel_warmup: false: time its first calls too\n"
          "  -n  rank counts                        -m  modes (default processes,threads)\n"
          "  -g  spread the ranks over GPUS GPUs, rank r on GPU r %% GPUS (default 1: all on\n"
          "      GPU 0; 0: every visible GPU); with 2 or more the ceiling is the peer copy,\n"
          "      and GPU 0 -> GPU 1 peer copy figures are printed once\n"
          "  -c  timed calls per op                 -w  untimed warm-up pairs\n"
          "  -r  copy-ceiling reps                  -o  append every raw time to a CSV file\n"
          "  -F  attach and time the first calls only (e.g. against a kernel_warmup: false daemon)\n"
          "  -T  rewrite each op's outputs just before its first call (cuda): the first call\n"
          "      then meets the caller's buffers as recently used ones, so first/med is the\n"
          "      library's own first-call cost\n"
          "  -G  each rank pauses MS ms between dep_attach and its first call, as a trainer\n"
          "      building its model does (the host backend's warm-up runs meanwhile)\n"
          "  -I  each rank pauses MS ms before every pair after the first calls, as a trainer's\n"
          "      compute between layers does: the median is then of calls after that much idle\n"
          "  -p  the pairs timed after the first calls (default tp,ll,ll8): tp dispatch and\n"
          "      combine, ll the low-latency pair in bf16, ll8 with the FP8 dispatch; the first\n"
          "      call of every op is timed either way\n"
          "  -P  N worlds with the stats page off and N on, alternating: per op the median of\n"
          "      each and what writing the page costs ($DEEPEP_STATS=0 turns it off)\n"
          "  -t/-l/-H/-e/-k  the shape: tokens, low-latency tokens, hidden, experts, top-k\n"
          "defaults by the daemon's backend (the host's finish in seconds on a few cores):\n");
  for (size_t i = 0; i < N_DEFAULTS; i++) {
    const struct ep_defaults *d = &ep_defaults[i];
    fprintf(stderr, "  %-4s -n %s -c %d -w %d -r %d -t %u -l %u -H %u -e %u -k %u\n", d->backend,
            d->counts, d->calls, d->warm, d->reps, d->shape.max_tokens_per_rank,
            d->shape.max_ll_tokens_per_rank, d->shape.hidden, d->shape.num_experts,
            d->shape.topk);
  }
  exit(2);
}

/* ---- driver ------------------------------------------------------------------- */

static size_t shm_bytes(const struct opts *o, int n) {
  return sizeof(struct shm) + (size_t)n * NOPS * ((size_t)o->calls + (size_t)o->reps) * 8;
}

/*
 * Run one world in fresh processes (the parent never touches CUDA, so no
 * module or context carries over between worlds).  Returns 0, or 1 with
 * the first failure in s->err.
 */
static int run_world(const struct opts *o, bool cuda, int n, bool threads, const char *sock,
                     bool first_only, struct shm *s, const char *job) {
  memset(s, 0, shm_bytes(o, n));
  g_shm = s;
  struct rank proto = {.o = o, .s = s, .n = n, .cuda = cuda, .first_only = first_only,
                       .sock = sock, .job = job};
  pid_t pids[MAX_RANKS];
  int np = threads ? 1 : n;
  for (int p = 0; p < np; p++) {
    pids[p] = fork();
    if (pids[p] < 0)
      fail("fork failed");
    if (pids[p] > 0)
      continue;
    if (cuda)
      cuda_load();
    if (!threads) {
      struct rank k = proto;
      k.r = p;
      rank_run(&k);
      _exit(0);
    }
    struct rank ks[MAX_RANKS];
    pthread_t th[MAX_RANKS];
    for (int r = 0; r < n; r++) {
      ks[r] = proto;
      ks[r].r = r;
      if (pthread_create(&th[r], NULL, rank_thread, &ks[r]) != 0)
        fail("pthread_create failed");
    }
    for (int r = 0; r < n; r++)
      pthread_join(th[r], NULL);
    _exit(0);
  }
  int bad = 0;
  for (int left = np; left > 0; left--) {
    int st;
    pid_t w = wait(&st);
    if (w < 0)
      break;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      if (!bad && !atomic_load(&s->failed))
        snprintf(s->err, sizeof s->err, "a rank process died (status 0x%x)", st);
      bad = 1;
      atomic_store(&s->failed, 1); /* the others leave their barrier */
      for (int p = 0; p < np; p++)
        if (pids[p] != w)
          kill(pids[p], SIGKILL);
    }
  }
  return bad || atomic_load(&s->failed);
}

static void raw_line(FILE *f, const char *be, int n, const char *mode, int op, const char *kind,
                     int i, double ms) {
  if (f != NULL)
    fprintf(f, "%s,%d,%s,%s,%s,%d,%.6f\n", be, n, mode, op_name[op], kind, i, ms);
}

/* The per-call (or per-rep) time of the world, the slowest rank's, in call
 * order (the raw file), then sorted (the statistics). */
static void world_times(const double *base, int n, int stride, double *out, FILE *raw,
                        const char *be, int op, const char *mode, const char *kind) {
  for (int i = 0; i < stride; i++) {
    out[i] = 0;
    for (int r = 0; r < n; r++)
      out[i] = fmax(out[i], base[(size_t)r * NOPS * stride + i]);
    raw_line(raw, be, n, mode, op, kind, i, out[i]);
  }
  bench_sort(out, (size_t)stride);
}

/*
 * -P: pairs worlds with the stats page off, then on, alternately; per op the
 * median of every call of the off worlds and of the on worlds (each call's
 * time the slowest rank's), and the difference.  0, or 1 after a failure.
 */
static int stats_overhead(const struct opts *o, bool cuda, int n, bool threads, struct shm *s,
                          const char *mode) {
  const size_t per = (size_t)o->stats_pairs * (size_t)o->calls;
  double *t[2] = {calloc(NOPS * per, sizeof(double)), calloc(NOPS * per, sizeof(double))};
  size_t got[2] = {0, 0};
  int bad = t[0] == NULL || t[1] == NULL;
  for (int w = 0; w < 2 * o->stats_pairs && !bad; w++) {
    int on = w % 2;
    if (on)
      unsetenv("DEEPEP_STATS");
    else
      setenv("DEEPEP_STATS", "0", 1);
    char job[64];
    snprintf(job, sizeof job, "ep-%d-%d-%c-p%d", (int)getpid(), n, mode[0], w);
    if (run_world(o, cuda, n, threads, o->sock, false, s, job)) {
      printf("%-5d %-9s stats %s world FAILED: %s\n", n, mode, on ? "on" : "off", s->err);
      bad = 1;
      break;
    }
    double calls[MAX_CALLS];
    for (int op = 0; op < NOPS; op++) {
      world_times(s->t + (size_t)op * o->calls, n, o->calls, calls, NULL, "", op, mode, "call");
      memcpy(t[on] + (size_t)op * per + got[on], calls, (size_t)o->calls * sizeof(double));
    }
    got[on] += (size_t)o->calls;
  }
  unsetenv("DEEPEP_STATS");
  for (int op = 0; op < NOPS && !bad; op++) {
    if (!op_timed(o, op))
      continue;
    bench_sort(t[0] + (size_t)op * per, per);
    bench_sort(t[1] + (size_t)op * per, per);
    double off = t[0][(size_t)op * per + per / 2], on = t[1][(size_t)op * per + per / 2];
    printf("%-5d %-9s %-15s %10.4f %10.4f %+10.4f %+8.2f%%\n", n, mode, op_name[op], off, on,
           on - off, 100.0 * (on - off) / off);
  }
  fflush(stdout);
  free(t[0]);
  free(t[1]);
  return bad;
}

/* One table row per op for a finished world (s), with its warm-up-off twin (s2) if cold. */
static void report(const struct opts *o, const char *be, int n, const char *mode,
                   const struct shm *s, const struct shm *s2, bool cold, FILE *raw) {
  double attach = 0, calls[MAX_CALLS], reps[MAX_CALLS];
  for (int r = 0; r < n; r++)
    attach = fmax(attach, s->attach_ms[r]);
  for (int op = 0; op < NOPS; op++) {
    double first = 0, first2 = 0;
    uint64_t bytes = 0, least = UINT64_MAX; /* all ranks' bytes; the smallest rank's */
    for (int r = 0; r < n; r++) {
      uint64_t rb = rank_bytes(s, r, op, n);
      first = fmax(first, s->first[r][op]);
      first2 = fmax(first2, s2->first[r][op]);
      bytes += rb;
      least = rb < least ? rb : least;
    }
    printf("%-5d %-9s %-15s %8.3f %8.3f", n, mode, op_name[op], attach, first);
    raw_line(raw, be, n, mode, op, "first", 0, first);
    if (o->first_only || !op_timed(o, op)) {
      printf(" %8s %9s %8.1f\n", "-", "-", (double)bytes / 1e6);
      continue;
    }
    world_times(s->t + (size_t)op * o->calls, n, o->calls, calls, raw, be, op, mode, "call");
    world_times(s->t + (size_t)n * NOPS * o->calls + (size_t)op * o->reps, n, o->reps, reps, raw,
                be, op, mode, "copy");
    double med = calls[o->calls / 2], p99 = calls[(o->calls * 99 + 99) / 100 - 1];
    double cmed = reps[o->reps / 2];
    double gbs = (double)bytes / med / 1e6, cgbs = (double)bytes / cmed / 1e6;
    double rank_gbs = (double)least / med / 1e6, rank_cgbs = (double)least / cmed / 1e6;
    printf(" %8.3f %9.3f %8.1f %8.1f %8.1f %9.1f %10.1f %6.3f %8.2fx", med, p99,
           (double)bytes / 1e6, gbs, rank_gbs, cgbs, rank_cgbs, gbs / cgbs, first / med);
    if (cold) {
      printf(" %9.3f %8.2fx", first2, first2 / med);
      raw_line(raw, be, n, mode, op, "first_nowarm", 0, first2);
    } else {
      printf(" %9s %9s", "-", "-");
    }
    if (o->nodes > 1) {
      uint64_t xb, xleast;
      xnode_bytes(o, s, op, n, &xb, &xleast);
      printf(" %10llu %8.3f %8.3f", (unsigned long long)xb, (double)xb / med / 1e6,
             (double)xleast / med / 1e6);
    }
    printf("\n");
  }
  fflush(stdout);
}

/* The options whose defaults are the backend's (struct ep_defaults), as given. */
struct ep_given {
  const char *n, *c, *w, *r, *t, *l, *H, *e, *k;
};

/*
 * The options, but for those whose defaults depend on the backend: they are
 * kept as given until the daemon has said its backend (settle_args).
 */
static void parse_args(int argc, char **argv, struct opts *o, struct ep_given *g,
                       const char **pairs, const char **modes) {
  const char *socks = NULL;
  int opt;
  while ((opt = getopt(argc, argv, "s:S:n:m:c:w:r:t:l:H:e:k:x:o:FTG:I:g:P:p:h")) != -1) {
    switch (opt) {
    case 's': socks = optarg; break;
    case 'S': o->sock_nowarm = optarg; break;
    case 'n': g->n = optarg; break;
    case 'm': *modes = optarg; break;
    case 'c': g->c = optarg; break;
    case 'w': g->w = optarg; break;
    case 'r': g->r = optarg; break;
    case 't': g->t = optarg; break;
    case 'l': g->l = optarg; break;
    case 'H': g->H = optarg; break;
    case 'e': g->e = optarg; break;
    case 'k': g->k = optarg; break;
    case 'x': o->seed = strtoull(optarg, NULL, 10); break;
    case 'o': o->raw = optarg; break;
    case 'F': o->first_only = true; break;
    case 'p': *pairs = optarg; break;
    case 'T': o->retouch = true; break;
    case 'G': o->gap_ms = atoi(optarg); break;
    case 'I': o->idle_ms = atoi(optarg); break;
    case 'g': o->gpus_want = atoi(optarg); break;
    case 'P': o->stats_pairs = atoi(optarg); break;
    default: usage();
    }
  }
  if (socks != NULL) {
    char *list = strdup(socks); /* kept: o->node_sock points into it */
    for (char *t = strtok(list, ","); t != NULL; t = strtok(NULL, ",")) {
      if (o->nodes == MAX_NODES) {
        fprintf(stderr, "ep: -s: at most %d daemons (nodes)\n", MAX_NODES);
        usage();
      }
      o->node_sock[o->nodes++] = t;
    }
    o->sock = o->nodes > 0 ? o->node_sock[0] : NULL;
  }
  if (o->nodes > 1 && o->sock_nowarm != NULL) {
    fprintf(stderr, "ep: -S (a kernel_warmup-off daemon) takes one node; run it without "
                    "several -s sockets\n");
    usage();
  }
  if (o->nodes == 0)
    o->nodes = 1;
  const char *bad = o->sock == NULL ? "-s names no daemon socket"
                    : optind != argc ? "arguments after the options"
                                     : NULL;
  if (bad != NULL) {
    fprintf(stderr, "ep: %s\n", bad);
    usage();
  }
}

/* The given options over the backend's defaults, checked. */
static void settle_args(struct opts *o, const struct ep_given *g, const char *pairs,
                        const char *modes, const char *backend) {
  const struct ep_defaults *d = &ep_defaults[0]; /* a backend not in the table: the GPU's */
  for (size_t i = 0; i < N_DEFAULTS; i++)
    if (strcmp(ep_defaults[i].backend, backend) == 0)
      d = &ep_defaults[i];
  const char *counts = g->n ? g->n : d->counts;
  o->calls = g->c ? atoi(g->c) : d->calls;
  o->warm = g->w ? atoi(g->w) : d->warm;
  o->reps = g->r ? atoi(g->r) : d->reps;
  struct dep_job_shape *sh = &o->shape;
  *sh = d->shape;
  sh->dtype = DEP_DTYPE_BF16;
  if (g->t)
    sh->max_tokens_per_rank = (uint32_t)atoi(g->t);
  if (g->l)
    sh->max_ll_tokens_per_rank = (uint32_t)atoi(g->l);
  if (g->H)
    sh->hidden = (uint32_t)atoi(g->H);
  if (g->e)
    sh->num_experts = (uint32_t)atoi(g->e);
  if (g->k)
    sh->topk = (uint32_t)atoi(g->k);
  /* The first rule an argument breaks, said before the usage. */
  const char *bad = o->gpus_want < 0 ? "-g must be 0 or more"
                    : o->gap_ms < 0 || o->gap_ms > 60000 ? "-G must be from 0 to 60000 ms"
                    : o->idle_ms < 0 || o->idle_ms > 10000 ? "-I must be from 0 to 10000 ms"
                    : o->calls < 1 || o->calls > MAX_CALLS ? "-c must be from 1 to the most calls"
                    : o->stats_pairs < 0 || o->stats_pairs > 100 ? "-P must be from 0 to 100"
                    : o->warm < 0 ? "-w must be 0 or more"
                    : o->reps < 1 || o->reps > MAX_CALLS ? "-r must be from 1 to the most calls"
                    : sh->max_tokens_per_rank < 1 ? "-t must be 1 or more"
                    : sh->hidden < 128 || sh->hidden % 128 != 0 ? "-H must be a multiple of 128"
                    : sh->topk < 1 || sh->topk > 16 ? "-k must be from 1 to 16"
                    : sh->num_experts < sh->topk ? "-e must be at least -k"
                    : sh->max_ll_tokens_per_rank < 1 ||
                            sh->max_ll_tokens_per_rank > sh->max_tokens_per_rank
                        ? "-l must be from 1 to -t (the low-latency tokens are at most the tokens)"
                        : NULL;
  if (bad != NULL) {
    fprintf(stderr, "ep: %s\n", bad);
    usage();
  }
  char *dup = strdup(counts);
  for (char *t = strtok(dup, ","); t != NULL; t = strtok(NULL, ",")) {
    int n = atoi(t);
    if (o->ncounts == 8 || n < 1 || n > MAX_RANKS || sh->num_experts % (uint32_t)n != 0 ||
        n % o->nodes != 0) {
      fprintf(stderr, "ep: rank count '%s': 1..%d ranks dividing %u experts, a multiple of the "
              "%d node(s)\n", t, MAX_RANKS, sh->num_experts, o->nodes);
      usage();
    }
    o->counts[o->ncounts++] = n;
  }
  free(dup);
  dup = strdup(pairs);
  for (char *t = strtok(dup, ","); t != NULL; t = strtok(NULL, ",")) {
    int p = strcmp(t, "tp") == 0 ? 0 : strcmp(t, "ll") == 0 ? 1 : strcmp(t, "ll8") == 0 ? 2 : -1;
    if (p < 0) {
      fprintf(stderr, "ep: -p '%s': the pairs are tp, ll and ll8\n", t);
      usage();
    }
    o->pairs[p] = true;
  }
  free(dup);
  dup = strdup(modes);
  for (char *t = strtok(dup, ","); t != NULL; t = strtok(NULL, ",")) {
    if (strcmp(t, "processes") != 0 && strcmp(t, "threads") != 0)
      usage();
    o->modes[strcmp(t, "threads") == 0] = true;
  }
  free(dup);
}

/*
 * The daemon's backend and device, asked from a child: the library may
 * initialise the CUDA driver (dep_client_free does), and a driver
 * initialised before fork() is unusable in the forked ranks.
 */
static int query_backend(const char *sock, char backend[8], char dev[64]) {
  struct q { int ok; char backend[8], dev[64], err[256]; } *q =
      mmap(NULL, sizeof *q, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (q == MAP_FAILED)
    return -1;
  pid_t qp = fork();
  if (qp == 0) {
    dep_client_t *c = NULL;
    struct dep_status *st = NULL;
    if (dep_client_new(&c) != 0 || dep_connect(c, sock) != 0 || dep_status(c, &st) != 0) {
      snprintf(q->err, sizeof q->err, "%s", c ? dep_errmsg(c) : "out of memory");
      _exit(1);
    }
    snprintf(q->backend, sizeof q->backend, "%s", st->backend);
    snprintf(q->dev, sizeof q->dev, "%s", st->num_devices ? st->devices[0].name : "?");
    q->ok = 1;
    _exit(0);
  }
  int st, ok = qp > 0 && waitpid(qp, &st, 0) == qp && q->ok;
  if (!ok)
    fprintf(stderr, "ep: cannot query deepepd at %s: %s\n", sock, q->err);
  memcpy(backend, q->backend, 8);
  memcpy(dev, q->dev, 64);
  munmap(q, sizeof *q);
  return ok ? 0 : -1;
}

int main(int argc, char **argv) {
  static struct opts o = {.seed = 42, .gpus_want = 1, .gpus = 1};
  struct ep_given given = {0};
  const char *pairs = "tp,ll,ll8", *modes = "processes,threads";
  parse_args(argc, argv, &o, &given, &pairs, &modes);
  char backend[8], dev[64];
  if (query_backend(o.sock, backend, dev) != 0)
    return 1;
  settle_args(&o, &given, pairs, modes, backend);
  const struct dep_job_shape *sh = &o.shape;
  bool cuda = strcmp(backend, "cuda") == 0;
  char why[256];
  if (cuda && (o.gpus = bench_gpus(o.gpus_want, why, sizeof why)) < 0) {
    fprintf(stderr, "ep: %s\n", why);
    return 1;
  }
  o.peer = cuda && o.gpus > 1;
  FILE *raw = o.raw ? fopen(o.raw, "a") : NULL;
  if (o.raw && raw == NULL) {
    fprintf(stderr, "ep: cannot open %s for appending\n", o.raw);
    return 1;
  }
  printf("# ep: backend %s (%s), %u tokens x %u hidden x top-%u x %u experts, LL %u tokens, "
         "%d calls (+%d warm-up pairs), copy ceiling %d reps, seed %llu%s\n",
         backend, dev, sh->max_tokens_per_rank, sh->hidden, sh->topk, sh->num_experts,
         sh->max_ll_tokens_per_rank, o.calls, o.warm, o.reps, (unsigned long long)o.seed,
         o.sock_nowarm ? ", kernel_warmup-off daemon too" : "");
  if (o.nodes > 1)
    printf("# nodes: %d daemons (%s first), ranks in equal blocks, rank r on node r / (ranks / "
           "%d); x*: bytes between nodes (the busiest direction per call; the smallest rank's)\n",
           o.nodes, o.sock, o.nodes);
  if (!cuda && o.gpus_want != 1)
    printf("# -g %d ignored: the host backend uses no GPU\n", o.gpus_want);
  else if (o.peer)
    printf("# placement: ranks spread over %d GPUs, rank r on GPU r %% %d\n", o.gpus, o.gpus);
  else if (cuda)
    printf("# placement: every rank on GPU 0 (-g N spreads them over N GPUs)\n");
  if (o.retouch)
    printf("# -T: each op's outputs rewritten just before its first call (cuda only)\n");
  if (o.gap_ms > 0)
    printf("# -G: each rank pauses %d ms between dep_attach and its first call\n", o.gap_ms);
  if (o.idle_ms > 0)
    printf("# -I: each rank pauses %d ms before every pair after the first calls\n", o.idle_ms);
  printf("# times: %s; bytes: what each rank sends per call, to every rank (itself included), "
         "counted once\n",
         cuda ? "CUDA events on each rank's stream" : "CLOCK_MONOTONIC from the common release");
  printf("# GB/s: all ranks' bytes / median; rankGB/s: the smallest rank's bytes / median; "
         "frac = GB/s / %s GB/s\n", o.peer ? "peer" : "copy");
  if (o.peer)
    printf("# peer: the ceiling of peer copies: every rank at once copies to every rank the bytes "
           "the op sent it (cuMemcpyPeerAsync to a buffer on its GPU, cuMemcpyDtoDAsync on its "
           "own), one stream per destination; slowest rank, median of %d\n", o.reps);
  else
    printf("# copy: the ceiling of a copy %s: every rank at once copies its bytes (%s); "
           "slowest rank, median of %d\n", cuda ? "within the GPU" : "in host memory",
           cuda ? "cuMemcpyDtoDAsync" : "memcpy", o.reps);
  int status = 0;
  if (o.stats_pairs > 0) {
    printf("# -P %d: %d worlds with the stats page off and %d on, alternating; medians of %d "
           "calls each\n", o.stats_pairs, o.stats_pairs, o.stats_pairs,
           o.stats_pairs * o.calls);
    printf("%-5s %-9s %-15s %10s %10s %10s %9s\n", "ranks", "mode", "op", "off_ms", "on_ms",
           "on-off_ms", "on/off-1");
    for (int ci = 0; ci < o.ncounts; ci++) {
      size_t sb = shm_bytes(&o, o.counts[ci]);
      struct shm *s = mmap(NULL, sb, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
      if (s == MAP_FAILED)
        return 1;
      for (int m = 0; m < 2; m++)
        if (o.modes[m])
          status |= stats_overhead(&o, cuda, o.counts[ci], m, s, m ? "threads" : "processes");
      munmap(s, sb);
    }
    return status;
  }
  if (o.peer && !o.first_only && peer_pair_report(&o) != 0)
    status = 1;
  printf("%-5s %-9s %-15s %8s %8s %8s %9s %8s %8s %8s %9s %10s %6s %9s %9s %9s%s\n", "ranks",
         "mode", "op", "attachms", "first_ms", "med_ms", "p99_ms", "MB/call", "GB/s", "rankGB/s",
         o.peer ? "peerGB/s" : "copyGB/s", o.peer ? "rkpeerGB/s" : "rkcopyGB/s", "frac",
         "first/med", "nowarm_ms", "nowarm/med", o.nodes > 1 ? "     xB/call    xGB/s  rkxGB/s" : "");
  fflush(stdout);
  for (int ci = 0; ci < o.ncounts; ci++) {
    int n = o.counts[ci];
    size_t sb = shm_bytes(&o, n);
    struct shm *s = mmap(NULL, sb, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    struct shm *s2 = mmap(NULL, sb, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED || s2 == MAP_FAILED) {
      fprintf(stderr, "ep: out of memory for the results\n");
      return 1;
    }
    for (int m = 0; m < 2; m++) {
      if (!o.modes[m])
        continue;
      const char *mode = m ? "threads" : "processes";
      char job[64];
      snprintf(job, sizeof job, "ep-%d-%d-%c", (int)getpid(), n, mode[0]);
      if (run_world(&o, cuda, n, m, o.sock, o.first_only, s, job)) {
        printf("%-5d %-9s FAILED: %s\n", n, mode, s->err);
        fflush(stdout);
        status = 1;
        continue;
      }
      bool cold = false;
      if (o.sock_nowarm && !o.first_only) {
        snprintf(job, sizeof job, "ep-%d-%d-%c-nowarm", (int)getpid(), n, mode[0]);
        cold = run_world(&o, cuda, n, m, o.sock_nowarm, true, s2, job) == 0;
        if (!cold) {
          printf("# %d %s kernel_warmup-off world FAILED: %s\n", n, mode, s2->err);
          status = 1;
        }
      }
      report(&o, backend, n, mode, s, s2, cold, raw);
    }
    munmap(s, sb);
    munmap(s2, sb);
  }
  if (raw != NULL)
    fclose(raw);
  return status;
}
