/*
 * ctl_clients.c — `deepepctl clients`: every connection the caller may see
 * (root and deepepd's user see all; others their own), with its process,
 * user, name, and for a rank its job, rank, device and since when its job
 * ran, as a table or --json.
 */
#include <stdio.h>
#include <stdlib.h>

#include "client_internal.h"
#include "ctl.h"
#include "uuid.h"

static const struct ctl_col clients_fields[] = {
    {"left_out", "not listed (over the limit)", CTL_UINT, 0},
};

/* The JSON keys are an interface: deepepctl(1) lists them; never rename. */
static const struct ctl_col client_cols[] = {
    {"pid", "PID", CTL_UINT, 0},
    {"uid", "UID", CTL_UINT, 0},
    {"name", "NAME", CTL_STR, 0},
    {"job", "JOB", CTL_STR, 0},
    {"rank", "RANK", CTL_UINT, 0},
    {"local_rank", "LOCAL", CTL_UINT, 0},
    {"device", "DEVICE", CTL_STR, 0},
    {"connected_ms", "CONNECTED", CTL_MS, 0},
    {"attached_ms", "ATTACHED", CTL_MS, 0},
    {"attached", "RUNNING", CTL_STR, 0},
};
#define CLIENT_NCOLS (sizeof client_cols / sizeof client_cols[0])

int ctl_clients(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  dep_client_t *c = ctl_connect(ctl);
  if (c == NULL)
    return CTL_EXIT_FAIL;
  struct dep_msg_clients m = {0};
  rc = ctl_ask(c, DEP_MSG_CLIENTS, NULL, DEP_MSG_CLIENTS_OK, ctl_decode_clients, &m);
  if (rc != 0)
    return ctl_fail_client(ctl, c, rc, "clients");
  dep_client_free(c);
  struct ctl_val *cells = calloc((size_t)m.n * CLIENT_NCOLS + 1, sizeof *cells);
  char(*uuid)[DEP_UUID_STR_LEN] = calloc((size_t)m.n + 1, sizeof *uuid);
  int out = -1;
  if (cells != NULL && uuid != NULL) {
    for (uint32_t i = 0; i < m.n; i++) {
      const struct dep_msg_client *x = &m.clients[i];
      struct ctl_val *row = cells + (size_t)i * CLIENT_NCOLS;
      bool rank = x->job_id[0] != '\0';
      if (rank)
        dep__uuid_str(x->device_uuid, uuid[i]);
      row[0].u = x->pid;
      row[1].u = x->uid;
      row[2].s = x->name;
      /* A connection that is no rank (deepepctl) has no job, rank, local rank, device or
       * attach time: "-" in text and null in JSON, not rank 0. */
      row[3] = (struct ctl_val){.s = x->job_id, .none = !rank};
      row[4] = (struct ctl_val){.u = x->rank, .none = !rank};
      row[5] = (struct ctl_val){.u = x->local_rank, .none = !rank};
      row[6] = (struct ctl_val){.s = uuid[i], .none = !rank};
      row[7].u = x->connected_ms;
      row[8] = (struct ctl_val){.u = x->attached_ms, .none = !rank || !x->attached};
      row[9] = (struct ctl_val){.s = x->attached ? "yes" : "waiting", .none = !rank};
    }
    const struct ctl_val fields[] = {{.u = m.left_out}};
    const struct ctl_table tables[] = {
        {"clients", "no clients", client_cols, CLIENT_NCOLS, m.n, cells, 0},
    };
    const struct ctl_doc doc = {clients_fields, fields, m.left_out > 0 || ctl->json, tables, 1};
    out = ctl_out_render(stdout, &doc, ctl->json);
  }
  free(cells);
  free(uuid);
  proto_clients_free(&m);
  if (out != 0)
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  return ctl_finish_output(CTL_EXIT_OK);
}
