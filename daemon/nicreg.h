/*
 * nicreg.h — arenas registered with the NIC (DESIGN §7): the pieces of a
 * pool block registered with the RDMA device (rdmaxp.h) the first time a
 * multi-node job is lent the block, and kept with it across jobs until the
 * block is unmade, so that a job restart pays no registration.  Host
 * pieces by the daemon's own mapping (ibv_reg_mr); GPU pieces as dma-buf
 * (the backend's chunk_dmabuf, then ibv_reg_dmabuf_mr).  A piece that
 * cannot be registered (no RDMA device, a GPU or driver without dma-buf,
 * RLIMIT_MEMLOCK) is left unregistered and said once: its windows carry
 * rkey 0, which no peer may write with.
 */
#ifndef DEP_DAEMON_NICREG_H
#define DEP_DAEMON_NICREG_H

#include <stdint.h>

#include "peer_proto.h"
#include "pool.h"

/* Register blk's pieces unless that was tried already (cheap then). */
void nicreg_block(struct pool_block *blk);
/* Drop blk's registrations (before its pieces go). */
void nicreg_release(struct pool_block *blk);

/*
 * The windows (peer_proto.h) for bytes [off, off + len) of blk, which is
 * local rank `rank_index`'s slab: one per piece it spans, appended to
 * out[*n..max).  Returns 0, or DEP_ERR_LIMIT when max is reached.
 */
int nicreg_windows(const struct pool_block *blk, uint32_t rank_index, uint64_t off, uint64_t len,
                   struct dep_peer_window *out, uint32_t *n, uint32_t max);

#endif /* DEP_DAEMON_NICREG_H */
