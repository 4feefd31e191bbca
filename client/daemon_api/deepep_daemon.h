/*
 * deepep_daemon.h — the library's internal interface for deepepd: what the
 * daemon may ask of libdeepep-client beyond deepep.h.
 *
 * deepepd links libdeepep-client.a and runs the library's own code, through
 * deepep.h as a trainer does, in two child processes of its own: the
 * start-up warm-up (daemon/warmup.c: one rank per GPU attaches, which runs
 * every kernel once) and the tuner (daemon/tunechild.c: a world of ranks
 * times each SM budget).  This header adds the little the daemon needs to
 * know about the library's inside and no trainer does.  Its functions are
 * dep__, hidden like every symbol of the library that is not dep_: they
 * link from the static archive and are not in the shared library.
 *
 * It is the one client/ header the daemon reaches: its folder is on the
 * daemon's include path, client/ is not (Makefile), and
 * tools/includes.py holds daemon/ to that.
 */
#ifndef DEP_DEEPEP_DAEMON_H
#define DEP_DEEPEP_DAEMON_H

#include <stdbool.h>

#include "deepep.h"

/*
 * Whether the kernels of an attached cuda client are the daemon's compile,
 * lent at attach (KERNELS), rather than the library's own fatbin: what the
 * warm-up reports, so that a start whose warm-up fell back to the fatbin
 * says so.  false on the host backend and when not attached.
 */
bool dep__client_kernels_lent(const dep_client_t *c);

#endif /* DEP_DEEPEP_DAEMON_H */
