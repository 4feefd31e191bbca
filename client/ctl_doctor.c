/*
 * ctl_doctor.c — `deepepctl doctor`: the field report's four checks
 * (DESIGN §10), allocation in two (the pools, and the GPUs' own memory),
 * each OK, WARN or FAIL with what to do, or SKIP where it does not apply
 * (the host backend has no kernels and no device memory), as a table or
 * --json; the exit status is 1 when any check fails.
 *
 *   connections  the control socket (there, a socket, who may connect) and
 *                every configured peer daemon up with all its connections
 *   kernels      on cuda, whether this build carries the kernels at all,
 *                and for each served GPU what serves it: SASS in the
 *                fatbin for its architecture (the fatbin read here, the
 *                GPU asked through the driver), or only PTX and the
 *                daemon's cached compile of it (KERNELS), of this very
 *                build; FAIL where neither SASS nor PTX can run on it
 *   allocation   the largest arena lent since the daemon started against
 *                what each device's pool has free now; on cuda each GPU's
 *                compute mode, and MPS where ranks of one job share a GPU
 *   memory       on cuda, each GPU's free memory against what its pool may
 *                still take from it (its budget less what it has made,
 *                STATS_OK) and against the largest job seen there
 *   balance      the tokens each rank receives in the newest layout every
 *                rank of a job reported: the most over the mean, WARN above
 *                DOCTOR_SKEW_WARN, FAIL above DOCTOR_SKEW_FAIL
 *
 * This file finds things out (the daemon's answers, the driver's); what the
 * kernels, compute mode, MPS and memory findings mean is decided in
 * ctl_doctor_judge.c, which the tests run on simulated values.
 */
#include <errno.h>
#include <grp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_internal.h"
#include "ctl.h"
#include "ctl_doctor.h"
#include "ctl_stats.h"
#include "cudadrv.h"
#include "kimage.h"
#include "uuid.h"

#define DOCTOR_SKEW_WARN 1.25
#define DOCTOR_SKEW_FAIL 1.75
#define DOCTOR_NCHECKS 5

/* ---- connections ------------------------------------------------------------------ */

static const char *doctor_socket_path(const struct ctl *ctl) {
  if (ctl->socket != NULL)
    return ctl->socket;
  const char *e = getenv(DEP_SOCKET_ENV);
  return e != NULL && e[0] != '\0' ? e : DEP_DEFAULT_SOCKET;
}

static void doctor_socket(const struct ctl *ctl, struct doctor_check *k, bool connected,
                          const char *why) {
  const char *path = doctor_socket_path(ctl);
  struct stat sb;
  if (stat(path, &sb) != 0) {
    doctor_note(k, DOCTOR_FAIL, "no control socket at %s (%s)", path, strerror(errno));
    doctor_do(k, "start deepepd (systemctl start deepepd; where it does not stay up, journalctl "
                 "-u deepepd says why, e.g. a kernel_cache_dir others may write), or name its "
                 "socket with -s");
    return;
  }
  if (!S_ISSOCK(sb.st_mode)) {
    doctor_note(k, DOCTOR_FAIL, "%s is not a socket", path);
    doctor_do(k, "remove it and restart deepepd, or fix socket.path");
    return;
  }
  struct group *g = getgrgid(sb.st_gid);
  char group[64];
  if (g != NULL)
    snprintf(group, sizeof group, "%s", g->gr_name);
  else
    snprintf(group, sizeof group, "%u", (unsigned)sb.st_gid);
  if (!connected) {
    doctor_note(k, DOCTOR_FAIL, "control socket %s (mode %04o, group %s) does not answer: %s",
                path, (unsigned)(sb.st_mode & 07777), group, why);
    doctor_do(k, errno == EACCES ? "join the socket's group, or ask for allow.users/groups"
                                 : "check that deepepd runs (systemctl status deepepd)");
    return;
  }
  doctor_note(k, DOCTOR_OK, "control socket %s answers (mode %04o, group %s)", path,
              (unsigned)(sb.st_mode & 07777), group);
  if ((sb.st_mode & 0006) != 0) {
    doctor_note(k, DOCTOR_WARN, "any local user may connect to it (mode %04o)",
                (unsigned)(sb.st_mode & 07777));
    doctor_do(k, "set socket.mode: 0660 and socket.group in deepepd.yaml");
  }
}

/* The whole number file `path` holds (a sysctl's), or -1. */
static int doctor_read_int(const char *path) {
  FILE *f = fopen(path, "re");
  int v = -1;
  if (f != NULL) {
    if (fscanf(f, "%d", &v) != 1)
      v = -1;
    fclose(f);
  }
  return v;
}

static void doctor_peers(dep_client_t *c, struct doctor_check *k) {
  struct dep_msg_peers m = {0};
  if (ctl_ask(c, DEP_MSG_PEERS, NULL, DEP_MSG_PEERS_OK, ctl_decode_peers, &m) != 0) {
    doctor_note(k, DOCTOR_WARN, "the daemon did not list its peers: %s", dep_errmsg(c));
    doctor_do(k, "deepepctl peers says more");
    return;
  }
  if (m.n_peers == 0)
    doctor_note(k, DOCTOR_OK, "no peers configured");
  uint32_t up = 0;
  for (uint32_t i = 0; i < m.n_peers; i++) {
    const struct dep_msg_peer_info *p = &m.peers[i];
    if (strcmp(p->state, "up") == 0 && p->conns_up == p->conns_total) {
      up++;
      continue;
    }
    doctor_note(k, DOCTOR_FAIL, "peer %s is %s on %s, %u/%u connections up%s%s", p->address,
                p->state, p->transport, p->conns_up, p->conns_total,
                p->last_error[0] ? ": " : "", p->last_error);
  }
  if (up < m.n_peers)
    doctor_do(k, "check that deepepd runs on each peer, its listen address and port, the "
                 "firewall between, and that both use the same peer_key_file");
  if (m.n_peers > 0 && up > 0)
    doctor_note(k, DOCTOR_OK, "%u of %u peers up with every connection", up, m.n_peers);
  uint32_t tcp = 0;
  for (uint32_t i = 0; i < m.n_peers; i++)
    tcp += strcmp(m.peers[i].transport, "tcp") == 0 || strcmp(m.peers[i].transport, "mixed") == 0;
  doctor_judge_tcp_idle(k, tcp > 0 ? doctor_read_int(DOCTOR_SSAI_PATH) : -1, tcp);
  proto_peers_free(&m);
}

/* ---- kernels ------------------------------------------------------------------------ */

#ifdef DEP_HAVE_FATBIN
/* What the fatbin has for a GPU (its compute capability asked through the driver), or UNKNOWN. */
static enum kimage_fit doctor_fit(const struct cudadrv *cu, const struct kimage *img,
                                  const uint8_t uuid[16], int *arch) {
  CUdevice dev;
  int major = 0, minor = 0;
  *arch = 0;
  if (cu == NULL || cudadrv_device_by_uuid(cu, uuid, &dev) != 0 ||
      cu->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) !=
          CUDA_SUCCESS ||
      cu->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev) !=
          CUDA_SUCCESS)
    return KIMAGE_UNKNOWN;
  *arch = major * 10 + minor;
  return kimage_fit(img->data, img->len, major, minor);
}
#endif

static void doctor_kernels(dep_client_t *c, const struct dep_status *st, struct doctor_check *k) {
  if (strcmp(st->backend, "cuda") != 0) {
    doctor_note(k, DOCTOR_SKIP, "%s backend: no kernels to load (the operations are the "
                "library's C code)", st->backend);
    return;
  }
#ifdef DEP_HAVE_FATBIN
  struct kimage img;
  kimage_embedded(&img);
  doctor_note(k, DOCTOR_OK, "this build's library embeds the CUDA kernels (build %.16s)", img.id);
  char why[256] = "";
  const struct cudadrv *cu = cudadrv_load(why, sizeof why);
  if (cu == NULL) {
    doctor_note(k, DOCTOR_WARN, "cannot ask the GPUs here what the fatbin has for them: %s", why);
    doctor_do(k, "run deepepctl doctor on the node itself, where libcuda.so.1 loads");
  }
  for (uint32_t i = 0; i < st->num_devices && c->fd >= 0; i++) {
    const char *gpu = st->devices[i].uuid;
    struct dep_msg_kernels m;
    if (dep__uuid_parse(gpu, m.device_uuid) != 0)
      continue;
    struct doctor_kernels_in in = {.gpu = gpu, .build = img.id, .lend_why = ""};
    in.fit = doctor_fit(cu, &img, m.device_uuid, &in.arch);
    struct dep_msg_kernels_ok ok;
    if (doctor_kernels_ask(in.fit)) {
      in.lend_rc = ctl_ask(c, DEP_MSG_KERNELS, &m, DEP_MSG_KERNELS_OK, ctl_decode_kernels_ok, &ok);
      in.lend_why = dep_errmsg(c);
      in.lent = in.lend_rc == 0 ? &ok : NULL;
    }
    doctor_judge_kernels(k, &in);
  }
#else
  doctor_note(k, DOCTOR_FAIL, "this build of libdeepep-client has no CUDA kernels (built "
              "without nvcc): a rank's operations return DEP_ERR_UNSUPPORTED on cuda");
  doctor_do(k, "rebuild with CUDA_HOME pointing at a CUDA toolkit");
#endif
}

/* ---- allocation ------------------------------------------------------------------------ */

static bool doctor_job_running(const struct dep_status *st, const char *id) {
  for (uint32_t i = 0; i < st->num_jobs; i++)
    if (strcmp(st->jobs[i].job_id, id) == 0)
      return true;
  return false;
}

static void doctor_pools(const struct dep_status *st, const struct ctl_stats *s,
                         struct doctor_check *k) {
  const double mib = 1024.0 * 1024.0;
  const struct dep_msg_stats_ok *ok = &s->ok;
  char uuid[DEP_UUID_STR_LEN];
  dep__uuid_str(ok->largest_uuid, uuid);
  for (uint32_t i = 0; i < st->num_devices; i++) {
    const struct dep_status_device *d = &st->devices[i];
    uint64_t busy = d->pool_used_bytes + d->pool_held_bytes;
    uint64_t avail = d->pool_total_bytes > busy ? d->pool_total_bytes - busy : 0;
    bool largest_here = ok->largest_bytes > 0 && strcmp(uuid, d->uuid) == 0;
    if (!largest_here || doctor_job_running(st, ok->largest_job)) {
      doctor_note(k, DOCTOR_OK, "device %s: %.1f of %.1f MiB free", d->uuid,
                  (double)avail / mib, (double)d->pool_total_bytes / mib);
      continue;
    }
    if (ok->largest_bytes > avail) {
      doctor_note(k, DOCTOR_FAIL, "device %s: job %s, the largest seen, took %.1f MiB, but only "
                  "%.1f of %.1f MiB are free now (%.1f lent to running jobs, %.1f held by gone "
                  "processes)", d->uuid, ok->largest_job, (double)ok->largest_bytes / mib,
                  (double)avail / mib, (double)d->pool_total_bytes / mib,
                  (double)d->pool_used_bytes / mib, (double)d->pool_held_bytes / mib);
      doctor_do(k, "let the running jobs end, or raise pool.size_per_device (pool.host_size on "
                   "the host backend) so that job %s can start again", ok->largest_job);
    } else {
      doctor_note(k, DOCTOR_OK, "device %s: %.1f MiB free, the largest job seen (%s) took %.1f MiB",
                  d->uuid, (double)avail / mib, ok->largest_job,
                  (double)ok->largest_bytes / mib);
    }
  }
}

static void doctor_gpus(dep_client_t *c, const struct dep_status *st, struct doctor_check *k) {
  if (strcmp(st->backend, "cuda") != 0)
    return;
  char why[256] = "";
  const struct cudadrv *cu = cudadrv_load(why, sizeof why);
  if (cu == NULL) {
    doctor_note(k, DOCTOR_WARN, "cannot ask the GPUs here: %s", why);
    doctor_do(k, "run deepepctl doctor on the node itself, where libcuda.so.1 loads");
    return;
  }
  struct dep_msg_clients m = {0};
  if (ctl_ask(c, DEP_MSG_CLIENTS, NULL, DEP_MSG_CLIENTS_OK, ctl_decode_clients, &m) != 0)
    m.n = 0;
  for (uint32_t i = 0; i < st->num_devices; i++) {
    uint8_t uuid[16];
    CUdevice dev;
    if (dep__uuid_parse(st->devices[i].uuid, uuid) != 0 ||
        cudadrv_device_by_uuid(cu, uuid, &dev) != 0)
      continue;
    int mode = 0, mps = 0;
    CUresult r = cu->cuDeviceGetAttribute(&mode, CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, dev);
    if (r != CUDA_SUCCESS) {
      doctor_note(k, DOCTOR_WARN, "GPU %s: its compute mode: %s", st->devices[i].uuid,
                  cudadrv_errstr(r));
      doctor_do(k, "see nvidia-smi -q -d COMPUTE for this GPU");
      continue;
    }
    /* An older driver without the attribute: taken as no MPS. */
    if (cu->cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev) != CUDA_SUCCESS)
      mps = 0;
    char job[DEP_JOB_ID_MAX];
    doctor_judge_mode(k, st->devices[i].uuid, mode, mps != 0,
                      doctor_shared_gpu(&m, uuid, job) ? job : NULL);
  }
  proto_clients_free(&m);
}

/* ---- the GPUs' own memory ------------------------------------------------------------- */

/* A GPU's free and total memory, through a primary context of this process (which takes some
 * of it: the figure errs low by that much).  CUDA_SUCCESS or the driver's result. */
static CUresult doctor_gpu_mem(const struct cudadrv *cu, CUdevice dev, size_t *free_b,
                               size_t *total_b) {
  CUcontext ctx = NULL;
  CUresult r = cu->cuDevicePrimaryCtxRetain(&ctx, dev);
  if (r != CUDA_SUCCESS)
    return r;
  if ((r = cu->cuCtxSetCurrent(ctx)) == CUDA_SUCCESS)
    r = cu->cuMemGetInfo(free_b, total_b);
  cu->cuCtxSetCurrent(NULL);
  cu->cuDevicePrimaryCtxRelease(dev);
  return r;
}

static void doctor_memory(const struct dep_status *st, const struct ctl_stats *s,
                          struct doctor_check *k) {
  if (strcmp(st->backend, "cuda") != 0) {
    doctor_note(k, DOCTOR_SKIP, "%s backend: no device memory (its pool is host memory, which "
                "allocation checks)", st->backend);
    return;
  }
  char why[256] = "";
  const struct cudadrv *cu = cudadrv_load(why, sizeof why);
  if (cu == NULL) {
    doctor_note(k, DOCTOR_WARN, "cannot ask the GPUs here: %s", why);
    doctor_do(k, "run deepepctl doctor on the node itself, where libcuda.so.1 loads");
    return;
  }
  const struct dep_msg_stats_ok *ok = &s->ok;
  for (uint32_t i = 0; i < st->num_devices; i++) {
    const struct dep_status_device *d = &st->devices[i];
    uint8_t uuid[16];
    CUdevice dev;
    if (dep__uuid_parse(d->uuid, uuid) != 0 || cudadrv_device_by_uuid(cu, uuid, &dev) != 0) {
      doctor_note(k, DOCTOR_WARN, "GPU %s: not visible here", d->uuid);
      doctor_do(k, "run deepepctl doctor on the node, with the daemon's GPUs visible");
      continue;
    }
    const struct dep_msg_stats_pool *p = NULL;
    for (uint32_t j = 0; j < ok->n_pools && p == NULL; j++)
      if (memcmp(ok->pools[j].uuid, uuid, 16) == 0)
        p = &ok->pools[j];
    size_t free_b = 0, total_b = 0;
    CUresult r = p != NULL ? doctor_gpu_mem(cu, dev, &free_b, &total_b) : CUDA_SUCCESS;
    if (p == NULL || r != CUDA_SUCCESS) {
      doctor_note(k, DOCTOR_WARN, "GPU %s: %s", d->uuid,
                  p == NULL ? "the daemon did not say what its pool has made (still starting?)"
                            : cudadrv_errstr(r));
      doctor_do(k, "see deepepctl stats and nvidia-smi for this GPU");
      continue;
    }
    char uuid_l[DEP_UUID_STR_LEN];
    dep__uuid_str(ok->largest_uuid, uuid_l);
    const bool largest_here = ok->largest_bytes > 0 && strcmp(uuid_l, d->uuid) == 0;
    const struct doctor_memory_in in = {
        .gpu = d->uuid, .budget = d->pool_total_bytes, .made = p->made_bytes,
        .busy = d->pool_used_bytes + d->pool_held_bytes, .free_b = free_b, .total_b = total_b,
        .largest = largest_here ? ok->largest_bytes : 0, .largest_job = ok->largest_job,
        .largest_running = largest_here && doctor_job_running(st, ok->largest_job)};
    doctor_judge_memory(k, &in);
  }
}

/* ---- load balance --------------------------------------------------------------------- */

static void doctor_balance(const struct ctl_stats *s, struct doctor_check *k) {
  uint32_t judged = 0;
  for (uint32_t i = 0; i < s->n; i++) {
    const char *job = s->ranks[i].job_id;
    if (!ctl_stats_job_first(s, i))
      continue;
    uint32_t hot = 0;
    double skew = ctl_stats_skew(s, job, &hot);
    if (skew == 0)
      continue;
    judged++;
    enum doctor_result r = skew > DOCTOR_SKEW_FAIL   ? DOCTOR_FAIL
                           : skew > DOCTOR_SKEW_WARN ? DOCTOR_WARN
                                                     : DOCTOR_OK;
    doctor_note(k, r, "job %s: rank %u receives %.2f x the mean tokens per rank", job, hot,
                skew);
    if (r != DOCTOR_OK)
      doctor_do(k, "job %s routes too many tokens to rank %u's experts: check the router's "
                   "balance loss, or place experts so that hot ones spread over ranks",
                job, hot);
  }
  if (judged == 0)
    doctor_note(k, DOCTOR_OK, "no job has a layout from every rank to judge yet");
}

/* ---- the command ------------------------------------------------------------------------- */

static const struct ctl_col doctor_fields[] = {
    {"ok", "healthy", CTL_BOOL, 0},
};

static const struct ctl_col check_cols[] = {
    {"check", "CHECK", CTL_STR, 0},
    {"result", "RESULT", CTL_STR, 0},
    {"detail", "FOUND", CTL_STR, 0},
    {"action", "TO DO", CTL_STR, 0},
};
#define CHECK_NCOLS (sizeof check_cols / sizeof check_cols[0])

static int doctor_render(const struct ctl *ctl, const struct doctor_check *k, size_t n) {
  bool failed = false;
  struct ctl_val cells[DOCTOR_NCHECKS * CHECK_NCOLS];
  memset(cells, 0, sizeof cells); /* a cell's none, read by the renderer, is false */
  for (size_t i = 0; i < n; i++) {
    failed |= k[i].result == DOCTOR_FAIL;
    cells[i * CHECK_NCOLS + 0].s = k[i].name;
    cells[i * CHECK_NCOLS + 1].s = doctor_result_name(k[i].result);
    cells[i * CHECK_NCOLS + 2].s = k[i].detail;
    cells[i * CHECK_NCOLS + 3].s = k[i].action;
  }
  if (ctl->json) {
    const struct ctl_val fields[] = {{.u = !failed}};
    const struct ctl_table tables[] = {{"checks", "", check_cols, CHECK_NCOLS, n, cells, 0}};
    const struct ctl_doc doc = {doctor_fields, fields, 1, tables, 1};
    if (ctl_out_render(stdout, &doc, true) != 0)
      return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  } else {
    /* One check per paragraph: its findings are too long for a table row. */
    for (size_t i = 0; i < n; i++) {
      printf("%-12s %-4s  %s\n", k[i].name, doctor_result_name(k[i].result), k[i].detail);
      if (k[i].action[0] != '\0')
        printf("%-12s %-4s  to do: %s\n", "", "", k[i].action);
    }
  }
  return ctl_finish_output(failed ? CTL_EXIT_FAIL : CTL_EXIT_OK);
}

int ctl_doctor(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  struct doctor_check k[DOCTOR_NCHECKS] = {{.name = "connections"},
                                           {.name = "kernels"},
                                           {.name = "allocation"},
                                           {.name = "memory"},
                                           {.name = "balance"}};
  dep_client_t *c = NULL;
  rc = dep_client_new(&c);
  if (rc != 0)
    return ctl_fail(ctl, rc, "%s", dep_strerror(rc));
  errno = 0;
  rc = ctl_dep_connect(ctl, c);
  doctor_socket(ctl, &k[0], rc == 0, dep_errmsg(c));
  struct dep_status *st = NULL;
  struct ctl_stats s = {0};
  if (rc == 0 && (rc = dep_status(c, &st)) == 0 && (rc = ctl_stats_fetch(c, NULL, &s)) == 0) {
    doctor_peers(c, &k[0]);
    doctor_kernels(c, st, &k[1]);
    doctor_pools(st, &s, &k[2]);
    doctor_gpus(c, st, &k[2]);
    doctor_memory(st, &s, &k[3]);
    doctor_balance(&s, &k[4]);
  } else {
    /* Without the daemon the other checks cannot look: each says so. */
    for (int i = 1; i < DOCTOR_NCHECKS; i++) {
      doctor_note(&k[i], DOCTOR_FAIL, "not checked: deepepd did not answer");
      doctor_do(&k[i], "fix the connection first");
    }
  }
  dep_client_free(c);
  int out = doctor_render(ctl, k, DOCTOR_NCHECKS);
  ctl_stats_free(&s);
  dep_status_free(st);
  return out;
}
