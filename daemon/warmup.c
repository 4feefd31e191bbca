/*
 * warmup.c — the start-up warm-up's child process and its parent side
 * (warmup.h).
 */
#include "warmup.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "deepep.h"
#include "deepep_daemon.h"
#include "devices.h"
#include "log.h"
#include "pool.h"
#include "proto.h"
#include "shape.h"
#include "uuid.h"

/* The smallest shape that runs every kernel, the low-latency ones included. */
static const struct dep_job_shape warmup_shape = {
    .max_tokens_per_rank = 8, .hidden = 128, .num_experts = 4, .topk = 2, .dtype = DEP_DTYPE_BF16};

static struct {
  uv_process_t proc;
  uv_timer_t timer;
  warmup_done_fn *done;
  bool running, timed_out, open;
  uint64_t t0;
} wu;

static void warmup_closed(uv_handle_t *h) { (void)h; }

static void warmup_close(void) {
  if (!wu.open)
    return;
  uv_close((uv_handle_t *)&wu.proc, warmup_closed);
  uv_close((uv_handle_t *)&wu.timer, warmup_closed);
  wu.open = false;
}

static void warmup_exited(uv_process_t *p, int64_t status, int sig) {
  wu.running = false;
  uv_timer_stop(&wu.timer);
  char why[DEP_MSG_TEXT_MAX] = "";
  int rc = 0;
  if (wu.timed_out) {
    snprintf(why, sizeof why, "the kernel warm-up did not end within %d ms (a GPU hung?); check "
             "nvidia-smi, or set kernel_warmup: false to start without it", WARMUP_TIMEOUT_MS);
    rc = DEP_ERR_TIMEOUT;
  } else if (status != 0 || sig != 0) {
    snprintf(why, sizeof why, "the kernel warm-up failed (%s %d; its lines above say where and "
             "why): fix the driver or the build it names, leave that GPU out of devices:, or set "
             "kernel_warmup: false to start without the check", sig ? "signal" : "exit status",
             sig ? sig : (int)status);
    rc = DEP_ERR_CUDA;
  } else {
    log_info("kernel warm-up: every GPU ran every kernel in %llu ms",
             (unsigned long long)((uv_hrtime() - wu.t0) / 1000000u));
    /* Its process is gone: what its jobs used goes back as if never lent. */
    for (size_t i = 0; i < devices_count(); i++)
      pool_forget(devices_at(i), geteuid(), dep__shape_key(&warmup_shape, 1));
  }
  warmup_close();
  wu.done(rc, rc ? why : NULL);
}

static void warmup_timeout(uv_timer_t *t) {
  wu.timed_out = true;
  uv_process_kill(&wu.proc, SIGKILL);
}

int warmup_start(uv_loop_t *loop, const char *socket, const char uuids[][37], size_t n,
                 warmup_done_fn *done) {
  char **args = calloc(n + 4, sizeof *args);
  if (args == NULL)
    return DEP_ERR_NO_MEMORY;
  args[0] = "deepepd";
  args[1] = "--" WARMUP_CHILD_OPT;
  args[2] = (char *)socket;
  for (size_t i = 0; i < n; i++)
    args[3 + i] = (char *)uuids[i];
  /* stdin from nowhere; its log lines go where the daemon's go. */
  uv_stdio_container_t io[3] = {{.flags = UV_IGNORE},
                                {.flags = UV_INHERIT_FD, .data.fd = 2},
                                {.flags = UV_INHERIT_FD, .data.fd = 2}};
  uv_process_options_t o = {.exit_cb = warmup_exited, .file = "/proc/self/exe", .args = args,
                            .stdio_count = 3, .stdio = io};
  memset(&wu, 0, sizeof wu);
  wu.done = done;
  wu.t0 = uv_hrtime();
  int rc = uv_spawn(loop, &wu.proc, &o);
  free(args);
  if (rc != 0) {
    log_errx("kernel warm-up: cannot start its process: %s", uv_strerror(rc));
    uv_close((uv_handle_t *)&wu.proc, warmup_closed);
    return DEP_ERR_INTERNAL;
  }
  uv_timer_init(loop, &wu.timer);
  uv_timer_start(&wu.timer, warmup_timeout, WARMUP_TIMEOUT_MS, 0);
  wu.running = wu.open = true;
  log_info("kernel warm-up: process %d attaches one rank on each of %zu GPU(s)", wu.proc.pid, n);
  return 0;
}

void warmup_fini(void) {
  if (wu.running)
    uv_process_kill(&wu.proc, SIGKILL);
  wu.running = false;
  warmup_close();
}

/* ---- the child ------------------------------------------------------------------------- */

/* One job of one rank on the GPU uuid: attach (which warms the kernels up) and detach. */
static int warmup_one(const char *socket, const char *uuid, int i) {
  dep_client_t *c = NULL;
  struct dep_attach_args a = {
      .size = sizeof a,
      .rank = 0, .world_size = 1, .local_rank = 0, .local_world_size = 1,
      .shape = warmup_shape,
  };
  snprintf(a.job_id, sizeof a.job_id, WARMUP_JOB_PREFIX "%d-%d", (int)getpid(), i);
  if (dep__uuid_parse(uuid, a.device_uuid) != 0) {
    log_errx("kernel warm-up: %s is not a GPU UUID", uuid);
    return -1;
  }
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, socket);
  if (rc == 0)
    rc = dep_attach(c, &a);
  struct dep_attach_times t = {.size = sizeof t};
  if (rc == 0) {
    dep_attach_times(c, &t);
    log_info("kernel warm-up: GPU %s: kernels (%s) loaded in %.1f ms, each run once in %.1f ms",
             uuid, dep__client_kernels_lent(c) ? "the daemon's compile" : "the library's fatbin",
             t.setup_ms, t.warmup_ms);
    rc = dep_detach(c);
  }
  if (rc != 0)
    log_errx("kernel warm-up: GPU %s: %s: %s", uuid, dep_strerror(rc),
             c != NULL ? dep_errmsg(c) : "out of memory");
  dep_client_free(c);
  return rc == 0 ? 0 : -1;
}

int warmup_child_main(const char *socket, int n, char **uuids) {
  int bad = 0;
  for (int i = 0; i < n; i++)
    bad += warmup_one(socket, uuids[i], i) != 0;
  return bad == 0 ? 0 : 1;
}
