/*
 * xnbytes.c — one crossing per destination node, predicted and counted
 * (xnbytes.h).
 */
#include "xnbytes.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemonwire.h"
#include "testutil.h"

void xn_cross_rows(const struct ow_case *d, const struct xn_place *p, int nodes, uint64_t *rows,
                   uint64_t *per_rank) {
  const uint32_t W = d->sc.world, K = d->sc.topk;
  for (int n = 0; n < nodes; n++)
    rows[n] = per_rank[n] = 0;
  for (uint32_t g = 0; g < W; g++) {
    for (uint32_t t = 0; t < d->in[g].num_tokens; t++) {
      bool node_hit[NODES_MAX] = {false}, rank_hit[OW_MAXW] = {false};
      for (uint32_t j = 0; j < K; j++) {
        const size_t i = (size_t)t * K + j;
        const int64_t e = d->sc.itype == DEP_INDEX_I64 ? ((const int64_t *)d->idx[g])[i]
                                                       : ((const int32_t *)d->idx[g])[i];
        const uint32_t r = e >= 0 ? (uint32_t)e / d->le : 0;
        if (e < 0 || p->node[r] == p->node[g])
          continue;
        node_hit[p->node[r]] = true;
        rank_hit[r] = true;
      }
      for (int n = 0; n < nodes; n++)
        rows[p->node[g]] += node_hit[n];
      for (uint32_t r = 0; r < W; r++)
        per_rank[p->node[g]] += rank_hit[r];
    }
  }
}

uint64_t xn_payload_out(const struct nodes *ns, int i, const char *job, char *why, size_t len) {
  static char out[65536];
  char cmd[700], key[96];
  dw_sfmt(cmd, sizeof cmd, "%s -s %s status --json", tu_bin("deepepctl"), ns->d[i].sock);
  FILE *f = popen(cmd, "r");
  size_t got = f != NULL ? fread(out, 1, sizeof out - 1, f) : 0;
  out[got] = '\0';
  if (f == NULL || pclose(f) != 0) {
    snprintf(why, len, "node %d: %s failed", i, cmd);
    return UINT64_MAX;
  }
  snprintf(key, sizeof key, "\"job_id\":\"%s\"", job);
  const char *j = strstr(out, key), *v = j != NULL ? strstr(j, "\"payload_out\":") : NULL;
  if (v == NULL) {
    snprintf(why, len, "node %d: no payload_out for job %s in %.300s", i, job, out);
    return UINT64_MAX;
  }
  return strtoull(v + strlen("\"payload_out\":"), NULL, 10);
}
