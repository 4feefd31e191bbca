/*
 * nicreg.c — registering pool blocks with the NIC (nicreg.h).
 */
#include "nicreg.h"

#include <stdbool.h>
#include <stdio.h>
#include <unistd.h>
#include <uv.h>

#include "config_value.h"
#include "log.h"
#include "rdmaxp.h"

/* One piece: 0, or DEP_ERR_* with why. */
static int reg_piece(struct pool_block *blk, uint32_t i, char *why, size_t whylen) {
  struct pool *p = blk->pool;
  struct chunk_mem *m = &blk->piece[i];
  if (p->ops->chunk_dmabuf == NULL) {
    blk->nic_addr[i] = (uintptr_t)m->host_ptr;
    return rdmaxp_reg_host(m->host_ptr, m->bytes, &blk->mr[i], why, whylen);
  }
  int fd = -1;
  uint64_t iova = 0;
  int rc = p->ops->chunk_dmabuf(&p->dev, m, &fd, &iova, why, whylen);
  if (rc != 0)
    return rc;
  blk->nic_addr[i] = iova;
  rc = rdmaxp_reg_dmabuf(fd, 0, m->bytes, iova, &blk->mr[i], why, whylen);
  close(fd); /* the registration keeps its own reference */
  return rc;
}

void nicreg_block(struct pool_block *blk) {
  if (blk->nic_done || !rdmaxp_active())
    return;
  blk->nic_done = true;
  struct pool *p = blk->pool;
  uint64_t t0 = uv_hrtime();
  for (uint32_t i = 0; i < blk->n_pieces; i++) {
    char why[256] = "";
    int rc = reg_piece(blk, i, why, sizeof why);
    if (rc != 0) {
      blk->mr[i] = NULL;
      /* Once per pool: every block of it would fail alike. */
      if (!p->nic_warned)
        log_warnx("rdma: device %s (%s): its memory cannot be registered with %s: %s; peers "
                  "cannot write into it over RDMA", p->dev.uuid_str, p->dev.name, rdmaxp_device(),
                  why);
      p->nic_warned = true;
      continue;
    }
    p->nic_bytes += blk->piece[i].bytes;
  }
  char a[32];
  log_info("rdma: registered a block of %s on device %s with %s in %llu us",
            config_value_size_text(blk->n_pieces * blk->piece_bytes, a, sizeof a),
            p->dev.uuid_str, rdmaxp_device(),
            (unsigned long long)((uv_hrtime() - t0) / 1000u));
}

void nicreg_release(struct pool_block *blk) {
  for (uint32_t i = 0; i < blk->n_pieces; i++) {
    if (blk->mr[i] == NULL)
      continue;
    rdmaxp_dereg(blk->mr[i]);
    blk->mr[i] = NULL;
    blk->pool->nic_bytes -= blk->piece[i].bytes;
  }
  blk->nic_done = false;
}

int nicreg_windows(const struct pool_block *blk, uint32_t rank_index, uint64_t off, uint64_t len,
                   struct dep_peer_window *out, uint32_t *n, uint32_t max) {
  const uint64_t pb = blk->piece_bytes;
  for (uint64_t at = off; at < off + len;) {
    uint32_t i = (uint32_t)(at / pb);
    uint64_t in = at - (uint64_t)i * pb;
    uint64_t take = pb - in < off + len - at ? pb - in : off + len - at;
    if (*n == max)
      return DEP_ERR_LIMIT;
    out[(*n)++] = (struct dep_peer_window){
        .rank_index = rank_index,
        .slab_off = at - off,
        .len = take,
        .addr = blk->mr[i] != NULL ? blk->nic_addr[i] + in : 0,
        .rkey = rdmaxp_mr_rkey(blk->mr[i]),
    };
    at += take;
  }
  return 0;
}
