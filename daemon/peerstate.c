/*
 * peerstate.c — the peer layer's state (peer_internal.h), defined apart
 * from peer.c so that the layer's halves (peerconn.c, peerxport.c) reach it
 * without leaning on peer.c: peerxport.c calls peer.c only through
 * P->core.
 */
#include "peer_internal.h"

struct peer_layer peer__layer = {.listen_fd = -1};
