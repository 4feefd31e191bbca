/*
 * pool.h — one device's memory pool: a byte budget, and the blocks made
 * within it and lent to jobs (DESIGN §4).
 *
 * A block is n equal backend allocations ("pieces", one fd each), every
 * size a multiple of the device's allocation granularity; clients map the
 * pieces one after another into one range.  A job's arena on a device is
 * exactly one block of the arena's size (rounded up to whole pieces),
 * because a client pays for what it maps: the driver will not map part of
 * an allocation, so a block larger than the job would be paid for at every
 * attach.  One piece where that is cheapest; several, each at most the
 * caller's cap, where peer GPUs map the arena: the driver maps a peer's
 * allocation of 512 MiB or more several times slower (BENCHMARKS.md,
 * vmm_map -g), while every extra piece costs each rank one more import.
 *
 * Life of a block: made (at start in blocks of pool.chunk_size with
 * preallocation, the reserve; else when a job of that size first needs it)
 * → lent to one job → scrubbed when its job ends → cached for the next job
 * of the same uid and shape, or free.  A free or cached block is unmade
 * when a job of another size needs the room.  The sum of made blocks never
 * exceeds the budget, so the pool never holds more device memory than
 * pool.size_per_device (pool.host_size) says.
 *
 * Holders: a process keeps what it was lent until it exits (an fd cannot
 * be revoked, DESIGN §4), so every block remembers the processes it was
 * lent to (proc.h) while they live.  A block with live holders is *held*:
 * it is lent again only to its own uid, and when it is unmade its bytes
 * stay charged, as a *ghost*, until the last holder exits — so memory a
 * client kept after detach still counts against the budget and against
 * its uid's limits.memory_per_uid.  A stopped daemon writes what is lent
 * or held to a file (held.h) and the next one starts with those ghosts.
 *
 * Regions: a rank of a job that spans nodes also gets its ring and
 * exchange region (lend.h), one sealed memfd of host memory whatever the
 * backend, which the daemon maps and may have registered with the NIC.
 * A region lives as a block does, and is charged as one: made within the
 * budget (on cuda too: the budget is what the daemon spends for the
 * device's ranks), lent to one rank, then cached, mapping and NIC
 * registration kept, for the next job of the same uid and key (shape,
 * world and local ranks: the layout), or unmade; a cached one is evicted,
 * oldest first beside cached blocks, when the budget needs the room; a
 * region another uid used is never lent (it is unmade, and its uid gets a
 * fresh one); held ones stay charged to their uid, as ghosts once unmade.
 * What a new job must not see (ring, slots) the lender resets; the blocks
 * keep the same uid's bytes, read only after a slot's flag says a call's
 * block is in.
 */
#ifndef DEP_POOL_H
#define DEP_POOL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "backend.h"
#include "proc.h"

struct ibv_mr;

enum pool_block_state { POOL_BLOCK_FREE = 0, POOL_BLOCK_LENT, POOL_BLOCK_CACHED };

/* The most pieces one block is made of (a larger block gets larger pieces). */
#define POOL_MAX_PIECES 64
/* Processes one block or ghost remembers: two jobs' worth of local ranks.
 * A block is lent again only while one more job's ranks fit beside the
 * holders still alive. */
#define POOL_MAX_HOLDERS (2 * DEP_MAX_LOCAL_RANKS)


/* One made block; what job.c holds per arena while it is lent. */
struct pool_block {
  struct pool *pool;
  struct chunk_mem piece[POOL_MAX_PIECES]; /* n_pieces of piece_bytes, in mapping order */
  uint32_t n_pieces;           /* the block's size is n_pieces * piece_bytes */
  uint64_t piece_bytes;
  enum pool_block_state state;
  bool has_owner;              /* it has served a job (a preallocated block has not yet) */
  uid_t last_uid;              /* owner of the job it serves or last served */
  uint64_t shape_key;          /* that job's shape: what a cached block matches on */
  uint64_t cached_seq;         /* CACHED: when, so that the oldest is evicted first */
  struct proc_id holders[POOL_MAX_HOLDERS]; /* processes it was lent to that may still live */
  uint32_t n_holders;
  struct pool_block *next;     /* the pool's list of made blocks */
};

/* A rank's ring and exchange region (lend.h), made and charged by its rank's pool. */
struct pool_region {
  struct pool *pool;
  int fd;                      /* the sealed memfd */
  void *map;                   /* the daemon's mapping of all of it */
  uint64_t bytes;
  struct ibv_mr *mr;           /* the mapping registered with the NIC, or NULL (nicreg.h) */
  /* Set by the layer that registered the mapping elsewhere (nicreg.c):
   * undoes that, and runs before the pool unmaps the region.  The pool
   * knows no NIC; NULL: nothing to undo. */
  void (*unregister)(struct pool_region *r);
  enum pool_block_state state; /* LENT or CACHED */
  bool warm;                   /* LENT: it was cached (mapping and registration kept) */
  uid_t uid;                   /* of the job it serves or last served */
  uint64_t key;                /* that job's: what a cached region matches on */
  uint64_t cached_seq;         /* CACHED: when (shares the blocks' sequence) */
  uint64_t file_dev, file_ino; /* the memfd, by which /proc shows who holds it */
  struct proc_id holders[POOL_MAX_HOLDERS];
  uint32_t n_holders;
  struct pool_region *next;    /* the pool's list of made regions */
};

/* Memory the pool no longer has but a process of uid may still hold. */
struct pool_ghost {
  struct pool_ghost *next;
  uid_t uid;
  uint64_t bytes;
  uint64_t file_dev;           /* the pieces' files, where /proc can show who holds them */
  uint64_t file_ino[POOL_MAX_PIECES];
  uint32_t n_files;            /* 0: holders are taken to hold it until they exit */
  struct proc_id holders[POOL_MAX_HOLDERS];
  uint32_t n_holders;
};

struct pool {
  struct backend_dev dev;
  const struct backend_ops *ops;  /* NULL: not initialised (or finished) */
  uint64_t budget_bytes;       /* pool.size_per_device or pool.host_size */
  uint64_t reserve_bytes;      /* pool.chunk_size: the size blocks are preallocated in */
  bool prealloc;               /* the reserve was made at start (preallocation) */
  struct pool_block *blocks;   /* every made block, in no particular order */
  uint32_t n_blocks;
  struct pool_region *regions; /* every made region */
  uint64_t made_bytes;         /* sum of the made blocks' and regions' sizes, <= budget_bytes */
  uint64_t used_bytes;         /* of them, lent to live jobs */
  uint64_t cached_bytes;       /* of them, cached for the next job of their shape */
  uint64_t region_bytes;       /* of made_bytes, the regions' */
  uint64_t cache_seq;          /* the last cached_seq handed out */
  struct pool_ghost *ghosts;   /* charged beside the made blocks: made + ghost <= budget */
  uint64_t ghost_bytes;
  uint64_t nic_bytes;          /* its ranks' exchange regions registered with the NIC (nicreg.h) */
  bool nic_warned;             /* a registration failed, said once */
};

/*
 * Before the pools are made: memory that processes of uid still hold on the
 * device `uuid` (from a stopped daemon's held file), charged by the pool_init
 * of that device from the start.  Processes no longer alive are skipped.
 */
void pool_preload_ghost(const uint8_t uuid[16], uid_t uid, uint64_t bytes,
                        const struct proc_id *holders, uint32_t n_holders);

/*
 * Set up a pool with a budget of budget_bytes on dev; with prealloc, make
 * floor((budget - preloaded ghosts) / reserve_bytes) blocks of reserve_bytes now.  reserve_bytes
 * must be a multiple of the device's granularity.  Returns 0 or DEP_ERR_*
 * with why; on failure the pool holds nothing and dev is released.
 */
int pool_init(struct pool *p, const struct backend_ops *ops, const struct backend_dev *dev,
              uint64_t budget_bytes, uint64_t reserve_bytes, bool prealloc, char *why,
              size_t whylen);
/*
 * Make any pool_init still making its reserve, on any thread, give up before
 * its next block (DEP_ERR_STATE): the daemon is stopping, and a large
 * reserve takes seconds to make that a stop should not wait for.
 */
void pool_stop_making(void);
/* Unmake every block (none may still be lent) and release the device.
 * Ghosts are forgotten: the held file (held.h) has them. */
void pool_fini(struct pool *p);

/* Forget the holders that have exited, and the ghosts none of whose holders
 * lives (logged).  Cheap: blocks and ghosts are few. */
void pool_reap(struct pool *p);

/*
 * The daemon's own start-up warm-up (warmup.h) is over and its process
 * gone: the blocks of its jobs (uid, shape_key), free or cached, are made
 * as if never lent, so that the pool starts as it would have without it —
 * one of the reserve's size goes back to the reserve, unowned; any other is
 * unmade and the reserve made whole again.  A block a live process still
 * holds is left as it is.
 */
void pool_forget(struct pool *p, uid_t uid, uint64_t shape_key);

/* Memory no live job holds that processes may still hold: held blocks and regions, ghosts. */
uint64_t pool_held_bytes(const struct pool *p);
/* What uid is charged on this pool: blocks and regions lent to its jobs or held by its
 * processes, ghosts. */
uint64_t pool_uid_bytes(const struct pool *p, uid_t uid);

/*
 * The block pool_block_get makes for `bytes` with pieces of at most
 * max_piece (0: one piece): n equal pieces, each a multiple of the
 * granularity (larger than max_piece only past POOL_MAX_PIECES).  Returns
 * the block's size, n * piece.
 */
uint64_t pool_block_layout(const struct pool *p, uint64_t bytes, uint64_t max_piece,
                           uint32_t *n, uint64_t *piece);

/*
 * Lend one block of `bytes` (laid out as pool_block_layout says) to a job
 * of `uid` and shape_key: a cached block of the same uid, shape and layout
 * first, then a free block of that layout not last used by another uid,
 * else a new block, releasing free then cached blocks to make room.
 * DEP_ERR_NO_MEMORY (with why) when the budget cannot hold it beside the
 * blocks lent to live jobs and what is held, or when uid's charge would pass
 * uid_quota (limits.memory_per_uid; 0: none).
 */
int pool_block_get(struct pool *p, uint64_t bytes, uint64_t max_piece, uid_t uid,
                   uint64_t shape_key, uint64_t uid_quota, struct pool_block **out, char *why,
                   size_t whylen);

/* The block's fds are being sent to process p (pid 0: gone already, nothing
 * to hold): it may hold them until it exits. */
void pool_block_hold(struct pool_block *b, const struct proc_id *p);

/* Return a lent block: scrub it (unmake it when that fails), then cache it or free it. */
void pool_block_put(struct pool_block *b, bool cache);

/* The daemon is stopping: give a lent block's memory back without scrubbing
 * it (live ranks may still compute on it; it goes with the last of them). */
void pool_block_abandon(struct pool_block *b);

/* One copy of a batch (pool_batch): len bytes at off of block b, from buf or, read, into it. */
struct pool_io {
  struct pool_block *b;
  uint64_t off;
  void *buf;                   /* a write's bytes (NULL: zeros), or where a read's go */
  size_t len;
  bool read;
};

/*
 * Copy between the daemon and lent blocks (across their pieces), in list
 * order: a write puts io[i].buf's len bytes (zeros where buf is NULL) at
 * off of io[i].b, landing in list order for any reader on the block's
 * device, all visible once this returns; a read puts the bytes at off into
 * buf, after the writes listed before it on that device have landed.  The
 * blocks may be on several devices: each device's copies are one backend
 * batch (one wait for the GPU on cuda, backend.h chunk_batch), device after
 * device; a batch larger than the backend's staging goes in pieces, in
 * order.  0, or DEP_ERR_* with why: DEP_ERR_INVALID (nothing copied) when a
 * copy passes the end of its block or a read has no buf, else the
 * backend's (copies before the failed one may have landed).  Safe from any
 * thread while the blocks are lent (lend.c writes the abort words with it).
 */
int pool_batch(const struct pool_io *io, size_t n, char *why, size_t whylen);
/* pool_batch of one read: len bytes at off of the block into dst. */
int pool_block_read(struct pool_block *b, uint64_t off, void *dst, size_t len, char *why,
                    size_t whylen);

/* The block's size, and how it is made: pieces of piece bytes each. */
uint64_t pool_block_bytes(const struct pool_block *b);
uint32_t pool_block_pieces(const struct pool_block *b);
uint64_t pool_block_piece_bytes(const struct pool_block *b);
/* Piece i's exported fd (owned by the pool: do not close). */
int pool_block_fd(const struct pool_block *b, uint32_t i);

/*
 * Lend a ring and exchange region of `bytes` to a rank of a job of `uid`
 * and key: a cached one of the same uid, key and size first (r->warm: its
 * contents and NIC registration are the last job's), else a new zeroed
 * sealed memfd, mapped, making room as pool_block_get does.  Refused as
 * pool_block_get refuses (DEP_ERR_NO_MEMORY, DEP_ERR_LIMIT past
 * uid_quota), with why.
 */
int pool_region_get(struct pool *p, uint64_t bytes, uid_t uid, uint64_t key, uint64_t uid_quota,
                    struct pool_region **out, char *why, size_t whylen);

/* The region's fd is being sent to process p: it may map it until it exits. */
void pool_region_hold(struct pool_region *r, const struct proc_id *p);

/* Return a lent region (its job's proxy no longer touches it): cached for
 * the next job of its uid and key, or unmade when !cache. */
void pool_region_put(struct pool_region *r, bool cache);

/* The pool's budget: what STATUS reports as its total. */
uint64_t pool_total_bytes(const struct pool *p);

#endif /* DEP_POOL_H */
