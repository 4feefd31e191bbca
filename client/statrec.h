/*
 * statrec.h — the library's side of the per-rank stats page (DESIGN §10,
 * proto/stats_page.h): asked for at the end of dep_attach (STATS_LEND),
 * mapped, and written by the operations with plain stores and the vDSO
 * clock, never a system call.  On cuda the kernels write the communicating
 * calls themselves (cuda_attach.c binds the page for them); the library
 * writes the rest: refused calls and the attach times.
 *
 * A daemon without STATS_LEND (older) or one that cannot make the page
 * leaves the rank without stats; the operations run the same.
 * $DEEPEP_STATS=0 turns the page off for this process (to measure what
 * writing it costs: bench/ep -P).
 */
#ifndef DEP_CLIENT_STATREC_H
#define DEP_CLIENT_STATREC_H

#include <stdbool.h>
#include <stdint.h>

#include "deepep.h"
#include "stats_page.h"

#define STATREC_ENV "DEEPEP_STATS"

struct statrec {
  struct dep_stats_page *page; /* NULL: no stats for this attachment */
  size_t bytes;                /* the page's: dep_stats_page_bytes(world) */
  uint32_t world;              /* the job's, which sizes the page's layout entries */
  uint64_t layouts;            /* layouts written */
};

/* The clock the host backend times calls with (CLOCK_MONOTONIC, vDSO), in ns. */
uint64_t statrec_now_ns(void);

/* After a successful attach: ask the daemon for the page and map it.
 * Never fails the attach: without a page the rank has no stats. */
void statrec_lend(dep_client_t *c);
/* Write the attach times (dep_attach_times) and mark the page attached. */
void statrec_attached(dep_client_t *c);
/* Unmap (client_unmap). */
void statrec_unmap(dep_client_t *c);

/* One communicating call that ran as call `seq` (host backend). */
static inline void statrec_call(struct statrec *s, unsigned op, uint64_t seq, uint64_t ns,
                                int status, uint64_t bytes) {
  if (s->page == NULL || seq == 0)
    return;
  struct dep_stats_call *e = &s->page->calls[seq % DEP_STATS_RING];
  __atomic_store_n(&e->bytes, bytes, __ATOMIC_RELAXED);
  __atomic_store_n(&e->ns, ns > UINT32_MAX ? UINT32_MAX : (uint32_t)ns, __ATOMIC_RELAXED);
  __atomic_store_n(&e->op, (uint16_t)op, __ATOMIC_RELAXED);
  __atomic_store_n(&e->status, (int16_t)status, __ATOMIC_RELAXED);
  __atomic_store_n(&e->seq, seq, __ATOMIC_RELEASE);
}

/* A call refused before anything ran (it has no seq). */
static inline void statrec_rejected(struct statrec *s, unsigned op) {
  if (s->page == NULL || op >= DEP_STATS_NOPS)
    return;
  __atomic_store_n(&s->page->rejected[op], s->page->rejected[op] + 1, __ATOMIC_RELAXED);
}

/* A layout that ran: its time and this rank's tokens for each of world ranks. */
void statrec_layout(struct statrec *s, uint64_t ns, int status, const int32_t *tokens_per_rank,
                    uint32_t world);

#endif /* DEP_CLIENT_STATREC_H */
