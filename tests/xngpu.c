/*
 * xngpu.c — rank processes of one job on the cuda backend, placed over
 * daemons that share this machine's GPU (the xnode suites' gpu cases).
 */
#include "xngpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemonwire.h"
#include "sm_budget.h"
#include "testutil.h"
#include "xnjob.h"

/*
 * Run fn in rank processes of job on the GPU, world ranks placed over ns's
 * daemons in blocks of split (xn_place): how many failed, their messages in
 * fails.  When any did, each daemon's log tail and peers are shown (for a
 * failure on a machine one cannot log into).  Every rank runs the library's
 * own SM budget for a job across nodes (sm_budget.h dep__xnode_budget: at
 * most two CTAs a rank of the world, so 16 at a world of 8), which keeps
 * every rank's CTAs resident at once (cuda_ops.h) though each daemon shares
 * the GPU out among the ranks it holds only, not knowing those of the others
 * here (one daemon per node is the design).  Before that cap, three ranks
 * alone on three daemons took 96 CTAs each, more than an H200 holds under
 * MPS, and the last one's grid barrier waited for CTAs that never started.
 */
int xg_run(const struct nodes *ns, const uint32_t *split, const char *job,
           const struct ow_case *d, cr_rank_body fn, void *arg, bool wait_all, char *fails,
           size_t len) {
  return xg_run_ctas(ns, split, job, d, fn, arg, wait_all, "", fails, len);
}

int xg_run_ctas(const struct nodes *ns, const uint32_t *split, const char *job,
                const struct ow_case *d, cr_rank_body fn, void *arg, bool wait_all,
                const char *ctas, char *fails, size_t len) {
  struct xn_place spread;
  memset(&spread, 0, sizeof spread);
  xn_place(&spread, split, ns->n);
  struct cr_place p = {.wait_all = wait_all};
  for (uint32_t g = 0; g < d->sc.world; g++) {
    p.sock[g] = ns->d[spread.node[g]].sock;
    p.local[g] = spread.local[g];
    p.lws[g] = spread.lws[g];
  }
  setenv(CUOPS_CTAS_ENV, ctas, 1);
  struct cr_world w;
  cr_world_msgs(&w);
  int nfail = cr_run_procs_placed(&w, &p, job, &d->shape, d->sc.world, fn, arg, fails, len);
  cr_world_msgs_free(&w);
  for (int i = 0; nfail > 0 && i < ns->n; i++) {
    char cmd[700];
    printf("--- node %d: deepepd's log (last 60 lines), then deepepctl peers\n", i);
    fflush(stdout);
    dw_sfmt(cmd, sizeof cmd, "tail -n 60 %s; %s -s %s peers", ns->d[i].log, tu_bin("deepepctl"),
            ns->d[i].sock);
    if (system(cmd) != 0)
      printf("(deepepctl peers failed)\n");
  }
  return nfail;
}

