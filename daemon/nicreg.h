/*
 * nicreg.h — exchange regions registered with the NIC (DESIGN §7): each
 * local rank's exchange region of a job that spans nodes (lend.h,
 * proto/slab.h: host memory the daemon maps) is registered with the RDMA
 * device (rdmaxp.h, ibv_reg_mr on the daemon's mapping) when the job is
 * first announced to its peers, so that peers' RDMA writes land in its in
 * blocks and slots and ours leave from its out blocks and slots, and is
 * counted in its rank's device pool (nic_bytes, deepepctl peers) until the
 * region is unmade: a region cached for the next job of its uid and shape
 * (pool.h) keeps its registration, so a restarted job pays none.  A region that cannot be registered (no RDMA
 * device, RLIMIT_MEMLOCK) is said once per pool: its window carries rkey
 * 0, which no peer may write with, so its blocks go over TCP.  No GPU
 * memory is registered: no byte between nodes passes through it.
 */
#ifndef DEP_DAEMON_NICREG_H
#define DEP_DAEMON_NICREG_H

#include <stdint.h>

#include "peer_proto.h"
#include "pool.h"

struct ibv_mr;

/* Register region r's mapping (all r->bytes of it): 0 with r->mr set (its
 * bytes counted in its pool's nic_bytes) and r->unregister, which the pool
 * runs when it unmakes r, or DEP_ERR_* with r->mr NULL (said once per
 * pool).  No RDMA device: DEP_ERR_UNSUPPORTED, said by rdmaxp already. */
int nicreg_region(struct pool_region *r);

/* The MEMBERSHIP window (peer_proto.h) of local rank `rank_index`'s exchange
 * region at addr, len bytes, registered as mr (NULL: rkey 0, no address). */
struct dep_peer_window nicreg_window(uint32_t rank_index, const void *addr, uint64_t len,
                                     const struct ibv_mr *mr);

#endif /* DEP_DAEMON_NICREG_H */
