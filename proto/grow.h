/*
 * grow.h — the one growable array of the tree: an array reached through a
 * pointer with its capacity in elements beside it, grown by doubling.  Its
 * users: the codec's buffers (proto_buf, codec_grow), the data path's batches
 * (daemon/xfer.c) and the tuning table (daemon/tune.c).
 */
#ifndef DEP_PROTO_GROW_H
#define DEP_PROTO_GROW_H

#include <stddef.h>

/*
 * Room for `need` elements of `size` bytes in the array whose pointer is at `arr` (of *cap
 * elements): nothing when it has the room, else a realloc to `first` elements (or the present
 * capacity) doubled until `need` fit.  0, or -1 when out of memory or when the bytes would pass
 * SIZE_MAX, with the array and *cap as they were.
 */
int dep__grow(void *arr, size_t *cap, size_t need, size_t size, size_t first);

/* dep__grow for an array `arr` (an lvalue of pointer type) and its `cap` (a size_t lvalue). */
#define DEP_GROW(arr, cap, need, first) dep__grow(&(arr), &(cap), (need), sizeof *(arr), (first))

#endif /* DEP_PROTO_GROW_H */
