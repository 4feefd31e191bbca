/*
 * ctl_reload.c — `deepepctl reload`: ask the daemon to re-read its
 * configuration, as SIGHUP does, and print what it applied and what needs
 * a restart.  Only root and deepepd's own user may.
 */
#include "client_internal.h"
#include "ctl.h"

int ctl_reload(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  dep_client_t *c = ctl_connect(ctl);
  if (c == NULL)
    return CTL_EXIT_FAIL;
  struct client_frame f;
  rc = client_request(c, DEP_MSG_RELOAD, NULL, DEP_MSG_RELOAD_OK, CLIENT_REQUEST_TIMEOUT_MS, &f);
  struct dep_msg_text m;
  if (rc == 0) {
    if (proto_decode_text(f.body, f.hdr.body_len, &m) != 0)
      rc = client_seterr(c, DEP_ERR_PROTOCOL, "deepepd sent a malformed RELOAD_OK");
    client_frame_release(&f);
  }
  if (rc != 0)
    return ctl_fail_client(ctl, c, rc, "reload");
  dep_client_free(c);
  static const struct ctl_col cols[] = {{"result", "reload", CTL_STR, 0}};
  const struct ctl_val vals[] = {{.s = m.text}};
  const struct ctl_doc doc = {cols, vals, 1, NULL, 0};
  ctl_out_render(stdout, &doc, ctl->json);
  return ctl_finish_output(CTL_EXIT_OK);
}
