/*
 * testutil.c — shared test helpers: binary paths, temporary directories, a
 * real daemon process on a temporary socket, and the GPU of each rank.
 */
#include "testutil.h"

#include <check.h>
#include <dirent.h>
#include <dlfcn.h>
#include <grp.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudadrv.h"
#include "deepep.h"
#include "proto.h"

const char *tu_bin(const char *name) {
  static char path[4][512];
  static int slot;
  const char *b = getenv("DEP_BUILD");
  char *out = path[slot++ % 4];
  snprintf(out, sizeof path[0], "%s/%s", b != NULL && b[0] != '\0' ? b : "build", name);
  return out;
}

int tu_otheruid_prepare(struct tu_otheruid *u, const char *name) {
  memset(u, 0, sizeof *u);
  u->fd[0] = u->fd[1] = -1;
  snprintf(u->dir, sizeof u->dir, "/tmp/deptest-bin.XXXXXX");
  if (mkdtemp(u->dir) == NULL)
    return -1;
  snprintf(u->path, sizeof u->path, "%s/%s", u->dir, name);
  int in = open(tu_bin(name), O_RDONLY | O_CLOEXEC);
  int out = open(u->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0755);
  int rc = in >= 0 && out >= 0 ? 0 : -1;
  char buf[1 << 16];
  ssize_t n = 0;
  while (rc == 0 && (n = read(in, buf, sizeof buf)) > 0)
    if (write(out, buf, (size_t)n) != n)
      rc = -1;
  /* The umask may have narrowed both modes; every uid must reach and run the copy. */
  if (rc == 0 && (n < 0 || fchmod(out, 0755) != 0 || chmod(u->dir, 0755) != 0))
    rc = -1;
  if (out >= 0 && close(out) != 0)
    rc = -1;
  if (in >= 0)
    close(in);
  if (rc == 0 && pipe2(u->fd, O_CLOEXEC) != 0)
    rc = -1;
  if (rc != 0) {
    int e = errno;
    tu_rmtree(u->dir);
    errno = e;
  }
  return rc;
}

void tu_otheruid_child(struct tu_otheruid *u) { close(u->fd[0]); }

void tu_otheruid_done(struct tu_otheruid *u) {
  close(u->fd[1]);
  /* EOF once the child's exec closed the write end, or the child is gone. */
  char c;
  while (read(u->fd[0], &c, 1) < 0 && errno == EINTR) {
  }
  close(u->fd[0]);
  tu_rmtree(u->dir);
}

void tu_tmpdir(char *out, size_t len) {
  const char *t = getenv("TMPDIR");
  snprintf(out, len, "%s/deptest.XXXXXX", t != NULL && t[0] != '\0' ? t : "/tmp");
  if (mkdtemp(out) == NULL) {
    perror("mkdtemp");
    abort();
  }
  chmod(out, 0755);
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(p);
}

void tu_rmtree(const char *dir) {
  if (dir != NULL && dir[0] != '\0')
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

int tu_write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f == NULL)
    return -1;
  int rc = fputs(text, f) < 0 ? -1 : 0;
  if (fclose(f) != 0)
    rc = -1;
  return rc;
}

int tu_connect_raw(const char *path) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof sa.sun_path)
    return -1;
  strcpy(sa.sun_path, path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

char *tu_daemon_log(const struct tu_daemon *d) {
  FILE *f = fopen(d->log, "r");
  if (f == NULL)
    return strdup("");
  char *buf = NULL;
  size_t len = 0;
  FILE *m = open_memstream(&buf, &len);
  char chunk[4096];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, f)) > 0)
    fwrite(chunk, 1, n, m);
  fclose(f);
  fclose(m);
  return buf;
}

int tu_daemon_start_in(struct tu_daemon *d, const char *dir, const char *extra_yaml) {
  return tu_daemon_start_opts(d, dir, extra_yaml, NULL);
}

int tu_daemon_start(struct tu_daemon *d, const char *extra_yaml) {
  memset(d, 0, sizeof *d);
  tu_tmpdir(d->dir, sizeof d->dir);
  return tu_daemon_start_in(d, d->dir, extra_yaml);
}

int tu_daemon_stop(struct tu_daemon *d) {
  if (d->pid <= 0)
    return -1;
  kill(d->pid, SIGTERM);
  int st = 0;
  for (int i = 0; i < 1000; i++) {
    pid_t r = waitpid(d->pid, &st, WNOHANG);
    if (r == d->pid) {
      d->pid = 0;
      return st;
    }
    sleep_ms(10);
  }
  kill(d->pid, SIGKILL);
  waitpid(d->pid, &st, 0);
  d->pid = 0;
  return -1;
}

void tu_daemon_cleanup(struct tu_daemon *d) {
  if (d->pid > 0) {
    kill(d->pid, SIGKILL);
    waitpid(d->pid, NULL, 0);
    d->pid = 0;
  }
  tu_rmtree(d->dir);
}

bool tu_have_gpu(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == NULL)
    return false;
  int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
  int (*count)(int *) = (int (*)(int *))dlsym(h, "cuDeviceGetCount");
  int n = 0;
  bool ok = init != NULL && count != NULL && init(0) == 0 && count(&n) == 0 && n > 0;
  dlclose(h);
  return ok;
}

/* ---- skips ---------------------------------------------------------------- */

/*
 * One line per skip, in one write() to the file opened O_APPEND, so that
 * lines from the forked test processes (and any of their children) never
 * interleave; the runner reads them in the order the tests ran.
 */
static void skip_record(const char *test, const char *kind, const char *fmt, va_list ap) {
  char name[128], why[512], line[768];
  size_t n = strlen(test);
  if (n > 3 && strcmp(test + n - 3, "_fn") == 0)
    n -= 3;
  snprintf(name, sizeof name, "%.*s", (int)n, test);
  vsnprintf(why, sizeof why, fmt, ap);
  for (char *p = why; *p != '\0'; p++)
    if (*p == '\t' || *p == '\n')
      *p = ' ';
  printf("%s: %s: %s\n", name, strcmp(kind, "part") == 0 ? "skipped in part" : "skipped", why);
  fflush(stdout);
  const char *path = getenv(TU_SKIPS_ENV);
  if (path == NULL || path[0] == '\0')
    return;
  int len = snprintf(line, sizeof line, "%s\t%s\t%s\n", name, kind, why);
  if (len < 0)
    return;
  if (len >= (int)sizeof line) /* a long reason is cut, the line still ends */
    len = (int)sizeof line - 1, line[len - 1] = '\n';
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    return;
  if (write(fd, line, (size_t)len) != len)
    fprintf(stderr, "%s: cannot record the skip in %s\n", name, path);
  close(fd);
}

void tu_skip(const char *test, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  skip_record(test, "skip", fmt, ap);
  va_end(ap);
}

void tu_skip_part(const char *test, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  skip_record(test, "part", fmt, ap);
  va_end(ap);
}

/* ---- rank placement on GPUs ------------------------------------------------ */

/* $DEP_TEST_GPUS as asked: unset or empty 1; "all" 0 (every visible GPU); else N >= 1. */
static int gpus_wanted(int *want, char *why, size_t len) {
  const char *v = getenv("DEP_TEST_GPUS");
  if (v == NULL || v[0] == '\0') {
    *want = 1;
    return 0;
  }
  if (strcmp(v, "all") == 0) {
    *want = 0;
    return 0;
  }
  char *end = NULL;
  errno = 0;
  long n = strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || n < 1 || n > TU_GPUS_MAX) {
    snprintf(why, len, "DEP_TEST_GPUS=%s: expected a number of GPUs from 1 to %d, or \"all\"", v,
             TU_GPUS_MAX);
    return -1;
  }
  *want = (int)n;
  return 0;
}

/* How many GPUs the ranks spread over, checked against those the driver shows. */
static int gpus_resolve(const struct cudadrv *cu, int *n, int *visible, char *why, size_t len) {
  int want = 1;
  if (gpus_wanted(&want, why, len) != 0)
    return -1;
  CUresult r = cu->cuDeviceGetCount(visible);
  if (r != CUDA_SUCCESS) {
    snprintf(why, len, "cuDeviceGetCount: %s", cudadrv_errstr(r));
    return -1;
  }
  if (want > *visible) {
    snprintf(why, len, "DEP_TEST_GPUS=%s asks for %d GPUs but only %d %s visible (check "
             "CUDA_VISIBLE_DEVICES, or set DEP_TEST_GPUS=all)", getenv("DEP_TEST_GPUS"), want,
             *visible, *visible == 1 ? "is" : "are");
    return -1;
  }
  *n = want == 0 ? *visible : want;
  if (*n > TU_GPUS_MAX)
    *n = TU_GPUS_MAX;
  return 0;
}

int tu_gpu_for_rank(uint32_t rank, int *ordinal, char *why, size_t len) {
  const struct cudadrv *cu = cudadrv_load(why, len);
  int n = 1, visible = 0;
  if (cu == NULL || gpus_resolve(cu, &n, &visible, why, len) != 0)
    return -1;
  *ordinal = (int)(rank % (uint32_t)n);
  return 0;
}

/* What the probe child hands back over its pipe (well under PIPE_BUF: one write). */
struct gpus_answer {
  int rc;
  char why[256];
  struct tu_gpus g;
};

static void gpus_probe_child(int fd) {
  struct gpus_answer a;
  memset(&a, 0, sizeof a);
  int want = 1;
  const struct cudadrv *cu = NULL;
  if (gpus_wanted(&want, a.why, sizeof a.why) != 0) {
    a.rc = -1; /* malformed: an error with or without a GPU */
  } else if ((cu = cudadrv_load(a.why, sizeof a.why)) == NULL) {
    a.rc = 0;
  } else if (gpus_resolve(cu, &a.g.n, &a.g.visible, a.why, sizeof a.why) != 0) {
    a.rc = -1;
  } else {
    a.rc = 1;
    for (int i = 0; i < a.g.n && a.rc == 1; i++) {
      CUdevice dev;
      CUuuid u;
      CUresult r = cu->cuDeviceGet(&dev, i);
      if (r == CUDA_SUCCESS)
        r = cu->cuDeviceGetUuid(&u, dev);
      if (r != CUDA_SUCCESS) {
        snprintf(a.why, sizeof a.why, "GPU %d: %s", i, cudadrv_errstr(r));
        a.rc = -1;
      } else {
        memcpy(a.g.uuid[i], u.bytes, 16);
      }
    }
    CUdevice dev0;
    int mps = 0;
    if (a.rc == 1 && cu->cuDeviceGet(&dev0, 0) == CUDA_SUCCESS &&
        cu->cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev0) == CUDA_SUCCESS)
      a.g.mps = mps != 0; /* an older driver without the attribute: taken as no MPS */
  }
  _exit(write(fd, &a, sizeof a) == (ssize_t)sizeof a ? 0 : 1);
}

int tu_gpus_probe(struct tu_gpus *g, char *why, size_t len) {
  _Static_assert(sizeof(struct gpus_answer) <= PIPE_BUF, "the answer must be one pipe write");
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) {
    snprintf(why, len, "pipe: %s", strerror(errno));
    return -1;
  }
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    gpus_probe_child(p[1]);
  }
  close(p[1]);
  struct gpus_answer a;
  memset(&a, 0, sizeof a);
  ssize_t got = pid > 0 ? read(p[0], &a, sizeof a) : -1;
  close(p[0]);
  if (pid > 0)
    waitpid(pid, NULL, 0);
  if (got != (ssize_t)sizeof a) {
    snprintf(why, len, "the GPU probe process %s", pid < 0 ? "could not be forked" : "died");
    return -1;
  }
  snprintf(why, len, "%s", a.why);
  *g = a.g;
  return a.rc;
}

/* ---- daemons started a particular way ------------------------------------ */

/* Read exactly len bytes by the deadline (ms, CLOCK_MONOTONIC): 0 or -1. */
static int tu_read_by(int fd, void *buf, size_t len, int64_t deadline) {
  uint8_t *p = buf;
  while (len > 0) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t left = deadline - ((int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    if (left <= 0 || poll(&pfd, 1, (int)left) <= 0)
      return -1;
    ssize_t n = read(fd, p, len);
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

char *tu_daemon_state(const char *sock, char *state, size_t len) {
  state[0] = '\0';
  int fd = tu_connect_raw(sock);
  if (fd < 0)
    return NULL;
  struct proto_buf b;
  proto_buf_init(&b);
  struct dep_msg_hello h = {.version = DEP_PROTO_VERSION, .pid = (uint32_t)getpid()};
  snprintf(h.name, sizeof h.name, "testutil");
  bool sent = proto_frame_encode(&b, DEP_MSG_HELLO, 0, 1, &h) == 0 &&
              proto_frame_encode(&b, DEP_MSG_STATUS, 0, 2, NULL) == 0 &&
              send(fd, b.data, b.len, MSG_NOSIGNAL) == (ssize_t)b.len;
  proto_buf_free(&b);
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t deadline = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + 2000;
  char *found = NULL;
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr fh;
  while (sent && found == NULL && tu_read_by(fd, hdr, sizeof hdr, deadline) == 0 &&
         proto_hdr_decode(hdr, DEP_PROTO_MAX_BODY, &fh, NULL, 0) == 0) {
    uint8_t *body = malloc(fh.body_len + 1u);
    if (body == NULL || tu_read_by(fd, body, fh.body_len, deadline) != 0) {
      free(body);
      break;
    }
    if (fh.type == DEP_MSG_STATUS_OK) {
      struct dep_status st;
      memset(&st, 0, sizeof st);
      if (proto_decode_status(body, fh.body_len, &st) == 0) {
        snprintf(state, len, "%s", st.state);
        found = state;
      }
      free(st.devices);
      free(st.jobs);
    }
    bool last = fh.type != DEP_MSG_HELLO_OK;
    free(body);
    if (last)
      break;
  }
  close(fd);
  return found;
}

int tu_daemon_start_opts(struct tu_daemon *d, const char *dir, const char *extra_yaml,
                         const struct tu_daemon_opts *o) {
  static const struct tu_daemon_opts defaults;
  if (o == NULL)
    o = &defaults;
  if (dir != d->dir)
    snprintf(d->dir, sizeof d->dir, "%s", dir);
  if (o->socket != NULL)
    snprintf(d->sock, sizeof d->sock, "%s", o->socket);
  else
    snprintf(d->sock, sizeof d->sock, "%s/d.sock", d->dir);
  snprintf(d->conf, sizeof d->conf, "%s/deepepd.yaml", d->dir);
  snprintf(d->log, sizeof d->log, "%s/deepepd.log", d->dir);
  /* make check-gpu runs the same suites with DEP_TEST_BACKEND=cuda. */
  const char *backend = getenv("DEP_TEST_BACKEND");
  /* A small pool keeps each daemon start fast; tests that need more
   * memory say so with their own pool: section. */
  const char *extra = extra_yaml != NULL ? extra_yaml : "";
  const char *pool = strstr(extra, "pool:") != NULL
                         ? ""
                         : "pool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n"
                           "  size_per_device: 1GiB\n";
  char yaml[8192];
  if (o->whole_config)
    snprintf(yaml, sizeof yaml, "%s", extra);
  else
    snprintf(yaml, sizeof yaml, "socket:\n  path: %s\n  mode: 0666\nbackend: %s\n%s%s", d->sock,
             backend != NULL && backend[0] != '\0' ? backend : "host", pool, extra);
  if (tu_write_file(d->conf, yaml) != 0)
    return -1;
  struct tu_otheruid other = {.fd = {-1, -1}};
  if (o->uid > 0 && tu_otheruid_prepare(&other, "deepepd") != 0)
    return -1;
  pid_t pid = fork();
  if (pid < 0) {
    if (o->uid > 0)
      tu_otheruid_done(&other);
    return -1;
  }
  if (pid == 0) {
    int fd = open(d->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 2);
      dup2(fd, 1);
      close(fd);
    }
    unsetenv("NOTIFY_SOCKET");
    /* The daemon runs outside MPS, as under systemd: a daemon made an MPS
     * client of the ranks' server could not serve them (DEVICE.md). */
    unsetenv("CUDA_MPS_PIPE_DIRECTORY");
    unsetenv("CUDA_MPS_LOG_DIRECTORY");
    if (o->uid > 0) {
      tu_otheruid_child(&other);
      /* At fd 3, where the close_range below keeps it open until the exec closes it. */
      if (o->nofile > 0 && other.fd[1] != 3) {
        if (dup3(other.fd[1], 3, O_CLOEXEC) < 0)
          _exit(126);
        other.fd[1] = 3;
      }
    }
    if (o->nofile > 0) {
      /* Only stdio goes with it, so that the fds it holds are its own (fd 3, where
         tu_otheruid's pipe is, closes at the exec). */
      close_range(o->uid > 0 ? 4 : 3, ~0u, 0);
      struct rlimit rl = {.rlim_cur = (rlim_t)o->nofile, .rlim_max = (rlim_t)o->nofile};
      if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
        perror("setrlimit RLIMIT_NOFILE");
        _exit(126);
      }
    }
    if (o->uid > 0 && (setgroups(0, NULL) != 0 || setgid((gid_t)o->uid) != 0 ||
                       setuid((uid_t)o->uid) != 0)) {
      perror("becoming the daemon's uid");
      _exit(126);
    }
    if (o->netns != NULL) {
      char path[300];
      snprintf(path, sizeof path, "/var/run/netns/%s", o->netns);
      int nfd = open(path, O_RDONLY | O_CLOEXEC);
      if (nfd < 0 || setns(nfd, CLONE_NEWNET) != 0) {
        perror("entering the daemon's network namespace");
        _exit(126);
      }
      close(nfd);
    }
    execl(o->uid > 0 ? other.path : tu_bin("deepepd"), "deepepd", "-c", d->conf, (char *)NULL);
    perror("exec deepepd");
    _exit(127);
  }
  if (o->uid > 0)
    tu_otheruid_done(&other);
  d->pid = pid;
  if (o->wait == TU_WAIT_NONE)
    return 0;
  for (int i = 0; i < 3000; i++) {
    char state[32];
    if (o->wait == TU_WAIT_SOCKET) {
      int fd = tu_connect_raw(d->sock);
      if (fd >= 0) {
        close(fd);
        return 0;
      }
    } else if (tu_daemon_state(d->sock, state, sizeof state) != NULL &&
               strcmp(state, "starting") != 0) {
      return 0; /* its pools are made: the daemon has started */
    }
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      d->pid = 0;
      break;
    }
    sleep_ms(10);
  }
  char *log = tu_daemon_log(d);
  fprintf(stderr, "deepepd did not start; its log:\n%s\n", log);
  free(log);
  if (d->pid > 0) {
    kill(d->pid, SIGKILL);
    waitpid(d->pid, NULL, 0);
    d->pid = 0;
  }
  return -1;
}

int tu_daemon_wait_exit(struct tu_daemon *d, int timeout_ms) {
  for (int waited = 0; d->pid > 0 && waited <= timeout_ms; waited += 10) {
    int st;
    if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
      d->pid = 0;
      return st;
    }
    sleep_ms(10);
  }
  return -1;
}

int tu_lowest_free_fd(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *dir = opendir(path);
  if (dir == NULL)
    return -1;
  static bool open_fd[4096];
  memset(open_fd, 0, sizeof open_fd);
  for (struct dirent *e; (e = readdir(dir)) != NULL;) {
    long n = strtol(e->d_name, NULL, 10);
    if (e->d_name[0] != '.' && n >= 0 && n < 4096)
      open_fd[n] = true;
  }
  closedir(dir);
  int n = 0;
  while (n < 4096 && open_fd[n])
    n++;
  return n;
}

char *tu_sh_out(const char *cmd, int *status) {
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  size_t cap = 1 << 16, len = 0, got;
  char *out = malloc(cap);
  ck_assert_ptr_nonnull(out);
  while ((got = fread(out + len, 1, cap - len - 1, p)) > 0) {
    len += got;
    if (cap - len < 4096) {
      cap *= 2;
      out = realloc(out, cap);
      ck_assert_ptr_nonnull(out);
    }
  }
  out[len] = '\0';
  const int st = pclose(p);
  if (status != NULL)
    *status = st;
  return out;
}

int tu_threads(pid_t pid, const char *name) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL)
    return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.')
      continue;
    if (name == NULL) {
      n++;
      continue;
    }
    char comm[400], got[32] = "";
    snprintf(comm, sizeof comm, "%s/%s/comm", path, e->d_name);
    FILE *f = fopen(comm, "r");
    if (f == NULL)
      continue;
    if (fgets(got, sizeof got, f) != NULL)
      got[strcspn(got, "\n")] = '\0';
    fclose(f);
    n += strcmp(got, name) == 0;
  }
  closedir(d);
  return n;
}
