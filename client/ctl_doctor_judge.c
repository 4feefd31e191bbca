/*
 * ctl_doctor_judge.c — doctor's decisions from what it found (ctl_doctor.h).
 * No I/O here: ctl_doctor.c asks the daemon and the driver, these say what
 * the answers mean.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ctl_doctor.h"
#include "deepep.h"

static const char *const doctor_names[] = {"SKIP", "OK", "WARN", "FAIL"};

const char *doctor_result_name(enum doctor_result r) {
  return r <= DOCTOR_FAIL ? doctor_names[r] : "?";
}

static void doctor_add(char *buf, const char *fmt, va_list ap) {
  size_t n = strlen(buf);
  if (n > 0 && n + 2 < DOCTOR_TEXT) {
    memcpy(buf + n, "; ", 3);
    n += 2;
  }
  if (n < DOCTOR_TEXT)
    vsnprintf(buf + n, DOCTOR_TEXT - n, fmt, ap);
}

void doctor_note(struct doctor_check *k, enum doctor_result r, const char *fmt, ...) {
  if (r > k->result)
    k->result = r;
  va_list ap;
  va_start(ap, fmt);
  doctor_add(k->detail, fmt, ap);
  va_end(ap);
}

void doctor_do(struct doctor_check *k, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  doctor_add(k->action, fmt, ap);
  va_end(ap);
}

/* ---- kernels ----------------------------------------------------------------------------- */

bool doctor_kernels_ask(enum kimage_fit fit) {
  return fit != KIMAGE_SASS && fit != KIMAGE_NONE;
}

void doctor_judge_kernels(struct doctor_check *k, const struct doctor_kernels_in *in) {
  const char *gpu = in->gpu;
  if (in->fit == KIMAGE_SASS) {
    doctor_note(k, DOCTOR_OK, "GPU %s (sm_%d): SASS for it in the fatbin", gpu, in->arch);
    return;
  }
  if (in->fit == KIMAGE_NONE) {
    doctor_note(k, DOCTOR_FAIL, "GPU %s (sm_%d): the library's kernels have no code for it (no "
                "SASS of its architecture, no PTX at or below it): its ranks' operations fail",
                gpu, in->arch);
    doctor_do(k, "rebuild with sm_%d in NVCC_GENCODE, or leave the GPU out of devices:", in->arch);
    return;
  }
  /* Only PTX (or a fatbin the parser does not read): the daemon's compile, if it lends one. */
  const bool ptx = in->fit == KIMAGE_PTX_ONLY;
  if (in->lend_rc == DEP_ERR_NOT_FOUND) {
    doctor_note(k, ptx ? DOCTOR_WARN : DOCTOR_OK, "GPU %s: %s%s", gpu, in->lend_why,
                ptx ? "; but this library's fatbin has only PTX for it: each trainer process "
                      "compiles it at its start"
                    : "");
    if (ptx)
      doctor_do(k, "install deepepd and libdeepep-client from one build (the daemon compiles "
                   "its PTX at start and lends it)");
    return;
  }
  if (in->lend_rc != 0 || in->lent == NULL) {
    doctor_note(k, DOCTOR_WARN, "GPU %s: the daemon did not say what it has for it (%s)", gpu,
                in->lend_why);
    doctor_do(k, "see the daemon's log for its kernel check at start");
    return;
  }
  const struct dep_msg_kernels_ok *ok = in->lent;
  if (strcmp(ok->build, in->build) != 0) {
    doctor_note(k, DOCTOR_WARN, "GPU %s: the fatbin has only PTX for it and the daemon lends a "
                "compile of build %.16s, not this library's %.16s: trainers of this build "
                "compile the PTX themselves at each start", gpu, ok->build, in->build);
    doctor_do(k, "install deepepd and libdeepep-client from one build");
    return;
  }
  doctor_note(k, DOCTOR_OK, "GPU %s: the fatbin has only PTX for it (sm_%u); the daemon lends "
              "its cached compile of it (%llu bytes, driver %d) at attach", gpu, ok->arch,
              (unsigned long long)ok->bytes, (int)ok->driver);
}

/* ---- allocation: compute mode and MPS ---------------------------------------------------- */

bool doctor_shared_gpu(const struct dep_msg_clients *m, const uint8_t uuid[16], char *job) {
  for (uint32_t i = 0; i < m->n; i++)
    for (uint32_t j = i + 1; j < m->n; j++) {
      const struct dep_msg_client *a = &m->clients[i], *b = &m->clients[j];
      if (a->job_id[0] != '\0' && strcmp(a->job_id, b->job_id) == 0 && a->pid != b->pid &&
          memcmp(a->device_uuid, b->device_uuid, 16) == 0 &&
          memcmp(a->device_uuid, uuid, 16) == 0) {
        snprintf(job, DEP_JOB_ID_MAX, "%s", a->job_id);
        return true;
      }
    }
  return false;
}

void doctor_judge_mode(struct doctor_check *k, const char *gpu, int mode, bool mps,
                       const char *shared_job) {
  if (mode == DOCTOR_MODE_PROHIBITED) {
    doctor_note(k, DOCTOR_FAIL, "GPU %s is in compute mode prohibited: no process may use it",
                gpu);
    doctor_do(k, "set it to default: nvidia-smi -i %s -c DEFAULT", gpu);
  } else if (mode == DOCTOR_MODE_EXCLUSIVE_PROCESS) {
    /* deepepd keeps a context of its own on each GPU it serves (it makes, scrubs and lends
     * the pool's memory), outside MPS: beside it no rank, nor an MPS server, gets one. */
    doctor_note(k, DOCTOR_FAIL, "GPU %s is in compute mode exclusive-process%s: one process "
                "alone may hold a context on it, and deepepd holds one of its own beside its "
                "ranks'", gpu, mps ? " (under MPS)" : "");
    doctor_do(k, "set it to default: nvidia-smi -i %s -c DEFAULT (MPS serves ranks in default "
                 "mode too)", gpu);
  } else {
    char name[32] = "default";
    if (mode != DOCTOR_MODE_DEFAULT)
      snprintf(name, sizeof name, "%d", mode); /* 1, exclusive-thread, is gone from drivers */
    doctor_note(k, DOCTOR_OK, "GPU %s: compute mode %s, MPS %s", gpu, name,
                mps ? "running" : "not running");
  }
  if (shared_job == NULL)
    return;
  if (mps) {
    doctor_note(k, DOCTOR_OK, "ranks of job %s in several processes share GPU %s through MPS",
                shared_job, gpu);
    return;
  }
  doctor_note(k, DOCTOR_WARN, "ranks of job %s in several processes share GPU %s without MPS: "
              "their kernels time-slice (a flag's round trip between two such processes takes "
              "milliseconds, under MPS about a microsecond)", shared_job, gpu);
  doctor_do(k, "start MPS for that GPU (nvidia-cuda-mps-control -d) before the trainers, or give "
               "each rank a GPU of its own");
}

/* ---- memory -------------------------------------------------------------------------------- */

void doctor_judge_memory(struct doctor_check *k, const struct doctor_memory_in *in) {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const uint64_t need = in->budget > in->made ? in->budget - in->made : 0;
  const uint64_t spare = in->made > in->busy ? in->made - in->busy : 0; /* made, lent to no one */
  if (need <= in->free_b) {
    doctor_note(k, DOCTOR_OK, "GPU %s: %.2f of %.2f GiB free; its pool has made %.2f of its "
                "%.2f GiB budget and the rest fits", in->gpu, (double)in->free_b / gib,
                (double)in->total_b / gib, (double)in->made / gib, (double)in->budget / gib);
    return;
  }
  /* A running largest job has its arena: what matters is whether it could attach again. */
  if (in->largest > 0 && !in->largest_running && in->largest > spare + in->free_b) {
    doctor_note(k, DOCTOR_FAIL, "GPU %s: job %s, the largest seen here, took %.2f GiB, but the "
                "pool holds only %.2f GiB made and unlent and the GPU has %.2f GiB free: a job "
                "that size cannot attach (the pool's %.2f GiB budget is %.2f GiB short)",
                in->gpu, in->largest_job, (double)in->largest / gib, (double)spare / gib,
                (double)in->free_b / gib, (double)in->budget / gib,
                (double)(need - in->free_b) / gib);
  } else {
    doctor_note(k, DOCTOR_WARN, "GPU %s: its pool may still make %.2f GiB of its %.2f GiB "
                "budget, but the GPU has only %.2f GiB free%s", in->gpu, (double)need / gib,
                (double)in->budget / gib, (double)in->free_b / gib,
                in->largest == 0        ? ""
                : in->largest_running   ? " (the largest job seen here runs now, its arena made)"
                                        : " (the largest job seen here still fits)");
  }
  doctor_do(k, "start deepepd before the trainers with preallocation: true (its pool is made "
               "at start), or lower pool.size_per_device to what the GPU can give");
}

/* ---- connections: TCP's restart after idle ---------------------------------------------- */

void doctor_judge_tcp_idle(struct doctor_check *k, int ssai, uint32_t tcp_peers) {
  if (tcp_peers == 0)
    return; /* RDMA's writes, or no peers: no window to restart */
  if (ssai < 0) {
    doctor_note(k, DOCTOR_OK, "%s unreadable here: its setting for the %u TCP peer(s) not judged",
                DOCTOR_SSAI_PATH, tcp_peers);
    return;
  }
  if (ssai == 0) {
    doctor_note(k, DOCTOR_OK, "net.ipv4.tcp_slow_start_after_idle 0: the data connections to "
                "the %u TCP peer(s) keep their window across a pause", tcp_peers);
    return;
  }
  doctor_note(k, DOCTOR_WARN, "net.ipv4.tcp_slow_start_after_idle %d with %u peer(s) over TCP: "
              "a data connection idle past its retransmission timeout (a trainer's model build, "
              "a pause between steps) restarts from its initial window, and the first call "
              "after it pays round trips for it", ssai, tcp_peers);
  doctor_do(k, "sysctl -w net.ipv4.tcp_slow_start_after_idle=0 on every node, and keep it in "
               "/etc/sysctl.d/ (docs/between-nodes.md)");
}
