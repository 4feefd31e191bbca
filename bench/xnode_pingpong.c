/*
 * xnode_pingpong.c — the latency ceiling of the benchmark between nodes
 * (bench/xnode.sh): a TCP round trip of a given number of bytes between
 * two network namespaces, over sockets tuned as deepepd's data connections
 * are (TCP_NODELAY, 4 MiB buffers), so that a low-latency dispatch can be
 * held against the round trip of its own bytes.
 *
 *   xnode_pingpong -l ADDR:PORT                 serve (echo) clients one after another
 *   xnode_pingpong -c ADDR:PORT -b B[,B...] [-i ITERS] [-w WARMUP]
 *
 * For each size B the client sends B bytes, the server reads all B and
 * sends B bytes back, the client reads all B: one round trip, timed with
 * CLOCK_MONOTONIC.  Per size it prints the first round trip (on a
 * connection that has carried the other sizes before, as a data
 * connection is warm), then the median and p99 of ITERS after WARMUP
 * untimed ones.  One connection, as deepepd sends one sweep's batch for a
 * peer on one connection.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "benchlib.h"

#define PP_MAX_BYTES (64ull << 20)
#define PP_MAX_SIZES 32
#define PP_MAX_ITERS 100000

/* What the client announces before each size: its bytes and round trips. */
struct pp_hello {
  uint64_t bytes;
  uint32_t rounds; /* 0: the client is done */
  uint32_t pad;
};

/* The message (one %s for arg), with errno's text when err is nonzero, then exit(1). */
static void die(int err, const char *fmt, const char *arg) __attribute__((noreturn));
static void die(int err, const char *fmt, const char *arg) {
  fprintf(stderr, "xnode_pingpong: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "%s%s\n", err ? ": " : "", err ? strerror(err) : "");
  exit(1);
}

static int io_all(int fd, void *buf, size_t len, int send_it) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = send_it ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n == 0)
      errno = ECONNRESET; /* the far end closed */
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* As deepepd's data connections (daemon/xfer.c's tune_socket). */
static void tune(int fd) {
  int one = 1, buf = 4 << 20;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

static struct sockaddr_in parse_addr(const char *s) {
  char host[64];
  const char *colon = strrchr(s, ':');
  struct sockaddr_in a = {.sin_family = AF_INET};
  long port = colon ? strtol(colon + 1, NULL, 10) : 0;
  if (colon == NULL || (size_t)(colon - s) >= sizeof host || port < 1 || port > 65535)
    die(0, "'%s' is not IPV4:PORT", s);
  memcpy(host, s, (size_t)(colon - s));
  host[colon - s] = '\0';
  if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
    die(0, "'%s' is not an IPv4 address", host);
  a.sin_port = htons((uint16_t)port);
  return a;
}

/* Echo one client's round trips until it says it is done; -1 when it broke off. */
static int serve_one(int fd, uint8_t *buf) {
  for (;;) {
    struct pp_hello h;
    if (io_all(fd, &h, sizeof h, 0) != 0)
      return -1;
    if (h.rounds == 0)
      return 0;
    if (h.bytes < 1 || h.bytes > PP_MAX_BYTES) {
      fprintf(stderr, "xnode_pingpong: a client asked for %llu bytes, out of range\n",
              (unsigned long long)h.bytes);
      return -1;
    }
    for (uint32_t i = 0; i < h.rounds; i++)
      if (io_all(fd, buf, h.bytes, 0) != 0 || io_all(fd, buf, h.bytes, 1) != 0)
        return -1;
  }
}

/* Serve clients one after another until killed (the driver stops it). */
static int serve(const char *where) {
  struct sockaddr_in a = parse_addr(where);
  int one = 1, ls = socket(AF_INET, SOCK_STREAM, 0);
  if (ls < 0 || setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(ls, (struct sockaddr *)&a, sizeof a) != 0 || listen(ls, 1) != 0)
    die(errno, "cannot listen on %s", where);
  uint8_t *buf = malloc(PP_MAX_BYTES);
  if (buf == NULL)
    die(0, "out of memory%s", "");
  printf("listening\n"); /* the driver waits for this line */
  fflush(stdout);
  for (;;) {
    int fd = accept(ls, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      die(errno, "accept on %s", where);
    }
    tune(fd);
    if (serve_one(fd, buf) != 0)
      fprintf(stderr, "xnode_pingpong: a client broke off (%s)\n", strerror(errno));
    close(fd);
  }
}

static int client(const char *where, const char *sizes, int iters, int warm) {
  uint64_t b[PP_MAX_SIZES];
  int nb = 0;
  char *dup = strdup(sizes);
  for (char *t = strtok(dup, ","); t != NULL; t = strtok(NULL, ",")) {
    unsigned long long v = strtoull(t, NULL, 10);
    if (nb == PP_MAX_SIZES || v < 1 || v > PP_MAX_BYTES)
      die(0, "size '%s': 1 byte to 64 MiB, at most 32 sizes", t);
    b[nb++] = v;
  }
  free(dup);
  struct sockaddr_in a = parse_addr(where);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    die(errno, "socket%s", "");
  tune(fd);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
    die(errno, "cannot connect to %s", where);
  uint8_t *buf = malloc(PP_MAX_BYTES);
  double *t = malloc(sizeof(double) * (size_t)iters);
  if (buf == NULL || t == NULL)
    die(0, "out of memory%s", "");
  memset(buf, 0x5a, PP_MAX_BYTES);
  /* A first untimed round of the smallest size: the connection is warm, as
   * deepepd's data connections are before a job's first call. */
  struct pp_hello h0 = {.bytes = 1, .rounds = 1};
  if (io_all(fd, &h0, sizeof h0, 1) != 0 || io_all(fd, buf, 1, 1) != 0 ||
      io_all(fd, buf, 1, 0) != 0)
    die(errno, "the first round trip failed%s", "");
  printf("%-10s %10s %10s %10s %10s\n", "bytes", "first_us", "med_us", "p99_us", "GB/s_1way");
  for (int s = 0; s < nb; s++) {
    struct pp_hello h = {.bytes = b[s], .rounds = (uint32_t)(1 + warm + iters)};
    if (io_all(fd, &h, sizeof h, 1) != 0)
      die(errno, "the server went away%s", "");
    double first = 0;
    for (int i = -1 - warm; i < iters; i++) {
      double t0 = bench_now_ms();
      if (io_all(fd, buf, b[s], 1) != 0 || io_all(fd, buf, b[s], 0) != 0)
        die(errno, "a round trip broke off%s", "");
      double us = (bench_now_ms() - t0) * 1e3;
      if (i == -1 - warm)
        first = us;
      else if (i >= 0)
        t[i] = us;
    }
    bench_sort(t, (size_t)iters);
    double med = t[iters / 2], p99 = t[(iters * 99 + 99) / 100 - 1];
    /* Bytes one way over half a round trip: the rate a one-way send of this size sees. */
    printf("%-10llu %10.1f %10.1f %10.1f %10.3f\n", (unsigned long long)b[s], first, med, p99,
           (double)b[s] / (med / 2) / 1e3);
    fflush(stdout);
  }
  struct pp_hello bye = {0};
  (void)io_all(fd, &bye, sizeof bye, 1);
  free(buf);
  free(t);
  close(fd);
  return 0;
}

int main(int argc, char **argv) {
  const char *listen_at = NULL, *connect_to = NULL, *sizes = NULL;
  int iters = 1000, warm = 20, opt;
  while ((opt = getopt(argc, argv, "l:c:b:i:w:")) != -1) {
    switch (opt) {
    case 'l': listen_at = optarg; break;
    case 'c': connect_to = optarg; break;
    case 'b': sizes = optarg; break;
    case 'i': iters = atoi(optarg); break;
    case 'w': warm = atoi(optarg); break;
    default: goto usage;
    }
  }
  if (optind == argc && listen_at != NULL && connect_to == NULL)
    return serve(listen_at);
  if (optind == argc && connect_to != NULL && listen_at == NULL && sizes != NULL && iters >= 1 &&
      iters <= PP_MAX_ITERS && warm >= 0)
    return client(connect_to, sizes, iters, warm);
usage:
  fprintf(stderr, "usage: xnode_pingpong -l IPV4:PORT\n"
                  "       xnode_pingpong -c IPV4:PORT -b BYTES[,BYTES...] [-i ITERS] [-w WARMUP]\n");
  return 2;
}
