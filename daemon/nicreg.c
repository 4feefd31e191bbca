/*
 * nicreg.c — registering exchange regions with the NIC (nicreg.h).
 */
#include "nicreg.h"

#include <stdio.h>
#include <uv.h>

#include "config_value.h"
#include "log.h"
#include "rdmaxp.h"

/* The pool is unmaking r (pool_region.unregister). */
static void nicreg_region_release(struct pool_region *r) {
  rdmaxp_dereg(r->mr);
  r->pool->nic_bytes -= r->bytes;
  r->mr = NULL;
  r->unregister = NULL;
}

int nicreg_region(struct pool_region *r) {
  struct pool *p = r->pool;
  r->mr = NULL;
  if (!rdmaxp_active())
    return DEP_ERR_UNSUPPORTED;
  char why[256] = "";
  const uint64_t t0 = uv_hrtime();
  int rc = rdmaxp_reg_host(r->map, r->bytes, &r->mr, why, sizeof why);
  if (rc != 0) {
    r->mr = NULL;
    /* Once per pool: every region of its ranks would fail alike. */
    if (!p->nic_warned)
      log_warnx("rdma: the exchange regions of device %s's ranks cannot be registered with %s: "
                "%s; peers send their blocks over TCP", p->dev.uuid_str, rdmaxp_device(), why);
    p->nic_warned = true;
    return rc;
  }
  p->nic_bytes += r->bytes;
  r->unregister = nicreg_region_release;
  char a[32];
  log_debug("rdma: registered an exchange region of %s for device %s with %s in %llu us",
            config_value_size_text(r->bytes, a, sizeof a), p->dev.uuid_str, rdmaxp_device(),
            (unsigned long long)((uv_hrtime() - t0) / 1000u));
  return 0;
}

struct dep_peer_window nicreg_window(uint32_t rank_index, const void *addr, uint64_t len,
                                     const struct ibv_mr *mr) {
  return (struct dep_peer_window){
      .rank_index = rank_index,
      .slab_off = 0,
      .len = len,
      .addr = mr != NULL ? (uint64_t)(uintptr_t)addr : 0,
      .rkey = rdmaxp_mr_rkey(mr),
  };
}
