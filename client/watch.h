/*
 * watch.h — a thread libdeepep-client makes (the other is the host
 * warm-up's, warm.h), and only for a rank of a job that spans nodes: it waits for the rank's control connection to
 * deepepd to close, and then fails the rank's operations at once with
 * DEP_ERR_DAEMON_GONE instead of letting them wait out the op timeout.
 *
 * Why a thread: the job's blocks for other nodes move through this node's
 * daemon (its proxy and peer links), so once the daemon stops, dies or
 * restarts they move no more, however long a call waits; and on the cuda
 * backend the waiting is done by a kernel the caller's thread has long
 * returned from.  A job whose ranks are all on one node needs no daemon for
 * its operations and gets no thread: a restart leaves it computing.
 *
 * The thread only polls: the connection for a hang-up (POLLRDHUP, never
 * POLLIN: it reads no byte, so no reply or notice is taken from the
 * caller's requests) and a pipe that stops it.  It starts at the end of a
 * dep_attach of such a job (never at load or dep_connect, so a process
 * that forks before attaching is untouched), runs with every signal
 * blocked, and is stopped and joined first thing when the attachment ends
 * (client_unmap: dep_detach, dep_connect again, dep_client_free, a failed
 * request), before the memory it writes to goes.  A child forked while it
 * runs has no such thread: its handle only closes the pipe.
 */
#ifndef DEP_CLIENT_WATCH_H
#define DEP_CLIENT_WATCH_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <sys/types.h>

struct dep_client;

struct watch {
  bool running;        /* a thread was started for this attachment */
  pid_t pid;           /* ... by this process (a forked child has none to join) */
  pthread_t thread;
  int wake[2];         /* a pipe: closing its write end stops the thread */
  _Atomic int gone;    /* the thread saw the connection close and failed the job's waits */
};

/* Start watching c's connection for c's current attachment: 0, or
 * DEP_ERR_LIMIT (no fd or thread to be had) with the handle's message set. */
int watch_start(struct dep_client *c);
/* Stop and join the thread (if any) and forget it; safe to call again. */
void watch_stop(struct dep_client *c);
/* Whether the daemon's connection closed while this attachment was watched. */
bool watch_gone(const struct dep_client *c);
/* Whether the connection fd has hung up, now (a poll that does not wait). */
bool watch_hung_up(int fd);

#endif /* DEP_CLIENT_WATCH_H */
