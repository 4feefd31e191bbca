/*
 * ctl_reload.c — `deepepctl reload`: ask the daemon to re-read its
 * configuration, as SIGHUP does, and print what it applied and what needs
 * a restart: in text the daemon's message, in JSON that message and the
 * keys of each kind by name.  Only root and deepepd's own user may.
 */
#include <stdlib.h>

#include "client_internal.h"
#include "ctl.h"

/* One list of key names as a one-column table, JSON alone: the message says it in words. */
static void ctl_reload_list(struct ctl_table *t, const char *key, const struct ctl_col *col,
                            struct ctl_val *cells, uint32_t n,
                            const char (*names)[DEP_RELOAD_KEY_MAX]) {
  for (uint32_t i = 0; i < n; i++)
    cells[i] = (struct ctl_val){.s = names[i]};
  *t = (struct ctl_table){key, "", col, 1, n, cells, CTL_TABLE_LIST | CTL_TABLE_NOTEXT};
}

int ctl_reload(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  dep_client_t *c = ctl_connect(ctl);
  if (c == NULL)
    return CTL_EXIT_FAIL;
  struct dep_msg_reload_ok *m = malloc(sizeof *m);
  rc = m != NULL ? ctl_ask(c, DEP_MSG_RELOAD, NULL, DEP_MSG_RELOAD_OK, ctl_decode_reload_ok, m)
                 : client_seterr(c, DEP_ERR_NO_MEMORY, "out of memory reading RELOAD_OK");
  if (rc != 0) {
    free(m);
    return ctl_fail_client(ctl, c, rc, "reload");
  }
  dep_client_free(c);
  static const struct ctl_col fields[] = {{"message", "reload", CTL_STR, 0}};
  static const struct ctl_col key_col = {"key", "KEY", CTL_STR, 0};
  const struct ctl_val vals[] = {{.s = m->message}};
  struct ctl_val applied[DEP_RELOAD_KEYS_MAX + 1], restart[DEP_RELOAD_KEYS_MAX + 1];
  struct ctl_table tables[2];
  ctl_reload_list(&tables[0], "applied", &key_col, applied, m->n_applied, m->applied);
  ctl_reload_list(&tables[1], "restart", &key_col, restart, m->n_restart, m->restart);
  const struct ctl_doc doc = {fields, vals, 1, tables, 2};
  ctl_out_render(stdout, &doc, ctl->json);
  free(m);
  return ctl_finish_output(CTL_EXIT_OK);
}
